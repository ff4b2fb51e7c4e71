"""Recording one eager training step at the level of the array computations Chainer makes.

Every ``FunctionNode.apply`` of the step, forward and backward alike (Chainer's backward applies
FunctionNodes too, gradient sums included), reaches :class:`Recorder.forward_preprocess`. For
each outermost application (an apply made inside another node's forward belongs to that forward)
the recorder keeps:

- the node, and a shallow copy of its attributes just before ``forward`` ran (``pre``), so that a
  replay can put the node back in the state in which it computed;
- the input arrays and the output arrays, by identity;
- the arrays (and numbers: NumPy scalars, Python floats) the node kept in its attributes after
  ``forward``
  (``post``): a replay refreshes them, so a gradient node built later from them
  (``ReLUGrad2(y)``, ``BatchNormalizationGrad(mean, inv_std)``, ``softmax_cross_entropy``'s
  ``1 / count`` of the labels not ignored) sees this step's values;
- Chainer's thread-local configuration at that moment (``train``, ``enable_backprop``, ...).

Two array computations Chainer makes outside ``FunctionNode.forward`` are recorded as ops too, so
that a replay redoes them instead of reading a stale array:

- the ``backward`` of an old-style ``chainer.Function`` (``F.hinge``, ``L.BatchRenormalization``,
  a user's own Function): it computes the input gradients on arrays, in Python;
- the cast of an array operand to the other operand's dtype in Chainer's arithmetic operators
  (``gy * mask`` with a boolean mask: ``F.zoneout``'s backward, a user's integer mask).

Reports (``chainer.report`` and reporters' ``report``) made during the step are recorded too.
Nothing here changes what the step computes: a recorded step is an eager step.
"""
import contextlib
import threading
import zlib

import numpy

import chainer
from chainer import configuration
from chainer import function as chainer_function
from chainer import reporter as reporter_module
from chainer.functions.math import basic_math

from chainer_tc.cuda import runtime
from chainer_tc.static_graph import _site

_ARRAY_TYPES = None


def array_types():
    global _ARRAY_TYPES
    if _ARRAY_TYPES is None:
        _ARRAY_TYPES = chainer.get_array_types()
    return _ARRAY_TYPES


class Op:
    """One recorded outermost ``FunctionNode.forward``."""

    __slots__ = ('node', 'state', 'pre', 'inputs', 'outputs', 'post', 'config', 'overwritten',
                 'site')

    def __init__(self, node, inputs, config, site=None):
        self.node = node
        # the object whose attributes forward() uses: an old-style Function keeps them itself
        self.state = node._function if isinstance(
            node, (chainer_function.FunctionAdapter, OldStyleBackward)) else node
        self.pre = dict(self.state.__dict__)
        self.inputs = tuple(inputs)
        self.outputs = None
        self.post = None
        self.config = config
        self.overwritten = ()     # (input index, its value before the op wrote into it)
        self.site = site          # where the loss function made it (_site.here())

    @property
    def label(self):
        return self.node.label


class OldStyleBackward:
    """The ``backward`` of an old-style ``chainer.Function`` as an op: ``forward(inputs)`` is
    ``function.backward(inputs[:n], inputs[n:])``, the input arrays (None where not retained)
    then the output gradients (None where there is none)."""

    def __init__(self, function, n_inputs):
        self._function = function
        self.n_inputs = n_inputs

    @property
    def label(self):
        return '{} (backward)'.format(self._function.label)

    def forward(self, inputs):
        n = self.n_inputs
        return tuple(self._function.backward(tuple(inputs[:n]), tuple(inputs[n:])))


class Cast:
    """``array.astype(dtype)`` as an op: the cast of an array operand in Chainer's arithmetic
    operators (``basic_math._preprocess_rhs``)."""

    def __init__(self, dtype):
        self.dtype = dtype

    @property
    def label(self):
        return 'astype({})'.format(self.dtype)

    def forward(self, inputs):
        return inputs[0].astype(self.dtype),


