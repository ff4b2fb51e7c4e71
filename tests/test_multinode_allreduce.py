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
