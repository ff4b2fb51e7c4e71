"""What the benchmarks in this directory share: machine and version facts, GPU detection, the
emulator switch, tables, JSON output, progress lines, FunctionNode counting and the tiny ResNet-50
training step that framework_overhead.py and ablation.py time.

Scripts run as ``python benchmarks/<name>.py`` import it as ``_common`` (their directory is first
on ``sys.path``). Not part of the package and not part of the tests.
"""
import collections
import contextlib
import io
import json
import os
import platform
import sys
import time

import numpy

import chainer_tc  # noqa: F401  (before chainer: preloads the CUDA libraries)
import chainer
import chainer.functions as F

from chainer_tc import kernels

#: the tiny ResNet-50 of DESIGN.md section 3: every channel count divided by 16, 32x32 images,
#: 10 classes; the arithmetic is negligible, so a training step times the framework
TINY = {'width': 16, 'insize': 32, 'n_classes': 10}


def progress(msg, end='\n'):
    """One progress line on stderr (rewritten in place on a terminal)."""
    if sys.stderr.isatty():
        sys.stderr.write('\r\033[K' + msg + end)
    else:
        sys.stderr.write(msg + '\n')
    sys.stderr.flush()


def gpu_available():
    """True when CuPy finds a CUDA GPU."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def machine_info():
    """The machine, the versions of the stack and which features can run here, from
    ``chainer_tc.info`` (the same report as ``python -m chainer_tc info``)."""
    from chainer_tc import info
    report = info.collect()
    return {
        'platform': platform.platform(),
        'processor': platform.processor() or platform.machine(),
        'cpus': os.cpu_count(),
        'cpu_affinity': len(os.sched_getaffinity(0)),
        'gpus': report['gpus'],
        'chainer_tc': report['chainer_tc'],
        'versions': report['versions'],
        'features': {k: v['available'] for k, v in report['features'].items()},
    }


@contextlib.contextmanager
def emulated():
    """``CHAINER_TC_EMULATE=1`` inside the block: NumPy arrays go through the emulated CUDA
    kernels, whose launches ``chainer_tc.kernels.count_launches`` counts. Objects that chose their
    path outside the block (an optimizer's prepared step, a traced replay) keep it: build them
    inside (the emulator's allocation tracker starts here: it knows only the arrays made after
    it, and refuses a pointer table into an older one)."""
    from chainer_tc.testing import emulator  # noqa: F401  (starts the allocation tracker)
    old = os.environ.get(kernels.ENV_EMULATE)
    os.environ[kernels.ENV_EMULATE] = '1'
    try:
        yield
    finally:
        if old is None:
            del os.environ[kernels.ENV_EMULATE]
        else:
            os.environ[kernels.ENV_EMULATE] = old


def format_table(head, rows):
    """Rows of strings under ``head``: the first column left-aligned, the others right-aligned."""
    rows = [tuple(str(x) for x in r) for r in rows]
    w = [max(len(x) for x in col) for col in zip(head, *rows)]
    return '\n'.join('  '.join(x.ljust(n) if i == 0 else x.rjust(n)
                               for i, (x, n) in enumerate(zip(line, w)))
                     for line in [tuple(head)] + rows)


def write_json(path, obj):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, 'w') as f:
        json.dump(obj, f, indent=1)


class NodeCounter(chainer.FunctionHook):
    """Counts the FunctionNodes applied (forward and backward), by class."""

    name = 'node_counter'

    def __init__(self):
        self.by_class = collections.Counter()

    @property
    def n(self):
        return sum(self.by_class.values())

    def forward_preprocess(self, function, in_data):
        key = type(function).__name__
        if key == '_Convolution2DNHWCGrad':      # the gradients asked for: (gx,) gW (, gb)
            key += '[{}]'.format(len(function.indexes))
        self.by_class[key] += 1


class TinyStep:
    """One model and optimizer training on one fixed synthetic batch: ``run()`` performs a
    training iteration (``optimizer.update(lossfun, x, t)``, or a call of
    ``chainer_tc.static_graph.TrainStep`` with ``replay=True``), ``timed()`` times one.

    The images are the same values for every instance of a batch size, in the model's layout
    (``model.layout``) and in ``dtype`` (default float32; the model casts them to its own).
    Each iteration runs under ``chainer.config.dtype = model.dtype`` with stdout captured
    (Chainer's static_graph prints), the same for every variant.
    """

    def __init__(self, name, model, optimizer, batch, replay=False, dtype=numpy.float32,
                 insize=TINY['insize'], n_classes=TINY['n_classes'], seed=0):
        from chainer_tc.static_graph import TrainStep
        self.name, self.batch, self.model, self.optimizer = name, batch, model, optimizer
        self.dtype = getattr(model, 'dtype', numpy.dtype(numpy.float32))
        r = numpy.random.RandomState(seed)
        x = r.randn(batch, 3, insize, insize).astype(numpy.float32)
        if getattr(model, 'layout', 'NCHW') == 'NHWC':
            x = x.transpose(0, 2, 3, 1).copy()
        self.x = x.astype(dtype)
        self.t = r.randint(0, n_classes, batch).astype(numpy.int32)

        def lossfun(x, t):
            return F.softmax_cross_entropy(model(x), t)
        self.lossfun = lossfun
        self.step = TrainStep(model, optimizer, lossfun) if replay else None
        self.times = []
        self.chainer_skipped = 0        # Chainer's dynamic loss scaling: steps it skipped

    def run(self):
        with chainer.using_config('dtype', self.dtype), \
                contextlib.redirect_stdout(io.StringIO()):
            if self.step is not None:
                self.step(self.x, self.t)
            else:
                self.optimizer.update(self.lossfun, self.x, self.t)
        if getattr(self.optimizer, '_loss_scaling_isnan', False):
            self.chainer_skipped += 1

    def timed(self):
        s = time.perf_counter()
        self.run()
        self.times.append(time.perf_counter() - s)

    def ms_per_iter(self):
        """Median host ms per timed iteration; for a TrainStep, with its periodic check
        (``check_every``: one recorded eager step in that many) averaged in."""
        ms = self.ms_per_replay()
        every = 0 if self.step is None else self.step.check_every
        if not every:
            return ms
        return with_checks(ms, self.ms_per_check(), every)

    def ms_per_replay(self):
        """Median host ms of the timed iterations: for a TrainStep, replays only."""
        return 1e3 * float(numpy.median(self.times))

    def ms_per_check(self, n=3):
        """Host ms of one of TrainStep's checks (median of ``n``, measured once): a recorded
        eager step compared with the trace, which every ``check_every``-th call runs."""
        if getattr(self, '_check_ms', None) is None:
            step, every, times = self.step, self.step.check_every, []
            step.check_every = 1                      # every call checks
            try:
                for _ in range(n):
                    s = time.perf_counter()
                    self.run()
                    times.append(time.perf_counter() - s)
            finally:
                step.check_every = every
            self._check_ms = 1e3 * float(numpy.median(times))
        return self._check_ms

    def census(self):
        """FunctionNodes applied by one more iteration, by class (a replay applies none)."""
        counter = NodeCounter()
        with counter:
            self.run()
        return counter.by_class

    def replayed_ops(self):
        """Array computations one CPU replay runs, or None when the step is not replayed."""
        return None if self.step is None else self.step.replayed_ops


def with_checks(ms_per_replay, ms_per_check, every):
    """ms per iteration of a TrainStep with its periodic check averaged in: one step in
    ``every`` (its ``check_every``; 0: never) is a check, the others replays."""
    if not every:
        return ms_per_replay
    return ms_per_replay + (ms_per_check - ms_per_replay) / every


def gpu_check_ms(train_step, run, n=3):
    """Wall ms of one of ``train_step``'s checks on a GPU (median of ``n``, each between two
    device-wide synchronisations): ``run()`` calls it with ``check_every`` set to 1."""
    import cupy
    every, times = train_step.check_every, []
    train_step.check_every = 1
    try:
        for _ in range(n):
            cupy.cuda.runtime.deviceSynchronize()
            s = time.perf_counter()
            run()
            cupy.cuda.runtime.deviceSynchronize()
            times.append(time.perf_counter() - s)
    finally:
        train_step.check_every = every
    return 1e3 * float(numpy.median(times))


def interleave(steps, iters, warmup):
    """Warm every step up, then time ``iters`` rounds of one iteration of each in turn, so that
    a noisy neighbour or a drifting clock hits every variant alike."""
    for s in steps:
        for _ in range(warmup):
            s.run()
    for _ in range(iters):
        for s in steps:
            s.timed()
