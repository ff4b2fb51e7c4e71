"""The ResNet-50 ImageNet input pipelines, defined with DALI.

    from chainer_tc import dali
    train = dali.imagenet_pipeline('/data/train', 'train.txt', shard_id=0)   # (root, list)
    val = dali.imagenet_pipeline('/data/val', 'val.txt', train=False)
    val = dali.imagenet_pipeline('/data/val', 'val.txt', train=False, mean='mean.npy', std=255)
    train = dali.imagenet_pipeline('/data/train', 'train.txt', pad_channels=4)  # (N, H, W, 4)

Training: random resized crop (area 8%-100% of the image, aspect ratio 3/4-4/3, decoded together
with the crop), resize to ``crop`` x ``crop``, horizontal flip with probability 1/2, normalisation
``(pixel - mean) / std`` per channel (default: ImageNet's mean and standard deviation).
Validation: resize the shorter side to ``resize`` (default ``crop * 256 / 224``, so 256 for 224),
centre crop ``crop`` x ``crop``, the same normalisation. Outputs: images (NHWC, or NCHW, float16 or
float32: by default ``chainer.config.dtype``) and int32 labels, on the GPU when CuPy sees one.
With ``pad_channels=4`` the images have a fourth channel of zeros, made by
``crop_mirror_normalize(pad_output=True)`` in the same pass (DALI pads to the next power of two
with zeros); with 8, ``fn.pad`` adds channels 3-7 after it, one more pass over the batch.

The object returned holds the data set, already read and checked, and the settings;
DaliIterator builds the DALI pipeline from it (``build``) and feeds it, through an
``external_source``, the file names and labels of each batch in the order it decides. DALI reads
the files (``fn.io.file.read``), decodes and augments them in its own threads.
"""
import os
import warnings

import numpy

import chainer

from chainer_tc import input_channels
from chainer_tc.dali import dataset as dataset_module
from chainer_tc.dali import normalisation

IMAGENET_MEAN = normalisation.IMAGENET_MEAN      # RGB, as fractions of 255
IMAGENET_STD = normalisation.IMAGENET_STD
DEVICES = ('gpu', 'cpu')
LAYOUTS = ('NHWC', 'NCHW')
# Buffers the mixed decoder reserves up front, as in DALI's ResNet-50 example: no reallocation
# during the first epoch on ImageNet-sized images.
_DEVICE_MEMORY_PADDING = 211025920
_HOST_MEMORY_PADDING = 140544512


def imagenet_pipeline(root, list_file=None, train=True, crop=224, resize=None, device=None,
                      device_id=None, dtype=None, layout='NHWC', num_classes=None,
                      seed=None, num_threads=None, prefetch_queue_depth=2, shard_id=0,
                      num_shards=1, check_files=True, area=(0.08, 1.0),
                      aspect_ratio=(3 / 4, 4 / 3), mean=None, std=None, pad_channels=None):
    """The ResNet-50 training (``train=True``) or validation pipeline over a data set.

    Args:
        root (str): directory of the images (first, as in ``dali-check ROOT LIST``; the old
            order ``(list_file, root)`` still works, with a DeprecationWarning).
        list_file (str): Chainer's ImageNet list (``relative/path label`` per line); None reads
            the class-per-directory tree under ``root``.
        train (bool): training augmentation, or the deterministic validation transform.
        crop (int): output height and width.
        resize (int): validation only: the shorter side before the centre crop (default
            ``round(crop * 256 / 224)``).
        device (str): 'gpu': mixed (nvJPEG) decoding, augmentation on the GPU, CuPy outputs;
            'cpu': everything on the CPU, NumPy outputs; None (default): 'gpu' when CuPy sees a
            GPU, else 'cpu' (the choice is in ``self.device``).
        device_id (int): GPU to use (default: CuPy's current device).
        dtype: numpy.float16 or numpy.float32 images; None (default): ``chainer.get_dtype()``
            (float16 under ``CHAINER_DTYPE=float16`` or mixed16), so the images arrive in the
            model's dtype.
        mean: per-channel mean (RGB, 0-255 scale) subtracted from the pixels: None (default)
            ImageNet's ``255 * IMAGENET_MEAN``; 3 numbers; an array of shape (3,) or (3, H, W);
            or the path of a ``.npy`` file holding one (read without unpickling). A (3, H, W)
            mean image, like Chainer's example's ``mean.npy`` (3, 256, 256), is reduced to its
            per-channel means: a per-pixel mean cannot follow random crops and resizes.
        std: divisor (0-255 scale): None (default) ImageNet's ``255 * IMAGENET_STD``; one number
            for all channels (Chainer's example: 255); or 3 numbers.
        layout (str): 'NHWC' or 'NCHW'.
        num_classes (int): labels must lie in [0, num_classes) (default: any label >= 0 for a
            list, the number of class directories for a tree).
        seed (int): seed of the augmentation and of the shuffling (default: drawn from NumPy's
            global random generator, so that ``numpy.random.seed(n)`` repeats a run as with
            Chainer's iterators; kept in ``self.seed`` and in the iterator's snapshots).
        num_threads (int): DALI's CPU threads (default: the CPUs this process may use).
        prefetch_queue_depth (int): batches DALI prepares ahead of the one being consumed; 2 or
            more overlaps the input pipeline with training.
        shard_id, num_shards (int): this process's part of the data set (one per GPU).
        check_files (bool): check up front that every image exists and is a non-empty file
            (one ``stat`` per image, a few seconds for ImageNet).
        area, aspect_ratio (pairs of float): ranges of the random resized crop.
        pad_channels (int): 4 or 8: the images' 3 channels padded with zeros to that many, for
            ``chainer_tc.models.ResNet50(pad_channels=...)`` (cuDNN's Tensor Core NHWC kernels
            want 4, or a multiple of 8, channels in float16). 4: DALI's
            ``crop_mirror_normalize(pad_output=True)``, in the same pass; 8: then ``fn.pad``,
            one more pass (``pad_output`` stops at the next power of two, 4). In either layout.
            None (default) or 3: no padding.
    """
    if list_file is not None and os.path.isfile(root) and os.path.isdir(list_file):
        warnings.warn('imagenet_pipeline takes (root, list_file); got the list file {!r} first '
                      'and the root {!r} second: taken in that order for now'
                      .format(root, list_file), DeprecationWarning, stacklevel=2)
        root, list_file = list_file, root
    return ImagenetPipeline(root, list_file, train, crop, resize, device, device_id, dtype,
                            layout, num_classes, seed, num_threads, prefetch_queue_depth,
                            shard_id, num_shards, check_files, area, aspect_ratio, mean, std,
                            pad_channels)


