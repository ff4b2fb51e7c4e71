"""Run CUDA kernels on the CPU, with CuPy's calling convention, as a memcheck and racecheck.

    from chainer_tc.testing import emulator
    mod = emulator.RawModule(code=open('kernels/layout.cu').read(), options=('-DTILE=32',))
    k = mod.get_function('batched_transpose_f32_f16')
    k((grid_x, grid_y, grid_z), (32, 8), (src, dst, np.int32(rows), np.int32(cols), np.int64(n)))

The same ``.cu`` text that NVRTC compiles for the GPU is compiled by g++ against the emulation
header ``include/chainer_tc_emu.h``, with GCC's instrumentation (every load and store, array
bounds, alignment, integer division) calling back into the emulator's runtime
(``runtime/emu_runtime.cpp``, whose header comment describes the execution model), and loaded from
memory. Array arguments are NumPy arrays (passed as device pointers); scalar arguments are NumPy
scalars whose dtype must match the kernel's parameter type exactly (a Python ``int`` would reach
CuPy as int64, so it is refused here).

Every array, and every allocation a pointer table inside an argument points into, is copied into
its own region of a per-launch arena for the launch; every access is checked against it, so an
out-of-bounds access, a data race (with the race detector on) or an order-dependent result raises
:class:`~chainer_tc.errors.KernelLaunchError` naming the argument, the offset and the threads,
instead of corrupting memory; the arrays are left untouched when a launch fails.

Checks, chosen per launch (see docs/emulator.md):

- always: memcheck (bounds of every access, static ``__shared__`` and local arrays, alignment,
  integer division by zero), ``__launch_bounds__``, shared-memory and parameter-block limits;
- ``CHAINER_TC_EMULATOR_RACECHECK=1`` (or ``with emulator.checking(race=True)``): the race detector,
  and the launch run under several schedules (``forward,reverse,random:1`` unless
  ``CHAINER_TC_EMULATOR_SCHEDULES`` says otherwise) whose results must agree, and the far check
  (the first schedule again over arrays laid out anew: an access so far off its array that it
  landed in another one is found; ``CHAINER_TC_EMULATOR_FAR=1``/``0`` or ``checking(far=...)``
  turns it on or off alone).

``with emulator.recording() as launches:`` counts every access of each launch per array, by
width, with its bytes (``chainer_tc.testing.access_counts``): a kernel's vector path, or the bytes
it moves, made visible.

Differences from a GPU, by design: the emulator rejects what CuPy would let through silently
(non-contiguous arrays, scalars of the wrong width, writing through a pointer to const), and NVRTC
options other than ``-D``/``-U``/``-I`` (architecture, fast-math, ``-ftz``) are ignored: fp32
results are IEEE-exact on the CPU, with subnormals, while CuPy always compiles with ``-ftz=true``;
``emulator.checking(ftz=True)`` (or ``CHAINER_TC_EMULATOR_FTZ=1``) flushes them as a GPU does
(float64 subnormals too, which a GPU keeps), and ``emulator.checking(fmad=True)`` (or
``CHAINER_TC_EMULATOR_FMAD=1``) contracts ``a * b + c`` into fmas as NVRTC does by default.
"""
import contextlib
import ctypes
import os
import platform
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import warnings

import numpy

from chainer_tc import _cache
from chainer_tc.errors import CompileError
from chainer_tc.errors import KernelLaunchError
from chainer_tc.testing import access_counts
from chainer_tc.testing.access_counts import recording  # NOQA: emulator.recording()

HERE = os.path.dirname(os.path.abspath(__file__))
INCLUDE_DIR = os.path.join(HERE, 'include')
RUNTIME_DIR = os.path.join(HERE, 'runtime')
_EMULATOR_VERSION = '8'        # part of the cache key: bump when the g++ commands change
_ERR_LEN = 2048
_SCALAR = 2 ** 64 - 1
_ALIGN = 64            # by-value arguments are copied to addresses aligned to this (__align__(16) ...)

#: CUDA's parameter block: 4 KiB (32764 bytes needs CUDA 12.1+ drivers and toolkits on Volta+).
PARAM_LIMIT = 4096
#: The most dynamic shared memory any GPU gives a block after opting in (sm_90: 227 KiB).
MAX_SHARED_OPT_IN = 227 * 1024

ENV_RACECHECK = 'CHAINER_TC_EMULATOR_RACECHECK'
ENV_FTZ = 'CHAINER_TC_EMULATOR_FTZ'
ENV_FMAD = 'CHAINER_TC_EMULATOR_FMAD'
ENV_SCHEDULES = 'CHAINER_TC_EMULATOR_SCHEDULES'
ENV_FAR = 'CHAINER_TC_EMULATOR_FAR'
DEFAULT_RACE_SCHEDULES = ('forward', 'reverse', 'random:1')

_launch_lock = threading.RLock()
_modules = {}          # cache key -> loaded ctypes library, so each module is loaded once
_binaries = {}         # cache key -> the shared object's bytes (to name source lines)
_memfds = []           # descriptors of the loaded modules (kept open, see _load)
_runtime_objects = {}  # (compiler id, flags) -> the compiled runtime object
_checks = threading.local()     # .stack: the overrides pushed by checking() in this thread

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
# what may stand before `__shared__` in a declaration
_SHARED_LEAD_RE = re.compile(
    r'((?:\b(?:static|extern|volatile|const)\b\s*|__align__\s*\(\s*\d+\s*\)\s*|'
    r'alignas\s*\(\s*\d+\s*\)\s*)*)$')
_DECLARATOR_RE = re.compile(r'^(.*?)\s*\b([A-Za-z_]\w*)\s*((?:\[[^\[\]]*\]\s*)*)$', re.S)
_NEXT_DECLARATOR_RE = re.compile(r'^([\s*]*)\b([A-Za-z_]\w*)\s*((?:\[[^\[\]]*\]\s*)*)$', re.S)
_ATTR_RE = re.compile(r'__align__\s*\(\s*\d+\s*\)|alignas\s*\(\s*\d+\s*\)|\bstatic\b')


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


def _block_start(code, pos):
    """Index of the '{' opening the block that contains ``pos``, or None at file scope."""
    depth = 0
    for i in range(pos - 1, -1, -1):
        c = code[i]
        if c == '}':
            depth += 1
        elif c == '{':
            if depth == 0:
                return i
            depth -= 1
    return None


def _in_function(plain, pos):
    """Whether ``pos`` is inside a function body (not at namespace or file scope)."""
    while True:
        open_ = _block_start(plain, pos)
        if open_ is None:
            return False
        head = plain[max(0, open_ - 200):open_]
        if re.search(r'(\bnamespace\b[\w\s:]*|\bextern\s*"[^"]*"\s*)$', head):
            pos = open_
            continue
        return True


