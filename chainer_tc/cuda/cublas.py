"""A ctypes binding to cuBLAS for the matrix products a captured training step makes.

CuPy refuses every cuBLAS call while the current stream is capturing (13.6 and 14 alike): its
``setStream`` (``cupy_backends/cuda/libs/cublas.pyx``) raises ``NotImplementedError('calling
cuBLAS API during stream capture is currently unsupported')``, and every ``cupy.dot`` /
``matmul`` calls it first, so no Chainer ``Linear`` could be captured (first seen on an H100:
every step fell back to eager). cuBLAS itself captures (its documentation's "CUDA Graphs
Support": with the host pointer mode, alpha and beta are read at capture time; give the handle
a workspace of its own so that no allocation happens during capture).

So captures use a :class:`Handle` of chainer_tc's own, one per device (:func:`capture_handle`),
bound before each capture begins to the capture's stream and then to a workspace from the
capture's pool (in that order: ``cublasSetStream`` resets the workspace to cuBLAS's default
pool), and call ``cublasGemmEx`` (and ``cublasGemmStridedBatchedEx`` for a batch of products, the
i-th operands at a fixed stride from the first) through this binding with CuPy's own choice for
the product (``cupy/_core/_routines_linalg.pyx``, ``tensordot_core_v11``): CuPy's compute type
for the dtype (``CUBLAS_COMPUTE_32F`` for float16/float32 by default, ``..._FAST_TF32`` or ``..._PEDANTIC`` as
``cupy._core.set_compute_type`` / ``CUPY_TF32`` say, ``CUBLAS_COMPUTE_64F`` for float64), alpha and
beta as host floats (doubles for 64F), the Tensor Core algorithm where CuPy picks it, the math
mode of CuPy's handle. Prototypes follow ``cublas_api.h`` (CUDA 12 / 13): handles and data are
pointers, enums ``int``, the workspace size ``size_t``, batch strides ``long long``.

The library is the one ``chainer_tc._cuda_libs`` preloaded or finds in the ``nvidia-cublas``
wheel, else ``libcublas.so.<CUDA major of CuPy's runtime>`` (the copy CuPy already loaded); a
handle refuses a library whose version differs from the one CuPy calls.
"""
import ctypes
import threading

import numpy

from chainer_tc import _cuda_libs
from chainer_tc.cuda import _counters
from chainer_tc.cuda import _library

_ptr, _int, _size, _int64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_longlong

OP_N, OP_T = 0, 1
CUDA_R_32F, CUDA_R_64F, CUDA_R_16F = 0, 1, 2
COMPUTE_32F, COMPUTE_32F_PEDANTIC, COMPUTE_64F, COMPUTE_64F_PEDANTIC = 68, 69, 70, 71
COMPUTE_32F_FAST_TF32 = 77
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
    'cublasSetMathMode': (('handle', _ptr), ('mode', _int)),
    'cublasGetVersion_v2': (('handle', _ptr), ('version', ctypes.POINTER(_int))),
    'cublasGemmEx': (
        ('handle', _ptr), ('transa', _int), ('transb', _int), ('m', _int), ('n', _int),
        ('k', _int), ('alpha', _ptr), ('A', _ptr), ('Atype', _int), ('lda', _int), ('B', _ptr),
        ('Btype', _int), ('ldb', _int), ('beta', _ptr), ('C', _ptr), ('Ctype', _int),
        ('ldc', _int), ('computeType', _int), ('algo', _int)),
    'cublasGemmStridedBatchedEx': (
        ('handle', _ptr), ('transa', _int), ('transb', _int), ('m', _int), ('n', _int),
        ('k', _int), ('alpha', _ptr), ('A', _ptr), ('Atype', _int), ('lda', _int),
        ('strideA', _int64), ('B', _ptr), ('Btype', _int), ('ldb', _int), ('strideB', _int64),
        ('beta', _ptr), ('C', _ptr), ('Ctype', _int), ('ldc', _int), ('strideC', _int64),
        ('batchCount', _int), ('computeType', _int), ('algo', _int)),
}
STATUS_STRING = 'cublasGetStatusString'       # const char *cublasGetStatusString(cublasStatus_t)


class CuBLASError(RuntimeError):
    """A cuBLAS call returned a status other than CUBLAS_STATUS_SUCCESS."""

    def __init__(self, call, status, message):
        self.call, self.status = call, status
        super().__init__('{} failed: {} (cublasStatus_t {})'.format(call, message, status))


class CuBLASUnavailable(OSError):
    """libcublas could not be loaded."""


