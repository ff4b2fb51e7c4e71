"""What two recorded steps must agree on for one of them to be replayed in place of the other.

A replay runs the ops of one recorded step (``last``) again. That is the step a user would have
run only if every other recorded step of the same signature (``first``: the other recorded step,
or a later check step) applied the same functions in the same order, **wired the same way**, with
the same values wherever a replay would freeze them:

- each input of each op comes from the same place in both: the same output of the same earlier
  op, the same array the op before it kept, the same input of the step, parameter or state
  array (or the same view of one). An array that comes from none of these is a *constant* and
  must have the same value in both;
- each non-array attribute of each node, and each constant array attribute, has the same value;
- Chainer's configuration (``chainer.config``, ``using_config``) is the same at each op;
- the same values are reported, where they are not computed by an op.

:class:`Known` tells where each array of one recorded step comes from; :func:`check_op` and
:func:`reports` compare two steps op by op and raise :class:`NotReplayable` naming the op and the
value that differ.
"""
import types

import numpy

import chainer
from chainer import configuration

from chainer_tc.static_graph import _site
from chainer_tc.static_graph import _trace


class NotReplayable(Exception):
    """The recorded steps cannot be replayed; the message says which op and why."""


MISSING = object()

# values compared by ``==`` alone: immutable, holding no array (the common case, checked first)
_ATOMS = frozenset((type(None), bool, int, str, bytes))


def base_chain(a):
    while a is not None:
        yield a
        a = getattr(a, 'base', None)


def _address(a):
    data = a.data
    return data.ptr if hasattr(data, 'ptr') else a.__array_interface__['data'][0]


class Known:
    """The arrays (and helper objects holding arrays) of one recorded step that are refreshed
    every step, by id, each with its *source*: ``('state', k)`` (the k-th of the step's inputs,
    parameters and state arrays), ``('output', i, j)`` (output j of op i), ``('kept', i, key)``
    (the array op i kept as attribute ``key``; ``('kept', i, key, name)``: an array of the
    helper object kept there). An array is known too when it is a view of a known one; its
    source is then ``('view', source of the base, shape, strides, byte offset)``."""

    def __init__(self, externals=(), leftover_grads=None):
        self.leftover_grads = leftover_grads or {}     # Trace.leftover_grads: for messages
        self.ids = set()
        self.keep = []
        self.tags = {}
        self.config = {}          # the configuration of the op last compared (_check_config)
        for k, a in enumerate(externals):
            self.add(a, ('state', k))

    def add(self, a, tag=None):
        if id(a) not in self.ids:
            self.ids.add(id(a))
            self.keep.append(a)
        if tag is not None:
            self.tags.setdefault(id(a), tag)

    def learn(self, op, i):
        """Op ``i``'s outputs and the arrays it kept, after it ran."""
        array_types = _trace.array_types()
        for j, y in enumerate(op.outputs):
            if y is not None:
                self.add(y, ('output', i, j))
        for key, v in op.post.items():
            if op.pre.get(key) is v:
                continue                   # given to the node, not made by its forward
            self.add(v, ('kept', i, key))
            if not isinstance(v, array_types) and hasattr(v, '__dict__'):
                for name, x in vars(v).items():
                    if isinstance(x, array_types):
                        self.add(x, ('kept', i, key, name))

    def __contains__(self, a):
        if not isinstance(a, _trace.array_types()):
            return id(a) in self.ids
        return any(id(b) in self.ids for b in base_chain(a))

    def source(self, a):
        """Where the array ``a`` comes from, or None for a constant."""
        tag = self.tags.get(id(a))
        if tag is not None or not isinstance(a, _trace.array_types()):
            return tag
        for b in base_chain(getattr(a, 'base', None)):
            tag = self.tags.get(id(b))
            if tag is not None:
                return ('view', tag, a.shape, a.strides, _address(a) - _address(b))
        return None


def describe(tag):
    if tag is None:
        return 'a constant (computed by no recorded function)'
    kind = tag[0]
    if kind == 'state':
        return "the step's input, parameter or state array #{}".format(tag[1])
    if kind == 'output':
        return 'output {} of function #{}'.format(tag[2], tag[1])
    if kind == 'kept':
        return 'the array function #{} kept as {}'.format(tag[1], '.'.join(tag[2:]))
    return 'a view {} of {}'.format(tag[2], describe(tag[1]))


def op_count(first, last):
    if len(first.ops) != len(last.ops):
        raise NotReplayable('the recorded steps applied {} and {} functions: the step does not '
                            'apply the same functions every time'
                            .format(len(first.ops), len(last.ops)))


