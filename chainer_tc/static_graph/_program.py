"""The CPU replay: a recorded step run again over the same arrays, without Chainer's graph.

A :class:`Program` is built from two recorded eager steps of the same shapes (``first`` and
``last``). It replays ``last``: for each op, its node gets its pre-forward attributes back,
``forward`` runs on the recorded input arrays, and the fresh outputs (and the arrays the node
keeps) are copied into the recorded ones, which every later op reads. So every array keeps its
identity from step to step, as on a GPU under a captured graph, and every value is computed by
the same code as in eager execution: the results are the same bits.

What is not an op output must be refreshed in place by someone else, or be a constant:
parameters (the optimizer updates them in place), persistent arrays (BatchNorm's running
statistics, updated in place by the ops), the step's input buffers (the caller copies each batch
in), the loss scale (updated in place by the optimizer). Any other array an op reads is a
*constant* of the step: the two recorded steps must agree on its value, and so must every
non-array attribute of every node (and on how the ops are wired: :mod:`._compare`); otherwise
the step is not replayable and the caller is told which op and which value differ (e.g. a label
array built from the batch in Python).
"""
import numpy

import chainer
from chainer import configuration

from chainer_tc.static_graph import _compare
from chainer_tc.static_graph import _trace
from chainer_tc.static_graph._compare import NotReplayable  # NOQA  (raised from here too)

_base_chain = _compare.base_chain
_is_plain = _compare.is_plain


def _shares(a, arrays):
    xp = chainer.backend.get_array_module(a)
    return any(xp.may_share_memory(a, b) for b in arrays
               if isinstance(b, _trace.array_types()) and type(b) is type(a))


class _Slot:
    """An array (or helper object) an op makes each step, and every place that refers to it.

    ``rebind``: each replay, the op's fresh result is written into the places that refer to
    it (op inputs, node attributes, reports): no copy, and the memory is recycled as in eager
    execution. ``copy`` (when a reference cannot be rewritten: a view made outside the ops, a
    container, a gradient in the optimizer's flat buffer): the fresh result is copied into the
    recorded array, whose identity every reference keeps.
    """

    __slots__ = ('obj', 'alias', 'sub', 'sites', 'copy', 'bases')

    def __init__(self, obj, alias, sub=None, bases=()):
        self.obj = obj
        self.alias = alias        # a view of one of its op's inputs (or outputs)
        self.sub = sub            # helper object: its array attributes, (key, array, alias)
        self.sites = []           # (container, key) holding obj
        self.copy = False
        self.bases = bases        # the slots whose memory this one may share


