"""chainer_tc.optimizers.MomentumSGD: Chainer equivalence, the kernel against the NumPy path,
loss scaling, snapshots, and bad input."""
import copy
import os
import warnings

import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer: CUDA libraries)
import chainer
import chainer.functions as F
import chainer.links as L
from chainer import serializers
from chainer import training
from chainer.training import extensions

from chainer_tc import kernels
from chainer_tc import optimizers
from chainer_tc.optimizers import _flat

from nets import ConvBNLinear
from nets import SizesNet


class MixedNet(ConvBNLinear):
    """conv, BN, linear and a 0-d parameter: every shape kind the optimizer sees."""

    def __init__(self, dtype=numpy.float32, seed=0):
        super().__init__(dtype, seed)
        with self.init_scope():
            self.gain = chainer.Parameter(numpy.array(1.5, dtype))

    def forward(self, x):
        return super().forward(x) * self.gain


def batch(dtype=numpy.float32, seed=0, n=4):
    r = numpy.random.RandomState(seed)
    return r.randn(n, 3, 6, 6).astype(dtype), r.randint(0, 5, n).astype(numpy.int32)


def loss_of(model, x, t):
    return lambda: F.softmax_cross_entropy(model(x), t)


def params_of(model):
    return {n: p.array.copy() for n, p in model.namedparams()}


def assert_params_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        numpy.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.fixture(params=['numpy', 'emulator'])
def path(request, monkeypatch):
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1' if request.param == 'emulator' else '0')
    return request.param


# ---- Chainer equivalence (float32) ----------------------------------------------------------------

def train_both(model, x, t, lr, momentum, wd, steps=10):
    """10 steps of Chainer's MomentumSGD + WeightDecay and of ours from the same weights."""
    ref, ours = model, copy.deepcopy(model)
    o_ref = chainer.optimizers.MomentumSGD(lr=lr, momentum=momentum).setup(ref)
    o_ref.add_hook(chainer.optimizer_hooks.WeightDecay(wd))
    o = optimizers.MomentumSGD(lr=lr, momentum=momentum, weight_decay=wd).setup(ours)
    for _ in range(steps):
        o_ref.update(loss_of(ref, x, t))
        o.update(loss_of(ours, x, t))
    return ref, ours, o_ref, o


def test_matches_chainer_momentum_sgd_with_weight_decay(path):
    x, t = batch()
    ref, ours, o_ref, o = train_both(MixedNet(), x, t, lr=0.05, momentum=0.9, wd=1e-3)
    # Same float32 operations in the same order: equal to the last bit, except that Chainer's
    # NumPy update of a 0-d parameter runs in float64 (a Python float times a 0-d array is a
    # scalar operation), which then feeds every other gradient: hence the 1e-6.
    for (name, a), (_, b) in zip(sorted(ref.namedparams()), sorted(ours.namedparams())):
        numpy.testing.assert_allclose(b.array, a.array, rtol=1e-6, atol=1e-7, err_msg=name)
    assert o.t == o_ref.t == 10


