"""Run CUDA kernels on the CPU, with CuPy's calling convention.

    from chainer_tc.testing import emulator
    mod = emulator.RawModule(code=open('kernels/layout.cu').read(), options=('-DTILE=32',))
    k = mod.get_function('batched_transpose_f32_f16')
    k((grid_x, grid_y, grid_z), (32, 8), (src, dst, np.int32(rows), np.int32(cols), np.int64(n)))

The same ``.cu`` text that NVRTC compiles for the GPU is compiled by g++ against the emulation
header ``include/chainer_tc_emu.h`` (see its header comment for the execution model) and loaded
from memory. Array arguments are NumPy arrays (passed as device pointers); scalar arguments are
NumPy scalars whose dtype must match the kernel's parameter type exactly (a Python ``int`` would
reach CuPy as int64, so it is refused here). Every array is copied into a guarded buffer for the
launch, so an out-of-bounds access raises :class:`~chainer_tc.errors.KernelLaunchError` naming the
argument, the offset and the thread, instead of corrupting memory; the arrays are left untouched
when a launch fails.

Differences from a GPU, by design: the emulator rejects what CuPy would let through silently
(non-contiguous arrays, scalars of the wrong width, writing through a pointer to const), and NVRTC
options other than ``-D``/``-U``/``-I`` (architecture, fast-math, ftz) are ignored: fp32 results
are IEEE-exact on the CPU, so tests that compare with a GPU must allow for ftz and fast-math.
"""
import ctypes
import os
import re
import shutil
import subprocess
import tempfile
import threading

import numpy

from chainer_tc import _cache
from chainer_tc.errors import CompileError
from chainer_tc.errors import KernelLaunchError

INCLUDE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'include')
_EMULATOR_VERSION = '2'        # part of the cache key: bump when the g++ command changes
_ERR_LEN = 1024
_SCALAR = 2 ** 64 - 1
_ALIGN = 64            # by-value arguments are copied to addresses aligned to this (__align__(16) ...)

_launch_lock = threading.RLock()
_modules = {}          # cache key -> loaded ctypes library, so each module is loaded once
_memfds = []           # descriptors of the loaded modules (kept open, see _load)

_CODES = {
    'b1': ('bool', numpy.bool_), 'i1': ('char', numpy.int8), 'u1': ('unsigned char', numpy.uint8),
    'i2': ('short', numpy.int16), 'u2': ('unsigned short', numpy.uint16),
    'i4': ('int', numpy.int32), 'u4': ('unsigned int', numpy.uint32),
    'i8': ('long long', numpy.int64), 'u8': ('unsigned long long', numpy.uint64),
    'f2': ('__half', numpy.float16), 'f4': ('float', numpy.float32), 'f8': ('double', numpy.float64),
    'f2x2': ('__half2', numpy.float16), 'f4x2': ('float2', numpy.float32),
    'f4x4': ('float4', numpy.float32), 'f8x2': ('double2', numpy.float64),
    'i4x2': ('int2', numpy.int32), 'i4x4': ('int4', numpy.int32),
    'u4x2': ('uint2', numpy.uint32), 'u4x4': ('uint4', numpy.uint32),
    'v': ('void', None),
}

# `extern "C" __global__ void [__launch_bounds__(..)] name(` : the entry points found automatically.
_ENTRY_RE = re.compile(
    r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+'
    r'(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(')
# `extern __shared__ [__align__(n)] T name[];` : dynamic shared memory, rewritten to a macro.
_DYN_SHARED_RE = re.compile(
    r'extern\s+__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s*)?([A-Za-z_][\w:\s]*?)\s*'
    r'(?:__align__\s*\(\s*\d+\s*\)\s*)?\b(\w+)\s*\[\s*\]\s*;')


# Comments and string / character literals, to blank out before matching code.
_LEXEME_RE = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)


