"""Max and average pooling over channels-last (NHWC) arrays.

    from chainer_tc import functions as TF
    y = TF.max_pooling_2d(x, 3, stride=2, pad=1)          # x: (N, H, W, C)
    y = TF.average_pooling_2d(x, 2)
    y = TF.global_average_pooling_2d(x)                   # (N, 1, 1, C), ResNet's last pooling

Chainer's semantics (``chainer.functions.max_pooling_2d`` with ``cover_all``, ties to the first
maximum in row-major window order; ``average_pooling_2d`` counting padding as zeros), in NHWC.
NumPy arrays take a NumPy path; CuPy arrays (and NumPy under ``CHAINER_TC_EMULATE=1``) one launch
of kernels/pooling.cu each way. Double backpropagation is not supported.
"""
import numpy

import chainer
from chainer import function_node
from chainer.utils import conv
from chainer.utils import type_check

from chainer_tc import _tiles
from chainer_tc import kernels
from chainer_tc.functions import _util

THREADS = 256
RUN = 16                    # backward: at most RUN input columns per work item (POOL_RUN)
_CTYPE = {numpy.dtype(numpy.float16): '__half', numpy.dtype(numpy.float32): 'float',
          numpy.dtype(numpy.float64): 'double'}
# max pooling's window offsets (argmax): one byte where every offset i*kw+j < kh*kw fits
_INDEX_CTYPE = {numpy.dtype(numpy.uint8): 'unsigned char', numpy.dtype(numpy.int32): 'int'}
_DEFINES = {'POOL_THREADS': THREADS, 'POOL_RUN': RUN}
_NAMES = (tuple('{}<{}, {}, {}>'.format(k, t, i, v)
                for k in ('max_pool_forward', 'max_pool_backward')
                for t in ('__half', 'float', 'double') for i in ('unsigned char', 'int')
                for v in (1, 2))
          + tuple('{}<{}, {}>'.format(k, t, v) for k in ('avg_pool_forward', 'avg_pool_backward')
                  for t in ('__half', 'float', 'double') for v in (1, 2)))
SHAPE = numpy.dtype([(f, '<i4') for f in ('N', 'H', 'W', 'C', 'OH', 'OW', 'kh', 'kw', 'sy', 'sx',
                                          'ph', 'pw')])
# the NumPy max pooling's temporaries, at most this many bytes at a time (a few images at a
# time): forward the windows' copy (9 times the output for a 3x3 window: ResNet-50's first
# pooling at batch 32 would take 230 MB in float32), backward the int64 scatter indices
_WINDOW_BYTES = 32 * 2 ** 20
INT_MAX = 2 ** 31 - 1       # the kernels' geometry is 32-bit int (PoolShape, window offsets)


