"""Where a recorded function was made, for the messages of a refused replay: the library
function or link method the loss function called (Chainer's, ChainerMN's or chainer_tc's), and
the line of the user's code that called it.

A refusal names a FunctionNode by its label (``SelectItem``, ``EmbedIDFunction``), which a user
never called: ``F.softmax_cross_entropy(..., enable_double_backprop=True)`` or ``L.CRF1d`` made
it, and what they compute from the data with NumPy is what a replay cannot redo. Found by an
audit (the message told the user to compute the input with Chainer functions, which the user's
code already did).

One walk of the Python stack per recorded forward (recorded steps only, never a replay): code
objects and line numbers are kept, not frames (which would keep every local alive).
"""
import os
import sys

import chainer

_PACKAGES = os.path.dirname(os.path.dirname(os.path.abspath(chainer.__file__)))
_CHAINER = os.path.join(_PACKAGES, 'chainer') + os.sep
_TC = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LIBRARIES = (_CHAINER, os.path.join(_PACKAGES, 'chainermn') + os.sep, _TC)
_STEP = os.path.join(_TC, 'static_graph') + os.sep
# the step's own code, which called the loss function (or the backward): the walk ends there
_DRIVERS = frozenset(os.path.join(_STEP, name) for name in ('step.py', '_capture.py'))
# frames that dispatch a call rather than say what was called: a link's __call__, apply(),
# a Variable's operators and properties (and the step's routes of Chainer's calls, in _STEP)
_MACHINERY = frozenset(os.path.join(_CHAINER, name) for name in (
    'function_node.py', 'function.py', 'link.py', 'variable.py', 'sequential.py'))
_BACKWARD = os.path.join(_CHAINER, '_backprop_utils.py')
_MAX_FRAMES = 200

# what a library function computes from the data in Python, for each one known to (by the
# function's name and the label of the node that reads it): why a step calling it cannot be
# replayed, and what can
KNOWN = {
    ('softmax_cross_entropy', 'SelectItem'):
        "F.softmax_cross_entropy(..., enable_double_backprop=True) selects the labels' scores "
        'with indices it computes with NumPy; the default, enable_double_backprop=False, '
        'replays',
    ('crf1d', 'EmbedIDFunction'):
        "F.crf1d (and L.CRF1d) computes the transitions' indices from the labels with NumPy",
}


class Site:
    """Where a FunctionNode was made (see :func:`here`)."""

    __slots__ = ('api', 'path', 'line', 'function', 'handed', 'known', 'known_handed',
                 'backward')

    def __init__(self, api=None, path=None, line=None, function=None, handed=None, known=None,
                 known_handed=None, backward=False):
        self.api = api              # the outermost library function's code object, or None
        self.path, self.line, self.function = path, line, function     # the user's call
        self.handed = handed        # {input index: whether the caller handed it to ``api``}
        self.known = known          # the innermost library function listed in KNOWN, or None
        self.known_handed = known_handed        # the same as ``handed``, for ``known``
        self.backward = backward    # made by Chainer's backward pass (a gradient's function)

    def computed_inside(self, k):
        """Whether the node's input ``k`` is known to be computed inside the library function
        ``api`` (not one of the arrays or Variables its caller handed to it)."""
        return self.api is not None and self.handed is not None and \
            self.handed.get(k) is False

    def known_note(self, k, label):
        """What KNOWN says of the library function that computed input ``k`` inside, or None."""
        if self.known is None or self.known_handed is None or \
                self.known_handed.get(k) is not False:
            return None
        return KNOWN.get((_name(self.known), label))

    @property
    def api_name(self):
        return None if self.api is None else _name(self.api)

    @property
    def known_name(self):
        return None if self.known is None else _name(self.known)

    def __str__(self):
        if self.backward:
            return 'made by the backward pass'
        parts = []
        if self.api is not None:
            where = self.api.co_filename
            if where.startswith(_PACKAGES + os.sep):
                where = where[len(_PACKAGES) + 1:]
            parts.append('made inside {} ({})'.format(self.api_name, where))
        if self.path is not None:
            parts.append('called at {}:{} (in {})'.format(self.path, self.line, self.function))
        return ', '.join(parts)


def _name(code):
    return getattr(code, 'co_qualname', code.co_name)      # (Python 3.11)


def here(inputs=None, label=None, candidates=None, scanned=None):
    """The :class:`Site` of the FunctionNode being applied now (``inputs``: its input arrays;
    ``label``: its label): the outermost library function or method between the user's code
    and the node (None when the user's code applied it), the innermost call from the user's
    code (None when the loss function is library code itself, a ``L.Classifier`` handed to the
    step), the innermost library function KNOWN lists for this node, and for each input in
    ``candidates`` (indices; None: all) whether it was among the arguments handed to those
    two functions (arrays or Variables, also in a list, tuple or dict). Only the inputs no
    earlier function made need asking (a refusal for an unrecorded input concerns only those),
    and ``scanned`` (a dict the caller keeps while it records, then clears) keeps each call's
    arguments once scanned: scanning them for every node made under one call of a function
    with long list arguments (F.n_step_lstm's) cost time quadratic in their length (found by
    review)."""
    frame = sys._getframe(1)
    api = user = known = None
    for _ in range(_MAX_FRAMES):
        if frame is None:
            break
        code = frame.f_code
        path = code.co_filename
        if path == _BACKWARD:
            return Site(backward=True)
        if path in _DRIVERS:
            break
        if path.startswith(_LIBRARIES):
            if path not in _MACHINERY and not path.startswith(_STEP):
                api = frame
                if known is None and label is not None and (_name(code), label) in KNOWN:
                    known = frame
        else:
            user = frame
            break
        frame = frame.f_back
    if inputs is not None and candidates is None:
        candidates = range(len(inputs))
    asked = inputs is not None and bool(candidates)
    return Site(None if api is None else api.f_code,
                None if user is None else user.f_code.co_filename,
                None if user is None else user.f_lineno,
                None if user is None else user.f_code.co_name,
                _handed(api, inputs, candidates, scanned) if api is not None and asked else None,
                None if known is None else known.f_code,
                _handed(known, inputs, candidates, scanned)
                if known is not None and asked else None)


def of_backward(site):
    """The site of an old-style Function's backward: its forward's, whose inputs are not the
    backward's (so none is known handed)."""
    return None if site is None else Site(site.api, site.path, site.line, site.function,
                                          backward=site.backward)


def _handed(frame, inputs, candidates, scanned=None):
    """{k: whether ``inputs[k]`` is among the arguments of ``frame``'s call} for k in
    ``candidates``; ``scanned``: id of a frame -> (the frame, its arguments' ids), kept by
    the caller (holding the frame, so that its id is not reused meanwhile)."""
    held = None if scanned is None else scanned.get(id(frame))
    if held is not None and held[0] is frame:
        given = held[1]
    else:
        given = _arguments(frame)
        if scanned is not None:
            scanned[id(frame)] = (frame, given)
    return {k: id(inputs[k]) in given for k in candidates}


def _arguments(frame):
    """The ids of the arrays and Variables' arrays among the arguments of ``frame``'s call."""
    code = frame.f_code
    n = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 0x4) + \
        bool(code.co_flags & 0x8)           # (*args, **kwargs)
    local = frame.f_locals
    given = set()
    for name in code.co_varnames[:n]:
        v = local.get(name)
        items = v if isinstance(v, (list, tuple)) else v.values() if isinstance(v, dict) \
            else (v,)
        for x in items:
            given.add(id(x.raw_array if isinstance(x, chainer.Variable) else x))
    return given
