"""What tests/test_multinode.py and its MPI worker share: the network, the data, the optimizer."""
import numpy

import chainer
import chainer.functions as F
import chainer.links as L

from chainer_tc import optimizers

STEPS = 8
OVERFLOW_STEP = 5
GLOBAL_BATCH = 8
DALI_IMAGES = 13          # odd: the two shards differ in size


class Net(chainer.Chain):
    """No BatchNorm: its statistics are per rank, so 2 ranks would not equal 1 process."""

    def __init__(self, seed=0):
        super().__init__()
        dtype = chainer.get_dtype()
        init = chainer.initializers.Normal(0.5, dtype=dtype, rng=numpy.random.RandomState(seed))
        with self.init_scope():
            self.fc1 = L.Linear(12, 16, initialW=init)
            self.fc2 = L.Linear(16, 5, initialW=init)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def optimizer(model, dynamic):
    opt = optimizers.MomentumSGD(lr=0.1, weight_decay=1e-3).setup(model)
    if dynamic:
        opt.loss_scaling(interval=3, initial_scale=2.0 ** 8)
    return opt


def lossfun(model):
    def f(x, t):
        return F.softmax_cross_entropy(F.cast(model(x), numpy.float32), t)
    return f


def batch(step, dtype):
    r = numpy.random.RandomState(100 + step)
    return (r.randn(GLOBAL_BATCH, 12).astype(dtype),
            r.randint(0, 5, GLOBAL_BATCH).astype(numpy.int32))


def shard(b, rank, size=2):
    n = GLOBAL_BATCH // size
    return tuple(a[rank * n:(rank + 1) * n] for a in b)
