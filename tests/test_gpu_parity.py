"""The GPU parity kit (python -m chainer_tc.testing.gpu_parity): here, without a GPU, it says so
and exits 0; its whole path runs with the emulator standing in for the device (--self-test); it
imports nothing that needs Chainer. On a GPU (-m gpu) it compares every kernel."""
import json
import subprocess
import sys

import numpy
import pytest

from chainer_tc.testing import gpu_parity
from chainer_tc.testing import kernel_cases

BLOCK_CHAINER = '''
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == 'chainer' or name.startswith(('chainer.', 'chainermn', 'nvidia.dali')):
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
'''


def run(args, prelude=''):
    code = prelude + 'import sys\nfrom chainer_tc.testing import gpu_parity\n' \
        'sys.exit(gpu_parity.main({!r}))\n'.format(args)
    return subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.skipif(gpu_parity.gpu_available()[0], reason='a GPU is present: the kit would run')
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    out = tmp_path / 'parity.json'
    proc = run(['--json', str(out)], BLOCK_CHAINER)
    assert proc.returncode == 0, proc.stderr
    assert 'no CUDA GPU here' in proc.stdout
    assert json.loads(out.read_text())['gpu'] is False


def test_self_test_runs_every_case_without_chainer(tmp_path):
    out = tmp_path / 'parity.json'
    proc = run(['--self-test', '--quick', '--json', str(out)], BLOCK_CHAINER)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    families = {r['family'] for r in result['cases']}
    assert families == {'layout', 'pooling', 'batchnorm', 'optimizer'}
    assert all(r['ok'] is True for r in result['cases']), result
    assert 'match' in proc.stdout and 'max err' in proc.stdout


def test_self_test_times_the_launches(tmp_path):
    out = tmp_path / 'parity.json'
    # batch norm updates its running statistics in place: timing must not change what was compared
    assert gpu_parity.main(['--self-test', '--shapes', 'awkward', '--family', 'batchnorm',
                            '--repeats', '2', '--json', str(out)]) == 0
    rows = json.loads(out.read_text())['cases']
    assert rows and all(r['ok'] for r in rows)
    merges = [r for r in rows if r['case'].startswith('bn merge')]
    assert len(merges) == 4, 'the multi-node summary and merge cases'
    for r in rows:
        assert [t['kernel'].split('<')[0] for t in r['launches']] == ([
            'bn_stats_partial', 'bn_stats_finalize', 'bn_stats_finalize'] if r in merges else [
            'bn_stats_partial', 'bn_stats_finalize', 'bn_apply', 'bn_backward_partial',
            'bn_backward_finalize', 'bn_backward_apply'])
        assert all(t['seconds'] > 0 and t['bytes'] > 0 for t in r['launches'])


def test_compare_tolerances():
    e = numpy.array([1.0, 2.0, numpy.nan], numpy.float32)
    assert gpu_parity.compare(e, e.copy())[0]
    assert gpu_parity.compare(e, e * numpy.float32(1 + 1e-6))[0]        # fma contraction
    ok, worst, where = gpu_parity.compare(e, e + numpy.float32(1e-3))
    assert not ok and 'first at 0' in where
    i = numpy.arange(5, dtype=numpy.int32)
    j = i.copy()
    j[3] = 7
    ok, _, where = gpu_parity.compare(i, j)
    assert not ok and '1 elements differ, first at 3: 3 vs 7' in where
    assert not gpu_parity.compare(e, numpy.array([1.0, 2.0, 0.0], numpy.float32))[0]  # NaN lost


@pytest.mark.gpu
def test_every_kernel_matches_on_the_gpu(tmp_path):
    out = tmp_path / 'parity.json'
    assert gpu_parity.main(['--quick', '--json', str(out)]) == 0
    assert all(r['ok'] for r in json.loads(out.read_text())['cases'])


def test_a_sum_may_differ_by_the_rounding_of_its_terms_not_more():
    """Seen on an H100: a per-block sum of g * xhat over 784 rows (threads adding 98 rows each,
    then 8 merged) was 0.01765 in the emulator and 0.01766 on the GPU (fma), sum|terms| ~ 500:
    within 4 * 2^-24 * sqrt(106) * 500 = 1.2e-3; 0.012 off is not rounding."""
    e = numpy.array([0.01764965, 203.0], numpy.float32)
    g = numpy.array([0.01766109, 203.0], numpy.float32)
    assert not gpu_parity.compare(e, g)[0], 'a plain float32 tolerance calls it a mismatch'
    assert gpu_parity.compare(e, g, (numpy.array([500.0, 500.0]), 106))[0]
    far = numpy.array([0.03, 203.0], numpy.float32)
    ok, _, where = gpu_parity.compare(e, far, (numpy.array([500.0, 500.0]), 106))
    assert not ok and where.startswith('1 elements differ, first at 0')


def test_a_row_block_lost_by_the_finalize_is_caught():
    """The sums' tolerance must stay below one row block's share: a finalize that dropped or
    doubled a block would otherwise pass (1000 blocks of 40 rows here)."""
    case = kernel_cases._batchnorm(40000, 2, numpy.float32, numpy.float32)
    sums = case.sums(case.arrays)
    exact = case.reference(case.arrays)['gbeta'][0]
    g = numpy.where(case.arrays['y_fwd'] > 0, case.arrays['gy'].astype(numpy.float64), 0)
    per = -(-40000 // case.arrays['bpartial'].shape[0])
    typical = numpy.median(numpy.abs(g[:per * 1000].reshape(1000, per, 2).sum(1)), axis=0)
    assert gpu_parity.compare(exact.astype(numpy.float32),
                              (exact * (1 + 1e-6)).astype(numpy.float32), sums['gbeta'])[0]
    for k in range(2):            # a block of typical size, dropped from channel k
        lost = exact.copy()
        lost[k] -= typical[k]
        ok, _, _ = gpu_parity.compare(exact.astype(numpy.float32), lost.astype(numpy.float32),
                                      sums['gbeta'])
        assert not ok, (k, typical[k])


def test_batchnorm_backward_reads_the_float64_forward_not_the_backends():
    """A ReLU mask flipped by rounding in one backend's forward must not reach the backward: its
    launches read y_fwd/mean_fwd/invstd_fwd, computed once in float64."""
    case = next(c for c in kernel_cases.cases(big=False) if c.family == 'batchnorm')
    backward = [l for l in case.launches if l.kernel.startswith('bn_backward')]
    assert backward and all('y' not in l.args and 'mean' not in l.args and
                            'invstd' not in l.args for l in backward)
    assert all('y_fwd' in l.args for l in backward if 'finalize' not in l.kernel)
    sums = case.sums(case.arrays)
    assert set(sums) == {'bpartial', 'sums', 'ggamma', 'gbeta'}
    assert sums['bpartial'][0].shape == case.arrays['bpartial'].shape
