"""chainer_tc.optimizers.MomentumSGD held to what Chainer 7.8.1's own optimizer tests ask of
chainer.optimizers.MomentumSGD (docs/optimizer.md, "Chainer's own optimizer tests"): a linear
model trained in float16/32/64, lazy or not, with every loss-scaling configuration; optimizer
hooks; pickling and deep copies; loss scales recorded on the parameters; hyperparameters; rule
state loading. Written for this project (none of Chainer's test code), each behaviour checked
against Chainer's MomentumSGD run side by side, on the NumPy path and through the emulated
kernel.

Unless a test says otherwise, results are compared bit for bit: for float32 and float64
parameters our update is Chainer's NumPy arithmetic in the same order (docs/optimizer.md), and
for float16 ones it is Chainer's ``use_fp32_update()`` arithmetic (no weight decay here).
"""
import copy
import pickle
import warnings

import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer: CUDA libraries)
import chainer
import chainer.functions as F
import chainer.links as L
from chainer import optimizer_hooks
from chainer import serializers

from chainer_tc import optimizers
from chainer_tc.optimizers import _scaler

DTYPES = [numpy.float16, numpy.float32, numpy.float64]


@pytest.fixture(params=['numpy', 'emulator'])
def path(request, monkeypatch):
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1' if request.param == 'emulator' else '0')
    return request.param


def chainer_momentum_sgd(dtype, **kwargs):
    """Chainer's MomentumSGD as a float16 user runs it: with float32 master weights."""
    opt = chainer.optimizers.MomentumSGD(**kwargs)
    if dtype == numpy.float16:
        opt.use_fp32_update()
    return opt


def clone(opt, how):
    return copy.deepcopy(opt) if how == 'deepcopy' else pickle.loads(pickle.dumps(opt))


def assert_same_params(ref, ours):
    pa, pb = dict(ref.namedparams()), dict(ours.namedparams())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert pb[name].dtype == pa[name].dtype, name
        numpy.testing.assert_array_equal(pb[name].array, pa[name].array, err_msg=name)


def assert_same_grads(ref, ours):
    """The gradients as the update left them: Chainer's update rule divides a float32 or
    float64 parameter's gradient by its loss scale in place, and leaves a float16 one's (it
    divides a float32 copy)."""
    pa, pb = dict(ref.namedparams()), dict(ours.namedparams())
    for name in pa:
        ga, gb = pa[name].grad, pb[name].grad
        assert (ga is None) == (gb is None), name
        if ga is not None:
            assert gb.dtype == ga.dtype, name
            bits = numpy.dtype('u{}'.format(ga.dtype.itemsize))
            numpy.testing.assert_array_equal(gb.view(bits), ga.view(bits), err_msg=name)


# ---- the linear model (test_optimizers_by_linear_model.py) ---------------------------------------

def linear_batches(dtype, steps=100, seed=0, n=32, units=10):
    """A separable two-class problem: ``steps`` training batches and one test batch."""
    r = numpy.random.RandomState(seed)
    w, b = r.uniform(-1, 1, (units, 1)), r.uniform(-1, 1, 1)
    batches = []
    for _ in range(steps + 1):
        x = r.uniform(-1, 1, (n, units)).astype(dtype)
        t = ((x.astype(numpy.float64) @ w + b).reshape(n) < 0).astype(numpy.int32)
        batches.append((x, t))
    return batches


def linear_model(dtype, lazy):
    init = chainer.initializers.HeNormal(1 / numpy.sqrt(2), dtype,
                                         rng=numpy.random.RandomState(1))
    return L.Linear(None if lazy else 10, 2, initialW=init,
                    initial_bias=chainer.initializers.Constant(0, dtype))


def configure(opt, scaling):
    if scaling == 'static':
        opt.loss_scaling(scale=10.0)
    elif scaling == 'dynamic':
        opt.loss_scaling()
    elif scaling is not None:
        opt.loss_scaling(scale=scaling)


def train_linear(opt, model, batches, how):
    """``how``: 'manual' is the loop of Chainer's test (cleargrads, a plain backward(),
    update()); 'lossfun' is update(lossfun), what StandardUpdater does. Returns the accuracy on
    the last batch."""
    for x, t in batches[:-1]:
        if how == 'lossfun':
            opt.update(lambda: F.softmax_cross_entropy(model(x), t))
        else:
            model.cleargrads()
            F.softmax_cross_entropy(model(x), t).backward()
            opt.update()
    x, t = batches[-1]
    return float(F.accuracy(model(x), t).array)


def run_linear(make_opt, dtype, lazy, scaling, how, steps=100):
    model = linear_model(dtype, lazy)
    opt = make_opt().setup(model)
    configure(opt, scaling)
    accuracy = train_linear(opt, model, linear_batches(dtype, steps), how)
    return model, opt, accuracy


@pytest.mark.parametrize('how', ['manual', 'lossfun'])
@pytest.mark.parametrize('scaling', [None, 'static'])
@pytest.mark.parametrize('lazy', [False, True])
@pytest.mark.parametrize('dtype', DTYPES)
def test_linear_model_learns_and_equals_chainer(path, dtype, lazy, scaling, how):
    """Static loss scaling included: through update(lossfun) the gradients are scaled by 10
    and divided back (by the same float operation in both); in the manual loop the plain
    backward() records no loss scale on the parameters, so, as Chainer does, the update uses
    those gradients as they are."""
    ref, o_ref, acc_ref = run_linear(lambda: chainer_momentum_sgd(dtype, lr=0.1), dtype, lazy,
                                     scaling, how)
    ours, o, acc = run_linear(lambda: optimizers.MomentumSGD(lr=0.1), dtype, lazy, scaling, how)
    assert acc > 0.9 and acc_ref > 0.9
    assert_same_params(ref, ours)
    assert_same_grads(ref, ours)
    assert o.t == o_ref.t == 100


