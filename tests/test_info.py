"""chainer_tc.info: the report is complete, documented and survives a half-installed stack."""
import json
import os
import re
import shutil
import sys

import pytest

from chainer_tc import info

from fresh_python import REPO
from fresh_python import run_python

DOC = os.path.join(REPO, 'docs', 'info.md')


def collect_in_subprocess(prelude='', **extra_env):
    """collect() in a fresh interpreter after running ``prelude``; the parsed report."""
    p = run_python(prelude + '\nimport sys, chainer_tc.info\n'
                   'sys.exit(chainer_tc.info.main(["--json"]))', **extra_env)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def documented_keys():
    """Backquoted names in the first column of the tables of docs/info.md."""
    with open(DOC) as f:
        return set(re.findall(r'^\| `([^`]+)` \|', f.read(), flags=re.M))


def check_shape(report):
    """Assertions that hold for every report, whatever is installed."""
    doc = documented_keys()
    assert set(report) == {k for k in doc if '.' not in k and '[' not in k and k not in
                           info.FEATURES}
    assert set(report['versions']) == {k.split('.', 1)[1] for k in doc
                                       if k.startswith('versions.')}
    assert set(report['chainer_cuda']) == {k.split('.', 1)[1] for k in doc
                                           if k.startswith('chainer_cuda.')}
    assert set(report['features']) == set(info.FEATURES) <= doc
    assert isinstance(report['gpus'], list)
    gpu_keys = {k.split('.', 1)[1] for k in doc if k.startswith('gpus[].')}
    for gpu in report['gpus']:
        assert set(gpu) == gpu_keys
    for name, feature in report['features'].items():
        assert set(feature) == {'available', 'reason'}, name
        assert isinstance(feature['available'], bool)
        if feature['available']:
            assert feature['reason'] is None
        else:
            assert isinstance(feature['reason'], str) and feature['reason'].strip(), name
    assert all(isinstance(v, str) for v in report['errors'].values())
    assert isinstance(report['warnings'], list)
    json.dumps(report)  # serialisable


@pytest.fixture(scope='module')
def report():
    return info.collect()


def test_report_has_all_documented_keys(report):
    check_shape(report)
    assert report['schema'] == info.SCHEMA_VERSION
    assert report['versions']['python'] == '%d.%d.%d' % sys.version_info[:3]


def test_report_sees_the_installed_stack(report):
    v = report['versions']
    assert v['cupy'].startswith('13.')
    assert v['cudnn'].startswith('8.9.')
    assert report['cudnn_library'] == report['preloaded_libraries']['cudnn'], "CuPy's own"
    assert v['nvrtc'].startswith('12.')
    assert v['cuda_runtime'].startswith('12.')
    assert v['chainer'] == '7.8.1'
    assert v['dali'] is not None
    assert report['features']['nvrtc_compile_check'] == {'available': True, 'reason': None}
    compiler = shutil.which('g++') is not None
    assert report['features']['cuda_emulator']['available'] is compiler


def test_no_gpu_is_a_normal_answer(report):
    if report['gpus']:      # on a GPU machine: the GPUs are listed and probing them raised nothing
        assert 'gpus' not in report['errors']
        assert all({'name', 'compute_capability'} <= set(g) for g in report['gpus'])
        return
    assert 'gpus' in report['errors']
    for name in ('nhwc_cudnn_conv', 'fused_bn_add_relu_cudnn', 'cuda_graphs', 'dali_gpu_decode',
                 'multinode_nccl'):
        feature = report['features'][name]
        assert feature['available'] is False
        assert feature['reason'].startswith('no CUDA GPU found'), feature
    if report['versions']['cuda_driver'] is None:
        assert 'no CUDA driver installed' in report['features']['cuda_graphs']['reason']


def fake_gpu(monkeypatch, major, minor):
    import cupy
    rt = cupy.cuda.runtime
    props = {'name': b'Fake GPU', 'major': major, 'minor': minor, 'totalGlobalMem': 16 << 30}
    monkeypatch.setattr(rt, 'getDeviceCount', lambda: 1)
    monkeypatch.setattr(rt, 'getDeviceProperties', lambda i: props)
    monkeypatch.setattr(rt, 'driverGetVersion', lambda: 12040)


def test_pascal_gpu_lacks_tensor_cores(monkeypatch):
    fake_gpu(monkeypatch, 6, 1)
    r = info.collect()
    check_shape(r)
    assert r['gpus'] == [{'index': 0, 'name': 'Fake GPU', 'compute_capability': '6.1',
                          'memory_bytes': 16 << 30}]
    assert r['versions']['cuda_driver'] == '12.4'
    for name in ('nhwc_cudnn_conv', 'fused_bn_add_relu_cudnn'):
        assert r['features'][name] == {
            'available': False,
            'reason': 'GPU compute capability 6.1 < 7.0 (Tensor Cores need Volta)'}
    assert r['features']['cuda_graphs']['available'] is True
    assert r['features']['dali_gpu_decode']['available'] is True


def test_ampere_gpu_has_every_feature(monkeypatch):
    fake_gpu(monkeypatch, 8, 0)
    r = info.collect()
    assert {name: f['available'] for name, f in r['features'].items()} == {
        name: (name != 'cuda_emulator' or shutil.which('g++') is not None)
        for name in info.FEATURES}
    assert 'Fake GPU  sm_80  16.0 GiB' in info.format_text(r)


