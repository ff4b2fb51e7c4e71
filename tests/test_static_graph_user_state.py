"""TrainStep keeps what a Chainer user reads after a step as an eager step leaves it: each
parameter's ``grad`` (also through a view of a parameter, after ``cleargrads()`` and after a step
of another signature), ``L.Classifier``'s ``loss``/``accuracy``/``y``, reported Variables and
the reporter they go to; a replaced persistent array re-traces; a graph the model carries from
one step into the next keeps its inputs; a used step pickles and deep-copies.

Found by an adversarial review on the CPU replay (each of these was a silent difference from
eager steps). Every comparison is bit for bit against eager ``optimizer.update`` steps.
"""
import contextlib
import copy
import pickle
import re
import warnings

import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer)
import chainer
import chainer.functions as F
import chainer.links as L
from chainer import reporter as reporter_module

from chainer_tc import optimizers
from chainer_tc.static_graph import TrainStep


class MLP(chainer.Chain):
    def __init__(self, bn=False):
        super().__init__()
        r = numpy.random.RandomState(0)
        with self.init_scope():
            self.l1 = L.Linear(6, 8, initialW=r.randn(8, 6).astype(numpy.float32) * 0.3)
            self.bn = L.BatchNormalization(8) if bn else None
            self.l2 = L.Linear(8, 5, initialW=r.randn(5, 8).astype(numpy.float32) * 0.3)

    def forward(self, x):
        h = self.l1(x)
        return self.l2(F.relu(self.bn(h) if self.bn is not None else h))


class ThroughViews(chainer.Chain):
    """A parameter used only through a view: the last backward op (the view's gradient) returns
    a view of another op's fresh array. With ``how='two_biases'``, two parameters added to a
    result of their shape: Add's backward gives both the same gradient array."""

    def __init__(self, how):
        super().__init__()
        r = numpy.random.RandomState(0)
        self.how = how
        with self.init_scope():
            self.W = chainer.Parameter(r.randn(5, 6).astype(numpy.float32))
            self.b = chainer.Parameter(r.randn(5).astype(numpy.float32))
            self.scale = L.Scale(axis=1, W_shape=(5,), bias_term=True)
            if how == 'two_biases':
                self.c1 = chainer.Parameter(r.randn(4, 5).astype(numpy.float32))
                self.c2 = chainer.Parameter(r.randn(4, 5).astype(numpy.float32))

    def forward(self, x):
        if self.how == 'reshape':
            return F.matmul(x, F.reshape(self.W, (6, 5)))
        if self.how == 'expand_dims':
            y = F.matmul(x, self.W, transb=True)
            return y + F.broadcast_to(F.expand_dims(self.b, 0), y.shape)
        if self.how == 'two_biases':
            return F.matmul(x, self.W, transb=True) + self.c1 + self.c2
        return self.scale(F.matmul(x, self.W, transb=True))


def data(n, size=4, seed=0):
    r = numpy.random.RandomState(seed)
    return [(r.randn(size, 6).astype(numpy.float32), r.randint(0, 5, size).astype(numpy.int32))
            for _ in range(n)]


def pair(make):
    """Two identical (model, optimizer) pairs: one for eager steps, one for the TrainStep."""
    out = []
    for _ in range(2):
        model = make()
        out.append((model, optimizers.MomentumSGD(lr=0.1, weight_decay=1e-3).setup(model)))
    return out


def eager_update(opt, lossfun, *args):
    held = []
    opt.update(lambda: held.append(lossfun(*args)) or held[-1])
    return held[-1]


def steps_equal_eager(step, lossfun, ms, me, oe, n=6):
    """``n`` steps of ``step`` (over ``ms``, from ``lossfun(ms)``) against eager updates of
    ``me`` by ``oe``: each returned loss and every parameter bit for bit."""
    for i, (x, t) in enumerate(data(n)):
        expected = eager_update(oe, lossfun(me), x, t).array
        assert step(x, t).array.tobytes() == expected.tobytes(), 'step {} loss'.format(i)
        assert_same(params(me), params(ms), 'step {} params'.format(i))


def grads(model):
    return {n: None if p.grad is None else p.grad.copy() for n, p in model.namedparams()}


def assert_same(a, b, what):
    assert a.keys() == b.keys(), what
    for k in a:
        if a[k] is None or b[k] is None:
            assert a[k] is None and b[k] is None, (what, k)
        else:
            numpy.testing.assert_array_equal(a[k].view(numpy.uint8), b[k].view(numpy.uint8),
                                             err_msg='{} {}'.format(what, k))


def params(model):
    out = {n: p.array if p.array is None else p.array.copy() for n, p in model.namedparams()}
    for name, link in model.namedlinks():
        out.update({name + '/' + k: link.__dict__[k].copy() for k in link._persistent
                    if isinstance(link.__dict__[k], numpy.ndarray)})
    return out


@pytest.mark.parametrize('how', ['reshape', 'expand_dims', 'scale_link', 'two_biases'])
def test_a_parameter_used_through_a_view_gets_this_steps_gradient(how):
    (me, oe), (ms, os_) = pair(lambda: ThroughViews(how))
    step = TrainStep(ms, os_, lambda x, t: F.softmax_cross_entropy(ms(x), t))
    for i, (x, t) in enumerate(data(8)):
        eager_update(oe, lambda x, t: F.softmax_cross_entropy(me(x), t), x, t)
        step(x, t)
        assert_same(grads(me), grads(ms), 'step {} grads'.format(i))
        assert_same(params(me), params(ms), 'step {} params'.format(i))
    assert step.replays == 5


def test_param_grad_is_this_steps_after_cleargrads_and_after_another_signature():
    (me, oe), (ms, os_) = pair(MLP)
    step = TrainStep(ms, os_, lambda x, t: F.softmax_cross_entropy(ms(x), t))
    batches = data(10) + data(1, size=3, seed=1) + data(4, seed=2)   # a partial batch at 10
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')              # the partial batch's re-trace notice
        for i, (x, t) in enumerate(batches):
            me.cleargrads()                          # the classic loop clears first
            ms.cleargrads()
            eager_update(oe, lambda x, t: F.softmax_cross_entropy(me(x), t), x, t)
            step(x, t)
            assert_same(grads(me), grads(ms), 'step {} grads'.format(i))
    assert_same(params(me), params(ms), 'params')
    assert step.replays >= 10


@pytest.mark.parametrize('alternate', [False, True])
def test_classifier_attributes_are_this_steps(alternate):
    """Also when two signatures alternate (full and partial batches, each replayed): each
    step's attributes, not the other signature's Variables left there by its last step. And
    each step's own Variables: one kept from an earlier step (a loss history) keeps its value,
    as after eager steps."""
    (me, oe), (ms, os_) = pair(lambda: L.Classifier(MLP()))
    step = TrainStep(ms, os_)
    batches = data(7)
    if alternate:
        batches = [b for ab in zip(batches, data(7, size=3, seed=1)) for b in ab]
    kept = {me: [], ms: []}
    returned = []
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')              # the partial batch's re-trace notice
        for i, (x, t) in enumerate(batches):
            eager_update(oe, me, x, t)
            returned.append(step(x, t))
            for name in ('loss', 'accuracy', 'y'):
                numpy.testing.assert_array_equal(getattr(me, name).array,
                                                 getattr(ms, name).array,
                                                 err_msg='step {} model.{}'.format(i, name))
            for model in kept:
                kept[model].append((model.loss, model.y))
    assert step.replays == (8 if alternate else 4)
    for i, ((le, ye), (ls, ys), r) in enumerate(zip(kept[me], kept[ms], returned)):
        numpy.testing.assert_array_equal(le.array, ls.array, err_msg='kept loss {}'.format(i))
        numpy.testing.assert_array_equal(le.array, r.array, err_msg='returned {}'.format(i))
        numpy.testing.assert_array_equal(ye.array, ys.array, err_msg='kept y {}'.format(i))


