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


def test_training_step_loads_and_looks_up_no_kernel_after_warm_up(monkeypatch):
    """Issue 13 item 3 for our kernels: after the first step, a training step of ResNet-50 (BN,
    pooling, layout-free NHWC, the batched optimizer; emulated) compiles, loads and looks up
    nothing: every kernel is a dictionary hit. The GPU path shares this memo (kernels.py)."""
    from chainer_tc import kernels
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1')
    model = make('NHWC')
    opt = optimizers.MomentumSGD(lr=0.05, weight_decay=1e-4).setup(model)
    opt.loss_scaling()
    x, t = batch('NHWC', n=2)
    opt.update(lambda: F.softmax_cross_entropy(model(x), t))
    kernels.reset_counters()
    with kernels.count_launches() as launches:
        opt.update(lambda: F.softmax_cross_entropy(model(x), t))
    assert launches.total > 100, 'the step ran on the emulated kernels'
    assert kernels.counters() == dict(nvrtc_compiles=0, cache_hits=0, modules_loaded=0,
                                      function_lookups=0)


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


# ---- pad_channels: conv1 reads 4 or 8 channels, invisibly ----------------------------------------

def _padded_input(x, channels):
    """NHWC images ``x`` with zero channels appended up to ``channels``, as the DALI pipeline
    makes them with pad_channels."""
    pad = numpy.zeros(x.shape[:3] + (channels - x.shape[3],), x.dtype)
    return numpy.concatenate([x, pad], axis=3)


@pytest.mark.parametrize('pad_channels', [4, 8])
@pytest.mark.parametrize('dtype', [numpy.float64, numpy.float32])
@pytest.mark.parametrize('train', [False, True])
def test_padded_model_gives_the_unpadded_models_logits(pad_channels, dtype, train):
    with chainer.using_config('dtype', dtype):
        plain = make('NHWC', seed=3)
        padded = make('NHWC', seed=3, pad_channels=pad_channels)
    assert padded.pad_channels == pad_channels and plain.pad_channels == 3
    w, w3 = padded.conv1.W.array, plain.conv1.W.array
    assert w.shape == w3.shape[:3] + (pad_channels,) and padded.conv1.in_channels == 3
    # the same random state gives the same filter (HeNormal over the 3 real channels), zeros
    # appended; every other parameter is the same too
    numpy.testing.assert_array_equal(w[..., :3], w3)
    assert not w[..., 3:].any()
    for (n1, p1), (n2, p2) in zip(sorted(plain.namedparams()), sorted(padded.namedparams())):
        if n1 != '/conv1/W':
            numpy.testing.assert_array_equal(p1.array, p2.array, err_msg=n1)
    x, _ = batch('NHWC')
    x = x.astype(dtype)
    with chainer.using_config('train', train):
        want = plain(x).array
        got = padded(x).array                                   # padded by the model
        got_padded = padded(_padded_input(x, pad_channels)).array   # padded already
    # The model's own padding and the pipeline's give the same input: the same bits.
    numpy.testing.assert_array_equal(got, got_padded)
    # Against the unpadded model: the zero channels add exact zeros to conv1's sums (often the
    # same bits), but BLAS may split the longer reduction (7 * 7 * 4 or 7 * 7 * 8 terms instead
    # of 7 * 7 * 3) into other blocks, so a sum may round differently in its last place. 50
    # layers amplify that, batch-2 BatchNorm in training most (statistics over 2 rows per
    # channel in the last stage): float32 logits were seen 1e-3 apart there, float64 ones stay
    # within 1e-12 (what is compared is the semantics).
    tol = {numpy.float64: 1e-12, numpy.float32: 2e-3 if train else 1e-4}[dtype]
    numpy.testing.assert_allclose(got, want, rtol=tol, atol=tol * numpy.abs(want).max())


def _train(model, opt, steps=3, n=4):
    x, t = batch('NHWC', n=n)
    x = x.astype(model.dtype)
    losses = []
    for _ in range(steps):
        loss = F.softmax_cross_entropy(model(x), t)
        losses.append(float(loss.array))
        model.cleargrads()
        loss.backward()
        grad = model.conv1.W.grad
        assert grad is not None and not grad[..., 3:].any(), 'zero input, zero gradient'
        opt.update()
    return losses