class Trace:
    """What one recorded step did: the ops in order, the reports, the loss and the gradients."""

    def __init__(self):
        self.ops = []
        self.reports = []          # (values dict, observer, where: None or (reporter, dict))
        self.loss = None           # the loss Variable's array
        self.grads = None          # per optimizer entry: its gradient array or None
        self.inputs = None         # the step's input buffers
        self.externals = None      # the arrays refreshed in place elsewhere (TrainStep's list)
        self.marks = None          # per optimizer entry: its parameter's _loss_scale then
        self.python_gradients = []  # Chainer functions whose backward computes in Python
        self.written = []          # inputs and parameters written in place outside the ops
        self.leftover_grads = {}   # id of a gradient the backward adds to -> its parameter
        self.untrained_grads = []  # (param, grad) of the target's parameters without a rule
        self.constants = {}        # id -> array an op read that no op made, no external
        self.exchanges = None      # (multinode.TrainStep) the host exchanges its functions made
        self.outer = None          # Recorder.outer while TrainStep needs it (detach_reports)


class _Patches:
    """``Reporter.report`` and Chainer's operand cast (``basic_math._preprocess_rhs``), replaced
    while any thread records, by functions that tell the calling thread's innermost recorder
    (if any) and then do what the originals do."""

    def __init__(self):
        self._lock = threading.Lock()
        self._count = 0
        self._local = threading.local()
        self._originals = None

    def current(self):
        stack = getattr(self._local, 'stack', None)
        return stack[-1] if stack else None

    def enter(self, recorder):
        stack = self._local.__dict__.setdefault('stack', [])
        stack.append(recorder)
        with self._lock:
            if self._count == 0:
                self._install()
            self._count += 1

    def exit(self, recorder):
        self._local.stack.remove(recorder)
        with self._lock:
            self._count -= 1
            if self._count == 0:
                reporter_module.Reporter.report, basic_math._preprocess_rhs = self._originals

    def _install(self):
        report, preprocess_rhs = self._originals = (reporter_module.Reporter.report,
                                                    basic_math._preprocess_rhs)
        current = self.current

        def recorded_report(reporter, values, observer=None):
            rec = current()
            if rec is not None:
                rec.on_report(reporter, values, observer)
            return report(reporter, values, observer)

        def recorded_rhs(x, value):
            out = preprocess_rhs(x, value)
            rec = current()
            if rec is not None:
                rec.on_cast(value, out)
            return out
        reporter_module.Reporter.report = recorded_report
        basic_math._preprocess_rhs = recorded_rhs


_patches = _Patches()


