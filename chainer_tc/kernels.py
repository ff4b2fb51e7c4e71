"""Loads the CUDA kernels of ``kernels/*.cu`` and counts their launches.

    from chainer_tc import kernels
    k = kernels.get_function('layout', 'batched_transpose_f32_f16', xp,
                             defines={'LAYOUT_TILE': 32})
    k(grid, block, (src, dst, numpy.int32(rows), ...))
    kernels.launch_count()            # launches so far, all kernels together

Three execution paths share one ``.cu`` source (see docs/kernels.md):

- ``xp is cupy``: compiled by NVRTC with the options CuPy's ``RawModule`` would use, the binary
  and its lowered template names kept in the per-user cache (``chainer_tc._cubin``), so a later
  process loads it without NVRTC, name expressions or not;
- ``xp is numpy`` with ``CHAINER_TC_EMULATE=1``: the CPU emulator of ``chainer_tc.testing``, so
  the GPU orchestration code runs in CI on NumPy arrays;
- otherwise a caller takes its plain NumPy path and never asks for a kernel
  (:func:`backend` tells it which path it is on).

Compiled modules are memoized per (file, defines, backend, device) and kernels per name as well;
nothing is compiled at import. :func:`counters` says how much of that work a process did (NVRTC
compiles, cache hits, modules loaded, functions looked up): after warm-up it stays zero.
"""
import collections
import contextlib
import numbers
import os
import re
import threading

from chainer_tc import _cubin
from chainer_tc import cuda_headers
from chainer_tc._cubin import counters  # NOQA
from chainer_tc._cubin import reset_counters  # NOQA

ENV_EMULATE = 'CHAINER_TC_EMULATE'
ENV_KERNEL_DIR = 'CHAINER_TC_KERNEL_DIR'

_lock = threading.Lock()
_modules = {}
_kernels = {}
_counts = collections.Counter()


def kernel_dir():
    """The directory holding the ``.cu`` sources.

    ``$CHAINER_TC_KERNEL_DIR`` if set; else ``kernels/`` of the source checkout (an editable
    install); else the copy shipped inside the installed package (``chainer_tc/_kernels``).
    """
    env = os.environ.get(ENV_KERNEL_DIR)
    if env:
        if not os.path.isdir(env):
            raise FileNotFoundError('{}={!r} is not a directory (it must hold the kernels\' .cu '
                                    'files; unset it to use the ones shipped with chainer_tc)'
                                    .format(ENV_KERNEL_DIR, env))
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    for d in (os.path.join(os.path.dirname(here), 'kernels'), os.path.join(here, '_kernels')):
        if os.path.isdir(d):
            return d
    raise FileNotFoundError('chainer_tc: no kernels/ directory found next to the package or inside '
                            'it; set {} to the directory holding the .cu files'
                            .format(ENV_KERNEL_DIR))


def _shown(name):
    """How messages and ``#line`` directives name the file ``name`` of the kernel directory:
    ``kernels/<name>`` for the directories chainer_tc ships (the same text, so the same cache
    keys, in every checkout), the full path under ``$CHAINER_TC_KERNEL_DIR``."""
    if os.environ.get(ENV_KERNEL_DIR):
        return os.path.join(os.path.abspath(kernel_dir()), name)
    return 'kernels/' + name


def families():
    """Names of the kernel families (``kernels/<family>.cu``), sorted."""
    return sorted(f[:-3] for f in os.listdir(kernel_dir()) if f.endswith('.cu'))


def source_path(family):
    path = os.path.join(kernel_dir(), family + '.cu')
    if not os.path.isfile(path):
        raise FileNotFoundError('no kernel family {!r}: {} does not exist (families: {})'
                                .format(family, path, ', '.join(families())))
    return path


# an #include "x.cuh" line, a comment after it allowed; one this does not take is refused (it
# would reach NVRTC, which has no -I for kernels/, and stay out of the cache keys)
_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"'
                         r'[ \t]*(?://[^\n]*|/\*.*?\*/[ \t]*)?$', re.M)
