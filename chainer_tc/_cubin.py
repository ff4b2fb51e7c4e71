"""NVRTC compiles for the GPU path, kept in the per-user cache so later processes skip NVRTC.

CuPy (13 and 14) reads its on-disk kernel cache only for modules compiled without
``name_expressions``: it must compile again to learn the lowered (mangled) names of templates,
so the ``batchnorm`` and ``pooling`` families ran NVRTC in every process and on every device
(about 1 s each). Here the loader compiles with NVRTC itself, with the options CuPy would pass,
and stores ``{binary, lowered names, NVRTC version, arch, options}`` in ``chainer_tc._cache``
(owner-only, checksummed) under a key of everything that changes the binary; a later process,
or another device of the same architecture, loads the stored binary with
``cupy.cuda.function.Module.load`` and looks kernels up by their lowered names.

:func:`counters` says how often NVRTC ran and how often the cache served instead, so a test can
assert that nothing is compiled after warm-up. Importing this module imports neither CuPy nor
NVRTC; nothing here imports ``chainer_tc.kernels``.
"""
import collections
import json
import os
import re
import sys
import threading
import time
import warnings

from chainer_tc import _cache
from chainer_tc import _tally
from chainer_tc.errors import CompileError

KIND = 'cubin'          # the cache's sub-directory
FORMAT = 2              # bump when the entry layout or the key changes meaning (2: whole
                        # cubins; 1 stored CuPy's, a byte short)


_lock = threading.Lock()
_memo = {}              # (what, args) -> value, for facts fixed in a process (arch, identity)
_warned = set()

# CuPy's list (cupy/cuda/compiler.py): Tegra parts get their own arch, never a neighbour's
_TEGRA = (32, 53, 62, 72, 87)
_ARCH_OPTION = re.compile(r'^(?:-arch=|--gpu-architecture=)(\S+)$')

Program = collections.namedtuple('Program', 'binary lowered log')
Entry = collections.namedtuple('Entry', 'binary lowered from_cache')


_counts = _tally.Tally(
    'nvrtc_compiles',       # NVRTC programs compiled (the loader, `python -m chainer_tc kernels`)
    'cache_hits',           # binaries the loader took from the per-user cache instead of NVRTC
    'modules_loaded',       # kernel modules loaded (into a CUDA context, or emulator modules)
    'function_lookups',     # kernels looked up in a loaded module (chainer_tc.kernels)
)
add = _counts.add
counters = _counts.counters
reset_counters = _counts.reset


def _warn_once(what, message, category=RuntimeWarning):
    with _lock:
        if what in _warned:
            return
        _warned.add(what)
    warnings.warn(message, category, stacklevel=3)


def nvrtc():
    """CuPy's low-level NVRTC binding (works without a GPU or driver)."""
    try:
        from cupy_backends.cuda.libs import nvrtc as lib
        lib.getVersion()
    except Exception as e:   # ImportError, or libnvrtc.so missing
        raise RuntimeError('NVRTC is not available ({}: {}); install the gpu extra: '
                           "pip install -e '.[gpu]'".format(type(e).__name__, e)) from e
    return lib


def nvrtc_version():
    """(major, minor) of the NVRTC in use."""
    return tuple(nvrtc().getVersion())


def compile_program(code, name, options, name_expressions=(), target='cubin'):
    """Compile ``code`` with NVRTC once; a :class:`Program` (binary, {expression: lowered name},
    log). ``target`` is 'cubin' (needs an ``sm_XY`` arch option) or 'ptx'. A failure raises
    :class:`~chainer_tc.errors.CompileError` naming ``name`` and the arch, with NVRTC's log."""
    if target not in ('cubin', 'ptx'):
        raise ValueError("target must be 'cubin' or 'ptx', not {!r}".format(target))
    lib = nvrtc()
    options = [str(o) for o in options]
    arch = next((m.group(1) for m in map(_ARCH_OPTION.match, options) if m), 'the default arch')
    prog = lib.createProgram(code, os.path.basename(name), [], [])
    try:
        for expression in name_expressions:
            lib.addNameExpression(prog, expression)
        add('nvrtc_compiles')
        try:
            lib.compileProgram(prog, options)
        except Exception as e:
            log = lib.getProgramLog(prog).rstrip('\x00').strip()
            raise CompileError('NVRTC failed to compile {} for {} ({}):\n{}'
                               .format(name, arch, e, log)) from e
        lowered = {x: lib.getLoweredName(prog, x) for x in name_expressions}
        binary = _full_cubin(prog, lib.getCUBIN(prog)) if target == 'cubin' else lib.getPTX(prog)
        log = lib.getProgramLog(prog).rstrip('\x00')
    finally:
        lib.destroyProgram(prog)
    return Program(binary, lowered, log)


