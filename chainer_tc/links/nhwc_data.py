"""Feeding NCHW data sets (Chainer's image datasets give (C, H, W) images) to an NHWC model.

    from chainer_tc import links as TL
    train = TL.nhwc_dataset(train)                     # each (C, H, W) image -> (H, W, C)
    updater = StandardUpdater(it, opt, converter=TL.nhwc_converter)    # or: per batch

``nhwc_dataset`` transposes each example where it is read (in MultiprocessIterator's workers,
off the training thread); ``nhwc_converter`` is ``concat_examples`` followed by one transpose of
the batch, on the device it was sent to (one kernel launch on a GPU, see chainer_tc.layout).
Either way the images keep their dtype: the model casts its input (ResNet50 does, once).
"""
import numpy

import chainer
from chainer.dataset import convert

from chainer_tc import layout


def _image_to_hwc(image, where):
    if getattr(image, 'ndim', None) != 3:
        raise ValueError('nhwc_dataset expects images of shape (C, H, W); {} has shape {}'
                         .format(where, getattr(image, 'shape', type(image).__name__)))
    return numpy.ascontiguousarray(image.transpose(1, 2, 0))


class _NHWCTransform(object):
    """Picklable (MultiprocessIterator sends it to its workers)."""

    def __init__(self, index):
        self.index = index

    def __call__(self, example):
        if isinstance(example, tuple):
            if not -len(example) <= self.index < len(example):
                raise ValueError('nhwc_dataset(index={}): the example is a tuple of {}'
                                 .format(self.index, len(example)))
            out = list(example)
            out[self.index] = _image_to_hwc(example[self.index],
                                            'element {} of the example'.format(self.index))
            return tuple(out)
        return _image_to_hwc(example, 'the example')


def nhwc_dataset(dataset, index=0):
    """``dataset`` with each image transposed from (C, H, W) to (H, W, C).

    Args:
        dataset: any Chainer dataset whose examples are images or tuples holding one (e.g.
            ``LabeledImageDataset``, ``TupleDataset``, ``TransformDataset``).
        index (int): which element of a tuple example is the image (default 0, the ``x`` of
            ``(x, t)``).
    """
    if isinstance(index, bool) or not isinstance(index, (int, numpy.integer)):
        raise TypeError('index must be an int (the image\'s position in each example); got {!r}'
                        .format(index))
    return chainer.datasets.TransformDataset(dataset, _NHWCTransform(int(index)))


@convert.converter()
def nhwc_converter(batch, device=None, padding=None):
    """``concat_examples(batch, device, padding)`` with the images, the first array of each
    example, transposed from (N, C, H, W) to (N, H, W, C) after they reach ``device``."""
    arrays = convert.concat_examples(batch, device, padding)
    if isinstance(arrays, tuple):
        return (_batch_to_nhwc(arrays[0]),) + tuple(arrays[1:])
    if isinstance(arrays, dict):
        raise TypeError('nhwc_converter takes examples that are arrays or tuples (image first); '
                        'got dicts: transpose the images yourself, or use nhwc_dataset(dataset, '
                        'index=...)')
    return _batch_to_nhwc(arrays)


def _batch_to_nhwc(x):
    if x.ndim != 4:
        raise ValueError('nhwc_converter expects images of shape (C, H, W) first in each '
                         'example; the batch of them has shape {}'.format(x.shape))
    if x.dtype in (numpy.float16, numpy.float32):
        return layout.nchw_to_nhwc(x)          # one kernel launch on a GPU
    xp = chainer.backend.get_array_module(x)   # other dtypes (uint8 images, float64): a copy
    return xp.ascontiguousarray(x.transpose(0, 2, 3, 1))
