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
import chainer.warnings

from chainer_tc import kernels
from chainer_tc.optimizers import _file_layout
from chainer_tc.optimizers import _flat
from chainer_tc.optimizers import _grads
from chainer_tc.optimizers import _hyper
from chainer_tc.optimizers import _rule
from chainer_tc.optimizers import _scaler

BLOCK = 256                 # threads per block of kernels/optimizer.cu (OPT_BLOCK)
_CPU_BLOCK = 1 << 15        # elements per step of the CPU path: its temporaries stay in cache
_DEFINES = {'OPT_BLOCK': BLOCK, 'OPT_GRAD_TABLE': _flat.GRAD_TABLE}

# kernels/optimizer.cu StepParams, passed by value
STEP_PARAMS = numpy.dtype([
    ('nesterov', '<i4'), ('scaling', '<i4'), ('interval', '<u4'), ('min_scale', '<f4'),
    ('max_scale', '<f4'), ('total_blocks', '<u4'), ('grad_divisor', '<f8'),
    ('grad', '<u8', (_flat.GRAD_TABLE,)),
])


def decay_all(name, param):
    """Default ``decay_filter``: weight decay for every parameter (Chainer's WeightDecay hook)."""
    return True


def skip_bn_and_bias(name, param):
    """``decay_filter`` of the usual ResNet-50 recipes: no weight decay for 1-D parameters
    (BatchNormalization's gamma and beta, every bias); decay for weights (2-D and more)."""
    return param.ndim > 1


