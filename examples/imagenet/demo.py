"""`make demo`: ResNet-50 learns a small real image set on the CPU, with every chainer_tc
technique on, by running the ImageNet example itself.

    make demo                                   # or: .venv/bin/python examples/imagenet/demo.py
    .venv/bin/python examples/imagenet/demo.py --epochs 8 --dtype float32 --out /tmp/demo

1. Makes six classes of JPEGs from the two photographs scikit-learn ships (demo_data.py: the
   sky, pagoda, lake and trees of one, the petals and leaves of the other; validation images
   from parts of each region that no training image shows) under ``OUT/data``.
2. Runs examples/imagenet/train_imagenet.py on them: ResNet-50 v1.5 at width/8 and 64x64
   input, float16, DALI's CPU pipeline padding the RGB images to 4 channels, NHWC fused links,
   the batched update with dynamic loss scaling, the static-graph updater; a warm-up and cosine
   schedule, label smoothing. Its progress bar, log (``OUT/log``), plots (``OUT/loss.png``,
   ``OUT/accuracy.png``) and snapshots go to ``OUT`` (default result/demo).
3. Reads the log and says whether the training loss fell and the validation accuracy is
   clearly above chance; the exit status is 0 only then.
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN_SCRIPT = os.path.join(HERE, 'train_imagenet.py')
sys.path.insert(0, HERE)

import demo_data  # noqa: E402

TECHNIQUES = ['--dali', '--nhwc', '--fused-bn', '--batched-update', '--static-graph',
              '--loss-scale', 'dynamic', '--pad-channels', '4']
LOSS_DROP = 0.75        # the last epoch's mean training loss below 75% of the first's
MIN_ACCURACY = 0.5      # and at least this validation accuracy (3x chance with 6 classes)


def train_args(data, out, epochs=20, dtype='float16', width=8, insize=64, batchsize=16,
               seed=0, loaderjob=2):
    """The example's command line (without the interpreter and script) for the demo."""
    return [data.train, data.val, '-R', data.root, '-o', out, '-d', '-1',
            '-a', 'resnet50_v1.5', '--width', str(width), '--insize', str(insize),
            '--n-classes', str(len(data.classes)), '-B', str(batchsize), '-b', '48',
            '-E', str(epochs), '--dtype', dtype, '-j', str(loaderjob), '--seed', str(seed),
            '--lr', '0.1', '--warmup-epochs', '2', '--schedule', 'cosine',
            '--weight-decay', '5e-5', '--label-smoothing', '0.1'] + TECHNIQUES


def verdict(log_file, n_classes):
    """(passed, one line) from the example's log: the loss of the first and the last entry,
    the last validation accuracy, against chance."""
    with open(log_file) as f:
        log = json.load(f)
    chance = 1 / n_classes
    threshold = max(MIN_ACCURACY, 2 * chance)
    first, last = log[0].get('main/loss'), log[-1].get('main/loss')
    accuracy = log[-1].get('validation/main/accuracy')
    if first is None or last is None or accuracy is None:
        return False, 'demo FAILED: the log {} lacks main/loss or validation/main/accuracy' \
            .format(log_file)
    fell = last < LOSS_DROP * first
    above = accuracy >= threshold
    line = 'training loss {:.2f} -> {:.2f}, validation accuracy {:.2f} (chance {:.2f})'.format(
        first, last, accuracy, chance)
    if fell and above:
        return True, 'demo passed: ' + line
    why = [] if fell else ['the loss did not fall below {:.0%} of its first value'
                           .format(LOSS_DROP)]
    why += [] if above else ['the accuracy is below {:.2f}'.format(threshold)]
    return False, 'demo FAILED: {} ({})'.format(line, '; '.join(why))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--out', default='result/demo', help='results directory (default '
                   'result/demo); the images go to OUT/data')
    p.add_argument('--epochs', type=int, default=20)
    p.add_argument('--dtype', choices=('float16', 'float32'), default='float16')
    p.add_argument('--width', type=int, default=8)
    p.add_argument('--insize', type=int, default=64)
    p.add_argument('--seed', type=int, default=0)
    args = p.parse_args(argv)
    start = time.time()
    data = demo_data.make(os.path.join(args.out, 'data'))
    print('data: {} classes ({}), {} training and {} validation images in {}'.format(
        len(data.classes), ', '.join(data.classes), _lines(data.train), _lines(data.val),
        data.root))
    command = [sys.executable, TRAIN_SCRIPT] + train_args(
        data, args.out, args.epochs, args.dtype, args.width, args.insize, seed=args.seed)
    print('$ ' + ' '.join(os.path.relpath(c) if os.path.isabs(c) else c for c in command[1:]))
    sys.stdout.flush()
    status = subprocess.call(command)
    if status != 0:
        print('demo FAILED: the example exited with status {}'.format(status))
        return 1
    passed, line = verdict(os.path.join(args.out, 'log'), len(data.classes))
    print('{}; {:.0f} s, log and plots in {}'.format(line, time.time() - start, args.out))
    return 0 if passed else 1


def _lines(path):
    with open(path) as f:
        return sum(1 for _ in f)


if __name__ == '__main__':
    sys.exit(main())
