"""A ctypes binding to cuBLAS for the matrix products a captured training step makes.

CuPy refuses every cuBLAS call while the current stream is capturing (13.6 and 14 alike): its
``setStream`` (``cupy_backends/cuda/libs/cublas.pyx``) raises ``NotImplementedError('calling
cuBLAS API during stream capture is currently unsupported')``, and every ``cupy.dot`` /
``matmul`` calls it first, so no Chainer ``Linear`` could be captured (first seen on an H100:
every step fell back to eager). cuBLAS itself captures (its documentation's "CUDA Graphs
Support": with the host pointer mode, alpha and beta are read at capture time; give the handle
a workspace of its own so that no allocation happens during capture).

So a capture gets a :class:`Handle` of its own (made, given a workspace and its stream before
the capture begins) and calls ``cublasGemmEx`` through this binding, with CuPy's own choice of
types for the product (``cupy/_core/_routines_linalg.pyx``, ``tensordot_core_v11``): float16 and
float32 data with ``CUBLAS_COMPUTE_32F`` (``..._FAST_TF32`` for float32 when ``CUPY_TF32=1``),
float64 with ``CUBLAS_COMPUTE_64F``, alpha and beta as host floats (doubles for float64), the
Tensor Core algorithm where CuPy picks it. Prototypes follow ``cublas_api.h`` (CUDA 12 / 13):
handles and data are pointers, enums ``int``, the workspace size ``size_t``.

The library is the one ``chainer_tc._cuda_libs`` preloaded or finds in the ``nvidia-cublas``
wheel, else ``libcublas.so.<CUDA major of CuPy's runtime>`` (the copy CuPy already loaded).
"""
import ctypes
import os

import numpy

from chainer_tc import _cuda_libs
from chainer_tc.cuda import _counters

_ptr, _int, _size = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t

OP_N, OP_T = 0, 1
CUDA_R_32F, CUDA_R_64F, CUDA_R_16F = 0, 1, 2
COMPUTE_32F, COMPUTE_64F, COMPUTE_32F_FAST_TF32 = 68, 70, 77
GEMM_DEFAULT, GEMM_DEFAULT_TENSOR_OP = -1, 99

DATA_TYPE = {numpy.dtype(numpy.float16): CUDA_R_16F, numpy.dtype(numpy.float32): CUDA_R_32F,
             numpy.dtype(numpy.float64): CUDA_R_64F}

# C name -> ((parameter name, ctypes type), ...) in the order of the C prototype; every function
# returns cublasStatus_t (an int).
PROTOTYPES = {
    'cublasCreate_v2': (('handle', ctypes.POINTER(_ptr)),),
    'cublasDestroy_v2': (('handle', _ptr),),
    'cublasSetStream_v2': (('handle', _ptr), ('streamId', _ptr)),
    'cublasSetWorkspace_v2': (('handle', _ptr), ('workspace', _ptr),
                              ('workspaceSizeInBytes', _size)),
    'cublasGetMathMode': (('handle', _ptr), ('mode', ctypes.POINTER(_int))),
    'cublasSetMathMode': (('handle', _ptr), ('mode', _int)),
    'cublasGemmEx': (
        ('handle', _ptr), ('transa', _int), ('transb', _int), ('m', _int), ('n', _int),
        ('k', _int), ('alpha', _ptr), ('A', _ptr), ('Atype', _int), ('lda', _int), ('B', _ptr),
        ('Btype', _int), ('ldb', _int), ('beta', _ptr), ('C', _ptr), ('Ctype', _int),
        ('ldc', _int), ('computeType', _int), ('algo', _int)),
}
STATUS_STRING = 'cublasGetStatusString'       # const char *cublasGetStatusString(cublasStatus_t)


class CuBLASError(RuntimeError):
    """A cuBLAS call returned a status other than CUBLAS_STATUS_SUCCESS."""

    def __init__(self, call, status, message):
        self.call, self.status = call, status
        super().__init__('{} failed: {} (cublasStatus_t {})'.format(call, message, status))


class CuBLASUnavailable(OSError):
    """libcublas could not be loaded."""


class Binding:
    """The bound functions of one library object (a ``ctypes.CDLL``, or a fake in tests)."""

    def __init__(self, lib):
        self._fn = {}
        for name, params in PROTOTYPES.items():
            fn = getattr(lib, name)
            fn.argtypes = [t for _, t in params]
            fn.restype = ctypes.c_int
            self._fn[name] = fn
        self._status_string = getattr(lib, STATUS_STRING)
        self._status_string.argtypes = [ctypes.c_int]
        self._status_string.restype = ctypes.c_char_p

    def status_string(self, status):
        s = self._status_string(status)
        return s.decode() if isinstance(s, bytes) else str(s)

    def _call(self, name, *args):
        _counters.add('cublas_calls')
        status = self._fn[name](*args)
        if status:
            raise CuBLASError(name, status, self.status_string(status))

    def create(self):
        handle = _ptr()
        self._call('cublasCreate_v2', ctypes.byref(handle))
        return handle.value

    def destroy(self, handle):
        self._call('cublasDestroy_v2', handle)

    def set_stream(self, handle, stream):
        self._call('cublasSetStream_v2', handle, stream)

    def set_workspace(self, handle, workspace, size):
        self._call('cublasSetWorkspace_v2', handle, workspace, size)

    def get_math_mode(self, handle):
        mode = _int()
        self._call('cublasGetMathMode', handle, ctypes.byref(mode))
        return mode.value

    def set_math_mode(self, handle, mode):
        self._call('cublasSetMathMode', handle, mode)

    def gemm_ex(self, handle, transa, transb, m, n, k, alpha, a, a_type, lda, b, b_type, ldb,
                beta, c, c_type, ldc, compute_type, algo):
        self._call('cublasGemmEx', handle, transa, transb, m, n, k, alpha, a, a_type, lda, b,
                   b_type, ldb, beta, c, c_type, ldc, compute_type, algo)