def test_bitwise_equal_to_chainer_without_0d_parameters(path):
    class Net(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.a = L.Linear(7, 33)
                self.b = L.Linear(33, 3)

        def forward(self, x):
            return self.b(F.tanh(self.a(x)))
    r = numpy.random.RandomState(1)
    x, t = r.randn(5, 7).astype(numpy.float32), r.randint(0, 3, 5).astype(numpy.int32)
    ref, ours, _, _ = train_both(Net(), x, t, lr=0.1, momentum=0.8, wd=1e-2)
    assert_params_equal(params_of(ref), params_of(ours))


def numpy_momentum_reference(params, grads_per_step, lr, mom, wd, nesterov, decays):
    """Independent float32 reference: p, v per parameter, one step per gradient set."""
    p = [a.astype(numpy.float32).copy() for a in params]
    v = [numpy.zeros_like(a) for a in p]
    lr, mom, wd = numpy.float32(lr), numpy.float32(mom), numpy.float32(wd)
    for grads in grads_per_step:
        for i, g in enumerate(grads):
            g = g.astype(numpy.float32) + (wd * p[i] if decays[i] else 0)
            v[i] = v[i] * mom - lr * g
            p[i] = p[i] + (v[i] * mom - lr * g if nesterov else v[i])
    return p, v


@pytest.mark.parametrize('nesterov', [False, True])
def test_nesterov_and_decay_exclusion_against_numpy_reference(path, nesterov):
    x, t = batch()
    model = MixedNet()
    start = [p.array.copy() for _, p in sorted(model.namedparams())]
    names = [n for n, _ in sorted(model.namedparams())]
    o = optimizers.MomentumSGD(lr=0.05, momentum=0.9, weight_decay=1e-2, nesterov=nesterov,
                               decay_filter=optimizers.skip_bn_and_bias).setup(model)
    grads = []
    for _ in range(5):
        model.cleargrads()
        F.softmax_cross_entropy(model(x), t).backward()
        grads.append([p.grad.copy() for _, p in sorted(model.namedparams())])
        o.update()
    decays = [n in ('/conv/W', '/fc/W') for n in names]
    assert [p.update_rule.hyperparam.weight_decay != 0
            for _, p in sorted(model.namedparams())] == decays
    p_ref, v_ref = numpy_momentum_reference(start, grads, 0.05, 0.9, 1e-2, nesterov, decays)
    entries = {e.name: e for e in o._flat.entries}
    for name, p, v in zip(names, p_ref, v_ref):
        numpy.testing.assert_allclose(dict(model.namedparams())[name].array, p, rtol=2e-6,
                                      atol=1e-7, err_msg=name)
        numpy.testing.assert_allclose(entries[name].v, v, rtol=2e-6, atol=1e-7, err_msg=name)


def test_decay_filter_matches_chainer_per_parameter_hooks(path):
    x, t = batch()
    ref = MixedNet()
    ours = copy.deepcopy(ref)
    o_ref = chainer.optimizers.MomentumSGD(lr=0.05).setup(ref)
    for name, p in ref.namedparams():
        if p.ndim > 1:
            p.update_rule.add_hook(chainer.optimizer_hooks.WeightDecay(1e-2))
    o = optimizers.MomentumSGD(lr=0.05, weight_decay=1e-2,
                               decay_filter=optimizers.skip_bn_and_bias).setup(ours)
    for _ in range(6):
        o_ref.update(loss_of(ref, x, t))
        o.update(loss_of(ours, x, t))
    for (name, a), (_, b) in zip(sorted(ref.namedparams()), sorted(ours.namedparams())):
        numpy.testing.assert_allclose(b.array, a.array, rtol=1e-6, atol=1e-7, err_msg=name)


# ---- the kernel (emulated) against the NumPy path ---------------------------------------------------

AWKWARD = [1, 31, 33, 127, 128, 129, 2047, 2048, 2049, 4097]


def run_steps(model, opt, steps, emulate, monkeypatch, grad_scale=1.0, inject=None):
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1' if emulate else '0')
    for s in range(steps):
        model.set_grads(100 + s, grad_scale)
        if inject is not None and s == inject[0]:
            name, index, value = inject[1:]
            g = dict(model.namedparams())[name].grad
            g.flat[index] = value
        opt.update()


def state_of(opt):
    f = opt._flat
    return {'params': [a.copy() for a in f.params], 'master': f.master.copy(),
            'momentum': [a.copy() for a in f.momentum], 'scaler': opt._scaler.state.copy()}


def assert_states_equal(a, b):
    for k in a:
        va, vb = a[k], b[k]
        for x, y in (zip(va, vb) if isinstance(va, list) else [(va, vb)]):
            numpy.testing.assert_array_equal(x.view(numpy.uint8), y.view(numpy.uint8), err_msg=k)


@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float16])
@pytest.mark.parametrize('nesterov', [False, True])
@pytest.mark.parametrize('scaling', [None, 'static', 'dynamic'])
def test_emulated_kernel_equals_numpy_path(monkeypatch, dtype, nesterov, scaling):
    states = []
    for emulate in (False, True):
        model = SizesNet(AWKWARD, dtype)
        opt = optimizers.MomentumSGD(lr=0.01, momentum=0.9, weight_decay=1e-3, nesterov=nesterov,
                                     decay_filter=lambda n, p: p.size % 2 == 1).setup(model)
        if scaling == 'static':
            opt.loss_scaling(scale=1000.0)
        elif scaling == 'dynamic':
            opt.loss_scaling(interval=2, initial_scale=8.0)
        run_steps(model, opt, 5, emulate, monkeypatch, grad_scale=1000.0 if scaling else 1.0)
        states.append(state_of(opt))
    assert_states_equal(*states)


