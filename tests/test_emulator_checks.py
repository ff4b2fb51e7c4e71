"""The emulator as a memcheck and racecheck: GPU bugs that a fixed thread order lets through must
fail here, and correct kernels must not be reported (issue 12's probes)."""
import os
import subprocess
import sys
import textwrap

import numpy
import pytest

from chainer_tc import kernels
from chainer_tc.errors import CompileError
from chainer_tc.errors import KernelLaunchError
from chainer_tc.testing import emulator
from chainer_tc.testing import kernel_cases
from chainer_tc.testing import mutate
from conftest import cuda_source

RACE = dict(race=True, schedules=['forward', 'reverse', 'random:1'])


@pytest.fixture(scope='module')
def buggy():
    return emulator.RawModule(path=cuda_source('buggy.cu'))


@pytest.fixture(scope='module')
def selftest():
    return emulator.RawModule(path=cuda_source('selftest.cu'))


# ---- memcheck ------------------------------------------------------------------------------------

def test_read_far_past_the_end(buggy):
    # 8 KiB past the end of a 4000-byte array: beyond a single guard page
    a, b = numpy.arange(1000, dtype=numpy.float32), numpy.zeros(1000, numpy.float32)
    with pytest.raises(KernelLaunchError, match=r"read of argument 0 \(const float\*, float32 array "
                                                r"of shape \(1000,\)\) at byte offset 8192 \(element "
                                                r"2048 of 1000\) in thread \(0,0,0\) of block \(0,0,0\) "
                                                r"\(at .*buggy.cu:\d+\)"):
        buggy.get_function('read_far')((4,), (256,), (a, b, numpy.int32(1000), numpy.int32(2048)))
    assert not b.any()


def test_read_far_before_the_start(buggy):
    a, b = numpy.arange(1000, dtype=numpy.float32), numpy.zeros(1000, numpy.float32)
    with pytest.raises(KernelLaunchError, match=r'at byte offset -40000 \(element -10000 of 1000\)'):
        buggy.get_function('read_far')((4,), (256,), (a, b, numpy.int32(1000), numpy.int32(-10000)))


# every distance from 16 bytes to 32 GiB (2^35: a 32-bit element index of 16-byte elements), both
# ways, and the ends of the int32 range
FAR_INDICES = sorted({s * (1 << k) for k in range(0, 31) for s in (1, -1)} |
                     {2 ** 31 - 1, -2 ** 31, 2 ** 20 + 3, -(2 ** 24) - 5})


@pytest.mark.parametrize('kernel', ['read_first_at', 'read_last_at'])
def test_far_accesses_are_reported_against_their_own_array(buggy, kernel):
    """An access up to 32 GiB off an array lands in its own slot of the arena or in an empty one
    (docs/emulator.md): reported against that array with its offset, whatever the distance, never
    taken as a read of another argument and never outside the launch's memory, with `a` the
    first argument (the arena's leading empty slot) or the last array argument (the slots of the
    shared memory follow it)."""
    assert emulator.FAR_BYTES == 2 ** 35 == 16 * 2 ** 31
    if emulator._far_warned:
        pytest.skip('this process could not reserve 32 GiB slots (ulimit -v): {} bytes'
                    .format(emulator._far_warned[0]))
    a, b, out = (numpy.zeros(4 * n, numpy.float32) for n in (3, 1000, 2))    # float4s
    args = (a, b, out) if kernel == 'read_first_at' else (b, out, a)
    name = 'argument {}'.format(0 if kernel == 'read_first_at' else 2)
    for index in FAR_INDICES:
        if 0 <= index < 3:
            continue
        with pytest.raises(KernelLaunchError) as e:
            buggy.get_function(kernel)((1,), (1,), args + (numpy.int64(index),))
        msg = str(e.value)
        assert 'out-of-bounds read of {} '.format(name) in msg, (index, msg)
        assert 'at byte offset {} (element {} of 12)'.format(16 * index, 4 * index) in msg, \
            (index, msg)


# the start of a script run under an address-space limit: a kernel k(a, out, i) reading a[i]
# into out[0], compiled and run once with far checking (before any limit), and the process's
# address space in use (vm), to which the script adds what it allows
_LIMITED = '''
import resource, warnings
import numpy
from chainer_tc.errors import KernelLaunchError
from chainer_tc.testing import emulator
code = ('extern "C" __global__ void k(const float* a, float* out, long long i) '
        '{ out[0] = a[i]; }')
f = emulator.RawModule(code=code).get_function('k')
a, out = numpy.ones(4, numpy.float32), numpy.zeros(1, numpy.float32)
with emulator.checking(far=True):
    f((1,), (1,), (a, out, numpy.int64(1)))
with open('/proc/self/status') as s:
    vm = [int(l.split()[1]) * 1024 for l in s if l.startswith('VmSize')][0]
'''


def test_smaller_slots_where_the_address_space_is_short(tmp_path):
    """Under an address-space limit (RLIMIT_AS) too small for 32 GiB slots, the launch halves them
    until they fit (and once more, leaving room for what it maps after), warns once with the
    distance it then covers, and still names an access that far off against its array."""
    script = tmp_path / 'short.py'
    script.write_text(_LIMITED + '''
resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 30), resource.RLIM_INFINITY))
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter('always')
    f((1,), (1,), (a, out, numpy.int64(3)))
    f((1,), (1,), (a, out, numpy.int64(2)))
print('warnings:', len(w), w[0].message if w else '')
print('out:', out[0])
got = emulator._far_warned[0]
print('slot:', got)
try:
    f((1,), (1,), (a, out, numpy.int64(-(got // 4))))
except KernelLaunchError as e:
    print('raised:', e)
''')
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert 'warnings: 1 emulator: the address space for 32 GiB slots could not be reserved' \
        in proc.stdout, proc.stdout
    assert 'out: 1.0' in proc.stdout
    got = int(proc.stdout.split('slot: ')[1].split()[0])
    assert 2 ** 24 <= got <= 2 ** 34 and 'catches accesses up to {} bytes'.format(got) in proc.stdout
    assert ('raised: kernel \'k\': out-of-bounds read of argument 0 (const float*, float32 array '
            'of shape (4,)) at byte offset {}'.format(-got)) in proc.stdout, proc.stdout


def test_the_far_check_is_skipped_with_a_warning_where_its_second_layout_cannot_be_had(
        tmp_path):
    """Under an address-space limit (RLIMIT_AS) that holds the launch's arena of 32 GiB slots
    but not a second one beside it (half or twice the size), the far check is skipped, said
    once, and the launch still runs (the same result) with its other checks (an out-of-bounds
    read is still named)."""
    script = tmp_path / 'skip.py'
    script.write_text(_LIMITED + '''
# the arena's slots (docs/emulator.md): two per region, and one; a region for each array and
# for the 64 static __shared__ variables and the dynamic shared memory of the one block
slots = 2 * (2 + 64 + 1) + 1
resource.setrlimit(resource.RLIMIT_AS,
                   (vm + slots * (32 << 30) + (1000 << 30), resource.RLIM_INFINITY))
with warnings.catch_warnings(record=True) as w, emulator.checking(far=True):
    warnings.simplefilter('always')
    f((1,), (1,), (a, out, numpy.int64(3)))
    f((1,), (1,), (a, out, numpy.int64(2)))
    print('warnings:', len(w), ' | '.join(str(x.message) for x in w))
    print('out:', out[0])
    try:
        f((1,), (1,), (a, out, numpy.int64(4)))
    except KernelLaunchError as e:
        print('raised:', e)
''')
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert ('warnings: 1 emulator: the far check of kernel k was skipped: the address space for '
            'its second layout of the arrays could not be reserved') in proc.stdout, proc.stdout
    assert 'out: 1.0' in proc.stdout
    assert ("raised: kernel 'k': out-of-bounds read of argument 0 (const float*, float32 array "
            'of shape (4,)) at byte offset 16') in proc.stdout, proc.stdout


def _next_region(elements_of):
    """The index that takes an access from the data of the arena's region k to that of region
    k + 1 (2 slots and a page on: docs/emulator.md), in elements of ``elements_of`` bytes."""
    return (2 * emulator.FAR_BYTES + os.sysconf('SC_PAGE_SIZE')) // elements_of


@pytest.mark.parametrize('kernel,access', [('write_at', 'a write'),
                                           ('atomic_at', 'an atomic access')])
