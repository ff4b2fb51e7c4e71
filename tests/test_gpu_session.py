""".ci/gpu_session: the script a session lent a GPU runs there, one part per device call.

A call to the device tool is expensive (minutes of a 30-minute budget) and brings back at most
8 files, named in letters, digits, '.', '_' and '-'. So each part is run here with the
programs it calls replaced by stubs that record their arguments and write the files they name:
each part must leave at most 8 such files, and every command line it gives chainer_tc's own
programs must be accepted by their argument parsers (checked with the real parsers).
"""
import os
import re
import stat
import subprocess
import sys

import pytest

from fresh_python import REPO

SCRIPT = os.path.join(REPO, '.ci', 'gpu_session')
STUB = '''#!/bin/sh
# records its command line; writes the files a real run would (--json, --out, --junitxml)
printf '%s\\0' "$(basename "$0")" "$@" >> "$STUB_LOG"; printf '\\n' >> "$STUB_LOG"
prev=
for a in "$@"; do
  case $prev in --json|--out) : > "$a";; esac
  case $a in --junitxml=*) : > "${a#--junitxml=}";; esac
  case $prev:$a in --out:*ablation*.json) : > "${a%.json}.png";; esac
  prev=$a
done
echo "stub $(basename "$0") done"
'''
# The real programs' parsers, given a recorded command line; exit 0 if it parses
CHECK_ARGS = '''
import argparse, os, runpy, sys
parse = argparse.ArgumentParser.parse_args
def parse_then_stop(self, args=None, namespace=None):
    parse(self, args, namespace)
    raise SystemExit(0)
argparse.ArgumentParser.parse_args = parse_then_stop
if sys.argv[1] == '-m':
    sys.argv = [sys.argv[2]] + sys.argv[3:]
    runpy.run_module(sys.argv[0], run_name='__main__')
else:
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))   # as `python script`
    runpy.run_path(sys.argv[0], run_name='__main__')
'''
ALLOWED_NAME = re.compile(r'^[A-Za-z0-9._-]+$')


def run_part(tmp_path, part, *paths, wheel=True):
    """Run ``.ci/gpu_session part`` in a folder of its own under ``tmp_path`` holding the
    script, with stub programs first on the PATH; (CompletedProcess, recorded command lines,
    files left in $OUT)."""
    tmp_path = tmp_path / (part or 'none')
    bin_dir, out, log = tmp_path / 'bin', tmp_path / 'out', tmp_path / 'stub.log'
    bin_dir.mkdir(parents=True)
    for name in ('python3', 'nvidia-smi', 'compute-sanitizer', 'g++'):
        (bin_dir / name).write_text(STUB)
        (bin_dir / name).chmod(stat.S_IRWXU)
    repo = tmp_path / 'repo'
    (repo / '.ci').mkdir(parents=True)
    (repo / '.ci' / 'gpu_session').write_bytes(open(SCRIPT, 'rb').read())
    (repo / '.ci' / 'gpu_session').chmod(stat.S_IRWXU)
    (repo / '.devrun').mkdir()
    if wheel:
        (repo / '.devrun' / 'chainer-7.8.1-py3-none-any.whl').write_bytes(b'')
    env = dict(os.environ, PATH='{}:{}'.format(bin_dir, os.environ['PATH']), OUT=str(out),
               STUB_LOG=str(log))
    p = subprocess.run([str(repo / '.ci' / 'gpu_session'), part] + list(paths), env=env, cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=60)
    calls = [line.split('\0')[:-1] for line in log.read_text().splitlines()] \
        if log.exists() else []
    files = sorted(os.path.relpath(os.path.join(d, f), str(out))
                   for d, _, names in os.walk(str(out)) for f in names) if out.exists() else []
    return p, calls, files


@pytest.mark.parametrize('part', ['checks', 'tests', 'bench'])
def test_each_part_brings_back_what_the_device_tool_can_carry(tmp_path, part):
    p, calls, files = run_part(tmp_path, part)
    assert p.returncode == 0, p.stdout + p.stderr
    assert 'summary.txt' in files and 1 <= len(files) <= 8, files
    assert all(ALLOWED_NAME.match(f) for f in files), 'flat, with names the tool brings back'
    summary = (tmp_path / part / 'out' / 'summary.txt').read_text().splitlines()
    assert summary and all(re.match(r'^\S+ +rc=0 +\d+s  stub \S+ done$', s) for s in summary)
    assert len(summary) == {'checks': 5, 'tests': 1, 'bench': 3}[part]


def test_the_commands_it_gives_chainer_tcs_programs_parse(tmp_path):
    lines = []
    for part in ('checks', 'tests', 'bench'):
        for call in run_part(tmp_path, part)[1]:
            if 'python3' not in call:
                continue
            args = call[call.index('python3') + 1:]        # also under compute-sanitizer
            if (args[:2] == ['-m', 'chainer_tc.testing.gpu_parity'] or
                    args[0].startswith('benchmarks/')):
                lines.append(args)
    programs = [a[1] if a[0] == '-m' else a[0] for a in lines]
    assert programs == ['chainer_tc.testing.gpu_parity'] * 6 + [
        'benchmarks/step_replay_gpu.py', 'benchmarks/ablation.py'], programs
    for args in lines:
        p = subprocess.run([sys.executable, '-c', CHECK_ARGS] + args, cwd=REPO,
                           env=dict(os.environ, PYTHONPATH=REPO), capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0, (args, p.stderr[-2000:])


def test_no_part_or_no_wheel_says_what_to_do(tmp_path):
    p, calls, _ = run_part(tmp_path, '')
    assert p.returncode == 2 and 'usage: .ci/gpu_session checks|tests [PATH...]|bench' in p.stderr
    assert calls == []
    p, calls, files = run_part(tmp_path, 'tests', wheel=False)
    assert p.returncode == 3 and 'pip wheel --no-deps chainer==7.8.1 -w .devrun' in p.stdout
    assert calls == [] and files == ['summary.txt']


def test_the_tests_part_runs_the_paths_given_or_all(tmp_path):
    def pytest_paths(calls):
        args, = [c[3:] for c in calls if c[:3] == ['python3', '-m', 'pytest']]
        return [a for a in args if not a.startswith('-') and a != 'gpu' and
                a != 'no:cacheprovider']
    assert pytest_paths(run_part(tmp_path / '1', 'tests')[1]) == ['tests/']
    assert pytest_paths(run_part(tmp_path / '2', 'tests', 'tests/test_a.py', 'tests/b.py')[1]) \
        == ['tests/test_a.py', 'tests/b.py']
