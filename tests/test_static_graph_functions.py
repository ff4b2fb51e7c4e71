"""Gradients Chainer computes outside ``FunctionNode.forward`` replay exactly: the ``backward``
of an old-style ``chainer.Function`` (``F.hinge``, ``L.BatchRenormalization``, a user's own
Function) and the cast of an array operand in Chainer's arithmetic (``gy * mask`` with a boolean
mask in ``F.zoneout``'s backward, a user's integer mask). Before, the replay would have read the
recorded step's arrays there, so TrainStep refused these steps and ran them eagerly.

Each case trains a TrainStep and eager steps side by side and compares every step bit for bit.
"""
import re
import warnings

import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer)
import chainer
import chainer.functions as F
import chainer.links as L

from chainer_tc import optimizers
from chainer_tc.static_graph import TrainStep


class Affine(chainer.Function):
    """A user's old-style Function: keeps an array of its own from forward for backward, retains
    only its first input, and gives no gradient to its integer input."""

    def forward(self, inputs):
        self.retain_inputs((0,))
        x, w, t = inputs
        self.scale = (t[:, None] % 3 + 1).astype(x.dtype)
        return x * w * self.scale,

    def backward(self, inputs, grad_outputs):
        x, w, t = inputs
        assert w is None and t is None, 'only x is retained'
        gy, = grad_outputs
        return gy * self.w_now * self.scale, (gy * x * self.scale).sum(axis=0), None


def affine(x, w, t):
    f = Affine()
    f.w_now = w.array            # read in backward; the parameter's array, updated in place
    return f(x, w, t)


class Net(chainer.Chain):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        r = numpy.random.RandomState(0)
        with self.init_scope():
            self.l1 = L.Linear(6, 8, initialW=r.randn(8, 6).astype(numpy.float32) * 0.3)
            self.l2 = L.Linear(8, 5, initialW=r.randn(5, 8).astype(numpy.float32) * 0.3)
            if kind == 'batch_renormalization':
                self.brn = L.BatchRenormalization(8, rmax=1.5, dmax=0.5)
            if kind == 'user_function':
                self.w = chainer.Parameter(r.randn(8).astype(numpy.float32))

    def forward(self, x, t, mask):
        h = self.l1(x)
        if self.kind == 'batch_renormalization':
            h = self.brn(h)
        elif self.kind == 'zoneout':
            h = F.zoneout(h, F.tanh(h), 0.3)
        elif self.kind == 'user_function':
            h = affine(h, self.w, t)
        elif self.kind == 'integer_mask':
            h = h * mask                       # int32 operand: cast to float32 by Chainer
        y = self.l2(F.relu(h))
        rows = numpy.arange(len(t))
        if self.kind == 'picked_by_labels':     # GetItem keeps the step's input t in a tuple
            return -F.mean(F.log_softmax(y)[rows, t])
        if self.kind == 'picked_by_argmax':     # ... or an array an op computed
            return F.softmax_cross_entropy(y, t) + F.mean(y[rows, F.argmax(y, axis=1).array])
        if self.kind == 'picked_at_random':     # ... or a constant drawn anew each step
            return -F.mean(F.log_softmax(y)[rows, numpy.random.randint(0, 5, len(t))])
        if self.kind.startswith('hinge'):
            return F.hinge(y, t, norm=self.kind[-2:])
        return F.softmax_cross_entropy(y, t)


def batches(n):
    r = numpy.random.RandomState(1)
    return [(r.randn(4, 6).astype(numpy.float32), r.randint(0, 5, 4).astype(numpy.int32),
             r.randint(0, 2, (4, 8)).astype(numpy.int32)) for _ in range(n)]


def state(model):
    out = {n: p.array.copy() for n, p in model.namedparams()}
    out.update({'grad' + n: p.grad.copy() for n, p in model.namedparams()})
    out.update({'v' + n: p.update_rule.state['v'].copy() for n, p in model.namedparams()})
    for name, link in model.namedlinks():
        out.update({name + '/' + k: link.__dict__[k].copy() for k in link._persistent
                    if isinstance(link.__dict__[k], numpy.ndarray)})
    return out


