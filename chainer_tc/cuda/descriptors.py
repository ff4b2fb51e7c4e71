"""cuDNN descriptors built through CuPy's raw bindings, counted, cached where they are immutable.

Descriptors are host objects: creating and setting one needs no GPU and no stream, but it is
set-up work that must not happen per call, and CuPy's bindings must not be called while a stream
is capturing. Tensor and filter descriptors, the ReLU activation descriptor and the derived
batch-norm descriptors are cached for the life of the process, keyed by what they describe, and
shared by every user (nothing modifies them after creation). A convolution descriptor carries the
math type chosen with its algorithm, so each convolution plan (``chainer_tc.cuda.conv``) owns its
own. Every creation adds 1 to ``counters()['descriptors']``.

Layouts are 'NHWC' or 'NCHW' for 4-D data; filters are (out, kh, kw, in/groups) in NHWC and
(out, in/groups, kh, kw) in NCHW, as ``cupyx.cudnn`` describes them.
"""
import numpy

from chainer_tc.cuda import _counters

LAYOUTS = ('NHWC', 'NCHW')

_tensors = {}
_filters = {}
_bn = {}
_relu = []


def clear_cache():
    """Forget the cached descriptors (those still held by a plan live on with it)."""
    _tensors.clear()
    _filters.clear()
    _bn.clear()
    del _relu[:]


def _lib():
    from cupy_backends.cuda.libs import cudnn
    return cudnn


def data_type(dtype):
    """The cudnnDataType_t of ``dtype`` (float16, float32 or float64)."""
    lib = _lib()
    types = {'e': lib.CUDNN_DATA_HALF, 'f': lib.CUDNN_DATA_FLOAT, 'd': lib.CUDNN_DATA_DOUBLE}
    dtype = numpy.dtype(dtype)
    if dtype.char not in types:
        raise TypeError('cuDNN takes float16, float32 or float64 data; got {}'.format(dtype.name))
    return types[dtype.char]


def compute_type(dtype):
    """The convolution compute type CuPy 13 uses: float for half data, else the data type."""
    lib = _lib()
    t = data_type(dtype)
    return lib.CUDNN_DATA_FLOAT if t == lib.CUDNN_DATA_HALF else t


def layout_format(layout):
    """The cudnnTensorFormat_t of 'NHWC' or 'NCHW'."""
    if layout not in LAYOUTS:
        raise ValueError('layout must be one of {}; got {!r}'.format(LAYOUTS, layout))
    lib = _lib()
    return lib.CUDNN_TENSOR_NHWC if layout == 'NHWC' else lib.CUDNN_TENSOR_NCHW


def nchw_dims(shape, layout):
    """(n, c, h, w) of a 4-D ``shape`` in ``layout`` (for a filter: (k, c, h, w))."""
    if len(shape) != 4:
        raise ValueError('cuDNN 4-D descriptors need a 4-D shape; got {}'.format(tuple(shape)))
    n, a, b, c = (int(s) for s in shape)
    return (n, c, a, b) if layout == 'NHWC' else (n, a, b, c)


class Descriptor:
    """A cuDNN descriptor (its address in ``value``) destroyed with this object."""

    __slots__ = ('value', '_destroy')

    def __init__(self, value, destroy):
        self.value, self._destroy = value, destroy

    def __del__(self):
        if self.value:
            try:
                self._destroy(self.value)
            except Exception:       # interpreter shutdown: the library may be gone already
                pass
            self.value = 0


def _new(create, destroy):
    _counters.add('descriptors')
    return Descriptor(create(), destroy)


def tensor_4d(shape, dtype, layout):
    """The fully packed 4-D tensor descriptor of ``shape`` in ``layout`` (cached)."""
    return _tensors.get(_key(shape, dtype, layout)) or _make_4d(_tensors, shape, dtype, layout,
                                                                 'Tensor')


def filter_4d(shape, dtype, layout):
    """The 4-D filter descriptor of ``shape`` in ``layout`` (cached)."""
    return _filters.get(_key(shape, dtype, layout)) or _make_4d(_filters, shape, dtype, layout,
                                                                 'Filter')


def _key(shape, dtype, layout):
    return tuple(shape), numpy.dtype(dtype).char, layout


def _make_4d(cache, shape, dtype, layout, kind):
    """A new tensor or filter descriptor (``kind``), described and cached (cache misses only)."""
    lib = _lib()
    desc = _new(getattr(lib, 'create{}Descriptor'.format(kind)),
                getattr(lib, 'destroy{}Descriptor'.format(kind)))
    fmt, t, dims = layout_format(layout), data_type(dtype), nchw_dims(shape, layout)
    if kind == 'Tensor':
        lib.setTensor4dDescriptor(desc.value, fmt, t, *dims)
    else:
        lib.setFilter4dDescriptor_v4(desc.value, t, fmt, *dims)
    cache[_key(shape, dtype, layout)] = desc
    return desc


def convolution(pad, stride, dilation, groups, dtype, tensor_ops):
    """A new 2-D cross-correlation descriptor (not cached: its owner sets its math type).

    ``tensor_ops``: start from CUDNN_TENSOR_OP_MATH (Tensor Cores allowed), else
    CUDNN_DEFAULT_MATH.
    """
    lib = _lib()
    desc = _new(lib.createConvolutionDescriptor, lib.destroyConvolutionDescriptor)
    lib.setConvolution2dDescriptor_v5(desc.value, pad[0], pad[1], stride[0], stride[1],
                                      dilation[0], dilation[1], lib.CUDNN_CROSS_CORRELATION,
                                      compute_type(dtype))
    if groups > 1:
        lib.setConvolutionGroupCount(desc.value, groups)
    set_math_type(desc, lib.CUDNN_TENSOR_OP_MATH if tensor_ops else lib.CUDNN_DEFAULT_MATH)
    return desc


def set_math_type(desc, math_type):
    _lib().setConvolutionMathType(desc.value, math_type)


def relu():
    """The ReLU activation descriptor (NaN propagated, no ceiling; cached)."""
    if not _relu:
        lib = _lib()
        desc = _new(lib.createActivationDescriptor, lib.destroyActivationDescriptor)
        lib.setActivationDescriptor(desc.value, lib.CUDNN_ACTIVATION_RELU,
                                    lib.CUDNN_PROPAGATE_NAN, 0.0)
        _relu.append(desc)
    return _relu[0]


def batch_norm(shape, dtype, layout, mode):
    """The scale/bias/mean/variance descriptor cuDNN derives from the data's (cached)."""
    key = (tuple(shape), numpy.dtype(dtype).char, layout, mode)
    desc = _bn.get(key)
    if desc is None:
        lib = _lib()
        desc = _new(lib.createTensorDescriptor, lib.destroyTensorDescriptor)
        lib.deriveBNTensorDescriptor(desc.value, tensor_4d(shape, dtype, layout).value, mode)
        _bn[key] = desc
    return desc