def test_the_far_check_finds_a_far_access_that_lands_in_another_array(buggy, kernel, access):
    """A 64-bit index 64 GiB off `a` lands exactly in `b`'s data: the plain memcheck takes it for
    an access to `b` (the hole the far check closes); the far check runs the launch again with
    the arrays laid out anew, sees the access land elsewhere, and names it, its line and both
    landing places, with the arrays left as they were."""
    if emulator._far_warned:
        pytest.skip('this process could not reserve 32 GiB slots (ulimit -v)')
    f = buggy.get_function(kernel)
    a, b = numpy.zeros(4, numpy.float32), numpy.zeros(4, numpy.float32)
    with emulator.checking(far=False):
        f((1,), (1,), (a, b, numpy.int64(_next_region(4))))
    assert b.tolist() == [1, 2, 0, 0] and not a.any()       # b[0] written through a
    b[:] = 0
    with emulator.checking(far=True):
        with pytest.raises(KernelLaunchError) as e:
            f((1,), (1,), (a, b, numpy.int64(_next_region(4))))
    msg = str(e.value)
    assert msg.startswith("kernel '{}': {} of 4 bytes in thread (0,0,0) of block (0,0,0) (at "
                          .format(kernel, access)), msg
    assert 'buggy.cu:' in msg
    assert ('lands in different places depending on where the launch\'s arrays lie: in argument '
            '1 (float*, float32 array of shape (4,)) at byte offset 0 with them about 2^36 bytes '
            'apart, outside every array the launch was given with them about 2^35 bytes apart. '
            'Its address was computed far out of its own array (more than 2^35 bytes off: a '
            '64-bit index) or from the distance between two arrays') in msg, msg
    assert not a.any() and not b.any()
    with emulator.checking(far=True):          # within bounds: no report, the same result
        f((1,), (1,), (a, b, numpy.int64(3)))
    assert a.tolist() == [0, 0, 0, 1] and b.tolist() == [0, 2, 0, 0]


def test_the_far_check_follows_pointer_tables(buggy):
    """An access through a table's first address that lands in the allocation its second
    address points into (two regions on) is found too, and named against that allocation."""
    if emulator._far_warned:
        pytest.skip('this process could not reserve 32 GiB slots (ulimit -v)')
    x, y = numpy.full(4, 3, numpy.float32), numpy.full(4, 7, numpy.float32)
    table = numpy.array([x.ctypes.data, y.ctypes.data], numpy.uint64)
    out = numpy.zeros(1, numpy.float32)
    f = buggy.get_function('table_read_at')
    with emulator.checking(far=False):
        f((1,), (1,), (table, out, numpy.int64(_next_region(4))))
    assert out[0] == 7                                          # y[0], read through x
    with emulator.checking(far=True):
        with pytest.raises(KernelLaunchError, match=r"a read of 4 bytes .* lands in different "
                                                    r"places .*: in the 16-byte array whose "
                                                    r"address argument 0 .* holds at byte offset "
                                                    r"8, at byte offset 0 with them about 2\^36"):
            f((1,), (1,), (table, out, numpy.int64(_next_region(4))))
        f((1,), (1,), (table, out, numpy.int64(2)))
    assert out[0] == 3


def test_the_far_check_finds_results_that_depend_on_addresses(buggy):
    """A kernel that writes addresses as values: its result differs between the two layouts."""
    out = numpy.zeros(3, numpy.uint64)
    args = (numpy.zeros(2, numpy.float32), numpy.zeros(2, numpy.float16), numpy.zeros(2), out)
    with emulator.checking(far=True):
        with pytest.raises(KernelLaunchError, match=r"the result depends on where the launch's "
                                                    r"arrays lie: argument 3 .* differs at byte "
                                                    r"offset 0 .* under schedule forward"):
            buggy.get_function('addresses')((1,), (1,), args)
    assert not out.any()


def test_the_far_check_is_on_with_the_race_detector(monkeypatch, buggy):
    """On by default with the race detector, off without it; CHAINER_TC_EMULATOR_FAR (0 or 1)
    and checking(far=...) say otherwise, the innermost checking() last."""
    monkeypatch.delenv(emulator.ENV_FAR, raising=False)
    monkeypatch.delenv(emulator.ENV_RACECHECK, raising=False)
    assert not emulator.current_far()
    with emulator.checking(race=True):
        assert emulator.current_far()
        with emulator.checking(far=False):
            assert not emulator.current_far()
    monkeypatch.setenv(emulator.ENV_RACECHECK, '1')
    assert emulator.current_far()
    monkeypatch.setenv(emulator.ENV_FAR, '0')
    assert not emulator.current_far()
    monkeypatch.setenv(emulator.ENV_FAR, '1')
    monkeypatch.setenv(emulator.ENV_RACECHECK, '0')
    assert emulator.current_far()
    with emulator.checking(far=False):
        assert not emulator.current_far()
    monkeypatch.delenv(emulator.ENV_FAR)
    if emulator._far_warned:
        return
    a, b = numpy.zeros(4, numpy.float32), numpy.zeros(4, numpy.float32)
    with emulator.checking(race=True, schedules=['forward']):
        with pytest.raises(KernelLaunchError, match='lands in different places'):
            buggy.get_function('write_at')((1,), (1,), (a, b, numpy.int64(_next_region(4))))


def test_module_variables_carry_one_run_per_launch_under_every_check(selftest):
    """A ``__device__`` counter advances once per launch, as on a GPU, also where the launch
    runs several times (schedules, the far check's second run): each run starts from the
    module's state at the launch's start (before, a later run saw the earlier runs' writes and
    the launch was reported as order- or address-dependent)."""
    f = selftest.get_function('count_launches')
    out = numpy.zeros(1, numpy.uint32)
    counts = []
    for checks in ({}, dict(far=True), RACE, dict(RACE, far=False), {}):
        with emulator.checking(**checks):
            f((2,), (32,), (out,))
        counts.append(int(out[0]))
    assert counts == [counts[0] + k for k in range(5)], counts


@pytest.mark.parametrize('far', [False, True])
def test_a_kernel_that_swaps_table_addresses_leaves_host_addresses(selftest, far):
    """A double buffer's two addresses swapped by the kernel: the table holds the host
    addresses, swapped (before, a moved word kept its arena address, and the far check took
    the table for an address-dependent result)."""
    x, y = numpy.full(2, 3, numpy.float32), numpy.full(2, 7, numpy.float32)
    table = numpy.array([x.ctypes.data, y.ctypes.data], numpy.uint64)
    out = numpy.zeros(1, numpy.float32)
    with emulator.checking(far=far):
        selftest.get_function('swap_buffers')((1,), (1,), (table, out))
    assert out[0] == 7
    assert table.tolist() == [y.ctypes.data, x.ctypes.data]


def test_an_atomic_outside_the_launchs_memory_is_reported(buggy):
    """An atomic on an address no launch gives a kernel (host memory passed as an integer) is
    reported as a plain access there is, and the host memory is left alone."""
    host = numpy.zeros(1, numpy.float32)
    with pytest.raises(KernelLaunchError, match=r"an atomic access of 4 bytes at address "
                                                r"0x[0-9a-f]+ in thread \(0,0,0\) of block "
                                                r"\(0,0,0\) \(at .*buggy.cu:\d+\): memory the "
                                                r"launch did not give"):
        buggy.get_function('atomic_to_address')((1,), (1,), (numpy.uint64(host.ctypes.data),))
    assert host[0] == 0


def test_arrays_are_aligned_as_cudamalloc_aligns_them(buggy):
    out = numpy.zeros(3, numpy.uint64)
    for n in (1, 3, 1001):          # sizes that are no multiple of anything
        buggy.get_function('addresses')((1,), (1,), (numpy.zeros(n, numpy.float32),
                                                      numpy.zeros(n, numpy.float16),
                                                      numpy.zeros(n), out))
        assert (out % 256 == 0).all(), [hex(int(a)) for a in out]


def test_views_keep_their_offset_so_misaligned_vector_loads_fail(buggy):
    """A view's offset in its array is kept in the emulated copy (mod 256, as a CuPy view of a
    256-byte aligned block keeps it): a float2 load through a view starting at an odd float fails
    as it would on a GPU; the same data at an even offset, or whole, runs."""
    base = numpy.arange(10, dtype=numpy.float32)
    out = numpy.zeros(4, numpy.float32)
    k = buggy.get_function('pair_sums')
    k((1,), (4,), (base[2:], out, numpy.int32(4)))                  # offset 8 bytes: aligned
    assert out.tolist() == [5, 9, 13, 17]
    k((1,), (4,), (base[:8].copy(), out, numpy.int32(4)))
    assert out.tolist() == [1, 5, 9, 13]
    with pytest.raises(KernelLaunchError, match=r"misaligned .* 'const struct float2', which "
                                                r'needs 8-byte alignment \(a GPU faults'):
        k((1,), (4,), (base[1:9], out, numpy.int32(4)))             # offset 4 bytes
    # the canary around a view's copy (before it too) is refreshed between schedules
    with emulator.checking(schedules=['forward', 'reverse']):
        k((1,), (4,), (base[2:], out, numpy.int32(4)))
    assert out.tolist() == [5, 9, 13, 17]
    # memory NumPy did not allocate: the buffer's own address counts, as launch code sees it
    raw = bytearray(64)
    owner = numpy.frombuffer(raw, numpy.float32, count=12, offset=4)
    view = owner[1:9]
    view[...] = numpy.arange(8)
    aligned = view.ctypes.data % 8 == 0
    if aligned:
        k((1,), (4,), (view, out, numpy.int32(4)))
        assert out.tolist() == [1, 5, 9, 13]
    else:
        with pytest.raises(KernelLaunchError, match='misaligned'):
            k((1,), (4,), (view, out, numpy.int32(4)))