def _statement_end(plain, pos):
    """Index of the ';' ending the declaration that continues at ``pos`` (brackets balanced)."""
    depth = 0
    for i in range(pos, len(plain)):
        c = plain[i]
        if c in '([{':
            depth += 1
        elif c in ')]}':
            depth -= 1
        elif c == ';' and depth == 0:
            return i
    return None


def _split_top(text, sep=','):
    """``text`` split at the ``sep`` characters outside brackets and template arguments."""
    parts, depth, angle, start = [], 0, 0, 0
    for i, c in enumerate(text):
        if c in '([{':
            depth += 1
        elif c in ')]}':
            depth -= 1
        elif c == '<' and depth == 0:
            angle += 1
        elif c == '>' and depth == 0 and angle:
            angle -= 1
        elif c == sep and depth == 0 and angle == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _shared_declarators(text, line):
    """[(name, type)] of the body of one ``__shared__`` declaration (after the keyword)."""
    text = _ATTR_RE.sub(' ', text)
    parts = _split_top(text)
    m = _DECLARATOR_RE.match(parts[0].strip())
    if not m or not m.group(1).strip():
        raise CompileError('emulator: cannot read the __shared__ declaration on line {} '
                           '("__shared__{};")'.format(line, text))
    spec, out = m.group(1).strip(), []
    out.append((m.group(2), spec + m.group(3).replace(' ', '')))
    base = spec.rstrip('*& \t\n')
    for part in parts[1:]:
        n = _NEXT_DECLARATOR_RE.match(part.strip())
        if not n:
            raise CompileError('emulator: cannot read the __shared__ declaration on line {} '
                               '("__shared__{};")'.format(line, text))
        out.append((n.group(2), base + n.group(1).replace(' ', '').replace('\n', '') +
                    n.group(3).replace(' ', '')))
    return out


def _in_directive(plain, pos):
    """Whether ``pos`` is in a preprocessor directive (a ``#define`` and its continued lines)."""
    start = plain.rfind('\n', 0, pos) + 1
    while start > 1 and plain[:start - 1].rstrip(' \t').endswith('\\'):
        start = plain.rfind('\n', 0, start - 1) + 1
    return plain[start:pos].lstrip().startswith('#')


def _rewrite_shared(code):
    """Shared memory declarations -> the runtime's per-block storage.

    ``extern __shared__ T name[];`` (dynamic) becomes a macro for the launch's dynamic shared
    memory, ``#undef``'d where the enclosing block ends. ``__shared__ T a[N], b;`` (static) becomes
    ``auto& a = ::ctemu::shared_ref<T[N], id>("a"); ...`` in a function body, a macro at
    namespace scope: storage per block, filled with 0xff bytes when the block starts (as a GPU
    gives garbage; a read of a byte no thread of the block wrote is an error), bounds-checked and
    seen by the race detector, so blocks may run interleaved.
    ``#line`` keeps compiler messages on the original line numbers.
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
    dynamic = [(s, e) for s, e, _ in edits]
    for i, m in enumerate(re.finditer(r'\b__shared__\b', plain)):
        if any(s <= m.start() < e for s, e in dynamic):
            continue
        lead = _SHARED_LEAD_RE.search(plain[:m.start()])
        if re.search(r'\bextern\b', lead.group(1)):
            continue
        line = code.count('\n', 0, m.start()) + 1
        if _in_directive(plain, m.start()):
            # where the macro is expanded (a kernel, namespace scope, twice in one function)
            # is not known here: left as the header's `static`, one copy for every block
            raise CompileError(
                'emulator: a __shared__ declaration inside a macro (line {}) cannot be given '
                'per-block storage: declare the variable outside the macro'.format(line))
        start = lead.start(1)
        end = _statement_end(plain, m.end())
        if end is None:
            raise CompileError('emulator: no ";" ends the __shared__ declaration on line {}'
                               .format(line))
        qualifiers = ' '.join(w for w in re.findall(r'\b(?:volatile|const)\b', lead.group(1)))
        decls = _shared_declarators(qualifiers + ' ' + code[m.end():end], line)
        newlines = code.count('\n', start, end + 1)
        refs = ['::ctemu::shared_ref<{t}, {id}>("{n}")'.format(t=t, id=1000 * (i + 1) + k, n=n)
                for k, (n, t) in enumerate(decls)]
        if _in_function(plain, m.start()):
            text = ' '.join('auto& {} = {};'.format(n, r) for (n, _), r in zip(decls, refs))
            text += '\n' * newlines
        else:
            text = ''.join('\n#define {} ({})'.format(n, r) for (n, _), r in zip(decls, refs))
            text += '\n#line {}\n'.format(code.count('\n', 0, end + 1) + 1)
            at_end.extend(n for n, _ in decls)
        edits.append((start, end + 1, text))
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


def _launch_bounds(code, name):
    """The first argument of the ``__launch_bounds__`` of kernel ``name`` (a templated kernel's
    name without its arguments), as text, or None. Only an expression the preprocessor can
    evaluate (numbers, macros, + - * / %) is returned."""
    plain = _blank(code)
    base = re.escape(name.split('<')[0].strip())
    m = re.search(r'__launch_bounds__\s*\(((?:[^()]|\([^()]*\))*)\)'
                  r'(?:\s*(?:__global__|void|static|inline|extern\s*"C")\b)*\s*'
                  r'(?:\w+\s*::\s*)*' + base + r'\s*[(<]', plain)
    if not m:
        return None
    expr = _split_top(m.group(1))[0].strip()
    if not re.fullmatch(r'[\w\s+\-*/%()]+', expr) or 'sizeof' in expr:
        return None
    return expr


def _restrict_params(code, name):
    """Per parameter of kernel ``name`` (a templated kernel's name with or without its
    arguments): 2 for a ``const ... * __restrict__`` pointer, 1 for another ``__restrict__``
    one, 0 otherwise, read from the kernel's definition (the declaration followed by its body);
    None where no definition is found (a kernel made by a macro). Top-level qualifiers of
    parameters are not part of a function's type, so the compiled module cannot tell."""
    plain = _blank(code, literals=True)
    base = re.escape(name.split('<')[0].strip())
    for m in re.finditer(r'\b' + base + r'\s*\(', plain):
        head = plain[max(0, m.start() - 400):m.start()]
        if '__global__' not in head[max(head.rfind(';'), head.rfind('}')) + 1:]:
            continue
        depth, close = 0, None
        for i in range(m.end() - 1, len(plain)):
            if plain[i] == '(':
                depth += 1
            elif plain[i] == ')':
                depth -= 1
                if depth == 0:
                    close = i
                    break
        if close is None or not re.match(r'\s*\{', plain[close + 1:]):
            continue                                     # a declaration or an instantiation
        text = plain[m.end():close]
        if not text.strip() or text.strip() == 'void':
            return []
        out = []
        for param in _split_top(text):
            if not re.search(r'\b__restrict(__)?\b', param):
                out.append(0)
                continue
            before = re.split(r'\*\s*(?:const\s+)?__restrict', param)[0]
            out.append(2 if re.search(r'\bconst\b', before) else 1)
        return out
    return None


