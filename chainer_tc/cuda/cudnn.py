"""A ctypes binding to cuDNN 8.9 (libcudnn.so.8) for the calls a captured training step makes.

CuPy 13.6 refuses every cuDNN call while the current stream is capturing: its ``setStream``
(``cupy_backends/cuda/libs/cudnn.pyx``) raises ``NotImplementedError('calling cuDNN API during
stream capture is currently unsupported')`` and every CuPy cuDNN binding calls it first. cuDNN
itself is capturable, so the calls that must run inside a ``cupy.cuda.Graph`` capture go through
this binding instead:

    cudnnSetStream, cudnnConvolutionForward, cudnnConvolutionBackwardData,
    cudnnConvolutionBackwardFilter, cudnnBatchNormalizationForwardTrainingEx,
    cudnnBatchNormalizationBackwardEx                          (and cudnnGetErrorString)

Everything else (the handle, descriptors, algorithm and workspace queries) still comes from CuPy's
bindings, once, outside capture (``chainer_tc.cuda.descriptors``). The prototypes below follow
the C declarations in cuDNN 8.9.7's ``cudnn_ops_infer_v8.h``, ``cudnn_ops_train_v8.h``,
``cudnn_cnn_infer_v8.h`` and ``cudnn_cnn_train_v8.h``: handles, descriptors and data are
pointers, enums are ``int``, sizes ``size_t``, epsilon and the average factor ``double``; the
scaling factors alpha/beta are pointers to a host ``float`` for half and float data and to a
``double`` for double data (:func:`scaling_factors`). Every call checks its status and raises
:class:`CuDNNError` naming the call and cuDNN's error string.

The library is the one ``chainer_tc._cuda_libs`` preloaded or finds in the ``nvidia-cudnn-cu12``
wheel, else ``libcudnn.so.8`` by soname (``LD_LIBRARY_PATH``).
"""
import ctypes
import os

import numpy

from chainer_tc import _cuda_libs
from chainer_tc.cuda import _counters
from chainer_tc.cuda import _library

SONAME = 'libcudnn.so.8'

_ptr, _int, _size, _double = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_double


def _conv(a, a_data, b, b_data, out, out_data):
    """The shared shape of the three convolution calls, operands named as in the C header."""
    return (('handle', _ptr), ('alpha', _ptr), (a, _ptr), (a_data, _ptr), (b, _ptr),
            (b_data, _ptr), ('convDesc', _ptr), ('algo', _int), ('workSpace', _ptr),
            ('workSpaceSizeInBytes', _size), ('beta', _ptr), (out, _ptr), (out_data, _ptr))


# C name -> ((parameter name, ctypes type), ...), in the order of the C prototype. Every function
# returns cudnnStatus_t (an int).
PROTOTYPES = {
    'cudnnSetStream': (('handle', _ptr), ('streamId', _ptr)),
    'cudnnConvolutionForward': _conv('xDesc', 'x', 'wDesc', 'w', 'yDesc', 'y'),
    'cudnnConvolutionBackwardData': _conv('wDesc', 'w', 'dyDesc', 'dy', 'dxDesc', 'dx'),
    'cudnnConvolutionBackwardFilter': _conv('xDesc', 'x', 'dyDesc', 'dy', 'dwDesc', 'dw'),
    'cudnnBatchNormalizationForwardTrainingEx': (
        ('handle', _ptr), ('mode', _int), ('bnOps', _int), ('alpha', _ptr), ('beta', _ptr),
        ('xDesc', _ptr), ('xData', _ptr), ('zDesc', _ptr), ('zData', _ptr), ('yDesc', _ptr),
        ('yData', _ptr), ('bnScaleBiasMeanVarDesc', _ptr), ('bnScale', _ptr), ('bnBias', _ptr),
        ('exponentialAverageFactor', _double), ('resultRunningMean', _ptr),
        ('resultRunningVariance', _ptr), ('epsilon', _double), ('resultSaveMean', _ptr),
        ('resultSaveInvVariance', _ptr), ('activationDesc', _ptr), ('workspace', _ptr),
        ('workSpaceSizeInBytes', _size), ('reserveSpace', _ptr),
        ('reserveSpaceSizeInBytes', _size)),
    'cudnnBatchNormalizationBackwardEx': (
        ('handle', _ptr), ('mode', _int), ('bnOps', _int), ('alphaDataDiff', _ptr),
        ('betaDataDiff', _ptr), ('alphaParamDiff', _ptr), ('betaParamDiff', _ptr),
        ('xDesc', _ptr), ('xData', _ptr), ('yDesc', _ptr), ('yData', _ptr), ('dyDesc', _ptr),
        ('dyData', _ptr), ('dzDesc', _ptr), ('dzData', _ptr), ('dxDesc', _ptr),
        ('dxData', _ptr), ('dBnScaleBiasDesc', _ptr), ('bnScaleData', _ptr),
        ('bnBiasData', _ptr), ('dBnScaleData', _ptr), ('dBnBiasData', _ptr),
        ('epsilon', _double), ('savedMean', _ptr), ('savedInvVariance', _ptr),
        ('activationDesc', _ptr), ('workSpace', _ptr), ('workSpaceSizeInBytes', _size),
        ('reserveSpace', _ptr), ('reserveSpaceSizeInBytes', _size)),
}
ERROR_STRING = 'cudnnGetErrorString'      # const char *cudnnGetErrorString(cudnnStatus_t)


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
    """libcudnn.so.8 could not be loaded."""


