"""Chainer's im2col convolutions inside a capture: their products through cuBLAS.

Where Chainer does not call cuDNN (CuPy 14 has none; ``use_cudnn='never'``; ``cover_all``), its
2-d convolutions compute on the GPU with im2col/col2im kernels (which capture) and
``cupy.tensordot`` (cuBLAS, which CuPy refuses while a stream captures). Patched by
:mod:`._products`, the three ``_forward_gpu_core`` methods compute the same products with
:func:`._gemm.matmul` on the capture's handle where this thread has products, for operands of
one float dtype in the standard layout; otherwise they run Chainer's code. With x (N, C, H, W),
W (O, C, kh, kw), col = im2col(x) (N, C*kh*kw, P) for P output pixels, gy (N, O, P):

- ``Convolution2DFunction`` (forward): y[n] = W col[n], one strided-batched product with W
  repeated (no copy of col; y is made NCHW-contiguous, where Chainer returns an NHWC array
  seen as NCHW);
- ``Deconvolution2DFunction`` (forward, and the convolution's input gradient): gcol[n] =
  W^T x[n], strided-batched likewise, then col2im;
- ``Convolution2DGradW``: gW = gy' col' over all N*P pixels, one product of copies of gy and
  col with the pixels as rows (CuPy's ``tensordot`` makes the same two copies).

Each output element is the same sum of products as Chainer's; only cuBLAS's order of
summation may differ. Grouped convolutions go through ``convolution_2d._matmul``
(:mod:`._matmul`).
"""
from chainer.functions.connection import convolution_2d as _chainer_convolution_2d
from chainer.functions.connection import deconvolution_2d as _chainer_deconvolution_2d
from chainer.utils import conv

from chainer_tc.static_graph import _gemm

_CLASSES = {'Convolution2DFunction': _chainer_convolution_2d.Convolution2DFunction,
            'Convolution2DGradW': _chainer_convolution_2d.Convolution2DGradW,
            'Deconvolution2DFunction': _chainer_deconvolution_2d.Deconvolution2DFunction}
# Chainer's methods, read once (a method fetched while patched still finds them)
_ORIGINAL = {name: cls._forward_gpu_core for name, cls in _CLASSES.items()}


def _products(node, *arrays):
    """This thread's products where the node's inputs are in the standard layout and the
    arrays suit them; else None."""
    if any(layout is not None for layout in node.input_layouts or ()):
        return None
    return _gemm.products_for(*arrays)


def _im2col(node, x, kh, kw):
    return conv.im2col(x, kh, kw, node.sy, node.sx, node.ph, node.pw,
                       cover_all=node.cover_all, dy=node.dy, dx=node.dx)


def _convolution_forward(self, x, W, b):
    p = _products(self, x, W)
    if p is not None:
        out_c, _, kh, kw = W.shape
        col = _im2col(self, x, kh, kw)
        n, c, _, _, out_h, out_w = col.shape
        y = _gemm.matmul(p, W.reshape(1, out_c, c * kh * kw),
                         col.reshape(n, c * kh * kw, out_h * out_w))
        if y is not None:
            y = y.reshape(n, out_c, out_h, out_w)
            if b is not None:
                y += b.reshape(1, out_c, 1, 1)
            return y,
    return _ORIGINAL['Convolution2DFunction'](self, x, W, b)


def _deconvolution_forward(self, x, W, b):
    p = _products(self, x, W)
    if p is not None:
        in_c, out_c, kh, kw = W.shape
        n, _, h, w = x.shape
        gcol = _gemm.matmul(p, W.reshape(1, in_c, out_c * kh * kw).swapaxes(1, 2),
                            x.reshape(n, in_c, h * w))
        if gcol is not None:
            y = conv.col2im(gcol.reshape(n, out_c, kh, kw, h, w), self.sy, self.sx, self.ph,
                            self.pw, self.outh, self.outw, dy=self.dy, dx=self.dx)
            if b is not None:
                y += b.reshape(1, b.size, 1, 1)
            return y,
    return _ORIGINAL['Deconvolution2DFunction'](self, x, W, b)


def _grad_weight_forward(self, x, gy):
    p = _products(self, x, gy)
    if p is not None:
        xp = p.xp
        col = _im2col(self, x, self.kh, self.kw)
        n, c, kh, kw, out_h, out_w = col.shape
        out_c = gy.shape[1]
        pixels = n * out_h * out_w
        cols = xp.ascontiguousarray(col.transpose(0, 4, 5, 1, 2, 3)).reshape(pixels, -1)
        gys = xp.ascontiguousarray(gy.transpose(0, 2, 3, 1)).reshape(pixels, out_c)
        gW = _gemm.matmul(p, gys.T, cols)
        if gW is not None:
            return gW.reshape(out_c, c, kh, kw).astype(self.W_dtype, copy=False),
    return _ORIGINAL['Convolution2DGradW'](self, x, gy)


# (owner, attribute, replacement) for :mod:`._products`
PATCHES = tuple((_CLASSES[name], '_forward_gpu_core', fn) for name, fn in (
    ('Convolution2DFunction', _convolution_forward),
    ('Convolution2DGradW', _grad_weight_forward),
    ('Deconvolution2DFunction', _deconvolution_forward)))