class MomentumSGD(chainer.optimizers.MomentumSGD):
    """Momentum SGD with weight decay, fp32 master weights and device-side loss scaling.

    A subclass of Chainer's ``MomentumSGD`` (``isinstance`` tests in user code hold), which
    it replaces whole: its update rules, update, serialization and loss scaling are ours.

    Args:
        lr (float): learning rate (assignable at any time, also by Chainer's extensions).
        momentum (float): momentum coefficient.
        weight_decay (float): L2 coefficient added to the gradient, as ``WeightDecay(rate)``.
        nesterov (bool): Nesterov momentum: ``p += momentum * v - lr * g`` after updating ``v``.
        decay_filter (callable): ``decay_filter(name, param) -> bool``, whether the parameter at
            path ``name`` takes weight decay, asked once per parameter at ``setup()`` (for a
            lazy link's parameter, when it gets its array): a parameter it excludes gets its
            own ``update_rule.hyperparam.weight_decay = 0``. Default: every parameter.
            :func:`skip_bn_and_bias` excludes BatchNorm parameters and biases.

    Every parameter gets an update rule, as with Chainer: ``update_rule.enabled`` (so
    ``Link.disable_update()``), ``update_rule.hyperparam.lr`` / ``momentum`` / ``weight_decay``
    per parameter, ``update_rule.state['v']``. See docs/optimizer.md.
    """

    lr = chainer_optimizer.HyperparameterProxy('lr')
    momentum = chainer_optimizer.HyperparameterProxy('momentum')
    weight_decay = chainer_optimizer.HyperparameterProxy('weight_decay')

    def __init__(self, lr=0.01, momentum=0.9, weight_decay=0.0, nesterov=False,
                 decay_filter=None):
        for name, value in (('lr', lr), ('momentum', momentum), ('weight_decay', weight_decay)):
            v = _scaler.number(name, value)
            if not numpy.isfinite(v) or v < 0:
                raise ValueError('{} must be a finite number >= 0; got {}'.format(name, value))
        if decay_filter is not None and not callable(decay_filter):
            raise TypeError('decay_filter must be callable(name, param) -> bool; got {!r}'
                            .format(decay_filter))
        self._versions = _rule.Versions()
        self._scaler = _scaler.LossScaler()
        self._clock = _rule.Clock(self._scaler)
        self._skip_watch = _scaler.SkipWatch()
        super().__init__(lr=lr, momentum=momentum)      # (Chainer's: sets these two)
        self.hyperparam.weight_decay = weight_decay
        self.nesterov = bool(nesterov)
        self.decay_filter = decay_filter or decay_all
        self._flat = None
        self._table = None
        self._temps = None
        self._warned = set()

    @property
    def hyperparam(self):
        return self._hyperparam

    @hyperparam.setter
    def hyperparam(self, value):
        self._hyperparam = _rule.track(value, self._versions)
        self._versions.root = value      # (the rules created before keep their parent, as
        #                                   Chainer's: tracked as any other Hyperparameter)

    @property
    def t(self):
        """Update steps so far, skipped overflow steps included (as Chainer counts them)."""
        return self._clock.t

    @t.setter
    def t(self, value):
        self._clock.t = int(value)

    # ---- set-up ---------------------------------------------------------------------------------

    def create_update_rule(self):
        return _rule.Rule(self.hyperparam, self._clock, self._versions)

    def setup(self, link):
        """Register ``link``: every parameter gets an update rule now; their arrays move into the
        optimizer's flat buffers now, or at the first update if some are not initialized yet."""
        if self._clock.steps:
            # the rules of the previous setup() stop counting, as Chainer's (no longer updated);
            # the new ones count from 0 whatever was skipped before
            self._clock.freeze()
            self._clock = _rule.Clock(self._scaler)    # (its skips count from its 1st step)
        super().setup(link)
        for name, param in link.namedparams():
            if param.array is None:
                # a lazy link: decay_filter is asked when the parameter gets its array (it
                # may read param.ndim, as skip_bn_and_bias does), before it enters the buffers
                param.update_rule._decay_pending = name
            else:
                self._filter_decay(name, param)
            if param._loss_scale is None:
                # no backward pass has marked this parameter: a gradient set by hand before
                # the first backward is taken as scaled by this optimizer's loss scale (a
                # backward pass replaces the mark; see _grads)
                param._loss_scale = _scaler.SCALED_ON_DEVICE
        self._flat = None
        self._try_build()
        return self

    def _filter_decay(self, name, param):
        rule = param.update_rule
        rule._decay_pending = None
        if 'weight_decay' in rule.hyperparam.__dict__:
            return                 # set on the rule since setup(): the user's choice stays
        try:
            decay = self.decay_filter(name, param)
        except Exception as e:
            if hasattr(e, 'add_note'):          # (Python 3.11+)
                e.add_note('in decay_filter({!r}, param), parameter {}'.format(name, name))
            raise
        if not decay:
            rule.hyperparam.weight_decay = 0.0

    def _try_build(self, required=False, walk=False):
        """The flat buffers, (re)built if missing or stale; None while lazy parameters wait.
        ``walk``: also compare the model's parameters with the buffers' (a link added or
        deleted since they were built), as Chainer's update does by walking the model."""
        flat = self._flat
        if flat is not None:
            why = flat.stale() or (flat.changed(self.target) if walk else None)
            if why is None:
                return flat
            self._warn_once('rebuild', '{}: the optimizer rebuilds its buffers, keeping every '
                                       'momentum; this costs a copy of all parameters each time '
                                       'it happens'.format(why))
        with variable._AllowArrayAccessWithNonstandardLayout():
            params = _flat.unique_params(self.target.namedparams())
            if not required and any(p.array is None for _, p in params):
                return None                       # lazy links: wait for the first update
            trained, untrained, waiting = [], [], []
            for name, p in params:
                rule = p.update_rule
                if rule is None:
                    untrained.append((name, p))
                elif p.array is None:              # a lazy link the loss has not called yet:
                    waiting.append((name, p))      # skipped, as Chainer's update skips it
                elif not isinstance(rule, _rule.Rule):
                    raise RuntimeError(
                        'parameter {} has update rule {!r}, not chainer_tc\'s: its update rule '
                        'was replaced after setup(), or the link was added after setup(); call '
                        'optimizer.setup(model) again'.format(name, rule))
                elif rule._versions is not self._versions:
                    raise RuntimeError(
                        "parameter {} has an update rule that is not this optimizer's: another "
                        'chainer_tc optimizer was set up on it since, or its link was copied '
                        "with its rules (Link.copy(mode='copy'), copy.deepcopy) and added after "
                        'setup(); call optimizer.setup(model) again (one optimizer per '
                        'parameter)'.format(name))
                else:
                    if rule._decay_pending is not None:
                        self._filter_decay(name, p)
                    trained.append((name, p))
            if untrained:
                names = ', '.join(n for n, _ in untrained)
                self._warn_once('untrained:' + names, (
                    'parameter(s) {} have no update rule (update_rule is None, or their link was '
                    'added after setup()): the optimizer does not train them, as Chainer\'s '
                    'optimizers do not; call optimizer.setup(model) again to train them'
                    ).format(names), UserWarning)
            self._flat = flat = _flat.FlatParams(trained, untrained, waiting)
            self._attach_rules([p.update_rule for _, p in trained + waiting])
        with flat.device_scope():
            self._scaler.to_device(flat.xp)
        self._table = _hyper.HyperTable(flat, kernels.backend(flat.xp) != 'numpy')
        self._temps = None
        return flat

    def _attach_rules(self, rules):
        """The rules of the target's parameters (``rules``) count their steps; a rule the last
        build had and this one has not (its parameter's ``update_rule = None``, its link
        deleted) stops counting, as Chainer's, which is then not called, until it is back."""
        rules = [r for r in rules if isinstance(r, _rule.Rule) and r._versions is self._versions]
        now = {id(r) for r in rules}
        for r in getattr(self, '_attached_rules', ()):
            if id(r) not in now:
                r._attach(False)
        for r in rules:
            r._attach(True)
        self._attached_rules = rules

    def _warn_once(self, key, message, category=chainer.warnings.PerformanceWarning):
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, category, stacklevel=4)

    def use_fp32_update(self, flag=True):
        """Accepted for compatibility and does nothing: float16 parameters always have float32
        master weights (``flag=False`` is refused)."""
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
            self._warn_once(hook.name, 'optimizer hook {} runs once per parameter, from Python: '
                                       'it costs a loop over all parameters every step'
                                       .format(hook.name))
        super().call_hook(hook)

    def __getstate__(self):
        # the flat buffers are rebuilt from the parameters and their rules' state (which holds
        # the momenta and masters) at the next update; kernels and module references stay out
        state = self.__dict__.copy()
        state['_flat'] = state['_table'] = state['_temps'] = None
        target = state.get('target')
        if target is not None:
            # Chainer's Parameter pickles without _loss_scale (a copy starts with None): keep
            # how each gradient was scaled, so that the copy unscales them as the original does
            state['_loss_scale_marks'] = [
                p._loss_scale for _, p in _flat.unique_params(target.namedparams())]
        return state

    def __setstate__(self, state):
        marks = state.pop('_loss_scale_marks', None)
        self.__dict__.update(state)
        if getattr(self._versions, 'root', None) is None:    # (pickled by an earlier version)
            self._versions.root = self._hyperparam
        if marks is not None:
            for (_, p), mark in zip(_flat.unique_params(self.target.namedparams()), marks):
                p._loss_scale = mark

    # ---- loss scaling -----------------------------------------------------------------------------

    def loss_scaling(self, interval=1000, scale=None, initial_scale=2.0 ** 15, min_scale=1.0,
                     max_scale=2.0 ** 24):
        """Loss scaling: dynamic when ``scale`` is None (see docs/optimizer.md), else static.

        Dynamic: a step with an inf or nan in any gradient is skipped and the scale halves; after
        ``interval`` clean steps it doubles; it stays within [min_scale, max_scale].
        """
        self._clock.reconfiguring()
        self._scaler.configure(interval, scale, initial_scale, min_scale, max_scale)
        self._skip_watch.rebase(0)

    def set_loss_scale(self, loss_scale):
        self.loss_scaling(scale=loss_scale)

    def scaled_backward(self, loss):
        """``loss.backward()`` seeded with the loss scale (on the device), for loops that call
        ``update()`` without a loss function. Without loss scaling it is ``loss.backward()``.

        As with Chainer, each gradient is unscaled by what its parameter's ``_loss_scale`` says
        the backward pass that computed it used: this method marks the optimizer's own scale;
        ``loss.backward(loss_scale=optimizer._loss_scale)`` (Chainer's idiom, e.g. chainermn)
        marks that number; a plain ``loss.backward()`` marks none, and its gradients are used
        as they are (loss scaling then only skips steps with inf or nan gradients)."""
        if self._scaler.mode != _scaler.NONE:
            if loss.size != 1:
                raise ValueError('the loss must have one element to be scaled; got shape {}'
                                 .format(loss.shape))
            self._check_set_up()
            self._try_build(required=True)
            loss.grad = self._scaler.seed(loss)
            # the seed is already scaled: Chainer's backward only records loss_scale on the
            # parameters it reaches (param._loss_scale), which is what the update reads
            loss.backward(loss_scale=_scaler.SCALED_ON_DEVICE)
        else:
            loss.backward()

    @property
    def loss_scale(self):
        """The current loss scale, or None without loss scaling (reading it synchronises)."""
        return None if self._scaler.mode == _scaler.NONE else self._scaler.scale

    @property
    def _loss_scale(self):
        """Chainer's attribute, read by code that runs ``loss.backward(loss_scale=
        optimizer._loss_scale)`` itself (chainermn's multi-node optimizer, custom updaters):
        the current loss scale, or None without loss scaling (reading it synchronises)."""
        return self.loss_scale

    @property
    def _loss_scaling_is_dynamic(self):
        # Chainer's attribute (a class attribute False there, set by its loss_scaling())
        return self._scaler.mode == _scaler.DYNAMIC

    def check_nan_in_grads(self):
        """As Chainer's: with dynamic loss scaling, warn for every parameter whose gradient
        holds an inf or nan (naming it), and remember the answer for ``is_safe_to_update()``.
        Reads every gradient on the host (one synchronisation per parameter, as Chainer's);
        ``update()`` does not call it: it checks on the device instead."""
        self._loss_scaling_isnan = False
        if not self._loss_scaling_is_dynamic:
            return
        with variable._AllowArrayAccessWithNonstandardLayout():
            for name, param in self.target.namedparams():
                g = param.grad
                if g is None:
                    continue
                xp = chainer.backend.get_array_module(g)
                if not bool(xp.isfinite(g).all()):
                    self._loss_scaling_isnan = True
                    warnings.warn('Non finite number found in param.grad of {} (iteration: {}, '
                                  'loss_scale: {})'.format(name, self.t, self.loss_scale),
                                  stacklevel=2)

    def is_safe_to_update(self):
        """As Chainer's: False when the last ``check_nan_in_grads()`` found an inf or nan."""
        return not getattr(self, '_loss_scaling_isnan', False)

    def update_loss_scale(self):
        """Chainer's step of its dynamic loss scale. Here ``update()`` moves the scale itself, on
        the device (halved on an overflow, doubled after ``interval`` clean steps): with dynamic
        loss scaling, a second move is refused; otherwise nothing to do, as with Chainer."""
        if self._loss_scaling_is_dynamic:
            raise RuntimeError(
                'chainer_tc.optimizers.MomentumSGD updates its dynamic loss scale inside '
                'update() (halved on an overflow, doubled after interval={} clean steps), on the '
                'device; update_loss_scale() would move it a second time. Call update() alone '
                '(it skips a step with an inf or nan gradient)'.format(self._scaler.interval))

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
            flat = self._try_build(required=True, walk=True)
            checked = None
            try:
                if self._has_hooks('pre'):
                    # as Chainer: cleared gradients become zeros, and dynamic loss scaling
                    # checks the gradients the backward pass computed before any hook runs
                    # (a hook could hide an overflow: GradientHardClipping clips inf to its
                    # bound); the update then skips on that check's flag
                    self.reallocate_cleared_grads()
                    checked = self._check_before_hooks(flat)
                    self.call_hooks('pre')
                    # a hook may have replaced a parameter's array or update rule
                    flat = self._try_build(required=True, walk=True)
                copied = []
                grads = flat.grads(copied=copied)
                self._step(self._plan(flat, grads, checked=checked, copied=copied,
                                      marks=[e.param._loss_scale for e in flat.entries],
                                      untrained=self._untrained_grads(flat, checked)))
            except BaseException:
                if checked is not None:
                    self._scaler.clear_flag()       # the step never ran: no flag left set
                raise
            post = self._has_hooks('post')
            if post or _has_none(grads) or _has_none([p.grad for _, p in flat.untrained]):
                # as Chainer: every parameter has a gradient after update() (zeros where
                # there was none), also when the post hooks run
                self.reallocate_cleared_grads()
            if post:
                self.call_hooks('post')

    def _check_before_hooks(self, flat):
        """With dynamic loss scaling, run the overflow check on the gradients now (before the
        pre-update hooks), as Chainer does: the kernel path leaves the flag on the device (no
        synchronisation), the NumPy path returns it. None without dynamic scaling."""
        if self._scaler.mode != _scaler.DYNAMIC:
            return None
        copied = []
        step = self._plan(flat, flat.grads(copied=copied), copied=copied,
                          marks=[e.param._loss_scale for e in flat.entries],
                          untrained=self._untrained_grads(flat, None))
        return step.check_now()

    def _untrained_grads(self, flat, checked, pairs=None):
        """The gradients of the target's parameters without an update rule, for the overflow
        check of dynamic loss scaling (Chainer's ``check_nan_in_grads()`` reads every
        parameter's): none when the step does not check (already checked, or not dynamic).
        ``pairs``: (param, gradient) to read them from (``flat.untrained_grads()``: what the
        parameters hold now)."""
        if checked is not None or self._scaler.mode != _scaler.DYNAMIC or not flat.untrained:
            return ()
        return [g for _, g in (flat.untrained_grads() if pairs is None else pairs)]

    def _has_hooks(self, timing):
        h = self._hookable
        if h is None:
            return False
        return bool(h._pre_update_hooks if timing == 'pre' else h._post_update_hooks)

    def _step(self, plan):
        """Apply one prepared update: hyperparameters to the device if they changed, then the
        kernels (or the NumPy path)."""
        self._table.refresh(self.hyperparam, self._versions, self._set_globals)
        self._clock.step()          # t += 1, and the rules' own count
        plan()
        self._skip_watch.after_step(self._scaler, self.t, stacklevel=3)

    def new_epoch(self, auto=False):
        super().new_epoch(auto)
        # (a synchronisation per epoch: says whether steps were skipped since the last look)
        self._skip_watch.now(self._scaler, self.t, stacklevel=2)

    def _plan(self, flat, grads, flat_grads=None, marks=None, checked=None, copied=(),
              untrained=()):
        """A callable that updates every parameter from ``grads`` (one array or None per entry
        of ``flat``), reading everything else (hyperparameters, loss scale) when it runs.
        ``flat_grads``: the gradients are views of these buffers (``flat.grad_buffers()``),
        which lets the CPU path update whole runs of parameters at once.
        ``marks``: each entry's ``param._loss_scale`` (see ``_grads.StepGrads``); None: every
        gradient comes from ``scaled_backward()``. ``copied``: ``(index, gradient)`` of each
        gradient that ``grads`` holds a contiguous copy of (``flat.grads(copied=...)``): a
        quotient written back goes there too.
        ``checked``: what ``check_now()`` of a step over this step's gradients returned before
        the pre-update hooks (dynamic loss scaling): the step skips on that check instead of
        checking again (as Chainer, which checks before its hooks only); None: it checks.
        ``untrained``: gradients of parameters without an update rule, which the overflow
        check reads too (as they are: Chainer's check reads every gradient), never updated."""
        if flat_grads is not None and (marks is not None or checked is not None or copied):
            raise ValueError('a step over flat gradient buffers takes its gradients from '
                             'scaled_backward(): marks must be None')
        if flat_grads is not None and kernels.backend(flat.xp) == 'numpy':
            return _NumpyFlatStep(self, flat, grads, flat_grads, untrained)
        step_grads = _grads.StepGrads(self._scaler.mode, flat, grads, marks, copied)
        if kernels.backend(flat.xp) != 'numpy':
            return _KernelStep(self, flat, step_grads, checked, untrained)
        return _NumpyStep(self, flat, step_grads, checked, untrained)

    def _set_globals(self, row):
        flat = self._flat
        if self._table.device is self._table.host:
            return
        g = numpy.zeros((), _hyper.GLOBALS)
        g['lr'], g['momentum'], g['weight_decay'] = row[:3]
        kernel = kernels.get_function('optimizer', 'momentum_sgd_set_globals', flat.xp, _DEFINES)
        with flat.device_scope():
            kernel((1,), (1,), (g, self._table.device))

    def _step_params(self, flat):
        sp = numpy.zeros((), STEP_PARAMS)
        sc = self._scaler
        sp['nesterov'] = self.nesterov
        sp['scaling'], sp['interval'] = sc.mode, sc.interval
        sp['min_scale'], sp['max_scale'] = sc.min_scale, sc.max_scale
        sp['total_blocks'] = flat.num_chunks
        return sp

    # ---- serialization -----------------------------------------------------------------------------

    def serialize(self, serializer):
        """Saves/loads what Chainer's MomentumSGD does (``t``, ``epoch``, and per parameter its
        rule's ``t`` and momentum ``v``), plus the float32 ``master`` of float16 parameters and the
        loss-scale configuration and state. Files move both ways between Chainer's optimizer
        and this one (see docs/optimizer.md).

        Loading is all or nothing: the loaded loss-scaling configuration and state are
        validated (an error names the key and the value), and if anything fails, every value
        the load had changed is put back."""
        if not isinstance(serializer, chainer.serializer.Deserializer):
            self._skip_watch.now(self._scaler, self.t, stacklevel=2)   # (saving synchronises)
            self._serialize(serializer)
            return
        backup = self._backup()
        try:
            self._serialize(serializer)
            self._scaler.validate()
        except Exception:
            self._restore(backup)
            raise
        self._skip_watch.rebase(self._scaler.skipped)

    def _serialize(self, serializer):
        self.t = serializer('t', self.t)
        self.epoch = serializer('epoch', self.epoch)
        sc = self._scaler
        saving = not isinstance(serializer, chainer.serializer.Deserializer)
        if saving:
            serializer('loss_scaling_mode', sc.mode)
            serializer('loss_scaling_interval', sc.interval)
            serializer('loss_scaling_min', sc.min_scale)
            serializer('loss_scaling_max', sc.max_scale)
            serializer('loss_scaler', sc.state)
        elif _has_key(serializer, 'loss_scaling_mode'):  # none in Chainer's files
            self._load_loss_scaling(serializer)
        self._clock.forget()
        layout = self._filter_state_layout(serializer)
        filters = _file_layout.filters_with_file_layout(self.target)
        seen = set()
        with variable._AllowArrayAccessWithNonstandardLayout():
            # every path, as Chainer's: a Parameter held by two links (tied weights) is saved
            # under both, so that Chainer's optimizer can load the file
            for name, param in self.target.namedparams():
                if param.update_rule is None:        # (as Chainer's: untrained, skipped)
                    continue
                inner = serializer[name]
                if id(param) in seen and not saving and not _has_key(inner, 't'):
                    continue            # an earlier chainer_tc's file: saved under one path
                seen.add(id(param))
                link = filters.get(id(param))
                if link is not None and layout is None:
                    inner = _file_layout.SaveState(inner, link)
                elif link is not None:
                    inner = _file_layout.LoadState(inner, link, layout, name)
                param.update_rule.serialize(inner)

    def _load_loss_scaling(self, serializer):
        """A file's loss scaling: its configuration and state are validated (an error names
        the key and the value); the configuration made in code stays, as with Chainer (whose
        files have none); the file's state (the scale, clean steps, skipped steps) is resumed
        where it fits that configuration: the same mode, for static scaling the same scale,
        for dynamic scaling a scale within [min_scale, max_scale]. Otherwise a UserWarning
        says what is not resumed and why."""
        sc = self._scaler
        saved = _scaler.LossScaler()
        saved.mode = int(serializer('loss_scaling_mode', sc.mode))
        saved.interval = int(serializer('loss_scaling_interval', sc.interval))
        saved.min_scale = float(serializer('loss_scaling_min', sc.min_scale))
        saved.max_scale = float(serializer('loss_scaling_max', sc.max_scale))
        state = serializer('loss_scaler', None)
        if state is None:                  # (strict=False, and not in the file)
            return
        state = numpy.asarray(state)
        if state.shape != saved.state.shape:
            raise ValueError('loss_scaler has shape {}; a saved loss-scale state has shape {}'
                             .format(state.shape, saved.state.shape))
        saved.state[...] = state
        saved.validate()
        why = sc.why_not_resumed(saved)
        if why is None:
            sc.resume(saved.state)
        else:
            warnings.warn(
                "the snapshot's loss scaling is not resumed: {}. A load keeps the loss-scaling "
                'configuration made in code, as Chainer\'s optimizers do (their files hold '
                "none); to resume the snapshot's scale, configure loss_scaling() as its run "
                'did before loading'.format(why), UserWarning, stacklevel=5)

    @staticmethod
    def _filter_state_layout(serializer):
        """None when saving (filters' state is written in Chainer's layout, and the file says
        so); when loading, the layout the file holds it in (see ``_file_layout``)."""
        if not isinstance(serializer, chainer.serializer.Deserializer):
            serializer(_file_layout.LAYOUT_KEY, True)
            return None
        if _has_key(serializer, _file_layout.LAYOUT_KEY):
            if not bool(serializer(_file_layout.LAYOUT_KEY, True)):
                raise ValueError('{} in the file is False: no chainer_tc writes that'
                                 .format(_file_layout.LAYOUT_KEY))
            return _file_layout.IN_CHAINER_LAYOUT
        if _has_key(serializer, 'loss_scaling_mode'):  # an earlier chainer_tc's file
            return _file_layout.IN_PARAM_LAYOUT
        return _file_layout.BY_SHAPE                     # Chainer's optimizer's file

    def _backup(self):
        sc = self._scaler
        rules = []
        for _, param in _flat.unique_params(self.target.namedparams()):
            rule = param.update_rule
            if rule is None:
                continue
            state = rule._state
            rules.append((rule, rule.t, None if state is None else
                           {k: v.copy() for k, v in state.items()}))
        return (self.t, self.epoch, (sc.mode, sc.interval, sc.min_scale, sc.max_scale),
                sc.state.copy(), rules)

    def _restore(self, backup):
        t, epoch, config, state, rules = backup
        sc = self._scaler
        self.t, self.epoch = t, epoch
        sc.mode, sc.interval, sc.min_scale, sc.max_scale = config
        sc.state[...] = state
        self._clock.forget()
        for rule, rule_t, saved in rules:
            if saved is None:
                rule._state = None
            else:
                current = rule._state or {}
                for k, v in saved.items():
                    if k in current and current[k].shape == v.shape:
                        current[k][...] = v          # in place: the flat buffers' views
                    else:
                        current[k] = v
                rule._state = current
            rule.t = rule_t


