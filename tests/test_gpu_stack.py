"""chainer_tc.gpu_stack: the GPU install check passes here and fails on a broken install."""
import re

import pytest

from chainer_tc import gpu_stack

from fresh_python import run_python

MAIN = 'import sys, chainer_tc.gpu_stack as g; sys.exit(g.main([]))'


def result_lines(stdout):
    return re.findall(r'^(PASS|FAIL)  (\S+) ', stdout, flags=re.M)


def test_check_passes_on_this_install():
    p = run_python(MAIN)
    assert p.returncode == 0, p.stdout + p.stderr
    names = [name for name, _ in gpu_stack.CHECKS]
    assert result_lines(p.stdout) == [('PASS', name) for name in names]
    assert 'cuDNN 8.9.' in p.stdout
    assert '%d/%d checks passed' % (len(names), len(names)) in p.stdout
    assert p.stderr == ''


def test_check_fails_without_the_preloaded_libraries():
    p = run_python(MAIN, CHAINER_TC_NO_PRELOAD='1')
    assert p.returncode == 1
    results = dict((name, status) for status, name in result_lines(p.stdout))
    # chainer_tc's cuDNN binding opens the wheel's libcudnn.so.8 by its full path; CuPy's cuDNN
    # module, imported again, then finds that very object: the one check that passes
    assert results == {name: 'PASS' if name == 'cudnn-binding' else 'FAIL'
                       for name, _ in gpu_stack.CHECKS}
    assert 'libcudnn.so.8' in p.stdout and 'libnvrtc.so.12' in p.stdout


def test_the_binding_check_names_the_library_and_what_is_bound():
    detail = gpu_stack.check_cudnn_binding()
    assert re.match(r'\d+ functions bound in .*libcudnn\.so\.8 \(cuDNN 8\.9\.\d+\), the '
                    r'library CuPy uses$', detail), detail
    from chainer_tc.cuda import cudnn
    assert detail.startswith('{} functions'.format(len(cudnn.PROTOTYPES)))


def test_a_failing_check_is_reported_and_makes_main_fail(monkeypatch, capsys):
    def broken():
        raise OSError('libfoo.so.1: cannot open shared object file')

    def wrong():
        raise gpu_stack.CheckFailed('bad')
    monkeypatch.setattr(gpu_stack, 'CHECKS', (('broken', broken),
                                              ('fine', lambda: 'ok'),
                                              ('wrong', wrong)))
    assert gpu_stack.main([]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == ['FAIL  broken  OSError: libfoo.so.1: cannot open shared object file',
                   'PASS  fine    ok',
                   'FAIL  wrong   bad',
                   '1/3 checks passed']


def test_the_nvrtc_check_compiles_every_time(monkeypatch):
    """With the kernel in the compile cache already, the check must still run NVRTC: an
    install whose libnvrtc loads but cannot compile (libnvrtc-builtins missing) used to pass
    from the cache."""
    from chainer_tc import _cubin
    gpu_stack.check_nvrtc()                         # fills the cache, if it was not

    def broken(*args, **kwargs):
        raise RuntimeError('NVRTC_ERROR_BUILTIN_OPERATION_FAILURE: libnvrtc-builtins.so.12.9: '
                           'cannot open shared object file')
    monkeypatch.setattr(_cubin, 'compile_program', broken)
    with pytest.raises(RuntimeError, match='libnvrtc-builtins'):
        gpu_stack.check_nvrtc()