def _loaded_nvrtc():
    """ctypes handle of the libnvrtc this process loaded (CuPy's binding links it by soname), or
    None with the reason. Only a library already mapped will do: a program handle is valid in
    the library instance that created it, never in another copy."""
    import ctypes
    try:
        with open('/proc/self/maps') as f:
            paths = {line.split(None, 5)[-1].strip() for line in f
                     if os.path.basename(line.split(None, 5)[-1].strip()).startswith('libnvrtc.so')}
    except (OSError, IndexError) as e:
        return None, 'cannot read /proc/self/maps ({})'.format(e)
    paths = sorted({os.path.realpath(p) for p in paths})
    if len(paths) != 1:
        return None, ('no libnvrtc.so* is mapped in this process' if not paths else
                      'several libnvrtc libraries are mapped ({})'.format(', '.join(paths)))
    try:
        return ctypes.CDLL(paths[0], mode=os.RTLD_NOLOAD), None
    except OSError as e:
        return None, 'cannot open {} ({})'.format(paths[0], e)


def _full_cubin(prog, cupy_bytes):
    """The whole cubin of the compiled program ``prog`` (CuPy's handle, an integer).

    CuPy 13's ``nvrtc.getCUBIN`` returns the binary one byte short (it drops the last byte): the
    driver loads it, but ``nvdisasm`` rejects it as a truncated ELF. So the size and bytes are
    asked again from the same libnvrtc through ctypes. Where that route fails (no such library
    mapped, an NVRTC error, bytes that do not extend CuPy's), a warning once and CuPy's bytes."""
    import ctypes
    hit = _memo.get('nvrtc-ctypes')
    if hit is None:
        hit = _memo['nvrtc-ctypes'] = _loaded_nvrtc()
    lib, why = hit
    if lib is not None:
        handle, size = ctypes.c_void_p(prog), ctypes.c_size_t()
        rc = lib.nvrtcGetCUBINSize(handle, ctypes.byref(size))
        if rc == 0:
            buf = ctypes.create_string_buffer(size.value)
            rc = lib.nvrtcGetCUBIN(handle, buf)
        if rc != 0:
            why = 'nvrtcGetCUBIN(Size) returned error {}'.format(rc)
        elif not buf.raw.startswith(cupy_bytes):
            why = 'its {} bytes do not extend CuPy\'s {}'.format(size.value, len(cupy_bytes))
        else:
            return buf.raw
    _warn_once('full-cubin', 'chainer_tc: could not read the whole cubin from libnvrtc ({}); '
               'using CuPy\'s bytes, which nvdisasm may reject as truncated'.format(why))
    return cupy_bytes


# -- what to compile for --------------------------------------------------------------------------

