"""chainer_tc's own ctypes binding to cuDNN (8.9 or 9): everything its convolutions and fused
batch normalization call, handles and descriptors included.

Why not CuPy's bindings: CuPy 13.6 refuses every cuDNN call while the current stream is
capturing (its ``setStream`` in ``cupy_backends/cuda/libs/cudnn.pyx`` raises
``NotImplementedError('calling cuDNN API during stream capture is currently unsupported')``, and
every binding calls it first), and CuPy 14 has no cuDNN at all. cuDNN itself is capturable, and
the calls chainer_tc makes are few (``chainer_tc.cuda._cudnn_api`` lists them), so they all go
through this binding: one handle per thread and device created here, descriptors created here
(``chainer_tc.cuda.descriptors``), algorithms and workspace sizes asked here, once per problem
outside capture; per call only ``cudnnSetStream`` and the computation.

Which library (:func:`binding`, first match wins):

1. ``CHAINER_TC_CUDNN_LIBRARY``: a path (or soname) the user names;
2. the cuDNN CuPy's bindings loaded, where CuPy has them (CuPy 13 with ``libcudnn.so.8``): the very
   same library object, so the process holds one cuDNN;
3. the ``libcudnn.so.*`` of an ``nvidia-cudnn-cu12``/``-cu13`` wheel (``chainer_tc._cuda_libs``);
4. ``libcudnn.so.9``, then ``libcudnn.so.8``, by soname (``LD_LIBRARY_PATH``, the system's).

The version must be 8.9.x or 9.x (:data:`SUPPORTED`): the legacy calls chainer_tc makes are
declared the same in both; another version is refused with its number. Every call checks its
status and raises :class:`CuDNNError` naming the call and cuDNN's error string.
"""
import collections
import ctypes
import os

import numpy

from chainer_tc import _cuda_libs
from chainer_tc.cuda import _counters
from chainer_tc.cuda import _cudnn_api as api
from chainer_tc.cuda import _library

LIBRARY_ENV = _cuda_libs.CUDNN_ENV
SONAMES = ('libcudnn.so.9', 'libcudnn.so.8')
SUPPORTED = ((8, 9), (9, None))         # (major, least minor): 8.9.x and every 9.x
PROTOTYPES = api.PROTOTYPES
ERROR_STRING = api.ERROR_STRING


class CuDNNError(RuntimeError):
    """A cuDNN call returned a status other than CUDNN_STATUS_SUCCESS."""

    def __init__(self, call, status, message):
        self.call, self.status = call, status
        super().__init__('{} failed: {} (cudnnStatus_t {})'.format(call, message, status))

    def add_context(self, text):
        """Append what the caller was doing (shapes, algorithm) to the message."""
        self.args = ('{}\n  {}'.format(self.args[0], text),)
        return self


class CuDNNUnavailable(OSError):
    """No usable cuDNN could be loaded (the message says which were tried and why)."""


def version_tuple(v):
    """cudnnGetVersion()'s number as (major, minor, patch): 8907 -> (8, 9, 7) (cuDNN 8's
    encoding), 92400 -> (9, 24, 0) (cuDNN 9's)."""
    if v >= 10000:
        return v // 10000, v // 100 % 100, v % 100
    return v // 1000, v // 100 % 10, v % 100


def version_string(v):
    return '{}.{}.{}'.format(*version_tuple(v))


def check_version(v, path):
    """Refuse a cuDNN whose version is not in :data:`SUPPORTED`, naming it."""
    major, minor, _ = version_tuple(v)
    for m, least in SUPPORTED:
        if major == m and (least is None or minor >= least):
            return
    raise CuDNNUnavailable(
        'the cuDNN at {} is version {}; chainer_tc calls cuDNN 8.9.x or 9.x (pip install '
        "nvidia-cudnn-cu12==8.9.7.29 with CuPy 13, or nvidia-cudnn-cu13 9.x; or name another "
        'library in {})'.format(path, version_string(v), LIBRARY_ENV))