class Program:
    """A replayable step, from two recorded steps ``first`` and ``last`` (the one replayed),
    and the step's inputs, parameters and state arrays as each of them saw them
    (``externals_first``, ``externals``: the same arrays in the same order, but for the
    inputs), which someone else refreshes in place every step."""

    def __init__(self, first, last, externals_first, externals):
        self.trace = last
        _compare.op_count(first, last)
        _compare.check_trace(first)         # (a captured step does not watch its writes)
        _compare.check_trace(last)
        known_first = _compare.Known(externals_first)
        known = _compare.Known(externals, last.leftover_grads)
        slots = {}
        ops = []
        restores = {}
        for i, (a, b) in enumerate(zip(first.ops, last.ops)):
            _compare.check_op(i, a, b, known_first, known)
            known_first.learn(a, i)
            inputs = list(b.inputs)
            for k, saved in b.overwritten or ():     # (None: captured, not read)
                x = b.inputs[k]
                # a constant made anew every step (different arrays in the two steps) that an
                # op writes into: its value at the start of the step comes back before each
                # replay. The same array in both steps is state the step updates, as in eager.
                if x not in known and x is not a.inputs[k] and id(x) not in restores:
                    restores[id(x)] = (x, saved)
            outs = []
            for y in b.outputs:
                slot = None
                if y is None:                  # no gradient for that input (old-style backward)
                    outs.append(None)
                    continue
                if id(y) not in slots and y not in known:     # else: returned an input as is
                    slot = slots[id(y)] = _Slot(y, _shares(y, b.inputs),
                                                bases=self._bases(y, b.inputs, slots))
                known.add(y)
                outs.append(slot)
            pins = []
            for key, v in b.post.items():
                if b.pre.get(key) is v:
                    continue                   # given to the node, not made by its forward
                if id(v) in slots:             # one of its outputs, kept as an attribute
                    pins.append((key, slots[id(v)], True))
                    continue
                if isinstance(v, _trace.array_types()):
                    slot = _Slot(v, _shares(v, b.inputs + b.outputs),
                                 bases=self._bases(v, b.inputs + b.outputs, slots))
                elif _trace.number(v):         # rebound, never copied into
                    slot = _Slot(v, False)
                else:                          # a helper object, and the arrays it holds
                    sub = tuple((k, x, _shares(x, b.inputs + b.outputs))
                                for k, x in vars(v).items()
                                if isinstance(x, _trace.array_types()))
                    slot = _Slot(v, False, sub)
                    for _, x, _ in sub:
                        known.add(x)
                slots[id(v)] = slot
                pins.append((key, slot, False))
                known.add(v)
            known.learn(b, i)
            # the replay rebinds references in its own copy of the attributes: the trace's
            # stay as recorded, for a later check to compare with (check_same_step)
            ops.append([b.state.__dict__, dict(b.pre), b.node.forward, inputs, outs, pins,
                        b.config])
        self._restores = tuple(restores.values())
        self._ops = ops
        self._slots = slots
        self._known = known
        self.reports = _compare.reports(first, last, known_first, known)
        self.loss = [last.loss]
        for g in last.grads:
            if g is not None and g not in known:
                raise NotReplayable('a gradient was produced outside the recorded functions '
                                    '(shape {}): it would not be recomputed'.format(g.shape))
        if last.loss not in known:
            raise NotReplayable('the loss was not computed by the recorded functions')
        self._find_sites()
        self._propagated = False

    def _find_sites(self):
        """Every place that refers to a slot; a slot referred to where no place can be
        rewritten (inside a container, or through a view made outside the ops) is copied."""
        self._owners = {id(x): sl for sl in self._slots.values() if sl.sub for _, x, _ in sl.sub}
        for d, pre, forward, inputs, outs, pins, config in self._ops:
            for j, x in enumerate(inputs):
                self._refer(inputs, j, x)
            for key, v in pre.items():
                self._refer(pre, key, v)
        for values, observer, _ in self.reports:
            for key, v in values.items():
                self._refer(values, key, v)
        self._refer(self.loss, 0, self.loss[0])

    def _refer(self, container, key, v):
        """``container[key]`` holds ``v``: a site of its slot, or its memory is kept."""
        sl = self._slots.get(id(v))
        if sl is not None:
            sl.sites.append((container, key))
        else:
            self._pin_memory(v)

    def _pin_memory(self, v, depth=0):
        if isinstance(v, _trace.array_types()):
            for b in _base_chain(v):
                sl = self._slots.get(id(b)) or self._owners.get(id(b))
                if sl is not None:
                    sl.copy = True
        elif id(v) in self._slots:
            # a number inside a container stays the traced value there (it cannot be copied
            # into): the comparisons of the steps check the container by value, as a constant
            if not _trace.number(v):
                self._slots[id(v)].copy = True
        elif depth < 2 and isinstance(v, (tuple, list)):
            for x in v:
                self._pin_memory(x, depth + 1)
        elif depth < 2 and isinstance(v, dict):
            for x in v.values():
                self._pin_memory(x, depth + 1)
        elif isinstance(v, chainer.Variable):
            self._pin_memory(v.raw_array, depth + 1)
        elif isinstance(v, chainer.variable.VariableNode):
            self._pin_memory(v.data, depth + 1)
        elif depth < 2 and _is_plain(v):
            self._pin_memory(vars(v), depth + 1)

    def follow(self, holders):
        """Keep each one-element list's array this step's after every replay: the arrays of
        the Variables a step leaves where the user reads them (``L.Classifier``'s ``loss``,
        ``accuracy`` and ``y``, any link attribute), which are arrays of the recorded step."""
        for held in holders:
            self._refer(held, 0, held[0])
        self._propagated = False

    def _propagate(self):
        """A copied slot that views another op's result needs that result's memory fixed too."""
        changed = True
        while changed:
            changed = False
            for sl in self._slots.values():
                if sl.copy:
                    for b in sl.bases:
                        if not b.copy:
                            b.copy = changed = True
        self._propagated = True

    def pin(self, a):
        """Keep the recorded array ``a`` (and its memory) from step to step: ``a`` may also be
        a view of an op's result that no op made itself (a gradient returned by ``reshape``
        of another op's fresh array): then that result is the one kept."""
        for b in _base_chain(a):
            sl = self._slots.get(id(b))
            if sl is not None:
                sl.copy = True
                self._propagated = False

    @staticmethod
    def _bases(a, arrays, slots):
        xp = chainer.backend.get_array_module(a)
        return tuple(slots[id(b)] for b in arrays if id(b) in slots and type(b) is type(a)
                     and xp.may_share_memory(a, b))
    def relocate(self, old, new):
        """Make the program write the recorded array ``old`` into ``new`` (same shape and dtype)
        instead, e.g. a gradient into a view of one flat buffer. Returns False, changing
        nothing, when ``old`` cannot move: it is not a result of one op, or something refers
        to it (or views it) where no reference can be rewritten."""
        sl = self._slots.get(id(old))
        if sl is None or sl.copy or sl.sub is not None or any(
                a is not old and isinstance(a, _trace.array_types()) and any(
                    b is old for b in _base_chain(getattr(a, 'base', None)))
                for a in self._known.keep):
            return False
        new[...] = old
        for c, k in sl.sites:
            c[k] = new
        del self._slots[id(old)]
        sl.obj, sl.alias, sl.bases, sl.copy = new, False, (), True
        self._slots[id(new)] = sl
        self._known.add(new)
        self._propagated = False
        return True

    def _compile(self):
        """The replay loop's work per op, with every slot's mode settled: (node dict, pre,
        forward, inputs, config, [(output index, sites)] to rebind, [(output index, array)] to
        copy into, [pin actions])."""
        self._propagate()
        compiled = []
        for d, pre, forward, inputs, outs, pins, config in self._ops:
            rebind = tuple((j, tuple(sl.sites)) for j, sl in enumerate(outs)
                           if sl is not None and not sl.copy)
            copy = tuple((j, sl.obj) for j, sl in enumerate(outs)
                         if sl is not None and sl.copy and not sl.alias)
            pin_actions = []
            for key, sl, is_output in pins:
                if not sl.copy:
                    if not is_output:
                        pin_actions.append((key, None, tuple(sl.sites), None, False))
                else:
                    pin_actions.append((key, sl.obj, None, sl.sub, sl.alias or is_output))
            compiled.append((d, pre, forward, inputs, config, rebind, copy,
                             tuple(pin_actions)))
        self._compiled = compiled

    def run(self):
        """Replay the step: every op's forward over the recorded arrays, in order."""
        if not self._propagated:
            self._compile()
        local = configuration.config._local.__dict__
        saved = dict(local)
        copyto = numpy.copyto
        array_types = _trace.array_types()
        for x, value in self._restores:
            x[...] = value
        try:
            for d, pre, forward, inputs, config, rebind, copy, pins in self._compiled:
                if config is not None:
                    local.clear()
                    local.update(config)
                d.update(pre)
                new = forward(tuple(inputs))
                for j, sites in rebind:
                    z = new[j]
                    for c, k in sites:
                        c[k] = z
                for j, v in copy:
                    z = new[j]
                    if z is not v:
                        copyto(v, z)
                for key, v, sites, sub, keep_memory in pins:
                    z = d[key]
                    if sites is not None:           # rebind the references to the new value
                        for c, k in sites:
                            c[k] = z
                        continue
                    if z is not v and not keep_memory:
                        if sub is None:
                            copyto(v, z)
                        else:                       # refresh the recorded object from the new
                            vd, zd = v.__dict__, z.__dict__
                            for k, x, a in sub:
                                if not a:
                                    copyto(x, zd[k])
                            for k, x in zd.items():
                                if k not in vd or not isinstance(x, array_types):
                                    vd[k] = x
                    d[key] = v
        finally:
            local.clear()
            local.update(saved)

    def report(self):
        """Issue the recorded reports again, with copies of this step's values (as Variables
        where the step reported Variables), to where the step reported them: the reporter and
        observation current now, or those the step made current itself."""
        array_types = _trace.array_types()
        for values, observer, (variables, where) in self.reports:
            out = {}
            for k, v in values.items():
                if isinstance(v, array_types):
                    v = v.copy()
                    if k in variables:
                        v = chainer.Variable(v, requires_grad=False)
                out[k] = v
            if where is None:
                chainer.reporter.report(out, observer)
                continue
            reporter, observation = where
            with reporter.scope(observation):
                reporter.report(out, observer)