def _translation_unit(code, source_name, names):
    lines = ['#line 1 "{}"'.format(source_name.replace('\\', '/').replace('"', '')),
             _rewrite_shared(code),
             '#line 1 "<chainer_tc emulator exports>"']
    for i, expr in enumerate(names):
        lines.append(
            'extern "C" __attribute__((visibility("default"))) int ctemu_launch_{i}('
            'const ::ctemu::LaunchArgs* la) {{ return ::ctemu::launch(&{e}, "{q}", la); }}\n'
            'extern "C" __attribute__((visibility("default"))) const char* ctemu_signature_{i}() {{ '
            'return ::ctemu::signature(&{e}); }}'
            .format(i=i, e=expr, q=expr.replace('"', '')))
        bound = _launch_bounds(code, expr)
        lines.append('extern "C" __attribute__((visibility("default"))) long long '
                     'ctemu_bounds_{}() {{'.format(i))
        if bound:
            lines.append('#if ({b}) > 0\n  return (long long)({b});\n#else\n  return 0;\n#endif'
                         .format(b=bound))
        else:
            lines.append('  return 0;')
        lines.append('}')
    return '\n'.join(lines) + '\n'


# ---- compiling ---------------------------------------------------------------------------------

def _compiler():
    cxx = os.environ.get('CXX') or shutil.which('g++') or shutil.which('c++')
    if not cxx:
        raise CompileError('the CUDA emulator needs a C++ compiler (g++) on PATH; none was found')
    return cxx


def _compiler_id(cxx):
    try:
        out = subprocess.run([cxx, '--version'], capture_output=True, text=True, check=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise CompileError('cannot run the C++ compiler {!r}: {}'.format(cxx, e))
    return out.splitlines()[0] if out else cxx


def _dir_text(d):
    parts = []
    for name in sorted(os.listdir(d)):
        with open(os.path.join(d, name), 'rb') as f:
            parts.append(name.encode() + b'\0' + f.read())
    return b'\0'.join(parts)


def _header_text():
    with open(os.path.join(RUNTIME_DIR, 'emu_runtime.cpp'), 'rb') as f:
        return _dir_text(INCLUDE_DIR) + b'\0\0' + f.read()


def _limits():
    """(seconds, bytes) the compiler may take: CHAINER_TC_EMULATOR_COMPILE_TIMEOUT (default 300)
    and CHAINER_TC_EMULATOR_COMPILE_MEMORY_MB (default 4096, its address space)."""
    def number(name, default):
        text = os.environ.get(name, '')
        try:
            value = float(text) if text else default
        except ValueError:
            raise ValueError('{} must be a number; got {!r}'.format(name, text)) from None
        if value <= 0:
            raise ValueError('{} must be positive; got {!r}'.format(name, text))
        return value
    return (number('CHAINER_TC_EMULATOR_COMPILE_TIMEOUT', 300.0),
            int(number('CHAINER_TC_EMULATOR_COMPILE_MEMORY_MB', 4096.0) * 2 ** 20))


def _run_compiler(cmd, what):
    """Run one compiler command under the time and memory limits; CompileError on failure."""
    seconds, memory = _limits()

    def limit():                    # in the child, before exec: the compiler's address space
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=limit, start_new_session=True)
    except OSError as e:
        raise CompileError('emulator: cannot run {}: {}'.format(cmd[0], e))
    try:
        out, err = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)     # the driver and cc1plus alike
        proc.communicate()
        raise CompileError('emulator: {} did not finish within {:g} s (raise '
                           'CHAINER_TC_EMULATOR_COMPILE_TIMEOUT)'.format(what, seconds))
    except BaseException:                       # KeyboardInterrupt: its own session got none
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    if proc.returncode == 0:
        return
    log = (err or out or '').strip()
    if proc.returncode < 0 or re.search(r'out of memory|memory exhausted|cannot allocate memory|'
                                        r'failed to map segment|internal compiler error', log, re.I):
        reason = ('killed by signal {}'.format(-proc.returncode) if proc.returncode < 0
                  else 'out of memory')
        raise CompileError('emulator: {} failed: the compiler was {} (its address space is limited '
                           'to {} MiB: raise CHAINER_TC_EMULATOR_COMPILE_MEMORY_MB){}'.format(
                               what, reason, memory >> 20, ':\n' + log if log else ''))
    raise CompileError('emulator: {}:\n{}'.format(what, log or 'the compiler exited with status {}'
                                                  .format(proc.returncode)))


# -U_FORTIFY_SOURCE: the runtime switches between thread stacks with _longjmp, which a fortified
# build turns into __longjmp_chk; that aborts ('longjmp causes uninitialized stack frame') when the
# target is another stack. Ubuntu's g++ fortifies by default at -O2; Debian's does not.
_RUNTIME_FLAGS = ('-std=c++17', '-O2', '-fPIC', '-fvisibility=hidden', '-fno-strict-aliasing',
                  '-U_FORTIFY_SOURCE')
# Every load and store of the kernel calls __tsan_readN/__tsan_writeN (volatile ones their own),
# with no function entry/exit hooks; array bounds, alignment and integer division by zero call
# __ubsan_handle_*: all defined by the runtime, no sanitizer library is linked. -fno-tree-sra keeps
# a copy of a vector type one access (a float2 load is one 8-byte read, as NVVM makes it one
# ld.v2), where scalar replacement would split it into its members: emulator.recording() counts
# accesses by width, and the tests read a kernel's vector path from them (no slower here).
# object-size: an access through a pointer past the end of a local or static array (which
# -fsanitize=bounds sees only when indexed as an array). -ftrivial-auto-var-init=pattern (GCC 12):
# a local read before it is written holds 0xFE bytes (-1.7e38 as a float), not the zero of a fresh
# fiber stack that would make an uninitialised accumulator look right. signed-integer-overflow (an
# NCHW offset in int), shift (a count of the type's width: a GPU clamps, x86 takes it mod 32) and
# float-cast-overflow (a GPU saturates a float converted to int, x86 does not) are undefined in
# CUDA C++ as in C++, and the CPU's result is not a GPU's. -fno-omit-frame-pointer: at a barrier the
# runtime walks the frames to tell apart two calls of a helper holding one __syncthreads().
_KERNEL_FLAGS = ('-std=c++17', '-O1', '-fno-tree-sra', '-g1', '-gdwarf-4', '-fPIC', '-fno-strict-aliasing', '-fvisibility=hidden',
                 '-U_FORTIFY_SOURCE', '-fno-omit-frame-pointer', '-fno-thread-jumps', '-fsanitize=thread',
                 '--param=tsan-instrument-func-entry-exit=0', '--param=tsan-distinguish-volatile=1',
                 '-fsanitize=bounds,alignment,integer-divide-by-zero,object-size',
                 '-fsanitize=signed-integer-overflow,shift-exponent,float-cast-overflow',
                 '-fno-sanitize-recover=all', '-ftrivial-auto-var-init=pattern')


