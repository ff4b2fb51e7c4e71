"""ResNet-50 in NCHW (Chainer's links) and NHWC (chainer_tc's): same numbers, no transposes, fewer
FunctionNodes, weights interchangeable, v1 and v1.5, float16 through chainer.config.dtype, trains
with chainer_tc's optimizer."""
import collections
import warnings

import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer)
import chainer
import chainer.functions as F
import chainer.links as L
from chainer import serializers

from chainer_tc import links as TL
from chainer_tc import optimizers
from chainer_tc.models import ResNet50


class NodeCounter(chainer.FunctionHook):
    """FunctionNodes applied, by label (forward and backward)."""
    name = 'node_counter'

    def __init__(self):
        self.counts = collections.Counter()

    def forward_preprocess(self, function, in_data):
        self.counts[function.label] += 1


def make(layout, seed=0, **kwargs):
    numpy.random.seed(seed)
    kwargs.setdefault('zero_init_residual', False)      # every branch contributes
    return ResNet50(layout, n_classes=10, width=16, **kwargs)


def batch(layout, n=2, seed=0):
    r = numpy.random.RandomState(seed)
    x = r.randn(n, 3, 32, 32).astype(numpy.float32)
    t = r.randint(0, 10, n).astype(numpy.int32)
    return (x.transpose(0, 2, 3, 1).copy() if layout == 'NHWC' else x), t


def step(model, layout):
    x, t = batch(layout)
    counter = NodeCounter()
    with counter:
        loss = F.softmax_cross_entropy(model(x), t)
        model.cleargrads()
        loss.backward()
    return float(loss.array), counter.counts


def _chainer_layout(name, array, nhwc):
    """A parameter (or its gradient) of the NHWC model in the NCHW model's layout."""
    if nhwc and array.ndim == 4:
        return array.transpose(0, 3, 1, 2)
    return array


@pytest.mark.parametrize('version', ['1', '1.5'])
def test_same_loss_and_gradients_in_both_layouts(version):
    """In float64, so that what is compared is the semantics: 50 layers of batch-2 BatchNorm
    amplify float32 rounding differences (our NHWC convolution sums in another order than
    Chainer's NCHW one) into gradient differences of a few percent."""
    with chainer.using_config('dtype', numpy.float64):
        nchw, nhwc = make('NCHW', version=version), make('NHWC', version=version)
    for (n1, p1), (n2, p2) in zip(sorted(nchw.namedparams()), sorted(nhwc.namedparams())):
        assert n1 == n2
        numpy.testing.assert_array_equal(p1.array, _chainer_layout(n2, p2.array, True))
    with chainer.using_config('dtype', numpy.float64):
        l1, _ = step(nchw, 'NCHW')
        l2, _ = step(nhwc, 'NHWC')
    assert l1 == pytest.approx(l2, rel=1e-10)
    grads = dict(nhwc.namedparams())
    for name, p in nchw.namedparams():
        g = _chainer_layout(name, grads[name].grad, True)
        scale = numpy.abs(p.grad).max()
        numpy.testing.assert_allclose(g, p.grad, rtol=1e-7, atol=1e-9 * scale, err_msg=name)


def test_v1_and_v15_differ_where_the_stride_sits():
    v1, v15 = make('NHWC', version='1'), make('NHWC', version='1.5')
    first_of_stage3 = 3
    assert v1.blocks[first_of_stage3].conv1.stride == (2, 2)
    assert v1.blocks[first_of_stage3].conv2.stride == (1, 1)
    assert v15.blocks[first_of_stage3].conv1.stride == (1, 1)
    assert v15.blocks[first_of_stage3].conv2.stride == (2, 2)
    for model in (v1, v15):
        assert model.blocks[first_of_stage3].conv_sc.stride == (2, 2)
        assert model.insize == 224
    x, _ = batch('NHWC')
    with chainer.using_config('train', False):
        assert not numpy.allclose(v1(x).array, v15(x).array)


def test_zero_init_residual_default_follows_the_version():
    assert ResNet50('NHWC', width=16, version='1.5').zero_init_residual is True
    assert ResNet50('NHWC', width=16, version='1').zero_init_residual is False
    z = ResNet50('NCHW', width=16, zero_init_residual=True)
    for block in z.blocks:
        assert not block.bn3.gamma.array.any()
        assert (block.bn1.gamma.array == 1).all() and (block.bn_sc.gamma.array == 1).all() \
            if hasattr(block, 'bn_sc') else True
    assert not ResNet50('NCHW', width=16, version='1.5', zero_init_residual=False) \
        .blocks[0].bn3.gamma.array.min() == 0


