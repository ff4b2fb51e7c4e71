"""The optimizer's flat storage: every parameter, master weight and momentum in a few buffers.

At build time (the first update after setup, or after anything made the old buffers stale) each
Parameter's array is replaced by a view of one flat buffer per dtype (float32, float16, float64),
its current values copied in. Master weights (for float16 parameters) and momenta are flat buffers
(float32; float64 for float64 parameters) with the same offsets. The momenta and masters are
*adopted* from the update rules' ``state`` where it holds arrays (a loaded snapshot, a deep copy or
an unpickled optimizer, a parameter moved to another device), and each rule's state then becomes
views of the flat buffers. The update then runs over a handful of contiguous buffers: one kernel
on a GPU, a few vectorised operations on the CPU. Only the gradients stay where Chainer's backward
puts them (it allocates a new array for each one every step), so their addresses are passed with
every launch.

Layout of a buffer: the parameters in the model's order, each starting at a multiple of ALIGN
elements (256 bytes for float16), padding zero. A Parameter shared by several links (tied
weights) appears once. The work list for the kernel (``chunks``) cuts every parameter into pieces
of at most CHUNK elements; see kernels/optimizer.cu for its format.
"""
import numpy

from chainer_tc.optimizers import _structure

ALIGN = 128           # elements; every parameter view starts 256-byte aligned (512 for float32)
CHUNK = 2048          # elements per thread block of the update kernel
GRAD_TABLE = 480      # gradient addresses per launch (kernels/optimizer.cu OPT_GRAD_TABLE)
DTYPES = (numpy.dtype(numpy.float32), numpy.dtype(numpy.float16),
          numpy.dtype(numpy.float64))                       # groups 0, 1, 2 (GROUP_* in the .cu)
F32, F16, F64 = 0, 1, 2
STATE_DTYPES = (DTYPES[F32], DTYPES[F32], DTYPES[F64])      # momentum (and master) per group


class Entry:
    """One parameter: where it lives in the flat buffers."""

    __slots__ = ('name', 'param', 'rule', 'group', 'offset', 'size', 'shape', 'view', 'v',
                 'master')


def _device_of(array):
    return 'cpu' if isinstance(array, numpy.ndarray) else 'gpu:{}'.format(array.device.id)


def unique_params(named_params):
    """(name, param) pairs with each Parameter once (tied weights), in the model's order."""
    seen = set()
    out = []
    for name, param in named_params:
        if id(param) not in seen:
            seen.add(id(param))
            out.append((name, param))
    return out