def augmentation_seed(seed, shard_id, epoch, current_position):
    """The seed of DALI's random crops and flips for a pipeline of shard ``shard_id`` that
    starts at (``epoch``, ``current_position``): the shards of one run draw independently (with
    one seed they would crop and flip the k-th image of each batch alike on every GPU), and a
    run resumed from a snapshot draws anew from where it stands, not the run's first draws
    again. Below 2**31, as DALI wants it."""
    state = numpy.random.SeedSequence([int(seed), int(shard_id), int(epoch),
                                       int(current_position)]).generate_state(1)[0]
    return int(state >> 1)


class ImagenetPipeline(object):
    """A checked data set (``dataset``) plus the settings of its DALI pipeline; see
    :func:`imagenet_pipeline` for the arguments. ``build(batch_size, source)`` makes the DALI
    pipeline."""

    def __init__(self, root, list_file, train, crop, resize, device, device_id, dtype, layout,
                 num_classes, seed, num_threads, prefetch_queue_depth, shard_id, num_shards,
                 check_files, area, aspect_ratio, mean=None, std=None, pad_channels=None):
        _positive_int('crop', crop)
        if resize is None:
            resize = int(round(crop * 256 / 224))
        _positive_int('resize', resize)
        if not train and resize < crop:
            raise ValueError('resize={} is smaller than crop={}: the centre crop would not fit'
                             .format(resize, crop))
        if device is None:
            device = 'gpu' if _cupy_sees_a_gpu() else 'cpu'
        if device not in DEVICES:
            raise ValueError('device must be one of {} or None; got {!r}'.format(DEVICES, device))
        if dtype is None:
            dtype = chainer.get_dtype()
            if dtype not in (numpy.float16, numpy.float32):
                raise ValueError('dtype defaults to chainer.config.dtype, which is {}; DALI '
                                 'outputs float16 or float32: pass dtype='.format(dtype.name))
        try:
            dtype = numpy.dtype(dtype)
        except TypeError:
            dtype = None
        if dtype not in (numpy.float16, numpy.float32):
            raise ValueError('dtype must be float16 or float32; got {!r}'.format(dtype))
        mean = normalisation.channel_mean(mean)
        std = normalisation.channel_std(std)
        if layout not in LAYOUTS:
            raise ValueError('layout must be one of {}; got {!r}'.format(LAYOUTS, layout))
        pad_channels = input_channels.check(pad_channels)
        if num_threads is None:
            num_threads = len(os.sched_getaffinity(0))
        _positive_int('num_threads', num_threads)
        _positive_int('prefetch_queue_depth', prefetch_queue_depth)
        self.seed_drawn = seed is None          # (a shuffling DaliIterator of shards refuses it)
        if seed is None:                # (NumPy's global generator: numpy.random.seed(n)
            seed = int(numpy.random.randint(2 ** 31))   # repeats a run, as Chainer's iterators)
        if isinstance(seed, bool) or not isinstance(seed, (int, numpy.integer)) \
                or not 0 <= seed < 2 ** 31:
            raise ValueError('seed must be an integer in [0, 2**31) or None; got {!r}'
                             .format(seed))
        for name, (lo, hi) in (('area', area), ('aspect_ratio', aspect_ratio)):
            if not 0 < lo <= hi:
                raise ValueError('{} must be a range (lo, hi) with 0 < lo <= hi; got {!r}'
                                 .format(name, (lo, hi)))
        if device == 'gpu':
            device_id = _gpu_device_id(device_id)
        self.dataset = dataset_module.load(root, list_file, num_classes, check_files)
        if not isinstance(num_shards, (int, numpy.integer)) or num_shards < 1:
            raise ValueError('num_shards must be a positive integer; got {!r}'.format(num_shards))
        if not isinstance(shard_id, (int, numpy.integer)) or not 0 <= shard_id < num_shards:
            raise ValueError('shard_id must be an integer in [0, num_shards={}); got {!r}'
                             .format(num_shards, shard_id))
        self.root, self.list_file = root, list_file
        self.train, self.crop, self.resize = bool(train), int(crop), int(resize)
        self.device, self.device_id = device, device_id
        self.dtype, self.layout, self.pad_channels = dtype, layout, int(pad_channels)
        self.seed, self.num_threads = int(seed), int(num_threads)
        self.prefetch_queue_depth = int(prefetch_queue_depth)
        self.shard_id, self.num_shards = int(shard_id), int(num_shards)
        self.area, self.aspect_ratio = tuple(area), tuple(aspect_ratio)
        self.mean, self.std = mean, std         # per channel, 0-255 scale

    def build(self, batch_size, source, random_seed=None):
        """A built ``nvidia.dali.Pipeline`` whose outputs are (images, labels). ``source()``
        returns each batch's inputs: a list of file paths as uint8 arrays (UTF-8) and an int32
        array of labels; it raises StopIteration when there is no more. ``random_seed``: the
        seed of DALI's crops and flips (default ``seed``; the iterator gives each shard and
        each starting position its own, :func:`augmentation_seed`)."""
        from nvidia.dali import fn
        from nvidia.dali import pipeline
        from nvidia.dali import types
        gpu = self.device == 'gpu'
        pipe = pipeline.Pipeline(
            batch_size=batch_size, num_threads=self.num_threads,
            device_id=self.device_id if gpu else None,
            seed=self.seed if random_seed is None else random_seed,
            prefetch_queue_depth=self.prefetch_queue_depth, exec_dynamic=True)
        decoder = {'device': 'mixed', 'device_memory_padding': _DEVICE_MEMORY_PADDING,
                   'host_memory_padding': _HOST_MEMORY_PADDING} if gpu else {'device': 'cpu'}
        with pipe:
            paths, labels = fn.external_source(
                source=source, num_outputs=2, batch=True, dtype=[types.UINT8, types.INT32],
                ndim=[1, 0])
            encoded = fn.io.file.read(paths)
            if self.train:
                images = fn.decoders.image_random_crop(
                    encoded, output_type=types.RGB, random_area=list(self.area),
                    random_aspect_ratio=list(self.aspect_ratio), num_attempts=100, **decoder)
                images = fn.resize(images, resize_x=self.crop, resize_y=self.crop)
                mirror = fn.random.coin_flip(probability=0.5)
            else:
                images = fn.decoders.image(encoded, output_type=types.RGB, **decoder)
                images = fn.resize(images, resize_shorter=self.resize)
                mirror = 0
            images = fn.crop_mirror_normalize(
                images, crop=(self.crop, self.crop), mirror=mirror,
                mean=list(self.mean), std=list(self.std),
                dtype=types.FLOAT16 if self.dtype == numpy.float16 else types.FLOAT,
                output_layout='HWC' if self.layout == 'NHWC' else 'CHW',
                pad_output=self.pad_channels > 3)      # zeros, to 4 (the next power of two)
            if self.pad_channels > 4:
                images = fn.pad(images, axis_names='C', shape=[self.pad_channels],
                                fill_value=0.0)
            pipe.set_outputs(images, labels.gpu() if gpu else labels)
        pipe.build()
        return pipe


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, numpy.integer)) or value < 1:
        raise ValueError('{} must be a positive integer; got {!r}'.format(name, value))


def _cupy_sees_a_gpu():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:       # CuPy missing, no driver, no device: the CPU pipeline
        return False


def _gpu_device_id(device_id):
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:      # CuPy missing, no driver, ...
        raise RuntimeError("device='gpu' needs CuPy and a CUDA GPU ({}: {}); use device='cpu'"
                           .format(type(e).__name__, e)) from None
    if count == 0:
        raise RuntimeError("device='gpu' needs a CUDA GPU and none was found; use device='cpu'")
    if device_id is None:
        return cupy.cuda.Device().id
    if not isinstance(device_id, (int, numpy.integer)) or not 0 <= device_id < count:
        raise ValueError('device_id must be an integer in [0, {}); got {!r}'
                         .format(count, device_id))
    return int(device_id)