class Binding(_library.Library):
    """Every cuDNN call chainer_tc makes, bound on one library object (a ``ctypes.CDLL``, or a
    fake in tests). Outputs are returned, not passed: :meth:`create` returns the new object's
    address, the queries return sizes and ranked :class:`~chainer_tc.cuda._cudnn_api.AlgoPerf`
    lists."""

    def __init__(self, lib):
        super().__init__(lib, PROTOTYPES, ERROR_STRING, CuDNNError, _count)
        self.lib, self.path = lib, None
        fn = getattr(lib, api.GET_VERSION)
        fn.argtypes, fn.restype = [], ctypes.c_size_t
        self._version = fn

    def version(self):
        return int(self._version())

    def error_string(self, status):
        return self.message(status)

    def call(self, name, *args):
        """The C function ``name`` with ``args`` in the C order (``PROTOTYPES``)."""
        self._call(name, *args)

    def _out(self, ctype, name, *args):
        """Call ``name`` with the address of a new ``ctype`` as its last argument; its value."""
        out = ctype()
        self._call(name, *(args + (ctypes.addressof(out),)))
        return out.value

    # handles and descriptors
    def create_handle(self):
        """cudnnCreate (needs a GPU: the handle belongs to the current device)."""
        return self._out(ctypes.c_void_p, 'cudnnCreate')

    def destroy_handle(self, handle):
        self._call('cudnnDestroy', handle)

    def set_stream(self, handle, stream, setup=False):
        """cudnnSetStream: later calls on ``handle`` run on ``stream`` (a cudaStream_t).
        ``setup``: before an algorithm search, not a step's call (not counted)."""
        self._call('cudnnSetStream', handle, stream, counted=not setup)

    def create(self, kind):
        """cudnnCreate<kind>Descriptor, ``kind`` in Tensor, Filter, Convolution, Activation,
        Pooling."""
        return self._out(ctypes.c_void_p, 'cudnnCreate{}Descriptor'.format(kind))

    def destroy(self, kind, desc):
        self._call('cudnnDestroy{}Descriptor'.format(kind), desc)

    # convolution algorithms
    def algorithms(self, name, handle, descs, conv_desc, count):
        """cudnnGetConvolution*Algorithm_v7 ``name``: cuDNN's heuristic ranking, as a list."""
        perfs, returned = (api.AlgoPerf * count)(), ctypes.c_int()
        a, b, out = descs
        self._call(name, handle, a, b, conv_desc, out, count, ctypes.addressof(returned),
                   ctypes.addressof(perfs))
        return list(perfs[:returned.value])

    def find_algorithms(self, name, handle, descs, data, conv_desc, count, workspace, size):
        """cudnnFindConvolution*AlgorithmEx ``name``: every algorithm run and timed on
        ``data`` (a, b, out addresses) with ``size`` bytes of scratch at ``workspace``."""
        perfs, returned = (api.AlgoPerf * count)(), ctypes.c_int()
        (a, b, out), (a_data, b_data, out_data) = descs, data
        self._call(name, handle, a, a_data, b, b_data, conv_desc, out, out_data, count,
                   ctypes.addressof(returned), ctypes.addressof(perfs), workspace, size)
        return list(perfs[:returned.value])

    def size(self, name, *args):
        """A ``size_t *sizeInBytes`` query (workspace or reserve space), arguments before it."""
        return self._out(ctypes.c_size_t, name, *args)

    # the calls a step makes
    def convolution_forward(self, handle, alpha, x_desc, x, w_desc, w, conv_desc, algo,
                            workspace, workspace_size, beta, y_desc, y):
        self._call('cudnnConvolutionForward', handle, alpha, x_desc, x, w_desc, w, conv_desc,
                   algo, workspace, workspace_size, beta, y_desc, y)

    def convolution_backward_data(self, handle, alpha, w_desc, w, dy_desc, dy, conv_desc, algo,
                                  workspace, workspace_size, beta, dx_desc, dx):
        self._call('cudnnConvolutionBackwardData', handle, alpha, w_desc, w, dy_desc, dy,
                   conv_desc, algo, workspace, workspace_size, beta, dx_desc, dx)

    def convolution_backward_filter(self, handle, alpha, x_desc, x, dy_desc, dy, conv_desc, algo,
                                    workspace, workspace_size, beta, dw_desc, dw):
        self._call('cudnnConvolutionBackwardFilter', handle, alpha, x_desc, x, dy_desc, dy,
                   conv_desc, algo, workspace, workspace_size, beta, dw_desc, dw)

    def batch_normalization_forward_training_ex(self, *args):
        """cudnnBatchNormalizationForwardTrainingEx, arguments in the C order (PROTOTYPES)."""
        self._call('cudnnBatchNormalizationForwardTrainingEx', *args)

    def batch_normalization_backward_ex(self, *args):
        """cudnnBatchNormalizationBackwardEx, arguments in the C order (PROTOTYPES)."""
        self._call('cudnnBatchNormalizationBackwardEx', *args)


def _count(name):
    """Count the calls a step makes (set-up is counted as descriptors and queries)."""
    if name in api.PER_CALL:
        _counters.add('cudnn_calls')


# ---- which library -------------------------------------------------------------------------

Candidate = collections.namedtuple('Candidate', 'what path lib skipped')
Candidate.__doc__ = """A library :func:`load` may try: ``path`` to open (``lib``: already open), or
``skipped`` saying why there is none."""