class Recorder(chainer.FunctionHook):
    """``with Recorder() as rec:`` records every outermost FunctionNode applied, and the reports."""

    name = 'chainer_tc_static_graph_recorder'

    def __init__(self, externals=None, watch=(), persistents=()):
        self.trace = Trace()
        self._depth = 0
        self._last_config = None
        self.outer = None
        self._installed = []        # old-style Functions given a recording backward
        self._sites = {}            # id of an old-style Function -> where its forward was made
        self._scanned = {}          # (_site.here's, while recording: the frames it scanned)
        # With ``externals`` (the arrays refreshed in place elsewhere: inputs, parameters,
        # state), the arrays ops read that no earlier op made and that are no external are
        # kept (Trace.constants); ``watch``, those of an earlier recorded step, are copied
        # when this step begins, and one an op reads with other values was written in the
        # step, in Python (a one-hot target the loss function keeps and refills in place):
        # the same object in every recorded step, so comparing two steps cannot see it. One
        # changed between steps, by code outside the step (another model's optimizer), is
        # read as it is, as a replay reads it.
        self._known = None if externals is None else {id(a) for a in externals}
        self._learned = 0           # ops whose results are in _known
        self._watch = {id(a): a.copy() for a in watch}     # (the arrays: held by that step)
        self._read = {}             # id of a watched constant -> (array, who first read it)
        # ``persistents``: (name, array, its value when the step began) of the model's
        # persistent arrays. One first handed to a function with another value was written
        # before, in Python (a class weight the loss function refills): a replay would hand
        # the function the recorded value. (Functions that update one, BatchNormalization its
        # running statistics, are handed it first: what it holds after is theirs.)
        self._unhanded = {id(a): (name, a, before) for name, a, before in persistents}
        self.stale = set()          # ids of those found written so (by finish())
        self.differences = Differences()    # comparisons finish() reads
        # the NumPy results of the forward's functions, each with a checksum (a recorded step
        # on the CPU: a CUDA graph captures the loss function's own array work, a CPU replay
        # does not run it): one written into in Python before the backward (numpy.clip(y.array,
        # ..., out=y.array), loss.array *= 2) would be recomputed by a replay without the write
        self._results = [] if externals is not None else None

    def __enter__(self):
        super().__enter__()
        reporters = reporter_module._get_reporters()
        # reports to the reporter and observation current when the step began (a Trainer's,
        # each iteration's) go to the current ones on replay; others to where they went
        self.outer = (reporters[-1], reporters[-1].observation) if reporters else (None, None)
        _patches.enter(self)
        return self

    def __exit__(self, *exc):
        self._scanned.clear()
        _patches.exit(self)
        for f in self._installed:           # a backward that never ran (an error before it)
            f.__dict__.pop('backward', None)
        return super().__exit__(*exc)

    def on_report(self, reporter, values, observer):
        here = (reporter, reporter.observation)
        outer = self.outer
        where = None if here[0] is outer[0] and here[1] is outer[1] else here
        self.trace.reports.append((dict(values), observer, where))

    def on_cast(self, value, out):
        if out is not value and not self._depth and isinstance(value, array_types()):
            op = Op(Cast(out.dtype), (value,), self._config())
            op.outputs, op.post = (out,), {}
            self.trace.ops.append(op)

    def _config(self):
        snap = dict(configuration.config._local.__dict__)
        last = self._last_config
        if last is not None and snap.keys() == last.keys() and all(
                snap[k] is last[k] for k in snap):
            return None                 # unchanged since the previous op: nothing to set
        self._last_config = snap        # (by identity: a value may be an array)
        return snap

    def forward_preprocess(self, function, in_data):
        if self._depth:
            return
        op = Op(function, in_data, self._config())
        self.trace.ops.append(op)
        index = len(self.trace.ops) - 1
        candidates = None
        if self._known is not None:
            self._constants(op)
            constants = self.trace.constants
            candidates = [k for k, a in enumerate(in_data) if id(a) in constants]
        op.site = _site.here(in_data, op.label, candidates, self._scanned)
        if isinstance(function, chainer_function.FunctionAdapter):
            self._sites[id(function._function)] = op.site     # for its backward's op
        if self._unhanded:
            self._handed(op)
        # watched constants read earlier and unchanged since: one the forward changes is state
        # the function updates in place
        kept = [a for a in _arrays_of(op) if id(a) in self._read
                and same_bits(a, self._watch[id(a)])] if self._read else ()
        forward = function.forward
        recorder = self

        def recording_forward(inputs):
            recorder._depth += 1
            try:
                outputs = forward(inputs)
            except BaseException:
                # a function that raised made nothing, and code that goes on caught it
                # (iterating over a Variable ends with GetItem's IndexError): not in the step
                ops = recorder.trace.ops
                if ops and ops[-1] is op:
                    ops.pop()
                raise
            finally:
                recorder._depth -= 1
                function.__dict__.pop('forward', None)
            op.outputs = tuple(outputs)
            op.post = _kept_values(op.state)
            for a in kept:
                recorder._updated(a)
            if recorder._results is not None:
                recorder._results.extend((y, _checksum(y), op, index) for y in op.outputs
                                         if type(y) is numpy.ndarray)
            return outputs

        function.__dict__['forward'] = recording_forward

    def _constants(self, op):
        """The arrays ``op`` reads (its inputs, and arrays among its attributes, in tuples
        and lists too) that no earlier op made and are no external or view of one: kept, and
        where watched, compared with their values when the step began."""
        known, constants, ops = self._known, self.trace.constants, self.trace.ops
        for done in ops[self._learned:-1]:      # they ran: what they made is no constant
            known.update(id(y) for y in done.outputs or ())
            known.update(id(v) for v in (done.post or {}).values())
        self._learned = len(ops) - 1
        arrays = array_types()
        found = list(op.inputs)
        for v in op.pre.values():
            if isinstance(v, (tuple, list)):
                found.extend(v)
            else:
                found.append(v)
        for a in found:
            if not isinstance(a, arrays) or id(a) in constants:
                continue
            b = a
            while b is not None and id(b) not in known:
                b = getattr(b, 'base', None)
            if b is not None:
                continue
            constants[id(a)] = a
            before = self._watch.get(id(a))
            if before is None:
                continue
            reader = 'an array function #{} ({}) reads (shape {})'.format(
                len(ops) - 1, op.label, a.shape)
            if not same_bits(a, before):
                self.trace.written.append(reader)
            else:
                self._read[id(a)] = (a, reader)

    def _updated(self, a):
        """After a function's forward: a watched constant it was handed, unchanged until then,
        that it changed is state the function updates in place (running statistics given to
        ``F.batch_normalization`` as plain arrays), which a replay updates too: watched from
        its new value on."""
        if not same_bits(a, self._watch[id(a)]):
            self._watch[id(a)] = a.copy()

    def _handed(self, op):
        """A persistent array handed to ``op`` for the first time in this step: it must hold
        its value from when the step began."""
        for a in _arrays_of(op):
            entry = self._unhanded.pop(id(a), None)
            if entry is not None:      # (read by finish(): stale, and written)
                self.differences.compare(a, entry[2], (
                    'handed', id(a), entry[0], len(self.trace.ops) - 1, op.label))

    def forward_done(self):
        """Between the forward and the backward: a result of a function (this step's, on the
        CPU) that no longer holds what the function computed was written into in Python."""
        results, self._results = self._results, None
        for y, checksum, op, index in results or ():
            if _checksum(y) != checksum:
                self.trace.written.append('the result of function #{} ({}) (shape {})'.format(
                    index, op.label, y.shape))

    def finish(self, others=()):
        """At the end of the step: a watched constant a function read, changed after that by
        no function (a queue the loss function fills after using it, a teacher model's
        weights averaged in Python), which a replay would leave as it was; a persistent array
        that held another value when a function was first handed it (:meth:`_handed`). Those
        comparisons, and the caller's ``others`` (``(tag, a, b)``), are read back together
        (:class:`Differences`): returns the tags of the ``others`` that differ."""
        for a, reader in self._read.values():
            self.differences.compare(a, self._watch[id(a)], ('read', reader))
        for tag, a, b in others:
            self.differences.compare(a, b, ('other', tag))
        theirs = []
        for found in self.differences.found():
            if found[0] == 'handed':
                _, i, name, index, label = found
                self.stale.add(i)
                self.trace.written.append('{} before function #{} ({}) read it'.format(
                    name, index, label))
            elif found[0] == 'read':
                self.trace.written.append(found[1] + ', after it read it')
            else:
                theirs.append(found[1])
        return theirs

    def backward_preprocess(self, function, in_data, out_grad):
        if self._depth:
            return
        name = python_gradient(function)
        if name is not None:
            self.trace.python_gradients.append(name)
        if not isinstance(function, chainer_function.FunctionAdapter):
            return
        old_style = function._function
        backward = old_style.backward
        recorder = self

        def recording_backward(inputs, grad_outputs):
            old_style.__dict__.pop('backward', None)      # before the attributes are copied
            op = Op(OldStyleBackward(old_style, len(inputs)), tuple(inputs) + tuple(grad_outputs),
                    recorder._config(), _site.of_backward(recorder._sites.get(id(old_style))))
            recorder.trace.ops.append(op)
            if recorder._known is not None:
                recorder._constants(op)
            # an old-style backward may write into its arrays (F.hinge: gloss /= len(t)); the
            # CPU replay puts a constant made anew each step back at the start of each replay
            # (_program.Program._restores). Not checked under a CUDA graph
            # capture (comparing would synchronise): an array made inside the graph (the
            # initial gradient) is made again by each launch, but one made before the capture
            # would be written into again at every launch (not detected)
            capturing = _capturing(op.inputs)
            before = [None if a is None or capturing else a.copy() for a in op.inputs]
            recorder._depth += 1
            try:
                gxs = backward(inputs, grad_outputs)
            finally:
                recorder._depth -= 1
            # None: not known (captured), as opposed to () (nothing written)
            op.overwritten = None if capturing else tuple(
                (k, b) for k, (a, b) in enumerate(zip(op.inputs, before))
                if b is not None and not same_bits(a, b))
            if recorder._known is not None:
                for k, _ in op.overwritten or ():   # state a recorded op updates, no constant
                    recorder._known.add(id(op.inputs[k]))
                    recorder.trace.constants.pop(id(op.inputs[k]), None)
            op.outputs = tuple(gxs)
            op.post = _kept_values(op.state)
            return gxs

        old_style.__dict__['backward'] = recording_backward
        self._installed.append(old_style)

    def backward_postprocess(self, function, in_data, out_grad):
        if isinstance(function, chainer_function.FunctionAdapter):
            function._function.__dict__.pop('backward', None)   # if it never ran