def arch_option(capability, supported, use_ptx=False):
    """(option, target) for a device of compute ``capability`` ('90' or 90) given the archs
    NVRTC ``supported`` (``nvrtcGetSupportedArchs``).

    As CuPy: a cubin for the device's own ``sm_XY`` when NVRTC supports it, PTX for
    ``compute_XY`` when ``use_ptx`` (``CUPY_COMPILE_WITH_PTX=1``). When NVRTC is older than the
    device, CuPy compiles a cubin for NVRTC's newest arch, which the driver refuses across major
    versions; here that cubin is used only within the device's major version (an X.y cubin runs
    on X.z, z >= y), and otherwise PTX for the newest arch below the device, which the driver
    compiles for it. An arch NVRTC cannot serve at all (CUDA 13 dropped sm_70) is a
    ``CompileError``.
    """
    cc = int(capability)
    supported = sorted(int(a) for a in supported)
    below = [a for a in supported if a <= cc and (a not in _TEGRA or a == cc)]
    if not below:
        raise CompileError('NVRTC cannot compile for this GPU (compute capability {}.{}): it '
                           'supports sm_{} to sm_{}; use an NVRTC (CUDA toolkit) that still '
                           'targets it'.format(cc // 10, cc % 10, supported[0], supported[-1])
                           if supported else 'NVRTC reports no supported architecture')
    best = below[-1]
    if use_ptx:
        return '-arch=compute_{}'.format(best), 'ptx'
    if best == cc or (best // 10 == cc // 10 and cc not in _TEGRA):
        return '-arch=sm_{}'.format(best), 'cubin'
    return '-arch=compute_{}'.format(best), 'ptx'


def _env_flag(name):
    """CuPy's reading of a boolean environment variable: '1' is on, anything else off."""
    value = os.environ.get(name)
    try:
        return bool(value) and int(value) == 1
    except ValueError:
        return False


def device_arch(capability):
    """:func:`arch_option` for a device of this capability with the NVRTC in use (memoized)."""
    use_ptx = _env_flag('CUPY_COMPILE_WITH_PTX')
    key = ('arch', str(capability), use_ptx)
    hit = _memo.get(key)
    if hit is None:
        hit = _memo[key] = arch_option(capability, nvrtc().getSupportedArchs(), use_ptx)
    return hit


def compile_options(options, arch_opt):
    """The NVRTC options CuPy's ``RawModule(code=..., options=options)`` compiles with, its
    arch option replaced by ``arch_opt``: CuPy's include directories (its CCCL and headers, the
    CUDA toolkit's, the wheels'), ``-ftz=true``, and ``--device-as-default-execution-space`` on
    NVRTC 12 and later; ``--device-debug --generate-line-info`` under
    ``CUPY_CUDA_COMPILE_WITH_DEBUG=1`` as in CuPy."""
    options = tuple(options)
    try:
        from cupy._core.core import assemble_cupy_compiler_options
        from cupy.cuda.compiler import _get_extra_include_dir_opts
    except ImportError as e:
        _warn_once('cupy-options', 'chainer_tc: this CuPy does not expose how it assembles NVRTC '
                   'options ({}); kernels are compiled with chainer_tc\'s own include path only'
                   .format(e))
        assembled, extra = options, ()
    else:
        assembled, extra = assemble_cupy_compiler_options(options), _get_extra_include_dir_opts()
    out = assembled + ('-ftz=true',)
    if _env_flag('CUPY_CUDA_COMPILE_WITH_DEBUG'):
        out += ('--device-debug', '--generate-line-info')
    out += tuple(extra) + (arch_opt,)
    if nvrtc_version()[0] >= 12:
        out += ('--device-as-default-execution-space',)
    return out


# -- the cache key --------------------------------------------------------------------------------

def nvrtc_identity():
    """'major.minor' plus the loaded libnvrtc's path, size and modification time (two builds of
    one minor version differ there), memoized."""
    hit = _memo.get('identity')
    if hit is None:
        version = '{}.{}'.format(*nvrtc_version())
        library = ''
        try:
            with open('/proc/self/maps') as f:
                paths = [line.split(None, 5)[-1].strip() for line in f if 'libnvrtc.so' in line]
            if paths:
                st = os.stat(paths[0])
                library = '{} {} {}'.format(os.path.realpath(paths[0]), st.st_size,
                                            st.st_mtime_ns)
        except OSError:
            pass
        hit = _memo['identity'] = version + '\n' + library
    return hit


def include_fingerprint(options):
    """The entries (name, size, modification time) at the top of every ``-I`` directory of
    ``options``: an upgraded CUDA header (``cuda_fp16.h``) changes the key. Memoized."""
    dirs = tuple(o[2:] if o.startswith('-I') else o[len('--include-path='):] for o in options
                 if o.startswith('-I') or o.startswith('--include-path='))
    hit = _memo.get(('include', dirs))
    if hit is None:
        parts = []
        for d in dirs:
            try:
                with os.scandir(d) as it:
                    rows = sorted('{} {} {}'.format(e.name, *_size_mtime(e)) for e in it)
            except OSError as e:
                rows = ['unreadable {}'.format(type(e).__name__)]
            parts.append(d + '\n' + '\n'.join(rows))
        hit = _memo[('include', dirs)] = '\n\n'.join(parts)
    return hit


def _size_mtime(entry):
    try:
        st = entry.stat()
        return st.st_size, st.st_mtime_ns
    except OSError:
        return -1, -1


def cache_key(code, name, options, name_expressions, target):
    """A hex key of everything that changes the binary: the source text, the program name,
    every option (the arch among them), the name expressions, the target, NVRTC's identity,
    the include directories' headers and :data:`FORMAT`."""
    return _cache.key_of('chainer_tc-cubin', str(FORMAT), nvrtc_identity(),
                         include_fingerprint(options), target, os.path.basename(name),
                         '\0'.join(options), '\0'.join(name_expressions), code)


def _payload(options, name_expressions, target, program):
    meta = {'format': FORMAT, 'nvrtc': '{}.{}'.format(*nvrtc_version()), 'target': target,
            'arch': next((o for o in options if _ARCH_OPTION.match(o)), None),
            'options': list(options), 'name_expressions': list(name_expressions),
            'lowered': program.lowered}
    # json.dumps escapes control characters, so the first NUL ends the header
    return json.dumps(meta, sort_keys=True).encode() + b'\0' + program.binary


def _parse(payload, options, name_expressions, target):
    """(binary, lowered) of an entry written for these inputs, or None."""
    head, sep, binary = payload.partition(b'\0')
    try:
        meta = json.loads(head.decode())
        ok = (sep and binary and meta['format'] == FORMAT and meta['target'] == target
              and meta['options'] == list(options)
              and meta['name_expressions'] == list(name_expressions)
              and set(meta['lowered']) == set(name_expressions)
              and all(isinstance(v, str) and v for v in meta['lowered'].values()))
    except (ValueError, TypeError, KeyError, AttributeError):
        ok = False
    return (binary, meta['lowered']) if ok else None


def fetch(code, name, options, name_expressions=(), target='cubin', load=None):
    """``(loaded, entry)``: the binary of ``code`` compiled with ``options`` (which hold the arch
    option) from the per-user cache, else from NVRTC (then stored), passed through ``load``
    (``cupy``'s module loader on the GPU path; the identity when None).

    An entry that is damaged (the cache discards it), not one this version wrote, or whose binary
    ``load`` rejects is a miss: compiled again, with a warning, and replaced. A compile error
    raises :class:`~chainer_tc.errors.CompileError` and stores nothing.
    """
    options, name_expressions = tuple(options), tuple(name_expressions)
    load = load or (lambda binary: binary)
    key = cache_key(code, name, options, name_expressions, target)
    payload = _cache.load(KIND, key)
    if payload is not None:
        parsed = _parse(payload, options, name_expressions, target)
        if parsed is None:
            warnings.warn('chainer_tc: the cached binary of {} is not one this version wrote; '
                          'compiling it again'.format(name), RuntimeWarning, stacklevel=2)
        else:
            try:
                loaded = load(parsed[0])
            except Exception as e:
                warnings.warn('chainer_tc: the cached binary of {} could not be loaded ({}: {}); '
                              'compiling it again'.format(name, type(e).__name__, e),
                              RuntimeWarning, stacklevel=2)
            else:
                add('cache_hits')
                return loaded, Entry(parsed[0], parsed[1], True)
    started = _say_compiling(name, options)
    try:
        program = compile_program(code, name, options, name_expressions, target)
    finally:
        _said_compiled(started)
    loaded = load(program.binary)
    _cache.store(KIND, key, _payload(options, name_expressions, target, program))
    return loaded, Entry(program.binary, program.lowered, False)


def _say_compiling(name, options):
    """On a terminal, one line while NVRTC compiles a kernel family on a cache miss (about 2 s
    each on first use, which would otherwise look like a hang before the first step); nothing
    in logs and pipes. Returns the start time, or None when nothing was said."""
    stream = sys.stderr
    if stream is None or not getattr(stream, 'isatty', lambda: False)():
        return None
    arch = next((o.split('=', 1)[1] for o in options if _ARCH_OPTION.match(o)), 'the device')
    stream.write('chainer_tc: compiling {} for {} (first use; cached for later runs) ...'
                 .format(os.path.basename(name), arch))
    stream.flush()
    return time.perf_counter()


def _said_compiled(started):
    if started is not None:
        sys.stderr.write(' {:.1f} s\n'.format(time.perf_counter() - started))
        sys.stderr.flush()


# -- the GPU path ---------------------------------------------------------------------------------

class Module:
    """A module loaded into the current CUDA context; kernels by plain or name-expression name."""

    def __init__(self, name, module, lowered):
        self.name = name
        self.module = module
        self.lowered = lowered

    def get_function(self, name):
        from cupy.cuda import driver
        try:
            return self.module.get_function(self.lowered.get(name, name))
        except driver.CUDADriverError as e:
            if 'NOT_FOUND' not in str(e):
                raise
            templated = ' (a templated kernel must be listed in name_expressions)' \
                if '<' in name and name not in self.lowered else ''
            raise AttributeError('no kernel {!r} in {}{}'.format(name, self.name, templated)) \
                from e


def _load_module(binary):
    from cupy.cuda import function
    module = function.Module()
    module.load(binary)
    add('modules_loaded')
    return module


def load_module(code, name, options, name_expressions, capability, load=_load_module):
    """The :class:`Module` of ``code`` for the current device (compute ``capability``), NVRTC
    options as CuPy's ``RawModule(options=options)`` would give them. (``load`` is for tests
    without a GPU: it stands in for loading the binary into the CUDA context.)"""
    arch_opt, target = device_arch(capability)
    module, entry = fetch(code, name, compile_options(options, arch_opt), name_expressions,
                          target, load=load)
    return Module(name, module, entry.lowered)