def test_reported_variables_stay_variables_with_this_steps_values():
    """Each step's observation keeps its own values after later steps (the recording step's
    too: its Variables are L.Classifier's attributes, which replays used to rebind), and
    checks of a step that reports what it keeps in a link find nothing changed (they used to
    take the rebound Variable for a new value at every check, and trace again)."""
    (me, oe), (ms, os_) = pair(lambda: L.Classifier(MLP()))
    step = TrainStep(ms, os_, check_every=3)
    kept = []
    with warnings.catch_warnings():
        warnings.simplefilter('error', RuntimeWarning)
        for i, (x, t) in enumerate(data(12)):
            seen = []
            for model, run in ((me, lambda: eager_update(oe, me, x, t)),
                               (ms, lambda: step(x, t))):
                reporter = reporter_module.Reporter()
                reporter.add_observer('main', model)
                observation = {}
                with reporter.scope(observation):
                    run()
                seen.append(observation)
            assert seen[0].keys() == seen[1].keys() == {'main/loss', 'main/accuracy'}
            kept.append(seen)
    for i, (eager, replayed) in enumerate(kept):
        for key in eager:
            assert isinstance(replayed[key], chainer.Variable), (i, key)
            numpy.testing.assert_array_equal(eager[key].array, replayed[key].array,
                                             err_msg='step {} {}'.format(i, key))
    assert step.traces == 1 and step.checks == 3 and step.replays == 6


@pytest.mark.parametrize('kind', ['numpy scalar', '0-d array', 'constant'])
def test_a_numpy_metric_equal_in_the_two_recorded_steps_is_not_frozen(kind):
    """A per-batch metric computed with NumPy in the loss function ((y.array.argmax(1) ==
    t).mean()) that happened to be equal in the two recorded steps (an accuracy of 0 early in
    training) was taken for a constant and reported by every replay until the next check
    (found by an audit). A NumPy value made anew in each step now makes the step run
    eagerly, said once; one object reported in every step (a constant) still replays."""
    constant = numpy.float32(0.5)

    class Metric(MLP):
        def forward(self, x):
            y = super().forward(x)
            value = {'numpy scalar': lambda: numpy.float64(0.0) + (y.array.size < 0),
                     '0-d array': lambda: numpy.zeros((), numpy.float32),
                     'constant': lambda: constant}[kind]()
            chainer.report({'metric': value})
            return y
    (me, oe), (ms, os_) = pair(Metric)
    step = TrainStep(ms, os_, lambda x, t: F.softmax_cross_entropy(ms(x), t))
    with warnings.catch_warnings(record=True) as said, reporter_module.Reporter().scope({}):
        warnings.simplefilter('always')
        steps_equal_eager(step, lambda m: lambda x, t: F.softmax_cross_entropy(m(x), t),
                          ms, me, oe)
    refused = [str(w.message) for w in said if 'cannot be replayed' in str(w.message)]
    if kind == 'constant':
        assert refused == [] and step.replays == 3
    else:
        assert len(refused) == 1 and step.replays == 0
        assert re.search(r"the reported value 'metric' \((0\.0|<array \(\) float32>)\) is a "
                         r'NumPy value the loss function computes in Python at every step',
                         refused[0]), refused[0]


def test_the_captured_steps_reports_are_given_arrays_of_their_own():
    """The GPU capture's reports hold the graph's arrays, which every later launch overwrites:
    after the first launch, ``detach_reports`` gives every observation the capture reported to
    (the caller's and one a model's own reporter holds) copies, Variables staying Variables,
    numbers as they were. Here on the CPU, a launch played by overwriting the arrays."""
    from chainer_tc.static_graph import _trace
    model = L.Classifier(MLP())
    outer, own = reporter_module.Reporter(), reporter_module.Reporter()
    outer.add_observer('main', model)
    observation, stats = {}, {}
    x, t = data(1)[0]
    with outer.scope(observation), _trace.Recorder() as rec:
        model(x, t)
        with own.scope(stats):
            chainer.report({'n': 3, 'raw': numpy.ones(2, numpy.float32)})
    graphs = [observation['main/loss'].array, observation['main/accuracy'].array, stats['raw']]
    values = [a.copy() for a in graphs]
    _trace.detach_reports(rec.trace.reports, rec.outer)
    for a in graphs:
        a[...] = numpy.nan                           # the next launch
    assert isinstance(observation['main/loss'], chainer.Variable) and stats['n'] == 3
    kept = [observation['main/loss'].array, observation['main/accuracy'].array, stats['raw']]
    for a, b in zip(kept, values):
        numpy.testing.assert_array_equal(a, b)


def observed(model, opt, step, batches):
    """Each step's observation, reported to a reporter with ``model`` as 'main' (a Trainer's
    iteration): ``step(*batch)``, or an eager ``opt.update`` where ``step`` is None."""
    out = []
    for batch in batches:
        reporter = reporter_module.Reporter()
        reporter.add_observer('main', model)
        observation = {}
        with reporter.scope(observation):
            if step is None:
                opt.update(model, *batch)
            else:
                step(*batch)
        out.append(observation)
    return out


def test_kept_observations_of_every_step_keep_their_values_on_the_cpu():
    """The CPU replay's arrays are those of the recorded step that built it: its reports (a
    hidden layer reported as a Variable, as its array, as a view of it) were overwritten by the
    replays after it, where an eager step's stay as they were (found by an audit: an extension
    keeping observations). That step's observation now gets copies, as the capture's does."""
    class Reporting(MLP):
        def forward(self, x):
            h = F.relu(self.l1(x))
            chainer.report({'h': h, 'h_array': h.array, 'h_row': h.array[0], 'h0': h[0],
                            'mean': F.mean(h)})
            return self.l2(h)
    kept = []
    for use_step in (False, True):
        model = L.Classifier(Reporting())
        opt = optimizers.MomentumSGD(lr=0.1, weight_decay=1e-3).setup(model)
        step = TrainStep(model, opt) if use_step else None
        kept.append(observed(model, opt, step, data(8)))
    assert step.replays == 5 and step.traces == 1
    for i, (eager, replayed) in enumerate(zip(*kept)):
        assert eager.keys() == replayed.keys()
        for key, v in eager.items():
            u = replayed[key]
            assert type(u) is type(v), (i, key)
            numpy.testing.assert_array_equal(getattr(u, 'array', u), getattr(v, 'array', v),
                                             err_msg='step {} {}'.format(i, key))


@pytest.mark.gpu
def test_a_kept_observation_of_the_captured_step_keeps_its_values_on_the_gpu():
    import cupy
    runs = []
    for use_step in (False, True):
        model = L.Classifier(MLP())
        model.to_device('@cupy:0')
        opt = optimizers.MomentumSGD(lr=0.1, weight_decay=1e-3).setup(model)
        step = TrainStep(model, opt) if use_step else None
        kept = observed(model, opt, step, [(cupy.asarray(x), cupy.asarray(t))
                                           for x, t in data(8)])
        runs.append([float(o['main/loss'].array) for o in kept])
    assert step.replays == 6 and step.traces == 1   # the capture launches step 3
    numpy.testing.assert_allclose(runs[1], runs[0], rtol=1e-5)     # cuBLAS algorithms may differ


def test_a_reporter_the_step_makes_current_gets_the_replayed_reports():
    """A model with a reporter of its own (its statistics dict kept across steps): replayed
    reports go there, not to the caller's reporter."""
    class Reporting(MLP):
        def __init__(self):
            super().__init__()
            self.stats, self.reporter = {}, reporter_module.Reporter()

        def forward(self, x):
            y = super().forward(x)
            with self.reporter.scope(self.stats):
                chainer.report({'mean': F.mean(y)})
            return y

    (me, oe), (ms, os_) = pair(Reporting)
    step = TrainStep(ms, os_, lambda x, t: F.softmax_cross_entropy(ms(x), t))
    outer = reporter_module.Reporter()
    for i, (x, t) in enumerate(data(6)):
        observation = {}
        with outer.scope(observation):
            eager_update(oe, lambda x, t: F.softmax_cross_entropy(me(x), t), x, t)
            step(x, t)
        assert observation == {}, 'nothing reaches the caller'
        numpy.testing.assert_array_equal(me.stats['mean'].array, ms.stats['mean'].array,
                                         err_msg='step {}'.format(i))
    assert step.replays == 3


