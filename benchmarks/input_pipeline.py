"""Input pipeline throughput: chainer_tc.dali against Chainer's own input pipeline.

    .venv/bin/python benchmarks/input_pipeline.py           # CPU (and the GPU if there is one)
    .venv/bin/python benchmarks/input_pipeline.py --images 512 --batches 40 --out r.json
    .venv/bin/python benchmarks/input_pipeline.py --list train.txt --root /data/train

Measures, in one run so that the ratio is fair (same images, same cores, same augmentation):
- CPU (rounds alternating the two, fresh iterators each; medians): images/s of DALI's CPU
  pipeline (``imagenet_pipeline(device='cpu')``: random resized crop 8-100% / 3:4-4:3 to 224,
  flip, ImageNet normalisation, NHWC float16) through DaliIterator, against Chainer's
  ``LabeledImageDataset`` + ``TransformDataset`` (the same augmentation with PIL: torchvision's
  random-resized-crop sampling, bilinear resize, flip, normalisation to NHWC float16) +
  ``MultiprocessIterator`` with one process per core, batches assembled by ``concat_examples``;
- GPU (when CuPy finds one): images/s of the mixed (nvJPEG) pipeline alone, and inside a training
  loop (Chainer's ResNet-50, float32 NCHW, MomentumSGD): images/s and the share of the loop's time
  that ``__next__`` waited for DALI (``DaliIterator.wait_seconds``).
The images are generated (ImageNet-like sizes, cut from scikit-learn's sample photographs) unless
``--list``/``--root`` name a data set. Prints a table, writes JSON. Not part of the tests.
"""
import argparse
import json
import math
import os
import platform
import random
import sys
import tempfile
import time

import numpy

import _common
import chainer

from chainer_tc import dali

MEAN = numpy.array(dali.IMAGENET_MEAN, numpy.float32) * 255
STD = numpy.array(dali.IMAGENET_STD, numpy.float32) * 255


progress = _common.progress


def make_images(directory, n, seed=0):
    """n JPEGs of ImageNet's typical sizes (sides 333-500, quality 90), cut from the two sample
    photographs scikit-learn ships; a list file in Chainer's ImageNet format."""
    from PIL import Image
    from sklearn.datasets import load_sample_images
    photos = load_sample_images().images
    r = numpy.random.RandomState(seed)
    lines = []
    for i in range(n):
        src = photos[i % 2]
        ch, cw = r.randint(250, src.shape[0] + 1), r.randint(300, src.shape[1] + 1)
        y, x = r.randint(0, src.shape[0] - ch + 1), r.randint(0, src.shape[1] - cw + 1)
        size = (r.randint(333, 501), r.randint(333, 501))
        name = '{:05d}.jpg'.format(i)
        Image.fromarray(src[y:y + ch, x:x + cw]).resize(size, Image.BILINEAR).save(
            os.path.join(directory, name), quality=90)
        lines.append('{} {}\n'.format(name, i % 2))
        if (i + 1) % 64 == 0 or i + 1 == n:
            progress('making images: {}/{}'.format(i + 1, n), end='' if i + 1 < n else '\n')
    path = os.path.join(directory, 'list.txt')
    with open(path, 'w') as f:
        f.writelines(lines)
    return path


