"""Per-parameter update rules of the batched optimizer: what Chainer code expects to find on
``param.update_rule`` (``enabled``, ``hyperparam``, ``state``, ``t``, ``serialize``,
``init_state``), while the update itself runs for all parameters at once in
``MomentumSGD.update()``.

Changes that matter to the kernel are tracked, not polled: assigning any hyperparameter (the
optimizer's, a parameter's own, or one on a Hyperparameter between them: a "parameter group")
or ``enabled`` bumps a counter in :class:`Versions`, and the optimizer rebuilds its device-side
hyperparameter table only when a counter moved. The common step, where nothing changed, costs
two integer comparisons.
"""
import numpy

import chainer
from chainer import backend
from chainer import optimizer as chainer_optimizer
from chainer import serializer as serializer_module

from chainer_tc.optimizers import _flat
from chainer_tc.optimizers import _scaler

HYPERPARAMETERS = ('lr', 'momentum', 'weight_decay')
_PRIVATE = ('_parent', '_versions', '_is_global')
_UNTRACKED = ('_versions', '_is_global')       # (bookkeeping, not hyperparameters)


class Versions:
    """Change counters shared by an optimizer, its hyperparameters and its rules. ``root`` is
    the optimizer's own Hyperparameter: an assignment on it moves ``globals`` (row 0 of the
    table), one on any other tracked Hyperparameter ``entries`` (the per-parameter rows)."""

    __slots__ = ('globals', 'entries', 'root')

    def __init__(self):
        self.globals = 0      # the optimizer's own hyperparameters
        self.entries = 0      # anything per parameter: own values, enabled, the set of rules
        self.root = None


class TrackedHyperparameter(chainer_optimizer.Hyperparameter):
    """A ``chainer.optimizer.Hyperparameter`` that reports every assignment to the
    :class:`Versions` of each optimizer that reads it (usually one)."""

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        self._changed(name)

    def __delattr__(self, name):
        object.__delattr__(self, name)
        self._changed(name)

    def _changed(self, name):
        tracked = self.__dict__.get('_versions')
        if tracked is None or name in _UNTRACKED:
            return
        for versions in (tracked if type(tracked) is list else (tracked,)):
            # (a new _parent changes what the whole chain reads: every row is rebuilt)
            if name != '_parent' and getattr(versions, 'root', None) is self:
                versions.globals += 1
            else:
                versions.entries += 1

    def get_dict(self):
        d = super().get_dict()
        for k in _PRIVATE:
            d.pop(k, None)
        return d


def track(hyperparam, versions, changed=True):
    """Make ``hyperparam`` (a Chainer Hyperparameter, possibly the user's own object) report its
    assignments to ``versions`` (besides any other optimizer's it already reports to).
    ``changed``: it was just given to a rule or to the optimizer (the table is rebuilt)."""
    if not isinstance(hyperparam, chainer_optimizer.Hyperparameter):
        raise TypeError('hyperparam must be a chainer.optimizer.Hyperparameter; got {!r}'
                        .format(type(hyperparam).__name__))
    if type(hyperparam) is chainer_optimizer.Hyperparameter:
        hyperparam.__class__ = TrackedHyperparameter       # same layout: a plain object
    elif not isinstance(hyperparam, TrackedHyperparameter):
        raise TypeError('hyperparam of type {} cannot be tracked; use '
                        'chainer.optimizer.Hyperparameter'.format(type(hyperparam).__name__))
    d = hyperparam.__dict__
    tracked = d.get('_versions')
    tracked = [] if tracked is None else tracked if type(tracked) is list else [tracked]
    if not any(v is versions for v in tracked):
        d['_versions'] = tracked + [versions]
    if changed:
        versions.globals += 1
        versions.entries += 1
    d.pop('_is_global', None)          # (an earlier version's flag: Versions.root says it now)
    return hyperparam


def track_chain(hyperparam, versions, stop=None):
    """Track every Hyperparameter from ``hyperparam`` up its parents (to ``stop``, excluded,
    or to the end): a later assignment on any of them then reaches the table. A parent that
    is not a Hyperparameter is refused, as is a cycle."""
    seen = set()
    h = hyperparam
    while h is not None and h is not stop:
        if id(h) in seen:
            raise ValueError('its hyperparam\'s parents form a cycle')
        seen.add(id(h))
        track(h, versions, changed=False)
        h = h.__dict__.get('_parent')