@pytest.mark.parametrize('optimizer', ['chainer_tc', 'chainer'])
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float16])
def test_padding_weights_stay_zero_in_training(optimizer, dtype):
    """Zero input channels give their filter weights a zero gradient; weight decay and momentum
    of zero are zero: after training steps the padding weights are still exactly zero, while
    the real ones moved."""
    with chainer.using_config('dtype', dtype):
        model = make('NHWC', pad_channels=4)
    before = model.conv1.W.array.copy()
    if optimizer == 'chainer_tc':
        opt = optimizers.MomentumSGD(lr=0.05, weight_decay=1e-2,
                                     decay_filter=optimizers.skip_bn_and_bias).setup(model)
        if dtype == numpy.float16:
            opt.loss_scaling()
    else:
        opt = chainer.optimizers.MomentumSGD(lr=0.05).setup(model)
        opt.add_hook(chainer.optimizer_hooks.WeightDecay(1e-2))
        if dtype == numpy.float16:
            opt.use_fp32_update()
    losses = _train(model, opt)
    w = model.conv1.W.array
    assert not w[..., 3:].any()
    assert not numpy.array_equal(w[..., :3], before[..., :3])
    assert all(numpy.isfinite(losses))
    v = model.conv1.W.update_rule.state['v']
    assert v.shape == w.shape and not v[..., 3:].any()


def test_padded_model_files_are_the_unpadded_models(tmp_path):
    """Saved without the padding channels: the file of the unpadded model, which loads into a
    padded model, an unpadded one and an NCHW one; an unpadded model's file loads into a padded
    model with zeros appended (whatever was there before)."""
    x, _ = batch('NHWC')
    padded = make('NHWC', seed=1, pad_channels=4)
    padded(x)                                   # running statistics away from 0 / 1
    serializers.save_npz(str(tmp_path / 'padded.npz'), padded)
    saved = numpy.load(str(tmp_path / 'padded.npz'))
    assert saved['conv1/W'].shape == (4, 3, 7, 7)
    numpy.testing.assert_array_equal(saved['conv1/W'],
                                     padded.conv1.W.array[..., :3].transpose(0, 3, 1, 2))
    plain = make('NHWC', seed=1)
    plain(x)
    serializers.save_npz(str(tmp_path / 'plain.npz'), plain)
    plain_saved = numpy.load(str(tmp_path / 'plain.npz'))
    assert sorted(saved.files) == sorted(plain_saved.files)
    for key in saved.files:
        numpy.testing.assert_array_equal(saved[key], plain_saved[key], err_msg=key)

    with chainer.using_config('train', False):
        want = padded(x).array
        for target in (make('NHWC', seed=2, pad_channels=4), make('NHWC', seed=2),
                       make('NHWC', seed=2, pad_channels=8)):
            serializers.load_npz(str(tmp_path / 'padded.npz'), target)
            numpy.testing.assert_allclose(target(x).array, want, rtol=1e-5, atol=1e-6)
        nchw = make('NCHW', seed=2)
        serializers.load_npz(str(tmp_path / 'padded.npz'), nchw)
        numpy.testing.assert_allclose(nchw(x.transpose(0, 3, 1, 2).copy()).array, want,
                                      rtol=1e-4, atol=1e-5)
    other = make('NHWC', seed=2, pad_channels=4)
    other.conv1.W.array[..., 3] = 1.0           # the load must put zeros there
    serializers.load_npz(str(tmp_path / 'plain.npz'), other)
    assert not other.conv1.W.array[..., 3:].any()
    numpy.testing.assert_array_equal(other.conv1.W.array, padded.conv1.W.array)