_ANY_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"[^\n]*$', re.M)


def source(family):
    """The text of ``kernels/<family>.cu`` with its ``#include "x.cuh"`` lines replaced by those
    files (from the same directory), ``#line`` directives keeping compiler messages on the right
    file and line. NVRTC, CuPy and the emulator all compile this one self-contained text, and
    their caches key on it, so a change to a shared header recompiles every family using it."""
    path = source_path(family)
    with open(path) as f:
        return _inline(f.read(), os.path.basename(path), set())


def _inline(text, name, seen):
    shown = _shown(name).replace('\\', '/').replace('"', '').replace('\n', ' ')
    taken = {m.start() for m in _INCLUDE_RE.finditer(text)}
    for m in _ANY_INCLUDE_RE.finditer(text):
        if m.start() not in taken:
            raise ValueError('{} line {}: {!r} is not an include this loader can inline (#include '
                             '"header.cuh", optionally followed by a comment)'.format(
                                 _shown(name), text.count('\n', 0, m.start()) + 1,
                                 m.group(0).strip()))
    out, pos = ['#line 1 "{}"\n'.format(shown)], 0
    for m in _INCLUDE_RE.finditer(text):
        header = m.group(1)
        out.append(text[pos:m.start()])
        if header not in seen:
            seen.add(header)
            path = os.path.join(kernel_dir(), header)
            if not os.path.isfile(path):
                raise FileNotFoundError('{} includes "{}", which is not in {}'
                                        .format(_shown(name), header, kernel_dir()))
            with open(path) as f:
                out.append(_inline(f.read(), header, seen))
        line = text.count('\n', 0, m.end()) + 2
        out.append('\n#line {} "{}"'.format(line, shown))
        pos = m.end()
    out.append(text[pos:])
    return ''.join(out)


def emulating():
    """True when ``CHAINER_TC_EMULATE=1``: NumPy arrays go through the emulated kernels."""
    return os.environ.get(ENV_EMULATE, '') == '1'


def backend(xp):
    """'cuda', 'emulator' or 'numpy': the path a function taking ``xp`` arrays should take."""
    if xp is not None and xp.__name__ == 'cupy':
        return 'cuda'
    return 'emulator' if emulating() else 'numpy'


def cuda_include_dirs():
    """``[directory]`` holding ``cuda_fp16.h`` for the NVRTC in use (:mod:`chainer_tc.cuda_headers`:
    the CUDA wheels', CuPy's copy or a toolkit's, preferring NVRTC's major version); ``[]`` if none."""
    try:
        major = _cubin.nvrtc_version()[0]
    except RuntimeError:          # no NVRTC: any header will do for whoever asks
        major = None
    return cuda_headers.include_dirs(major)


_options = {}      # id(defines) -> (defines, a copy of it, its options): callers pass constants


def _define_options(defines):
    """The ``-DKEY=VALUE`` options of ``defines``; for a dict seen before and unchanged since, a
    lookup (this runs before every launch, so sorting and formatting each time would cost more
    than the rest of ``get_function``)."""
    if not defines:
        return ()
    hit = _options.get(id(defines))
    if hit is not None and hit[0] is defines and hit[1] == defines:
        return hit[2]
    for k, v in defines.items():
        if not isinstance(k, str) or not k.isidentifier() or isinstance(v, bool) or \
                not isinstance(v, (numbers.Integral, str)):
            raise TypeError('defines must map macro names to ints or strings; got {!r}: {!r} '
                            '(-D{}={} would not be what the kernel expects)'.format(k, v, k, v))
    options = tuple('-D{}={}'.format(k, v) for k, v in sorted(defines.items()))
    if len(_options) >= 64:        # callers' throwaway dicts must not pile up
        _options.clear()
    _options[id(defines)] = (defines, dict(defines), options)   # kept alive: its id stays its own
    return options


