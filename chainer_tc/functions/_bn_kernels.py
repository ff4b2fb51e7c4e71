"""BatchNormalization (+ Add + ReLU) over channels-last arrays with kernels/batchnorm.cu: the GPU
path (CuPy) and, under CHAINER_TC_EMULATE=1, the emulated one. Arrays are 2-D (rows, C).

Every launch over the data, the elementwise ones (``bn_apply``, ``bn_backward_apply``) and the
reductions (``bn_stats_partial``, ``bn_backward_partial``), takes two channels per thread
(``<..., 2>``: one __half2/float2/double2 access) when C is even and every data array it reads or
writes is aligned to two elements, else one (``<..., 1>``); an even C held back by a misaligned
array (an offset view) says so once per kernel, as a PerformanceWarning. Both widths compute each
channel with the same operations in the same order: their results are bitwise equal."""
import numpy

import chainer

from chainer_tc import _tiles
from chainer_tc import kernels

TILE_C, ROWS, THREADS, FINAL_ROWS = 32, 8, 256, 16
_DEFINES = {'BN_TILE_C': TILE_C, 'BN_ROWS': ROWS, 'BN_THREADS': THREADS,
            'BN_FINAL_ROWS': FINAL_ROWS}
_CTYPE = {numpy.dtype(numpy.float16): '__half', numpy.dtype(numpy.float32): 'float',
          numpy.dtype(numpy.float64): 'double'}
PAIRS = [(numpy.float16, numpy.float16), (numpy.float16, numpy.float32),
         (numpy.float32, numpy.float32), (numpy.float64, numpy.float64)]
_NAMES = tuple(['{}<{}, {}>'.format(k, t, v) for k in ('bn_stats_partial', 'bn_backward_partial')
           for t in ('__half', 'float', 'double') for v in (1, 2)]
          + ['bn_stats_finalize<{}>'.format(t) for t in ('__half', 'float', 'double')]
          + ['bn_backward_finalize<{}>'.format(t) for t in ('__half', 'float', 'double')]
          + ['{}<{}, {}, {}>'.format(k, _CTYPE[numpy.dtype(t)], _CTYPE[numpy.dtype(p)], v)
             for k in ('bn_apply', 'bn_backward_apply') for t, p in PAIRS for v in (1, 2)])


def _kernel(name, *dtypes, xp, width=None):
    args = [_CTYPE[numpy.dtype(d)] for d in dtypes] + ([] if width is None else [str(width)])
    full = '{}<{}>'.format(name, ', '.join(args))
    return kernels.get_function('batchnorm', full, xp, _DEFINES, name_expressions=_NAMES)


def _elementwise(name, rows, C, arrays):
    """(vector width, grid, block) of bn_apply / bn_backward_apply over ``arrays`` (data)."""
    return _tiles.plan(name, C, rows, THREADS, arrays, chainer.warnings.PerformanceWarning)


