"""`python -m chainer_tc`: usage and dispatch."""
import subprocess
import sys


def run(*args):
    return subprocess.run([sys.executable, '-m', 'chainer_tc', *args], capture_output=True,
                          text=True)


def test_usage_lists_commands():
    p = run('--help')
    assert p.returncode == 0
    for cmd in ('info', 'kernels', 'sass', 'check-gpu-stack'):
        assert cmd in p.stdout


def test_no_command_is_a_usage_error():
    assert run().returncode == 2


def test_unknown_command():
    p = run('frobnicate')
    assert p.returncode == 2 and "unknown command 'frobnicate'" in p.stderr


def test_info_json_runs():
    p = run('info', '--json')
    assert p.returncode == 0, p.stderr
    assert '"features"' in p.stdout