def check_trace(trace):
    """What one recorded step shows by itself that a replay could not redo: a gradient through
    a Chainer function that computes an array from the data in Python in its backward
    (:func:`._trace.python_gradient`), a write in place into an input or a parameter that no
    recorded function made (``x -= x.mean(0)``, ``numpy.clip(W.array, .., out=W.array)``
    in the loss function). Raises :class:`NotReplayable`."""
    if trace.written:
        raise NotReplayable(
            'the step wrote into {} in place, outside any Chainer function (e.g. `x -= ...` '
            'or `out=` on the array in the loss function, or a link hook that updates state '
            'in Python, as SpectralNormalization its W_u): a replay would not do it again. '
            'Compute a new array with Chainer functions instead (x = x - ...); change '
            'parameters in an optimizer hook, other state (a persistent array: a running '
            'mean, a counter) after the call (hooks and code outside the step run at every '
            'replay)'
            .format(', '.join(trace.written)))
    if trace.python_gradients:
        names = sorted(set(trace.python_gradients))
        raise NotReplayable(
            "the gradient of {} needs {} that Chainer's backward computes in Python from the "
            'values (a mask or a sign, made by no FunctionNode), which a replay cannot '
            "recompute: it would reuse the recorded step's"
            .format(', '.join(names), 'arrays' if len(names) > 1 else 'an array'))


def check_op(i, a, b, known_first, known):
    """Op ``i`` of the later recorded step (``b``, whose arrays ``known`` describes) against
    the earlier one's (``a``, ``known_first``), before either learns op ``i``'s results."""
    where = 'function #{} ({})'.format(i, b.label)
    try:
        if type(a.node) is not type(b.node) or type(a.state) is not type(b.state):
            raise NotReplayable('{}: the earlier recorded step applied {} there'
                                .format(where, a.label))
        if b.outputs is None:
            raise NotReplayable('{}: its forward did not return'.format(where))
        _check_config(a, b, known_first, known, where)
        _check_inputs(a, b, known_first, known, where)
        _check_attributes(a, b, known_first, known, where)
    except NotReplayable as e:
        made = '' if b.site is None else str(b.site)
        if made:        # which call of the loss function made it (its label is no name a
            #             user called): e.args is the message, re-raised with it
            e.args = ('{} (function #{} was {}){}'.format(e.args[0], i, made,
                                                          _library_note(b, e)),)
        raise


def _made_in_python(v):
    """A NumPy scalar (not a bool: True_ and False_ are shared objects) or array: what a loss
    function computes from the data outside Chainer's functions."""
    return isinstance(v, _trace.array_types()) or (
        isinstance(v, numpy.generic) and not isinstance(v, numpy.bool_))


def _library_note(op, error):
    """Where the input of ``op`` that no recorded function computed (``error``: an
    :class:`_Unrecorded`) was computed inside library code, not handed to it by its caller:
    that code computes it (from the step's data, in Python), so no change to the loss function
    helps but another call; '' otherwise."""
    if not isinstance(error, _Unrecorded):
        return ''
    site, k = op.site, error.index
    known = site.known_note(k, op.label)
    if known is not None:
        return '. That input is computed inside {}, not by the loss function: {}'.format(
            site.known_name, known)
    if site.computed_inside(k):
        return ('. That input is computed inside {}, not by the loss function (with NumPy, '
                'from the data): a step calling it cannot be replayed'.format(site.api_name))
    return ''


class _Unrecorded(NotReplayable):
    """An input of an op that no recorded function computed differs between steps."""

    def __init__(self, message, index):
        super().__init__(message)
        self.index = index


def _check_config(a, b, known_first, known, where):
    """The configuration each op ran under (recorded where it changed since the op before):
    the values in effect, the thread's own or else the global ones, must be the same."""
    if a.config is None and b.config is None:
        return
    if a.config is not None:
        known_first.config = a.config
    if b.config is not None:
        known.config = b.config
    ca, cb = known_first.config, known.config
    glob = configuration.global_config.__dict__
    for key in sorted(set(ca) | set(cb)):
        u = ca.get(key, glob.get(key, MISSING))
        v = cb.get(key, glob.get(key, MISSING))
        if not same_value(u, v):
            raise NotReplayable("{}: Chainer's configuration differs between steps ({} is {} "
                                'then {}); a replay would freeze it'
                                .format(where, key, short(u), short(v)))


