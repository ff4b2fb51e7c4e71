"""cuDNN descriptors built through chainer_tc's binding, counted, cached where they are immutable.

Descriptors are host objects: creating and setting one needs no GPU and no stream, but it is
set-up work that must not happen per call (and does not happen while a stream captures). Tensor
and filter descriptors, the activation descriptors and the derived batch-norm descriptors are
cached for the life of the process, keyed by what they describe, and shared by every user
(nothing modifies them after creation). A convolution descriptor carries the math type chosen
with its algorithm, so each convolution plan (``chainer_tc.cuda.conv``) owns its own. The 2-D
pooling descriptors are cached too. Every creation adds 1 to ``counters()['descriptors']``.

Layouts are 'NHWC' or 'NCHW' for 4-D data; filters are (out, kh, kw, in/groups) in NHWC and
(out, in/groups, kh, kw) in NCHW, as ``cupyx.cudnn`` describes them.
"""
import numpy

from chainer_tc.cuda import _counters
from chainer_tc.cuda import _cudnn_api as api
from chainer_tc.cuda import cudnn

LAYOUTS = ('NHWC', 'NCHW')

_tensors = {}
_filters = {}
_bn = {}
_pooling = {}
_activations = {}


def clear_cache():
    """Forget the cached descriptors (those still held by a plan live on with it)."""
    _tensors.clear()
    _filters.clear()
    _bn.clear()
    _pooling.clear()
    _activations.clear()


def data_type(dtype):
    """The cudnnDataType_t of ``dtype`` (float16, float32 or float64)."""
    types = {'e': api.CUDNN_DATA_HALF, 'f': api.CUDNN_DATA_FLOAT, 'd': api.CUDNN_DATA_DOUBLE}
    dtype = numpy.dtype(dtype)
    if dtype.char not in types:
        raise TypeError('cuDNN takes float16, float32 or float64 data; got {}'.format(dtype.name))
    return types[dtype.char]


def compute_type(dtype):
    """The convolution compute type CuPy 13 uses: float for half data, else the data type."""
    t = data_type(dtype)
    return api.CUDNN_DATA_FLOAT if t == api.CUDNN_DATA_HALF else t


def layout_format(layout):
    """The cudnnTensorFormat_t of 'NHWC' or 'NCHW'."""
    if layout not in LAYOUTS:
        raise ValueError('layout must be one of {}; got {!r}'.format(LAYOUTS, layout))
    return api.CUDNN_TENSOR_NHWC if layout == 'NHWC' else api.CUDNN_TENSOR_NCHW


def nchw_dims(shape, layout):
    """(n, c, h, w) of a 4-D ``shape`` in ``layout`` (for a filter: (k, c, h, w))."""
    if len(shape) != 4:
        raise ValueError('cuDNN 4-D descriptors need a 4-D shape; got {}'.format(tuple(shape)))
    n, a, b, c = (int(s) for s in shape)
    return (n, c, a, b) if layout == 'NHWC' else (n, a, b, c)


class Descriptor:
    """A cuDNN descriptor of ``kind`` (Tensor, Filter, Convolution, Activation), its address in
    ``value``, destroyed with this object by the binding that created it."""

    __slots__ = ('value', 'kind', '_binding')

    def __init__(self, kind):
        self._binding = cudnn.binding()
        self.kind, self.value = kind, self._binding.create(kind)
        _counters.add('descriptors')

    def __del__(self):
        if getattr(self, 'value', 0):        # unset where create() raised
            try:
                self._binding.destroy(self.kind, self.value)
            except Exception:       # interpreter shutdown: the library may be gone already
                pass
            self.value = 0

    def set(self, what, *args):
        """cudnnSet<what>(this descriptor, *args)."""
        self._binding.call('cudnnSet' + what, self.value, *args)


def tensor_4d(shape, dtype, layout):
    """The fully packed 4-D tensor descriptor of ``shape`` in ``layout`` (cached)."""
    key = _key(shape, dtype, layout)
    desc = _tensors.get(key)
    if desc is None:
        _fits_cudnn(shape, 'tensor')
        desc = Descriptor('Tensor')
        desc.set('Tensor4dDescriptor', layout_format(layout), data_type(dtype),
                 *nchw_dims(shape, layout))
        _tensors[key] = desc          # cached once described: a failed set leaves nothing
    return desc