class Binding(_library.Library):
    """The cuDNN calls of a step, bound on one library object (a ``ctypes.CDLL``, or a fake)."""

    def __init__(self, lib):
        super().__init__(lib, PROTOTYPES, ERROR_STRING, CuDNNError,
                         lambda: _counters.add('cudnn_calls'))

    def error_string(self, status):
        return self.message(status)

    def set_stream(self, handle, stream):
        """cudnnSetStream: later calls on ``handle`` run on ``stream`` (a cudaStream_t)."""
        self._call('cudnnSetStream', handle, stream)

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


def library_path():
    """The file this binding loads: the wheel's libcudnn.so.8, else the soname."""
    return _cuda_libs.find_library('cudnn') or SONAME


_binding = None


def binding():
    """The process's :class:`Binding` of libcudnn.so.8, loaded on first use. The library must
    be the cuDNN CuPy uses: the descriptors the calls take come from CuPy's bindings."""
    global _binding
    if _binding is None:
        path = library_path()
        _binding = _library.load(
            path, Binding, CuDNNUnavailable, 'cuDNN 8',
            'install the gpu extra (nvidia-cudnn-cu12 8.9) or put libcudnn.so.8 on '
            'LD_LIBRARY_PATH',
            check=lambda lib: check_same_as_cupys(path, _library_version(lib),
                                                  _cupy_cudnn_version(), _same_object(lib)))
    return _binding


def _library_version(lib):
    fn = lib.cudnnGetVersion                    # size_t cudnnGetVersion(void)
    fn.argtypes, fn.restype = [], ctypes.c_size_t
    return int(fn())


def _cupy_cudnn_version():
    """cudnnGetVersion() of the cuDNN CuPy's bindings call, or the reason there is none."""
    try:
        from cupy_backends.cuda.libs import cudnn as cupy_cudnn
        return int(cupy_cudnn.getVersion())
    except Exception as e:       # CuPy 14 has no cuDNN bindings; libcudnn missing for CuPy 13
        return '{}: {}'.format(type(e).__name__, e)


def _same_object(lib):
    """Whether ``lib`` is the object a dlopen of ``libcudnn.so.8`` (CuPy's way) gives; True where
    none is loaded under that name (nothing to compare)."""
    try:
        loaded = ctypes.CDLL(SONAME, mode=os.RTLD_NOLOAD)
    except OSError:
        return True
    return loaded._handle == lib._handle


def check_same_as_cupys(path, version, cupys, same_object=True):
    """Refuse a library other than CuPy's (a machine with cuDNN 9 beside 8, a CuPy without
    cuDNN, a second copy of 8.9 from another directory): a descriptor made by one libcudnn
    passed to another is undefined behaviour."""
    if isinstance(cupys, str):
        raise CuDNNUnavailable(
            "CuPy's cuDNN bindings are not usable ({}); chainer_tc's capture-safe calls take "
            "CuPy's descriptors, so they need CuPy 13 with cuDNN 8.9 (pip install -e "
            "'.[gpu]')".format(cupys))
    if version != cupys:
        raise CuDNNUnavailable(
            'the cuDNN at {} is version {}, but CuPy calls version {}: chainer_tc must call '
            'the same library as CuPy (check LD_LIBRARY_PATH and the installed nvidia-cudnn '
            'wheels)'.format(path, version, cupys))
    if not same_object:
        raise CuDNNUnavailable(
            'the cuDNN at {} is another copy than the {} CuPy loaded (the same version {}): '
            'chainer_tc must call the same library as CuPy (check LD_LIBRARY_PATH and the '
            'installed nvidia-cudnn wheels)'.format(path, SONAME, version))


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