def _runtime_object(cxx, cxx_id, name):
    """The compiled object of ``runtime/<name>.cpp`` (cached per compiler and source)."""
    src = os.path.join(RUNTIME_DIR, name + '.cpp')
    with open(src, 'rb') as f:
        text = f.read()
    memo = (cxx_id, name, text)
    obj = _runtime_objects.get(memo)
    if obj is not None:
        return obj
    key = _cache.key_of(_EMULATOR_VERSION, cxx_id, '\0'.join(_RUNTIME_FLAGS), _header_text(),
                        name, text)
    obj = _cache.load('emulator_runtime', key)
    if obj is None:
        with tempfile.TemporaryDirectory(prefix='chainer_tc_emu_') as tmp:
            out = os.path.join(tmp, name + '.o')
            _run_compiler([cxx, *_RUNTIME_FLAGS, '-I' + INCLUDE_DIR, '-c', src, '-o', out],
                          'g++ failed to compile the emulator runtime ' + src)
            with open(out, 'rb') as f:
                obj = f.read()
        _cache.store('emulator_runtime', key, obj)
    _runtime_objects[memo] = obj
    return obj


def _fmad_flags():
    """g++ flags that contract a * b + c into an fma wherever it can, as NVRTC does by default
    (-fmad=true): -ffp-contract=fast, and -fexpensive-optimizations, without which -O1 forms no
    fma. On x86 the CPU must have FMA instructions (-mfma)."""
    machine = platform.machine().lower()
    flags = ['-ffp-contract=fast', '-fexpensive-optimizations']
    if machine in ('x86_64', 'amd64', 'i386', 'i686'):
        try:
            with open('/proc/cpuinfo') as f:
                has_fma = any(line.startswith('flags') and ' fma ' in line + ' ' for line in f)
        except OSError:
            has_fma = False
        if not has_fma:
            raise RuntimeError('emulator.checking(fmad=True): this CPU has no FMA instructions, so '
                               'the emulator cannot contract a * b + c as a GPU does')
        flags.append('-mfma')
    elif machine not in ('aarch64', 'arm64'):
        raise RuntimeError('emulator.checking(fmad=True): contraction is set up for x86-64 and '
                           'aarch64; this machine is {}'.format(machine))
    return tuple(flags)


def _build(unit, options, source_name, extra_flags=()):
    cxx = _compiler()
    cxx_id = _compiler_id(cxx)
    key = _cache.key_of(_EMULATOR_VERSION, cxx_id, '\0'.join(_KERNEL_FLAGS + tuple(extra_flags)),
                        '\0'.join(_RUNTIME_FLAGS), _header_text(),
                        '\0'.join(options), unit)
    binary = _cache.load('emulator', key)
    if binary is None:
        runtime = _runtime_object(cxx, cxx_id, 'emu_runtime')
        with tempfile.TemporaryDirectory(prefix='chainer_tc_emu_') as tmp:
            src, obj = os.path.join(tmp, 'kernel.cpp'), os.path.join(tmp, 'kernel.o')
            rt_obj, so = os.path.join(tmp, 'runtime.o'), os.path.join(tmp, 'kernel.so')
            with open(src, 'w') as f:
                f.write(unit)
            with open(rt_obj, 'wb') as f:
                f.write(runtime)
            # -fvisibility=hidden: only the launchers are exported. Otherwise g++ makes the runtime
            # and every static in a template or inline function one process-wide STB_GNU_UNIQUE
            # object, shared by all modules whatever their sizes.
            try:
                _run_compiler([cxx, *_KERNEL_FLAGS, *extra_flags, '-I' + INCLUDE_DIR, '-include',
                               'chainer_tc_emu.h', *options, '-x', 'c++', '-c', src, '-o', obj],
                              'g++ failed to compile ' + source_name)
            except CompileError:
                if os.environ.get('CHAINER_TC_DUMP_SOURCE') == '1':
                    print(unit)
                raise
            # linked without -fsanitize: no sanitizer runtime; the runtime object defines the hooks
            _run_compiler([cxx, '-shared', '-fPIC', obj, rt_obj, '-o', so, '-lpthread', '-ldl'],
                          'g++ failed to link ' + source_name)
            with open(so, 'rb') as f:
                binary = f.read()
        _cache.store('emulator', key, binary)
    return key, binary


def _load_bytes(tag, binary):
    if hasattr(os, 'memfd_create'):
        # The verified bytes are loaded from memory, so nothing on disk can change between the
        # check and the load. The descriptor stays open for the life of the process: dlopen
        # recognises an already-loaded library by its path, so a reused /proc/self/fd/N would
        # silently return the previous module.
        fd = os.memfd_create('chainer_tc_emu_' + tag, getattr(os, 'MFD_CLOEXEC', 0))
        view = memoryview(binary)
        while view:
            view = view[os.write(fd, view):]
        lib = ctypes.CDLL('/proc/self/fd/{}'.format(fd))
        _memfds.append(fd)
        return lib
    with tempfile.TemporaryDirectory(prefix='chainer_tc_emu_') as tmp:  # pragma: no cover
        path = os.path.join(tmp, 'kernel.so')
        with open(path, 'wb') as f:
            f.write(binary)
        return ctypes.CDLL(path)


def _load(key, binary):
    lib = _modules.get(key)
    if lib is None:
        lib = _modules[key] = _load_bytes(key[:16], binary)
        _binaries[key] = binary
    return lib


# ---- source lines of code addresses ---------------------------------------------------------------

_lines = {}


