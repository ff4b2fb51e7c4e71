"""``python -m chainer_tc sass FAMILY KERNEL``: a kernel's machine code (SASS) and its inner loops.

Without a GPU, a kernel change is judged by what the GPU would execute: the SASS instructions of
its hot loop per element handled. This module compiles a family exactly as the loader does for an
``sm_XY`` device (``_cubin.compile_options``: CuPy's options, ``-ftz=true``, the callers' ``-D``
launch constants; through the per-user cubin cache), disassembles the kernel with ``nvdisasm``
(the ``nvidia-cuda-nvdisasm`` wheel, or one on PATH) and finds its loops: a loop is a backward
branch, its body the addresses from the branch target to the branch; an innermost loop is one
whose body holds no other backward branch. The body is an address range, so it counts every
instruction laid out inside it, rarely taken side paths included (say so when comparing).

Source lines come from a second compile with ``--generate-line-info``, used only when its
instructions are the same as the loaded binary's (line info must not change the code; if it ever
does, the loops are reported without lines rather than with the wrong code).

    python -m chainer_tc sass batchnorm 'bn_stats_partial<__half, 2>'
    python -m chainer_tc sass optimizer momentum_sgd_check --arch sm_80 --json
"""
import argparse
import collections
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

from chainer_tc import _cubin
from chainer_tc import kernels
from chainer_tc.errors import CompileError

ARCHS = ('sm_70', 'sm_80', 'sm_90')

Instruction = collections.namedtuple('Instruction', 'address predicate opcode operands line')
Instruction.__doc__ = """One SASS instruction: ``address`` (int, bytes from the kernel's start),
``predicate`` ('@P0', '@!UP1' or ''), ``opcode`` with its modifiers ('LDG.E.U16'), ``operands``
(text), ``line`` (the innermost source line, 'file:line', or None)."""

Loop = collections.namedtuple('Loop', 'start end instructions shortest longest loads stores '
                                      'load_bytes store_bytes lines opcodes')
Loop.__doc__ = """An innermost loop: ``start``/``end`` addresses of its first instruction (the
branch target) and of its backward branch, ``instructions`` in that range, ``shortest``: the
fewest and ``longest`` the most instructions from the head to the back edge on one path
(:func:`paths`), global ``loads``
(LDG) and ``stores`` (STG) and their bytes, the source ``lines`` it was compiled from
('file:line', sorted), ``opcodes`` ({mnemonic: count})."""


# -- nvdisasm -----------------------------------------------------------------------------------

def find_nvdisasm():
    """The nvdisasm to use: the ``nvidia-cuda-nvdisasm`` wheel's (its binary is
    ``site-packages/nvidia/cu13/bin/nvdisasm`` in CUDA 13 wheels, ``nvidia/cuda_nvdisasm/bin``
    in CUDA 12 ones), else one on PATH."""
    roots = [sysconfig.get_paths()['purelib'], sysconfig.get_paths()['platlib']] + sys.path
    for root in dict.fromkeys(r for r in roots if isinstance(r, str) and r):
        for path in sorted(glob.glob(os.path.join(root, 'nvidia', '*', 'bin', 'nvdisasm'))):
            if os.access(path, os.X_OK):
                return path
    path = shutil.which('nvdisasm')
    if path:
        return path
    raise FileNotFoundError('nvdisasm not found (neither the nvidia-cuda-nvdisasm wheel\'s nor one '
                            'on PATH); install it: pip install nvidia-cuda-nvdisasm (part of the '
                            'test extra)')


def _run_nvdisasm(cubin):
    """nvdisasm's text of ``cubin`` (bytes): code sections only, with line info and inlining."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, 'kernel.cubin')
        with open(path, 'wb') as f:
            f.write(cubin)
        p = subprocess.run([find_nvdisasm(), '-c', '-gi', path], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError('nvdisasm failed ({}) on a {}-byte cubin:\n{}'
                           .format(p.returncode, len(cubin), p.stderr.strip()))
    return p.stdout


# -- parsing nvdisasm's text --------------------------------------------------------------------

# '//---- .text.NAME ----' (the name padded with spaces), '//---- SYMBOLS ----'
_SECTION = re.compile(r'^//-+ (\S+)\s+-+$')
_LABEL = re.compile(r'^(\.L_x_\d+):')
_LINE = re.compile(r'^\s*//## File "([^"]*)", line (\d+)')
_INSTRUCTION = re.compile(r'^\s*/\*([0-9a-f]+)\*/\s+(@!?U?P(?:\d|T)\s+)?([A-Z][A-Z0-9_.]*)\s*'
                          r'([^;]*);')
_TARGET = re.compile(r'`\((\.L_x_\d+)\)')


def functions(text):
    """The (mangled) names of the kernels in nvdisasm's text, in order."""
    return [m.group(1)[len('.text.'):] for m in map(_SECTION.match, text.splitlines())
            if m and m.group(1).startswith('.text.')]