@pytest.mark.parametrize('kind', ['hinge_L1', 'hinge_L2', 'batch_renormalization', 'zoneout',
                                  'user_function', 'integer_mask',
                                  'picked_by_labels', 'picked_by_argmax'])
def test_steps_with_gradients_computed_outside_forward_replay_exactly(kind):
    """(And ``y[arange(n), t]``: the arrays inside GetItem's ``slices`` tuple follow their
    source, the step's input or an op's output, as an input of a function does.)"""
    runs = []
    for use_step in (False, True):
        model = Net(kind)
        opt = optimizers.MomentumSGD(lr=0.05, weight_decay=1e-3).setup(model)
        step = TrainStep(model, opt, check_every=3) if use_step else None
        numpy.random.seed(5)                             # zoneout's draws: the same in both runs
        per_step = []
        with warnings.catch_warnings():
            warnings.simplefilter('error', RuntimeWarning)   # no "runs eagerly"/"changed"
            for x, t, mask in batches(10):
                if step is None:
                    held = []
                    opt.update(lambda: held.append(model(x, t, mask)) or held[-1])
                    loss = held[-1]
                else:
                    loss = step(x, t, mask)
                per_step.append((loss.array.copy(), state(model)))
        runs.append(per_step)
    for i, ((le, se), (ls, ss)) in enumerate(zip(*runs)):
        assert le.tobytes() == ls.tobytes(), 'step {} loss'.format(i)
        for k in se:
            numpy.testing.assert_array_equal(se[k], ss[k], err_msg='step {} {}'.format(i, k))
    assert step.replays >= 4 and step.checks >= 2 and step.traces == 1


class HalveInBackward(chainer.Function):
    """An old-style Function whose backward writes into its second input, in place."""

    def forward(self, inputs):
        return inputs[0] * inputs[1],

    def backward(self, inputs, grad_outputs):
        x, w = inputs
        g = grad_outputs[0] * w
        w *= 0.5
        return g, None


class Written(chainer.Chain):
    """``fresh``: the array written into is made anew every step (and read by a function
    before the backward writes into it): each replay starts from its value at the start of the
    step. Else it is one array kept across steps (a counter): replays go on updating it."""

    def __init__(self, fresh):
        super().__init__()
        self.fresh = fresh
        self.kept = numpy.full((4, 5), 2, numpy.float32)
        r = numpy.random.RandomState(0)
        with self.init_scope():
            self.l1 = L.Linear(6, 5, initialW=r.randn(5, 6).astype(numpy.float32) * 0.3)

    def forward(self, x, t, mask):
        w = numpy.full((4, 5), 2, numpy.float32) if self.fresh else self.kept
        h = self.l1(x) * w
        return F.softmax_cross_entropy(HalveInBackward()(h, w), t)


@pytest.mark.parametrize('fresh', [True, False])
def test_an_array_an_old_style_backward_writes_into_is_what_eager_steps_see(fresh):
    runs = []
    for use_step in (False, True):
        model = Written(fresh)
        opt = optimizers.MomentumSGD(lr=0.05).setup(model)
        step = TrainStep(model, opt, check_every=3) if use_step else None
        losses = []
        with warnings.catch_warnings():
            warnings.simplefilter('error', RuntimeWarning)   # replayed, no change found
            for x, t, mask in batches(10):
                if step is None:
                    held = []
                    opt.update(lambda: held.append(model(x, t, mask)) or held[-1])
                    losses.append(held[-1].array.copy())
                else:
                    losses.append(step(x, t, mask).array.copy())
        runs.append((losses, state(model), model.kept.copy()))
    assert [a.tobytes() for a in runs[0][0]] == [b.tobytes() for b in runs[1][0]]
    for k in runs[0][1]:
        numpy.testing.assert_array_equal(runs[0][1][k], runs[1][1][k], err_msg=k)
    numpy.testing.assert_array_equal(runs[0][2], runs[1][2])     # the kept array: 2 ** -9
    assert step.replays >= 4