def _source_line(key, offset):
    """'file:line' (innermost first, ' inlined in ' the callers) of a code offset in a module."""
    memo = (key, offset)
    if memo in _lines:
        return _lines[memo]
    text = None
    binary, tool = _binaries.get(key), shutil.which('addr2line')
    if binary is not None and tool:
        with tempfile.TemporaryDirectory(prefix='chainer_tc_emu_') as tmp:
            path = os.path.join(tmp, 'kernel.so')
            with open(path, 'wb') as f:
                f.write(binary)
            try:
                out = subprocess.run([tool, '-e', path, '-i', hex(max(offset - 1, 0))],
                                     capture_output=True, text=True, timeout=30).stdout
            except (OSError, subprocess.SubprocessError):
                out = ''
        places = []
        for line in out.splitlines():
            line = line.split(' (discriminator')[0].strip()
            if '/<' in line:                      # '<string>' joined to the compile directory
                line = line[line.index('/<') + 1:]
            if line and not line.startswith('??') and line not in places:
                places.append(line)
        if places:
            text = ' inlined in '.join(places[:3])
    _lines[memo] = text
    return text


# ---- pointer tables: allocations behind addresses ------------------------------------------------

_tracker = None
_CAPSULE_NAME = b'mem_handler'


def _numpy_api_indices():
    """The C-API table slots of PyDataMem_SetHandler/GetHandler, read from NumPy's own header."""
    header = os.path.join(numpy.get_include(), 'numpy', '__multiarray_api.h')
    try:
        with open(header) as f:
            text = f.read()
    except OSError:
        return None
    found = {}
    for name in ('PyDataMem_SetHandler', 'PyDataMem_GetHandler'):
        m = re.search(r'#define ' + name + r' \\\s*\(\*\([^\n]*\)\s*\\?\s*PyArray_API\[(\d+)\]\)',
                      text)
        if not m:
            return None
        found[name] = int(m.group(1))
    return found


def _install_tracker():
    """Make NumPy allocate array data through runtime/alloc_track.cpp, which remembers every live
    allocation (NEP 49's PyDataMem_SetHandler): a pointer table may then point at NumPy arrays
    that are not kernel arguments and still be checked. Off with
    CHAINER_TC_EMULATOR_TRACK_ALLOCATIONS=0; silently off where NumPy or the compiler cannot."""
    global _tracker
    if _tracker is not None or os.environ.get('CHAINER_TC_EMULATOR_TRACK_ALLOCATIONS', '1') == '0':
        return
    _tracker = False
    try:
        indices = _numpy_api_indices()
        core = getattr(numpy, '_core', None) or numpy.core
        capsule = core._multiarray_umath._ARRAY_API
        if indices is None:
            return
        cxx = _compiler()
        cxx_id = _compiler_id(cxx)
        obj = _runtime_object(cxx, cxx_id, 'alloc_track')
        key = _cache.key_of('alloc_track', obj)
        binary = _cache.load('emulator_runtime', key)
        if binary is None:
            with tempfile.TemporaryDirectory(prefix='chainer_tc_emu_') as tmp:
                o, so = os.path.join(tmp, 'alloc_track.o'), os.path.join(tmp, 'alloc_track.so')
                with open(o, 'wb') as f:
                    f.write(obj)
                _run_compiler([cxx, '-shared', '-fPIC', o, '-o', so, '-lpthread'],
                              'g++ failed to link the allocation tracker')
                with open(so, 'rb') as f:
                    binary = f.read()
            _cache.store('emulator_runtime', key, binary)
        lib = _load_bytes('alloc_track', binary)
        api = ctypes.pythonapi
        api.PyCapsule_GetPointer.restype = ctypes.c_void_p
        api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
        api.PyCapsule_IsValid.restype = ctypes.c_int
        api.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
        api.PyCapsule_New.restype = ctypes.py_object
        api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        table = ctypes.cast(api.PyCapsule_GetPointer(capsule, None),
                            ctypes.POINTER(ctypes.c_void_p))
        get_handler = ctypes.PYFUNCTYPE(ctypes.py_object)(table[indices['PyDataMem_GetHandler']])
        set_handler = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.py_object)(
            table[indices['PyDataMem_SetHandler']])
        previous = get_handler()
        if not api.PyCapsule_IsValid(previous, _CAPSULE_NAME):
            return
        lib.ctemu_track_init.argtypes = [ctypes.c_void_p]
        lib.ctemu_track_init.restype = ctypes.c_int
        if lib.ctemu_track_init(api.PyCapsule_GetPointer(previous, _CAPSULE_NAME)) != 0:
            return
        handler = api.PyCapsule_New(
            ctypes.addressof(ctypes.c_char.in_dll(lib, 'ctemu_track_handler')), _CAPSULE_NAME, None)
        set_handler(handler)
        lib.ctemu_track_find.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                         ctypes.c_void_p]
        lib.ctemu_track_find.restype = None
        # the library, the handler and the one it replaced live as long as the process: arrays
        # allocated through them free through them
        _tracker = (lib, handler, previous)
    except Exception:          # tracking is a help, never a requirement
        _tracker = False


def tracking_allocations():
    """Whether NumPy arrays allocated from now on are known to the emulator (pointer tables)."""
    return bool(_tracker)


def _allocations(words):
    """(start, size) of the live tracked allocation holding each address (0, 0 where none)."""
    words = numpy.ascontiguousarray(words, numpy.uint64)
    start, size = numpy.zeros_like(words), numpy.zeros_like(words)
    if _tracker and words.size:
        _tracker[0].ctemu_track_find(words.ctypes.data, words.size, start.ctypes.data,
                                     size.ctypes.data)
    return start, size


# ---- launching ------------------------------------------------------------------------------------

def _offset_in_allocation(a):
    """Bytes from the start of the memory ``a`` views (its owning array's) to its first byte. The
    emulator places each array's copy this far (mod 256) past a 256-byte boundary, so a view that
    would be misaligned on a GPU (CuPy's allocations are 256-byte aligned, a view keeps its
    offset) is misaligned in the emulator too, and a vector access through it fails as it would
    there; a whole array starts on the boundary, as cudaMalloc's do."""
    owner = a
    while isinstance(owner.base, numpy.ndarray):
        owner = owner.base
    offset = a.ctypes.data - owner.ctypes.data
    if owner.base is not None:      # memory NumPy did not allocate (a buffer): its own address
        offset += owner.ctypes.data  # counts, as launch code that reads the address sees it
    return offset


