"""The small collectives of the multi-node BatchNormalization: gather and sum a few numbers per
channel over the ranks of a ChainerMN communicator.

    backend = collectives.backend(comm, 'auto')          # 'nccl' or 'mpi'
    everyone = collectives.allgather(comm, summary, backend)   # (ranks,) + summary.shape
    collectives.allreduce_sum(comm, sums, backend)             # in place

Where the arrays go:

- NumPy arrays: MPI on the host (mpi4py's ``Allgather`` / ``Allreduce`` on contiguous buffers),
  whatever the backend. MPI has no float16 type: the arrays here are float32 or float64 (the
  statistics' accumulation dtype), and a float16 array is refused.
- CuPy arrays with the ``'nccl'`` backend (``chainermn.create_communicator('pure_nccl')``):
  NCCL's allGather / allReduce on the current CUDA stream, no host synchronisation, capturable
  in a CUDA graph.
- CuPy arrays with the ``'mpi'`` backend (any other communicator): a copy to the host (which
  waits for the GPU), MPI, a copy back; a PerformanceWarning says so once per process.

:func:`allgather_objects` exchanges small Python values on the host (``mpi_comm.allgather``):
the row counts, which every rank needs on the host before any collective on the data.

A step can record its host exchanges and a later run of the same step can replay them without
communicating (:func:`recording_exchanges`, :func:`replaying_exchanges`): multinode.TrainStep
does so while it captures a step into a CUDA graph, so that a capture failing on one rank only,
halfway, leaves no rank waiting in an exchange the failed rank will not make, and in its CPU
replays.
"""
import contextlib
import copy
import pickle
import threading
import warnings

import numpy

import chainer

BACKENDS = ('auto', 'mpi', 'nccl')

_warned_host_copies = []        # one warning per process


def has_nccl(comm):
    """Whether ``comm`` carries an NCCL communicator (ChainerMN's ``pure_nccl``: its
    ``nccl_comm`` attribute, created at first use)."""
    return hasattr(comm, 'nccl_comm')


def backend(comm, communication_backend='auto'):
    """'nccl' or 'mpi' for ``communication_backend`` in ('auto', 'mpi', 'nccl'): 'auto' is
    'nccl' for a communicator with NCCL (``pure_nccl``), else 'mpi'; 'nccl' needs such a
    communicator. ValueError naming the argument otherwise (ChainerMN's own check, worded
    here)."""
    if not isinstance(communication_backend, str) or communication_backend not in BACKENDS:
        raise ValueError("communication_backend: expected 'auto', 'mpi' or 'nccl'; got {!r}"
                         .format(communication_backend))
    if communication_backend == 'auto':
        return 'nccl' if has_nccl(comm) else 'mpi'
    if communication_backend == 'nccl' and not has_nccl(comm):
        raise ValueError("communication_backend='nccl' needs a communicator with NCCL "
                         "(chainermn.create_communicator('pure_nccl')); got {}"
                         .format(type(comm).__name__))
    return communication_backend


def allgather_objects(comm, value):
    """[value of rank 0, value of rank 1, ...] on every rank (small picklable values). Within
    :func:`replaying_exchanges` for ``comm``: the recorded result, with no exchange."""
    tape = getattr(_tapes, 'current', None)
    if tape is not None and tape.mpi_comm is getattr(comm, 'mpi_comm', None):
        return tape.exchange(comm, value)
    return _allgather_objects(comm, value)


def _allgather_objects(comm, value):
    if comm.size == 1:
        return [value]
    return comm.mpi_comm.allgather(value)


class ExchangeChanged(RuntimeError):
    """A replay of recorded host exchanges was asked for one the recording does not hold (this
    rank's value differs, or one more exchange than recorded)."""


class _Tape:
    def __init__(self, comm, recorded):
        # (two ChainerMN communicators made over one MPI communicator share its object)
        self.mpi_comm = comm.mpi_comm
        self.recording = recorded is None
        self.entries = [] if recorded is None else recorded
        self.next = 0

    def exchange(self, comm, value):
        # compared as MPI sends them, pickled (an array's == is no bool)
        mine = pickle.dumps(value)
        if self.recording:
            result = _allgather_objects(comm, value)
            self.entries.append((mine, copy.deepcopy(value), copy.deepcopy(result)))
            return result
        i = self.next
        if i == len(self.entries):
            raise ExchangeChanged(
                'host exchange {} of this step: the recorded step made {} (this rank gives {!r})'
                .format(i + 1, i, value))
        sent, recorded, result = self.entries[i]
        if sent != mine:
            raise ExchangeChanged(
                'host exchange {} of this step: this rank gives {!r}, it gave {!r} in the '
                'recorded step'.format(i + 1, value, recorded))
        self.next = i + 1
        return list(result)         # a new list, as an exchange gives (its values shared)


_tapes = threading.local()