class Binding(_library.Library):
    """The cuBLAS calls of a capture, bound on one library object (a ``ctypes.CDLL``, or a
    fake)."""

    def __init__(self, lib):
        super().__init__(lib, PROTOTYPES, STATUS_STRING, CuBLASError,
                         lambda name: _counters.add('cublas_calls'))

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

    def get_version(self, handle):
        version = _int()
        self._call('cublasGetVersion_v2', handle, ctypes.byref(version))
        return version.value

    def set_math_mode(self, handle, mode):
        self._call('cublasSetMathMode', handle, mode)

    def gemm_ex(self, handle, transa, transb, m, n, k, alpha, a, a_type, lda, b, b_type, ldb,
                beta, c, c_type, ldc, compute_type, algo):
        self._call('cublasGemmEx', handle, transa, transb, m, n, k, alpha, a, a_type, lda, b,
                   b_type, ldb, beta, c, c_type, ldc, compute_type, algo)

    def gemm_strided_batched_ex(self, handle, transa, transb, m, n, k, alpha, a, a_type, lda,
                                stride_a, b, b_type, ldb, stride_b, beta, c, c_type, ldc,
                                stride_c, batch_count, compute_type, algo):
        self._call('cublasGemmStridedBatchedEx', handle, transa, transb, m, n, k, alpha, a,
                   a_type, lda, stride_a, b, b_type, ldb, stride_b, beta, c, c_type, ldc,
                   stride_c, batch_count, compute_type, algo)


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
        _binding = _library.load(library_path(), Binding, CuBLASUnavailable, 'cuBLAS',
                                 'install the gpu extra (nvidia-cublas-cu12) or put libcublas on '
                                 'LD_LIBRARY_PATH')
    return _binding


# Host alpha/beta, alive for the whole process (cuBLAS reads them during the call, also while
# capturing): float for the 32F compute types, double for 64F.
_ONE_ZERO = {COMPUTE_32F: (ctypes.c_float(1.0), ctypes.c_float(0.0)),
             COMPUTE_64F: (ctypes.c_double(1.0), ctypes.c_double(0.0))}
for _t, _base in ((COMPUTE_32F_PEDANTIC, COMPUTE_32F), (COMPUTE_32F_FAST_TF32, COMPUTE_32F),
                  (COMPUTE_64F_PEDANTIC, COMPUTE_64F)):
    _ONE_ZERO[_t] = _ONE_ZERO[_base]
_ADDRESSES = {t: tuple(ctypes.addressof(v) for v in pair) for t, pair in _ONE_ZERO.items()}


def compute_type(dtype, cupy_choice=None):
    """The cuBLAS compute type CuPy's ``tensordot_core_v11`` uses for ``dtype`` data, from
    ``cupy_choice`` (``cupy._core._routines_linalg.get_compute_type(dtype)``: 'default', 'tf32'
    or 'pedantic'; read from CuPy when None)."""
    dtype = numpy.dtype(dtype)
    if cupy_choice is None:
        cupy_choice = _cupy_compute_type(dtype)
    if dtype == numpy.float64:
        return COMPUTE_64F_PEDANTIC if cupy_choice == 'pedantic' else COMPUTE_64F
    if cupy_choice == 'pedantic':
        return COMPUTE_32F_PEDANTIC
    if cupy_choice == 'tf32' and dtype == numpy.float32:
        return COMPUTE_32F_FAST_TF32
    return COMPUTE_32F


def _cupy_compute_type(dtype):
    from cupy._core import _routines_linalg as linalg
    choice = linalg.get_compute_type(dtype)
    if choice == linalg.COMPUTE_TYPE_PEDANTIC:
        return 'pedantic'
    if choice == linalg.COMPUTE_TYPE_TF32:
        return 'tf32'
    return 'default'


def algorithm(dtype, compute_capability):
    """CuPy's algorithm choice: Tensor Core ops from sm_80 on, and for float16 from sm_70."""
    if compute_capability >= 80 or (compute_capability >= 70 and
                                    numpy.dtype(dtype) == numpy.float16):
        return GEMM_DEFAULT_TENSOR_OP
    return GEMM_DEFAULT


def workspace_bytes(compute_capability):
    """The workspace a capture gives the handle: what cuBLAS recommends (32 MiB on Hopper,
    4 MiB before), so that its algorithm choice matches the eager handle's."""
    return (32 << 20) if compute_capability >= 90 else (4 << 20)