def test_steps_logged_now_and_then_report_like_eager_steps():
    """Steps called outside any reporter, and every third one inside a reporter's scope (a
    loop that logs now and then, or a Trainer made after a warm-up loop): chainer.report does
    nothing without a reporter, so a step traced outside one recorded no reports, and its
    replays inside one reported nothing. Whether a reporter is current is part of the
    signature. Found by review."""
    def run(use_step):
        model = L.Classifier(MLP())
        opt = optimizers.MomentumSGD(lr=0.1).setup(model)
        rep = reporter_module.Reporter()
        rep.add_observer('main', model)
        step = TrainStep(model, opt) if use_step else None
        seen = []
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', RuntimeWarning)      # the new signature, said
            for i, (x, t) in enumerate(data(15)):
                logged = i % 3 == 2
                observation = {}
                with rep.scope(observation) if logged else contextlib.nullcontext():
                    step(x, t) if use_step else opt.update(model, x, t)
                if logged:
                    seen.append({k: v.array.copy() for k, v in observation.items()})
        return seen, step
    eager, _ = run(False)
    replayed, step = run(True)
    assert step.replays >= 6 and len(replayed) == 5
    for i, (a, b) in enumerate(zip(eager, replayed)):
        assert a.keys() == b.keys() == {'main/loss', 'main/accuracy'}, i
        for k in a:
            numpy.testing.assert_array_equal(a[k], b[k], err_msg='{} {}'.format(i, k))


def test_a_replaced_persistent_array_retraces_and_is_updated():
    (me, oe), (ms, os_) = pair(lambda: MLP(bn=True))
    step = TrainStep(ms, os_, lambda x, t: F.softmax_cross_entropy(ms(x), t))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for i, (x, t) in enumerate(data(12)):
            if i in (5, 8):                          # a user resets the running statistics
                me.bn.avg_mean = numpy.zeros(8, numpy.float32)
                ms.bn.avg_mean = numpy.zeros(8, numpy.float32)
            eager_update(oe, lambda x, t: F.softmax_cross_entropy(me(x), t), x, t)
            step(x, t)
            assert_same(params(me), params(ms), 'step {}'.format(i))
    notes = [str(w.message) for w in caught if 'persistent array' in str(w.message)]
    assert len(notes) == 1 and 'traced again' in notes[0], 'said once'
    assert step.traces == 3 and step.replays == 3, 'traced at 2, 7, 10; replays at 3, 4, 11'


def test_a_graph_carried_into_the_next_step_keeps_its_inputs():
    """A model that adds the previous step's hidden state, graph and all (a stateful RNN
    without reset): the step refuses the replay, and every step, recorded ones included,
    equals the eager step."""
    class Carry(MLP):
        prev = None

        def forward(self, x):
            h = self.l1(x)
            if self.prev is not None:
                h = h + 0.5 * self.prev
            self.prev = h
            return self.l2(F.relu(h))

    (me, oe), (ms, os_) = pair(Carry)
    step = TrainStep(ms, os_, lambda x, t: F.softmax_cross_entropy(ms(x), t))
    with pytest.warns(RuntimeWarning, match='cannot be replayed, it runs eagerly'):
        for i, (x, t) in enumerate(data(5)):
            eager_update(oe, lambda x, t: F.softmax_cross_entropy(me(x), t), x, t)
            step(x, t)
            assert_same(params(me), params(ms), 'step {}'.format(i))
    assert step.replays == 0


@pytest.mark.parametrize('how', ['pickle', 'deepcopy'])
def test_a_used_step_pickles_and_deep_copies_and_goes_on_like_eager_steps(how):
    (me, oe), (ms, os_) = pair(lambda: L.Classifier(MLP(bn=True)))
    step = TrainStep(ms, os_)
    batches = data(12)
    for x, t in batches[:6]:
        eager_update(oe, me, x, t)
        step(x, t)
    assert step.replays == 3
    clone = pickle.loads(pickle.dumps(step)) if how == 'pickle' else copy.deepcopy(step)
    assert clone.model is clone.optimizer.target and clone.model is not ms
    for x, t in batches[6:]:
        eager_update(oe, me, x, t)
        clone(x, t)
    assert_same(params(me), params(clone.model), 'after the copy')
    assert clone.replays == 3 + 3, 'traced again: two recorded steps, then replays'


