"""Where NVRTC finds ``cuda_fp16.h``: the one CUDA header our kernels include.

NVRTC ships no headers of its own; the CUDA installs a user may have put them in different places:

- the CUDA 12 runtime wheel: ``site-packages/nvidia/cuda_runtime/include`` (our stack);
- the CUDA 13 wheels (``cuda-toolkit``): ``site-packages/nvidia/cu13/include``;
- CuPy's own copies, one per CUDA major version: ``cupy/_core/include/cupy/_cuda/cuda-12``, ...;
- a CUDA toolkit: ``$CUDA_PATH``, ``$CUDA_HOME``, ``/usr/local/cuda``, ``/usr/local/cuda-*``.

:func:`include_dirs` returns the first directory made for NVRTC's own major version, else the
first found at all (a header of another major version usually still compiles; none at all fails in
NVRTC with "could not open source file cuda_fp16.h", which is worse than a mismatch).
"""
import glob
import os
import re
import sys

HEADER = 'cuda_fp16.h'
_CUDART = re.compile(rb'#define\s+CUDART_VERSION\s+(\d+)')
_DIR_MAJOR = re.compile(r'^(?:cuda-|cu)(\d+)(?:\.\d+)*$')


TOOLKIT = os.path.join(os.sep, 'usr', 'local', 'cuda')


def candidates(path=None, environ=None, toolkit=TOOLKIT):
    """Every directory that may hold the header, in the order of preference (unchecked)."""
    path = sys.path if path is None else path
    environ = os.environ if environ is None else environ
    dirs = []
    for p in path:
        if not p:
            continue
        dirs.append(os.path.join(p, 'nvidia', 'cuda_runtime', 'include'))
        dirs += _newest_first(glob.glob(os.path.join(p, 'nvidia', 'cu[0-9]*', 'include')))
        dirs += _newest_first(glob.glob(os.path.join(p, 'cupy', '_core', 'include', 'cupy',
                                                     '_cuda', 'cuda-[0-9]*')))
    for env in ('CUDA_PATH', 'CUDA_HOME'):
        if environ.get(env):
            dirs.append(os.path.join(environ[env], 'include'))
    if toolkit:
        dirs.append(os.path.join(toolkit, 'include'))
        dirs += _newest_first(glob.glob(toolkit + '-[0-9]*' + os.sep + 'include'))
    return dirs


def _newest_first(dirs):
    """Version-named directories (``cu13``, ``cuda-12``, ``cuda-12.4``), highest version first
    (numerically: cu13 before cu9); unversioned ones last."""
    def version(d):
        m = _DIR_MAJOR.match(_versioned_part(d) or '')
        return tuple(int(x) for x in re.findall(r'\d+', m.group(0))) if m else ()
    return sorted(dirs, key=version, reverse=True)


def _versioned_part(directory):
    """The directory's own name or its parent's, where it names a CUDA version (``cuda-12``,
    ``cu13/include``, ``cuda-12.4/include``), or None: folders further up say nothing."""
    for part in reversed(os.path.normpath(directory).split(os.sep)[-2:]):
        if _DIR_MAJOR.match(part):
            return part
    return None


def major_of(directory):
    """The CUDA major version a header directory was made for, or None: ``CUDART_VERSION`` of its
    ``cuda_runtime_api.h``, else a ``cuda-NN`` / ``cuNN`` part of its path."""
    try:
        with open(os.path.join(directory, 'cuda_runtime_api.h'), 'rb') as f:
            m = _CUDART.search(f.read())
        if m:
            return int(m.group(1)) // 1000
    except OSError:
        pass
    part = _versioned_part(directory)
    return int(_DIR_MAJOR.match(part).group(1)) if part else None


def include_dirs(nvrtc_major=None, path=None, environ=None, toolkit=TOOLKIT):
    """``[directory]`` holding ``cuda_fp16.h`` for an NVRTC of major version ``nvrtc_major`` (one
    made for that version if any, else the first found), or ``[]`` when there is none."""
    found = []
    for d in candidates(path, environ, toolkit):
        if d not in found and os.path.isfile(os.path.join(d, HEADER)):
            found.append(d)
    if nvrtc_major is not None:
        for d in found:
            if major_of(d) == nvrtc_major:
                return [d]
    return found[:1]