def test_mixed_float16_and_float32_parameters(monkeypatch):
    class Mixed(SizesNet):
        def __init__(self):
            super().__init__([33, 2049], numpy.float16)
            with self.init_scope():
                self.q = chainer.Parameter(numpy.linspace(-1, 1, 130).astype(numpy.float32))
    states = []
    for emulate in (False, True):
        model = Mixed()
        opt = optimizers.MomentumSGD(lr=0.1, weight_decay=1e-2).setup(model)
        opt.loss_scaling(interval=3)
        run_steps(model, opt, 4, emulate, monkeypatch)
        states.append(state_of(opt))
        assert model.q.dtype == numpy.float32 and model.p0.dtype == numpy.float16
    assert_states_equal(*states)


@pytest.mark.parametrize('n_params', [3, 161])
def test_at_most_two_launches_per_update(monkeypatch, n_params):
    model = SizesNet([1 + (i * 37) % 300 for i in range(n_params)], numpy.float16)
    opt = optimizers.MomentumSGD(lr=0.1).setup(model)
    opt.loss_scaling()
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1')
    for s in range(3):
        model.set_grads(s)
        with kernels.count_launches() as c:
            opt.update()
        assert c.per_kernel == {'momentum_sgd_check': 1, 'momentum_sgd_update': 1}
    opt2 = optimizers.MomentumSGD(lr=0.1).setup(SizesNet([5] * n_params, numpy.float32))
    opt2.target.set_grads(0)
    with kernels.count_launches() as c:
        opt2.update()
    assert c.per_kernel == {'momentum_sgd_update': 1}, 'no loss scaling: one launch'


def test_more_parameters_than_one_launch_holds(monkeypatch):
    n = _flat.GRAD_TABLE + 20
    states, launches = [], None
    for emulate in (False, True):
        model = SizesNet([3] * n, numpy.float32)
        opt = optimizers.MomentumSGD(lr=0.1).setup(model)
        opt.loss_scaling(interval=2)
        with kernels.count_launches() as c:
            run_steps(model, opt, 3, emulate, monkeypatch)
        launches = c.total if emulate else launches
        states.append(state_of(opt))
    assert_states_equal(*states)
    assert launches == 3 * 4    # per step: 2 checks + 2 updates, the table holding 480 addresses


def test_parameters_are_views_of_the_flat_buffers():
    model = SizesNet([5, 300], numpy.float16)
    opt = optimizers.MomentumSGD().setup(model)
    for e in opt._flat.entries:
        assert e.param.array is e.view
        assert numpy.shares_memory(e.view, opt._flat.params[1])
        assert e.view.ctypes.data % 256 == 0, 'every parameter starts 256-byte aligned'
    numpy.testing.assert_array_equal(opt._flat.master[:5], model.p0.array.astype(numpy.float32))


# ---- loss scaling ------------------------------------------------------------------------------------

@pytest.mark.parametrize('value', [numpy.inf, -numpy.inf, numpy.nan])
@pytest.mark.parametrize('where', [('/p0', 0), ('/p8', 2048), ('/p9', 4096)])
def test_overflow_skips_the_step_exactly(path, monkeypatch, value, where):
    model = SizesNet(AWKWARD, numpy.float16)
    opt = optimizers.MomentumSGD(lr=0.01, weight_decay=1e-3).setup(model)
    opt.loss_scaling(interval=1000, initial_scale=1024.0)
    run_steps(model, opt, 2, path == 'emulator', monkeypatch)
    before = state_of(opt)
    model.set_grads(999)
    dict(model.namedparams())[where[0]].grad.flat[where[1]] = value
    with pytest.warns(UserWarning, match=r'skipped 1 update step\(s\) .*iteration 3'):
        opt.update()
    after = state_of(opt)
    for k in ('params', 'master', 'momentum'):
        for x, y in (zip(before[k], after[k]) if isinstance(before[k], list) else
                     [(before[k], after[k])]):
            numpy.testing.assert_array_equal(x.view(numpy.uint8), y.view(numpy.uint8))
    assert opt.loss_scale == 512.0 and opt.skipped_steps == 1
    assert opt.t == 3, 't counts skipped steps too, as in Chainer'


