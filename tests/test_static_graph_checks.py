"""TrainStep's periodic check (``check_every``): every n-th step of a replayed signature runs
eagerly, recorded, and is compared with the trace, so that what first changes after the trace
is seen, said once, and traced again.

Each case changes something the two recorded steps could not see: a link attribute set by a
schedule, a branch first taken at some iteration, a Python value reported from the loss
function, the wiring of two results, a configuration value. Where the change lands on a check,
every step equals an eager step bit for bit; where it lands between two checks, the replays in
between used the traced value, as the warning says, and the steps after the check are right
again. Also here: what the comparison must not take for a change (a configuration reset to its
value, ignored labels, whose count the replay recomputes, NumPy bools). And a Python float a
function computes for its gradient node, followed like a NumPy scalar; inside a container,
a number is a constant compared by value.
"""
import warnings

import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer)
import chainer
import chainer.functions as F
import chainer.links as L

from chainer_tc import links as TL
from chainer_tc import optimizers
from chainer_tc.static_graph import TrainStep

# With warmup=1 the calls are: 1 eager, 2 and 3 recorded (3 builds the replay), then replays;
# with check_every=4 the calls 7, 11, 15, ... are checks.
CHECK_EVERY = 4
FIRST_CHECK = 3 + CHECK_EVERY


class Net(chainer.Chain):
    def __init__(self, bn=L.BatchNormalization):
        super().__init__()
        r = numpy.random.RandomState(0)
        with self.init_scope():
            self.l1 = L.Linear(6, 8, initialW=r.randn(8, 6).astype(numpy.float32) * 0.3)
            self.bn = bn(8)
            self.l2 = L.Linear(8, 5, initialW=r.randn(5, 8).astype(numpy.float32) * 0.3)
            self.l1b = L.Linear(6, 8, initialW=r.randn(8, 6).astype(numpy.float32) * 0.3)
        self.iteration = 0
        self.double_after = None      # from this iteration on, the hidden layer is doubled
        self.weight = 1.0             # a Python value reported from the loss
        self.swap = False             # which of two results is doubled: only the wiring changes

    def forward(self, x, t):
        self.iteration += 1
        h = F.relu(self.bn(self.l1(x)))
        if self.double_after is not None and self.iteration >= self.double_after:
            h = h * 2
        g = F.tanh(Temperature().apply((self.l1b(x),))[0])
        h, g = (g, h) if self.swap else (h, g)
        h = h * 2 + g
        loss = F.softmax_cross_entropy(self.l2(h), t)
        chainer.report({'loss': loss, 'weight': self.weight}, self)
        return loss


class Temperature(chainer.FunctionNode):
    """Divides by ``chainer.config.temperature`` (1 when unset): a configuration value read
    inside a function, which a caller may set per step with ``chainer.using_config``."""

    def forward(self, inputs):
        self.t = getattr(chainer.config, 'temperature', 1.0)
        return inputs[0] / inputs[0].dtype.type(self.t),

    def backward(self, indexes, grad_outputs):
        return grad_outputs[0] / self.t,


def data(n, seed=0):
    r = numpy.random.RandomState(seed)
    return [(r.randn(4, 6).astype(numpy.float32), r.randint(0, 5, 4).astype(numpy.int32))
            for _ in range(n)]


def twins():
    out = []
    for _ in range(2):
        model = Net()
        out.append((model, optimizers.MomentumSGD(lr=0.1, weight_decay=1e-3).setup(model)))
    return out


def snapshot(model):
    out = {n: p.array.copy() for n, p in model.namedparams()}
    out.update(mean=model.bn.avg_mean.copy(), var=model.bn.avg_var.copy())
    return out


def assert_same(a, b, what):
    for k in a:
        numpy.testing.assert_array_equal(a[k], b[k], err_msg='{} {}'.format(what, k))