_PYTHON_GRADIENTS = None


def detach_reports(reports, outer):
    """Each value a recorded step reported (``reports``: its trace's; ``outer``: the reporter
    and observation current when it began, ``Recorder.outer``) is, where the reporter stored
    it, replaced by a copy (a Variable by a new Variable). The step whose trace becomes the
    replay (a CUDA graph's capture, the CPU's second recorded step) reported the arrays every
    later replay overwrites, so an observation kept from that step (a user's list of
    observations, an extension reading it later) would change under it. An eager step leaves
    arrays of its own; so does this one. Reporters store the values or shallow copies of the
    Variables (sharing the array), so they are found by array."""
    types = array_types()
    for values, _, where in reports:
        observation = (where or outer)[1]
        if observation is None:
            continue
        reported = set()
        for v in values.values():
            a = v.raw_array if isinstance(v, chainer.Variable) else v
            if isinstance(a, types):
                reported.add(id(a))
        for key, v in list(observation.items()):
            if isinstance(v, chainer.Variable):
                if id(v.raw_array) in reported:
                    observation[key] = chainer.Variable(v.raw_array.copy(), requires_grad=False)
            elif id(v) in reported:
                observation[key] = v.copy()


def python_gradient(function):
    """The name of the Chainer function ``function`` is, if its ``backward`` computes an array
    from the data in Python (a mask ``x >= y``, a sign) rather than in a FunctionNode: no op
    records that array, so a replay would reuse the recorded step's. Else None.

    Found by reading Chainer 7.8.1's ``backward`` methods (and the gradient nodes they build)
    for array arithmetic on ``.data``/``.array``: ``F.clip`` and ``F.maximum``/``F.minimum``
    (``ClipGrad``/``MaximumGrad``/``MinimumGrad`` compute their mask in ``__init__``),
    ``F.max``/``F.min`` (so ``F.maxout``, ``L.Maxout``), ``F.crelu``, ``F.absolute_error``,
    ``F.mean_absolute_error``, ``F.contrastive``, ``F.triplet`` and ``F.normalize``; and the
    second derivative of ``F.batch_normalization`` (found by review: the refusal named an
    array instead)."""
    global _PYTHON_GRADIENTS
    if _PYTHON_GRADIENTS is None:
        from chainer.functions.activation import crelu
        from chainer.functions.loss import absolute_error, contrastive, mean_absolute_error
        from chainer.functions.loss import triplet
        from chainer.functions.math import clip, maximum, minimum, minmax
        from chainer.functions.normalization import batch_normalization
        from chainer.functions.normalization import l2_normalization
        _PYTHON_GRADIENTS = {
            # its backward (a second derivative: a gradient penalty through BatchNormalization)
            # uses arrays its forward's gradient node computed in Python
            batch_normalization.BatchNormalizationGrad:
                'F.batch_normalization (L.BatchNormalization) differentiated twice',
            clip.Clip: 'F.clip', maximum.Maximum: 'F.maximum', minimum.Minimum: 'F.minimum',
            minmax.Max: 'F.max (also inside F.maxout and L.Maxout)', minmax.Min: 'F.min',
            crelu.CReLU: 'F.crelu', absolute_error.AbsoluteError: 'F.absolute_error',
            mean_absolute_error.MeanAbsoluteError: 'F.mean_absolute_error',
            contrastive.Contrastive: 'F.contrastive', triplet.Triplet: 'F.triplet',
            l2_normalization.NormalizeL2: 'F.normalize'}
    return _PYTHON_GRADIENTS.get(type(function))


