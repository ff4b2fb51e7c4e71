"""2-D convolution over channels-last (NHWC) arrays, with filters in (out, kh, kw, in/groups).

    from chainer_tc import functions as TF
    y = TF.convolution_2d(x, W, b, stride=2, pad=1)     # x: (N, H, W, C), W: (O, kh, kw, C)

Semantics of ``chainer.functions.convolution_2d`` (cover_all=False) in NHWC. CuPy arrays run on
cuDNN with NHWC tensor and filter descriptors (``cupyx.cudnn``, honouring ``config.autotune``,
``config.use_cudnn_tensor_core``, ``config.cudnn_deterministic`` and
``chainer.backends.cuda.set_max_workspace_size``): no transposes on the GPU. NumPy arrays run
Chainer's own CPU convolution on transposed copies (the CPU path may transpose; its speed is
secondary). Double backpropagation is not supported.
"""
import numpy

import chainer
from chainer import function_node
from chainer.utils import conv
from chainer.utils import type_check
from chainer.functions.connection import convolution_2d as chainer_conv
from chainer.functions.connection import deconvolution_2d as chainer_deconv

from chainer_tc.functions import _util


def _nchw(a):
    return numpy.ascontiguousarray(a.transpose(0, 3, 1, 2))


def _nhwc(a):
    return numpy.ascontiguousarray(a.transpose(0, 2, 3, 1))


def _run_cpu(node, inputs):
    """Chainer's CPU implementation of ``node`` on standard-layout arrays, outside the graph."""
    node._input_layouts = (None,) * len(inputs)
    return node.forward_cpu(inputs)


def _cudnn():
    """(cupy, cupyx.cudnn, keyword arguments every cuDNN convolution call takes)."""
    import cupy
    import cupyx.cudnn
    from cupy_backends.cuda.libs import cudnn as libcudnn
    config = chainer.config
    return cupy, cupyx.cudnn, dict(
        auto_tune=config.autotune, tensor_core=config.use_cudnn_tensor_core,
        d_layout=libcudnn.CUDNN_TENSOR_NHWC, w_layout=libcudnn.CUDNN_TENSOR_NHWC)


class Convolution2DNHWC(function_node.FunctionNode):

    def __init__(self, stride=1, pad=0, dilate=1, groups=1):
        self.sy, self.sx = _util.pair(stride, 'stride')
        self.ph, self.pw = _util.pair(pad, 'pad')
        self.dy, self.dx = _util.pair(dilate, 'dilate')
        self.groups = int(groups)
        if min(self.sy, self.sx, self.dy, self.dx, self.groups) < 1 or min(self.ph, self.pw) < 0:
            raise ValueError('stride, dilate and groups must be >= 1 and pad >= 0; got stride {}, '
                             'dilate {}, groups {}, pad {}'.format(
                                 (self.sy, self.sx), (self.dy, self.dx), self.groups,
                                 (self.ph, self.pw)))

    def check_type_forward(self, in_types):
        type_check._argname(in_types, ('x', 'W') + (('b',) if len(in_types) == 3 else ()))
        x_type, w_type = in_types[:2]
        type_check.expect(
            x_type.dtype.kind == 'f', w_type.dtype == x_type.dtype,
            x_type.ndim == 4, w_type.ndim == 4,
            x_type.shape[3] == w_type.shape[3] * self.groups,
            w_type.shape[0] % self.groups == 0,
        )
        if len(in_types) == 3:
            b_type = in_types[2]
            type_check.expect(b_type.dtype == x_type.dtype, b_type.ndim == 1,
                              b_type.shape[0] == w_type.shape[0])

    def _outsize(self, x, W):
        _, h, w, _ = x.shape
        _, kh, kw, _ = W.shape
        oh = conv.get_conv_outsize(h, kh, self.sy, self.ph, d=self.dy)
        ow = conv.get_conv_outsize(w, kw, self.sx, self.pw, d=self.dx)
        if oh < 1 or ow < 1:
            raise ValueError('a {}x{} filter (dilate {}) with stride {} and pad {} leaves no '
                             'output for input of shape {} (N, H, W, C)'.format(
                                 kh, kw, (self.dy, self.dx), (self.sy, self.sx),
                                 (self.ph, self.pw), x.shape))
        return oh, ow

    def forward(self, inputs):
        self.retain_inputs((0, 1))
        x, W = inputs[:2]
        b = inputs[2] if len(inputs) == 3 else None
        oh, ow = self._outsize(x, W)
        if isinstance(x, numpy.ndarray):
            # Chainer's CPU convolution, called directly: no FunctionNode enters the graph
            node = chainer_conv.Convolution2DFunction(
                (self.sy, self.sx), (self.ph, self.pw), dilate=(self.dy, self.dx),
                groups=self.groups)
            y, = _run_cpu(node, (_nchw(x), _nchw(W)) + (() if b is None else (b,)))
            return _nhwc(y),
        xp, cudnn, opts = _cudnn()
        y = xp.empty((x.shape[0], oh, ow, W.shape[0]), x.dtype)
        cudnn.convolution_forward(
            xp.ascontiguousarray(x), xp.ascontiguousarray(W), b, y, (self.ph, self.pw),
            (self.sy, self.sx), (self.dy, self.dx), self.groups, **opts)
        return y,

    def backward(self, indexes, grad_outputs):
        x, W = self.get_retained_inputs()
        gy, = grad_outputs
        grads = _Convolution2DNHWCGrad(self, len(self.inputs) == 3).apply((x, W, gy))
        return tuple(grads[i] for i in indexes)


