"""The study's ablation: what each technique gains, cumulatively, over vanilla Chainer fp32.

    .venv/bin/python benchmarks/ablation.py              # CPU proxies (+ the GPU rows on a GPU)
    .venv/bin/python benchmarks/ablation.py --quick      # the same, smaller, in a few minutes
    .venv/bin/python benchmarks/ablation.py --batches 64,256 --list train.txt --root /data/train

Configurations, each adding to the one above (as the original Chainer fp16 study measured them):

  fp32                 vanilla Chainer: ResNet-50 v1.5 from Chainer's links (NCHW),
                       chainer.optimizers.MomentumSGD + optimizer_hooks.WeightDecay, Chainer's
                       input pipeline (LabeledImageDataset + PIL augmentation +
                       MultiprocessIterator)
  fp16                 chainer.config.dtype = float16 (CHAINER_DTYPE=float16): float16 model;
                       Chainer's optimizer with use_fp32_update() and dynamic loss_scaling()
  +DALI                the input decoded and augmented by chainer_tc.dali (nvJPEG on a GPU)
  +NHWC/fused/batched  chainer_tc.models.ResNet50(layout='NHWC'): NHWC cuDNN convolutions, fused
                       BN+Add+ReLU; chainer_tc.optimizers.MomentumSGD: one update kernel for every
                       parameter, the loss scale kept and decided on the device
  +static graph        every step replayed by chainer_tc.static_graph.TrainStep (GPU: one CUDA
                       graph launch; CPU: the recorded array computations, no FunctionNodes)

On a GPU (when CuPy finds one): images/s of ResNet-50 training (224x224, 1000 classes) per
configuration at each batch size of --batches (default 32,64,128,256); cuDNN autotune on; warm-up
iterations excluded; each repeat times --gpu-iters iterations between two CUDA events recorded
after a device-wide synchronisation (so DALI's stream and the captured graph's are included);
the median of --gpu-repeats repeats. The NHWC configurations feed conv1 an input padded to
--pad-channels (default 4, zeros; DALI emits it so) for cuDNN's Tensor Core kernels. Two inputs:
  synthetic  the batch already on the device (the +DALI row then does the fp16 row's work);
  pipeline   as the study: fp32 and fp16 fed by Chainer's input pipeline, +DALI and later by the
             DALI GPU pipeline (when DALI's GPU pipeline is available), over generated JPEGs
             unless --list/--root name a data set.

On the CPU (what runs anywhere), the proxies of DESIGN.md section 3, measured in one run, each
against the vanilla baseline of the same run:
  host time  ms per training iteration of the tiny ResNet-50 (width/16, 32x32, 10 classes) at
             --cpu-batches (default 1,2,4), fp32 / fp16 / +NHWC/fused/batched / +static graph
             timed interleaved (synthetic data: +DALI has nothing to change there);
             FunctionNodes per iteration; kernel launches per iteration, two ways:
             counted: chainer_tc's own kernels, counted through the CUDA emulator
             (CHAINER_TC_EMULATE=1; only chainer_tc's configurations launch any);
             estimated: what a GPU step launches (kernels and cuDNN calls), from a census of the
             FunctionNodes applied and what each one's GPU path launches in Chainer's and
             chainer_tc's code (GPU_LAUNCHES below, a lower bound), plus the optimizer's;
             host synchronisations per iteration, from the code;
  optimizer  one update of the full ResNet-50 parameter set (benchmarks/optimizer_update.py's
             functions), the three optimizer recipes interleaved: ms, bytes moved, GB/s against
             this machine's copy bandwidth;
  input      images/s of DALI's CPU pipeline against Chainer's (benchmarks/input_pipeline.py).
Prints the tables, writes JSON (--out, default benchmarks/results/ablation.json) and a PNG bar
chart of the speedups next to it. Not part of the tests (tests/test_ablation_benchmark.py runs
it with --smoke, a seconds-long setting whose numbers mean nothing).
"""
import argparse
import collections
import gc
import os
import sys
import tempfile
import time
import warnings

import numpy

import _common
import chainer

import input_pipeline
import optimizer_update

from chainer_tc import dali
from chainer_tc import kernels
from chainer_tc.models import ResNet50

FP32, FP16, DALI, NHWC, STATIC = ('fp32', 'fp16', '+DALI', '+NHWC/fused/batched',
                                  '+static graph')
CONFIGS = (FP32, FP16, DALI, NHWC, STATIC)
CPU_CONFIGS = (FP32, FP16, NHWC, STATIC)      # synthetic data: +DALI changes nothing there
SECTIONS = ('host', 'launches', 'optimizer', 'pipeline', 'gpu')

Spec = collections.namedtuple('Spec', 'fp16 dali nhwc replay')
SPECS = {c: Spec(*(i >= k for k in (1, 2, 3, 4))) for i, c in enumerate(CONFIGS)}