def leftover_grads(loss):
    """The gradients the backward from ``loss`` will add to, after the optimizer cleared its
    own: {id of the array: 'parameter W of shape (8, 6)'}, for the leaf variables of the
    graph that hold one (a parameter the step does not train, such as another model's)."""
    out = {}
    seen = set()
    stack = [loss.node]
    while stack:
        node = stack.pop()
        creator = node.creator_node
        if creator is not None:
            for x in creator.inputs:
                if id(x) not in seen:
                    seen.add(id(x))
                    stack.append(x)
            continue
        v = node.get_variable_or_none()
        g = None if v is None else v.grad
        if g is not None:
            out[id(g)] = '{} {} of shape {}'.format(
                'parameter' if isinstance(v, chainer.Parameter) else 'variable',
                v.name or '(unnamed)', tuple(v.shape))
    return out


def _capturing(arrays):
    return any(a is not None and type(a).__module__.startswith('cupy') for a in arrays) \
        and runtime.is_capturing()


def _checksum(a):
    """A checksum of a NumPy array's values (CRC-32 of its bytes, read in place when it is
    contiguous)."""
    data = a if a.flags.c_contiguous else numpy.ascontiguousarray(a)
    return zlib.crc32(memoryview(data.reshape(-1)).cast('B'))


def _arrays_of(op):
    """The arrays ``op`` is handed: its inputs, and its attributes' (in tuples and lists)."""
    arrays = array_types()
    for v in list(op.inputs) + list(op.pre.values()):
        for a in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(a, arrays):
                yield a


