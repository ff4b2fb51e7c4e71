"""``TrainStep``: a whole training step (forward, backward, the batched update) traced once and
replayed, without Chainer's per-node Python machinery.

    from chainer_tc.static_graph import TrainStep
    step = TrainStep(model, optimizer, lossfun)      # lossfun(*batch) -> loss; default: model
    for x, t in batches:
        loss = step(x, t)                            # a Variable holding this step's loss

The first calls for a given input signature run eagerly (``warmup``, then two recorded steps);
from then on the step is replayed: on the CPU by :class:`~chainer_tc.static_graph._program.Program`
(the recorded array computations, same bits as eager), on a GPU as one CUDA graph launch
(:mod:`chainer_tc.static_graph._capture`). See docs/static_graph.md for the rules a step must
follow to be replayable; a step that breaks them runs eagerly, with one warning saying why.
"""
import collections
import contextlib
import os
import sys
import warnings

import numpy

import chainer
from chainer import configuration
from chainer import reporter as reporter_module
from chainer import variable

from chainer_tc.optimizers import _flat
from chainer_tc.optimizers import _scaler
from chainer_tc.optimizers import _structure
from chainer_tc.optimizers import momentum_sgd
from chainer_tc.static_graph import _compare
from chainer_tc.static_graph import _program
from chainer_tc.static_graph import _trace


class _Entry:
    """Everything kept for one input signature."""

    def __init__(self, inputs):
        self.buffers = tuple(_empty_like(a) for a in inputs)
        self.calls = 0
        self.first = None          # the first recorded trace
        self.replay = None         # a Program (CPU) or a captured graph (GPU)
        self.failed = None         # why this signature runs eagerly
        self.visible = ()          # (link dict, name, [array]): what the replay leaves there
        self.since_check = 0       # calls served since the replay was built or last checked

    def load(self, inputs):
        for buf, a in zip(self.buffers, inputs):
            _copy_into(buf, a)

    def forget(self):
        """Drop the recorded step and the replay: the next calls record the step again."""
        self.first = self.replay = None
        self.visible = ()
        self.since_check = 0


