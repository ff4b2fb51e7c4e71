"""chainer_tc.optimizers.MomentumSGD as a drop-in: what Chainer users do with the optimizer they
replace (freeze links, per-parameter hyperparameters, copies, pickles, float64, snapshots both
ways) gives Chainer's result, on the NumPy path and through the emulated kernel."""
import copy
import pickle
import warnings

import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer: CUDA libraries)
import chainer
import chainer.functions as F
import chainer.links as L
from chainer import serializers

from chainer_tc import kernels
from chainer_tc import optimizers
from chainer_tc.optimizers import _scaler
from chainer_tc import serializers as tc_serializers

from nets import ConvBNLinear as Net


@pytest.fixture(params=['numpy', 'emulator'])
def path(request, monkeypatch):
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1' if request.param == 'emulator' else '0')
    return request.param


def data(dtype=numpy.float32, seed=0, n=4):
    r = numpy.random.RandomState(seed)
    return r.randn(n, 3, 6, 6).astype(dtype), r.randint(0, 5, n).astype(numpy.int32)


def lossfun(model, x, t):
    return lambda: F.softmax_cross_entropy(model(x), t)


def chainer_pair(dtype=numpy.float32, lr=0.1, momentum=0.9, wd=1e-2, net=Net):
    """The same model twice: Chainer's MomentumSGD + WeightDecay on one, ours on the other."""
    ref = net(dtype)
    ours = copy.deepcopy(ref)
    o_ref = chainer.optimizers.MomentumSGD(lr=lr, momentum=momentum).setup(ref)
    if wd:
        o_ref.add_hook(chainer.optimizer_hooks.WeightDecay(wd))
    o = optimizers.MomentumSGD(lr=lr, momentum=momentum, weight_decay=wd).setup(ours)
    return ref, o_ref, ours, o


def step_both(ref, o_ref, ours, o, x, t, steps=1):
    for _ in range(steps):
        o_ref.update(lossfun(ref, x, t))
        o.update(lossfun(ours, x, t))


def assert_same_params(a, b):
    pa, pb = dict(a.namedparams()), dict(b.namedparams())
    assert pa.keys() == pb.keys()
    for k in pa:
        numpy.testing.assert_array_equal(pb[k].array, pa[k].array, err_msg=k)


def snapshot(model):
    return {n: p.array.copy() for n, p in model.namedparams()}


# ---- frozen links --------------------------------------------------------------------------------

def test_it_is_a_chainer_momentum_sgd_for_isinstance_and_replaces_all_of_it():
    """User code that tests ``isinstance(opt, chainer.optimizers.MomentumSGD)`` (a schedule
    that handles SGD's lr alone) takes ours for one (it did not); every rule is ours, and
    the hyperparameters are the ones given, not Chainer's defaults."""
    o = optimizers.MomentumSGD(lr=0.3, momentum=0.5, weight_decay=1e-4)
    assert isinstance(o, chainer.optimizers.MomentumSGD)
    assert (o.lr, o.momentum, o.weight_decay) == (0.3, 0.5, 1e-4)
    o.setup(Net())
    assert {type(p.update_rule).__module__ for p in o.target.params()} == {
        'chainer_tc.optimizers._rule'}
    chainers = [n for n in vars(chainer.optimizers.MomentumSGD) if not n.startswith('__doc')]
    assert {'__init__', 'create_update_rule', 'lr', 'momentum'} <= set(chainers)
    assert set(chainers) <= set(vars(optimizers.MomentumSGD)), 'every name of it is ours'


def test_frozen_link_is_not_touched_and_resumes_like_chainer(path):
    x, t = data()
    ref, o_ref, ours, o = chainer_pair()
    step_both(ref, o_ref, ours, o, x, t, 2)
    ref.conv.disable_update()
    ours.conv.disable_update()          # after setup, as fine-tuning users do
    frozen = {n: p.array.copy() for n, p in ours.conv.namedparams()}
    v_frozen = ours.conv.W.update_rule.state['v'].copy()
    step_both(ref, o_ref, ours, o, x, t, 3)
    for n, p in ours.conv.namedparams():
        numpy.testing.assert_array_equal(p.array, frozen[n], err_msg='frozen ' + n)
    numpy.testing.assert_array_equal(ours.conv.W.update_rule.state['v'], v_frozen)
    assert not ours.conv.update_enabled and ours.fc.update_enabled
    assert_same_params(ref, ours)
    ref.conv.enable_update()
    ours.conv.enable_update()
    step_both(ref, o_ref, ours, o, x, t, 2)
    assert_same_params(ref, ours)
    assert ours.conv.W.update_rule.t == ref.conv.W.update_rule.t == 4
    assert ours.fc.W.update_rule.t == ref.fc.W.update_rule.t == 7


def test_a_skipped_overflow_step_does_not_count_in_rule_t(path):
    """Also across loss_scaling() called again, which starts the skipped count anew: a rule's
    t stays the steps applied."""
    model = Net()
    o = optimizers.MomentumSGD(lr=0.1).setup(model)
    o.loss_scaling(initial_scale=4.0)
    x, t = data()
    o.update(lossfun(model, x, t))
    with pytest.warns(UserWarning, match='dynamic loss scaling skipped 1 update step'):
        o.update(lossfun(model, x * numpy.float32(numpy.inf), t))
    assert (o.t, o.skipped_steps, model.fc.W.update_rule.t) == (2, 1, 1)
    o.loss_scaling(initial_scale=8.0)
    assert (o.skipped_steps, model.fc.W.update_rule.t) == (0, 1)
    o.update(lossfun(model, x, t))
    assert (o.t, model.fc.W.update_rule.t) == (3, 2)


def test_rule_t_is_its_own_count_like_chainer_across_t_assignments_and_a_second_setup(path):
    x, t = data()
    counts = {}
    for name in ('chainer', 'ours'):
        model = Net()
        opt = (chainer.optimizers.MomentumSGD(lr=0.1) if name == 'chainer'
               else optimizers.MomentumSGD(lr=0.1)).setup(model)
        opt.loss_scaling()
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            for i in range(4):                         # 3 overflow steps, then 1 applied
                _plain_grads(model, x, t, inf_at=(0, 0) if i < 3 else None)
                opt.update()
            got = [model.fc.W.update_rule.t]
            opt.t = 0                                  # the rules keep their count
            got.append(model.fc.W.update_rule.t)
            second = Net()
            opt.setup(second)                          # t = 0 again; new rules
            for _ in range(2):
                _plain_grads(second, x, t)
                opt.update()
        counts[name] = got + [second.fc.W.update_rule.t, model.fc.W.update_rule.t, opt.t]
    assert counts['ours'] == counts['chainer'] == [1, 1, 2, 1, 2]


def test_rule_t_goes_on_from_a_snapshot_taken_after_skipped_steps(path, tmp_path):
    """A resumed run: the snapshot restores t, the rules' t and the skipped count into an
    optimizer whose clock has not stepped yet; its next steps count on from there (the skips
    before the snapshot were counted against the new clock's steps: the rule's t fell behind
    an uninterrupted run's by the number of skips; the example's resume test found it)."""
    x, t = data()

    def steps(model, opt, overflows):
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            for inf in overflows:
                _plain_grads(model, x, t, inf_at=(0, 0) if inf else None)
                opt.update()
    plan = [True, True, False, False]                  # 2 skipped, then 2 applied
    model = Net()
    opt = optimizers.MomentumSGD(lr=0.1).setup(model)
    opt.loss_scaling()
    steps(model, opt, plan)
    chainer.serializers.save_npz(str(tmp_path / 'opt.npz'), opt)
    steps(model, opt, [False, False])
    resumed_model = Net()
    resumed = optimizers.MomentumSGD(lr=0.1).setup(resumed_model)
    resumed.loss_scaling()
    chainer.serializers.load_npz(str(tmp_path / 'opt.npz'), resumed)
    assert resumed_model.fc.W.update_rule.t == 2 and resumed.t == 4
    steps(resumed_model, resumed, [False, False])
    assert (resumed.t, resumed_model.fc.W.update_rule.t) == (opt.t, model.fc.W.update_rule.t) \
        == (6, 4)


# ---- per-parameter hyperparameters ----------------------------------------------------------------

def test_per_parameter_lr_and_momentum_equal_chainer(path):
    x, t = data()
    ref, o_ref, ours, o = chainer_pair(wd=0)
    for m in (ref, ours):
        m.fc.W.update_rule.hyperparam.lr = 0.01
        m.conv.b.update_rule.hyperparam.momentum = 0.5
    step_both(ref, o_ref, ours, o, x, t, 3)
    assert_same_params(ref, ours)
    for m, opt in ((ref, o_ref), (ours, o)):
        opt.lr = 0.05                       # the optimizer's lr reaches every other parameter
        m.fc.W.update_rule.hyperparam.lr = 0.2
    step_both(ref, o_ref, ours, o, x, t, 2)
    assert_same_params(ref, ours)
    assert ours.fc.W.update_rule.hyperparam.lr == 0.2
    assert ours.fc.b.update_rule.hyperparam.lr == 0.05
    del ours.fc.W.update_rule.hyperparam.lr          # back to inheriting
    del ref.fc.W.update_rule.hyperparam.lr
    step_both(ref, o_ref, ours, o, x, t, 1)
    assert_same_params(ref, ours)


