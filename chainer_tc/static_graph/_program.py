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
non-array attribute of every node; otherwise the step is not replayable and the caller is told
which op and which value differ (e.g. a label array built from the batch in Python).
"""
import types

import numpy

import chainer
from chainer import configuration

from chainer_tc.static_graph import _trace


class NotReplayable(Exception):
    """The recorded steps cannot be replayed; the message says which op and why."""


def _base_chain(a):
    while a is not None:
        yield a
        a = getattr(a, 'base', None)


class _Known:
    """Arrays (and helper objects holding arrays) refreshed every step, by id; an array is
    known too when it is a view of a known one."""

    def __init__(self):
        self.ids = set()
        self.keep = []

    def add(self, a):
        if id(a) not in self.ids:
            self.ids.add(id(a))
            self.keep.append(a)

    def __contains__(self, a):
        if not isinstance(a, _trace.array_types()):
            return id(a) in self.ids
        return any(id(b) in self.ids for b in _base_chain(a))


def _is_plain(v):
    """A helper object a forward may keep (e.g. BatchNormalization's ``_impl``), whose arrays a
    gradient node reads later: not a node, Variable, array, class, function or module."""
    return (hasattr(v, '__dict__') and not isinstance(
        v, (type, chainer.FunctionNode, chainer.Function, chainer.Variable,
            chainer.variable.VariableNode, types.ModuleType, types.FunctionType,
            types.MethodType)) and not isinstance(v, _trace.array_types()))


def _same_value(a, b, depth=0):
    if isinstance(a, _trace.array_types()) or isinstance(b, _trace.array_types()):
        if type(a) is not type(b) or a.shape != b.shape or a.dtype != b.dtype:
            return False
        xp = chainer.backend.get_array_module(a)
        return bool(xp.array_equal(a, b, equal_nan=a.dtype.kind in 'fc'))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y, depth) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k], depth) for k in a)
    if isinstance(a, (chainer.FunctionNode, chainer.Function, chainer.Variable,
                      chainer.variable.VariableNode)) or callable(a):
        return type(a) is type(b)
    if _is_plain(a):
        return type(a) is type(b) and (depth > 2 or _same_value(vars(a), vars(b), depth + 1))
    try:
        return bool(a == b) or (a != a and b != b)
    except Exception:
        return type(a) is type(b)


def _shares(a, arrays):
    xp = chainer.backend.get_array_module(a)
    return any(xp.may_share_memory(a, b) for b in arrays
               if isinstance(b, _trace.array_types()) and type(b) is type(a))


class Program:
    """A replayable step, from two recorded steps ``first`` and ``last`` (the one replayed)."""

    def __init__(self, first, last, externals):
        self.trace = last
        if len(first.ops) != len(last.ops):
            raise NotReplayable('the two recorded steps applied {} and {} functions: the step '
                                'does not apply the same functions every time'
                                .format(len(first.ops), len(last.ops)))
        known = _Known()
        for a in externals:
            known.add(a)
        ops = []
        for i, (a, b) in enumerate(zip(first.ops, last.ops)):
            where = 'function #{} ({})'.format(i, b.label)
            if type(a.node) is not type(b.node):
                raise NotReplayable('{}: the first recorded step applied {} there'
                                    .format(where, a.label))
            if b.outputs is None:
                raise NotReplayable('{}: its forward did not return'.format(where))
            self._check_inputs(a, b, known, where)
            self._check_attributes(a, b, known, where)
            outs = []
            for y in b.outputs:
                outs.append((y, _shares(y, b.inputs)))
                known.add(y)
            pins = []
            for key, v in b.post.items():
                if b.pre.get(key) is v:
                    continue                   # given to the node, not made by its forward
                if isinstance(v, _trace.array_types()):
                    pins.append((key, v, _shares(v, b.inputs + b.outputs), None))
                else:                          # a helper object: pin the arrays it holds
                    sub = tuple((k, x, _shares(x, b.inputs + b.outputs))
                                for k, x in vars(v).items()
                                if isinstance(x, _trace.array_types()))
                    for _, x, _ in sub:
                        known.add(x)
                    pins.append((key, v, False, sub))
                known.add(v)
            ops.append((b.state.__dict__, b.pre, b.node.forward, b.inputs, tuple(outs),
                        tuple(pins), b.config))
        self._ops = ops
        self._known = known
        self.reports = self._reports(first, last, known)
        for g in last.grads:
            if g is not None and g not in known:
                raise NotReplayable('a gradient was produced outside the recorded functions '
                                    '(shape {}): it would not be recomputed'.format(g.shape))
        if last.loss not in known:
            raise NotReplayable('the loss was not computed by the recorded functions')

    @staticmethod
    def _check_inputs(a, b, known, where):
        if len(a.inputs) != len(b.inputs):
            raise NotReplayable('{}: {} inputs, then {}'.format(where, len(a.inputs),
                                                               len(b.inputs)))
        for k, (x, y) in enumerate(zip(a.inputs, b.inputs)):
            if x.shape != y.shape or x.dtype != y.dtype:
                raise NotReplayable('{}: input {} changed from {} {} to {} {}'.format(
                    where, k, x.shape, x.dtype, y.shape, y.dtype))
            if y not in known and not _same_value(x, y):
                raise NotReplayable(
                    '{}: input {} (shape {}) is not computed by a recorded function and differs '
                    'between steps, so a replay would use a stale value; compute it with '
                    'Chainer functions inside the step, or pass it as an input of the step'
                    .format(where, k, y.shape))

    @staticmethod
    def _check_attributes(a, b, known, where):
        for key, v in b.pre.items():
            if key in ('forward',):
                continue
            if isinstance(v, _trace.array_types()):
                if v in known:
                    continue
            u = a.pre.get(key, _MISSING)
            if u is _MISSING or not _same_value(u, v):
                raise NotReplayable('{}: its attribute {!r} differs between steps ({!r} then '
                                    '{!r}); a replay would freeze it'
                                    .format(where, key, _short(u), _short(v)))

    @staticmethod
    def _reports(first, last, known):
        if len(first.reports) != len(last.reports):
            raise NotReplayable('the step reported {} times, then {} times'.format(
                len(first.reports), len(last.reports)))
        out = []
        for (va, oa), (vb, ob) in zip(first.reports, last.reports):
            values = {}
            for key, v in vb.items():
                arr = v.array if isinstance(v, chainer.Variable) else v
                if isinstance(arr, _trace.array_types()) and arr in known:
                    values[key] = arr
                    continue
                u = va.get(key, _MISSING)
                u = u.array if isinstance(u, chainer.Variable) else u
                if u is _MISSING or not _same_value(u, arr):
                    raise NotReplayable('the reported value {!r} is not computed by a recorded '
                                        'function and differs between steps'.format(key))
                values[key] = arr
            out.append((values, ob))
        return out

    def relocate(self, old, new):
        """Make the program write the recorded array ``old`` into ``new`` (same shape and dtype)
        instead, e.g. a gradient into a view of one flat buffer. Returns False, changing
        nothing, when ``old`` cannot move: another recorded array is a view of it."""
        for a in self._known.keep:
            if a is not old and isinstance(a, _trace.array_types()) and any(
                    b is old for b in _base_chain(getattr(a, 'base', None))):
                return False

        def sub(x):
            return new if x is old else x
        new[...] = old
        ops = []
        for d, pre, forward, inputs, outs, pins, config in self._ops:
            for k, v in pre.items():
                if v is old:
                    pre[k] = new
            pins = tuple((k, sub(v), a, None if s is None else
                          tuple((k2, sub(x), a2) for k2, x, a2 in s))
                         for k, v, a, s in pins)
            ops.append((d, pre, forward, tuple(sub(x) for x in inputs),
                        tuple((sub(y), a) for y, a in outs), pins, config))
        self._ops = ops
        self.reports = [({k: sub(v) for k, v in values.items()}, o) for values, o in self.reports]
        self._known.add(new)
        return True

    def run(self):
        """Replay the step: every op's forward over the recorded arrays, in order."""
        local = configuration.config._local.__dict__
        saved = dict(local)
        copyto = numpy.copyto
        array_types = _trace.array_types()
        try:
            for d, pre, forward, inputs, outs, pins, config in self._ops:
                if config is not None:
                    local.clear()
                    local.update(config)
                d.update(pre)
                new = forward(inputs)
                for (y, alias), z in zip(outs, new):
                    if z is not y and not alias:
                        copyto(y, z)
                for key, v, alias, sub in pins:
                    z = d[key]
                    if z is v:
                        continue
                    if sub is None:
                        if not alias:
                            copyto(v, z)
                    else:                      # refresh the recorded object from the new one
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
        """Issue the recorded reports again, with copies of this step's values."""
        for values, observer in self.reports:
            chainer.reporter.report(
                {k: v.copy() if isinstance(v, _trace.array_types()) else v
                 for k, v in values.items()}, observer)


_MISSING = object()


def _short(v):
    if isinstance(v, _trace.array_types()):
        return '<array {} {}>'.format(v.shape, v.dtype)
    r = repr(v)
    return r if len(r) < 60 else r[:57] + '...'
