"""TrainStep: a replayed training step gives the same bits as eager steps, follows what changes
between iterations (lr, loss scale, skipped steps, BatchNorm statistics, frozen links), re-traces
on a new signature, refuses what it cannot replay, and works inside a Trainer."""
import contextlib
import copy
import tracemalloc
import warnings

import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer)
import chainer
import chainer.functions as F
import chainer.links as L
from chainer import serializers
from chainer import training
from chainer.training import extensions

from chainer_tc import links as TL
from chainer_tc import optimizers
from chainer_tc.models import ResNet50
from chainer_tc.static_graph import TrainStep
from chainer_tc.static_graph import TrainStepUpdater


@pytest.fixture(params=['numpy', 'emulator'])
def path(request, monkeypatch):
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1' if request.param == 'emulator' else '0')
    return request.param


class StockNet(chainer.Chain):
    """Chainer's own links only."""

    def __init__(self, dtype=numpy.float32):
        super().__init__()
        init = chainer.initializers.Normal(0.3, dtype=dtype, rng=numpy.random.RandomState(0))
        with self.init_scope():
            self.conv = L.Convolution2D(3, 6, 3, pad=1, initialW=init,
                                        initial_bias=chainer.initializers.Zero(dtype))
            self.bn = L.BatchNormalization(6, dtype=dtype)
            self.conv2 = L.Convolution2D(6, 6, 3, stride=2, initialW=init, nobias=True)
            self.fc = L.Linear(6 * 3 * 3, 5, initialW=init,
                               initial_bias=chainer.initializers.Zero(dtype))

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x)))
        h = F.max_pooling_2d(F.relu(self.conv2(h) + 0), 1)
        return self.fc(h)


def batches(n, size=4, dtype=numpy.float32, seed=0, shape=(3, 8, 8)):
    r = numpy.random.RandomState(seed)
    return [(r.randn(size, *shape).astype(dtype), r.randint(0, 5, size).astype(numpy.int32))
            for _ in range(n)]


def make(dtype=numpy.float32, model_fn=StockNet, scaling=None, **kw):
    model = model_fn(dtype)
    opt = optimizers.MomentumSGD(lr=0.05, weight_decay=1e-3, **kw).setup(model)
    if scaling == 'dynamic':
        opt.loss_scaling(interval=3, initial_scale=2.0 ** 10)
    elif scaling == 'static':
        opt.loss_scaling(scale=64.0)
    return model, opt


def sce(model):
    def lossfun(x, t):
        return F.softmax_cross_entropy(F.cast(model(x), numpy.float32), t)
    return lossfun


def run_eager(model, opt, data):
    losses = []
    lossfun = sce(model)
    for x, t in data:
        holder = []
        opt.update(lambda: holder.append(lossfun(x, t)) or holder[-1])
        losses.append(holder[-1].array.copy())
    return losses


def run_step(model, opt, data, **kw):
    step = TrainStep(model, opt, sce(model), **kw)
    return [step(x, t).array.copy() for x, t in data], step


def state(model, opt):
    out = {'param' + n: p.array.copy() for n, p in model.namedparams()}
    for link_name, link in model.namedlinks():
        for name in link._persistent:
            v = link.__dict__[name]
            if isinstance(v, numpy.ndarray):
                out['persistent' + link_name + '/' + name] = v.copy()
    for n, p in model.namedparams():
        out['v' + n] = p.update_rule.state['v'].copy()
        if p.grad is not None:      # as the update left it (float32/64: divided, as Chainer)
            out['grad' + n] = numpy.ascontiguousarray(p.grad)
    out['scaler'] = opt._scaler.state.copy()
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        numpy.testing.assert_array_equal(a[k].view(numpy.uint8), b[k].view(numpy.uint8),
                                         err_msg=k)


def twin(**kw):
    a = make(**kw)
    b = copy.deepcopy(a[0]), None
    b = (b[0], optimizers.MomentumSGD(lr=0.05, weight_decay=1e-3,
                                      nesterov=kw.get('nesterov', False)).setup(b[0]))
    if kw.get('scaling') == 'dynamic':
        b[1].loss_scaling(interval=3, initial_scale=2.0 ** 10)
    elif kw.get('scaling') == 'static':
        b[1].loss_scaling(scale=64.0)
    return a, b


# ---- bit-for-bit equality with eager steps ------------------------------------------------------

@pytest.mark.parametrize('scaling', [None, 'static', 'dynamic'])
def test_twenty_replayed_steps_equal_twenty_eager_steps(path, scaling):
    data = batches(20)
    (m1, o1), (m2, o2) = twin(scaling=scaling)
    l1 = run_eager(m1, o1, data)
    l2, step = run_step(m2, o2, data)
    assert step.traces == 1 and step.replays == 20 - 3, 'warm-up, two recorded steps, replays'
    assert step.replayed_ops > 20, 'forward and backward functions of the network'
    for a, b in zip(l1, l2):
        assert a.tobytes() == b.tobytes()
    assert_same(state(m1, o1), state(m2, o2))
    assert o1.t == o2.t == 20


def test_tiny_resnet50_nhwc_replay_equals_eager():
    def model_fn(dtype):
        numpy.random.seed(0)
        return ResNet50('NHWC', n_classes=5, width=16)
    data = [(x.transpose(0, 2, 3, 1).copy(), t)
            for x, t in batches(20, size=2, shape=(3, 32, 32))]
    m1, o1 = make(model_fn=model_fn)
    m2, o2 = make(model_fn=model_fn)
    l1 = run_eager(m1, o1, data)
    with warnings.catch_warnings():
        warnings.simplefilter('error', RuntimeWarning)        # no "cannot be replayed"
        l2, step = run_step(m2, o2, data)
    assert step.replays == 17
    assert [a.tobytes() for a in l1] == [b.tobytes() for b in l2]
    assert_same(state(m1, o1), state(m2, o2))


def tiny_resnet50(dtype):
    numpy.random.seed(0)
    with chainer.using_config('dtype', dtype):
        return ResNet50('NHWC', n_classes=5, width=16)


def resnet50_batches(n, dtype=numpy.float32, seed=0):
    return [(x.transpose(0, 2, 3, 1).astype(dtype), t)
            for x, t in batches(n, size=2, shape=(3, 32, 32), seed=seed)]


