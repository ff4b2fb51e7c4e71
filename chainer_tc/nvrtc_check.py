"""Compile every ``kernels/*.cu`` with NVRTC 12 for sm_70/80/90 and report resource usage.

    python -m chainer_tc kernels            # a table
    python -m chainer_tc kernels --json     # [{file, kernel, arch, registers, spill_stores,
                                            #   spill_loads, shared_bytes}, ...]

No GPU or driver is needed: NVRTC is called through CuPy's low-level binding
(``cupy_backends.cuda.libs.nvrtc``), which works without a driver, whereas CuPy's high-level
compiler queries the device. The machine's own nvcc (CUDA 13) can no longer target sm_70 (V100),
so NVRTC 12 from the ``nvidia-cuda-nvrtc-cu12`` wheel is what we use. Registers, spills and shared
memory come from ptxas's verbose log (``--ptxas-options=-v``).

Exit status: 0 all compiled without spills; 1 a compile error (NVRTC's log is printed with the file
name); 2 some kernel spills registers. Results are cached per (source, options, NVRTC version) in
the per-user cache (``chainer_tc._cache``), with the cubin.
"""
import argparse
import base64
import json
import os
import re
import shutil
import subprocess
import sys

from chainer_tc import _cache
from chainer_tc import _cubin
from chainer_tc import kernels
from chainer_tc.errors import CompileError

ARCHS = ('sm_70', 'sm_80', 'sm_90')
FIELDS = ('file', 'kernel', 'arch', 'registers', 'spill_stores', 'spill_loads', 'shared_bytes')

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def compile_options(arch, options=()):
    """NVRTC's options for the check: ``arch``, ptxas's report, CuPy's ``-ftz=true``, the CUDA
    headers' directories, then ``options``."""
    return ('--gpu-architecture=' + arch, '--ptxas-options=-v', '--std=c++17', '-ftz=true') + \
        tuple('-I' + d for d in kernels.cuda_include_dirs()) + tuple(options)


def compile_source(code, name, arch, options=()):
    """NVRTC-compile ``code`` for ``arch``; returns (cubin bytes, ptxas log). Cached. With
    ``-ftz=true``, which CuPy adds to every RawModule (``_cubin.compile_options``): the code
    checked is the code loaded (flushing subnormals changes instruction selection)."""
    opts = compile_options(arch, options)
    # NVRTC's identity (a patch release or another build of one minor version compiles
    # differently) and the headers of the -I directories (an upgraded cuda_fp16.h), as the
    # loader's cubin cache keys (_cubin.cache_key)
    key = _cache.key_of('nvrtc-3', _cubin.nvrtc_identity(), _cubin.include_fingerprint(opts),
                        '\0'.join(opts), code)
    hit = _cache.load('nvrtc', key)
    if hit is not None:
        entry = json.loads(hit.decode())
        return base64.b64decode(entry['cubin']), entry['log']
    program = _cubin.compile_program(code, name, opts)
    _cache.store('nvrtc', key, json.dumps(
        {'cubin': base64.b64encode(program.binary).decode(), 'log': program.log}).encode())
    return program.binary, program.log


def parse_ptxas_log(log):
    """{function: {registers, spill_stores, spill_loads, shared_bytes}} from a ptxas -v log."""
    out, current = {}, None
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            current = out.setdefault(m.group(1), {'registers': 0, 'spill_stores': 0,
                                                  'spill_loads': 0, 'shared_bytes': 0})
            continue
        m = _PROPS.search(line)
        if m:
            current = out.setdefault(m.group(1), {'registers': 0, 'spill_stores': 0,
                                                  'spill_loads': 0, 'shared_bytes': 0})
            continue
        if current is None:
            continue
        m = _SPILL.search(line)
        if m:
            current['spill_stores'] = int(m.group(2))
            current['spill_loads'] = int(m.group(3))
        m = _USED.search(line)
        if m:
            current['registers'] = int(m.group(1))
            s = _SMEM.search(line)
            current['shared_bytes'] = int(s.group(1)) if s else 0
    return out


def demangle(names):
    """{mangled: 'kernel<args>'} for C++ names (templates), through c++filt when it is there;
    names it cannot demangle map to themselves."""
    mangled = [n for n in names if n.startswith('_Z')]
    out = {n: n for n in names}
    cxxfilt = shutil.which('c++filt')
    if not mangled or not cxxfilt:
        return out
    proc = subprocess.run([cxxfilt], input='\n'.join(mangled), capture_output=True, text=True)
    for m, d in zip(mangled, proc.stdout.splitlines()):
        if d.startswith('void '):
            d = d[5:]
        depth = 0
        for i, ch in enumerate(d):             # cut the parameter list: the first '(' at depth 0
            depth += (ch == '<') - (ch == '>')
            if ch == '(' and depth == 0:
                d = d[:i]
                break
        out[m] = d
    return out


def check(families=None, archs=ARCHS):
    """Compile the given kernel families (all by default); a list of result dicts (FIELDS)."""
    rows = []
    for family in families or kernels.families():
        path = kernels.source_path(family)
        code = kernels.source(family)
        rel = os.path.relpath(path, os.path.dirname(kernels.kernel_dir()))
        for arch in archs:
            _, log = compile_source(code, rel, arch)
            parsed = parse_ptxas_log(log)
            names = demangle(list(parsed))
            for fn, r in sorted(parsed.items(), key=lambda kv: names[kv[0]]):
                rows.append(dict(file=rel, kernel=names[fn], arch=arch, **r))
    return rows


def _table(rows):
    head = ('file', 'kernel', 'arch', 'regs', 'spill st', 'spill ld', 'smem')
    body = [(r['file'], r['kernel'], r['arch'], str(r['registers']), str(r['spill_stores']),
             str(r['spill_loads']), str(r['shared_bytes'])) for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = ['  '.join(x.ljust(w) for x, w in zip(line, widths)) for line in [head] + body]
    return '\n'.join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog='python -m chainer_tc kernels',
                                description='Compile kernels/*.cu with NVRTC 12 and report '
                                            'registers, spills and shared memory.')
    p.add_argument('--json', action='store_true', help='print JSON instead of a table')
    p.add_argument('--arch', action='append', choices=ARCHS,
                   help='architecture (repeatable; default: all of {})'.format(', '.join(ARCHS)))
    p.add_argument('families', nargs='*', help='kernel families (default: all)')
    args = p.parse_args(argv)
    try:
        rows = check(args.families or None, tuple(args.arch or ARCHS))
    except (CompileError, RuntimeError, FileNotFoundError) as e:
        print(e, file=sys.stderr)
        return 1
    print(json.dumps(rows, indent=1) if args.json else _table(rows))
    spilled = [r for r in rows if r['spill_stores'] or r['spill_loads']]
    if spilled:
        print('register spills in: ' + ', '.join('{} ({})'.format(r['kernel'], r['arch'])
                                                for r in spilled), file=sys.stderr)
        return 2
    return 0