class RandomResizedCropFlip(object):
    """The training augmentation with PIL, as DALI's: random resized crop (torchvision's sampling:
    area and log-uniform aspect ratio, 10 tries, then a centre crop), bilinear resize to ``crop``,
    horizontal flip with probability 1/2, ImageNet normalisation, HWC (or ``layout='CHW'``) in
    ``dtype`` (default float16)."""

    def __init__(self, crop, area=(0.08, 1.0), ratio=(3 / 4, 4 / 3), layout='HWC',
                 dtype=numpy.float16):
        if layout not in ('HWC', 'CHW'):
            raise ValueError("layout must be 'HWC' or 'CHW'; got {!r}".format(layout))
        self.crop, self.area, self.log_ratio = crop, area, (math.log(ratio[0]),
                                                            math.log(ratio[1]))
        self.layout, self.dtype = layout, numpy.dtype(dtype)

    def box(self, w, h, rnd):
        for _ in range(10):
            target = w * h * rnd.uniform(*self.area)
            aspect = math.exp(rnd.uniform(*self.log_ratio))
            cw, ch = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
            if 0 < cw <= w and 0 < ch <= h:
                x, y = rnd.randint(0, w - cw), rnd.randint(0, h - ch)
                return x, y, x + cw, y + ch
        s = min(w, h)
        return (w - s) // 2, (h - s) // 2, (w - s) // 2 + s, (h - s) // 2 + s

    def __call__(self, example):
        from PIL import Image
        image, label = example                    # CHW uint8 from LabeledImageDataset
        im = Image.fromarray(image.transpose(1, 2, 0))
        rnd = random.Random()
        im = im.resize((self.crop, self.crop), Image.BILINEAR, box=self.box(*im.size, rnd))
        x = numpy.asarray(im, numpy.float32)
        if rnd.random() < 0.5:
            x = x[:, ::-1]
        x = ((x - MEAN) / STD).astype(self.dtype)
        return (x.transpose(2, 0, 1).copy() if self.layout == 'CHW' else x), label


def chainer_iterator(list_file, root, batch, crop, processes, layout='HWC',
                     dtype=numpy.float16):
    ds = chainer.datasets.LabeledImageDataset(list_file, root, dtype=numpy.uint8)
    ds = chainer.datasets.TransformDataset(ds, RandomResizedCropFlip(crop, layout=layout,
                                                                     dtype=dtype))
    return chainer.iterators.MultiprocessIterator(
        ds, batch, n_processes=processes, n_prefetch=2,
        shared_mem=crop * crop * 3 * numpy.dtype(dtype).itemsize + 1024)


def images_per_second(it, convert, batches, warmup, label):
    for _ in range(warmup):
        convert(next(it))
    n, start = 0, time.perf_counter()
    for i in range(batches):
        x, _ = convert(next(it))
        n += len(x)
        if (i + 1) % 5 == 0 or i + 1 == batches:
            progress('{}: batch {}/{}, {:.0f} images/s'.format(
                label, i + 1, batches, n / (time.perf_counter() - start)),
                end='' if i + 1 < batches else '\n')
    return n / (time.perf_counter() - start)


def run_cpu(list_file, root, args):
    """Rounds of DALI then Chainer, each with fresh iterators (nothing of the other prefetching
    in the background). The ratio is the median of the rounds' ratios: the two sides of a round
    run seconds apart, so a noisy neighbour on a shared machine costs a round, not the
    comparison."""
    ours, theirs, waits = [], [], []
    for r in range(args.rounds):
        it = dali.DaliIterator(dali.imagenet_pipeline(
            root, list_file, device='cpu', crop=args.crop, num_threads=args.threads, seed=r),
            args.batch)
        ours.append(images_per_second(it, lambda b: b, args.batches, args.warmup,
                                      'round {}/{}: dali cpu'.format(r + 1, args.rounds)))
        waits.append(it.wait_seconds)
        it.finalize()
        it = chainer_iterator(list_file, root, args.batch, args.crop, args.threads)
        theirs.append(images_per_second(it, chainer.dataset.concat_examples, args.batches,
                                        args.warmup, 'round {}/{}: chainer multiprocess'
                                        .format(r + 1, args.rounds)))
        it.finalize()
    return {'dali_cpu_images_per_s': float(numpy.median(ours)),
            'chainer_images_per_s': float(numpy.median(theirs)),
            'ratio': float(numpy.median([a / b for a, b in zip(ours, theirs)])),
            'rounds': {'dali_cpu': ours, 'chainer': theirs,
                       'ratio': [a / b for a, b in zip(ours, theirs)]},
            'threads_or_processes': args.threads, 'dali_wait_s': waits}


