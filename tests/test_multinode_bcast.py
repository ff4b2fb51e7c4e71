"""multinode.TrainStep's broadcasts of the model without mpiexec: a one-rank stand-in
communicator whose ``bcast_data`` packs every parameter in ``chainer.get_dtype()`` and unpacks it,
as ChainerMN's ``pure_nccl`` communicator does (pure_nccl_communicator.py ``bcast_data``:
``data_dtype = chainer.get_dtype()``, then ``_memory_utility.pack_params`` casts each parameter
to it), so a float32 parameter broadcast under ``dtype`` float16 or mixed16 comes back rounded."""
import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer)
import chainer
import chainer.functions as F
import chainer.links as L

from chainer_tc import multinode
from chainer_tc import optimizers


class PackingInConfigDtype:
    """One rank; ``bcast_data`` round-trips every parameter through ``chainer.get_dtype()``
    (``rounding=False``: leaves them as they are) and records that dtype."""

    size, rank = 1, 0

    def __init__(self, rounding=True):
        self.mpi_comm = self
        self.rounding = rounding
        self.dtypes = []

    def bcast_data(self, model):
        packed = chainer.get_dtype()
        self.dtypes.append(packed)
        for p in model.params():
            if p.array is not None and self.rounding:
                p.array[...] = p.array.astype(packed).astype(p.array.dtype)


def constant(values, dtype):
    return chainer.initializers.Constant(values.astype(dtype), dtype)


class Mixed(chainer.Chain):
    """float16 weights (the config's), a float32 classifier and BatchNorm (as the float16
    ResNet-50's), a float64 link when asked, and a lazy head called in training only (its
    parameters come into being at the first training step: the second broadcast)."""

    def __init__(self, float64=False):
        super().__init__()
        r = numpy.random.RandomState(0)
        with self.init_scope():
            self.fc1 = L.Linear(6, 8, initialW=constant(r.randn(8, 6), numpy.float16),
                                initial_bias=constant(numpy.zeros(8), numpy.float16))
            self.bn = L.BatchNormalization(8, dtype=numpy.float32)      # as under mixed16
            self.fc = L.Linear(8, 5, initialW=constant(r.randn(5, 8) * 0.3 + 1e-4, numpy.float32),
                               initial_bias=constant(numpy.full(5, 0.1 + 2 ** -20), numpy.float32))
            self.aux = L.Linear(None, 5, initialW=chainer.initializers.Normal(
                0.3, dtype=numpy.float32, rng=numpy.random.RandomState(1)),
                initial_bias=constant(numpy.full(5, 0.1), numpy.float32))
            if float64:
                self.wide = L.Linear(8, 5, initialW=constant(r.randn(5, 8) + 1e-12, numpy.float64),
                                     initial_bias=constant(numpy.full(5, 0.1), numpy.float64))
        self.float64 = float64

    def forward(self, x):
        h = F.cast(F.relu(self.fc1(x)), numpy.float32)
        y = self.fc(self.bn(h))
        if chainer.config.train:
            y = y + self.aux(h)
        if self.float64:
            y = y + F.cast(self.wide(F.cast(h, numpy.float64)), numpy.float32)
        return y


def train(comm, config_dtype, float64):
    with chainer.using_config('dtype', config_dtype):
        model = Mixed(float64)
        opt = optimizers.MomentumSGD(lr=0.1).setup(model)
        step = multinode.TrainStep(
            model, opt, comm, lambda x, t: F.softmax_cross_entropy(model(x), t))
        r = numpy.random.RandomState(7)
        for _ in range(3):
            step(r.randn(4, 6).astype(numpy.float16), r.randint(0, 5, 4).astype(numpy.int32))
            assert chainer.config.dtype == config_dtype, 'the config is given back'
        return {n: p.array.copy() for n, p in model.namedparams()}


@pytest.mark.parametrize('config_dtype', [chainer.mixed16, numpy.float16])
@pytest.mark.parametrize('float64', [False, True])
def test_the_model_is_broadcast_without_rounding_its_float32_parameters(config_dtype, float64):
    """(ChainerMN's pure_nccl packs the broadcast in chainer.get_dtype(): float32 parameters,
    BatchNorm's and the classifier's, were rounded to float16 on every rank at the first step
    and after every resume.) Both broadcasts (before the first step; the lazy head's at its
    first training step) run with dtype float32, float64 with a float64 parameter, and the
    run's parameters are those of a broadcast that changes nothing, to the bit. Found by
    review."""
    comm = PackingInConfigDtype()
    got = train(comm, config_dtype, float64)
    want = train(PackingInConfigDtype(rounding=False), config_dtype, float64)
    for name in want:
        numpy.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert {str(got[n].dtype) for n in got} == (
        {'float16', 'float32', 'float64'} if float64 else {'float16', 'float32'})
    wide = numpy.dtype(numpy.float64 if float64 else numpy.float32)
    assert comm.dtypes == [wide, wide], 'one broadcast before the first step, one for aux'