def test_table_pointer_read_past_a_gradient(buggy):
    # a table of addresses of arrays that are not kernel arguments (the optimizer's gradient table)
    assert emulator.tracking_allocations()
    grads = [numpy.ones(n, numpy.float32) for n in (10, 3, 7)]
    table = numpy.array([g.ctypes.data for g in grads], numpy.uint64)
    count = numpy.array([g.size for g in grads], numpy.int32)
    out = numpy.zeros(3, numpy.float32)
    with pytest.raises(KernelLaunchError, match=r'out-of-bounds read of the 40-byte array whose '
                                                r'address argument 0 \(const unsigned long long\*\) '
                                                r'holds at byte offset 0, at byte offset 40 in thread '
                                                r'\(0,0,0\)'):
        buggy.get_function('table_sum_off_by_one')((1,), (32,), (table, count, out, numpy.int32(3)))
    # the same with the right count reads through the table and writes through nothing else
    count -= 1
    buggy.get_function('table_sum_off_by_one')((1,), (32,), (table, count, out, numpy.int32(3)))
    numpy.testing.assert_array_equal(out, [10, 3, 7])
    assert list(table) == [g.ctypes.data for g in grads], 'the table is given back unchanged'


def test_optimizer_reading_past_each_gradient_is_caught():
    # optimizers' check kernel, mutated to read one element past each chunk: past the end of the
    # gradient for the last chunk of every parameter (issue 12: passed 9 of 10 checks)
    code = kernels.source('optimizer')
    old = 'for (int i = threadIdx.x; i < n; i += OPT_BLOCK) {\n    T grad = ctc::load(g, i);'
    assert old in code
    backend = kernel_cases.EmulatorBackend({'optimizer': code.replace(old, old.replace(
        'i < n', 'i <= n'))})
    case = kernel_cases._optimizer([5, 2049], [numpy.float32, numpy.float16])
    with pytest.raises(KernelLaunchError, match=r"kernel 'momentum_sgd_check': out-of-bounds read of "
                                                r"the \d+-byte array whose address argument 0 \(struct "
                                                r"of 3872 bytes\) holds at byte offset (32|40),"):
        kernel_cases.run(case, backend)


def test_static_shared_array_overflow(buggy):
    out = numpy.zeros(64, numpy.float32)
    buggy.get_function('shared_overflow')((1,), (32,), (out[:32],))
    with pytest.raises(KernelLaunchError, match=r"index 32 out of range for an array of type "
                                                r"'float \[32\]' .* at .*buggy.cu:\d+ in thread "
                                                r"\(32,0,0\)"):
        buggy.get_function('shared_overflow')((1,), (64,), (out,))
    with pytest.raises(KernelLaunchError, match=r"out-of-bounds write to __shared__ variable 's' "
                                                r"\(float \[32\], 128 bytes\) at byte offset 128 "
                                                r"\(element 32 of 32\) in thread \(32,0,0\)"):
        buggy.get_function('shared_overflow_by_pointer')((1,), (64,), (out,))


def test_local_array_overflow(buggy):
    idx, out = numpy.array([0, 3, 4, 1], numpy.int32), numpy.zeros(4, numpy.float32)
    with pytest.raises(KernelLaunchError, match=r"index 4 out of range for an array of type "
                                                r"'float \[4\]'.* in thread \(2,0,0\)"):
        buggy.get_function('local_overflow')((1,), (4,), (idx, out))


def test_launch_beyond_launch_bounds(buggy):
    out = numpy.zeros(512, numpy.float32)
    k = buggy.get_function('bounded')
    assert k.max_threads_per_block == 256
    k((2,), (256,), (out,))
    with pytest.raises(ValueError, match=r'block \(512, 1, 1\) has 512 threads but the kernel was '
                                         r'compiled with __launch_bounds__\(256\)'):
        k((1,), (512,), (out,))


def test_our_kernels_launch_bounds_are_read():
    mod = kernel_cases.EmulatorBackend().module(kernel_cases._optimizer([3], [numpy.float32]))
    assert mod.get_function('momentum_sgd_update').max_threads_per_block == 256
    assert mod.get_function('momentum_sgd_set_globals').max_threads_per_block is None


def test_integer_division_by_zero_raises(buggy):
    a = numpy.array([7, 8, 9, 10], numpy.int32)
    d = numpy.array([1, 2, 0, 5], numpy.int32)
    out = numpy.zeros(4, numpy.int32)
    with pytest.raises(KernelLaunchError, match=r"kernel 'divide': integer division by zero of type "
                                                r"'int' at .*buggy.cu:\d+ in thread \(2,0,0\)"):
        buggy.get_function('divide')((1,), (4,), (a, d, out))
    a[0], d[2] = numpy.iinfo(numpy.int32).min, 3
    d[0] = -1
    with pytest.raises(KernelLaunchError, match=r"kernel 'divide': integer division overflow "
                                                r"\(INT_MIN / -1\) of type 'int' at .*buggy.cu:\d+ "
                                                r"in thread \(0,0,0\)"):
        buggy.get_function('divide')((1,), (4,), (a, d, out))
    with pytest.raises(KernelLaunchError, match=r'integer division by zero or overflow \(INT_MIN / '
                                                r'-1\): SIGFPE in thread \(0,0,0\)'):
        buggy.get_function('divide_trap')((1,), (4,), (a, d, out))     # the trap, unchecked
    d[0] = 1
    buggy.get_function('divide')((1,), (4,), (a, d, out))
    assert out[1] == 4


def test_division_by_zero_does_not_kill_the_process(tmp_path):
    # SIGFPE once killed Python: run it in a child and see it come back with the error
    script = tmp_path / 'div.py'
    script.write_text('''
import numpy
from chainer_tc.errors import KernelLaunchError
from chainer_tc.testing import emulator
code = 'extern "C" __global__ void k(const long long* a, long long* out) { out[0] = 1 / a[0]; }'
try:
    emulator.RawModule(code=code).get_function('k')((1,), (1,), (numpy.zeros(1, numpy.int64),
                                                              numpy.zeros(1, numpy.int64)))
except KernelLaunchError as e:
    print('raised:', e)
''')
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "raised: kernel 'k': integer division by zero" in proc.stdout


def test_misaligned_vector_load(buggy):
    x, out = numpy.arange(8, dtype=numpy.float32), numpy.zeros(1, numpy.float32)
    with pytest.raises(KernelLaunchError, match=r"misaligned .* address 0x[0-9a-f]+ for type "
                                                r"'const (struct )?float4', which needs 16-byte "
                                                r"alignment \(a GPU faults: misaligned address\) at "
                                                r".*buggy.cu:\d+ in thread \(0,0,0\)"):
        buggy.get_function('misaligned_float4')((1,), (1,), (x, out))


def test_kernels_named_after_c_library_functions(buggy):
    x = numpy.zeros(4, numpy.float32)
    for name, value in (('signal', 1), ('gamma', 2), ('fadd', 3)):
        buggy.get_function(name)((1,), (4,), (x,))
        assert (x == value).all()


def test_parameter_block_limit(monkeypatch):
    code = '''struct Big { unsigned long long w[513]; };
    extern "C" __global__ void k(const Big b, unsigned long long* out) { out[0] = b.w[512]; }'''
    k = emulator.RawModule(code=code).get_function('k')
    assert k.param_bytes == 4112
    big = numpy.zeros(1, [('w', '<u8', (513,))])
    big['w'][0, 512] = 9
    out = numpy.zeros(1, numpy.uint64)
    with pytest.raises(ValueError, match=r'its parameters take 4112 bytes; CUDA allows 4096'):
        k((1,), (1,), (big, out))
    monkeypatch.setenv('CHAINER_TC_EMULATOR_PARAM_LIMIT', '32764')
    k((1,), (1,), (big, out))
    assert out[0] == 9


def test_static_plus_dynamic_shared_memory_limit():
    code = '''extern "C" __global__ void k(float* out) {
      __shared__ float tile[8192];                       // 32 KiB
      extern __shared__ float more[];
      tile[threadIdx.x] = 1.0f;
      more[threadIdx.x] = 2.0f;
      __syncthreads();
      out[threadIdx.x] = tile[threadIdx.x] + more[threadIdx.x];
    }
    extern "C" __global__ void huge(float* out) {
      __shared__ double big[7000];                       // 56000 bytes
      big[threadIdx.x] = 1.0;
      out[threadIdx.x] = (float)big[threadIdx.x];
    }'''
    m = emulator.RawModule(code=code)
    out = numpy.zeros(32, numpy.float32)
    k = m.get_function('k')
    k((1,), (32,), (out,), shared_mem=16 * 1024)              # 48 KiB in all: fine
    assert (out == 3).all()
    with pytest.raises(KernelLaunchError, match=r"32768 bytes of static __shared__ memory \('tile' "
                                                r"\(float \[8192\], 32768 bytes\)\) plus shared_mem="
                                                r"16388 bytes of dynamic shared memory exceed the "
                                                r"49152 bytes"):
        k((1,), (32,), (out,), shared_mem=16 * 1024 + 4)
    with pytest.raises(KernelLaunchError, match=r"56000 bytes of static __shared__ memory .* at most "
                                                r"48 KiB"):
        m.get_function('huge')((1,), (32,), (out,))