def test_skipped_step_equals_a_control_run_that_never_saw_it(monkeypatch):
    """Inject an inf at step 3; the run must equal a control run without that step, except for
    the scale, which halved."""
    def make():
        model = SizesNet([40, 2100], numpy.float16)
        opt = optimizers.MomentumSGD(lr=0.01, momentum=0.9).setup(model)
        opt.loss_scaling(interval=1000, initial_scale=256.0)
        return model, opt

    model, opt = make()
    control, copt = make()
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1')
    for s in range(6):
        model.set_grads(s, opt.loss_scale)
        if s == 3:
            model.p1.grad[7] = numpy.inf
            with pytest.warns(UserWarning, match='dynamic loss scaling skipped'):
                opt.update()
        else:
            opt.update()
        if s != 3:
            control.set_grads(s, copt.loss_scale)
            copt.update()
    a, b = state_of(opt), state_of(copt)
    b['scaler'] = a['scaler']
    assert_states_equal(a, b)
    assert opt.loss_scale == 128.0 and copt.loss_scale == 256.0


def test_scale_grows_after_interval_clean_steps_and_stays_in_bounds(path):
    model = SizesNet([10], numpy.float32)
    opt = optimizers.MomentumSGD(lr=0.0).setup(model)
    opt.loss_scaling(interval=3, initial_scale=2.0, min_scale=1.0, max_scale=16.0)
    seen = []
    for s in range(14):
        model.set_grads(s)
        opt.update()
        seen.append(opt.loss_scale)
    assert seen == [2, 2, 4, 4, 4, 8, 8, 8, 16, 16, 16, 16, 16, 16]
    with pytest.warns(UserWarning) as said:
        for s in range(6):      # overflow every step: halves down to the floor, never below
            model.set_grads(s)
            model.p0.grad[0] = numpy.nan
            opt.update()
    assert opt.loss_scale == 1.0 and opt.skipped_steps == 6
    # one warning for the burst, one more when the scale reaches min_scale
    assert [str(w.message).count('min_scale') for w in said] == [0, 1]


def test_loss_is_seeded_with_the_scale_and_grads_are_unscaled(path):
    x, t = batch(numpy.float16)
    ref = MixedNet(numpy.float16)
    ours = copy.deepcopy(ref)
    o_ref = optimizers.MomentumSGD(lr=0.05).setup(ref)
    o = optimizers.MomentumSGD(lr=0.05).setup(ours)
    o.loss_scaling(scale=64.0)
    ours.cleargrads()
    o.update(loss_of(ours, x, t))
    # backward ran on a loss seeded with 64: the gradients are 64 times the unscaled ones, up to
    # float16 rounding (half an ulp, relative 2^-11), and to the subnormals of the unscaled run
    # (absolute 2^-24), which is what loss scaling is for
    ref.cleargrads()
    F.softmax_cross_entropy(ref(x), t).backward()
    for (n, a), (_, b) in zip(sorted(ref.namedparams()), sorted(ours.namedparams())):
        numpy.testing.assert_allclose(b.grad.astype(numpy.float32) / 64, a.grad, rtol=2 ** -9,
                                      atol=2 ** -23, err_msg=n)
    o_ref.update()
    for (n, a), (_, b) in zip(sorted(ref.namedparams()), sorted(ours.namedparams())):
        numpy.testing.assert_allclose(b.array, a.array, rtol=1e-3, atol=1e-4, err_msg=n)


@pytest.mark.parametrize('dtype', [numpy.float16, numpy.float32, numpy.float64])
def test_loss_seed_is_a_copy_of_the_scale_made_by_a_chainer_function(dtype):
    """docs/optimizer.md: the seed is the state's scale, copied on the device by a Chainer
    function (so a recorded step makes it again at each replay: chainer_tc.static_graph), and
    a backward writing into it leaves the scale alone."""
    model = MixedNet(numpy.float16)
    o = optimizers.MomentumSGD(lr=0.05).setup(model)
    o.loss_scaling(initial_scale=2.0 ** 10)
    scaler = o._scaler
    from chainer_tc.static_graph import _trace
    with _trace.Recorder() as rec:
        seed = scaler.seed(numpy.zeros((), dtype))
    assert seed.dtype == dtype and seed.shape == () and float(seed) == 2.0 ** 10
    assert len(rec.trace.ops) == 1       # one recorded function made it
    assert rec.trace.ops[0].outputs[0] is (seed if seed.base is None else seed.base)
    assert not numpy.shares_memory(seed, scaler.state)
    seed /= 4                  # F.hinge's backward: gloss /= len(t)
    assert o.loss_scale == 2.0 ** 10