def run(batches, change, at, check_every=CHECK_EVERY):
    """Eager steps and TrainStep steps side by side, ``change(model)`` applied to both before
    call ``at`` (1-based). Returns (step, [(eager state, step state, eager report, step
    report)] per call, the warnings)."""
    (me, oe), (ms, os_) = twins()
    step = TrainStep(ms, os_, check_every=check_every)
    out = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for call, (x, t) in enumerate(batches, 1):
            if call == at:
                change(me)
                change(ms)
            seen = []
            for model, go in ((me, lambda: oe.update(me, x, t)), (ms, lambda: step(x, t))):
                reporter = chainer.Reporter()
                reporter.add_observer('main', model)
                obs = {}
                with reporter.scope(obs), chainer.using_config(
                        'temperature', getattr(model, 'temperature', 1.0)):
                    go()
                seen.append((snapshot(model), {k: float(getattr(v, 'array', v))
                                               for k, v in obs.items()}))
            out.append((seen[0][0], seen[1][0], seen[0][1], seen[1][1]))
    return step, out, [w for w in caught if issubclass(w.category, RuntimeWarning)]


def changed_warnings(caught):
    return [str(w.message) for w in caught if 'changed after it was traced' in str(w.message)]


CHANGES = {      # what changes, and what the warning says about it
    'eps': (lambda model: setattr(model.bn, 'eps', 1e-2), "'eps' differs"),
    'branch': (lambda model: setattr(model, 'double_after', model.iteration + 1), 'functions'),
    'report': (lambda model: setattr(model, 'weight', 0.5), "'weight'"),
    'wiring': (lambda model: setattr(model, 'swap', True), 'wired differently'),
    'config': (lambda model: setattr(model, 'temperature', 4.0), 'temperature is 1.0 then 4.0'),
}


@pytest.mark.parametrize('what', sorted(CHANGES))
def test_a_change_on_a_check_is_seen_and_every_step_equals_eager(what):
    change, said = CHANGES[what]
    at = FIRST_CHECK + CHECK_EVERY                       # the second check
    step, out, caught = run(data(20), change, at)
    for call, (se, ss, re, rs) in enumerate(out, 1):
        assert_same(se, ss, 'call {}'.format(call))
        assert re == rs, 'call {}'.format(call)
    warned = changed_warnings(caught)
    assert len(warned) == 1, [str(w.message) for w in caught]
    assert said in warned[0]
    assert '3 replays' in warned[0]
    # the warning points at the line that called the step
    assert [w.filename for w in caught if 'changed after' in str(w.message)] == [__file__]
    assert step.traces == 2
    # call 1 eager, 2-3 recorded, 7 and 11 checks; 11 is the first recorded step of the new
    # trace and 12 the second; 16 and 20 check it
    assert step.checks == 4
    assert step.replays == 20 - 1 - 2 - 1 - step.checks


def test_a_change_between_checks_is_frozen_until_the_next_check():
    at = FIRST_CHECK + 2                                  # two calls after the first check
    step, out, caught = run(data(16), lambda model: setattr(model, 'weight', 0.5), at)
    next_check = FIRST_CHECK + CHECK_EVERY
    for call, (_, _, re, rs) in enumerate(out, 1):
        expected = 0.5 if call >= at else 1.0
        assert re['main/weight'] == expected
        # the replays between the change and the next check report the traced value
        stale = at <= call < next_check
        assert rs['main/weight'] == (1.0 if stale else expected), 'call {}'.format(call)
    warned = changed_warnings(caught)
    assert len(warned) == 1 and "'weight'" in warned[0] and '(1.0 then 0.5)' in warned[0]


@pytest.mark.parametrize('from_call', [1, FIRST_CHECK])
def test_ignored_labels_replay_exactly_whatever_their_count(from_call):
    """softmax_cross_entropy divides by the count of labels not ignored, a NumPy scalar its
    forward computes and its gradient node keeps: the replay rebinds it like an array, so a
    count that changes from batch to batch (from the start, or first after the trace) is
    replayed exactly, with no change for a check to find."""
    batches = data(24)
    for i in range(from_call, 24, 2):
        batches[i - 1][1][:i % 3 + 1] = -1                # some labels ignored, a varying count
    (me, oe), (ms, os_) = twins()
    step = TrainStep(ms, os_, check_every=CHECK_EVERY)
    with warnings.catch_warnings():
        warnings.simplefilter('error', RuntimeWarning)
        for call, (x, t) in enumerate(batches, 1):
            oe.update(me, x, t)
            step(x, t)
            assert_same(snapshot(me), snapshot(ms), 'call {}'.format(call))
    assert step.traces == 1 and step.checks == 5