def test_nonzero_padding_weights_are_saved_with_a_warning_and_refused_by_an_unpadded_model(
        tmp_path):
    """If the input's padding channels were not zero, their weights learned something: saving
    keeps them (nothing is dropped), says so, and an unpadded model refuses the file naming
    why."""
    model = make('NHWC', pad_channels=4)
    model.conv1.W.array[0, 0, 0, 3] = 0.5
    with pytest.warns(TL.PaddingWarning, match=r'^conv1: the weights of its padding channels '
                                               r'\(3..3 .*are not zero.*saved with them \(4 '
                                               r'input channels\)'):
        serializers.save_npz(str(tmp_path / 'm.npz'), model)
    assert numpy.load(str(tmp_path / 'm.npz'))['conv1/W'].shape == (4, 4, 7, 7)
    again = make('NHWC', seed=5, pad_channels=4)
    serializers.load_npz(str(tmp_path / 'm.npz'), again)
    numpy.testing.assert_array_equal(again.conv1.W.array, model.conv1.W.array)
    with pytest.raises(ValueError, match=r'W in the file has shape \(4, 4, 7, 7\) .*this link '
                                         r'needs \(4, 3, 7, 7\); .*a link with pad_channels=4 '
                                         r'saves them all when its padding channels are not '
                                         r'zero'):
        serializers.load_npz(str(tmp_path / 'm.npz'), make('NHWC'))
    with pytest.raises(ValueError, match=r'needs \(4, 3, 7, 7\) \(or \(4, 8, 7, 7\) with its '
                                         r'padding channels\)'):
        serializers.load_npz(str(tmp_path / 'm.npz'), make('NHWC', pad_channels=8))


def test_chainer_examples_weights_load_into_a_padded_model(tmp_path):
    from chainer_tc.models import load_chainer_example
    from test_chainer_example import CLASSES, WIDTH, _images, _trained_example
    example = _trained_example()
    chainer.serializers.save_npz(str(tmp_path / 'model_iter_1'), example)
    ours = ResNet50('NHWC', n_classes=CLASSES, width=WIDTH, version='1', pad_channels=4)
    ours.conv1.W.array[...] = 1.0
    load_chainer_example(str(tmp_path / 'model_iter_1'), ours)
    assert not ours.conv1.W.array[..., 3:].any()
    numpy.testing.assert_array_equal(ours.conv1.W.array[..., :3],
                                     example.conv1.W.array.transpose(0, 2, 3, 1))
    with chainer.using_config('train', False):
        want = example(_images('NCHW')).array
        got = ours(_images('NHWC')).array
    numpy.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_padded_model_pickles():
    import pickle
    model = make('NHWC', pad_channels=4)
    x, _ = batch('NHWC')
    with chainer.using_config('train', False):
        want = model(x).array
        copy = pickle.loads(pickle.dumps(model))
        assert copy.pad_channels == 4 and copy.conv1.pad_channels == 4
        numpy.testing.assert_array_equal(copy(x).array, want)


def test_padded_convolution_converts_to_nchw_without_its_padding():
    numpy.random.seed(0)
    conv = TL.Convolution2D(3, 5, 3, pad=1, pad_channels=4)
    conv.b.array[...] = numpy.arange(5)
    chain = chainer.Sequential(conv)
    x = numpy.random.RandomState(0).randn(2, 6, 6, 3).astype(numpy.float32)
    want = chain(x).array
    TL.to_nchw(chain)
    nchw = chain[0]
    assert type(nchw) is L.Convolution2D and nchw.W.shape == (5, 3, 3, 3)
    numpy.testing.assert_allclose(chain(x.transpose(0, 3, 1, 2).copy()).array,
                                  want.transpose(0, 3, 1, 2), rtol=1e-5, atol=1e-6)
    TL.to_nhwc(chain)                       # back: an unpadded NHWC link, the same function
    assert chain[0].pad_channels is None and chain[0].W.shape == (5, 3, 3, 3)
    numpy.testing.assert_allclose(chain(x).array, want, rtol=1e-5, atol=1e-6)

    bad = chainer.Sequential(TL.Convolution2D(3, 5, 3, pad_channels=4))
    bad[0].W.array[..., 3] = 1.0
    with pytest.raises(ValueError, match=r'cannot convert 0 to NCHW: .*padding channels \(3..3 '
                                         r'.*are not zero'):
        TL.to_nchw(bad)