# Launches (kernels and cuDNN calls) the GPU path of each FunctionNode of a ResNet-50 training
# step makes, read from Chainer 7.8.1's code (cuDNN enabled) and chainer_tc's, for the nodes
# such a step applies (convolutions without bias). A lower bound: what CuPy's cuDNN wrappers
# launch inside (casts of float16 BN parameters to float32, running statistics) is not counted.
# A node class not listed counts 1.
GPU_LAUNCHES = {
    # Chainer
    'Convolution2DFunction': 1,         # cudnnConvolutionForward
    'Deconvolution2DFunction': 1,       # gx: cudnnConvolutionBackwardData
    'Convolution2DGradW': 1,            # gW: cudnnConvolutionBackwardFilter
    'BatchNormalization': 1,            # cudnnBatchNormalizationForwardTraining(Ex)
    'BatchNormalizationGrad': 1,        # cudnnBatchNormalizationBackward(Ex)
    'ReLU': 1,                          # cudnnActivationForward
    'ReLUGrad2': 1,                     # elementwise
    'Add': 1,                           # residual add; gradient accumulation in backward
    'Reshape': 0,                       # a view
    'LinearFunction': 2,                # gemm, bias add
    'LinearGradData': 1,                # gemm
    'LinearGradWeight': 1,              # gemm
    'Sum': 1,                           # the bias gradient
    'SoftmaxCrossEntropy': 3,           # log-softmax, valid-label count, loss reduction
    '_SoftmaxCrossEntropyGrad_NoDoubleBackprop': 2,     # softmax, gradient
    'MaxPoolingND': 1, 'MaxPoolingNDGrad': 1,           # cudnnPooling*
    'AveragePooling2D': 1, 'AveragePooling2DGrad': 1,   # cudnnPooling* (also chainer_tc's: ours)
    'Cast': 1,                          # astype (chainer_tc.functions.cast too)
    # chainer_tc
    'Convolution2DNHWC': 1,             # cudnnConvolutionForward, NHWC
    '_Convolution2DNHWCGrad[1]': 1,     # gW only (the network's input needs no gx)
    '_Convolution2DNHWCGrad[2]': 2,     # gx and gW: backward data, backward filter
    'BatchNormAddAct': 1,               # cudnnBatchNormalizationForwardTrainingEx (BN+Add+ReLU)
    'BatchNormAddActGrad': 1,           # cudnnBatchNormalizationBackwardEx
    'MaxPooling2D': 1,                  # kernels/pooling.cu
    '_PoolingGrad': 1,                  # kernels/pooling.cu
}
# What the host does per replayed step on a GPU (chainer_tc/static_graph/step.py, _capture.py):
# the two inputs copied into the graph's buffers, one cudaGraphLaunch, the loss copied out.
GRAPH_HOST_LAUNCHES = 4

# Defaults per mode: (full, --quick, --smoke).
DEFAULTS = {
    'cpu_batches': ('1,2,4', '1,2,4', '1'),
    'iters': (40, 12, 2),
    'warmup': (5, 4, 3),
    'opt_repeat': (7, 3, 1),
    'copy_mib': (512, 256, 16),
    'images': (256, 128, 8),
    'pipeline_batch': (32, 32, 4),
    'pipeline_batches': (30, 12, 1),
    'pipeline_rounds': (5, 3, 1),
    'gpu_iters': (20, 10, 2),
    'gpu_repeats': (5, 3, 1),
    'gpu_warmup': (10, 6, 4),
}


# ---- models and optimizers ------------------------------------------------------------------

def build(config, device=None, lr=0.01, **model_kwargs):
    """The model and optimizer of a configuration (optimizer_update.py's recipes)."""
    s = SPECS[config]
    numpy.random.seed(0)
    with chainer.using_config('dtype', numpy.float16 if s.fp16 else numpy.float32):
        model = ResNet50('NHWC' if s.nhwc else 'NCHW', **model_kwargs)
    if device is not None:
        model.to_device(device)
    if s.nhwc:
        opt = optimizer_update.ours_optimizer(model, s.fp16, lr=lr)
    else:
        opt = optimizer_update.chainer_optimizer(model, s.fp16, loss_scaling=s.fp16, lr=lr)
    return model, opt


def tiny_step(config, batch):
    model, opt = build(config, width=_common.TINY['width'],
                       n_classes=_common.TINY['n_classes'])
    return _common.TinyStep(config, model, opt, batch, replay=SPECS[config].replay,
                            dtype=model.dtype)


def tiny_params(dtype):
    """--smoke: the tiny ResNet-50's parameters stand in for the full set."""
    model = ResNet50('NCHW', width=_common.TINY['width'], n_classes=_common.TINY['n_classes'])
    for p in model.params():
        p.array = p.array.astype(dtype)
    return model


# ---- launches and synchronisations per iteration --------------------------------------------

def node_launches(census):
    unknown = sorted(k for k in census if k not in GPU_LAUNCHES)
    return sum(n * GPU_LAUNCHES.get(k, 1) for k, n in census.items()), unknown


def optimizer_launches(config, n_params):
    """(launches, how they were obtained) of one update."""
    s = SPECS[config]
    if s.nhwc:
        return optimizer_update.ours_launches(n_params, s.fp16), 'counted (emulator)'
    return (optimizer_update.chainer_launches(n_params, s.fp16, loss_scaling=s.fp16),
            'estimated from Chainer\'s code')


def seed_launches(config):
    """The backward pass's seed: Chainer fills ones (and multiplies by the loss scale);
    chainer_tc's scaled_backward seeds with a view of the device-side scale."""
    s = SPECS[config]
    return 0 if s.nhwc else 1 + int(s.fp16)


def host_syncs(config, n_params):
    """Host synchronisations per iteration, from the code: Chainer's dynamic loss scaling reads
    all(isfinite(grad)) per parameter; chainer_tc decides on the device."""
    s = SPECS[config]
    return 0 if s.nhwc else optimizer_update.chainer_host_syncs(n_params, loss_scaling=s.fp16)


# ---- CPU: host time per iteration -----------------------------------------------------------

