"""Gradient allreduce + update per step on 2 CPU ranks, ResNet-50's parameter set: chainer_tc's
one collective on one buffer against ChainerMN's paths, measured in one run.

    .venv/bin/python benchmarks/multinode_allreduce.py [--repeat 5] [--out results.json]

(it starts itself under ``mpiexec -n 2``). Per step, with the 162 gradients of
``chainer.links.ResNet50Layers`` (25.6M float32 elements) on each rank:
- chainermn naive: ``communicator.multi_node_mean_grad(model)`` (ChainerMN's default on CPUs: one
  MPI Allreduce per parameter) + chainer_tc's MomentumSGD update;
- chainer_tc: ``chainer_tc.multinode.GradientAllreduce`` on the flat gradient buffers a
  TrainStep replay leaves (one collective, no packing) + the update over flat buffers.
(ChainerMN's packing communicators, ``flat`` and ``pure_nccl``, keep their buffers on a GPU: not
measurable here.) Prints a table (rank 0) and writes JSON. Not part of the tests.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy

HERE = os.path.dirname(os.path.abspath(__file__))


def _launch(argv):
    mpiexec = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    cmd = [mpiexec, '--allow-run-as-root', '--oversubscribe', '-n', '2', sys.executable,
           os.path.abspath(__file__), '--rank-worker'] + argv
    return subprocess.call(cmd)


def _worker(args):
    import chainer_tc  # noqa: F401  (before chainer)
    import chainermn
    from chainer_tc import multinode
    from chainer_tc import optimizers

    sys.path.insert(0, HERE)
    import optimizer_update as ou

    comm = chainermn.create_communicator('naive')
    variants = []
    for variant in ('chainermn naive', 'chainer_tc'):
        model = ou.resnet50_params(numpy.float32)
        opt = optimizers.MomentumSGD(lr=ou.LR, momentum=ou.MOMENTUM,
                                     weight_decay=ou.WD).setup(model)
        ou.set_grads(model, numpy, seed=comm.rank)
        if variant == 'chainer_tc':
            variants.append((variant,) + _ours(comm, opt, multinode))
        else:
            variants.append((variant,) + _chainermn(comm, model, opt, chainermn))
    params = list(model.params())
    for _, reduce, update, _ in variants:                   # warm-up
        reduce()
        update()
    times = {name: ([], []) for name, _, _, _ in variants}
    before = {name: calls() for name, _, _, calls in variants}
    for _ in range(args.repeat):                           # interleaved: load hits both alike
        for name, reduce, update, _ in variants:
            for part, fn in zip(times[name], (reduce, update)):
                comm.mpi_comm.Barrier()
                t = time.perf_counter()
                fn()
                part.append(time.perf_counter() - t)
    rows = []
    for name, _, _, calls in variants:
        reduce_ms, update_ms = (1e3 * float(numpy.median(t)) for t in times[name])
        rows.append({'variant': name, 'allreduce_ms': reduce_ms, 'update_ms': update_ms,
                     'ms_per_step': reduce_ms + update_ms,
                     'collective_calls_per_step': (calls() - before[name]) / args.repeat})
    if comm.rank != 0:
        return 0
    base = rows[0]
    print('{:>16} {:>12} {:>10} {:>10} {:>9} {:>9} {:>17}'.format(
        'variant', 'allreduce ms', 'update ms', 'ms/step', 'allreduce', 'step', 'collective calls'))
    for r in rows:
        r['allreduce_speedup'] = base['allreduce_ms'] / r['allreduce_ms']
        r['speedup'] = base['ms_per_step'] / r['ms_per_step']
        print('{:>16} {:>12.1f} {:>10.1f} {:>10.1f} {:>8.2f}x {:>8.2f}x {:>17.0f}'.format(
            r['variant'], r['allreduce_ms'], r['update_ms'], r['ms_per_step'],
            r['allreduce_speedup'], r['speedup'], r['collective_calls_per_step']))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump({'benchmark': 'multinode_allreduce', 'ranks': comm.size,
                   'machine': platform.platform(), 'cpus': os.cpu_count(),
                   'parameters': len(params), 'elements': sum(p.size for p in params),
                   'rows': rows}, f, indent=1)
    print('wrote', args.out)
    return 0


def _ours(comm, opt, multinode):
    """One collective on the flat gradient buffers a TrainStep replay leaves, then the update."""
    flat = opt._flat
    buffers, views = flat.grad_buffers()
    for e, v in zip(flat.entries, views):
        v[...] = e.param.grad
    reduce = multinode.GradientAllreduce(comm)
    plan = opt._plan(flat, views, flat_grads=buffers)

    return (lambda: reduce(buffers)), (lambda: opt._step(plan)), lambda: reduce.calls


def _chainermn(comm, model, opt, chainermn):
    """ChainerMN's default CPU path (one Allreduce per parameter, counted), then the update."""
    count = [0]
    real = comm.mpi_comm

    class Counting:
        """The MPI communicator, counting Allreduce calls."""

        def __getattr__(self, name):
            return getattr(real, name)

        def Allreduce(self, *a, **k):
            count[0] += 1
            return real.Allreduce(*a, **k)
    counting = Counting()

    def reduce():
        comm.mpi_comm = counting
        try:
            comm.multi_node_mean_grad(model)
        finally:
            comm.mpi_comm = real
    return reduce, opt.update, lambda: count[0]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--repeat', type=int, default=5)
    p.add_argument('--out', default=os.path.join(HERE, 'results', 'multinode_allreduce.json'))
    p.add_argument('--rank-worker', action='store_true', help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.rank_worker:
        return _launch([a for a in argv])
    return _worker(args)


if __name__ == '__main__':
    sys.exit(main())