def test_without_checks_a_late_change_stays_frozen():
    step, out, caught = run(data(12), lambda model: setattr(model, 'weight', 0.5), 6,
                            check_every=None)
    assert step.checks == 0 and not changed_warnings(caught)
    assert [rs['main/weight'] for _, _, _, rs in out[5:]] == [1.0] * 7     # documented


def test_a_change_found_by_one_signature_has_the_others_checked_at_their_next_call():
    """Full batches (signature A) and every third call a partial one (B), both replayed: a
    change found by A's check makes B check at its next call instead of check_every later."""
    (me, oe), (ms, os_) = twins()
    step = TrainStep(ms, os_, check_every=CHECK_EVERY)
    r = numpy.random.RandomState(3)
    reported = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for call in range(1, 61):
            size = 3 if call % 3 == 0 else 4
            x, t = r.randn(size, 6).astype(numpy.float32), r.randint(0, 5, size).astype(
                numpy.int32)
            if call == 38:
                me.weight = ms.weight = 0.5
            for model, go in ((me, lambda: oe.update(me, x, t)), (ms, lambda: step(x, t))):
                reporter = chainer.Reporter()
                reporter.add_observer('main', model)
                obs = {}
                with reporter.scope(obs):
                    go()
                reported.append(float(obs['main/weight']))
    pairs = list(zip(reported[0::2], reported[1::2]))        # (eager, step) per call
    stale = [call for call, (e, s) in enumerate(pairs, 1) if e != s]
    # A replays 38 stale and checks at 40; B replays 39 stale and is checked at 42
    assert stale == [38, 39], stale
    assert len(changed_warnings(caught)) == 1


def test_nothing_that_stays_the_same_is_taken_for_a_change():
    """``chainer.config.train`` set on the thread and back to the global value between steps
    (an old-style evaluation), and a configuration value holding an array, set anew each step
    with the same value: the configuration in effect is the same, so no re-trace."""
    (model, opt), _ = twins()
    step = TrainStep(model, opt, check_every=3)
    with warnings.catch_warnings():
        warnings.simplefilter('error', RuntimeWarning)
        for call, (x, t) in enumerate(data(12), 1):
            if call == 6:
                chainer.config.train = False
                model.l1(x)
                chainer.config.train = True
            with chainer.using_config('class_weight', numpy.ones(5, numpy.float32)):
                step(x, t)
    del chainer.config.train
    assert step.traces == 1 and step.checks == 3


class Shift(chainer.FunctionNode):
    """Sets ``offset`` only when one is given."""

    def __init__(self, offset=None):
        if offset is not None:
            self.offset = offset

    def forward(self, inputs):
        return inputs[0] + getattr(self, 'offset', numpy.float32(0)),

    def backward(self, indexes, grad_outputs):
        return grad_outputs


def test_an_attribute_the_traced_step_had_and_a_check_lacks_is_a_change():
    class Shifted(Net):
        offset = numpy.float32(0.25)

        def forward(self, x, t):
            h = Shift(self.offset).apply((self.l1(x),))[0]
            return F.softmax_cross_entropy(self.l2(F.relu(h)), t)
    model = Shifted()
    step = TrainStep(model, optimizers.MomentumSGD(lr=0.1).setup(model),
                     check_every=CHECK_EVERY)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for call, (x, t) in enumerate(data(FIRST_CHECK), 1):
            if call == FIRST_CHECK:
                model.offset = None
            step(x, t)
    warned = changed_warnings(caught)
    assert len(warned) == 1 and "'offset' is set in one step only" in warned[0], warned


def test_a_number_where_the_trace_had_an_array_in_an_attribute_is_a_change():
    """GetItem keeps its index in ``slices``: an array in the traced step (``y[t % 4]``), a
    number at the check (``y[0]``). The comparison's fast path for equal numbers takes only
    tuples of numbers on both sides: it once compared the traced array with the number by
    ``==``, and the ValueError of the array's truth value left the step (found by review)."""
    model = L.Linear(6, 5, initialW=numpy.random.RandomState(0).randn(5, 6).astype('f'))
    index = {'at': None}

    def lossfun(x, t):
        y = model(x)
        return F.sum(y[t % 4] if index['at'] is None else y[index['at']])
    step = TrainStep(model, optimizers.MomentumSGD(lr=0.1).setup(model), lossfun,
                     check_every=CHECK_EVERY)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for call, (x, t) in enumerate(data(1) * FIRST_CHECK, 1):    # (t % 4 is the same)
            if call == FIRST_CHECK:
                index['at'] = 0
            step(x, t)
    warned = changed_warnings(caught)
    assert len(warned) == 1 and "'slices'[0]" in warned[0], warned
    assert step.checks == 1