def test_static_shared_memory_is_garbage_in_every_block():
    # a GPU gives a block whatever the shared memory held: reading bytes no thread of the block
    # wrote is an error, in every block (the record of what was written starts anew per block,
    # as the contents do: 0xff bytes, NaN for floats, not the previous block's values or zeros)
    code = '''extern "C" __global__ void k(float* out, int write_in_block) {
      __shared__ float s[4];
      if (threadIdx.x == 0 && blockIdx.x == write_in_block) s[0] = 2.0f;
      __syncthreads();
      if (threadIdx.x == 0) out[blockIdx.x] = s[0];
    }'''
    out = numpy.zeros(3, numpy.float32)
    k = emulator.RawModule(code=code).get_function('k')
    with pytest.raises(KernelLaunchError, match=r"offset 0 of __shared__ variable 's' .* in thread "
                                                r"\(0,0,0\) of block \(1,0,0\) .*reads bytes no "
                                                r"thread of this block wrote"):
        k((3,), (4,), (out, numpy.int32(0)))
    with pytest.raises(KernelLaunchError, match=r"block \(0,0,0\) .*reads bytes no thread of this "
                                                r"block wrote"):
        k((3,), (4,), (out, numpy.int32(2)))


def test_compiler_time_limit(monkeypatch):
    monkeypatch.setenv('CHAINER_TC_EMULATOR_COMPILE_TIMEOUT', '0.05')
    code = 'extern "C" __global__ void k(int* x) {{ x[0] = {}; }}'.format(os.getpid() * 7 + 1)
    with pytest.raises(CompileError, match=r'did not finish within 0.05 s \(raise '
                                           r'CHAINER_TC_EMULATOR_COMPILE_TIMEOUT\)'):
        emulator.RawModule(code=code)


def test_compiler_memory_limit(monkeypatch):
    monkeypatch.setenv('CHAINER_TC_EMULATOR_COMPILE_MEMORY_MB', '24')
    code = 'extern "C" __global__ void k(int* x) {{ x[0] = {}; }}'.format(os.getpid() * 7 + 2)
    with pytest.raises(CompileError, match=r'its address space is limited to 24 MiB: raise '
                                           r'CHAINER_TC_EMULATOR_COMPILE_MEMORY_MB'):
        emulator.RawModule(code=code)


# ---- racecheck and schedule exploration -----------------------------------------------------------

@pytest.mark.parametrize('name', sorted(mutate.issue_mutants()))
def test_issue_mutants_are_reported(name):
    """The five bugs that passed every test (issue 12), on the cases that exercise them."""
    family, source = mutate.issue_mutants()[name]
    backend = kernel_cases.EmulatorBackend({family: source})
    if family == 'optimizer':
        sizes, dtypes = [5, 2049, 300], [numpy.float32, numpy.float16, numpy.float32]
        case = kernel_cases._optimizer(sizes, dtypes, inject_inf=True)
    else:
        case = kernel_cases._batchnorm(37, 33, numpy.float32, numpy.float32)
    with emulator.checking(**RACE):
        with pytest.raises(KernelLaunchError, match=r'data race on '):
            kernel_cases.run(case, backend)


def test_issue_mutants_pass_without_the_checks():
    # the reason they survived: one fixed order, no race detector
    for name, (family, source) in mutate.issue_mutants().items():
        backend = kernel_cases.EmulatorBackend({family: source})
        case = (kernel_cases._optimizer([5, 2049], [numpy.float32, numpy.float16])
                if family == 'optimizer' else
                kernel_cases._batchnorm(37, 33, numpy.float32, numpy.float32))
        kernel_cases.run(case, backend)


def test_missing_barrier_in_a_tree_reduction(buggy):
    x, out = numpy.ones(512, numpy.float32), numpy.zeros(2, numpy.float32)
    k = buggy.get_function('tree_sum_no_barrier')
    with emulator.checking(**RACE):
        with pytest.raises(KernelLaunchError, match=r"data race on __shared__ variable 's' \(float "
                                                    r"\[256\], 1024 bytes\) at byte offset \d+ "
                                                    r"\(element \d+ of 256\): a (read|write) by thread "
                                                    r"\(\d+,0,0\) of block \(\d,0,0\) \(at .*buggy.cu:"
                                                    r"\d+\) and an earlier (read|write) by thread "):
            k((2,), (256,), (x, out))


def test_last_block_reduction_without_fences(buggy):
    n = 1000
    x = numpy.arange(n, dtype=numpy.float32)
    partial, count, out = numpy.zeros(8, numpy.float32), numpy.zeros(1, numpy.uint32), \
        numpy.zeros(1, numpy.float32)
    k = buggy.get_function('last_block_sum_no_fence')
    k((8,), (32,), (x, partial, count, out, numpy.int32(n)))
    assert out[0] == x.sum()
    with emulator.checking(race=True):
        with pytest.raises(KernelLaunchError, match=r'data race on argument 1 \(float\*, float32 '
                                                    r'array of shape \(8,\)\) .* in different blocks, '
                                                    r'not ordered by a __threadfence\(\) and an atomic'):
            k((8,), (32,), (x, partial, count, out, numpy.int32(n)))


def test_plain_counter_across_blocks(buggy):
    count = numpy.zeros(1, numpy.uint32)
    buggy.get_function('plain_counter')((5,), (32,), (count,))
    assert count[0] == 5
    with emulator.checking(race=True):
        with pytest.raises(KernelLaunchError, match=r'data race on argument 0 \(unsigned int\*'):
            buggy.get_function('plain_counter')((5,), (32,), (count,))


@pytest.mark.parametrize('schedule', ['forward', 'random:3'])
@pytest.mark.parametrize('readers,silent', [(3, 1), (3, 0), (3, 2), (9, 4), (9, 8)])
def test_write_races_with_one_unreleased_read_among_many(buggy, readers, silent, schedule):
    # A cell keeps two reads; a third that neither is ordered before used to evict the second, so
    # the write saw only released reads: (3, 1) and (9, 4) passed under the forward schedule,
    # (3, 2), (9, 4) and (9, 8) under random:3. The read set keeps every reader, and the report
    # names the silent block's thread and line.
    x, flag, out = numpy.ones(1, numpy.float32), numpy.zeros(1, numpy.uint32), \
        numpy.zeros(readers, numpy.float32)
    k = buggy.get_function('write_after_unreleased_read')
    with emulator.checking(race=True, schedules=[schedule]):
        with pytest.raises(KernelLaunchError, match=(
                r'data race on argument 0 \(float\*, float32 array of shape \(1,\)\) at byte offset '
                r'0 \(element 0 of 1\): a write by thread \(0,0,0\) of block \(%d,0,0\) \(at .*buggy'
                r'\.cu:\d+\) and an earlier read by thread \(0,0,0\) of block \(%d,0,0\) \(at .*buggy'
                r'\.cu:\d+\), in different blocks' % (readers, silent))):
            k((readers + 1,), (32,), (x, flag, out, numpy.int32(silent)))


@pytest.mark.parametrize('readers', [3, 9])
def test_write_after_many_released_reads_is_race_free(buggy, readers):
    x, flag, out = numpy.ones(1, numpy.float32), numpy.zeros(1, numpy.uint32), \
        numpy.zeros(readers, numpy.float32)
    with emulator.checking(race=True, schedules=['forward', 'random:3']):
        buggy.get_function('write_after_unreleased_read')(
            (readers + 1,), (32,), (x, flag, out, numpy.int32(-1)))
    assert x[0] == 2 and (out == 1).all() and flag[0] == readers


@pytest.mark.parametrize('schedule', ['forward', 'random:3'])
@pytest.mark.parametrize('how', [0, 1])
def test_a_read_after_a_blocks_release_races_with_the_write(buggy, how, schedule):
    # Finished blocks' reads that no release of theirs follows are folded into one (a read set
    # then holds the live blocks, not every block that read): the fold must keep this block's
    # read, which a release came before (how 0) or which a second read follows (how 1).
    x, flag, out = numpy.ones(1, numpy.float32), numpy.zeros(1, numpy.uint32), \
        numpy.zeros(9, numpy.float32)
    with emulator.checking(race=True, schedules=[schedule]):
        with pytest.raises(KernelLaunchError, match=(
                r'data race on argument 0 .*: a write by thread \(0,0,0\) of block \(9,0,0\) '
                r'\(at .*buggy\.cu:\d+\) and an earlier read by thread \(0,0,0\) of block '
                r'\(4,0,0\) \(at .*buggy\.cu:\d+\), in different blocks')):
            buggy.get_function('write_after_read_after_release')(
                (10,), (32,), (x, flag, out, numpy.int32(4), numpy.int32(how)))


def test_a_byte_blocks_read_without_releasing_costs_no_memory_per_block():
    """The race detector's memory for a broadcast input that blocks read and release nothing
    after does not grow with the blocks: 96 blocks reading 64 KB took 1.5 GB before finished
    blocks' reads were folded."""
    code = textwrap.dedent("""
        import resource, numpy
        from chainer_tc.testing import emulator
        k = emulator.RawModule(path=%r).get_function('every_block_reads_all')
        w, out = numpy.ones(16384, numpy.float32), numpy.zeros(1, numpy.float32)
        k((1,), (128,), (w, out, numpy.int32(16384)))       # compiled, and a one-block baseline
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with emulator.checking(race=True, schedules=['forward']):
            k((96,), (128,), (w, out, numpy.int32(16384)))
        grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        assert out[0] == 97 * 16384, out
        print('grew', grew // 1024, 'MB')
    """ % cuda_source('buggy.cu'))
    run = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    grew = int(run.stdout.split()[1])
    # a set per byte (~1.2 KB with its entries' memory: 80 MB for 64 KB), whatever the blocks
    assert grew < 300, run.stdout


