"""Mutation testing of the kernel tests: plant classic GPU bugs in copies of ``kernels/*.cu`` and
report which ones the test suite kills.

    python -m chainer_tc.testing.mutate                  # every mutant; exit 1 if one survives
    python -m chainer_tc.testing.mutate --list           # the mutants, without running anything
    python -m chainer_tc.testing.mutate --family batchnorm --json mutants.json

Each mutant is a copy of the kernel directory with one bug planted in one family's ``.cu`` file;
the family's tests run against it (``CHAINER_TC_KERNEL_DIR``) with the emulator's race detector and
schedule exploration on (``CHAINER_TC_EMULATOR_RACECHECK=1``). A mutant is killed when a test
fails. The operators are the bugs that pass unnoticed when threads run in one fixed order:

- ``drop_barrier``: a ``__syncthreads();`` removed;
- ``vote_to_local``: ``__syncthreads_or(p)`` (or ``_and``, ``_count``) replaced by ``p``, the
  thread's own value;
- ``vote_to_shared_flag``: the vote replaced by a ``__shared__`` flag that thread 0 resets without
  a barrier before the other threads set it;
- ``drop_fence``: a ``__threadfence();`` removed, and all of a file's at once;
- ``early_fence``: a ``__threadfence();`` moved to the start of its function, before the accesses
  it should order (a fence orders only what its thread did before it);
- ``plain_arithmetic``: every ``__fadd_rn``/``__fsub_rn``/``__fmul_rn`` (and the double ones) of a
  file written as a plain ``+``/``-``/``*``, which NVRTC contracts into fmas (``-fmad=true``):
  killed only by tests that run under ``emulator.checking(fmad=True)``;
- ``plain_atomic``: an ``atomicAdd``/``atomicInc``/... replaced by a plain read-modify-write;
- ``off_by_one``: a loop bound ``i < n`` made ``i <= n``, a guard ``c >= C`` made ``c > C``;
- ``move_reduction``: a reduction step moved from row 0 to the last row (the loop adjusted so
  that the arithmetic is the same) and the barrier before it removed;
- ``wrong_thread``: the thread that performs a reduction step changed (``threadIdx.y == 0`` ->
  ``== 1``).

Mutants that cannot be told apart from the original by any run (equivalent mutants) are listed
in ``EQUIVALENT`` with the reason, and not made.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from chainer_tc import kernels

# The tests that exercise each family's kernels (through CHAINER_TC_KERNEL_DIR): its own test
# file, and the family's launches of tests/test_emulator_kernels.py (every kernel on awkward
# shapes, with fewer blocks than work so that grid-stride loops run, under the race detector).
FAMILY_TESTS = {
    'layout': ['tests/test_layout.py'],
    'pooling': ['tests/test_pooling.py'],
    'batchnorm': ['tests/test_batchnorm.py'],
    'optimizer': ['tests/test_optimizer.py', 'tests/test_optimizer_unscale.py'],
}
KERNEL_CASES = 'tests/test_emulator_kernels.py'

# (family, mutant id prefix, reason): mutants that no run can tell from the original.
EQUIVALENT = [
    ('optimizer', 'wrong_thread:', 'any one thread of the block may read the flag or take the '
     'ticket; which one is irrelevant'),
    ('layout', 'off_by_one:tr < row_tiles',
     'an extra row tile starts at row_tiles * TILE >= rows: every access is guarded by r < rows'),
]


class Mutant:
    def __init__(self, family, ident, description, source):
        self.family, self.id, self.description, self.source = family, ident, description, source
        self.killed = None
        self.by = self.reason = None
        self.seconds = None

    def as_dict(self):
        return {'family': self.family, 'id': self.id, 'description': self.description,
                'killed': self.killed, 'by': self.by, 'reason': self.reason,
                'seconds': self.seconds}


def _blank(code):
    """Comments blanked (same length), so that sites inside comments are never mutated."""
    return re.sub(r'//[^\n]*|/\*.*?\*/',
                  lambda m: re.sub(r'[^\n]', ' ', m.group(0)), code, flags=re.S)


def _line(code, pos):
    return code.count('\n', 0, pos) + 1


def _replace(code, start, end, text):
    return code[:start] + text + code[end:]


def _matching_paren(code, open_):
    depth = 0
    for i in range(open_, len(code)):
        if code[i] == '(':
            depth += 1
        elif code[i] == ')':
            depth -= 1
            if depth == 0:
                return i
    raise ValueError('unbalanced parentheses at {}'.format(open_))


# ---- operators: (code, plain) -> [(id, description, mutated code)] -------------------------------

def drop_barrier(code, plain):
    out = []
    for m in re.finditer(r'__syncthreads\(\)\s*;', plain):
        n = _line(code, m.start())
        out.append(('drop_barrier@{}'.format(n), 'line {}: __syncthreads() removed'.format(n),
                    _replace(code, m.start(), m.end(), '')))
    return out


def vote_to_local(code, plain):
    out = []
    for m in re.finditer(r'__syncthreads_(or|and|count)\s*\(', plain):
        close = _matching_paren(plain, m.end() - 1)
        n = _line(code, m.start())
        pred = code[m.end():close]
        out.append(('vote_to_local@{}'.format(n),
                    'line {}: __syncthreads_{}({}) -> ({}), the thread\'s own value'.format(
                        n, m.group(1), pred, pred),
                    _replace(code, m.start(), close + 1, '({})'.format(pred))))
    return out


def vote_to_shared_flag(code, plain):
    """``if (__syncthreads_or(p) && rest) S;`` -> a __shared__ flag reset by thread 0 with no
    barrier before the other threads set it."""
    out = []
    for m in re.finditer(r'if\s*\(\s*__syncthreads_or\s*\(', plain):
        open_ = m.end() - 1
        close = _matching_paren(plain, open_)
        pred = code[open_ + 1:close]
        if_close = _matching_paren(plain, plain.index('(', m.start()))
        rest = code[close + 1:if_close]
        n = _line(code, m.start())
        text = ('__shared__ unsigned any_bad;\n'
                '  if (threadIdx.x == 0) any_bad = 0;\n'
                '  if ({p}) any_bad = 1;\n'
                '  __syncthreads();\n'
                '  if (any_bad{r})').format(p=pred, r=rest)
        out.append(('vote_to_shared_flag@{}'.format(n),
                    'line {}: __syncthreads_or({}) -> a __shared__ flag reset by thread 0 with no '
                    'barrier before the other threads set it'.format(n, pred),
                    _replace(code, m.start(), if_close + 1, text)))
    return out


def drop_fence(code, plain):
    sites = list(re.finditer(r'__threadfence\(\)\s*;', plain))
    out = []
    for m in sites:
        n = _line(code, m.start())
        out.append(('drop_fence@{}'.format(n), 'line {}: __threadfence() removed'.format(n),
                    _replace(code, m.start(), m.end(), '')))
    if len(sites) > 1:
        mutated = code
        for m in reversed(sites):
            mutated = _replace(mutated, m.start(), m.end(), '')
        out.append(('drop_fence@all', 'every __threadfence() removed ({} of them)'.format(len(sites)),
                    mutated))
    return out


def _function_body(plain, at):
    """The position just after the opening brace of the function whose body holds ``at``: the
    outermost brace around it that follows a ``)`` (not a namespace's or a struct's)."""
    stack = []
    for m in re.finditer(r'[{}]', plain[:at]):
        if m.group() == '{':
            stack.append(m.start())
        elif stack:
            stack.pop()
    for brace in stack:
        if plain[:brace].rstrip().endswith(')'):
            return brace + 1
    return None


def early_fence(code, plain):
    out = []
    for m in re.finditer(r'__threadfence\(\)\s*;', plain):
        body = _function_body(plain, m.start())
        if body is None:
            continue
        n = _line(code, m.start())
        mutated = _replace(code, m.start(), m.end(), '')
        mutated = _replace(mutated, body, body, ' __threadfence();')
        out.append(('early_fence@{}'.format(n), 'line {}: __threadfence() moved to the start of its '
                    'function (line {})'.format(n, _line(code, body)), mutated))
    return out


_RN_OPERATORS = {'__fadd_rn': '+', '__fsub_rn': '-', '__fmul_rn': '*', '__dadd_rn': '+',
                 '__dsub_rn': '-', '__dmul_rn': '*'}


def _top_level_comma(text):
    depth = 0
    for i, ch in enumerate(text):
        depth += ch in '([{'
        depth -= ch in ')]}'
        if ch == ',' and depth == 0:
            return i
    raise ValueError('no top-level comma in {!r}'.format(text))


_RN_CALL = re.compile(r'\b(__[fd](?:add|sub|mul)_rn)\s*\(')


def plain_arithmetic(code, plain):
    count = len(_RN_CALL.findall(plain))
    if not count:
        return []
    mutated = code
    while True:                       # the last call first: it holds no other (nested ones go on)
        now = _blank(mutated)
        sites = list(_RN_CALL.finditer(now))
        if not sites:
            break
        m = sites[-1]
        close = _matching_paren(now, m.end() - 1)
        args = mutated[m.end():close]
        comma = _top_level_comma(args)
        text = '(({}) {} ({}))'.format(args[:comma].strip(), _RN_OPERATORS[m.group(1)],
                                       args[comma + 1:].strip())
        mutated = _replace(mutated, m.start(), close + 1, text)
    return [('plain_arithmetic@all', 'every _rn add, subtract and multiply ({}) written as a plain '
             'operator, which a GPU contracts into fmas'.format(count), mutated)]


_PLAIN = {'atomicAdd': 'o + v', 'atomicSub': 'o - v', 'atomicExch': 'v',
          'atomicMax': 'o > v ? o : v', 'atomicMin': 'o < v ? o : v', 'atomicOr': 'o | v',
          'atomicAnd': 'o & v', 'atomicXor': 'o ^ v', 'atomicInc': 'o >= v ? 0 : o + 1'}
_PLAIN_HELPER = ('\ntemplate <typename T, typename V> __device__ __forceinline__ T '
                 'mutant_plain_rmw(T* a, V v_) {{ const T v = (T)v_; const T o = *a; *a = {e}; '
                 'return o; }}\n')


def plain_atomic(code, plain):
    out = []
    for m in re.finditer(r'\b(atomic(?:Add|Sub|Exch|Max|Min|Or|And|Xor|Inc))\s*\(', plain):
        name = m.group(1)
        close = _matching_paren(plain, m.end() - 1)
        n = _line(code, m.start())
        mutated = _replace(code, m.start(), m.end(), 'mutant_plain_rmw(')
        first = re.search(r'^[ \t]*#[ \t]*include[^\n]*\n', mutated, re.M)
        at = first.end() if first else 0
        mutated = mutated[:at] + _PLAIN_HELPER.format(e=_PLAIN[name]) + mutated[at:]
        out.append(('plain_atomic@{}'.format(n),
                    'line {}: {}({}) -> a plain read-modify-write'.format(
                        n, name, code[m.end():close]), mutated))
    return out


def _comparison(cond, at):
    """The comparison of ``cond`` around offset ``at``: the text between the && / || / , around
    it, and its right operand."""
    parts = re.split(r'&&|\|\||,', cond)
    pos = 0
    for part in parts:
        if pos <= at < pos + len(part):
            text = ' '.join(part.split()).strip('() ')
            right = part[at - pos:].lstrip('<>=! ')
            return text, right.strip()
        pos += len(part) + 2
    return ' '.join(cond.split()), ''


def _index_like(right):
    """Whether the right operand of a comparison reads as a count or an index, not a value in a
    floating-point type (a constructor such as A(0), a literal with a point)."""
    return not re.match(r'(\w+\s*\(|[-+]?\d*\.\d)', right)


def off_by_one(code, plain):
    out = []
    # loop bounds: for (init; a < b; step)
    for m in re.finditer(r'\bfor\s*\(([^;]*);([^;]*);', plain):
        cond = m.group(2)
        for c in re.finditer(r'(?<![<>=!])<(?![<=])', cond):
            at = m.start(2) + c.start()
            text, right = _comparison(code[m.start(2):m.end(2)], c.start())
            if not _index_like(right):
                continue
            n = _line(code, at)
            out.append(('off_by_one:{}@{}'.format(text, n),
                        'line {}: loop bound {} -> {}'.format(n, text, text.replace('<', '<=', 1)),
                        _replace(code, at, at + 1, '<=')))
    # guards: if (x >= n) return;  if (c < C ...)
    for m in re.finditer(r'\bif\s*\(', plain):
        close = _matching_paren(plain, m.end() - 1)
        cond = plain[m.end():close]
        for c in re.finditer(r'(?<![<>=!])(<|>=)(?![<=])', cond):
            at = m.end() + c.start()
            op = c.group(1)
            text, right = _comparison(code[m.end():close], c.start())
            if not _index_like(right):
                continue
            new = '<=' if op == '<' else '>'
            n = _line(code, at)
            out.append(('off_by_one:{}@{}'.format(text, n),
                        'line {}: guard {} -> {}'.format(n, text, text.replace(op, new, 1)),
                        _replace(code, at, at + len(op), new)))
    return out


def move_reduction(code, plain):
    """``__syncthreads(); if (threadIdx.D == 0 ...) { for (int k = 1; k < N; ++k) ...`` -> the
    last row merges rows 0 .. N-2, and the barrier before it is gone."""
    out = []
    pattern = (r'__syncthreads\(\)\s*;\s*if\s*\(\s*threadIdx\.([xyz])\s*==\s*0\b([^)]*)\)\s*\{\s*'
               r'for\s*\(\s*int\s+(\w+)\s*=\s*1\s*;\s*\3\s*<\s*(\w+)\s*;')
    for m in re.finditer(pattern, plain):
        d, rest, k, bound = m.groups()
        n = _line(code, m.start())
        text = ('if (threadIdx.{d} == {b} - 1{r}) {{\n    for (int {k} = 0; {k} < {b} - 1;'
                .format(d=d, b=bound, r=rest, k=k))
        out.append(('move_reduction@{}'.format(n),
                    'line {}: the merge done by row {} - 1 instead of row 0 (same arithmetic), '
                    'the __syncthreads() before it removed'.format(n, bound),
                    _replace(code, m.start(), m.end(), text)))
    return out


def wrong_thread(code, plain):
    out = []
    for m in re.finditer(r'threadIdx\.([xyz])\s*==\s*0\b', plain):
        n = _line(code, m.start())
        out.append(('wrong_thread:threadIdx.{}@{}'.format(m.group(1), n),
                    'line {}: threadIdx.{} == 0 -> == 1'.format(n, m.group(1)),
                    _replace(code, m.start(), m.end(), 'threadIdx.{} == 1'.format(m.group(1)))))
    return out


def no_vector_path(code, plain):
    """``if (pairs)`` -> ``if (false)`` at each test of a kernel's own vector-path flag: where it
    guards the path, the path is never taken (the same results, only slower: only the tests that
    read the accesses' widths through emulator.recording can kill it); where it guards the
    alignment test, the path is taken unchecked (the memcheck's alignment check kills it)."""
    out = []
    for m in re.finditer(r'\bif\s*\(\s*(pairs)\s*\)', plain):
        n = _line(code, m.start())
        out.append(('no_vector_path@{}'.format(n),
                    'line {}: if ({}) -> if (false)'.format(n, m.group(1)),
                    _replace(code, m.start(), m.end(), 'if (false)')))
    return out


OPERATORS = [drop_barrier, vote_to_local, vote_to_shared_flag, drop_fence, early_fence,
             plain_arithmetic, plain_atomic,
             off_by_one, move_reduction, wrong_thread, no_vector_path]


def _equivalent(family, ident):
    for f, prefix, reason in EQUIVALENT:
        if f == family and ident.startswith(prefix):
            return reason
    return None


def mutants(families=None):
    """Every mutant of every family (or of ``families``), equivalent ones left out."""
    out = []
    for family in families or sorted(FAMILY_TESTS):
        with open(kernels.source_path(family)) as f:
            code = f.read()
        plain = _blank(code)
        for op in OPERATORS:
            for ident, description, source in op(code, plain):
                if source == code or _equivalent(family, ident):
                    continue
                out.append(Mutant(family, '{}:{}'.format(family, ident), description, source))
    return out


# The five bugs issue 12 found passing every test, restated for the current sources: each must be
# killed (tests/test_emulator_checks.py launches them directly as well).
def issue_mutants():
    """{name: (family, mutated source)} of the five mutants that passed every test before the
    race detector and schedule exploration."""
    def mutated(family, old, new):
        with open(kernels.source_path(family)) as f:
            code = f.read()
        if old not in code:
            raise ValueError('kernels/{}.cu changed: {!r} is no longer in it'.format(family, old))
        return family, code.replace(old, new)

    return {
        'check_barrier_removed': mutated(
            'optimizer', 'if (threadIdx.x == 0) already = *found;\n  __syncthreads();',
            'if (threadIdx.x == 0) already = *found;'),
        'done_counter_plain': mutated(
            'optimizer', 'last = atomicAdd(scaler + SCALER_DONE, 1u) == sp.total_blocks - 1;',
            'last = scaler[SCALER_DONE]++ == sp.total_blocks - 1;'),
        'fences_removed': mutated('optimizer', '__threadfence();', ''),
        'flag_reset_without_barrier': mutated(
            'optimizer', 'if (__syncthreads_or(bad) && threadIdx.x == 0) *found = 1u;',
            '__shared__ unsigned any_bad;\n  if (threadIdx.x == 0) any_bad = 0;\n'
            '  if (bad) any_bad = 1;\n  __syncthreads();\n'
            '  if (any_bad && threadIdx.x == 0) *found = 1u;'),
        'bn_merge_in_last_row': mutated(
            'batchnorm',
            '  __syncthreads();\n  if (threadIdx.y == 0 && c < C) {\n'
            '    for (int k = 1; k < BN_ROWS; ++k)\n      bn::merge(',
            '  if (threadIdx.y == BN_ROWS - 1 && c < C) {\n'
            '    for (int k = 0; k < BN_ROWS - 1; ++k)\n      bn::merge('),
    }


# ---- running -------------------------------------------------------------------------------------

def _root():
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.dirname(os.path.dirname(here))


def _pytest(tests, kernel_dir, timeout, race=True):
    env = dict(os.environ, CHAINER_TC_KERNEL_DIR=kernel_dir,
               CHAINER_TC_EMULATOR_RACECHECK='1' if race else '0')
    env.pop('CHAINER_TC_EMULATOR_SCHEDULES', None)
    cmd = [sys.executable, '-m', 'pytest', '-x', '-q', '-p', 'no:cacheprovider', '-W',
           'ignore', *tests]
    try:
        proc = subprocess.run(cmd, cwd=_root(), env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, 'timed out after {} s'.format(timeout), ''
    return proc.returncode, proc.stdout, proc.stderr


def _verdict(out):
    """(first failing test, first line of the error) from pytest's output."""
    failed = re.search(r'^FAILED (\S+)', out, re.M)
    error = re.search(r'^E\s+(\S.*)$', out, re.M)
    return (failed.group(1) if failed else None,
            error.group(1)[:400] if error else None)


def run_mutant(m, timeout=900, race=True):
    """Run the family's tests against mutant ``m``; sets m.killed, m.by, m.reason."""
    start = time.time()
    with tempfile.TemporaryDirectory(prefix='chainer_tc_mutant_') as tmp:
        for name in os.listdir(kernels.kernel_dir()):
            src = os.path.join(kernels.kernel_dir(), name)
            if os.path.isfile(src):
                shutil.copy(src, tmp)
        with open(os.path.join(tmp, m.family + '.cu'), 'w') as f:
            f.write(m.source)
        rc, out, err = _pytest(_selection(m.family), tmp, timeout, race)
    m.seconds = round(time.time() - start, 1)
    if rc is None:
        m.killed, m.by, m.reason = True, 'timeout', out
    elif rc == 1:
        m.killed = True
        m.by, m.reason = _verdict(out)
    elif rc == 0:
        m.killed = False
    else:
        raise RuntimeError('pytest could not run the tests of mutant {} (exit status {}):\n{}\n{}'
                           .format(m.id, rc, out[-3000:], err[-3000:]))
    return m


def _selection(family):
    """pytest arguments selecting the family's tests: the kernel cases first (fast), then its
    own test file."""
    return ['{}::test_kernel_case'.format(KERNEL_CASES), *FAMILY_TESTS[family],
            '-k', 'not test_kernel_case or {}'.format(family)]


def main(argv=None):
    parser = argparse.ArgumentParser(prog='python -m chainer_tc.testing.mutate',
                                     description=__doc__.split('\n\n')[0])
    parser.add_argument('--family', action='append', choices=sorted(FAMILY_TESTS),
                        help='only this family (repeatable)')
    parser.add_argument('--list', action='store_true', help='list the mutants and exit')
    parser.add_argument('--only', help='only mutants whose id contains this text')
    parser.add_argument('--json', help='write the results here')
    parser.add_argument('--timeout', type=int, default=900, help='seconds per mutant')
    parser.add_argument('--memcheck-only', action='store_true',
                        help='run the tests without the race detector and with one thread order, '
                             'to see what those add')
    parser.add_argument('--no-baseline', action='store_true',
                        help='skip checking that the unmutated kernels pass the same tests')
    args = parser.parse_args(argv)
    found = mutants(args.family)
    if args.only:
        found = [m for m in found if args.only in m.id]
    if args.list:
        for m in found:
            print('{:55s} {}'.format(m.id, m.description))
        print('{} mutants'.format(len(found)))
        return 0
    families = sorted({m.family for m in found})
    if not args.no_baseline:
        for family in families:
            rc, out, err = _pytest(_selection(family), kernels.kernel_dir(), args.timeout,
                                   not args.memcheck_only)
            if rc != 0:
                print('the unmutated {} kernels fail their own tests (exit status {}): fix that '
                      'first\n{}'.format(family, rc, out[-3000:]))
                return 2
            print('baseline: {} passes its tests{}'.format(
                family, '' if args.memcheck_only else ' under the race detector'))
    for k, m in enumerate(found, 1):
        run_mutant(m, args.timeout, not args.memcheck_only)
        print('[{}/{}] {:9s} {:55s} {:6.1f}s {}'.format(
            k, len(found), 'killed' if m.killed else 'SURVIVED', m.id, m.seconds,
            (m.by or '') + (': ' + m.reason if m.reason else '')), flush=True)
    killed = sum(m.killed for m in found)
    print('\n{} of {} mutants killed ({:.0f}%)'.format(killed, len(found),
                                                       100.0 * killed / max(len(found), 1)))
    for m in found:
        if not m.killed:
            print('  survived: {} ({})'.format(m.id, m.description))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump({'killed': killed, 'total': len(found),
                       'mutants': [m.as_dict() for m in found]}, f, indent=1)
    return 0 if killed == len(found) else 1


if __name__ == '__main__':
    sys.exit(main())
