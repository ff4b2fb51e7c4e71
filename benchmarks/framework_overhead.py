"""Host time and FunctionNodes per training iteration on a tiny ResNet-50: the framework overhead
that limits fp16 training on a GPU, measured on the CPU.

    .venv/bin/python benchmarks/framework_overhead.py [--iters 20] [--out results.json]

ResNet-50 with every channel count divided by 16, 32x32 inputs, batch 1, 2 and 4, so that the
arithmetic is negligible and what is timed is Python, Chainer's graph and the optimizer:
- baseline: NCHW model from Chainer's links, chainer.optimizers.MomentumSGD + WeightDecay hook;
- chainer.static_graph: the same, with the model's forward under Chainer's @static_graph;
- chainer_tc: NHWC model (fused BN+Add+ReLU), chainer_tc.optimizers.MomentumSGD, eager;
- TrainStep: the same, each iteration replayed by chainer_tc.static_graph.TrainStep; its
  ms/iter includes the periodic check (one recorded eager step in ``check_every``, default
  100), timed separately and averaged in.
Counts the FunctionNodes applied per iteration (a replay applies none: it re-runs the recorded
array computations, counted as ops). All variants are measured in one run, interleaved, and
the speedups are ratios against the baseline of the same run. Prints a table, writes JSON.
"""
import argparse
import os
import platform
import sys
import warnings

import numpy

import _common
import chainer

from chainer.graph_optimizations.static_graph import static_graph

from chainer_tc import optimizers
from chainer_tc.models import ResNet50

VARIANTS = ('baseline', 'chainer.static_graph', 'chainer_tc', 'TrainStep')


class StaticResNet50(ResNet50):
    """The baseline model with its forward under Chainer's own static-graph optimization."""

    @static_graph
    def forward(self, x):
        return super().forward(x)


def setup(variant):
    numpy.random.seed(0)
    if variant in ('baseline', 'chainer.static_graph'):
        cls = StaticResNet50 if variant == 'chainer.static_graph' else ResNet50
        model = cls('NCHW', n_classes=10, width=16)
        opt = chainer.optimizers.MomentumSGD(lr=0.01).setup(model)
        opt.add_hook(chainer.optimizer_hooks.WeightDecay(1e-4))
    else:
        model = ResNet50('NHWC', n_classes=10, width=16)
        opt = optimizers.MomentumSGD(lr=0.01, weight_decay=1e-4).setup(model)
    return model, opt


def runner(variant, batch):
    """One variant at one batch size (the images in float32, cast by the model)."""
    model, opt = setup(variant)
    return _common.TinyStep(variant, model, opt, batch, replay=variant == 'TrainStep')


def result(r):
    row = {'variant': r.name, 'batch': r.batch, 'ms_per_iter': r.ms_per_iter(),
           'function_nodes_per_iter': sum(r.census().values()),
           'params': len(list(r.model.params())),
           # every parameter finite after the run: a variant that diverged is timed on NaNs
           'finite': all(bool(numpy.isfinite(p.array).all()) for p in r.model.params())}
    if r.step is not None:
        row['replayed_ops_per_iter'] = r.replayed_ops()
        row['ms_per_replay'] = r.ms_per_replay()
        row['ms_per_check'] = r.ms_per_check()
        row['check_every'] = r.step.check_every
        row['replays'] = r.step.replays
    return row


def measure(batch, iters, warmup=5):
    runners = [runner(v, batch) for v in VARIANTS]
    _common.interleave(runners, iters, warmup)   # drift hits every variant alike
    return [result(r) for r in runners]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--iters', type=int, default=20)
    p.add_argument('--out', default=os.path.join(os.path.dirname(__file__), 'results',
                                                 'framework_overhead.json'))
    args = p.parse_args(argv)
    rows = []
    batches = (1, 2, 4)
    for i, b in enumerate(batches):
        sys.stderr.write('\r  [{:<{w}}] batch {}   '.format('#' * (i + 1), b, w=len(batches)))
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', UserWarning)   # batch 1: single-sample BN warns
            rows.extend(measure(b, args.iters))
    sys.stderr.write('\r' + ' ' * 60 + '\r')
    print('{:>22} {:>5} {:>9} {:>8} {:>11} {:>11}'.format(
        'variant', 'batch', 'ms/iter', 'speedup', 'nodes/iter', 'ops/iter'))
    for r in rows:
        base = next(b for b in rows if b['batch'] == r['batch'] and b['variant'] == 'baseline')
        r['speedup'] = base['ms_per_iter'] / r['ms_per_iter']
        print('{:>22} {:>5} {:>9.2f} {:>7.2f}x {:>11} {:>11}'.format(
            r['variant'], r['batch'], r['ms_per_iter'], r['speedup'],
            r['function_nodes_per_iter'], r.get('replayed_ops_per_iter', '')))
    for r in rows:
        if not r['finite']:
            print('{} at batch {}: its parameters hold NaN or inf after the run; its time is '
                  "that of a diverged run (docs/performance.md: Chainer's static_graph "
                  'computes wrong gradients here from its second iteration)'.format(
                      r['variant'], r['batch']))
    for r in rows:
        if 'ms_per_check' in r:
            print('TrainStep at batch {}: {:.2f} ms a replay, {:.2f} ms a check (one call in {}), '
                  'averaged in above'.format(r['batch'], r['ms_per_replay'], r['ms_per_check'],
                                             r['check_every']))
    _common.write_json(args.out, {'benchmark': 'framework_overhead',
                                  'machine': platform.platform(), 'cpus': os.cpu_count(),
                                  'rows': rows})
    print('wrote', args.out)
    return 0


if __name__ == '__main__':
    sys.exit(main())
