"""2-D convolution over channels-last (NHWC) arrays, with filters in (out, kh, kw, in/groups).

    from chainer_tc import functions as TF
    y = TF.convolution_2d(x, W, b, stride=2, pad=1)     # x: (N, H, W, C), W: (O, kh, kw, C)

Semantics of ``chainer.functions.convolution_2d`` (cover_all=False) in NHWC. CuPy arrays run on
cuDNN with NHWC tensor and filter descriptors through ``chainer_tc.cuda.conv`` (honouring
``config.autotune``, ``config.use_cudnn_tensor_core`` and ``config.cudnn_deterministic``; the
workspace limit is ``chainer_tc.cuda.conv.get_workspace_limit()``): no transposes on the GPU,
and after the first call of a shape nothing but the cuDNN call itself, so it can be captured
into a CUDA graph. Where ``chainer.config.use_cudnn`` is 'never', CuPy arrays run Chainer's own
convolution instead (``_conv_without_cudnn``: slow, warned once). NumPy arrays run
``_conv_numpy``: channels-last patches as a strided view and one matrix product per call (no
transposes; equal to Chainer's NCHW convolution within the rounding of a differently ordered
sum). Backward computes only the gradients asked for (no gx
for a network's raw input). Double backpropagation is not supported.
"""
import numpy

import chainer
from chainer import function_node
from chainer.utils import conv
from chainer.utils import type_check

from chainer_tc.cuda import conv as cuda_conv
from chainer_tc.functions import _conv_numpy
from chainer_tc.functions import _conv_without_cudnn as _without_cudnn
from chainer_tc.functions import _util


class Convolution2DNHWC(function_node.FunctionNode):

    def __init__(self, stride=1, pad=0, dilate=1, groups=1):
        self.sy, self.sx = _util.pair(stride, 'stride')
        self.ph, self.pw = _util.pair(pad, 'pad')
        self.dy, self.dx = _util.pair(dilate, 'dilate')
        self.groups = _util.integer(groups, 'groups')
        if min(self.sy, self.sx, self.dy, self.dx, self.groups) < 1 or min(self.ph, self.pw) < 0:
            raise ValueError('stride, dilate and groups must be >= 1 and pad >= 0; got stride {}, '
                             'dilate {}, groups {}, pad {}'.format(
                                 (self.sy, self.sx), (self.dy, self.dx), self.groups,
                                 (self.ph, self.pw)))
        self.geometry = cuda_conv.Geometry((self.ph, self.pw), (self.sy, self.sx),
                                           (self.dy, self.dx), self.groups)

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
            return _conv_numpy.forward(x, W, b, self.cpu_geometry()),
        if chainer.config.use_cudnn == 'never':
            return _without_cudnn.forward(self, x, W, b),
        xp = chainer.backend.get_array_module(x)
        x, W = xp.ascontiguousarray(x), xp.ascontiguousarray(W)
        y = xp.empty((x.shape[0], oh, ow, W.shape[0]), x.dtype)
        cuda_conv.forward(x, W, y, self.geometry, cuda_conv.chainer_settings())
        if b is not None:
            y += b                  # broadcast over the last (channel) axis: one kernel
        return y,

    def cpu_geometry(self):
        g = self.__dict__.get('_cpu_geometry')
        if g is None:
            g = self._cpu_geometry = _conv_numpy.Geometry(
                (self.sy, self.sx), (self.ph, self.pw), (self.dy, self.dx), self.groups)
        return g

    def backward(self, indexes, grad_outputs):
        x, W = self.get_retained_inputs()
        gy, = grad_outputs
        return _Convolution2DNHWCGrad(self, indexes).apply((x, W, gy))


def _bias_grad(gy):
    """gy summed over every axis but the channels, float16 accumulated in float32 (as CuPy's
    sum does; NumPy's float16 running total stops growing at 2048-4096 where the rows add about
    1 each), then rounded to gy's dtype. float16 with loss scaling overflows to inf now and then:
    expected, the optimizer skips that step."""
    rows = gy.reshape(-1, gy.shape[-1])
    acc = numpy.float32 if gy.dtype == numpy.float16 else gy.dtype
    with numpy.errstate(over='ignore'):
        return rows.sum(axis=0, dtype=acc).astype(gy.dtype, copy=False)


class _Convolution2DNHWCGrad(function_node.FunctionNode):
    """The gradients of Convolution2DNHWC asked for: ``indexes`` among 0 (gx), 1 (gW), 2 (gb),
    in that order. Nothing else is computed: no gx for an input that needs none (a network's
    raw input), as Chainer's Convolution2DFunction. Not differentiable again."""

    def __init__(self, f, indexes):
        self.f, self.indexes = f, tuple(indexes)

    def forward(self, inputs):
        x, W, gy = inputs
        grads = self._cpu(x, W, gy) if isinstance(x, numpy.ndarray) else self._cudnn(x, W, gy)
        if 2 in self.indexes:
            grads[2] = _bias_grad(gy)
        return tuple(grads[i] for i in self.indexes)

    def _cpu(self, x, W, gy):
        gx, gW, _ = _conv_numpy.backward(x, W, gy, self.f.cpu_geometry(),
                                         need_x=0 in self.indexes, need_W=1 in self.indexes)
        return {0: gx, 1: gW}

    def _cudnn(self, x, W, gy):
        if chainer.config.use_cudnn == 'never':
            return _without_cudnn.grads(self.f, x, W, gy, self.indexes)
        f, grads = self.f, {}
        xp = chainer.backend.get_array_module(x)
        gy = xp.ascontiguousarray(gy)
        settings = cuda_conv.chainer_settings()
        if 0 in self.indexes:
            grads[0] = gx = xp.empty(x.shape, x.dtype)
            cuda_conv.backward_data(xp.ascontiguousarray(W), gy, gx, f.geometry, settings)
        if 1 in self.indexes:
            grads[1] = gW = xp.empty(W.shape, W.dtype)
            cuda_conv.backward_filter(xp.ascontiguousarray(x), gy, gW, f.geometry, settings)
        return grads

    def backward(self, indexes, grad_outputs):
        raise NotImplementedError('chainer_tc: double backpropagation through convolution is '
                                  'not supported')


def convolution_2d(x, W, b=None, stride=1, pad=0, cover_all=False, *, dilate=1, groups=1):
    """Convolution of NHWC ``x`` with ``W`` of shape (out, kh, kw, in/groups); ``b`` (out,).

    The arguments of ``chainer.functions.convolution_2d``, in its order (``dilate`` and
    ``groups`` by keyword); ``cover_all=True`` is refused (cuDNN has no asymmetric padding, and
    Chainer's own cuDNN path does not take it either)."""
    if cover_all:
        raise ValueError('cover_all=True is not supported by the NHWC convolution (it needs '
                         'extra padding on one side only); got cover_all={!r}'.format(cover_all))
    inputs = (x, W) if b is None else (x, W, b)
    return Convolution2DNHWC(stride, pad, dilate, groups).apply(inputs)[0]