class _LaunchArgs(ctypes.Structure):
    _fields_ = [
        ('grid', ctypes.c_uint * 3), ('block', ctypes.c_uint * 3),
        ('shared_mem', ctypes.c_uint64), ('max_dyn_shared', ctypes.c_uint64),
        ('nargs', ctypes.c_int),
        ('args', ctypes.POINTER(ctypes.c_void_p)),
        ('nbytes', ctypes.POINTER(ctypes.c_uint64)),
        ('itemsize', ctypes.POINTER(ctypes.c_uint64)),
        ('writeback', ctypes.POINTER(ctypes.c_int)),
        ('alias', ctypes.POINTER(ctypes.c_int)),
        ('misalign', ctypes.POINTER(ctypes.c_uint64)),
        ('ntargets', ctypes.c_int),
        ('target_host', ctypes.POINTER(ctypes.c_uint64)),
        ('target_nbytes', ctypes.POINTER(ctypes.c_uint64)),
        ('target_arg', ctypes.POINTER(ctypes.c_int)),
        ('nslots', ctypes.c_int),
        ('slot_arg', ctypes.POINTER(ctypes.c_int)),
        ('slot_offset', ctypes.POINTER(ctypes.c_uint64)),
        ('slot_target', ctypes.POINTER(ctypes.c_int)),
        ('race', ctypes.c_int),
        ('schedules', ctypes.c_char_p),
        ('err', ctypes.c_char_p),
        ('slot_bytes', ctypes.POINTER(ctypes.c_uint64)),
        ('counts', ctypes.POINTER(ctypes.c_uint64)),
        ('ftz', ctypes.c_int),
        ('restrict', ctypes.POINTER(ctypes.c_int)),
        ('nc_all', ctypes.c_int),
        ('far', ctypes.c_int),
        ('far_skipped', ctypes.POINTER(ctypes.c_int)),
    ]


#: The arena's slot size the runtime asks for: an access up to this many bytes before or after
#: an array (a 32-bit index of 16-byte elements) is reported against that array.
FAR_BYTES = 1 << 35
_far_warned = []
_far_skipped = []


def _check_slot_bytes(got):
    if got < FAR_BYTES and not _far_warned:
        _far_warned.append(got)
        warnings.warn('emulator: the address space for 32 GiB slots could not be reserved; this '
                      'launch catches accesses up to {} bytes off an array, not {} (an access '
                      'further away may land in another array)'.format(got, FAR_BYTES),
                      RuntimeWarning, stacklevel=3)


class _Param:
    """One kernel parameter, decoded from the signature the compiled module reports."""

    def __init__(self, text):
        code, size, align = text.split(':')
        self.kind = code[0]                       # 'P' pointer, 'C' pointer to const, 'S' scalar
        self.code = code[1:]
        self.size, self.align = int(size), int(align)     # in the parameter block
        self.is_pointer = self.kind in 'PC'
        if self.code in _CODES:
            self.ctype, self.dtype = _CODES[self.code]
        elif self.code.startswith('s'):           # a struct: 's<size>'
            self.ctype, self.dtype = 'struct of {} bytes'.format(self.code[1:]), None
        else:
            raise RuntimeError('emulator: unknown parameter code {!r}'.format(text))
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

    @property
    def may_hold_addresses(self):
        """A struct passed by value, or an array of uint64 (a table of pointers)."""
        return (self.kind == 'S' and self.code.startswith('s')) or \
            (self.is_pointer and self.code == 'u8')


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


def _schedule_names(spec):
    """'forward,reverse,random:3' or a count n (forward, reverse, random:1 .. random:n-2)."""
    if isinstance(spec, (int, numpy.integer)) or (isinstance(spec, str) and spec.strip().isdigit()):
        n = int(spec)
        if n < 1:
            raise ValueError('the number of schedules must be >= 1; got {}'.format(n))
        names = ['forward', 'reverse'][:n] + ['random:{}'.format(k) for k in range(1, n - 1)]
    else:
        names = [s.strip() for s in (spec.split(',') if isinstance(spec, str) else spec)]
    for s in names:
        if not re.fullmatch(r'forward|reverse|random(:\d+)?', s):
            raise ValueError("unknown schedule {!r}: use 'forward', 'reverse' or 'random:<seed>'"
                             .format(s))
    if not names or len(names) > 16:
        raise ValueError('between 1 and 16 schedules; got {}'.format(len(names)))
    return names


def current_checks():
    """(race, schedules) for the next launch: the innermost :func:`checking`, else the
    environment (CHAINER_TC_EMULATOR_RACECHECK, CHAINER_TC_EMULATOR_SCHEDULES)."""
    race = os.environ.get(ENV_RACECHECK, '') == '1'
    spec = os.environ.get(ENV_SCHEDULES, '')
    schedules = _schedule_names(spec) if spec else None
    for override in getattr(_checks, 'stack', ()):
        if override[0] is not None:
            race = override[0]
        if override[1] is not None:
            schedules = override[1]
    if schedules is None:
        schedules = list(DEFAULT_RACE_SCHEDULES) if race else ['forward']
    return race, schedules


def _current_flag(env, index):
    value = os.environ.get(env, '') == '1'
    for override in getattr(_checks, 'stack', ()):
        if override[index] is not None:
            value = override[index]
    return value


def current_far():
    """Whether the next launch runs the far check (its first schedule again, over arrays laid
    out anew): the innermost :func:`checking` that says, else CHAINER_TC_EMULATOR_FAR (``1`` or
    ``0``), else whether the race detector is on."""
    value = os.environ.get(ENV_FAR, '')
    value = current_checks()[0] if value not in ('0', '1') else value == '1'
    for override in getattr(_checks, 'stack', ()):
        if override[4] is not None:
            value = override[4]
    return value


def current_ftz():
    """Whether the next launch flushes float32 subnormals as CuPy's ``-ftz=true`` does: the
    innermost :func:`checking` that says, else CHAINER_TC_EMULATOR_FTZ=1."""
    return _current_flag(ENV_FTZ, 2)


def current_fmad():
    """Whether the next launch runs code compiled to contract ``a * b + c`` into fmas, as NVRTC's
    default ``-fmad=true`` does: the innermost :func:`checking` that says, else
    CHAINER_TC_EMULATOR_FMAD=1."""
    return _current_flag(ENV_FMAD, 3)


@contextlib.contextmanager
def checking(race=None, schedules=None, ftz=None, fmad=None, far=None):
    """Within this block, launches run with the race detector on or off (``race``), under the
    given ``schedules`` (a list such as ``['forward', 'reverse', 'random:7']``, or a count),
    flushing float32 subnormals to zero or not (``ftz``: as a GPU does under CuPy's
    ``-ftz=true``; float64 subnormals flush too here, which a GPU does not do), with
    ``a * b + c`` contracted into fmas or not (``fmad``: as NVRTC does by default; the ``_rn``
    intrinsics are never contracted), and with the far check or not (``far``: the first schedule
    runs again over arrays laid out anew, and every access must land where it did, which finds
    an access so far off its array that it landed in another one; on by default with the race
    detector). A module is compiled a second time, once, for ``fmad``."""
    if not hasattr(_checks, 'stack'):
        _checks.stack = []
    _checks.stack.append((race, None if schedules is None else _schedule_names(schedules),
                          None if ftz is None else bool(ftz), None if fmad is None else bool(fmad),
                          None if far is None else bool(far)))
    try:
        yield
    finally:
        _checks.stack.pop()


