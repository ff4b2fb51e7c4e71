"""What tests/test_multinode_batchnorm.py and its MPI worker share: the cases, their data (the
global batch, which each rank slices), the small NHWC network and its training."""
import numpy

import chainer
import chainer.functions as F
import chainer.links as L

from chainer_tc import functions as TF
from chainer_tc import links as TL
from chainer_tc import optimizers

RANKS = 2
C = 6
HW = (3, 2)
UNEQUAL = (3, 5)                # images per rank: unequal batches
EMPTY = (0, 4)                  # rank 0 has no rows
EPS, DECAY = 1e-3, 0.8
F64, F32, F16 = numpy.float64, numpy.float32, numpy.float16
PAIRS = [(F64, F64), (F32, F32), (F16, F32), (F16, F16)]


def function_cases():
    """(name, path, x dtype, gamma dtype, relu, with_z, images per rank)."""
    out = []
    for path in ('numpy', 'emulator'):
        for t, p in PAIRS:
            for relu, with_z in ((False, False), (True, True), (True, False)):
                out.append((path, t, p, relu, with_z, UNEQUAL))
        out.append((path, F32, F32, True, True, EMPTY))
    return [('{}-{}-{}-{}{}{}'.format(path, numpy.dtype(t).name, numpy.dtype(p).name,
                                      'relu' if relu else 'bn', '-z' if z else '',
                                      '-empty' if b == EMPTY else ''),
             path, t, p, relu, z, b) for path, t, p, relu, z, b in out]


def global_data(name, dtype, pdtype, images):
    """The global batch of a case: x, z, gy (sum(images), H, W, C), gamma, beta, running mean
    and variance to start from. Per-channel offsets and scales (the statistics differ by
    channel); one seed per case name, so that both ranks and the test build the same."""
    r = numpy.random.RandomState(sum(map(ord, name)))
    shape = (sum(images),) + HW + (C,)
    x = (r.randn(*shape) * (r.rand(C) + 0.5) * 2 + r.randn(C) * 3).astype(dtype)
    z = r.randn(*shape).astype(dtype)
    gy = r.randn(*shape).astype(dtype)
    gamma = (r.rand(C) + 0.5).astype(pdtype)
    beta = r.randn(C).astype(pdtype)
    rm, rv = r.randn(C).astype(pdtype), (r.rand(C) + 0.5).astype(pdtype)
    return dict(x=x, z=z, gy=gy, gamma=gamma, beta=beta, rm=rm, rv=rv)


def shard(a, rank, images):
    start = sum(images[:rank])
    return a[start:start + images[rank]]


# ---- training a small NHWC network -----------------------------------------------------------

TRAIN_STEPS = 5
TRAIN_BATCH = 8                 # 4 images per rank: the ranks' mean losses average to the
                                # global mean loss only for equal batches


class Net(chainer.Chain):
    """conv -> BN+ReLU -> conv -> BN+add(residual)+ReLU -> BN -> global pool -> fc, NHWC."""

    def __init__(self):
        super().__init__()
        r = numpy.random.RandomState(3)
        with self.init_scope():
            self.conv1 = TL.Convolution2D(3, 8, 3, pad=1, nobias=True,
                                          initialW=r.randn(8, 3, 3, 3).astype(F32) * 0.3)
            self.bn1 = TL.BatchNormAddReLU(8)
            self.conv2 = TL.Convolution2D(8, 8, 3, pad=1, nobias=True,
                                          initialW=r.randn(8, 8, 3, 3).astype(F32) * 0.2)
            self.bn2 = TL.BatchNormAddReLU(8, initial_gamma=0.5)
            self.bn3 = TL.BatchNormalization(8)
            self.fc = L.Linear(8, 5, initialW=r.randn(5, 8).astype(F32) * 0.3)

    def forward(self, x):
        h = self.bn1(self.conv1(x))
        h = self.bn2(self.conv2(h), h)
        h = TF.global_average_pooling_2d(self.bn3(h))
        return self.fc(F.reshape(h, (h.shape[0], -1)))


def train_batch(step):
    r = numpy.random.RandomState(50 + step)
    return (r.randn(TRAIN_BATCH, 6, 6, 3).astype(F32) * 2 + 1,
            r.randint(0, 5, TRAIN_BATCH).astype(numpy.int32))


def optimizer(model):
    return optimizers.MomentumSGD(lr=0.1, momentum=0.9).setup(model)


def lossfun(model):
    return lambda x, t: F.softmax_cross_entropy(model(x), t)


def state(model):
    """{name: array} of every parameter and BatchNorm statistic of ``model``."""
    out = {'param' + n: numpy.array(p.array) for n, p in model.namedparams()}
    for path, link in model.namedlinks():
        for name in ('avg_mean', 'avg_var'):
            if getattr(link, name, None) is not None:
                out['{}/{}'.format(path, name)] = numpy.array(getattr(link, name))
    return out


# ---- ranks that would step differently (multinode.TrainStep's agreement) ---------------------

AGREE_STEPS = 8
PARTIAL_AT = 5                  # rank 0 has one image less at this step (a last partial batch)
PARTIAL = (3, 4)
GAIN_AT = 4                     # rank 0 alone changes Net's gain before this step
GAIN_CHECK_EVERY = 2
FAIL_STEPS = 6
BUILD_AT = 2                    # warmup 1: step 1 is the first recorded step, step 2 the build


def images_at(step):
    """Images per rank at ``step`` of the partial-batch run."""
    return PARTIAL if step == PARTIAL_AT else (TRAIN_BATCH // RANKS,) * RANKS


def agreed_batch(step):
    """The global batch of ``step`` of the partial-batch run (each rank takes its shard)."""
    return tuple(a[:sum(images_at(step))] for a in train_batch(step))


def shards_lossfun(model, images):
    """The mean over the ranks of each rank's mean loss over its shard (``images`` per rank):
    what the ranks' gradient mean is the gradient of, computed by one process."""
    def f(x, t):
        y = model(x)
        bounds = numpy.cumsum((0,) + tuple(images))
        return sum(F.softmax_cross_entropy(y[a:b], t[a:b])
                   for a, b in zip(bounds[:-1], bounds[1:])) / len(images)
    return f


class GainNet(Net):
    """Net with a Python number its forward multiplies by (a value a TrainStep's check sees
    change)."""

    def __init__(self):
        super().__init__()
        self.gain = 1.0

    def forward(self, x):
        return super().forward(x) * self.gain
