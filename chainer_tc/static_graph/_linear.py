"""Chainer's ``Linear`` inside a CUDA graph capture: its three matrix products through cuBLAS.

Chainer's ``LinearFunction``, ``LinearGradData`` and ``LinearGradWeight`` compute with
``ndarray.dot``, which CuPy refuses while a stream captures. While :mod:`._products` has them
patched and this thread has :func:`._gemm.current` products, they compute the same products
with :func:`._gemm.matmul` (``cublasGemmEx`` on the capture's own handle): with x (M, K),
W (N, K), gy (M, N),

    y = x W^T,   gx = gy W,   gW = gy^T x

(the transposes are ops of the product, not copies). For 2-d operands of one float dtype with
no empty axis; anything else goes to Chainer's code unchanged. Another thread calling
``F.linear`` meanwhile runs Chainer's own code.
"""
import numpy

import chainer
from chainer.functions.connection import linear as _chainer_linear

from chainer_tc.static_graph import _gemm

# Chainer's methods, read once: a thread that fetched a patched method just before the patch
# was removed still finds the original through this (never emptied) table
_ORIGINAL = {name: getattr(_chainer_linear, name).forward
             for name in ('LinearFunction', 'LinearGradData', 'LinearGradWeight')}


def _product(node, fits, a, b):
    """a @ b through this thread's products, for 2-d operands that ``fits`` (the node then keeps
    its inputs as Chainer's forward does); None where Chainer's own code must compute it."""
    p = _gemm.products_for(a, b)
    y = _gemm.matmul(p, a, b) if p is not None and a.ndim == b.ndim == 2 and fits else None
    if y is None:
        return None
    node._config_use_ideep = chainer.config.use_ideep
    node.retain_inputs((0, 1))
    return y


def _linear_forward(self, inputs):
    x, W = inputs[0], inputs[1]
    y = _product(self, x.shape[-1] == W.shape[-1], x, W.T)
    if y is None:
        return _ORIGINAL['LinearFunction'](self, inputs)
    if len(inputs) == 3:
        y += inputs[2]
    return y,


def _grad_data_forward(self, inputs):
    W, gy = inputs
    gx = _product(self, gy.shape[-1] == W.shape[0], gy, W)
    return _ORIGINAL['LinearGradData'](self, inputs) if gx is None else (gx,)


def _grad_weight_forward(self, inputs):
    x, gy = inputs
    fits = x.shape[0] == gy.shape[0] and numpy.dtype(self._w_dtype) == x.dtype
    gW = _product(self, fits, gy.T, x)
    return _ORIGINAL['LinearGradWeight'](self, inputs) if gW is None else (gW,)


# (owner, attribute, replacement) for :mod:`._products`
PATCHES = tuple((getattr(_chainer_linear, name), 'forward', fn) for name, fn in (
    ('LinearFunction', _linear_forward), ('LinearGradData', _grad_data_forward),
    ('LinearGradWeight', _grad_weight_forward)))