def test_nhwc_model_has_no_transposes_and_fewer_nodes():
    _, c_nchw = step(make('NCHW'), 'NCHW')
    _, c_nhwc = step(make('NHWC'), 'NHWC')
    assert not [k for k in c_nhwc if 'Transpose' in k]
    assert 'ReLU' not in c_nhwc and 'BatchNormalization' not in c_nhwc, 'BN+Add+ReLU are fused'
    assert c_nhwc['BatchNormAddAct'] == 53
    assert 'Cast' not in c_nhwc, 'a float32 model casts nothing'
    # reported in docs/performance.md (benchmarks/framework_overhead.py)
    assert sum(c_nhwc.values()) < sum(c_nchw.values())


def test_unfused_nhwc_model_computes_the_same_with_separate_ops():
    """fused=False (the example's --nhwc without --fused-bn): the same parameters and names, BN,
    Add and ReLU as separate nodes, the same loss and gradients as the fused model."""
    with chainer.using_config('dtype', numpy.float64):
        fused, unfused = make('NHWC'), make('NHWC', fused=False)
    assert fused.fused is True and unfused.fused is False
    assert sorted(n for n, _ in fused.namedparams()) == sorted(n for n, _ in unfused.namedparams())
    with chainer.using_config('dtype', numpy.float64):
        l1, c1 = step(fused, 'NHWC')
        l2, c2 = step(unfused, 'NHWC')
    assert 'ReLU' not in c1 and c2['ReLU'] == 1 + 16 * 3      # the stem and 3 per block
    assert l1 == pytest.approx(l2, rel=1e-12)
    grads = dict(unfused.namedparams())
    for name, p in fused.namedparams():
        numpy.testing.assert_allclose(grads[name].grad, p.grad, rtol=1e-9, atol=1e-12,
                                      err_msg=name)
    with pytest.raises(ValueError, match="fused=True needs layout='NHWC'"):
        ResNet50('NCHW', width=16, fused=True)
    with pytest.raises(TypeError, match='fused must be True, False or None'):
        ResNet50(width=16, fused=1)


@pytest.mark.parametrize('version', ['1', '1.5'])
def test_weights_move_between_layouts(tmp_path, version):
    nchw = make('NCHW', seed=1, version=version)
    x, _ = batch('NCHW')
    nchw(x)
    serializers.save_npz(str(tmp_path / 'resnet.npz'), nchw)
    nhwc = make('NHWC', seed=2, version=version)
    serializers.load_npz(str(tmp_path / 'resnet.npz'), nhwc)
    with chainer.using_config('train', False):
        numpy.testing.assert_allclose(nhwc(x.transpose(0, 2, 3, 1).copy()).array,
                                      nchw(x).array, rtol=1e-4, atol=1e-5)


def test_nhwc_model_trains_with_the_batched_optimizer(monkeypatch):
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1')     # every custom kernel, emulated
    model = make('NHWC')
    opt = optimizers.MomentumSGD(lr=0.05, weight_decay=1e-4,
                                 decay_filter=optimizers.skip_bn_and_bias).setup(model)
    x, t = batch('NHWC', n=4)
    losses = []
    for _ in range(8):
        loss = F.softmax_cross_entropy(model(x), t)
        losses.append(float(loss.array))
        opt.update(lambda: loss)
    assert losses[-1] < 0.5 * losses[0]


def test_bad_arguments():
    with pytest.raises(ValueError, match="layout must be 'NCHW' or 'NHWC'; got 'nhwc'"):
        ResNet50('nhwc')
    with pytest.raises(ValueError, match="version must be '1.5' or '1' .*got 1.5"):
        ResNet50(version=1.5)
    with pytest.raises(ValueError, match='width must be a positive integer dividing 64.*got 3'):
        ResNet50(width=3)
    with pytest.raises(ValueError, match='n_classes must be a positive integer; got 0'):
        ResNet50(n_classes=0)
    with pytest.raises(TypeError, match="zero_init_residual must be True, False or None"):
        ResNet50(width=16, zero_init_residual='yes')


# ---- float16 through chainer.config.dtype -------------------------------------------------------

def _dtypes(model):
    return {name: p.dtype for name, p in model.namedparams()}


@pytest.mark.parametrize('config_dtype', [numpy.float16, chainer.mixed16])
def test_float16_nhwc_model_dtypes(config_dtype):
    with chainer.using_config('dtype', config_dtype):
        model = make('NHWC')
    assert model.dtype == numpy.float16
    for name, dtype in _dtypes(model).items():
        if '/bn' in name or name.startswith('/fc/'):
            assert dtype == numpy.float32, name       # BN for cuDNN's fused path; the classifier
        else:
            assert dtype == numpy.float16, name
    for link in model.links():
        if isinstance(link, TL.BatchNormalization):
            assert link.avg_mean.dtype == numpy.float32 and link.avg_var.dtype == numpy.float32


