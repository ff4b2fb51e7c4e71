"""Momentum SGD that updates every parameter with one kernel launch.

    from chainer_tc import optimizers
    opt = optimizers.MomentumSGD(lr=0.1, momentum=0.9, weight_decay=1e-4,
                                 decay_filter=optimizers.skip_bn_and_bias)
    opt.setup(model)
    opt.loss_scaling()                 # dynamic loss scaling, decided on the device
    opt.update(model, x, t)            # or: opt.scaled_backward(loss); opt.update()

A drop-in for ``chainer.optimizers.MomentumSGD`` with the ``optimizer_hooks.WeightDecay`` hook and,
for float16 parameters, ``use_fp32_update()``. See docs/optimizer.md for the design and its limits.
"""
import warnings

import numpy

import chainer
from chainer import optimizer as chainer_optimizer
from chainer import variable

from chainer_tc import kernels
from chainer_tc.optimizers import _flat
from chainer_tc.optimizers import _scaler

BLOCK = 256                 # threads per block of kernels/optimizer.cu (OPT_BLOCK)
_CPU_BLOCK = 1 << 15        # elements per step of the CPU path: its temporaries stay in cache
_DEFINES = {'OPT_BLOCK': BLOCK, 'OPT_GRAD_TABLE': _flat.GRAD_TABLE}

# kernels/optimizer.cu StepParams, passed by value
STEP_PARAMS = numpy.dtype([
    ('lr', '<f4'), ('momentum', '<f4'), ('weight_decay', '<f4'), ('nesterov', '<i4'),
    ('scaling', '<i4'), ('interval', '<u4'), ('min_scale', '<f4'), ('max_scale', '<f4'),
    ('total_blocks', '<u4'), ('reserved', '<u4'), ('grad', '<u8', (_flat.GRAD_TABLE,)),
])


def decay_all(name, param):
    """Default ``decay_filter``: weight decay for every parameter (Chainer's WeightDecay hook)."""
    return True


def skip_bn_and_bias(name, param):
    """``decay_filter`` of the usual ResNet-50 recipes: no weight decay for 1-D parameters
    (BatchNormalization's gamma and beta, every bias); decay for weights (2-D and more)."""
    return param.ndim > 1


