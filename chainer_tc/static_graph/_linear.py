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


def _products(*arrays):
    """This thread's products where the operands are theirs and matrices, else None."""
    p = _gemm.current()
    if p is None or not _gemm.usable(p.xp, *arrays) or any(a.ndim != 2 for a in arrays):
        return None
    return p


def _keep_inputs(node):
    """What Chainer's forward records: its inputs for backward, and the iDeep setting."""
    node._config_use_ideep = chainer.config.use_ideep
    node.retain_inputs((0, 1))


def _linear_forward(self, inputs):
    x, W = inputs[0], inputs[1]
    p = _products(x, W)
    if p is None or x.shape[1] != W.shape[1]:
        return _ORIGINAL['LinearFunction'](self, inputs)
    y = _gemm.matmul(p, x, W.T)
    if y is None:
        return _ORIGINAL['LinearFunction'](self, inputs)
    _keep_inputs(self)
    if len(inputs) == 3:
        y += inputs[2]
    return y,


def _grad_data_forward(self, inputs):
    W, gy = inputs
    p = _products(W, gy)
    if p is None or gy.shape[1] != W.shape[0]:
        return _ORIGINAL['LinearGradData'](self, inputs)
    gx = _gemm.matmul(p, gy, W)
    if gx is None:
        return _ORIGINAL['LinearGradData'](self, inputs)
    _keep_inputs(self)
    return gx,


def _grad_weight_forward(self, inputs):
    x, gy = inputs
    p = _products(x, gy)
    if (p is None or x.shape[0] != gy.shape[0] or numpy.dtype(self._w_dtype) != x.dtype):
        return _ORIGINAL['LinearGradWeight'](self, inputs)
    gW = _gemm.matmul(p, gy.T, x)
    if gW is None:
        return _ORIGINAL['LinearGradWeight'](self, inputs)
    _keep_inputs(self)
    return gW,


# (owner, attribute, replacement) for :mod:`._products`
PATCHES = tuple((getattr(_chainer_linear, name), 'forward', fn) for name, fn in (
    ('LinearFunction', _linear_forward), ('LinearGradData', _grad_data_forward),
    ('LinearGradWeight', _grad_weight_forward)))