@pytest.mark.parametrize('lazy', [False, True])
@pytest.mark.parametrize('dtype', DTYPES)
def test_linear_model_dynamic_loss_scaling_through_update_lossfun(path, dtype, lazy):
    """Ours starts at 2**15 and doubles after 1000 clean steps (apex's policy); Chainer's
    starts at 1 and doubles every step until the first overflow, capped at 65504. Over 100
    clean steps ours stays at 2**15, so it equals Chainer with a static 2**15 bit for bit.
    Against Chainer's dynamic run the only difference is then the scale (65504 is not a power
    of two, so Chainer's unscaling rounds where ours is exact): every gradient differs by at
    most a rounding, and the weights end within a few ulps. Seen (seed 0): 1 float16 ulp
    (2e-4 relative), 5e-8 (float32), 2e-16 (float64); bounds: 2**-9, 2**-20, 2**-49."""
    ours, o, acc = run_linear(lambda: optimizers.MomentumSGD(lr=0.1), dtype, lazy, 'dynamic',
                              'lossfun')
    assert acc > 0.9
    assert o.skipped_steps == 0 and o.loss_scale == 2.0 ** 15
    static, _, _ = run_linear(lambda: chainer_momentum_sgd(dtype, lr=0.1), dtype, lazy,
                              2.0 ** 15, 'lossfun')
    assert_same_params(static, ours)
    dynamic, o_ref, acc_ref = run_linear(lambda: chainer_momentum_sgd(dtype, lr=0.1), dtype,
                                         lazy, 'dynamic', 'lossfun')
    assert acc_ref > 0.9 and o_ref._loss_scale == 65504
    rtol = {numpy.float16: 2 ** -9, numpy.float32: 2 ** -20, numpy.float64: 2 ** -49}[dtype]
    for (name, a), (_, b) in zip(sorted(dynamic.namedparams()), sorted(ours.namedparams())):
        scale = numpy.abs(a.array.astype(numpy.float64)).max()
        numpy.testing.assert_allclose(b.array.astype(numpy.float64),
                                      a.array.astype(numpy.float64), rtol=0, atol=rtol * scale,
                                      err_msg=name)


@pytest.mark.parametrize('dtype', DTYPES)
def test_linear_model_dynamic_loss_scaling_in_a_manual_loop(path, dtype):
    """The loop of Chainer's test: a plain backward() leaves unscaled gradients marked as such,
    which both optimizers use as they are (only the overflow check of dynamic scaling runs):
    the same weights as Chainer's, bit for bit, whatever the two scales are."""
    ref, o_ref, acc_ref = run_linear(lambda: chainer_momentum_sgd(dtype, lr=0.1), dtype, True,
                                     'dynamic', 'manual')
    ours, o, acc = run_linear(lambda: optimizers.MomentumSGD(lr=0.1), dtype, True, 'dynamic',
                              'manual')
    assert acc > 0.9 and acc_ref > 0.9
    assert_same_params(ref, ours)
    assert o.skipped_steps == 0


# ---- loss scales recorded on the parameters (Chainer's param._loss_scale) -----------------------

class TwoLinear(chainer.Chain):
    def __init__(self, dtype=numpy.float32, seed=0):
        super().__init__()
        init = chainer.initializers.Normal(0.5, dtype, rng=numpy.random.RandomState(seed))
        with self.init_scope():
            self.a = L.Linear(6, 5, initialW=init, initial_bias=init)
            self.b = L.Linear(5, 3, initialW=init, initial_bias=init)

    def forward(self, x):
        return self.b(F.tanh(self.a(x)))


def two_linear_data(dtype=numpy.float32, seed=0, n=8):
    r = numpy.random.RandomState(seed)
    return r.randn(n, 6).astype(dtype), r.randint(0, 3, n).astype(numpy.int32)


@pytest.mark.parametrize('scaling', ['static', 'dynamic'])
@pytest.mark.parametrize('dtype', DTYPES)
def test_backward_with_the_optimizers_loss_scale_equals_update_lossfun(path, dtype, scaling):
    """Chainer's idiom for loops that run backward themselves (chainermn's multi-node
    optimizer, custom updaters): ``loss.backward(loss_scale=optimizer._loss_scale)``."""
    x, t = two_linear_data(dtype)
    a, b = TwoLinear(dtype), TwoLinear(dtype)
    oa = optimizers.MomentumSGD(lr=0.1).setup(a)
    ob = optimizers.MomentumSGD(lr=0.1).setup(b)
    for o in (oa, ob):
        configure(o, scaling)
        assert o._loss_scale == o.loss_scale == (10.0 if scaling == 'static' else 2.0 ** 15)
    for _ in range(4):
        oa.update(lambda: F.softmax_cross_entropy(a(x), t))
        b.cleargrads()
        F.softmax_cross_entropy(b(x), t).backward(loss_scale=ob._loss_scale)
        assert b.a.W._loss_scale == ob._loss_scale
        ob.update()
    assert_same_params(a, b)
    assert optimizers.MomentumSGD()._loss_scale is None, 'no loss scaling: None, as Chainer'


@pytest.mark.parametrize('loss_scale', [None, 1.0, 10.0])
@pytest.mark.parametrize('dtype', DTYPES)
def test_gradients_are_divided_by_the_loss_scale_recorded_on_them(path, dtype, loss_scale):
    """Gradients set by hand on parameters whose ``_loss_scale`` says how they were scaled,
    without loss scaling configured on the optimizer: Chainer's update rules divide them by
    it; three steps against Chainer's MomentumSGD."""
    r = numpy.random.RandomState(0)
    models = []
    for _ in range(2):
        link = chainer.Link()
        with link.init_scope():
            link.p = chainer.Parameter(numpy.linspace(-1, 1, 24).astype(dtype).reshape(4, 3, 2))
            link.q = chainer.Parameter(numpy.linspace(2, -2, 7).astype(dtype))
        models.append(link)
    ref, ours = models
    o_ref = chainer_momentum_sgd(dtype, lr=0.5).setup(ref)
    o = optimizers.MomentumSGD(lr=0.5).setup(ours)
    for step in range(3):
        grads = {n: r.uniform(-1, 1, p.shape).astype(dtype) * dtype(loss_scale or 1)
                 for n, p in ref.namedparams()}
        for model in (ref, ours):
            for n, p in model.namedparams():
                p.grad = grads[n].copy()
                p._loss_scale = loss_scale
        o_ref.update()
        o.update()
        assert_same_params(ref, ours)
        assert_same_grads(ref, ours)


