"""How one update reads each gradient: divided or not, by what, and whether it is written back.

Chainer's backward records on every parameter it reaches the loss scale it used
(``param._loss_scale``: None for a plain ``backward()``, ``s`` for ``backward(loss_scale=s)``;
our ``scaled_backward()`` marks ``SCALED_ON_DEVICE``, the optimizer's own scale in device
memory), and Chainer's update rule divides each gradient by its record: **in place** for a
float32 or float64 parameter (``param.grad /= loss_scale``), as a float32 copy for a float16 one
(whose ``param.grad`` stays scaled). The batched update does the same in its one launch
(kernels/optimizer.cu): per gradient, bit 0 of its address says "divide", bit 1 "write the
quotient back"; the divisor is one number for the step, or each parameter's own when the step's
gradients carry different ones (two backward passes with different scales).

A gradient is written back only where no other gradient the update reads shares its memory:
Chainer's backward gives one array to several parameters (``F.sum(W1 + W2)``: both gradients
are the same array, which Chainer's rules then divide twice, once per parameter). Every gradient
of such a group is read from a private copy made when the step is built, and the quotients are
copied back after the update, so each one is divided once. A gradient that is not C-contiguous
is read from the contiguous copy ``FlatParams.grads()`` made, and copied back likewise. A step
that skips (an overflow under dynamic loss scaling) writes nothing: the copies back then carry
the values the gradients already had.
"""
import numpy

from chainer_tc.optimizers import _flat, _scaler

MIXED = -1.0        # StepParams.grad_divisor: each parameter's divisor is in ``divisors``


class StepGrads:
    """The gradients of one step as the update reads them (see the module's docstring).

    ``read``: one array or None per entry of the flat buffers: what the update reads (the
    gradient, or a private copy of it). ``divide`` / ``write``: per entry, whether it is divided,
    and whether its quotient is written back over ``read``. ``divisor``: 0.0 (the device loss
    scale), a number (a backward pass's loss_scale) or ``MIXED``, then ``divisors`` holds each
    entry's (0.0: the device scale). ``after``: ``(destination, source)`` copies to make once the
    update ran (quotients back into the gradients the parameters hold)."""

    __slots__ = ('read', 'divide', 'write', 'divisor', 'divisors', 'after')

    def __init__(self, scaling_mode, flat, grads, marks=None, copied=()):
        """``grads``: the C-contiguous gradients (``flat.grads()``); ``copied``: ``(index,
        original)`` for each one that is a contiguous copy of ``original`` (a strided gradient);
        ``marks``: each entry's ``param._loss_scale``, or None (every gradient from
        ``scaled_backward()``)."""
        self.divide, self.divisor, self.divisors = _unscaling(scaling_mode, flat, grads, marks)
        self.read = grads
        self.after = []
        # a quotient goes back where Chainer's rule divides in place: a divided float32 or
        # float64 gradient of an enabled rule (a frozen one's rule does not run), not a
        # read-only one (NumPy's broadcast view from F.sum's backward: Chainer's division
        # raises there)
        write = self.write = [d and h and e.rule.enabled
                              for d, h, e in zip(self.divide, flat.not_half, flat.entries)]
        if not any(write):
            return
        if flat.xp is numpy:        # (a CuPy array has no read-only flag; copies are checked)
            write = self.write = [w and (g is None or g.flags.writeable)
                                  for w, g in zip(write, grads)]
        originals = dict(copied)
        for i, o in copied:
            if write[i] and not _writeable(o):
                write[i] = False
        read = list(grads)
        shared = [i for group in _overlapping(read) if any(write[i] for i in group)
                  for i in group]
        if shared:
            xp = flat.xp
            with flat.device_scope():
                for i in shared:
                    read[i] = xp.array(read[i], copy=True)
                    originals.setdefault(i, grads[i])
        self.after = [(originals[i], read[i]) for i in sorted(originals) if write[i]]
        self.read = read

    def copy_back(self):
        for dst, src in self.after:
            dst[...] = src