def _reduction(name, rows, C, arrays):
    """(vector width, grid, block, rows per block) of bn_stats_partial / bn_backward_partial
    over ``arrays`` (the data they read): the width chosen, and a misaligned array warned of once
    per kernel, as for the elementwise launches (``_tiles.width``); blocks of TILE_C threads over
    channel groups by ROWS over rows, each block reducing ``per`` rows (the same for both
    widths)."""
    width = _tiles.width(name, C, arrays, chainer.warnings.PerformanceWarning)
    per, blocks = _row_blocks(rows, C)
    return width, (-(-C // (width * TILE_C)), blocks), (TILE_C, ROWS), per


def acc_dtype(dtype):
    return numpy.float64 if dtype == numpy.float64 else numpy.float32


def _row_blocks(rows, C):
    """(rows per block, row blocks) of the reductions: about 1024 blocks in all for the launch
    with two channels per thread (tiles of 2 * TILE_C channels), at least 4 rows per thread. The
    one-channel launch reduces the same row blocks (twice as many blocks: its tiles are half as
    wide), so that both widths give the same partial sums, bit for bit."""
    tiles = -(-C // (2 * TILE_C))
    blocks = max(1, min(-(-rows // (4 * ROWS)), max(1, 1024 // tiles)))
    per = -(-rows // blocks)
    return per, -(-rows // per)


def _stats_partial(x, xp):
    """bn_stats_partial over the rows of ``x``: the (row blocks, C, 3) summaries."""
    rows, C = x.shape
    width, grid, block, per = _reduction('bn_stats_partial', rows, C, {'x': x})
    partial = xp.empty((grid[1], C, 3), acc_dtype(x.dtype))
    _kernel('bn_stats_partial', x.dtype, xp=xp, width=width)(
        grid, block, (x, numpy.int64(rows), numpy.int32(C), numpy.int64(per), partial))
    return partial


def finalize(partial, rows, eps, decay, running_mean, running_var, xp, dtype):
    """(mean, invstd) of the summaries ``partial`` (blocks, C, 3) of ``rows`` rows in all (the
    acc type of ``dtype``, the data's); updates the running statistics if given."""
    blocks, C = partial.shape[:2]
    a = acc_dtype(dtype)
    mean, invstd = xp.empty(C, a), xp.empty(C, a)
    update = running_mean is not None
    p_dtype = running_mean.dtype if update else dtype     # None: null pointers
    _kernel('bn_stats_finalize', p_dtype, xp=xp)(
        (-(-C // TILE_C),), (TILE_C, FINAL_ROWS),
        (partial, numpy.int32(blocks), numpy.int32(C), numpy.int64(rows), numpy.float64(eps),
         numpy.float64(decay), numpy.int32(update), running_mean, running_var, mean, invstd,
         None))
    return mean, invstd


def statistics(x, eps, decay, running_mean, running_var, xp):
    """(mean, invstd) in the accumulation dtype; updates the running statistics if given."""
    return finalize(_stats_partial(x, xp), x.shape[0], eps, decay, running_mean, running_var,
                    xp, x.dtype)


def summary(x, xp):
    """(C, 3) (count, mean, M2) of each channel over the rows of ``x``, in the acc type: the row
    blocks of bn_stats_partial merged by bn_stats_finalize (its ``summary`` output), as it
    merges them for the statistics. No rows: zeros (an empty summary, skipped by every
    merge)."""
    rows, C = x.shape
    a = acc_dtype(x.dtype)
    if rows == 0:
        return xp.zeros((C, 3), a)
    partial = _stats_partial(x, xp)
    out = xp.empty((C, 3), a)
    _kernel('bn_stats_finalize', x.dtype, xp=xp)(
        (-(-C // TILE_C),), (TILE_C, FINAL_ROWS),
        (partial, numpy.int32(partial.shape[0]), numpy.int32(C), numpy.int64(rows),
         numpy.float64(1), numpy.float64(0), numpy.int32(0), None, None, None, None, out))
    return out


def forward(x, z, gamma, beta, mean, invstd, relu, xp):
    rows, C = x.shape
    y = xp.empty_like(x)
    width, grid, block = _elementwise('bn_apply', rows, C, {'x': x, 'z': z, 'y': y})
    _kernel('bn_apply', x.dtype, gamma.dtype, xp=xp, width=width)(
        grid, block, (x, z, gamma, beta, mean, invstd, y, numpy.int64(rows), numpy.int32(C),
                      numpy.int32(relu)))
    return y


def backward_sums(gy, y, x, gamma, mean, invstd, relu, xp):
    """(sums, ggamma, gbeta): sums (2C, acc type) = (sum g, sum g * xhat) over the rows,
    ggamma = sum g * xhat and gbeta = sum g in gamma's dtype (g: gy masked by y > 0 when
    ``relu``). No rows: zeros."""
    rows, C = x.shape
    a = acc_dtype(x.dtype)
    if rows == 0:           # an empty batch: nothing to reduce, nothing to launch
        return xp.zeros(2 * C, a), xp.zeros_like(gamma), xp.zeros_like(gamma)
    width, grid, block, per = _reduction('bn_backward_partial', rows, C,
                                         {'gy': gy, 'y': y if relu else None, 'x': x})
    partial = xp.empty((grid[1], C, 2), a)
    _kernel('bn_backward_partial', x.dtype, xp=xp, width=width)(
        grid, block, (gy, y, x, mean, invstd, numpy.int64(rows), numpy.int32(C), numpy.int64(per),
                      numpy.int32(relu), partial))
    tiles = -(-C // TILE_C)
    sums = xp.empty(2 * C, a)
    ggamma, gbeta = xp.empty_like(gamma), xp.empty_like(gamma)
    _kernel('bn_backward_finalize', gamma.dtype, xp=xp)(
        (tiles,), (TILE_C, FINAL_ROWS),
        (partial, numpy.int32(grid[1]), numpy.int32(C), sums, ggamma, gbeta))
    return sums, ggamma, gbeta


def backward_apply(gy, y, x, gamma, mean, invstd, sums, count, relu, want_gz, xp):
    """(gx, gz): gx = gamma * invstd * (g - (xhat * sums[C:] + sums[:C]) / count), gz = g (None
    without ``want_gz``); ``count``: the rows the sums and statistics were taken over."""
    rows, C = x.shape
    gx = xp.empty_like(x)
    gz = xp.empty_like(x) if want_gz else None
    if rows == 0:
        return gx, gz
    width, grid, block = _elementwise('bn_backward_apply', rows, C,
                                      {'gy': gy, 'y': y, 'x': x, 'gx': gx, 'gz': gz})
    _kernel('bn_backward_apply', x.dtype, gamma.dtype, xp=xp, width=width)(
        grid, block, (gy, y, x, gamma, mean, invstd, sums, numpy.int64(rows),
                      numpy.int64(count), numpy.int32(C), numpy.int32(relu), gx, gz))
    return gx, gz


def backward(gy, y, x, gamma, mean, invstd, relu, fixed, want_gz, xp):
    rows, C = x.shape
    if rows == 0:           # an empty batch (inference): nothing to reduce, nothing to launch
        return (xp.empty_like(x), xp.zeros_like(gamma), xp.zeros_like(gamma),
                xp.empty_like(x) if want_gz else None)
    sums, ggamma, gbeta = backward_sums(gy, y, x, gamma, mean, invstd, relu, xp)
    if fixed:               # inference statistics are constants: gx = gamma * invstd * g
        sums = xp.zeros(2 * C, acc_dtype(x.dtype))
    gx, gz = backward_apply(gy, y, x, gamma, mean, invstd, sums, rows, relu, want_gz, xp)
    return gx, ggamma, gbeta, gz
