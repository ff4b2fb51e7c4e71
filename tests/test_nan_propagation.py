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
