"""Launches of every kernel of ``kernels/``, with arguments built the same way on any backend.

A :class:`Case` is one family's launch sequence on one shape (the arguments a caller in
``chainer_tc`` would pass, built here from each file's header contract), runnable on the emulator
(NumPy arrays) and on a GPU (CuPy arrays) alike; :func:`cases` lists them on awkward shapes and on
ResNet-50-sized ones. The GPU parity kit (:mod:`chainer_tc.testing.gpu_parity`) compares the two
backends and times them; the emulator's own tests run the awkward ones under the race detector.

Only NumPy (and CuPy for a GPU) is needed: nothing here imports Chainer or a chainer_tc module that
does, so this runs where the project's full stack cannot be installed.
"""
import numpy

from chainer_tc import _tiles
from chainer_tc import kernels

# The launch constants the callers use (chainer_tc/layout.py, functions/_bn_kernels.py,
# functions/pooling.py, optimizers/momentum_sgd.py), restated: those modules import Chainer. The
# channels-last elementwise launches (bn_apply, bn_backward_apply, pooling) are shaped by
# chainer_tc._tiles, the callers' own functions.
LAYOUT = {'LAYOUT_TILE': 32, 'LAYOUT_BLOCK_ROWS': 8}
BN = {'BN_TILE_C': 32, 'BN_ROWS': 8, 'BN_THREADS': 256, 'BN_FINAL_ROWS': 16}
POOL = {'POOL_THREADS': 256, 'POOL_RUN': 16}
OPT = {'OPT_BLOCK': 256, 'OPT_GRAD_TABLE': 480}
OPT_CHUNK = 2048

_CTYPE = {numpy.dtype(numpy.float16): '__half', numpy.dtype(numpy.float32): 'float',
          numpy.dtype(numpy.float64): 'double'}
_SHORT = {numpy.dtype(numpy.float16): 'f16', numpy.dtype(numpy.float32): 'f32',
          numpy.dtype(numpy.float64): 'f64'}


class Struct:
    """A by-value struct argument whose fields may hold addresses of the case's arrays:
    ``build(address)`` returns the size-1 structured NumPy array, ``address(name)`` giving the
    device address of array ``name`` on the backend (CuPy and the emulator both take size-1
    NumPy arrays for structs); ``refs`` names the arrays it points to."""

    def __init__(self, build, refs=()):
        self.build, self.refs = build, tuple(refs)


class Launch:
    """One kernel launch: ``args`` holds array names (str), NumPy scalars and :class:`Struct`s."""

    def __init__(self, kernel, grid, block, args, shared_mem=0):
        self.kernel, self.grid, self.block = kernel, grid, block
        self.args, self.shared_mem = tuple(args), shared_mem


class Case:
    """A family's launches on one shape.

    ``arrays``: name -> initial NumPy array (every backend starts from a copy);
    ``outputs``: the names compared between backends; ``bytes``: bytes the launches must move
    (read plus written), for the bandwidth column; ``big``: a ResNet-50-sized case.
    """

    def __init__(self, family, name, defines, names, arrays, launches, outputs, big=False,
                 extra_bytes=0, reference=None, sums=None):
        self.family, self.name, self.defines = family, name, dict(defines)
        #: reference(arrays) -> {output: (expected, rtol, atol)}, the NumPy result of some outputs
        self.reference = reference
        #: sums(arrays) -> {output: (sum of |terms|, chain)} per element, for outputs that are
        #: sums: backends that round a term differently (NVRTC's fma contraction) differ by
        #: about (unit roundoff) * sqrt(chain) * sum|terms|, however small the sum, where chain
        #: is the longest sequence of additions any thread makes on the way to the element
        self.sums = sums
        self.name_expressions = tuple(names)
        self.arrays, self.launches, self.outputs = arrays, launches, list(outputs)
        self.big = big
        self.bytes = int(sum(arrays[k].nbytes for k in arrays)) + extra_bytes

    def options(self):
        return tuple('-D{}={}'.format(k, v) for k, v in sorted(self.defines.items()))

    def kernel_names(self):
        return sorted({launch.kernel for launch in self.launches})


def _rng(seed):
    return numpy.random.RandomState(seed)


# ---- layout ------------------------------------------------------------------------------------

