"""One rank of the multi-node tests: run by tests/test_multinode.py under ``mpiexec -n 2``.

    mpiexec -n 2 python tests/multinode_worker.py CASE OUTDIR

Trains the small network of ``multinode_common`` on this rank's half of each global batch and
writes rank-tagged results (parameters, loss scale, skipped steps, collectives) to OUTDIR.
"""
import os
import sys

import numpy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import chainer_tc  # noqa: E402,F401  (before chainer)
import chainer  # noqa: E402
import chainer.functions as F  # noqa: E402
import chainer.links as L  # noqa: E402
import chainermn  # noqa: E402

import multinode_common as common  # noqa: E402
from chainer_tc import multinode  # noqa: E402
from chainer_tc import optimizers  # noqa: E402


def shards(comm, outdir):
    """Each rank reads its DALI shard of a small real image set for one epoch, and evaluates
    over the whole set with multinode.Evaluator: the mean label, keys reported for some batches
    only (``big``; ``low``, which one rank's batches never report), and a ``(value, weight)``
    pair the model weighted itself (``even``: the mean even label, weighted by their count)."""
    import chainer.functions as F
    import dali_data
    from chainer_tc import dali
    data = dali_data.make_dataset(os.path.join(outdir, 'data-{}'.format(comm.rank)),
                                  n=common.DALI_IMAGES)

    def iterator():
        pipe = dali.imagenet_pipeline(data.root, data.ids_list, train=False, device='cpu',
                                      crop=32, num_threads=1, shard_id=comm.rank,
                                      num_shards=comm.size)
        return dali.DaliIterator(pipe, 3, repeat=False)

    batches = [numpy.asarray(t) for _, t in (dali.converter(b) for b in iterator())]
    labels = numpy.concatenate(batches)

    class MeanLabel(chainer.Link):
        def forward(self, x, t):
            t = numpy.asarray(t).astype(numpy.float64)
            even = t[t % 2 == 0]
            report = {'label': F.mean(F.cast(t, numpy.float64)),
                      'even': (even.mean() if even.size else 0.0, even.size)}
            if (t >= 5).any():
                report['big'] = (t >= 5).mean()
            if (t < 2).any():
                report['low'] = (t < 2).mean()
            chainer.report(report, self)

    ev = multinode.Evaluator(iterator(), MeanLabel(), comm, converter=dali.converter)
    result = ev()
    again = ev()
    numpy.savez(os.path.join(outdir, 'dali-{}.npz'.format(comm.rank)), labels=labels,
                batch_sizes=[len(b) for b in batches],
                mean=result[[k for k in result if k.endswith('/label')][0]], keys=sorted(result),
                **{'result' + k: v for k, v in result.items()},
                **{'again' + k: v for k, v in again.items()})


class Edges(chainer.Chain):
    """fc1 -> fc2 and three heads on fc1's output: ``only0``, which only rank 0's loss uses
    (rank 1 has no gradient for it); ``aux``, a lazy head called in training only (so first in
    the first training step, with values of each rank's own); ``frozen``, added after
    ``optimizer.setup`` (no update rule; its gradient enters GradientClipping's norm), and
    ``frozen0``, the same but used by rank 0's loss only."""

    def __init__(self, rank):
        super().__init__()
        r = numpy.random.RandomState(rank)            # different on each rank until broadcast
        with self.init_scope():
            self.fc1 = L.Linear(6, 8, initialW=r.randn(8, 6).astype(numpy.float32) * 0.3)
            self.fc2 = L.Linear(8, 5, initialW=r.randn(5, 8).astype(numpy.float32) * 0.3)
            self.only0 = L.Linear(8, 5, initialW=r.randn(5, 8).astype(numpy.float32) * 0.3)
            self.aux = L.Linear(None, 5)
        self.rank = rank

    def forward(self, x):
        h = F.relu(self.fc1(x))
        y = self.fc2(h)
        if chainer.config.train:
            y = y + self.aux(h)
        if self.rank == 0:
            y = y + self.only0(h)
        if hasattr(self, 'frozen'):
            y = y + self.frozen(h)
        if hasattr(self, 'frozen0') and self.rank == 0:
            y = y + self.frozen0(h)
        return y


def edges(comm, outdir):
    """The same steps replayed (warmup=1) and eager (warmup=100): every parameter equal on the
    ranks, and the replayed run equal to the eager one."""
    results = {}
    for warmup in (1, 100):
        numpy.random.seed(comm.rank)                  # aux's initializer: each rank's own
        model = Edges(comm.rank)
        opt = optimizers.MomentumSGD(lr=0.1, weight_decay=1e-3).setup(model)
        opt.add_hook(chainer.optimizer_hooks.GradientClipping(0.05))
        with model.init_scope():
            model.frozen = L.Linear(8, 5, initialW=numpy.full((5, 8), 0.1 * (comm.rank + 1),
                                                              numpy.float32))
            model.frozen0 = L.Linear(8, 5, initialW=numpy.full((5, 8), 0.2, numpy.float32))
        step = multinode.TrainStep(model, opt, comm,
                                   lambda x, t: F.softmax_cross_entropy(model(x), t),
                                   warmup=warmup)
        r = numpy.random.RandomState(7)
        for s in range(common.STEPS):
            x = r.randn(8, 6).astype(numpy.float32)
            t = r.randint(0, 5, 8).astype(numpy.int32)
            step(x[comm.rank * 4:(comm.rank + 1) * 4], t[comm.rank * 4:(comm.rank + 1) * 4])
        results['replays{}'.format(warmup)] = step.replays
        for name, p in model.namedparams():
            results['w{}{}'.format(warmup, name)] = p.array
            if name.startswith('/frozen'):      # not trained: the last step's mean gradient
                results['g{}{}'.format(warmup, name)] = p.grad
    numpy.savez(os.path.join(outdir, 'edges-{}.npz'.format(comm.rank)), **results)


