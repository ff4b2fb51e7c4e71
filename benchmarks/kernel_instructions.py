"""SASS instructions per element in the inner loops of the kernels timed on an H100
(docs/performance.md, "Kernels on an H100"): a CPU proxy for kernel changes.

    .venv/bin/python benchmarks/kernel_instructions.py                    # HEAD's kernels/ (sm_90)
    .venv/bin/python benchmarks/kernel_instructions.py --compare 793ef2f  # before/after
    .venv/bin/python benchmarks/kernel_instructions.py --arch sm_80 --out /tmp/k.json

Each kernel is compiled as the loader compiles it (chainer_tc.sass: CuPy's options, -ftz=true,
the callers' -D constants) and disassembled with nvdisasm (pip install nvidia-cuda-nvdisasm).
Its innermost loops are found from the backward branches; KERNELS below says which loop is the
hot one and how many elements one iteration handles. Elements per iteration are derived from the
loop's global loads: bytes loaded per iteration / bytes the kernel loads per element (a property
of its contract, the same in every revision), so a before/after needs no hand count; the table
shows the loads so a reader can check. Per element: the most instructions on one path through
the loop (the range's length counts both sides of an if/else), with the fewest alongside.
--compare REV takes kernels/ from the git revision REV (git show) through CHAINER_TC_KERNEL_DIR;
a kernel whose name expression does not exist there is tried under its older names. The -D
constants are today's. Not part of the tests; needs no GPU.
"""
import argparse
import contextlib
import os
import subprocess
import sys
import tempfile

import _common

from chainer_tc import kernels
from chainer_tc import sass
from chainer_tc.errors import CompileError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _elements(loop, spec):
    """Elements one iteration of ``loop`` handles: bytes it loads (stores, for a store-only
    loop) / the kernel's bytes per element; None when not a whole number."""
    if loop.loads:
        n, rest = divmod(loop.load_bytes, spec['bytes'])
    else:
        n, rest = divmod(loop.store_bytes, spec.get('store_bytes', spec['bytes']))
    return n if n and not rest else None


def _main_loop(loops, spec):
    """The loop handling the most elements per iteration (the unrolled main loop; the others are
    remainders), the widest accesses (fewest LDG per element) first."""
    cands = [lp for lp in loops if _elements(lp, spec)]
    return [max(cands, key=lambda lp: (_elements(lp, spec), -lp.loads / _elements(lp, spec)))] \
        if cands else []


def _unscaling_loop(kind):
    """The optimizer's float16 loop that dynamic loss scaling runs: float16 parameters (``kind``
    'update': float->half conversions, F2FP; 'check': half->float ones, HADD2, and no float64
    arithmetic) that unscale the gradient: by a multiply (an exact reciprocal: FMUL, no MUFU)
    where the source has one, else by a division (MUFU.RCP and its slow path); then the widest
    accesses (pairs), the most elements, the most FMUL (the multiply among other modes)."""
    def pick(loops, spec):
        half = [lp for lp in loops if _elements(lp, spec) and 'DMUL' not in lp.opcodes
                and ('F2FP' if kind == 'update' else 'HADD2') in lp.opcodes]
        mul = [lp for lp in half if 'MUFU' not in lp.opcodes and lp.opcodes.get('FMUL')]
        div = [lp for lp in half if 'MUFU' in lp.opcodes]
        if kind == 'check':     # the plain check has no FMUL; the multiply adds one per element
            mul = [lp for lp in mul if lp.opcodes['FMUL'] >= _elements(lp, spec)]
        cands = mul or div
        return [max(cands, key=lambda lp: (-lp.loads / _elements(lp, spec), _elements(lp, spec),
                                           lp.opcodes.get('FMUL', 0)))] if cands else []
    return pick


def _all_loops(loops, spec):
    """Every loop (a kernel whose iteration is split in several loops: summed)."""
    return [lp for lp in loops if _elements(lp, spec)]