@pytest.mark.parametrize('atomic', [0, 1])
def test_folded_volatile_reads_race_with_a_plain_write_only(buggy, atomic):
    # 9 readers: blocks 0-2's reads are released and acquired; blocks 3-7's (not released)
    # fold into one, block 3's, which the report names; the kind rules still apply to it
    x, flag, out = numpy.ones(1, numpy.float32), numpy.zeros(1, numpy.uint32), \
        numpy.zeros(9, numpy.float32)
    k = buggy.get_function('volatile_reads_then_write')
    with emulator.checking(race=True, schedules=['forward']):
        if atomic:
            k((10,), (32,), (x, flag, out, numpy.int32(1)))
            assert x[0] == 2 and (out == 1).all()
            return
        with pytest.raises(KernelLaunchError, match=(
                r'data race on argument 0 .*: a write by thread \(0,0,0\) of block \(9,0,0\) '
                r'\(at .*buggy\.cu:\d+\) and an earlier volatile read by thread \(0,0,0\) of '
                r'block \(3,0,0\)')):
            k((10,), (32,), (x, flag, out, numpy.int32(0)))


def test_write_races_with_another_warps_read_between_two_synced_lanes(buggy):
    # forward order: lane 0 reads, thread 32 reads, lane 1 reads; lane 0's write after the
    # __syncwarp is ordered after both lanes' reads. Thread 32's read was the evicted one.
    out = numpy.zeros(3, numpy.float32)
    k = buggy.get_function('write_after_other_warps_read')
    with emulator.checking(race=True, schedules=['forward']):
        with pytest.raises(KernelLaunchError, match=(
                r"data race on __shared__ variable 's' \(float, 4 bytes\) at byte offset 0 \(element "
                r"0 of 1\): a write by thread \(0,0,0\) of block \(0,0,0\) \(at .*buggy\.cu:\d+\) and "
                r"an earlier read by thread \(32,0,0\) of block \(0,0,0\) \(at .*buggy\.cu:\d+\), in "
                r"one block, with no __syncthreads\(\) between them")):
            k((1,), (64,), (out,))


def test_reads_before_a_barrier_are_ordered_and_later_ones_are_not(buggy):
    # 64 readers, then 16 + 32 again after a barrier: the byte's reads are in a read set, in two
    # barrier intervals. Thread 63's write is ordered after warp 1's (a __syncwarp) and after
    # every first read (the barrier); threads 0-15's second reads race with it.
    k = buggy.get_function('write_after_reads_in_two_intervals')
    out = numpy.zeros(64, numpy.float32)
    with emulator.checking(race=True):
        k((1,), (64,), (out, numpy.int32(0)))
    assert (out == numpy.repeat([1, 2], 32)).all()
    with emulator.checking(race=True, schedules=['forward']):
        with pytest.raises(KernelLaunchError, match=(
                r"data race on __shared__ variable 's' .*: a write by thread \(63,0,0\) of block "
                r"\(0,0,0\) \(at .*buggy\.cu:\d+\) and an earlier read by thread \(0,0,0\) of block "
                r"\(0,0,0\) \(at .*buggy\.cu:\d+\), in one block, with no __syncthreads\(\)")):
            k((1,), (64,), (out, numpy.int32(16)))


@pytest.mark.parametrize('readers', [2, 5])
def test_volatile_reads_race_with_a_plain_write_not_an_atomic(buggy, readers):
    # with 5 readers the volatile reads are in a read set, which keeps them apart from plain ones
    x, out = numpy.zeros(1, numpy.uint32), numpy.zeros(readers, numpy.uint32)
    k = buggy.get_function('write_after_volatile_reads')
    with emulator.checking(race=True, schedules=['forward']):
        k((readers + 1,), (32,), (x, out, numpy.int32(1)))
        assert x[0] == 1
        with pytest.raises(KernelLaunchError, match=(
                r'a write by thread \(0,0,0\) of block \(%d,0,0\) \(at .*\) and an earlier volatile '
                r'read by thread \(0,0,0\) of block \(\d,0,0\) \(at .*buggy\.cu:\d+\), in different '
                r'blocks' % readers)):
            k((readers + 1,), (32,), (x, out, numpy.int32(0)))


# Publications that a fence does not order (each passed the detector before 2026-11-23):
# - the fence before the data instead of between the data and the signal: it used to release
#   everything its thread did in its barrier interval, accesses after it included;
# - a release whose fence came before another thread of its block acquired the data: the
#   release used the block's knowledge at the atomic, an acquire after the fence included.
@pytest.mark.parametrize('kernel,blocks,reader', [('fence_before_the_write', 2, 1),
                                                  ('release_before_the_acquire_it_passes_on', 3, 2)])
def test_a_fence_orders_only_what_came_before_it(buggy, kernel, blocks, reader):
    data, out = numpy.zeros(1, numpy.float32), numpy.zeros(1, numpy.float32)
    k = buggy.get_function(kernel)
    k((blocks,), (32,), (data, numpy.zeros(2, numpy.uint32), out))
    assert out[0] == data[0] != 0
    with emulator.checking(race=True, schedules=['forward']):
        with pytest.raises(KernelLaunchError, match=(
                r'data race on argument 0 \(float\*, float32 array of shape \(1,\)\) at byte offset 0 '
                r'\(element 0 of 1\): a read by thread \(0,0,0\) of block \(%d,0,0\) \(at .*buggy\.cu:'
                r'\d+\) and an earlier write by thread \(0,0,0\) of block \(0,0,0\) \(at .*buggy\.cu:'
                r'\d+\), in different blocks' % reader)):
            k((blocks,), (32,), (data, numpy.zeros(2, numpy.uint32), out))


@pytest.mark.parametrize('schedule', ['forward', 'random:2'])
def test_every_thread_fencing_before_its_write_is_a_race(buggy, schedule):
    # Each thread's fence releases what it did before the fence, even when every thread fenced
    # before the barrier; it used to release the whole barrier interval, and this passed.
    data, flag = numpy.zeros(64, numpy.float32), numpy.zeros(1, numpy.uint32)
    out = numpy.zeros(64, numpy.float32)
    k = buggy.get_function('publish_with_every_thread_fencing')
    with emulator.checking(race=True, schedules=[schedule]):
        k((2,), (64,), (data, flag, out, numpy.int32(0)))
        assert (out == numpy.arange(1, 65)).all()
        flag[0] = 0
        with pytest.raises(KernelLaunchError, match=(
                r'data race on argument 0 .*: a read by thread \((\d+),0,0\) of block \(1,0,0\) \(at '
                r'.*buggy\.cu:\d+\) and an earlier write by thread \(\1,0,0\) of block \(0,0,0\)')):
            k((2,), (64,), (data, flag, out, numpy.int32(1)))


def test_volatile_write_races_with_a_plain_read_the_thread_read_again_volatile(buggy):
    # the thread's later volatile read replaced its plain one in the shadow, and this passed
    x, out = numpy.full(1, 3, numpy.uint32), numpy.zeros(2, numpy.uint32)
    with emulator.checking(race=True, schedules=['forward']):
        with pytest.raises(KernelLaunchError, match=(
                r'a volatile write by thread \(0,0,0\) of block \(1,0,0\) \(at .*\) and an earlier '
                r'read by thread \(0,0,0\) of block \(0,0,0\)')):
            buggy.get_function('volatile_write_after_plain_read')((2,), (32,), (x, out))


@pytest.mark.parametrize('schedule', ['forward', 'reverse', 'random:4'])
@pytest.mark.parametrize('lane0_reads', [0, 1])
def test_a_partial_syncwarp_orders_only_the_lanes_it_names(buggy, schedule, lane0_reads):
    # __syncwarp(3) counted as ordering the whole warp: where lane 2 read first (reverse), the
    # race was missed, with two readers (the cell) and with three (a read set)
    out = numpy.zeros(3, numpy.float32)
    with emulator.checking(race=True, schedules=[schedule]):
        with pytest.raises(KernelLaunchError, match=(
                r"data race on __shared__ variable 's' .*(a write by thread \(0,0,0\) .* and an "
                r"earlier read by thread \(2,0,0\)|a read by thread \(2,0,0\) .* and an earlier "
                r"write by thread \(0,0,0\)).*, in one warp, with no __syncthreads\(\) or "
                r"__syncwarp\(\) of both between them")):
            buggy.get_function('partial_syncwarp_write')((1,), (32,), (out, numpy.int32(lane0_reads)))


def test_a_race_with_a_read_set_names_the_line_of_that_read(buggy):
    # a read set kept one code address per warp, the latest, and reported no line for a lane
    # that read on another; each lane's is kept once they differ
    with open(cuda_source('buggy.cu')) as f:
        line = next(i for i, text in enumerate(f, 1) if '// the first line' in text)
    with emulator.checking(race=True, schedules=['forward']):
        with pytest.raises(KernelLaunchError, match=(
                r"a write by thread \(16,0,0\) of block \(0,0,0\) \(at .*\) and an earlier read by "
                r"thread \(0,0,0\) of block \(0,0,0\) \(at .*buggy\.cu:%d\)" % line)):
            buggy.get_function('write_after_reads_on_two_lines')((1,), (32,),
                                                                  (numpy.zeros(32, numpy.float32),))