@pytest.mark.parametrize('replay', [False, True])
def test_a_backward_writing_into_its_gradient_leaves_the_loss_scale_alone(replay):
    """F.hinge divides its output gradient in place: with loss scaling that gradient is the
    scale's seed, which must be an array of its own (it once was a view of the scale)."""
    model = Net('hinge_L1')
    opt = optimizers.MomentumSGD(lr=0.05).setup(model)
    opt.loss_scaling(scale=64.0)
    step = TrainStep(model, opt, check_every=3) if replay else None
    for x, t, mask in batches(8):
        if step is None:
            opt.update(model, x, t, mask)
        else:
            step(x, t, mask)
    assert opt.loss_scale == 64.0
    assert all(numpy.isfinite(p.array).all() for p in model.params())


def test_recording_on_two_threads_at_once_restores_chainers_functions():
    """Recorders on two threads that exit in the order they entered (not nested) leave
    Chainer's ``Reporter.report`` and operand cast as they were."""
    import threading
    from chainer import reporter as reporter_module
    from chainer.functions.math import basic_math
    from chainer_tc.static_graph import _trace
    originals = reporter_module.Reporter.report, basic_math._preprocess_rhs
    entered, release = threading.Event(), threading.Event()
    seen = []

    def other():
        with _trace.Recorder() as rec:
            entered.set()
            release.wait(10)
            chainer.Variable(numpy.ones(3, numpy.float32)) * numpy.ones(3, numpy.int32)
        seen.append(len(rec.trace.ops))
    first = _trace.Recorder().__enter__()
    thread = threading.Thread(target=other)
    thread.start()
    assert entered.wait(10)
    chainer.Variable(numpy.ones(3, numpy.float32)) * numpy.ones(3, numpy.int32)
    first.__exit__(None, None, None)              # before the other thread's recorder
    release.set()
    thread.join(10)
    assert seen == [2]            # its cast and its multiplication: not this thread's
    assert len(first.trace.ops) == 2
    assert (reporter_module.Reporter.report, basic_math._preprocess_rhs) == originals


PYTHON_GRADIENTS = {
    'F.max': lambda h: h - F.max(h, axis=1, keepdims=True),
    'F.clip': lambda h: F.clip(h, -100., 100.),          # clips nothing: the mask stays put
    'F.maximum': lambda h: F.maximum(h, h * 0 - 100.),
    'F.crelu': lambda h: F.crelu(h)[:, :8],
    'F.mean_absolute_error': lambda h: h * F.mean_absolute_error(h, h * 0),
    'F.normalize': F.normalize,
}


def assert_refused(model, message):
    """Five steps of ``model`` under a TrainStep all run eagerly, said with ``message``."""
    step = TrainStep(model, optimizers.MomentumSGD().setup(model))
    with pytest.warns(RuntimeWarning, match=r'cannot be replayed.*' + message):
        for x, t, mask in batches(5):
            step(x, t, mask)
    assert step.replays == 0 and step.eager_steps == 5


@pytest.mark.parametrize('name', sorted(PYTHON_GRADIENTS))
def test_functions_whose_backward_computes_in_python_are_refused_by_name(name):
    """These functions' backward computes an array from the values in Python (F.max: ``x ==
    y``; F.clip: ``x_min <= x`` in ClipGrad): no op records it. Refused by name, also when
    that array happens to be the same in the two recorded steps (nothing clipped yet), where
    comparing the steps cannot see it and a replay would keep the traced mask."""
    class PythonGradientNet(Net):
        def forward(self, x, t, mask):
            return F.softmax_cross_entropy(self.l2(PYTHON_GRADIENTS[name](self.l1(x))), t)
    assert_refused(PythonGradientNet(name),
                   r'the gradient of {}\b.* needs'.format(re.escape(name)))


def test_a_constant_inside_a_tuple_attribute_that_changes_is_refused_naming_its_place():
    assert_refused(Net('picked_at_random'),
                   r"GetItem\): its attribute 'slices'\[1\] differs between steps")


