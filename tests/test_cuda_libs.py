"""chainer_tc._cuda_libs: pip-installed CUDA libraries become visible to CuPy and Chainer."""
import json
import os

from chainer_tc import _cuda_libs

from fresh_python import run_python

CUDNN_PARTS = ('cudnn_ops_infer', 'cudnn_ops_train', 'cudnn_cnn_infer', 'cudnn_cnn_train',
               'cudnn_adv_infer', 'cudnn_adv_train', 'cudnn')


def loaded_files(name_part):
    """(code snippet) distinct mapped files in /proc/self/maps whose name contains name_part."""
    return ('sorted({l.split()[-1] for l in open("/proc/self/maps") if %r in l.split()[-1]})'
            % name_part)


def test_import_makes_chainer_see_cupy_and_cudnn():
    code = ('import json, chainer_tc, chainer\n'
            'from chainer.backends import cuda\n'
            'from chainer_tc import _cuda_libs\n'
            'print(json.dumps([cuda.available, cuda.cudnn_enabled, _cuda_libs.preloaded(),\n'
            '                  _cuda_libs.preload_errors()]))')
    p = run_python(code)
    assert p.returncode == 0, p.stderr
    available, cudnn_enabled, loaded, errors = json.loads(p.stdout)
    assert available is True and cudnn_enabled is True
    assert errors == {}
    for name in ('cudart', 'cublasLt', 'cublas', 'nvrtc', 'curand', 'nccl') + CUDNN_PARTS:
        assert name in loaded, name
        assert os.path.isfile(loaded[name])
        assert os.sep + 'nvidia' + os.sep in loaded[name]
    assert os.path.basename(loaded['cudnn']) == 'libcudnn.so.8'


def test_preload_order_puts_dependencies_first():
    names = [name for name, _, _ in _cuda_libs.LIBRARIES]
    assert names.index('cublasLt') < names.index('cublas')
    assert names.index('nvrtc-builtins') < names.index('nvrtc')
    assert names.index('cudnn_ops_infer') < names.index('cudnn_cnn_infer')
    assert max(names.index(n) for n in CUDNN_PARTS[:-1]) < names.index('cudnn')
    assert names.index('nvjitlink') < names.index('cusparse') < names.index('cusolver')


def test_import_is_silent():
    p = run_python('import chainer_tc')
    assert p.returncode == 0
    assert p.stdout == '' and p.stderr == ''


def test_preload_is_idempotent_and_never_loads_a_second_copy():
    code = ('import json, chainer_tc\n'
            'from chainer_tc import _cuda_libs as c\n'
            'first = c.preloaded()\n'
            'c.preload(); c.preload()\n'
            'again = c.load_from(c.default_search_paths())  # every soname is loaded already\n'
            'print(json.dumps([first == c.preloaded(), again, %s]))' % loaded_files('libcudnn'))
    p = run_python(code)
    assert p.returncode == 0, p.stderr
    same, again, cudnn_files = json.loads(p.stdout)
    assert same is True
    assert again == [{}, {}]
    assert len(cudnn_files) == len(CUDNN_PARTS)  # one copy of each cuDNN library
    assert p.stderr == ''


def test_opt_out_loads_nothing():
    code = ('import json, chainer_tc\n'
            'from chainer_tc import _cuda_libs as c\n'
            'c.preload()\n'
            'import chainer\n'
            'print(json.dumps([c.preloaded(), c.preload_errors(), %s,\n'
            '                  chainer.backends.cuda.available]))' % loaded_files('libcudnn'))
    p = run_python(code, CHAINER_TC_NO_PRELOAD='1')
    assert p.returncode == 0, p.stderr
    loaded, errors, cudnn_files, available = json.loads(p.stdout)
    assert loaded == {} and errors == {} and cudnn_files == []
    assert available is False  # without the preload Chainer cannot import cupy.cuda.cublas


def test_no_nvidia_dirs_is_harmless(tmp_path):
    (tmp_path / 'somepkg').mkdir()
    paths = [str(tmp_path), str(tmp_path / 'missing'), '', None]
    assert _cuda_libs.find_lib_dirs(paths) == {}
    assert _cuda_libs.load_from(paths) == ({}, {})


def test_find_lib_dirs_first_path_wins(tmp_path):
    for root in ('a', 'b'):
        (tmp_path / root / 'nvidia' / 'cublas' / 'lib').mkdir(parents=True)
    (tmp_path / 'b' / 'nvidia' / 'cudnn' / 'lib').mkdir(parents=True)
    (tmp_path / 'b' / 'nvidia' / 'dali').mkdir(parents=True)  # no lib/: ignored
    found = _cuda_libs.find_lib_dirs([str(tmp_path / 'a'), str(tmp_path / 'b')])
    assert found == {'cublas': str(tmp_path / 'a' / 'nvidia' / 'cublas' / 'lib'),
                     'cudnn': str(tmp_path / 'b' / 'nvidia' / 'cudnn' / 'lib')}


def test_pick_prefers_the_soname(tmp_path):
    for name in ('libcudnn.so.8.9.7', 'libcudnn.so.8', 'libcudnn_ops_infer.so.8'):
        (tmp_path / name).write_bytes(b'')
    assert _cuda_libs._pick(str(tmp_path), 'libcudnn.so.*') == str(tmp_path / 'libcudnn.so.8')
    assert _cuda_libs._pick(str(tmp_path), 'libcufft.so.*') is None


def test_broken_library_is_recorded_not_raised(tmp_path):
    # libcutensor is not installed in this environment, so it is not loaded already.
    lib_dir = tmp_path / 'nvidia' / 'cutensor' / 'lib'
    lib_dir.mkdir(parents=True)
    (lib_dir / 'libcutensor.so.2').write_bytes(b'not an ELF file')
    loaded, errors = _cuda_libs.load_from([str(tmp_path)])
    assert loaded == {}
    assert list(errors) == ['cutensor']
    assert 'libcutensor.so.2' in errors['cutensor']


def test_importing_chainer_first_is_warned_about():
    out = run_python(
        'import warnings; warnings.simplefilter("error", RuntimeWarning)\n'
        'import chainer\n'
        'try:\n'
        '    import chainer_tc\n'
        'except RuntimeWarning as e:\n'
        '    print("WARNED:", e)\n')
    assert 'WARNED: chainer was imported before chainer_tc' in out.stdout
    assert 'Import chainer_tc first' in out.stdout