def test_per_parameter_weight_decay_equals_chainer_per_rule_hooks(path):
    x, t = data()
    ref, o_ref, ours, o = chainer_pair(wd=0)
    ours.fc.W.update_rule.hyperparam.weight_decay = 1e-2
    ref.fc.W.update_rule.add_hook(chainer.optimizer_hooks.WeightDecay(1e-2))
    step_both(ref, o_ref, ours, o, x, t, 4)
    assert_same_params(ref, ours)


def test_decay_filter_sets_a_per_parameter_weight_decay():
    model = Net()
    o = optimizers.MomentumSGD(weight_decay=1e-4,
                               decay_filter=optimizers.skip_bn_and_bias).setup(model)
    for name, p in model.namedparams():
        assert p.update_rule.hyperparam.weight_decay == (1e-4 if p.ndim > 1 else 0.0), name
    o.weight_decay = 5e-4
    assert model.fc.W.update_rule.hyperparam.weight_decay == 5e-4
    assert model.fc.b.update_rule.hyperparam.weight_decay == 0.0


def test_unchanged_step_writes_no_hyperparameter_and_an_lr_change_writes_row_0(monkeypatch):
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1')
    model = Net()
    o = optimizers.MomentumSGD(lr=0.1).setup(model)
    x, t = data()
    o.update(lossfun(model, x, t))
    table = o._table.device.copy()
    with kernels.count_launches() as c:
        o.update(lossfun(model, x, t))
    assert c.per_kernel == {'momentum_sgd_update': 1}
    numpy.testing.assert_array_equal(o._table.device, table)
    o.lr = 0.025
    with kernels.count_launches() as c:
        o.update(lossfun(model, x, t))
    assert c.per_kernel == {'momentum_sgd_set_globals': 1, 'momentum_sgd_update': 1}
    assert o._table.device[0, 0] == 0.025
    numpy.testing.assert_array_equal(o._table.device[1:], table[1:])


def test_replaced_hyperparameter_object_is_tracked(path):
    x, t = data()
    ref, o_ref, ours, o = chainer_pair(wd=0)
    for m, opt in ((ref, o_ref), (ours, o)):
        h = chainer.optimizer.Hyperparameter(opt.hyperparam)
        m.fc.W.update_rule.hyperparam = h
        h.lr = 0.3
    step_both(ref, o_ref, ours, o, x, t, 2)
    assert_same_params(ref, ours)


def test_single_parameter_update_and_rule_hooks_are_refused():
    model = Net()
    optimizers.MomentumSGD().setup(model)
    with pytest.raises(RuntimeError, match='updates all parameters together'):
        model.fc.W.update()
    with pytest.raises(NotImplementedError, match='no per-rule hooks'):
        model.fc.W.update_rule.add_hook(chainer.optimizer_hooks.WeightDecay(1e-4))


def test_a_foreign_update_rule_is_refused_by_name():
    model = Net()
    o = optimizers.MomentumSGD().setup(model)
    model.fc.W.update_rule = chainer.optimizers.momentum_sgd.MomentumSGDRule()
    model.fc.W.array = model.fc.W.array.copy()       # forces the rebuild that meets the rule
    x, t = data()
    with pytest.raises(RuntimeError, match=r"parameter /fc/W has update rule .*not chainer_tc"):
        with pytest.warns(RuntimeWarning):
            o.update(lossfun(model, x, t))


# ---- momentum resets and model changes after setup ------------------------------------------------

def test_a_momentum_reset_by_assignment_equals_chainer(path):
    """``state['v'] = zeros`` (what Chainer users do to reset the momentum) takes effect; the
    state stays a view of the flat buffer."""
    x, t = data()
    ref, o_ref, ours, o = chainer_pair()
    step_both(ref, o_ref, ours, o, x, t, 2)
    for m in (ref, ours):
        for p in m.params():
            p.update_rule.state['v'] = numpy.zeros_like(p.array)
    for e in o._flat.entries:
        assert e.param.update_rule.state['v'] is e.v and not e.v.any()
    step_both(ref, o_ref, ours, o, x, t, 2)
    assert_same_params(ref, ours)
    state = ours.fc.W.update_rule.state
    state |= {'v': numpy.full(ours.fc.W.shape, 2, numpy.float32)}
    assert state is ours.fc.W.update_rule.state
    numpy.testing.assert_array_equal(state['v'], 2)
    ours.fc.W.update_rule.state.update(v=numpy.ones(ours.fc.W.shape, numpy.float64))
    entry, = [e for e in o._flat.entries if e.param is ours.fc.W]
    assert ours.fc.W.update_rule.state['v'] is entry.v
    numpy.testing.assert_array_equal(entry.v, 1)


def test_the_state_keeps_its_keys_and_shapes_and_pickles_as_a_dict():
    model = Net()
    optimizers.MomentumSGD().setup(model)
    state = model.fc.W.update_rule.state
    with pytest.raises(ValueError, match=r"state\['v'\] has shape \(5, 64\); the array "
                                         r"assigned has shape \(64, 5\)"):
        state['v'] = numpy.zeros((64, 5), numpy.float32)
    with pytest.raises(TypeError, match=r"state\['v'\] must be an array of shape \(5, 64\)"):
        state['v'] = None
    for remove in (lambda: state.pop('v'), lambda: state.clear(), lambda: state.popitem()):
        with pytest.raises(TypeError, match=r"reset a value in place, state\['v'\]\[...\] = 0"):
            remove()
    with pytest.raises(TypeError, match='keeps its keys'):
        del state['v']
    assert set(state) == {'v'}
    state['v'][...] = 2
    for copied in (pickle.loads(pickle.dumps(state)), copy.deepcopy(state)):
        assert type(copied) is dict and set(copied) == {'v'}
        numpy.testing.assert_array_equal(copied['v'], 2)
        assert not numpy.shares_memory(copied['v'], state['v'])


class WithExtra(Net):
    """Net and, while it has one, a link ``extra`` applied to its output."""

    def __init__(self, dtype=numpy.float32):
        super().__init__(dtype)
        with self.init_scope():
            self.extra = L.Linear(5, 5, initialW=numpy.eye(5, dtype=dtype) * 0.5)

    def forward(self, x):
        y = super().forward(x)
        extra = getattr(self, 'extra', None)
        return y if extra is None else extra(y)


@pytest.mark.parametrize('how', ['delete the link', 'update_rule = None',
                                 'replace the link', 'replace the Parameter'])
def test_parameters_taken_out_of_training_stop_like_chainer(path, how):
    """After setup(), a link deleted or replaced, a Parameter replaced, or a rule set to None:
    Chainer's update walks the model and no longer updates the old parameters (nor the new
    ones, which have no update rule); ours does the same, with a warning naming them."""
    x, t = data()
    ref, o_ref, ours, o = chainer_pair(wd=0, net=WithExtra)
    step_both(ref, o_ref, ours, o, x, t, 2)
    old = {}
    for m in (ref, ours):
        extra = old[id(m)] = m.extra
        if how == 'delete the link':
            del m.extra
        elif how == 'update_rule = None':
            extra.W.update_rule = extra.b.update_rule = None
        elif how == 'replace the link':
            del m.extra
            with m.init_scope():
                m.extra = L.Linear(5, 5, initialW=numpy.eye(5, dtype=numpy.float32))
        else:
            with extra.init_scope():
                extra.W = chainer.Parameter(numpy.eye(5, dtype=numpy.float32))
        for p in extra.params():          # a gradient left behind must not be applied
            p.grad = numpy.ones_like(p.array)
    kept = {n: p.array.copy() for n, p in old[id(ours)].namedparams()}
    with pytest.warns(chainer.warnings.PerformanceWarning, match='the optimizer rebuilds'):
        if how == 'delete the link':
            step_both(ref, o_ref, ours, o, x, t, 2)
        else:
            with pytest.warns(UserWarning, match=r'parameter\(s\) /extra/W.* have no update rule'):
                step_both(ref, o_ref, ours, o, x, t, 2)
    assert_same_params(ref, ours)
    for (n, p), (_, q) in zip(old[id(ref)].namedparams(), old[id(ours)].namedparams()):
        if how == 'replace the Parameter' and n == '/b':     # still in the model, trained
            numpy.testing.assert_array_equal(q.array, p.array)
            continue
        numpy.testing.assert_array_equal(q.array, kept[n], err_msg=n)


