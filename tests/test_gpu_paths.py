"""GPU paths that had no test (issue 13): each one against the NumPy/CPU path of the same function
(or Chainer's own), with the path actually taken checked where the code makes it observable
(kernel launches, cuDNN calls, ``cudnn_reason``, the launch grid).

Every test but the emulated layout one is marked ``gpu`` and skipped without a GPU. Tests that
need cuDNN (CuPy 13 with cuDNN 8.9) or DALI skip, with the reason, where the stack lacks them.

Tolerances, unless a test says otherwise:
- float64: reductions in another order over at most a few hundred terms: 1e-10 relative.
- float32 BatchNorm (our kernels against NumPy): elementwise math within an ulp or two, column sums
  of ~200 terms of size ~10 in another order: 1e-5 relative, 1e-4 absolute.
- float16 outputs are rounded to 11 bits of values up to ~8 (4e-3), after float32 arithmetic that
  may differ by an ulp before the rounding: 1e-2 relative, 2e-2 absolute (3e-2 / 2e-2 where a
  gradient sums float16-rounded terms).
- float32 convolutions on cuDNN 8 on an A100/H100: CUDNN_DEFAULT_MATH lets cuDNN use TF32 tensor
  cores (10-bit mantissa inputs, float32 accumulation), up to ~2^-10 of the sum of |products|
  (5e-3 of the output's scale). tests/conftest.py turns TF32 off (NVIDIA_TF32_OVERRIDE=0) for the
  whole run, so the 5e-3 tolerances below that cite it are generous there; they are kept so
  that the tests also hold where a user runs them with TF32 on.
"""
import collections
import copy
import importlib
import os
import subprocess
import sys

import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer: CUDA libraries)
import chainer
import chainer.functions as F
import chainer.links as L
from chainer import serializers

from chainer_tc import dali
from chainer_tc import functions as TF
from chainer_tc import kernels
from chainer_tc import layout
from chainer_tc import links as TL
from chainer_tc import optimizers
from chainer_tc import serializers as tc_serializers
from chainer_tc.functions import _bn_cudnn
from chainer_tc.models import ResNet50
from chainer_tc.optimizers import _flat

import dali_data
import nets
from conftest import _cudnn_problem
from conftest import _dali_problem

host = chainer.backends.cuda.to_cpu
TESTS = os.path.dirname(os.path.abspath(__file__))
_BN_MODULE = importlib.import_module('chainer_tc.functions.batch_normalization')


def nchw(a):
    return numpy.ascontiguousarray(a.transpose(0, 3, 1, 2))


def nhwc(a):
    return numpy.ascontiguousarray(a.transpose(0, 2, 3, 1))


# What the stack must have: the cudnn_stack and dali_stack fixtures, and _cudnn_problem() and
# _dali_problem() that give their reasons, are in tests/conftest.py.


def record_calls(monkeypatch, names):
    """The names of the calls made through our cuDNN binding among ``names``, in order."""
    from chainer_tc.cuda import cudnn
    calls = []
    lib = cudnn.binding()
    for name in names:
        real = getattr(lib, name)
        monkeypatch.setattr(lib, name, lambda *a, _real=real, _n=name: (calls.append(_n),
                                                                         _real(*a))[1])
    return calls


# ==== BatchNormalization ===========================================================================

PAIRS = [(numpy.float64, numpy.float64), (numpy.float32, numpy.float32),
         (numpy.float16, numpy.float32), (numpy.float16, numpy.float16)]
CTYPE = {numpy.float16: '__half', numpy.float32: 'float', numpy.float64: 'double'}


def bn_data(shape, dtype, pdtype, seed=0):
    r = numpy.random.RandomState(seed)
    C = shape[-1]
    x = (r.randn(*shape) * 2 + r.randn(C) * 3).astype(dtype)       # per-channel offsets
    gamma = (r.rand(C) + 0.5).astype(pdtype)
    beta = r.randn(C).astype(pdtype)
    z = r.randn(*shape).astype(dtype)
    gy = r.randn(*shape).astype(dtype)
    return x, gamma, beta, z, gy


def bn_tol(dtype):
    return {numpy.float64: dict(rtol=1e-10, atol=1e-10),
            numpy.float32: dict(rtol=1e-5, atol=1e-4),
            numpy.float16: dict(rtol=2e-2, atol=3e-2)}[numpy.dtype(dtype).type]


