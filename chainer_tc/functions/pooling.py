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
_CTYPE = {numpy.dtype(numpy.float16): '__half', numpy.dtype(numpy.float32): 'float',
          numpy.dtype(numpy.float64): 'double'}
_DEFINES = {'POOL_THREADS': THREADS}
_NAMES = tuple('{}<{}, {}>'.format(k, t, v) for k in ('max_pool_forward', 'max_pool_backward',
                                                      'avg_pool_forward', 'avg_pool_backward')
               for t in ('__half', 'float', 'double') for v in (1, 2))
SHAPE = numpy.dtype([(f, '<i4') for f in ('N', 'H', 'W', 'C', 'OH', 'OW', 'kh', 'kw', 'sy', 'sx',
                                          'ph', 'pw')])
INT_MAX = 2 ** 31 - 1       # the kernels' geometry is 32-bit int (PoolShape, window offsets)


def _acc(dtype):
    return numpy.float64 if dtype == numpy.float64 else numpy.float32


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
            raise ValueError('ksize {} has {} elements per window; at most 2**31 - 1 (window '
                             'offsets are int32)'.format((self.kh, self.kw), self.kh * self.kw))
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
        holds the data type): one row of threads per output position (forward) or input position
        (backward), two channels per thread where C is even and every array is aligned to two of
        its elements, else one (an even C held back by a misaligned array says so once)."""
        rows, cols = ('OH', 'OW') if name.endswith('forward') else ('H', 'W')
        positions = int(s['N']) * int(s[rows]) * int(s[cols])
        width, grid, block = _tiles.plan(name, int(s['C']), positions, THREADS, arrays,
                                         chainer.warnings.PerformanceWarning)
        dtype = next(iter(arrays.values())).dtype
        f = kernels.get_function('pooling', '{}<{}, {}>'.format(
            name, _CTYPE[numpy.dtype(dtype)], width), xp, _DEFINES, name_expressions=_NAMES)
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


class MaxPooling2D(_Pooling2D):

    def forward(self, inputs):
        x, = inputs
        s = self.shape = self._geometry(x)
        self._in_dtype = x.dtype
        xp = chainer.backend.get_array_module(x)
        if kernels.backend(xp) == 'numpy':
            xpad = self._padded(x, s, -numpy.inf)
            y = argmax = None
            for i, j, sl in self._windows(s):
                v = xpad[sl]
                if y is None:
                    y, argmax = v.copy(), numpy.zeros(v.shape, numpy.int32)
                else:        # the first NaN wins and stays, as with Chainer's argmax
                    better = (v > y) | (numpy.isnan(v) & ~numpy.isnan(y))
                    numpy.copyto(y, v, where=better)
                    numpy.copyto(argmax, i * self.kw + j, where=better)
        else:
            x = xp.ascontiguousarray(x)
            y = xp.empty((int(s['N']), int(s['OH']), int(s['OW']), int(s['C'])), x.dtype)
            argmax = xp.empty(y.shape, numpy.int32)
            self._launch('max_pool_forward', s, {'x': x, 'y': y, 'argmax': argmax}, xp)
        self.argmax = argmax
        return y,

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
            for i, j, sl in f._windows(s):
                if self.is_max:
                    gp[sl] += numpy.where(f.argmax == i * f.kw + j, gy.astype(a), a(0))
                else:
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


def max_pooling_2d(x, ksize, stride=None, pad=0, cover_all=True):
    """Max pooling of NHWC ``x`` (Chainer's arguments and defaults)."""
    return MaxPooling2D(ksize, stride, pad, cover_all).apply((x,))[0]


def average_pooling_2d(x, ksize, stride=None, pad=0):
    """Average pooling of NHWC ``x``; padding counts as zeros (as Chainer's)."""
    return AveragePooling2D(ksize, stride, pad, False).apply((x,))[0]


def global_average_pooling_2d(x):
    """Average over H and W: (N, H, W, C) -> (N, 1, 1, C)."""
    return average_pooling_2d(x, x.shape[1:3])