def test_snapshots_skip_parameters_without_a_rule_and_a_rule_given_back_trains_like_chainer(
        path, tmp_path):
    x, t = data()
    ref, o_ref, ours, o = chainer_pair(wd=0, net=WithExtra)
    step_both(ref, o_ref, ours, o, x, t, 1)
    rules = {}
    for m in (ref, ours):
        rules[id(m)] = m.extra.W.update_rule
        m.extra.W.update_rule = None
    with pytest.warns(UserWarning, match=r'parameter\(s\) /extra/W have no update rule'):
        step_both(ref, o_ref, ours, o, x, t, 2)
    for name, opt in (('ref', o_ref), ('ours', o)):        # skipped, as Chainer skips it
        serializers.save_npz(str(tmp_path / name), opt)
        serializers.load_npz(str(tmp_path / name), opt)
    assert 'extra/W/v' not in numpy.load(str(tmp_path / 'ours'))
    for m in (ref, ours):
        m.extra.W.update_rule = rules[id(m)]
    frozen = ours.extra.W.array.copy()
    assert o._flat.stale() == 'parameter /extra/W was given an update rule'
    step_both(ref, o_ref, ours, o, x, t, 2)
    assert_same_params(ref, ours)
    assert not numpy.array_equal(ours.extra.W.array, frozen)


def test_a_link_added_after_setup_is_left_untrained_like_chainer_and_said_once(path):
    x, t = data()
    ref, o_ref, ours, o = chainer_pair()
    step_both(ref, o_ref, ours, o, x, t, 1)
    for m in (ref, ours):
        with m.init_scope():
            m.head = L.Linear(5, 3, initialW=numpy.ones((3, 5), numpy.float32))
    before = ours.head.W.array.copy()

    def loss(m):
        return lambda: F.sum(m.head(m(x)))
    with pytest.warns(UserWarning, match=r'parameter\(s\) /head/W, /head/b have no update rule '
                                         r'.*call optimizer.setup\(model\) again'):
        o.update(loss(ours))
    o_ref.update(loss(ref))
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        o.update(loss(ours))
    o_ref.update(loss(ref))
    assert_same_params(ref, ours)
    numpy.testing.assert_array_equal(ours.head.W.array, before)
    o.setup(ours)                           # as with Chainer, setup() again trains it
    o.update(loss(ours))
    assert not numpy.array_equal(ours.head.W.array, before)


class WithLazy(Net):
    """Net and a lazy link ``late`` that the loss calls only when ``use_late`` is set."""

    def __init__(self, dtype=numpy.float32):
        super().__init__(dtype)
        self.use_late = False
        with self.init_scope():
            self.late = L.Linear(None, 5, initialW=numpy.eye(5, dtype=dtype) * 0.5)

    def forward(self, x):
        y = super().forward(x)
        return self.late(y) if self.use_late else y


def test_a_lazy_link_the_loss_never_called_is_skipped_like_chainer_until_its_first_call(
        path, tmp_path):
    """Chainer's update skips a parameter that has no array yet; ours keeps it out of the flat
    buffers, saves snapshots as Chainer does (and fails to load them strictly, as Chainer does:
    no momentum was saved for it), and trains it from its first call."""
    x, t = data()
    ref, o_ref, ours, o = chainer_pair(net=WithLazy)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        step_both(ref, o_ref, ours, o, x, t, 2)
    assert_same_params(ref, ours)
    assert ours.late.W.array is None
    assert [n for n, _ in o._flat.waiting] == ['/late/W']
    for name, opt in (('ref', o_ref), ('ours', o)):
        serializers.save_npz(str(tmp_path / name), opt)
    saved = [numpy.load(str(tmp_path / n)) for n in ('ref', 'ours')]
    assert sorted(k for k in saved[1] if 'late' in k) == sorted(
        k for k in saved[0] if 'late' in k) == ['late/W/t', 'late/b/t', 'late/b/v']
    with pytest.raises(KeyError, match='late/W/v'):   # as Chainer's own load of its file
        serializers.load_npz(str(tmp_path / 'ours'), o)   # (which then leaves a broken state;
    assert ours.late.W.update_rule.state is None          # ours changes nothing)
    for m in (ref, ours):
        m.use_late = True
    with pytest.warns(chainer.warnings.PerformanceWarning,
                      match='parameter /late/W was initialized .* rebuilds its buffers'):
        step_both(ref, o_ref, ours, o, x, t, 3)
    assert_same_params(ref, ours)
    assert o._flat.waiting == []


def test_an_update_before_any_parameter_has_an_array_says_so():
    model = chainer.Sequential(L.Linear(None, 3, nobias=True))
    o = optimizers.MomentumSGD().setup(model)
    with pytest.raises(RuntimeError, match=r'no parameter of the target is initialized yet '
                                           r'\(/0/W wait .*run a forward pass'):
        o.update()


def test_a_link_copied_with_mode_share_beside_its_original_is_refused_by_name():
    """Both Parameters hold one array: Chainer updates it twice per step (each with its own
    gradient), which flat buffers cannot do; ours says so when it builds them (at setup())."""
    model = chainer.Chain()
    with model.init_scope():
        model.a = L.Linear(3, 3)
        model.b = model.a.copy(mode='share')
    with pytest.raises(ValueError, match=r"parameters /a/W and /b/W share one array "
                                         r"\(a Link.copy\(mode='share'\).*call the same link"):
        optimizers.MomentumSGD().setup(model)


def test_a_parameter_set_up_by_another_optimizer_is_refused_by_name():
    model = Net()
    o = optimizers.MomentumSGD().setup(model)
    optimizers.MomentumSGD().setup(model.fc)
    x, t = data()
    with pytest.raises(RuntimeError, match="parameter /fc/W has an update rule that is not this "
                                           "optimizer's"):
        with pytest.warns(RuntimeWarning, match='parameter /fc/W was given a new array'):
            o.update(lossfun(model, x, t))        # (the other optimizer moved it)


@pytest.mark.parametrize('change', ['add a parameter', 'delete a parameter',
                                    'replace a parameter without init_scope', 'add a link',
                                    'delete a link', 'append to a ChainList',
                                    'replace in a ChainList', 'delete from a ChainList'])
def test_the_structure_snapshot_sees_every_change(change):
    from chainer_tc.optimizers import _structure

    def make():
        m = Net()
        with m.init_scope():
            m.seq = chainer.ChainList(L.Linear(2, 2), L.Linear(2, 2))
        return m
    m = make()
    s = _structure.Structure(m)
    assert s.same()
    m.fc.W.array = m.fc.W.array.copy()      # a new array is not a structure change
    m.cleargrads()
    m(data()[0])
    assert s.same()
    if change == 'add a parameter':
        m.fc.add_param('c', (2,))
    elif change == 'delete a parameter':
        del m.fc.b
    elif change == 'replace a parameter without init_scope':
        m.fc.W = chainer.Parameter(m.fc.W.array)
    elif change == 'add a link':
        m.add_link('head', L.Linear(2, 2))
    elif change == 'delete a link':
        del m.bn
    elif change == 'append to a ChainList':
        m.seq.append(L.Linear(2, 2))
    elif change == 'replace in a ChainList':
        m.seq[0] = L.Linear(2, 2)
    else:
        del m.seq[1]
    assert not s.same()


# ---- copies and pickles --------------------------------------------------------------------------

@pytest.mark.parametrize('how', ['deepcopy', 'pickle'])
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float16])
def test_copy_trains_like_the_original_and_independently(path, how, dtype):
    x, t = data(dtype)
    model = Net(dtype)
    o = optimizers.MomentumSGD(lr=0.05, weight_decay=1e-3).setup(model)
    if dtype == numpy.float16:
        o.loss_scaling(interval=2, initial_scale=8.0)
    for _ in range(3):
        o.update(lossfun(model, x, t))
    o2 = copy.deepcopy(o) if how == 'deepcopy' else pickle.loads(pickle.dumps(o))
    model2 = o2.target
    assert model2 is not model
    before = snapshot(model)
    for _ in range(3):
        o2.update(lossfun(model2, x, t))
    for n, a in snapshot(model).items():      # the original did not move
        numpy.testing.assert_array_equal(a, before[n], err_msg=n)
    for _ in range(3):
        o.update(lossfun(model, x, t))
    assert_same_params(model, model2)
    assert (o2.t, o2.loss_scale, o2.skipped_steps) == (o.t, o.loss_scale, o.skipped_steps)
    for (n, p), (_, q) in zip(model.namedparams(), model2.namedparams()):
        numpy.testing.assert_array_equal(p.update_rule.state['v'], q.update_rule.state['v'])


# ---- float64 -------------------------------------------------------------------------------------

def test_float64_equals_chainer_bit_for_bit(path):
    x, t = data(numpy.float64)
    ref, o_ref, ours, o = chainer_pair(numpy.float64, lr=0.1, momentum=0.8, wd=1e-2)
    step_both(ref, o_ref, ours, o, x, t, 6)
    for name, p in ours.namedparams():
        assert p.dtype == numpy.float64 and p.update_rule.state['v'].dtype == numpy.float64
    assert_same_params(ref, ours)