def library_path(cuda_major=None):
    """The file this binding loads: the wheel's libcublas, else the soname of ``cuda_major``
    (default: the CUDA major version of CuPy's runtime)."""
    found = _cuda_libs.find_library('cublas')
    if found:
        return found
    if cuda_major is None:
        import cupy
        cuda_major = cupy.cuda.runtime.runtimeGetVersion() // 1000
    return 'libcublas.so.{}'.format(cuda_major)


_binding = None


def binding():
    """The process's :class:`Binding` of libcublas, loaded on first use."""
    global _binding
    if _binding is None:
        path = library_path()
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            raise CuBLASUnavailable(
                'cannot load cuBLAS from {} ({}): install the gpu extra (nvidia-cublas-cu12) or '
                'put libcublas on LD_LIBRARY_PATH'.format(path, e)) from e
        _binding = Binding(lib)
    return _binding


# Host alpha/beta, alive for the whole process (cuBLAS reads them during the call, also while
# capturing): float for the 32F compute types, double for 64F.
_ONE_ZERO = {COMPUTE_32F: (ctypes.c_float(1.0), ctypes.c_float(0.0)),
             COMPUTE_64F: (ctypes.c_double(1.0), ctypes.c_double(0.0))}
_ONE_ZERO[COMPUTE_32F_FAST_TF32] = _ONE_ZERO[COMPUTE_32F]
_ADDRESSES = {t: tuple(ctypes.addressof(v) for v in pair) for t, pair in _ONE_ZERO.items()}


def compute_type(dtype, environ=None):
    """CuPy's compute type for a product of ``dtype`` data (see the module docstring)."""
    dtype = numpy.dtype(dtype)
    if dtype == numpy.float64:
        return COMPUTE_64F
    environ = os.environ if environ is None else environ
    if dtype == numpy.float32 and environ.get('CUPY_TF32', '0') != '0':
        return COMPUTE_32F_FAST_TF32
    return COMPUTE_32F


def algorithm(dtype, compute_capability):
    """CuPy's algorithm choice: Tensor Core ops from sm_80 on, and for float16 from sm_70."""
    if compute_capability >= 80 or (compute_capability >= 70 and
                                    numpy.dtype(dtype) == numpy.float16):
        return GEMM_DEFAULT_TENSOR_OP
    return GEMM_DEFAULT


def workspace_bytes(compute_capability):
    """The workspace a capture handle gets: what cuBLAS recommends (32 MiB on Hopper, 4 MiB
    before), so that its algorithm choice matches the eager handle's."""
    return (32 << 20) if compute_capability >= 90 else (4 << 20)


class Handle:
    """A cuBLAS handle for one capture: its own workspace (a device buffer the caller keeps
    alive as long as any graph captured with it) and stream, the math mode of ``like`` (CuPy's
    handle). ``binding`` is :func:`binding` or a fake; :meth:`close` destroys the handle."""

    def __init__(self, binding, stream, workspace, workspace_size, compute_capability,
                 like=None):
        self.binding = binding
        self.compute_capability = compute_capability
        self.handle = binding.create()
        try:
            if like is not None:
                binding.set_math_mode(self.handle, binding.get_math_mode(like))
            binding.set_workspace(self.handle, workspace, workspace_size)
            binding.set_stream(self.handle, stream)
        except Exception:
            self.close()
            raise

    def close(self):
        if self.handle is not None:
            handle, self.handle = self.handle, None
            self.binding.destroy(handle)

    def gemm(self, transa, transb, m, n, k, a, lda, b, ldb, c, ldc, dtype):
        """C (m x n, column-major, ``ldc``) = op(A) op(B), all of ``dtype``; a, b, c addresses."""
        dtype = numpy.dtype(dtype)
        if dtype not in DATA_TYPE:
            raise TypeError('cuBLAS product of {} data: expected float16, float32 or float64'
                            .format(dtype))
        t = DATA_TYPE[dtype]
        ct = compute_type(dtype)
        one, zero = _ADDRESSES[ct]
        self.binding.gemm_ex(self.handle, transa, transb, m, n, k, one, a, t, lda, b, t, ldb,
                             zero, c, t, ldc, ct, algorithm(dtype, self.compute_capability))