@pytest.mark.parametrize('scale', [10.0, 2.0 ** 10])
@pytest.mark.parametrize('dtype', DTYPES)
def test_gradients_after_a_scaled_update_are_chainers(path, dtype, scale):
    """``update(lossfun)`` with a static loss scale, 3 steps: what the parameters and their
    gradients hold afterwards, bit for bit against Chainer (float32 and float64 gradients
    divided in place, by a division (10) or an exact reciprocal (2^10); float16 ones left
    scaled). Post-update hooks and extensions such as ParameterStatistics read them."""
    x, t = two_linear_data(dtype)
    ref, ours = TwoLinear(dtype), TwoLinear(dtype)
    o_ref = chainer_momentum_sgd(dtype, lr=0.1).setup(ref)
    o = optimizers.MomentumSGD(lr=0.1).setup(ours)
    for opt in (o_ref, o):
        opt.loss_scaling(scale=scale)
    for _ in range(3):
        o_ref.update(lambda: F.softmax_cross_entropy(ref(x), t))
        o.update(lambda: F.softmax_cross_entropy(ours(x), t))
    assert_same_params(ref, ours)
    assert_same_grads(ref, ours)
    if dtype != numpy.float16:
        ours.cleargrads()
        F.softmax_cross_entropy(ours(x), t).backward()          # unscaled
        plain = {n: p.grad.copy() for n, p in ours.namedparams()}
        ours.cleargrads()
        o.update(lambda: F.softmax_cross_entropy(ours(x), t))
        for n, p in ours.namedparams():
            numpy.testing.assert_allclose(p.grad, plain[n], rtol=1e-5 if dtype == numpy.float32
                                          else 1e-12, err_msg=n)


def test_a_skipped_step_leaves_the_gradients_scaled(path):
    """Dynamic scaling that skips a step (an inf gradient): nothing is divided, as Chainer's
    update() returns before its update rules run."""
    model = TwoLinear()
    o = optimizers.MomentumSGD(lr=0.1).setup(model)
    o.loss_scaling(initial_scale=64.0)
    x, t = two_linear_data()
    model.cleargrads()
    F.softmax_cross_entropy(model(x), t).backward(loss_scale=64.0)
    model.b.b.grad[1] = numpy.inf
    before = {n: p.grad.copy() for n, p in model.namedparams()}
    with pytest.warns(UserWarning, match='skipped 1 update step'):
        o.update()
    assert o.skipped_steps == 1
    for n, p in model.namedparams():
        numpy.testing.assert_array_equal(p.grad, before[n], err_msg=n)


def test_a_gradient_two_parameters_share_is_divided_once(path):
    """Chainer's backward gives one array to both inputs of an addition: ``a.grad is b.grad``.
    Chainer's update rules then divide it in place once per parameter, so ``b`` (updated
    second) trains on grad / scale**2 (with lr 1, scale 4 and a gradient of 4: a ends at 0, b at
    0.75). Ours reads it once for each, from private copies, and writes the quotient back once:
    both parameters take the same step, and the shared gradient holds grad / scale."""
    link = chainer.Link()
    with link.init_scope():
        link.a = chainer.Parameter(numpy.ones(300, numpy.float32))
        link.b = chainer.Parameter(numpy.ones(300, numpy.float32))
        link.c = chainer.Parameter(numpy.ones(300, numpy.float32))
    o = optimizers.MomentumSGD(lr=1.0, momentum=0.0).setup(link)
    o.loss_scaling(scale=4.0)
    link.cleargrads()
    F.sum(F.relu(link.a + link.b) + link.c * 2).backward(loss_scale=4.0)
    assert link.a.grad is link.b.grad
    o.update()
    numpy.testing.assert_array_equal(link.a.array, 0.0)
    numpy.testing.assert_array_equal(link.b.array, 0.0)
    numpy.testing.assert_array_equal(link.c.array, -1.0)
    assert link.a.grad is link.b.grad
    numpy.testing.assert_array_equal(link.a.grad, 1.0)
    numpy.testing.assert_array_equal(link.c.grad, 2.0)


def test_a_strided_gradient_gets_its_quotient_back(path):
    """A gradient that is a transposed view is read from a contiguous copy; its quotient is
    copied back into it, as Chainer divides the view in place."""
    models = []
    for _ in range(2):
        link = chainer.Link()
        with link.init_scope():
            link.w = chainer.Parameter(numpy.linspace(-1, 1, 12).astype(numpy.float32)
                                       .reshape(3, 4))
        models.append(link)
    ref, ours = models
    o_ref = chainer_momentum_sgd(numpy.float32, lr=0.5).setup(ref)
    o = optimizers.MomentumSGD(lr=0.5).setup(ours)
    g = numpy.random.RandomState(3).randn(4, 3).astype(numpy.float32) * 10
    for model in (ref, ours):
        model.w.grad = g.copy().T
        model.w._loss_scale = 10.0
    o_ref.update()
    o.update()
    assert not ours.w.grad.flags.c_contiguous
    assert_same_params(ref, ours)
    assert_same_grads(ref, ours)