def test_float64_with_static_loss_scaling_equals_chainer(path):
    x, t = data(numpy.float64)
    ref, o_ref, ours, o = chainer_pair(numpy.float64, wd=0)
    o_ref.loss_scaling(scale=256.0)
    o.loss_scaling(scale=256.0)
    step_both(ref, o_ref, ours, o, x, t, 3)
    assert_same_params(ref, ours)


@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
@pytest.mark.parametrize('scale, how', [
    (None, 'none'), (8.0, 'optimizer'), (10.0, 'optimizer'), (10.3, 'optimizer'),
    (10.3, 'backward'), (3 * 2.0 ** -20, 'optimizer')])
@pytest.mark.parametrize('wd', [0.0, 1e-2])
def test_bit_for_bit_with_chainer_exactly_under_the_documented_conditions(path, dtype, scale,
                                                                          how, wd):
    """docs/optimizer.md, "Bit for bit with Chainer": equal without loss scaling, or with a
    power-of-two scale; without weight decay also with any float32 scale (float64: a scale
    that is a float32 number, or one given to backward()); different otherwise (Chainer adds
    the decay to the scaled gradient; ours keeps the optimizer's scale as float32)."""
    x, t = data(dtype)
    ref, o_ref, ours, o = chainer_pair(dtype, wd=wd)
    if how == 'optimizer':
        for opt in (o_ref, o):
            opt.loss_scaling(scale=scale)
    for _ in range(4):
        for m, opt in ((ref, o_ref), (ours, o)):
            if how == 'backward':
                m.cleargrads()
                lossfun(m, x, t)().backward(loss_scale=scale)
                opt.update()
            else:
                opt.update(lossfun(m, x, t))
    power_of_two = scale is None or numpy.log2(scale).is_integer()
    float32_number = scale is None or numpy.float32(scale) == scale
    if wd:
        expected = power_of_two
    else:
        expected = dtype == numpy.float32 or float32_number or how == 'backward'
    same = all(numpy.array_equal(p.array, q.array)
               for p, q in zip(ref.params(), ours.params()))
    assert same == expected


def test_mixed_float64_float32_float16_parameters_kernel_equals_numpy(monkeypatch):
    def run(emulate):
        monkeypatch.setenv('CHAINER_TC_EMULATE', '1' if emulate else '0')
        link = chainer.Link()
        r = numpy.random.RandomState(0)
        with link.init_scope():
            for i, (n, dt) in enumerate([(33, 'f8'), (2049, 'f4'), (130, 'e'), (4097, 'f8')]):
                setattr(link, 'p{}'.format(i), chainer.Parameter(r.randn(n).astype(dt)))
        o = optimizers.MomentumSGD(lr=0.1, weight_decay=1e-3, nesterov=True).setup(link)
        o.loss_scaling(interval=2, initial_scale=16.0)
        link.p0.update_rule.hyperparam.lr = 0.3
        for s in range(4):
            g = numpy.random.RandomState(10 + s)
            for _, p in sorted(link.namedparams()):
                p.grad = (g.randn(*p.shape) * 16).astype(p.dtype)
            if s == 2:
                link.p3.grad[5] = numpy.nan
                with pytest.warns(UserWarning, match='dynamic loss scaling skipped 1 update step'):
                    o.update()
            else:
                o.update()
        return {n: (p.array.copy(), p.update_rule.state['v'].copy())
                for n, p in link.namedparams()}, o.loss_scale
    a, sa = run(False)
    b, sb = run(True)
    assert sa == sb
    for n in a:
        for x, y in zip(a[n], b[n]):
            numpy.testing.assert_array_equal(x.view(numpy.uint8), y.view(numpy.uint8), err_msg=n)


# ---- snapshots with Chainer's optimizer, both ways ----------------------------------------------

@pytest.mark.parametrize('direction', ['chainer_to_ours', 'ours_to_chainer'])
def test_snapshots_move_between_chainer_and_ours(path, tmp_path, direction):
    x, t = data()
    ref, o_ref, ours, o = chainer_pair()
    step_both(ref, o_ref, ours, o, x, t, 3)
    src_model, src_opt = (ref, o_ref) if direction == 'chainer_to_ours' else (ours, o)
    serializers.save_npz(str(tmp_path / 'opt.npz'), src_opt)
    serializers.save_npz(str(tmp_path / 'model.npz'), src_model)
    # a fresh pair, resumed from the one snapshot, must continue like the uninterrupted run
    ref2, o_ref2, ours2, o2 = chainer_pair()
    for m, opt in ((ref2, o_ref2), (ours2, o2)):
        serializers.load_npz(str(tmp_path / 'model.npz'), m)
        serializers.load_npz(str(tmp_path / 'opt.npz'), opt)
    assert o2.t == o_ref2.t == 3
    step_both(ref, o_ref, ours, o, x, t, 2)
    step_both(ref2, o_ref2, ours2, o2, x, t, 2)
    assert_same_params(ref, ref2)
    assert_same_params(ref, ours2)
    assert_same_params(ours, ours2)


def test_state_v_is_a_view_of_the_flat_momentum():
    model = Net()
    o = optimizers.MomentumSGD().setup(model)
    for e in o._flat.entries:
        v = e.param.update_rule.state['v']
        assert v is e.v and numpy.shares_memory(v, o._flat.momentum[e.group])


# ---- tied weights --------------------------------------------------------------------------------

