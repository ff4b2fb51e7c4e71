"""A fake libcublas for testing chainer_tc's capture products without a GPU: it records every
call, checks each argument against the C prototype as ctypes would pass it (an int that would
not fit is an error here, where ctypes would truncate it), and computes cublasGemmEx and
cublasGemmStridedBatchedEx from the raw host addresses, column-major, in float64, as cuBLAS
defines them.

It reads and writes only inside the arrays whose addresses chainer_tc took (the
:func:`fake_cublas` fixture records each one through ``_gemm.address``): a leading dimension,
batch stride or count that reaches past an operand's own elements is an assertion here, where
a GPU would read a neighbour's memory or fault. An output that overlaps an input is refused too
(cuBLAS leaves the result of aliased operands undefined)."""
import ctypes

import numpy
import pytest

from chainer_tc.cuda import cublas
from chainer_tc.static_graph import _gemm
from chainer_tc.static_graph import _products

NUMPY_TYPE = {cublas.CUDA_R_16F: numpy.float16, cublas.CUDA_R_32F: numpy.float32,
              cublas.CUDA_R_64F: numpy.float64}
_RANGE = {ctypes.c_int: 2 ** 31, ctypes.c_longlong: 2 ** 63}


def span(a):
    """The bytes [start, end) that the NumPy array ``a``'s elements occupy."""
    lo = hi = a.ctypes.data
    for n, stride in zip(a.shape, a.strides):
        lo, hi = (lo, hi + (n - 1) * stride) if stride >= 0 else (lo + (n - 1) * stride, hi)
    return lo, hi + a.itemsize


def extent(addr, dtype, rows, cols, ld):
    """The bytes [start, end) that the column-major rows x cols matrix at ``addr`` with leading
    dimension ``ld`` reaches."""
    assert ld >= rows, 'a leading dimension below the row count'
    return addr, addr + (ld * (cols - 1) + rows) * numpy.dtype(dtype).itemsize