def _check_inputs(a, b, known_first, known, where):
    if len(a.inputs) != len(b.inputs):
        raise NotReplayable('{}: {} inputs, then {}'.format(where, len(a.inputs),
                                                           len(b.inputs)))
    # what an old-style backward wrote into: the same inputs, and a constant made anew each
    # step (not one array both steps share: state the step updates) with the same value before
    # A step recorded under a CUDA graph capture reads no values (None): not compared. That
    # is safe: an input the eager step saw written is either the same array in both steps
    # (state written at every step, eagerly too) or one the captured step made inside the
    # graph (nothing reaches the device from the host during a capture), made again by each
    # launch before the backward writes into it, as F.hinge's initial gradient is
    wa, wb = dict(a.overwritten or ()), dict(b.overwritten or ())
    if a.overwritten is not None and b.overwritten is not None and wa.keys() != wb.keys():
        raise NotReplayable('{}: it wrote into its inputs {} in one step and {} in the other'
                            .format(where, sorted(wa), sorted(wb)))
    for k in wa.keys() & wb.keys():
        if a.inputs[k] is not b.inputs[k] and not same_value(wa[k], wb[k]):
            raise NotReplayable('{}: its input {} held {} before it wrote into it in one step '
                                'and {} in the other'
                                .format(where, k, short(wa[k]), short(wb[k])))
    for k, (x, y) in enumerate(zip(a.inputs, b.inputs)):
        if x is None or y is None:         # an old-style backward's missing array
            if x is not y:
                raise NotReplayable('{}: input {} is None in one step only'.format(where, k))
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            raise NotReplayable('{}: input {} changed from {} {} to {} {}'.format(
                where, k, x.shape, x.dtype, y.shape, y.dtype))
        sx, sy = known_first.source(x), known.source(y)
        if sx != sy:
            raise NotReplayable('{}: input {} is {} in one step and {} in the other: the '
                                'functions are wired differently'
                                .format(where, k, describe(sx), describe(sy)))
        if sy is None and not same_value(x, y):
            if id(y) in known.leftover_grads:
                raise NotReplayable(
                    '{}: input {} is the gradient of {}, held before the step, which the '
                    "backward adds to: this step's optimizer does not train it, so nothing "
                    "clears it between steps (another model's parameter under this loss, as a "
                    "GAN's generator under the discriminator's), and a replay cannot follow "
                    'it. Keep the backward out of that model (pass fake.array, not fake) or '
                    'clear its gradients in the loss function (other_model.cleargrads())'
                    .format(where, k, known.leftover_grads[id(y)]))
            raise _Unrecorded(
                '{}: input {} ({}) is not computed by a recorded function and differs '
                'between steps, so a replay would use a stale value. Only FunctionNodes are '
                'recorded: an array computed with NumPy/CuPy, from a Variable\'s .array, or '
                'by F.sign, F.floor, F.ceil or F.fix (which compute directly, with no '
                'FunctionNode) is not; compute it with differentiable Chainer functions '
                'inside the step, or pass it as an input of the step'
                .format(where, k, _values(x, y)), k)


def _check_attributes(a, b, known_first, known, where):
    for key in a.pre.keys() - b.pre.keys() - {'forward'}:
        raise NotReplayable('{}: its attribute {!r} is set in one step only ({} then absent); '
                            'a replay would freeze it'.format(where, key, short(a.pre[key])))
    for key, v in b.pre.items():
        if key != 'forward':
            _check_attribute(a.pre.get(key, MISSING), v, known_first, known, where,
                             'its attribute {!r}'.format(key))


def _check_attribute(u, v, known_first, known, where, what, depth=0):
    """An attribute's value ``u`` in the earlier step against ``v``: what a forward computes
    (an array, a NumPy scalar or float) by source, where either has one; a tuple or list
    element by element, its arrays by source (``y[xp.arange(n), t]`` keeps the step's input
    ``t`` in GetItem's ``slices``: a replay refreshes it in place) and its numbers by value
    (a replay cannot rebind them there); anything else by value."""
    if _same_atoms(u, v):
        return          # (most attributes: the same ints, flags and None in both steps)
    computed = _trace.array_types() + ((numpy.generic, float) if depth == 0 else ())
    if isinstance(v, computed) and isinstance(u, computed):
        su, sv = known_first.source(u), known.source(v)
        if su != sv:
            raise NotReplayable('{}: {} is {} in one step and {} in the other: the functions '
                                'are wired differently'.format(where, what, describe(su),
                                                               describe(sv)))
        if sv is not None:
            return
    elif (depth < 2 and isinstance(v, (tuple, list)) and type(u) is type(v)
          and len(u) == len(v)):
        for j, (x, y) in enumerate(zip(u, v)):
            _check_attribute(x, y, known_first, known, where, '{}[{}]'.format(what, j),
                             depth + 1)
        return
    if u is MISSING or not same_value(u, v):
        raise NotReplayable('{}: {} differs between steps ({} then {}); a replay would freeze '
                            'it'.format(where, what, short(u), short(v)))


def _same_atoms(u, v):
    """Whether ``u`` and ``v`` are equal atoms, or tuples of equal atoms and floats element by
    element (each pair of one type: an array on either side is no atom, and is left to the
    comparison by source)."""
    t = type(v)
    if type(u) is not t:
        return False
    if t in _ATOMS:
        return u == v
    return t is tuple and len(u) == len(v) and all(
        type(x) is type(y) and (type(y) in _ATOMS or type(y) is float) and x == y
        for x, y in zip(u, v))