@contextlib.contextmanager
def _using(tape):
    outer = getattr(_tapes, 'current', None)
    _tapes.current = tape
    try:
        yield tape.entries
    finally:
        _tapes.current = outer


def recording_exchanges(comm):
    """A context: every :func:`allgather_objects` on ``comm`` (or on another communicator
    over ``comm.mpi_comm``) made within it, in this thread, is made as usual and recorded; the
    context's value is the list of records (this rank's value, pickled and as it was, and the
    result), for :func:`replaying_exchanges`."""
    return _using(_Tape(comm, None))


def replaying_exchanges(comm, recorded):
    """A context: the i-th :func:`allgather_objects` on ``comm`` (or on another communicator
    over ``comm.mpi_comm``) within it, in this thread, makes no exchange and returns the i-th
    ``recorded`` result (a new list of the recorded values: read them, do not change them),
    where this rank's value is the one it gave then; else it raises :class:`ExchangeChanged`.
    Where every rank replays the records of one recorded step (multinode.TrainStep's ranks
    agree on each step), each result is what the exchange would give: every rank checked that
    its own part is the same. A rank that stops midway (a failed capture) leaves no other rank
    waiting for it."""
    return _using(_Tape(comm, recorded))


def allgather(comm, array, backend_name):
    """The ``array`` of every rank, stacked in rank order: shape ``(comm.size,) +
    array.shape``, on ``array``'s device, identical on every rank."""
    xp = chainer.backend.get_array_module(array)
    out = xp.empty((comm.size,) + array.shape, array.dtype)
    if comm.size == 1:
        out[0] = array
        return out
    if xp is numpy:
        _check_mpi_dtype(array)
        comm.mpi_comm.Allgather(numpy.ascontiguousarray(array), out)
        return out
    array = xp.ascontiguousarray(array)
    if backend_name == 'nccl':
        return nccl_allgather(comm, array, out)
    host = _to_host(array)
    gathered = numpy.empty(out.shape, host.dtype)
    comm.mpi_comm.Allgather(host, gathered)
    out.set(gathered)
    return out


def allreduce_sum(comm, array, backend_name):
    """``array`` (C-contiguous) replaced in place by its sum over the ranks."""
    if comm.size == 1:
        return array
    xp = chainer.backend.get_array_module(array)
    if not array.flags.c_contiguous:
        raise ValueError('allreduce_sum: the array must be C-contiguous (it is summed in place)')
    from mpi4py import MPI
    if xp is numpy:
        _check_mpi_dtype(array)
        comm.mpi_comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
        return array
    if backend_name == 'nccl':
        return nccl_allreduce_sum(comm, array)
    host = _to_host(array)
    comm.mpi_comm.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM)
    array.set(host)
    return array


def nccl_allgather(comm, array, out):
    """NCCL's allGather of the contiguous CuPy ``array`` into ``out`` (``(comm.size,) +
    array.shape``) on the current stream (even on one rank: no shortcut here)."""
    import cupy
    nccl_comm, kind = _nccl(comm, array.dtype)
    nccl_comm.allGather(array.data.ptr, out.data.ptr, array.size, kind,
                        cupy.cuda.get_current_stream().ptr)
    return out


def nccl_allreduce_sum(comm, array):
    """NCCL's in-place allReduce (sum) of the contiguous CuPy ``array`` on the current stream
    (even on one rank: no shortcut here)."""
    import cupy
    from cupy.cuda import nccl
    nccl_comm, kind = _nccl(comm, array.dtype)
    nccl_comm.allReduce(array.data.ptr, array.data.ptr, array.size, kind, nccl.NCCL_SUM,
                        cupy.cuda.get_current_stream().ptr)
    return array


def _check_mpi_dtype(array):
    if array.dtype not in (numpy.float32, numpy.float64):
        raise TypeError('MPI collectives here take float32 or float64 arrays (MPI has no '
                        'float16); got {}'.format(array.dtype))


def _nccl(comm, dtype):
    from cupy.cuda import nccl
    if getattr(comm, 'nccl_comm', None) is None and hasattr(comm, '_init_comms'):
        comm._init_comms()
    kind = {numpy.dtype(numpy.float32): nccl.NCCL_FLOAT32,
            numpy.dtype(numpy.float64): nccl.NCCL_FLOAT64}.get(numpy.dtype(dtype))
    if kind is None:
        raise TypeError('NCCL collectives here take float32 or float64 arrays; got {}'
                        .format(dtype))
    return comm.nccl_comm, kind


def _to_host(array):
    if not _warned_host_copies:
        _warned_host_copies.append(True)
        warnings.warn('multi-node BatchNormalization on GPU arrays without NCCL: the statistics '
                      'and gradient sums of every layer go through the host for MPI (each '
                      'copy waits for the GPU); use chainermn.create_communicator('
                      "'pure_nccl')", chainer.warnings.PerformanceWarning, stacklevel=4)
    return numpy.ascontiguousarray(array.get())