class Function:
    """One emulated kernel: call it as ``f(grid, block, args, shared_mem=0)``."""

    #: Like CuPy's attribute: dynamic shared memory beyond 48 KiB must be opted into.
    max_dynamic_shared_size_bytes = 48 * 1024

    def __init__(self, lib, index, name, key=None, module=None, source=None):
        self.name = name
        self._key = key
        self._module = module          # the RawModule, whose contracting build fmad launches use
        if source is None and module is not None:
            source = module.code
        # per parameter: 2 const __restrict__, 1 __restrict__, 0 neither (None: not known)
        self._restrict = _restrict_params(source, name) if source is not None else None
        # the module loads through __ldg: every array's bytes written are tracked from the start
        self._nc_all = bool(source is not None and re.search(r'\b__ldg\s*\(', _blank(source)))
        self._launch = getattr(lib, 'ctemu_launch_{}'.format(index))
        self._launch.argtypes = [ctypes.POINTER(_LaunchArgs)]
        self._launch.restype = ctypes.c_int
        sig = getattr(lib, 'ctemu_signature_{}'.format(index))
        sig.restype = ctypes.c_char_p
        self.params = [_Param(c) for c in sig().decode().split(',') if c]
        bounds = getattr(lib, 'ctemu_bounds_{}'.format(index))
        bounds.restype = ctypes.c_longlong
        #: maxThreadsPerBlock of the kernel's __launch_bounds__ (None when it has none)
        self.max_threads_per_block = bounds() or None
        offset = 0
        for p in self.params:
            offset = -(-offset // p.align) * p.align + p.size
        #: bytes of the kernel's parameter block
        self.param_bytes = offset

    @property
    def signature(self):
        return '{}({})'.format(self.name, ', '.join(p.describe() for p in self.params))

    def _check_launch(self, grid, block, shared_mem):
        if grid[0] > 2 ** 31 - 1 or grid[1] > 65535 or grid[2] > 65535:
            raise ValueError('grid {} exceeds CUDA limits (2^31-1, 65535, 65535)'.format(grid))
        threads = block[0] * block[1] * block[2]
        if threads > 1024 or block[0] > 1024 or block[1] > 1024 or block[2] > 64:
            raise ValueError('block {} exceeds CUDA limits (at most 1024 threads; x, y <= 1024, '
                             'z <= 64)'.format(block))
        if self.max_threads_per_block and threads > self.max_threads_per_block:
            raise ValueError(
                'kernel {}: block {} has {} threads but the kernel was compiled with '
                '__launch_bounds__({}): a GPU refuses the launch (too many resources requested '
                'for launch)'.format(self.name, block, threads, self.max_threads_per_block))
        limit = int(os.environ.get('CHAINER_TC_EMULATOR_PARAM_LIMIT', PARAM_LIMIT))
        if self.param_bytes > limit:
            raise ValueError(
                'kernel {}: its parameters take {} bytes; CUDA allows {} (32764 only with CUDA 12.1+ '
                'drivers and toolkits on Volta or later: set CHAINER_TC_EMULATOR_PARAM_LIMIT=32764 '
                'to accept that)'.format(self.signature, self.param_bytes, limit))
        max_dyn = int(self.max_dynamic_shared_size_bytes)
        if max_dyn > MAX_SHARED_OPT_IN:
            raise ValueError('kernel {}: max_dynamic_shared_size_bytes={} exceeds the {} bytes any '
                             'GPU gives a block'.format(self.name, max_dyn, MAX_SHARED_OPT_IN))
        if shared_mem < 0 or shared_mem > max_dyn:
            raise ValueError(
                'shared_mem={} for kernel {}: must be in [0, {}] (raise '
                'max_dynamic_shared_size_bytes to opt into more, as on a GPU)'
                .format(shared_mem, self.name, max_dyn))

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        if self._module is not None and current_fmad():
            return self._module._contracting(self.name)(grid, block, args, shared_mem, stream)
        grid, block = _dim3(grid, 'grid'), _dim3(block, 'block')
        shared_mem = int(shared_mem)
        self._check_launch(grid, block, shared_mem)
        args = tuple(args)
        if len(args) != len(self.params):
            raise TypeError('kernel {} takes {} arguments; got {}'
                            .format(self.signature, len(self.params), len(args)))
        n = len(args)
        restrict = self._restrict if self._restrict and len(self._restrict) == n else [0] * n
        values, keep = (ctypes.c_void_p * n)(), []
        nbytes, itemsize = (ctypes.c_uint64 * n)(), (ctypes.c_uint64 * n)()
        writeback, alias = (ctypes.c_int * n)(), (ctypes.c_int * n)()
        misalign = (ctypes.c_uint64 * n)()
        seen, raw_values = {}, {}
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
                    writeback[i] = int(p.kind == 'P')
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
                misalign[i] = _offset_in_allocation(a) % 256
            else:
                raw = self._scalar(i, p, a)
                holder, address = _aligned_copy(raw)
                raw_values[i] = raw
                nbytes[i] = _SCALAR
            keep.append(holder)
            values[i] = address
        tables = self._tables(args, raw_values, seen)
        race, schedules = current_checks()
        names = ','.join(schedules).encode()
        err = ctypes.create_string_buffer(_ERR_LEN)
        slot_bytes = ctypes.c_uint64(0)
        far_skipped = ctypes.c_int(0)
        targets, slots = tables
        counts = access_counts.buffer(n + len(targets) + 1) if access_counts.active() else None

        def array(ctype, items):
            arr = (ctype * max(len(items), 1))(*items)
            keep.append(arr)
            return arr

        la = _LaunchArgs(
            grid=(ctypes.c_uint * 3)(*grid), block=(ctypes.c_uint * 3)(*block),
            shared_mem=shared_mem, max_dyn_shared=int(self.max_dynamic_shared_size_bytes),
            nargs=n, args=values, nbytes=nbytes, itemsize=itemsize, writeback=writeback,
            alias=alias, misalign=misalign, ntargets=len(targets),
            target_host=array(ctypes.c_uint64, [t[0] for t in targets]),
            target_nbytes=array(ctypes.c_uint64, [t[1] for t in targets]),
            target_arg=array(ctypes.c_int, [t[2] for t in targets]),
            nslots=len(slots),
            slot_arg=array(ctypes.c_int, [s[0] for s in slots]),
            slot_offset=array(ctypes.c_uint64, [s[1] for s in slots]),
            slot_target=array(ctypes.c_int, [s[2] for s in slots]),
            race=int(race), schedules=names, err=ctypes.cast(err, ctypes.c_char_p),
            slot_bytes=ctypes.pointer(slot_bytes),
            counts=None if counts is None else counts.ctypes.data_as(ctypes.POINTER(ctypes.c_uint64)),
            ftz=int(current_ftz()),
            restrict=array(ctypes.c_int, [r if self.params[i].is_pointer else 0
                                          for i, r in enumerate(restrict)]),
            nc_all=int(self._nc_all), far=int(current_far()),
            far_skipped=ctypes.pointer(far_skipped))
        with _launch_lock:
            rc = self._launch(ctypes.byref(la))
        if slot_bytes.value:
            _check_slot_bytes(slot_bytes.value)
        if far_skipped.value and not _far_skipped:
            _far_skipped.append(self.name)
            warnings.warn('emulator: the far check of kernel {} was skipped: the address space '
                          'for its second layout of the arrays could not be reserved (an '
                          'address-space limit, ulimit -v); the launch ran its other checks '
                          '(said once)'.format(self.name), RuntimeWarning, stacklevel=2)
        if rc != 0:
            raise KernelLaunchError(self._explain(err.value.decode(errors='replace'), args, tables))
        if counts is not None:
            arrays = [None if nbytes[i] == _SCALAR else (alias[i] if alias[i] >= 0 else i)
                      for i in range(n)]
            access_counts.record(self.name, grid, block, args, arrays, targets, counts)

    def _tables(self, args, raw_values, seen):
        """Words of struct values and uint64 arrays that hold addresses of arrays: ([targets],
        [slots]), a target (host address, bytes, argument index or -1) a whole allocation to copy
        for the launch, a slot (argument, byte offset, target) a word to point into the copy."""
        spans = sorted((q, qn, j) for (q, qn), j in seen.items() if qn)
        targets, index, slots = [], {}, []
        for i, (p, a) in enumerate(zip(self.params, args)):
            if not p.may_hold_addresses:
                continue
            if i in raw_values:
                raw = raw_values[i]
                words = numpy.frombuffer(raw[:len(raw) // 8 * 8], numpy.uint64)
            elif isinstance(a, numpy.ndarray) and a.size:
                words = a.reshape(-1).view(numpy.uint64)
            else:
                continue
            # only what can be a user-space address (integer data is mostly small)
            hits = numpy.flatnonzero((words >= 1 << 16) & (words < 1 << 48))
            if not hits.size:
                continue
            w = words[hits]
            target = numpy.full(w.size, -1, numpy.int64)
            for q, qn, j in spans:                   # inside an array argument
                inside = (w >= q) & (w < q + qn) & (target < 0)
                if inside.any():
                    key = ('arg', j)
                    if key not in index:
                        index[key] = len(targets)
                        targets.append((q, qn, j))
                    target[inside] = index[key]
            rest = numpy.flatnonzero(target < 0)
            if rest.size and _tracker:
                start, size = _allocations(w[rest])
                for k in numpy.flatnonzero(size):
                    s0, sz = int(start[k]), int(size[k])
                    for q, qn, j in spans:
                        if q < s0 + sz and s0 < q + qn:
                            raise ValueError(
                                'kernel {}: argument {} holds an address inside the allocation '
                                'of argument {} but outside that array; the emulator cannot keep '
                                'one copy of both (pass the whole allocation)'
                                .format(self.name, i, j))
                    key = ('alloc', s0)
                    if key not in index:
                        index[key] = len(targets)
                        targets.append((s0, sz, -1))
                    target[rest[k]] = index[key]
            for k in numpy.flatnonzero(target >= 0):
                slots.append((i, int(hits[k]) * 8, int(target[k])))
        return targets, slots

    def _explain(self, msg, args, tables=((), ())):
        """Name each 'argument N (B bytes)' of a runtime message by its type and array, each table
        target by the word that points at it; decode values and source lines."""
        targets, slots = tables

        def arg(m):
            i = int(m.group(1))
            if i >= len(args):
                return m.group(0)
            a = args[i]
            return 'argument {} ({}, {} array of shape {})'.format(
                i, self.params[i].describe(), a.dtype, a.shape)

        def target(m):
            t = int(m.group(1))
            words = [(a, o) for a, o, tt in slots if tt == t]
            if not words:
                return m.group(0)
            a, o = words[0]
            return ('the {}-byte array whose address argument {} ({}) holds at byte offset {},'
                    .format(m.group(2), a, self.params[a].describe(), o))

        def value(m):
            i, raw = int(m.group(1)), bytes.fromhex(m.group(2))
            if 0 <= i < len(args) and isinstance(args[i], numpy.ndarray) \
                    and len(raw) == args[i].itemsize:
                return repr(numpy.frombuffer(raw, args[i].dtype)[0].item())
            return '0x' + m.group(2)

        def line(m):
            where = _source_line(self._key, int(m.group(1), 16)) if self._key else None
            return ' (at {})'.format(where) if where else ''

        msg = re.sub(r'argument (\d+) \((\d+) bytes\)', arg, msg)
        msg = re.sub(r'table target (\d+) \((\d+) bytes\)', target, msg)
        msg = re.sub(r'\{hex:(-?\d+):([0-9a-f]+)\}', value, msg)
        return re.sub(r'\{pc:0x([0-9a-f]+)\}', line, msg)

    def _check_array(self, i, p, a):
        if isinstance(a, numpy.ndarray) and (p.dtype is None or a.dtype == p.dtype) and \
                a.flags.c_contiguous and (p.kind != 'P' or a.flags.writeable):
            return
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
        if p.nbytes is None and isinstance(a, numpy.generic) and a.dtype == p.dtype:
            return a.tobytes()
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
        self._key = key
        self._lib = _load(key, binary)
        self._functions = {}
        self._build_args = (unit, _host_options(self.options), source_name)
        self._contracting_functions = None

    def get_function(self, name):
        if name not in self._names:
            raise AttributeError('no kernel {!r} in this module; it has: {}. A templated kernel '
                                 'must be listed in name_expressions.'
                                 .format(name, ', '.join(self._names) or 'none'))
        f = self._functions.get(name)
        if f is None:
            f = self._functions[name] = Function(self._lib, self._names.index(name), name,
                                                 self._key, self)
        return f

    def _contracting(self, name):
        """Kernel ``name`` of this module compiled to contract ``a * b + c`` (built once)."""
        if self._contracting_functions is None:
            key, binary = _build(*self._build_args, extra_flags=_fmad_flags())
            lib = _load(key, binary)
            self._contracting_functions = {
                n: Function(lib, i, n, key, source=self.code) for i, n in enumerate(self._names)}
        return self._contracting_functions[name]


class RawKernel(Function):
    """Emulated counterpart of ``cupy.RawKernel(code, name, options=())``."""

    def __init__(self, code, name, options=()):
        mod = RawModule(code=code, options=options, name_expressions=[name])
        f = mod.get_function(name)
        self.__dict__.update(f.__dict__)
        self._module = mod


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


_install_tracker()