def test_a_read_only_gradient_is_used_and_left_as_it_is(path):
    """``F.sum(p)``'s backward gives ``p`` a read-only broadcast view: Chainer's in-place
    division fails on it ("output array is read-only"); ours updates from it and leaves it."""
    link = chainer.Link()
    with link.init_scope():
        link.p = chainer.Parameter(numpy.ones(5, numpy.float32))
    o = optimizers.MomentumSGD(lr=1.0, momentum=0.0).setup(link)
    o.loss_scaling(scale=4.0)
    link.cleargrads()
    F.sum(link.p).backward(loss_scale=4.0)
    assert not link.p.grad.flags.writeable
    o.update()
    numpy.testing.assert_array_equal(link.p.array, 0.0)
    numpy.testing.assert_array_equal(link.p.grad, 4.0)


def test_float16_gradients_of_different_loss_scales_are_divided_in_float32(path):
    """A step mixing loss scales (the optimizer's static 16, and backward passes with 4 and 8):
    each float16 gradient is divided by its own scale in float32, as Chainer's
    use_fp32_update divides a float32 copy, and is left scaled. In float16 the small quotients
    (2^-22 / 8) would be rounded to float16 subnormals or zero."""
    r = numpy.random.RandomState(4)
    names = ('dev', 'four', 'eight')
    models = []
    for _ in range(2):
        link = chainer.Link()
        with link.init_scope():
            for name in names:
                setattr(link, name, chainer.Parameter(
                    (r.randn(40) * 1e-4).astype(numpy.float16)))
        models.append(link)
    ref, ours = models
    for name in names:
        getattr(ours, name).array[...] = getattr(ref, name).array
    o_ref = chainer_momentum_sgd(numpy.float16, lr=1.0, momentum=0.0).setup(ref)
    o = optimizers.MomentumSGD(lr=1.0, momentum=0.0).setup(ours)
    o.loss_scaling(scale=16.0)
    grads = {n: (r.randn(40) * 2.0 ** -20).astype(numpy.float16) for n in names}
    marks = {'dev': 16.0, 'four': 4.0, 'eight': 8.0}
    for model in (ref, ours):
        for n in names:
            p = getattr(model, n)
            p.grad = grads[n].copy()
            p._loss_scale = marks[n]
    ours.dev._loss_scale = _scaler.SCALED_ON_DEVICE
    o_ref.update()
    o.update()
    assert_same_params(ref, ours)
    assert_same_grads(ref, ours)
    for n in names:
        numpy.testing.assert_array_equal(getattr(ours, n).grad, grads[n], err_msg=n)


@pytest.mark.parametrize('scaling', ['none', 'static'])
def test_one_step_holding_gradients_of_different_loss_scales(path, scaling):
    """Each gradient divided by its own recorded scale, as Chainer's per-parameter update rules
    do: the optimizer's (static 16 here), none (a plain backward), 4 and 8 (two
    backward(loss_scale=...) passes). Values are powers of two: the reference is exact."""
    link = chainer.Link()
    with link.init_scope():
        for name in ('dev', 'plain', 'four', 'eight'):
            setattr(link, name, chainer.Parameter(numpy.full(300, 1.0, numpy.float32)))
    o = optimizers.MomentumSGD(lr=0.5, momentum=0.0).setup(link)
    if scaling == 'static':
        o.loss_scaling(scale=16.0)
    marks = {'dev': _scaler.SCALED_ON_DEVICE, 'plain': None, 'four': 4.0, 'eight': 8}
    assert link.dev._loss_scale is _scaler.SCALED_ON_DEVICE, 'set at setup(): no backward yet'
    for name, mark in marks.items():
        p = getattr(link, name)
        p.grad = numpy.full(300, 2.0, numpy.float32)
        p._loss_scale = mark
    o.update()
    divisor = {'dev': 16.0 if scaling == 'static' else 1.0, 'plain': 1.0, 'four': 4.0,
               'eight': 8.0}
    for name, d in divisor.items():
        numpy.testing.assert_array_equal(getattr(link, name).array, 1.0 - 0.5 * 2.0 / d,
                                         err_msg=name)


def test_an_unscaled_overflow_is_still_caught_by_dynamic_scaling(path):
    """A plain backward() under dynamic scaling: Chainer still checks every gradient and skips
    the step; so does ours (one overflow check over all gradients, scaled or not)."""
    model = TwoLinear()
    o = optimizers.MomentumSGD(lr=0.1).setup(model)
    o.loss_scaling(initial_scale=64.0)
    before = {n: p.array.copy() for n, p in model.namedparams()}
    x, t = two_linear_data()
    model.cleargrads()
    F.softmax_cross_entropy(model(x), t).backward()
    model.b.b.grad[1] = numpy.inf
    with pytest.warns(UserWarning, match='dynamic loss scaling skipped 1 update step'):
        o.update()
    for n, p in model.namedparams():
        numpy.testing.assert_array_equal(p.array, before[n], err_msg=n)
    assert (o.skipped_steps, o.loss_scale, o.t) == (1, 32.0, 1)


@pytest.mark.parametrize('mark, error, message', [
    (0.0, ValueError, r'parameter /p: its gradient was computed with loss_scale=0.0 '
                      r'\(param._loss_scale\); a loss scale must be a positive finite number'),
    (-2, ValueError, 'loss_scale=-2.0'),
    (numpy.inf, ValueError, 'loss_scale=inf'),
    (float('nan'), ValueError, 'loss_scale=nan'),
    ('ten', TypeError, r"parameter /p: .*loss_scale='ten' .*not a number"),
])
def test_a_meaningless_recorded_loss_scale_is_refused_by_name(path, mark, error, message):
    link = chainer.Link()
    with link.init_scope():
        link.p = chainer.Parameter(numpy.ones(3, numpy.float32))
    o = optimizers.MomentumSGD().setup(link)
    link.p.grad = numpy.ones(3, numpy.float32)
    link.p._loss_scale = mark
    with pytest.raises(error, match=message):
        o.update()


