"""The part of a ctypes binding to a CUDA library that cuDNN's and cuBLAS's share: set each C
function's prototype once, call it, and turn a non-zero status into the library's exception
with the library's own message."""
import ctypes


class Library:
    """The bound functions of one library object (a ``ctypes.CDLL``, or a fake in tests).

    ``prototypes``: C name -> ((parameter name, ctypes type), ...), every function returning
    an int status; ``message``: the C name of ``const char *f(status)``; ``error``: raised as
    ``error(call, status, message)``; ``count(name)``: called once per call (a counter).
    """

    def __init__(self, lib, prototypes, message, error, count):
        self._fn = {}
        for name, params in prototypes.items():
            fn = getattr(lib, name)
            fn.argtypes = [t for _, t in params]
            fn.restype = ctypes.c_int
            self._fn[name] = fn
        self._message = getattr(lib, message)
        self._message.argtypes = [ctypes.c_int]
        self._message.restype = ctypes.c_char_p
        self._error, self._count = error, count

    def message(self, status):
        s = self._message(status)
        return s.decode() if isinstance(s, bytes) else str(s)

    def _call(self, name, *args, counted=True):
        if counted:
            self._count(name)
        status = self._fn[name](*args)
        if status:
            raise self._error(name, status, self.message(status))


def load(path, binding, unavailable, what, hint, check=None):
    """``binding(ctypes.CDLL(path))``; ``unavailable`` (an exception class) naming ``what`` and
    the reason where the file does not load or lacks a function we call (an older release),
    with ``hint`` on what to install. ``check(lib)`` may refuse the library before it is bound."""
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise unavailable('cannot load {} from {} ({}): {}'.format(what, path, e, hint)) from e
    if check is not None:
        check(lib)
    try:
        return binding(lib)
    except AttributeError as e:
        raise unavailable('the {} at {} lacks a function chainer_tc calls: {}'
                          .format(what, path, e)) from e