def test_order_dependent_result_without_a_race(buggy):
    # atomics only, so the detector is silent; the schedules see that the result depends on order
    counter, out = numpy.zeros(1, numpy.uint32), numpy.zeros(64, numpy.int32)
    k = buggy.get_function('tickets')
    with emulator.checking(race=True, schedules=['forward']):
        k((2,), (32,), (counter, out))
    counter[0] = 0
    with emulator.checking(race=False, schedules=['forward', 'reverse']):
        with pytest.raises(KernelLaunchError, match=r"kernel 'tickets': the result depends on the "
                                                    r"order in which threads run: argument 1 \(int\*, "
                                                    r"int32 array of shape \(64,\)\) differs at byte "
                                                    r"offset 0 \(element 0 of 64\): 0 under schedule "
                                                    r"forward, 63 under schedule reverse"):
            k((2,), (32,), (counter, out))


def test_racecheck_from_the_environment(buggy, monkeypatch):
    count = numpy.zeros(1, numpy.uint32)
    monkeypatch.setenv('CHAINER_TC_EMULATOR_RACECHECK', '1')
    assert emulator.current_checks() == (True, ['forward', 'reverse', 'random:1'])
    with pytest.raises(KernelLaunchError, match='data race'):
        buggy.get_function('plain_counter')((2,), (32,), (count,))
    monkeypatch.setenv('CHAINER_TC_EMULATOR_SCHEDULES', '4')
    assert emulator.current_checks()[1] == ['forward', 'reverse', 'random:1', 'random:2']
    monkeypatch.setenv('CHAINER_TC_EMULATOR_SCHEDULES', 'forward,sideways')
    with pytest.raises(ValueError, match="unknown schedule 'sideways'"):
        emulator.current_checks()


# ---- correct kernels are not reported ---------------------------------------------------------------