@pytest.mark.parametrize('how', ['pickle', 'deepcopy'])
def test_a_copied_optimizer_unscales_each_gradient_as_the_original(path, how):
    """Chainer's Parameter pickles without its ``_loss_scale`` (a copy starts with None); a
    copy of the optimizer (which copies its target) keeps every parameter's mark, so gradients
    waiting for the update are unscaled alike: here copied between backward and update."""
    link = chainer.Link()
    with link.init_scope():
        for name in ('dev', 'plain', 'four'):
            setattr(link, name, chainer.Parameter(numpy.full(5, 1.0, numpy.float32)))
    opt = optimizers.MomentumSGD(lr=0.5).setup(link)
    opt.loss_scaling(scale=16.0)
    for name, mark in (('plain', None), ('four', 4.0)):
        getattr(link, name)._loss_scale = mark
    for p in link.params():
        p.grad = numpy.full(5, 2.0, numpy.float32)
    copied = clone(opt, how)
    assert copied.target.dev._loss_scale is _scaler.SCALED_ON_DEVICE
    assert copied.target.plain._loss_scale is None and copied.target.four._loss_scale == 4.0
    opt.update()
    copied.update()
    assert_same_params(link, copied.target)
    numpy.testing.assert_array_equal(link.dev.array, 1.0 - 0.5 * 2.0 / 16)


def test_the_device_scale_mark_refuses_to_be_a_number():
    with pytest.raises(TypeError, match="scaled by chainer_tc's MomentumSGD loss scale"):
        float(_scaler.SCALED_ON_DEVICE)
    assert pickle.loads(pickle.dumps(_scaler.SCALED_ON_DEVICE)) is _scaler.SCALED_ON_DEVICE
    assert copy.deepcopy(_scaler.SCALED_ON_DEVICE) is _scaler.SCALED_ON_DEVICE


def test_dynamic_policies_differ_as_documented():
    """docs/optimizer.md: Chainer's scale starts at 1 and doubles every clean step until the
    first overflow, then grows by 2**(1/interval) per clean step; ours starts at
    ``initial_scale`` and doubles after ``interval`` clean steps in a row. Both halve on an
    overflow and skip the step."""
    seen = {}
    for name, opt in (('chainer', chainer.optimizers.MomentumSGD(lr=0.0)),
                      ('ours', optimizers.MomentumSGD(lr=0.0))):
        link = chainer.Link()
        with link.init_scope():
            link.p = chainer.Parameter(numpy.ones(3, numpy.float32))
        opt.setup(link)
        opt.loss_scaling(interval=2)
        scales = []
        for step in range(7):
            link.p.grad = numpy.ones(3, numpy.float32)
            if step == 3:
                link.p.grad[0] = numpy.nan
            with warnings.catch_warnings():
                warnings.simplefilter('ignore')      # Chainer warns about the nan
                opt.update()
            scales.append(float(opt._loss_scale))
        seen[name] = scales
    c = seen['chainer']
    assert c[:4] == [2.0, 4.0, 8.0, 4.0]
    assert c[4:] == pytest.approx([4 * 2 ** 0.5, 8.0, 8 * 2 ** 0.5], rel=1e-12)
    assert seen['ours'] == [2.0 ** 15, 2.0 ** 16, 2.0 ** 16, 2.0 ** 15, 2.0 ** 15, 2.0 ** 16,
                            2.0 ** 16]


# ---- optimizer hooks ---------------------------------------------------------------------------

HOOKS = {
    'clipping': lambda: [optimizer_hooks.GradientClipping(0.05)],
    'hard_clipping': lambda: [optimizer_hooks.GradientHardClipping(-0.02, 0.02)],
    'lasso': lambda: [optimizer_hooks.Lasso(1e-2)],
    'noise': lambda: [optimizer_hooks.GradientNoise(0.01)],
    'lars': lambda: [optimizer_hooks.GradientLARS(threshold=1e-2, weight_decay=1e-3)],
    'all': lambda: [optimizer_hooks.Lasso(1e-2), optimizer_hooks.GradientNoise(0.01),
                    optimizer_hooks.GradientClipping(0.05)],
}


@pytest.mark.parametrize('hooks', sorted(HOOKS))
def test_optimizer_hooks_give_chainers_result(path, hooks):
    """Per-parameter hooks get ``(param.update_rule, param)``, so GradientNoise's default
    noise reads the rule's ``t`` (it is Chainer's: steps applied so far); its noise comes from
    NumPy's global generator, seeded alike for both runs and drawn in the same order."""
    x, t = two_linear_data()
    results = []
    for make in (lambda: chainer.optimizers.MomentumSGD(lr=0.2),
                 lambda: optimizers.MomentumSGD(lr=0.2)):
        model = TwoLinear()
        opt = make().setup(model)
        for hook in HOOKS[hooks]():
            opt.add_hook(hook)
        numpy.random.seed(7)
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', chainer.warnings.PerformanceWarning)
            for _ in range(5):
                opt.update(lambda: F.softmax_cross_entropy(model(x), t))
        results.append(model)
    assert_same_params(*results)


def test_hooks_see_scaled_gradients_as_in_chainer(path):
    """With loss scaling, Chainer runs the hooks before its update rules unscale the
    gradients; so does ours (the kernel unscales): float16, static scale 32, hard clipping."""
    x, t = two_linear_data(numpy.float16)
    results = []
    for make in (lambda: chainer_momentum_sgd(numpy.float16, lr=0.2),
                 lambda: optimizers.MomentumSGD(lr=0.2)):
        model = TwoLinear(numpy.float16)
        opt = make().setup(model)
        opt.loss_scaling(scale=32.0)
        opt.add_hook(optimizer_hooks.GradientHardClipping(-0.5, 0.5))
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', chainer.warnings.PerformanceWarning)
            for _ in range(4):
                opt.update(lambda: F.softmax_cross_entropy(model(x), t))
        results.append(model)
    assert_same_params(*results)