def test_padded_model_replays_under_train_step():
    """The static-graph TrainStep replays the padded model fed 3-channel images (the model's
    pad op is part of the trace) with the bits of eager steps; the padding weights stay zero."""
    import copy
    from chainer_tc.static_graph import TrainStep
    model = make('NHWC', pad_channels=4)
    twin = copy.deepcopy(model)
    r = numpy.random.RandomState(0)
    data = [(r.randn(2, 32, 32, 3).astype(numpy.float32), r.randint(0, 10, 2).astype(numpy.int32))
            for _ in range(6)]
    opts = [optimizers.MomentumSGD(lr=0.05, weight_decay=1e-3).setup(m) for m in (model, twin)]

    def lossfun(m):
        return lambda x, t: F.softmax_cross_entropy(m(x), t)
    eager = []
    for x, t in data:
        holder = []
        opts[0].update(lambda: holder.append(lossfun(model)(x, t)) or holder[-1])
        eager.append(holder[-1].array.copy())
    step = TrainStep(twin, opts[1], lossfun(twin))
    with warnings.catch_warnings():
        warnings.simplefilter('error', RuntimeWarning)        # no "cannot be replayed"
        replayed = [step(x, t).array.copy() for x, t in data]
    assert step.replays == 3
    assert [a.tobytes() for a in eager] == [b.tobytes() for b in replayed]
    for (name, p), (_, q) in zip(sorted(model.namedparams()), sorted(twin.namedparams())):
        numpy.testing.assert_array_equal(p.array, q.array, err_msg=name)
    assert not twin.conv1.W.array[..., 3:].any()


def test_pad_channels_bad_arguments():
    with pytest.raises(ValueError, match=r'pad_channels must be 3 \(no padding\), 4 or 8, or '
                                         r'None \(3\); got 5'):
        ResNet50(width=16, pad_channels=5)
    for bad in (True, 4.0, '4'):
        with pytest.raises(TypeError, match='pad_channels must be 3'):
            ResNet50(width=16, pad_channels=bad)
    with pytest.raises(ValueError, match="pad_channels=4 needs layout='NHWC'"):
        ResNet50('NCHW', width=16, pad_channels=4)
    assert ResNet50('NCHW', width=16, pad_channels=3).pad_channels == 3
    with pytest.raises(ValueError, match='pad_channels needs in_channels'):
        TL.Convolution2D(None, 8, 3, pad_channels=4)
    with pytest.raises(ValueError, match='pad_channels needs in_channels'):
        TL.Convolution2D(8, 3, pad_channels=4)             # (out, ksize): lazy
    with pytest.raises(ValueError, match='pad_channels needs groups=1; got groups=3'):
        TL.Convolution2D(3, 6, 3, groups=3, pad_channels=4)
    with pytest.raises(ValueError, match='pad_channels=2 is smaller than in_channels=3'):
        TL.Convolution2D(3, 6, 3, pad_channels=2)
    with pytest.raises(TypeError, match='pad_channels must be an int'):
        TL.Convolution2D(3, 6, 3, pad_channels=4.0)
    assert TL.Convolution2D(3, 6, 3, pad_channels=3).W.shape == (6, 3, 3, 3)


def test_input_of_another_channel_count_is_an_error_naming_the_padding():
    model = make('NHWC', pad_channels=4)
    x, _ = batch('NHWC')
    with pytest.raises(ValueError, match=r'its 3 \(or 4, padded with zeros\) channels on the '
                                         r'last axis; got shape \(2, 32, 32, 8\)'):
        model(_padded_input(x, 8))
    with pytest.raises(ValueError, match=r'This looks like NCHW data'):
        model(_padded_input(x, 4).transpose(0, 3, 1, 2).copy())
    with pytest.raises(ValueError, match=r'its 3 channels on the last axis; got shape \(2, 32, '
                                         r'32, 4\)\. These look like RGB images padded with zero '
                                         r'channels .*pad_channels=4\): build the first '
                                         r'convolution \(ResNet50\) with the same pad_channels'):
        make('NHWC')(_padded_input(x, 4))