def host_section(args):
    rows = []
    for i, batch in enumerate(args.cpu_batches):
        _common.progress('host time: batch {} ({}/{}), {} configurations interleaved, {} '
                         'iterations each'.format(batch, i + 1, len(args.cpu_batches),
                                                  len(CPU_CONFIGS), args.iters))
        steps = [tiny_step(c, batch) for c in CPU_CONFIGS]
        _common.interleave(steps, args.iters, args.warmup)
        for st in steps:
            n_params = len(list(st.model.params()))
            census = st.census()
            row = {'config': st.name, 'batch': batch, 'ms_per_iter': st.ms_per_iter(),
                   'ms_each': [1e3 * t for t in st.times], 'params': n_params,
                   'function_nodes_per_iter': sum(census.values()),
                   'function_nodes_by_class': dict(sorted(census.items())),
                   'replayed_ops_per_iter': st.replayed_ops(),
                   'host_syncs_per_iter': host_syncs(st.name, n_params)}
            if SPECS[st.name].nhwc:
                row['loss_scale_skipped_steps'] = int(st.optimizer.skipped_steps)
            elif SPECS[st.name].fp16:
                row['loss_scale_skipped_steps'] = st.chainer_skipped
            if st.step is not None:
                row['ms_per_replay'], row['ms_per_check'] = st.ms_per_replay(), st.ms_per_check()
                row['replays'], row['eager_steps'] = st.step.replays, st.step.eager_steps
                row['checks'] = st.step.checks
            rows.append(row)
        del steps
        gc.collect()
    for r in rows:
        same = [b for b in rows if b['batch'] == r['batch']]
        base = next(b for b in same if b['config'] == FP32)
        prev = same[max(0, [b['config'] for b in same].index(r['config']) - 1)]
        r['speedup_vs_fp32'] = base['ms_per_iter'] / r['ms_per_iter']
        r['speedup_vs_previous'] = prev['ms_per_iter'] / r['ms_per_iter']
    add_launch_estimates(rows)
    return {'model': dict(_common.TINY, layout_per_config={
        c: 'NHWC' if SPECS[c].nhwc else 'NCHW' for c in CPU_CONFIGS}), 'iters': args.iters,
        'warmup': args.warmup, 'rows': rows}


def add_launch_estimates(rows):
    """Estimated GPU launches per iteration. A replayed step launches, inside its CUDA graph,
    what the eager step of the configuration before it launches; the host makes
    GRAPH_HOST_LAUNCHES calls."""
    eager = {}
    for r in rows:
        if SPECS[r['config']].replay:
            continue
        nodes, unknown = node_launches(r['function_nodes_by_class'])
        opt, how = optimizer_launches(r['config'], r['params'])
        r['launches_estimated'] = nodes + opt + seed_launches(r['config'])
        r['launches_estimated_parts'] = {'function_nodes': nodes, 'optimizer': opt,
                                         'optimizer_source': how,
                                         'backward_seed': seed_launches(r['config'])}
        if unknown:
            r['launches_estimated_parts']['node_classes_counted_as_1'] = unknown
        r['host_launches_estimated'] = r['launches_estimated']
        if r['config'] == NHWC:
            eager[r['batch']] = r
    for r in rows:
        if SPECS[r['config']].replay:
            src = eager[r['batch']]
            r['launches_estimated'] = src['launches_estimated']
            r['launches_estimated_parts'] = dict(src['launches_estimated_parts'],
                                                 inside_one_cuda_graph=True)
            r['host_launches_estimated'] = GRAPH_HOST_LAUNCHES


def launches_section(batch, warmup):
    """chainer_tc's own kernels launched by one iteration, counted through the emulator. The
    emulator has no cuDNN: convolutions take the NumPy path (no launch) and batch normalization
    runs chainer_tc's kernels, where a GPU calls cuDNN's fused kernel (one call each way)."""
    out = {}
    with _common.emulated():
        for c in (NHWC, STATIC):
            _common.progress('kernel launches through the emulator: {}'.format(c))
            st = tiny_step(c, batch)
            for _ in range(warmup):
                st.run()
            with kernels.count_launches() as n:
                st.run()
            out[c] = {'batch': batch, 'launches_per_iter': n.total,
                      'per_kernel': dict(sorted(n.per_kernel.items())),
                      'replayed': st.step is not None and st.step.replays > 0}
    return out


# ---- CPU (and GPU): optimizer update on the full ResNet-50 parameter set ----------------------

OPTIMIZER_CASES = ((FP32, 'chainer', False), (FP16, 'chainer', True),
                   (NHWC, 'chainer_tc', True))