def test_check_every_is_validated():
    model = Net()
    opt = optimizers.MomentumSGD().setup(model)
    with pytest.raises(ValueError, match='check_every'):
        TrainStep(model, opt, check_every=-1)
    assert TrainStep(model, opt, check_every=0).check_every == 0
    assert TrainStep(model, opt).check_every == 100


@pytest.mark.gpu
@pytest.mark.parametrize('what', ['eps', 'branch'])
def test_a_change_on_a_check_is_seen_and_captured_again_on_the_gpu(what):
    """The check step runs eagerly between graph launches; on a change the step is captured
    again (chainer_tc's BatchNormalization: its cuDNN calls capture)."""
    import cupy
    batches = [(cupy.asarray(x), cupy.asarray(t)) for x, t in data(16)]
    runs = []
    for use_step in (False, True):
        model = Net(TL.BatchNormalization)
        model.to_device('@cupy:0')
        opt = optimizers.MomentumSGD(lr=0.1, weight_decay=1e-3).setup(model)
        step = TrainStep(model, opt, check_every=CHECK_EVERY) if use_step else None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            for call, (x, t) in enumerate(batches, 1):
                if call == FIRST_CHECK:
                    if what == 'eps':
                        model.bn.eps = 1e-2
                    else:
                        model.double_after = model.iteration + 1
                if step is None:
                    opt.update(model, x, t)
                else:
                    step(x, t)
        runs.append(snapshot(model))
    assert len(changed_warnings(caught)) == 1
    assert step.traces == 2 and step.replays >= 8
    # cuBLAS may pick other algorithms on the capture's handle (test_static_graph.py)
    for k in runs[0]:
        cupy.testing.assert_allclose(runs[0][k], runs[1][k], rtol=1e-5, atol=1e-6, err_msg=k)


class Probe(chainer.FunctionNode):
    """Keeps a NumPy bool its forward computes (numpy.True_ or numpy.False_: shared objects)."""

    def forward(self, inputs):
        self.positive = (inputs[0] > 0).all()
        return inputs[0] * 1,

    def backward(self, indexes, grad_outputs):
        return grad_outputs


class Gate(chainer.FunctionNode):
    """Doubles when ``enabled``: given numpy.True_, the same object Probe may keep."""

    def __init__(self, enabled):
        self.enabled = enabled

    def forward(self, inputs):
        return (inputs[0] * 2 if self.enabled else inputs[0]),

    def backward(self, indexes, grad_outputs):
        return (grad_outputs[0] * 2 if self.enabled else grad_outputs[0]),


def test_a_numpy_bool_a_function_keeps_is_not_taken_for_another_attribute():
    """NumPy scalars a forward keeps are followed by identity (softmax_cross_entropy's count),
    but not NumPy bools: numpy.True_ is one object, which an unrelated attribute holds too."""
    class Gated(Net):
        def forward(self, x, t):
            h = self.l1(Probe().apply((x,))[0])
            h = Gate(numpy.True_).apply((h,))[0]
            return F.softmax_cross_entropy(self.l2(F.relu(h)), t)
    batches = data(10)
    for i in range(3):                      # all positive while traced: Probe keeps True_
        batches[i] = (numpy.abs(batches[i][0]) + 10, batches[i][1])
    ms = Gated()
    me = Gated()
    oe = optimizers.MomentumSGD(lr=0.1).setup(me)
    step = TrainStep(ms, optimizers.MomentumSGD(lr=0.1).setup(ms), check_every=None)
    for call, (x, t) in enumerate(batches, 1):
        oe.update(me, x, t)
        step(x, t)
        assert_same(snapshot(me), snapshot(ms), 'call {}'.format(call))
    assert step.replays == 7