def test_float16_training_tracks_float32(path):
    """A long fp16 run with dynamic scaling follows the fp32 run: the master weights are fp32,
    so the only difference is fp16 arithmetic in forward and backward (11-bit mantissas through
    conv, BN and linear layers). Seen over seeds 0-6: losses within 1.5% (0.004 absolute),
    weights within 3% in norm; seed 0 is the one tested, with bounds 3% + 0.005 and 3%."""
    x, t = batch(n=16)
    m32 = MixedNet(numpy.float32)
    m16 = MixedNet(numpy.float16)
    for (_, a), (_, b) in zip(sorted(m32.namedparams()), sorted(m16.namedparams())):
        a.array[...] = b.array.astype(numpy.float32)
    o32 = optimizers.MomentumSGD(lr=0.02).setup(m32)
    o16 = optimizers.MomentumSGD(lr=0.02).setup(m16)
    o16.loss_scaling(interval=10, initial_scale=256.0)
    losses = []
    for s in range(40):
        l32 = F.softmax_cross_entropy(m32(x), t)
        l16 = F.softmax_cross_entropy(m16(x.astype(numpy.float16)), t)
        losses.append((float(l32.array), float(l16.array)))
        o32.update(lambda: l32)
        o16.update(lambda: l16)
    l32s, l16s = numpy.array(losses).T
    assert l32s[-1] < 0.5 * l32s[0], 'the model learns'
    numpy.testing.assert_allclose(l16s, l32s, rtol=0.03, atol=0.005)
    assert o16.skipped_steps == 0 and o16.loss_scale == 256.0 * 2 ** 4
    for (n, a), (_, b) in zip(sorted(m32.namedparams()), sorted(m16.namedparams())):
        if n == '/conv/b':      # a bias before BN has a zero gradient: only rounding noise moves it
            continue
        err = numpy.linalg.norm(b.array.astype(numpy.float32) - a.array)
        assert err <= 0.03 * numpy.linalg.norm(a.array), n


# ---- snapshots -----------------------------------------------------------------------------------

@pytest.mark.parametrize('fmt', ['npz', 'hdf5'])
def test_resume_mid_run_is_bit_identical(path, monkeypatch, tmp_path, fmt):
    """Through either of Chainer's file formats (HDF5 writes into an empty group: the
    loss-scaling keys were once left out of it, as if the file already lacked them)."""
    save = getattr(serializers, 'save_' + fmt)
    load = getattr(serializers, 'load_' + fmt)

    def make():
        model = SizesNet([33, 2049, 7], numpy.float16)
        opt = optimizers.MomentumSGD(lr=0.01, weight_decay=1e-3).setup(model)
        opt.loss_scaling(interval=2, initial_scale=4.0)
        return model, opt

    emulate = path == 'emulator'
    model, opt = make()
    run_steps(model, opt, 3, emulate, monkeypatch)
    model.p1.grad[0] = numpy.inf           # one skipped step before the snapshot
    with pytest.warns(UserWarning, match='dynamic loss scaling skipped'):
        opt.update()
    save(str(tmp_path / ('opt.' + fmt)), opt)
    save(str(tmp_path / ('model.' + fmt)), model)
    saved_scale, saved_skipped = opt.loss_scale, opt.skipped_steps
    for s in range(4, 9):
        model.set_grads(100 + s)
        opt.update()
    straight = state_of(opt)

    model2, opt2 = make()
    # the same configuration as the saved run's: the scale goes on from the snapshot's
    opt2.loss_scaling(interval=2, initial_scale=64.0)
    load(str(tmp_path / ('opt.' + fmt)), opt2)
    load(str(tmp_path / ('model.' + fmt)), model2)
    assert (opt2.t, opt2.loss_scale, opt2.skipped_steps) == (4, saved_scale, saved_skipped)
    for s in range(4, 9):
        model2.set_grads(100 + s)
        opt2.update()
    assert_states_equal(straight, state_of(opt2))
    assert opt2.t == opt.t == 9


