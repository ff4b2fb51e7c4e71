"""Every kernel of kernels/, emulated on awkward shapes with the race detector on and under three
schedules (forward, reverse, random): the project's own kernels must not be reported, must agree
between schedules, must write every output, and match NumPy where a reference is given.

Some cases launch fewer blocks than the work needs, as the kernels' contracts allow, so that their
grid-stride and tile loops run more than once (the mutation tool relies on them:
python -m chainer_tc.testing.mutate).
"""
import os

import numpy
import pytest

from chainer_tc.testing import emulator
from chainer_tc.testing import kernel_cases

CASES = kernel_cases.cases(big=False)


@pytest.fixture(scope='module')
def backend():
    return kernel_cases.EmulatorBackend()


def checks():
    """Race detector and three schedules, unless the environment says otherwise (the mutation
    tool's --memcheck-only sets CHAINER_TC_EMULATOR_RACECHECK=0)."""
    if 'CHAINER_TC_EMULATOR_RACECHECK' in os.environ:
        return emulator.checking()
    return emulator.checking(race=True, schedules=['forward', 'reverse', 'random:3'])


@pytest.mark.parametrize('case', CASES, ids=['{}-{}'.format(c.family, c.name) for c in CASES])
def test_kernel_case(case, backend):
    with checks():
        out, _ = kernel_cases.run(case, backend)
    for name, value in out.items():
        if value.dtype.kind == 'f':
            assert not numpy.isnan(value).any(), '{}: elements left unwritten (NaN)'.format(name)
        else:       # integer outputs start as -1 (unsigned: their maximum, 255 for uint8)
            unset = numpy.iinfo(value.dtype).max if value.dtype.kind == 'u' else -1
            assert not (value == unset).all() or value.size == 0, '{}: not written'.format(name)
    if case.reference is not None:
        for name, (expected, rtol, atol) in case.reference(case.arrays).items():
            numpy.testing.assert_allclose(out[name].astype(numpy.float64),
                                          numpy.asarray(expected, numpy.float64),
                                          rtol=rtol, atol=atol, err_msg=name)


OPTIMIZER_DATA = ('p32', 'p16', 'master', 'mom32', 'mom16', 'p64', 'mom64')
TRAFFIC_CASES = [c for c in CASES if c.family in ('batchnorm', 'layout', 'optimizer')]


@pytest.mark.parametrize('case', TRAFFIC_CASES,
                         ids=['{}-{}'.format(c.family, c.name) for c in TRAFFIC_CASES])
def test_memory_bound_kernels_move_each_data_array_once(case, backend):
    """The GB/s columns of the GPU table (docs/performance.md) count each array a launch touches
    once. The code's own traffic, counted by the emulator (emulator.recording), must not exceed
    that for the arrays that carry the data: every (rows, C) array of the batch-norm kernels,
    every array of the transposes and of the batched update (pointer-table gradients included)
    is read at most once and written at most once per launch. (Per-channel arrays are re-read by
    each row group, and the update's work list and hyperparameters by every thread, from cache on
    a GPU; pooling windows overlap, so it is not held to this.)"""
    with emulator.recording() as launches:
        kernel_cases.run(case, backend)
    assert len(launches) == len(case.launches)
    checked = 0
    for launch, counted in zip(case.launches, launches):
        for access in counted.arrays:
            if access.what.startswith('argument'):
                name = launch.args[int(access.what.split()[1])]
                if case.family == 'batchnorm' and case.arrays[name].ndim != 2 or \
                        case.family == 'optimizer' and name not in OPTIMIZER_DATA:
                    continue
            where = '{} in {}'.format(access.what, launch.kernel)
            assert access.bytes_read <= access.nbytes, where
            assert access.bytes_written <= access.nbytes, where
            checked += bool(access.bytes_read or access.bytes_written)
    assert checked


def test_every_kernel_has_a_case():
    from chainer_tc import kernels
    launched = {(c.family, k.split('<')[0]) for c in CASES for k in c.kernel_names()}
    for family in kernels.families():
        code = kernels.source(family)
        names = set(emulator.entry_points(code))
        names |= {n.split('<')[0] for c in CASES if c.family == family for n in c.name_expressions}
        missing = sorted(n for n in names if (family, n) not in launched)
        assert not missing, 'kernels/{}.cu: no case launches {}'.format(family, missing)


# ---- the channels-last launches: tiles, vector width, and both paths' results ------------------

