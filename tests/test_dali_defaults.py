"""chainer_tc.dali defaults: the device the machine has, the dtype of chainer.config.dtype,
ImageNet's normalisation unless a mean/std (or Chainer's example's mean file) is given, and the
(root, list) argument order. CPU pipelines on a small generated image set (tests/dali_data.py)."""
import warnings

import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer: CUDA libraries)
import chainer

from chainer_tc import dali
from chainer_tc.dali import check
from chainer_tc.dali import pipeline as pipeline_module

import dali_data

N = 8
CROP = 32
IMAGENET_MEAN = 255 * numpy.array(dali.IMAGENET_MEAN)
IMAGENET_STD = 255 * numpy.array(dali.IMAGENET_STD)


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    return dali_data.make_dataset(tmp_path_factory.mktemp('dali_defaults'), n=N)


def _gpu():
    return pipeline_module._cupy_sees_a_gpu()


def validation(data, **kwargs):
    """One batch of every image through the (deterministic) validation pipeline, as float64."""
    args = dict(train=False, crop=CROP, seed=1, num_threads=2, dtype=numpy.float32)
    args.update(kwargs)
    p = dali.imagenet_pipeline(data.root, data.ids_list, **args)
    it = dali.DaliIterator(p, batch_size=N, repeat=False)
    try:
        x, _ = next(it)
        return p, chainer.backend.CpuDevice().send(x).astype(numpy.float64)
    finally:
        it.finalize()


# ---- device and dtype ---------------------------------------------------------------------------

def test_device_defaults_to_what_cupy_sees(data, monkeypatch):
    p = dali.imagenet_pipeline(data.root, data.ids_list, check_files=False)
    assert p.device == ('gpu' if _gpu() else 'cpu')
    if not _gpu():      # a GPU would be chosen if CuPy saw one: here it then fails clearly
        monkeypatch.setattr(pipeline_module, '_cupy_sees_a_gpu', lambda: True)
        with pytest.raises(RuntimeError, match="device='gpu' needs"):
            dali.imagenet_pipeline(data.root, data.ids_list)


@pytest.mark.parametrize('config,want', [(numpy.float32, numpy.float32),
                                         (numpy.float16, numpy.float16),
                                         (chainer.mixed16, numpy.float16)])
def test_dtype_defaults_to_chainer_config(data, config, want):
    with chainer.using_config('dtype', config):
        p, _ = validation(data, dtype=None, device='cpu')
    assert p.dtype == want
    it = dali.DaliIterator(p, batch_size=4, repeat=False)
    x, _ = next(it)
    it.finalize()
    assert x.dtype == want
    explicit = dali.imagenet_pipeline(data.root, data.ids_list, dtype=numpy.float32,
                                      device='cpu')
    assert explicit.dtype == numpy.float32


def test_float64_config_needs_an_explicit_dtype(data):
    with chainer.using_config('dtype', numpy.float64):
        with pytest.raises(ValueError, match='dtype defaults to chainer.config.dtype, which is '
                                             'float64; DALI outputs float16 or float32'):
            dali.imagenet_pipeline(data.root, data.ids_list, device='cpu')


# ---- normalisation ------------------------------------------------------------------------------

def test_default_is_imagenets_and_mean_std_are_per_channel_0_255(data):
    p, x = validation(data, device='cpu')
    numpy.testing.assert_allclose(p.mean, IMAGENET_MEAN)
    numpy.testing.assert_allclose(p.std, IMAGENET_STD)
    pixels = x * IMAGENET_STD + IMAGENET_MEAN             # what DALI normalised
    mean, std = (100.0, 120.0, 90.0), (50.0, 60.0, 70.0)
    q, y = validation(data, device='cpu', mean=mean, std=std)
    assert q.mean == mean and q.std == std
    numpy.testing.assert_allclose(y, (pixels - mean) / std, atol=1e-4)
    _, z = validation(data, device='cpu', mean=mean, std=255)     # one std for every channel
    numpy.testing.assert_allclose(z, (pixels - mean) / 255, atol=1e-4)