def test_trainer_snapshot_extensions_and_lr_schedule(tmp_path):
    x, t = batch(n=12)
    dataset = chainer.datasets.TupleDataset(x, t)

    def make_trainer(out):
        model = L.Classifier(MixedNet())
        opt = optimizers.MomentumSGD(lr=0.1).setup(model)
        it = chainer.iterators.SerialIterator(dataset, 4, shuffle=False)
        updater = training.updaters.StandardUpdater(it, opt)
        trainer = training.Trainer(updater, (6, 'iteration'), out=str(out))
        trainer.extend(extensions.ExponentialShift('lr', 0.5), trigger=(2, 'iteration'))
        return trainer, model, opt

    trainer, model, opt = make_trainer(tmp_path / 'a')
    trainer.extend(extensions.snapshot(filename='snap_{.updater.iteration}'),
                   trigger=(3, 'iteration'))
    trainer.run()
    assert opt.t == 6 and opt.lr == pytest.approx(0.1 * 0.5 ** 3)

    trainer2, model2, opt2 = make_trainer(tmp_path / 'b')
    serializers.load_npz(str(tmp_path / 'a' / 'snap_3'), trainer2)
    assert opt2.t == 3
    trainer2.run()
    assert opt2.t == 6 and opt2.lr == opt.lr
    for (n, a), (_, b) in zip(sorted(model.namedparams()), sorted(model2.namedparams())):
        numpy.testing.assert_array_equal(a.array, b.array, err_msg=n)


def test_loading_float16_weights_after_setup_is_adopted(path, tmp_path):
    model = SizesNet([5, 40], numpy.float16)
    opt = optimizers.MomentumSGD(lr=0.0, momentum=0.0).setup(model)
    pretrained = SizesNet([5, 40], numpy.float16, seed=7)
    serializers.save_npz(str(tmp_path / 'w.npz'), pretrained)
    serializers.load_npz(str(tmp_path / 'w.npz'), model)
    model.set_grads(0)
    opt.update()     # lr 0: the update must keep the loaded weights, not the stale masters
    numpy.testing.assert_array_equal(model.p1.array, pretrained.p1.array)
    numpy.testing.assert_array_equal(opt._flat.master[128:168],
                                     pretrained.p1.array.astype(numpy.float32))


# ---- bad input -------------------------------------------------------------------------------------

def test_update_before_setup():
    with pytest.raises(RuntimeError, match='not set up'):
        optimizers.MomentumSGD().update()


def test_hyperparameters_are_validated():
    with pytest.raises(ValueError, match='lr must be a finite number >= 0; got -1'):
        optimizers.MomentumSGD(lr=-1)
    with pytest.raises(ValueError, match='momentum must be a finite number'):
        optimizers.MomentumSGD(momentum=float('nan'))
    with pytest.raises(TypeError, match='decay_filter must be callable'):
        optimizers.MomentumSGD(decay_filter=['/W'])
    opt = optimizers.MomentumSGD().setup(SizesNet([3], numpy.float32))
    with pytest.raises(ValueError, match='interval must be >= 1'):
        opt.loss_scaling(interval=0)
    with pytest.raises(ValueError, match='min_scale <= initial_scale'):
        opt.loss_scaling(initial_scale=0.5)
    with pytest.raises(ValueError, match='positive finite'):
        opt.loss_scaling(scale=-2)


def test_weight_decay_hook_is_refused_with_guidance():
    opt = optimizers.MomentumSGD().setup(SizesNet([3], numpy.float32))
    with pytest.raises(TypeError, match=r'pass weight_decay=0.0005'):
        opt.add_hook(chainer.optimizer_hooks.WeightDecay(5e-4))


def test_other_hooks_still_work(path):
    model = SizesNet([3, 40], numpy.float32)
    opt = optimizers.MomentumSGD(lr=1.0, momentum=0.0).setup(model)
    opt.add_hook(chainer.optimizer_hooks.GradientClipping(1e-3))
    model.set_grads(0)
    before = params_of(model)
    opt.update()
    step = numpy.sqrt(sum(((before[n] - p.array) ** 2).sum() for n, p in model.namedparams()))
    assert step == pytest.approx(1e-3, rel=1e-4)


def test_unsupported_parameter_dtype_is_refused():
    with pytest.raises(TypeError, match='parameter /p0 is int32; chainer_tc.optimizers supports '
                                        'float16, float32 and float64'):
        optimizers.MomentumSGD().setup(SizesNet([3], numpy.int32))


