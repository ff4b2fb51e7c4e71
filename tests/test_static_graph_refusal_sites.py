"""A refused replay names where the refused function was made: the library function or link
method the loss function called, and the line of the user's code that called it; and, where
the array a replay could not redo was computed inside that library code (not handed to it by
the loss function), it says so, with what to do for the calls known to (found by an audit:
``F.softmax_cross_entropy(..., enable_double_backprop=True)`` and ``L.CRF1d`` were refused with
advice to compute the input with Chainer functions, which the user's code already did).
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


def marked_lines():
    """{name: line} of the lines of this file ending in ``# site: name``."""
    with open(__file__) as f:
        return {m.group(1): i + 1 for i, line in enumerate(f)
                for m in [re.search(r'# site: (\w+)$', line)] if m}


class Net(chainer.Chain):
    def __init__(self):
        super().__init__()
        r = numpy.random.RandomState(0)
        with self.init_scope():
            self.l = L.Linear(6, 5, initialW=r.randn(5, 6).astype(numpy.float32) * 0.3)
            self.lt = L.Linear(6, 25, initialW=r.randn(25, 6).astype(numpy.float32) * 0.3)
            self.crf = L.CRF1d(5)


class Scale(chainer.FunctionNode):
    """The user's own FunctionNode, applied by the user's code: x * w, w a constant array."""

    def forward(self, inputs):
        x, w = inputs
        self.w = w
        return x * w,

    def backward(self, indexes, grad_outputs):
        return grad_outputs[0] * self.w, None


def lossfun(case, m):
    def sce_double(x, t):
        return F.softmax_cross_entropy(m.l(x), t, enable_double_backprop=True)  # site: sce

    def sce(x, t):
        return F.softmax_cross_entropy(m.l(x), t)

    def crf(x, t):
        h = m.l(x)
        return m.crf([h[:2], h[2:]], [t[:2], t[2:]])        # site: crf

    def user_numpy(x, t):
        h = m.l(x)
        w = numpy.abs(h.array)              # computed by the user's code, in NumPy
        return F.softmax_cross_entropy(h * w, t)            # site: user_numpy

    def own_node(x, t):
        h = m.l(x)
        w = numpy.abs(h.array)
        y, = Scale().apply((h, w))                           # site: own_node
        return F.softmax_cross_entropy(y, t)

    def tree_lstm(x, t):
        c = numpy.zeros((4, 5), numpy.float32)
        _, h = F.tree_lstm(c, c, m.lt(x))                    # site: tree_lstm
        return F.softmax_cross_entropy(h, t)
    return locals()[case]