def _blank(code, literals=False):
    """``code`` with its comments (and, if ``literals``, the insides of its string and character
    literals) replaced by spaces: same length and newlines, so positions and lines still match."""
    def sub(m):
        text = m.group(0)
        if text[0] in '"\'':
            return text[0] + re.sub(r'[^\n]', ' ', text[1:-1]) + text[-1] if literals else text
        return re.sub(r'[^\n]', ' ', text)
    return _LEXEME_RE.sub(sub, code)


def _block_end(code, pos):
    """Index of the '}' closing the block that contains ``pos``, or None at file scope."""
    depth = 0
    for m in re.finditer(r'[{}]', code[pos:]):
        if m.group(0) == '{':
            depth += 1
        elif depth == 0:
            return pos + m.start()
        else:
            depth -= 1
    return None


class _LaunchArgs(ctypes.Structure):
    _fields_ = [
        ('grid', ctypes.c_uint * 3), ('block', ctypes.c_uint * 3),
        ('shared_mem', ctypes.c_uint64), ('nargs', ctypes.c_int),
        ('args', ctypes.POINTER(ctypes.c_void_p)),
        ('nbytes', ctypes.POINTER(ctypes.c_uint64)),
        ('itemsize', ctypes.POINTER(ctypes.c_uint64)),
        ('writeback', ctypes.POINTER(ctypes.c_int)),
        ('alias', ctypes.POINTER(ctypes.c_int)),
        ('guard_front', ctypes.c_int),
        ('err', ctypes.c_char_p),
    ]


class _Param:
    """One kernel parameter, decoded from the signature the compiled module reports."""

    def __init__(self, code):
        self.kind = code[0]                       # 'P' pointer, 'C' pointer to const, 'S' scalar
        self.code = code[1:]
        self.is_pointer = self.kind in 'PC'
        if self.code in _CODES:
            self.ctype, self.dtype = _CODES[self.code]
        elif self.code.startswith('s'):           # a struct: 's<size>'
            self.ctype, self.dtype = 'struct of {} bytes'.format(self.code[1:]), None
        else:
            raise RuntimeError('emulator: unknown parameter code {!r}'.format(code))
        # By value, a struct or a vector type (float4, __half2: 'f4x4', 'f2x2') is raw bytes of its
        # size, which CuPy 13 takes as a NumPy array of size 1 (a structured dtype).
        self.nbytes = None
        if self.kind == 'S' and self.dtype is None:
            self.nbytes = int(self.code[1:])
        elif self.kind == 'S' and 'x' in self.code:
            self.nbytes = numpy.dtype(self.dtype).itemsize * int(self.code.split('x')[1])

    def describe(self):
        if self.is_pointer:
            return ('const ' if self.kind == 'C' else '') + self.ctype + '*'
        return self.ctype


def _describe(x):
    if isinstance(x, numpy.ndarray):
        return 'numpy array {} of shape {}'.format(x.dtype, x.shape)
    if isinstance(x, numpy.generic):
        return 'numpy scalar {}'.format(x.dtype)
    return 'Python {}'.format(type(x).__name__)


def _dim3(value, what):
    if isinstance(value, (int, numpy.integer)):
        value = (value,)
    try:
        dims = tuple(int(v) for v in value)
    except TypeError:
        raise TypeError('{} must be an int or a tuple of 1 to 3 ints; got {!r}'.format(what, value))
    if not 1 <= len(dims) <= 3:
        raise ValueError('{} must have 1 to 3 dimensions; got {!r}'.format(what, value))
    if any(d < 1 for d in dims):
        raise ValueError('{} dimensions must be >= 1 (CUDA rejects empty launches); got {!r}'
                         .format(what, value))
    return dims + (1,) * (3 - len(dims))