@pytest.mark.parametrize('change', ['dtype', 'value'])
def test_parameter_replaced_after_setup_is_adopted_with_a_warning(path, change):
    """A parameter given a new array after setup() (new values or dtype) trains on from that
    array, momentum kept, exactly like a fresh optimizer given the same state; once warned."""
    model = SizesNet([3, 4], numpy.float32)
    opt = optimizers.MomentumSGD(lr=0.1).setup(model)
    model.set_grads(0)
    opt.update()
    v_before = model.p1.update_rule.state['v'].copy()
    new = (model.p1.array.astype(numpy.float16) if change == 'dtype'
           else numpy.full(4, 2.0, numpy.float32))
    model.p1.array = new
    model.set_grads(1)
    with pytest.warns(RuntimeWarning, match='parameter /p1 was given a new array after setup'):
        opt.update()
    assert model.p1.dtype == new.dtype
    g = numpy.random.RandomState(1)
    g0 = g.randn(3)  # p0's gradient of seed 1, consumed first in sorted order
    g1 = g.randn(4).astype(new.dtype).astype(numpy.float32)
    v = v_before * numpy.float32(0.9) - numpy.float32(0.1) * g1
    numpy.testing.assert_array_equal(model.p1.update_rule.state['v'], v)
    expect = (new.astype(numpy.float32) + v).astype(new.dtype)
    numpy.testing.assert_array_equal(model.p1.array, expect)
    model.set_grads(2)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        opt.update()                       # no second rebuild, no second warning


def test_parameters_on_mixed_devices(monkeypatch):
    model = SizesNet([3, 4], numpy.float32)
    monkeypatch.setattr(_flat, '_device_of',
                        lambda a: 'gpu:1' if a.shape == (4,) else 'cpu')
    with pytest.raises(ValueError, match=r'parameters are on different devices \(/p0 on cpu, '
                                         r'/p1 on gpu:1\)'):
        optimizers.MomentumSGD().setup(model)


def test_lazy_parameters_are_set_up_at_the_first_update(path):
    model = L.Linear(None, 3)
    opt = optimizers.MomentumSGD(lr=0.1).setup(model)
    assert opt._flat is None
    x = numpy.ones((2, 5), numpy.float32)
    opt.update(lambda: F.sum(model(x)))
    assert opt._flat is not None
    assert any(model.W.array is e.view for e in opt._flat.entries)


def test_update_without_gradients_applies_momentum_only(path):
    model = SizesNet([4], numpy.float32)
    opt = optimizers.MomentumSGD(lr=0.5, momentum=0.5).setup(model)
    model.set_grads(0)
    g = model.p0.grad.copy()
    p0 = model.p0.array.copy()
    opt.update()
    model.cleargrads()                 # no gradient: as if zero (Chainer reallocates it)
    opt.update()
    v1 = -numpy.float32(0.5) * g
    expect = p0 + v1 + v1 * numpy.float32(0.5)
    numpy.testing.assert_allclose(model.p0.array, expect, rtol=1e-6)


# ---- GPU -----------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float16])
def test_gpu_equals_numpy_path(monkeypatch, dtype):
    states = []
    for device in ('cpu', 'gpu'):
        model = SizesNet(AWKWARD, dtype)
        if device == 'gpu':
            model.to_gpu()
        opt = optimizers.MomentumSGD(lr=0.01, weight_decay=1e-3).setup(model)
        opt.loss_scaling(interval=2, initial_scale=8.0)
        for s in range(5):
            model.set_grads(100 + s)        # NumPy's numbers, on the model's device
            opt.update()
        st = state_of(opt)
        states.append({k: ([chainer.backends.cuda.to_cpu(a) for a in v] if isinstance(v, list)
                           else chainer.backends.cuda.to_cpu(v)) for k, v in st.items()})
    # the GPU kernel uses the _rn intrinsics: no fma contraction, the same roundings
    assert_states_equal(*states)