# name: the name expression today, then older names (--compare); bytes: loaded per element (the
# loads that size an iteration); pick: the hot loop(s); why: the table's note
KERNELS = [
    dict(label='bn_stats_partial f16 x1', family='batchnorm', names=['bn_stats_partial<__half, 1>',
         'bn_stats_partial<__half>'], bytes=2, pick=_main_loop,
         why='reads x (2 B) per element; the rows loop, 4 rows unrolled'),
    dict(label='bn_stats_partial f16 x2', family='batchnorm', names=['bn_stats_partial<__half, 2>',
         'bn_stats_partial<__half>'], bytes=2, pick=_main_loop,
         why='reads x (2 B); 4 rows x 2 channels (__half2) per iteration'),
    dict(label='bn_backward_partial f16 x1', family='batchnorm',
         names=['bn_backward_partial<__half, 1>', 'bn_backward_partial<__half>'], bytes=6,
         pick=_main_loop, why='reads gy, y (the ReLU mask) and x (3 x 2 B; the ReLU loop)'),
    dict(label='bn_backward_partial f16 x2', family='batchnorm',
         names=['bn_backward_partial<__half, 2>', 'bn_backward_partial<__half>'], bytes=6,
         pick=_main_loop, why='as x1, two channels per access'),
    dict(label='bn_apply f16 x2', family='batchnorm', names=['bn_apply<__half, float, 2>'],
         bytes=4, pick=_main_loop, why='reads x and z (2 x 2 B); one row x 2 channels (__half2)'),
    dict(label='max_pool_forward f16 x2', family='pooling',
         names=['max_pool_forward<__half, unsigned char, 2>', 'max_pool_forward<__half, 2>'],
         bytes=2, pick=_main_loop,
         why='the window loop: per window element and channel (x, 2 B), not per output'),
    dict(label='max_pool_backward f16 x2', family='pooling',
         names=['max_pool_backward<__half, unsigned char, 2>', 'max_pool_backward<__half, 2>'],
         bytes=None, pick=None,
         why='no single hot loop: per input position straight code plus a loop over the '
             'covering outputs (gy and the argmax byte); its loops are listed, no per-element '
             'number (today: about 278 -> 130 per position for 3x3/2, by walking paths)'),
    dict(label='momentum_sgd_update f16', family='optimizer', names=['momentum_sgd_update'],
         bytes=12, pick=_unscaling_loop('update'),
         why='reads grad (2 B), p16 (2), master (4), momentum (4); the dynamic-scaling loop'),
    dict(label='momentum_sgd_check f16', family='optimizer', names=['momentum_sgd_check'],
         bytes=2, pick=_unscaling_loop('check'),
         why='reads grad (2 B); the dynamic-scaling loop'),
    dict(label='batched_transpose f32->f16', family='layout', names=['batched_transpose_f32_f16'],
         bytes=4, store_bytes=2, pick=_all_loops,
         why='two loops over the tile rows, loads (4 B) then stores (2 B): summed'),
]


def _loops(spec, arch):
    """(name expression found, its innermost loops)."""
    error = None
    for name in spec['names']:
        try:
            return name, sass.kernel_loops(spec['family'], name, arch, lines=False)
        except (CompileError, KeyError) as e:
            error = e
    raise error


def measure(spec, arch):
    """One row: the kernel's hot loop(s), elements and instructions per iteration and element."""
    name, loops = _loops(spec, arch)
    row = dict(kernel=spec['label'], name=name, why=spec['why'],
               loops=[dict(lp._asdict(), elements=_elements(lp, spec) if spec['bytes'] else None)
                      for lp in loops])
    if spec['pick'] is None:
        return row
    hot = spec['pick'](loops, spec)
    if not hot:
        row['error'] = 'no loop matches the rule'
        return row
    n = _elements(hot[0], spec)
    if any(_elements(lp, spec) != n for lp in hot):
        row['error'] = 'its loops handle different numbers of elements'
        return row
    shortest = sum(lp.shortest for lp in hot)
    longest = sum(lp.longest for lp in hot)
    row.update(hot=['{:04x}-{:04x}'.format(lp.start, lp.end) for lp in hot], elements=n,
               per_iteration=sum(lp.instructions for lp in hot), shortest=shortest,
               longest=longest, per_element=longest / n, per_element_min=shortest / n,
               loads=sum(lp.loads for lp in hot), stores=sum(lp.stores for lp in hot))
    return row