def test_a_second_derivative_through_batch_normalization_is_refused_by_name():
    """A gradient penalty through L.BatchNormalization: Chainer's second derivative of batch
    normalization uses arrays computed in Python. The refusal names the function (it named
    an array as if the user's loss had computed it; found by review)."""
    class PenaltyNet(Net):
        def __init__(self):
            super().__init__('plain')
            with self.init_scope():
                self.bn = L.BatchNormalization(8)

        def forward(self, x, t, mask):
            x = chainer.Variable(x)
            y = self.l2(F.relu(self.bn(self.l1(x))))
            loss = F.softmax_cross_entropy(y, t, enable_double_backprop=True)
            gx, = chainer.grad([loss], [x], enable_double_backprop=True)
            return loss + 0.1 * F.sum(gx * gx)
    assert_refused(PenaltyNet(), r'the gradient of F\.batch_normalization '
                                 r'\(L\.BatchNormalization\) differentiated twice needs')


@pytest.mark.parametrize('name', ['sign', 'floor'])
def test_functions_that_are_not_function_nodes_are_refused_with_their_names(name):
    """F.sign and F.floor compute on the array directly (no FunctionNode): their result reaches
    the next function unrecorded, and the refusal says that these functions are why, rather
    than telling the user to use Chainer functions (they are Chainer functions)."""
    class SignNet(Net):
        def forward(self, x, t, mask):
            h = self.l1(x)
            return F.softmax_cross_entropy(self.l2(h * getattr(F, name)(h)), t)
    assert_refused(SignNet(name), r'not computed by a recorded function.*F\.sign, F\.floor, '
                                  r'F\.ceil or F\.fix')


def test_what_an_old_style_backward_writes_into_is_compared_only_where_both_steps_read_it():
    """A step recorded under a CUDA graph capture reads no values, so it does not know what
    F.hinge's backward wrote into (``overwritten`` None): the eager recorded step's writes
    are then not compared with it (they were, as 'nothing', and every captured F.hinge step
    was refused on an H100). Two steps that both read them must still agree."""
    from types import SimpleNamespace
    from chainer_tc.static_graph import _compare
    from chainer_tc.static_graph._program import NotReplayable
    x, t = numpy.ones((4, 5), numpy.float32), numpy.zeros(4, numpy.int32)
    gloss = [numpy.full((), v, numpy.float32) for v in (1.0, 1.0)]

    def op(g, overwritten):
        return SimpleNamespace(inputs=(x, t, g), overwritten=overwritten)
    eager = op(gloss[0], ((2, gloss[0] * 4),))
    check = _compare._check_inputs
    check(eager, op(gloss[1], None), _compare.Known(), _compare.Known(), 'Hinge (backward)')
    with pytest.raises(NotReplayable, match=r'wrote into its inputs \[2\] in one step and '
                                            r'\[\] in the other'):
        check(eager, op(gloss[1], ()), _compare.Known(), _compare.Known(), 'Hinge (backward)')


@pytest.mark.gpu
@pytest.mark.parametrize('kind', ['hinge_L1', 'user_function', 'integer_mask'])
def test_steps_with_gradients_computed_outside_forward_are_captured_on_the_gpu(kind):
    import cupy
    runs = []
    for use_step in (False, True):
        model = Net(kind)
        model.to_device('@cupy:0')
        opt = optimizers.MomentumSGD(lr=0.05, weight_decay=1e-3).setup(model)
        step = TrainStep(model, opt, check_every=3) if use_step else None
        with warnings.catch_warnings():
            warnings.simplefilter('error', RuntimeWarning)   # captured, no change found
            for x, t, mask in batches(10):
                x, t, mask = cupy.asarray(x), cupy.asarray(t), cupy.asarray(mask)
                if step is None:
                    opt.update(model, x, t, mask)
                else:
                    step(x, t, mask)
        runs.append({n: p.array.copy() for n, p in model.namedparams()})
    assert step.replays >= 4 and step.traces == 1
    # cuBLAS may pick other algorithms on the capture's handle (test_static_graph.py)
    for k in runs[0]:
        cupy.testing.assert_allclose(runs[0][k], runs[1][k], rtol=1e-5, atol=1e-6, err_msg=k)
