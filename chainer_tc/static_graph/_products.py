"""Chainer's matrix products inside a capture: :func:`products_through`.

While at least one capture runs, the methods and functions in which Chainer multiplies matrices
are replaced by versions that compute through :func:`._gemm.current` (the capturing thread's
cuBLAS handle) and otherwise call Chainer's own code:

- ``Linear``'s forward and its two gradients (:mod:`._linear`);
- the convolutions Chainer computes with im2col/col2im where it does not use cuDNN (CuPy 14
  has none; ``use_cudnn='never'``), grouped ones included, and ``Deconvolution2D``
  (:mod:`._im2col`);
- ``F.matmul`` and ``F.batch_matmul`` (:mod:`._matmul`).

The replacement is on the classes and modules, for the duration of the captures only; which
thread computes through what is per thread (:func:`._gemm.set_current`), so another thread
calling these functions meanwhile runs Chainer's code. What the attributes held when the first
block opened (a user's own replacement included) is put back when the last one closes; in
between, what is not computed here runs Chainer's own code.
"""
import contextlib
import threading

from chainer_tc.static_graph import _gemm
from chainer_tc.static_graph import _im2col
from chainer_tc.static_graph import _linear
from chainer_tc.static_graph import _matmul

PATCHES = _linear.PATCHES + _im2col.PATCHES + _matmul.PATCHES

_ABSENT = object()
_lock = threading.Lock()
_installed = [0]
_saved = []         # while installed: (owner, name, value before, or _ABSENT where inherited)


def installed():
    """How many :func:`products_through` blocks are open (all threads)."""
    return _installed[0]


def _install():
    """Keep what each attribute is now (a user's own patch included), then replace it."""
    _saved[:] = [(owner, name, vars(owner).get(name, _ABSENT)) for owner, name, _ in PATCHES]
    for owner, name, fn in PATCHES:
        setattr(owner, name, fn)


def _restore():
    for owner, name, value in _saved:
        if value is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, value)
    del _saved[:]


@contextlib.contextmanager
def products_through(products):
    """Within this block, on this thread, Chainer's matrix products compute through
    ``products`` (a :class:`._gemm.Products`; None: Chainer's own code)."""
    with _lock:
        if _installed[0] == 0:
            _install()
        _installed[0] += 1
    previous = _gemm.set_current(products)
    try:
        yield
    finally:
        _gemm.set_current(previous)
        with _lock:
            _installed[0] -= 1
            if _installed[0] == 0:
                _restore()