def _time_once(f, device):
    if device == 'gpu':
        import cupy
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        f()
        end.record()
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) / 1e3
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def optimizer_section(args):
    make = tiny_params if args.smoke else optimizer_update.resnet50_params
    devices = ['cpu'] + (['gpu'] if args.gpu else [])
    peak = {'cpu': optimizer_update.copy_bandwidth(args.copy_mib * 2 ** 20)}
    if args.gpu:
        peak['gpu'] = optimizer_update.gpu_peak_bandwidth()
    rows = []
    for device in devices:
        cases = []
        for config, who, fp16 in OPTIMIZER_CASES:
            _common.progress('optimizer update: {} {} ({})'.format(device, config, who))
            model = make(numpy.float16 if fp16 else numpy.float32)
            xp = numpy
            if device == 'gpu':
                import cupy
                model.to_gpu()
                xp = cupy
            if who == 'chainer':
                opt = optimizer_update.chainer_optimizer(model, fp16, loss_scaling=fp16)
                if fp16:
                    # as after loss.backward(loss_scale=...): every gradient is unscaled
                    for p in model.params():
                        p._loss_scale = 1.0
            else:
                opt = optimizer_update.ours_optimizer(model, fp16)
            optimizer_update.set_grads(model, xp)
            opt.update()                        # warm-up: states, fp32 copies, buffers
            cases.append((config, who, fp16, model, opt, []))
        for _ in range(args.opt_repeat):        # interleaved
            for case in cases:
                case[5].append(_time_once(case[4].update, device))
        for config, who, fp16, model, opt, times in cases:
            n_params = len(list(model.params()))
            launches, how = optimizer_launches(config, n_params)
            if who == 'chainer':
                nbytes = optimizer_update.chainer_bytes_per_update(model, fp16, fp16)
                bytes_how = 'estimated from Chainer\'s code'
            else:
                nbytes = optimizer_update.bytes_per_update(model, fp16)
                bytes_how = 'kernels/optimizer.cu contract'
            ms = 1e3 * float(numpy.median(times))
            rows.append({'device': device, 'config': config, 'optimizer': who,
                         'precision': 'fp16' if fp16 else 'fp32', 'params': n_params,
                         'elements': int(sum(p.size for p in model.params())),
                         'ms_per_update': ms, 'ms_each': [1e3 * t for t in times],
                         'launches_per_update': launches, 'launches_source': how,
                         'host_syncs_per_update': (optimizer_update.chainer_host_syncs(
                             n_params, fp16) if who == 'chainer' else 0),
                         'bytes_per_update': nbytes, 'bytes_source': bytes_how,
                         'GB_per_s': nbytes / (ms / 1e3) / 1e9,
                         'fraction_of_copy_bandwidth': nbytes / (ms / 1e3) / peak[device]})
        del cases
        gc.collect()
    for r in rows:
        same = [b for b in rows if b['device'] == r['device']]
        prev = same[max(0, [b['config'] for b in same].index(r['config']) - 1)]
        r['speedup_vs_fp32'] = same[0]['ms_per_update'] / r['ms_per_update']
        r['speedup_vs_previous'] = prev['ms_per_update'] / r['ms_per_update']
    return {'parameter_set': ('tiny ResNet-50 (--smoke)' if args.smoke else
                              'chainer.links.ResNet50Layers'),
            'repeat': args.opt_repeat, 'copy_bytes_per_s': peak, 'rows': rows}


# ---- input ----------------------------------------------------------------------------------

def pipeline_section(args, data):
    ns = argparse.Namespace(rounds=args.pipeline_rounds, crop=224, threads=args.threads,
                            batch=args.pipeline_batch, batches=args.pipeline_batches,
                            warmup=1 if args.smoke else 3)
    out = input_pipeline.run_cpu(data['list'], data['root'], ns)
    out.update(batch=args.pipeline_batch, batches=args.pipeline_batches, crop=224)
    return out


# ---- GPU: images/s --------------------------------------------------------------------------

def gpu_section(args, data, dali_gpu):
    import cupy
    device = chainer.get_device('@cupy:{}'.format(cupy.cuda.Device().id))
    device.use()
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    rows = []
    modes = ['synthetic'] + (['pipeline'] if data is not None else [])
    with chainer.using_config('autotune', True), \
            chainer.using_config('cudnn_deterministic', False):
        for batch in args.batches:
            for mode in modes:
                for config in CONFIGS:
                    row = {'config': config, 'batch': batch, 'input': mode}
                    rows.append(row)
                    if mode == 'synthetic' and config == DALI:
                        row['same_as'] = FP16       # no input pipeline: the fp16 row's work
                        continue
                    if mode == 'pipeline' and SPECS[config].dali and not dali_gpu:
                        row['error'] = 'DALI GPU pipeline not available'
                        continue
                    _common.progress('GPU: batch {}, {} input, {}'.format(batch, mode, config))
                    try:
                        row.update(gpu_run(config, batch, mode, args, data, device))
                    except Exception as e:      # one failed cell (memory, capture) is reported
                        row['error'] = '{}: {}'.format(type(e).__name__, e)
                    finally:
                        gc.collect()
                        cupy.get_default_memory_pool().free_all_blocks()
                        cupy.get_default_pinned_memory_pool().free_all_blocks()
    for r in rows:
        if 'same_as' in r:
            src = next(b for b in rows if b['batch'] == r['batch'] and b['input'] == r['input']
                       and b['config'] == r['same_as'])
            for k in ('images_per_s', 'images_per_s_each', 'error'):
                if k in src:
                    r[k] = src[k]
    for r in rows:
        base = next(b for b in rows if b['batch'] == r['batch'] and b['input'] == r['input']
                    and b['config'] == FP32)
        if r.get('images_per_s') and base.get('images_per_s'):
            r['speedup_vs_fp32'] = r['images_per_s'] / base['images_per_s']
    name = props['name']
    from chainer_tc.cuda import cudnn
    return {'device': name.decode() if isinstance(name, bytes) else str(name),
            # the baseline's convolutions: Chainer's own cuDNN path needs CuPy's cuDNN (CuPy
            # 13); without it (CuPy 14) Chainer's links run im2col + matrix products instead
            'chainer_cudnn': bool(chainer.backends.cuda.cudnn_enabled),
            'chainer_tc_cudnn': cudnn.version_string(cudnn.binding().version()),
            'model': 'ResNet-50 v1.5, 224x224, 1000 classes', 'iters': args.gpu_iters,
            'repeats': args.gpu_repeats, 'warmup': args.gpu_warmup, 'autotune': True,
            'nhwc_pad_channels': args.pad_channels,
            'rows': rows}