def _has_key(serializer, key):
    """Whether a deserializer's file holds ``key`` (Chainer's deserializers raise KeyError for
    a missing key only when strict; ours asks first so that a load is all or nothing)."""
    if not isinstance(serializer, chainer.serializer.Deserializer):
        raise TypeError('_has_key reads a file: {} writes one'.format(type(serializer).__name__))
    npz = getattr(serializer, 'npz', None)
    if npz is not None:
        return serializer.path + key in npz
    group = getattr(serializer, 'group', None)          # HDF5
    if group is not None:
        return key in group
    try:
        serializer(key, None)
        return True
    except KeyError:
        return False


class _KernelStep:
    """The GPU path (CuPy), or the emulated one under CHAINER_TC_EMULATE=1: at most 2 launches
    for up to GRAD_TABLE parameters (the finite check only with dynamic loss scaling). The
    gradient addresses are fixed here; the kernels read hyperparameters and the loss scale from
    device memory, so the same step can be captured (each replay recomputing the gradients)."""

    def __init__(self, opt, flat, step_grads, checked=None, untrained=()):
        xp = flat.xp
        self.flat = flat
        self.untrained = untrained
        self.dynamic = opt._scaler.mode == _scaler.DYNAMIC
        self.checked = checked is not None
        self.update = kernels.get_function('optimizer', 'momentum_sgd_update', xp, _DEFINES)
        self.check = kernels.get_function('optimizer', 'momentum_sgd_check', xp, _DEFINES) \
            if self.dynamic else None
        g = step_grads
        base = opt._step_params(flat)
        base['grad_divisor'] = g.divisor
        if g.divisors is not None:          # a step mixing loss scales: each parameter's own
            with flat.device_scope():
                flat.divisors[...] = xp.asarray(numpy.array(g.divisors, numpy.float64))
        addresses = [0 if a is None else _grads._address(a) for a in g.read]
        if any(a & m for a, m in zip(addresses, flat.align_masks)):
            raise ValueError(_misaligned(flat, addresses))
        self.launches = []
        for c0, nc, e0, ne in flat.launches:
            if not nc:
                continue
            sp = base.copy()
            # bit 0 of an address (gradients are aligned to their element size): divide it;
            # bit 1 (float32 and float64 ones, 4-byte aligned): write the quotient back
            sp['grad'][:ne] = [a | d | (w << 1) for a, d, w in zip(
                addresses[e0:e0 + ne], g.divide[e0:e0 + ne], g.write[e0:e0 + ne])]
            # a size-1 structured NumPy array: CuPy (>= 9) passes it by value, as the struct
            self.launches.append((sp, flat.chunks[c0:c0 + nc], nc))
        self.step_grads = g           # keeps the gradients alive as long as their addresses
        self.scaler_state = opt._scaler.state
        self.table = opt._table.device

    def check_now(self):
        """The overflow check alone, now (before the pre-update hooks): sets the flag on the
        device, which the step built after the hooks reads. Returns True: the flag is on the
        device."""
        with self.flat.device_scope():
            for sp, chunks, nc in self.launches:
                self.check((nc,), (BLOCK,), (sp, chunks, self.flat.divisors, self.scaler_state))
            self._check_untrained()
        return True

    def _check_untrained(self):
        """The gradients of parameters without an update rule (not in the buffers, so not
        in the kernel's tables), as Chainer's check reads them: whether each is all finite,
        reduced on the device and or-ed into the overflow flag (four CuPy launches per
        gradient, no synchronisation; none in the usual step, which has no such gradient)."""
        xp = self.flat.xp
        flag = self.scaler_state[_scaler.FOUND_INF:_scaler.FOUND_INF + 1]
        for g in self.untrained:
            xp.bitwise_or(flag, xp.logical_not(xp.isfinite(g).all()), out=flag)

    def __call__(self):
        flat, state = self.flat, self.scaler_state
        with flat.device_scope():
            if self.dynamic and not self.checked:
                for sp, chunks, nc in self.launches:
                    self.check((nc,), (BLOCK,), (sp, chunks, flat.divisors, state))
                self._check_untrained()
            for sp, chunks, nc in self.launches:
                self.update((nc,), (BLOCK,), (
                    sp, chunks, flat.divisors, flat.params[_flat.F32], flat.params[_flat.F16],
                    flat.master, flat.momentum[_flat.F32], flat.momentum[_flat.F16],
                    flat.params[_flat.F64], flat.momentum[_flat.F64], self.table, state))
            self.step_grads.copy_back()


