"""The `make smoke` job (`make demo` runs examples/imagenet/demo.py): what chainer_tc can do
here, one kernel run through the CPU CUDA emulator against NumPy, and a few training steps of an
NHWC ResNet-50 (fused BatchNorm+Add+ReLU links, batched optimizer) on the CPU.

    make smoke                      # or: .venv/bin/python examples/smoke.py
"""
import os
import sys
import time

import numpy

import chainer_tc  # noqa: F401  (first: makes the pip-installed CUDA libraries visible)
import chainer.links as L
from chainer_tc import info
from chainer_tc import kernels
from chainer_tc import layout
from chainer_tc import optimizers
from chainer_tc.models import ResNet50


def section(title):
    print('\n== {} =='.format(title))


def show_features():
    section('what can run here (python -m chainer_tc info)')
    report = info.collect()
    for name, f in report['features'].items():
        print('  {:<26} {}'.format(name, 'yes' if f['available'] else 'no: ' + f['reason']))


def layout_through_the_emulator():
    section('NCHW float32 -> NHWC float16 with kernels/layout.cu, emulated on the CPU')
    x = numpy.random.RandomState(0).randn(8, 3, 32, 32).astype(numpy.float32)
    os.environ[kernels.ENV_EMULATE] = '1'
    try:
        t = time.time()
        with kernels.count_launches() as c:
            y = layout.nchw_to_nhwc(x, numpy.float16)
        dt = time.time() - t
    finally:
        del os.environ[kernels.ENV_EMULATE]
    ref = layout.nchw_to_nhwc(x, numpy.float16)     # the NumPy path
    same = numpy.array_equal(y, ref)
    print('  {} -> {} {}, {} launch(es), {:.2f} s; bit-identical to NumPy: {}'
          .format(x.shape, y.shape, y.dtype, c.total, dt, same))
    return same


def train_a_few_steps(steps=40):
    section('{} training steps of an NHWC ResNet-50 (width/16) with the batched optimizer'
            .format(steps))
    numpy.random.seed(0)
    rng = numpy.random.RandomState(0)
    model = L.Classifier(ResNet50('NHWC', n_classes=2, width=16))
    opt = optimizers.MomentumSGD(lr=0.01, weight_decay=1e-4,
                                 decay_filter=optimizers.skip_bn_and_bias).setup(model)
    losses = []
    for i in range(steps):
        t = rng.randint(0, 2, size=8).astype(numpy.int32)
        x = (rng.rand(8, 32, 32, 3) * 0.5 + t[:, None, None, None] * 0.5).astype(numpy.float32)
        opt.update(model, x, t)
        loss = float(model.loss.array)
        losses.append(loss)
        bar = '#' * int(30 * (i + 1) / steps)
        sys.stdout.write('\r  [{:<30}] step {:>3}/{}  loss {:.4f}'.format(bar, i + 1, steps, loss))
        sys.stdout.flush()
    first, last = numpy.mean(losses[:5]), numpy.mean(losses[-5:])
    print('\n  mean loss of the first 5 steps {:.4f} -> of the last 5 {:.4f}'.format(first, last))
    return last < first


def main():
    show_features()
    ok = layout_through_the_emulator()
    ok = train_a_few_steps() and ok
    print('\nsmoke job {}'.format('passed' if ok else 'FAILED'))
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