class FlatParams:
    """Flat buffers of a model's parameters, built from ``named_params`` (unique, initialized,
    each with an update rule). The target's other parameters are held so that :meth:`changed`
    can tell them from new ones: ``untrained`` (no update rule) and ``waiting`` (a lazy link the
    loss has not called yet: no array; Chainer's update skips them, and :meth:`stale` says when
    one is initialized)."""

    def __init__(self, named_params, untrained=(), waiting=()):
        entries = []
        self.untrained = list(untrained)
        self.waiting = list(waiting)
        devices = {}
        arrays = {}          # id of a Parameter's array holder -> its name
        for name, param in named_params:
            a = param.array
            if a is None:
                raise RuntimeError('parameter {} is not initialized yet: pass it as waiting'
                                   .format(name))
            other = arrays.setdefault(id(param._data), name)
            if other != name:
                raise ValueError(
                    "parameters {} and {} share one array (a Link.copy(mode='share') of a link, "
                    'both in the model): Chainer updates that array once for each of them, '
                    'which flat buffers cannot do; to tie weights, call the same link twice '
                    "(its parameters are then updated once), or copy it with mode='copy'"
                    .format(other, name))
            if a.dtype not in DTYPES:
                raise TypeError('parameter {} is {}; chainer_tc.optimizers supports float16, '
                                'float32 and float64 parameters'.format(name, a.dtype))
            devices.setdefault(_device_of(a), name)
            e = Entry()
            e.name, e.param, e.shape, e.size = name, param, a.shape, a.size
            e.rule = param.update_rule
            e.group = DTYPES.index(a.dtype)
            entries.append(e)
        if not entries and self.waiting:
            raise RuntimeError('no parameter of the target is initialized yet ({} wait for '
                               "their link's first call); run a forward pass before the first "
                               'update'.format(', '.join(n for n, _ in self.waiting)))
        if not entries:
            raise ValueError('the target link has no parameters to optimize')
        if len(devices) > 1:
            raise ValueError('parameters are on different devices ({}); put the whole model on '
                             'one device before setup()'.format(
                                 ', '.join('{} on {}'.format(n, d) for d, n in devices.items())))
        self.device = next(iter(devices))
        self.xp = _array_module(entries[0].param.array)
        # by dtype, then decayed before undecayed (so that in the common case the parameters
        # sharing their hyperparameters are contiguous: see MomentumSGD's flat CPU step);
        # stable: the model's order within
        order = sorted(entries, key=lambda e: (e.group, _no_decay(e.param)))
        sizes = [0] * len(DTYPES)
        for e in order:
            e.offset = sizes[e.group]
            sizes[e.group] += -(-e.size // ALIGN) * ALIGN
        self.entries = order
        self.not_half = [e.group != F16 for e in order]
        self.align_masks = [DTYPES[e.group].itemsize - 1 for e in order]
        self.sizes = sizes
        self.known = frozenset([id(e.param) for e in order] +
                               [id(p) for _, p in self.untrained + self.waiting])
        self._structure = None
        self._allocate()
        self.chunks, self.launches = self._work_list()

    def device_scope(self):
        return on_device(self)

    def _allocate(self):
        xp = self.xp
        with on_device(self):
            self.params = [_zeros(xp, self.sizes[g], DTYPES[g]) for g in range(len(DTYPES))]
            self.momentum = [_zeros(xp, self.sizes[g], STATE_DTYPES[g])
                             for g in range(len(DTYPES))]
            self.master = _zeros(xp, self.sizes[F16], numpy.float32)
            # each parameter's loss-scale divisor, in a step whose gradients carry several
            self.divisors = _zeros(xp, len(self.entries), numpy.float64)
            for e in self.entries:
                sl = slice(e.offset, e.offset + e.size)
                state = e.param.update_rule._state or {}
                e.view = self.params[e.group][sl].reshape(e.shape)
                e.view[...] = e.param.array
                e.param.array = e.view
                e.v = self.momentum[e.group][sl].reshape(e.shape)
                _adopt(e, 'v', e.v, state.get('v'), xp)
                new_state = {'v': e.v}
                if e.group == F16:
                    e.master = self.master[sl].reshape(e.shape)
                    e.master[...] = e.view
                    _adopt(e, 'master', e.master, state.get('master'), xp)
                    new_state['master'] = e.master
                else:
                    e.master = None
                e.param.update_rule._state = FlatState(new_state)

    def _work_list(self):
        """The chunk table and the launches: [(first chunk, chunk count, first entry, entries)]."""
        rows, launches = [], []
        for first in range(0, len(self.entries), GRAD_TABLE):
            batch = self.entries[first:first + GRAD_TABLE]
            start = len(rows)
            for j, e in enumerate(batch):
                bits = j | (e.group << 16) | ((first + j) << 32)
                for inner in range(0, e.size, CHUNK):
                    rows.append((e.offset + inner, inner, min(CHUNK, e.size - inner), bits))
            launches.append((start, len(rows) - start, first, len(batch)))
        table = numpy.array(rows, dtype=numpy.int64).reshape(-1, 4)
        with on_device(self):
            return self.xp.asarray(table), launches

    @property
    def num_chunks(self):
        return int(self.chunks.shape[0])

    def grad_buffers(self):
        """Zeroed flat gradient buffers with the parameters' layout, and a view per entry."""
        with on_device(self):
            bufs = [_zeros(self.xp, self.sizes[g], DTYPES[g]) for g in range(len(DTYPES))]
            views = [bufs[e.group][e.offset:e.offset + e.size].reshape(e.shape)
                     for e in self.entries]
        return bufs, views

    def stale(self):
        """Why the buffers no longer fit the parameters they were built from (a parameter's
        array replaced, retyped or moved; its update rule replaced or set to None; a waiting
        parameter initialized), or None. Cheap: two identity tests per parameter."""
        for e in self.entries:
            if e.param.raw_array is not e.view:
                return ('parameter {} was given a new array after setup() (a new value, dtype '
                        'or device)'.format(e.name))
            if e.param.update_rule is not e.rule:
                return 'the update rule of parameter {} was {}'.format(
                    e.name, 'set to None' if e.param.update_rule is None else 'replaced')
        for name, p in self.untrained:
            if p.update_rule is not None:
                return 'parameter {} was given an update rule'.format(name)
        for name, p in self.waiting:
            if p.raw_array is not None:
                return 'parameter {} was initialized (a lazy link called for the first time)' \
                    .format(name)
        return None

    def changed(self, target):
        """Why the parameters of ``target`` are no longer those the buffers were built from (a
        link or Parameter added, deleted or replaced), or None. Identity tests while the model's
        structure is unchanged; a walk of its parameters when it changed."""
        shape = self._structure
        if shape is not None and shape.roots == (target,) and shape.same():
            return None
        now = unique_params(target.namedparams())
        ids = {id(p) for _, p in now}
        if ids == self.known:
            self._structure = _structure.Structure(target)
            return None
        gone = [e.name for e in self.entries if id(e.param) not in ids]
        new = [name for name, p in now if id(p) not in self.known]
        return 'the model {}'.format(' and '.join(
            ['no longer holds parameter(s) {}'.format(', '.join(gone))] * bool(gone)
            + ['holds new parameter(s) {}'.format(', '.join(new))] * bool(new)))

    def untrained_grads(self):
        """(param, grad) of the target's parameters without an update rule that have a
        gradient (optimizer hooks read them, as GradientClipping's norm does)."""
        return [(p, p.grad) for _, p in self.untrained if p.grad is not None]

    def grads(self, contiguous=True, copied=None):
        """Each parameter's gradient (None where there is none), C-contiguous unless
        ``contiguous`` is False (a gradient that is a transposed or broadcast view stays one).
        Chainer already guarantees that a gradient has its parameter's dtype and shape.
        ``copied``: a list given (index, gradient) of each gradient replaced by a copy."""
        out = []
        xp = self.xp
        for i, e in enumerate(self.entries):
            g = e.param.grad
            if contiguous and g is not None and not g.flags.c_contiguous:
                if copied is not None:
                    copied.append((i, g))
                g = xp.ascontiguousarray(g)
            out.append(g)
        return out


class FlatState(dict):
    """An update rule's ``state`` whose arrays are views of the flat buffers.

    Chainer's rules update whatever array ``state['v']`` holds, so assigning one (a momentum
    reset: ``state['v'] = zeros``) takes effect. Here the view stays and the assigned values are
    copied into it (any device, castable dtype; the shape must match). Removing a key is refused:
    the flat buffers would still update it."""

    __slots__ = ()

    def __setitem__(self, key, value):
        view = self.get(key)
        if view is None or value is view:
            dict.__setitem__(self, key, value)
            return
        if value is None or not hasattr(value, 'shape'):
            raise TypeError('update_rule.state[{!r}] must be an array of shape {}; got {!r}'
                            .format(key, tuple(view.shape), value))
        if tuple(value.shape) != tuple(view.shape):
            raise ValueError('update_rule.state[{!r}] has shape {}; the array assigned has shape '
                             '{}'.format(key, tuple(view.shape), tuple(value.shape)))
        if isinstance(view, numpy.ndarray):
            view[...] = value if isinstance(value, numpy.ndarray) else value.get()
        else:
            with view.device:
                view[...] = _array_module(view).asarray(value)

    def update(self, *args, **kwargs):
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def __ior__(self, other):
        self.update(other)
        return self

    def _refuse(self, *args):
        raise TypeError(
            'the update rule state of chainer_tc.optimizers.MomentumSGD keeps its keys (its '
            "arrays are views of the optimizer's flat buffers); reset a value in place, "
            "state['v'][...] = 0, or assign a new array, state['v'] = array")

    __delitem__ = pop = popitem = clear = _refuse

    def __reduce__(self):          # pickles and copies as the plain dict Chainer's rules hold
        return dict, (dict(self),)


def _no_decay(param):
    try:
        return float(param.update_rule.hyperparam.weight_decay) == 0
    except AttributeError:
        return False


def _adopt(e, key, dst, src, xp):
    """Copy a rule's existing state array into its flat view (any device, castable dtype)."""
    if src is None or src is dst:
        return
    if tuple(src.shape) != tuple(e.shape):
        raise ValueError('parameter {}: its update rule state {!r} has shape {}, the parameter '
                         '{}'.format(e.name, key, tuple(src.shape), tuple(e.shape)))
    if xp is numpy:
        src = src if isinstance(src, numpy.ndarray) else src.get()
    else:
        src = xp.asarray(src)
    dst[...] = src


def _zeros(xp, n, dtype):
    """Zeros starting 256-byte aligned (CuPy's allocations already are; NumPy's are not)."""
    if xp is not numpy:
        return xp.zeros(n, dtype)
    dtype = numpy.dtype(dtype)
    raw = numpy.zeros(n + 256 // dtype.itemsize, dtype)
    skip = (-raw.ctypes.data % 256) // dtype.itemsize
    return raw[skip:skip + n]


def _array_module(array):
    if isinstance(array, numpy.ndarray):
        return numpy
    import cupy
    return cupy


class on_device:
    """``with on_device(flat):`` makes the flat buffers' GPU current (nothing on the CPU)."""

    def __init__(self, flat):
        self._ctx = None
        if flat.device.startswith('gpu:'):
            import cupy
            self._ctx = cupy.cuda.Device(int(flat.device[4:]))

    def __enter__(self):
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc):
        if self._ctx is not None:
            self._ctx.__exit__(*exc)

