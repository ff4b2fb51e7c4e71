"""The NHWC convolution on CuPy arrays where ``chainer.config.use_cudnn`` is 'never'.

chainer_tc's GPU convolution is cuDNN's; a user who forbids cuDNN still gets the convolution, as
from ``L.Convolution2D``: computed by Chainer's own GPU code (im2col and cuBLAS) on NCHW copies of
the operands, the results copied back to NHWC. Much slower than cuDNN (the transposes and
im2col's buffers on top of Chainer's own cost): a :class:`~chainer_tc.cuda.PerformanceWarning`
says so once per process. Inside a captured training step its products go through
chainer_tc's cuBLAS handle, as Chainer's own im2col convolutions do
(:mod:`chainer_tc.static_graph._im2col`).
"""
import warnings

import chainer
from chainer.functions.connection import convolution_2d as chainer_conv
from chainer.functions.connection import deconvolution_2d as chainer_deconv

from chainer_tc.cuda import PerformanceWarning

_warned = []


def _warn():
    if not _warned:
        _warned.append(True)
        warnings.warn(
            "chainer.config.use_cudnn is 'never': chainer_tc's NHWC convolution runs Chainer's "
            "own GPU convolution (im2col and cuBLAS) on NCHW copies of its operands, far slower "
            "than cuDNN; set use_cudnn to 'auto' for cuDNN", PerformanceWarning, stacklevel=4)


# plain transposes, not chainer_tc.layout's kernel: that one takes float16/float32, the
# convolution float64 too, and this path is slow anyway
def _nchw(a):
    return chainer.backend.get_array_module(a).ascontiguousarray(a.transpose(0, 3, 1, 2))


def _nhwc(a):
    return chainer.backend.get_array_module(a).ascontiguousarray(a.transpose(0, 2, 3, 1))


def _chainer_function(f):
    """Chainer's Convolution2DFunction with the geometry of ``f`` (a Convolution2DNHWC)."""
    return chainer_conv.Convolution2DFunction(
        stride=(f.sy, f.sx), pad=(f.ph, f.pw), cover_all=False, dilate=(f.dy, f.dx),
        groups=f.groups)


def forward(f, x, W, b):
    """y (NHWC) = the convolution of NHWC ``x`` with ``W`` (out, kh, kw, in/groups), + ``b``."""
    _warn()
    inputs = (_nchw(x), _nchw(W)) + (() if b is None else (b,))
    with chainer.no_backprop_mode():
        y, = _chainer_function(f).apply(inputs)
    return _nhwc(y.array)


def grads(f, x, W, gy, indexes):
    """{0: gx, 1: gW} (NHWC, those in ``indexes``) as Chainer's Convolution2DFunction.backward
    computes them: a deconvolution for gx, Convolution2DGradW for gW."""
    _warn()
    x_, W_, gy_ = _nchw(x), _nchw(W), _nchw(gy)
    out = {}
    with chainer.no_backprop_mode():
        if 0 in indexes:
            gx, = chainer_deconv.Deconvolution2DFunction(
                stride=(f.sy, f.sx), pad=(f.ph, f.pw), outsize=x_.shape[2:],
                dilate=(f.dy, f.dx), groups=f.groups).apply((gy_, W_))
            out[0] = _nhwc(gx.array)
        if 1 in indexes:
            gW, = chainer_conv.Convolution2DGradW(
                _chainer_function(f), W_.shape, W_.dtype, None).apply((x_, gy_))
            out[1] = _nhwc(gW.array)
    return out