def test_tiny_resnet50_float16_overflow_skips_and_running_statistics_replay_as_eager():
    """The float16 ResNet-50 (its 53 fused BatchNorm layers' running statistics in float32)
    with dynamic loss scaling, over 20 steps, two of them replayed with an inf in the batch:
    each is skipped as eager Chainer skips it, and every parameter, momentum, running
    statistic, the scale and each loss keep the bits of eager steps."""
    data = resnet50_batches(20, numpy.float16)
    for k in (9, 15):
        data[k][0][0, 0, 0, 0] = numpy.inf
    runs = []
    for run in (run_eager, run_step):
        model, opt = make(numpy.float16, model_fn=tiny_resnet50, scaling='dynamic')
        with warnings.catch_warnings(), numpy.errstate(all='ignore'):   # (the infs)
            warnings.filterwarnings('ignore', 'dynamic loss scaling skipped')
            warnings.filterwarnings('error', 'TrainStep')    # no "cannot be replayed"
            out = run(model, opt, data)
        runs.append((out, model, opt))
    (l1, m1, o1), ((l2, step), m2, o2) = runs
    # (the scale starts at 2^10: early steps overflow and are skipped too)
    assert step.replays == 17 and o1.skipped_steps == o2.skipped_steps >= 2
    assert not numpy.isfinite(l2[9]).all() and not numpy.isfinite(l2[15]).all()
    assert o1.loss_scale == o2.loss_scale
    assert [a.tobytes() for a in l1] == [b.tobytes() for b in l2]
    s1, s2 = state(m1, o1), state(m2, o2)
    assert sum(k.endswith('/avg_mean') or k.endswith('/avg_var') for k in s1) == 2 * 53
    assert_same(s1, s2)


def test_tiny_resnet50_in_a_trainer_follows_lr_schedules_like_standard_updater(tmp_path):
    """20 iterations of the ResNet-50 in a Trainer, lr set by ExponentialShift and
    MultistepShift (the momentum), an Evaluator and reports: the same log and state as
    StandardUpdater's."""
    data = resnet50_batches(10)
    xs = numpy.concatenate([x for x, _ in data])
    ts = numpy.concatenate([t for _, t in data])
    runs = []
    for cls in (training.updaters.StandardUpdater, TrainStepUpdater):
        ds = chainer.datasets.TupleDataset(xs, ts)
        it = chainer.iterators.SerialIterator(ds, 2, shuffle=False)
        model = tiny_resnet50(numpy.float32)
        classifier = L.Classifier(model)
        opt = optimizers.MomentumSGD(lr=0.1, weight_decay=1e-4).setup(classifier)
        trainer = training.Trainer(cls(it, opt), (20, 'iteration'),
                                   out=str(tmp_path / cls.__name__))
        trainer.extend(extensions.ExponentialShift('lr', 0.7), trigger=(3, 'iteration'))
        trainer.extend(extensions.MultistepShift('momentum', 0.5, [6, 14], 0.9))
        val = chainer.iterators.SerialIterator(ds, 4, repeat=False, shuffle=False)
        trainer.extend(extensions.Evaluator(val, classifier), trigger=(10, 'iteration'))
        trainer.extend(extensions.observe_lr(), trigger=(1, 'iteration'))
        trainer.extend(extensions.LogReport(trigger=(1, 'iteration')))
        with warnings.catch_warnings():
            warnings.simplefilter('error', RuntimeWarning)    # no "cannot be replayed"
            trainer.run()
        runs.append((trainer.get_extension('LogReport').log, state(model, opt), opt))
    (log_a, state_a, opt_a), (log_b, state_b, opt_b) = runs
    assert trainer.updater.step.replays == 17
    assert opt_a.lr == opt_b.lr == 0.1 * 0.7 ** 6
    assert opt_a.momentum == opt_b.momentum == 0.9 * 0.5 ** 2
    assert_same(state_a, state_b)
    assert len(log_a) == len(log_b) == 20
    for i, (a, b) in enumerate(zip(log_a, log_b)):
        assert a.keys() == b.keys(), (i, set(a) ^ set(b))
        for k in a:
            if k != 'elapsed_time':
                assert a[k] == b[k], (i, k)
    assert 'validation/main/loss' in log_a[9] and 'validation/main/loss' in log_a[19]