class WithAux(chainer.Chain):
    """fc, and ``aux``, left without an update rule, whose output the loss reads times zero:
    its gradient is 0 * z, a NaN where the rank's ``z`` holds an inf."""

    def __init__(self):
        super().__init__()
        r = numpy.random.RandomState(0)
        with self.init_scope():
            self.fc = L.Linear(6, 5, initialW=r.randn(5, 6).astype(numpy.float32) * 0.3)
            self.aux = L.Linear(6, 3, initialW=numpy.ones((3, 6), numpy.float32))

    def loss(self, x, t, z):
        return F.softmax_cross_entropy(self.fc(x), t) + F.sum(self.aux(z)) * 0.0


def untrained_nan(comm, outdir):
    """Dynamic loss scaling, no optimizer hooks, and a NaN in the untrained link's gradient on
    rank 1 only, at one step: replayed (warmup=1) and eager (warmup=100)."""
    results = {}
    for warmup in (1, 100):
        model = WithAux()
        opt = optimizers.MomentumSGD(lr=0.1, weight_decay=1e-3).setup(model)
        opt.loss_scaling(initial_scale=16.0)
        model.aux.W.update_rule = model.aux.b.update_rule = None
        step = multinode.TrainStep(model, opt, comm, model.loss, warmup=warmup)
        r = numpy.random.RandomState(7)
        for s in range(common.STEPS):
            x = r.randn(8, 6).astype(numpy.float32)
            t = r.randint(0, 5, 8).astype(numpy.int32)
            z = numpy.ones((4, 6), numpy.float32)
            if s == common.OVERFLOW_STEP and comm.rank == 1:
                z[0, 0] = numpy.inf
            half = slice(comm.rank * 4, (comm.rank + 1) * 4)
            step(x[half], t[half], z)
        results['replays{}'.format(warmup)] = step.replays
        results['skipped{}'.format(warmup)] = opt.skipped_steps
        for name, p in model.namedparams():
            results['w{}{}'.format(warmup, name)] = p.array
    numpy.savez(os.path.join(outdir, 'untrained_nan-{}.npz'.format(comm.rank)), **results)


def scaling_one_rank(comm, outdir):
    """Dynamic loss scaling on rank 0 only, a link without an update rule, no hooks: the ranks
    differ in the step's signature (said), step eagerly, and must make the same collectives."""
    model = WithAux()
    opt = optimizers.MomentumSGD(lr=0.1).setup(model)
    model.aux.W.update_rule = model.aux.b.update_rule = None
    if comm.rank == 0:
        opt.loss_scaling(initial_scale=16.0)
    step = multinode.TrainStep(model, opt, comm, model.loss)
    r = numpy.random.RandomState(comm.rank)
    for _ in range(4):
        step(r.randn(4, 6).astype(numpy.float32), r.randint(0, 5, 4).astype(numpy.int32),
             numpy.ones((4, 6), numpy.float32))
    numpy.savez(os.path.join(outdir, 'scaling_one_rank-{}.npz'.format(comm.rank)),
                eager=step.eager_steps, aux_grad=model.aux.W.grad)


def main(case, outdir):
    nccl = case.startswith('nccl')
    comm = chainermn.create_communicator('pure_nccl' if nccl else 'naive')
    if case == 'dali':
        return shards(comm, outdir)
    if case == 'edges':
        return edges(comm, outdir)
    if case == 'untrained_nan':
        return untrained_nan(comm, outdir)
    if case == 'scaling_one_rank':
        return scaling_one_rank(comm, outdir)
    dtype = numpy.float16 if 'fp16' in case else numpy.float32
    with chainer.using_config('dtype', dtype):
        model = common.Net(seed=comm.rank)            # different on each rank until broadcast
        if nccl:
            import cupy
            cupy.cuda.Device(comm.intra_rank).use()
            model.to_device('@cupy:{}'.format(comm.intra_rank))
        opt = common.optimizer(model, dynamic='fp16' in case)
        results = {}
        if case.startswith('chainermn'):
            mn = chainermn.create_multi_node_optimizer(opt, comm)
            x, t = common.shard(common.batch(-1, dtype), comm.rank)
            mn.update(common.lossfun(model), x, t)    # ChainerMN's first update: broadcast only
            for s in range(common.STEPS):
                x, t = common.shard(common.batch(s, dtype), comm.rank)
                mn.update(common.lossfun(model), x, t)
        else:
            step = multinode.TrainStep(model, opt, comm, common.lossfun(model))
            for s in range(common.STEPS):
                x, t = common.shard(common.batch(s, dtype), comm.rank)
                if case.endswith('overflow') and s == common.OVERFLOW_STEP and comm.rank == 1:
                    x = x * dtype(numpy.inf)          # only this rank's gradients overflow
                if nccl:
                    x, t = cupy.asarray(x), cupy.asarray(t)
                step(x, t)
            results['collectives'] = step.allreduce.collectives
            results['replays'] = step.replays
        results['skipped'] = opt.skipped_steps
        results['scale'] = opt.loss_scale if opt.loss_scale is not None else 0.0
        for name, p in model.namedparams():
            results['param' + name] = chainer.backend.CpuDevice().send(p.array)
    numpy.savez(os.path.join(outdir, '{}-{}.npz'.format(case, comm.rank)), **results)


if __name__ == '__main__':
    main(sys.argv[1], sys.argv[2])