@contextlib.contextmanager
def kernels_at(rev):
    """CHAINER_TC_KERNEL_DIR set to a copy of kernels/ at git revision ``rev``."""
    files = subprocess.run(['git', 'ls-tree', '--name-only', rev, 'kernels/'], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    with tempfile.TemporaryDirectory() as d:
        for path in files:
            blob = subprocess.run(['git', 'show', '{}:{}'.format(rev, path)], cwd=ROOT,
                                  capture_output=True, check=True).stdout
            with open(os.path.join(d, os.path.basename(path)), 'wb') as f:
                f.write(blob)
        old = os.environ.get(kernels.ENV_KERNEL_DIR)
        os.environ[kernels.ENV_KERNEL_DIR] = d
        try:
            yield d
        finally:
            if old is None:
                del os.environ[kernels.ENV_KERNEL_DIR]
            else:
                os.environ[kernels.ENV_KERNEL_DIR] = old


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--arch', default='sm_90', choices=sass.ARCHS)
    p.add_argument('--compare', metavar='REV', help='also count the kernels at git revision REV')
    p.add_argument('--out', default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 'results', 'kernel_instructions.json'))
    args = p.parse_args()
    result = {'arch': args.arch, 'head': _git('rev-parse', '--short', 'HEAD'),
              'dirty': bool(_git('status', '--porcelain', 'kernels/')), 'rows': []}
    for spec in KERNELS:
        _common.progress('counting ' + spec['label'])
        result['rows'].append(measure(spec, args.arch))
    if args.compare:
        result['compare'] = {'rev': args.compare, 'rows': []}
        with kernels_at(args.compare):
            for spec in KERNELS:
                _common.progress('counting {} at {}'.format(spec['label'], args.compare))
                result['compare']['rows'].append(measure(spec, args.arch))
    _common.write_json(args.out, result)
    print(report(result))
    print('\nwrote ' + args.out)
    return 0


def _git(*args):
    return subprocess.run(['git'] + list(args), cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()


def report(result):
    """The table: per kernel the hot loop, elements and instructions per iteration, instructions
    per element (most on one path; the fewest in brackets), and the revision compared."""
    head = ['kernel', 'loop', 'LDG/STG', 'elements', 'per iteration (range, paths)',
            'per element']
    before = {r['kernel']: r for r in result.get('compare', {}).get('rows', [])}
    if before:
        head.append('at ' + result['compare']['rev'])
    rows = []
    for r in result['rows']:
        if 'per_element' in r:
            line = [r['kernel'], ' + '.join(r['hot']), '{}/{}'.format(r['loads'], r['stores']),
                    str(r['elements']), '{} ({}-{})'.format(r['per_iteration'], r['shortest'],
                                                             r['longest']),
                    '{:.2f} ({:.2f})'.format(r['per_element'], r['per_element_min'])]
        else:
            line = [r['kernel'], '{} loops'.format(len(r['loops'])), '', '', ', '.join(
                '{}-{}'.format(lp['shortest'], lp['longest']) for lp in r['loops']), 'see note']
        if before:
            b = before.get(r['kernel'], {})
            line.append('{:.2f} ({:.2f})'.format(b['per_element'], b['per_element_min'])
                        if 'per_element' in b else
                        ', '.join('{}-{}'.format(lp['shortest'], lp['longest'])
                                  for lp in b.get('loops', [])) or b.get('error', ''))
        rows.append(line)
    notes = ['{}: {} ({})'.format(r['kernel'], r['why'], r['name']) for r in result['rows']]
    return '{} ({}{}), SASS instructions per element in the hot loop, most on one path (fewest):\n'\
        .format(result['arch'], result['head'], ', kernels/ modified' if result['dirty'] else '') \
        + _common.format_table(head, rows) + '\n\nElements per iteration, and why:\n  ' \
        + '\n  '.join(notes)


if __name__ == '__main__':
    sys.exit(main())