class _Convolution2DNHWCGrad(function_node.FunctionNode):
    """(gx, gW[, gb]) of Convolution2DNHWC; not differentiable again."""

    def __init__(self, f, with_bias):
        self.f, self.with_bias = f, with_bias

    def forward(self, inputs):
        x, W, gy = inputs
        if isinstance(x, numpy.ndarray):
            gx, gW = self._cpu(x, W, gy)
        else:
            gx, gW = self._cudnn(x, W, gy)
        out = (gx, gW)
        if self.with_bias:
            out += (gy.reshape(-1, gy.shape[-1]).sum(axis=0),)
        return out

    def _cpu(self, x, W, gy):
        f = self.f
        x_c, w_c, gy_c = _nchw(x), _nchw(W), _nchw(gy)
        # gx by deconvolution and gW by Chainer's own kernels, called directly (no graph nodes)
        geometry = dict(dilate=(f.dy, f.dx), groups=f.groups)
        gx, = _run_cpu(chainer_deconv.Deconvolution2DFunction(
            (f.sy, f.sx), (f.ph, f.pw), outsize=x_c.shape[2:], **geometry), (gy_c, w_c))
        node = chainer_conv.Convolution2DFunction((f.sy, f.sx), (f.ph, f.pw), **geometry)
        node._use_ideep = False
        gW, = _run_cpu(chainer_conv.Convolution2DGradW(node, w_c.shape, w_c.dtype, None),
                       (x_c, gy_c))
        return _nhwc(gx), _nhwc(gW)

    def _cudnn(self, x, W, gy):
        f = self.f
        xp, cudnn, opts = _cudnn()
        x, W, gy = (xp.ascontiguousarray(a) for a in (x, W, gy))
        geometry = ((f.ph, f.pw), (f.sy, f.sx), (f.dy, f.dx), f.groups)
        deterministic = chainer.config.cudnn_deterministic
        gW = xp.empty_like(W)
        cudnn.convolution_backward_filter(x, gy, gW, *geometry, deterministic=deterministic,
                                          **opts)
        gx = xp.empty_like(x)
        cudnn.convolution_backward_data(W, gy, None, gx, *geometry, deterministic=deterministic,
                                        **opts)
        return gx, gW

    def backward(self, indexes, grad_outputs):
        raise NotImplementedError('chainer_tc: double backpropagation through convolution is '
                                  'not supported')


def convolution_2d(x, W, b=None, stride=1, pad=0, dilate=1, groups=1):
    """Convolution of NHWC ``x`` with ``W`` of shape (out, kh, kw, in/groups); ``b`` (out,)."""
    inputs = (x, W) if b is None else (x, W, b)
    return Convolution2DNHWC(stride, pad, dilate, groups).apply(inputs)[0]