@pytest.mark.parametrize('block', [32, 256])
def test_tree_reduction_with_barriers_is_race_free(selftest, block):
    x = numpy.random.RandomState(0).randn(3000)
    out = numpy.zeros(5)
    with emulator.checking(**RACE):
        selftest.get_function('block_sum')((5,), (block,), (x, out, numpy.int32(x.size)),
                                           shared_mem=block * 8)
    expect = [x[numpy.arange(x.size) % (5 * block) // block == b].sum() for b in range(5)]
    numpy.testing.assert_allclose(out, expect, rtol=1e-12)


@pytest.mark.parametrize('kernel', ['last_block_sum', 'guide_sum'])
@pytest.mark.parametrize('blocks', [1, 7])
def test_last_block_reduction_with_fences_is_race_free(selftest, kernel, blocks):
    n = 5000
    x = numpy.arange(n, dtype=numpy.float32) % 7
    partial, count, out = numpy.zeros(blocks, numpy.float32), numpy.zeros(1, numpy.uint32), \
        numpy.zeros(1, numpy.float32)
    with emulator.checking(**RACE):
        selftest.get_function(kernel)((blocks,), (256,), (x, partial, count, out, numpy.int32(n)))
    assert out[0] == x.sum() and count[0] == 0


def test_warp_level_and_block_level_selftest_kernels_are_race_free(selftest):
    r = numpy.random.RandomState(1)
    with emulator.checking(**RACE):
        x = r.randint(-9, 9, 1000).astype(numpy.int32)
        out = numpy.zeros(4, numpy.int32)
        selftest.get_function('warp_sum')((4,), (256,), (x, out, numpy.int32(1000)))
        assert out.sum() == x.sum()
        scan, bcast = numpy.zeros(1000, numpy.int32), numpy.zeros(1000, numpy.int32)
        selftest.get_function('warp_scan')((16,), (64,), (x, scan, bcast, numpy.int32(8),
                                                         numpy.int32(1000)))
        lock, counter = numpy.zeros(1, numpy.int32), numpy.zeros(1, numpy.int32)
        selftest.get_function('cas_lock')((9,), (32,), (lock, counter))
        assert counter[0] == 9
        pred = (r.rand(4, 100) > 0.5).astype(numpy.int32)
        votes = numpy.zeros((4, 100, 3), numpy.int32)
        selftest.get_function('block_votes')((4,), (100,), (pred, votes, numpy.int32(70)))


@pytest.mark.parametrize('blocks', [2, 4])
def test_grid_barrier_of_cooperative_groups_is_race_free(selftest, blocks):
    # __syncthreads(), then one thread's fence and atomic: the fence orders the whole block's
    # earlier writes (cumulativity), which the detector used to report as a race.
    x = numpy.arange(blocks * 64, dtype=numpy.float32)
    doubled, shifted = numpy.zeros_like(x), numpy.zeros_like(x)
    arrived = numpy.zeros(1, numpy.uint32)
    with emulator.checking(race=True, schedules=['random:1', 'random:2', 'random:3']):
        selftest.get_function('grid_barrier_shift')((blocks,), (64,), (x, doubled, shifted, arrived))
    assert (doubled == 2 * x).all()
    assert (shifted == numpy.roll(2 * x, -64)).all() and arrived[0] == blocks


def test_uneven_fence_counts_then_a_release_are_race_free(selftest):
    # 32 readers put x[0]'s reads in a read set; thread 0's read came after one more fence than
    # the others'. The set used one count for the warp (its largest) and reported the others.
    x, flag, out = numpy.ones(1, numpy.float32), numpy.zeros(1, numpy.uint32), \
        numpy.zeros(32, numpy.float32)
    with emulator.checking(race=True, schedules=['forward', 'random:1']):
        selftest.get_function('uneven_fences_then_release')((2,), (32,), (x, flag, out))
    assert x[0] == 2 and (out == 1).all()


def test_atomics_and_volatile_reads_of_a_counter_are_race_free(selftest):
    # the first atomic, kept as a read, went to the plain reads when the third reader made a
    # read set, and the last atomic was reported against it
    c = numpy.zeros(1, numpy.uint32)
    with emulator.checking(race=True, schedules=['forward']):
        selftest.get_function('atomics_around_volatile_reads')((1,), (4,), (c,))
    assert c[0] == 2


def test_spin_wait_on_a_volatile_flag_is_race_free():
    code = '''extern "C" __global__ void k(int* out) {
      __shared__ volatile int flag;
      if (threadIdx.x == 0) flag = 0;     // shared memory starts as the previous block left it
      __syncthreads();
      if (threadIdx.x == 1) { flag = 7; __threadfence_block(); }
      if (threadIdx.x == 0) {
        while (flag != 7) __nanosleep(100);
        out[0] = flag;
      }
    }'''
    out = numpy.zeros(1, numpy.int32)
    with emulator.checking(race=True, schedules=['forward', 'random:5']):
        emulator.RawModule(code=code).get_function('k')((1,), (2,), (out,))
    assert out[0] == 7


# ---- what the unwritten-shared, barrier and UBSan checks must not report ----------------------

VALID = r'''
struct Best { double v; int i; };          // 4 bytes of tail padding, never written

extern "C" __global__ void argmax(const double* x, double* v, int* at) {
  __shared__ Best s[64];
  s[threadIdx.x].v = x[threadIdx.x];
  s[threadIdx.x].i = threadIdx.x;
  __syncthreads();
  for (int d = 32; d; d >>= 1) {
    if (threadIdx.x < d) {
      Best o = s[threadIdx.x + d];         // a whole-struct copy reads the padding
      if (o.v > s[threadIdx.x].v) s[threadIdx.x] = o;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) { v[0] = s[0].v; at[0] = s[0].i; }
}

extern "C" __global__ void cleared_then_counted(const int* bins, int* out) {
  __shared__ int counts[64];
  __shared__ unsigned flag;
  if (threadIdx.x == 0) { memset(counts, 0, sizeof counts); atomicExch(&flag, 5u); }
  __syncthreads();
  atomicAdd(&counts[bins[threadIdx.x]], 1);
  __syncthreads();
  int copy[2];
  if (threadIdx.x == 0) memcpy(copy, counts, sizeof copy);
  if (threadIdx.x == 0) out[64] = copy[0] + copy[1] + (int)flag;
  out[threadIdx.x] = counts[threadIdx.x];
}

extern "C" __global__ void gpu_arithmetic(const int* a, int* out) {
  int w = a[0];
  atomicAdd(&out[0], w);                   // wraps, as on a GPU
  out[1] = __mul24(a[1], a[2]);
  out[2] = (int)__umul24((unsigned)a[1], (unsigned)a[2]);
  out[3] = a[3] << 3;                      // a negative value shifted left: C++20 and GPUs agree
}

extern "C" __global__ void counts_unwritten(int* out) {
  __shared__ int n;
  atomicAdd(&n, 1);                        // n was never set
  __syncthreads();
  out[threadIdx.x] = n;
}
'''


@pytest.fixture(scope='module')
def valid():
    return emulator.RawModule(code=VALID)


def test_a_struct_copy_reads_its_unwritten_padding_without_complaint(valid):
    x = numpy.random.RandomState(0).randn(64)
    v, at = numpy.zeros(1), numpy.zeros(1, numpy.int32)
    with emulator.checking(race=True, schedules=['forward', 'random:3']):
        valid.get_function('argmax')((1,), (64,), (x, v, at))
    assert v[0] == x.max() and at[0] == x.argmax()


def test_memset_memcpy_and_atomic_exchange_count_as_writes(valid):
    bins = numpy.arange(64, dtype=numpy.int32) % 8
    out = numpy.zeros(65, numpy.int32)
    valid.get_function('cleared_then_counted')((2,), (64,), (bins, out))
    assert (out[:8] == 8).all() and (out[8:64] == 0).all() and out[64] == 16 + 5


def test_gpu_arithmetic_is_not_reported(valid):
    a = numpy.array([2 ** 31 - 1, 0x7fffff, -3, -1], numpy.int32)
    out = numpy.array([2 ** 31 - 1, 0, 0, 0], numpy.int32)
    valid.get_function('gpu_arithmetic')((1,), (1,), (a, out))
    assert out[0] == -2                                     # 2**31 - 1 twice, wrapped
    assert out[1] == numpy.int32(numpy.int64(0x7fffff) * -3 & 0xffffffff)     # 24-bit operands
    a[2] = 0x1000003                                        # bit 24 and above are ignored
    valid.get_function('gpu_arithmetic')((1,), (1,), (a, out))
    assert out[1] == 0x7fffff * 3 and out[2] == 0x7fffff * 3 and out[3] == -8


def test_an_atomic_on_unwritten_shared_memory_is_reported_at_the_kernels_line(valid):
    out = numpy.zeros(32, numpy.int32)
    with pytest.raises(KernelLaunchError, match=r"kernel 'counts_unwritten': an atomic access of 4 "
                                                r"bytes at offset 0 of __shared__ variable 'n' .*"
                                                r"\(at <string>:\d+\) reads bytes no thread"):
        valid.get_function('counts_unwritten')((1,), (32,), (out,))


def test_a_memset_past_a_shared_array_is_caught():
    code = '''extern "C" __global__ void k(int* out) {
      __shared__ int s[8];
      memset(s, 0, 9 * sizeof(int));
      out[0] = s[0];
    }'''
    with pytest.raises(KernelLaunchError, match=r"__shared__ variable 's'"):
        emulator.RawModule(code=code).get_function('k')((1,), (1,), (numpy.zeros(1, 'i'),))


# ---- fences and volatile: a volatile access orders nothing ---------------------------------------
# The programming guide's last-block sum (its __threadfence() example) written four ways: partial
# sums stored through a volatile or a plain pointer, with or without the fence between the store
# and the ticket. The last block reads them through a volatile pointer, with no fence after its
# ticket, as the guide does (a volatile read goes to L2: the atomic that saw the release orders it).
LAST_BLOCK = r'''
template <bool Fence, typename P>
__device__ void guide(const float* x, P* partial, unsigned* count, float* out, int n) {
  __shared__ bool last;
  if (threadIdx.x == 0) {
    float v = 0.0f;
    for (int i = blockIdx.x; i < n; i += gridDim.x) v += x[i];
    partial[blockIdx.x] = v;
    if (Fence) __threadfence();
    last = atomicInc(count, gridDim.x) == gridDim.x - 1;
  }
  __syncthreads();
  if (last && threadIdx.x == 0) {
    volatile P* vp = partial;
    float total = 0.0f;
    for (unsigned b = 0; b < gridDim.x; ++b) total += vp[b];
    out[0] = total;
    *count = 0;
  }
}
extern "C" __global__ void volatile_fenced(const float* x, volatile float* p, unsigned* c, float* o,
                                           int n) { guide<true>(x, p, c, o, n); }
extern "C" __global__ void volatile_unfenced(const float* x, volatile float* p, unsigned* c, float* o,
                                             int n) { guide<false>(x, p, c, o, n); }
extern "C" __global__ void plain_fenced(const float* x, float* p, unsigned* c, float* o, int n) {
  guide<true>(x, p, c, o, n);
}
extern "C" __global__ void plain_unfenced(const float* x, float* p, unsigned* c, float* o, int n) {
  guide<false>(x, p, c, o, n);
}

// Block 0 publishes data[0..32) and raises a volatile flag; block 1 spins on the flag, then reads
// the data (message passing through a volatile flag instead of an atomic).
template <bool WriterFence, bool ReaderFence, typename D>
__device__ void message(D* data, volatile unsigned* flag, float* out) {
  if (blockIdx.x == 0) {
    data[threadIdx.x] = 1.0f + threadIdx.x;
    __syncthreads();
    if (threadIdx.x == 0) {
      if (WriterFence) __threadfence();
      *flag = 1u;
    }
  } else {
    if (threadIdx.x == 0) {
      while (*flag == 0u) __nanosleep(100);
      if (ReaderFence) __threadfence();
    }
    __syncthreads();
    out[threadIdx.x] = data[threadIdx.x];
  }
}
extern "C" __global__ void flag_volatile_data(volatile float* d, volatile unsigned* f, float* o) {
  message<true, false>(d, f, o);
}
extern "C" __global__ void flag_volatile_data_unfenced(volatile float* d, volatile unsigned* f,
                                                       float* o) {
  message<false, false>(d, f, o);
}
extern "C" __global__ void flag_plain_data(float* d, volatile unsigned* f, float* o) {
  message<true, true>(d, f, o);
}
extern "C" __global__ void flag_plain_data_unfenced(float* d, volatile unsigned* f, float* o) {
  message<false, true>(d, f, o);
}
'''


@pytest.fixture(scope='module')
def last_block():
    return emulator.RawModule(code=LAST_BLOCK)


def _last_block_sum(last_block, name, blocks):
    x = numpy.arange(1000, dtype=numpy.float32) % 7
    partial, count, out = numpy.zeros(blocks, numpy.float32), numpy.zeros(1, numpy.uint32), \
        numpy.zeros(1, numpy.float32)
    last_block.get_function(name)((blocks,), (64,), (x, partial, count, out, numpy.int32(x.size)))
    assert out[0] == x.sum() and count[0] == 0


@pytest.mark.parametrize('kernel', ['volatile_fenced', 'plain_fenced'])
@pytest.mark.parametrize('blocks', [1, 7])
def test_the_guides_last_block_sum_with_its_fence_passes(last_block, kernel, blocks):
    # plain_fenced (a plain store, the volatile read after the ticket) was reported as a race
    with emulator.checking(**RACE):
        _last_block_sum(last_block, kernel, blocks)


def test_the_guides_volatile_last_block_sum_without_its_fence_is_a_stale_read(last_block):
    # Volatile stores and volatile loads never race with each other, so this passed: but without
    # the fence a GPU may let the ticket be seen before the partial sum it announces.
    _last_block_sum(last_block, 'volatile_unfenced', 7)         # right here, in one order
    with emulator.checking(**RACE):
        with pytest.raises(KernelLaunchError, match=(
                r"kernel 'volatile_unfenced': stale read: a volatile read of argument 1 \(float\*, "
                r"float32 array of shape \(7,\)\) at byte offset \d+ \(element \d of 7\) by thread "
                r"\(0,0,0\) of block \(\d,0,0\) \(at <string>:\d+\) may return the value from before "
                r"the volatile write by thread \(0,0,0\) of block \(\d,0,0\) \(at <string>:\d+\): "
                r"that block announced the write afterwards through argument 2 \(unsigned int\*, "
                r"uint32 array of shape \(1,\)\) at byte offset 0 .* no __threadfence\(\) between "
                r"the write and that announcement")):
            _last_block_sum(last_block, 'volatile_unfenced', 7)


def test_the_guides_plain_last_block_sum_without_its_fence_is_a_race(last_block):
    with emulator.checking(**RACE):
        with pytest.raises(KernelLaunchError, match=r"kernel 'plain_unfenced': data race on "
                                                    r"argument 1 .* a volatile read by .* and an "
                                                    r"earlier write by .* in different blocks"):
            _last_block_sum(last_block, 'plain_unfenced', 7)


def _message(last_block, name):
    data, flag, out = numpy.zeros(32, numpy.float32), numpy.zeros(1, numpy.uint32), \
        numpy.zeros(32, numpy.float32)
    # both blocks live at once: random schedules only (the reader spins)
    with emulator.checking(race=True, schedules=['random:1', 'random:2', 'random:3']):
        last_block.get_function(name)((2,), (32,), (data, flag, out))
    assert (out == 1 + numpy.arange(32)).all()


@pytest.mark.parametrize('kernel', ['flag_volatile_data', 'flag_plain_data'])
def test_a_fence_then_a_volatile_flag_releases(last_block, kernel):
    # flag_plain_data (fence, volatile store; volatile spin, fence) was reported as a race: only
    # an atomic released
    _message(last_block, kernel)


def test_a_volatile_flag_without_a_fence_publishes_nothing(last_block):
    with pytest.raises(KernelLaunchError, match=r"kernel 'flag_volatile_data_unfenced': stale "
                                                r"read: a volatile read of argument 0 .* announced "
                                                r"the write afterwards through argument 1 "):
        _message(last_block, 'flag_volatile_data_unfenced')
    with pytest.raises(KernelLaunchError, match=r"kernel 'flag_plain_data_unfenced': data race on "
                                                r"argument 0 "):
        _message(last_block, 'flag_plain_data_unfenced')


# ---- __restrict__ and the read-only cache --------------------------------------------------------
RESTRICT = r'''
extern "C" __global__ void scale(const float* __restrict__ x, float* __restrict__ y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = 2.0f * x[i];
}
extern "C" __global__ void scale_plain(const float* x, float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = 2.0f * x[i];
}
// mode 0 touches only a (the same array given for b is never accessed through b)
extern "C" __global__ void add_to(float* __restrict__ a, float* __restrict__ b, int n, int mode) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  if (mode == 0) a[i] += 1.0f;
  else a[i] = b[i] + 1.0f;
}
// Each thread writes its element, then (after a barrier) loads its neighbour's through __ldg.
extern "C" __global__ void ldg_after_write(float* buf, float* out, int n) {
  const int i = threadIdx.x;
  buf[i] = (float)i;
  __syncthreads();
  out[i] = __ldg(&buf[(i + 1) % n]);
}
extern "C" __global__ void ldg_input(const float* in, float* out) {
  out[threadIdx.x] = __ldg(&in[threadIdx.x]) + __ldg(&in[(threadIdx.x + 1) % blockDim.x]);
}
'''


@pytest.fixture(scope='module')
def restrict_mod():
    return emulator.RawModule(code=RESTRICT)


def test_restrict_arguments_given_one_array_are_reported(restrict_mod):
    x = numpy.arange(40, dtype=numpy.float32)
    with pytest.raises(KernelLaunchError, match=(
            r"kernel 'scale': argument 0 \(const float\*, float32 array of shape \(40,\)\) and "
            r"argument 1 \(float\*, float32 array of shape \(40,\)\) are the same array, but both "
            r"are declared __restrict__ .*: byte offset 0 \(element 0 of 40\) is read through "
            r"argument 0 and written through argument 1 \(this access: a write in thread "
            r"\(0,0,0\) of block \(0,0,0\) \(at <string>:4\)\)")):
        restrict_mod.get_function('scale')((2,), (32,), (x, x, numpy.int32(40)))
    assert (x == numpy.arange(40)).all()              # a failed launch changes nothing
    with pytest.raises(KernelLaunchError, match=r"kernel 'add_to': argument 0 .* and argument 1 "
                                                r".* byte offset 0 \(element 0 of 40\) is written "
                                                r"through argument 0 and read through argument 1"):
        restrict_mod.get_function('add_to')((2,), (32,), (x, x, numpy.int32(40), numpy.int32(1)))


def test_one_array_for_restrict_arguments_is_fine_where_one_of_them_is_used(restrict_mod):
    x = numpy.arange(40, dtype=numpy.float32)
    with emulator.checking(**RACE):
        restrict_mod.get_function('add_to')((2,), (32,), (x, x, numpy.int32(40), numpy.int32(0)))
        assert (x == numpy.arange(40) + 1).all()
        y = numpy.zeros_like(x)
        restrict_mod.get_function('scale')((2,), (32,), (x, y, numpy.int32(40)))   # distinct
        assert (y == 2 * x).all()
        restrict_mod.get_function('scale_plain')((2,), (32,), (x, x, numpy.int32(40)))
        assert (x == 2 * (numpy.arange(40) + 1)).all()     # in place, without __restrict__
    with emulator.recording() as launches:
        restrict_mod.get_function('add_to')((2,), (32,), (x, x, numpy.int32(40), numpy.int32(0)))
    assert launches[0].of(x).reads == {4: 40} and launches[0].of(x).writes == {4: 40}


def test_an_ldg_of_bytes_the_launch_writes_is_reported(restrict_mod):
    buf, out = numpy.zeros(32, numpy.float32), numpy.zeros(32, numpy.float32)
    with pytest.raises(KernelLaunchError, match=(
            r"kernel 'ldg_after_write': byte offset \d+ \(element \d+ of 32\) of argument 0 "
            r"\(float\*, float32 array of shape \(32,\)\) is loaded through __ldg and also written "
            r"in this launch \(this access: a __ldg read in thread \(\d+,0,0\) of block \(0,0,0\) "
            r"\(at <string>:\d+\)\): the read-only non-coherent cache may return the value from "
            r"before the write")):
        restrict_mod.get_function('ldg_after_write')((1,), (32,), (buf, out, numpy.int32(32)))
    x, out = numpy.arange(32, dtype=numpy.float32), numpy.zeros(32, numpy.float32)
    restrict_mod.get_function('ldg_input')((1,), (32,), (x, out))      # read-only data: fine
    assert (out == x + numpy.roll(x, -1)).all()


def test_the_project_kernels_declare_restrict_parameters_where_the_emulator_sees_them():
    # the check reads the definitions: every kernel with a __restrict__ parameter is found
    for path, names in [('batchnorm.cu', ['bn_stats_partial', 'bn_apply', 'bn_backward_apply']),
                        ('pooling.cu', ['max_pool_forward', 'avg_pool_backward'])]:
        with open(os.path.join(kernels.kernel_dir(), path)) as f:
            code = f.read()
        for name in names:
            flags = emulator._restrict_params(code, name + '<float>')
            assert flags and 2 in flags and 1 in flags, (path, name, flags)


# ---- one __syncthreads() reached through two calls -------------------------------------------------
BARRIER_HELPERS = r'''
__device__ __noinline__ void stage(float* s, float v) {
  s[threadIdx.x] = v;
  __syncthreads();
}
__device__ inline void stage_inline(float* s, float v) {
  s[threadIdx.x] = v;
  __syncthreads();
}
// The two halves of the block call the helper from different places: one barrier line, two
// barriers (a GPU may let the halves pass each other, or hang).
extern "C" __global__ void helper_twice(float* out) {
  __shared__ float s[64];
  if (threadIdx.x < 32) {
    stage(s, 1.0f);
    out[threadIdx.x] = s[threadIdx.x ^ 1];
  } else {
    stage(s, 2.0f);
    out[threadIdx.x] = 2.0f * s[threadIdx.x ^ 1];
  }
}
extern "C" __global__ void inline_helper_twice(float* out) {
  __shared__ float s[64];
  if (threadIdx.x < 32) {
    stage_inline(s, 1.0f);
    out[threadIdx.x] = s[threadIdx.x ^ 1];
  } else {
    stage_inline(s, 2.0f);
    out[threadIdx.x] = 2.0f * s[threadIdx.x ^ 1];
  }
}
extern "C" __global__ void one_line(float* out) {
  __shared__ float s[64];
  s[threadIdx.x] = 1.0f;
  if (threadIdx.x < 32) { __syncthreads(); out[threadIdx.x] = s[threadIdx.x ^ 1]; } else { __syncthreads(); out[threadIdx.x] = 2.0f * s[threadIdx.x ^ 1]; }
}
// Every thread makes the same calls: fine, in a loop too.
extern "C" __global__ void helper_converged(float* out) {
  __shared__ float s[64];
  stage(s, threadIdx.x < 32 ? 1.0f : 2.0f);
  stage_inline(s, 3.0f);
  for (int k = 0; k < 3; ++k) stage(s, (float)k);
  stage(s, 5.0f);
  out[threadIdx.x] = s[threadIdx.x ^ 1];
}
// One barrier after a branch on a condition tested again after it: g++'s jump threading copied
// the barrier's call into both paths (turned off for kernel code), which read as two barriers.
extern "C" __global__ void branch_around_one_barrier(const float* x, float* out) {
  __shared__ float s[64];
  const int t = threadIdx.x;
  if (t < 32) s[t] = x[t] * 2.0f; else s[t] = 1.0f;
  __syncthreads();
  if (t < 32) out[t] = s[t + 1]; else out[t] = s[t - 1] + 1.0f;
}
'''


@pytest.fixture(scope='module')
def barrier_helpers():
    return emulator.RawModule(code=BARRIER_HELPERS)


@pytest.mark.parametrize('kernel,line,calls', [('helper_twice', 4, (18, 15)),
                                               ('inline_helper_twice', 8, (28, 25)),
                                               ('one_line', 35, (35, 35))])
def test_one_barrier_line_reached_through_two_calls_is_reported(barrier_helpers, kernel, line,
                                                                 calls):
    # barriers were told apart by source line only: the helper's line for both calls
    out = numpy.zeros(64, numpy.float32)
    with pytest.raises(KernelLaunchError, match=(
            r"kernel '{k}': threads of one block wait at two different __syncthreads\(\): this "
            r"thread at <string>:{l} reached through the call \(at <string>:({l} inlined in "
            r"<string>:)?{a}\), thread \(0,0,0\) of block \(0,0,0\) at <string>:{l} reached "
            r"through the call \(at <string>:({l} inlined in <string>:)?{b}\) \(one "
            r"__syncthreads\(\) in a function called from two places, or two on one line, in "
            r"divergent code").format(k=kernel, l=line, a=calls[0], b=calls[1])):
        barrier_helpers.get_function(kernel)((1,), (64,), (out,))


def test_one_barrier_line_reached_through_the_same_calls_passes(barrier_helpers):
    out = numpy.zeros(64, numpy.float32)
    with emulator.checking(**RACE):
        barrier_helpers.get_function('helper_converged')((1,), (64,), (out,))
    assert (out == 5).all()
    x = numpy.arange(64, dtype=numpy.float32)
    with emulator.checking(**RACE):
        barrier_helpers.get_function('branch_around_one_barrier')((1,), (64,), (x, out))
    s = numpy.where(numpy.arange(64) < 32, 2 * x, 1)
    assert (out == numpy.where(numpy.arange(64) < 32, numpy.roll(s, -1), numpy.roll(s, 1) + 1)).all()