def _both_widths():
    """(id, build(width)) of cases that exist with one and with two channels per thread."""
    f16, f32, f64 = numpy.float16, numpy.float32, numpy.float64
    out = []
    for t, p in [(f16, f16), (f16, f32), (f32, f32), (f64, f64)]:
        out.append(('bn {} {} C70'.format(t.__name__, p.__name__),
                    lambda w, t=t, p=p: kernel_cases._batchnorm(45, 70, t, p, grid_cap=2, width=w)))
        out.append(('bn {} {} C6 no-relu no-z'.format(t.__name__, p.__name__),
                    lambda w, t=t, p=p: kernel_cases._batchnorm(23, 6, t, p, relu=0, with_z=False,
                                                                width=w)))
    for t in (f16, f32, f64):
        out.append(('pool {} C70'.format(t.__name__),
                    lambda w, t=t: kernel_cases._pooling(2, 7, 8, 70, 3, 2, 1, t, grid_cap=1,
                                                         width=w)))
        out.append(('pool {} C4'.format(t.__name__),
                    lambda w, t=t: kernel_cases._pooling(3, 5, 5, 4, 2, 1, 0, t, width=w)))
    return out


@pytest.mark.parametrize('build', [b for _, b in _both_widths()],
                         ids=[i for i, _ in _both_widths()])
def test_two_channels_per_thread_give_the_bits_of_one(backend, build):
    """V = 2 (one __half2/float2/double2 access per two channels) computes each channel as V = 1
    does: every output, bit for bit, with the launches the callers make for each width."""
    out = {}
    for w in (1, 2):
        case = build(w)
        widths = {k.kernel.rsplit(', ', 1)[1] for k in case.launches
                  if k.kernel.startswith(('bn_apply', 'bn_backward_apply', 'max_pool', 'avg_pool'))}
        assert widths == {'{}>'.format(w)}
        out[w], _ = kernel_cases.run(case, backend)
    for name in out[1]:
        numpy.testing.assert_array_equal(out[2][name], out[1][name], err_msg=name)


@pytest.mark.parametrize('build', [b for i, b in _both_widths() if i.startswith('pool')],
                         ids=[i for i, _ in _both_widths() if i.startswith('pool')])
def test_max_pool_backward_reads_gy_only_where_it_is_used(backend, build):
    """Every output's gradient goes to one input position (its argmax), so the one-channel path
    reads each element of gy once; the two-channel path reads a pair where either channel's
    argmax matches: at most twice gy's bytes (it read a pair for every covering window, matched
    or not: 6.75 times gy's bytes on a 3x3/2 window)."""
    read = {}
    for w in (1, 2):
        case = build(w)
        with emulator.recording() as launches:
            kernel_cases.run(case, backend)
        (launch, counted), = [(k, c) for k, c in zip(case.launches, launches)
                              if k.kernel.startswith('max_pool_backward')]
        at = [i for i, a in enumerate(launch.args) if isinstance(a, str) and a == 'gy']
        gy, = [a for a in counted.arrays if a.what == 'argument {}'.format(*at)]
        read[w] = gy.bytes_read
    nbytes = build(1).arrays['gy'].nbytes
    assert read[1] == nbytes
    assert nbytes <= read[2] <= 2 * nbytes


@pytest.mark.parametrize('groups', [0, 1, 3, 17, 32, 33, 35, 64, 1024, 1025, 300000])
@pytest.mark.parametrize('positions', [0, 1, 7, 255, 802816, 10 ** 9])
def test_channel_tiles_cover_every_group_and_position(groups, positions):
    from chainer_tc import _tiles
    (tiles, gy), (tx, ty) = _tiles.channel_tiles(groups, positions, 256)
    assert 1 <= tx <= 32 and tx * ty <= 256 and ty >= 1
    assert tiles * tx >= groups and (groups == 0 or (tiles - 1) * tx < groups), \
        'every group covered, no tile without work'
    assert (tx - 1) * tiles < max(groups, 1), 'balanced tiles: 33 groups are 17 + 16, not 32 + 1'
    assert 1 <= gy <= 65535 and (gy * ty >= positions or tiles * gy > 8192 - tiles), \
        'one row of threads per position, or the block budget is spent (the kernels stride)'


def test_vector_width_names_what_holds_it_back():
    from chainer_tc import _tiles
    a = numpy.zeros(10, numpy.float16)
    assert _tiles.vector_width(4, {'x': a, 'z': None}) == (2, None)
    assert _tiles.vector_width(3, {'x': a}) == (1, None), 'odd C: the only path, no complaint'
    width, why = _tiles.vector_width(4, {'x': a, 'gy': a[1:]})
    assert width == 1 and why.startswith('gy starts at an address that is not a multiple of 4 '
                                         'bytes (two float16 elements')
    d = numpy.zeros(10, numpy.float64)
    assert _tiles.vector_width(2, {'x': d[2:]})[0] == 2
    assert _tiles.vector_width(2, {'x': d[1:]})[0] == 1, 'double2 needs 16 bytes'