def test_chainers_example_mean_file_is_reduced_to_channel_means(data, tmp_path):
    r = numpy.random.RandomState(0)
    image = (r.rand(3, 256, 256) * 40 + numpy.array([110, 120, 100])[:, None, None])
    numpy.save(str(tmp_path / 'mean.npy'), image.astype(numpy.float32))
    want = image.astype(numpy.float32).mean(axis=(1, 2))
    p, x = validation(data, device='cpu', mean=str(tmp_path / 'mean.npy'), std=255)
    numpy.testing.assert_allclose(p.mean, want, rtol=1e-6)
    _, y = validation(data, device='cpu', mean=tuple(float(v) for v in p.mean), std=255)
    numpy.testing.assert_array_equal(x, y)
    _, z = validation(data, device='cpu', mean=image)       # an array works as the file does
    assert numpy.isfinite(z).all()


def test_a_pickled_mean_file_is_refused(data, tmp_path):
    numpy.save(str(tmp_path / 'evil.npy'), numpy.array([object(), 1, 2], dtype=object),
               allow_pickle=True)
    with pytest.raises(ValueError, match=r"mean: the mean file '.*evil\.npy' is not a \.npy array "
                                         r"of numbers"):
        dali.imagenet_pipeline(data.root, data.ids_list, device='cpu',
                               mean=str(tmp_path / 'evil.npy'))


@pytest.mark.parametrize('kwargs,error,message', [
    (dict(mean=(1, 2, 3, 4)), ValueError, r'mean must be 3 numbers .*has shape \(4,\)'),
    (dict(mean=(0.485, 0.456, 0.406)), ValueError, 'look like fractions of 255'),
    (dict(mean=(300, 0, 0)), ValueError, 'mean is on the 0-255 scale'),
    (dict(mean='no_such_mean.npy'), FileNotFoundError, "mean: the mean file 'no_such_mean.npy'"),
    (dict(mean='abc'), FileNotFoundError, 'does not exist'),
    (dict(mean=('a', 'b', 'c')), TypeError, 'mean must be numbers'),
    (dict(std=(1, 2)), ValueError, r'std must be one number or 3 \(RGB\); got shape \(2,\)'),
    (dict(std=0), ValueError, 'std must be positive and finite'),
    (dict(std=(0.229, 0.224, 0.225)), ValueError, 'std is on the 0-255 scale.*fractions'),
])
def test_bad_mean_and_std_name_the_argument(data, kwargs, error, message):
    with pytest.raises(error, match=message):
        dali.imagenet_pipeline(data.root, data.ids_list, device='cpu', **kwargs)


def test_a_zero_mean_is_taken_for_pixels_in_0_1():
    """mean=0, std=255: pixels scaled to [0, 1]; a zero mean is no fraction of 255."""
    from chainer_tc.dali import normalisation
    assert normalisation.channel_mean((0, 0, 0)) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match='look like fractions of 255'):
        normalisation.channel_mean((0, 0.5, 0.5))


# ---- (root, list) everywhere --------------------------------------------------------------------

def test_old_argument_order_still_works_with_a_deprecation_warning(data):
    with pytest.warns(DeprecationWarning, match=r'takes \(root, list_file\)'):
        old = dali.imagenet_pipeline(data.ids_list, data.root, device='cpu')
    new = dali.imagenet_pipeline(data.root, data.ids_list, device='cpu')
    assert old.root == new.root and old.list_file == new.list_file
    assert old.dataset.paths == new.dataset.paths
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        dali.imagenet_pipeline(data.root, data.ids_list, device='cpu')


def test_dali_check_takes_root_then_list_and_the_old_order_with_a_notice(data, capsys):
    assert check.main([data.root, data.ids_list, '--no-decode']) == 0
    assert 'deprecated' not in capsys.readouterr().err
    with pytest.warns(DeprecationWarning):
        assert check.main([data.ids_list, data.root, '--no-decode']) == 0
    assert 'dali-check: deprecated: dali-check takes ROOT LIST' in capsys.readouterr().err


def test_error_hints_name_root_then_list(data, tmp_path):
    lst = tmp_path / 'bad.txt'
    lst.write_text('missing.jpg 0\n')
    with pytest.raises(dali.DatasetError, match='dali-check {} {} lists'.format(data.root, lst)):
        dali.imagenet_pipeline(data.root, str(lst), device='cpu')