class MomentumSGD(chainer_optimizer.Optimizer):
    """Momentum SGD with weight decay, fp32 master weights and device-side loss scaling.

    Args:
        lr (float): learning rate (assignable at any time, also by Chainer's extensions).
        momentum (float): momentum coefficient.
        weight_decay (float): L2 coefficient added to the gradient, as ``WeightDecay(rate)``.
        nesterov (bool): Nesterov momentum: ``p += momentum * v - lr * g`` after updating ``v``.
        decay_filter (callable): ``decay_filter(name, param) -> bool``, whether the parameter at
            path ``name`` takes weight decay; decided once, at setup. Default: every parameter.
            :func:`skip_bn_and_bias` excludes BatchNorm parameters and biases.
    """

    lr = chainer_optimizer.HyperparameterProxy('lr')
    momentum = chainer_optimizer.HyperparameterProxy('momentum')
    weight_decay = chainer_optimizer.HyperparameterProxy('weight_decay')

    def __init__(self, lr=0.01, momentum=0.9, weight_decay=0.0, nesterov=False,
                 decay_filter=None):
        super().__init__()
        for name, value in (('lr', lr), ('momentum', momentum), ('weight_decay', weight_decay)):
            if not numpy.isfinite(value) or value < 0:
                raise ValueError('{} must be a finite number >= 0; got {}'.format(name, value))
        if decay_filter is not None and not callable(decay_filter):
            raise TypeError('decay_filter must be callable(name, param) -> bool; got {!r}'
                            .format(decay_filter))
        self.hyperparam = chainer_optimizer.Hyperparameter()
        self.hyperparam.lr = lr
        self.hyperparam.momentum = momentum
        self.hyperparam.weight_decay = weight_decay
        self.nesterov = bool(nesterov)
        self.decay_filter = decay_filter or decay_all
        self._flat = None
        self._scaler = _scaler.LossScaler()
        self._temps = None
        self._warned = set()

    # ---- set-up ---------------------------------------------------------------------------------

    def setup(self, link):
        """Register ``link``; its parameters move into the optimizer's flat buffers now, or at
        the first update if some are not initialized yet."""
        super().setup(link)
        self._flat = None
        self._try_build()
        return self

    def _try_build(self, required=False):
        if self._flat is not None:
            return self._flat
        params = list(self.target.namedparams())
        with variable._AllowArrayAccessWithNonstandardLayout():
            if not required and any(p.array is None for _, p in params):
                return None                       # lazy links: wait for the first update
            self._flat = _flat.FlatParams(params, self.decay_filter)
        self._scaler.to_device(self._flat.xp)
        return self._flat

    def use_fp32_update(self, flag=True):
        """Accepted for compatibility: float16 parameters always have float32 master weights."""
        if not flag:
            raise ValueError('chainer_tc.optimizers.MomentumSGD always updates float16 parameters '
                             'through float32 master weights; use_fp32_update(False) is not '
                             'supported')

    def add_hook(self, hook, name=None, timing='auto'):
        if isinstance(hook, chainer.optimizer_hooks.WeightDecay):
            raise TypeError('chainer_tc.optimizers.MomentumSGD applies weight decay inside its '
                            'kernel: pass weight_decay={} (and decay_filter=...) instead of the '
                            'WeightDecay hook'.format(hook.rate))
        super().add_hook(hook, name, timing)

    def call_hook(self, hook):
        if getattr(hook, 'call_for_each_param', False):
            if hook.name not in self._warned:
                self._warned.add(hook.name)
                warnings.warn('optimizer hook {} runs once per parameter, from Python: it costs '
                              'a loop over all parameters every step'.format(hook.name),
                              RuntimeWarning, stacklevel=3)
            for param in self.target.params():
                hook(self, param)
        else:
            hook(self)

    # ---- loss scaling -----------------------------------------------------------------------------

    def loss_scaling(self, interval=1000, scale=None, initial_scale=2.0 ** 15, min_scale=1.0,
                     max_scale=2.0 ** 24):
        """Loss scaling: dynamic when ``scale`` is None (see docs/optimizer.md), else static.

        Dynamic: a step with an inf or nan in any gradient is skipped and the scale halves; after
        ``interval`` clean steps it doubles; it stays within [min_scale, max_scale].
        """
        self._scaler.configure(interval, scale, initial_scale, min_scale, max_scale)

    def set_loss_scale(self, loss_scale):
        self.loss_scaling(scale=loss_scale)

    def scaled_backward(self, loss):
        """``loss.backward()`` seeded with the loss scale (on the device), for loops that call
        ``update()`` without a loss function. Without loss scaling it is ``loss.backward()``.
        A plain ``loss.backward()`` with loss scaling on would leave the gradients unscaled, and
        the update would divide them by the scale anyway."""
        if self._scaler.mode != _scaler.NONE:
            if loss.size != 1:
                raise ValueError('the loss must have one element to be scaled; got shape {}'
                                 .format(loss.shape))
            self._check_set_up()
            self._try_build(required=True)
            loss.grad = self._scaler.seed(loss)
        loss.backward()

    @property
    def loss_scale(self):
        """The current loss scale, or None without loss scaling (reading it synchronises)."""
        return None if self._scaler.mode == _scaler.NONE else self._scaler.scale

    @property
    def skipped_steps(self):
        """Steps skipped for an inf or nan gradient so far (reading it synchronises)."""
        return self._scaler.skipped

    # ---- the update -------------------------------------------------------------------------------

    def update(self, lossfun=None, *args, **kwds):
        self._check_set_up()
        if lossfun is not None:
            loss = lossfun(*args, **kwds)
            self.target.cleargrads()
            self.scaled_backward(loss)
            del loss
        with variable._AllowArrayAccessWithNonstandardLayout():
            flat = self._try_build(required=True)
            if self._has_hooks('pre'):
                self._reallocate_cleared_grads()
                self.call_hooks('pre')
            grads = flat.grads()          # (raises, before anything changes, on a bad param)
            self.t += 1
            if kernels.backend(flat.xp) == 'numpy':
                self._update_numpy(flat, grads)
            else:
                self._update_kernels(flat, grads)
            if self._has_hooks('post'):
                self.call_hooks('post')

    def _has_hooks(self, timing):
        hooks = getattr(self._hookable, '_{}_update_hooks'.format(timing), None)
        return bool(hooks)

    def _reallocate_cleared_grads(self):
        # hooks expect every parameter to have a gradient, as in Chainer
        for param in self.target.params():
            if param.grad is None:
                param.grad = param.device.xp.zeros_like(param.array)

    def _step_params(self, flat):
        sp = numpy.zeros((), STEP_PARAMS)
        sp['lr'], sp['momentum'] = self.lr, self.momentum
        sp['weight_decay'], sp['nesterov'] = self.weight_decay, self.nesterov
        sc = self._scaler
        sp['scaling'], sp['interval'] = sc.mode, sc.interval
        sp['min_scale'], sp['max_scale'] = sc.min_scale, sc.max_scale
        sp['total_blocks'] = flat.num_chunks
        return sp

    def _update_kernels(self, flat, grads):
        """The GPU path (CuPy), or the emulated one under CHAINER_TC_EMULATE=1: at most 2 launches
        for up to GRAD_TABLE parameters (the finite check only with dynamic loss scaling)."""
        xp = flat.xp
        dynamic = self._scaler.mode == _scaler.DYNAMIC
        update = kernels.get_function('optimizer', 'momentum_sgd_update', xp, _DEFINES)
        check = kernels.get_function('optimizer', 'momentum_sgd_check', xp, _DEFINES) \
            if dynamic else None
        base = self._step_params(flat)
        steps = []
        for c0, nc, e0, ne in flat.launches:
            sp = base.copy()
            sp['grad'][:ne] = [0 if g is None else _address(g) for g in grads[e0:e0 + ne]]
            # a size-1 structured NumPy array: CuPy (>= 9) passes it by value, as the struct
            steps.append((sp, flat.chunks[c0:c0 + nc], nc))
        state = self._scaler.state
        with _flat.on_device(flat):
            if dynamic:
                for sp, chunks, nc in steps:
                    if nc:
                        check((nc,), (BLOCK,), (sp, chunks, state))
            for sp, chunks, nc in steps:
                if nc:
                    update((nc,), (BLOCK,), (sp, chunks, flat.params[0], flat.params[1],
                                             flat.master, flat.momentum[0], flat.momentum[1],
                                             state))

    def _update_numpy(self, flat, grads):
        """The CPU path: the kernel's arithmetic, in the same order, as vectorised NumPy over
        cache-sized blocks of each parameter, reading the gradients where they are."""
        if self._temps is None:
            self._temps = [numpy.empty(_CPU_BLOCK, numpy.float32) for _ in range(3)]
        t1, t2, t3 = self._temps
        sc = self._scaler
        scale = sc.state[_scaler.SCALE:_scaler.SCALE + 1].view(numpy.float32)[0]
        blocks = [(e, None if g is None else g.reshape(-1), a, min(a + _CPU_BLOCK, e.size))
                  for e, g in zip(flat.entries, grads) for a in range(0, e.size, _CPU_BLOCK)]

        def load_grad(g, a, b, out):          # g = grad / scale, in float32
            if g is None:
                out[...] = 0
            elif sc.mode == _scaler.NONE:
                out[...] = g[a:b]
            else:
                numpy.divide(g[a:b], scale, out=out, dtype=numpy.float32)
            return out

        with numpy.errstate(invalid='ignore', over='ignore', divide='ignore'):
            if sc.mode == _scaler.DYNAMIC and not all(
                    numpy.isfinite(load_grad(g, a, b, t1[:b - a])).all()
                    for e, g, a, b in blocks if g is not None):
                sc.finish_step_host(True)
                return
        lr, mom, wd = (numpy.float32(x) for x in (self.lr, self.momentum, self.weight_decay))
        p16 = flat.params[1]
        for e, g, a, b in blocks:
            n, lo, hi = b - a, e.offset + a, e.offset + b
            p = (flat.params[0] if e.group == 0 else flat.master)[lo:hi]
            v = flat.momentum[e.group][lo:hi]
            gb, tb, ub = load_grad(g, a, b, t1[:n]), t2[:n], t3[:n]
            if e.group == 1:        # adopt float16 values written from outside the optimizer
                stale = p16[lo:hi].view(numpy.uint16) != p.astype(numpy.float16).view(numpy.uint16)
                if stale.any():
                    p[stale] = p16[lo:hi][stale]
            if e.decay and wd != 0:
                numpy.multiply(p, wd, out=tb)           # g = g + wd * p
                gb += tb
            v *= mom                                    # v = v * momentum - lr * g
            numpy.multiply(gb, lr, out=tb)
            v -= tb
            if self.nesterov:                           # p = p + (v * momentum - lr * g)
                numpy.multiply(v, mom, out=ub)
                ub -= tb
                p += ub
            else:                                       # p = p + v
                p += v
            if e.group == 1:
                p16[lo:hi] = p                          # rounds to nearest even
        if sc.mode == _scaler.DYNAMIC:
            sc.finish_step_host(False)

    # ---- serialization -----------------------------------------------------------------------------

    def serialize(self, serializer):
        """Saves/loads t, epoch, the loss-scale state and, per parameter, its momentum ``v`` and
        (float16 parameters) its float32 ``master``; the parameters belong to the model."""
        self.t = serializer('t', self.t)
        self.epoch = serializer('epoch', self.epoch)
        sc = self._scaler
        sc.mode = int(serializer('loss_scaling_mode', sc.mode))
        sc.interval = int(serializer('loss_scaling_interval', sc.interval))
        sc.min_scale = float(serializer('loss_scaling_min', sc.min_scale))
        sc.max_scale = float(serializer('loss_scaling_max', sc.max_scale))
        with variable._AllowArrayAccessWithNonstandardLayout():
            flat = self._try_build(required=True)
        serializer('loss_scaler', sc.state)
        for e in flat.entries:
            s = serializer[e.name]
            s('v', e.v)
            if e.master is not None:
                s('master', e.master)


def _address(a):
    return a.ctypes.data if isinstance(a, numpy.ndarray) else a.data.ptr
