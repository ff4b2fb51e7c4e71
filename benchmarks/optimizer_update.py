"""Optimizer update on the full ResNet-50 parameter set: chainer_tc against Chainer.

    .venv/bin/python benchmarks/optimizer_update.py              # CPU (and the GPU if there is one)
    .venv/bin/python benchmarks/optimizer_update.py --repeat 20 --out results.json

Measures, in one run so that the ratios are fair:
- time per update of chainer.optimizers.MomentumSGD + optimizer_hooks.WeightDecay (float32, and
  float16 parameters with use_fp32_update, as Chainer's mixed-precision recipe does) against
  chainer_tc.optimizers.MomentumSGD (float32, and float16 with dynamic loss scaling);
- chainer_tc's bytes moved per update and the bandwidth that achieves, against this machine's
  copy bandwidth (a large NumPy copy);
- kernel launches per update: chainer_tc's counted through the emulator; Chainer's from its code
  (per parameter: the WeightDecay and momentum elementwise kernels, plus two casts with
  use_fp32_update, plus an isfinite and an all() with a host synchronisation each under dynamic
  loss scaling);
- on a GPU (when CuPy finds one): the same updates timed with CUDA events, and GB/s against the
  device's memory bandwidth.
Prints a table and writes JSON. Not part of the tests.
"""
import argparse
import json
import os
import platform
import sys
import time

import numpy

import _common
import chainer

from chainer_tc import kernels
from chainer_tc import optimizers

LR, MOMENTUM, WD = 0.1, 0.9, 1e-4


def resnet50_params(dtype):
    """The 162 parameters of chainer.links.ResNet50Layers (25.6M elements), as a Link."""
    model = chainer.links.ResNet50Layers(pretrained_model=None)
    for p in model.params():
        p.array = p.array.astype(dtype)
    return model


def set_grads(model, xp, seed=0):
    r = numpy.random.default_rng(seed)
    for p in model.params():
        g = (r.standard_normal(p.shape, dtype=numpy.float32) * 1e-3).astype(p.dtype)
        p.grad = xp.asarray(g)


def chainer_optimizer(model, fp16, loss_scaling=False, lr=LR):
    """Chainer's recipe: MomentumSGD + WeightDecay (+ use_fp32_update for fp16, + its dynamic
    loss scaling with ``loss_scaling``)."""
    opt = chainer.optimizers.MomentumSGD(lr=lr, momentum=MOMENTUM)
    if fp16:
        opt.use_fp32_update()
    opt.setup(model)
    opt.add_hook(chainer.optimizer_hooks.WeightDecay(WD))
    if loss_scaling:
        opt.loss_scaling()
    return opt


def ours_optimizer(model, fp16, lr=LR):
    opt = optimizers.MomentumSGD(lr=lr, momentum=MOMENTUM, weight_decay=WD).setup(model)
    if fp16:
        opt.loss_scaling(initial_scale=1.0)     # scale 1: the synthetic gradients stay finite
    return opt


def time_host(update, repeat):
    update()                                    # warm-up (allocates Chainer's states)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        update()
        times.append(time.perf_counter() - t)
    return float(numpy.median(times))


def time_gpu(update, repeat):
    import cupy
    update()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(repeat):
        start.record()
        update()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return float(numpy.median(times))