def test_main_text_and_json(capsys):
    assert info.main([]) == 0
    text = capsys.readouterr().out
    for heading in ('versions', 'GPUs', 'chainer.backends.cuda', 'preloaded libraries',
                    'features'):
        assert '\n%s\n' % heading in text
    for name in info.FEATURES:
        assert re.search(r'^  %s +(yes|no)' % name, text, flags=re.M), name
    assert info.main(['--json']) == 0
    check_shape(json.loads(capsys.readouterr().out))


def test_main_rejects_unknown_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        info.main(['--bogus'])
    assert e.value.code == 2


def test_fresh_process_chainer_sees_cuda_and_cudnn():
    r = collect_in_subprocess()
    check_shape(r)
    assert r['chainer_cuda'] == {'available': True, 'cudnn_enabled': True}
    assert r['preloaded_libraries']['cudnn'].endswith('libcudnn.so.8')
    assert r['preload_errors'] == {}
    assert 'chainer.backends.cuda' not in r['errors']


def test_importing_info_is_cheap():
    p = run_python('import sys, chainer_tc.info\n'
                   'print(sorted({"chainer", "cupy", "numpy", "nvidia.dali"} & set(sys.modules)))')
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == '[]'


def test_cupy_missing_is_reported_not_raised():
    r = collect_in_subprocess("import sys; sys.modules['cupy'] = None")
    check_shape(r)
    assert r['versions']['cupy'] is None
    assert r['versions']['cuda_runtime'] is None and r['versions']['cuda_driver'] is None
    assert 'cupy' in r['errors']
    assert r['gpus'] == []
    assert r['chainer_cuda'] == {'available': False, 'cudnn_enabled': False}
    assert r['features']['nhwc_cudnn_conv']['reason'].startswith('CuPy not importable')
    assert r['features']['cuda_emulator']['available'] is (shutil.which('g++') is not None)


def test_cuda_libraries_missing_is_reported_not_raised():
    # Without the preload, libcublas.so.12 / libnvrtc.so.12 cannot be found by CuPy, nor CuPy's
    # libcudnn.so.8; chainer_tc's own cuDNN binding still opens the wheel's by its full path
    # (as where CuPy has no cuDNN at all), and says which.
    r = collect_in_subprocess(CHAINER_TC_NO_PRELOAD='1')
    check_shape(r)
    assert r['preloaded_libraries'] == {}
    assert r['versions']['cudnn'].startswith('8.9.') and r['versions']['nvrtc'] is None
    assert r['cudnn_library'].endswith('/nvidia/cudnn/lib/libcudnn.so.8')
    assert 'libnvrtc.so.12' in r['errors']['nvrtc']
    assert 'libcublas.so.12' in r['errors']['chainer.backends.cuda']
    assert r['chainer_cuda'] == {'available': False, 'cudnn_enabled': False}
    assert r['features']['nvrtc_compile_check']['reason'].startswith('NVRTC not loadable: ')


def test_no_usable_cudnn_is_reported_with_what_was_tried():
    r = collect_in_subprocess(CHAINER_TC_CUDNN_LIBRARY='/nonexistent/libcudnn.so.9')
    check_shape(r)
    assert r['versions']['cudnn'] is None and r['cudnn_library'] is None
    assert r['preloaded_libraries'].get('cudnn') is None, 'the wheel\'s cuDNN is not preloaded'
    reason = r['features']['nhwc_cudnn_conv']['reason']
    assert reason.startswith('cuDNN not loadable: CuDNNUnavailable: no usable cuDNN: '
                             'CHAINER_TC_CUDNN_LIBRARY (/nonexistent/libcudnn.so.9): '), reason
    assert r['features']['cuda_graphs']['reason'] == reason


def test_multinode_is_reported_without_starting_mpi(report):
    """make test installs the mpi extra: ChainerMN and mpiexec are there, NCCL needs a GPU."""
    assert report['versions']['mpi4py'] is not None
    assert report['features']['multinode_mpi'] == {'available': True, 'reason': None}
    p = run_python('import sys, chainer_tc.info\nchainer_tc.info.collect()\n'
                   'print("mpi4py.MPI" in sys.modules)')
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == 'False'


def test_multinode_missing_is_named():
    r = collect_in_subprocess("import sys; sys.modules['chainermn'] = None")
    check_shape(r)
    assert r['features']['multinode_mpi']['reason'].startswith('ChainerMN not importable: ')
    assert r['features']['multinode_nccl']['reason'] == r['features']['multinode_mpi']['reason']


def test_an_error_banner_is_not_the_message():
    """CuPy's import error starts with a line of '='; the report gives its first real line."""
    e = ImportError('\n' + '=' * 64 + '\nFailed to import CuPy.\n\nmore\n' + '=' * 64)
    assert info._error(e) == 'ImportError: Failed to import CuPy.'
    assert info._error(ValueError('')) == 'ValueError'


def test_version_strings():
    assert info.cudnn_version_string(8907) == '8.9.7'
    assert info.cudnn_version_string(7401) == '7.4.1'
    assert info.cudnn_version_string(90100) == '9.1.0'
    assert info.cuda_version_string(12090) == '12.9'
    assert info.cuda_version_string(11080) == '11.8'


def test_feature_reports_first_unmet_requirement():
    assert info._feature((True, 'a'), (False, 'b'), (False, 'c')) == {'available': False,
                                                                      'reason': 'b'}
    assert info._feature((True, 'a')) == {'available': True, 'reason': None}
