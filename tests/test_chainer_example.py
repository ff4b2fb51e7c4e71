"""load_chainer_example: an npz of Chainer's ImageNet example's ResNet50 loads into
ResNet50(version='1') in either layout and gives the same outputs.

The test builds its own narrow model with the example's parameter names and structure (stride on
the first 1x1 convolution, a biased first convolution, projection shortcut conv4/bn4, stages
res2..res5 as ChainLists, unpadded ceil-mode max pooling), written for this test."""
import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer)
import chainer
import chainer.functions as F
import chainer.links as L

from chainer_tc.models import load_chainer_example
from chainer_tc.models import ResNet50

WIDTH, CLASSES = 16, 7


class _Unit(chainer.Chain):
    def __init__(self, in_ch, mid, out, stride, project):
        super().__init__()
        with self.init_scope():
            for i, (a, b, k, s) in enumerate([(in_ch, mid, 1, stride), (mid, mid, 3, 1),
                                               (mid, out, 1, 1)], 1):
                setattr(self, 'conv%d' % i, L.Convolution2D(a, b, k, s, k // 2, nobias=True))
                setattr(self, 'bn%d' % i, L.BatchNormalization(b))
            if project:
                self.conv4 = L.Convolution2D(in_ch, out, 1, stride, 0, nobias=True)
                self.bn4 = L.BatchNormalization(out)
        self.project = project

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        h = self.bn3(self.conv3(h))
        return F.relu(h + (self.bn4(self.conv4(x)) if self.project else x))


class ExampleLikeResNet50(chainer.Chain):
    def __init__(self, w=WIDTH, n_classes=CLASSES):
        super().__init__()
        c = 64 // w
        with self.init_scope():
            self.conv1 = L.Convolution2D(3, c, 7, 2, 3)          # with a bias, as the example
            self.bn1 = L.BatchNormalization(c)
            in_ch = c
            for name, n, mid, stride in (('res2', 3, 64, 1), ('res3', 4, 128, 2),
                                         ('res4', 6, 256, 2), ('res5', 3, 512, 2)):
                units = chainer.ChainList()
                for i in range(n):
                    units.add_link(_Unit(in_ch, mid // w, 4 * mid // w, stride if i == 0 else 1,
                                         i == 0))
                    in_ch = 4 * mid // w
                setattr(self, name, units)
            self.fc = L.Linear(in_ch, n_classes)

    def forward(self, x):
        h = F.max_pooling_2d(F.relu(self.bn1(self.conv1(x))), 3, stride=2)
        for stage in (self.res2, self.res3, self.res4, self.res5):
            for unit in stage:
                h = unit(h)
        return self.fc(F.average_pooling_2d(h, h.shape[2:]))


def _trained_example(seed=0):
    """The example's model with every parameter and statistic away from its initial value."""
    numpy.random.seed(seed)
    model = ExampleLikeResNet50()
    r = numpy.random.RandomState(seed)
    for name, p in model.namedparams():
        if p.ndim == 1:
            p.array[...] = r.uniform(0.5, 1.5, p.shape) if name.endswith('gamma') \
                else r.randn(*p.shape) * 0.1
    for _ in range(2):                      # running statistics, N
        model(r.randn(4, 3, 64, 64).astype(model.conv1.W.dtype))
    return model


def _images(layout, seed=5):
    x = numpy.random.RandomState(seed).randn(3, 3, 64, 64).astype(numpy.float32)
    return x.transpose(0, 2, 3, 1).copy() if layout == 'NHWC' else x


def test_the_example_names_its_parameters_as_the_loader_expects():
    names = {n for n, _ in _trained_example().namedparams()}
    assert {'/conv1/W', '/conv1/b', '/res2/0/conv4/W', '/res3/3/bn3/gamma', '/fc/b'} <= names


@pytest.mark.parametrize('layout', ['NCHW', 'NHWC'])
@pytest.mark.parametrize('train', [False, True])
def test_loaded_model_gives_the_examples_outputs(tmp_path, layout, train):
    example = _trained_example()
    chainer.serializers.save_npz(str(tmp_path / 'model_iter_1'), example)
    ours = ResNet50(layout, n_classes=CLASSES, width=WIDTH, version='1')
    load_chainer_example(str(tmp_path / 'model_iter_1'), ours)
    assert ours.bn1.N == example.bn1.N
    x = _images('NCHW')
    with chainer.using_config('train', train):
        want = example(x).array
        got = ours(_images(layout)).array
    # training: batch statistics over the 12 rows per channel of the last stage amplify the
    # float32 rounding differences of the two computations
    tol = 1e-3 if train else 1e-4
    numpy.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_from_a_trainer_snapshot_with_path(tmp_path):
    example = _trained_example()
    opt = chainer.optimizers.MomentumSGD().setup(example)
    updater = chainer.training.StandardUpdater(
        chainer.iterators.SerialIterator([(_images('NCHW')[0], numpy.int32(0))], 1), opt,
        loss_func=lambda x, t: F.softmax_cross_entropy(example(x), t))
    trainer = chainer.training.Trainer(updater, (1, 'iteration'), out=str(tmp_path))
    trainer.run()
    chainer.serializers.save_npz(str(tmp_path / 'snapshot'), trainer)
    ours = ResNet50('NHWC', n_classes=CLASSES, width=WIDTH, version='1')
    with pytest.raises(ValueError, match="path='updater/model:main/'"):
        load_chainer_example(str(tmp_path / 'snapshot'), ours)
    load_chainer_example(str(tmp_path / 'snapshot'), ours, path='updater/model:main/')
    again = ResNet50('NHWC', n_classes=CLASSES, width=WIDTH, version='1')
    load_chainer_example(str(tmp_path / 'snapshot'), again, path='updater/model:main')
    numpy.testing.assert_array_equal(again.conv1.W.array, ours.conv1.W.array)   # no slash: same
    with chainer.using_config('train', False):
        numpy.testing.assert_allclose(ours(_images('NHWC')).array,
                                      example(_images('NCHW')).array, rtol=1e-4, atol=1e-4)


def test_float16_example_into_a_float16_model(tmp_path):
    with chainer.using_config('dtype', numpy.float16):
        example = _trained_example()
        chainer.serializers.save_npz(str(tmp_path / 'm.npz'), example)
        ours = ResNet50('NHWC', n_classes=CLASSES, width=WIDTH, version='1')
    load_chainer_example(str(tmp_path / 'm.npz'), ours)
    assert ours.conv1.W.dtype == numpy.float16 and ours.bn1.gamma.dtype == numpy.float32
    with chainer.using_config('train', False):
        want = example(_images('NCHW').astype(numpy.float16)).array.astype(numpy.float32)
        got = ours(_images('NHWC')).array
    numpy.testing.assert_allclose(got, want, rtol=5e-2, atol=5e-2)


def test_refusals(tmp_path):
    example = _trained_example()
    chainer.serializers.save_npz(str(tmp_path / 'm.npz'), example)
    with pytest.raises(ValueError, match="version='1' to load it; got version='1.5'"):
        load_chainer_example(str(tmp_path / 'm.npz'),
                             ResNet50(n_classes=CLASSES, width=WIDTH))
    with pytest.raises(ValueError, match=r"res2/0/bn1/avg_mean has shape \(4,\) in the file; "
                                         r"this model's blocks/0/bn1/avg_mean needs \(8,\).*"
                                         r"n_classes=7, width=8"):
        load_chainer_example(str(tmp_path / 'm.npz'),
                             ResNet50(n_classes=CLASSES, width=8, version='1'))
    with pytest.raises(ValueError, match=r'fc/W has shape \(7, 128\).*n_classes=5'):
        load_chainer_example(str(tmp_path / 'm.npz'),
                             ResNet50(n_classes=5, width=WIDTH, version='1'))
    with pytest.raises(TypeError, match='must be a chainer_tc.models.ResNet50'):
        load_chainer_example(str(tmp_path / 'm.npz'), example)
    arrays = dict(numpy.load(str(tmp_path / 'm.npz')))
    del arrays['res4/5/bn2/avg_var']
    arrays['res6/0/conv1/W'] = numpy.zeros(1)
    numpy.savez(str(tmp_path / 'odd.npz'), **arrays)
    with pytest.raises(ValueError, match="not parameters of Chainer's example's ResNet50: "
                                         "res6/0/conv1/W"):
        load_chainer_example(str(tmp_path / 'odd.npz'),
                             ResNet50(n_classes=CLASSES, width=WIDTH, version='1'))
    del arrays['res6/0/conv1/W']
    arrays['res2/00/conv1/W'] = arrays['res2/0/conv1/W']      # '00' is no index of the example
    numpy.savez(str(tmp_path / 'odd.npz'), **arrays)
    with pytest.raises(ValueError, match="not parameters of Chainer's example's ResNet50: "
                                         "res2/00/conv1/W"):
        load_chainer_example(str(tmp_path / 'odd.npz'),
                             ResNet50(n_classes=CLASSES, width=WIDTH, version='1'))
    del arrays['res2/00/conv1/W']
    numpy.savez(str(tmp_path / 'odd.npz'), **arrays)
    with pytest.raises(ValueError, match='lacks 1 array.*blocks/12/bn2/avg_var'):
        load_chainer_example(str(tmp_path / 'odd.npz'),
                             ResNet50(n_classes=CLASSES, width=WIDTH, version='1'))
