"""Samples/s and host time per training iteration on a GPU, eager against a captured TrainStep.

    .venv/bin/python benchmarks/step_replay_gpu.py [--blocks 4 16 48] [--batch 32 64 256]
                                                   [--iters 50] [--out results/step_replay_gpu.json]

The model is a stack of residual-free blocks Linear -> chainer_tc BatchNormalization -> ReLU
(width 256, 10 classes): everything in it is capturable with CuPy alone (Linear through the
capture's own cuBLAS handle, our BN kernels), so it runs on a GPU machine without cuDNN, and its
depth can grow without its arithmetic hiding the framework (each block is ~15 kernels forward
and backward). For each (dtype, blocks, batch): eager Chainer steps with chainer_tc's
MomentumSGD, then TrainStep (warm-up, capture, replay), each timed over ``--iters`` iterations
after a synchronize, the GPU synchronized at the end: samples/s, and host ms per iteration (the
time until the Python call returns, which for a replay is the launch). TrainStep's figures
average in its periodic check (one recorded eager step compared with the trace in every
``check_every``, default 100), timed apart; the JSON has the replays alone too. The ResNet-50 rows of
docs/performance.md need cuDNN (benchmarks/ablation.py). Prints a table, writes JSON; exits with
a message where there is no GPU.
"""
import argparse
import sys
import time
import warnings

import numpy

import _common
import chainer
import chainer.functions as F
import chainer.links as L

from chainer_tc import links as TL
from chainer_tc import optimizers
from chainer_tc.static_graph import TrainStep

WIDTH, CLASSES = 256, 10


class Blocks(chainer.ChainList):
    def __init__(self, blocks, dtype):
        links = []
        for i in range(blocks):
            links.append(L.Linear(WIDTH, WIDTH, nobias=True,
                                  initialW=chainer.initializers.HeNormal(dtype=dtype)))
            links.append(TL.BatchNormalization(WIDTH, dtype=dtype))
        links.append(L.Linear(WIDTH, CLASSES, initialW=chainer.initializers.HeNormal(dtype=dtype),
                              initial_bias=chainer.initializers.Zero(dtype)))
        super().__init__(*links)

    def forward(self, x, t):
        h = x
        for i in range(0, len(self) - 1, 2):
            h = F.relu(self[i + 1](self[i](h)))
        return F.softmax_cross_entropy(self[-1](h), t)


def measure(blocks, batch, dtype, iters, captured):
    import cupy
    model = Blocks(blocks, dtype)
    model.to_device('@cupy:0')
    opt = optimizers.MomentumSGD(lr=0.01, weight_decay=1e-4).setup(model)
    if dtype == numpy.float16:
        opt.loss_scaling()
    x = cupy.random.standard_normal((batch, WIDTH)).astype(dtype)
    t = cupy.random.randint(0, CLASSES, batch).astype(numpy.int32)
    if captured:
        step = TrainStep(model, opt, model)
        run = lambda: step(x, t)                       # noqa: E731
    else:
        run = lambda: opt.update(model, x, t)          # noqa: E731
    for _ in range(5):                                 # warm-up (and the capture)
        run()
    cupy.cuda.Device().synchronize()
    host = 0.0
    start = time.perf_counter()
    for _ in range(iters):
        s = time.perf_counter()
        run()
        host += time.perf_counter() - s
    cupy.cuda.Device().synchronize()
    wall = time.perf_counter() - start
    out = {'samples_per_s': batch * iters / wall, 'host_ms': 1e3 * host / iters,
           'wall_ms': 1e3 * wall / iters}
    if captured:
        out['traces'], out['replays'] = step.traces, step.replays
        # --iters calls never reach the periodic check (one eager step and a comparison in
        # check_every): timed apart, and averaged in
        check = _common.gpu_check_ms(step, run)
        wall_ms = _common.with_checks(out['wall_ms'], check, step.check_every)
        out.update(check_ms=check, check_every=step.check_every, wall_ms_replays=out['wall_ms'],
                   host_ms_replays=out['host_ms'], samples_per_s_replays=out['samples_per_s'],
                   wall_ms=wall_ms, samples_per_s=1e3 * batch / wall_ms,
                   host_ms=_common.with_checks(out['host_ms'], check, step.check_every))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--blocks', type=int, nargs='+', default=[4, 16, 48])
    parser.add_argument('--batch', type=int, nargs='+', default=[32, 64, 256])
    parser.add_argument('--dtype', nargs='+', default=['float32', 'float16'])
    parser.add_argument('--iters', type=int, default=50)
    parser.add_argument('--out', default='benchmarks/results/step_replay_gpu.json')
    args = parser.parse_args(argv)
    if not _common.gpu_available():
        print('step_replay_gpu: no CUDA GPU here; nothing to measure.')
        return 0
    rows, results = [], []
    for dtype in args.dtype:
        for blocks in args.blocks:
            for batch in args.batch:
                _common.progress('{} blocks={} batch={}'.format(dtype, blocks, batch))
                with warnings.catch_warnings():
                    # a step that cannot be captured would time eager against eager
                    warnings.filterwarnings('error', message='TrainStep: this step cannot be',
                                            category=RuntimeWarning)
                    eager = measure(blocks, batch, numpy.dtype(dtype).type, args.iters, False)
                    step = measure(blocks, batch, numpy.dtype(dtype).type, args.iters, True)
                results.append({'dtype': dtype, 'blocks': blocks, 'batch': batch,
                                'eager': eager, 'TrainStep': step})
                rows.append((dtype, blocks, batch,
                             '{:.0f}'.format(eager['samples_per_s']),
                             '{:.0f}'.format(step['samples_per_s']),
                             '{:.2f}x'.format(step['samples_per_s'] / eager['samples_per_s']),
                             '{:.2f}'.format(eager['host_ms']), '{:.3f}'.format(step['host_ms'])))
    print(_common.format_table(('dtype', 'blocks', 'batch', 'eager samples/s',
                                'TrainStep samples/s', 'speed-up', 'eager host ms',
                                'step host ms'), rows))
    _common.write_json(args.out, {'machine': _common.machine_info(), 'iters': args.iters,
                                  'width': WIDTH, 'results': results})
    return 0


if __name__ == '__main__':
    sys.exit(main())
