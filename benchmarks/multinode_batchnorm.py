"""What the multi-node BatchNormalization costs per training step on 2 CPU ranks: the tiny
ResNet-50 of framework_overhead.py (NHWC, width/16, 32x32, 10 classes), each rank on its own
batch, its BatchNorm statistics per rank or over both ranks, measured in one run.

    .venv/bin/python benchmarks/multinode_batchnorm.py [--iters 20] [--batch 4] [--out results.json]

(it starts itself under ``mpiexec -n 2``). Variants, each with chainer_tc's MomentumSGD:
- per-rank BN, TrainStep: ``multinode.TrainStep`` (one gradient collective per step), the
  model's own BatchNorm links;
- multi-node BN, TrainStep: the same on ``multinode.create_mnbn_model(model, comm)``;
- per-rank BN / multi-node BN, ChainerMN's wrapper: eager steps through
  ``multinode.create_multi_node_optimizer`` (ChainerMN's ``naive`` communicator: one MPI call
  per parameter).
Host ms per step (median of interleaved rounds, the ranks meeting at a barrier before each
step; TrainStep's periodic check averaged in) and the multi-node BatchNorm's collectives per
step (host exchanges of row counts, allgathers of summaries, allreduces of gradient sums).
On GPUs with NCCL the summaries and sums stay on the device: this CPU run times MPI on the
host and the NumPy paths. Prints a table (rank 0) and writes JSON. Not part of the tests.
"""
import argparse
import collections
import contextlib
import io
import os
import platform
import subprocess
import sys
import time

import numpy

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, 'results', 'multinode_batchnorm.json')


def _launch(argv):
    mpiexec = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    return subprocess.call([mpiexec, '--allow-run-as-root', '--oversubscribe', '-n', '2',
                            sys.executable, os.path.abspath(__file__), '--rank-worker'] + argv)


def _counting(collectives):
    """Wraps the multi-node BatchNorm's three collectives to count their calls (the host
    exchanges of row counts that are made: a replay answers them from its recorded step)."""
    counts = collections.Counter()
    for name in ('_allgather_objects', 'allgather', 'allreduce_sum'):
        original = getattr(collectives, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)
        setattr(collectives, name, counted)
    return counts


class _Variant:
    def __init__(self, name, comm, mnbn, replay, batch):
        import chainer.functions as F
        from chainer_tc import multinode
        from chainer_tc import optimizers
        from chainer_tc.models import ResNet50
        numpy.random.seed(0)
        model = ResNet50('NHWC', n_classes=10, width=16)
        if mnbn:
            model = multinode.create_mnbn_model(model, comm)
        opt = optimizers.MomentumSGD(lr=0.01, momentum=0.9).setup(model)
        r = numpy.random.RandomState(comm.rank)
        self.x = r.randn(batch, 32, 32, 3).astype(numpy.float32)
        self.t = r.randint(0, 10, batch).astype(numpy.int32)

        def lossfun(x, t):
            return F.softmax_cross_entropy(model(x), t)
        self.name, self.mnbn, self.replay = name, mnbn, replay
        if replay:
            self.step = multinode.TrainStep(model, opt, comm, lossfun)
            self._run = lambda: self.step(self.x, self.t)
        else:
            self.step = None
            opt = multinode.create_multi_node_optimizer(opt, comm)
            self._run = lambda: opt.update(lossfun, self.x, self.t)
        self.times = []

    def run(self):
        with contextlib.redirect_stdout(io.StringIO()):
            self._run()


def _worker(args):
    import chainer_tc  # noqa: F401  (before chainer)
    import chainermn
    from chainer_tc.multinode import collectives

    sys.path.insert(0, HERE)
    import _common

    comm = chainermn.create_communicator('naive')
    counts = _counting(collectives)
    variants = [_Variant('per-rank BN, TrainStep', comm, False, True, args.batch),
                _Variant('multi-node BN, TrainStep', comm, True, True, args.batch),
                _Variant("per-rank BN, ChainerMN's wrapper", comm, False, False, args.batch),
                _Variant("multi-node BN, ChainerMN's wrapper", comm, True, False, args.batch)]
    for i, v in enumerate(variants):                    # warm-up: traces, replays settle
        for _ in range(args.warmup):
            v.run()
        if comm.rank == 0:
            _common.progress('warm-up {}/{}'.format(i + 1, len(variants)), end='\r')
    per_step = {}
    for v in variants:
        counts.clear()
        v.run()
        per_step[v.name] = dict(counts)
    for k in range(args.iters):                         # interleaved rounds
        for v in variants:
            comm.mpi_comm.Barrier()
            s = time.perf_counter()
            v.run()
            v.times.append(time.perf_counter() - s)
        if comm.rank == 0:
            _common.progress('round {}/{}'.format(k + 1, args.iters), end='\r')
    checks = {}
    for v in variants:       # TrainStep's periodic check, timed on its own (every rank)
        if v.step is not None and v.step.check_every:
            every, times = v.step.check_every, []
            v.step.check_every = 1
            for _ in range(3):
                comm.mpi_comm.Barrier()
                s = time.perf_counter()
                v.run()
                times.append(time.perf_counter() - s)
            v.step.check_every = every
            checks[v.name] = (1e3 * float(numpy.median(times)), every)
    rows = []
    for v in variants:
        ms = 1e3 * float(numpy.median(v.times))
        if v.name in checks:
            ms = _common.with_checks(ms, *checks[v.name])
        # the slower rank decides a step: both ranks' medians, the larger kept
        ms = max(comm.mpi_comm.allgather(ms))
        c = per_step[v.name]
        rows.append({'variant': v.name, 'ms_per_step': ms,
                     'count_exchanges_per_step': c.get('_allgather_objects', 0),
                     'summary_allgathers_per_step': c.get('allgather', 0),
                     'sum_allreduces_per_step': c.get('allreduce_sum', 0),
                     'replays': None if v.step is None else v.step.replays})
    if comm.rank != 0:
        return 0
    for r, base in zip(rows, (rows[0], rows[0], rows[2], rows[2])):
        r['vs_per_rank_bn'] = r['ms_per_step'] / base['ms_per_step']
    print()
    print(_common.format_table(
        ['variant', 'ms/step', 'vs per-rank BN', 'count exchanges', 'summary allgathers',
         'sum allreduces'],
        [[r['variant'], '{:.2f}'.format(r['ms_per_step']), '{:.2f}x'.format(r['vs_per_rank_bn']),
          r['count_exchanges_per_step'], r['summary_allgathers_per_step'],
          r['sum_allreduces_per_step']] for r in rows]))
    _common.write_json(args.out, {
        'benchmark': 'multinode_batchnorm', 'ranks': comm.size, 'batch_per_rank': args.batch,
        'iters': args.iters, 'model': 'ResNet50 NHWC width/16, 32x32, 10 classes',
        'machine': _common.machine_info(), 'python': platform.python_version(), 'rows': rows})
    print('wrote', args.out)
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--iters', type=int, default=20, help='timed rounds (default 20)')
    p.add_argument('--warmup', type=int, default=4,
                   help='untimed steps per variant first (default 4: the trace is built)')
    p.add_argument('--batch', type=int, default=4, help='images per rank (default 4)')
    p.add_argument('--out', default=DEFAULT_OUT, help='JSON output (default %(default)s)')
    p.add_argument('--rank-worker', action='store_true', help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_worker:
        return _worker(args)
    return _launch(list(argv if argv is not None else sys.argv[1:]))


if __name__ == '__main__':
    sys.exit(main())