def same_bits(a, b):
    """Whether ``a`` and ``b`` (one shape and dtype) hold the same bits (so NaNs and the sign
    of zeros too); NumPy arrays by their bytes (one comparison, no temporaries)."""
    return not changed(((a, b),))


def changed(pairs):
    """The indices of the ``(a, b)`` pairs (each of one shape and dtype) whose bits differ, in
    order (:class:`Differences`: device arrays read back with one copy)."""
    differences = Differences()
    for i, (a, b) in enumerate(pairs):
        differences.compare(a, b, i)
    return differences.found()


class Differences:
    """Bit comparisons made at moments of a step, read when it ends. NumPy arrays compare at
    once, by their bytes. Device arrays compare where they live, in stream order, so each
    comparison sees the values of its moment (a running mean before the BatchNorm that
    updates it), and :meth:`found` reads all of them back with one copy per device: one
    synchronisation for a recorded step, not one per comparison (a check step compares every
    parameter with its value when the step began, and each persistent array when a function
    is first handed it: 106 of them in ResNet-50)."""

    def __init__(self):
        self._tags = []           # what each comparison was, in order
        self._found = []          # indices of those found to differ (NumPy)
        self._pending = []        # (index, 0-d device bool: whether they differ)

    def compare(self, a, b, tag):
        """Compare ``a`` with ``b`` (one shape and dtype) now; ``tag`` names the pair."""
        k = len(self._tags)
        self._tags.append(tag)
        if type(a) is numpy.ndarray and type(b) is numpy.ndarray:
            if a.tobytes() != b.tobytes():
                self._found.append(k)
        else:
            cuda = getattr(chainer.backend.get_array_module(a), 'cuda', None)
            # (where it was queued; None for a NumPy array standing in for a device array)
            stream = None if cuda is None else cuda.get_current_stream()
            self._pending.append((k, _differ_on_device(a, b), stream))

    def found(self):
        """The tags of the pairs whose bits differ, in the order they were compared; the
        comparisons are then forgotten. One copy back per device; a comparison queued on
        another stream (a loss function may switch streams) is waited for first."""
        tags, out, pending = self._tags, list(self._found), self._pending
        self.__init__()
        devices = {}
        for k, flag, stream in pending:
            device = None if stream is None else flag.device
            devices.setdefault(None if device is None else device.id, (device, []))[1].append(
                (k, flag, stream))
        for device, group in devices.values():
            with device if device is not None else contextlib.nullcontext():
                xp = chainer.backend.get_array_module(group[0][1])
                if device is not None:
                    here = xp.cuda.get_current_stream()
                    for stream in {s.ptr: s for _, _, s in group}.values():
                        if stream.ptr != here.ptr:
                            here.wait_event(stream.record())
                flags = chainer.backend.CpuDevice().send(
                    xp.concatenate([f.reshape(1) for _, f, _ in group]))
            out += [k for (k, _, _), f in zip(group, flags) if f]
        return [tags[k] for k in sorted(out)]


