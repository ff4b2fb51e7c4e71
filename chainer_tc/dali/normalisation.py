"""The per-channel mean and standard deviation the pipelines normalise with, on the 0-255 scale.

    channel_mean(None)          # ImageNet's: 255 * (0.485, 0.456, 0.406)
    channel_mean('mean.npy')    # Chainer's example's mean image (3, 256, 256): its channel means
    channel_std(255)            # Chainer's example: (x - mean) / 255
"""
import os

import numpy

IMAGENET_MEAN = (0.485, 0.456, 0.406)      # RGB, as fractions of 255
IMAGENET_STD = (0.229, 0.224, 0.225)


def channel_mean(mean):
    """(r, g, b) floats from None, 3 numbers, a (3,) or (3, H, W) array, or a .npy path."""
    if mean is None:
        return tuple(255.0 * m for m in IMAGENET_MEAN)
    source = 'mean'
    if isinstance(mean, (str, os.PathLike)):
        source = 'the mean file {!r}'.format(os.fspath(mean))
        if not os.path.isfile(mean):
            raise FileNotFoundError('mean: {} does not exist or is not a file'.format(source))
        try:        # never a pickle: an object array in a crafted file would run code
            mean = numpy.load(mean, allow_pickle=False)
        except ValueError as e:
            raise ValueError('mean: {} is not a .npy array of numbers ({})'.format(source, e)) \
                from None
        if isinstance(mean, numpy.lib.npyio.NpzFile):
            names = mean.files
            mean.close()
            raise ValueError('mean: {} is an .npz archive (of {}), not a .npy array: save the '
                             'mean with numpy.save, or pass the array itself'
                             .format(source, ', '.join(names) or 'nothing'))
    a = _numbers(mean, 'mean', source)
    if a.ndim == 3 and a.shape[0] == 3:
        a = a.mean(axis=(1, 2))        # a mean image: per-channel means (see the docstring)
    if a.shape != (3,):
        raise ValueError('mean must be 3 numbers (RGB), an array of shape (3,) or (3, H, W), or '
                         'a .npy file of one; {} has shape {}'.format(source, a.shape))
    if not (numpy.isfinite(a).all() and (a >= 0).all() and (a <= 255).all()):
        raise ValueError('mean is on the 0-255 scale of the pixels; {} gives {} per channel'
                         .format(source, a.tolist()))
    _not_fractions(a, 'mean', source)
    return tuple(float(v) for v in a)


def _not_fractions(a, name, source):
    if (a < 1).all() and (a > 0).any():      # (a zero mean is a choice: pixels kept as they are)
        raise ValueError('{} is on the 0-255 scale of the pixels; {} gives {}, which look like '
                         'fractions of 255: pass 255 times them (ImageNet\'s are the default)'
                         .format(name, source, a.tolist()))


def channel_std(std):
    """(r, g, b) floats from None, one number or 3 numbers."""
    if std is None:
        return tuple(255.0 * s for s in IMAGENET_STD)
    a = _numbers(std, 'std', 'std')
    if a.ndim == 0:
        a = numpy.repeat(a, 3)
    if a.shape != (3,):
        raise ValueError('std must be one number or 3 (RGB); got shape {}'.format(a.shape))
    if not (numpy.isfinite(a).all() and (a > 0).all()):
        raise ValueError('std must be positive and finite (0-255 scale); got {}'
                         .format(a.tolist()))
    _not_fractions(a, 'std', 'std')
    return tuple(float(v) for v in a)


def _numbers(value, name, source):
    try:
        a = numpy.asarray(value, dtype=numpy.float64)
    except (TypeError, ValueError):
        raise TypeError('{} must be numbers; {} is {!r}'.format(name, source, value)) from None
    return a
