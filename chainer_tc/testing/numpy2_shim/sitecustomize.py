"""Lets Chainer 7.8.1 import on NumPy 2 / Python 3.12, for running chainer_tc's ``gpu`` tests on a
GPU machine whose image has CuPy 14 and NumPy 2 (the H100/H200 this project is lent), where our
pinned stack (NumPy < 2, CuPy 13) cannot be installed. Never for users: put this directory on
PYTHONPATH only for such a test run (docs/stack.md, "Running the gpu tests on a CuPy 14 machine").

Chainer reads ``numpy.sctypes`` (removed in NumPy 2) when it is imported, and its environment check
imports ``numpy.distutils`` (gone on Python 3.12) and ``pkg_resources`` (gone from recent
setuptools). What it reads of them is restored or stubbed; nothing else is changed.
"""
import sys
import types

import numpy

try:
    numpy.sctypes
except AttributeError:
    numpy.sctypes = {
        'int': [numpy.int8, numpy.int16, numpy.int32, numpy.int64],
        'uint': [numpy.uint8, numpy.uint16, numpy.uint32, numpy.uint64],
        'float': [numpy.float16, numpy.float32, numpy.float64],
        'complex': [numpy.complex64, numpy.complex128],
        'others': [bool, object, bytes, str, numpy.void]}

try:
    import numpy.distutils.system_info  # noqa: F401
except Exception:
    _distutils = types.ModuleType('numpy.distutils')
    _system_info = types.ModuleType('numpy.distutils.system_info')
    _system_info.get_info = lambda name: {}          # read on macOS only
    _distutils.system_info = _system_info
    sys.modules['numpy.distutils'] = _distutils
    sys.modules['numpy.distutils.system_info'] = _system_info

try:
    import pkg_resources  # noqa: F401
except Exception:
    _pr = types.ModuleType('pkg_resources')

    class DistributionNotFound(Exception):
        pass

    class VersionConflict(Exception):
        pass

    def require(requirement):           # Chainer's optional-dependency check: "not installed"
        raise DistributionNotFound(requirement)

    _pr.DistributionNotFound, _pr.VersionConflict, _pr.require = (
        DistributionNotFound, VersionConflict, require)
    sys.modules['pkg_resources'] = _pr
