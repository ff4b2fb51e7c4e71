"""Launch shapes of the channels-last elementwise kernels (``bn_apply``, ``bn_backward_apply`` and
the pooling kernels): threads over channel groups, rows of threads over positions, and the vector
width (1 or 2 channels per thread) the arrays allow.

Only NumPy is imported here, so :mod:`chainer_tc.testing.kernel_cases` builds its launches with
the very functions the callers (``functions/_bn_kernels.py``, ``functions/pooling.py``) use.
"""
import warnings

import numpy

WARP = 32
MAX_GRID_Y = 65535


def channel_tiles(groups, positions, threads, max_blocks=8192):
    """``(grid, block)`` for ``groups`` channel groups (``C // V``) over ``positions`` rows.

    ``block = (tx, ty)``: ``tx`` threads side by side over channel groups (at most a warp, and
    the tiles balanced: 33 groups make two tiles of 17, not 32 + 1), ``ty = threads // tx`` rows
    of them over positions. ``grid = (tiles, gy)``: enough tiles to cover every group, and enough
    row tiles to cover every position, but at most about ``max_blocks`` blocks in all (and
    65535): the kernels stride over the positions beyond the grid.
    """
    tiles = max(1, -(-groups // WARP))
    tx = max(1, -(-groups // tiles))
    ty = threads // tx
    gy = max(1, min(-(-positions // ty), max(1, max_blocks // tiles), MAX_GRID_Y))
    return (tiles, gy), (tx, ty)


def address(a):
    """The data address of a NumPy or CuPy array (what a kernel receives as its pointer)."""
    if isinstance(a, numpy.ndarray):
        return a.__array_interface__['data'][0]
    return a.data.ptr


def vector_width(channels, arrays):
    """``(2, None)`` when two channels per thread can use one vector access: ``channels`` even
    and every array of ``arrays`` (``{name: array or None}``) at an address aligned to two of its
    elements; else ``(1, why)``, with ``why`` None for an odd channel count (the one-channel path
    is the only one there) and naming the misaligned array otherwise."""
    if channels % 2:
        return 1, None
    for name, a in arrays.items():
        if a is not None and address(a) % (2 * a.dtype.itemsize):
            return 1, ('{} starts at an address that is not a multiple of {} bytes (two {} '
                       'elements; an offset view?)'.format(name, 2 * a.dtype.itemsize, a.dtype))
    return 2, None


_WARNED = set()


def width(kernel, channels, arrays, category, stacklevel=3):
    """The vector width :func:`vector_width` allows a launch of ``kernel`` over ``arrays``. An
    even channel count held back to one channel per thread by a misaligned array says so once
    per kernel and reason (a warning of ``category``): nothing falls back silently."""
    w, why = vector_width(channels, arrays)
    if why is not None and (kernel, why) not in _WARNED:
        _WARNED.add((kernel, why))
        warnings.warn('chainer_tc: {} takes one channel per thread instead of two: {}'.format(
            kernel, why), category, stacklevel=stacklevel)
    return w


def plan(kernel, channels, positions, threads, arrays, category):
    """``(width, grid, block)`` of a launch of ``kernel`` over ``positions`` with ``arrays``: the
    :func:`width` it may take (warned of once when held back) and :func:`channel_tiles` for it."""
    w = width(kernel, channels, arrays, category, stacklevel=4)
    grid, block = channel_tiles(channels // w, positions, threads)
    return w, grid, block