def test_float16_overflow_step_is_skipped_as_in_eager(path):
    data = batches(12, dtype=numpy.float16)
    x, t = data[8]
    data[8] = (x * numpy.float16(numpy.inf), t)     # a replayed step whose gradients overflow
    (m1, o1), (m2, o2) = twin(dtype=numpy.float16, scaling='dynamic')
    said = []
    for run in (lambda: run_eager(m1, o1, data), lambda: run_step(m2, o2, data)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            said.append((run(), [str(w.message) for w in caught
                                 if 'dynamic loss scaling skipped' in str(w.message)]))
    (l1, said1), ((l2, step), said2) = said
    assert said1 == said2 and len(said1) >= 1, 'the replay says a skipped step as eager does'
    assert o1.skipped_steps == o2.skipped_steps >= 1
    assert o1.loss_scale == o2.loss_scale
    assert [a.tobytes() for a in l1] == [b.tobytes() for b in l2]
    assert_same(state(m1, o1), state(m2, o2))
    assert step.replays == 9


def test_float64_dynamic_loss_scaling_replays_the_current_scale():
    """The float64 seed of backward is a cast of the float32 scale: a recorded function, so a
    replay after the scale grew starts backward from the new scale (it once froze it)."""
    data = batches(16, dtype=numpy.float64)
    (m1, o1), (m2, o2) = twin(dtype=numpy.float64, scaling='dynamic')   # scale doubles every 3
    step = TrainStep(m2, o2, lambda x, t: F.softmax_cross_entropy(m2(x), t), check_every=None)
    for x, t in data:
        o1.update(lambda: F.softmax_cross_entropy(m1(x), t))
        assert step(x, t).dtype == numpy.float64
    assert o1.loss_scale == o2.loss_scale == 2.0 ** 15
    assert_same(state(m1, o1), state(m2, o2))
    assert step.replays == 13


@pytest.mark.parametrize('reduce', [False, True])
def test_gradients_without_the_loss_scale_mark_make_the_step_run_eagerly(reduce):
    """F.forget runs its inner backward without the loss scale, so Chainer marks those
    parameters' gradients unscaled and an eager update leaves them scaled; a replay would
    unscale every gradient. The step says so and runs eagerly: the same as eager steps, also
    with a gradient reduction (a multi-node step: its eager update unscaled every gradient,
    found by review; here a reduction that changes nothing)."""
    class Forgetting(StockNet):
        def forward(self, x):
            h = F.forget(lambda a: F.relu(self.bn(a)), self.conv(x))
            return self.fc(F.max_pooling_2d(F.relu(self.conv2(h)), 1))
    data = batches(6)
    results = []
    for use_step in (False, True):
        model = Forgetting()
        opt = optimizers.MomentumSGD(lr=0.05).setup(model)
        opt.loss_scaling(scale=64.0)
        if use_step:
            kw = dict(reduce_gradients=lambda buffers: None) if reduce else {}
            with pytest.warns(RuntimeWarning, match=r'gradients of /bn/beta, /bn/gamma were not '
                                                    r'computed by the loss-scaled backward'):
                losses, step = run_step(model, opt, data, **kw)
            assert step.replays == 0
        else:
            losses = run_eager(model, opt, data)
        results.append((losses, state(model, opt)))
    assert [a.tobytes() for a in results[0][0]] == [b.tobytes() for b in results[1][0]]
    assert_same(results[0][1], results[1][1])


def test_lr_and_frozen_links_changed_between_replays_are_followed(path):
    data = batches(12)
    (m1, o1), (m2, o2) = twin()
    step = TrainStep(m2, o2, sce(m2))
    lf1 = sce(m1)
    for i, (x, t) in enumerate(data):
        for m, o in ((m1, o1), (m2, o2)):
            if i == 5:
                o.lr = 0.01
                m.fc.W.update_rule.hyperparam.lr = 0.2
            if i == 7:
                m.conv.disable_update()
            if i == 10:
                m.conv.enable_update()
        o1.update(lambda: lf1(x, t))
        step(x, t)
    assert step.replays == 9
    assert_same(state(m1, o1), state(m2, o2))


# ---- signatures -----------------------------------------------------------------------------------

@pytest.mark.parametrize('change, said', [
    ('loss scaling', r"the optimizer's loss scaling changed \(off then dynamic, interval "
                     r"1000, scales 1\.0\.\.16777216\.0\)"),
    ('train mode, then loss scaling', r"the optimizer's loss scaling changed \(off then "
                                      r"dynamic"),
    ('keyword', r'keyword inputs changed \(by keyword: t then by keyword: y\)'),
    ('train mode', r'chainer\.config\.train changed \(True then False\)'),
    ('batch size', r'new input signature \(2 inputs \(3, 3, 8, 8\) float32, \(3,\) int32\)')])
def test_a_new_signature_is_said_with_what_changed(change, said):
    model, opt = make()
    step = TrainStep(model, opt, sce(model) if change != 'keyword' else
                     lambda x, t: sce(model)(x, t))
    data = batches(4)
    for x, t in data:
        step(x, t=t) if change == 'keyword' else step(x, t)
    with pytest.warns(RuntimeWarning, match=said):
        if change == 'loss scaling':
            opt.loss_scaling()
            step(*data[0])
        elif change == 'train mode':
            with chainer.using_config('train', False):
                step(*data[0])
        elif change == 'train mode, then loss scaling':
            with chainer.using_config('train', False):
                step(*data[0])                        # (said too: a kind of its own)
            opt.loss_scaling()
            step(*data[0])
        elif change == 'keyword':
            step.lossfun = lambda x, y: sce(model)(x, y)
            step(data[0][0], y=data[0][1])
        else:
            step(*batches(1, size=3)[0])


def test_signatures_cycling_beyond_max_signatures_are_said_once():
    model, opt = make()
    step = TrainStep(model, opt, sce(model), max_signatures=2)
    data = [batches(1, size=n, seed=n)[0] for n in (2, 3, 4)]
    with pytest.warns(RuntimeWarning) as record:
        for _ in range(4):
            for x, t in data:
                step(x, t)
    back = [str(w.message) for w in record if 'comes back' in str(w.message)]
    assert len(back) == 1 and 'raise max_signatures' in back[0]
    assert 'max_signatures=2' in back[0] and '(2, 3, 8, 8)' in back[0]
    assert step.replays == 0 and step.traces == 0


def test_a_shape_change_mid_run_retraces_once_and_stays_exact():
    data = batches(6, size=4) + batches(1, size=3, seed=1) + batches(6, size=4, seed=2) \
        + batches(3, size=3, seed=3)
    (m1, o1), (m2, o2) = twin()
    l1 = run_eager(m1, o1, data)
    with pytest.warns(RuntimeWarning, match='new input signature') as record:
        l2, step = run_step(m2, o2, data)
    assert len([w for w in record if 'new input signature' in str(w.message)]) == 1
    assert step.traces == 2
    assert [a.tobytes() for a in l1] == [b.tobytes() for b in l2]
    assert_same(state(m1, o1), state(m2, o2))


def renew_arrays(model):
    """What ``model.to_device`` does to a model: every parameter and persistent array is a new
    array (here a copy on the same device)."""
    for p in model.params():
        p.array = p.array.copy()
    for link in model.links():
        for name in link._persistent:
            v = link.__dict__[name]
            if isinstance(v, numpy.ndarray):
                link.__dict__[name] = v.copy()


def test_new_arrays_for_every_parameter_and_persistent_are_said_once_and_traced_again():
    """A model moved to another device gets new parameter and persistent arrays: one change,
    said once (it was said twice, once for the parameters and once for the persistents, found
    by review), traced again, and every step keeps the bits of eager steps."""
    data = batches(12)
    (m1, o1), (m2, o2) = twin()
    step = TrainStep(m2, o2, sce(m2))
    losses = [[], []]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for i, (x, t) in enumerate(data):
            if i == 6:
                renew_arrays(m1)
                renew_arrays(m2)
            losses[0].append(run_eager(m1, o1, [(x, t)])[0])
            losses[1].append(step(x, t).array.copy())
    said = [str(w.message) for w in caught if 'traced again' in str(w.message)]
    assert len(said) == 1 and 'new array' in said[0], said
    assert step.traces == 2
    assert [a.tobytes() for a in losses[0]] == [b.tobytes() for b in losses[1]]
    assert_same(state(m1, o1), state(m2, o2))


def test_train_mode_is_part_of_the_signature():
    (m, o), _ = twin()
    step = TrainStep(m, o, sce(m))
    for x, t in batches(5):
        step(x, t)
    with chainer.using_config('train', False), pytest.warns(RuntimeWarning, match='signature'):
        step(*batches(1)[0])
    assert step.traces == 1


def test_memory_stays_flat_over_1000_replays():
    (m, o), _ = twin()
    step = TrainStep(m, o, sce(m))
    x, t = batches(1)[0]
    tracemalloc.start()
    try:
        for _ in range(300):          # NumPy's and Python's own caches fill up once
            step(x, t)
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(1000):
            step(x, t)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert step.replays >= 1000
    assert grown < 16 * 1024, 'memory grew by {} bytes over 1000 replays'.format(grown)


def test_a_step_prints_nothing(capfd):
    """Warm-up, recording, replays, a check, a new signature and a step that cannot be
    replayed: what TrainStep has to say is a warning, never a print (chainer.static_graph
    prints its schedule)."""
    (m, o), _ = twin()
    step = TrainStep(m, o, sce(m), check_every=4)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for x, t in batches(9) + batches(3, size=3):
            step(x, t)

        def lossfun(x, t):
            return F.softmax_cross_entropy(m(x), (t + 1) % 5)
        other = TrainStep(m, o, lossfun)
        for x, t in batches(4):
            other(x, t)
    assert step.replays >= 4 and step.checks >= 1 and step.traces == 2
    assert other.replays == 0
    assert capfd.readouterr() == ('', '')


# ---- what cannot be replayed ---------------------------------------------------------------------

def test_a_value_computed_outside_functions_is_refused_and_the_step_runs_eagerly():
    data = batches(8)
    results = []
    for use_step in (False, True):
        (m, o), _ = twin()

        def lossfun(x, t):      # the labels are changed in Python, outside Chainer functions
            return F.softmax_cross_entropy(m(x), (t + 1) % 5)
        if use_step:
            step = TrainStep(m, o, lossfun)
            with pytest.warns(RuntimeWarning, match=r'cannot be replayed.*input 1 .*differs'):
                for x, t in data:
                    step(x, t)
            assert step.replays == 0
        else:
            for x, t in data:
                o.update(lossfun, x, t)
        results.append(state(m, o))
    assert_same(*results)


def test_a_capture_that_fails_is_said_once_and_the_step_runs_eagerly_like_eager_steps(
        monkeypatch):
    """The GPU path on NumPy arrays, with a stand-in for the capture that fails as CUDA may
    (out of memory, an operation a capture refuses): the step says so once, with the reason,
    and every later step of the signature runs eagerly, with the bits of eager steps."""
    from chainer_tc.static_graph import _capture
    from chainer_tc.static_graph import _program
    from chainer_tc.static_graph import step as step_module
    attempts = []

    class FailingCapture:
        def __init__(self, step, entry):
            attempts.append(entry)
            raise _program.NotReplayable('capturing the step into a CUDA graph failed: '
                                         'out of memory (a test)')
    monkeypatch.setattr(step_module, '_is_cupy', lambda arrays: True)
    monkeypatch.setattr(_capture, 'CapturedStep', FailingCapture)
    monkeypatch.setattr(step_module.TrainStep, '_chainer_cudnn_routed',
                        lambda self, inputs: contextlib.nullcontext())
    data = batches(10)
    (m1, o1), (m2, o2) = twin()
    l1 = run_eager(m1, o1, data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        l2, step = run_step(m2, o2, data)
    assert [str(w.message) for w in caught] == [
        'TrainStep: this step cannot be captured, it runs eagerly: capturing the step into '
        'a CUDA graph failed: out of memory (a test)']
    assert len(attempts) == 1, 'one attempt per signature'
    assert (step.traces, step.replays, step.eager_steps) == (0, 0, 10)
    assert [a.tobytes() for a in l1] == [b.tobytes() for b in l2]
    assert_same(state(m1, o1), state(m2, o2))


def test_bad_arguments_are_named():
    model = StockNet()
    with pytest.raises(TypeError, match=r'replays chainer_tc.optimizers.MomentumSGD .*got '
                                        r'chainer.optimizers.momentum_sgd.MomentumSGD\. .*'
                                        r'StandardUpdater'):
        TrainStep(model, chainer.optimizers.MomentumSGD().setup(model))
    with pytest.raises(RuntimeError, match='not set up'):
        TrainStep(model, optimizers.MomentumSGD())

    class MultiNodeOptimizer:            # what chainermn.create_multi_node_optimizer returns
        actual_optimizer = optimizers.MomentumSGD().setup(model)
    with pytest.raises(TypeError, match=r"given ChainerMN's multi-node optimizer: pass "
                                        r"chainer_tc's MomentumSGD itself"):
        TrainStep(model, MultiNodeOptimizer())
    step = TrainStep(model, optimizers.MomentumSGD().setup(model))
    with pytest.raises(TypeError, match='input 1 is list'):
        step(numpy.zeros((1, 3, 8, 8), numpy.float32), [1])
    # an optimizer set up on a copy: replays would train the copy (found by review); a link
    # under the target, or one holding it, is fine
    with pytest.raises(ValueError, match=r'model must be optimizer.target, a link under it or '
                                         r'a link holding it; got a StockNet'):
        TrainStep(model, optimizers.MomentumSGD().setup(copy.deepcopy(model)))
    TrainStep(model.conv, optimizers.MomentumSGD().setup(model))
    TrainStep(L.Classifier(model), optimizers.MomentumSGD().setup(model))


# ---- inside a Trainer -----------------------------------------------------------------------------

def trainer_for(model, opt, updater_cls, out, data, iterations=14, snapshot_at=None):
    xs = numpy.concatenate([x for x, _ in data])
    ts = numpy.concatenate([t for _, t in data])
    ds = chainer.datasets.TupleDataset(xs, ts)
    it = chainer.iterators.SerialIterator(ds, 4, shuffle=False)
    classifier = L.Classifier(model)
    opt.setup(classifier)
    updater = updater_cls(it, opt)
    trainer = training.Trainer(updater, (iterations, 'iteration'), out=str(out))
    trainer.extend(extensions.ExponentialShift('lr', 0.8), trigger=(2, 'iteration'))
    val = chainer.iterators.SerialIterator(ds, 8, repeat=False, shuffle=False)
    trainer.extend(extensions.Evaluator(val, classifier), trigger=(5, 'iteration'))
    trainer.extend(extensions.LogReport(trigger=(1, 'iteration')))
    if snapshot_at:
        trainer.extend(extensions.snapshot(filename='snap'),
                       trigger=training.triggers.ManualScheduleTrigger([snapshot_at],
                                                                       'iteration'))
    return trainer


def test_trainer_with_lr_schedule_evaluator_and_reports_equals_standard_updater(tmp_path):
    data = batches(6)
    logs = []
    states = []
    for cls in (training.updaters.StandardUpdater, TrainStepUpdater):
        model = StockNet()
        opt = optimizers.MomentumSGD(lr=0.1, weight_decay=1e-3)
        trainer = trainer_for(model, opt, cls, tmp_path / cls.__name__, data)
        trainer.run()
        logs.append(trainer.get_extension('LogReport').log)
        states.append(state(model, opt))
    assert_same(*states)
    assert len(logs[0]) == len(logs[1]) == 14
    for a, b in zip(*logs):
        for key in ('main/loss', 'main/accuracy', 'lr', 'validation/main/loss'):
            assert (key in a) == (key in b)
            if key in a:
                assert a[key] == b[key], key


@pytest.mark.parametrize('scale', [None, 64.0])
def test_trainer_extensions_that_read_the_step_see_what_they_see_with_standard_updater(
        tmp_path, scale):
    """Schedules of lr and momentum (WarmupShift, PolynomialShift), ParameterStatistics (it
    reads every parameter's grad after the update: unscaled with loss scaling, as Chainer leaves
    them), FailOnNonNumber, observe_lr and DumpGraph (its graph is the first iteration's, an
    eager one): the same log entries and the same graph under TrainStepUpdater."""
    data = batches(6)
    xs = numpy.concatenate([x for x, _ in data])
    ts = numpy.concatenate([t for _, t in data])
    runs = []
    for cls in (training.updaters.StandardUpdater, TrainStepUpdater):
        it = chainer.iterators.SerialIterator(chainer.datasets.TupleDataset(xs, ts), 4,
                                              shuffle=False)
        model = StockNet()
        classifier = L.Classifier(model)
        opt = optimizers.MomentumSGD(lr=0.1, weight_decay=1e-3).setup(classifier)
        if scale is not None:
            opt.loss_scaling(scale=scale)
        out = tmp_path / cls.__name__
        trainer = training.Trainer(cls(it, opt), (14, 'iteration'), out=str(out))
        trainer.extend(extensions.WarmupShift('lr', 0.01, 4, 0.1))
        trainer.extend(extensions.PolynomialShift('momentum', 0.5, 40), trigger=(3, 'iteration'))
        trainer.extend(extensions.ParameterStatistics(classifier, trigger=(1, 'iteration')))
        trainer.extend(extensions.FailOnNonNumber())
        trainer.extend(extensions.DumpGraph('main/loss'))
        trainer.extend(extensions.observe_lr(), trigger=(1, 'iteration'))
        trainer.extend(extensions.LogReport(trigger=(1, 'iteration')))
        trainer.run()
        runs.append((trainer.get_extension('LogReport').log, state(model, opt),
                     (out / 'cg.dot').read_text()))
    (log_a, state_a, graph_a), (log_b, state_b, graph_b) = runs
    assert trainer.updater.step.replays == 11
    assert_same(state_a, state_b)
    assert len(log_a) == len(log_b) == 14
    assert any(k.endswith('/grad/mean') for k in log_a[0])
    for i, (a, b) in enumerate(zip(log_a, log_b)):
        assert a.keys() == b.keys(), (i, set(a) ^ set(b))
        for k in a:
            if k != 'elapsed_time':
                assert a[k] == b[k] or (numpy.isnan(a[k]) and numpy.isnan(b[k])), (i, k)
    assert graph_a.count('->') == graph_b.count('->') > 10


@pytest.mark.parametrize('change', ['loss_func', 'setup'])
def test_a_new_loss_func_or_optimizer_target_mid_run_is_followed_like_standard_updater(change):
    """StandardUpdater reads ``updater.loss_func`` and the optimizer's target at every
    iteration; TrainStepUpdater froze both into its TrainStep (found by an audit: a new
    loss_func was ignored, and after optimizer.setup(other) the loss ran through the old model
    while the new one was updated). Now a change gets a new TrainStep, said once."""
    data = batches(8)
    runs = []
    for cls in (training.updaters.StandardUpdater, TrainStepUpdater):
        xs = numpy.concatenate([x for x, _ in data])
        ts = numpy.concatenate([t for _, t in data])
        it = chainer.iterators.SerialIterator(chainer.datasets.TupleDataset(xs, ts), 4,
                                              shuffle=False)
        first, second = L.Classifier(StockNet()), L.Classifier(StockNet())
        opt = optimizers.MomentumSGD(lr=0.1, weight_decay=1e-3).setup(first)
        updater = cls(it, opt, loss_func=first if change == 'loss_func' else None)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter('always')
            for i in range(12):
                if i == 5 and change == 'loss_func':
                    updater.loss_func = lambda x, t: first(x, t) * 3.0
                elif i == 5:
                    opt.setup(second)
                updater.update()
        runs.append((state(first, opt), state(second, opt) if change == 'setup' else {},
                     [str(w.message) for w in said if 'TrainStepUpdater' in str(w.message)]))
    (a1, a2, said_std), (b1, b2, said) = runs
    assert_same(a1, b1)
    assert_same(a2, b2)
    what = 'updater.loss_func' if change == 'loss_func' else \
        "the optimizer's target (optimizer.setup())"
    assert said_std == [] and said == ['TrainStepUpdater: {} changed since the step was made '
                                       '(found at iteration 5): a new TrainStep traces it '
                                       'again'.format(what)]
    assert updater.step.replays == 4        # (12 - 5 updates: warm-up, 2 recorded, 4 replays)


def test_a_train_step_whose_optimizer_is_set_up_on_an_unrelated_model_refuses():
    """Used directly, a TrainStep made for one model refuses to run once the optimizer was
    set up on another (it would update that one from this one's loss); a model holding the
    step's model is fine."""
    model, opt = make()
    step = TrainStep(model, opt, sce(model))
    x, t = batches(1)[0]
    step(x, t)
    holder = chainer.Chain()
    with holder.init_scope():
        holder.inner = model
    opt.setup(holder)
    step(x, t)
    opt.setup(StockNet())
    with pytest.raises(ValueError, match=r'the step was made for a StockNet that is none of '
                                         r'these .*optimizer.setup\(\) called with another'):
        step(x, t)


def test_trainer_resumed_from_a_snapshot_continues_like_an_uninterrupted_run(tmp_path):
    data = batches(6)
    model = StockNet()
    opt = optimizers.MomentumSGD(lr=0.1, weight_decay=1e-3)
    straight = trainer_for(model, opt, TrainStepUpdater, tmp_path / 'a', data, snapshot_at=7)
    straight.run()
    expected = state(model, opt)

    model2 = StockNet()
    opt2 = optimizers.MomentumSGD(lr=0.1, weight_decay=1e-3)
    resumed = trainer_for(model2, opt2, TrainStepUpdater, tmp_path / 'b', data)
    serializers.load_npz(str(tmp_path / 'a' / 'snap'), resumed)
    assert resumed.updater.iteration == 7
    resumed.run()
    assert_same(expected, state(model2, opt2))


# ---- GPU -----------------------------------------------------------------------------------------

class CapturableNet(chainer.Chain):
    """What a CUDA graph can hold on any CuPy: Chainer's Linear (its products go through our own
    cuBLAS handle under capture) and our BatchNormalization (our kernels or our cuDNN binding).
    Chainer's stock Convolution2D is the next test (without cuDNN) and
    tests/test_chainer_cudnn.py (with cuDNN, which TrainStep routes)."""

    def __init__(self, dtype=numpy.float32):
        super().__init__()
        init = chainer.initializers.Normal(0.3, dtype=dtype, rng=numpy.random.RandomState(0))
        with self.init_scope():
            self.fc1 = L.Linear(3 * 8 * 8, 32, initialW=init,
                                initial_bias=chainer.initializers.Zero(dtype))
            self.bn = TL.BatchNormalization(32, dtype=dtype)
            self.fc2 = L.Linear(32, 5, initialW=init, nobias=True)

    def forward(self, x):
        return self.fc2(F.relu(self.bn(self.fc1(x))))


@pytest.mark.gpu
@pytest.mark.parametrize('dtype,scaling', [(numpy.float32, None), (numpy.float16, 'dynamic')])
def test_captured_step_equals_eager_on_the_gpu(dtype, scaling):
    import cupy
    data = [(cupy.asarray(x.astype(dtype)), cupy.asarray(t)) for x, t in batches(10)]
    models = [CapturableNet(dtype) for _ in range(2)]
    opts = [optimizers.MomentumSGD(lr=0.05, weight_decay=1e-3) for _ in range(2)]
    for m, o in zip(models, opts):
        m.to_device('@cupy:0')
        o.setup(m)
        if scaling:
            o.loss_scaling(interval=3, initial_scale=2.0 ** 10)
    l1 = run_eager(models[0], opts[0], data)
    with warnings.catch_warnings():
        warnings.simplefilter('error')          # no "runs eagerly" warning: it is captured
        l2, step = run_step(models[1], opts[1], data)
    assert step.traces == 1 and step.replays == 8
    # cuBLAS may pick another algorithm on the capture's handle than on CuPy's: the last bits
    # of a float32 product can differ, and ten SGD steps carry that along
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == numpy.float32 else dict(rtol=2e-2, atol=2e-3)
    for a, b in zip(l1, l2):
        cupy.testing.assert_allclose(a, b, **tol)
    for (n, p), (_, q) in zip(sorted(models[0].namedparams()), sorted(models[1].namedparams())):
        cupy.testing.assert_allclose(p.array, q.array, err_msg=n, **tol)
    if scaling:
        cupy.testing.assert_array_equal(opts[0]._scaler.state, opts[1]._scaler.state)


def gpu_twins(n=2, dtype=numpy.float32):
    models = [CapturableNet(dtype) for _ in range(n)]
    opts = [optimizers.MomentumSGD(lr=0.05, weight_decay=1e-3) for _ in range(n)]
    for m, o in zip(models, opts):
        m.to_device('@cupy:0')
        o.setup(m)
    return models, opts


def assert_close_on_gpu(m1, m2, l1=(), l2=(), tol=None):
    """Losses and parameters of an eager run and a captured one, equal within ``tol`` (default:
    float32's, as test_captured_step_equals_eager_on_the_gpu says why)."""
    import cupy
    tol = tol or dict(rtol=1e-5, atol=1e-6)
    for a, b in zip(l1, l2):
        cupy.testing.assert_allclose(a, b, **tol)
    for (n, p), (_, q) in zip(sorted(m1.namedparams()), sorted(m2.namedparams())):
        cupy.testing.assert_allclose(p.array, q.array, err_msg=n, **tol)


@pytest.mark.gpu
def test_lr_momentum_and_a_per_parameter_lr_set_between_launches_are_followed_on_the_gpu():
    """The hyperparameters a captured graph reads live in device memory (refreshed before a
    launch when they changed): an lr decayed at every step, a new momentum and one
    parameter's own lr give what eager steps give (a frozen lr would be off by 0.8^10)."""
    import cupy
    data = [(cupy.asarray(x), cupy.asarray(t)) for x, t in batches(14)]
    (m1, m2), (o1, o2) = gpu_twins()
    step = TrainStep(m2, o2, sce(m2))
    losses = [[], []]
    for i, (x, t) in enumerate(data):
        for m, o in ((m1, o1), (m2, o2)):
            o.lr = 0.05 * 0.8 ** i
            if i == 7:
                o.momentum = 0.5
            if i == 9:
                m.fc2.W.update_rule.hyperparam.lr = 0.2
        holder = []
        o1.update(lambda: holder.append(sce(m1)(x, t)) or holder[-1])
        losses[0].append(holder[-1].array)
        losses[1].append(step(x, t).array)
    assert step.traces == 1 and step.replays == 12   # the capture launches step 3
    assert_close_on_gpu(m1, m2, *losses)


@pytest.mark.gpu
@pytest.mark.parametrize('layout', ['contiguous', 'strided'])
def test_a_device_batch_reaches_the_graph_without_a_trip_through_the_host(monkeypatch, layout):
    """A batch already on the device (chainer_tc.dali's iterator hands out CuPy arrays, by
    DLPack) is copied device to device into the graph's input buffers: no replay reads
    anything back to the host, and a strided batch (a view) is copied as its values."""
    import cupy
    base = [(cupy.asarray(x), cupy.asarray(t)) for x, t in batches(9)]
    if layout == 'strided':            # the same values through a view of a larger array
        base = [(cupy.concatenate([x, x], axis=1)[:, :3], t) for x, t in base]
        assert not base[0][0].flags.c_contiguous
    (m1, m2), (o1, o2) = gpu_twins()
    l1 = run_eager(m1, o1, base)
    step = TrainStep(m2, o2, sce(m2), check_every=None)
    l2 = [step(x, t).array for x, t in base[:4]]
    assert step.replays == 2

    def refused(*args, **kwargs):
        raise AssertionError('a replay read an array back to the host')
    monkeypatch.setattr(cupy.ndarray, 'get', refused)
    monkeypatch.setattr(cupy, 'asnumpy', refused)
    l2 += [step(x, t).array for x, t in base[4:]]
    monkeypatch.undo()
    assert step.replays == 7
    assert_close_on_gpu(m1, m2, l1, l2)


@pytest.mark.gpu
def test_the_graphs_memory_comes_from_a_pool_of_its_own_that_lives_with_it():
    """Everything the capture allocated comes from the captured step's own pool: later
    allocations (the user's, CuPy's default pool freeing its blocks) neither take from it nor
    release it, and the graph keeps computing what eager steps compute."""
    import gc
    import cupy
    data = [(cupy.asarray(x), cupy.asarray(t)) for x, t in batches(10)]
    (m1, m2), (o1, o2) = gpu_twins()
    l1 = run_eager(m1, o1, data)
    step = TrainStep(m2, o2, sce(m2), check_every=None)
    l2 = [step(x, t).array.copy() for x, t in data[:4]]
    captured = next(iter(step._entries.values())).replay
    pool = captured.pool
    assert pool is not cupy.get_default_memory_pool()
    gc.collect()
    used, total = pool.used_bytes(), pool.total_bytes()
    assert used > 0
    others = [cupy.empty(1 << 20, numpy.float32) for _ in range(4)]    # the user's
    del others
    cupy.get_default_memory_pool().free_all_blocks()
    gc.collect()
    l2 += [step(x, t).array.copy() for x, t in data[4:]]
    assert (pool.used_bytes(), pool.total_bytes()) == (used, total)
    assert next(iter(step._entries.values())).replay is captured
    assert_close_on_gpu(m1, m2, l1, l2)


@pytest.mark.gpu
def test_a_model_moved_to_the_gpu_after_its_cpu_replays_is_traced_again_there():
    """Five steps on the CPU (traced and replayed), then the model is moved to the GPU: the
    step says once that the parameters have new arrays, traces (captures) the GPU step, and
    goes on as eager steps do across the same move."""
    import cupy
    cpu, gpu = batches(5), [(cupy.asarray(x), cupy.asarray(t)) for x, t in batches(6, seed=1)]
    (m1, o1), (m2, o2) = twin()
    run_eager(m1, o1, cpu)
    step = TrainStep(m2, o2, sce(m2))
    for x, t in cpu:
        step(x, t)
    assert step.replays == 2
    for m in (m1, m2):
        m.to_device('@cupy:0')
    l1 = run_eager(m1, o1, gpu)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        l2 = [step(x, t).array for x, t in gpu]
    said = [str(w.message) for w in caught if 'traced again' in str(w.message)]
    assert len(said) == 1 and 'new array' in said[0], said
    assert step.traces == 2 and step.replays == 2 + 4     # (the capture launches step 3)
    assert isinstance(next(reversed(step._entries.values())).replay.graph, cupy.cuda.Graph)
    assert_close_on_gpu(m1, m2, l1, l2)


@pytest.mark.gpu
def test_a_step_a_capture_refuses_is_said_once_and_runs_eagerly_on_the_gpu():
    """A loss function that reads a value back to the host (float(loss)) cannot be captured:
    CUDA refuses the copy while the stream captures. The step says so once, with CUDA's
    reason, and runs eagerly from then on, as eager steps would."""
    import cupy
    data = [(cupy.asarray(x), cupy.asarray(t)) for x, t in batches(8)]
    (m1, m2), (o1, o2) = gpu_twins()
    seen = [[], []]

    def lossfun(m, k):
        def f(x, t):
            loss = sce(m)(x, t)
            seen[k].append(float(loss.array))        # a host synchronisation
            return loss
        return f
    for x, t in data:
        o1.update(lossfun(m1, 0), x, t)
    step = TrainStep(m2, o2, lossfun(m2, 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for x, t in data:
            step(x, t)
    said = [str(w.message) for w in caught if 'TrainStep' in str(w.message)]
    assert len(said) == 1 and 'cannot be captured' in said[0] and 'CUDA graph' in said[0], said
    assert step.replays == 0 and step.eager_steps == 8
    assert len(seen[1]) == 8, 'the capture stopped at the synchronisation'
    numpy.testing.assert_allclose(seen[1], seen[0], rtol=1e-5)
    assert_close_on_gpu(m1, m2)


class CapturableWithAux(CapturableNet):
    """CapturableNet and a link ``aux`` left without an update rule, whose output the loss
    reads times zero: its gradient is 0 * z, a NaN where the batch's ``z`` holds an inf."""

    def __init__(self, dtype=numpy.float32):
        super().__init__(dtype)
        with self.init_scope():
            self.aux = L.Linear(6, 3, initialW=numpy.ones((3, 6), dtype))
        self.aux.W.update_rule = self.aux.b.update_rule = None


@pytest.mark.gpu
def test_a_nan_in_an_untrained_gradient_skips_a_captured_step_like_eager():
    """The captured update's overflow check reads the gradients of parameters without an
    update rule too (in the graph), as Chainer's check and an eager update do
    (tests/test_static_graph_user_state.py runs it on the CPU replay and the emulator)."""
    import cupy
    data = []
    for i, (x, t) in enumerate(batches(9)):
        z = numpy.ones((4, 6), numpy.float32)
        if i == 6:
            z[1, 2] = numpy.inf
        data.append(tuple(cupy.asarray(a) for a in (x, t, z)))
    models = [CapturableWithAux() for _ in range(2)]
    opts = [optimizers.MomentumSGD(lr=0.05, weight_decay=1e-3) for _ in range(2)]
    for m, o in zip(models, opts):
        m.to_device('@cupy:0')
        o.setup(m)
        o.loss_scaling(initial_scale=2.0 ** 10)

    def lossfun(m):
        return lambda x, t, z: F.softmax_cross_entropy(m(x), t) + F.sum(m.aux(z)) * 0.0
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')         # the untrained link's notice
        for x, t, z in data:
            opts[0].update(lossfun(models[0]), x, t, z)
        step = TrainStep(models[1], opts[1], lossfun(models[1]))
        for x, t, z in data:
            step(x, t, z)
    assert step.traces == 1 and step.replays == 7   # the capture launches step 3
    assert opts[0].skipped_steps == opts[1].skipped_steps == 1
    tol = dict(rtol=1e-5, atol=1e-6)        # as test_captured_step_equals_eager_on_the_gpu
    for (n, p), (_, q) in zip(sorted(models[0].namedparams()), sorted(models[1].namedparams())):
        cupy.testing.assert_allclose(p.array, q.array, err_msg=n, **tol)


@pytest.mark.gpu
@pytest.mark.parametrize('dtype,scaling', [(numpy.float32, None), (numpy.float16, 'dynamic')])
def test_stock_convolutions_without_cudnn_are_captured_on_the_gpu(dtype, scaling):
    """Chainer's im2col convolutions (every convolution on CuPy 14, which has no cuDNN): their
    products go through our cuBLAS handle under capture (tests/test_capture_products.py)."""
    import cupy
    data = [(cupy.asarray(x.astype(dtype)), cupy.asarray(t)) for x, t in batches(6)]
    (m1, m2), (o1, o2) = [StockNet(dtype) for _ in range(2)], [
        optimizers.MomentumSGD(lr=0.05, weight_decay=1e-3) for _ in range(2)]
    for m, o in ((m1, o1), (m2, o2)):
        m.to_device('@cupy:0')
        o.setup(m)
        if scaling:
            o.loss_scaling(interval=3, initial_scale=2.0 ** 10)
    with chainer.using_config('use_cudnn', 'never'):      # im2col, col2im and cuBLAS
        l1 = run_eager(m1, o1, data)
        with warnings.catch_warnings():
            warnings.simplefilter('error')      # no "runs eagerly" warning: it is captured
            l2, step = run_step(m2, o2, data)
    assert step.traces == 1 and step.replays == 4
    # as test_captured_step_equals_eager_on_the_gpu: cuBLAS may pick other algorithms on the
    # capture's handle, and the batched products sum in another order than CuPy's tensordot
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == numpy.float32 else dict(rtol=2e-2, atol=2e-3)
    assert_close_on_gpu(m1, m2, l1, l2, tol)


@pytest.mark.gpu
def test_captured_step_host_time_does_not_grow_with_depth():
    import time
    import cupy

    def timed(blocks):
        class Deep(chainer.ChainList):
            def __init__(self):
                super().__init__(*[L.Linear(64, 64) for _ in range(blocks)])

            def forward(self, x):
                for link in self:
                    x = F.relu(link(x))
                return x
        model = Deep()
        model.to_device('@cupy:0')
        opt = optimizers.MomentumSGD(lr=0.01).setup(model)
        # replays only (a periodic check is an eager step)
        step = TrainStep(model, opt, lambda x: F.sum(model(x)), check_every=None)
        x = cupy.ones((8, 64), cupy.float32)
        for _ in range(5):
            step(x)
        windows = []
        for _ in range(5):         # the best of 5 windows: one slow window of 50 steps
            cupy.cuda.Device().synchronize()      # made this fail once on an H100 (0.30 ms
            s = time.perf_counter()               # against 0.09 ms; it passed on the next
            for _ in range(20):                   # run, at the same code)
                step(x)
            windows.append((time.perf_counter() - s) / 20)
        cupy.cuda.Device().synchronize()
        return min(windows)
    shallow, deep = timed(4), timed(64)
    assert deep < 3 * shallow, (shallow, deep)


# ---- info --------------------------------------------------------------------------------------

def test_info_cuda_graphs_needs_the_capture_safe_cudnn_binding(monkeypatch):
    from chainer_tc import info
    from chainer_tc.cuda import cudnn
    assert cudnn.unavailable_reason() is None, 'the cuDNN 8.9 wheel is installed here'
    monkeypatch.setattr(cudnn, '_binding', None)
    monkeypatch.setattr(cudnn, '_unavailable', 'no usable cuDNN: binding missing')
    assert info.collect()['features']['cuda_graphs'] == {
        'available': False,
        'reason': 'cuDNN not loadable: CuDNNUnavailable: no usable cuDNN: binding missing'}


def test_info_cuda_graphs_needs_the_capture_safe_cublas_binding(monkeypatch):
    from chainer_tc import info
    assert info._capture_cublas() == (True, None), 'the cuBLAS 12 wheel is installed here'
    monkeypatch.setattr(info, '_capture_cublas', lambda: (False, 'no cublas'))
    assert info.collect()['features']['cuda_graphs'] == {'available': False,
                                                         'reason': 'no cublas'}


def test_dropout_draws_a_new_mask_every_replayed_step():
    class DropNet(StockNet):
        def forward(self, x):
            return super().forward(F.dropout(x, 0.3))
    data = batches(8)
    results = []
    for use_step in (False, True):
        numpy.random.seed(7)
        model = DropNet()
        opt = optimizers.MomentumSGD(lr=0.05).setup(model)
        numpy.random.seed(11)             # the masks: the same draws in both runs
        if use_step:
            losses, step = run_step(model, opt, data)
            assert step.replays == 5
        else:
            losses = run_eager(model, opt, data)
        results.append((losses, state(model, opt)))
    assert [a.tobytes() for a in results[0][0]] == [b.tobytes() for b in results[1][0]]
    assert len({a.tobytes() for a in results[1][0][3:]}) == 5, 'a new mask each step'
    assert_same(results[0][1], results[1][1])


@pytest.mark.parametrize('scaling', [None, 'dynamic'])
@pytest.mark.parametrize('warmup', [0, 1, 2])
def test_lazy_links_and_any_warmup_replay_exactly(warmup, scaling):
    class Lazy(chainer.Chain):
        def __init__(self, dtype=numpy.float32):
            super().__init__()
            with self.init_scope():
                self.fc1 = L.Linear(None, 7)
                self.fc2 = L.Linear(None, 5)

        def forward(self, x):
            return self.fc2(F.relu(self.fc1(x)))
    data = batches(9)
    results = []
    for use_step in (False, True):
        numpy.random.seed(3)
        model = Lazy()
        opt = optimizers.MomentumSGD(lr=0.05).setup(model)
        if scaling:
            opt.loss_scaling(interval=3)
        assert opt._flat is None                       # lazy: built at the first update
        if use_step:
            losses, step = run_step(model, opt, data, warmup=warmup)
            assert step.traces == 1 and step.replays >= 9 - warmup - 4
        else:
            losses = run_eager(model, opt, data)
        results.append((losses, state(model, opt)))
    assert [a.tobytes() for a in results[0][0]] == [b.tobytes() for b in results[1][0]]
    assert_same(results[0][1], results[1][1])