def gpu_run(config, batch, mode, args, data, device):
    import cupy
    s = SPECS[config]
    # NHWC configurations take conv1's input padded to --pad-channels (cuDNN's Tensor Core
    # kernels want 4 or 8 channels in float16), made so by the data: DALI emits it padded
    pad = args.pad_channels if s.nhwc else 3
    model, opt = build(config, device=device, **({'pad_channels': pad} if s.nhwc else {}))
    dtype = model.dtype
    it = None
    if mode == 'synthetic':
        shape = (batch, 224, 224, pad) if s.nhwc else (batch, 3, 224, 224)
        x = cupy.random.standard_normal(shape, dtype=numpy.float32).astype(dtype)
        x[..., 3:] = 0                                  # padding channels are zeros
        t = cupy.random.randint(0, 1000, batch).astype(numpy.int32)

        def next_batch():
            return x, t
    elif s.dali:
        it = dali.DaliIterator(dali.imagenet_pipeline(
            data['root'], data['list'], device='gpu', crop=224, dtype=dtype, seed=0,
            layout='NHWC' if s.nhwc else 'NCHW', num_threads=args.threads,
            **({'pad_channels': pad} if s.nhwc else {})), batch)

        def next_batch():
            return next(it)
    else:
        it = input_pipeline.chainer_iterator(data['list'], data['root'], batch, 224,
                                             args.threads, layout='CHW', dtype=dtype)

        def next_batch():
            return chainer.dataset.concat_examples(next(it), device)

    def lossfun(x, t):
        return chainer.functions.softmax_cross_entropy(model(x), t)
    train_step = None
    if s.replay:
        from chainer_tc.static_graph import TrainStep
        train_step = TrainStep(model, opt, lossfun)

    def step():
        x, t = next_batch()
        with chainer.using_config('dtype', dtype):
            if train_step is not None:
                train_step(x, t)
            else:
                opt.update(lossfun, x, t)
    try:
        rates = time_gpu(step, batch, args.gpu_iters, args.gpu_repeats, args.gpu_warmup)
    finally:
        if it is not None:
            it.finalize()
    out = {'images_per_s': float(numpy.median(rates)), 'images_per_s_each': rates}
    if train_step is not None:
        out['replays'], out['eager_steps'] = train_step.replays, train_step.eager_steps
        out['checks'] = train_step.checks
        # a repeat holding the one check of check_every steps is the median's outlier: the
        # check is timed apart and averaged in, as on the CPU
        check = _common.gpu_check_ms(train_step, step)
        replay_ms = 1e3 * batch / out['images_per_s']
        out.update(images_per_s_replays=out['images_per_s'], check_ms=check,
                   check_every=train_step.check_every,
                   images_per_s=1e3 * batch / _common.with_checks(replay_ms, check,
                                                                  train_step.check_every))
    return out


def time_gpu(step, batch, iters, repeats, warmup):
    """images/s of each repeat: ``iters`` steps between two CUDA events, each recorded after a
    device-wide synchronisation (every stream: DALI's, the captured graph's, the default)."""
    import cupy
    for _ in range(warmup):
        step()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    rates = []
    for _ in range(repeats):
        cupy.cuda.runtime.deviceSynchronize()
        start.record()
        for _ in range(iters):
            step()
        cupy.cuda.runtime.deviceSynchronize()
        end.record()
        end.synchronize()
        rates.append(batch * iters / (cupy.cuda.get_elapsed_time(start, end) / 1e3))
    return rates


# ---- tables ---------------------------------------------------------------------------------

def _f(x, fmt='{:.2f}', none='-'):
    return none if x is None else fmt.format(x)


def host_table(host, launches):
    head = ('configuration', 'batch', 'ms/iter', 'vs fp32', 'vs prev', 'nodes/iter',
            'replayed ops', 'launches est.', 'host launches est.', 'host syncs')
    body = [(r['config'], r['batch'], _f(r['ms_per_iter']), _f(r['speedup_vs_fp32'], '{:.2f}x'),
             _f(r['speedup_vs_previous'], '{:.2f}x'), r['function_nodes_per_iter'],
             _f(r['replayed_ops_per_iter'], '{}'), r['launches_estimated'],
             r['host_launches_estimated'], r['host_syncs_per_iter']) for r in host['rows']]
    text = ['Host time per training iteration, tiny ResNet-50 (CPU; width/16, 32x32; median of '
            '{} interleaved iterations)'.format(host['iters']), _common.format_table(head, body),
            'launches est.: kernels + cuDNN calls a GPU step makes, estimated from Chainer\'s '
            'and chainer_tc\'s code (lower bound); host launches: the calls the host makes '
            '(one graph launch + {} copies for a replayed step)'.format(GRAPH_HOST_LAUNCHES - 1)]
    if launches:
        text.append('counted through the emulator (chainer_tc\'s own kernels, CHAINER_TC_EMULATE'
                    '=1): ' + ', '.join('{}: {}/iter'.format(c, v['launches_per_iter'])
                                        for c, v in launches.items())
                    + ' (batch normalization in chainer_tc\'s kernels; a GPU uses cuDNN\'s '
                      'fused one)')
    return '\n'.join(text)