class Handle:
    """A cuBLAS handle of chainer_tc's own for captures on one device (:func:`capture_handle`
    keeps one per device for the process: cuBLAS handles are meant to live long, and destroying
    one synchronises the device, which would break a capture in progress). ``binding`` is
    :func:`binding` or a fake; ``math_mode`` and ``version`` are those of CuPy's handle (None:
    not checked). Hold :attr:`lock` from :meth:`bind` to the end of the capture."""

    def __init__(self, binding, compute_capability, math_mode=None, version=None):
        self.binding = binding
        self.compute_capability = compute_capability
        self.lock = threading.Lock()
        self.handle = binding.create()
        try:
            if version is not None and binding.get_version(self.handle) != version:
                raise CuBLASUnavailable(
                    'the cuBLAS chainer_tc loaded is version {}, but CuPy calls version {}: '
                    'chainer_tc must call the same library as CuPy (check LD_LIBRARY_PATH and '
                    'the installed nvidia-cublas wheels)'.format(
                        binding.get_version(self.handle), version))
            if math_mode is not None:
                binding.set_math_mode(self.handle, math_mode)
        except BaseException:
            try:
                self.close()
            except Exception:       # the first error is the one to report
                pass
            raise

    def bind(self, stream, workspace, size):
        """Before a capture: its stream, then a workspace of its own (``cublasSetStream``
        resets the workspace to cuBLAS's default pool, so the order matters)."""
        self.binding.set_stream(self.handle, stream)
        self.binding.set_workspace(self.handle, workspace, size)

    def close(self):
        if self.handle is not None:
            handle, self.handle = self.handle, None
            self.binding.destroy(handle)

    def gemm(self, transa, transb, m, n, k, a, lda, b, ldb, c, ldc, dtype):
        """C (m x n, column-major, ``ldc``) = op(A) op(B), all of ``dtype``; a, b, c addresses."""
        _fits_int(m=m, n=n, k=k, lda=lda, ldb=ldb, ldc=ldc)
        t, ct, (one, zero), algo = self._types(dtype)
        self.binding.gemm_ex(self.handle, transa, transb, m, n, k, one, a, t, lda, b, t, ldb,
                             zero, c, t, ldc, ct, algo)

    def gemm_batched(self, transa, transb, m, n, k, a, lda, stride_a, b, ldb, stride_b, c, ldc,
                     stride_c, batch, dtype):
        """``batch`` products as :meth:`gemm`, the i-th on a + i stride_a, b + i stride_b and
        c + i stride_c (strides in elements; 0 repeats an operand) in one
        ``cublasGemmStridedBatchedEx``, with the compute type and algorithm of :meth:`gemm`."""
        _fits_int(m=m, n=n, k=k, lda=lda, ldb=ldb, ldc=ldc, batchCount=batch)
        t, ct, (one, zero), algo = self._types(dtype)
        self.binding.gemm_strided_batched_ex(
            self.handle, transa, transb, m, n, k, one, a, t, lda, stride_a, b, t, ldb, stride_b,
            zero, c, t, ldc, stride_c, batch, ct, algo)

    def _types(self, dtype):
        """(data type, compute type, (alpha, beta) addresses, algorithm) of a ``dtype`` product,
        as CuPy's ``tensordot_core_v11`` chooses them."""
        dtype = numpy.dtype(dtype)
        if dtype not in DATA_TYPE:
            raise TypeError('cuBLAS product of {} data: expected float16, float32 or float64'
                            .format(dtype))
        ct = compute_type(dtype)
        return (DATA_TYPE[dtype], ct, _ADDRESSES[ct],
                algorithm(dtype, self.compute_capability))


def _fits_int(**values):
    """cuBLAS takes these as C ints: ctypes would wrap a larger value silently (2**32 + 5
    becomes 5), so one that does not fit is refused, named."""
    for name, v in values.items():
        if not -2 ** 31 <= v < 2 ** 31:
            raise ValueError('cuBLAS product: {} = {} does not fit the C int cuBLAS takes (at '
                             'most 2**31 - 1); split the product'.format(name, v))


_handles = {}
_handles_lock = threading.Lock()


def capture_handle(device):
    """The process's capture :class:`Handle` for ``device`` (a ``cupy.cuda.Device``), made on
    first use with the math mode and checked against the version of CuPy's handle."""
    with _handles_lock:
        h = _handles.get(device.id)
        if h is None:
            from cupy_backends.cuda.libs import cublas as cupy_cublas
            like = device.cublas_handle
            h = Handle(binding(), int(device.compute_capability),
                       math_mode=cupy_cublas.getMathMode(like),
                       version=cupy_cublas.getVersion(like))
            _handles[device.id] = h
        return h