def run(case, steps=5):
    m = Net()
    step = TrainStep(m, optimizers.MomentumSGD(lr=0.1).setup(m), lossfun(case, m))
    r = numpy.random.RandomState(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for _ in range(steps):
            step(r.randn(4, 6).astype(numpy.float32), r.randint(0, 5, 4).astype(numpy.int32))
    said = [str(w.message) for w in caught if 'cannot be replayed' in str(w.message)]
    return step, said


@pytest.mark.parametrize('case, made, computed_inside', [
    ('sce_double', 'softmax_cross_entropy (chainer/functions/loss/softmax_cross_entropy.py)',
     ('softmax_cross_entropy', 'the default, enable_double_backprop=False, replays')),
    ('crf', 'CRF1d.forward (chainer/links/loss/crf1d.py)',
     ('crf1d', "F.crf1d (and L.CRF1d) computes the transitions' indices from the labels "
               'with NumPy')),
    ('user_numpy', 'mul (chainer/functions/math/basic_math.py)', None),
    ('own_node', None, None),
    ('tree_lstm', 'tree_lstm (chainer/functions/rnn/tree_lstm.py)', None),
])
def test_a_refusal_names_the_call_that_made_the_function(case, made, computed_inside):
    step, said = run(case)
    assert step.replays == 0 and len(said) == 1, said
    line = marked_lines()[case.replace('_double', '')]
    site = 'called at {}:{} (in {})'.format(__file__, line, case)
    assert site in said[0], said[0]
    if made is None:                        # the user's code applied it: no library named
        assert 'was called at' in said[0] and 'made inside' not in said[0], said[0]
    else:
        assert 'was made inside {}, {}'.format(made, site) in said[0], said[0]
    if computed_inside is None:             # handed by the user's code, or an old-style
        assert 'computed inside' not in said[0], said[0]      # backward's (not known)
    else:
        inside, note = computed_inside
        assert '. That input is computed inside {}, not by the loss function: '.format(
            inside) in said[0] and said[0].endswith(note), said[0]


def test_the_default_softmax_cross_entropy_replays():
    """(What the advice above says.)"""
    step, said = run('sce', steps=6)
    assert (step.replays, said) == (3, [])


def test_each_recorded_function_knows_its_site_and_gradients_the_backward_pass():
    from chainer_tc.static_graph import _trace
    m = Net()
    x = numpy.ones((4, 6), numpy.float32)
    with _trace.Recorder() as rec:
        loss = F.sum(m.l(x))                                    # site: recorded
        loss.backward()
    forward = [op for op in rec.trace.ops if not op.site.backward]
    backward = [op for op in rec.trace.ops if op.site.backward]
    assert [op.label for op in forward] == ['LinearFunction', 'Sum']
    linear = forward[0].site
    assert (linear.api_name, linear.path, linear.line) == (
        'Linear.forward', __file__, marked_lines()['recorded'])
    # x is the user's; W and b the link's, not arguments
    assert linear.handed == {0: True, 1: False, 2: False}
    assert forward[1].site.api_name == 'sum' and forward[1].site.handed == {0: True}
    assert backward and all(str(op.site) == 'made by the backward pass' for op in backward)


def test_an_input_computed_inside_an_unlisted_library_function_is_said_so():
    """(No stock function but the listed ones is known to do this: the general wording, on a
    site made by hand.)"""
    from chainer_tc.static_graph import _compare, _site, _trace
    op = _trace.Op(chainer.functions.array.select_item.SelectItem(), (), None,
                   _site.Site(F.dropout.__code__, __file__, 1, 'f', handed={0: True, 1: False}))
    error = _compare._Unrecorded('input 1 differs', 1)
    assert _compare._library_note(op, error) == (
        '. That input is computed inside dropout, not by the loss function (with NumPy, from '
        'the data): a step calling it cannot be replayed')
    assert _compare._library_note(op, _compare._Unrecorded('input 0 differs', 0)) == ''
    assert _compare._library_note(op, _compare.NotReplayable('wired differently')) == ''


def test_a_library_loss_function_still_gets_the_known_advice():
    """The step's loss function is L.Classifier itself (no line of the user's code on the
    stack): the outermost library frame is Classifier.forward, and the advice for the known
    case inside it (found by review: it said Classifier could not be replayed)."""
    import functools
    m = Net()
    model = L.Classifier(m.l, lossfun=functools.partial(F.softmax_cross_entropy,
                                                        enable_double_backprop=True))
    step = TrainStep(model, optimizers.MomentumSGD(lr=0.1).setup(model))
    r = numpy.random.RandomState(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for _ in range(5):
            step(r.randn(4, 6).astype(numpy.float32), r.randint(0, 5, 4).astype(numpy.int32))
    said = [str(w.message) for w in caught if 'cannot be replayed' in str(w.message)]
    assert len(said) == 1 and 'was made inside Classifier.forward' in said[0], said
    assert said[0].endswith('. That input is computed inside softmax_cross_entropy, not by the '
                            "loss function: F.softmax_cross_entropy(..., enable_double_backprop="
                            "True) selects the labels' scores with indices it computes with "
                            'NumPy; the default, enable_double_backprop=False, replays'), said[0]


def test_only_inputs_no_function_made_have_their_callers_arguments_scanned(monkeypatch):
    """(The scan of a library function's arguments, for every node made under it, cost time
    quadratic in the length of a list argument: F.n_step_lstm's. Found by review.) In a step
    whose every input comes from the batch, the parameters or an earlier function, none is."""
    from chainer_tc.static_graph import _site
    calls = []
    real = _site._handed
    monkeypatch.setattr(_site, '_handed', lambda *a: calls.append(a) or real(*a))
    m = Net()
    step = TrainStep(m, optimizers.MomentumSGD(lr=0.1).setup(m), lossfun('sce', m))
    r = numpy.random.RandomState(0)
    for _ in range(4):
        step(r.randn(4, 6).astype(numpy.float32), r.randint(0, 5, 4).astype(numpy.int32))
    assert step.replays == 1 and calls == []