def optimizer_table(opt):
    head = ('configuration', 'device', 'optimizer', 'ms/update', 'vs fp32', 'vs prev',
            'launches', 'host syncs', 'GB/s', '% of copy bw')
    body = [(r['config'], r['device'], r['optimizer'] + ' ' + r['precision'],
             _f(r['ms_per_update'], '{:.1f}'), _f(r['speedup_vs_fp32'], '{:.2f}x'),
             _f(r['speedup_vs_previous'], '{:.2f}x'), r['launches_per_update'],
             r['host_syncs_per_update'], _f(r['GB_per_s'], '{:.1f}'),
             '{:.0f}%'.format(100 * r['fraction_of_copy_bandwidth'])) for r in opt['rows']]
    return '\n'.join([
        'Optimizer update, {} ({} elements; median of {} interleaved updates)'.format(
            opt['parameter_set'], opt['rows'][0]['elements'], opt['repeat']),
        _common.format_table(head, body),
        'copy bandwidth (read+write): ' + ', '.join(
            '{} {:.1f} GB/s'.format(k, v / 1e9) for k, v in opt['copy_bytes_per_s'].items()),
        'launches and bytes: chainer_tc counted (emulator) / its kernel\'s contract; Chainer '
        'estimated from its code (fp16: use_fp32_update + dynamic loss scaling)'])


def pipeline_table(p):
    return '\n'.join([
        'Input pipeline (CPU, {} threads/processes; batch {}, crop {}; median of {} rounds)'
        .format(p['threads_or_processes'], p['batch'], p['crop'], len(p['rounds']['ratio'])),
        _common.format_table(('pipeline', 'images/s'), [
            ('Chainer LabeledImageDataset + PIL + MultiprocessIterator',
             '{:.0f}'.format(p['chainer_images_per_s'])),
            ('chainer_tc.dali CPU pipeline (DaliIterator)',
             '{:.0f}'.format(p['dali_cpu_images_per_s'])),
            ('ratio (median of the rounds\' ratios)', '{:.2f}x'.format(p['ratio']))])])


def gpu_table(gpu):
    head = ('configuration', 'input', 'batch', 'images/s', 'vs fp32', 'TrainStep')
    body = []
    for r in gpu['rows']:
        if 'images_per_s' in r:
            ips = '{:.0f}'.format(r['images_per_s']) + (' (= fp16)' if 'same_as' in r else '')
        else:
            ips = r.get('error', '-')[:60]
        note = ''
        if 'replays' in r:      # a step TrainStep could not capture runs eagerly: say so
            eager = r['eager_steps'] - r.get('checks', 0)     # the trace's periodic checks
            note = 'replayed' if eager <= 3 else '{} eager steps'.format(eager)
        body.append((r['config'], r['input'], r['batch'], ips,
                     _f(r.get('speedup_vs_fp32'), '{:.2f}x'), note))
    text = ['GPU: {} ({}; median of {} repeats of {} iterations)'.format(
        gpu['device'], gpu['model'], gpu['repeats'], gpu['iters']),
        _common.format_table(head, body)]
    if not gpu.get('chainer_cudnn', True):
        text.append("Chainer's own links ran without cuDNN here (CuPy has none): the fp32/fp16 "
                    'rows convolve by im2col and matrix products, not the study\'s cuDNN '
                    'baseline; chainer_tc used cuDNN {}'.format(gpu.get('chainer_tc_cudnn')))
    return '\n'.join(text)


def summary(figures, args):
    """The study's table: one row per configuration, speedups against fp32 of the same run."""
    host = figures.get('host_time')
    opt = figures.get('optimizer_update')
    pipe = figures.get('input_pipeline')
    gpu = figures.get('gpu')
    gpu_rows = gpu.get('rows', []) if gpu else []
    cols = []
    if host:
        cols += [('CPU host b={}'.format(b), 'host', b) for b in args.cpu_batches]
    if opt:
        cols.append(('CPU optimizer', 'optimizer', None))
    if pipe:
        cols.append(('CPU input', 'input', None))
    for mode in ('synthetic', 'pipeline'):
        for b in sorted({r['batch'] for r in gpu_rows if r['input'] == mode}):
            cols.append(('GPU {} b={}'.format('synth' if mode == 'synthetic' else 'input', b),
                         mode, b))
    table = []
    for c in CONFIGS:
        row = {'config': c}
        for name, kind, b in cols:
            v = None
            if kind == 'host':
                v = next((r['speedup_vs_fp32'] for r in host['rows']
                          if r['config'] == c and r['batch'] == b), None)
            elif kind == 'optimizer':
                # the recipe a configuration trains with: +DALI keeps fp16's, +static graph
                # replays +NHWC/fused/batched's kernel
                src = {DALI: FP16, STATIC: NHWC}.get(c, c)
                v = next((r['speedup_vs_fp32'] for r in opt['rows']
                          if r['config'] == src and r['device'] == 'cpu'), None)
            elif kind == 'input':
                v = pipe['ratio'] if SPECS[c].dali else 1.0
            else:
                v = next((r.get('speedup_vs_fp32') for r in gpu_rows
                          if r['config'] == c and r['batch'] == b and r['input'] == kind), None)
            row[name] = v
        table.append(row)
    return table