def test_float16_nchw_model_dtypes_are_chainers():
    with chainer.using_config('dtype', numpy.float16):
        model = make('NCHW')
    conv = [d for n, d in _dtypes(model).items() if n.endswith('/W') and not n.startswith('/fc')]
    assert set(conv) == {numpy.dtype(numpy.float16)}
    assert model.bn1.gamma.dtype == numpy.float16 and model.bn1.avg_mean.dtype == numpy.float16
    assert model.fc.W.dtype == numpy.float32


@pytest.mark.parametrize('layout', ['NHWC', 'NCHW'])
def test_float16_input_is_cast_once_and_logits_are_float32(layout):
    with chainer.using_config('dtype', numpy.float16):
        model = make(layout)
    x, _ = batch(layout)
    for x_dtype, casts in ((numpy.float32, 2), (numpy.float16, 1)):
        counter = NodeCounter()
        with counter, chainer.using_config('train', False):
            y = model(x.astype(x_dtype))
        assert y.dtype == numpy.float32
        assert counter.counts['Cast'] == casts      # the input (if float32), the classifier's
        assert numpy.isfinite(y.array).all()


def test_float16_training_with_loss_scaling_is_finite_and_learns():
    """A float16 NHWC model, chainer_tc's optimizer with dynamic loss scaling, a fixed batch: the
    loss falls, everything stays finite, and with an initial scale that overflows float16 the
    expected overflows are skipped without a RuntimeWarning flood."""
    with chainer.using_config('dtype', numpy.float16):
        model = make('NHWC', zero_init_residual=True)   # v1.5's default
        opt = optimizers.MomentumSGD(lr=0.05, decay_filter=optimizers.skip_bn_and_bias)
        opt.setup(model)
        opt.loss_scaling(initial_scale=2.0 ** 24)        # overflows at first: expected
        x, t = batch('NHWC', n=8)
        losses = []
        with warnings.catch_warnings():
            warnings.simplefilter('error', RuntimeWarning)
            for _ in range(16):
                loss = F.softmax_cross_entropy(model(x), t)
                assert loss.dtype == numpy.float32
                losses.append(float(loss.array))
                opt.update(lambda: loss)
    assert opt.loss_scale < 2.0 ** 24, 'the first steps overflowed and were skipped'
    assert all(numpy.isfinite(losses))
    for name, p in model.namedparams():
        assert numpy.isfinite(p.array).all(), name
    assert losses[-1] < 0.5 * losses[0]


def test_float16_model_through_the_emulated_kernels(monkeypatch):
    """float16 data with float32 gamma/beta/statistics through kernels/batchnorm.cu (emulated)
    and the NumPy path: the same logits and gradients up to float16 rounding. In inference mode:
    with batch statistics over the 2 rows per channel of the last stage, BN's output is the sign
    of a difference, and rounding-level differences flip it."""
    with chainer.using_config('dtype', numpy.float16):
        model = make('NHWC')
    x, t = batch('NHWC', n=4)
    model(x)                            # running statistics away from 0 / 1
    results = []
    for emulate in ('0', '1'):
        monkeypatch.setenv('CHAINER_TC_EMULATE', emulate)
        with chainer.using_config('train', False):
            loss = F.softmax_cross_entropy(model(x), t)
        model.cleargrads()
        loss.backward()
        results.append((float(loss.array), {n: p.grad.astype(numpy.float32)
                                            for n, p in model.namedparams()}))
    (ref_loss, ref), (loss, grads) = results
    assert loss == pytest.approx(ref_loss, rel=1e-2)
    for name, g in grads.items():
        assert numpy.isfinite(g).all(), name
        scale = max(numpy.abs(ref[name]).max(), 1e-3)
        numpy.testing.assert_allclose(g, ref[name], rtol=5e-2, atol=5e-2 * scale, err_msg=name)


def test_float32_and_float16_runs_differ_only_in_the_config():
    """The same code, twice: the float16 logits are close to the float32 ones."""
    x, _ = batch('NHWC')
    outs = []
    for dtype in (numpy.float32, numpy.float16):
        with chainer.using_config('dtype', dtype):
            model = make('NHWC')
            with chainer.using_config('train', False):
                outs.append(model(x).array)
    assert outs[1].dtype == numpy.float32
    numpy.testing.assert_allclose(outs[1], outs[0], rtol=5e-2, atol=5e-2)


def test_classifier_wrapper_reports_float32_loss():
    with chainer.using_config('dtype', numpy.float16):
        model = L.Classifier(make('NHWC'))
    x, t = batch('NHWC')
    loss = model(x, t)
    assert loss.dtype == numpy.float32 and numpy.isfinite(loss.array)
