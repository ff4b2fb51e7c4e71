"""NaN propagates through the fused BatchNorm(+Add)+ReLU as through Chainer's relu(BN(x) + z):
on the NumPy path and through the emulated kernels (the issue 'no silent wrong results')."""
import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer)
import chainer
import chainer.functions as F

from chainer_tc import functions as TF


@pytest.mark.parametrize('path', ['numpy', 'emulator'])
@pytest.mark.parametrize('with_z, where', [(False, 'x'), (False, 'gamma'), (True, 'x'),
                                           (True, 'z'), (True, 'gamma')])
def test_nan_in_gives_nan_out_where_chainer_gives_it(monkeypatch, path, with_z, where):
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1' if path == 'emulator' else '0')
    r = numpy.random.RandomState(0)
    x = r.randn(2, 3, 4, 8).astype(numpy.float32)
    z = r.randn(*x.shape).astype(numpy.float32)
    gamma, beta = r.rand(8).astype(numpy.float32) + 0.5, r.randn(8).astype(numpy.float32)
    {'x': x, 'z': z, 'gamma': gamma}[where].flat[3] = numpy.nan
    y = TF.batch_normalization_add_relu(x, z if with_z else None, gamma, beta).array
    ref = F.batch_normalization(x.transpose(0, 3, 1, 2), gamma, beta)
    if with_z:
        ref = ref + z.transpose(0, 3, 1, 2)
    ref = F.relu(ref).array.transpose(0, 2, 3, 1)
    assert numpy.isnan(ref).any()
    numpy.testing.assert_array_equal(numpy.isnan(y), numpy.isnan(ref))
    finite = ~numpy.isnan(ref)
    numpy.testing.assert_allclose(y[finite], ref[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('path', ['numpy', 'emulator'])
@pytest.mark.parametrize('dtype', [numpy.float16, numpy.float32, numpy.float64])
def test_max_pooling_propagates_nan_like_chainer(monkeypatch, path, dtype):
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1' if path == 'emulator' else '0')
    r = numpy.random.RandomState(1)
    x = r.randn(2, 7, 6, 3).astype(dtype)
    x[0, 1, 2, 0] = numpy.nan          # inside several windows
    x[1, 6, 5, 2] = numpy.nan          # a corner
    x[1, 3, 3, 1] = numpy.nan
    x[1, 3, 4, 1] = numpy.nan          # two NaN in one window: the first one's gradient
    xv = chainer.Variable(x)
    y = TF.max_pooling_2d(xv, 3, stride=2, pad=1)
    rv = chainer.Variable(x.transpose(0, 3, 1, 2).copy())
    ref = F.max_pooling_2d(rv, 3, stride=2, pad=1)
    numpy.testing.assert_array_equal(y.array, ref.array.transpose(0, 2, 3, 1))
    gy = r.randn(*y.shape).astype(dtype)
    y.grad = gy
    y.backward()
    ref.grad = gy.transpose(0, 3, 1, 2).copy()
    ref.backward()
    # where windows overlap, gradients are summed in another order (and in float32 for float16
    # data): a rounding apart; the NaN-free positions and the routing are what is tested
    eps = numpy.finfo(dtype).eps
    numpy.testing.assert_allclose(xv.grad, rv.grad.transpose(0, 2, 3, 1), rtol=2 * eps,
                                  atol=4 * eps)


@pytest.mark.gpu
def test_cudnn_fused_path_propagates_nan_like_chainer():
    import cupy
    r = numpy.random.RandomState(0)
    x = r.randn(2, 3, 4, 8).astype(numpy.float16)         # float16 NHWC, C % 4 == 0: cuDNN's
    z = r.randn(*x.shape).astype(numpy.float16)
    gamma, beta = r.rand(8).astype(numpy.float32) + 0.5, r.randn(8).astype(numpy.float32)
    x[0, 1, 1, 3] = numpy.nan
    y = TF.batch_normalization_add_relu(*(cupy.asarray(a) for a in (x, z, gamma, beta))).array
    ref = F.relu(F.batch_normalization(x.astype(numpy.float32).transpose(0, 3, 1, 2), gamma,
                                       beta) + z.astype(numpy.float32).transpose(0, 3, 1, 2))
    numpy.testing.assert_array_equal(numpy.isnan(cupy.asnumpy(y)),
                                     numpy.isnan(ref.array.transpose(0, 2, 3, 1)))


def test_resnet50_fed_a_nan_pixel_gives_nan_logits_as_chainer():
    from chainer_tc.models import ResNet50
    r = numpy.random.RandomState(0)
    x = r.randn(2, 3, 32, 32).astype(numpy.float32)
    x[1, 0, 5, 7] = numpy.nan
    outs = []
    for layout in ('NCHW', 'NHWC'):
        numpy.random.seed(0)
        model = ResNet50(layout, n_classes=5, width=16)
        outs.append(model(x if layout == 'NCHW' else x.transpose(0, 2, 3, 1).copy()).array)
    assert numpy.isnan(outs[0]).any()
    numpy.testing.assert_array_equal(numpy.isnan(outs[1]), numpy.isnan(outs[0]))