class MeanOverValid(chainer.FunctionNode):
    """Sums the rows whose label is not -1 and divides by their count: a Python float its
    forward computes from the labels and hands to its gradient node (as an attribute, or
    inside a tuple with ``boxed``); a NumPy float64 with ``kind=numpy.float64``."""

    def __init__(self, boxed=False, kind=float):
        self.boxed, self.kind = boxed, kind

    def forward(self, inputs):
        h, t = inputs
        valid = t >= 0
        self.valid = valid
        self.scale = self.kind(1.0 / max(int(valid.sum()), 1))      # a new object each step
        return numpy.asarray((h[valid].sum(axis=0) * h.dtype.type(self.scale))),

    def backward(self, indexes, grad_outputs):
        scale = (self.scale,) if self.boxed else self.scale
        return MeanOverValidGrad(self.valid, scale).apply(grad_outputs)[0], None


class MeanOverValidGrad(chainer.FunctionNode):
    def __init__(self, valid, scale):
        self.valid, self.scale = valid, scale

    def forward(self, inputs):
        gy, = inputs
        scale = self.scale[0] if isinstance(self.scale, tuple) else self.scale
        g = numpy.zeros((len(self.valid), gy.shape[0]), gy.dtype)
        g[self.valid] = gy * gy.dtype.type(scale)
        return g,


def valid_counts_net(boxed, kind):
    class Net2(Net):
        def forward(self, x, t):
            h = MeanOverValid(boxed, kind).apply((self.l1(x), t))[0]
            return F.sum(self.l2(F.expand_dims(F.tanh(h), 0)) ** 2)
    return Net2()


def run_valid_counts(boxed, vary_from, kind=float, n=12):
    """Eager steps and TrainStep (no checks) side by side, compared after every call; from call
    ``vary_from`` on, 4, 3 or 2 of the 4 labels are valid. Returns (step, the warnings)."""
    batches = data(n)
    for call, (x, t) in enumerate(batches, 1):
        t[...] = numpy.arange(4)
        if call >= vary_from:
            t[:call % 3] = -1
    ms, me = valid_counts_net(boxed, kind), valid_counts_net(boxed, kind)
    oe = optimizers.MomentumSGD(lr=0.1).setup(me)
    step = TrainStep(ms, optimizers.MomentumSGD(lr=0.1).setup(ms), check_every=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for call, (x, t) in enumerate(batches, 1):
            oe.update(me, x, t)
            step(x, t)
            assert_same(snapshot(me), snapshot(ms), 'call {}'.format(call))
    return step, [str(w.message) for w in caught]


def test_a_python_float_a_function_computes_for_its_gradient_is_this_steps():
    """A Python float a forward keeps and its gradient node is given (the same object) is
    followed like a NumPy scalar: with the count of valid labels the same while traced and
    varying afterwards, every replay equals an eager step, with no check to catch it."""
    step, warned = run_valid_counts(boxed=False, vary_from=5)
    assert warned == [] and step.replays == 9


@pytest.mark.parametrize('kind', [float, numpy.float64])
@pytest.mark.parametrize('vary_from', [1, 13])
def test_a_number_handed_over_inside_a_container_is_compared_as_a_constant(vary_from, kind):
    """Inside a tuple the float cannot be rebound: it is a constant of the step, compared by
    value. Varying while traced: refused with the reason (before, a NumPy scalar there made
    the step refuse even when it stayed put); constant: replayed."""
    step, warned = run_valid_counts(boxed=True, vary_from=vary_from, kind=kind)
    if vary_from == 1:
        assert step.replays == 0
        assert len(warned) == 1 and "its attribute 'scale'[0] differs between steps" in warned[0]
    else:
        assert warned == [] and step.replays == 9


def test_a_capture_that_fails_as_it_ends_is_not_replayable():
    """cudaStreamEndCapture reports an invalidated capture (an unjoined side stream, a call on
    the legacy stream) and instantiation fails only there: that too is NotReplayable, which
    TrainStep turns into an eager step with a warning, not a crash of the training run."""
    from chainer_tc.static_graph import _capture
    from chainer_tc.static_graph import _program

    class Stream:
        def __init__(self):
            self.ends = 0

        def end_capture(self):
            self.ends += 1
            raise RuntimeError('cudaErrorStreamCaptureInvalidated: operation failed due to a '
                               'previous error during capture')
    stream = Stream()
    with pytest.raises(_program.NotReplayable, match=r'^ending the capture of the step '
                                                     r'\(instantiating its CUDA graph\) failed: '
                                                     r'RuntimeError: cudaErrorStreamCapture'):
        _capture._end_capture(stream)
    assert stream.ends == 2, 'abandoned: the stream is not left capturing'
