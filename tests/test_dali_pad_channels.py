"""imagenet_pipeline(..., pad_channels=4 or 8): the images with zero channels appended, in both
layouts, training and validation, the real channels bit for bit those of the unpadded pipeline
(the same seed, the same crops and flips); a padded batch feeds ResNet50(pad_channels=...) and
gives the logits of the unpadded batch. CPU pipelines here; the GPU pipeline is a ``gpu`` test."""
import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer)
import chainer

from chainer_tc import dali
from chainer_tc.models import ResNet50

import dali_data

N = 11


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    return dali_data.make_dataset(tmp_path_factory.mktemp('dali_pad'), n=N)


def first_batch(data, batch_size=N, **kwargs):
    args = dict(device='cpu', crop=32, seed=5, num_threads=2, dtype=numpy.float16)
    args.update(kwargs)
    it = dali.DaliIterator(dali.imagenet_pipeline(data.root, data.ids_list, **args), batch_size,
                           repeat=False, shuffle=False)
    try:
        return next(it)
    finally:
        it.finalize()


def channels_last(x, layout):
    return x if layout == 'NHWC' else x.transpose(0, 2, 3, 1)


@pytest.mark.parametrize('pad_channels', [4, 8])
@pytest.mark.parametrize('layout', ['NHWC', 'NCHW'])
@pytest.mark.parametrize('train', [False, True])
def test_padded_images_are_the_unpadded_ones_with_zero_channels(data, pad_channels, layout,
                                                                train):
    plain, t_plain = first_batch(data, layout=layout, train=train)
    padded, t_padded = first_batch(data, layout=layout, train=train, pad_channels=pad_channels)
    assert padded.dtype == numpy.float16
    assert padded.shape == ((N, 32, 32, pad_channels) if layout == 'NHWC'
                            else (N, pad_channels, 32, 32))
    numpy.testing.assert_array_equal(t_padded, t_plain)
    p, q = channels_last(padded, layout), channels_last(plain, layout)
    numpy.testing.assert_array_equal(p[..., :3], q)        # the same crops, flips and values
    assert (p[..., 3:] == 0).all() and not numpy.signbit(p[..., 3:]).any()    # +0.0 exactly


def test_pad_channels_setting_and_refusals(data):
    kwargs = dict(device='cpu', check_files=False)
    assert dali.imagenet_pipeline(data.root, data.ids_list, **kwargs).pad_channels == 3
    assert dali.imagenet_pipeline(data.root, data.ids_list, pad_channels=8,
                                  **kwargs).pad_channels == 8
    for bad in (5, 16, 2, True, 4.0, '4'):
        error = ValueError if type(bad) is int else TypeError
        with pytest.raises(error, match=r'pad_channels must be 3 \(no padding\), 4 or 8, '
                                        r'or None \(3\); got'):
            dali.imagenet_pipeline(data.root, data.ids_list, pad_channels=bad, **kwargs)


@pytest.mark.parametrize('pad_channels', [4, 8])
def test_a_padded_batch_feeds_the_padded_model_like_the_unpadded_batch(data, pad_channels):
    plain, _ = first_batch(data, train=False, dtype=numpy.float32)
    padded, _ = first_batch(data, train=False, dtype=numpy.float32, pad_channels=pad_channels)
    numpy.random.seed(0)
    model = ResNet50('NHWC', n_classes=5, width=16, pad_channels=pad_channels)
    with chainer.using_config('train', False):
        numpy.testing.assert_array_equal(model(padded).array, model(plain).array)


@pytest.mark.gpu
@pytest.mark.parametrize('pad_channels', [4, 8])
@pytest.mark.parametrize('layout', ['NHWC', 'NCHW'])
def test_gpu_pipeline_pads_with_zeros(dali_stack, data, pad_channels, layout):
    """crop_mirror_normalize(pad_output=True) on the GPU (DALI's HWC uint8 fast kernel), and
    fn.pad for 8: zero channels appended to what the unpadded GPU pipeline gives."""
    import cupy
    plain, _ = first_batch(data, device='gpu', layout=layout, train=False)
    padded, _ = first_batch(data, device='gpu', layout=layout, train=False,
                            pad_channels=pad_channels)
    assert isinstance(padded, cupy.ndarray) and padded.dtype == numpy.float16
    p = channels_last(cupy.asnumpy(padded), layout)
    q = channels_last(cupy.asnumpy(plain), layout)
    assert p.shape == q.shape[:3] + (pad_channels,)
    numpy.testing.assert_array_equal(p[..., :3], q)
    assert (p[..., 3:] == 0).all()