@pytest.mark.gpu
def test_gpu_update_does_not_synchronize(monkeypatch):
    import cupy
    model = SizesNet([100, 3000], numpy.float16)
    model.to_gpu()
    opt = optimizers.MomentumSGD(lr=0.01).setup(model)
    opt.loss_scaling()
    for p in model.params():
        p.grad = cupy.ones_like(p.array)
    opt.update()                          # compile and warm up

    def forbidden(*a, **k):
        raise AssertionError('update() synchronised with the device')
    for target, name in [(cupy.cuda.runtime, 'deviceSynchronize'),
                         (cupy.cuda.Stream, 'synchronize'), (cupy.cuda.Event, 'synchronize'),
                         (cupy.ndarray, 'get'), (cupy.ndarray, 'item'),
                         (cupy.ndarray, '__float__'), (cupy.ndarray, '__bool__'),
                         (cupy.cuda.runtime, 'memcpy')]:
        monkeypatch.setattr(target, name, forbidden)
    with kernels.count_launches() as c:
        opt.update()
    assert c.total == 2


def test_non_contiguous_gradient(path):
    results = []
    for fortran in (False, True):
        model = chainer.Link()
        with model.init_scope():
            model.w = chainer.Parameter(numpy.arange(12, dtype=numpy.float32).reshape(3, 4))
        opt = optimizers.MomentumSGD(lr=0.1).setup(model)
        g = numpy.linspace(-1, 1, 12, dtype=numpy.float32).reshape(3, 4)
        model.w.grad = numpy.asfortranarray(g) if fortran else g
        assert model.w.grad.flags.c_contiguous != fortran
        opt.update()
        results.append(model.w.array.copy())
    numpy.testing.assert_array_equal(*results)


def test_scaled_backward_for_loops_without_a_loss_function(path):
    x, t = batch(numpy.float16)
    a, b = MixedNet(numpy.float16), MixedNet(numpy.float16)
    oa = optimizers.MomentumSGD(lr=0.05).setup(a)
    ob = optimizers.MomentumSGD(lr=0.05).setup(b)
    for o in (oa, ob):
        o.loss_scaling(interval=1000, initial_scale=128.0)
    for _ in range(3):
        oa.update(loss_of(a, x, t))
        b.cleargrads()
        ob.scaled_backward(F.softmax_cross_entropy(b(x), t))
        ob.update()
    assert_params_equal(params_of(a), params_of(b))


@pytest.mark.gpu
def test_gpu_update_can_be_captured_in_a_cuda_graph():
    """A stream capture refuses any synchronisation or synchronous copy: update() must pass."""
    import cupy
    model = SizesNet([100, 3000], numpy.float16)
    model.to_gpu()
    opt = optimizers.MomentumSGD(lr=0.01).setup(model)
    opt.loss_scaling()
    for p in model.params():
        p.grad = cupy.ones_like(p.array)
    opt.update()                          # compile outside the capture
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        opt.update()
        graph = stream.end_capture()
    before = cupy.asnumpy(model.p1.array)
    graph.launch(stream)
    stream.synchronize()
    assert not numpy.array_equal(cupy.asnumpy(model.p1.array), before)


@pytest.mark.parametrize('make_extension', [
    lambda: extensions.MultistepShift('lr', 0.1, [2, 4], 0.5),
    lambda: extensions.LinearShift('lr', (0.5, 0.1), (1, 5)),
    lambda: extensions.ExponentialShift('lr', 0.7),
])
def test_chainer_lr_schedules_reach_the_device_table(make_extension):
    """The same schedule gives the same lr sequence as with Chainer's MomentumSGD, and the lr
    reaches the hyperparameter table the kernel reads."""
    x, t = batch(n=8)
    sequences = []
    for make_opt in (lambda: chainer.optimizers.MomentumSGD(lr=0.5),
                     lambda: optimizers.MomentumSGD(lr=0.5)):
        model = L.Classifier(MixedNet())
        opt = make_opt().setup(model)
        it = chainer.iterators.SerialIterator(chainer.datasets.TupleDataset(x, t), 4)
        trainer = training.Trainer(training.updaters.StandardUpdater(it, opt), (5, 'iteration'))
        seen = []
        trainer.extend(make_extension(), trigger=(1, 'iteration'))
        trainer.extend(lambda tr: seen.append(tr.updater.get_optimizer('main').lr),
                       trigger=(1, 'iteration'), priority=training.PRIORITY_READER)
        trainer.run()
        sequences.append(seen)
    assert len(sequences[1]) == 5 and len(set(sequences[1])) > 1
    assert sequences[0] == sequences[1]
    opt._table.refresh(opt.hyperparam, opt._versions, opt._set_globals)
    assert opt._table.device[0, 0] == sequences[1][-1]