def run_gpu(list_file, root, args):
    import cupy
    import chainer.functions as F
    it = dali.DaliIterator(dali.imagenet_pipeline(root, list_file, device='gpu', crop=args.crop,
                                                  num_threads=args.threads, seed=0), args.batch)
    alone = images_per_second(it, lambda b: b, args.batches, args.warmup, 'dali gpu alone')
    it.finalize()
    it = dali.DaliIterator(dali.imagenet_pipeline(
        root, list_file, device='gpu', crop=args.crop, num_threads=args.threads, seed=0,
        dtype=numpy.float32, layout='NCHW'), args.batch)
    model = chainer.links.ResNet50Layers(pretrained_model=None)
    model.to_device('@cupy:{}'.format(cupy.cuda.Device().id))
    opt = chainer.optimizers.MomentumSGD(lr=0.01).setup(model)

    def step():
        x, t = next(it)
        loss = F.softmax_cross_entropy(model(x, layers=['fc6'])['fc6'], t)
        model.cleargrads()
        loss.backward()
        opt.update()
        return len(x)

    for _ in range(args.warmup):
        step()
    cupy.cuda.Device().synchronize()
    wait0, n, start = it.wait_seconds, 0, time.perf_counter()
    for i in range(args.batches):
        n += step()
        if (i + 1) % 5 == 0:
            progress('resnet-50 training loop: batch {}/{}'.format(i + 1, args.batches))
    cupy.cuda.Device().synchronize()
    elapsed = time.perf_counter() - start
    waited = it.wait_seconds - wait0
    it.finalize()
    return {'dali_gpu_images_per_s': alone, 'training_images_per_s': n / elapsed,
            'training_wait_s': waited, 'training_wait_share': waited / elapsed,
            'device': cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}


def table(cpu, gpu):
    rows = [('DALI CPU pipeline (DaliIterator)', '{:.0f}'.format(cpu['dali_cpu_images_per_s'])),
            ('Chainer LabeledImageDataset + PIL + MultiprocessIterator',
             '{:.0f}'.format(cpu['chainer_images_per_s'])),
            ('ratio DALI / Chainer (median of {} rounds; each: {})'.format(
                len(cpu['rounds']['ratio']),
                ', '.join('{:.2f}'.format(r) for r in cpu['rounds']['ratio'])),
             '{:.2f}x'.format(cpu['ratio']))]
    if gpu:
        rows += [('DALI mixed (GPU) pipeline alone', '{:.0f}'.format(gpu['dali_gpu_images_per_s'])),
                 ('ResNet-50 fp32 training loop fed by DaliIterator',
                  '{:.0f}'.format(gpu['training_images_per_s'])),
                 ('  share of the loop waiting in __next__',
                  '{:.1%}'.format(gpu['training_wait_share']))]
    w = max(len(r[0]) for r in rows)
    return '\n'.join(['{:<{w}}  {:>10}'.format('', 'images/s', w=w)]
                     + ['{:<{w}}  {:>10}'.format(a, b, w=w) for a, b in rows])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--images', type=int, default=256, help='generated images (default 256)')
    p.add_argument('--list', help='list file of an existing data set (with --root)')
    p.add_argument('--root', help='image root of an existing data set')
    p.add_argument('--batch', type=int, default=32)
    p.add_argument('--batches', type=int, default=30, help='timed batches per pipeline and round')
    p.add_argument('--rounds', type=int, default=5, help='CPU: rounds of DALI then Chainer')
    p.add_argument('--warmup', type=int, default=3, help='untimed batches first')
    p.add_argument('--crop', type=int, default=224)
    p.add_argument('--threads', type=int, default=len(os.sched_getaffinity(0)),
                   help='DALI threads and Chainer processes (default: the CPUs available)')
    p.add_argument('--no-gpu', action='store_true')
    p.add_argument('--out', default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 'results', 'input_pipeline.json'))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.list:
            list_file, root = args.list, args.root or os.path.dirname(args.list)
        else:
            list_file, root = make_images(tmp, args.images), tmp
        cpu = run_cpu(list_file, root, args)
        gpu = (run_gpu(list_file, root, args) if not args.no_gpu and _common.gpu_available()
               else None)
    result = {
        'benchmark': 'input_pipeline', 'crop': args.crop, 'batch': args.batch,
        'batches': args.batches, 'rounds': args.rounds,
        'images': None if args.list else args.images,
        'cpus': os.cpu_count(), 'cpu_affinity': len(os.sched_getaffinity(0)),
        'machine': platform.processor() or platform.machine(), 'python': platform.python_version(),
        'cpu': cpu, 'gpu': gpu,
    }
    print(table(cpu, gpu))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(result, f, indent=1)
    print('written to {}'.format(args.out))
    return 0


if __name__ == '__main__':
    sys.exit(main())