class _NumpyStep:
    """The CPU path: the kernel's arithmetic, in the same order, as vectorised NumPy over
    cache-sized blocks of each parameter, reading the gradients where they are."""

    def __init__(self, opt, flat, step_grads, checked=None, untrained=()):
        self.opt, self.flat = opt, flat
        self.untrained = untrained
        g = self.step_grads = step_grads
        flat_grads = [None if a is None else a.reshape(-1) for a in g.read]
        self.blocks = [(i, flat_grads[i], g.divide[i], g.write[i]) + rest
                       for i, rest in _cpu_blocks(opt, flat)]
        self.checked = checked

    def _load_grad(self):
        """``load_grad(i, g, divide, a, b, out)``: entry i's g[a:b] / its divisor, in the
        arithmetic type of ``out``."""
        scale = self.opt._scaler.state[_scaler.SCALE:_scaler.SCALE + 1].view(numpy.float32)[0]
        sg = self.step_grads
        # the kernel's divisor: 0 is the device loss scale (float32), else a host value
        # rounded to the arithmetic type
        divisors = {}
        for number in ([sg.divisor] if sg.divisors is None else set(sg.divisors)):
            divisors[number] = {t: scale if number == 0.0 else t.type(number)
                                for t in (numpy.dtype(numpy.float32),
                                          numpy.dtype(numpy.float64))}
        of_entry = (lambda i: divisors[sg.divisor]) if sg.divisors is None else \
            (lambda i: divisors[sg.divisors[i]])

        def load_grad(i, g, divide, a, b, out):
            if g is None:
                out[...] = 0
            elif not divide:
                out[...] = g[a:b]
            else:
                numpy.divide(g[a:b], of_entry(i)[out.dtype], out=out, dtype=out.dtype)
            return out
        return load_grad

    def _nonfinite(self, load_grad):
        """Whether a divided gradient, or a gradient of a parameter without an update rule
        (as it is, as Chainer's check reads it), holds an inf or nan."""
        with numpy.errstate(invalid='ignore', over='ignore', divide='ignore'):
            return not all(
                numpy.isfinite(load_grad(i, g, d, a, b, temps[0][:b - a])).all()
                for i, g, d, w, a, b, p, v, p16, temps in self.blocks if g is not None) or \
                not all(numpy.isfinite(g).all() for g in self.untrained)

    def check_now(self):
        """The overflow check alone, before the pre-update hooks: whether a divided gradient
        holds an inf or nan."""
        return self._nonfinite(self._load_grad())

    def __call__(self):
        opt = self.opt
        sc = opt._scaler
        mode = sc.mode
        load_grad = self._load_grad()
        if mode == _scaler.DYNAMIC and (
                self._nonfinite(load_grad) if self.checked is None else self.checked):
            sc.finish_step_host(True)
            return
        hyper = opt._table.values
        nesterov = opt.nesterov
        for i, g, d, w, a, b, p, v, p16, (t1, t2, t3) in self.blocks:
            lr, mom, wd, enabled = hyper[i]
            if not enabled:
                continue
            n = b - a
            dt = t1.dtype.type
            lr, mom, wd = dt(lr), dt(mom), dt(wd)
            gb, tb, ub = load_grad(i, g, d, a, b, t1[:n]), t2[:n], t3[:n]
            if w:                                       # the quotient, as Chainer leaves it
                g[a:b] = gb
            if p16 is not None:     # adopt float16 values written from outside the optimizer
                stale = p16.view(numpy.uint16) != p.astype(numpy.float16).view(numpy.uint16)
                if stale.any():
                    p[stale] = p16[stale]
            if wd != 0:
                numpy.multiply(p, wd, out=tb)           # g = g + wd * p
                gb += tb
            v *= mom                                    # v = v * momentum - lr * g
            numpy.multiply(gb, lr, out=tb)
            v -= tb
            if nesterov:                                # p = p + (v * momentum - lr * g)
                numpy.multiply(v, mom, out=ub)
                ub -= tb
                p += ub
            else:                                       # p = p + v
                p += v
            if p16 is not None:
                p16[...] = p                            # rounds to nearest even
        self.step_grads.copy_back()
        if mode == _scaler.DYNAMIC:
            sc.finish_step_host(False)


