"""``F.matmul``, ``F.batch_matmul`` and the grouped convolutions' products inside a capture.

Chainer computes them with ``xp.matmul`` in two module functions,
``chainer.functions.math.matmul._matmul(a, b, transa, transb, transout)`` (``MatMul``,
``BatchMatMul`` and their gradients) and ``chainer.functions.connection.convolution_2d._matmul``
(grouped ``convolution_2d``, ``deconvolution_2d`` and their weight gradients). Patched by
:mod:`._products`, they compute through :func:`._gemm.matmul` where this thread has products
and the operands suit cuBLAS (one float dtype, two or more axes each: a 1-d operand goes to
Chainer's code), and otherwise run Chainer's code.

CuPy's own ``matmul`` of a batch of float16 matrices converts them to float32 and back; here
they are multiplied as float16 with float32 accumulation (CuPy's compute type for float16
products): the same products within float16 rounding. The compute type is the one CuPy's
``tensordot`` (and so Chainer's eager ``Linear`` and convolutions) uses: where a user opted into
TF32 (``CUPY_TF32=1``) or pedantic products (``cupy._core.set_compute_type``), a captured batched
``F.matmul`` follows that choice, while CuPy's batched ``matmul`` ignores it.
"""
from chainer.functions.connection import convolution_2d as _chainer_convolution_2d
from chainer.functions.math import matmul as _chainer_matmul

from chainer_tc.static_graph import _gemm

_ORIGINAL_MATH = _chainer_matmul._matmul
_ORIGINAL_CONVOLUTION = _chainer_convolution_2d._matmul


def _through(a, b):
    """a @ b through this thread's products, or None."""
    p = _gemm.current()
    return None if p is None else _gemm.matmul(p, a, b)


def _math_matmul(a, b, transa=False, transb=False, transout=False):
    if transout:            # (op(a) op(b))^T = op(b)^T op(a)^T
        l, r, tl, tr = b, a, not transb, not transa
    else:
        l, r, tl, tr = a, b, transa, transb
    if l.ndim >= 2 and r.ndim >= 2:
        c = _through(l.swapaxes(-1, -2) if tl else l, r.swapaxes(-1, -2) if tr else r)
        if c is not None:
            return c
    return _ORIGINAL_MATH(a, b, transa, transb, transout)


def _convolution_matmul(a, b):
    c = _through(a, b)
    return _ORIGINAL_CONVOLUTION(a, b) if c is None else c


# (owner, attribute, replacement) for :mod:`._products`
PATCHES = ((_chainer_matmul, '_matmul', _math_matmul),
           (_chainer_convolution_2d, '_matmul', _convolution_matmul))