def copy_bandwidth(n_bytes=512 * 2 ** 20, repeat=5):
    a = numpy.ones(n_bytes // 4, numpy.float32)
    b = numpy.empty_like(a)
    best = min(_timed(lambda: numpy.copyto(b, a)) for _ in range(repeat))
    return 2 * a.nbytes / best                  # read + write


def gpu_peak_bandwidth():
    """The current GPU's memory bandwidth from its attributes (bytes/s, read + write)."""
    import cupy
    attrs = cupy.cuda.Device().attributes
    return 2 * attrs['MemoryClockRate'] * 1e3 * attrs['GlobalMemoryBusWidth'] / 8


def _timed(f):
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def bytes_per_update(model, fp16):
    """Bytes chainer_tc reads and writes per update (see kernels/optimizer.cu)."""
    n = sum(p.size for p in model.params())
    # fp32: read g, p, v; write p, v.  fp16: read g, master, v, p16; write master, v, p16;
    # plus the finite check reading g once more.
    return n * (22 + 2 if fp16 else 20)


def chainer_bytes_per_update(model, fp16, loss_scaling=False):
    """Bytes Chainer's update reads and writes, estimated from its code (per element): fp32:
    WeightDecay (read p, g; write g) + momentum (read g, v, p; write v, p) = 32. fp16 with
    use_fp32_update: + the gradient cast (read g16, write g32) and the parameter cast back (read
    p32, write p16) = 44; with dynamic loss scaling + isfinite (read g16, write a bool),
    all() (read the bools) and grad /= scale (read and write g32) = 56."""
    n = sum(p.size for p in model.params())
    per = 32
    if fp16:
        per += 6 + 6
        if loss_scaling:
            per += 3 + 1 + 8
    return n * per


def chainer_launches(n_params, fp16, loss_scaling=False):
    per = 2 + (2 if fp16 else 0)                # WeightDecay + momentum (+ 2 casts)
    if loss_scaling:
        per += 3                                # isfinite, all() (a host sync), grad /= scale
    return n_params * per


def chainer_host_syncs(n_params, loss_scaling=False):
    """Host synchronisations per update: Chainer's dynamic loss scaling reads
    ``xp.all(xp.isfinite(grad))`` for every parameter; nothing else in its update does."""
    return n_params if loss_scaling else 0


def ours_launches(n_params, fp16):
    """Count through the emulator, with the same number of (tiny) parameters."""
    with _common.emulated():             # the arrays made inside: the emulator knows them
        model = chainer.Link()
        with model.init_scope():
            for i in range(n_params):
                setattr(model, 'p{}'.format(i), chainer.Parameter(
                    numpy.zeros(3, numpy.float16 if fp16 else numpy.float32)))
        opt = ours_optimizer(model, fp16)
        set_grads(model, numpy)
        opt.update()
        with kernels.count_launches() as c:
            opt.update()
    return c.total


def run_device(device, repeat, progress):
    xp = numpy
    timer = time_host
    if device == 'gpu':
        import cupy
        xp, timer = cupy, time_gpu
    rows = []
    for fp16 in (False, True):
        for who, make in (('chainer', chainer_optimizer), ('chainer_tc', ours_optimizer)):
            progress('{} {} {}'.format(device, 'fp16' if fp16 else 'fp32', who))
            model = resnet50_params(numpy.float16 if fp16 else numpy.float32)
            if device == 'gpu':
                model.to_gpu()
            opt = make(model, fp16)
            set_grads(model, xp)
            seconds = timer(opt.update, repeat)
            n_params = len(list(model.params()))
            rows.append({
                'device': device, 'precision': 'fp16' if fp16 else 'fp32', 'optimizer': who,
                'params': n_params, 'elements': int(sum(p.size for p in model.params())),
                'ms_per_update': seconds * 1e3,
                'launches_per_update': (ours_launches(n_params, fp16) if who == 'chainer_tc'
                                        else chainer_launches(n_params, fp16)),
                'bytes_per_update': bytes_per_update(model, fp16) if who == 'chainer_tc' else None,
            })
            del opt, model
    for r in rows:
        base = next(b for b in rows if b['precision'] == r['precision']
                    and b['optimizer'] == 'chainer')
        r['speedup_vs_chainer'] = base['ms_per_update'] / r['ms_per_update']
        if r['bytes_per_update']:
            r['GB_per_s'] = r['bytes_per_update'] / (r['ms_per_update'] / 1e3) / 1e9
    return rows


def table(rows, peak):
    head = ('device', 'precision', 'optimizer', 'ms/update', 'speedup', 'launches', 'GB/s',
            '% of peak')
    body = []
    for r in rows:
        gbs = r.get('GB_per_s')
        pk = peak.get(r['device'])
        body.append((r['device'], r['precision'], r['optimizer'], '{:.2f}'.format(r['ms_per_update']),
                     '{:.2f}x'.format(r['speedup_vs_chainer']), str(r['launches_per_update']),
                     '-' if gbs is None else '{:.1f}'.format(gbs),
                     '-' if gbs is None or not pk else '{:.0f}%'.format(100 * gbs * 1e9 / pk)))
    w = [max(len(x) for x in col) for col in zip(head, *body)]
    return '\n'.join('  '.join(x.rjust(n) for x, n in zip(line, w)) for line in [head] + body)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--repeat', type=int, default=7, help='timed updates per case (median)')
    p.add_argument('--out', default=os.path.join(os.path.dirname(__file__), 'results',
                                                 'optimizer_update.json'))
    p.add_argument('--cpu-only', action='store_true')
    args = p.parse_args(argv)

    def progress(msg):
        sys.stderr.write('\r  measuring {:<40}'.format(msg))
        sys.stderr.flush()

    peak = {'cpu': copy_bandwidth()}
    rows = run_device('cpu', args.repeat, progress)
    if not args.cpu_only and _common.gpu_available():
        peak['gpu'] = gpu_peak_bandwidth()
        rows += run_device('gpu', args.repeat, progress)
    sys.stderr.write('\r' + ' ' * 60 + '\r')
    print(table(rows, peak))
    print('CPU copy bandwidth (read+write): {:.1f} GB/s'.format(peak['cpu'] / 1e9))
    result = {'benchmark': 'optimizer_update', 'command': ' '.join(['benchmarks/optimizer_update.py']
                                                                     + (argv or sys.argv[1:])),
              'machine': platform.platform(), 'cpus': os.cpu_count(),
              'peak_bytes_per_s': peak, 'rows': rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(result, f, indent=1)
    print('wrote', args.out)
    return 0


if __name__ == '__main__':
    sys.exit(main())
