"""Recording one eager training step at the level of the array computations Chainer makes.

Every ``FunctionNode.apply`` of the step, forward and backward alike (Chainer's backward applies
FunctionNodes too, gradient sums included), reaches :class:`Recorder.forward_preprocess`. For
each outermost application (an apply made inside another node's forward belongs to that forward)
the recorder keeps:

- the node, and a shallow copy of its attributes just before ``forward`` ran (``pre``), so that a
  replay can put the node back in the state in which it computed;
- the input arrays and the output arrays, by identity;
- the arrays the node kept in its attributes after ``forward`` (``post``): a replay refreshes
  them in place, so a gradient node built later from them (``ReLUGrad2(y)``,
  ``BatchNormalizationGrad(mean, inv_std)``) sees this step's values;
- Chainer's thread-local configuration at that moment (``train``, ``enable_backprop``, ...).

Reports (``chainer.report`` and reporters' ``report``) made during the step are recorded too.
Nothing here changes what the step computes: a recorded step is an eager step.
"""
import chainer
from chainer import configuration
from chainer import function as chainer_function
from chainer import reporter as reporter_module

_ARRAY_TYPES = None


def array_types():
    global _ARRAY_TYPES
    if _ARRAY_TYPES is None:
        _ARRAY_TYPES = chainer.get_array_types()
    return _ARRAY_TYPES


class Op:
    """One recorded outermost ``FunctionNode.forward``."""

    __slots__ = ('node', 'state', 'pre', 'inputs', 'outputs', 'post', 'config')

    def __init__(self, node, inputs, config):
        self.node = node
        # the object whose attributes forward() uses: an old-style Function keeps them itself
        self.state = node._function if isinstance(node, chainer_function.FunctionAdapter) \
            else node
        self.pre = dict(self.state.__dict__)
        self.inputs = tuple(inputs)
        self.outputs = None
        self.post = None
        self.config = config

    @property
    def label(self):
        return self.node.label


class Trace:
    """What one recorded step did: the ops in order, the reports, the loss and the gradients."""

    def __init__(self):
        self.ops = []
        self.reports = []          # (values dict, observer, where: None or (reporter, dict))
        self.loss = None           # the loss Variable's array
        self.grads = None          # per optimizer entry: its gradient array or None
        self.inputs = None         # the step's input buffers


class Recorder(chainer.FunctionHook):
    """``with Recorder() as rec:`` records every outermost FunctionNode applied, and the reports."""

    name = 'chainer_tc_static_graph_recorder'

    def __init__(self):
        self.trace = Trace()
        self._depth = 0
        self._last_config = None
        self._report = None

    def __enter__(self):
        super().__enter__()
        original = reporter_module.Reporter.report
        trace = self.trace
        reporters = reporter_module._get_reporters()
        outer = (reporters[-1], reporters[-1].observation) if reporters else (None, None)

        def report(reporter, values, observer=None):
            # to the reporter and observation current when the step began (a Trainer's, each
            # iteration's): None, the ones current then; else those the step itself set
            here = (reporter, reporter.observation)
            where = None if here[0] is outer[0] and here[1] is outer[1] else here
            trace.reports.append((dict(values), observer, where))
            return original(reporter, values, observer)

        self._report = original
        reporter_module.Reporter.report = report
        return self

    def __exit__(self, *exc):
        reporter_module.Reporter.report = self._report
        return super().__exit__(*exc)

    def _config(self):
        snap = dict(configuration.config._local.__dict__)
        if snap == self._last_config:
            return None                 # unchanged since the previous op: nothing to set
        self._last_config = snap
        return snap

    def forward_preprocess(self, function, in_data):
        if self._depth:
            return
        op = Op(function, in_data, self._config())
        self.trace.ops.append(op)
        forward = function.forward
        recorder = self

        def recording_forward(inputs):
            recorder._depth += 1
            try:
                outputs = forward(inputs)
            finally:
                recorder._depth -= 1
                function.__dict__.pop('forward', None)
            op.outputs = tuple(outputs)
            op.post = {k: v for k, v in op.state.__dict__.items()
                       if isinstance(v, array_types()) or _holds_arrays(v)}
            return outputs

        function.__dict__['forward'] = recording_forward


def _holds_arrays(v):
    """A plain helper object (not a node or Variable) with arrays among its attributes."""
    d = getattr(v, '__dict__', None)
    if d is None or isinstance(v, (type, chainer.FunctionNode, chainer.Function,
                                   chainer.Variable)):
        return False
    return any(isinstance(x, array_types()) for x in d.values())