class RecordWeights:
    """A per-parameter hook keeping a copy of the weights it sees."""
    call_for_each_param = True

    def __init__(self, name, timing):
        self.name, self.timing = name, timing
        self.seen = None

    def __call__(self, rule, param):
        assert rule is param.update_rule
        self.seen = param.array.copy()


@pytest.mark.parametrize('register', ['timing_argument', 'timing_attribute'])
def test_pre_hooks_see_the_old_weights_and_post_hooks_the_new(path, register):
    link = chainer.Link()
    with link.init_scope():
        link.w = chainer.Parameter(numpy.array([0.5, -1.0], numpy.float32))
    opt = optimizers.MomentumSGD(lr=0.1).setup(link)
    pre, post = RecordWeights('pre_hook', 'pre'), RecordWeights('post_hook', 'post')
    for hook in (pre, post):
        if register == 'timing_argument':
            opt.add_hook(hook, timing=hook.timing)
        else:
            opt.add_hook(hook)                       # 'auto': the hook's timing attribute
    before = link.w.array.copy()
    with pytest.warns(chainer.warnings.PerformanceWarning, match='runs once per parameter'):
        opt.update(lambda: F.sum(link.w * link.w))
    numpy.testing.assert_array_equal(pre.seen, before)
    numpy.testing.assert_array_equal(post.seen, link.w.array)
    numpy.testing.assert_array_equal(link.w.array, before - numpy.float32(0.1) * 2 * before)


def test_per_parameter_hooks_pass_under_chainers_warning_policy(path):
    """Chainer's tests run with every warning an error except its PerformanceWarning: the
    warning about per-parameter hooks is one (a RuntimeWarning subclass)."""
    link = chainer.Link()
    with link.init_scope():
        link.w = chainer.Parameter(numpy.ones(2, numpy.float32))
    opt = optimizers.MomentumSGD().setup(link)
    opt.add_hook(optimizer_hooks.Lasso(1e-3))
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        warnings.simplefilter('ignore', chainer.warnings.PerformanceWarning)
        opt.update(lambda: F.sum(link.w * link.w))
    assert issubclass(chainer.warnings.PerformanceWarning, RuntimeWarning)


def test_a_hook_that_clears_gradients_leaves_zeros_for_the_next_hook_and_the_update(path):
    link = chainer.Link()
    with link.init_scope():
        link.w = chainer.Parameter(numpy.array([1.0, 2.0], numpy.float32))
    opt = optimizers.MomentumSGD(lr=0.5, momentum=0.5).setup(link)
    opt.update(lambda: F.sum(link.w))                 # v = -0.5
    seen = []

    def clear(o):
        for p in o.target.params():
            p.cleargrad()

    def check(o):
        seen.extend(p.grad.copy() for p in o.target.params())
    opt.add_hook(clear, name='clear', timing='pre')
    opt.add_hook(check, name='check', timing='pre')
    opt.update(lambda: F.sum(link.w))
    numpy.testing.assert_array_equal(seen[0], [0.0, 0.0])
    # the second step is momentum alone: v = 0.5 * -0.5
    numpy.testing.assert_array_equal(link.w.array, [1.0 - 0.5 - 0.25, 2.0 - 0.5 - 0.25])


def test_hook_registration_errors_are_chainers():
    link = chainer.Link()
    with link.init_scope():
        link.w = chainer.Parameter(numpy.ones(2, numpy.float32))
    with pytest.raises(RuntimeError, match='not set up'):
        optimizers.MomentumSGD().add_hook(lambda o: None, 'h')
    opt = optimizers.MomentumSGD().setup(link)
    opt.add_hook(lambda o: None, 'h')
    with pytest.raises(KeyError, match='already exists'):
        opt.add_hook(lambda o: None, 'h')
    with pytest.raises(TypeError, match='callable'):
        opt.add_hook(1)
    opt.remove_hook('h')
    with pytest.raises(KeyError):
        opt.remove_hook('h')


# ---- pickling and deep copies --------------------------------------------------------------------

@pytest.mark.parametrize('how', ['pickle', 'deepcopy'])
@pytest.mark.parametrize('lazy', [False, True])
def test_a_copy_made_before_the_first_update_trains_like_the_original(path, how, lazy):
    """Lazy: the copy is made before the parameters exist, so before any flat buffer."""
    batches = linear_batches(numpy.float32, steps=6)
    model = linear_model(numpy.float32, lazy)
    opt = optimizers.MomentumSGD(lr=0.1).setup(model)
    copied = clone(opt, how)
    for o in (opt, copied):
        train_linear(o, o.target, batches, 'lossfun')
    assert_same_params(model, copied.target)
    ref, _, _ = run_linear(lambda: chainer.optimizers.MomentumSGD(lr=0.1), numpy.float32, lazy,
                           None, 'lossfun', steps=6)
    assert_same_params(ref, copied.target)