def _aligned_copy(raw):
    """(buffer, address): ``raw`` copied to an address aligned to _ALIGN bytes inside ``buffer``."""
    buf = ctypes.create_string_buffer(len(raw) + _ALIGN)
    address = -(-ctypes.addressof(buf) // _ALIGN) * _ALIGN
    ctypes.memmove(address, raw, len(raw))
    return buf, address


def _guard_front():
    """``CHAINER_TC_EMULATOR_GUARD``: 'end' (default) faults on any access past the end of an array,
    'start' on any access before its start; writes on the other side are still caught, after the
    launch, by a canary."""
    mode = os.environ.get('CHAINER_TC_EMULATOR_GUARD', 'end')
    if mode not in ('end', 'start'):
        raise ValueError("CHAINER_TC_EMULATOR_GUARD must be 'end' or 'start'; got {!r}".format(mode))
    return int(mode == 'start')


def _compiler():
    cxx = os.environ.get('CXX') or shutil.which('g++') or shutil.which('c++')
    if not cxx:
        raise CompileError('the CUDA emulator needs a C++ compiler (g++) on PATH; none was found')
    return cxx


def _compiler_id(cxx):
    try:
        out = subprocess.run([cxx, '--version'], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise CompileError('cannot run the C++ compiler {!r}: {}'.format(cxx, e))
    return out.splitlines()[0] if out else cxx


def _header_text():
    parts = []
    for name in sorted(os.listdir(INCLUDE_DIR)):
        with open(os.path.join(INCLUDE_DIR, name), 'rb') as f:
            parts.append(name.encode() + b'\0' + f.read())
    return b'\0'.join(parts)


def _host_options(options):
    """Keep the NVRTC options that mean the same to g++ (-D, -U, -I); drop device-only ones."""
    out = []
    for opt in options:
        for long_, short in (('--define-macro=', '-D'), ('--undefine-macro=', '-U'),
                             ('--include-path=', '-I')):
            if opt.startswith(long_):
                opt = short + opt[len(long_):]
        if opt[:2] in ('-D', '-U', '-I'):
            out.append(opt)
    return out


def _rewrite_dynamic_shared(code):
    """``extern __shared__ T name[];`` -> a macro giving the launch's dynamic shared memory.

    A macro works at any scope. It is ``#undef``'d where the enclosing block (the kernel's body)
    ends, so a later kernel may use the name for something else; ``#line`` keeps compiler messages
    on the original line numbers.
    """
    plain = _blank(code, literals=True)
    edits, at_end = [], []                 # (start, end, replacement), names defined at file scope
    for m in _DYN_SHARED_RE.finditer(plain):
        ctype, name = ' '.join(m.group(1).split()), m.group(2)
        edits.append((m.start(), m.end(),
                      '\n#undef {n}\n#define {n} (reinterpret_cast<{t}*>(::ctemu::dyn_smem()))\n'
                      '#line {l}\n'.format(n=name, t=ctype, l=code.count('\n', 0, m.end()) + 1)))
        close = _block_end(plain, m.end())
        if close is None:
            at_end.append(name)
        else:
            edits.append((close + 1, close + 1, '\n#undef {}\n#line {}\n'.format(
                name, code.count('\n', 0, close) + 1)))
    out, pos = [], 0
    for start, end, text in sorted(edits):
        out.append(code[pos:start])
        out.append(text)
        pos = end
    out.append(code[pos:])
    # the rest end with the source, so they cannot capture names in the generated exports
    out.extend('\n#undef {}'.format(name) for name in at_end)
    return ''.join(out)


def entry_points(code):
    """Names of the ``extern "C" __global__`` kernels defined in ``code`` (not in its comments)."""
    return list(dict.fromkeys(_ENTRY_RE.findall(_blank(code))))


def _translation_unit(code, source_name, names):
    lines = ['#line 1 "{}"'.format(source_name.replace('\\', '/').replace('"', '')),
             _rewrite_dynamic_shared(code),
             '#line 1 "<chainer_tc emulator exports>"']
    for i, expr in enumerate(names):
        lines.append(
            'extern "C" __attribute__((visibility("default"))) int ctemu_launch_{i}('
            'const ::ctemu::LaunchArgs* la) {{ return ::ctemu::launch(&{e}, "{q}", la); }}\n'
            'extern "C" __attribute__((visibility("default"))) const char* ctemu_signature_{i}() {{ '
            'static std::string sig = ::ctemu::signature(&{e}); return sig.c_str(); }}'
            .format(i=i, e=expr, q=expr.replace('"', '')))
    return '\n'.join(lines) + '\n'


def _build(unit, options, source_name):
    cxx = _compiler()
    key = _cache.key_of(_EMULATOR_VERSION, _compiler_id(cxx), _header_text(), '\0'.join(options),
                        unit)
    binary = _cache.load('emulator', key)
    if binary is None:
        with tempfile.TemporaryDirectory(prefix='chainer_tc_emu_') as tmp:
            src, so = os.path.join(tmp, 'kernel.cpp'), os.path.join(tmp, 'kernel.so')
            with open(src, 'w') as f:
                f.write(unit)
            # -fvisibility=hidden: only the launchers are exported. Otherwise g++ makes the runtime
            # and every static in a template or inline function (a __shared__ array) one
            # process-wide STB_GNU_UNIQUE object, shared by all modules whatever their sizes.
            cmd = [cxx, '-std=c++17', '-O1', '-fPIC', '-shared', '-fno-strict-aliasing',
                   '-fvisibility=hidden', '-U_FORTIFY_SOURCE', '-I' + INCLUDE_DIR,
                   '-include', 'chainer_tc_emu.h',
                   *options, '-x', 'c++', src, '-o', so, '-lpthread']
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                if os.environ.get('CHAINER_TC_DUMP_SOURCE') == '1':
                    print(unit)
                raise CompileError('emulator: g++ failed to compile {}:\n{}'
                                   .format(source_name, proc.stderr.strip()))
            with open(so, 'rb') as f:
                binary = f.read()
        _cache.store('emulator', key, binary)
    return key, binary


def _load(key, binary):
    lib = _modules.get(key)
    if lib is not None:
        return lib
    if hasattr(os, 'memfd_create'):
        # The verified bytes are loaded from memory, so nothing on disk can change between the
        # check and the load. The descriptor stays open for the life of the process: dlopen
        # recognises an already-loaded library by its path, so a reused /proc/self/fd/N would
        # silently return the previous module.
        fd = os.memfd_create('chainer_tc_emu_' + key[:16], getattr(os, 'MFD_CLOEXEC', 0))
        view = memoryview(binary)
        while view:
            view = view[os.write(fd, view):]
        lib = ctypes.CDLL('/proc/self/fd/{}'.format(fd))
        _memfds.append(fd)
    else:   # pragma: no cover - Linux always has memfd_create
        with tempfile.TemporaryDirectory(prefix='chainer_tc_emu_') as tmp:
            path = os.path.join(tmp, 'kernel.so')
            with open(path, 'wb') as f:
                f.write(binary)
            lib = ctypes.CDLL(path)
    _modules[key] = lib
    return lib


class Function:
    """One emulated kernel: call it as ``f(grid, block, args, shared_mem=0)``."""

    #: Like CuPy's attribute: dynamic shared memory beyond 48 KiB must be opted into.
    max_dynamic_shared_size_bytes = 48 * 1024

    def __init__(self, lib, index, name):
        self.name = name
        self._launch = getattr(lib, 'ctemu_launch_{}'.format(index))
        self._launch.argtypes = [ctypes.POINTER(_LaunchArgs)]
        self._launch.restype = ctypes.c_int
        sig = getattr(lib, 'ctemu_signature_{}'.format(index))
        sig.restype = ctypes.c_char_p
        self.params = [_Param(c) for c in sig().decode().split(',') if c]

    @property
    def signature(self):
        return '{}({})'.format(self.name, ', '.join(p.describe() for p in self.params))

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        grid, block = _dim3(grid, 'grid'), _dim3(block, 'block')
        if grid[0] > 2 ** 31 - 1 or grid[1] > 65535 or grid[2] > 65535:
            raise ValueError('grid {} exceeds CUDA limits (2^31-1, 65535, 65535)'.format(grid))
        if block[0] * block[1] * block[2] > 1024 or block[0] > 1024 or block[1] > 1024 \
                or block[2] > 64:
            raise ValueError('block {} exceeds CUDA limits (at most 1024 threads; x, y <= 1024, '
                             'z <= 64)'.format(block))
        shared_mem = int(shared_mem)
        if shared_mem < 0 or shared_mem > self.max_dynamic_shared_size_bytes:
            raise ValueError(
                'shared_mem={} for kernel {}: must be in [0, {}] (raise '
                'max_dynamic_shared_size_bytes to opt into more, as on a GPU)'
                .format(shared_mem, self.name, self.max_dynamic_shared_size_bytes))
        args = tuple(args)
        if len(args) != len(self.params):
            raise TypeError('kernel {} takes {} arguments; got {}'
                            .format(self.signature, len(self.params), len(args)))
        n = len(args)
        values, keep = (ctypes.c_void_p * n)(), []
        nbytes, itemsize = (ctypes.c_uint64 * n)(), (ctypes.c_uint64 * n)()
        writeback, alias = (ctypes.c_int * n)(), (ctypes.c_int * n)()
        seen = {}
        for i, (p, a) in enumerate(zip(self.params, args)):
            alias[i] = -1
            if p.is_pointer and a is None:               # a null pointer, as CuPy passes None
                holder = ctypes.c_void_p(0)
                address = ctypes.addressof(holder)
                nbytes[i] = _SCALAR
            elif p.is_pointer:
                self._check_array(i, p, a)
                ptr = a.ctypes.data
                span = (ptr, a.nbytes)
                if span in seen:
                    alias[i] = seen[span]
                    writeback[seen[span]] |= int(p.kind == 'P')
                else:
                    for (q, qn), j in seen.items():      # (an empty array overlaps nothing)
                        if ptr < q + qn and q < ptr + a.nbytes and qn and a.nbytes:
                            raise ValueError(
                                'kernel {}: arguments {} and {} overlap without being the same '
                                'array; the emulator cannot guard partial overlaps'
                                .format(self.name, j, i))
                    seen[span] = i
                    writeback[i] = int(p.kind == 'P')
                holder = ctypes.c_void_p(ptr)
                address = ctypes.addressof(holder)
                nbytes[i], itemsize[i] = a.nbytes, a.itemsize
            else:
                holder, address = _aligned_copy(self._scalar(i, p, a))
                nbytes[i] = _SCALAR
            keep.append(holder)
            values[i] = address
        err = ctypes.create_string_buffer(_ERR_LEN)
        la = _LaunchArgs(grid=(ctypes.c_uint * 3)(*grid), block=(ctypes.c_uint * 3)(*block),
                         shared_mem=shared_mem, nargs=n, args=values, nbytes=nbytes,
                         itemsize=itemsize, writeback=writeback, alias=alias,
                         guard_front=_guard_front(), err=ctypes.cast(err, ctypes.c_char_p))
        with _launch_lock:
            rc = self._launch(ctypes.byref(la))
        if rc != 0:
            raise KernelLaunchError(self._explain(err.value.decode(errors='replace'), args))

    def _explain(self, msg, args):
        """Name each 'argument N (B bytes)' of a runtime message by its type and array."""
        def sub(m):
            i = int(m.group(1))
            if i >= len(args):
                return m.group(0)
            a = args[i]
            return 'argument {} ({}, {} array of shape {})'.format(
                i, self.params[i].describe(), a.dtype, a.shape)
        return re.sub(r'argument (\d+) \((\d+) bytes\)', sub, msg)

    def _check_array(self, i, p, a):
        where = 'argument {} ({}) of kernel {}'.format(i, p.describe(), self.signature)
        if not isinstance(a, numpy.ndarray):
            raise TypeError('{}: expected a NumPy array; got {}'.format(where, _describe(a)))
        if p.dtype is not None and a.dtype != p.dtype:
            raise TypeError('{}: expected a {} array; got {}'
                            .format(where, numpy.dtype(p.dtype).name, _describe(a)))
        if not a.flags.c_contiguous:
            raise ValueError('{}: the array must be C-contiguous (CuPy would pass its raw pointer '
                             'and the kernel would read the wrong elements); got strides {}'
                             .format(where, a.strides))
        if p.kind == 'P' and not a.flags.writeable:
            raise ValueError('{}: the kernel may write through this pointer but the array is '
                             'read-only'.format(where))

    def _scalar(self, i, p, a):
        """The bytes of a by-value argument, checked against the parameter."""
        where = 'argument {} ({}) of kernel {}'.format(i, p.describe(), self.signature)
        if p.nbytes is not None:                   # struct or vector type: raw bytes of its size
            expected = ('{}: expected a NumPy array of size 1 holding {} bytes (a structured '
                        'dtype: CuPy passes only size-1 arrays by value); got {}'.format(
                            where, p.nbytes, _describe(a)))
            if not isinstance(a, numpy.ndarray) or a.size != 1:
                raise TypeError(expected)
            raw = a.tobytes()
            if len(raw) != p.nbytes:
                raise TypeError('{} of {} bytes'.format(expected, len(raw)))
            return raw
        if not isinstance(a, numpy.generic) or a.dtype != p.dtype:
            hint = ''
            if isinstance(a, (bool, int, float)):
                hint = (' (pass numpy.{}(...): CuPy turns a Python {} into a 64-bit value)'
                        .format(numpy.dtype(p.dtype).name, type(a).__name__))
            raise TypeError('{}: expected a numpy.{} scalar; got {}{}'
                            .format(where, numpy.dtype(p.dtype).name, _describe(a), hint))
        return a.tobytes()


class RawModule:
    """Emulated counterpart of ``cupy.RawModule(code=..., options=..., name_expressions=...)``.

    ``path`` reads the source from a file (and names it in compiler messages), like CuPy's ``path``
    for source files. Kernels are the ``extern "C" __global__`` functions of the source plus every
    entry of ``name_expressions`` (e.g. ``'my_kernel<float>'``).
    """

    def __init__(self, code=None, *, path=None, options=(), name_expressions=None):
        if (code is None) == (path is None):
            raise TypeError('RawModule needs exactly one of code= or path=')
        source_name = '<string>'
        if path is not None:
            with open(path) as f:
                code = f.read()
            source_name = path
        self.code = code
        self.options = tuple(options)
        names = entry_points(code) + [e for e in (name_expressions or ())
                                      if e not in entry_points(code)]
        self._names = names
        unit = _translation_unit(code, source_name, names)
        key, binary = _build(unit, _host_options(self.options), source_name)
        self._lib = _load(key, binary)
        self._functions = {}

    def get_function(self, name):
        if name not in self._names:
            raise AttributeError('no kernel {!r} in this module; it has: {}. A templated kernel '
                                 'must be listed in name_expressions.'
                                 .format(name, ', '.join(self._names) or 'none'))
        f = self._functions.get(name)
        if f is None:
            f = self._functions[name] = Function(self._lib, self._names.index(name), name)
        return f


class RawKernel(Function):
    """Emulated counterpart of ``cupy.RawKernel(code, name, options=())``."""

    def __init__(self, code, name, options=()):
        mod = RawModule(code=code, options=options, name_expressions=[name])
        f = mod.get_function(name)
        self.__dict__.update(f.__dict__)
        self._module = mod