class TrainStep:
    """One training iteration of ``model`` with ``optimizer``, replayed after it was traced.

    Args:
        model (chainer.Link): the model; it must be ``optimizer.target``, a link under it or
            a link holding it (refused otherwise).
        optimizer (chainer_tc.optimizers.MomentumSGD): set up on the model. Its loss scaling
            (static or dynamic), lr schedules, per-parameter settings and frozen links work
            under replay; its hooks run eagerly after the replayed forward and backward.
        lossfun (callable): ``lossfun(*inputs) -> loss Variable``; default ``model``.
        warmup (int): eager iterations per input signature before tracing (cuDNN autotune, the
            memory pool and lazy initialisation settle there).
        max_signatures (int): input signatures (shapes, dtypes, train mode, ...) kept traced
            at once; a last partial batch is a second signature.
        capture (bool): on a GPU, capture the step into a CUDA graph (default True).
        reduce_gradients (callable): ``reduce_gradients(buffers)`` runs between backward and the
            update on the gradients laid out in flat buffers (one per parameter dtype, laid out
            like the optimizer's parameters), in place: e.g. their mean over the ranks of a
            multi-node run (:mod:`chainer_tc.multinode`). Under replay and capture too.
        check_every (int or None): every ``check_every``-th step of a replayed signature runs
            eagerly instead, recorded, and is compared with the trace: a value or a branch that
            changed since the trace (a link attribute set by a schedule, a reported Python
            value, a branch first taken) is seen there; the step then warns (the first time),
            naming the function and the value, traces again and checks its other signatures
            at their next call. Replays between two checks use the traced values. ``None`` or
            0: never check (a value first changing after the trace then stays frozen,
            silently).

    Attributes:
        traces (int): replays built so far (a new input signature builds one).
        replays (int): steps run by replay.
        eager_steps (int): steps run eagerly (warm-up, recording and checks included).
        checks (int): steps run as checks of a replay (``check_every``).
    """

    def __init__(self, model, optimizer, lossfun=None, warmup=1, max_signatures=4,
                 capture=True, reduce_gradients=None, check_every=100):
        if hasattr(optimizer, 'actual_optimizer') and isinstance(
                optimizer.actual_optimizer, momentum_sgd.MomentumSGD):
            raise TypeError('TrainStep was given ChainerMN\'s multi-node optimizer: pass '
                            'chainer_tc\'s MomentumSGD itself (optimizer.actual_optimizer); '
                            'chainer_tc.multinode.TrainStep and TrainStepUpdater average the '
                            'gradients themselves, with one collective per step')
        if not isinstance(optimizer, momentum_sgd.MomentumSGD):
            raise TypeError('TrainStep replays chainer_tc.optimizers.MomentumSGD (whose '
                            'hyperparameters and loss scale live in device memory); got {}.{}. '
                            'Use it, or run eager steps (optimizer.update(lossfun, ...); in a '
                            'Trainer, chainer.training.updaters.StandardUpdater)'
                            .format(type(optimizer).__module__, type(optimizer).__name__))
        if optimizer.target is None:
            raise RuntimeError('optimizer is not set up: call optimizer.setup(model) first')
        if not isinstance(model, chainer.Link):
            raise TypeError('model must be a chainer.Link; got {}'.format(type(model).__name__))
        _check_model(model, optimizer.target, 'got')
        if lossfun is not None and not callable(lossfun):
            raise TypeError('lossfun must be callable(*inputs) -> loss; got {!r}'
                            .format(lossfun))
        if reduce_gradients is not None and not callable(reduce_gradients):
            raise TypeError('reduce_gradients must be callable(buffers); got {!r}'
                            .format(reduce_gradients))
        if int(warmup) < 0 or int(max_signatures) < 1:
            raise ValueError('warmup must be >= 0 and max_signatures >= 1; got {} and {}'
                             .format(warmup, max_signatures))
        if check_every is not None and int(check_every) < 0:
            raise ValueError('check_every must be None (never check) or an int >= 0; got {!r}'
                             .format(check_every))
        self.model = model
        self.optimizer = optimizer
        self._target = optimizer.target      # (the one model was checked against)
        self.lossfun = lossfun if lossfun is not None else model
        self.warmup = int(warmup)
        self.max_signatures = int(max_signatures)
        self.capture = bool(capture)
        self.reduce_gradients = reduce_gradients
        self.check_every = int(check_every or 0)
        self._eager_grads = None      # (flat, buffers, views) for eager steps with a reduction
        self.traces = 0
        self.replays = 0
        self.eager_steps = 0
        self.checks = 0
        self._entries = collections.OrderedDict()
        self._flat = None
        self._persistent_arrays = None   # _persistents() when the traces in use were built
        self._untrained = ()             # _others() then
        self._evicted = set()            # signatures dropped to keep max_signatures
        self._structure = None           # the model's links and parameters when last traced
        self._warned = set()

    def __getstate__(self):
        """Pickles and deep-copies without its traces (arrays of recorded steps, compiled
        replays, CUDA graphs): the copy traces its steps again, after ``warmup`` eager ones."""
        state = dict(self.__dict__)
        state.update(_entries=collections.OrderedDict(), _flat=None, _eager_grads=None,
                     _persistent_arrays=None, _untrained=(), _structure=None)
        return state

    @property
    def replayed_ops(self):
        """FunctionNode computations one replay of the most recently used signature runs (the
        forward and backward functions the step applied), or None before it has a replay."""
        for entry in reversed(list(self._entries.values())):
            program = getattr(entry.replay, 'program', None)
            if program is not None:
                return len(program.trace.ops)
        return None

    # ---- the step ---------------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        names = tuple(sorted(kwargs))
        inputs = tuple(self._as_array(a, i) for i, a in enumerate(args + tuple(kwargs[k]
                                                                               for k in names)))
        self._names = len(args), names
        if self.optimizer.target is not self._target:      # optimizer.setup(another model)
            _check_model(self.model, self.optimizer.target, 'the step was made for')
            self._target = self.optimizer.target
        flat = self.optimizer._flat
        # replays see the model only through their traces: a parameter given a new array or
        # update rule, or a link added, deleted, replaced or moved, is found here (identity
        # tests; the optimizer's own walk of the model only when its structure changed)
        why = None if flat is None else flat.stale()
        if why is None and self._structure is not None and not self._structure.same():
            why = (None if flat is None else flat.changed(self.optimizer.target)) or (
                "the model's links were replaced, moved or reordered")
            self._structure = None
        if why is not None:
            flat = None                   # the next update rebuilds the buffers if needed
        if flat is not self._flat:
            self._drop_traces(why or 'the optimizer rebuilt its parameter buffers (after '
                                     'optimizer.setup(), or a change it found in an update)')
            self._flat = flat
        if self._persistent_arrays is not None and any(
                d.get(name) is not a for d, name, a in self._persistent_arrays):
            self._warn('persistent', "a persistent array of the model (e.g. BatchNorm's "
                                     'avg_mean) was replaced: every trace is dropped and the '
                                     'step is traced again (update such arrays in place, '
                                     'a[...] = value, to keep the traces)')
            self._forget_traces()
        replaced = [n for n, p, a in self._untrained if p.raw_array is not a]
        if replaced:
            self._warn('untrained', 'the array of {} (a parameter the optimizer does not '
                                    'train, which replays read as a constant) was replaced: '
                                    'every trace is dropped and the step is traced again '
                                    '(write into it in place, W.array[...] = value, to keep '
                                    'the traces)'.format(', '.join(replaced)))
            self._forget_traces()
        key = self._key(inputs)
        entry = self._entries.get(key)
        if entry is None:
            if key in self._evicted:
                self._warn('evicted', 'TrainStep: a signature traced before ({}) comes back '
                                      'after it was dropped to keep max_signatures={}: it is '
                                      'traced again, and steps that cycle through more '
                                      'signatures than that never replay; raise '
                                      'max_signatures'.format(describe_signature(key),
                                                              self.max_signatures))
            elif self._entries:
                what, change = signature_change(list(self._entries), key)
                kinds = {'signature:' + w for w in what}     # said once per kind of change
                if not kinds <= self._warned:
                    self._warned |= kinds
                    warnings.warn('TrainStep: {}: the step is traced again for it (each '
                                  'signature is traced once; a last partial batch is one more)'
                                  .format(change), RuntimeWarning, stacklevel=_caller_level())
            entry = self._entries[key] = _Entry(inputs)
            while len(self._entries) > self.max_signatures:
                self._evicted.add(self._entries.popitem(last=False)[0])
        else:
            self._entries.move_to_end(key)
        entry.calls += 1
        mode = self._agreed(key, entry, self._mode(entry, flat))
        with self._chainer_cudnn_routed(inputs):
            if mode == 'replay':
                return self._replay(entry, inputs)
            if mode == 'check':
                loss = self._check(entry, inputs)
            elif mode == 'eager':
                loss = self._eager(inputs)
            else:
                loss = self._record(entry, inputs)
        # the buffers this step updated (a first update builds them): only a rebuild after
        # this drops the traces, not the first build
        self._flat = self.optimizer._flat
        return loss

    def _mode(self, entry, flat):
        """How this call of ``entry``'s signature runs: 'replay', 'check' (a recorded eager
        step compared with the replay, every ``check_every``-th), 'eager' (warm-up, or a step
        that cannot be replayed), 'record' (the first recorded step) or 'build' (the second,
        which builds the replay: on a GPU it is captured)."""
        if entry.replay is not None:
            entry.since_check += 1
            if not self.check_every or entry.since_check < self.check_every:
                return 'replay'
            return 'check'
        if entry.failed is not None or entry.calls <= self.warmup or flat is None:
            # (the optimizer's buffers are built by a first update, which moves the
            # parameters: a recorded step starts with them in place)
            return 'eager'
        return 'record' if entry.first is None else 'build'

    def _agreed(self, key, entry, mode):
        """The mode this step runs in (see :meth:`_mode`): here the one decided. A multi-node
        step (:class:`chainer_tc.multinode.TrainStep`) makes every rank run the same one."""
        return mode

    def _shared_failure(self, failure):
        """Why a build or check of the current step failed (a string), or None, made the same
        on every process that steps together: here the one given. A multi-node step
        (:class:`chainer_tc.multinode.TrainStep`) gives every rank the failures of all, so
        that no rank replays a step another runs eagerly."""
        return failure

    def _exchanges_answered(self, trace):
        """The context of a capture or a CPU replay of the step that ``trace`` recorded (the
        last recorded step of its signature): here none. A multi-node step answers the host
        exchanges of its functions there from those ``trace`` made, without communicating."""
        return contextlib.nullcontext()

    def _fail(self, entry, why, done):
        """The signature of ``entry`` runs eagerly from now on, because of ``why``; said once
        (``done``: 'replayed' or 'captured', what it cannot be)."""
        entry.failed = why
        entry.replay = None
        entry.visible = ()
        self._warn('failed:' + why, 'TrainStep: this step cannot be {}, it runs eagerly: {}'
                                    .format(done, why))

    def _drop_traces(self, why):
        """Forget every trace, saying why once (when there was one)."""
        if any(e.first is not None or e.replay is not None for e in self._entries.values()):
            self._warn('model', 'TrainStep: {}: every trace is dropped and the step is traced '
                                'again'.format(why))
        self._forget_traces()

    def _forget_traces(self):
        """Every trace dropped, and what the model held when they were built (no trace is left
        to compare it with: one change, a move to another device that gives parameters and
        persistent arrays new arrays, is said once, not once for each kind of array)."""
        self._entries.clear()
        self._persistent_arrays, self._untrained = None, ()

    def _chainer_cudnn_routed(self, inputs):
        """On a GPU with capture, Chainer's own cuDNN calls go through chainer_tc's binding in
        every step of this TrainStep (eager ones too: their plans serve the capture)."""
        if not (self.capture and _is_cupy(inputs)):
            return contextlib.nullcontext()
        from chainer_tc.static_graph import _chainer_cudnn
        return _chainer_cudnn.routed()

    def _key(self, inputs):
        opt = self.optimizer
        sc = opt._scaler
        config = configuration.config
        return (tuple((a.shape, a.dtype.str, type(a).__module__) for a in inputs), self._names,
                bool(config.train), bool(config.enable_backprop),
                (sc.mode, sc.interval, sc.min_scale, sc.max_scale), opt.nesterov,
                opt._has_hooks('pre') or opt._has_hooks('post'),
                # reports are recorded only where a reporter is current (chainer.report does
                # nothing without one): a step traced outside one would replay none inside one
                bool(reporter_module._get_reporters()))

    def _call_lossfun(self, inputs):
        n, names = self._names
        return self.lossfun(*inputs[:n], **dict(zip(names, inputs[n:])))

    def _eager(self, inputs):
        """``optimizer.update(lossfun, *inputs)`` (with the gradient reduction, if any),
        keeping the loss."""
        self.eager_steps += 1
        opt = self.optimizer
        if self.reduce_gradients is None:
            holder = []

            def lossfun():
                loss = self._call_lossfun(inputs)
                holder.append(loss)
                return loss
            opt.update(lossfun)
            return _detached(holder[0])
        loss = self._call_lossfun(inputs)
        opt.target.cleargrads()
        opt.scaled_backward(loss)
        result = _detached(loss)
        del loss
        with variable._AllowArrayAccessWithNonstandardLayout():
            grads = opt._try_build(required=True, walk=True).grads()
        self._update(grads)
        return result

    def _update(self, grads):
        """The update of an eager or recorded step from this step's ``grads`` (per optimizer
        entry): ``optimizer.update()``, or with a gradient reduction: the gradients copied into
        flat buffers, reduced, and the update read from there."""
        opt = self.optimizer
        if self.reduce_gradients is None:
            opt.update()
            return
        flat = opt._flat
        if self._eager_grads is None or self._eager_grads[0] is not flat:
            self._eager_grads = (flat,) + tuple(flat.grad_buffers())
        _, buffers, views = self._eager_grads
        for view, g in zip(views, grads):     # a copy per parameter: eager steps only
            if g is None:
                view[...] = 0
            else:
                view[...] = g
        self.reduce_gradients(buffers)
        # each parameter's grad is its reduced gradient, as after a replay (and as ChainerMN
        # leaves it after its allreduce, which writes into the gradients: a shared one stays so)
        held = _program.shared_once(views, grads)
        _program.give_grads(list(zip((e.param for e in flat.entries), held)) +
                            _program.reduce_untrained(self, flat.untrained_grads()))
        _apply_update(opt, flat, buffers, views, held)

    def _record(self, entry, inputs):
        """An eager step, recorded: the first of a signature on a copy of the batch of its
        own, the second on the signature's input buffers (which the replay reads); the second
        builds the replay."""
        if entry.first is None:
            entry.first, result = self._recorded(inputs)
            self._update(entry.first.grads)
            return result
        unmarked = _unmarked(self.optimizer, entry.first)
        failure = self._shared_failure(None if not unmarked else (
            'the gradients of {} were not computed by the loss-scaled backward (their '
            'parameters\' _loss_scale is not the optimizer\'s, e.g. under F.forget, whose '
            'inner backward Chainer runs unscaled): an eager update leaves them scaled, a '
            'replay would unscale them'.format(', '.join(unmarked))))
        if failure is not None:
            self._fail(entry, failure, 'replayed')
            entry.first = None
            return self._eager(inputs)
        entry.load(inputs)
        if self.capture and _is_cupy(entry.buffers):
            return self._capture(entry, inputs)
        trace, result = self._recorded(inputs, entry.buffers, entry.first)
        grads = list(trace.grads)         # as computed (the build moves them into its views)
        try:
            replay, failure = self._build(entry, trace), None
        except _program.NotReplayable as e:
            replay, failure = None, str(e)
        failure = self._shared_failure(failure)
        if failure is None:
            entry.replay = replay
            self.traces += 1
            self._traced()
            # this step's reports hold the arrays the replays overwrite: copies for them
            _trace.detach_reports(trace.reports, trace.outer)
        else:
            self._fail(entry, failure, 'replayed')
        trace.outer = None
        entry.first = None
        self._update(grads)
        return result

    def _recorded(self, inputs, buffers=None, previous=None):
        """A recorded eager step without its update: (trace, loss). It reads ``buffers``, or
        when None copies of the batch of its own: a graph the model carries from it into the
        next step (which refuses the replay) then keeps this step's inputs. The constants the
        ``previous`` recorded step read are watched for writes made in this step."""
        opt = self.optimizer
        given = buffers
        if buffers is None:
            buffers = tuple(_empty_like(a) for a in inputs)
            for buf, a in zip(buffers, inputs):
                _copy_into(buf, a)
        self.eager_steps += 1
        watched = self._watched(buffers)
        before = [a.copy() for _, a in watched]
        state = self._named_persistents()
        state_before = [a.copy() for _, a in state]
        numbers = self._persistent_numbers()
        watch = () if previous is None else previous.constants.values()
        with _trace.Recorder(self._externals(buffers), watch,
                             [(n, a, b) for (n, a), b in zip(state, state_before)]) as rec:
            loss = self._call_lossfun(buffers)
            rec.forward_done()
            opt.target.cleargrads()
            rec.trace.leftover_grads = _trace.leftover_grads(loss)    # (for the messages)
            opt.scaled_backward(loss)
            trace = rec.trace
            # a persistent array changed by no function it was handed to as an attribute
            # (BatchNormalization's running statistics are): written in Python, which a
            # replay would not do again (unless the recorder found it stale when handed)
            handed = {id(x) for op in trace.ops for v in op.pre.values()
                      for x in (v if isinstance(v, (tuple, list)) else (v,))}
            found = rec.finish(
                [(('watched', name), a, b) for (name, a), b in zip(watched, before)] +
                [(('unhanded', id(a), name), a, b) for (name, a), b in zip(state, state_before)
                 if id(a) not in handed])
        if buffers is given:        # (the step that may build the replay: detach_reports)
            trace.outer = rec.outer
        # a persistent number (a counter registered with add_persistent) changed in the step:
        # in Python, which a replay does not run
        trace.written += ['{} (a number: {!r} when the step began, {!r} after it)'.format(
            name, v, d[key]) for name, d, key, v in numbers if not _same_number(d[key], v)]
        # (after what the recorder found: constants written in the step)
        trace.written[:0] = [tag[1] for tag in found if tag[0] == 'watched']
        trace.written += [tag[2] for tag in found
                          if tag[0] == 'unhanded' and tag[1] not in rec.stale]
        trace.externals = self._externals(buffers)
        with variable._AllowArrayAccessWithNonstandardLayout():
            flat = opt._try_build(required=True)
            # as the backward left them: a replay copies a strided one (the gradient of a
            # parameter used through F.transpose, a broadcast) into its flat view
            trace.grads = flat.grads(contiguous=False)
        trace.marks = [e.param._loss_scale for e in flat.entries]
        trace.untrained_grads = flat.untrained_grads()
        trace.loss = loss.array
        trace.inputs = buffers
        # a copy: this trace may become the replayed one, whose arrays replays refresh
        return trace, chainer.Variable(loss.array.copy(), requires_grad=False)

    def _check(self, entry, inputs):
        """A recorded eager step in place of a replay, compared with the replayed trace as the
        two recorded steps were: what changed since (a link attribute, a reported Python value,
        a branch) shows here. On a difference the replay is dropped, with a warning, and this
        step is the first recorded step of a new trace."""
        replayed = entry.since_check - 1
        entry.since_check = 0
        self.checks += 1
        traced = entry.replay.program.trace
        trace, result = self._recorded(inputs, None, traced)
        try:
            _compare.check_same_step(traced, trace, traced.externals, trace.externals)
            change = None
        except _program.NotReplayable as e:
            change = str(e)
        change = self._shared_failure(change)
        if change is not None:
            self._warn('changed', 'TrainStep: the step changed after it was traced ({}); the '
                                  '{} replays of this input signature since it was last '
                                  'checked ran the step as traced. It is traced again, and '
                                  'every other traced signature is checked at its next call '
                                  '(check_every={} bounds how long a change goes unseen; this '
                                  'warning is given once)'.format(change, replayed,
                                                                  self.check_every))
            for other in self._entries.values():
                if other is not entry and other.replay is not None:
                    other.since_check = self.check_every - 1
            entry.replay = None
            entry.visible = ()
            entry.first = trace
        self._update(trace.grads)
        return result

    def _externals(self, inputs):
        """Arrays a replay may read without recomputing them, refreshed in place elsewhere: the
        step's ``inputs``, the loss-scale state, the parameters and the persistent arrays, in
        an order that does not change (a recorded step keeps them, and two recorded steps are
        compared array by array)."""
        opt = self.optimizer
        out = list(inputs)
        out.append(opt._scaler.state)
        out.extend(p.array for p in opt.target.params())
        out.extend(a for _, _, a in self._persistents())
        return [a for a in out if isinstance(a, _trace.array_types())]

    def _as_array(self, a, i):
        """Input ``i``'s array. A step runs from copies of its inputs' arrays, so no gradient
        reaches an input Variable: one computed by functions (a graph a model made before the
        step, which the step would not train) is refused; one made with ``requires_grad``
        (Chainer's default) gets no ``grad``, said once."""
        if isinstance(a, chainer.Variable):
            if a.creator_node is not None:
                raise TypeError(
                    'TrainStep input {} is a Variable computed by {}: the step runs from a '
                    "copy of its array, so that graph would get no gradient and what made it "
                    'would not be trained. Compute it inside the loss function (TrainStep('
                    'model, optimizer, lossfun) with lossfun applying it), or pass its .array '
                    'if it is not to be trained'.format(i, type(a.creator_node).__name__))
            if a.requires_grad:
                self._warn('input_grad', 'TrainStep: input {} is a Variable that requires a '
                                         'gradient; the step runs from a copy of its array and '
                                         'leaves its .grad as it is (pass the array, or a '
                                         'Variable made with requires_grad=False, to silence '
                                         'this)'.format(i))
            a = a.array
        if not isinstance(a, _trace.array_types()):
            raise TypeError('TrainStep inputs must be arrays (NumPy or CuPy) or Variables; input '
                            '{} is {}'.format(i, type(a).__name__))
        return a

    def _watched(self, buffers):
        """(name, array) of what no recorded function may write into but a loss function
        could, in Python: the step's inputs and the parameters (a recorded step compares them
        before and after; on a GPU each is a device copy and a comparison, at recorded steps
        and checks only)."""
        out = [('input {}'.format(k), b) for k, b in enumerate(buffers)]
        seen = set()
        for root in self._roots():
            for name, p in root.namedparams(include_uninit=False):
                if id(p) not in seen and isinstance(p.array, _trace.array_types()):
                    seen.add(id(p))
                    out.append(('parameter ' + name.lstrip('/'), p.array))
        return out

    def _roots(self):
        """The model, and the optimizer's target where it is another link."""
        target = self.optimizer.target
        return (self.model,) if target is self.model else (self.model, target)

    def _links(self):
        """The model's links and the optimizer target's, each once."""
        seen = {}
        for link in list(self.model.links()) + list(self.optimizer.target.links()):
            seen.setdefault(id(link), link)
        return seen.values()

    def _visible_variables(self, trace):
        """(link dict, name, [array]) for each Variable the step leaves in a link attribute,
        where a user reads it after a step (``L.Classifier``'s ``loss``, ``accuracy``, ``y``):
        those holding a result of the recorded step's functions (not parameters, nor the
        user's own Variables, which the user may replace). The one-element list holds the
        Variable's array, which a replay rebinds (:meth:`_program.Program.follow`): the
        recorded Variable itself stays as it was (the recorded step may have reported it)."""
        results = {id(y) for op in trace.ops for y in op.outputs or () if y is not None}
        return tuple((d, name, [v.raw_array]) for d in (vars(link) for link in self._links())
                     for name, v in d.items()
                     if isinstance(v, chainer.Variable) and not isinstance(v, chainer.Parameter)
                     and id(v.raw_array) in results)

    def _traced(self):
        """What a new trace read of the model, to notice when the user changes it."""
        self._persistent_arrays, self._untrained = self._persistents(), self._others()
        self._structure = _structure.Structure(self.model, self.optimizer.target)

    def _persistents(self):
        """(link's dict, name, array) of every persistent array: a replay updates these
        arrays in place, so one replaced by the user invalidates the traces."""
        return tuple((link.__dict__, name, link.__dict__[name]) for link in self._links()
                     for name in link._persistent
                     if isinstance(link.__dict__[name], _trace.array_types()))

    def _persistent_values(self):
        """('persistent <path>', link's dict, name) of every persistent of the model and the
        optimizer's target, each link once."""
        seen = set()
        for root in self._roots():
            for path, link in root.namedlinks():
                if id(link) in seen:
                    continue
                seen.add(id(link))
                for name in link._persistent:
                    yield ('persistent ' + '{}/{}'.format(path, name).lstrip('/')
                           .replace('//', '/'), link.__dict__, name)

    def _named_persistents(self):
        """('persistent <path>', array) of every persistent array, each array once."""
        out, seen = [], set()
        for label, d, name in self._persistent_values():
            a = d[name]
            if isinstance(a, _trace.array_types()) and id(a) not in seen:
                seen.add(id(a))
                out.append((label, a))
        return out

    def _persistent_numbers(self):
        """('persistent <path>', link's dict, name, value) of every persistent that is a
        number (not an array)."""
        return [(label, d, name, d[name]) for label, d, name in self._persistent_values()
                if not isinstance(d[name], _trace.array_types())]

    def _others(self):
        """(name, param, array) of each parameter of the model that the optimizer does not
        train (a frozen backbone left out of ``optimizer.setup``): a replay reads its array as
        a constant, so one replaced by the user invalidates the traces. Usually none."""
        flat = self.optimizer._flat
        trained = {id(e.param) for e in flat.entries} | {id(p) for _, p in flat.waiting}
        return tuple((name.lstrip('/'), p, p.raw_array) for name, p in self.model.namedparams()
                     if id(p) not in trained)

    def _build(self, entry, trace):
        program = _program.Program(entry.first, trace, entry.first.externals, trace.externals)
        entry.visible = self._visible_variables(trace)
        program.follow(held for _, _, held in entry.visible)
        _leave_copies(entry.visible)            # this step's, which replays refresh in place
        flat = self._flat = self.optimizer._flat      # built by the recorded steps at the latest
        # the gradients move into flat buffers laid out like the parameters: the update then
        # runs over whole runs of parameters (and one buffer is one allreduce)
        buffers, views = flat.grad_buffers()
        copies = []
        moved = {}        # id of a relocated gradient -> the view it now lives in
        computed = list(trace.grads)
        for i, (g, view) in enumerate(zip(trace.grads, views)):
            if g is None:
                continue
            if id(g) in moved:        # one array for two parameters (Add's backward gives
                view[...] = moved[id(g)]                # its gradient to both): copied over
                copies.append((view, moved[id(g)]))     # after each replay
                trace.grads[i] = view
            elif g.flags.c_contiguous and program.relocate(g, view):
                moved[id(g)] = view
                trace.grads[i] = view
            else:
                program.pin(g)
                copies.append((view, g))      # moved by a copy after each replay
        # the flat update reads every view, while the parameters hold a shared gradient once
        # (the first sharer's array), as after an eager step: a hook sees it once per sharer
        held = _program.shared_once(trace.grads, computed)
        for (param, g) in zip((e.param for e in flat.entries), held):
            if g is not None:
                param.grad = g
        for _, g in trace.untrained_grads:       # (read by hooks: GradientClipping's norm)
            program.pin(g)
        # a parameter without a gradient in this step: zeros in its view, which a reduction
        # overwrites with the other ranks' mean, and so refills before each one
        zeros = [view for g, view in zip(trace.grads, views) if g is None]
        # a strided float32/64 gradient the parameter keeps (copied in above): with loss
        # scaling the update divides its flat view, and the quotient goes back into it after
        # each replay, as an eager update leaves it (a read-only one stays as it is)
        quotients = [(g, view) for g, view, e in zip(trace.grads, views, flat.entries)
                     if g is not None and g is not view and e.group != _flat.F16
                     and g.flags.writeable]
        plan = self.optimizer._plan(flat, views, flat_grads=buffers)
        return _CpuReplay(program, plan, trace, held, _program.shared_once(views, computed), copies,
                          buffers, zeros, quotients)

    def _capture(self, entry, inputs):
        from chainer_tc.static_graph import _capture
        first, entry.first = entry.first, None
        try:
            with self._exchanges_answered(first):
                captured, failure = _capture.CapturedStep(self, entry), None
        except _program.NotReplayable as e:
            captured, failure = None, str(e)
        failure = self._shared_failure(failure)
        if failure is not None:                     # nothing ran: run this step eagerly
            self._fail(entry, failure, 'captured')
            return self._eager(inputs)
        loss = captured.first_launch(self)          # this step
        try:
            captured.trace.externals = self._externals(entry.buffers)
            captured.validate(first, first.externals, captured.trace.externals)
            failure = None
        except _program.NotReplayable as e:
            failure = str(e)
        failure = self._shared_failure(failure)
        if failure is not None:                     # this step ran; later ones eager
            self._fail(entry, failure, 'replayed')
            self.eager_steps += 1
            return loss
        entry.replay = captured
        entry.visible = self._visible_variables(captured.trace)   # their arrays: the graph's
        _leave_copies(entry.visible)
        self.traces += 1
        self._traced()
        self.replays += 1
        return loss

    def _replay(self, entry, inputs):
        self.replays += 1
        entry.load(inputs)
        with self._exchanges_answered(entry.replay.program.trace):
            loss = entry.replay.run(self)
        _leave_copies(entry.visible)
        return loss

    def _warn(self, key, message):
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=_caller_level())


