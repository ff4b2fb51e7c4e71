"""to_nhwc / to_nchw: links replaced in place, same function on transposed data, and back."""
import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer)
import chainer
import chainer.functions as F
import chainer.links as L

from chainer_tc import links as TL

from nets import ConvertibleNet as Net


def test_to_nhwc_and_back():
    numpy.random.seed(0)
    model = Net()
    x = numpy.random.RandomState(1).randn(2, 3, 5, 5).astype(numpy.float32)
    model(x)                                          # running statistics move away from 0/1
    with chainer.using_config('train', False):
        ref = model(x).array
    TL.to_nhwc(model)
    assert isinstance(model.conv, TL.Convolution2D) and isinstance(model.bn, TL.BatchNormalization)
    assert isinstance(model.blocks[0], TL.Convolution2D) and model.blocks[0].groups == 2
    assert model.blocks[1].gamma is None
    assert sorted(n for n, _ in model.namedparams()) == [
        '/blocks/0/W', '/blocks/1/beta', '/bn/beta', '/bn/gamma', '/conv/W', '/conv/b', '/fc/W',
        '/fc/b']
    with chainer.using_config('train', False):
        out = model(x.transpose(0, 2, 3, 1).copy(), nhwc=True).array
    numpy.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    TL.to_nchw(model)
    assert type(model.conv) is L.Convolution2D and type(model.bn) is L.BatchNormalization
    with chainer.using_config('train', False):
        numpy.testing.assert_allclose(model(x).array, ref, rtol=1e-5, atol=1e-6)


def test_a_top_level_link_is_returned_converted():
    conv = TL.to_nhwc(L.Convolution2D(3, 4, 3))
    assert isinstance(conv, TL.Convolution2D)


def test_unconvertible():
    with pytest.raises(ValueError, match=r'axis \(0, 1\)'):
        TL.to_nhwc(L.BatchNormalization(axis=(0, 1)))
    with pytest.raises(ValueError, match='fuses BatchNorm, Add and ReLU'):
        TL.to_nchw(TL.BatchNormAddReLU(4))
    with pytest.raises(TypeError, match='must be a chainer.Link'):
        TL.to_nhwc(object())


def test_sequential_forward_uses_the_converted_links():
    numpy.random.seed(0)
    seq = chainer.Sequential(L.Convolution2D(3, 4, 3, pad=1), L.BatchNormalization(4), F.relu)
    x = numpy.random.randn(2, 3, 5, 5).astype(numpy.float32)
    ref = seq(x).array
    TL.to_nhwc(seq)
    assert all(a is b for a, b in zip(seq._layers[:2], seq.children()))
    assert isinstance(seq._layers[0], TL.Convolution2D)
    y = seq(x.transpose(0, 2, 3, 1).copy()).array
    numpy.testing.assert_allclose(y.transpose(0, 3, 1, 2), ref, rtol=1e-5, atol=1e-5)
    params = {id(p) for p in seq.params()}
    seq.cleargrads()
    F.sum(seq(x.transpose(0, 2, 3, 1).copy())).backward()
    assert all(p.grad is not None for p in seq.params()), 'the optimizer trains what forward uses'
    assert len(params) == 4