def resolve(hyperparam, name, root):
    """(value, own): ``name`` as Chainer would read it from ``hyperparam``; ``own`` is False when
    it comes from ``root`` (the optimizer's hyperparameters), which the kernel reads itself."""
    h = hyperparam
    while h is not None:
        if h is root:
            return None, False
        d = h.__dict__
        if name in d:
            return _scaler.number('hyperparam.' + name, d[name]), True
        h = d.get('_parent')
    raise AttributeError(
        'its update_rule.hyperparam has no {!r}: not set on it nor on its parents, and its '
        "parents do not lead to the optimizer's hyperparam (chainer_tc's MomentumSGD reads lr, "
        'momentum and weight_decay for every parameter); set it there (weight_decay = 0.0 for '
        'none), or give the Hyperparameter a parent chain that ends at optimizer.hyperparam'
        .format(name))


def resolve_root(root, name):
    """``name`` as Chainer reads it from the optimizer's ``root`` Hyperparameter (on it, or on
    its parents), or an AttributeError that says which hyperparameter is missing."""
    h = root
    seen = set()
    while h is not None and id(h) not in seen:
        seen.add(id(h))
        d = getattr(h, '__dict__', {})
        if name in d:
            return _scaler.number("the optimizer's " + name, d[name])
        h = d.get('_parent')
    raise AttributeError(
        "the optimizer's hyperparam has no {!r} (not set on it nor on its parents): "
        "chainer_tc's MomentumSGD reads lr, momentum and weight_decay from it; a "
        'Hyperparameter that replaces optimizer.hyperparam must set all three '
        '(weight_decay = 0.0 for none)'.format(name))


class Clock:
    """The optimizer's step count ``t``, and the steps that were applied (not skipped for an
    overflow), from which each rule's own ``t`` follows without a per-step loop.

    ``steps`` counts the updates this clock saw, apart from the public ``t`` (which users
    and snapshots assign: Chainer's rules keep their own count when they do). A ``setup()``
    freezes the clock of the rules it replaces, as Chainer's old rules stop counting."""

    steps = None                 # (a clock pickled before it had its own count: t's)
    _frozen = None

    def __init__(self, scaler):
        self.t = 0
        self.steps = 0
        self.scaler = scaler
        self._cached = (None, 0)
        # added to the scaler's skipped count: the skips it lost to a reconfigure, less those
        # it had counted before this clock's first step
        self._skipped_before = 0

    def step(self):
        """Before an update: t and the clock's own count move on. At the clock's first step,
        the skips the scaler counted before it (a snapshot's, loaded after this clock began:
        a resumed run) are left out of the count from then on."""
        if self.steps == 0:               # (none of the skips so far are this clock's)
            self._skipped_before = -self.scaler.skipped
            self._cached = (None, 0)
        self.t += 1
        self.steps = (self.t - 1 if self.steps is None else self.steps) + 1

    def applied(self):
        """Steps applied so far (reads the skipped count from the device when a step ran)."""
        if self._frozen is not None:
            return self._frozen
        steps = self.t if self.steps is None else self.steps
        if steps == 0:
            return 0
        if self._cached[0] != steps:
            self._cached = (steps, steps - self._skipped_before - self.scaler.skipped)
        return self._cached[1]

    def freeze(self):
        """No more steps for this clock's rules (their optimizer was set up anew)."""
        self._frozen = self.applied()

    def reconfiguring(self):
        """Before the scaler starts its skipped count again (``loss_scaling()``)."""
        self._skipped_before += self.scaler.skipped
        self.forget()

    def forget(self):
        self._cached = (None, 0)


