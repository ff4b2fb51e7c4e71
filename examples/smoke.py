"""The `make demo` smoke job, until the ImageNet example lands: what chainer_tc can do here, one
kernel run through the CPU CUDA emulator against NumPy, and a few Chainer training steps on the CPU.

    make demo                       # or: .venv/bin/python examples/smoke.py
"""
import os
import sys
import time

import numpy

import chainer_tc  # noqa: F401  (first: makes the pip-installed CUDA libraries visible)
import chainer
import chainer.functions as F
import chainer.links as L
from chainer_tc import info
from chainer_tc import kernels
from chainer_tc import layout


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


class TinyNet(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(3, 8, ksize=3, pad=1)
            self.bn = L.BatchNormalization(8)
            self.fc = L.Linear(8, 2)

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x)))
        return self.fc(F.average(h, axis=(2, 3)))


def train_a_few_steps(steps=40):
    section('{} training steps of a tiny CNN on the CPU (bright vs dark images)'.format(steps))
    rng = numpy.random.RandomState(0)
    model = L.Classifier(TinyNet())
    opt = chainer.optimizers.MomentumSGD(lr=0.05)
    opt.setup(model)
    first = last = None
    for i in range(steps):
        t = rng.randint(0, 2, size=16).astype(numpy.int32)
        x = (rng.rand(16, 3, 16, 16) * 0.5 + t[:, None, None, None] * 0.5).astype(numpy.float32)
        model.cleargrads()
        loss = model(x, t)
        loss.backward()
        opt.update()
        first = float(loss.array) if first is None else first
        last = float(loss.array)
        bar = '#' * int(30 * (i + 1) / steps)
        sys.stdout.write('\r  [{:<30}] step {:>3}/{}  loss {:.4f}'.format(bar, i + 1, steps, last))
        sys.stdout.flush()
    print('\n  loss {:.4f} -> {:.4f}'.format(first, last))
    return last < first


def main():
    show_features()
    ok = layout_through_the_emulator()
    ok = train_a_few_steps() and ok
    print('\nsmoke job {}'.format('passed' if ok else 'FAILED'))
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