def summary_table(rows, gpu_note, parameter_set):
    names = [k for k in rows[0] if k != 'config']
    body = [[r['config']] + [_f(r[k], '{:.2f}x') for k in names] for r in rows]
    return '\n'.join([
        'Ablation (cumulative; speedup against vanilla Chainer fp32 of the same run)',
        _common.format_table(['configuration'] + names, body),
        'CPU host: tiny ResNet-50 step (synthetic data, so +DALI is not measured there); CPU '
        'optimizer: one update of the {} parameters; CPU input: images/s of the input '
        'pipeline. '.format(parameter_set) + gpu_note])


# ---- chart ----------------------------------------------------------------------------------

def chart(path, figures, args):
    """A PNG of the speedups: the host-time proxy grouped by batch, the optimizer and input
    proxies, and the GPU images/s grouped by batch when there are any."""
    try:
        import matplotlib
    except ImportError as e:
        return None, 'matplotlib not installed ({}): pip install matplotlib'.format(e)
    matplotlib.use('Agg')
    import matplotlib.patches  # noqa: F401  (matplotlib.patches.Patch below)
    import matplotlib.pyplot as plt
    panels = []
    host = figures.get('host_time')
    if host:
        panels.append(('CPU proxy: host time per iteration\n(tiny ResNet-50, higher is better)',
                       CPU_CONFIGS, ['batch {}'.format(b) for b in args.cpu_batches],
                       lambda c, i: next((r['speedup_vs_fp32'] for r in host['rows']
                                          if r['config'] == c
                                          and r['batch'] == args.cpu_batches[i]), None)))
    opt = figures.get('optimizer_update')
    other = [(k, name) for k, name in (
        ('optimizer_update', 'optimizer update\n({})'.format(opt and opt['parameter_set'])),
        ('input_pipeline', 'input pipeline')) if figures.get(k)]
    if other:
        summ = {r['config']: r for r in figures['summary']}
        cols = {'optimizer_update': 'CPU optimizer', 'input_pipeline': 'CPU input'}
        panels.append(('CPU proxies: optimizer and input', CONFIGS, [n for _, n in other],
                       lambda c, i: summ[c].get(cols[other[i][0]])))
    gpu = figures.get('gpu') or {}
    for mode in ('synthetic', 'pipeline'):
        rows = [r for r in gpu.get('rows', []) if r['input'] == mode]
        batches = sorted({r['batch'] for r in rows})
        if batches:
            panels.append(('GPU images/s, {} input\n({})'.format(mode, gpu['device']), CONFIGS,
                           ['batch {}'.format(b) for b in batches],
                           lambda c, i, rows=rows, batches=batches: next(
                               (r.get('speedup_vs_fp32') for r in rows
                                if r['config'] == c and r['batch'] == batches[i]), None)))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.6), squeeze=False)
    for ax, (title, configs, groups, value) in zip(axes[0], panels):
        width = 0.8 / len(configs)
        x = numpy.arange(len(groups))
        for k, c in enumerate(configs):
            heights = [value(c, i) for i in range(len(groups))]
            bars = ax.bar(x + (k - (len(configs) - 1) / 2) * width,
                          [h or 0 for h in heights], width, label=c, color='C{}'.format(
                              CONFIGS.index(c)))
            ax.bar_label(bars, labels=['' if h is None else '{:.2f}'.format(h)
                                       for h in heights], fontsize=6, padding=1)
        ax.axhline(1.0, color='grey', linewidth=0.8)
        ax.set_xticks(x)
        ax.set_xticklabels(groups)
        ax.set_ylabel('speedup vs fp32')
        ax.set_title(title, fontsize=9)
        ax.margins(y=0.12)
    handles = [matplotlib.patches.Patch(color='C{}'.format(i), label=c)
               for i, c in enumerate(CONFIGS)]
    fig.legend(handles=handles, loc='lower center', ncol=len(CONFIGS), fontsize=8,
               frameon=False)
    fig.suptitle('chainer_tc ablation: cumulative speedup over vanilla Chainer fp32 (same run)'
                 + ('' if gpu else '; GPU not measured'), fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path, None


# ---- main -----------------------------------------------------------------------------------

def _batches(text):
    try:
        values = [int(v) for v in text.split(',') if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError('a comma-separated list of batch sizes, e.g. 32,64; '
                                         'got {!r}'.format(text))
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError('batch sizes must be >= 1; got {!r}'.format(text))
    return values


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--quick', action='store_true',
                   help='fewer iterations and smaller sets (a few minutes on 2 cores)')
    p.add_argument('--smoke', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('--batches', type=_batches, default=_batches('32,64,128,256'),
                   help='GPU batch sizes (default 32,64,128,256)')
    p.add_argument('--cpu-batches', type=_batches, help='tiny-model batch sizes (default 1,2,4)')
    p.add_argument('--iters', type=int, help='CPU: timed iterations per configuration')
    p.add_argument('--warmup', type=int, help='CPU: untimed iterations first (>= 3: TrainStep '
                                              'replays from its 4th call)')
    p.add_argument('--opt-repeat', type=int, help='timed optimizer updates per recipe')
    p.add_argument('--copy-mib', type=int, help='size of the copy measuring memory bandwidth')
    p.add_argument('--images', type=int, help='generated JPEGs (without --list)')
    p.add_argument('--list', help='list file of an existing data set (with --root)')
    p.add_argument('--root', help='image root of an existing data set')
    p.add_argument('--pipeline-batch', type=int)
    p.add_argument('--pipeline-batches', type=int, help='timed batches per pipeline and round')
    p.add_argument('--pipeline-rounds', type=int)
    p.add_argument('--threads', type=int, default=len(os.sched_getaffinity(0)),
                   help='DALI threads and Chainer processes (default: the CPUs available)')
    p.add_argument('--gpu-iters', type=int, help='GPU: iterations per timed repeat')
    p.add_argument('--gpu-repeats', type=int)
    p.add_argument('--gpu-warmup', type=int)
    p.add_argument('--pad-channels', type=int, choices=(3, 4, 8), default=4,
                   help='GPU, NHWC configurations: conv1\'s input channels (default 4; 3: '
                        'unpadded)')
    p.add_argument('--no-gpu', action='store_true', help='CPU proxies only')
    p.add_argument('--skip', default='', help='comma-separated sections to leave out: '
                                              + ', '.join(SECTIONS))
    p.add_argument('--out', default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 'results', 'ablation.json'))
    args = p.parse_args(argv)
    mode = 2 if args.smoke else 1 if args.quick else 0
    for key, values in DEFAULTS.items():
        if getattr(args, key) is None:
            v = values[mode]
            setattr(args, key, _batches(v) if key == 'cpu_batches' else v)
    args.skip = {s.strip() for s in args.skip.split(',') if s.strip()}
    if args.skip - set(SECTIONS):
        p.error('--skip: unknown sections {} (known: {})'.format(
            ', '.join(sorted(args.skip - set(SECTIONS))), ', '.join(SECTIONS)))
    if args.warmup < 3:
        p.error('--warmup must be >= 3: TrainStep traces its first 3 calls and replays from '
                'the 4th, and only replays should be timed')
    if min(args.iters, args.opt_repeat, args.pipeline_rounds, args.gpu_iters,
           args.gpu_repeats) < 1:
        p.error('iteration and repeat counts must be >= 1')
    if args.smoke:          # seconds on the CPU: never the GPU's full ResNet-50 runs
        args.no_gpu = True
    args.gpu = 'gpu' not in args.skip and not args.no_gpu and _common.gpu_available()
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    started = time.time()
    machine = _common.machine_info()
    figures = {}
    warnings.filterwarnings('ignore', category=UserWarning)         # batch 1: single-sample BN
    warnings.filterwarnings('ignore', category=RuntimeWarning,       # fp16 overflow before the
                            module='numpy')                          # loss scale settles
    tmp = None
    data = None
    need_data = 'pipeline' not in args.skip or args.gpu
    if need_data:
        if args.list:
            data = {'list': args.list, 'root': args.root or os.path.dirname(args.list),
                    'generated': None}
        else:
            tmp = tempfile.TemporaryDirectory()
            data = {'list': input_pipeline.make_images(tmp.name, args.images), 'root': tmp.name,
                    'generated': args.images}
    try:
        if 'host' not in args.skip:
            figures['host_time'] = host_section(args)
        if 'launches' not in args.skip:
            figures['launches_counted'] = launches_section(args.cpu_batches[0], args.warmup)
        if 'optimizer' not in args.skip:
            figures['optimizer_update'] = optimizer_section(args)
        if 'pipeline' not in args.skip:
            figures['input_pipeline'] = pipeline_section(args, data)
        if args.gpu:
            figures['gpu'] = gpu_section(args, data, machine['features'].get('dali_gpu_decode'))
    finally:
        if tmp is not None:
            tmp.cleanup()
    if args.gpu:
        gpu_note = 'GPU: measured on {}.'.format(figures['gpu']['device'])
    else:
        why = ('--smoke' if args.smoke else '--no-gpu' if args.no_gpu else
               '--skip gpu' if 'gpu' in args.skip else 'no CUDA GPU found')
        figures['gpu'] = None
        gpu_note = 'GPU rows: not measured ({}).'.format(why)
    figures['summary'] = summary(figures, args)

    out = os.path.abspath(args.out)
    png = os.path.splitext(out)[0] + '.png'
    os.makedirs(os.path.dirname(out), exist_ok=True)
    png, chart_error = chart(png, figures, args)

    text = []
    if figures.get('host_time'):
        text.append(host_table(figures['host_time'], figures.get('launches_counted')))
    if figures.get('optimizer_update'):
        text.append(optimizer_table(figures['optimizer_update']))
    if figures.get('input_pipeline'):
        text.append(pipeline_table(figures['input_pipeline']))
    if figures.get('gpu'):
        text.append(gpu_table(figures['gpu']))
    text.append(summary_table(figures['summary'], gpu_note,
                              (figures.get('optimizer_update') or {}).get('parameter_set')))
    print('\n\n'.join(text))

    config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(args).items()}
    config.update(configurations=list(CONFIGS), cpu_configurations=list(CPU_CONFIGS),
                  data=None if data is None else {'list': data['list'] if args.list else None,
                                                  'generated_images': data['generated']},
                  gpu_launches_per_node=GPU_LAUNCHES, graph_host_launches=GRAPH_HOST_LAUNCHES)
    result = {'benchmark': 'ablation',
              'command': ' '.join(['benchmarks/ablation.py'] + argv),
              'date': time.strftime('%Y-%m-%d %H:%M:%S'),
              'seconds': time.time() - started,
              'machine': machine, 'versions': machine['versions'], 'config': config,
              'gpu_measured': bool(args.gpu), 'gpu_note': gpu_note,
              'figures': figures, 'chart': png, 'chart_error': chart_error}
    _common.write_json(out, result)
    print('wrote {}{}'.format(out, '' if png is None else ' and ' + png))
    if chart_error:
        print('no chart: ' + chart_error)
    return 0


if __name__ == '__main__':
    sys.exit(main())
