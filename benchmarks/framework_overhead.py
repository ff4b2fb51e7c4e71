"""Host time and FunctionNodes per training iteration on a tiny ResNet-50: the framework overhead
that limits fp16 training on a GPU, measured on the CPU.

    .venv/bin/python benchmarks/framework_overhead.py [--iters 20] [--out results.json]

ResNet-50 with every channel count divided by 16, 32x32 inputs, batch 1, 2 and 4, so that the
arithmetic is negligible and what is timed is Python, Chainer's graph and the optimizer:
- baseline: NCHW model from Chainer's links, chainer.optimizers.MomentumSGD + WeightDecay hook;
- chainer.static_graph: the same, with the model's forward under Chainer's @static_graph;
- chainer_tc: NHWC model (fused BN+Add+ReLU), chainer_tc.optimizers.MomentumSGD, eager;
- TrainStep: the same, each iteration replayed by chainer_tc.static_graph.TrainStep.
Counts the FunctionNodes applied per iteration (a replay applies none: it re-runs the recorded
array computations, counted as ops). All variants are measured in one run, interleaved, and
the speedups are ratios against the baseline of the same run. Prints a table, writes JSON.
"""
import argparse
import contextlib
import io
import json
import os
import platform
import sys
import time
import warnings

import numpy

import chainer_tc  # noqa: F401  (before chainer)
import chainer
import chainer.functions as F

from chainer.graph_optimizations.static_graph import static_graph

from chainer_tc import optimizers
from chainer_tc.models import ResNet50
from chainer_tc.static_graph import TrainStep

VARIANTS = ('baseline', 'chainer.static_graph', 'chainer_tc', 'TrainStep')


class StaticResNet50(ResNet50):
    """The baseline model with its forward under Chainer's own static-graph optimization."""

    @static_graph
    def forward(self, x):
        return super().forward(x)


class NodeCounter(chainer.FunctionHook):
    name = 'node_counter'

    def __init__(self):
        self.n = 0

    def forward_preprocess(self, function, in_data):
        self.n += 1


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


class Runner:
    """One variant at one batch size: ``run()`` does one training iteration."""

    def __init__(self, variant, batch):
        self.variant, self.batch = variant, batch
        self.model, self.opt = setup(variant)
        r = numpy.random.RandomState(0)
        x = r.randn(batch, 3, 32, 32).astype(numpy.float32)
        self.x = x if variant in ('baseline', 'chainer.static_graph') \
            else x.transpose(0, 2, 3, 1).copy()
        self.t = r.randint(0, 10, batch).astype(numpy.int32)
        model = self.model

        def lossfun(x, t):
            return F.softmax_cross_entropy(model(x), t)
        self.lossfun = lossfun
        self.step = TrainStep(model, self.opt, lossfun) if variant == 'TrainStep' else None
        self.times = []

    def run(self):
        with contextlib.redirect_stdout(io.StringIO()):   # chainer.static_graph prints
            if self.step is not None:
                self.step(self.x, self.t)
            else:
                self.opt.update(self.lossfun, self.x, self.t)

    def timed(self):
        s = time.perf_counter()
        self.run()
        self.times.append(time.perf_counter() - s)

    def nodes_per_iter(self):
        counter = NodeCounter()
        with counter:
            self.run()
        return counter.n

    def result(self):
        row = {'variant': self.variant, 'batch': self.batch,
               'ms_per_iter': 1e3 * float(numpy.median(self.times)),
               'function_nodes_per_iter': self.nodes_per_iter(),
               'params': len(list(self.model.params()))}
        if self.step is not None:
            replay = next(iter(self.step._entries.values())).replay
            row['replayed_ops_per_iter'] = len(replay.program._ops)
            row['replays'] = self.step.replays
        return row


def measure(batch, iters, warmup=5):
    runners = [Runner(v, batch) for v in VARIANTS]
    for r in runners:
        for _ in range(warmup):
            r.run()
    for _ in range(iters):                     # interleaved: drift hits every variant alike
        for r in runners:
            r.timed()
    return [r.result() for r in runners]


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
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump({'benchmark': 'framework_overhead', 'machine': platform.platform(),
                   'cpus': os.cpu_count(), 'rows': rows}, f, indent=1)
    print('wrote', args.out)
    return 0


if __name__ == '__main__':
    sys.exit(main())