def _overlapping(arrays):
    """Groups of indices of the arrays (C-contiguous, or None) whose memory overlaps: each chain
    of overlapping spans, of two or more arrays. Only arrays of one allocation can overlap (a
    NumPy array's last base, a CuPy array's memory chunk), so addresses are read only for those:
    the usual step, every gradient its own allocation, costs one attribute walk per array."""
    first = next((a for a in arrays if a is not None), None)
    if first is None:
        return []
    if isinstance(first, numpy.ndarray):
        owners = [id(a) if a.base is None else _root(a) for a in arrays if a is not None]
    else:
        owners = [id(a.data.mem) for a in arrays if a is not None]
    if len(set(owners)) == len(owners):
        return []
    present = [i for i, a in enumerate(arrays) if a is not None]
    by_owner = {}
    for i, owner in zip(present, owners):
        by_owner.setdefault(owner, []).append(i)
    groups = []
    for members in by_owner.values():
        if len(members) > 1:
            groups += _chains([(_address(arrays[i]), _address(arrays[i]) + arrays[i].nbytes, i)
                               for i in members if arrays[i].size])
    return groups


def _root(a):
    """The id of the object that holds a NumPy view's memory: NumPy sets a view's base to the
    array that owns it, or to the first array whose base is not an array (``frombuffer``'s,
    whose base is the buffer), so the walk ends in one or two steps."""
    b = a.base
    while isinstance(b, numpy.ndarray) and b.base is not None:
        b = b.base
    return id(b)


def _chains(spans):
    """The chains of two or more overlapping ``(start, end, index)`` spans."""
    groups = []
    group, end = [], -1
    for lo, hi, i in sorted(spans):
        if lo < end:
            group.append(i)
        else:
            if len(group) > 1:
                groups.append(group)
            group = [i]
        end = max(end, hi)
    if len(group) > 1:
        groups.append(group)
    return groups


def _unscaling(scaling_mode, flat, grads, marks):
    """``(divide, divisor, divisors)`` from each entry's mark (see StepGrads): a gradient is
    divided by its mark, a ``SCALED_ON_DEVICE`` one by the device scale and only while loss
    scaling is on; one divisor for the step where every divided gradient has the same one,
    else ``MIXED`` and each entry's in ``divisors``. A mark that is not a positive finite
    number is refused, naming the parameter."""
    on_device = scaling_mode != _scaler.NONE
    if marks is None:
        return [on_device and g is not None for g in grads], 0.0, None
    divide = []
    numbers = False
    for g, m in zip(grads, marks):
        if g is None or m is None:
            divide.append(False)
        elif m is _scaler.SCALED_ON_DEVICE:
            divide.append(on_device)
        else:
            divide.append(True)
            numbers = True
    if not numbers:
        return divide, 0.0, None
    divisors = [0.0] * len(grads)
    for i, (d, m) in enumerate(zip(divide, marks)):
        if d and m is not _scaler.SCALED_ON_DEVICE:
            divisors[i] = _number_scale(flat.entries[i].name, m)
    used = {s for d, s in zip(divide, divisors) if d}
    if len(used) == 1:          # (not empty: a number-marked gradient is divided)
        return divide, used.pop(), None
    return divide, MIXED, divisors


def _number_scale(name, mark):
    try:
        s = float(mark)
    except (TypeError, ValueError):
        raise TypeError('parameter {}: its gradient was computed with loss_scale={!r} '
                        '(param._loss_scale), which is not a number'.format(name, mark)) from None
    if not 0 < s < numpy.inf:
        raise ValueError('parameter {}: its gradient was computed with loss_scale={} '
                         '(param._loss_scale); a loss scale must be a positive finite number'
                         .format(name, s))
    return s


def _writeable(a):
    """Whether a quotient may be written into ``a``: not a read-only NumPy array, nor (CuPy has
    no such flag) a view with a zero stride, whose elements share memory (a broadcast: F.sum's
    backward gives one; NumPy marks it read-only)."""
    if isinstance(a, numpy.ndarray):
        return a.flags.writeable
    return all(st or n == 1 for st, n in zip(a.strides, a.shape))


def _address(a):
    return a.ctypes.data if isinstance(a, numpy.ndarray) else a.data.ptr
