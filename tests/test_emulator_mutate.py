"""The mutation tool (python -m chainer_tc.testing.mutate): its mutants, and one run end to end.
The full run (every mutant killed) is documented in docs/emulator.md; it takes minutes."""
import collections
import re

from chainer_tc.testing import mutate


def test_every_operator_finds_its_sites():
    found = mutate.mutants()
    ids = [m.id for m in found]
    assert len(ids) == len(set(ids)), [i for i, n in collections.Counter(ids).items() if n > 1]
    ops = collections.Counter(m.id.split(':')[1].split('@')[0] for m in found)
    for op in ('drop_barrier', 'vote_to_local', 'vote_to_shared_flag', 'drop_fence', 'early_fence',
               'plain_arithmetic', 'plain_atomic', 'off_by_one', 'move_reduction', 'wrong_thread',
               'no_vector_path'):
        assert ops[op] >= 1, op
    assert {m.family for m in found} == set(mutate.FAMILY_TESTS)
    for m in found:
        with open(mutate.kernels.source_path(m.family)) as f:
            assert m.source != f.read(), m.id


def test_operators_rewrite_the_code_they_name():
    code = ('__device__ float f(float a, float b) {\n  float x = __fadd_rn(g(a, b), __fmul_rn(a, b));\n'
            '  // __fsub_rn(a, b) in a comment stays\n  return __dsub_rn(x, (a, b).y);\n}\n'
            '__global__ void k(float* p) {\n  p[0] = 1.0f;\n  __threadfence();\n}\n')
    plain = mutate._blank(code)
    (ident, _, out), = mutate.plain_arithmetic(code, plain)
    assert ident == 'plain_arithmetic@all'
    assert 'float x = ((g(a, b)) + (((a) * (b))));' in out
    assert 'return ((x) - ((a, b).y));' in out and '// __fsub_rn(a, b) in a comment' in out
    (ident, _, out), = mutate.early_fence(code, plain)
    assert ident == 'early_fence@8'
    assert '__global__ void k(float* p) { __threadfence();\n  p[0] = 1.0f;\n  \n}' in out


def test_equivalent_mutants_are_left_out():
    ids = [m.id for m in mutate.mutants(['optimizer', 'layout'])]
    assert not [i for i in ids if i.startswith('optimizer:wrong_thread')]
    assert not [i for i in ids if 'tr < row_tiles' in i]


def test_the_issue_mutants_are_among_the_tools():
    # the five bugs of issue 12 as the tool's operators make them (tests/test_emulator_checks.py
    # launches the issue's own versions directly)
    ids = {m.id for m in mutate.mutants()}
    assert len(mutate.issue_mutants()) == 5
    for prefix in ('optimizer:drop_barrier@', 'optimizer:plain_atomic@', 'optimizer:drop_fence@all',
                   'optimizer:vote_to_shared_flag@', 'batchnorm:move_reduction@'):
        assert any(i.startswith(prefix) for i in ids), prefix


def test_a_mutant_is_killed_by_the_race_detector():
    m = next(m for m in mutate.mutants(['optimizer']) if m.id.startswith('optimizer:plain_atomic'))
    mutate.run_mutant(m)
    assert m.killed, m.as_dict()
    # on the scaler, the kernel's last argument (its index moves as the kernel gains arguments)
    assert 'test_kernel_case[optimizer' in m.by
    assert re.search(r'data race on argument \d+ \(unsigned int\*', m.reason), m.reason


def test_list(capsys):
    assert mutate.main(['--list', '--family', 'layout']) == 0
    out = capsys.readouterr().out
    assert 'layout:drop_barrier@' in out and 'mutants' in out