def _images_per_pass(bytes_per_image):
    """How many images the NumPy max pooling takes at once for temporaries of
    ``bytes_per_image`` each: as many as fit in _WINDOW_BYTES, at least one."""
    return max(1, _WINDOW_BYTES // max(1, bytes_per_image))


def _acc(dtype):
    return numpy.float64 if dtype == numpy.float64 else numpy.float32


def index_dtype(kh, kw):
    """The dtype max pooling keeps its window offsets (argmax, ``i * kw + j``) in, from forward
    to backward: uint8 where every offset fits (``kh * kw <= 256``: a quarter of int32's bytes,
    half of float16 data's), int32 otherwise. The same on every path."""
    return numpy.dtype(numpy.uint8 if kh * kw <= 256 else numpy.int32)


class _Pooling2D(function_node.FunctionNode):

    def __init__(self, ksize, stride, pad, cover_all):
        self.kh, self.kw = _util.pair(ksize, 'ksize')
        self.sy, self.sx = _util.pair(ksize if stride is None else stride, 'stride')
        self.ph, self.pw = _util.pair(pad, 'pad')
        if min(self.kh, self.kw, self.sy, self.sx) < 1 or min(self.ph, self.pw) < 0:
            raise ValueError('ksize and stride must be >= 1 and pad >= 0; got ksize {}, stride {}, '
                             'pad {}'.format((self.kh, self.kw), (self.sy, self.sx),
                                             (self.ph, self.pw)))
        for name, pair in (('ksize', (self.kh, self.kw)), ('stride', (self.sy, self.sx)),
                           ('pad', (self.ph, self.pw))):
            if max(pair) > INT_MAX:
                raise ValueError('{} must be at most 2**31 - 1 = {} (the pooling kernels\' '
                                 'geometry is 32-bit); got {}'.format(name, INT_MAX, pair))
        if self.kh * self.kw > INT_MAX:
            raise ValueError('ksize {} has {} elements per window; at most 2**31 - 1 (the '
                             'window offsets of windows over 256 elements are int32)'.format(
                                 (self.kh, self.kw), self.kh * self.kw))
        self.cover_all = cover_all

    def check_type_forward(self, in_types):
        type_check.expect(in_types.size() == 1, in_types[0].dtype.kind == 'f',
                          in_types[0].ndim == 4)

    def _geometry(self, x):
        n, h, w, c = x.shape
        oh = conv.get_conv_outsize(h, self.kh, self.sy, self.ph, self.cover_all)
        ow = conv.get_conv_outsize(w, self.kw, self.sx, self.pw, self.cover_all)
        if oh < 1 or ow < 1:
            raise ValueError('pooling window {} with stride {} and pad {} leaves no output for '
                             'input of shape {} (N, H, W, C)'.format(
                                 (self.kh, self.kw), (self.sy, self.sx), (self.ph, self.pw),
                                 x.shape))
        for axis, size, out, k, st, p in (('height', h, oh, self.kh, self.sy, self.ph),
                                          ('width', w, ow, self.kw, self.sx, self.pw)):
            # the kernels form padded coordinates up to (out - 1) * stride + ksize and size + pad
            span = max((out - 1) * st + k, size + 2 * p)
            if span > INT_MAX:
                raise ValueError('pooling input {} {} with ksize {}, stride {} and pad {} spans {} '
                                 'padded positions; the pooling kernels\' geometry is 32-bit (at '
                                 'most 2**31 - 1)'.format(axis, size, k, st, p, span))
        for name, v in (('N', n), ('C', c)):
            if v > INT_MAX:
                raise ValueError('pooling input {} = {} is more than 2**31 - 1 (the pooling '
                                 'kernels\' geometry is 32-bit)'.format(name, v))
        s = numpy.zeros((), SHAPE)
        for f, v in zip(SHAPE.names, (n, h, w, c, oh, ow, self.kh, self.kw, self.sy, self.sx,
                                      self.ph, self.pw)):
            s[f] = v
        return s

    def _launch(self, name, s, arrays, xp):
        """Launch kernel ``name`` on ``arrays`` (its array arguments in order, by name; the first
        holds the data type, ``argmax``, where there is one, the window offsets' type): one row of
        threads per work item (forward an output position; backward a run of up to RUN input
        columns of one row, N * H * ceil(W / RUN) of them), two channels per thread where C is
        even and every array is aligned to two of its elements, else one (an even C held back by
        a misaligned array says so once)."""
        if name.endswith('forward'):
            items = int(s['N']) * int(s['OH']) * int(s['OW'])
        else:
            items = int(s['N']) * int(s['H']) * -(-int(s['W']) // RUN)
        width, grid, block = _tiles.plan(name, int(s['C']), items, THREADS, arrays,
                                         chainer.warnings.PerformanceWarning)
        dtype = next(iter(arrays.values())).dtype
        types = [_CTYPE[numpy.dtype(dtype)], str(width)]       # <T, V>; max pooling <T, I, V>
        if 'argmax' in arrays:
            types.insert(1, _INDEX_CTYPE[arrays['argmax'].dtype])
        f = kernels.get_function('pooling', '{}<{}>'.format(name, ', '.join(types)), xp, _DEFINES,
                                 name_expressions=_NAMES)
        f(grid, block, (s,) + tuple(arrays.values()))

    def _windows(self, s):
        """(i, j, slice of the padded array) for every window offset (the NumPy path)."""
        oh, ow, sy, sx = int(s['OH']), int(s['OW']), self.sy, self.sx
        for i in range(self.kh):
            for j in range(self.kw):
                yield i, j, (slice(None), slice(i, i + sy * (oh - 1) + 1, sy),
                             slice(j, j + sx * (ow - 1) + 1, sx), slice(None))

    def _padded(self, x, s, value, dtype=None):
        """``x`` inside a border of ``value`` wide enough for every window; ``x=None``: only
        the border (the array of ``value``), in ``dtype``."""
        n, h, w, c = (int(s[k]) for k in ('N', 'H', 'W', 'C'))
        extra_h = max(0, (int(s['OH']) - 1) * self.sy + self.kh - (h + 2 * self.ph))
        extra_w = max(0, (int(s['OW']) - 1) * self.sx + self.kw - (w + 2 * self.pw))
        out = numpy.full((n, h + 2 * self.ph + extra_h, w + 2 * self.pw + extra_w, c), value,
                         x.dtype if dtype is None else dtype)
        if x is not None:
            out[:, self.ph:self.ph + h, self.pw:self.pw + w] = x
        return out

    def _crop(self, gp, s):
        return gp[:, self.ph:self.ph + int(s['H']), self.pw:self.pw + int(s['W']), :]

    def _window_rows(self, xpad, s, n0, count):
        """Images n0 .. n0 + count - 1 of the padded array as (count, OH, OW, kh * kw, C): each
        window's values copied out along axis 3, in window-offset order i * kw + j."""
        oh, ow, c = int(s['OH']), int(s['OW']), int(s['C'])
        s0, s1, s2, s3 = xpad.strides
        view = numpy.ndarray((count, oh, ow, self.kh, self.kw, c), xpad.dtype, buffer=xpad,
                             offset=n0 * s0, strides=(s0, self.sy * s1, self.sx * s2, s1, s2, s3))
        return view.reshape(count, oh, ow, self.kh * self.kw, c)      # a copy: strided windows

    def _flat_index(self, shape, s, offsets):
        """Where in the flattened padded array of ``shape`` (n images) each output element's
        window offset (``offsets``, i * kw + j, of shape (n, OH, OW, C)) falls: the scatter of
        max pooling's gradient."""
        n, hp, wp, c = shape
        oh, ow = int(s['OH']), int(s['OW'])
        start = ((numpy.arange(n).reshape(-1, 1, 1, 1) * hp
                  + self.sy * numpy.arange(oh).reshape(-1, 1, 1)) * wp
                 + self.sx * numpy.arange(ow).reshape(-1, 1)) * c + numpy.arange(c)
        k = numpy.arange(self.kh * self.kw)
        return start + ((k // self.kw) * wp + k % self.kw)[offsets] * c


class MaxPooling2D(_Pooling2D):

    def forward(self, inputs):
        x, = inputs
        s = self.shape = self._geometry(x)
        self._in_dtype = x.dtype
        xp = chainer.backend.get_array_module(x)
        if kernels.backend(xp) == 'numpy':
            y, argmax = self._max_numpy(x, s)
        else:
            x = xp.ascontiguousarray(x)
            y = xp.empty((int(s['N']), int(s['OH']), int(s['OW']), int(s['C'])), x.dtype)
            argmax = xp.empty(y.shape, index_dtype(self.kh, self.kw))
            self._launch('max_pool_forward', s, {'x': x, 'y': y, 'argmax': argmax}, xp)
        self.argmax = argmax
        return y,

    def _max_numpy(self, x, s):
        """(y, argmax) on the NumPy path: the windows copied out as rows of kh * kw values (a
        few images at a time, the copy at most _WINDOW_BYTES) and numpy.argmax along them: the
        first maximum, or the first NaN (NaN propagates), as Chainer's argmax and the kernel."""
        xpad = self._padded(x, s, -numpy.inf)
        n = int(s['N'])
        y = numpy.empty((n, int(s['OH']), int(s['OW']), int(s['C'])), x.dtype)
        argmax = numpy.empty(y.shape, index_dtype(self.kh, self.kw))
        per = _images_per_pass(y[:1].nbytes * self.kh * self.kw)
        for n0 in range(0, n, per):
            rows = self._window_rows(xpad, s, n0, min(per, n - n0))
            first = rows.argmax(axis=3)
            y[n0:n0 + per] = numpy.take_along_axis(rows, first[:, :, :, None], axis=3)[:, :, :, 0]
            argmax[n0:n0 + per] = first
        return y, argmax

    def backward(self, indexes, grad_outputs):
        return _PoolingGrad(self, True).apply(grad_outputs)


class AveragePooling2D(_Pooling2D):

    def forward(self, inputs):
        x, = inputs
        s = self.shape = self._geometry(x)
        xp = chainer.backend.get_array_module(x)
        if kernels.backend(xp) == 'numpy':
            a = _acc(x.dtype)
            xpad = self._padded(x, s, 0)
            total = sum(xpad[sl].astype(a) for _, _, sl in self._windows(s))
            return (total / a(self.kh * self.kw)).astype(x.dtype),
        x = xp.ascontiguousarray(x)
        y = xp.empty((int(s['N']), int(s['OH']), int(s['OW']), int(s['C'])), x.dtype)
        self._launch('avg_pool_forward', s, {'x': x, 'y': y}, xp)
        return y,

    def backward(self, indexes, grad_outputs):
        return _PoolingGrad(self, False).apply(grad_outputs)


class _PoolingGrad(function_node.FunctionNode):
    """gx of a pooling node ``f`` (max: to the remembered argmax; average: spread evenly)."""

    def __init__(self, f, is_max):
        self.f, self.is_max = f, is_max

    def forward(self, inputs):
        gy, = inputs
        f, s = self.f, self.f.shape
        xp = chainer.backend.get_array_module(gy)
        in_shape = (int(s['N']), int(s['H']), int(s['W']), int(s['C']))
        if kernels.backend(xp) == 'numpy':
            a = _acc(gy.dtype)
            gp = f._padded(None, s, 0, a)
            if self.is_max:
                # each output's gradient added where its maximum was, in the order of the outputs
                # (oh, then ow) as the kernel sums, so the same float additions; a few images at a
                # time (each image's sums are its own), the int64 indices at most _WINDOW_BYTES
                per = _images_per_pass(3 * 8 * gy[:1].size)
                for n0 in range(0, in_shape[0], per):
                    part = gp[n0:n0 + per]              # a view: leading images of gp
                    numpy.add.at(part.reshape(-1),
                                 f._flat_index(part.shape, s, f.argmax[n0:n0 + per]).reshape(-1),
                                 gy[n0:n0 + per].astype(a, copy=False).reshape(-1))
            else:
                for _, _, sl in f._windows(s):
                    gp[sl] += gy.astype(a)
            gx = f._crop(gp, s)
            return (gx if self.is_max else gx / a(f.kh * f.kw)).astype(gy.dtype),
        gx = xp.empty(in_shape, gy.dtype)
        gy = xp.ascontiguousarray(gy)
        if self.is_max:
            f._launch('max_pool_backward', s, {'gy': gy, 'argmax': f.argmax, 'gx': gx}, xp)
        else:
            f._launch('avg_pool_backward', s, {'gy': gy, 'gx': gx}, xp)
        return gx,

    def backward(self, indexes, grad_outputs):
        raise NotImplementedError('chainer_tc: double backpropagation through pooling is not '
                                  'supported')


def max_pooling_2d(x, ksize, stride=None, pad=0, cover_all=True, return_indices=False):
    """Max pooling of NHWC ``x`` (Chainer's arguments and defaults). ``return_indices=True`` is
    refused with NotImplementedError: Chainer's indices (each window's argmax, an NCHW array)
    are for ``F.upsampling_2d``, which unpools NCHW data, and there is no NHWC unpooling here;
    where they are needed, pool NCHW data with ``F.max_pooling_2d``."""
    if return_indices:
        raise NotImplementedError(
            'chainer_tc.functions.max_pooling_2d: return_indices=True is not supported; got '
            'return_indices={!r}. Chainer\'s indices (each window\'s argmax, an NCHW array) are '
            'for F.upsampling_2d, which unpools NCHW data, and chainer_tc has no NHWC '
            'unpooling: where they are needed, pool NCHW data with Chainer\'s function, '
            'F.max_pooling_2d(F.transpose(x, (0, 3, 1, 2)), ksize, ..., return_indices=True)'
            .format(return_indices))
    return MaxPooling2D(ksize, stride, pad, cover_all).apply((x,))[0]


def average_pooling_2d(x, ksize, stride=None, pad=0):
    """Average pooling of NHWC ``x``; padding counts as zeros (as Chainer's)."""
    return AveragePooling2D(ksize, stride, pad, False).apply((x,))[0]


def global_average_pooling_2d(x):
    """Average over H and W: (N, H, W, C) -> (N, 1, 1, C)."""
    return average_pooling_2d(x, x.shape[1:3])
