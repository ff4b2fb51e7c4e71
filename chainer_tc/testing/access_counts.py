"""What an emulated launch did to each array it touched: its loads, stores and atomics counted by
width, and the bytes they moved.

``with emulator.recording() as launches:`` gives a list that gets one :class:`Launch` per launch
made inside the block. The counts come from the emulator's instrumentation (every access of the
kernel's code to global and shared memory, the first schedule's run only), so they show what the
kernel's code does, not what a GPU's caches make of it:

- whether a kernel takes its vector path: a ``float2`` load of a ``float`` array is an 8-byte
  read, so ``launch.of(x).reads == {8: n // 2}`` says every element was read in pairs;
- the bytes a kernel moves against the bytes it must move (each input read once, each output
  written once), the proxy ``docs/performance.md`` uses for memory-bound kernels;
- shared memory traffic, for the launch as a whole (``launch.shared``).

An access the compiler splits (a ``float4`` copied member by member) is counted as it is made;
``memcpy`` in kernel code is not seen at all (docs/emulator.md, "Limits").
"""
import contextlib
import threading

import numpy

# the runtime's layout (emu_runtime.cpp: count_access): reads, writes, atomics; for each the
# accesses of 1, 2, 4, 8, 16 bytes and of any other size, then the bytes
PER_REGION = 21
_SIZES = (1, 2, 4, 8, 16, None)
_recorders = threading.local()      # .stack: the lists recording() hands out in this thread


class Access:
    """One array's accesses in one launch. ``reads``, ``writes`` and ``atomics`` map an access's
    width in bytes to how many there were (``None``: any other width, e.g. a struct copy);
    ``bytes_read``, ``bytes_written`` and ``bytes_atomic`` are their bytes."""

    def __init__(self, what, array, address, nbytes, row):
        self.what = what
        #: the NumPy array passed as the argument (None for a pointer table's target)
        self.array = array
        self.address = address
        self.nbytes = nbytes
        #: for an argument passing the same array as an earlier one: that argument's index (the
        #: counts are the array's, shown under both)
        self.same_as = None
        kinds = []
        for k in range(3):
            part = row[k * 7:(k + 1) * 7]
            kinds.append(({s: int(c) for s, c in zip(_SIZES, part[:6]) if c}, int(part[6])))
        (self.reads, self.bytes_read), (self.writes, self.bytes_written), \
            (self.atomics, self.bytes_atomic) = kinds

    def __repr__(self):
        return '<{} of {} bytes: reads {} ({} B), writes {} ({} B), atomics {}>'.format(
            self.what, self.nbytes, self.reads, self.bytes_read, self.writes, self.bytes_written,
            self.atomics)


class Launch:
    """The counts of one launch: ``arrays`` (an :class:`Access` per array argument and per
    allocation a pointer table pointed into) and ``shared`` (all shared memory of all blocks)."""

    def __init__(self, kernel, grid, block, arrays, shared):
        self.kernel = kernel
        self.grid = tuple(grid)
        self.block = tuple(block)
        self.arrays = arrays
        self.shared = shared

    def of(self, array):
        """The :class:`Access` of the allocation that holds ``array`` (an argument itself, or an
        array that a pointer table pointed into); KeyError if the launch had none."""
        for a in self.arrays:
            if a.array is array:
                return a
        start = array.__array_interface__['data'][0]
        for a in self.arrays:
            if a.address <= start < a.address + max(a.nbytes, 1):
                return a
        raise KeyError('kernel {} had no array at address {:#x} (of {})'.format(
            self.kernel, start, [a.what for a in self.arrays]))

    @property
    def bytes_moved(self):
        """Bytes read, written and atomically updated in global memory (shared memory not
        included)."""
        return sum(a.bytes_read + a.bytes_written + a.bytes_atomic for a in self.arrays
                   if a.same_as is None)

    def __repr__(self):
        return '<launch of {} {}x{}: {} arrays, {} bytes moved>'.format(
            self.kernel, self.grid, self.block, len(self.arrays), self.bytes_moved)


@contextlib.contextmanager
def recording():
    """Within this block every emulated launch of this thread is counted: yields a list that
    gets one :class:`Launch` per successful launch, in order."""
    if not hasattr(_recorders, 'stack'):
        _recorders.stack = []
    launches = []
    _recorders.stack.append(launches)
    try:
        yield launches
    finally:
        _recorders.stack.pop()


def active():
    """Whether a recording() block is open in this thread."""
    return bool(getattr(_recorders, 'stack', None))


def buffer(nrows):
    """The zeroed uint64 array the runtime fills for a launch with ``nrows`` rows."""
    return numpy.zeros(nrows * PER_REGION, numpy.uint64)


def record(kernel, grid, block, args, arrays, targets, counts):
    """Hand the counts of a finished launch to every open recording(): ``args`` the launch's
    arguments, ``arrays`` per argument None for a value (a scalar, a struct) or the argument
    whose row counts its array (itself, or the first argument passing the same array),
    ``targets`` its table targets as (host address, bytes, argument or -1)."""
    rows = counts.reshape(-1, PER_REGION)
    accesses = []
    for i, (a, row) in enumerate(zip(args, arrays)):
        if row is not None:
            access = Access('argument {}'.format(i), a, a.__array_interface__['data'][0],
                            a.nbytes, rows[row])
            if row != i:
                access.same_as = row
            accesses.append(access)
    for t, (address, nbytes, arg) in enumerate(targets):
        if arg < 0:
            accesses.append(Access('table target {:#x}'.format(address), None, address, nbytes,
                                   rows[len(args) + t]))
    shared = Access('shared memory', None, 0, 0, rows[-1])
    launch = Launch(kernel, grid, block, accesses, shared)
    for launches in _recorders.stack:
        launches.append(launch)