class Kernel:
    """A loaded kernel; calling it launches it and counts the launch."""

    def __init__(self, name, function):
        self.name = name
        self._function = function

    def __call__(self, grid, block, args, shared_mem=0):
        self._function(grid, block, args, shared_mem=shared_mem)
        _counts[self.name] += 1

    def __repr__(self):
        return '<chainer_tc kernel {}>'.format(self.name)


def _nvrtc_options(options):
    """What the loader passes to NVRTC besides the ``-D`` options (CuPy adds its own, see
    ``_cubin.compile_options``)."""
    return options + ('--std=c++17',) + tuple('-I' + d for d in cuda_include_dirs())


def _module(family, options, xp, name_expressions=()):
    where = os.environ.get(ENV_KERNEL_DIR)
    if backend(xp) == 'cuda':
        device = xp.cuda.Device()
        key = (family, where, options, name_expressions, 'cuda', device.id)
    elif emulating():
        key = (family, where, options, name_expressions, 'emulator')
    else:
        raise RuntimeError('kernel family {!r} asked for NumPy arrays without {}=1: the caller '
                           'should have taken its NumPy path'.format(family, ENV_EMULATE))
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            path = source_path(family)
            code = source(family)
            if key[4] == 'cuda':
                mod = _cubin.load_module(code, path, _nvrtc_options(options), name_expressions,
                                         device.compute_capability)
            else:
                from chainer_tc.testing import emulator
                mod = emulator.RawModule(code=code, options=options,
                                         name_expressions=list(name_expressions))
                _cubin.add('modules_loaded')
            _modules[key] = mod
    return mod


def get_function(family, name, xp, defines=None, name_expressions=()):
    """The kernel ``name`` of ``kernels/<family>.cu`` for arrays of module ``xp``.

    ``defines`` become ``-DKEY=VALUE`` options, so launch constants have one source of truth.
    ``name_expressions`` lists template instantiations (``'k<float>'``) to compile, as in CuPy;
    a templated ``name`` must be one of them. Kernels are memoized per (family, name, defines,
    name expressions, backend, device): asking again costs a dictionary lookup.
    """
    options = _define_options(defines)
    if isinstance(name_expressions, str):
        raise TypeError('name_expressions must be a list of strings (template instantiations '
                        'such as "k<float>"), not the string {!r}'.format(name_expressions))
    name_expressions = tuple(name_expressions)
    path = backend(xp)
    device = xp.cuda.runtime.getDevice() if path == 'cuda' else None
    key = (family, name, options, name_expressions, path, device,
           os.environ.get(ENV_KERNEL_DIR))
    kernel = _kernels.get(key)
    if kernel is None:
        mod = _module(family, options, xp, name_expressions)
        kernel = Kernel(name, mod.get_function(name))
        _cubin.add('function_lookups')
        with _lock:
            kernel = _kernels.setdefault(key, kernel)
    return kernel


def launch_count():
    """Kernel launches made through this module since the start (or the last reset)."""
    return sum(_counts.values())


def launch_counts():
    """Launches per kernel name, as a dict."""
    return dict(_counts)


def reset_launch_count():
    _counts.clear()


class _LaunchCounter:
    def __init__(self):
        self._start = collections.Counter(_counts)
        self.stop = None

    @property
    def total(self):
        end = self.stop if self.stop is not None else _counts
        return sum(end.values()) - sum(self._start.values())

    @property
    def per_kernel(self):
        end = self.stop if self.stop is not None else _counts
        return {k: end[k] - self._start.get(k, 0) for k in end if end[k] - self._start.get(k, 0)}


@contextlib.contextmanager
def count_launches():
    """``with count_launches() as c: ...``; then ``c.total`` and ``c.per_kernel``."""
    c = _LaunchCounter()
    try:
        yield c
    finally:
        c.stop = collections.Counter(_counts)