class Rule(chainer_optimizer.UpdateRule):
    """``param.update_rule`` under chainer_tc's batched MomentumSGD.

    ``enabled`` (``Link.disable_update()``), ``hyperparam.lr/momentum/weight_decay`` and
    ``state['v']`` (and ``state['master']`` for float16 parameters) behave as with Chainer's
    ``MomentumSGDRule``; ``state`` arrays are views of the optimizer's flat buffers, and
    ``init_state(param)`` zeroes the momentum. ``t`` counts the steps applied while the rule was
    enabled and its parameter's (Chainer does not call a rule that is disabled, or no longer
    on a parameter of the target). The update itself is the optimizer's: ``param.update()``
    alone is refused, and so are hooks on a single rule.
    """

    is_elementwise = True
    _decay_pending = None     # the parameter's name while its decay_filter waits for its array
    _attached = True          # the parameter is the optimizer's (see MomentumSGD._try_build)

    def __init__(self, parent_hyperparam, clock, versions):
        self._clock = clock
        self._versions = versions
        self._enabled = True
        self._attached = True
        self._t_base = 0
        self._t_frozen = 0
        super().__init__(parent_hyperparam)

    @property
    def hyperparam(self):
        return self._hyperparam

    @hyperparam.setter
    def hyperparam(self, value):
        self._hyperparam = track(value, self._versions)

    @property
    def enabled(self):
        return self._enabled

    @enabled.setter
    def enabled(self, value):
        value = bool(value)
        if value == self._enabled:
            return
        t = self.t
        self._enabled = value
        self.t = t
        self._versions.entries += 1

    def _attach(self, attached):
        """Whether the optimizer updates this rule's parameter (it is on a parameter of the
        target): while it does not (``update_rule = None``, the link deleted), ``t`` stops, as
        Chainer's, which is not called then. Set when the buffers are built."""
        if attached == self._attached:
            return
        t = self.t
        self._attached = attached
        self.t = t

    @property
    def t(self):
        if self._enabled and self._attached:
            return self._t_base + self._clock.applied()
        return self._t_frozen

    @t.setter
    def t(self, value):
        if self._enabled and self._attached:
            self._t_base = int(value) - self._clock.applied()
        else:
            self._t_frozen = int(value)

    def init_state(self, param):
        """As Chainer's ``MomentumSGDRule.init_state``: the momentum starts again from zeros
        (how Chainer users reset it). Zeroed in place in the flat buffer, so the next update
        reads zeros; a float16 parameter's master weights stay (they hold its value)."""
        state = self._state
        if state is None:
            return                       # no momentum yet: it starts from zeros
        v = state.get('v')
        if v is None:
            return
        shape = getattr(param, 'shape', None) if getattr(param, 'array', None) is not None \
            else None
        if shape is not None and tuple(shape) != tuple(v.shape):
            raise ValueError('init_state: the parameter given has shape {}; this rule\'s '
                             'momentum has shape {}'.format(tuple(shape), tuple(v.shape)))
        if not isinstance(state, _flat.FlatState):
            # (not in the flat buffers yet, e.g. loaded before the first update: a new array,
            # as Chainer's; the buffers adopt it when they are built)
            device = backend.get_device_from_array(v)
            with chainer.using_device(device):
                state['v'] = device.xp.zeros_like(v)
        elif isinstance(v, numpy.ndarray):
            v[...] = 0
        else:
            with v.device:
                v.fill(0)

    def update(self, param):
        raise RuntimeError(
            'chainer_tc.optimizers.MomentumSGD updates all parameters together, in one kernel, '
            'in optimizer.update(); param.update() / update_rule.update() cannot update one '
            'parameter alone')

    def add_hook(self, hook, name=None, timing='auto'):
        raise NotImplementedError(
            'chainer_tc.optimizers.MomentumSGD has no per-rule hooks (the update of every '
            'parameter is one kernel); add the hook to the optimizer instead: '
            'optimizer.add_hook(hook) runs it with (update_rule, param) for each parameter when '
            'hook.call_for_each_param is True')

    def use_fp32_update(self, flag=True):
        if not flag:
            raise ValueError('chainer_tc.optimizers.MomentumSGD always updates float16 parameters '
                             'through float32 master weights; use_fp32_update(False) is not '
                             'supported')

    def serialize(self, serializer):
        """``t`` and ``v`` under the parameter's path, as Chainer's MomentumSGDRule writes them,
        plus ``master`` for float16 parameters (optional when loading: a file from Chainer's
        optimizer has none, and the master is then taken from the parameter)."""
        self.t = serializer('t', self.t)
        loading = isinstance(serializer, serializer_module.Deserializer)
        state = self._state
        if state is None:
            if not loading:
                return
            state = {}
            for key in ('v', 'master'):
                try:
                    value = serializer(key, None)
                except KeyError:
                    if key == 'v' and self.enabled:
                        raise
                    value = None
                if value is not None:
                    state[key] = numpy.asarray(value) if isinstance(value, numpy.ndarray) \
                        else value
            self._state = state or None
            return
        for key in list(state):
            try:
                state[key] = serializer(key, state[key])
            except KeyError:
                if key == 'v' and self.enabled:
                    raise
                if key == 'master':           # take the parameter's value at the next update
                    state[key][...] = numpy.nan