def parse(text, function):
    """(instructions, labels) of ``function`` (its mangled name) in nvdisasm ``-c -gi`` text:
    a list of :class:`Instruction` and {label: index of the instruction it marks}."""
    instructions, labels, inside, found = [], {}, False, False
    line, fresh = None, True        # several comments before one instruction: the first is the
    for raw in text.splitlines():   # innermost location (the next ones are "inlined at" callers)
        m = _SECTION.match(raw)
        if m:
            inside = m.group(1) == '.text.' + function
            found = found or inside
            continue
        if not inside:
            continue
        m = _LINE.match(raw)
        if m:
            if fresh:
                line, fresh = '{}:{}'.format(os.path.basename(m.group(1)), m.group(2)), False
            continue
        m = _LABEL.match(raw)
        if m:
            labels[m.group(1)] = len(instructions)
            continue
        m = _INSTRUCTION.match(raw)
        if m:
            instructions.append(Instruction(int(m.group(1), 16), (m.group(2) or '').strip(),
                                            m.group(3), m.group(4).strip(), line))
            fresh = True
    if not found:
        raise KeyError('no function {} in the disassembly (it has: {})'
                       .format(function, ', '.join(functions(text)) or 'none'))
    return instructions, labels


def _branch_target(ins, labels):
    """The index a BRA instruction jumps to, or None (not a BRA, or an indirect one)."""
    if ins.opcode.split('.')[0] != 'BRA':
        return None
    m = _TARGET.search(ins.operands)
    return labels.get(m.group(1)) if m else None


def access_bytes(opcode):
    """Bytes one LDG/STG moves per thread, from its size modifier (none: 32 bits)."""
    sizes = {'U8': 1, 'S8': 1, 'U16': 2, 'S16': 2, '64': 8, '128': 16}
    return next((sizes[m] for m in opcode.split('.')[1:] if m in sizes), 4)


def loops(instructions, labels):
    """The innermost loops (:class:`Loop`) of a parsed function, in address order.

    A backward branch (a BRA to an instruction at or before it) closes a loop; a branch to
    itself is not one (the ``BRA`` spin after the last ``EXIT`` that ends every kernel). An
    innermost loop's range holds no other backward branch; several back edges to one head make
    the shortest range the loop."""
    back = [(target, i) for i, ins in enumerate(instructions)
            for target in [_branch_target(ins, labels)] if target is not None and target < i]
    out = []
    for start, end in back:
        if any(start <= i < end for _, i in back):
            continue
        body = instructions[start:end + 1]
        loads = [b for b in body if b.opcode.split('.')[0] == 'LDG']
        stores = [b for b in body if b.opcode.split('.')[0] == 'STG']
        lines = sorted({b.line for b in body if b.line}, key=_line_key)
        out.append(Loop(body[0].address, body[-1].address, len(body),
                        *paths(instructions, labels, start, end), len(loads), len(stores),
                        sum(access_bytes(b.opcode) for b in loads),
                        sum(access_bytes(b.opcode) for b in stores), lines,
                        dict(collections.Counter(b.opcode.split('.')[0] for b in body))))
    return out


def paths(instructions, labels, start, end):
    """(fewest, most) instructions executed on one path from index ``start`` (a loop's head) to
    its backward branch at ``end``, every instruction counted whether its predicate holds or not.

    The range's length counts both sides of an ``if``/``else`` and the code of rare side paths (a
    fix-up, a division's slow path laid out inline); one iteration runs one path, between these
    two. Inside an innermost loop every branch goes forward, so one pass in address order finds
    both; branches that leave the range (the loop's exits) are not followed."""
    best = {start: (1, 1)}
    for i in range(start, end):
        if i not in best:
            continue
        ins = instructions[i]
        target = _branch_target(ins, labels)
        successors = []
        if not (ins.predicate == '' and ins.opcode.split('.')[0] in _LEAVES):
            successors.append(i + 1)             # falls through unless it always leaves
        if target is not None and start < target <= end:
            successors.append(target)
        lo, hi = best[i]
        for j in successors:
            old = best.get(j, (lo + 1, hi + 1))
            best[j] = (min(old[0], lo + 1), max(old[1], hi + 1))
    return best.get(end, (None, None))


_LEAVES = ('BRA', 'EXIT', 'RET', 'BRX', 'JMP')     # unpredicated, control never falls through


def _line_key(line):
    name, _, number = line.rpartition(':')
    return name, int(number)


# -- compiling a family as the loader does ------------------------------------------------------

def family_defines(family):
    """The ``-D`` launch constants the callers pass for ``family`` (as restated for the GPU
    parity kit in ``chainer_tc.testing.kernel_cases``); {} for a family no caller loads."""
    from chainer_tc.testing import kernel_cases as kc
    return dict({'layout': kc.LAYOUT, 'batchnorm': kc.BN, 'pooling': kc.POOL,
                 'optimizer': kc.OPT}.get(family, {}))