def reports(first, last, known_first, known):
    """The reports of ``last`` as a replay issues them, ``[(values, observer, (names of the
    values reported as Variables, where))]``, once checked against ``first``'s."""
    if len(first.reports) != len(last.reports):
        raise NotReplayable('the step reported {} times, then {} times'.format(
            len(first.reports), len(last.reports)))
    array_types = _trace.array_types()
    out = []
    for (va, oa, _), (vb, ob, where) in zip(first.reports, last.reports):
        if va.keys() != vb.keys():
            raise NotReplayable('the step reported {}, then {}'.format(sorted(va), sorted(vb)))
        values = {}
        for key, v in vb.items():
            arr = v.array if isinstance(v, chainer.Variable) else v
            u = va[key]
            u = u.array if isinstance(u, chainer.Variable) else u
            if isinstance(arr, array_types) and isinstance(u, array_types):
                su, sv = known_first.source(u), known.source(arr)
                if su != sv:
                    raise NotReplayable('the reported value {!r} is {} in one step and {} in '
                                        'the other'.format(key, describe(su), describe(sv)))
                if sv is not None:
                    values[key] = arr
                    continue
            if not same_value(u, arr):
                raise NotReplayable('the reported value {!r} is not computed by a recorded '
                                    'function and differs between steps ({} then {})'
                                    .format(key, short(u), short(arr)))
            if u is not arr and _made_in_python(arr):
                # the same value in both recorded steps, but made anew in each (a constant
                # is one object): computed from the data, equal by chance (an accuracy of 0
                # early on), which a replay would report from then on
                raise NotReplayable(
                    'the reported value {!r} ({}) is a NumPy value the loss function computes '
                    'in Python at every step (e.g. (y.array.argmax(1) == t).mean()), which a '
                    'replay cannot compute again: it would report the recorded value until the '
                    'next check (check_every). Compute it with Chainer functions (F.accuracy, '
                    'F.mean, ...) or report it outside the step'.format(key, short(arr)))
            values[key] = arr
        variables = frozenset(k for k, v in vb.items() if isinstance(v, chainer.Variable))
        out.append((values, ob, (variables, where)))
    return out


def check_same_step(first, last, externals_first, externals):
    """Raise :class:`NotReplayable` where the recorded step ``last`` differs from ``first`` in
    what a replay of one freezes: the checks a :class:`~._program.Program` makes, without
    building one. ``externals``: the step's inputs, parameters and state arrays, in the same
    order for both steps."""
    op_count(first, last)
    check_trace(last)
    known_first, known = Known(externals_first), Known(externals, last.leftover_grads)
    for i, (a, b) in enumerate(zip(first.ops, last.ops)):
        check_op(i, a, b, known_first, known)
        known_first.learn(a, i)
        known.learn(b, i)
    reports(first, last, known_first, known)


def is_plain(v):
    """A helper object a forward may keep (e.g. BatchNormalization's ``_impl``), whose arrays a
    gradient node reads later: not a node, Variable, array, class, function or module."""
    return (hasattr(v, '__dict__') and not isinstance(
        v, (type, chainer.FunctionNode, chainer.Function, chainer.Variable,
            chainer.variable.VariableNode, types.ModuleType, types.FunctionType,
            types.MethodType)) and not isinstance(v, _trace.array_types()))


def same_value(a, b, depth=0):
    if type(a) is type(b) and type(a) in _ATOMS:
        return a == b
    if isinstance(a, _trace.array_types()) or isinstance(b, _trace.array_types()):
        if type(a) is not type(b) or a.shape != b.shape or a.dtype != b.dtype:
            return False
        xp = chainer.backend.get_array_module(a)
        return bool(xp.array_equal(a, b, equal_nan=a.dtype.kind in 'fc'))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y, depth) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k], depth) for k in a)
    if isinstance(a, (chainer.FunctionNode, chainer.Function, chainer.Variable,
                      chainer.variable.VariableNode)) or callable(a):
        return type(a) is type(b)
    if is_plain(a):
        return type(a) is type(b) and (depth > 2 or same_value(vars(a), vars(b), depth + 1))
    try:
        return bool(a == b) or (a != a and b != b)
    except Exception:
        return type(a) is type(b)


def _values(x, y):
    """Shape, and both values where they are short."""
    if x.size > 4:
        return 'shape {}'.format(y.shape)
    host = chainer.backend.CpuDevice().send
    return 'shape {}: {} then {}'.format(y.shape, host(x).tolist(), host(y).tolist())


def short(v):
    if v is MISSING:
        return 'absent'
    if isinstance(v, _trace.array_types()):
        return '<array {} {}>'.format(v.shape, v.dtype)
    r = repr(v)
    return r if len(r) < 60 else r[:57] + '...'
