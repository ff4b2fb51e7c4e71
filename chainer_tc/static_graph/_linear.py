"""Chainer's ``Linear`` inside a CUDA graph capture: its three matrix products through cuBLAS.

CuPy refuses cuBLAS while a stream captures (:mod:`chainer_tc.cuda.cublas`), and Chainer's
``LinearFunction``, ``LinearGradData`` and ``LinearGradWeight`` compute with ``ndarray.dot``. While
:func:`products_through` is active on this thread, those three ``forward`` methods compute the
same products with ``cublasGemmEx`` on the capture's own handle instead, for 2-d operands of one
dtype (float16/32/64) with no empty axis; anything else goes to Chainer's code unchanged (and, on
a capturing stream, fails there with CuPy's message, so the step runs eagerly and says why).

Row-major arrays are column-major transposes, so with x (M, K), W (N, K), gy (M, N):

    y  = x W^T   ->  y^T  (N x M) = op_T(W) x^T   gemm(T, N, m=N, n=M, k=K; W, K; x, K; y, N)
    gx = gy W    ->  gx^T (K x M) = W^T gy^T      gemm(N, N, m=K, n=M, k=N; W, K; gy, N; gx, K)
    gW = gy^T x  ->  gW^T (K x N) = x^T op_T(gy)  gemm(N, T, m=K, n=N, k=M; x, K; gy, N; gW, K)

The patch is on the classes, for the duration of the capture only; which products it computes
is per thread (``products_through`` sets them for the calling thread), so another thread calling
``F.linear`` meanwhile runs Chainer's own code.
"""
import contextlib
import threading

import numpy

import chainer
from chainer.functions.connection import linear as _chainer_linear

_state = threading.local()
_lock = threading.Lock()
_installed = [0]
# Chainer's methods, read once: a thread that fetched a patched method just before the patch
# was removed still finds the original through this (never emptied) table
_ORIGINAL = {name: getattr(_chainer_linear, name).forward
             for name in ('LinearFunction', 'LinearGradData', 'LinearGradWeight')}


def _gemm():
    return getattr(_state, 'gemm', None)


def _address(a):
    data = getattr(a, 'data', None)
    ptr = getattr(data, 'ptr', None)
    return ptr if ptr is not None else a.ctypes.data


def _usable(xp, *arrays):
    """This capture's kind of arrays, 2-d, one float dtype, no empty axis."""
    dtype = arrays[0].dtype
    return all(type(a) is xp.ndarray and a.ndim == 2 and a.dtype == dtype and a.size
               for a in arrays) and dtype.kind == 'f'


def _product(node, gemm, a, b, shape, transa, transb, m, n, k, lda, ldb, ldc):
    """A new (``shape``) array of a's dtype = ``gemm(transa, transb, m, n, k)`` of the contiguous
    a and b; ``node`` keeps its inputs and the iDeep setting as Chainer's forward does."""
    node._config_use_ideep = chainer.config.use_ideep
    node.retain_inputs((0, 1))
    out = gemm.xp.empty(shape, dtype=a.dtype)
    gemm.handle.gemm(transa, transb, m, n, k, _address(a), lda, _address(b), ldb, _address(out),
                     ldc, a.dtype)
    return out


def _linear_forward(self, inputs):
    gemm = _gemm()
    x, W = inputs[0], inputs[1]
    if gemm is None or not _usable(gemm.xp, x, W) or x.shape[1] != W.shape[1]:
        return _ORIGINAL['LinearFunction'](self, inputs)
    x, W = gemm.xp.ascontiguousarray(x), gemm.xp.ascontiguousarray(W)
    (m, k), n = x.shape, W.shape[0]
    y = _product(self, gemm, W, x, (m, n), 1, 0, n, m, k, k, k, n)       # y^T = op_T(W) x^T
    if len(inputs) == 3:
        y += inputs[2]
    return y,


def _grad_data_forward(self, inputs):
    gemm = _gemm()
    W, gy = inputs
    if gemm is None or not _usable(gemm.xp, W, gy) or gy.shape[1] != W.shape[0]:
        return _ORIGINAL['LinearGradData'](self, inputs)
    W, gy = gemm.xp.ascontiguousarray(W), gemm.xp.ascontiguousarray(gy)
    (n, k), m = W.shape, gy.shape[0]
    return _product(self, gemm, W, gy, (m, k), 0, 0, k, m, n, k, n, k),   # gx^T = W^T gy^T


def _grad_weight_forward(self, inputs):
    gemm = _gemm()
    x, gy = inputs
    if (gemm is None or not _usable(gemm.xp, x, gy) or x.shape[0] != gy.shape[0]
            or numpy.dtype(self._w_dtype) != x.dtype):
        return _ORIGINAL['LinearGradWeight'](self, inputs)
    x, gy = gemm.xp.ascontiguousarray(x), gemm.xp.ascontiguousarray(gy)
    (m, k), n = x.shape, gy.shape[1]
    return _product(self, gemm, x, gy, (n, k), 0, 1, k, n, m, k, n, k),   # gW^T = x^T op_T(gy)


_PATCHES = {'LinearFunction': _linear_forward, 'LinearGradData': _grad_data_forward,
            'LinearGradWeight': _grad_weight_forward}


class Products:
    """What the patched methods compute with: ``handle`` (a bound
    :class:`chainer_tc.cuda.cublas.Handle`, or anything with its ``gemm``) and ``xp`` (the array
    module whose arrays it takes)."""

    def __init__(self, handle, xp):
        self.handle, self.xp = handle, xp


@contextlib.contextmanager
def products_through(products):
    """Within this block, on this thread, Chainer's Linear computes through ``products``."""
    with _lock:
        if _installed[0] == 0:
            for name, fn in _PATCHES.items():
                getattr(_chainer_linear, name).forward = fn
        _installed[0] += 1
    previous = _gemm()
    _state.gemm = products
    try:
        yield
    finally:
        _state.gemm = previous
        with _lock:
            _installed[0] -= 1
            if _installed[0] == 0:
                for name in _PATCHES:
                    getattr(_chainer_linear, name).forward = _ORIGINAL[name]
