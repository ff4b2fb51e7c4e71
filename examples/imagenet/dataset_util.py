"""The example's input without DALI: images named by a list file, decoded with PIL and augmented
as chainer_tc.dali's pipelines do (see docs/dali.md), for Chainer's iterators.

    train = ImageListDataset(root, 'train.txt', insize=224, train=True, rng=rng)
    it = ReproducibleSerialIterator(train, 32, rng)        # -j 0: in this process, resumable
    it = chainer.iterators.MultiprocessIterator(           # -j N: worker processes
        InWorkers(train), 32, order_sampler=ChainedOrderSampler(seed))
    x, t = concat_examples(it.next())                      # raises what a worker could not read

Training: a random resized crop (area 8-100% of the image, aspect ratio 3/4-4/3), resized to
``insize`` x ``insize`` (PIL's bilinear filter, antialiased when shrinking), a horizontal flip with
probability 1/2. Validation: the shorter side resized to ``round(insize * 256 / 224)``, the centre
``insize`` x ``insize``. Both: ``(pixel - mean) / std`` per RGB channel on the 0-255 scale,
channels last (NHWC) or first (NCHW), in the model's dtype.

Randomness: with ``-j 0`` every draw (the crops, the flips, the shuffled order) comes from one
``numpy.random.RandomState`` shared by the dataset and the iterator.
``ReproducibleSerialIterator`` saves its state in snapshots, so a run resumed from a snapshot
draws what the uninterrupted run drew. Under ``MultiprocessIterator`` each worker process
reseeds its own copy from the OS: the crops are not reproducible. The orders are
``ChainedOrderSampler``'s, each epoch's a function of the one before and the seed, so a
resumed run goes on with the uninterrupted run's orders.

Errors in worker processes: ``MultiprocessIterator`` hangs when a worker's ``get_example``
raises (its prefetch thread dies), so ``InWorkers`` hands back an ``Unreadable`` in place of the
example, and ``concat_examples`` raises its error in the training process: the ``ImageError``
that ``-j 0`` raises.
"""
import hashlib
import math
import os
import traceback

import numpy

import chainer
from chainer import iterators

from chainer_tc.dali import dataset as dataset_module


class ImageError(ValueError):
    """An image of the list could not be read or decoded (the message names it and its line)."""


class ImageListDataset(chainer.dataset.DatasetMixin):
    """``(image, label)`` examples of a list file (``relative/path label`` per line).

    Args:
        root (str): directory the paths are relative to.
        list_file (str): Chainer's ImageNet list file.
        insize (int): height and width of the images returned.
        train (bool): random resized crops and flips, or the deterministic validation crop.
        rng (numpy.random.RandomState): where the training transform draws from (required for
            ``train=True``; share it with the iterator's order sampler).
        mean, std: 3 numbers each, per RGB channel on the 0-255 scale.
        layout (str): 'NHWC' or 'NCHW'.
        dtype: of the images (the labels are int32).
        num_classes (int): labels must lie in [0, num_classes).

    The list is read and checked when the dataset is made (a missing or malformed list, or a
    missing image, raises FileNotFoundError or ``chainer_tc.dali.DatasetError`` naming the file
    and the line), as chainer_tc.dali does.
    """

    area = (0.08, 1.0)
    aspect_ratio = (3 / 4, 4 / 3)

    def __init__(self, root, list_file, insize, train, rng=None, mean=(0, 0, 0),
                 std=(1, 1, 1), layout='NHWC', dtype=numpy.float32, num_classes=None):
        if train and rng is None:
            raise ValueError('train=True needs rng, the RandomState of the augmentation')
        data = dataset_module.load(root, list_file, num_classes=num_classes)
        self.paths, self.labels = data.paths, data.labels
        self.list_file = list_file
        self.insize = int(insize)
        self.resize = int(round(insize * 256 / 224))
        self.train = bool(train)
        self.rng = rng
        self.mean = numpy.asarray(mean, numpy.float32)
        self.inv_std = numpy.float32(1) / numpy.asarray(std, numpy.float32)
        self.nchw = layout == 'NCHW'
        self.dtype = numpy.dtype(dtype)
        self._pid = os.getpid()

    def __len__(self):
        return len(self.paths)

    def get_example(self, i):
        from PIL import Image
        path = self.paths[i]
        try:
            with Image.open(path) as im:
                im = im.convert('RGB')
        except Exception as e:          # PIL raises OSError, SyntaxError, ValueError, ...
            raise ImageError('{}: cannot decode the image listed at {}:{}: {}'.format(
                path, self.list_file, i + 1, e)) from None
        if self.train:
            box, flip = self._random_box(im.size)
        else:
            box, flip = self._centre_box(im.size), False
        im = im.resize((self.insize, self.insize), Image.BILINEAR, box=box)
        if flip:
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        x = (numpy.asarray(im, numpy.float32) - self.mean) * self.inv_std
        if self.nchw:
            x = x.transpose(2, 0, 1)
        return numpy.ascontiguousarray(x, dtype=self.dtype), self.labels[i]

    def _random_box(self, size):
        """A random resized crop (torchvision's and DALI's rule: area and log aspect ratio
        uniform; after 10 failed tries the largest centred crop within the ratio range) and a
        coin for the flip."""
        if os.getpid() != self._pid:    # a MultiprocessIterator worker: its own stream
            self._pid = os.getpid()
            self.rng = numpy.random.RandomState()
        w, h = size
        lo, hi = math.log(self.aspect_ratio[0]), math.log(self.aspect_ratio[1])
        for _ in range(10):
            area = w * h * self.rng.uniform(*self.area)
            ratio = math.exp(self.rng.uniform(lo, hi))
            cw, ch = int(round(math.sqrt(area * ratio))), int(round(math.sqrt(area / ratio)))
            if 0 < cw <= w and 0 < ch <= h:
                left, top = self.rng.randint(0, w - cw + 1), self.rng.randint(0, h - ch + 1)
                break
        else:
            ratio = min(max(w / h, self.aspect_ratio[0]), self.aspect_ratio[1])
            cw, ch = (w, int(round(w / ratio))) if w / h < ratio else (int(round(h * ratio)), h)
            left, top = (w - cw) // 2, (h - ch) // 2
        return (left, top, left + cw, top + ch), self.rng.randint(2) == 1

    def _centre_box(self, size):
        """The centre ``insize`` square of the image resized so that its shorter side is
        ``resize``, in the original image's coordinates, placed as DALI places it: both axes
        scaled by the same factor, the resized longer side rounded, the crop's offset rounded
        half up, pixel centres aligned about the image's centre."""
        w, h = size
        scale = min(w, h) / self.resize              # source pixels per resized pixel
        box = []
        for n in (w, h):
            resized = int(math.floor(n / scale + 0.5))
            offset = (resized - self.insize + 1) // 2
            box.append(n / 2 + (offset - resized / 2) * scale)
        left, top = box
        side = self.insize * scale
        return (left, top, left + side, top + side)


