"""GradientAllreduce on the host without mpiexec: a stand-in communicator of 3 ranks that all
hold the same buffer, so each MPI call sees what a real one would (the sum is 3 times it)."""
import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer)

from chainer_tc.multinode import allreduce


class ThreeRanks:
    """mpi_comm.Allreduce(IN_PLACE, buf): buf *= 3, as three ranks with equal buffers sum."""

    size, rank = 3, 0

    def __init__(self):
        self.sizes = []
        self.mpi_comm = self

    def Allreduce(self, sendbuf, recvbuf):
        from mpi4py import MPI
        assert sendbuf is MPI.IN_PLACE
        assert recvbuf.flags.c_contiguous
        self.sizes.append(recvbuf.size)
        recvbuf *= recvbuf.dtype.type(3)


@pytest.mark.parametrize('dtypes', [('float32',), ('float16', 'float32'), ('float64',)])
def test_the_host_mean_goes_in_segments_and_is_the_mean(monkeypatch, dtypes):
    """One 100 MB Allreduce ran out of cache (3.4x slower than 4 MiB calls): the buffer goes in
    segments, each divided as it comes back; one reduction per step all the same."""
    monkeypatch.setattr(allreduce, 'HOST_SEGMENT_BYTES', 1024)
    r = numpy.random.RandomState(0)
    buffers = [(r.randn(n) * 8).astype(d) for n, d in zip((1000, 333), dtypes)]
    want = [b.astype(numpy.float64) for b in buffers]
    comm = ThreeRanks()
    reduce = allreduce.GradientAllreduce(comm)
    reduce(buffers)
    for b, w in zip(buffers, want):
        numpy.testing.assert_allclose(b, w, rtol=1e-3 if b.dtype == numpy.float16 else 1e-6)
    work = sum(b.size for b in buffers)
    itemsize = 8 if 'float64' in dtypes else 4
    per_call = 1024 // itemsize
    assert comm.sizes == [min(per_call, work - i) for i in range(0, work, per_call)]
    assert reduce.collectives == 1 and reduce.calls == len(comm.sizes) > 1


class Recording(ThreeRanks):
    """ThreeRanks that keeps every buffer MPI was given (so none is freed and re-used)."""

    def __init__(self):
        super().__init__()
        self.bases = []

    def Allreduce(self, sendbuf, recvbuf):
        self.bases.append(recvbuf.base if recvbuf.base is not None else recvbuf)
        super().Allreduce(sendbuf, recvbuf)


def test_a_work_buffer_stays_the_same_array_after_calls_of_other_sizes():
    """A CUDA graph captured around a call reads and writes the work buffer by address; a call
    with another size or dtype (the untrained parameters' reduction) replaced it, freeing the
    buffer the graph still used. Each (size, dtype) keeps its buffer for the object's lifetime.
    Found by review."""
    comm = Recording()
    reduce = allreduce.GradientAllreduce(comm)
    mixed = [numpy.ones(10, numpy.float16), numpy.ones(6, numpy.float32)]
    other = [numpy.ones(3, numpy.float16), numpy.ones(4, numpy.float32)]
    wide = [numpy.ones(10, numpy.float16), numpy.ones(6, numpy.float64)]
    for buffers in (mixed, other, wide, mixed, other):
        reduce(buffers)
    first, second, third, fourth, fifth = comm.bases
    assert first.size == 16 and second.size == 7 and third.dtype == numpy.float64
    assert fourth is first and fifth is second, 'the same work buffer for the same size'
    assert len({id(first), id(second), id(third)}) == 3
    for b in mixed + other:
        assert (b == 1).all()                       # the mean of three equal buffers


@pytest.mark.gpu
def test_a_gpu_work_buffer_keeps_its_address_after_calls_of_other_sizes():
    """The same on the GPU, where it matters: the buffer's device address is what a captured
    graph holds."""
    import cupy
    reduce = allreduce.GradientAllreduce(ThreeRanks())
    seen = []

    def record(work, on_gpu):
        seen.append(work)
        work *= work.dtype.type(1)
    reduce._allreduce = record
    mixed = [cupy.ones(10, cupy.float16), cupy.ones(6, cupy.float32)]
    other = [cupy.ones(3, cupy.float16), cupy.ones(4, cupy.float32)]
    for buffers in (mixed, other, mixed):
        reduce(buffers)
    assert seen[2] is seen[0] and seen[2].data.ptr == seen[0].data.ptr
    assert seen[1].data.ptr != seen[0].data.ptr