def _differ_on_device(a, b):
    """A 0-d device bool: whether ``a`` and ``b`` differ in any bit (no synchronisation)."""
    if a.dtype.kind == 'c':             # (CuPy 14's array_equal synchronises)
        return _differ_on_device(a.real, b.real) | _differ_on_device(a.imag, b.imag)
    if a.dtype.kind not in 'biuf' or a.dtype.itemsize not in (1, 2, 4, 8):
        xp = chainer.backend.get_array_module(a)      # (no other kind expected: values)
        return xp.asarray(not bool(xp.array_equal(a, b)))
    bits = numpy.dtype('u{}'.format(a.dtype.itemsize))
    return (a.view(bits) != b.view(bits)).any()


def _kept_values(state):
    """The attributes a forward may compute for a gradient node to read: arrays, numbers
    (``softmax_cross_entropy``'s ``1 / count``, a NumPy scalar) and helper objects holding
    arrays."""
    return {k: v for k, v in state.__dict__.items()
            if isinstance(v, array_types()) or number(v) or _holds_arrays(v)}


def number(v):
    """A number a forward computes, followed by identity like an array: a NumPy scalar or a
    Python float (a new object each time one is computed, so an attribute holding the same
    object was handed it). Not a NumPy bool, whose two values are shared objects
    (``numpy.True_``) that unrelated attributes may hold too; not a Python int or bool, which
    CPython shares as well (small ints are cached)."""
    return (isinstance(v, numpy.generic) and not isinstance(v, numpy.bool_)) or \
        type(v) is float


def _holds_arrays(v):
    """A plain helper object (not a node or Variable) with arrays among its attributes."""
    d = getattr(v, '__dict__', None)
    if d is None or isinstance(v, (type, chainer.FunctionNode, chainer.Function,
                                   chainer.Variable)):
        return False
    return any(isinstance(x, array_types()) for x in d.values())