class Unreadable:
    """What ``InWorkers`` returns for an example whose reading raised: the error's message
    (``ImageError``: an image that does not decode) or, for any other exception, its traceback.
    Small and picklable: it crosses from the worker to the training process."""

    def __init__(self, message, image_error):
        self.message, self.image_error = message, image_error

    def error(self):
        """The exception to raise in the training process."""
        if self.image_error:
            return ImageError(self.message)
        return RuntimeError('a data loading worker process failed:\n' + self.message)


class InWorkers(chainer.dataset.DatasetMixin):
    """``dataset`` for ``MultiprocessIterator``'s worker processes, which must not raise (the
    iterator then waits forever, or fails on ``None``): an example whose reading raises is
    returned as an ``Unreadable``, raised by ``concat_examples`` in the training process."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def get_example(self, i):
        try:
            return self.dataset[i]
        except ImageError as e:
            return Unreadable(str(e), True)
        except Exception:
            return Unreadable(traceback.format_exc(), False)


@chainer.dataset.converter()
def concat_examples(batch, device=None, padding=None):
    """``chainer.dataset.concat_examples``, after raising the error of an example that could
    not be read (an ``Unreadable`` from ``InWorkers``)."""
    for example in batch:
        if isinstance(example, Unreadable):
            raise example.error()
    return chainer.dataset.concat_examples(batch, device, padding)


class ChainedOrderSampler:
    """Shuffled orders for ``MultiprocessIterator``, each drawn from a generator seeded by
    ``seed`` and the order before it (the first: by ``arange(n)``). Nothing but the current
    order decides the next, and the iterator's snapshot holds the current order: a run resumed
    from a snapshot goes on with the orders of the uninterrupted run, although the iterator's
    prefetch thread draws ahead of the batches delivered.

    Args:
        seed (int or sequence of ints): e.g. ``[seed, rank]``.
    """

    def __init__(self, seed):
        self.seed = [int(s) for s in numpy.ravel(seed)]

    def __call__(self, current_order, current_position):
        order = numpy.ascontiguousarray(current_order, dtype=numpy.int64)
        digest = numpy.frombuffer(hashlib.sha256(order.tobytes()).digest(), numpy.uint32)
        rng = numpy.random.RandomState(self.seed + [int(d) for d in digest])
        return rng.permutation(len(order))


class ReproducibleSerialIterator(iterators.SerialIterator):
    """``SerialIterator`` whose shuffling draws from ``rng`` (shared with the dataset's
    augmentation) and whose snapshots hold ``rng``'s state: resuming continues with the same
    orders, crops and flips as the uninterrupted run."""

    def __init__(self, dataset, batch_size, rng, repeat=True, shuffle=True):
        self.rng = rng
        sampler = iterators.ShuffleOrderSampler(rng) if shuffle else None
        super().__init__(dataset, batch_size, repeat=repeat, shuffle=None,
                         order_sampler=sampler)

    def serialize(self, serializer):
        super().serialize(serializer)
        name, keys, pos, has_gauss, gauss = self.rng.get_state()
        keys = serializer('rng_keys', keys)
        counters = serializer('rng_counters', numpy.array([pos, has_gauss], numpy.int64))
        gauss = serializer('rng_gauss', gauss)
        if isinstance(serializer, chainer.serializer.Deserializer):
            self.rng.set_state((name, numpy.asarray(keys, numpy.uint32), int(counters[0]),
                                int(counters[1]), float(gauss)))