def _cupys_library():
    """The libcudnn CuPy's bindings use, as a :class:`Candidate`."""
    what = "CuPy's cuDNN"
    try:
        from cupy_backends.cuda.libs import cudnn as cupy_cudnn
        cupy_cudnn.getVersion()
    except Exception as e:       # CuPy 14 has no cuDNN bindings; CuPy 13 without libcudnn.so.8
        return Candidate(what, None, None, 'not usable ({}: {})'.format(type(e).__name__, e))
    soname = 'libcudnn.so.8'
    try:
        lib = ctypes.CDLL(soname, mode=os.RTLD_NOLOAD)     # the object CuPy's dlopen gave
    except OSError as e:
        return Candidate(what, None, None, '{} is not loaded under that name ({})'.format(
            soname, e))
    return Candidate(what, loaded_file(lib, api.GET_VERSION) or soname, lib, None)


class _DlInfo(ctypes.Structure):
    _fields_ = [('dli_fname', ctypes.c_char_p), ('dli_fbase', ctypes.c_void_p),
                ('dli_sname', ctypes.c_char_p), ('dli_saddr', ctypes.c_void_p)]


def loaded_file(lib, symbol):
    """The file the dynamic linker loaded ``lib`` from (``dladdr`` of one of its functions), or
    None where that cannot be told."""
    try:
        dladdr = ctypes.CDLL(None).dladdr
        dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        info = _DlInfo()
        if dladdr(ctypes.cast(getattr(lib, symbol), ctypes.c_void_p), ctypes.byref(info)):
            return os.path.abspath(info.dli_fname.decode()) if info.dli_fname else None
    except (AttributeError, OSError, ValueError):
        pass
    return None


def candidates():
    """The libraries :func:`load` tries, in order (see the module's docstring)."""
    named = os.environ.get(LIBRARY_ENV)
    if named:
        return [Candidate(LIBRARY_ENV, named, None, None)]
    cupys = _cupys_library()
    if cupys.path is not None:
        return [cupys]
    wheel = _cuda_libs.find_library('cudnn')
    return [cupys, Candidate('the nvidia-cudnn wheel', wheel, None,
                             None if wheel else 'not installed')] + [
        Candidate('by soname', soname, None, None) for soname in SONAMES]


def _open(candidate):
    """(binding, None) for ``candidate``'s library, or (None, why not)."""
    lib = candidate.lib
    if lib is None:
        try:
            lib = ctypes.CDLL(candidate.path)
        except OSError as e:
            return None, str(e)
    try:
        b = Binding(lib)
    except AttributeError as e:
        return None, 'lacks a function chainer_tc calls: {}'.format(e)
    try:
        check_version(b.version(), candidate.path)
    except CuDNNUnavailable as e:
        return None, str(e)
    b.path = candidate.path
    return b, None


def load():
    """A :class:`Binding` of the first usable library of :func:`candidates`, or
    :class:`CuDNNUnavailable` listing what was tried and why each failed."""
    tried = []
    for c in candidates():
        if c.path is None:
            tried.append('{}: {}'.format(c.what, c.skipped))
            continue
        b, why = _open(c)
        if b is not None:
            return b
        tried.append('{} ({}): {}'.format(c.what, c.path, why))
    raise CuDNNUnavailable(
        'no usable cuDNN: {}. Install nvidia-cudnn-cu12==8.9.7.29 (the gpu extra, with CuPy 13) '
        'or nvidia-cudnn-cu13 9.x, or name a libcudnn in {}'.format('; '.join(tried),
                                                                     LIBRARY_ENV))


_binding = None
_unavailable = None


def binding():
    """The process's :class:`Binding`, loaded on first use (:func:`load`)."""
    global _binding, _unavailable
    if _binding is None:
        if _unavailable is not None:
            raise CuDNNUnavailable(_unavailable)
        try:
            _binding = load()
        except CuDNNUnavailable as e:
            _unavailable = str(e)
            raise
    return _binding


def unavailable_reason():
    """None where :func:`binding` loads, else why not."""
    try:
        binding()
    except CuDNNUnavailable as e:
        return str(e)
    return None


# ---- scaling factors -----------------------------------------------------------------------

# Host scaling factors, alive for the whole process: cuDNN reads them during the call (also
# while capturing), so their addresses are stable. Half and float data take float, double double.
_ONE_ZERO = {numpy.dtype(numpy.float32): (ctypes.c_float(1.0), ctypes.c_float(0.0)),
             numpy.dtype(numpy.float64): (ctypes.c_double(1.0), ctypes.c_double(0.0))}
_ONE_ZERO[numpy.dtype(numpy.float16)] = _ONE_ZERO[numpy.dtype(numpy.float32)]
_ADDRESSES = {dtype: tuple(ctypes.addressof(v) for v in pair) for dtype, pair in _ONE_ZERO.items()}


def scaling_factors(dtype):
    """(address of 1, address of 0) as cuDNN's alpha/beta for data of ``dtype``."""
    try:
        return _ADDRESSES[numpy.dtype(dtype)]
    except KeyError:
        raise TypeError('cuDNN scaling factors exist for float16, float32 and float64 data; got '
                        '{}'.format(numpy.dtype(dtype).name)) from None
