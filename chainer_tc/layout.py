"""NCHW <-> NHWC conversion of 4-D arrays, with an optional float32 <-> float16 cast.

    from chainer_tc.layout import nchw_to_nhwc, nhwc_to_nchw
    y = nchw_to_nhwc(x)                          # (N, C, H, W) -> (N, H, W, C), same dtype
    y = nchw_to_nhwc(x, dtype=numpy.float16)     # and cast to half on the way (round to nearest even)

NumPy arrays take a NumPy path; CuPy arrays (and NumPy arrays under ``CHAINER_TC_EMULATE=1``) take
one launch of ``kernels/layout.cu``. Both give bit-identical results: the only arithmetic is the
float32 -> float16 rounding, which is round-to-nearest-even on both. The result is always a new
C-contiguous array, even when no cast is asked for. Big-endian input (``'>f4'``) is converted
to the native byte order first (one copy); the result has the byte order of ``dtype``, else the
input's.
"""
import numpy

from chainer_tc import kernels

TILE = 32          # tile edge of kernels/layout.cu
BLOCK_ROWS = 8     # rows of the tile each thread block row walks
_SUFFIX = {numpy.dtype(numpy.float32): 'f32', numpy.dtype(numpy.float16): 'f16'}


def nchw_to_nhwc(x, dtype=None):
    """(N, C, H, W) -> (N, H, W, C), cast to ``dtype`` (float16 or float32) if given."""
    n, c, h, w = _check(x, 'x', '(N, C, H, W)')
    return _transpose(x, n, c, h * w, (n, h, w, c), dtype)


def nhwc_to_nchw(x, dtype=None):
    """(N, H, W, C) -> (N, C, H, W), cast to ``dtype`` (float16 or float32) if given."""
    n, h, w, c = _check(x, 'x', '(N, H, W, C)')
    return _transpose(x, n, h * w, c, (n, c, h, w), dtype)


def _check(x, name, layout):
    if getattr(x, 'ndim', None) != 4:
        raise ValueError('{} must be a 4-D array {}; got shape {}'
                         .format(name, layout, getattr(x, 'shape', type(x).__name__)))
    if _native(x.dtype) not in _SUFFIX:
        raise TypeError('{} must be float16 or float32; got {}'.format(name, x.dtype))
    return x.shape


def _native(dtype):
    """``dtype`` in this machine's byte order (a big-endian '>f4' is float32's value)."""
    return dtype.newbyteorder('=')


def _out_dtype(x, dtype):
    """The result's dtype: ``dtype`` (any byte order), else ``x``'s."""
    if dtype is None:
        return x.dtype
    try:
        out = numpy.dtype(dtype)
    except TypeError:
        hint = ''
        if isinstance(dtype, str) and dtype == 'mixed16':
            hint = (" (mixed16 is Chainer's configuration of float16 values with float32 "
                    "parameters, not an array dtype: pass numpy.float16)")
        raise TypeError('dtype must be float16 or float32 (a NumPy dtype or its name); got '
                        '{!r}{}'.format(dtype, hint)) from None
    if _native(out) not in _SUFFIX:
        raise TypeError('dtype must be float16 or float32; got {}'.format(out))
    return out


def _transpose(x, batch, rows, cols, out_shape, dtype):
    """Transpose each of ``batch`` (rows x cols) matrices of ``x`` into ``out_shape``.

    A non-native byte order (``'>f4'`` on a little-endian machine) is the same value: the input
    is read as such, the result computed in the native dtype and converted to the byte order
    asked for (``dtype``, else the input's) with one more copy."""
    xp = _array_module(x)
    out_dtype = _out_dtype(x, dtype)
    native = _native(out_dtype)
    if out_dtype != native:
        return _transpose(x, batch, rows, cols, out_shape, native).astype(out_dtype)
    if x.dtype != _native(x.dtype):
        x = x.astype(_native(x.dtype))
    if max(batch, rows, cols) > 2 ** 31 - 1:
        raise ValueError('x has a dimension product over 2^31-1 (N={}, rows={}, cols={}); split '
                         'the batch'.format(batch, rows, cols))
    path = kernels.backend(xp)
    if path == 'numpy':
        m = numpy.ascontiguousarray(x).reshape(batch, rows, cols)
        with numpy.errstate(over='ignore'):    # overflow to inf is the defined cast, as on the GPU
            y = numpy.ascontiguousarray(m.transpose(0, 2, 1).astype(out_dtype))
        return y.reshape(out_shape)
    y = xp.empty(out_shape, dtype=out_dtype)
    if y.size == 0:
        return y
    x = xp.ascontiguousarray(x)
    k = kernels.get_function(
        'layout', 'batched_transpose_{}_{}'.format(_SUFFIX[x.dtype], _SUFFIX[out_dtype]), xp,
        defines={'LAYOUT_TILE': TILE, 'LAYOUT_BLOCK_ROWS': BLOCK_ROWS})
    grid = (-(-cols // TILE), min(-(-rows // TILE), 65535), min(batch, 65535))
    k(grid, (TILE, BLOCK_ROWS), (x, y, numpy.int32(rows), numpy.int32(cols), numpy.int64(batch)))
    return y


def _array_module(x):
    if isinstance(x, numpy.ndarray):
        return numpy
    mod = type(x).__module__.split('.')[0]
    if mod == 'cupy':
        import cupy
        return cupy
    raise TypeError('x must be a numpy.ndarray or cupy.ndarray; got {}'.format(type(x).__name__))