def compile_options(defines, arch='sm_90'):
    """The NVRTC options the loader compiles a family with on an ``arch`` device."""
    return _cubin.compile_options(kernels._nvrtc_options(kernels._define_options(defines)),
                                  '-arch=' + arch)


def _compile(family, names, options):
    code = kernels.source(family)
    _, entry = _cubin.fetch(code, kernels.source_path(family), options, names, 'cubin')
    return entry


def disassemble(family, name_expression, arch='sm_90', defines=None, lines=True):
    """The SASS of kernel ``name_expression`` of ``kernels/<family>.cu`` on ``arch``, compiled as
    the loader compiles it (``defines``: the callers' by default): a list of
    :class:`Instruction`, with the labels' indices as its ``labels`` attribute."""
    if arch not in ARCHS:
        raise ValueError('arch must be one of {}, not {!r}'.format(', '.join(ARCHS), arch))
    defines = family_defines(family) if defines is None else defines
    names = (name_expression,) if '<' in name_expression else ()
    options = compile_options(defines, arch)
    entry = _compile(family, names, options)
    mangled = entry.lowered.get(name_expression, name_expression)
    instructions, labels = parse(_run_nvdisasm(entry.binary), mangled)
    if lines:
        annotated = _compile(family, names, options + ('--generate-line-info',))
        with_lines, _ = parse(_run_nvdisasm(annotated.binary), mangled)
        if [i._replace(line=None) for i in with_lines] == instructions:
            instructions = with_lines
    out = _Listing(instructions)
    out.labels = labels
    return out


class _Listing(list):
    """A list of instructions that also carries the labels (``labels``: {label: index})."""


def kernel_loops(family, name_expression, arch='sm_90', defines=None, lines=True):
    """:func:`loops` of :func:`disassemble`."""
    listing = disassemble(family, name_expression, arch, defines, lines)
    return loops(listing, listing.labels)


# -- the command --------------------------------------------------------------------------------

def _table(loops_):
    head = ('loop', 'instructions', 'path min-max', 'LDG', 'STG', 'bytes ld/st', 'source lines')
    rows = [('{:04x}-{:04x}'.format(lp.start, lp.end), str(lp.instructions),
             '{}-{}'.format(lp.shortest, lp.longest), str(lp.loads),
             str(lp.stores), '{}/{}'.format(lp.load_bytes, lp.store_bytes),
             _lines_text(lp.lines)) for lp in loops_]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    return '\n'.join('  '.join(x.ljust(w) for x, w in zip(r, widths)).rstrip()
                     for r in [head] + rows)


def _lines_text(lines):
    """'optimizer.cu:117-119,422' from ['optimizer.cu:117', ...]: runs of lines per file."""
    by_file = collections.OrderedDict()
    for line in lines:
        name, number = line.rsplit(':', 1)
        by_file.setdefault(name, []).append(int(number))
    parts = []
    for name, numbers in by_file.items():
        runs, first = [], None
        for a, b in zip(numbers, numbers[1:] + [None]):
            first = a if first is None else first
            if b != a + 1:
                runs.append(str(first) if first == a else '{}-{}'.format(first, a))
                first = None
        parts.append('{}:{}'.format(name, ','.join(runs)))
    return ' '.join(parts) or '-'


def main(argv=None):
    p = argparse.ArgumentParser(prog='python -m chainer_tc sass',
                                description='Disassemble one kernel of kernels/FAMILY.cu as the '
                                            'loader compiles it and list its innermost loops.')
    p.add_argument('family', help='kernel family (kernels/FAMILY.cu)')
    p.add_argument('kernel', help="kernel name or name expression, e.g. "
                                  "'bn_apply<__half, float, 2>'")
    p.add_argument('--arch', default='sm_90', choices=ARCHS, help='architecture (default sm_90)')
    p.add_argument('--json', action='store_true', help='print JSON instead of a table')
    args = p.parse_args(argv)
    try:
        listing = disassemble(args.family, args.kernel, args.arch)
    except (CompileError, RuntimeError, FileNotFoundError, KeyError, ValueError) as e:
        print(e.args[0] if isinstance(e, KeyError) else e, file=sys.stderr)
        return 1
    found = loops(listing, listing.labels)
    if args.json:
        print(json.dumps({'family': args.family, 'kernel': args.kernel, 'arch': args.arch,
                          'instructions': len(listing),
                          'loops': [lp._asdict() for lp in found]}, indent=1))
    else:
        print('{} ({}.cu, {}): {} instructions, {} innermost loop{}'.format(
            args.kernel, args.family, args.arch, len(listing), len(found),
            '' if len(found) == 1 else 's'))
        if found:
            print(_table(found))
    return 0