def _layout(n, c, h, w, tin, tout, big=False, grid_cap=None, seed=0):
    src = _rng(seed).randn(n, c, h * w).astype(tin)
    dst = numpy.full((n, h * w, c), numpy.nan, tout)
    rows, cols, tile = c, h * w, LAYOUT['LAYOUT_TILE']
    grid = [-(-cols // tile), min(-(-rows // tile), 65535), min(n, 65535)]
    if grid_cap:                 # fewer blocks than tiles: the kernel's strided loops run
        grid = [grid[0], min(grid[1], grid_cap), min(grid[2], grid_cap)]
    name = 'batched_transpose_{}_{}'.format(_SHORT[numpy.dtype(tin)], _SHORT[numpy.dtype(tout)])
    launch = Launch(name, tuple(grid), (tile, LAYOUT['LAYOUT_BLOCK_ROWS']),
                    ('src', 'dst', numpy.int32(rows), numpy.int32(cols), numpy.int64(n)))
    label = '{} N{}C{}H{}W{}{}'.format(name, n, c, h, w, ' grid<=' + str(grid_cap) if grid_cap else '')

    def reference(arrays):
        return {'dst': (arrays['src'].transpose(0, 2, 1).astype(tout), 0, 0)}

    return Case('layout', label, LAYOUT, (), {'src': src, 'dst': dst}, [launch], ['dst'], big,
                reference=reference)


# ---- pooling -----------------------------------------------------------------------------------

POOL_SHAPE = numpy.dtype([(f, '<i4') for f in ('N', 'H', 'W', 'C', 'OH', 'OW', 'kh', 'kw', 'sy',
                                               'sx', 'ph', 'pw')])
_POOL_NAMES = (['{}<{}, {}, {}>'.format(k, t, i, v)
                for k in ('max_pool_forward', 'max_pool_backward')
                for t in ('__half', 'float', 'double') for i in ('unsigned char', 'int')
                for v in (1, 2)]
               + ['{}<{}, {}>'.format(k, t, v) for k in ('avg_pool_forward', 'avg_pool_backward')
                  for t in ('__half', 'float', 'double') for v in (1, 2)])


def _out(size, k, s, p):
    return (size + 2 * p - k) // s + 1


def _width(c, width):
    """The vector width of a case: as the callers choose it for fresh (aligned) arrays, or
    ``width`` (1: the one-channel path on an even C, as a misaligned array would make it)."""
    if width is None:
        return 2 if c % 2 == 0 else 1
    if width == 2 and c % 2:
        raise ValueError('two channels per thread need an even C; got C = {}'.format(c))
    return width


def _tile_launch(groups, positions, threads, grid_cap):
    """channel_tiles, with at most ``grid_cap`` row tiles (the kernels' strided loops run)."""
    grid, block = _tiles.channel_tiles(groups, positions, threads)
    return (grid[0], min(grid[1], grid_cap) if grid_cap else grid[1]), block


def _pooling(n, h, w, c, k, s, p, dtype, big=False, grid_cap=None, seed=0, width=None):
    oh, ow = _out(h, k, s, p), _out(w, k, s, p)
    v = _width(c, width)
    shape = numpy.zeros(1, POOL_SHAPE)
    for f, val in zip(POOL_SHAPE.names, (n, h, w, c, oh, ow, k, k, s, s, p, p)):
        shape[f] = val
    r = _rng(seed)
    x = r.randn(n, h, w, c).astype(dtype)
    gy = r.randn(n, oh, ow, c).astype(dtype)
    t = _CTYPE[numpy.dtype(dtype)]
    # window offsets in one byte where they fit, as functions/pooling.py keeps them; argmax
    # starts at a value no window offset of a case has (k * k < 256 or int32)
    index, it, unset = ((numpy.uint8, 'unsigned char', 255) if k * k <= 256 else
                        (numpy.int32, 'int', -1))
    fwd = _tile_launch(c // v, n * oh * ow, POOL['POOL_THREADS'], grid_cap)
    # backward: a row of threads per run of up to POOL_RUN input columns
    bwd = _tile_launch(c // v, n * h * -(-w // POOL['POOL_RUN']), POOL['POOL_THREADS'], grid_cap)
    arrays = {'x': x, 'gy': gy, 'y': numpy.full(gy.shape, numpy.nan, dtype),
              'argmax': numpy.full(gy.shape, unset, index),
              'gx': numpy.full(x.shape, numpy.nan, dtype),
              'ya': numpy.full(gy.shape, numpy.nan, dtype),
              'gxa': numpy.full(x.shape, numpy.nan, dtype)}
    launches = [
        Launch('max_pool_forward<{}, {}, {}>'.format(t, it, v), *fwd, (shape, 'x', 'y', 'argmax')),
        Launch('max_pool_backward<{}, {}, {}>'.format(t, it, v), *bwd,
               (shape, 'gy', 'argmax', 'gx')),
        Launch('avg_pool_forward<{}, {}>'.format(t, v), *fwd, (shape, 'x', 'ya')),
        Launch('avg_pool_backward<{}, {}>'.format(t, v), *bwd, (shape, 'gy', 'gxa')),
    ]
    label = 'pool {} N{}H{}W{}C{} k{}s{}p{} x{}{}'.format(
        _SHORT[numpy.dtype(dtype)], n, h, w, c, k, s, p, v,
        ' grid<=' + str(grid_cap) if grid_cap else '')

    def reference(arrays):
        xp = numpy.full((n, h + 2 * p + k, w + 2 * p + k, c), -numpy.inf)
        xp[:, p:p + h, p:p + w] = arrays['x']
        zp = numpy.zeros_like(xp)
        zp[:, p:p + h, p:p + w] = arrays['x']
        win = [(i, j) for i in range(k) for j in range(k)]
        views = numpy.stack([xp[:, i:i + s * (oh - 1) + 1:s, j:j + s * (ow - 1) + 1:s]
                             for i, j in win])
        sums = sum(zp[:, i:i + s * (oh - 1) + 1:s, j:j + s * (ow - 1) + 1:s] for i, j in win)
        tol = 1e-3 if dtype == numpy.float16 else 1e-6
        argmax = views.argmax(0)
        # gradients: every output's gy goes to its argmax (max) or to its whole window (average)
        gxp = numpy.zeros_like(xp)
        gxa = numpy.zeros_like(xp)
        g = arrays['gy'].astype(numpy.float64)
        for a, (i, j) in enumerate(win):
            sl = (slice(None), slice(i, i + s * (oh - 1) + 1, s), slice(j, j + s * (ow - 1) + 1, s))
            gxp[sl] += numpy.where(argmax == a, g, 0)
            gxa[sl] += g / (k * k)
        crop = (slice(None), slice(p, p + h), slice(p, p + w))
        return {'y': (views.max(0).astype(dtype), 0, 0), 'argmax': (argmax, 0, 0),
                'ya': ((sums / (k * k)).astype(dtype), tol, tol),
                'gx': (gxp[crop], tol, tol), 'gxa': (gxa[crop], tol, tol)}

    return Case('pooling', label, POOL, _POOL_NAMES, arrays, launches,
                ['y', 'argmax', 'gx', 'ya', 'gxa'], big, reference=reference)


# ---- batchnorm ---------------------------------------------------------------------------------

_BN_PAIRS = [(numpy.float16, numpy.float16), (numpy.float16, numpy.float32),
             (numpy.float32, numpy.float32), (numpy.float64, numpy.float64)]
_BN_NAMES = (['{}<{}, {}>'.format(k, t, v) for k in ('bn_stats_partial', 'bn_backward_partial')
              for t in ('__half', 'float', 'double') for v in (1, 2)]
             + ['bn_stats_finalize<{}>'.format(t) for t in ('__half', 'float', 'double')]
             + ['bn_backward_finalize<{}>'.format(t) for t in ('__half', 'float', 'double')]
             + ['{}<{}, {}, {}>'.format(k, _CTYPE[numpy.dtype(t)], _CTYPE[numpy.dtype(p)], v)
                for k in ('bn_apply', 'bn_backward_apply') for t, p in _BN_PAIRS for v in (1, 2)])


def _batchnorm(rows, c, dtype, pdtype, relu=1, with_z=True, big=False, grid_cap=None, seed=0,
               width=None, row_blocks=None):
    """``row_blocks``: reduce the rows in this many blocks instead of the callers' (about 1024
    in all, at least 4 rows per thread): fewer blocks give each thread of the partial kernels
    more rows, so that their loops of several rows at a time run (the contract allows any)."""
    tile, nrows, threads = BN['BN_TILE_C'], BN['BN_ROWS'], BN['BN_THREADS']
    v = _width(c, width)
    a = numpy.float64 if dtype == numpy.float64 else numpy.float32
    tiles = -(-c // tile)
    # the row blocks of functions/_bn_kernels._row_blocks: about 1024 blocks of the two-channel
    # launch, the same for both widths (both give the same partial sums)
    blocks = max(1, min(-(-rows // (4 * nrows)), max(1, 1024 // -(-c // (2 * tile)))))
    if row_blocks:
        blocks = row_blocks
    per = -(-rows // blocks)
    blocks = -(-rows // per)
    r = _rng(seed)
    t, p = _CTYPE[numpy.dtype(dtype)], _CTYPE[numpy.dtype(pdtype)]
    arrays = {
        'x': (r.randn(rows, c) * 2 + 0.5).astype(dtype),
        'z': r.randn(rows, c).astype(dtype),
        'gy': r.randn(rows, c).astype(dtype),
        'gamma': (r.rand(c) + 0.5).astype(pdtype), 'beta': r.randn(c).astype(pdtype),
        'running_mean': r.randn(c).astype(pdtype), 'running_var': (r.rand(c) + 1).astype(pdtype),
        'partial': numpy.full((blocks, c, 3), numpy.nan, a),
        'mean': numpy.full(c, numpy.nan, a), 'invstd': numpy.full(c, numpy.nan, a),
        'y': numpy.full((rows, c), numpy.nan, dtype),
        'bpartial': numpy.full((blocks, c, 2), numpy.nan, a),
        'sums': numpy.full(2 * c, numpy.nan, a),
        'ggamma': numpy.full(c, numpy.nan, pdtype), 'gbeta': numpy.full(c, numpy.nan, pdtype),
        'gx': numpy.full((rows, c), numpy.nan, dtype), 'gz': numpy.full((rows, c), numpy.nan, dtype),
    }
    # the backward launches read a forward computed here in float64 (y_fwd, mean_fwd,
    # invstd_fwd), not the backend's own: where a pre-activation sits within rounding of 0, two
    # backends' ReLU masks may differ, and one flipped element would carry into every sum
    fwd = _bn_forward64(arrays, relu, with_z)
    arrays['y_fwd'] = fwd['y'].astype(dtype)
    arrays['mean_fwd'], arrays['invstd_fwd'] = fwd['mean'].astype(a), fwd['invstd'].astype(a)
    elementwise = _tile_launch(c // v, rows, threads, grid_cap)
    final = ((tiles,), (tile, BN['BN_FINAL_ROWS']))
    reduction = ((-(-c // (v * tile)), blocks), (tile, nrows))   # the partial kernels' tiles
    z = 'z' if with_z else None
    gz = 'gz' if with_z else None
    launches = [
        Launch('bn_stats_partial<{}, {}>'.format(t, v), *reduction,
               ('x', numpy.int64(rows), numpy.int32(c), numpy.int64(per), 'partial')),
        Launch('bn_stats_finalize<{}>'.format(p), *final,
               ('partial', numpy.int32(blocks), numpy.int32(c), numpy.int64(rows),
                numpy.float64(2e-5), numpy.float64(0.9), numpy.int32(1), 'running_mean',
                'running_var', 'mean', 'invstd', None)),
        Launch('bn_apply<{}, {}, {}>'.format(t, p, v), *elementwise,
               ('x', z, 'gamma', 'beta', 'mean', 'invstd', 'y', numpy.int64(rows), numpy.int32(c),
                numpy.int32(relu))),
        Launch('bn_backward_partial<{}, {}>'.format(t, v), *reduction,
               ('gy', 'y_fwd', 'x', 'mean_fwd', 'invstd_fwd', numpy.int64(rows), numpy.int32(c),
                numpy.int64(per), numpy.int32(relu), 'bpartial')),
        Launch('bn_backward_finalize<{}>'.format(p), *final,
               ('bpartial', numpy.int32(blocks), numpy.int32(c), 'sums', 'ggamma', 'gbeta')),
        Launch('bn_backward_apply<{}, {}, {}>'.format(t, p, v), *elementwise,
               ('gy', 'y_fwd', 'x', 'gamma', 'mean_fwd', 'invstd_fwd', 'sums', numpy.int64(rows),
                numpy.int64(rows), numpy.int32(c), numpy.int32(relu), 'gx', gz)),
    ]
    if not with_z:
        del arrays['z'], arrays['gz']
    label = 'bn {}/{} rows{} C{} x{}{}{}{}{}'.format(
        _SHORT[numpy.dtype(dtype)], _SHORT[numpy.dtype(pdtype)], rows, c, v,
        '' if relu else ' no-relu', '' if with_z else ' no-z',
        ' grid<=' + str(grid_cap) if grid_cap else '',
        ' row blocks ' + str(blocks) if row_blocks else '')
    outputs = ['partial', 'mean', 'invstd', 'running_mean', 'running_var', 'y', 'bpartial', 'sums',
               'ggamma', 'gbeta', 'gx'] + (['gz'] if with_z else [])

    def backward_terms(arrays):
        """g (gy masked as the kernels mask it, by y_fwd) and xhat from the forward given."""
        g = arrays['gy'].astype(numpy.float64)
        if relu:
            g = numpy.where(arrays['y_fwd'] > 0, g, 0)
        xhat = (arrays['x'].astype(numpy.float64) - arrays['mean_fwd']) * arrays['invstd_fwd']
        return g, xhat

    def sums(arrays):
        g, xhat = backward_terms(arrays)
        ag, agx = numpy.abs(g), numpy.abs(g * xhat)
        pad = blocks * per - rows
        blockwise = numpy.stack([numpy.pad(t, ((0, pad), (0, 0))).reshape(blocks, per, c).sum(1)
                                 for t in (ag, agx)], axis=2)
        total_g, total_gx = ag.sum(0), agx.sum(0)
        # a thread adds every nrows-th row of its block, then one thread per channel merges
        # nrows of them; the finalize does the same over the blocks with BN_FINAL_ROWS threads
        final = BN['BN_FINAL_ROWS']
        partial_chain = -(-per // nrows) + nrows
        total_chain = partial_chain + -(-blocks // final) + final
        both = numpy.concatenate([total_g, total_gx])
        return {'bpartial': (blockwise, partial_chain), 'sums': (both, total_chain),
                'ggamma': (total_gx, total_chain), 'gbeta': (total_g, total_chain)}

    def reference(arrays):
        f = _bn_forward64(arrays, relu, with_z)
        mean, invstd, v = f['mean'], f['invstd'], f['y']
        tol = {numpy.dtype(numpy.float16): 2e-3, numpy.dtype(numpy.float32): 2e-5}.get(
            numpy.dtype(dtype), 1e-10)
        # backward: g = gy where y > 0 (relu), gx = gamma * invstd * (g - mean(g) - xhat *
        # mean(g * xhat)); the sums over rows carry rounding ~ sqrt(rows) times a term's
        g, xhat = backward_terms(arrays)
        sum_g, sum_gx = g.sum(0), (g * xhat).sum(0)
        gx = (arrays['gamma'].astype(numpy.float64) * arrays['invstd_fwd'] *
              (g - (xhat * sum_gx + sum_g) / rows))
        out = {'mean': (mean, tol, tol), 'invstd': (invstd, tol, tol),
               'y': (v.astype(dtype), tol, 2 * tol), 'gx': (gx, tol, 2 * tol),
               'ggamma': (sum_gx, tol, tol * numpy.sqrt(rows)),
               'gbeta': (sum_g, tol, tol * numpy.sqrt(rows))}
        if with_z:
            out['gz'] = (g.astype(dtype), 0, 0)
        return out

    return Case('batchnorm', label, BN, _BN_NAMES, arrays, launches, outputs, big,
                reference=reference, sums=sums)


def _bn_merge(shards, c, dtype, pdtype, seed=0):
    """The multi-node statistics (chainer_tc.multinode): one rank's (count, mean, M2) summary
    per channel (bn_stats_partial, then bn_stats_finalize's ``summary`` output), and the
    finalize over every rank's summaries (given: ``shards`` rows per rank, the last this
    rank's, an empty one included) with rows = their total, which also updates the running
    statistics."""
    tile, nrows = BN['BN_TILE_C'], BN['BN_ROWS']
    a = numpy.float64 if dtype == numpy.float64 else numpy.float32
    r = _rng(seed)
    offset = r.randn(c) * 3
    xs = [(r.randn(n, c) * 2 + offset).astype(dtype) for n in shards]
    rows, total = shards[-1], sum(shards)
    blocks = max(1, min(-(-rows // (4 * nrows)), max(1, 1024 // -(-c // (2 * tile)))))
    per = -(-rows // blocks)
    blocks = -(-rows // per)

    def summary64(x):
        x = x.astype(numpy.float64)
        if not len(x):
            return numpy.zeros((c, 3))
        m = x.mean(0)
        return numpy.stack([numpy.full(c, float(len(x))), m, ((x - m) ** 2).sum(0)], axis=1)

    t, p = _CTYPE[numpy.dtype(dtype)], _CTYPE[numpy.dtype(pdtype)]
    arrays = {
        'x': xs[-1],
        'partial': numpy.full((blocks, c, 3), numpy.nan, a),
        'summary': numpy.full((c, 3), numpy.nan, a),
        'summaries': numpy.stack([summary64(x) for x in xs]).astype(a),
        'running_mean': r.randn(c).astype(pdtype), 'running_var': (r.rand(c) + 1).astype(pdtype),
        'mean': numpy.full(c, numpy.nan, a), 'invstd': numpy.full(c, numpy.nan, a),
    }
    final = ((-(-c // tile),), (tile, BN['BN_FINAL_ROWS']))
    eps, decay = 2e-5, 0.9
    launches = [
        Launch('bn_stats_partial<{}, 1>'.format(t), (-(-c // tile), blocks), (tile, nrows),
               ('x', numpy.int64(rows), numpy.int32(c), numpy.int64(per), 'partial')),
        Launch('bn_stats_finalize<{}>'.format(t), *final,
               ('partial', numpy.int32(blocks), numpy.int32(c), numpy.int64(rows),
                numpy.float64(1), numpy.float64(0), numpy.int32(0), None, None, None, None,
                'summary')),
        Launch('bn_stats_finalize<{}>'.format(p), *final,
               ('summaries', numpy.int32(len(shards)), numpy.int32(c), numpy.int64(total),
                numpy.float64(eps), numpy.float64(decay), numpy.int32(1), 'running_mean',
                'running_var', 'mean', 'invstd', None)),
    ]
    label = 'bn merge {}/{} ranks {} C{}'.format(
        _SHORT[numpy.dtype(dtype)], _SHORT[numpy.dtype(pdtype)],
        '+'.join(str(n) for n in shards), c)

    def reference(arrays):
        # float32 accumulation: the mean of up to 700 rows carries a few float32 roundings of
        # the data's magnitude (|x| up to ~10: 2e-5 absolute; seen 4e-7), M2 (a sum of squares,
        # positive) a few relative to its size (2e-5 relative; seen 1e-7), the count is exact;
        # the running statistics add the parameters' rounding (float16: 2^-10 relative)
        tol = 1e-10 if dtype == numpy.float64 else 2e-5
        ptol = 2e-3 if pdtype == numpy.float16 else tol
        mine = summary64(arrays['x'])
        everything = numpy.concatenate([x.astype(numpy.float64) for x in xs])
        mean, var = everything.mean(0), everything.var(0)
        rm0, rv0 = (arrays[k].astype(numpy.float64) for k in ('running_mean', 'running_var'))
        return {
            'summary': (mine, tol, tol),
            'mean': (mean, tol, tol), 'invstd': (1 / numpy.sqrt(var + eps), tol, tol),
            'running_mean': (decay * rm0 + (1 - decay) * mean, ptol, ptol),
            'running_var': (decay * rv0 + (1 - decay) * var * total / (total - 1), ptol, ptol),
        }

    return Case('batchnorm', label, BN, _BN_NAMES, arrays, launches,
                ['partial', 'summary', 'mean', 'invstd', 'running_mean', 'running_var'],
                reference=reference)


def _bn_forward64(arrays, relu, with_z):
    """Training-mode BN(+z)(+ReLU) of ``arrays['x']`` in float64: {'mean', 'invstd', 'y'}."""
    x = arrays['x'].astype(numpy.float64)
    mean, var = x.mean(0), x.var(0)
    invstd = 1 / numpy.sqrt(var + 2e-5)
    y = arrays['gamma'] * (x - mean) * invstd + arrays['beta']
    if with_z:
        y = y + arrays['z']
    if relu:
        y = numpy.maximum(y, 0)
    return {'mean': mean, 'invstd': invstd, 'y': y}


# ---- optimizer ---------------------------------------------------------------------------------

STEP_PARAMS = numpy.dtype([
    ('nesterov', '<i4'), ('scaling', '<i4'), ('interval', '<u4'), ('min_scale', '<f4'),
    ('max_scale', '<f4'), ('total_blocks', '<u4'), ('grad_divisor', '<f8'),
    ('grad', '<u8', (OPT['OPT_GRAD_TABLE'],)),
])
GLOBALS = numpy.dtype([('lr', '<f8'), ('momentum', '<f8'), ('weight_decay', '<f8')])
_GROUP = {numpy.dtype(numpy.float32): 0, numpy.dtype(numpy.float16): 1,
          numpy.dtype(numpy.float64): 2}
RESNET50_SHAPES = (
    [(64, 3, 7, 7)] + [(64,)] * 2 +
    sum([[(w, cin, 1, 1), (w,), (w,), (w, w, 3, 3), (w,), (w,), (4 * w, w, 1, 1), (4 * w,), (4 * w,)]
         + ([(4 * w, cin, 1, 1), (4 * w,), (4 * w,)] if b == 0 else [])
         for w, n in ((64, 3), (128, 4), (256, 6), (512, 3))
         for b, cin in enumerate([64 if w == 64 else 2 * w] + [4 * w] * (n - 1))], [])
    + [(1000, 2048), (1000,)])


def _optimizer(sizes, dtypes, inject_inf=False, big=False, seed=0, scale=1024.0):
    """Dynamic loss scaling over parameters of ``sizes`` (elements) and ``dtypes``: the finite
    check, the update, and the hyperparameter write, as optimizers/momentum_sgd.py launches them."""
    r = _rng(seed)
    flat = {numpy.dtype(d): 0 for d in (numpy.float32, numpy.float16, numpy.float64)}
    entries = []
    for i, (n, d) in enumerate(zip(sizes, dtypes)):
        d = numpy.dtype(d)
        entries.append((i, n, d, flat[d]))
        flat[d] += n
    arrays = {}
    f32, f16, f64 = (numpy.dtype(numpy.float32), numpy.dtype(numpy.float16),
                     numpy.dtype(numpy.float64))
    arrays['p32'] = r.randn(max(flat[f32], 1)).astype(numpy.float32)
    arrays['p16'] = r.randn(max(flat[f16], 1)).astype(numpy.float16)
    arrays['master'] = arrays['p16'].astype(numpy.float32)
    arrays['mom32'] = (r.randn(max(flat[f32], 1)) * 0.1).astype(numpy.float32)
    arrays['mom16'] = (r.randn(max(flat[f16], 1)) * 0.1).astype(numpy.float32)
    arrays['p64'] = r.randn(max(flat[f64], 1))
    arrays['mom64'] = r.randn(max(flat[f64], 1)) * 0.1
    grads = []
    for i, n, d, off in entries:
        g = (r.randn(n) * scale * 0.01).astype(d)
        if inject_inf and i == len(entries) // 2:
            g[(n // 2 + 1) % n] = numpy.inf        # not thread 0's element
        arrays['grad{}'.format(i)] = g
        grads.append('grad{}'.format(i))
    hyper = numpy.zeros((1 + len(entries), 4))
    hyper[0, :3] = (0.1, 0.9, 1e-4)
    for i, n, d, off in entries:
        flags = 1 | (2 if i % 3 == 1 else 0)        # enabled; every third its own lr
        hyper[1 + i] = (0.05, 0.8, 5e-4, flags)
    arrays['hyper'] = hyper.reshape(-1)
    arrays['divisors'] = numpy.zeros(len(entries))      # read only in a step mixing scales
    scaler = numpy.zeros(8, numpy.uint32)
    scaler[0] = numpy.float32(scale).view(numpy.uint32)
    scaler[1] = 3
    scaler[5] = numpy.float16(scale).view(numpy.uint16)
    arrays['scaler'] = scaler
    table = OPT['OPT_GRAD_TABLE']
    launches, chunk_rows, sets = [], [], []
    for first in range(0, len(entries), table):
        batch = entries[first:first + table]
        start = len(chunk_rows)
        for k, (i, n, d, off) in enumerate(batch):
            bits = k | (_GROUP[d] << 16) | (i << 32)
            for inner in range(0, n, OPT_CHUNK):
                chunk_rows.append((off + inner, inner, min(OPT_CHUNK, n - inner), bits))
        sets.append((first, batch, start, len(chunk_rows) - start))
    chunks = numpy.array(chunk_rows, numpy.int64).reshape(-1, 4)
    total = chunks.shape[0]
    for first, batch, start, count in sets:
        name = 'chunks{}'.format(first)
        arrays[name] = chunks[start:start + count].copy()

        def build(address, batch=batch):
            sp = numpy.zeros(1, STEP_PARAMS)
            sp['scaling'], sp['interval'] = 2, 5
            sp['min_scale'], sp['max_scale'] = 1.0, 2.0 ** 24
            sp['total_blocks'] = total
            for k, (i, n, d, off) in enumerate(batch):
                # bit 0: divide it; bit 1 (float32 and float64): write the quotient back
                sp['grad'][0, k] = address('grad{}'.format(i)) | (1 if d == f16 else 3)
            return sp

        sp = Struct(build, ['grad{}'.format(i) for i, n, d, off in batch])
        launches.append((Launch('momentum_sgd_check', (count,), (OPT['OPT_BLOCK'],),
                                (sp, name, 'divisors', 'scaler')),
                         Launch('momentum_sgd_update', (count,), (OPT['OPT_BLOCK'],),
                                (sp, name, 'divisors', 'p32', 'p16', 'master', 'mom32', 'mom16',
                                 'p64', 'mom64', 'hyper', 'scaler'))))
    glob = numpy.zeros(1, GLOBALS)
    glob['lr'], glob['momentum'], glob['weight_decay'] = 0.1, 0.9, 1e-4
    ordered = [c for c, u in launches] + [u for c, u in launches]
    ordered.append(Launch('momentum_sgd_set_globals', (1,), (1,), (Struct(lambda _: glob), 'hyper')))
    label = 'optimizer {} params, {} elements{}'.format(len(sizes), sum(sizes),
                                                        ' with an inf' if inject_inf else '')
    outputs = ['p32', 'p16', 'master', 'mom32', 'mom16', 'p64', 'mom64', 'hyper', 'scaler'] + [
        g for g, (i, n, d, off) in zip(grads, entries) if d != f16]     # quotients written back
    # the update reads every gradient, parameter and momentum and writes parameters, momenta
    # and the float32 and float64 gradients' quotients
    moved = sum(arrays[k].nbytes for k in ('p32', 'p16', 'master', 'mom32', 'mom16', 'p64', 'mom64'))
    moved += sum(arrays[g].nbytes for g, (i, n, d, off) in zip(grads, entries) if d != f16)
    return Case('optimizer', label, OPT, (), arrays, ordered, outputs, big, extra_bytes=moved)


# ---- the list ------------------------------------------------------------------------------------

def cases(big=True, awkward=True):
    """Every family on awkward shapes (``awkward``) and on ResNet-50-sized ones (``big``)."""
    out = []
    if awkward:
        for tin in (numpy.float32, numpy.float16):
            for tout in (numpy.float32, numpy.float16):
                out.append(_layout(2, 3, 5, 7, tin, tout))
        out.append(_layout(3, 33, 17, 9, numpy.float32, numpy.float16))
        out.append(_layout(3, 70, 5, 13, numpy.float16, numpy.float32, grid_cap=1))
        out.append(_layout(1, 1, 1, 1, numpy.float16, numpy.float16))
        for d in (numpy.float16, numpy.float32, numpy.float64):
            out.append(_pooling(2, 7, 9, 3, 3, 2, 1, d))            # odd C: one channel
            out.append(_pooling(2, 7, 9, 6, 3, 2, 1, d))            # even C: two channels
        out.append(_pooling(3, 5, 6, 33, 2, 2, 0, numpy.float32, grid_cap=2))
        # fewer row tiles than positions: each thread walks many positions, its steps carrying
        # across columns, rows and images (85 positions a step over planes of 63)
        out.append(_pooling(3, 7, 9, 6, 3, 1, 1, numpy.float16, grid_cap=1))
        for w in (2, 1):          # the same shape on both paths: 8 positions a step
            out.append(_pooling(3, 6, 6, 64, 2, 1, 0, numpy.float16, grid_cap=1, width=w))
        out.append(_pooling(2, 4, 5, 70, 2, 2, 1, numpy.float64))  # 35 pairs: tiles of 18
        out.append(_pooling(2, 4, 4, 2, 2, 2, 0, numpy.float32))   # one pair per position
        # backward runs: 37 columns make runs of 13, 13 and 11; 8 runs a step over 45 of them
        for w in (2, 1):
            out.append(_pooling(3, 5, 37, 64, 3, 2, 1, numpy.float16, grid_cap=1, width=w))
        out.append(_pooling(2, 6, 8, 3, 2, 3, 0, numpy.float32))   # stride > window: gaps
        # 17x17 windows (289 elements): int32 window offsets; up to 25 outputs per input
        out.append(_pooling(2, 19, 21, 6, 17, 1, 1, numpy.float32, grid_cap=2))
        for t, p in _BN_PAIRS:
            out.append(_batchnorm(37, 33, t, p))                    # odd C: one channel
            out.append(_batchnorm(37, 34, t, p))                    # even C: two channels
        out.append(_batchnorm(1, 3, numpy.float32, numpy.float32, relu=0, with_z=False))
        for w in (2, 1):          # the same shape on both paths, rows strided (36 a step)
            out.append(_batchnorm(300, 40, numpy.float16, numpy.float32, grid_cap=3, width=w))
        out.append(_batchnorm(29, 70, numpy.float16, numpy.float16, relu=1, with_z=False))
        out.append(_batchnorm(50, 2, numpy.float64, numpy.float64, relu=0, with_z=True))
        out.append(_batchnorm(9, 2048, numpy.float16, numpy.float32))   # rows 9, tiles of 8
        # two row blocks of 151 and 150 rows: 18 or 19 rows per thread, so the partial kernels'
        # loops of four rows at a time run, with their remainders
        for t, p in ((numpy.float16, numpy.float32), (numpy.float64, numpy.float64)):
            for w in (2, 1):
                out.append(_batchnorm(301, 6, t, p, width=w, row_blocks=2))
        out.append(_batchnorm(301, 5, numpy.float32, numpy.float32, relu=0, row_blocks=2))
        # 22 row blocks: the finalize's 16 threads per channel merge two summaries (threads
        # 0-5) or one, and a second tile of channels is partly empty (C 33)
        for t, p in ((numpy.float32, numpy.float32), (numpy.float64, numpy.float64)):
            out.append(_batchnorm(700, 33, t, p))
        # the multi-node statistics: a rank's summary, and the merge of 3 ranks' (one empty,
        # unequal counts); two tiles of channels, 16 or 2 summaries per finalize thread
        out.append(_bn_merge((0, 13, 70), 33, numpy.float16, numpy.float32))
        out.append(_bn_merge((5, 0, 40), 34, numpy.float64, numpy.float64, seed=1))
        out.append(_bn_merge((20, 31), 3, numpy.float32, numpy.float32, seed=2))
        out.append(_bn_merge((9, 700), 5, numpy.float16, numpy.float16, seed=3))
        sizes = [1, 31, 2049, 5000, 7, 300]
        dtypes = [numpy.float32, numpy.float16, numpy.float32, numpy.float16, numpy.float64,
                  numpy.float32]
        out.append(_optimizer(sizes, dtypes))
        out.append(_optimizer(sizes, dtypes, inject_inf=True))
        out.append(_optimizer([3] * 500, [numpy.float16, numpy.float32] * 250))
    if big:              # gigabytes in all: each is built when first used (LazyCase)
        sizes = [int(numpy.prod(s)) for s in RESNET50_SHAPES]
        out += [
            LazyCase('layout', 'batched_transpose_f32_f16 N256C64H56W56',
                     lambda: _layout(256, 64, 56, 56, numpy.float32, numpy.float16, big=True)),
            LazyCase('layout', 'batched_transpose_f16_f32 N256C64H56W56',
                     lambda: _layout(256, 64, 56, 56, numpy.float16, numpy.float32, big=True)),
        ]
        # each ResNet-50 shape on both paths: two channels per thread (x2, the path fresh arrays
        # take) and one (x1, the path of an odd C or a misaligned array), for the timing columns
        for w in (2, 1):
            out += [
                LazyCase('pooling', 'pool f16 N256H112W112C64 k3s2p1 x{}'.format(w),
                         lambda w=w: _pooling(256, 112, 112, 64, 3, 2, 1, numpy.float16, big=True,
                                              width=w)),
                LazyCase('pooling', 'pool f16 N256H7W7C2048 k7s1p0 x{}'.format(w),
                         lambda w=w: _pooling(256, 7, 7, 2048, 7, 1, 0, numpy.float16, big=True,
                                              width=w)),
                LazyCase('batchnorm', 'bn f16/f32 rows802816 C64 x{}'.format(w),
                         lambda w=w: _batchnorm(256 * 56 * 56, 64, numpy.float16, numpy.float32,
                                                big=True, width=w)),
                LazyCase('batchnorm', 'bn f16/f32 rows12544 C2048 x{}'.format(w),
                         lambda w=w: _batchnorm(256 * 7 * 7, 2048, numpy.float16, numpy.float32,
                                                big=True, width=w)),
            ]
        out += [
            LazyCase('optimizer', 'optimizer ResNet-50: 161 float16 params, 25557032 elements',
                     lambda: _optimizer(sizes, [numpy.float16] * len(sizes), big=True)),
        ]
    return out


class LazyCase:
    """A case whose arrays are built when first needed, and dropped by :meth:`release`."""

    big = True

    def __init__(self, family, name, build):
        self.family, self.name, self._build, self._case = family, name, build, None

    def __getattr__(self, attr):
        if self._case is None:
            self._case = self._build()
        return getattr(self._case, attr)

    def release(self):
        self._case = None


# ---- running a case ----------------------------------------------------------------------------

class EmulatorBackend:
    """Runs cases in the CPU emulator."""

    name = 'emulator'
    xp = numpy

    def __init__(self, sources=None):
        """``sources``: family -> source text to use instead of ``kernels/<family>.cu``."""
        from chainer_tc.testing import emulator
        self._emulator = emulator
        self._sources = dict(sources or {})
        self._modules = {}

    def module(self, case):
        key = (case.family, case.options(), case.name_expressions)
        if key not in self._modules:
            code, options = kernels.source(case.family), case.options()
            if case.family in self._sources:     # the text of a .cu file: its includes are beside it
                code = self._sources[case.family]
                options += ('-I' + kernels.kernel_dir(),)
            self._modules[key] = self._emulator.RawModule(
                code=code, options=options, name_expressions=list(case.name_expressions))
        return self._modules[key]

    def to_device(self, a):
        return a.copy()

    def address(self, a):
        return a.ctypes.data

    def to_host(self, a):
        return numpy.array(a)          # a copy: later launches (timing) must not change it

    def synchronize(self):
        pass


def launch_bytes(case, launch):
    """Bytes of the arrays one launch touches (each once: a lower bound on its memory traffic)."""
    names = set()
    for a in launch.args:
        if isinstance(a, str):
            names.add(a)
        elif isinstance(a, Struct):
            names.update(a.refs)
    return int(sum(case.arrays[k].nbytes for k in names))


def run(case, backend, repeats=0, timer=None):
    """Run ``case`` on ``backend``: ({output name: NumPy array}, timings). With ``repeats`` and a
    ``timer`` (``timer(run, repeats) -> seconds``), timings lists every launch as
    ``{'kernel', 'seconds', 'bytes'}``, each timed on its own after the checked run."""
    mod = backend.module(case)
    fns = {name: mod.get_function(name) for name in case.kernel_names()}
    dev = {k: backend.to_device(v) for k, v in case.arrays.items()}

    def address(name):
        return backend.address(dev[name])

    structs = {}

    def arg(a):
        if isinstance(a, str):
            return dev[a]
        if isinstance(a, Struct):
            if id(a) not in structs:
                structs[id(a)] = a.build(address)
            return structs[id(a)]
        return a

    launches = [(fns[launch.kernel], launch, tuple(arg(a) for a in launch.args))
                for launch in case.launches]
    for f, launch, args in launches:
        f(launch.grid, launch.block, args, shared_mem=launch.shared_mem)
    backend.synchronize()
    out = {k: backend.to_host(dev[k]) for k in case.outputs}
    timings = []
    if repeats and timer is not None:
        for f, launch, args in launches:
            def once(f=f, launch=launch, args=args):
                f(launch.grid, launch.block, args, shared_mem=launch.shared_mem)
            timings.append({'kernel': launch.kernel, 'seconds': timer(once, repeats),
                            'bytes': launch_bytes(case, launch)})
    return out, timings
