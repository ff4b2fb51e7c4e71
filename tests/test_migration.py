"""Migrating a Chainer model to NHWC: the errors that point at the cause, feeding NCHW data sets,
float16 defaults of the links, and TF.cast (the float16 model's classifier cast)."""
import pickle
import warnings

import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer)
import chainer
import chainer.functions as F
import chainer.links as L
from chainer import gradient_check

from chainer_tc import functions as TF
from chainer_tc import links as TL


class OldNet(chainer.Chain):
    """A Chainer model whose forward pools with Chainer's NCHW function."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.conv1 = L.Convolution2D(3, 8, 3, pad=1)
            self.bn = L.BatchNormalization(8)
            self.conv2 = L.Convolution2D(8, 8, 3, pad=1)
            self.fc = L.Linear(8, 2)

    def forward(self, x, pool=F.max_pooling_2d):
        h = pool(F.relu(self.bn(self.conv1(x))), 2)
        h = self.conv2(h)
        return self.fc(F.mean(h, axis=(1, 2)))


def _nhwc_images(n=2):
    return numpy.random.RandomState(0).randn(n, 16, 16, 3).astype(numpy.float32)


# ---- errors that name the cause -----------------------------------------------------------------

def test_nchw_pooling_left_in_forward_is_named():
    model = TL.to_nhwc(OldNet())
    with pytest.raises(ValueError) as e:
        model(_nhwc_images())
    msg = str(e.value)
    assert msg.startswith('Convolution2D expects channels-last (NHWC) input with its 8 channels '
                          'on the last axis; got shape (2, 16, 8, 4).')
    assert 'F.max_pooling_2d -> chainer_tc.functions.max_pooling_2d' in msg
    assert 'F.average_pooling_2d -> chainer_tc.functions.average_pooling_2d' in msg
    assert msg.endswith('See docs/migrating.md.')
    # with the replacement, the same model runs
    model(_nhwc_images(), pool=TF.max_pooling_2d)


def test_nchw_data_into_an_nhwc_model_is_named():
    model = TL.to_nhwc(OldNet())
    x = _nhwc_images().transpose(0, 3, 1, 2).copy()
    with pytest.raises(ValueError, match=r'got shape \(2, 3, 16, 16\)\. This looks like NCHW data '
                                         r'.*nhwc_dataset\(dataset\).*nhwc_converter'):
        model(x)


def test_batch_normalization_link_names_the_cause_too():
    bn = TL.BatchNormalization(8)
    with pytest.raises(ValueError, match=r'BatchNormalization expects channels-last.*got shape '
                                         r'\(2, 8, 5, 5\)\. This looks like NCHW data'):
        bn(numpy.zeros((2, 8, 5, 5), numpy.float32))
    with pytest.raises(ValueError, match=r'got shape \(2, 5, 4, 4\)\. If this link follows '
                                         r'to_nhwc\(model\).*F\.max_pooling_2d'):
        TL.BatchNormAddReLU(8)(numpy.zeros((2, 5, 4, 4), numpy.float32))


# ---- NCHW data sets -----------------------------------------------------------------------------

def _nchw_dataset(n=5, dtype=numpy.float32):
    r = numpy.random.RandomState(1)
    return chainer.datasets.TupleDataset((r.rand(n, 3, 6, 4) * 255).astype(dtype),
                                         r.randint(0, 2, n).astype(numpy.int32))


def test_nhwc_dataset_transposes_each_image():
    base = _nchw_dataset()
    ds = TL.nhwc_dataset(base)
    assert len(ds) == len(base)
    x, t = ds[3]
    assert x.shape == (6, 4, 3) and x.flags.c_contiguous and t == base[3][1]
    numpy.testing.assert_array_equal(x, base[3][0].transpose(1, 2, 0))
    images = TL.nhwc_dataset(base._datasets[0])             # bare images, no tuple
    assert images[0].shape == (6, 4, 3)
    pickle.loads(pickle.dumps(ds))                          # MultiprocessIterator's workers
    swapped = TL.nhwc_dataset(chainer.datasets.TupleDataset(base._datasets[1],
                                                            base._datasets[0]), index=1)
    assert swapped[0][1].shape == (6, 4, 3)


def test_nhwc_dataset_errors():
    with pytest.raises(ValueError, match=r'expects images of shape \(C, H, W\); element 0 of the '
                                         r'example has shape \(\)'):
        TL.nhwc_dataset(chainer.datasets.TupleDataset(numpy.zeros(3), numpy.zeros(3)))[0]
    with pytest.raises(ValueError, match='index=2.*tuple of 2'):
        TL.nhwc_dataset(_nchw_dataset(), index=2)[0]
    with pytest.raises(TypeError, match='index must be an int'):
        TL.nhwc_dataset(_nchw_dataset(), index='x')


@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float16, numpy.float64, numpy.uint8])
def test_nhwc_converter(dtype):
    batch = [_nchw_dataset(dtype=dtype)[i] for i in range(4)]
    x, t = TL.nhwc_converter(batch)
    want, want_t = chainer.dataset.concat_examples(batch)
    assert x.dtype == dtype and x.shape == (4, 6, 4, 3) and x.flags.c_contiguous
    numpy.testing.assert_array_equal(x, want.transpose(0, 2, 3, 1))
    numpy.testing.assert_array_equal(t, want_t)


def test_nhwc_converter_drives_a_standard_updater():
    numpy.random.seed(0)
    model = L.Classifier(TL.to_nhwc(OldNet()),
                         lossfun=F.softmax_cross_entropy)
    model.predictor.forward = lambda x: OldNet.forward(model.predictor, x,
                                                       pool=TF.max_pooling_2d)
    opt = chainer.optimizers.SGD().setup(model)
    data = chainer.datasets.TupleDataset(
        numpy.random.RandomState(0).randn(4, 3, 16, 16).astype(numpy.float32),
        numpy.array([0, 1, 0, 1], numpy.int32))
    it = chainer.iterators.SerialIterator(data, 2)
    updater = chainer.training.StandardUpdater(it, opt, converter=TL.nhwc_converter)
    updater.update()
    assert numpy.isfinite(float(model.loss.array))
    with pytest.raises(ValueError, match=r'images of shape \(C, H, W\) first.*shape \(2, 3\)'):
        TL.nhwc_converter([(numpy.zeros(3, numpy.float32), 0)] * 2)


# ---- float16 defaults of the links --------------------------------------------------------------

@pytest.mark.parametrize('config_dtype', [numpy.float16, chainer.mixed16])
def test_batch_normalization_link_takes_float32_parameters_for_float16(config_dtype):
    with chainer.using_config('dtype', config_dtype):
        bn, lazy = TL.BatchNormAddReLU(8), TL.BatchNormalization()
        half = TL.BatchNormalization(8, dtype=numpy.float16)
        conv = TL.Convolution2D(3, 8, 3)
    assert bn.gamma.dtype == bn.beta.dtype == bn.avg_mean.dtype == numpy.float32
    assert half.gamma.dtype == half.avg_var.dtype == numpy.float16
    assert conv.W.dtype == numpy.float16
    x = numpy.random.RandomState(0).randn(4, 3, 3, 8).astype(numpy.float16)
    y = lazy(x)
    assert lazy.gamma.dtype == lazy.avg_mean.dtype == numpy.float32 and y.dtype == numpy.float16
    y = bn(x, x)
    y.grad = numpy.ones_like(y.array)
    bn.cleargrads()
    y.backward()
    assert bn.gamma.grad.dtype == numpy.float32 and numpy.isfinite(bn.gamma.grad).all()
    assert TL.BatchNormalization(8).gamma.dtype == numpy.float32     # float32 config: float32


def test_to_nhwc_gives_float16_bn_float32_parameters():
    with chainer.using_config('dtype', numpy.float16):
        old = OldNet()
    assert old.bn.gamma.dtype == numpy.float16
    ref_gamma = old.bn.gamma.array.copy()
    model = TL.to_nhwc(old)
    assert model.bn.gamma.dtype == model.bn.avg_mean.dtype == numpy.float32
    numpy.testing.assert_array_equal(model.bn.gamma.array, ref_gamma)
    assert model.conv1.W.dtype == numpy.float16
    TL.to_nchw(model)
    assert type(model.bn) is L.BatchNormalization and model.bn.gamma.dtype == numpy.float32


# ---- TF.cast ------------------------------------------------------------------------------------

@pytest.mark.parametrize('src,dst,tol', [(numpy.float64, numpy.float32, 1e-4),
                                         (numpy.float32, numpy.float64, 1e-4),
                                         (numpy.float16, numpy.float32, 1e-2)])
def test_cast_gradients(src, dst, tol):
    r = numpy.random.RandomState(0)
    x = r.randn(3, 4).astype(src)
    gy = r.randn(3, 4).astype(dst)
    ggx = r.randn(3, 4).astype(src)
    y = TF.cast(x, dst)
    assert y.dtype == dst
    numpy.testing.assert_array_equal(y.array, x.astype(dst))
    gradient_check.check_backward(lambda a: TF.cast(a, dst), x, gy, dtype=numpy.float64,
                                  atol=tol, rtol=tol)
    gradient_check.check_double_backward(lambda a: TF.cast(a, dst), x, gy, ggx,
                                         dtype=numpy.float64, atol=tol, rtol=tol)


def test_cast_backward_overflows_quietly_and_forward_warns():
    x = chainer.Variable(numpy.ones(3, numpy.float16))
    y = TF.cast(x, numpy.float32)
    y.grad = numpy.array([1e6, -1e6, 1.0], numpy.float32)      # beyond float16's 65504
    with warnings.catch_warnings():
        warnings.simplefilter('error', RuntimeWarning)
        y.backward()
    assert x.grad.dtype == numpy.float16
    assert list(x.grad) == [numpy.inf, -numpy.inf, 1.0]
    with pytest.warns(RuntimeWarning, match='overflow'):
        TF.cast(numpy.array([1e6], numpy.float32), numpy.float16)


def test_cast_refuses_non_floating():
    with pytest.raises(TypeError, match='floating dtypes only; got dtype int32'):
        TF.cast(numpy.ones(2, numpy.float32), numpy.int32)
    with pytest.raises(TypeError, match='floating-point x; got int32'):
        TF.cast(numpy.ones(2, numpy.int32), numpy.float32)


# ---- the recipe of docs/migrating.md, end to end ------------------------------------------------

def _recipe_trainer(out, stop, data):
    """train_imagenet.py as docs/migrating.md changes it, on a tiny NCHW data set, float16."""
    from chainer_tc import optimizers
    from chainer_tc.models import ResNet50
    numpy.random.seed(0)
    with chainer.using_config('dtype', numpy.float16):
        model = L.Classifier(ResNet50(n_classes=2, width=16, version='1'))
        train = TL.nhwc_dataset(data)
        it = chainer.iterators.MultiprocessIterator(train, 4, n_processes=1)    # 4 per epoch
        optimizer = optimizers.MomentumSGD(lr=0.01, momentum=0.9)
        optimizer.setup(model)
        # this tiny v1 model's first gradients (BN over 4 rows per channel in the last stage)
        # overflow float16 at the default initial scale 2**15 for several steps: start lower
        optimizer.loss_scaling(initial_scale=2.0 ** 6)
        updater = chainer.training.StandardUpdater(it, optimizer)
        trainer = chainer.training.Trainer(updater, (stop, 'iteration'), out=out)
        trainer.extend(chainer.training.extensions.snapshot(filename='snap_{.updater.iteration}'),
                       trigger=(2, 'iteration'))
        trainer.extend(chainer.training.extensions.LogReport(trigger=(1, 'iteration')))
    return trainer, model, it


def test_the_migration_recipe_trains_and_resumes(tmp_path):
    from chainer_tc import serializers
    r = numpy.random.RandomState(0)
    data = chainer.datasets.TupleDataset(r.randn(16, 3, 32, 32).astype(numpy.float32),
                                         r.randint(0, 2, 16).astype(numpy.int32))
    full, full_model, it1 = _recipe_trainer(str(tmp_path / 'full'), 3, data)
    with chainer.using_config('dtype', numpy.float16):
        full.run()
    first, _, it2 = _recipe_trainer(str(tmp_path / 'first'), 2, data)
    with chainer.using_config('dtype', numpy.float16):
        first.run()
    resumed, resumed_model, it3 = _recipe_trainer(str(tmp_path / 'resumed'), 3, data)
    serializers.load_npz(str(tmp_path / 'first' / 'snap_2'), resumed)
    with chainer.using_config('dtype', numpy.float16):
        resumed.run()
    for i in (it1, it2, it3):
        i.finalize()
    assert full_model.predictor.conv1.W.dtype == numpy.float16
    assert numpy.isfinite(float(full_model.loss.array))
    _, initial, it4 = _recipe_trainer(str(tmp_path / 'unused'), 3, data)
    it4.finalize()
    assert not numpy.array_equal(initial.predictor.conv1.W.array,
                                 full_model.predictor.conv1.W.array), 'the steps were taken'
    for (n1, p1), (n2, p2) in zip(sorted(full_model.namedparams()),
                                  sorted(resumed_model.namedparams())):
        numpy.testing.assert_array_equal(p1.array, p2.array, err_msg=n1)