def matrix(addr, dtype, rows, cols, ld):
    """The column-major rows x cols matrix at ``addr`` with leading dimension ``ld``, as a
    writable NumPy view (rows x cols)."""
    start, end = extent(addr, dtype, rows, cols, ld)
    itemsize = numpy.dtype(dtype).itemsize
    buf = (ctypes.c_char * (end - start)).from_address(addr)
    flat = numpy.frombuffer(buf, dtype=dtype, count=(end - start) // itemsize)
    return numpy.lib.stride_tricks.as_strided(flat, (rows, cols), (itemsize, ld * itemsize))


def _check(name, args):
    params = cublas.PROTOTYPES[name]
    assert len(args) == len(params), '{}: {} arguments for {}'.format(name, len(args),
                                                                       len(params))
    for (param, ctype), value in zip(params, args):
        if ctype in _RANGE:
            assert type(value) is int, '{}({}): {!r} is not an int'.format(name, param, value)
            assert -_RANGE[ctype] <= value < _RANGE[ctype], '{}({}) = {} overflows'.format(
                name, param, value)


class FakeCuBLAS:
    """Stands in for libcublas; ``fail``: the name of a call that returns an error."""

    def __init__(self, fail=None, version=120405):
        self.calls, self.fail, self.version = [], fail, version
        self.workspace = None               # the user workspace in effect, as cuBLAS keeps it
        self.operands = {}                  # address taken -> the span of that array's elements
        for name in cublas.PROTOTYPES:
            setattr(self, name, self._recorder(name))
        self.cublasGetStatusString = lambda status: b'CUBLAS_STATUS_FAKE_ERROR'

    def _recorder(self, name):
        def call(*args):
            _check(name, args)
            self.calls.append((name, args))
            if name == self.fail:
                return 13
            return getattr(self, '_' + name, lambda *a: 0)(*args)
        return call

    def _cublasCreate_v2(self, out):
        out._obj.value = 0x1000 + len(self.calls)
        return 0

    def _cublasGetVersion_v2(self, handle, out):
        out._obj.value = self.version
        return 0

    def _cublasSetStream_v2(self, handle, stream):
        self.workspace = None     # "unconditionally resets the workspace to the default pool"
        return 0

    def _cublasSetWorkspace_v2(self, handle, workspace, size):
        self.workspace = (workspace, size)
        return 0

    def address(self, a):
        """``_gemm.address``, recording the span of ``a``'s elements as the operand at that
        address."""
        self.operands[a.ctypes.data] = span(a)
        return a.ctypes.data

    def _inside(self, name, base, region):
        """Assert that ``region`` (bytes) lies in the operand whose address was passed as
        ``base``."""
        assert base in self.operands, '{} at {:#x}: no array of that address was passed'.format(
            name, base)
        (start, end), (lo, hi) = region, self.operands[base]
        assert lo <= start and end <= hi, (
            '{} reaches bytes [{:#x}, {:#x}) outside its operand [{:#x}, {:#x})'.format(
                name, start, end, lo, hi))

    def _product(self, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, types, compute,
                 bases=None):
        at, bt, ct = types
        assert at == bt == ct
        assert self.workspace is not None, "a capture's product must use the capture's workspace"
        dtype = NUMPY_TYPE[ct]
        regions = {'A': extent(a, dtype, *((m, k) if ta == 0 else (k, m)), lda),
                   'B': extent(b, dtype, *((k, n) if tb == 0 else (n, k)), ldb),
                   'C': extent(c, dtype, m, n, ldc)}
        for name, base in zip('ABC', bases or (a, b, c)):
            self._inside(name, base, regions[name])
        for name in 'AB':
            (lo, hi), (clo, chi) = regions[name], regions['C']
            assert hi <= clo or chi <= lo, 'the output C overlaps the input ' + name
        scalar = ctypes.c_double if compute in (cublas.COMPUTE_64F,
                                                cublas.COMPUTE_64F_PEDANTIC) else ctypes.c_float
        alpha = scalar.from_address(alpha).value
        beta = scalar.from_address(beta).value
        A = matrix(a, dtype, *((m, k) if ta == 0 else (k, m)), lda).astype(numpy.float64)
        B = matrix(b, dtype, *((k, n) if tb == 0 else (n, k)), ldb).astype(numpy.float64)
        C = matrix(c, dtype, m, n, ldc)
        A, B = (A if ta == 0 else A.T), (B if tb == 0 else B.T)
        C[...] = (alpha * A.dot(B) + beta * (C.astype(numpy.float64) if beta else 0)).astype(dtype)

    def _cublasGemmEx(self, handle, ta, tb, m, n, k, alpha, a, at, lda, b, bt, ldb, beta, c,
                      ct, ldc, compute, algo):
        self._product(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, (at, bt, ct),
                      compute)
        return 0

    def _cublasGemmStridedBatchedEx(self, handle, ta, tb, m, n, k, alpha, a, at, lda, sa, b, bt,
                                    ldb, sb, beta, c, ct, ldc, sc, count, compute, algo):
        size = numpy.dtype(NUMPY_TYPE[ct]).itemsize
        assert count >= 1 and sc >= m + ldc * (n - 1), 'the outputs of a batch overlap'
        for i in range(count):
            self._product(ta, tb, m, n, k, alpha, a + i * sa * size, lda, b + i * sb * size, ldb,
                          beta, c + i * sc * size, ldc, (at, bt, ct), compute, (a, b, c))
        return 0

    def products(self):
        """The recorded product calls: (name, args)."""
        return [(name, args) for name, args in self.calls
                if name in ('cublasGemmEx', 'cublasGemmStridedBatchedEx')]


@pytest.fixture
def fake_cublas():
    """A FakeCuBLAS whose handle (bound as a capture binds it) computes this thread's products
    on NumPy arrays for the duration of the test."""
    lib = FakeCuBLAS()
    handle = cublas.Handle(cublas.Binding(lib), compute_capability=90, math_mode=3,
                           version=120405)
    handle.bind(0x77, 0x5000, 4 << 20)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_gemm, 'address', lib.address)
        with _products.products_through(_gemm.Products(handle, numpy)):
            yield lib
    handle.close()
