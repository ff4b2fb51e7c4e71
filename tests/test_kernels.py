"""The kernel loader: sources, backend selection, launch counting."""
import re
import subprocess
import sys

import numpy
import pytest

from chainer_tc import kernels


def test_families_and_sources():
    assert 'layout' in kernels.families()
    assert kernels.source_path('layout').endswith('kernels/layout.cu')
    with pytest.raises(FileNotFoundError, match="no kernel family 'nope'.*families: .*layout"):
        kernels.source('nope')


def test_every_kernel_file_states_its_contract():
    for family in kernels.families():
        with open(kernels.source_path(family)) as f:
            head = f.read().lstrip()
        assert head.startswith('// kernels/{}.cu'.format(family)), family
        assert 'Launch' in head.split('#include')[0] or 'launch' in head.split('#include')[0], family


def test_backend_selection(monkeypatch):
    monkeypatch.delenv('CHAINER_TC_EMULATE', raising=False)
    assert kernels.backend(numpy) == 'numpy'
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1')
    assert kernels.backend(numpy) == 'emulator'

    class FakeCupy:
        __name__ = 'cupy'
    assert kernels.backend(FakeCupy()) == 'cuda'


def test_numpy_arrays_without_emulation_get_no_kernel(monkeypatch):
    monkeypatch.delenv('CHAINER_TC_EMULATE', raising=False)
    with pytest.raises(RuntimeError, match='should have taken its NumPy path'):
        kernels.get_function('layout', 'batched_transpose_f32_f32', numpy)


def test_launches_are_counted(monkeypatch):
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1')
    k = kernels.get_function('layout', 'batched_transpose_f32_f32', numpy)
    x, y = numpy.ones((1, 2, 3), numpy.float32), numpy.zeros((1, 3, 2), numpy.float32)
    before = kernels.launch_count()
    with kernels.count_launches() as c:
        for _ in range(3):
            k((1, 1, 1), (32, 8), (x, y, numpy.int32(2), numpy.int32(3), numpy.int64(1)))
    assert c.total == 3 and c.per_kernel == {'batched_transpose_f32_f32': 3}
    assert kernels.launch_count() == before + 3
    assert kernels.launch_counts()['batched_transpose_f32_f32'] >= 3


def test_a_failed_launch_is_not_counted(monkeypatch):
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1')
    k = kernels.get_function('layout', 'batched_transpose_f32_f32', numpy)
    with kernels.count_launches() as c, pytest.raises(TypeError):
        k((1,), (32, 8), (numpy.ones(3, numpy.float32),))
    assert c.total == 0


def test_modules_are_memoized(monkeypatch):
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1')
    kernels.get_function('layout', 'batched_transpose_f32_f32', numpy)
    n = len(kernels._modules)
    kernels.get_function('layout', 'batched_transpose_f16_f32', numpy)
    assert len(kernels._modules) == n


def test_import_is_cheap():
    # importing chainer_tc compiles nothing and queries no device: no cupy, no compiler
    code = ('import sys, chainer_tc, chainer_tc.kernels, chainer_tc.layout;'
            'print(sorted(m for m in ("cupy", "chainer", "nvidia.dali", "subprocess") '
            'if m in sys.modules))')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == '[]', out.stdout


def test_shared_headers_are_inlined_with_line_markers(tmp_path, monkeypatch):
    (tmp_path / 'common.cuh').write_text('#define TWICE(x) (2 * (x))\n')
    (tmp_path / 'fam.cu').write_text('// kernels/fam.cu: launch (1,), (1,)\n'
                                     '#include "common.cuh"\n#include "common.cuh"\n'
                                     'extern "C" __global__ void k(int* x) { x[0] = TWICE(21); }\n')
    monkeypatch.setenv('CHAINER_TC_KERNEL_DIR', str(tmp_path))
    text = kernels.source('fam')
    assert text.count('#define TWICE') == 1, 'a header is inlined once'
    # under CHAINER_TC_KERNEL_DIR the files are named by their real paths, not kernels/...
    assert '#line 1 "{}"'.format(tmp_path / 'common.cuh') in text
    assert '#line 4 "{}"'.format(tmp_path / 'fam.cu') in text
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1')
    x = numpy.zeros(1, numpy.int32)
    kernels.get_function('fam', 'k', numpy)((1,), (1,), (x,))
    assert x[0] == 42
    (tmp_path / 'bad.cu').write_text('#include "missing.cuh"\n')
    with pytest.raises(FileNotFoundError, match='{} includes "missing.cuh"'.format(
            tmp_path / 'bad.cu')):
        kernels.source('bad')


def test_an_include_with_a_comment_is_inlined_and_an_odd_one_refused(tmp_path, monkeypatch):
    """A comment after the header's name used to leave the line to NVRTC, which has no -I for
    kernels/ ("cannot open source file"), and the header out of the cache keys."""
    (tmp_path / 'common.cuh').write_text('#define TWICE(x) (2 * (x))\n')
    (tmp_path / 'fam.cu').write_text('#include "common.cuh"  // TWICE\n'
                                     '# include"common.cuh" /* again */\n'
                                     'extern "C" __global__ void k(int* x) { x[0] = TWICE(21); }\n')
    monkeypatch.setenv('CHAINER_TC_KERNEL_DIR', str(tmp_path))
    text = kernels.source('fam')
    assert text.count('#define TWICE') == 1 and not re.search(r'#\s*include', text)
    (tmp_path / 'odd.cu').write_text('\n#include "common.cuh" TWICE\n')
    with pytest.raises(ValueError, match=r'odd.cu line 2: \'#include "common.cuh" TWICE\' is not '
                                         r'an include this loader can inline'):
        kernels.source('odd')


def test_define_values_and_name_expressions_are_checked(monkeypatch):
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1')
    for defines in ({'LAYOUT_TILE': 32.0}, {'LAYOUT_TILE': True}, {'LAYOUT TILE': 32}):
        with pytest.raises(TypeError, match=r'defines must map macro names to ints or strings'):
            kernels.get_function('layout', 'batched_transpose_f32_f32', numpy, defines)
    assert kernels._define_options({'LAYOUT_TILE': numpy.int64(32), 'X': 'float'}) == (
        '-DLAYOUT_TILE=32', '-DX=float')
    with pytest.raises(TypeError, match=r"name_expressions must be a list of strings .* not the "
                                        r"string 'k<float>'"):
        kernels.get_function('layout', 'k<float>', numpy, name_expressions='k<float>')
