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


class Site:
    """Where a FunctionNode was made (see :func:`here`)."""

    __slots__ = ('api', 'path', 'line', 'function', 'handed', 'backward')

    def __init__(self, api, path, line, function, handed, backward=False):
        self.api = api              # the library function's code object, or None
        self.path, self.line, self.function = path, line, function     # the user's call
        self.handed = handed        # indices of the node's inputs the user's code handed it
        self.backward = backward    # made by Chainer's backward pass (a gradient's function)

    def computed_inside(self, k):
        """Whether the node's input ``k`` was computed inside the library function (not one
        of the arrays or Variables the user's code handed to it)."""
        return self.api is not None and self.handed is not None and k not in self.handed

    @property
    def api_name(self):
        return None if self.api is None else getattr(self.api, 'co_qualname', self.api.co_name)

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


def here(inputs=None):
    """The :class:`Site` of the FunctionNode being applied now: the outermost library function
    or method between the user's code and the node (None when the user's code applied it),
    the innermost call from the user's code (None when the loss function is library code
    itself, a ``L.Classifier`` handed to the step), and which of the node's ``inputs`` were
    among the arguments the user's code handed the library function (arrays or Variables, also
    in a list or tuple)."""
    frame = sys._getframe(1)
    api = user = None
    for _ in range(_MAX_FRAMES):
        if frame is None:
            break
        code = frame.f_code
        path = code.co_filename
        if path == _BACKWARD:
            return Site(None, None, None, None, None, backward=True)
        if path in _DRIVERS:
            break
        if path.startswith(_LIBRARIES):
            if path not in _MACHINERY and not path.startswith(_STEP):
                api = frame
        else:
            user = frame
            break
        frame = frame.f_back
    handed = None if api is None or inputs is None else _handed(api, inputs)
    return Site(None if api is None else api.f_code,
                None if user is None else user.f_code.co_filename,
                None if user is None else user.f_lineno,
                None if user is None else user.f_code.co_name, handed)


def of_backward(site):
    """The site of an old-style Function's backward: its forward's, whose inputs are not the
    backward's (so none is known handed)."""
    return None if site is None else Site(site.api, site.path, site.line, site.function, None,
                                          site.backward)


def _handed(frame, inputs):
    """Indices of ``inputs`` among the arguments of ``frame``'s call."""
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
    return frozenset(k for k, a in enumerate(inputs) if id(a) in given)