@pytest.mark.parametrize('how', ['pickle', 'deepcopy'])
@pytest.mark.parametrize('scaling', [None, 'static', 'dynamic'])
@pytest.mark.parametrize('dtype', DTYPES)
def test_a_copy_made_mid_training_continues_identically(path, how, scaling, dtype):
    """The copy carries momenta, masters, t, the loss-scale state and the scale marks on the
    parameters; it trains on exactly as the original does, and as Chainer's optimizer would
    have (dynamic scaling apart, whose policy differs: compared with the original only)."""
    batches = linear_batches(dtype, steps=8)
    model = linear_model(dtype, True)
    opt = optimizers.MomentumSGD(lr=0.1).setup(model)
    configure(opt, scaling)
    train_linear(opt, model, batches[:4] + batches[-1:], 'lossfun')
    copied = clone(opt, how)
    assert copied.target is not model and copied.t == opt.t == 4
    for o in (opt, copied):
        train_linear(o, o.target, batches[4:], 'lossfun')
    assert_same_params(model, copied.target)
    assert (copied.t, copied.loss_scale, copied.skipped_steps) == (
        opt.t, opt.loss_scale, opt.skipped_steps)
    for (n, p), (_, q) in zip(sorted(model.namedparams()), sorted(copied.target.namedparams())):
        numpy.testing.assert_array_equal(q.update_rule.state['v'], p.update_rule.state['v'])
        assert q.update_rule.t == p.update_rule.t == 8
    if scaling != 'dynamic':
        ref = linear_model(dtype, True)
        o_ref = chainer_momentum_sgd(dtype, lr=0.1).setup(ref)
        configure(o_ref, scaling)
        train_linear(o_ref, ref, batches, 'lossfun')
        assert_same_params(ref, copied.target)


# ---- hyperparameters (test_optimizers.py, test_optimizer.py) -------------------------------------

def one_param_link(value=(1.0, 2.0)):
    link = chainer.Link()
    with link.init_scope():
        link.w = chainer.Parameter(numpy.array(value, numpy.float32))
    return link


def test_hyperparameters_are_chainers_plus_weight_decay():
    ours = optimizers.MomentumSGD(lr=0.1, momentum=0.8)
    ref = chainer.optimizers.MomentumSGD(lr=0.1, momentum=0.8)
    assert ours.hyperparam.get_dict() == dict(ref.hyperparam.get_dict(), weight_decay=0.0)
    assert repr(ours.hyperparam) == 'Hyperparameter(lr=0.1, momentum=0.8, weight_decay=0.0)'
    assert repr(ref.hyperparam) == 'Hyperparameter(lr=0.1, momentum=0.8)'
    assert optimizers.MomentumSGD().hyperparam.get_dict() == {
        'lr': 0.01, 'momentum': 0.9, 'weight_decay': 0.0}


def test_every_hyperparameter_given_to_the_constructor_reaches_the_rules():
    for name, default in optimizers.MomentumSGD().hyperparam.get_dict().items():
        link = one_param_link()
        optimizers.MomentumSGD().setup(link)
        assert getattr(link.w.update_rule.hyperparam, name) == default
        link = one_param_link()
        optimizers.MomentumSGD(**{name: default + 0.1}).setup(link)
        assert getattr(link.w.update_rule.hyperparam, name) == default + 0.1, name


def test_rule_hyperparameters_inherit_override_and_copy_like_chainers():
    link = one_param_link()
    opt = optimizers.MomentumSGD(lr=1, momentum=0.5).setup(link)
    parent, child = opt.hyperparam, link.w.update_rule.hyperparam
    assert child.parent is parent
    child.momentum = 0.25
    child.extra = 4
    assert child.get_dict() == {'lr': 1, 'momentum': 0.25, 'weight_decay': 0.0, 'extra': 4}
    assert repr(child) == 'Hyperparameter(extra=4, lr=1, momentum=0.25, weight_decay=0.0)'
    parent.lr = 3
    assert child.lr == 3 and child.get_dict()['lr'] == 3
    parent_copy, child_copy = copy.deepcopy([parent, child])
    assert child_copy.parent is parent_copy
    assert child_copy.get_dict() == child.get_dict()
    assert parent_copy.get_dict() == parent.get_dict()
    opt2 = pickle.loads(pickle.dumps(opt))
    assert opt2.target.w.update_rule.hyperparam.parent is opt2.hyperparam
    assert opt2.target.w.update_rule.hyperparam.get_dict() == child.get_dict()


def test_proxies_reach_the_update_like_chainers(path):
    """``opt.lr`` / ``opt.momentum`` are Chainer's HyperparameterProxy: assigning them moves
    every rule that does not override the value, in the next update."""
    assert isinstance(optimizers.MomentumSGD.__dict__['lr'],
                      chainer.optimizer.HyperparameterProxy)
    x, t = two_linear_data()
    results = []
    for make in (lambda: chainer.optimizers.MomentumSGD(lr=0.1),
                 lambda: optimizers.MomentumSGD(lr=0.1)):
        model = TwoLinear()
        opt = make().setup(model)
        for lr, momentum in ((0.1, 0.9), (0.03, 0.9), (0.03, 0.5), (0.2, 0.0)):
            opt.lr, opt.momentum = lr, momentum
            assert opt.hyperparam.lr == lr and model.a.W.update_rule.hyperparam.lr == lr
            assert model.b.b.update_rule.hyperparam.momentum == momentum
            opt.update(lambda: F.softmax_cross_entropy(model(x), t))
        results.append(model)
    assert_same_params(*results)


# ---- rule state from a file (test_optimizer.py's serialize tests) -------------------------------

def lazy_link():
    link = chainer.Link()
    with link.init_scope():
        link.w = chainer.Parameter(chainer.initializers.Constant(0.5))
    return link


@pytest.mark.parametrize('enabled', [True, False])
@pytest.mark.parametrize('strict', [True, False])
def test_rule_state_loads_like_chainers_before_the_parameters_exist(path, strict, enabled):
    """A lazy parameter has no state yet: a file with ``t`` but no ``v`` raises KeyError only
    for a strict load into an enabled rule, and otherwise leaves the state empty, in both."""
    results = []
    for make in (chainer.optimizers.MomentumSGD, optimizers.MomentumSGD):
        link = lazy_link()
        make().setup(link)
        link.w.update_rule.enabled = enabled
        file = {'t': numpy.asarray(7)}
        loader = serializers.NpzDeserializer(file, strict=strict)
        if strict and enabled:
            with pytest.raises(KeyError):
                link.w.update_rule.serialize(loader)
            results.append('KeyError')
        else:
            link.w.update_rule.serialize(loader)
            results.append((link.w.update_rule.t, link.w.update_rule.state))
    assert results[0] == results[1]
    assert results[1] == 'KeyError' or results[1] == (7, None)