def assert_close(got, want, tol, what):
    for name, g, w in zip(what, got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        numpy.testing.assert_allclose(g.astype(numpy.float64), w.astype(numpy.float64),
                                      err_msg=name, **tol)


def launched(per_kernel):
    """{kernel name without its template arguments: launches}, and the set of first template
    arguments (the data type the kernels were instantiated for)."""
    names, types = collections.Counter(), set()
    for k, n in per_kernel.items():
        base, _, args = k.partition('<')
        names[base] += n
        types.add(args.split(',')[0].rstrip('>').strip())
    return dict(names), types


def _no_cudnn(*args, **kwargs):
    raise AssertionError('cuDNN\'s fused batch normalization must not be used here')


def bn_run(f, inputs, gy, xp):
    """f(*Variables) forward and backward on ``xp``; the output node, [y, grads...] on the host,
    and the chainer_tc kernel launches of forward and of backward."""
    vs = [chainer.Variable(xp.asarray(a)) for a in inputs]
    with kernels.count_launches() as fwd:
        y = f(*vs)
    y.grad = xp.asarray(gy)
    with kernels.count_launches() as bwd:
        y.backward()
    return y.creator, [host(y.array)] + [host(v.grad) for v in vs], fwd.per_kernel, bwd.per_kernel


@pytest.mark.gpu
@pytest.mark.parametrize('dtype,pdtype', PAIRS)
@pytest.mark.parametrize('op', ['bn', 'relu', 'add_relu'])
def test_inference_bn_on_cupy_equals_numpy_path_in_one_launch(monkeypatch, dtype, pdtype, op):
    """fixed_batch_normalization(_add_relu): one bn_apply launch forward, three backward; never
    cuDNN, even for (float16, float32) with C % 4 == 0, which cuDNN would take in training."""
    import cupy
    monkeypatch.delenv(kernels.ENV_EMULATE, raising=False)
    monkeypatch.setattr(_bn_cudnn, 'FusedBatchNorm', _no_cudnn)
    x, gamma, beta, z, gy = bn_data((4, 7, 7, 64), dtype, pdtype)
    mean = numpy.linspace(-2, 2, 64).astype(pdtype)
    var = numpy.linspace(0.5, 3, 64).astype(pdtype)
    inputs = (x, gamma, beta) + ((z,) if op == 'add_relu' else ())
    runs = []
    for xp in (numpy, cupy):
        m, v = xp.asarray(mean), xp.asarray(var)

        def f(x, gamma, beta, *zz):
            if op == 'bn':
                return TF.fixed_batch_normalization(x, gamma, beta, m, v, eps=1e-4)
            return TF.fixed_batch_normalization_add_relu(x, zz[0] if zz else None, gamma, beta,
                                                         m, v, eps=1e-4)
        runs.append(bn_run(f, inputs, gy, xp))
    (_, want, f0, b0), (node, got, f1, b1) = runs
    assert (f0, b0) == ({}, {}), 'NumPy arrays take the NumPy path'
    assert launched(f1) == ({'bn_apply': 1}, {CTYPE[dtype]})
    assert launched(b1)[0] == {'bn_backward_partial': 1, 'bn_backward_finalize': 1,
                               'bn_backward_apply': 1}
    assert node.cudnn_reason.startswith('inference')
    assert_close(got, want, bn_tol(dtype), ['y', 'gx', 'ggamma', 'gbeta', 'gz'])


@pytest.mark.gpu
@pytest.mark.parametrize('why', ['use_cudnn_never', 'channels_not_multiple_of_4'])
@pytest.mark.parametrize('with_z', [True, False])
def test_training_kernels_for_float16_data_float32_gamma(monkeypatch, why, with_z):
    """(float16 x, float32 gamma) through kernels/batchnorm.cu, not cuDNN: the pair cuDNN takes
    when it can, so it is forced off two ways (config, and a channel count cuDNN refuses)."""
    import cupy
    if why == 'channels_not_multiple_of_4' and _cudnn_problem():
        pytest.skip(_cudnn_problem())       # the reason would be cuDNN's absence, not C
    monkeypatch.delenv(kernels.ENV_EMULATE, raising=False)
    monkeypatch.setattr(_bn_cudnn, 'FusedBatchNorm', _no_cudnn)
    C = 64 if why == 'use_cudnn_never' else 66
    x, gamma, beta, z, gy = bn_data((4, 7, 7, C), numpy.float16, numpy.float32)
    inputs = (x, gamma, beta) + ((z,) if with_z else ())
    runs, stats = [], []
    for xp in (numpy, cupy):
        rm, rv = xp.zeros(C, numpy.float32), xp.ones(C, numpy.float32)

        def f(x, gamma, beta, *zz):
            return TF.batch_normalization_add_relu(x, zz[0] if zz else None, gamma, beta,
                                                   eps=1e-4, running_mean=rm, running_var=rv,
                                                   decay=0.8)
        with chainer.using_config('use_cudnn', 'never' if why == 'use_cudnn_never' else 'auto'):
            runs.append(bn_run(f, inputs, gy, xp))
        stats.append([host(rm), host(rv)])
    (_, want, _, _), (node, got, fwd, bwd) = runs
    assert launched(fwd)[0] == {'bn_stats_partial': 1, 'bn_stats_finalize': 1, 'bn_apply': 1}
    assert launched(bwd)[0] == {'bn_backward_partial': 1, 'bn_backward_finalize': 1,
                                'bn_backward_apply': 1}
    for kind in (fwd, bwd):        # the data kernels for __half x (the finalizers take float32)
        assert all(k.split('<')[1].startswith('__half') for k in kind if 'finalize' not in k)
    expected = "use_cudnn is 'never'" if why == 'use_cudnn_never' else 'divisible by 4'
    assert expected in node.cudnn_reason
    assert_close(got, want, bn_tol(numpy.float16), ['y', 'gx', 'ggamma', 'gbeta', 'gz'])
    # float32 statistics of the same float16 data: shifted sums per thread and Chan merges (kernel)
    # against two-pass (NumPy)
    assert_close(stats[1], stats[0], dict(rtol=1e-5, atol=1e-6), ['running_mean', 'running_var'])


CUDNN_OPS = {'bn': 'CUDNN_BATCHNORM_OPS_BN', 'relu': 'CUDNN_BATCHNORM_OPS_BN_ACTIVATION',
             'add_relu': 'CUDNN_BATCHNORM_OPS_BN_ADD_ACTIVATION'}


@pytest.mark.gpu
@pytest.mark.parametrize('op,running', [('bn', True), ('bn', False), ('relu', False),
                                        ('add_relu', False)])
def test_cudnn_bn_variants_equal_numpy_path(cudnn_stack, monkeypatch, op, running):
    """cuDNN's ForwardTrainingEx/BackwardEx with the plain BN op (ResNet's shortcut BN, no
    activation) and with running_mean=None (no statistics to update) for every op."""
    import cupy
    from chainer_tc.cuda import _cudnn_api as lib
    monkeypatch.delenv(kernels.ENV_EMULATE, raising=False)
    calls = record_calls(monkeypatch, ['batch_normalization_forward_training_ex',
                                       'batch_normalization_backward_ex'])
    x, gamma, beta, z, gy = bn_data((4, 7, 7, 64), numpy.float16, numpy.float32)
    inputs = (x, gamma, beta) + ((z,) if op == 'add_relu' else ())
    runs, stats = [], []
    for xp in (numpy, cupy):
        rs = dict(running_mean=xp.zeros(64, numpy.float32), running_var=xp.ones(64, numpy.float32)
                  ) if running else {}

        def f(x, gamma, beta, *zz):
            if op == 'bn':
                return TF.batch_normalization(x, gamma, beta, eps=1e-4, decay=0.8, **rs)
            return TF.batch_normalization_add_relu(x, zz[0] if zz else None, gamma, beta,
                                                   eps=1e-4, decay=0.8, **rs)
        runs.append(bn_run(f, inputs, gy, xp))
        stats.append([host(a) for a in rs.values()])
    (_, want, _, _), (node, got, fwd, bwd) = runs
    assert node.cudnn_reason is None
    assert calls == ['batch_normalization_forward_training_ex', 'batch_normalization_backward_ex']
    assert node._fused.plan.ops == getattr(lib, CUDNN_OPS[op])
    assert fwd == {} and bwd == {}, 'no kernel of ours on the cuDNN path'
    assert_close(got, want, bn_tol(numpy.float16), ['y', 'gx', 'ggamma', 'gbeta', 'gz'])
    # cuDNN's own float32 reduction over the 196 rows: 1e-4 relative
    assert_close(stats[1], stats[0], dict(rtol=1e-4, atol=1e-5), ['running_mean', 'running_var'])


@pytest.mark.gpu
@pytest.mark.parametrize('with_z', [False, True])
def test_single_row_on_cupy_updates_running_variance_like_numpy(with_z):
    """One row per channel, with dtypes cuDNN's fused path takes: cuDNN's unbiased variance would
    divide by rows - 1 = 0; the result must be the kernel/NumPy one (max(rows - 1, 1)), with the
    single-sample warning on the CuPy call too."""
    import cupy
    C = 8
    x, gamma, beta, z, _ = bn_data((1, 1, 1, C), numpy.float16, numpy.float32)
    outs = []
    for xp in (numpy, cupy):
        rm, rv = xp.zeros(C, numpy.float32), xp.ones(C, numpy.float32)
        _BN_MODULE._WARNED_SINGLE_SAMPLE.clear()
        with pytest.warns(UserWarning, match='single sample'):
            y = TF.batch_normalization_add_relu(
                xp.asarray(x), xp.asarray(z) if with_z else None, xp.asarray(gamma),
                xp.asarray(beta), running_mean=rm, running_var=rv, decay=0.9)
        outs.append([host(y.array), host(rm), host(rv)])
    (y0, rm0, rv0), (y1, rm1, rv1) = outs
    assert numpy.isfinite(rv1).all()
    numpy.testing.assert_allclose(rv1, rv0, rtol=1e-6)             # 0.9 * 1 + 0.1 * 0
    numpy.testing.assert_allclose(rm1, rm0, rtol=1e-6)             # 0.1 * x
    numpy.testing.assert_allclose(y1.astype('f8'), y0.astype('f8'), **bn_tol(numpy.float16))


@pytest.mark.gpu
def test_no_rows_on_cupy_is_refused_before_any_path():
    import cupy
    x = cupy.zeros((0, 2, 2, 8), numpy.float16)
    g, b = cupy.ones(8, numpy.float32), cupy.zeros(8, numpy.float32)
    with pytest.raises(ValueError, match='at least one row'):
        TF.batch_normalization(x, g, b)


# ==== the optimizer ================================================================================

def give_grads(model, seed, scale=1.0, inject=None):
    """Gradients drawn on the host (the same on every device), times ``scale``; ``inject`` =
    (parameter name, flat index, value) overwrites one element."""
    r = numpy.random.RandomState(seed)
    for name, p in sorted(model.namedparams()):
        g = r.randn(*p.shape).astype(p.dtype) * p.dtype.type(scale)
        if inject is not None and inject[0] == name:
            g.flat[inject[1]] = inject[2]
        p.grad = p.device.send(g)


def opt_state(opt):
    f = opt._flat
    return {'params': [host(a) for a in f.params], 'master': host(f.master),
            'momentum': [host(a) for a in f.momentum], 'scaler': host(opt._scaler.state)}


def assert_same_state(a, b):
    """Bit for bit (docs/optimizer.md: the _rn intrinsics forbid fma contraction; -ftz only
    matters below 1.2e-38, which none of these values reach)."""
    for k in a:
        pairs = zip(a[k], b[k]) if isinstance(a[k], list) else [(a[k], b[k])]
        for x, y in pairs:
            numpy.testing.assert_array_equal(x.view(numpy.uint8), y.view(numpy.uint8), err_msg=k)


AWKWARD = [1, 31, 33, 127, 128, 129, 2047, 2048, 2049, 4097]
OPT_CASES = {
    # name: (sizes, optimizer kwargs, loss_scaling kwargs or None, gradient scale, injections)
    'static_scaling': (AWKWARD, dict(weight_decay=1e-3), dict(scale=1024.0), 1024.0, {}),
    'nesterov_decay_filter': (AWKWARD, dict(weight_decay=1e-2, nesterov=True,
                                            decay_filter=lambda n, p: p.size % 2 == 1),
                              None, 1.0, {}),
    'overflow_skip': (AWKWARD, dict(weight_decay=1e-3), dict(interval=2, initial_scale=8.0), 1.0,
                      {2: ('/p8', 2048, numpy.inf), 4: ('/p0', 0, numpy.nan)}),
    'more_than_480': ([3] * (_flat.GRAD_TABLE + 20), dict(weight_decay=1e-3),
                      dict(interval=2, initial_scale=4.0), 1.0, {3: ('/p490', 1, -numpy.inf)}),
}


@pytest.mark.gpu
@pytest.mark.parametrize('case', sorted(OPT_CASES))
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float16])
def test_optimizer_on_gpu_equals_numpy_path(monkeypatch, case, dtype):
    monkeypatch.delenv(kernels.ENV_EMULATE, raising=False)
    sizes, kwargs, scaling, grad_scale, inject = OPT_CASES[case]
    results = []
    for device in ('@numpy', '@cupy:0'):
        model = nets.SizesNet(sizes, dtype)
        model.to_device(device)
        opt = optimizers.MomentumSGD(lr=0.01, momentum=0.9, **kwargs).setup(model)
        if scaling is not None:
            opt.loss_scaling(**scaling)
        launches, scales, skipped_state = [], [], None
        for s in range(6):
            give_grads(model, 100 + s, grad_scale, inject.get(s))
            before = opt_state(opt) if s in inject and opt._flat is not None else None
            with kernels.count_launches() as c:
                opt.update()
            launches.append(c.per_kernel)
            if before is not None and device != '@numpy':
                skipped_state = (before, opt_state(opt))
            if scaling is not None:
                scales.append(opt.loss_scale)
        results.append((opt_state(opt), scales, opt.t,
                        opt.skipped_steps if scaling is not None else 0))
        if device == '@numpy':
            continue
        # the GPU path: its kernels, as many launches as the gradient table needs
        tables = -(-len(sizes) // _flat.GRAD_TABLE)
        expect = {'momentum_sgd_update': tables}
        if scaling is not None and 'interval' in scaling:
            expect['momentum_sgd_check'] = tables
        assert launches[-1] == expect
        if skipped_state is not None:
            assert_same_state({k: v for k, v in skipped_state[0].items() if k != 'scaler'},
                              {k: v for k, v in skipped_state[1].items() if k != 'scaler'})
    (cpu, cpu_scales, cpu_t, cpu_skipped), (gpu, gpu_scales, gpu_t, gpu_skipped) = results
    assert_same_state(gpu, cpu)
    assert gpu_scales == cpu_scales and gpu_t == cpu_t == 6
    assert gpu_skipped == cpu_skipped == sum(1 for s in inject if s < 6)
    if case == 'nesterov_decay_filter':         # the filter reached the GPU model's rules
        for name, p in model.namedparams():
            assert p.update_rule.hyperparam.weight_decay == (1e-2 if p.size % 2 else 0.0), name


@pytest.mark.gpu
def test_overflow_on_gpu_skips_the_step_exactly_and_halves_the_scale():
    """Against a control run that never saw the poisoned step: equal, bit for bit, except the
    scale, which halved. Each run's gradients carry its own scale (256, then 128 after the
    overflow for the first run), so the unscaled gradients are the same."""
    def make():
        model = nets.SizesNet([40, 2100, 5000], numpy.float16)
        model.to_device('@cupy:0')
        opt = optimizers.MomentumSGD(lr=0.01, momentum=0.9, weight_decay=1e-4).setup(model)
        opt.loss_scaling(interval=1000, initial_scale=256.0)
        return model, opt

    (model, opt), (control, copt) = make(), make()
    for s in range(6):
        give_grads(model, s, 256.0 if s <= 3 else 128.0, ('/p1', 7, numpy.inf) if s == 3 else None)
        opt.update()
        if s != 3:
            give_grads(control, s, 256.0)
            copt.update()
    a, b = opt_state(opt), opt_state(copt)
    assert_same_state({k: v for k, v in a.items() if k != 'scaler'},
                      {k: v for k, v in b.items() if k != 'scaler'})
    assert opt.loss_scale == 128.0 and copt.loss_scale == 256.0
    assert opt.skipped_steps == 1 and copt.skipped_steps == 0
    assert opt.t == 6 and copt.t == 5


def small_batch(dtype, n=8, seed=0):
    r = numpy.random.RandomState(seed)
    return r.randn(n, 3, 6, 6).astype(dtype), r.randint(0, 5, n).astype(numpy.int32)


@pytest.mark.gpu
def test_scaled_backward_on_gpu_seeds_the_device_scale_and_unscales(cudnn_stack):
    """scaled_backward(loss) then update() equals update(lossfun); its gradients are the scale
    times those of a plain backward (float32, a power-of-two scale: exact up to the TF32 and
    reduction-order noise of cuDNN, 1e-5 relative)."""
    import cupy
    x, t = (cupy.asarray(a) for a in small_batch(numpy.float32))
    with chainer.using_config('cudnn_deterministic', True):
        a, b, plain = nets.ConvBNLinear(), nets.ConvBNLinear(), nets.ConvBNLinear()
        for m in (a, b, plain):
            m.to_device('@cupy:0')
        oa = optimizers.MomentumSGD(lr=0.05).setup(a)
        ob = optimizers.MomentumSGD(lr=0.05).setup(b)
        for o in (oa, ob):
            o.loss_scaling(interval=1000, initial_scale=128.0)
        plain.cleargrads()
        F.softmax_cross_entropy(plain(x), t).backward()
        for step in range(3):
            oa.update(lambda: F.softmax_cross_entropy(a(x), t))
            b.cleargrads()
            ob.scaled_backward(F.softmax_cross_entropy(b(x), t))
            if step == 0:
                for (n, p), (_, q) in zip(sorted(b.namedparams()), sorted(plain.namedparams())):
                    scale = float(abs(q.grad).max()) + 1e-30
                    numpy.testing.assert_allclose(host(p.grad) / 128.0, host(q.grad),
                                                  rtol=1e-5, atol=1e-6 * scale, err_msg=n)
            ob.update()
    for (n, p), (_, q) in zip(sorted(a.namedparams()), sorted(b.namedparams())):
        numpy.testing.assert_allclose(host(q.array), host(p.array), rtol=1e-6, atol=1e-7,
                                      err_msg=n)
    assert ob.loss_scale == oa.loss_scale == 128.0 and ob.t == 3


@pytest.mark.gpu
@pytest.mark.parametrize('resume_on', ['@cupy:0', '@numpy'])
def test_optimizer_snapshot_from_gpu_resumes_bit_identically(tmp_path, monkeypatch, resume_on):
    """Saved on the GPU mid-run (after a skipped step), resumed on the GPU or on the CPU (the
    NumPy path is the GPU's bit for bit): the same state as the uninterrupted GPU run."""
    monkeypatch.delenv(kernels.ENV_EMULATE, raising=False)

    def make(device):
        model = nets.SizesNet([33, 2049, 7], numpy.float16)
        model.to_device(device)
        opt = optimizers.MomentumSGD(lr=0.01, weight_decay=1e-3).setup(model)
        opt.loss_scaling(interval=2, initial_scale=4.0)
        return model, opt

    model, opt = make('@cupy:0')
    for s in range(4):
        give_grads(model, 100 + s, inject=('/p1', 0, numpy.inf) if s == 3 else None)
        opt.update()
    serializers.save_npz(str(tmp_path / 'opt.npz'), opt)
    serializers.save_npz(str(tmp_path / 'model.npz'), model)
    saved = (opt.t, opt.loss_scale, opt.skipped_steps)
    assert saved[2] == 1
    for s in range(4, 9):
        give_grads(model, 100 + s)
        opt.update()
    straight = opt_state(opt)

    model2, opt2 = make(resume_on)
    opt2.loss_scaling(interval=2, initial_scale=64.0)  # its scale and counts: the snapshot's
    tc_serializers.load_npz(str(tmp_path / 'opt.npz'), opt2)
    tc_serializers.load_npz(str(tmp_path / 'model.npz'), model2)
    assert (opt2.t, opt2.loss_scale, opt2.skipped_steps) == saved
    for s in range(4, 9):
        give_grads(model2, 100 + s)
        opt2.update()
    assert_same_state(opt_state(opt2), straight)
    assert opt2.t == opt.t == 9


# ==== ResNet-50 NHWC end to end ====================================================================

def tiny_resnet(dtype, zero_init_residual=False, seed=0):
    numpy.random.seed(seed)
    with chainer.using_config('dtype', dtype):
        return ResNet50('NHWC', n_classes=10, width=16, zero_init_residual=zero_init_residual)


def resnet_batch(n=8, seed=0):
    r = numpy.random.RandomState(seed)
    return (r.randn(n, 32, 32, 3).astype(numpy.float32),
            r.randint(0, 10, n).astype(numpy.int32))


def resnet_float32_step(out):
    """One training step (forward, loss, backward) of the float32 NHWC ResNet-50 on the CPU and
    on the GPU from the same weights, saved to ``out``. Run in a subprocess started with
    NVIDIA_TF32_OVERRIDE=0 (see the test)."""
    import cupy
    cpu = tiny_resnet(numpy.float32)
    gpu = copy.deepcopy(cpu)
    gpu.to_device('@cupy:0')
    x, t = resnet_batch()
    saved = {}
    for tag, model, xp in (('cpu', cpu, numpy), ('gpu', gpu, cupy)):
        chainer_tc.cuda.reset_counters()
        with kernels.count_launches() as c:
            y = model(xp.asarray(x))
            loss = F.softmax_cross_entropy(y, xp.asarray(t))
            model.cleargrads()
            loss.backward()
        saved[tag + ':y'], saved[tag + ':loss'] = host(y.array), host(loss.array)
        for name, p in model.namedparams():
            assert isinstance(p.grad, xp.ndarray), name
            saved[tag + ':grad:' + name] = host(p.grad)
        for name, link in model.namedlinks():
            if isinstance(link, TL.BatchNormalization):
                saved[tag + ':avg_mean:' + name] = host(link.avg_mean)
        saved[tag + ':cudnn_calls'] = numpy.array(chainer_tc.cuda.counters()['cudnn_calls'])
        saved[tag + ':bn_launches'] = numpy.array(sum(n for k, n in c.per_kernel.items()
                                                      if k.startswith('bn_')))
        saved[tag + ':pool_launches'] = numpy.array(sum(n for k, n in c.per_kernel.items()
                                                        if 'pool' in k))
    numpy.savez(out, **saved)


@pytest.mark.gpu
def test_resnet50_nhwc_float32_on_gpu_equals_cpu(cudnn_stack, tmp_path):
    """Logits, loss, every gradient and the running means after one training step.

    Batch statistics over few rows amplify small differences: on the CPU, float32 convolutions
    summed in float64 instead change this model's gradients by up to 3e-4 of their norm (BN
    gamma/beta of early blocks), and cuDNN's TF32 tensor-core math (the default for float32 on an
    A100/H100, 10-bit mantissa inputs) changes them by more than their size. So the step runs in
    a process started with NVIDIA_TF32_OVERRIDE=0 (true float32 in cuDNN and cuBLAS; conftest
    sets it for the suite too, this holds even when a user exported another value) and the
    tolerances leave 10-50x room over float32's reordering: logits 2e-3 of their scale, loss
    1e-3, each gradient 1e-2 of its norm. A wrong layout, filter orientation or BN axis moves
    them by their whole size."""
    out = tmp_path / 'step.npz'
    code = ('import sys; sys.path.insert(0, {!r}); import test_gpu_paths; '
            'test_gpu_paths.resnet_float32_step({!r})'.format(TESTS, str(out)))
    env = dict(os.environ, NVIDIA_TF32_OVERRIDE='0')
    env.pop(kernels.ENV_EMULATE, None)
    run = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    with numpy.load(str(out)) as f:
        r = dict(f)
    # the GPU model ran its convolutions on cuDNN (fwd, bwd filter, bwd data but conv1's: 53 + 53
    # + 52 at least) and its BN and pooling on our kernels (3 + 3 launches per BN); the CPU none
    assert r['gpu:cudnn_calls'] >= 53 + 53 + 52 and r['cpu:cudnn_calls'] == 0
    assert r['gpu:bn_launches'] == 6 * 53 and r['gpu:pool_launches'] >= 2
    assert r['cpu:bn_launches'] == r['cpu:pool_launches'] == 0
    y0, y1 = r['cpu:y'], r['gpu:y']
    scale = numpy.abs(y0).max()
    numpy.testing.assert_allclose(y1, y0, rtol=2e-3, atol=2e-3 * scale)
    assert float(r['gpu:loss']) == pytest.approx(float(r['cpu:loss']), rel=1e-3)
    grads = [k[3:] for k in r if k.startswith('cpu:grad:')]          # ':grad:<name>'
    assert len(grads) == 161
    for k in grads:
        g0, g1 = r['cpu' + k], r['gpu' + k]
        err = numpy.linalg.norm(g1 - g0)
        assert err <= 1e-2 * numpy.linalg.norm(g0) + 1e-7, (k, err / numpy.linalg.norm(g0))
    for k in (k[3:] for k in r if k.startswith('cpu:avg_mean:')):
        m0 = r['cpu' + k]
        numpy.testing.assert_allclose(r['gpu' + k], m0, rtol=1e-3,
                                      atol=1e-3 * (numpy.abs(m0).max() + 1e-6), err_msg=k)


@pytest.mark.gpu
def test_resnet50_nhwc_float16_trains_on_gpu_through_fused_cudnn_bn(cudnn_stack, monkeypatch):
    """The fast path with v1.5's recipe: float16 NHWC, every BN through cuDNN's fused kernel
    (one ForwardTrainingEx and one BackwardEx per BN link per step), the batched optimizer with
    dynamic loss scaling. Before training, the inference logits are the CPU float16 model's
    within float16 accuracy through 50 layers (5e-2 of their scale, as float16 against float32 in
    tests/test_models.py); the loss on a fixed batch falls by half in 16 steps, as on the CPU."""
    import cupy
    monkeypatch.delenv(kernels.ENV_EMULATE, raising=False)
    cpu = tiny_resnet(numpy.float16, zero_init_residual=True)
    gpu = copy.deepcopy(cpu)
    gpu.to_device('@cupy:0')
    x, t = resnet_batch()
    bns = [link for link in gpu.links() if isinstance(link, TL.BatchNormalization)]
    assert len(bns) == 53
    with chainer.using_config('train', False):
        ref = cpu(x.astype(numpy.float16)).array
    opt = optimizers.MomentumSGD(lr=0.05, decay_filter=optimizers.skip_bn_and_bias).setup(gpu)
    opt.loss_scaling(initial_scale=2.0 ** 10)
    calls = record_calls(monkeypatch, ['batch_normalization_forward_training_ex',
                                       'batch_normalization_backward_ex'])
    xg, tg = cupy.asarray(x.astype(numpy.float16)), cupy.asarray(t)
    with chainer.using_config('train', False):
        first = host(gpu(xg).array)
    assert calls == [], 'inference takes our single-pass kernel'
    numpy.testing.assert_allclose(first, ref, rtol=5e-2, atol=5e-2 * numpy.abs(ref).max())
    losses = []
    for step in range(16):
        del calls[:]
        loss = F.softmax_cross_entropy(gpu(xg), tg)
        losses.append(float(loss.array))
        opt.update(lambda: loss)
        assert calls.count('batch_normalization_forward_training_ex') == 53
        assert calls.count('batch_normalization_backward_ex') == 53
    assert all(numpy.isfinite(losses))
    assert losses[-1] < 0.5 * losses[0], losses
    for n, p in gpu.namedparams():
        assert bool(cupy.isfinite(p.array).all()), n


# ==== links on the GPU: to_nhwc / to_nchw, the convolution link's npz files ==========================

@pytest.mark.gpu
def test_to_nhwc_and_back_on_gpu(cudnn_stack):
    """Converted on the GPU: the new links live there (CuPy arrays), compute the function the
    NCHW model computed (inference; TF32 convolutions on both sides: 5e-3 of scale) and train
    (gradients reach every parameter); back to NCHW computes what the NHWC model computed."""
    import cupy
    numpy.random.seed(0)
    model = nets.ConvertibleNet()
    model.to_device('@cupy:0')
    x = cupy.asarray(numpy.random.RandomState(1).randn(4, 3, 6, 5).astype(numpy.float32))
    model(x)                                            # running statistics move from 0 / 1
    with chainer.using_config('train', False):
        ref = host(model(x).array)
    TL.to_nhwc(model)
    assert isinstance(model.conv, TL.Convolution2D) and isinstance(model.bn, TL.BatchNormalization)
    for name, p in model.namedparams():
        assert isinstance(p.array, cupy.ndarray), name
    assert isinstance(model.bn.avg_mean, cupy.ndarray)
    xh = cupy.ascontiguousarray(x.transpose(0, 2, 3, 1))
    with chainer.using_config('train', False):
        out = host(model(xh, nhwc=True).array)
    scale = numpy.abs(ref).max()
    numpy.testing.assert_allclose(out, ref, rtol=5e-3, atol=5e-3 * scale)
    model.cleargrads()
    F.sum(model(xh, nhwc=True)).backward()                # training: the statistics move again
    for name, p in model.namedparams():
        assert isinstance(p.grad, cupy.ndarray) and bool(cupy.isfinite(p.grad).all()), name
    with chainer.using_config('train', False):
        trained = host(model(xh, nhwc=True).array)
    TL.to_nchw(model)
    assert type(model.conv) is L.Convolution2D and type(model.blocks[0]) is L.Convolution2D
    assert isinstance(model.conv.W.array, cupy.ndarray)
    with chainer.using_config('train', False):
        back = host(model(x).array)
    numpy.testing.assert_allclose(back, trained, rtol=5e-3, atol=5e-3 * scale)


@pytest.mark.gpu
def test_to_nhwc_on_gpu_gives_float32_statistics_for_float16_bn():
    import cupy
    bn = L.BatchNormalization(8, dtype=numpy.float16)
    bn.to_device('@cupy:0')
    bn(cupy.asarray(numpy.random.RandomState(0).randn(4, 8, 3, 3).astype(numpy.float16)))
    mean16 = host(bn.avg_mean)
    new = TL.to_nhwc(bn)
    for a in (new.gamma.array, new.beta.array, new.avg_mean, new.avg_var):
        assert isinstance(a, cupy.ndarray) and a.dtype == numpy.float32
    numpy.testing.assert_array_equal(host(new.avg_mean), mean16.astype(numpy.float32))


@pytest.mark.gpu
def test_convolution_link_npz_files_move_between_gpu_nhwc_and_cpu_nchw(cudnn_stack, tmp_path):
    import cupy
    r = numpy.random.RandomState(0)
    x = r.randn(2, 3, 6, 5).astype(numpy.float32)
    ref = L.Convolution2D(3, 4, 3, pad=1, initial_bias=chainer.initializers.Normal(1.0))
    ref(x)
    serializers.save_npz(str(tmp_path / 'nchw.npz'), ref)

    ours = TL.Convolution2D(3, 4, 3, pad=1)
    ours.to_device('@cupy:0')
    ours(cupy.zeros((1, 6, 5, 3), numpy.float32))
    w = ours.W.array
    tc_serializers.load_npz(str(tmp_path / 'nchw.npz'), ours)
    assert ours.W.array is w and isinstance(w, cupy.ndarray), 'loaded in place, on the GPU'
    numpy.testing.assert_array_equal(host(w), nhwc(ref.W.array))
    numpy.testing.assert_array_equal(host(ours.b.array), ref.b.array)
    y = host(ours(cupy.asarray(nhwc(x))).array)
    want = nhwc(ref(x).array)
    numpy.testing.assert_allclose(y, want, rtol=5e-3, atol=5e-3 * numpy.abs(want).max())

    serializers.save_npz(str(tmp_path / 'from_gpu.npz'), ours)      # saved in Chainer's layout
    with numpy.load(str(tmp_path / 'from_gpu.npz')) as f:
        numpy.testing.assert_array_equal(f['W'], ref.W.array)
    back = L.Convolution2D(3, 4, 3, pad=1)
    back(x)
    tc_serializers.load_npz(str(tmp_path / 'from_gpu.npz'), back)
    numpy.testing.assert_array_equal(back.W.array, ref.W.array)

    lazy = TL.Convolution2D(None, 4, 3, pad=1)          # in_channels from the file, on the GPU
    lazy.to_device('@cupy:0')
    tc_serializers.load_npz(str(tmp_path / 'from_gpu.npz'), lazy)
    assert isinstance(lazy.W.array, cupy.ndarray) and lazy.W.shape == (4, 3, 3, 3)
    numpy.testing.assert_array_equal(host(lazy.W.array), nhwc(ref.W.array))


# ==== float64 NHWC convolution ======================================================================

# (ksize, stride, pad, dilate, groups, bias, N, H, W)
CONV64 = [(3, 1, 1, 1, 1, True, 2, 9, 7), (3, 2, 1, 1, 2, False, 3, 8, 11),
          (1, 2, 0, 1, 1, True, 2, 7, 7), (3, 1, 2, 2, 1, False, 1, 10, 9),
          (7, 2, 3, 1, 1, True, 2, 13, 9)]


@pytest.mark.gpu
@pytest.mark.parametrize('case', CONV64)
def test_float64_nhwc_convolution_on_cudnn_equals_numpy_path(cudnn_stack, case):
    """float64 has no tensor-core math: cuDNN and NumPy differ by summation order only (at most
    7*7*4 products): 1e-10 relative."""
    import cupy
    k, s, p, d, g, bias, n, h, w = case
    r = numpy.random.RandomState(0)
    x = r.randn(n, h, w, 4)
    W = r.randn(6, k, k, 4 // g) * 0.3
    b = r.randn(6) if bias else None
    kw = dict(stride=s, pad=p, dilate=d, groups=g)
    gy = r.randn(*TF.convolution_2d(x, W, b, **kw).shape)
    out = []
    for xp in (numpy, cupy):
        vs = [None if a is None else chainer.Variable(xp.asarray(a)) for a in (x, W, b)]
        y = TF.convolution_2d(*vs, **kw)
        y.grad = xp.asarray(gy)
        y.backward()
        assert y.dtype == numpy.float64
        out.append([host(y.array)] + [None if v is None else host(v.grad) for v in vs])
    for name, a, c in zip(('y', 'gx', 'gW', 'gb'), *out):
        if a is not None:
            numpy.testing.assert_allclose(c, a, rtol=1e-10, atol=1e-10, err_msg=name)


# ==== the layout kernel past CUDA's grid limits =====================================================

# layout.py caps gridDim.y (row tiles of 32) and gridDim.z (images) at 65535, the kernel striding
# over the rest: these shapes need 65537 row tiles, or 65540 images.
GRID_CASES = [
    ('nchw_to_nhwc', (65540, 2, 1, 3), numpy.float32, numpy.float16, (1, 1, 65535)),
    ('nhwc_to_nchw', (1, 65535 * 32 + 33, 1, 2), numpy.float32, None, (1, 65535, 1)),
]


def _grid_spy(monkeypatch):
    grids = []
    real = kernels.get_function

    def get_function(*args, **kwargs):
        k = real(*args, **kwargs)

        def launch(grid, block, args, shared_mem=0):
            grids.append(tuple(grid))
            return k(grid, block, args, shared_mem=shared_mem)
        return launch
    monkeypatch.setattr(kernels, 'get_function', get_function)
    return grids


def _layout_case(monkeypatch, xp, case):
    direction, shape, src, dst, grid = case
    x = numpy.random.RandomState(0).randn(*shape).astype(src)
    ref = numpy.ascontiguousarray(x.transpose((0, 2, 3, 1) if direction == 'nchw_to_nhwc'
                                              else (0, 3, 1, 2))).astype(dst or src)
    grids = _grid_spy(monkeypatch)
    y = getattr(layout, direction)(xp.asarray(x), dst)
    assert grids == [grid]
    numpy.testing.assert_array_equal(host(y), ref)


@pytest.mark.gpu
@pytest.mark.parametrize('case', GRID_CASES, ids=[c[0] for c in GRID_CASES])
def test_layout_kernel_past_grid_limits_on_gpu(monkeypatch, case):
    import cupy
    _layout_case(monkeypatch, cupy, case)


@pytest.mark.parametrize('case', GRID_CASES, ids=[c[0] for c in GRID_CASES])
def test_layout_kernel_past_grid_limits_emulated(monkeypatch, case):
    """The same launches through the emulator (65535 blocks: ~8 s each here)."""
    monkeypatch.setenv(kernels.ENV_EMULATE, '1')
    _layout_case(monkeypatch, numpy, case)


# ==== DALI on the GPU ===============================================================================

N_IMAGES = 29           # not a multiple of the batch size


@pytest.fixture(scope='module')
def images(tmp_path_factory):
    why = _dali_problem()
    if why:
        pytest.skip(why)
    return dali_data.make_dataset(tmp_path_factory.mktemp('dali_gpu'), n=N_IMAGES)


@pytest.fixture
def finalize():
    """Iterators to finalize after the test, whatever happens."""
    its = []
    yield its.append
    for it in its:
        it.finalize()


def gpu_pipeline(images, list_file='ids', **kwargs):
    args = dict(device='gpu', crop=32, seed=7, num_threads=2)
    args.update(kwargs)
    lst = {'ids': images.ids_list, 'classes': images.classes_list}[list_file]
    return dali.imagenet_pipeline(images.root, lst, **args)


@pytest.mark.gpu
def test_dali_nhwc_float16_training_pipeline_on_gpu(images, finalize):
    """The training pipeline as the fast path uses it: NHWC float16 CuPy arrays. The same seed
    makes the same random crops and flips whatever the output layout and dtype, so the NHWC
    float16 batch is the NCHW float32 one transposed and rounded (half an ulp, |x| * 2^-11, twice
    if DALI normalises in float16); the values stay within the normalised range; a new epoch
    gives new crops."""
    import cupy
    a = dali.DaliIterator(gpu_pipeline(images, dtype=numpy.float16, layout='NHWC'), 8,
                          shuffle=False)
    b = dali.DaliIterator(gpu_pipeline(images, dtype=numpy.float32, layout='NCHW'), 8,
                          shuffle=False)
    finalize(a)
    finalize(b)
    x16, t16 = next(a)
    x32, t32 = next(b)
    assert isinstance(x16, cupy.ndarray) and isinstance(t16, cupy.ndarray)
    assert x16.dtype == numpy.float16 and x16.shape == (8, 32, 32, 3)
    assert t16.dtype == numpy.int32 and host(t16).tolist() == list(range(8))
    assert host(t32).tolist() == list(range(8))
    h16 = host(x16).astype(numpy.float64)
    h32 = host(x32).astype(numpy.float64).transpose(0, 2, 3, 1)
    numpy.testing.assert_allclose(h16, h32, rtol=2.0 ** -10, atol=2e-3)
    lo = -numpy.array(dali.IMAGENET_MEAN) / numpy.array(dali.IMAGENET_STD)
    hi = (1 - numpy.array(dali.IMAGENET_MEAN)) / numpy.array(dali.IMAGENET_STD)
    assert (h16 >= lo - 1e-2).all() and (h16 <= hi + 1e-2).all()
    assert h16.std() > 0.1, 'images, not a constant'
    for _ in range(3):                       # 32 images: into the second epoch
        next(a)
    x16b, t16b = next(a)                     # images 3..10 of epoch 1
    assert host(t16b).tolist() == [3, 4, 5, 6, 7, 8, 9, 10]
    first_epoch = numpy.concatenate([h16[3:], host(next(b)[0])[:3].astype(numpy.float64)
                                     .transpose(0, 2, 3, 1)])
    again = host(x16b).astype(numpy.float64)
    assert all(not numpy.allclose(p, q, atol=1e-2) for p, q in zip(first_epoch, again))


@pytest.mark.gpu
def test_dali_gpu_batches_stay_valid_while_the_iterator_runs_on(images, finalize):
    """A batch is a DLPack view of DALI's buffer: later batches must not overwrite it."""
    import cupy
    it = dali.DaliIterator(gpu_pipeline(images, train=False, dtype=numpy.float16), 4,
                           shuffle=False)
    finalize(it)
    kept = next(it)
    saved = [host(a).copy() for a in kept]
    for _ in range(12):
        next(it)
    cupy.cuda.get_current_stream().synchronize()
    numpy.testing.assert_array_equal(host(kept[0]), saved[0])
    assert host(kept[1]).tolist() == [0, 1, 2, 3]


@pytest.mark.gpu
def test_dali_gpu_partial_last_batch_and_reset(images, finalize):
    """repeat=False: 'partial' gives 8, 8, 8, 5, every image once; again after reset() at the
    end of a pass and after reset() in the middle; the images are the same every pass."""
    it = dali.DaliIterator(gpu_pipeline(images, train=False, dtype=numpy.float32), 8,
                           repeat=False, last_batch='partial')
    finalize(it)
    passes = []
    for attempt in range(2):
        batches = [(host(x), host(t)) for x, t in it]
        assert [len(t) for _, t in batches] == [8, 8, 8, 5]
        labels = numpy.concatenate([t for _, t in batches])
        assert sorted(labels.tolist()) == list(range(N_IMAGES))
        assert it.epoch == 1 and it.is_new_epoch
        with pytest.raises(StopIteration):
            next(it)
        order = numpy.argsort(labels)
        passes.append(numpy.concatenate([x for x, _ in batches])[order])
        it.reset()
        assert it.epoch == 0
    next(it)
    it.reset()                                          # mid-pass: the pipeline is rebuilt
    batches = [(host(x), host(t)) for x, t in it]
    labels = numpy.concatenate([t for _, t in batches])
    assert sorted(labels.tolist()) == list(range(N_IMAGES))
    passes.append(numpy.concatenate([x for x, _ in batches])[numpy.argsort(labels)])
    numpy.testing.assert_array_equal(passes[1], passes[0])
    numpy.testing.assert_array_equal(passes[2], passes[0])


@pytest.mark.gpu
def test_dali_gpu_iterator_snapshot_resumes_mid_epoch(images, tmp_path, finalize):
    a = dali.DaliIterator(gpu_pipeline(images, train=False, dtype=numpy.float16), 4)  # shuffled
    finalize(a)
    for _ in range(10):                                   # 40 images: into the second epoch
        next(a)
    path = str(tmp_path / 'it.npz')
    serializers.save_npz(path, a)
    saved = (a.epoch, a.epoch_detail, a.previous_epoch_detail, a.is_new_epoch)
    rest = [(host(x), host(t)) for x, t in (next(a) for _ in range(8))]   # into the third
    b = dali.DaliIterator(gpu_pipeline(images, train=False, dtype=numpy.float16, seed=99), 4)
    finalize(b)
    next(b)
    tc_serializers.load_npz(path, b)
    assert (b.epoch, b.epoch_detail, b.previous_epoch_detail, b.is_new_epoch) == saved
    for x, t in rest:
        xb, tb = next(b)
        numpy.testing.assert_array_equal(host(tb), t)
        numpy.testing.assert_array_equal(host(xb), x)     # the same decode, resize, crop
    assert (b.epoch, b.epoch_detail) == (a.epoch, a.epoch_detail)


class NHWCNet(chainer.Chain):
    """float16 NHWC images in, float32 logits out: conv (cuDNN), BN, global pooling, linear."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.conv = TL.Convolution2D(3, 8, 3, stride=2, initialW=chainer.initializers
                                         .HeNormal(rng=numpy.random.RandomState(0)))
            self.bn = TL.BatchNormalization(8)
            self.fc = L.Linear(8, 2, initialW=chainer.initializers.HeNormal(
                rng=numpy.random.RandomState(1)))

    def forward(self, x):
        h = F.relu(self.bn(self.conv(F.cast(x, numpy.float32))))
        return self.fc(F.reshape(TF.global_average_pooling_2d(h), (len(x), -1)))


@pytest.mark.gpu
def test_dali_gpu_trainer_and_evaluator_accuracy_is_per_image(cudnn_stack, images, tmp_path,
                                                              finalize):
    """Trainer on the GPU pipeline (NHWC float16); dali.Evaluator on a repeat=False GPU iterator
    reports the mean over the 29 images, Chainer's the mean of the 4 batch means (8, 8, 8, 5)."""
    from chainer import training
    common = dict(list_file='classes', dtype=numpy.float16, layout='NHWC')
    train = dali.DaliIterator(gpu_pipeline(images, **common), 8)
    val = dali.DaliIterator(gpu_pipeline(images, train=False, **common), 8, repeat=False)
    finalize(train)
    finalize(val)
    model = L.Classifier(NHWCNet())
    model.to_device('@cupy:0')
    opt = optimizers.MomentumSGD(lr=0.05).setup(model)
    updater = training.StandardUpdater(train, opt, converter=dali.converter)
    trainer = training.Trainer(updater, (2, 'epoch'), out=str(tmp_path))
    trainer.extend(dali.Evaluator(val, model, converter=dali.converter), name='ours',
                   trigger=(2, 'epoch'))
    trainer.extend(training.extensions.Evaluator(val, model, converter=dali.converter),
                   name='chainers', trigger=(2, 'epoch'))
    trainer.run()
    assert updater.iteration == 8 and train.epoch == 2           # 2 epochs of 29 at batch 8
    val.reset()
    correct = []
    with chainer.using_config('train', False), chainer.no_backprop_mode():
        for x, t in val:
            correct.append(host(model.predictor(x).array.argmax(axis=1) == t))
    assert [len(c) for c in correct] == [8, 8, 8, 5]
    obs = trainer.observation
    exact = numpy.concatenate(correct).mean()
    assert float(obs['ours/main/accuracy']) == pytest.approx(exact, abs=1e-6)
    assert float(obs['chainers/main/accuracy']) == pytest.approx(
        numpy.mean([c.mean() for c in correct]), abs=1e-6)
    assert numpy.isfinite(float(obs['ours/main/loss']))