def test_a_parameter_replaced_during_warm_up_starts_it_again_without_a_warning():
    """Only traces are dropped with a warning: before the first trace, a replaced parameter
    (the optimizer rebuilds its buffers) just restarts the warm-up."""
    (me, oe), (ms, os_) = pair(MLP)
    step = TrainStep(ms, os_, lambda x, t: F.softmax_cross_entropy(ms(x), t), warmup=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for i, (x, t) in enumerate(data(8)):
            if i == 1:
                for model in (me, ms):
                    model.l1.W.array = model.l1.W.array.copy()
            eager_update(oe, lambda x, t: F.softmax_cross_entropy(me(x), t), x, t)
            step(x, t)
            assert_same(params(me), params(ms), 'step {}'.format(i))
    assert step.traces == 1 and step.replays == 3, 'warm-up 1, 2 (again), recorded 3, 4'
    assert any('rebuilds its buffers' in str(w.message) for w in caught), "the optimizer's"
    assert not [w for w in caught if 'traced again' in str(w.message)], 'none of the step\'s'


def test_a_variable_the_user_keeps_in_a_link_and_replaces_stays_replaced():
    """Only Variables holding results of the step's functions are put back after a replay; a
    user's own Variable attribute (a temperature) replaced mid-run stays replaced, and the
    next check sees the new value."""
    class Tempered(MLP):
        def __init__(self):
            super().__init__()
            self.temperature = chainer.Variable(numpy.array(1.0, numpy.float32),
                                                requires_grad=False)

        def forward(self, x):
            y = super().forward(x)
            return y / F.broadcast_to(self.temperature, y.shape)
    model = Tempered()
    opt = optimizers.MomentumSGD(lr=0.1).setup(model)
    step = TrainStep(model, opt, lambda x, t: F.softmax_cross_entropy(model(x), t),
                     check_every=3)
    new = chainer.Variable(numpy.array(4.0, numpy.float32), requires_grad=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for call, (x, t) in enumerate(data(12), 1):
            if call == 6:                   # a check: 1 eager, 2-3 recorded, 4-5 replays
                model.temperature = new
            step(x, t)
            assert model.temperature is (new if call >= 6 else model.temperature)
    assert any('changed after it was traced' in str(w.message) and 'shape (): 1.0 then 4.0'
               in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert step.traces == 2


def test_with_a_gradient_reduction_param_grad_is_the_reduced_gradient_after_every_step():
    """As a replay (and ChainerMN's allreduce) leaves it: also after the step's eager, recorded
    and check steps."""
    model = MLP()
    opt = optimizers.MomentumSGD(lr=0.1).setup(model)
    reduced = []

    def halve(buffers):
        for b in buffers:
            b *= 0.5
        reduced[:] = buffers
    step = TrainStep(model, opt, lambda x, t: F.softmax_cross_entropy(model(x), t),
                     reduce_gradients=halve, check_every=3)
    for call, (x, t) in enumerate(data(9), 1):
        step(x, t)
        for name, p in model.namedparams():
            assert any(numpy.shares_memory(p.grad, b) for b in reduced), (call, name)
    assert step.replays >= 4 and step.checks >= 1


def test_a_plain_backward_between_steps_leaves_replays_with_hooks_unscaled_right():
    """Loss scaling and an optimizer hook (the update runs through ``optimizer.update()``,
    which unscales the gradients marked scaled), and a plain ``backward()`` between steps (a
    gradient norm on a validation batch) that leaves its own marks: replays put the recorded
    step's marks back, as an eager step's backward does."""
    (me, oe), (ms, os_) = pair(MLP)
    for opt in (oe, os_):
        opt.loss_scaling(scale=1024.0)
        opt.add_hook(chainer.optimizer_hooks.GradientClipping(100.0))
    step = TrainStep(ms, os_, lambda x, t: F.softmax_cross_entropy(ms(x), t))
    (vx, vt), = data(1, seed=9)
    for i, (x, t) in enumerate(data(8)):
        eager_update(oe, lambda x, t: F.softmax_cross_entropy(me(x), t), x, t)
        step(x, t)
        assert_same(params(me), params(ms), 'step {} params'.format(i))
        for model in (me, ms):                 # diagnostics: an unscaled gradient
            model.cleargrads()
            F.softmax_cross_entropy(model(vx), vt).backward()
    assert step.replays == 5


class Counting(MLP):
    """MLP with persistent arrays the loss function may update in Python."""

    def __init__(self):
        super().__init__(bn=True)
        self.add_persistent('center', numpy.zeros(8, numpy.float32))
        with self.init_scope():
            self.l1.add_persistent('calls', numpy.zeros(1, numpy.int64))


@pytest.mark.parametrize('what', ['input', 'parameter', 'persistent', 'persistent_read'])
def test_a_write_in_place_in_the_loss_function_is_refused_with_what_was_written(what):
    """``x -= x.mean(0)`` on the batch, a constraint applied with ``out=`` to a parameter, a
    counter or a running mean kept in a persistent array (one also read by the loss), updated
    in the loss function: no recorded function made the write, so a replay would not redo it
    (the arrays keep their identity: comparing the steps cannot see it). Refused, naming the
    array; every step equals an eager one. BatchNormalization's running statistics, which its
    function is handed and updates, still replay (the other tests). Found by review (the
    persistent arrays: replays silently left them as the last eager step had)."""
    def lossfun(model):
        def f(x, t):
            if what == 'input':
                x -= x.mean(axis=0)
            elif what == 'parameter':
                numpy.clip(model.l1.W.array, -0.2, 0.2, out=model.l1.W.array)
            elif what == 'persistent':
                model.l1.calls[...] += 1
            h = model.l1(x)
            if what == 'persistent_read':
                model.center[...] = 0.9 * model.center + 0.1 * h.array.mean(axis=0)
                h = h - model.center
            return F.softmax_cross_entropy(model.l2(F.relu(model.bn(h))), t)
        return f
    (me, oe), (ms, os_) = pair(Counting)
    step = TrainStep(ms, os_, lossfun(ms))
    name = {'input': 'input 0', 'parameter': 'parameter l1/W', 'persistent': 'persistent l1/calls',
            'persistent_read': r'persistent center before function #\d+ \(_ - _\) read it'}[what]
    with pytest.warns(RuntimeWarning, match='cannot be replayed.*wrote into {} in place'
                      .format(name)):
        for i, (x, t) in enumerate(data(6)):
            eager_update(oe, lossfun(me), x.copy(), t)
            step(x.copy(), t)
            assert_same(params(me), params(ms), 'step {} params'.format(i))
    assert step.replays == 0


class OneHotTarget(MLP):
    """MLP whose loss is against a one-hot target kept in a buffer and refilled in place each
    step (``always_same``: with the same values every step)."""

    def __init__(self, always_same=False):
        super().__init__()
        self.target = numpy.zeros((4, 5), numpy.float32)
        self.always_same = always_same

    def loss(self, x, t):
        self.target[...] = 0
        self.target[numpy.arange(len(t)), 0 if self.always_same else t] = 1
        return F.mean_squared_error(F.softmax(self(x)), self.target)


@pytest.mark.parametrize('always_same', [False, True])
def test_a_buffer_the_loss_function_refills_in_place_is_compared_by_its_values(always_same):
    """The same array object in every recorded step, so comparing it with itself always
    passed: replays read what the last eager step left in it. A recorded step compares such
    an array (read by an op, made by none, no input, parameter or state) as the op reads it
    with its value when the step began: refused (runs eagerly, warned, naming the function)
    when the step wrote into it, replayed when it did not. (An array code outside the step
    changes, another model's parameter, is read live: the GAN test.) Every step equals an
    eager one. Found by review."""
    (me, oe), (ms, os_) = pair(lambda: OneHotTarget(always_same))
    step = TrainStep(ms, os_, ms.loss, check_every=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for i, (x, t) in enumerate(data(8)):
            eager_update(oe, me.loss, x, t)
            step(x, t)
            assert_same(params(me), params(ms), 'step {} params'.format(i))
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    if always_same:
        assert step.replays > 0 and not said
    else:
        assert step.replays == 0
        assert len(said) == 1 and re.search(r'wrote into an array function #\d+ '
                                            r'\(MeanSquaredError\) reads \(shape \(4, 5\)\) '
                                            r'in place', said[0]), said


class LateWrites(MLP):
    """MLP with state the loss function changes in Python: ``how='queue'``, a MoCo-style
    queue (a plain attribute) that a function reads and that is refilled after it;
    ``how='class_weight'``, class weights kept as a persistent array and refilled before
    ``softmax_cross_entropy`` is handed them; ``how='counter'``, a persistent number;
    ``how='stats'``, running statistics kept as plain arrays and handed to
    ``F.batch_normalization``, which updates them (state a function updates: replayed)."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.queue = numpy.zeros((5, 6), numpy.float32)
        self.add_persistent('class_weight', numpy.ones(5, numpy.float32))
        self.add_persistent('seen', 0)
        with self.init_scope():
            self.gamma = chainer.Parameter(numpy.ones(8, numpy.float32))
            self.beta = chainer.Parameter(numpy.zeros(8, numpy.float32))
        self.mean, self.var = numpy.zeros(8, numpy.float32), numpy.ones(8, numpy.float32)

    def loss(self, x, t):
        h = self.l1(x)
        if self.how == 'stats':
            h = F.batch_normalization(h, self.gamma, self.beta, running_mean=self.mean,
                                      running_var=self.var)
        y = self.l2(F.relu(h))
        if self.how == 'queue':
            y = y + F.matmul(y, self.queue)[:, :5] * 0.1
            self.queue[:4, :4] = y.array[:, :4].T           # after the read
        if self.how == 'class_weight':
            self.class_weight[...] = 1 + numpy.bincount(t, minlength=5)
        if self.how == 'counter':
            self.seen += len(x)
        return F.softmax_cross_entropy(y, t, class_weight=self.class_weight)


@pytest.mark.parametrize('how,said', [
    ('queue', r'wrote into an array function #\d+ \(MatMul\) reads \(shape \(5, 6\)\), '
              r'after it read it'),
    ('class_weight', r'wrote into persistent class_weight before function #\d+ '
                     r'\(SoftmaxCrossEntropy\) read it'),
    ('counter', r'wrote into persistent seen \(a number: 4 when the step began, 8 after it\)'),
    ('stats', None)])
def test_state_the_loss_function_changes_in_python_is_refused(how, said):
    """Three writes a replay would not redo, each silently frozen before (the values replays
    used were the last recorded step's; found by an adversarial review): an array a function
    read and the loss function wrote into afterwards, a persistent array written before the
    function it is handed to reads it (it was exempt, as BatchNormalization's running
    statistics are), and a persistent number. Each is refused, naming it, and every step equals
    an eager one; running statistics a function updates in place still replay."""
    (me, oe), (ms, os_) = pair(lambda: LateWrites(how))
    step = TrainStep(ms, os_, ms.loss)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for i, (x, t) in enumerate(data(7)):
            eager_update(oe, me.loss, x, t)
            step(x, t)
            assert_same(params(me), params(ms), 'step {} params'.format(i))
            assert me.seen == ms.seen
            state = ('queue', 'class_weight', 'mean', 'var')
            assert_same({a: getattr(me, a) for a in state}, {a: getattr(ms, a) for a in state},
                        'step {} state'.format(i))
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    if said is None:
        assert step.replays == 4 and not messages, messages
    else:
        assert step.replays == 0
        assert len(messages) == 1 and re.search('cannot be replayed.*' + said, messages[0]), \
            messages


@pytest.mark.parametrize('how,function', [
    ('clip', r'#2 \(LinearFunction\) \(shape \(4, 5\)\)'),
    ('mask', r'#0 \(LinearFunction\) \(shape \(4, 8\)\)'),
    ('loss', r'#\d+ \(SoftmaxCrossEntropy\) \(shape \(\)\)')])
def test_a_write_in_place_into_a_functions_result_is_refused(how, function):
    """``numpy.clip(y.array, .., out=y.array)``, rows of a hidden layer zeroed in place, the loss
    scaled in place: a replay recomputes each result and skips the write (silently different
    parameters and a different returned loss before; found by an adversarial review). A
    recorded step checksums the forward's results as its functions make them and again before
    the backward: refused, naming the function whose result was written; every step equals an
    eager one."""
    def lossfun(model):
        def f(x, t):
            h = model.l1(x)
            if how == 'mask':
                h.array[t == 0] = 0
            y = model.l2(F.relu(h))
            if how == 'clip':
                numpy.clip(y.array, -0.3, 0.3, out=y.array)
            loss = F.softmax_cross_entropy(y, t)
            if how == 'loss':
                loss.array *= 2
            return loss
        return f
    (me, oe), (ms, os_) = pair(MLP)
    step = TrainStep(ms, os_, lossfun(ms))
    with pytest.warns(RuntimeWarning, match='cannot be replayed.*wrote into the result of '
                                            'function ' + function + ' in place'):
        steps_equal_eager(step, lossfun, ms, me, oe)
    assert step.replays == 0


def test_iterating_over_a_variable_replays():
    """``a, b = y[:2]`` or ``list(y)`` iterate over a Variable: Python calls ``y[i]`` until
    GetItem raises IndexError, which the iteration catches. The failed GetItem made nothing
    and is no part of the step (it was recorded as a function whose forward did not return,
    and such models ran eagerly, warned). Replayed, every step equal to an eager one."""
    def lossfun(model):
        def f(x, t):
            y = model(x)
            a, b = y[:2]
            rows = list(F.transpose(y))
            return F.softmax_cross_entropy(y, t) + F.sum(a * b) * 0.01 + sum(
                F.sum(r * r) for r in rows) * 0.001
        return f
    (me, oe), (ms, os_) = pair(MLP)
    step = TrainStep(ms, os_, lossfun(ms))
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        steps_equal_eager(step, lossfun, ms, me, oe)
    assert step.replays == 3


def test_an_input_variable_with_a_graph_is_refused_and_one_needing_a_gradient_is_warned_of():
    """A step runs from copies of its inputs' arrays: a Variable computed by functions (a
    model's output fed to the step) would leave what made it untrained, silently, so it is
    refused; a Variable that requires a gradient gets no .grad, said once; one that does not
    is taken as its array."""
    (me, oe), (ms, os_) = pair(MLP)
    step = TrainStep(ms, os_, lambda x, t: F.softmax_cross_entropy(ms(x), t))
    (x, t), = data(1)
    with pytest.raises(TypeError, match='input 0 is a Variable computed by Mul'):
        step(chainer.Variable(x) * 2, t)
    with pytest.warns(RuntimeWarning, match='input 0 is a Variable that requires a gradient'):
        step(chainer.Variable(x), t)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        step(chainer.Variable(x), t)                           # said once
        step(chainer.Variable(x, requires_grad=False), chainer.Variable(t))
    for _ in range(3):                                         # the three steps taken
        eager_update(oe, lambda x, t: F.softmax_cross_entropy(me(x), t), x, t)
    assert_same(params(me), params(ms), 'params')


def test_a_replaced_parameter_the_optimizer_does_not_train_retraces():
    """A frozen backbone left out of the optimizer (set up on the head only): replays read its
    parameters as constants, so replacing one's array (loading other weights) drops the traces,
    said once, and every step equals an eager one."""
    models = [MLP(), MLP()]
    opts = [optimizers.MomentumSGD(lr=0.1).setup(m.l2) for m in models]
    (me, ms), (oe, os_) = models, opts
    step = TrainStep(ms, os_, lambda x, t: F.softmax_cross_entropy(ms(x), t))
    new = numpy.random.RandomState(5).randn(8, 6).astype(numpy.float32)
    with pytest.warns(RuntimeWarning, match='the array of l1/W .*was replaced'):
        for i, (x, t) in enumerate(data(12)):
            if i == 6:
                for m in models:
                    m.l1.W.array = new.copy()
            eager_update(oe, lambda x, t: F.softmax_cross_entropy(me(x), t), x, t)
            step(x, t)
            assert_same(params(me), params(ms), 'step {} params'.format(i))
    assert step.traces == 2


class MaybeExtra(MLP):
    def forward(self, x):
        y = super().forward(x)
        extra = getattr(self, 'extra', None)
        return y if extra is None else extra(y)


@pytest.mark.parametrize('how', ['replace a link', 'replace a Parameter', 'delete a link',
                                 'add a link', 'set an update rule to None'])
def test_a_change_of_the_models_structure_is_seen_at_the_next_step(how):
    """Without optimizer.setup() again: the step after the change equals the eager one (no
    check needed: check_every=None), the traces are dropped, said once, naming the parameters."""
    def make():
        m = MaybeExtra()
        with m.init_scope():
            m.extra = L.Linear(5, 5, initialW=numpy.eye(5, dtype=numpy.float32) * 0.5)
        return m
    (me, oe), (ms, os_) = pair(make)
    step = TrainStep(ms, os_, lambda x, t: F.softmax_cross_entropy(ms(x), t), check_every=None)
    names = {'replace a link': '/l2/W, /l2/b', 'replace a Parameter': '/l1/W',
             'delete a link': '/extra/W, /extra/b', 'add a link': '/more/W, /more/b',
             'set an update rule to None': '/extra/W'}[how]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always')
        for i, (x, t) in enumerate(data(12)):
            if i == 6:
                for m in (me, ms):
                    if how == 'replace a link':
                        del m.l2
                        with m.init_scope():
                            m.l2 = L.Linear(8, 5, initialW=numpy.ones((5, 8), numpy.float32))
                    elif how == 'replace a Parameter':
                        with m.l1.init_scope():
                            m.l1.W = chainer.Parameter(m.l1.W.array * 0.5)
                    elif how == 'delete a link':
                        del m.extra
                    elif how == 'add a link':
                        del m.extra
                        with m.init_scope():
                            m.more = L.Linear(5, 5, initialW=numpy.eye(5, dtype=numpy.float32))
                        m.extra = m.more          # (not a child: set outside init_scope)
                    else:
                        m.extra.W.update_rule = None
            eager_update(oe, lambda x, t: F.softmax_cross_entropy(me(x), t), x, t)
            step(x, t)
            assert_same(params(me), params(ms), 'step {} params'.format(i))
    dropped = [str(w.message) for w in said if 'every trace is dropped' in str(w.message)]
    assert len(dropped) == 1 and names in dropped[0], dropped
    assert step.traces == 2 and step.checks == 0


class StridedGradients(chainer.Chain):
    """Parameters whose gradient Chainer leaves as a strided view: a depthwise convolution
    (its W goes through F.transpose), a weight used only transposed, a parameter only summed
    (a broadcast gradient)."""

    def __init__(self, kind):
        super().__init__()
        r = numpy.random.RandomState(0)
        self.kind = kind
        with self.init_scope():
            self.dw = L.DepthwiseConvolution2D(3, 2, 3, pad=1,
                                               initialW=r.randn(2, 3, 3, 3).astype('f') * 0.3)
            self.tied = L.Linear(6, 6, initialW=r.randn(6, 6).astype(numpy.float32) * 0.3)
            self.p = chainer.Parameter(r.randn(6).astype(numpy.float32))
            self.fc = L.Linear(6, 5, initialW=r.randn(5, 6).astype(numpy.float32) * 0.3)

    def forward(self, x, t):
        if self.kind == 'depthwise':
            h = F.mean(self.dw(x), axis=(2, 3))
        else:
            h = F.mean(F.concat([x, x]), axis=(2, 3))
        if self.kind == 'transposed':
            h = F.relu(F.linear(h, F.transpose(self.tied.W)))
        loss = F.softmax_cross_entropy(self.fc(h), t)
        if self.kind == 'summed':
            loss = loss + 0.1 * F.sum(self.p)
        return loss


@pytest.mark.parametrize('scaled', [False, True])
@pytest.mark.parametrize('reduce', [False, True])
@pytest.mark.parametrize('kind', ['depthwise', 'transposed', 'summed'])
def test_a_strided_parameter_gradient_replays_like_eager_steps(kind, reduce, scaled):
    """Such a gradient is copied into the parameter's flat view after each replay (it used to
    be refused as 'produced outside the recorded functions'). With loss scaling, the eager
    update leaves a float32 gradient divided (as Chainer), the strided one included (its
    quotient copied back; a read-only one, the summed parameter's, is left as it is); so
    does a replay."""
    (me, oe), (ms, os_) = pair(lambda: StridedGradients(kind))
    if scaled:
        oe.loss_scaling(scale=8.0)
        os_.loss_scaling(scale=8.0)
    step = TrainStep(ms, os_, reduce_gradients=(lambda buffers: None) if reduce else None)
    r = numpy.random.RandomState(1)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        for i in range(8):
            x = r.randn(4, 3, 5, 5).astype(numpy.float32)
            t = r.randint(0, 5, 4).astype(numpy.int32)
            eager_update(oe, me, x, t)
            step(x, t)
            expect = grads(me)
            if reduce:                # (with a reduction an unused parameter's grad is zeros)
                expect = {n: numpy.zeros_like(p.array) if expect[n] is None else expect[n]
                          for n, p in me.namedparams()}
                if scaled and kind == 'summed':
                    # the gradients are the flat buffers then: the read-only one's is divided
                    expect['/p'] = expect['/p'] / numpy.float32(8)
            assert_same(expect, grads(ms), 'step {} grads'.format(i))
            assert_same(params(me), params(ms), 'step {} params'.format(i))
    assert step.replays == 5


@pytest.mark.gpu
@pytest.mark.parametrize('kind', ['depthwise', 'transposed', 'summed'])
def test_a_strided_parameter_gradient_is_captured_on_the_gpu(kind):
    import cupy
    runs = []
    for use_step in (False, True):
        model = StridedGradients(kind)
        model.to_device('@cupy:0')
        opt = optimizers.MomentumSGD(lr=0.1, weight_decay=1e-3).setup(model)
        step = TrainStep(model, opt) if use_step else None
        r = numpy.random.RandomState(1)
        with warnings.catch_warnings():
            warnings.simplefilter('error', RuntimeWarning)      # captured, nothing refused
            for _ in range(8):
                x = cupy.asarray(r.randn(4, 3, 5, 5).astype(numpy.float32))
                t = cupy.asarray(r.randint(0, 5, 4).astype(numpy.int32))
                if step is None:
                    opt.update(model, x, t)
                else:
                    step(x, t)
        runs.append({n: p.array.copy() for n, p in model.namedparams()})
        # each grad as an eager step leaves it: the strided view backward made
        runs[-1].update({n + ' strides': p.grad.strides for n, p in model.namedparams()
                         if p.grad is not None})
    assert step.replays == 6 and step.traces == 1   # the capture launches step 3
    # cuBLAS may pick other algorithms on the capture's handle (test_static_graph.py)
    for k in runs[0]:
        if k.endswith('strides'):
            assert runs[0][k] == runs[1][k], k
        else:
            cupy.testing.assert_allclose(runs[0][k], runs[1][k], rtol=1e-5, atol=1e-6,
                                         err_msg=k)


class Dense(chainer.Chain):
    """Linear layers through ``sizes``, ReLU between them, ``tanh`` after the last if asked:
    a GAN's generator (4 -> 6, tanh) or discriminator (6 -> 8 -> 1)."""

    def __init__(self, sizes, seed, tanh=False):
        super().__init__()
        r = numpy.random.RandomState(seed)
        self.tanh = tanh
        with self.init_scope():
            self.layers = chainer.ChainList(*[
                L.Linear(a, b, initialW=r.randn(b, a).astype(numpy.float32) * 0.3)
                for a, b in zip(sizes, sizes[1:])])

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x if i == 0 else F.relu(x))
        return F.tanh(x) if self.tanh else x


@pytest.mark.parametrize('separated', [False, True])
def test_a_gan_replays_when_each_loss_keeps_to_its_model_and_is_told_why_when_not(separated):
    """Two TrainSteps whose losses run through both models: the discriminator's backward adds
    to the generator's gradients, which its optimizer never clears. That is refused, saying
    so (it used to blame an array computed with NumPy); with the fix the message gives (the
    fake batch passed as an array, the other model's gradients cleared in the loss) both
    steps replay, equal to eager steps."""
    def losses(gen, dis):
        def loss_dis(x, z):
            fake = gen(z)
            return (F.mean(F.softplus(-dis(x)))
                    + F.mean(F.softplus(dis(fake.array if separated else fake))))

        def loss_gen(z):
            if separated:
                dis.cleargrads()
            return F.mean(F.softplus(-dis(gen(z))))
        return loss_dis, loss_gen
    r = numpy.random.RandomState(0)
    batches = [(r.randn(5, 6).astype(numpy.float32), r.randn(5, 4).astype(numpy.float32))
               for _ in range(10)]
    runs = []
    for use_step in (False, True):
        gen, dis = Dense((4, 6), 1, tanh=True), Dense((6, 8, 1), 2)
        og = optimizers.MomentumSGD(lr=0.05).setup(gen)
        od = optimizers.MomentumSGD(lr=0.05).setup(dis)
        loss_dis, loss_gen = losses(gen, dis)
        if use_step:
            sd, sg = TrainStep(dis, od, loss_dis), TrainStep(gen, og, loss_gen)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter('always')
            for x, z in batches:
                if use_step:
                    sd(x, z)
                    sg(z)
                else:
                    eager_update(od, loss_dis, x, z)
                    eager_update(og, loss_gen, z)
        runs.append({**params(gen), **{'dis' + k: v for k, v in params(dis).items()}})
    assert_same(runs[0], runs[1], 'params')
    messages = [str(w.message) for w in said if issubclass(w.category, RuntimeWarning)]
    if separated:
        assert messages == [] and sd.replays == sg.replays == 7
    else:
        assert sd.replays == sg.replays == 0 and len(messages) == 2
        for m, shape in zip(messages, ['(6, 4)', '(1, 8)']):
            assert re.search(r'input 0 is the gradient of parameter W of shape {}, held '
                             r"before the step, which the backward adds to: this step's "
                             r'optimizer does not train it'.format(re.escape(shape)), m), m


class Blocks(chainer.Chain):
    """Two same-shape blocks in a ChainList and an activation link without parameters."""

    def __init__(self):
        super().__init__()
        r = numpy.random.RandomState(0)
        with self.init_scope():
            self.l1 = L.Linear(6, 8, initialW=r.randn(8, 6).astype(numpy.float32) * 0.3)
            self.blocks = chainer.ChainList(*[
                L.Linear(8, 8, initialW=r.randn(8, 8).astype(numpy.float32) * 0.3)
                for _ in range(2)])
            self.act = Activation(F.tanh)
            self.l2 = L.Linear(8, 5, initialW=r.randn(5, 8).astype(numpy.float32) * 0.3)

    def forward(self, x):
        h = F.relu(self.l1(x))
        for block in self.blocks:
            h = self.act(block(h))
        return self.l2(h)


class Activation(chainer.Link):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, x):
        return self.f(x)


@pytest.mark.parametrize('how', ['swap two blocks', 'swap two Parameters',
                                 'replace a link without parameters'])
def test_a_rewiring_that_keeps_the_parameters_is_seen_at_the_next_step(how):
    """The optimizer's parameters stay the same, so it rebuilds nothing, but the replay would
    run the traced wiring: the step sees the change (identity tests), drops its traces and
    equals eager steps from the step after the change on (check_every=None)."""
    (me, oe), (ms, os_) = pair(Blocks)
    step = TrainStep(ms, os_, lambda x, t: F.softmax_cross_entropy(ms(x), t), check_every=None)
    with pytest.warns(RuntimeWarning, match="the model's links were replaced, moved or "
                                            "reordered: every trace is dropped"):
        for i, (x, t) in enumerate(data(12)):
            if i == 6:
                for m in (me, ms):
                    a, b = m.blocks[0], m.blocks[1]
                    if how == 'swap two blocks':
                        m.blocks[0], m.blocks[1] = b, a
                    elif how == 'swap two Parameters':
                        with a.init_scope():
                            a.W, b.W = b.W, a.W
                    else:
                        del m.act
                        with m.init_scope():
                            m.act = Activation(F.relu)
            eager_update(oe, lambda x, t: F.softmax_cross_entropy(me(x), t), x, t)
            step(x, t)
            assert_same(params(me), params(ms), 'step {} params'.format(i))
    assert step.traces == 2


@pytest.mark.parametrize('reduce', [False, True])
@pytest.mark.parametrize('change', [None, 'a new array'])
def test_a_parameter_of_the_target_without_update_rule_replays_like_eager_steps(change, reduce):
    """Left untrained (as Chainer's optimizers leave it), its gradient is still this step's
    after each replay (GradientClipping's norm reads it), and a new array given to it drops
    the traces (replays read it as a constant)."""
    (me, oe), (ms, os_) = pair(MLP)
    for m, o in ((me, oe), (ms, os_)):
        m.l1.W.update_rule = None
        o.add_hook(chainer.optimizer_hooks.GradientClipping(0.5))
    step = TrainStep(ms, os_, lambda x, t: F.softmax_cross_entropy(ms(x), t), check_every=None,
                     reduce_gradients=(lambda buffers: None) if reduce else None)
    new = numpy.random.RandomState(5).randn(8, 6).astype(numpy.float32)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always')
        for i, (x, t) in enumerate(data(12)):
            if change and i == 6:
                for m in (me, ms):
                    m.l1.W.array = new.copy()
            eager_update(oe, lambda x, t: F.softmax_cross_entropy(me(x), t), x, t)
            step(x, t)
            assert_same(params(me), params(ms), 'step {} params'.format(i))
            numpy.testing.assert_array_equal(me.l1.W.grad, ms.l1.W.grad,
                                             err_msg='step {} l1/W grad'.format(i))
    dropped = [str(w.message) for w in said if 'every trace is dropped' in str(w.message)]
    assert (step.traces, len(dropped)) == ((2, 1) if change else (1, 0)), dropped


class MaybeLate(MLP):
    """MLP and a lazy link ``late`` that the loss calls from the step ``use_late`` is set."""

    def __init__(self):
        super().__init__()
        self.use_late = False
        with self.init_scope():
            self.late = L.Linear(None, 5, initialW=numpy.eye(5, dtype=numpy.float32) * 0.5)

    def forward(self, x):
        y = super().forward(x)
        return self.late(y) if self.use_late else y


def test_a_lazy_link_the_loss_does_not_call_yet_is_skipped_and_trained_from_its_first_call():
    """While ``late`` has no array the optimizer skips it (as Chainer's does) and the step
    replays. Calling it is a change of the step's functions (rule 2: a new TrainStep); its
    first call initializes it, the optimizer rebuilds its buffers, and the new step replays
    with it, like eager steps."""
    (me, oe), (ms, os_) = pair(MaybeLate)

    def new_step():
        return TrainStep(ms, os_, lambda x, t: F.softmax_cross_entropy(ms(x), t),
                         check_every=None)
    step = new_step()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always')
        for i, (x, t) in enumerate(data(14)):
            if i == 7:
                assert (step.traces, step.replays) == (1, 4)
                me.use_late = ms.use_late = True
                step = new_step()
            eager_update(oe, lambda x, t: F.softmax_cross_entropy(me(x), t), x, t)
            step(x, t)
            assert_same(params(me), params(ms), 'step {} params'.format(i))
    assert (step.traces, step.replays) == (1, 4)
    said = [str(w.message) for w in said]
    assert any('parameter /late/W was initialized' in m for m in said), said


@pytest.mark.parametrize('reduce', [False, True])
@pytest.mark.parametrize('scale', [None, 1024.0])
@pytest.mark.parametrize('clip', [None, 0.5])
def test_a_gradient_shared_by_two_parameters_stays_shared_under_replay(clip, scale, reduce):
    """Add's backward gives ``c1`` and ``c2`` one gradient array. An eager step leaves them
    sharing it, and a hook sees it once per parameter (GradientClipping scales the shared array
    twice, as Chainer does): a replay gives the same bits and the same sharing, also through a
    gradient reduction (one rank's: it leaves the flat buffers as they are)."""
    (me, oe), (ms, os_) = pair(lambda: ThroughViews('two_biases'))
    for opt in (oe, os_):
        if scale is not None:
            opt.loss_scaling(scale=scale)
        if clip is not None:
            opt.add_hook(chainer.optimizer_hooks.GradientClipping(clip))
    step = TrainStep(ms, os_, lambda x, t: F.softmax_cross_entropy(ms(x), t),
                     reduce_gradients=(lambda buffers: None) if reduce else None)
    for i, (x, t) in enumerate(data(8)):
        eager_update(oe, lambda x, t: F.softmax_cross_entropy(me(x), t), x, t)
        step(x, t)
        assert me.c1.grad is me.c2.grad
        assert ms.c1.grad is ms.c2.grad, 'step {}'.format(i)
        assert_same(grads(me), grads(ms), 'step {} grads'.format(i))
        assert_same(params(me), params(ms), 'step {} params'.format(i))
    assert step.replays == 5


@pytest.mark.gpu
@pytest.mark.parametrize('reduce', [False, True])
@pytest.mark.parametrize('clip', [None, 0.5])
def test_a_gradient_shared_by_two_parameters_stays_shared_on_the_gpu(clip, reduce):
    """The captured step leaves ``c1`` and ``c2`` sharing their gradient as an eager step
    does, and with GradientClipping (the update runs eagerly after the graph) trains them
    alike."""
    import cupy
    runs = []
    for use_step in (False, True):
        model = ThroughViews('two_biases')
        model.to_device('@cupy:0')
        opt = optimizers.MomentumSGD(lr=0.1, weight_decay=1e-3).setup(model)
        opt.loss_scaling(scale=1024.0)
        if clip is not None:
            opt.add_hook(chainer.optimizer_hooks.GradientClipping(clip))
        lossfun = lambda x, t: F.softmax_cross_entropy(model(x), t)      # noqa: E731
        step = TrainStep(model, opt, lossfun, reduce_gradients=(
            lambda buffers: None) if reduce else None) if use_step else None
        for x, t in data(8):
            x, t = cupy.asarray(x), cupy.asarray(t)
            if step is None:
                eager_update(opt, lossfun, x, t)
            else:
                step(x, t)
            assert model.c1.grad is model.c2.grad
        runs.append({n: p.array.copy() for n, p in model.namedparams()})
    assert step.replays == 6 and step.traces == 1   # the capture launches step 3
    for k in runs[0]:
        cupy.testing.assert_allclose(runs[0][k], runs[1][k], rtol=1e-5, atol=1e-6, err_msg=k)


class WithAux(MLP):
    """MLP and a link ``aux`` the loss reads times zero: its gradient is 0 * z, a NaN where
    the batch's ``z`` holds an inf, while every other gradient stays finite."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.aux = L.Linear(6, 3, initialW=numpy.ones((3, 6), numpy.float32))


@pytest.mark.parametrize('emulate', ['0', '1'])
@pytest.mark.parametrize('reduce', [False, True])
def test_a_nan_in_an_untrained_parameters_gradient_skips_a_replayed_step_like_eager(
        monkeypatch, reduce, emulate):
    """Under dynamic loss scaling Chainer's check reads every parameter's gradient, also one
    without an update rule, and so does an eager update (tests/test_optimizer_dropin.py). A
    replay's check read only the gradients of the parameters it updates: the step with the
    NaN was applied where the eager one was skipped. With a (here identity) gradient
    reduction, the untrained gradients are reduced for the check, as ChainerMN reduces them.
    ``emulate``: the NumPy update, or the kernels' (the GPU path's) through the emulator."""
    monkeypatch.setenv('CHAINER_TC_EMULATE', emulate)
    (me, oe), (ms, os_) = pair(WithAux)
    for m, o in ((me, oe), (ms, os_)):
        o.loss_scaling(initial_scale=16.0)
        m.aux.W.update_rule = m.aux.b.update_rule = None

    def lossfun(m):
        return lambda x, t, z: F.softmax_cross_entropy(m(x), t) + F.sum(m.aux(z)) * 0.0
    step = TrainStep(ms, os_, lossfun(ms), check_every=None,
                     reduce_gradients=(lambda buffers: None) if reduce else None)
    z = numpy.ones((4, 6), numpy.float32)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')       # the untrained link's notice
        for i, (x, t) in enumerate(data(8)):
            zi = z.copy()
            if i == 5:
                zi[1, 2] = numpy.inf
            expected = eager_update(oe, lossfun(me), x, t, zi).array
            assert step(x, t, zi).array.tobytes() == expected.tobytes(), 'step {} loss'.format(i)
            assert_same(params(me), params(ms), 'step {} params'.format(i))
    assert oe.skipped_steps == os_.skipped_steps == 1
    assert (step.eager_steps, step.replays) == (3, 5)      # the NaN step (5) is a replay


class _OnDevice(numpy.ndarray):
    """A NumPy array that takes the device branch of _trace.changed (compared where it lives,
    read back once), so that branch's logic runs here; the gpu test below runs it on CuPy."""


def _bit_pairs(xp, wrap=lambda a: a):
    nan = numpy.float32(numpy.nan)
    other_nan = numpy.array([0x7FC00001], numpy.uint32).view(numpy.float32)[0]
    cases = [
        (numpy.array([1.0, nan, 0.0], numpy.float32), numpy.array([1.0, nan, 0.0], numpy.float32)),
        (numpy.array([0.0, 2.0], numpy.float16), numpy.array([-0.0, 2.0], numpy.float16)),
        (numpy.array([nan]), numpy.array([other_nan])),          # another NaN's payload
        (numpy.arange(6, dtype=numpy.int64).reshape(2, 3), numpy.arange(6).reshape(2, 3)),
        (numpy.array([True, False]), numpy.array([True, True])),
        (numpy.array([1 + 2j, nan]), numpy.array([1 + 2j, nan])),
        (numpy.array([0j]), numpy.array([complex(-0.0, 0.0)])),
        (numpy.ones((3, 4), numpy.float64)[:, ::2], numpy.ones((3, 2))),   # a strided view
    ]
    return [(wrap(xp.asarray(a)), wrap(xp.asarray(b.astype(a.dtype)))) for a, b in cases]


_CHANGED = [1, 2, 4, 6]      # which of _bit_pairs differ in some bit


def test_bits_are_compared_alike_in_memory_and_on_a_device():
    """A recorded or check step compares every watched array (each parameter) with its value
    when the step began: NumPy arrays by their bytes, device arrays by their bits there, read
    back with one copy for all of them (one synchronisation: it was one or two per parameter,
    most of a check step's time on an H100). Both say the same: NaNs equal to themselves, a
    NaN of another payload and a zero of the other sign differ."""
    from chainer_tc.static_graph import _trace
    assert _trace.changed(_bit_pairs(numpy)) == _CHANGED
    device = _bit_pairs(numpy, lambda a: a.view(_OnDevice))
    assert _trace.changed(device) == _CHANGED
    assert _trace.changed(device[::-1]) == [len(device) - 1 - k for k in reversed(_CHANGED)]
    assert [_trace.same_bits(a, b) for a, b in device] == [
        k not in _CHANGED for k in range(len(device))]
    assert _trace.changed([]) == []


@pytest.mark.gpu
def test_bits_are_compared_on_the_gpu_with_one_synchronisation(monkeypatch):
    import cupy
    from chainer_tc.static_graph import _trace
    pairs = _bit_pairs(cupy)
    syncs = []
    get = cupy.ndarray.get
    monkeypatch.setattr(cupy.ndarray, 'get', lambda a, *k, **kw: syncs.append(a.shape) or
                        get(a, *k, **kw))
    assert _trace.changed(pairs) == _CHANGED
    assert syncs == [(len(pairs),)]


def test_comparisons_made_during_a_step_are_read_back_at_its_end_in_their_order(monkeypatch):
    """A recorded step compares arrays at moments of the step (each persistent array when a
    function is first handed it, before that function updates it) and reads all of them back
    when it ends: NumPy arrays compare at once, device arrays on the device, each seeing the
    values of its moment, read back with one copy for the whole step."""
    from chainer_tc.static_graph import _trace
    sends = []
    send = chainer.backend.CpuDevice.send
    monkeypatch.setattr(chainer.backend.CpuDevice, 'send',
                        lambda self, a: sends.append(a.shape) or send(self, a))
    pairs = _bit_pairs(numpy)
    device = _bit_pairs(numpy, lambda a: a.view(_OnDevice))
    differences = _trace.Differences()
    for k, ((a, b), (c, d)) in enumerate(zip(pairs, device)):     # host and device, mixed
        differences.compare(a, b, ('host', k))
        differences.compare(c, d, ('device', k))
    moment = numpy.zeros(3, numpy.float32).view(_OnDevice)
    differences.compare(moment, moment.copy(), 'the same when compared')
    moment[1] = 1                                  # written after its comparison was made
    assert sends == []
    assert differences.found() == [(where, k) for k in _CHANGED
                                   for where in ('host', 'device')]
    assert sends == [(len(device) + 1,)]            # one copy back, for all of them
    assert differences.found() == []                # read once


class ManyNorms(chainer.ChainList):
    def __init__(self, n):
        r = numpy.random.RandomState(0)
        links = []
        for _ in range(n):
            links += [L.Linear(6, 6, initialW=r.randn(6, 6).astype(numpy.float32) * 0.4),
                      L.BatchNormalization(6)]
        super().__init__(*links)

    def forward(self, x, t):
        h = x
        for k in range(0, len(self), 2):
            h = F.relu(self[k + 1](self[k](h)))
        return F.softmax_cross_entropy(h, t)


def test_a_check_step_reads_back_its_comparisons_once(monkeypatch):
    """Every parameter and every running statistic of the model is compared in a check step
    (with its value when the step began, or when a BatchNorm is handed it): all of it is read
    back at once, as one synchronisation on a GPU, where each running statistic was one of its
    own (two per BatchNorm link: 106 in ResNet-50)."""
    from chainer_tc.static_graph import _trace
    model = ManyNorms(6)
    opt = optimizers.MomentumSGD(lr=0.1).setup(model)
    step = TrainStep(model, opt, check_every=2)
    r = numpy.random.RandomState(1)
    x, t = r.randn(4, 6).astype(numpy.float32), r.randint(0, 6, 4).astype(numpy.int32)
    for _ in range(4):
        step(x, t)
    reads = []
    found = _trace.Differences.found
    monkeypatch.setattr(_trace.Differences, 'found', lambda d: reads.append(len(d._tags)) or
                        found(d))
    assert (step.replays, step.checks) == (1, 0)
    step(x, t)                          # the second call since the replay was built: a check
    assert step.checks == 1
    # the 2 inputs and 24 parameters (with their values when the step began) and the 12
    # running statistics (when their BatchNorm is handed them): all in one read
    assert reads == [2 + 24 + 12] and len(list(model.params())) == 24


@pytest.mark.gpu
def test_a_check_step_synchronises_once_more_than_an_eager_step(monkeypatch):
    import cupy
    model = ManyNorms(6)
    model.to_device('@cupy:0')
    opt = optimizers.MomentumSGD(lr=0.1).setup(model)
    step = TrainStep(model, opt, check_every=2)
    x = cupy.asarray(numpy.random.RandomState(1).randn(4, 6).astype(numpy.float32))
    t = cupy.asarray(numpy.random.RandomState(2).randint(0, 6, 4).astype(numpy.int32))
    for _ in range(4):
        step(x, t)
    syncs = []
    get = cupy.ndarray.get
    monkeypatch.setattr(cupy.ndarray, 'get', lambda a, *k, **kw: syncs.append(a.shape) or
                        get(a, *k, **kw))
    assert (step.replays, step.checks) == (2, 0)    # (the capture launched step 3)
    step(x, t)                          # a check
    assert step.checks == 1
    in_check, syncs[:] = len(syncs), []
    opt.update(model, x, t)             # an eager step
    assert in_check == len(syncs) + 1, (in_check, len(syncs))


@pytest.mark.gpu
def test_device_comparisons_see_the_values_of_their_moment_on_any_stream():
    """A comparison queued on the device sees the arrays as they are at that point of the
    stream, whatever is written after it; one queued on another stream is waited for before
    the flags are read."""
    import cupy
    from chainer_tc.static_graph import _trace
    a = cupy.arange(1 << 20, dtype=cupy.float32)
    differences = _trace.Differences()
    differences.compare(a, a.copy(), 'equal then')
    b = a.copy()
    b[0] = -1
    differences.compare(a, b, 'different then')
    a[1] = -1                           # written after the first comparison
    b[0] = 0                            # made equal after the second
    side = cupy.cuda.Stream(non_blocking=True)
    with side:
        c = cupy.zeros(1 << 22, cupy.float32)
        differences.compare(c, c + 1, 'different, on another stream')
    assert differences.found() == ['different then', 'different, on another stream']
