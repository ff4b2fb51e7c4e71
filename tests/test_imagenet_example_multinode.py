"""examples/imagenet/train_imagenet.py --communicator under ``mpiexec -n 2`` (real MPI, ChainerMN's
naive communicator on the CPU): only rank 0 reports and writes the log, plots and snapshots
(the other rank writes its own position and BatchNorm statistics next to them), and a run
resumed from a snapshot ends with the bits of the uninterrupted run."""
import json
import os
import subprocess
import sys

import numpy
import pytest

import dali_data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, 'examples', 'imagenet', 'train_imagenet.py')
MPIEXEC = os.path.join(os.path.dirname(sys.executable), 'mpiexec')


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    data = dali_data.make_dataset(tmp_path_factory.mktemp('tiny'), n=12)
    val = dali_data.write_list(os.path.join(data.root, 'val.txt'), data.files[:5],
                               data.classes[:5])            # 5: the ranks' shards differ
    return data, val


def run(tiny, out, *flags, returncode=0):
    data, val = tiny
    argv = [MPIEXEC, '--allow-run-as-root', '--oversubscribe', '-n', '2', sys.executable, SCRIPT,
            data.classes_list, val, '-R', data.root, '-o', str(out), '--width', '64',
            '--insize', '32', '-B', '4', '-b', '4', '--n-classes', '2', '--seed', '0', '-j', '0',
            '--iterations', '6', '--val-interval', '3', '--communicator', 'naive'] + list(flags)
    p = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=300)
    assert p.returncode == returncode, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout if returncode == 0 else p.stderr


STATIC = ['--nhwc', '--fused-bn', '--batched-update', '--static-graph']


def test_rank_0_reports_and_a_resumed_run_ends_with_the_same_bits(tiny, tmp_path):
    out = run(tiny, tmp_path / 'a', *STATIC)
    assert out.count('Techniques:') == 1, 'one rank describes the run'
    assert 'Static graph: 3 of 6 steps replayed' in out
    files = set(os.listdir(str(tmp_path / 'a')))
    assert {'log', 'snapshot_iter_3', 'snapshot_iter_6', 'model_iter_6',
            'snapshot_iter_3.rank1'} <= files
    assert not any(f.endswith('.rank0') for f in files)
    run(tiny, tmp_path / 'b', *STATIC, '-r', tmp_path / 'a' / 'snapshot_iter_3')
    a = numpy.load(str(tmp_path / 'a' / 'model_iter_6'))
    b = numpy.load(str(tmp_path / 'b' / 'model_iter_6'))
    assert sorted(a.files) == sorted(b.files)
    for k in a.files:
        numpy.testing.assert_array_equal(a[k], b[k], err_msg=k)
    with open(str(tmp_path / 'a' / 'log')) as f:
        log_a = json.load(f)
    with open(str(tmp_path / 'b' / 'log')) as f:
        log_b = json.load(f)
    assert log_a[-1]['validation/main/loss'] == log_b[-1]['validation/main/loss']
    # a rank that cannot resume stops every rank (the others used to wait in a collective)
    os.remove(str(tmp_path / 'a' / 'snapshot_iter_3.rank1'))
    err = run(tiny, tmp_path / 'c', *STATIC, '-r', tmp_path / 'a' / 'snapshot_iter_3',
              returncode=2)
    assert 'rank 1 needs its own snapshot' in err and 'rank 1 could not set up' in err


def test_chainermn_wrapper_path(tiny, tmp_path):
    out = run(tiny, tmp_path, '--batched-update', '--loss-scale', 'dynamic')
    assert 'validation/main/accuracy' in out
    assert 'log' in os.listdir(str(tmp_path))


def test_multi_node_bn_gives_every_rank_the_global_statistics(tiny, tmp_path):
    """--multi-node-bn: the BatchNorm links of the NHWC model (ours) and of the NCHW model
    (ChainerMN's) reduce over both ranks (the runs are replayed), so rank 1's running
    statistics, written next to rank 0's snapshot, are rank 0's bits; without it they are its
    own batches' (they differ)."""
    def statistics(out):
        own = numpy.load(str(out / 'snapshot_iter_6.rank1'))
        snap = numpy.load(str(out / 'snapshot_iter_6'))
        keys = [k for k in own.files if k.endswith(('avg_mean', 'avg_var'))]
        assert len(keys) == 2 * 53, 'every BatchNorm link of ResNet-50'
        return [(own[k], snap['updater/model:main/' + k[len('persistent/'):]]) for k in keys]

    out = run(tiny, tmp_path / 'mnbn', *STATIC, '--multi-node-bn')
    assert '--multi-node-bn' in out and 'Static graph: 3 of 6 steps replayed' in out
    for mine, rank0 in statistics(tmp_path / 'mnbn'):
        numpy.testing.assert_array_equal(mine, rank0)
    run(tiny, tmp_path / 'own', *STATIC)
    assert not all(numpy.array_equal(a, b) for a, b in statistics(tmp_path / 'own'))
    # an NCHW model of Chainer's links gets ChainerMN's multi-node links, replayed too
    out = run(tiny, tmp_path / 'nchw', '--batched-update', '--static-graph', '--multi-node-bn')
    assert 'Static graph: 3 of 6 steps replayed' in out
    for mine, rank0 in statistics(tmp_path / 'nchw'):
        numpy.testing.assert_array_equal(mine, rank0)