class _NumpyFlatStep:
    """The CPU path over flat gradient buffers: the same per-element arithmetic as
    :class:`_NumpyStep` (so the same bits), applied to runs of consecutive parameters that share
    their hyperparameters (padding between parameters stays zero), a few NumPy calls per run
    instead of per parameter. The runs are recomputed when the hyperparameter table changes."""

    def __init__(self, opt, flat, grads, flat_grads, untrained=()):
        self.opt, self.flat = opt, flat
        # gradients of parameters without an update rule, checked as they are (``untrained``
        # of :class:`_NumpyStep`); a replay sets them anew before each step
        self.untrained = untrained
        if opt._temps is None:
            opt._temps = {dt: [numpy.empty(_CPU_BLOCK, dt) for _ in range(3)]
                          for dt in (numpy.dtype(numpy.float32), numpy.dtype(numpy.float64))}
        self.grads = grads
        self.flat_grads = flat_grads
        self._runs_of = None

    def _runs(self):
        """[(group, lo, hi, lr, momentum, weight_decay)] for the enabled runs, in blocks."""
        values = self.opt._table.values
        if self._runs_of is values:
            return self._blocks
        flat = self.flat
        runs = []
        for e, hp in zip(flat.entries, values):
            lo, hi = e.offset, e.offset + -(-e.size // _flat.ALIGN) * _flat.ALIGN
            if runs and runs[-1][0] == e.group and tuple(runs[-1][3:]) == hp and runs[-1][2] == lo:
                runs[-1][2] = hi
            else:
                runs.append([e.group, lo, hi] + list(hp))
        blocks = []
        for group, lo, hi, lr, mom, wd, enabled in runs:
            if not enabled:
                continue
            dt = _flat.STATE_DTYPES[group].type
            p = flat.master if group == _flat.F16 else flat.params[group]
            for a in range(lo, hi, _CPU_BLOCK):
                b = min(a + _CPU_BLOCK, hi)
                blocks.append((self.flat_grads[group][a:b], p[a:b], flat.momentum[group][a:b],
                               flat.params[_flat.F16][a:b] if group == _flat.F16 else None,
                               self.opt._temps[numpy.dtype(dt)], dt(lr), dt(mom), dt(wd)))
        self._runs_of, self._blocks = values, blocks
        return blocks

    def __call__(self):
        opt = self.opt
        sc = opt._scaler
        scale = sc.state[_scaler.SCALE:_scaler.SCALE + 1].view(numpy.float32)[0]
        mode = sc.mode

        def load_grad(g, out):
            if mode == _scaler.NONE:
                out[...] = g
            else:
                numpy.divide(g, scale, out=out, dtype=out.dtype)
            return out

        if mode == _scaler.DYNAMIC:
            temps = opt._temps
            with numpy.errstate(invalid='ignore', over='ignore', divide='ignore'):
                for g in self.flat_grads:
                    t = temps[numpy.dtype(_flat.STATE_DTYPES[_flat.DTYPES.index(g.dtype)])][0]
                    for a in range(0, g.size, _CPU_BLOCK):
                        b = min(a + _CPU_BLOCK, g.size)
                        if not numpy.isfinite(load_grad(g[a:b], t[:b - a])).all():
                            sc.finish_step_host(True)
                            return
            if not all(numpy.isfinite(g).all() for g in self.untrained):
                sc.finish_step_host(True)
                return
        nesterov = opt.nesterov
        write = mode != _scaler.NONE        # float32 and float64 quotients, as Chainer's
        for g, p, v, p16, (t1, t2, t3), lr, mom, wd in self._runs():
            n = g.size
            gb, tb, ub = load_grad(g, t1[:n]), t2[:n], t3[:n]
            if write and p16 is None:
                g[...] = gb
            if p16 is not None:
                stale = p16.view(numpy.uint16) != p.astype(numpy.float16).view(numpy.uint16)
                if stale.any():
                    p[stale] = p16[stale]
            if wd != 0:
                numpy.multiply(p, wd, out=tb)
                gb += tb
            v *= mom
            numpy.multiply(gb, lr, out=tb)
            v -= tb
            if nesterov:
                numpy.multiply(v, mom, out=ub)
                ub -= tb
                p += ub
            else:
                p += v
            if p16 is not None:
                p16[...] = p
        if mode == _scaler.DYNAMIC:
            sc.finish_step_host(False)


def _cpu_blocks(opt, flat):
    """The CPU path's blocks of ``flat``, built once per FlatParams: [(entry index, (start, stop
    inside the parameter, its master/parameter slice, momentum slice, float16 slice or None,
    temporaries))]."""
    cached = getattr(flat, '_cpu_blocks', None)
    if cached is not None:
        return cached
    if opt._temps is None:
        opt._temps = {dt: [numpy.empty(_CPU_BLOCK, dt) for _ in range(3)]
                      for dt in (numpy.dtype(numpy.float32), numpy.dtype(numpy.float64))}
    blocks = []
    for i, e in enumerate(flat.entries):
        adt = _flat.STATE_DTYPES[e.group]
        p = flat.master if e.group == _flat.F16 else flat.params[e.group]
        for a in range(0, e.size, _CPU_BLOCK):
            b = min(a + _CPU_BLOCK, e.size)
            lo, hi = e.offset + a, e.offset + b
            p16 = flat.params[_flat.F16][lo:hi] if e.group == _flat.F16 else None
            blocks.append((i, (a, b, p[lo:hi], flat.momentum[e.group][lo:hi], p16,
                               opt._temps[adt])))
    flat._cpu_blocks = blocks
    return blocks


def _misaligned(flat, addresses):
    names = ['{} (address {:#x}, {})'.format(e.name, a, e.view.dtype)
             for e, a, m in zip(flat.entries, addresses, flat.align_masks) if a & m]
    return ('the gradient of parameter(s) {} is not aligned to its element size, which a GPU '
            'cannot load (a view at an odd byte offset; Chainer\'s backward allocates aligned '
            'gradients): give the parameter a copy, param.grad = param.grad.copy()'
            .format(', '.join(names)))


def _has_none(items):
    for x in items:
        if x is None:
            return True
    return False