def test_tied_weights_are_trained_once_per_step(path):
    class Tied(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.a = L.Linear(4, 4, initialW=numpy.eye(4, dtype=numpy.float32) * 0.5)
                self.b = L.Linear(4, 4, nobias=True)
            self.b.W = self.a.W               # the same Parameter in both links

        def forward(self, x):
            return F.sum(self.b(F.tanh(self.a(x))))

    model = Tied()
    o = optimizers.MomentumSGD(lr=0.1, momentum=0.0).setup(model)
    x = numpy.random.RandomState(0).randn(3, 4).astype(numpy.float32)
    model.cleargrads()
    model(x).backward()
    expect = model.a.W.array - numpy.float32(0.1) * model.a.W.grad
    o.update(lambda: model(x))
    numpy.testing.assert_allclose(model.a.W.array, expect, rtol=1e-6)
    assert model.b.W is model.a.W
    assert len(o._flat.entries) == 2                  # a/W, a/b (b/W is a/W)


# ---- device ------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_state_lives_on_the_parameters_device_whatever_the_current_device():
    import cupy
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip('needs two gpus')
    model = Net()
    model.to_device('@cupy:1')
    with cupy.cuda.Device(0):
        o = optimizers.MomentumSGD(lr=0.1).setup(model)
        o.loss_scaling()
        x, t = (cupy.asarray(a) for a in data())
        with cupy.cuda.Device(1):
            x, t = cupy.asarray(x), cupy.asarray(t)
        o.update(lossfun(model, x, t))
    assert o._scaler.state.device.id == 1
    assert o._table.device.device.id == 1
    for e in o._flat.entries:
        assert e.v.device.id == 1
    scale = o.loss_scale
    model.to_device('@cupy:0')                  # the state follows the parameters, scale kept
    with cupy.cuda.Device(1):
        x, t = (cupy.asarray(a) for a in data())
        with cupy.cuda.Device(0):
            x, t = cupy.asarray(x), cupy.asarray(t)
        o.update(lossfun(model, x, t))
    assert o._scaler.state.device.id == 0 and o.loss_scale == scale
    assert o._table.device.device.id == 0


@pytest.mark.gpu
def test_a_momentum_reset_from_host_or_device_arrays_reaches_the_gpu_buffer():
    import cupy
    model = Net()
    model.to_gpu()
    o = optimizers.MomentumSGD(lr=0.1).setup(model)
    x, t = (cupy.asarray(a) for a in data())
    o.update(lossfun(model, x, t))
    state = model.fc.W.update_rule.state
    v = state['v']
    state['v'] = numpy.zeros(v.shape, numpy.float32)
    assert state['v'] is v and not v.any()
    state['v'] = cupy.full(v.shape, 0.5, cupy.float64)
    assert state['v'] is v and bool((v == 0.5).all())


# ---- snapshots that would poison the state ----------------------------------------------------

def _tampered(tmp_path, opt, **changes):
    path = str(tmp_path / 'opt.npz')
    serializers.save_npz(path, opt)
    with numpy.load(path) as f:
        d = dict(f)
    for key, value in changes.items():
        if key == 'scale':
            d['loss_scaler'] = d['loss_scaler'].copy()
            d['loss_scaler'][0] = numpy.float32(value).view(numpy.uint32)
        elif value is None:
            del d[key]
        else:
            d[key] = numpy.asarray(value, d[key].dtype)
    numpy.savez(path, **d)
    return path


@pytest.mark.parametrize('changes, message', [
    (dict(scale=numpy.nan), 'loss_scaler holds the loss scale nan'),
    (dict(scale=-4.0), 'loss_scaler holds the loss scale -4.0'),
    (dict(loss_scaling_interval=0), 'loss_scaling_interval must be >= 1; got 0'),
    (dict(loss_scaling_interval=-5), 'loss_scaling_interval must be >= 1; got -5'),
    (dict(loss_scaling_min=-1.0, loss_scaling_max=-2.0), 'loss_scaling_min <= loss_scaling_max'),
    (dict(loss_scaling_mode=7), 'loss_scaling_mode must be 0'),
    (dict(loss_scaler=None), "loss_scaler"),
    ({'fc/W/v': None}, 'fc/W/v'),
])
def test_a_bad_snapshot_is_refused_naming_the_key_and_changes_nothing(tmp_path, changes,
                                                                        message):
    x, t = data()
    model = Net()
    opt = optimizers.MomentumSGD(lr=0.1).setup(model)
    opt.loss_scaling(interval=5, initial_scale=8.0)
    for _ in range(3):
        opt.update(lossfun(model, x, t))
    path = _tampered(tmp_path, opt, **changes)

    model2 = Net()
    opt2 = optimizers.MomentumSGD(lr=0.1).setup(model2)
    opt2.loss_scaling(interval=2, initial_scale=64.0)
    for _ in range(2):
        opt2.update(lossfun(model2, x, t))
    before = {n: p.update_rule.state['v'].copy() for n, p in model2.namedparams()}
    config = (opt2.t, opt2.loss_scale, opt2._scaler.interval, opt2._scaler.mode)
    with pytest.raises((ValueError, KeyError), match=message):
        serializers.load_npz(path, opt2)
    assert (opt2.t, opt2.loss_scale, opt2._scaler.interval, opt2._scaler.mode) == config
    for n, p in model2.namedparams():
        numpy.testing.assert_array_equal(p.update_rule.state['v'], before[n], err_msg=n)
        assert numpy.shares_memory(p.update_rule.state['v'], opt2._flat.momentum[0])
    opt2.update(lossfun(model2, x, t))               # and it still trains
    assert numpy.isfinite(model2.fc.W.array).all()


@pytest.mark.gpu
def test_hyperparameter_changes_reach_the_gpu_kernel_like_the_numpy_path():
    import cupy
    results = []
    for device in ('@numpy', '@cupy:0'):
        model = Net()
        model.to_device(device)
        o = optimizers.MomentumSGD(lr=0.1).setup(model)
        xp = model.device.xp
        x, t = (xp.asarray(a) for a in data())
        for s in range(4):
            if s == 1:
                o.lr = 0.03                                   # row 0: momentum_sgd_set_globals
            if s == 2:
                model.fc.W.update_rule.hyperparam.lr = 0.2    # a per-parameter row
                model.conv.disable_update()
            o.update(lossfun(model, x, t))
        results.append({n: cupy.asnumpy(p.array) for n, p in model.namedparams()})
    for n in results[0]:
        numpy.testing.assert_allclose(results[1][n], results[0][n], rtol=1e-5, atol=1e-6,
                                      err_msg=n)


# ---- hooks: the order of Chainer's update -------------------------------------------------------

def _plain_grads(model, x, t, inf_at=None):
    """A plain backward (no loss-scale mark: both optimizers use the gradients as they are),
    with an inf written into fc/W's gradient when ``inf_at`` is given."""
    model.cleargrads()
    F.softmax_cross_entropy(model(x), t).backward()
    if inf_at is not None:
        model.fc.W.grad[inf_at] = numpy.inf


def test_a_pre_hook_cannot_hide_an_overflow_from_dynamic_loss_scaling(path):
    # Chainer checks the gradients for inf/nan before its pre-update hooks: a hook that clips
    # (GradientHardClipping turns inf into its bound) must not turn the overflow step into an
    # applied one
    x, t = data()
    ref, o_ref, ours, o = chainer_pair(wd=0)
    for opt in (o_ref, o):
        opt.loss_scaling()
        opt.add_hook(chainer.optimizer_hooks.GradientHardClipping(-0.05, 0.05))
    before = snapshot(ours)
    for model, opt in ((ref, o_ref), (ours, o)):
        _plain_grads(model, x, t, inf_at=(0, 0))
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            opt.update()
    for n, p in ours.namedparams():
        numpy.testing.assert_array_equal(p.array, before[n], err_msg=n)   # skipped
    assert_same_params(ref, ours)
    assert o.skipped_steps == 1 and o.loss_scale == 2.0 ** 14
    for model, opt in ((ref, o_ref), (ours, o)):                  # a clean step: applied
        _plain_grads(model, x, t)
        opt.update()
    assert_same_params(ref, ours)
    assert o.skipped_steps == 1 and o._scaler.state[_scaler.FOUND_INF] == 0


def test_a_failing_pre_hook_leaves_no_overflow_flag_behind(path):
    x, t = data()
    model = Net()
    o = optimizers.MomentumSGD(lr=0.1).setup(model)
    o.loss_scaling()

    def bad(optimizer):
        raise RuntimeError('hook failed')
    bad.name, bad.timing, bad.call_for_each_param = 'bad', 'pre', False
    o.add_hook(bad)
    _plain_grads(model, x, t, inf_at=(0, 0))
    with pytest.raises(RuntimeError, match='hook failed'):
        o.update()
    assert o._scaler.state[_scaler.FOUND_INF] == 0
    o.remove_hook('bad')
    before = snapshot(model)
    _plain_grads(model, x, t)
    o.update()                                          # trains: no stale flag skips it
    assert not numpy.array_equal(model.fc.W.array, before['/fc/W'])
    assert o.skipped_steps == 0


class _ClipWeights:
    """A per-parameter pre-update hook that replaces each parameter's array (out of place)."""
    name, timing, call_for_each_param = 'clip_weights', 'pre', True

    def __call__(self, rule, param):
        param.array = numpy.clip(param.array, -0.2, 0.2)


def test_a_pre_hook_that_replaces_arrays_or_rules_updates_like_chainer(path):
    x, t = data()
    ref, o_ref, ours, o = chainer_pair(wd=0)    # (Chainer's WeightDecay hook would decay the
    for opt in (o_ref, o):                      # unclipped weights: ours decays in the update)
        opt.add_hook(_ClipWeights())
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        step_both(ref, o_ref, ours, o, x, t, 3)
        assert_same_params(ref, ours)

        def drop_rule(optimizer):
            optimizer.target.fc.W.update_rule = None
        drop_rule.name, drop_rule.timing, drop_rule.call_for_each_param = 'drop', 'pre', False
        for opt in (o_ref, o):
            opt.add_hook(drop_rule)
        fc_w = ours.fc.W.array.copy()
        step_both(ref, o_ref, ours, o, x, t)
    numpy.testing.assert_array_equal(numpy.clip(fc_w, -0.2, 0.2), ours.fc.W.array)
    assert_same_params(ref, ours)


def test_post_hooks_and_the_caller_see_a_gradient_for_every_parameter_like_chainer(path):
    x, t = data()
    ref, o_ref, ours, o = chainer_pair(wd=0)     # (Chainer's WeightDecay adds to the gradients)
    seen = {}

    def post(optimizer):
        seen[optimizer] = {n: None if p.grad is None else p.grad.copy()
                           for n, p in optimizer.target.namedparams()}
    post.name, post.timing, post.call_for_each_param = 'post', 'post', False
    for model, opt in ((ref, o_ref), (ours, o)):
        opt.add_hook(post)
        model.cleargrads()
        F.sum(model.conv(x)).backward()                 # bn and fc get no gradient
        opt.update()
    for n, g in seen[o_ref].items():
        numpy.testing.assert_array_equal(seen[o][n], g, err_msg=n)
    assert_same_params(ref, ours)
    o.remove_hook('post')                               # without hooks too
    o_ref.remove_hook('post')
    for model, opt in ((ref, o_ref), (ours, o)):
        model.cleargrads()
        F.sum(model.conv(x)).backward()
        opt.update()
    for n, p in ref.namedparams():
        q = dict(ours.namedparams())[n]
        assert q.grad is not None, n
        numpy.testing.assert_array_equal(q.grad, p.grad, err_msg=n)
    assert_same_params(ref, ours)


# ---- Chainer's loss-scaling methods ----------------------------------------------------------

@pytest.mark.parametrize('dynamic', [True, False])
def test_check_nan_in_grads_and_is_safe_to_update_answer_like_chainer(dynamic):
    x, t = data()
    ref, o_ref, ours, o = chainer_pair(wd=0)
    for opt in (o_ref, o):
        opt.loss_scaling(scale=None if dynamic else 8.0)
    answers = {}
    for model, opt in ((ref, o_ref), (ours, o)):
        _plain_grads(model, x, t, inf_at=(1, 2))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always')
            opt.check_nan_in_grads()
        bad = opt.is_safe_to_update()
        _plain_grads(model, x, t)
        opt.check_nan_in_grads()
        answers[opt] = ([str(m.message).split(' (')[0] for m in w], bad,
                        opt.is_safe_to_update())
    assert answers[o] == answers[o_ref]
    if dynamic:
        assert answers[o] == (['Non finite number found in param.grad of /fc/W'], False, True)
        with pytest.raises(RuntimeError, match='inside update'):
            o.update_loss_scale()         # update() moves the scale itself: not twice
    else:
        assert answers[o] == ([], True, True)
        o.update_loss_scale()               # nothing to do, as with Chainer
        assert o.loss_scale == 8.0


def _nan_loss(model, x, t):
    return lambda: F.softmax_cross_entropy(model(x), t) * numpy.float32('nan')


def test_steps_skipped_by_dynamic_loss_scaling_are_said_once_per_burst(path):
    # Chainer warns at every skipped step; ours says it once per burst of skipped steps, and
    # again when the scale has fallen to min_scale (a diverged model), naming the counts
    x, t = data()
    model = Net()
    o = optimizers.MomentumSGD(lr=0.1).setup(model)
    o.loss_scaling(min_scale=2.0 ** 10)
    o.update(lossfun(model, x, t))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for _ in range(10):
            o.update(_nan_loss(model, x, t))
    said = [str(m.message) for m in w if issubclass(m.category, UserWarning)]
    assert len(said) == 2, said
    assert 'skipped 1 update step(s)' in said[0] and 'min_scale' not in said[0]
    assert 'min_scale=1024.0' in said[1] and 'diverged' in said[1]
    assert all(m.filename == __file__ for m in w)       # the caller's line
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        o.update(lossfun(model, x, t))                  # applied: the burst ends
        o.update(_nan_loss(model, x, t))                # a new one: said again
        o.update(_nan_loss(model, x, t))
        o.new_epoch()
    said = [str(m.message) for m in w]
    assert len(said) == 1 and 'skipped 1 update step(s)' in said[0], said
    assert o.skipped_steps == 12


def test_skipped_steps_on_a_gpu_are_said_without_a_per_step_synchronisation(monkeypatch):
    # the device's count is read from an asynchronous copy made every WATCH_EVERY updates, or
    # at new_epoch(); here a NumPy state posing as a device one, and a fake copy
    x, t = data()
    model = Net()
    o = optimizers.MomentumSGD(lr=0.1).setup(model)
    o.loss_scaling()
    watch = o._skip_watch
    started = []

    class Done:
        done = True

    def start(state):
        started.append(o.t)
        watch._probe = (state.copy(), Done())
    monkeypatch.setattr(watch, '_start', start)
    monkeypatch.setattr(_scaler, 'WATCH_EVERY', 4)
    monkeypatch.setattr(watch, '_on_host', lambda state: False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for _ in range(3):
            o.update(_nan_loss(model, x, t))
        assert not w and started == []                  # no look yet
        o.update(_nan_loss(model, x, t))                # t = 4: a copy starts
        assert started == [4] and not w
        o.update(lossfun(model, x, t))                  # the copy is done: read
    said = [str(m.message) for m in w]
    assert len(said) == 1 and 'skipped 4 update step(s)' in said[0], said


@pytest.mark.gpu
def test_skipped_steps_on_a_gpu_are_said(monkeypatch):
    import cupy
    monkeypatch.setattr(_scaler, 'WATCH_EVERY', 2)
    model = Net()
    model.to_device('@cupy:0')
    o = optimizers.MomentumSGD(lr=0.1).setup(model)
    o.loss_scaling()
    x, t = (cupy.asarray(a) for a in data())
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for _ in range(3):
            o.update(_nan_loss(model, x, t))
        cupy.cuda.Device().synchronize()
        o.update(_nan_loss(model, x, t))        # the copy made at t = 2 is done: read
    said = [str(m.message) for m in w]
    assert len(said) == 1 and 'skipped 2 update step(s)' in said[0], said


# ---- decay_filter on lazy links -------------------------------------------------------------

def test_decay_filter_on_a_lazy_link_is_asked_when_it_gets_its_array_like_chainer_hooks(path):
    x, t = data()
    ref = WithLazy()
    ref.use_late = True
    ours = copy.deepcopy(ref)
    o_ref = chainer.optimizers.MomentumSGD(lr=0.1).setup(ref)
    for name, p in ref.namedparams():               # what skip_bn_and_bias means, as hooks
        if name.endswith('/W'):
            p.update_rule.add_hook(chainer.optimizer_hooks.WeightDecay(1e-2))
    o = optimizers.MomentumSGD(lr=0.1, weight_decay=1e-2,
                               decay_filter=optimizers.skip_bn_and_bias).setup(ours)
    assert ours.late.W.array is None
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        step_both(ref, o_ref, ours, o, x, t, 3)
    assert_same_params(ref, ours)
    assert ours.late.W.update_rule.hyperparam.weight_decay == 1e-2
    assert ours.late.b.update_rule.hyperparam.weight_decay == 0.0


def test_decay_filter_on_a_lazy_link_keeps_a_weight_decay_set_by_hand_and_names_a_failure():
    x, t = data()
    model = WithLazy()
    model.use_late = True
    o = optimizers.MomentumSGD(weight_decay=1e-2,
                               decay_filter=optimizers.skip_bn_and_bias).setup(model)
    model.late.b.update_rule.hyperparam.weight_decay = 3e-3     # before its first call
    o.update(lossfun(model, x, t))
    assert model.late.b.update_rule.hyperparam.weight_decay == 3e-3

    def bad(name, param):
        if param.array is None:
            raise AssertionError('asked too early')
        raise ValueError('no answer')
    model = WithLazy()
    model.use_late = True
    o = optimizers.MomentumSGD(weight_decay=1e-2, decay_filter=bad)
    with pytest.raises(ValueError, match='no answer') as e:
        o.setup(model)
    notes = getattr(e.value, '__notes__', None)
    if notes is not None:                           # (Python 3.11+: the parameter is named)
        assert any(n.startswith('in decay_filter(') and 'parameter /' in n for n in notes)


# ---- tied weights in snapshots --------------------------------------------------------------

class _Tied(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.a = L.Linear(4, 4, initialW=numpy.eye(4, dtype=numpy.float32) * 0.5)
            self.b = L.Linear(4, 4, nobias=True, initialW=numpy.eye(4, dtype=numpy.float32))
        self.b.W = self.a.W               # the same Parameter in both links

    def forward(self, x):
        return F.sum(self.b(F.tanh(self.a(x))) ** 2)


def test_tied_weights_are_saved_under_every_path_like_chainer_and_chainer_loads_them(tmp_path):
    x = numpy.random.RandomState(0).randn(3, 4).astype(numpy.float32)
    model = _Tied()
    o = optimizers.MomentumSGD(lr=0.01).setup(model)
    o.update(lambda: model(x))
    o.update(lambda: model(x))
    ref = _Tied()
    o_ref = chainer.optimizers.MomentumSGD(lr=0.01).setup(ref)
    o_ref.update(lambda: ref(x))
    for name, opt in (('ours.npz', o), ('ref.npz', o_ref)):
        serializers.save_npz(str(tmp_path / name), opt)
    keys = [set(k for k in numpy.load(str(tmp_path / n)).files if k.count('/') == 2)
            for n in ('ours.npz', 'ref.npz')]
    assert keys[0] == keys[1] == {'a/W/t', 'a/W/v', 'a/b/t', 'a/b/v', 'b/W/t', 'b/W/v'}
    other = _Tied()
    o_other = chainer.optimizers.MomentumSGD(lr=0.01).setup(other)
    serializers.load_npz(str(tmp_path / 'ours.npz'), o_other)       # (a KeyError before)
    numpy.testing.assert_array_equal(other.b.W.update_rule.state['v'],
                                     model.a.W.update_rule.state['v'])
    # a file of an earlier chainer_tc (the tied parameter under one path) still loads
    with numpy.load(str(tmp_path / 'ours.npz')) as f:
        old = {k: f[k] for k in f.files if not k.startswith('b/W/')}
    numpy.savez(str(tmp_path / 'old.npz'), **old)
    again = _Tied()
    o_again = optimizers.MomentumSGD(lr=0.01).setup(again)
    tc_serializers.load_npz(str(tmp_path / 'old.npz'), o_again)
    numpy.testing.assert_array_equal(again.a.W.update_rule.state['v'],
                                     model.a.W.update_rule.state['v'])
    assert again.a.W.update_rule.t == 2


# ---- bad arguments are named ------------------------------------------------------------------

@pytest.mark.parametrize('call, error, message', [
    (lambda: optimizers.MomentumSGD(lr=None), TypeError, 'lr must be a number; got None'),
    (lambda: optimizers.MomentumSGD(momentum='0.9'), TypeError,
     "momentum must be a number; got '0.9'"),
    (lambda: optimizers.MomentumSGD(weight_decay=[1e-4]), TypeError,
     r'weight_decay must be a number; got \[0.0001\]'),
    (lambda: optimizers.MomentumSGD().loss_scaling(min_scale=None), TypeError,
     'min_scale must be a number; got None'),
    (lambda: optimizers.MomentumSGD().loss_scaling(max_scale='1e6'), TypeError,
     "max_scale must be a number; got '1e6'"),
    (lambda: optimizers.MomentumSGD().loss_scaling(initial_scale=None), TypeError,
     'initial_scale must be a number; got None'),
    (lambda: optimizers.MomentumSGD().loss_scaling(scale='8'), TypeError,
     "scale must be a number; got '8'"),
    (lambda: optimizers.MomentumSGD().loss_scaling(scale=float('nan')), ValueError,
     r'scale \(the loss scale\) must be a positive finite number; got nan'),
    (lambda: optimizers.MomentumSGD().loss_scaling(interval='x'), TypeError,
     "interval must be a number; got 'x'"),
    (lambda: optimizers.MomentumSGD().loss_scaling(interval=2.5), ValueError,
     'interval must be a whole number of steps >= 1; got 2.5'),
])
def test_bad_arguments_are_refused_naming_them(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_interval_as_a_whole_float_is_taken():
    o = optimizers.MomentumSGD()
    o.loss_scaling(interval=1e3)
    assert o._scaler.interval == 1000


@pytest.mark.parametrize('where', ['optimizer', 'rule'])
def test_a_hyperparameter_set_to_none_is_refused_at_the_update_naming_it(path, where):
    x, t = data()
    model = Net()
    o = optimizers.MomentumSGD().setup(model)
    if where == 'optimizer':
        o.lr = None
        message = "the optimizer's lr must be a number; got None"
    else:
        model.fc.W.update_rule.hyperparam.momentum = 'high'
        message = "parameter /fc/W: update_rule.hyperparam.momentum must be a number; got 'high'"
    with pytest.raises(TypeError, match=message):
        o.update(lossfun(model, x, t))


@pytest.mark.parametrize('where', ['optimizer', 'rule'])
def test_a_hyperparameter_object_lacking_weight_decay_is_refused_saying_so(path, where):
    """Replacing ``optimizer.hyperparam`` (or a rule's, without a parent chain to the
    optimizer's) with a Hyperparameter holding only Chainer's lr and momentum: the error says
    which hyperparameter is missing and what to do (it used to read "the optimizer has no
    hyperparameter 'NoneType' object has no attribute 'weight_decay'")."""
    x, t = data()
    model = Net()
    o = optimizers.MomentumSGD().setup(model)
    h = chainer.optimizer.Hyperparameter()
    h.lr, h.momentum = 0.1, 0.9
    if where == 'optimizer':
        o.hyperparam = h
        message = (r"^the optimizer's hyperparam has no 'weight_decay' \(not set on it nor on "
                   r'its parents\).*must set all three \(weight_decay = 0.0 for none\)$')
    else:
        model.fc.W.update_rule.hyperparam = h
        message = (r"^parameter /fc/W: its update_rule.hyperparam has no 'weight_decay': not "
                   r"set on it nor on its parents, and its parents do not lead to the "
                   r"optimizer's hyperparam")
    with pytest.raises(AttributeError, match=message):
        o.update(lossfun(model, x, t))


# ---- parameter groups, init_state, detached rules, untrained gradients (audit) ----------------

def test_a_parameter_group_between_rules_and_the_optimizer_is_followed_like_chainer(path):
    """A Hyperparameter between a rule and the optimizer's (``group = Hyperparameter(
    opt.hyperparam)``, ``rule.hyperparam = Hyperparameter(group)``): a later assignment on the
    group reaches the update (it used to be ignored: the kernel went on with the value of
    the table's last rebuild). Also a group above a group, ``del`` on it, and the optimizer's
    old hyperparam after ``optimizer.hyperparam`` was replaced (the rules still inherit it,
    as Chainer's)."""
    x, t = data()
    ref, o_ref, ours, o = chainer_pair(wd=0)
    groups = {}
    for m, opt in ((ref, o_ref), (ours, o)):
        outer = chainer.optimizer.Hyperparameter(opt.hyperparam)
        inner = chainer.optimizer.Hyperparameter(outer)
        for p in m.conv.params():
            p.update_rule.hyperparam = chainer.optimizer.Hyperparameter(inner)
        groups[id(m)] = outer, inner
        outer.lr = 0.01
    step_both(ref, o_ref, ours, o, x, t, 2)
    assert_same_params(ref, ours)
    changes = [lambda outer, inner, opt: setattr(outer, 'lr', 0.3),
               lambda outer, inner, opt: setattr(inner, 'momentum', 0.5),
               lambda outer, inner, opt: delattr(outer, 'lr'),
               lambda outer, inner, opt: setattr(opt, 'hyperparam',
                                                 chainer.optimizer.Hyperparameter()),
               lambda outer, inner, opt: setattr(outer._parent, 'lr', 0.2)]
    for change in changes:
        for m, opt in ((ref, o_ref), (ours, o)):
            outer, inner = groups[id(m)]
            change(outer, inner, opt)
        if change is changes[3]:                 # (ours needs all three on the new one)
            o.hyperparam.lr, o.hyperparam.momentum, o.hyperparam.weight_decay = 0.5, 0.9, 0.0
            o_ref.hyperparam.lr, o_ref.hyperparam.momentum = 0.5, 0.9
        step_both(ref, o_ref, ours, o, x, t, 2)
        assert_same_params(ref, ours)
    assert ours.conv.W.update_rule.hyperparam.lr == 0.2


def test_a_hyperparameter_object_given_to_a_second_rule_is_read_for_it(path):
    """One Hyperparameter object as the hyperparam of two rules, the second given it after an
    update (when it was already tracked): the second rule reads it too."""
    x, t = data()
    ref, o_ref, ours, o = chainer_pair(wd=0)
    shared = {}
    for m, opt in ((ref, o_ref), (ours, o)):
        h = shared[id(m)] = chainer.optimizer.Hyperparameter(opt.hyperparam)
        h.lr = 0.02
        m.conv.W.update_rule.hyperparam = h
    step_both(ref, o_ref, ours, o, x, t, 1)
    for m in (ref, ours):
        m.fc.W.update_rule.hyperparam = shared[id(m)]
    step_both(ref, o_ref, ours, o, x, t, 2)
    assert_same_params(ref, ours)


def test_a_group_whose_parent_is_another_optimizers_hyperparam_follows_it(path):
    """A chain through another optimizer's hyperparam: an assignment there (its own lr
    schedule) reaches this optimizer's table too."""
    x, t = data()
    results = {}
    for name, cls in (('chainer', chainer.optimizers.MomentumSGD),
                      ('ours', optimizers.MomentumSGD)):
        a, b = Net(), Net()
        oa, ob = cls(lr=0.1).setup(a), cls(lr=0.1).setup(b)
        for p in b.fc.params():
            p.update_rule.hyperparam = chainer.optimizer.Hyperparameter(oa.hyperparam)
        for step in range(4):
            if step == 2:
                oa.lr = 0.01
            oa.update(lossfun(a, x, t))
            ob.update(lossfun(b, x, t))
        results[name] = snapshot(b)
    for n in results['chainer']:
        numpy.testing.assert_array_equal(results['ours'][n], results['chainer'][n], err_msg=n)


def test_init_state_resets_the_momentum_like_chainer(path):
    """``update_rule.init_state(param)``: Chainer's MomentumSGDRule makes a new zero ``v``
    (users reset the momentum with it); ours zeroes the flat buffer's view (it used to do
    nothing). Also in a copy whose buffers are not built yet (its state is a plain dict)."""
    x, t = data()
    ref, o_ref, ours, o = chainer_pair()
    step_both(ref, o_ref, ours, o, x, t, 2)
    for m in (ref, ours):
        for p in m.params():
            p.update_rule.init_state(p)
    for e in o._flat.entries:
        assert e.param.update_rule.state['v'] is e.v and not e.v.any()
    step_both(ref, o_ref, ours, o, x, t, 2)
    assert_same_params(ref, ours)
    ours2, o2 = copy.deepcopy((ours, o))
    assert type(ours2.fc.W.update_rule.state) is dict          # adopted at the first update
    for m in (ref, ours2):
        m.fc.W.update_rule.init_state(m.fc.W)
    step_both(ref, o_ref, ours2, o2, x, t, 2)
    assert_same_params(ref, ours2)
    with pytest.raises(ValueError, match=r'init_state: the parameter given has shape \(5,\); '
                                         r"this rule's momentum has shape \(5, 64\)"):
        ours.fc.W.update_rule.init_state(ours.fc.b)


def test_init_state_keeps_the_float16_master():
    model = Net(numpy.float16)
    o = optimizers.MomentumSGD(lr=0.1).setup(model)
    x, t = data(numpy.float16)
    o.update(lossfun(model, x, t))
    master = model.fc.W.update_rule.state['master'].copy()
    model.fc.W.update_rule.init_state(model.fc.W)
    assert not model.fc.W.update_rule.state['v'].any()
    numpy.testing.assert_array_equal(model.fc.W.update_rule.state['master'], master)


def test_a_rule_detached_from_its_parameter_stops_counting_like_chainer(path):
    """``update_rule = None`` for a while, then the rule given back; a link deleted; a second
    setup() before any update: Chainer does not call those rules, so their ``t`` stops (ours
    went on counting). The parameters train as Chainer's, also under a hook that reads ``t``
    (GradientNoise: its noise shrinks with the rule's t)."""
    class Noise(chainer.optimizer_hooks.GradientNoise):
        def __call__(self, rule, param):
            if rule is not None:
                super().__call__(rule, param)
    x, t = data()
    ref, o_ref, ours, o = chainer_pair(wd=0, net=WithExtra)
    for opt in (o_ref, o):
        opt.add_hook(Noise(0.3))
    ts = {}
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for step in range(6):
            for m in (ref, ours):
                if step == 1:
                    ts[id(m)] = m.extra.W.update_rule
                    m.extra.W.update_rule = None
                if step == 4:
                    m.extra.W.update_rule = ts[id(m)]
            for m, opt in ((ref, o_ref), (ours, o)):
                numpy.random.seed(step)
                opt.update(lossfun(m, x, t))
            if step == 2:
                assert ts[id(ours)].t == ts[id(ref)].t == 1
    assert ours.extra.W.update_rule.t == ref.extra.W.update_rule.t == 3
    assert ours.extra.b.update_rule.t == ref.extra.b.update_rule.t == 6
    assert_same_params(ref, ours)
    for m in (ref, ours):
        ts[id(m)] = m.extra.W.update_rule
        del m.extra
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        step_both(ref, o_ref, ours, o, x, t, 2)
    assert ts[id(ours)].t == ts[id(ref)].t == 3
    for cls in (chainer.optimizers.MomentumSGD, optimizers.MomentumSGD):
        first, second = Net(), Net()
        opt = cls(lr=0.1).setup(first)
        opt.setup(second)                             # before any update
        opt.update(lossfun(second, x, t))
        assert (first.fc.W.update_rule.t, second.fc.W.update_rule.t) == (0, 1), cls


@pytest.mark.parametrize('hooks', [False, True])
@pytest.mark.parametrize('frozen_by', ['update_rule = None', 'disable_update'])
def test_an_overflow_in_an_untrained_parameters_gradient_skips_the_step_like_chainer(
        path, hooks, frozen_by):
    """Chainer's check_nan_in_grads() reads the gradient of every parameter of the target,
    also one without an update rule: an inf there skips the step under dynamic loss scaling
    (ours used to check only the parameters it trains). A finite one does not."""
    x, t = data()
    ref, o_ref, ours, o = chainer_pair(wd=0)
    # Chainer's dynamic scale starts at 1 and stays there after a skip; ours halves from 2 to 1
    # (the clipping hook sees the scaled gradients: the finite step needs the same scale)
    o_ref.loss_scaling()
    o.loss_scaling(initial_scale=2.0)
    for m, opt in ((ref, o_ref), (ours, o)):
        if hooks:
            opt.add_hook(chainer.optimizer_hooks.GradientHardClipping(-1e-3, 1e-3))
        if frozen_by == 'disable_update':
            m.conv.disable_update()
        else:
            for p in m.conv.params():
                p.update_rule = None
    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for m, opt in ((ref, o_ref), (ours, o)):
            before = snapshot(m)
            for inf in (True, False):
                m.cleargrads()
                lossfun(m, x, t)().backward(loss_scale=opt._loss_scale)
                if inf:
                    m.conv.W.grad[0, 0, 0, 0] = numpy.inf
                opt.update()
                if inf:
                    skipped = all(numpy.array_equal(p.array, before[n])
                                  for n, p in m.namedparams())
            results[id(opt)] = (skipped, opt.t, m.fc.W.update_rule.t)
    assert results[id(o)] == results[id(o_ref)] == (True, 2, 1)
    assert o.skipped_steps == 1
    assert_same_params(ref, ours)


# ---- loss scaling in snapshots: the code's configuration stays, as with Chainer -----------------

@pytest.mark.parametrize('saved, code, resumed', [
    # (the snapshot's run, this run's loss_scaling() kwargs or None, whether the state resumes)
    (None, {}, False),
    ({}, None, False),
    (dict(scale=8.0), dict(scale=16.0), False),
    (dict(initial_scale=2.0 ** 10), dict(max_scale=2.0 ** 8, initial_scale=4.0), False),
    (dict(initial_scale=2.0 ** 10, interval=2), dict(interval=5, initial_scale=4.0), True),
    (dict(scale=8.0), dict(scale=8.0), True),
])
def test_a_snapshot_keeps_the_loss_scaling_made_in_code_like_chainer(tmp_path, saved, code,
                                                                     resumed):
    """Chainer's optimizers save no loss scaling: a load keeps the configuration made in
    code. Ours does too (a snapshot used to replace it: loss scaling enabled in code was
    switched off by a file saved without it); the file's state (scale, clean and skipped
    steps) goes on where it fits the code's configuration, else a warning says why not."""
    x, t = data()
    model = Net()
    opt = optimizers.MomentumSGD(lr=0.1).setup(model)
    if saved is not None:
        opt.loss_scaling(**saved)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        opt.update(lossfun(model, x * numpy.float32(numpy.inf), t))    # one skipped step
        for _ in range(3):
            opt.update(lossfun(model, x, t))
    serializers.save_npz(str(tmp_path / 'opt.npz'), opt)
    chainer_opt = chainer.optimizers.MomentumSGD(lr=0.1).setup(Net())
    again = optimizers.MomentumSGD(lr=0.1).setup(Net())
    for o in (chainer_opt, again):
        if code is not None:
            o.loss_scaling(**{k: v for k, v in code.items()
                              if o is again or k in ('scale',)})
    config = (again._scaler.mode, again._scaler.interval, again._scaler.min_scale,
              again._scaler.max_scale)
    own = (again.loss_scale, again.skipped_steps)
    serializers.load_npz(str(tmp_path / 'opt.npz'), chainer_opt)
    if resumed:
        with warnings.catch_warnings():
            warnings.simplefilter('error')
            tc_serializers.load_npz(str(tmp_path / 'opt.npz'), again)
        assert (again.loss_scale, again.skipped_steps) == (opt.loss_scale, opt.skipped_steps)
    else:
        with pytest.warns(UserWarning, match="the snapshot's loss scaling is not resumed: "
                                             r'.*keeps the loss-scaling configuration made in '
                                             'code'):
            tc_serializers.load_npz(str(tmp_path / 'opt.npz'), again)
        assert (again.loss_scale, again.skipped_steps) == own
    assert (again._scaler.mode, again._scaler.interval, again._scaler.min_scale,
            again._scaler.max_scale) == config
    assert again._loss_scaling_is_dynamic == chainer_opt._loss_scaling_is_dynamic
    assert (again._loss_scale is None) == (chainer_opt._loss_scale is None)
    assert again.t == chainer_opt.t == 4


# ---- references to parameter arrays (docs/optimizer.md, "An array taken from a parameter") ----

@pytest.mark.parametrize('lazy', [False, True])
def test_an_array_taken_before_the_buffers_stops_following_and_a_shared_copy_follows(lazy):
    """What the docs tell users: an array referenced before the buffers are built (before
    ``setup()``; for a lazy model also after it, before its first update), and a model given
    the same arrays (``q.array = p.array``), keep the old values; one taken after they are
    built follows; ``Link.copy(mode='share')``, made before ``setup()``, follows training."""
    x, t = data()
    model = Net()
    if lazy:
        del model.fc
        with model.init_scope():
            model.fc = L.Linear(None, 5)
    shared = model.copy(mode='share')
    aliased = Net()
    for p, q in zip(model.conv.params(), aliased.conv.params()):
        q.array = p.array
    before_setup = model.conv.W.array
    opt = optimizers.MomentumSGD(lr=0.1).setup(model)
    after_setup = model.conv.W.array
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for _ in range(2):
            opt.update(lossfun(model, x, t))
    live = model.conv.W.array
    assert not numpy.array_equal(before_setup, live)
    assert not numpy.array_equal(aliased.conv.W.array, live)
    assert (after_setup is live) == (not lazy)
    for (n, p), (_, q) in zip(model.namedparams(), shared.namedparams()):
        assert q.array is p.array, n
