"""Host time and FunctionNodes per training iteration on a tiny ResNet-50: the framework overhead
that limits fp16 training on a GPU, measured on the CPU.

    .venv/bin/python benchmarks/framework_overhead.py [--iters 20] [--out results.json]

ResNet-50 with every channel count divided by 16, 32x32 inputs, batch 1, 2 and 4, so that the
arithmetic is negligible and what is timed is Python, Chainer's graph and the optimizer:
- baseline: NCHW model from Chainer's links, chainer.optimizers.MomentumSGD + WeightDecay hook;
- chainer_tc: NHWC model (fused BN+Add+ReLU), chainer_tc.optimizers.MomentumSGD.
Counts every FunctionNode applied in forward and backward. Prints a table, writes JSON.
"""
import argparse
import collections
import json
import os
import platform
import sys
import time

import numpy

import chainer_tc  # noqa: F401  (before chainer)
import chainer
import chainer.functions as F

from chainer_tc import optimizers
from chainer_tc.models import ResNet50


class NodeCounter(chainer.FunctionHook):
    name = 'node_counter'

    def __init__(self):
        self.n = 0

    def forward_preprocess(self, function, in_data):
        self.n += 1


def setup(variant):
    numpy.random.seed(0)
    if variant == 'baseline':
        model = ResNet50('NCHW', n_classes=10, width=16)
        opt = chainer.optimizers.MomentumSGD(lr=0.01).setup(model)
        opt.add_hook(chainer.optimizer_hooks.WeightDecay(1e-4))
    else:
        model = ResNet50('NHWC', n_classes=10, width=16)
        opt = optimizers.MomentumSGD(lr=0.01, weight_decay=1e-4).setup(model)
    return model, opt


def measure(variant, batch, iters):
    model, opt = setup(variant)
    r = numpy.random.RandomState(0)
    x = r.randn(batch, 3, 32, 32).astype(numpy.float32)
    if variant != 'baseline':
        x = x.transpose(0, 2, 3, 1).copy()
    t = r.randint(0, 10, batch).astype(numpy.int32)

    def lossfun():
        return F.softmax_cross_entropy(model(x), t)
    opt.update(lossfun)                       # warm-up (lazy states)
    counter = NodeCounter()
    with counter:
        opt.update(lossfun)
    times = []
    for _ in range(iters):
        s = time.perf_counter()
        opt.update(lossfun)
        times.append(time.perf_counter() - s)
    return {'variant': variant, 'batch': batch, 'ms_per_iter': 1e3 * float(numpy.median(times)),
            'function_nodes_per_iter': counter.n,
            'params': len(list(model.params()))}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--iters', type=int, default=20)
    p.add_argument('--out', default=os.path.join(os.path.dirname(__file__), 'results',
                                                 'framework_overhead.json'))
    args = p.parse_args(argv)
    rows = []
    cases = [(v, b) for b in (1, 2, 4) for v in ('baseline', 'chainer_tc')]
    for i, (v, b) in enumerate(cases):
        sys.stderr.write('\r  [{:<{w}}] {} batch {}   '.format('#' * (i + 1), v, b, w=len(cases)))
        rows.append(measure(v, b, args.iters))
    sys.stderr.write('\r' + ' ' * 60 + '\r')
    print('{:>10} {:>5} {:>11} {:>8} {:>14}'.format('variant', 'batch', 'ms/iter', 'speedup',
                                                    'nodes/iter'))
    for r in rows:
        base = next(b for b in rows if b['batch'] == r['batch'] and b['variant'] == 'baseline')
        r['speedup'] = base['ms_per_iter'] / r['ms_per_iter']
        print('{:>10} {:>5} {:>11.2f} {:>7.2f}x {:>14}'.format(
            r['variant'], r['batch'], r['ms_per_iter'], r['speedup'],
            r['function_nodes_per_iter']))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump({'benchmark': 'framework_overhead', 'machine': platform.platform(),
                   'cpus': os.cpu_count(), 'rows': rows}, f, indent=1)
    print('wrote', args.out)
    return 0


if __name__ == '__main__':
    sys.exit(main())
