"""Matrix products on a capture's own cuBLAS handle, in NumPy's row-major terms.

CuPy refuses cuBLAS while a stream captures (:mod:`chainer_tc.cuda.cublas`), so while a capture
records Chainer's functions, the ones that multiply matrices (``Linear``, the im2col
convolutions, ``F.matmul``) compute their products here instead (:mod:`._products` installs
them). Which products this thread computes here, and with what, is :func:`current`: a
:class:`Products` while a capture on this thread runs, else None.

:func:`matmul` is ``numpy.matmul`` for what those functions pass: operands of one float dtype
(float16/32/64), two or more axes, no empty axis, sizes within cuBLAS's 32-bit ints. It
returns None for anything else, and the caller then runs Chainer's own code (which, on a
capturing stream, fails there with CuPy's message: the step runs eagerly and says why).

Row-major matrices are column-major transposes, so C (M, N) = op(A) (M, K) op(B) (K, N) is the
column-major C^T = op(B)^T op(A)^T:

    gemm(transa=tB, transb=tA, m=N, n=M, k=K; B, ldb=B.shape[-1]; A, lda=A.shape[-1]; C, N)

An operand whose last two axes are a transposed contiguous matrix (a ``swapaxes`` view) is
passed as that matrix with the transposing op, not copied; any other layout is copied once.
A batch (axes before the last two) runs as one strided-batched product; an operand whose batch
is one matrix broadcasts with stride 0, other broadcasts are copied out first.
"""
import threading

import numpy

_state = threading.local()
_INT_MAX = 2 ** 31 - 1


class Products:
    """What products compute with: ``handle`` (a bound :class:`chainer_tc.cuda.cublas.Handle`,
    or anything with its ``gemm`` and ``gemm_batched``) and ``xp`` (the array module whose
    arrays it takes)."""

    def __init__(self, handle, xp):
        self.handle, self.xp = handle, xp


def current():
    """The :class:`Products` this thread computes through, or None."""
    return getattr(_state, 'products', None)


def set_current(products):
    """Make ``products`` this thread's (None: none); returns the previous ones."""
    previous = current()
    _state.products = products
    return previous


def products_for(*arrays):
    """This thread's products where the arrays suit them (:func:`usable`), else None."""
    p = current()
    return p if p is not None and usable(p.xp, *arrays) else None


def address(a):
    """The device (CuPy) or host (NumPy) address of ``a``'s first element."""
    data = getattr(a, 'data', None)
    ptr = getattr(data, 'ptr', None)
    return ptr if ptr is not None else a.ctypes.data


def usable(xp, *arrays):
    """Whether the arrays are ``xp``'s, of one float16/32/64 dtype, with two or more axes and
    no empty axis."""
    dtype = arrays[0].dtype
    return (dtype in (numpy.float16, numpy.float32, numpy.float64) and
            all(type(a) is xp.ndarray and a.ndim >= 2 and a.dtype == dtype and a.size
                for a in arrays))


def _as_operand(xp, a, batch):
    """(matrix array, transposed, batch stride in elements) of operand ``a`` (..., R, C) for a
    product over the batch shape ``batch``: the array is C-contiguous and op(array) is ``a``'s
    matrices (transposed: the array holds ``a``'s matrices transposed)."""
    lead = a.shape[:-2]
    if lead and lead != batch:
        if int(numpy.prod(lead)) == 1:
            lead = ()
        else:           # a partial broadcast: its batch made real
            a = xp.ascontiguousarray(xp.broadcast_to(a, batch + a.shape[-2:]))
            lead = batch
    if not lead:
        a = a.reshape(a.shape[-2:])
    t = a.swapaxes(-1, -2)
    if a.flags.c_contiguous:
        m, transposed = a, False
    elif t.flags.c_contiguous:
        m, transposed = t, True
    else:
        m, transposed = xp.ascontiguousarray(a), False
    stride = m.shape[-1] * m.shape[-2] if lead else 0
    return m, transposed, stride


def matmul(products, a, b):
    """``numpy.matmul(a, b)`` through ``products`` (a new C-contiguous array), or None where
    the operands are not for cuBLAS (see the module's docstring)."""
    xp = products.xp
    if not usable(xp, a, b) or a.shape[-1] != b.shape[-2]:
        return None
    try:
        batch = numpy.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except ValueError:
        return None
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    count = int(numpy.prod(batch))
    if max(m, n, k, count) > _INT_MAX:
        return None
    A, ta, sa = _as_operand(xp, a, batch)
    B, tb, sb = _as_operand(xp, b, batch)
    c = xp.empty(batch + (m, n), dtype=a.dtype)
    h = products.handle
    if count == 1:
        h.gemm(int(tb), int(ta), n, m, k, address(B), B.shape[-1], address(A), A.shape[-1],
               address(c), n, a.dtype)
    else:
        h.gemm_batched(int(tb), int(ta), n, m, k, address(B), B.shape[-1], sb, address(A),
                       A.shape[-1], sa, address(c), n, m * n, count, a.dtype)
    return c
