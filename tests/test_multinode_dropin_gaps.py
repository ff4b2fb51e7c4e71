"""What ChainerMN users do with its pieces, done with chainer_tc.multinode (found by an audit of
the multi-node drop-ins): the multi-node BatchNorm takes L.BatchNormalization's initial running
statistics, also through create_mnbn_model on a lazy link; an evaluation over no image gives {}
as Chainer's; a (value, weight) pair of weight 0 adds nothing (it made 0 / 0); ranks whose
models differ in their parameters fail alike in a broadcast (one rank used to wait forever).
One process (COMM_SELF) but the last, on two MPI ranks."""
import os
import subprocess
import sys
import warnings

import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer)
import chainer
import chainermn
from mpi4py import MPI

from chainer_tc import dali
from chainer_tc import links as TL
from chainer_tc import multinode


def comm():
    return chainermn.create_communicator('naive', MPI.COMM_SELF)


@pytest.mark.parametrize('lazy', [False, True])
def test_initial_running_statistics_are_taken_as_by_batch_normalization(lazy):
    """MultiNodeBatchNormalization refused initial_avg_mean / initial_avg_var (a TypeError,
    where the docs promise TL.BatchNormalization's arguments), and create_mnbn_model dropped
    them from a lazy link (zeros and ones in test mode)."""
    x = numpy.random.RandomState(0).randn(2, 3, 3, 4).astype(numpy.float32)
    size = None if lazy else 4
    made = multinode.MultiNodeBatchNormalization(size, comm(), initial_avg_mean=3.0,
                                                 initial_avg_var=numpy.full(4, 2.0))
    converted = multinode.create_mnbn_model(
        TL.BatchNormalization(size, initial_avg_mean=3.0, initial_avg_var=numpy.full(4, 2.0)),
        comm())
    reference = TL.BatchNormalization(size, initial_avg_mean=3.0,
                                      initial_avg_var=numpy.full(4, 2.0))
    with chainer.using_config('train', False):
        want = reference(x).array
        for link in (made, converted):
            numpy.testing.assert_allclose(link(x).array, want, rtol=1e-6)
            assert (link.avg_mean.tolist(), link.avg_var.tolist()) == ([3.0] * 4, [2.0] * 4)


class Pairs(chainer.Link):
    """Reports a (value, weight) pair whose weight is 0 in every batch, and one whose weight
    is 0 in some."""

    def forward(self, x):
        n = len(x)
        chainer.report({'never': (5.0, 0), 'odd': (1.0, n % 2),
                        'np': (2.0, numpy.float32(0.0))}, self)


def test_a_pair_of_weight_zero_adds_nothing_and_a_key_only_such_batches_report_is_absent():
    data = numpy.zeros((7, 1), numpy.float32)
    for make in (lambda it: dali.Evaluator(it, Pairs()),
                 lambda it: multinode.Evaluator(it, Pairs(), comm())):
        it = chainer.iterators.SerialIterator(data, 2, repeat=False, shuffle=False)
        assert make(it)() == {'main/odd': 1.0}


class Empty(chainer.dataset.Iterator):
    """An empty shard (a SerialIterator over no data divides by zero)."""

    def reset(self):
        pass

    def __next__(self):
        raise StopIteration


def test_an_evaluation_over_no_image_gives_an_empty_result_as_chainer_s():
    """It raised a RuntimeError; Chainer's and ChainerMN's evaluators give {}."""
    it = Empty()
    with pytest.warns(RuntimeWarning, match='no rank evaluated any image'):
        assert multinode.Evaluator(it, Pairs(), comm())() == {}


def test_ranks_whose_models_differ_fail_alike_in_a_broadcast(tmp_path):
    """A lazy link only rank 0 called: ChainerMN's broadcast (and ours) failed on one rank
    (MPI_ERR_TRUNCATE) while the other waited for ever. Both ranks now raise one ValueError
    naming the parameter."""
    script = tmp_path / 'ranks.py'
    script.write_text('''
import sys
import numpy
import chainer_tc
import chainer, chainer.links as L, chainermn
from chainer_tc import multinode
comm = chainermn.create_communicator('naive')
model = chainer.Chain()
with model.init_scope():
    model.fc = L.Linear(3, 2)
    model.head = L.Linear(None, 2)
if comm.rank == 0:
    model.head(numpy.zeros((1, 4), numpy.float32))
try:
    multinode.bcast_data(comm, model)
except ValueError as e:
    print('rank', comm.rank, 'raised:', e, flush=True)
''')
    mpiexec = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    p = subprocess.run([mpiexec, '--allow-run-as-root', '--oversubscribe', '-n', '2',
                        sys.executable, str(script)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    said = sorted(line for line in p.stdout.splitlines() if 'raised:' in line)
    assert len(said) == 2, p.stdout
    for line in said:
        assert ("raised: bcast_data: the ranks' models differ in their initialised parameters "
                '(rank 1 lacks /head/W (2, 4) float32 and has none more than rank 0)') in line