class _CpuReplay:
    def __init__(self, program, plan, trace, held, reduced, copies, buffers, zeros, quotients):
        self.program = program
        self.plan = plan
        self.copies = copies
        self.quotients = quotients
        self.buffers = buffers
        self.zeros = zeros
        self.untrained = list(trace.untrained_grads)
        entries = plan.flat.entries
        # what each parameter's grad is after a step (``held``: a shared gradient once)
        self.grads = [(e.param, g) for e, g in zip(entries, held)]
        self.marks = [(e.param, m) for e, m in zip(entries, trace.marks)]
        # with a reduction every parameter's gradient is its view (zeros if it has none), a
        # shared one the first sharer's (``reduced``: the views reduced equal inputs alike)
        self.reduced_grads = [(e.param, v) for e, v in zip(entries, reduced)]
        self.grads += self.untrained
        self.refill = _program.leaves_none(plan.flat, trace.grads)

    def run(self, step):
        opt = step.optimizer
        self.program.run()
        for dst, src in self.copies:
            dst[...] = src
        grads = self.grads
        if step.reduce_gradients is not None:
            for view in self.zeros:
                view[...] = 0
            step.reduce_gradients(self.buffers)
            grads = self.reduced_grads + _program.reduce_untrained(step, self.untrained)
        _program.give_grads(grads)     # hooks may read and change them, as in an eager step
        if opt._has_hooks('pre') or opt._has_hooks('post'):
            _program.give_marks(self.marks)
            opt.update()
        else:
            # the overflow check reads the untrained gradients too, as Chainer's (those just
            # given: reduced ones with a reduction); () without dynamic scaling or such
            self.plan.untrained = opt._untrained_grads(self.plan.flat, None)
            opt._step(self.plan)
            if self.quotients and step.reduce_gradients is None and \
                    opt._scaler.mode != _scaler.NONE:
                for dst, src in self.quotients:
                    dst[...] = src
            if self.refill:                 # as update(): zeros where there was no gradient
                opt.reallocate_cleared_grads()
        self.program.report()
        return chainer.Variable(self.program.loss[0].copy(), requires_grad=False)