def filter_4d(shape, dtype, layout):
    """The 4-D filter descriptor of ``shape`` in ``layout`` (cached)."""
    key = _key(shape, dtype, layout)
    desc = _filters.get(key)
    if desc is None:
        _fits_cudnn(shape, 'filter')
        desc = Descriptor('Filter')
        desc.set('Filter4dDescriptor', data_type(dtype), layout_format(layout),
                 *nchw_dims(shape, layout))
        _filters[key] = desc
    return desc


def _fits_cudnn(shape, what):
    """cuDNN's 4-D descriptors take int dimensions, and a tensor of at most 2**31 - 1
    elements: ctypes would wrap a larger dimension silently."""
    total = 1
    for d in shape:
        total *= d
    if total >= 2 ** 31 or any(d >= 2 ** 31 for d in shape):
        raise ValueError('cuDNN {} descriptor of shape {}: cuDNN takes at most 2**31 - 1 elements '
                         'in a 4-D tensor; split the batch'.format(what, tuple(shape)))


def _key(shape, dtype, layout):
    return tuple(int(s) for s in shape), numpy.dtype(dtype).char, layout


def convolution(pad, stride, dilation, groups, dtype, tensor_ops):
    """A new 2-D cross-correlation descriptor (not cached: its owner sets its math type).

    ``tensor_ops``: start from CUDNN_TENSOR_OP_MATH (Tensor Cores allowed), else
    CUDNN_DEFAULT_MATH.
    """
    desc = Descriptor('Convolution')
    desc.set('Convolution2dDescriptor', pad[0], pad[1], stride[0], stride[1], dilation[0],
             dilation[1], api.CUDNN_CROSS_CORRELATION, compute_type(dtype))
    if groups > 1:
        desc.set('ConvolutionGroupCount', groups)
    set_math_type(desc, api.CUDNN_TENSOR_OP_MATH if tensor_ops else api.CUDNN_DEFAULT_MATH)
    return desc


def set_math_type(desc, math_type):
    desc.set('ConvolutionMathType', math_type)


def relu():
    """The ReLU activation descriptor of the fused batch normalization (NaN propagated, no
    ceiling; cached)."""
    return activation(api.CUDNN_ACTIVATION_RELU, api.CUDNN_PROPAGATE_NAN, 0.0)


def activation(mode, nan_opt, coef):
    """The activation descriptor of cudnnActivationMode_t ``mode``, cudnnNanPropagation_t
    ``nan_opt`` and ``coef`` (the ceiling of a clipped ReLU, the slope of an ELU; cached)."""
    key = (int(mode), int(nan_opt), float(coef))
    desc = _activations.get(key)
    if desc is None:
        desc = Descriptor('Activation')
        desc.set('ActivationDescriptor', *key)
        _activations[key] = desc
    return desc


def batch_norm(shape, dtype, layout, mode):
    """The scale/bias/mean/variance descriptor cuDNN derives from the data's (cached)."""
    key = _key(shape, dtype, layout) + (mode,)
    desc = _bn.get(key)
    if desc is None:
        desc = Descriptor('Tensor')
        cudnn.binding().call('cudnnDeriveBNTensorDescriptor', desc.value,
                             tensor_4d(shape, dtype, layout).value, mode)
        _bn[key] = desc
    return desc


def pooling_2d(mode, ksize, stride, pad):
    """The 2-D pooling descriptor of cudnnPoolingMode_t ``mode`` with (h, w) pairs ``ksize``,
    ``stride`` and ``pad``; NaN not propagated, as ``cupyx.cudnn`` sets it (cached)."""
    key = (int(mode),) + tuple(int(v) for pair in (ksize, stride, pad) for v in pair)
    if len(key) != 7:
        raise ValueError('2-D pooling takes (h, w) pairs; got ksize {}, stride {}, pad {}'
                         .format(ksize, stride, pad))
    desc = _pooling.get(key)
    if desc is None:
        mode, kh, kw, sy, sx, ph, pw = key
        desc = Descriptor('Pooling')
        desc.set('Pooling2dDescriptor', mode, api.CUDNN_NOT_PROPAGATE_NAN, kh, kw, ph, pw, sy,
                 sx)
        _pooling[key] = desc
    return desc