def test_a_loaded_momentum_of_a_lazy_parameter_is_used_like_chainers(path):
    """``t`` and ``v`` loaded before the parameter exists: the first update uses them."""
    results = []
    for make in (chainer.optimizers.MomentumSGD, optimizers.MomentumSGD):
        # a fresh file each: Chainer's rule keeps the loaded array itself as its state
        file = {'t': numpy.asarray(3), 'v': numpy.array([0.25, -0.5], numpy.float32)}
        link = lazy_link()
        opt = make(lr=0.5, momentum=0.5).setup(link)
        link.w.update_rule.serialize(serializers.NpzDeserializer(file))
        link.w.initialize((2,))
        link.w.grad = numpy.array([1.0, 1.0], numpy.float32)
        opt.update()
        results.append((link.w.array.copy(), link.w.update_rule.state['v'].copy(),
                        link.w.update_rule.t))
    for a, b in zip(*results):
        numpy.testing.assert_array_equal(b, a)
    assert results[1][2] == 4


# ---- parameter shapes (test_optimizers.py TestOptimizer) -----------------------------------------

class Quadratic(chainer.Chain):
    def __init__(self, shape):
        super().__init__()
        with self.init_scope():
            self.w = chainer.Parameter(
                numpy.asarray(numpy.random.RandomState(0).randn(*shape), numpy.float32))

    def forward(self, x):
        return F.sum((x - self.w) ** 2)


@pytest.mark.parametrize('shape', [(2, 3), (), (1, 0, 2)])
def test_matrix_scalar_and_empty_parameters(path, shape):
    """Chainer updates a 0-d parameter with NumPy scalar arithmetic, in float64 (a Python
    float times a 0-d array): its result can differ from ours (float32) by a float32
    rounding, hence a relative 2**-23 for that one; the others are bit for bit."""
    x = numpy.asarray(numpy.random.RandomState(1).randn(*shape), numpy.float32)
    results = []
    for make in (chainer.optimizers.MomentumSGD, optimizers.MomentumSGD):
        model = Quadratic(shape)
        opt = make().setup(model)
        for _ in range(3):
            opt.update(model, x)
        results.append(model.w.array.copy())
    assert results[1].shape == shape and results[1].dtype == numpy.float32
    if shape == ():
        numpy.testing.assert_allclose(results[1], results[0], rtol=2 ** -23)
    else:
        numpy.testing.assert_array_equal(results[1], results[0])


@pytest.mark.parametrize('frozen', ['a', 'b'])
def test_a_frozen_parameter_sharing_a_gradient_leaves_the_quotient(path, frozen):
    """One array for both gradients, one of the two parameters frozen: only the trained one's
    rule divides it, once, in Chainer; ours too, whichever of the two comes first (the frozen
    one's private copy, never divided, was once copied back over the quotient)."""
    results = []
    for make in (lambda: chainer_momentum_sgd(numpy.float32, lr=1.0, momentum=0.0),
                 lambda: optimizers.MomentumSGD(lr=1.0, momentum=0.0)):
        link = chainer.Link()
        with link.init_scope():
            link.a = chainer.Parameter(numpy.ones(300, numpy.float32))
            link.b = chainer.Parameter(numpy.ones(300, numpy.float32))
        o = make().setup(link)
        o.loss_scaling(scale=4.0)
        getattr(link, frozen).update_rule.enabled = False
        link.cleargrads()
        F.sum(F.relu(link.a + link.b)).backward(loss_scale=4.0)
        assert link.a.grad is link.b.grad
        o.update()
        results.append((link.a.array.copy(), link.b.array.copy(), link.a.grad.copy()))
    for want, got in zip(*results):
        numpy.testing.assert_array_equal(got, want)
    numpy.testing.assert_array_equal(results[1][2], 1.0)


def test_views_of_one_buffer_sharing_memory_are_found():
    """Gradients that are views of a buffer NumPy did not allocate (numpy.frombuffer: the
    array's base is the buffer, a view's base the array) are found to share memory: both
    parameters train on grad / scale, which is written back once."""
    link = chainer.Link()
    with link.init_scope():
        link.a = chainer.Parameter(numpy.zeros(4, numpy.float32))
        link.b = chainer.Parameter(numpy.zeros(4, numpy.float32))
    o = optimizers.MomentumSGD(lr=1.0, momentum=0.0).setup(link)
    o.loss_scaling(scale=4.0)
    g = numpy.frombuffer(bytearray(numpy.full(4, 8.0, numpy.float32).tobytes()), numpy.float32)
    link.a.grad, link.b.grad = g, g[:]
    o.update()
    numpy.testing.assert_array_equal(link.a.array, -2.0)
    numpy.testing.assert_array_equal(link.b.array, -2.0)
    numpy.testing.assert_array_equal(g, 2.0)


def test_a_misaligned_gradient_is_refused_by_name_on_the_kernel_path(monkeypatch):
    """A float32 gradient at an address that is not a multiple of 4 (a view at an odd byte
    offset): a GPU cannot load it; the kernel path says which parameter (the NumPy path, like
    Chainer, trains from it)."""
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1')
    link = chainer.Link()
    with link.init_scope():
        link.a = chainer.Parameter(numpy.zeros(2, numpy.float32))
    o = optimizers.MomentumSGD(lr=1.0).setup(link)
    raw = numpy.zeros(12, numpy.uint8)
    skew = 2 if raw.ctypes.data % 4 == 0 else 0
    link.a.grad = raw[skew:skew + 8].view(numpy.float32)
    assert link.a.grad.ctypes.data % 4 == 2
    with pytest.raises(ValueError, match=r'gradient of parameter\(s\) /a \(address 0x[0-9a-f]+, '
                                         r'float32\) is not aligned'):
        o.update()