@pytest.mark.gpu
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float16])
def test_padded_conv1_on_the_gpu_equals_the_cpu(cudnn_stack, dtype):
    """The padded conv1 link alone, CuPy (cuDNN NHWC, 4-channel input) against NumPy: output and
    filter gradient within the dtype's rounding (one layer: no amplification; float16 products
    accumulate in float32 on both sides, the outputs round to float16: 2^-11 relative, with
    margin 1e-2 of the scale; float32 1e-5), the padding gradient exactly zero."""
    import cupy
    r = numpy.random.RandomState(5)
    with chainer.using_config('dtype', dtype):
        cpu = TL.Convolution2D(3, 16, 7, stride=2, pad=3, nobias=True, pad_channels=4)
    gpu = cpu.copy(mode='copy').to_gpu()
    x = r.randn(4, 32, 32, 3).astype(dtype)
    gy = r.randn(4, 16, 16, 16).astype(dtype)
    out = []
    for link, xp in ((cpu, numpy), (gpu, cupy)):
        y = link(xp.asarray(x))
        y.grad = xp.asarray(gy)
        link.cleargrads()
        y.backward()
        out.append([chainer.backend.CpuDevice().send(a).astype(numpy.float64)
                    for a in (y.array, link.W.grad)])
    (y_cpu, g_cpu), (y_gpu, g_gpu) = out
    tol = 1e-2 if dtype == numpy.float16 else 1e-5
    numpy.testing.assert_allclose(y_gpu, y_cpu, rtol=0, atol=tol * numpy.abs(y_cpu).max())
    numpy.testing.assert_allclose(g_gpu, g_cpu, rtol=0, atol=tol * numpy.abs(g_cpu).max())
    assert not g_gpu[..., 3:].any()


@pytest.mark.gpu
def test_padded_model_inference_on_the_gpu_equals_the_cpu(cudnn_stack):
    """The whole padded model in inference (running statistics: well conditioned, unlike a
    training step whose batch-4 BatchNorm in the last stage amplifies last-place differences):
    float32 logits within 1e-4 of their scale (TF32 is off in the test suite: conftest)."""
    import cupy
    cpu = make('NHWC', pad_channels=4)
    x, t = batch('NHWC', n=4)
    cpu(x)                                  # running statistics away from their initial values
    gpu = cpu.copy(mode='copy').to_gpu()
    with chainer.using_config('train', False):
        l_cpu = cpu(x).array.astype(numpy.float64)
        l_gpu = cupy.asnumpy(gpu(cupy.asarray(x)).array).astype(numpy.float64)
    numpy.testing.assert_allclose(l_gpu, l_cpu, rtol=0, atol=1e-4 * numpy.abs(l_cpu).max())


@pytest.mark.gpu
def test_padded_float16_conv1_runs_on_tensor_cores(cudnn_stack):
    """The cuDNN plans of the padded float16 conv1 (forward and backward filter: the input needs
    no gradient) use Tensor Core math, and the padding weights get a zero gradient."""
    import cupy
    from chainer_tc.cuda import conv as cuda_conv
    with chainer.using_config('dtype', numpy.float16):
        model = ResNet50('NHWC', width=1, n_classes=10, pad_channels=4).to_gpu()
    x = numpy.random.RandomState(0).randn(32, 224, 224, 3).astype(numpy.float16)
    cuda_conv.clear_plans()
    loss = F.sum(model.conv1(cupy.asarray(x)))
    model.cleargrads()
    loss.backward()
    plans = {key[0]: plan for key, plan in cuda_conv._plans.items() if key[3][3] == 4}
    assert sorted(plans) == ['backward_filter', 'forward']
    for name, plan in plans.items():
        assert plan.math_type in cuda_conv.TENSOR_CORE_MATH, (name, plan.algo, plan.math_type)
    assert not model.conv1.W.grad[..., 3:].any()