def _unmarked(opt, trace):
    """With loss scaling, the names of the parameters whose gradient in ``trace`` does not carry
    the optimizer's scale mark: an eager update leaves such a gradient as it is, while a
    replay (and a capture) unscales every gradient."""
    if opt._scaler.mode == _scaler.NONE:
        return []
    return [e.name for e, g, m in zip(opt._flat.entries, trace.grads, trace.marks)
            if g is not None and m is not _scaler.SCALED_ON_DEVICE]


def _same_number(a, b):
    """Whether a persistent's value ``a`` is still ``b``: the same object, or of the same type
    and equal (a NaN equal to a NaN); a comparison that raises counts as a change."""
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b or (a != a and b != b))
    except Exception:
        return False


def _caller_level():
    """The ``stacklevel`` of the first frame outside chainer_tc, seen from the function that
    calls ``warnings.warn``: the user's line (or Chainer's updater's) that called the step."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(
            package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def _check_model(model, target, got):
    """``model`` must be the optimizer's ``target``, a link under it or a link holding it:
    else the step would update the target while the loss ran through another model."""
    if model is target or any(link is model for link in target.links()) or \
            any(link is target for link in model.links()):
        return
    raise ValueError(
        'model must be optimizer.target, a link under it or a link holding it; {} a {} that is '
        'none of these (an optimizer set up on a copy of the model, or optimizer.setup() called '
        'with another model since: make a TrainStep for that one): the step would update the '
        'target while the loss runs through this model'.format(got, type(model).__name__))


def _apply_update(opt, flat, buffers, views, held):
    """The update from gradients held in flat ``buffers`` (``views``: one per entry; ``held``:
    what each parameter's grad is, a shared gradient the first sharer's view): by
    ``optimizer.update()`` where it has hooks, or where a gradient lacks the loss-scale mark
    (``F.forget``'s, which it leaves scaled, as after ChainerMN's allreduce; the flat plan
    unscales every gradient)."""
    if opt._has_hooks('pre') or opt._has_hooks('post') or (
            opt._scaler.mode != _scaler.NONE and any(
                e.param._loss_scale is not _scaler.SCALED_ON_DEVICE for e in flat.entries)):
        for e, v in zip(flat.entries, held):
            e.param.grad = v
        opt.update()
        return
    opt._step(opt._plan(flat, views, flat_grads=buffers,
                        untrained=opt._untrained_grads(flat, None)))


_SIGNATURE_PARTS = ('the input shapes and dtypes', 'the keyword inputs', 'chainer.config.train',
                    'chainer.config.enable_backprop', "the optimizer's loss scaling",
                    "the optimizer's nesterov", 'whether the optimizer has hooks',
                    'whether a reporter is current')
_SCALING = {_scaler.NONE: 'off', _scaler.STATIC: 'static', _scaler.DYNAMIC: 'dynamic'}


def describe_signature(key):
    """A signature (``TrainStep._key``) in words: its input shapes and dtypes, and train mode."""
    return '{} inputs {}{}'.format(
        len(key[0]), ', '.join('{}{} {}'.format('cupy ' if m.startswith('cupy') else '',
                                                shape, numpy.dtype(dt).name)
                               for shape, dt, m in key[0]),
        '' if key[2] else ', chainer.config.train False')


def signature_change(kept, new):
    """(the parts that changed, a sentence): how signature ``new`` differs from the closest of
    the ``kept`` ones (the fewest parts changed)."""
    old = min(kept, key=lambda k: sum(a != b for a, b in zip(k, new)))
    parts = [i for i, (a, b) in enumerate(zip(old, new)) if a != b]
    said = ['a new input signature ({})'.format(describe_signature(new)) if i == 0 else
            '{} changed ({} then {})'.format(_SIGNATURE_PARTS[i], _part(i, old[i]),
                                             _part(i, new[i]))
            for i in parts]
    return tuple(_SIGNATURE_PARTS[i] for i in parts), '; '.join(said)


def _part(i, value):
    if i == 1:                        # (positional count, keyword names)
        return 'by keyword: {}'.format(', '.join(value[1])) if value[1] else 'none by keyword'
    if i == 4:                        # (mode, interval, min_scale, max_scale)
        mode = _SCALING.get(value[0], value[0])
        return mode if mode != 'dynamic' else 'dynamic, interval {}, scales {}..{}'.format(
            *value[1:])
    return value


def _is_cupy(arrays):
    return any(type(a).__module__.startswith('cupy') for a in arrays)


def _empty_like(a):
    return chainer.backend.get_array_module(a).empty_like(a)


def _copy_into(buf, a):
    if type(buf) is type(a):
        buf[...] = a
    else:
        buf.set(a)                   # NumPy batch into a CuPy buffer


def _leave_copies(visible):
    """Each (link dict, name, [array]) of ``visible``: a new Variable holding a copy of this
    step's values put there, as an eager step leaves new Variables (one the user kept from an
    earlier step, ``history.append(model.loss)``, keeps its values; the recorded arrays are
    rebound or refreshed in place by every replay, or by every launch of a CUDA graph)."""
    for d, name, held in visible:
        d[name] = chainer.Variable(held[0].copy(), requires_grad=False)


def _detached(loss):
    return chainer.Variable(loss.array, requires_grad=False)