def give_grads(pairs):
    """``param.grad = g`` for each (param, g) where it is not so already: after a replay every
    parameter's ``grad`` is this step's gradient, as after an eager step, also when the user
    cleared it (``cleargrads()``) or a step of another signature set another array. Costs an
    identity test per parameter when nothing changed."""
    for param, g in pairs:
        gv = param._grad_var                  # what param.grad reads (Chainer 7.8.1)
        if (param._grad if gv is None else gv.array) is not g or not param._grad_valid:
            param.grad = g


def shared_once(arrays, grads):
    """``arrays`` (one per optimizer entry), each one whose gradient in ``grads`` is an
    earlier entry's array (Add's backward gives both inputs one) replaced by that entry's:
    what the parameters hold after a step that moved their gradients into ``arrays``, so
    that they share a gradient as after an eager step (a hook sees it once per sharer)."""
    first = {}
    out = list(arrays)
    for i, g in enumerate(grads):
        if g is not None:
            out[i] = out[first.setdefault(id(g), i)]
    return out


def reduce_untrained(step, pairs):
    """(param, gradient) of the parameters the optimizer does not train, with a gradient
    reduction: their gradients averaged over the ranks too (new arrays), as ChainerMN averages
    every gradient, so that a hook reading all of them (GradientClipping's norm) computes the
    same on every rank, and so does the overflow check of dynamic loss scaling (Chainer's reads
    them: a rank checking only its own would skip a step alone). One more collective, made
    whenever such parameters exist (usually there are none; a link frozen by
    ``disable_update()`` keeps its rule, and its gradients are in the main collective): made
    only with hooks or loss scaling, it was made by some ranks only where they differ in
    those, and their collectives went out of step (MPI_ERR_TRUNCATE; found by review).

    Every rank makes it over the same arrays: each initialised parameter without an update
    rule (the model is the same on every rank), zeros for one this rank has no gradient for
    (ChainerMN's ``zero_fill``), so a link that only some ranks' losses use gets the mean too.
    Deciding from this rank's own gradients (``pairs``) made ranks differ in collectives."""
    opt = step.optimizer
    if step.reduce_gradients is None:
        return pairs
    params = [p for _, p in opt._flat.untrained if p.raw_array is not None]
    if not params:
        return pairs
    have = {id(p): g for p, g in pairs}
    xp = chainer.backend.get_array_module(params[0].raw_array)
    flats = [xp.array(have[id(p)], copy=True).reshape(-1) if id(p) in have
             else xp.zeros(p.size, p.dtype) for p in params]
    step.reduce_gradients(flats)
    return [(p, f.reshape(p.shape)) for p, f in zip(params, flats)]


def leaves_none(flat, grads):
    """Whether a replay's update leaves a parameter without a gradient (``grads``: the
    recorded step's, per optimizer entry), which ``optimizer.update()`` fills with zeros
    afterwards, as Chainer's: one this step gave none, or one the optimizer does not train."""
    return any(g is None for g in grads) or bool(flat.untrained)


def give_marks(pairs):
    """``param._loss_scale = mark`` for each (param, mark): the loss-scale marks the recorded
    step's backward left on the parameters, for an optimizer update that reads them (with
    hooks, ``optimizer.update()`` unscales only the gradients marked scaled). A replay runs no
    backward, so without this a plain ``loss.backward()`` made between two steps (a gradient
    norm on a validation batch) would leave its marks and the replayed, scaled gradients
    would be applied without unscaling."""
    for param, mark in pairs:
        param._loss_scale = mark
