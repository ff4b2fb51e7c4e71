"""chainer_tc.cuda: the ctypes cuDNN binding, the convolution driver, the fused-BN plans, counters.

Without a GPU: the prototypes, enum values and result layout against cuDNN 8.9's and 9's own
headers; which library is loaded; the real library's error statuses (NULL arguments are refused
before any GPU work); descriptors made by the binding and read back with cuDNN's getters
(host-only calls); and the driver run against the real descriptors with a fake handle, queries and
computations and a fake runtime, to check what it passes, caches and counts. The tests marked
cudnn_library run twice: with cuDNN 8.9 (CuPy's) and, in a process of their own, with cuDNN 9.
The CPU path of the convolution gradient skips gx when it is not needed. GPU-marked tests compare
against Chainer (and cupyx.cudnn where CuPy has cuDNN) and capture the layers into a CUDA graph.
"""
import ctypes
import json
import os
import re
import subprocess
import sys
import time
import warnings

import numpy
import pytest

import chainer_tc
import chainer
import chainer.functions as F

from chainer_tc import _cuda_libs
from chainer_tc import functions as TF
from chainer_tc.cuda import _cudnn_api as api
from chainer_tc.cuda import conv
from chainer_tc.cuda import cudnn
from chainer_tc.cuda import descriptors
from chainer_tc.cuda import runtime
from chainer_tc.functions import _bn_cudnn
from chainer_tc.functions import _conv_numpy

from cudnn_fakes import (
    BN_QUERIES, HANDLE, STREAM, FakeArray, FakeFunction, FakeLib, write_perfs, lib_calls,
    needs_cudnn, perf, read_conv, read_filter, read_tensor)


def nchw(a):
    return numpy.ascontiguousarray(a.transpose(0, 3, 1, 2))


def nhwc(a):
    return numpy.ascontiguousarray(a.transpose(0, 2, 3, 1))


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# `make test` extracts cuDNN 9 (headers and the libraries of the host-only calls) and names its
# directory here; the tests marked cudnn_library then run a second time against it, in a process
# that loads nothing else of cuDNN (test_the_library_tests_pass_under_cudnn_9).
CUDNN9_ENV = 'CHAINER_TC_TEST_CUDNN9'
UNDER_CUDNN9_ENV = 'CHAINER_TC_TEST_UNDER_CUDNN9'
UNDER_CUDNN9 = os.environ.get(UNDER_CUDNN9_ENV) == '1'


def _cudnn8_dir():
    lib_dir = _cuda_libs.find_lib_dirs(_cuda_libs.default_search_paths()).get('cudnn')
    return os.path.dirname(lib_dir) if lib_dir else None


def _cudnn9_dir():
    """The extracted cuDNN 9 (`make test`), or a skip saying how to get it."""
    path = os.environ.get(CUDNN9_ENV)
    if not path:
        pytest.skip('cuDNN 9 is not extracted here: run the tests through `make test` (it sets '
                    '{})'.format(CUDNN9_ENV))
    assert os.path.isdir(os.path.join(path, 'include')), '{}={} has no include/'.format(
        CUDNN9_ENV, path)
    return path


# ---- the binding against cuDNN 8.9's and 9's C declarations --------------------------------------

KINDS = {ctypes.c_void_p: 'pointer', ctypes.c_int: 'int', ctypes.c_size_t: 'size_t',
         ctypes.c_double: 'double'}
# what each C parameter type is passed as: handles/descriptors are pointers to opaque structs,
# outputs pointers, every enum an int
POINTER_TYPES = ('cudnnHandle_t', 'cudaStream_t')


def c_kind(c_type):
    t = c_type.replace('const', '').strip()
    if '*' in t or t in POINTER_TYPES or t.endswith('Descriptor_t'):
        return 'pointer'
    if t == 'size_t':
        return 'size_t'
    if t == 'double':
        return 'double'
    if t == 'int' or (t.startswith('cudnn') and t.endswith('_t')):
        return 'int'
    raise AssertionError('unexpected C type {!r}'.format(c_type))


_HEADERS = {}


def header_text(version):
    """cuDNN ``version``'s ('8' or '9') headers, comments removed, as one string."""
    if version not in _HEADERS:
        root = _cudnn8_dir() if version == '8' else _cudnn9_dir()
        if root is None:
            pytest.skip('cuDNN 8.9 is not installed (pip install nvidia-cudnn-cu12==8.9.7.29)')
        include = os.path.join(root, 'include')
        text = ''
        for fname in sorted(os.listdir(include)):
            if fname.endswith('_v{}.h'.format(version)):
                with open(os.path.join(include, fname)) as f:
                    text += re.sub(r'/\*.*?\*/|//[^\n]*', ' ', f.read(), flags=re.S)
        _HEADERS[version] = text
    return _HEADERS[version]


def c_declaration(name, version):
    """(return type, [(C type, parameter name), ...]) of ``name`` in cuDNN ``version``'s headers."""
    m = re.search(r'(const\s+char\s*\*|cudnnStatus_t|size_t)\s*CUDNNWINAPI\s+' + name +
                  r'\s*\(([^;]*?)\)\s*;', header_text(version))
    assert m, '{} not declared in the cuDNN {} headers'.format(name, version)
    params = []
    for p in m.group(2).split(','):
        if p.strip() == 'void':
            continue
        c_type, pname = re.match(r'(.*?)(\w+)\s*$', p.strip()).groups()
        params.append((c_type.strip(), pname))
    return ' '.join(m.group(1).split()), params


def c_enum_value(name, version):
    m = re.search(r'\b' + name + r'\b(?:\s+CUDNN_DEPRECATED_ENUM)?\s*=\s*(\d+)',
                  header_text(version))
    if m is None:
        m = re.search(r'#define\s+' + name + r'\s+([\d.]+)', header_text(version))
    assert m, '{} not defined in the cuDNN {} headers'.format(name, version)
    return float(m.group(1)) if '.' in m.group(1) else int(m.group(1))


VERSIONS = ['8', '9']


@pytest.mark.parametrize('version', VERSIONS)
@pytest.mark.parametrize('name', sorted(cudnn.PROTOTYPES))
def test_prototype_matches_the_c_header(name, version):
    restype, c_params = c_declaration(name, version)
    assert restype == 'cudnnStatus_t'
    ours = cudnn.PROTOTYPES[name]
    assert [c_kind(t) for t, _ in c_params] == [KINDS[t] for _, t in ours]
    assert [p for _, p in c_params] == [p for p, _ in ours], 'parameter names, in order'


@pytest.mark.parametrize('version', VERSIONS)
def test_the_functions_returning_no_status_match_the_c_header(version):
    restype, params = c_declaration(cudnn.ERROR_STRING, version)
    assert restype.replace(' ', '') == 'constchar*' and [t for t, _ in params] == ['cudnnStatus_t']
    assert c_declaration(api.GET_VERSION, version) == ('size_t', [])


@pytest.mark.parametrize('version', VERSIONS)
def test_enum_values_match_the_c_header(version):
    for name, value in api.ENUMS.items():
        assert c_enum_value(name, version) == value, name
    for direction, name in ((conv.FORWARD, 'FWD'), (conv.BACKWARD_DATA, 'BWD_DATA'),
                            (conv.BACKWARD_FILTER, 'BWD_FILTER')):
        assert c_enum_value('CUDNN_CONVOLUTION_{}_ALGO_COUNT'.format(name), version) == \
            direction.count


@pytest.mark.parametrize('version', VERSIONS)
@pytest.mark.parametrize('which', ['Fwd', 'BwdData', 'BwdFilter'])
def test_algorithm_result_layout_matches_the_c_header(version, which):
    m = re.search(r'typedef struct cudnnConvolution' + which + r'AlgoPerfStruct\s*\{(.*?)\}',
                  header_text(version), flags=re.S)
    fields = [re.match(r'(.*?)(\w+)\s*(\[\d+\])?$', f.strip()).groups()
              for f in m.group(1).split(';') if f.strip()]
    assert [name for _, name, _ in fields] == [name for name, _ in api.AlgoPerf._fields_]
    sizes = {'float': 4, 'size_t': 8, 'int': 4}
    for (c_type, name, array), (_, ctype) in zip(fields, api.AlgoPerf._fields_):
        c_type = c_type.strip()
        size = sizes.get(c_type, 4)           # the enums and cudnnStatus_t are ints
        if array:
            size *= int(array[1:-1])
        assert ctypes.sizeof(ctype) == size, name
        if c_type == 'float':
            assert ctype is ctypes.c_float, name


def test_the_calls_a_step_makes_are_bound():
    """What runs per call (also under capture) and the set-up queries: nothing else is called."""
    per_call = {'cudnnSetStream', 'cudnnConvolutionForward', 'cudnnConvolutionBackwardData',
                'cudnnConvolutionBackwardFilter', 'cudnnBatchNormalizationForwardTrainingEx',
                'cudnnBatchNormalizationBackwardEx', 'cudnnBatchNormalizationForwardInference',
                'cudnnSoftmaxForward', 'cudnnSoftmaxBackward',
                'cudnnActivationForward', 'cudnnActivationBackward', 'cudnnPoolingForward',
                'cudnnPoolingBackward'}
    assert api.PER_CALL == per_call and per_call <= set(cudnn.PROTOTYPES)
    assert all(t in KINDS for params in cudnn.PROTOTYPES.values() for _, t in params)
    assert api.HOST_ONLY & per_call == set()


# ---- the real library ----------------------------------------------------------------------------

@needs_cudnn
def test_binding_loads_cupys_library_or_the_one_named_and_sets_the_prototypes():
    b = cudnn.binding()
    assert b is cudnn.binding()
    major = cudnn.version_tuple(b.version())[0]
    if UNDER_CUDNN9:
        assert major == 9 and b.path == os.environ[cudnn.LIBRARY_ENV]
    else:
        assert cudnn.version_tuple(b.version())[:2] == (8, 9)
        cupys = ctypes.CDLL('libcudnn.so.8', mode=os.RTLD_NOLOAD)
        assert b.lib._handle == cupys._handle, 'the very library object CuPy loaded'
        assert b.path == _cuda_libs.preloaded()['cudnn']
    for name, params in cudnn.PROTOTYPES.items():
        fn = b._fn[name]
        assert list(fn.argtypes) == [t for _, t in params] and fn.restype is ctypes.c_int


@needs_cudnn
@pytest.mark.parametrize('name', sorted(set(cudnn.PROTOTYPES) - {
    'cudnnDeriveBNTensorDescriptor',      # crashes on NULL descriptors, in 8.9 and 9
    'cudnnDestroy', 'cudnnDestroyTensorDescriptor', 'cudnnDestroyFilterDescriptor',
    'cudnnDestroyConvolutionDescriptor', 'cudnnDestroyActivationDescriptor',
    'cudnnDestroyPoolingDescriptor'}))                                          # NULL: no-op
def test_errors_name_the_call_and_cudnns_message(name):
    """NULL handles, descriptors and outputs: the real library refuses them with
    CUDNN_STATUS_BAD_PARAM (numbered 3 in 8.9, 2000 in 9), no GPU touched."""
    args = [0.0 if t is ctypes.c_double else 0 for _, t in cudnn.PROTOTYPES[name]]
    with pytest.raises(cudnn.CuDNNError) as e:
        cudnn.binding().call(name, *args)
    status = 2000 if UNDER_CUDNN9 else 3
    assert str(e.value) == '{} failed: CUDNN_STATUS_BAD_PARAM (cudnnStatus_t {})'.format(
        name, status)
    assert e.value.call == name and e.value.status == status


@needs_cudnn
def test_descriptors_are_made_read_back_and_destroyed_by_the_binding(monkeypatch):
    descriptors.clear_cache()
    chainer_tc.cuda.reset_counters()
    destroyed = []
    b = cudnn.binding()
    real = b.destroy
    monkeypatch.setattr(b, 'destroy', lambda kind, d: (destroyed.append((kind, d)),
                                                       real(kind, d))[1])
    t = descriptors.tensor_4d((2, 5, 7, 8), numpy.float16, 'NHWC')
    assert descriptors.tensor_4d((2, 5, 7, 8), numpy.float16, 'NHWC') is t, 'cached'
    assert read_tensor(t.value) == (api.CUDNN_DATA_HALF, 2, 8, 5, 7, 5 * 7 * 8, 1, 7 * 8, 8)
    f = descriptors.filter_4d((16, 3, 3, 8), numpy.float32, 'NCHW')
    assert read_filter(f.value) == (api.CUDNN_DATA_FLOAT, api.CUDNN_TENSOR_NCHW, 16, 3, 3, 8)
    c = descriptors.convolution((1, 2), (2, 1), (1, 2), 2, numpy.float16, True)
    assert read_conv(c.value) == ((1, 2, 2, 1, 1, 2, api.CUDNN_CROSS_CORRELATION,
                                   api.CUDNN_DATA_FLOAT), 2, api.CUDNN_TENSOR_OP_MATH)
    bn = descriptors.batch_norm((2, 5, 7, 8), numpy.float16, 'NHWC',
                                api.CUDNN_BATCHNORM_SPATIAL_PERSISTENT)
    assert read_tensor(bn.value)[:5] == (api.CUDNN_DATA_FLOAT, 1, 8, 1, 1), 'float for half'
    assert descriptors.relu() is descriptors.relu()
    assert chainer_tc.cuda.counters()['descriptors'] == 5
    assert chainer_tc.cuda.counters()['cudnn_calls'] == 0, 'set-up is not a step\'s call'
    value = c.value
    del c
    assert destroyed == [('Convolution', value)], 'a plan\'s own descriptor dies with it'
    with pytest.raises(cudnn.CuDNNError, match='cudnnSetTensor4dDescriptor failed: '
                                               'CUDNN_STATUS_BAD_PARAM'):
        descriptors.tensor_4d((0, 5, 7, 8), numpy.float32, 'NHWC')
    assert ((0, 5, 7, 8), 'f', 'NHWC') not in descriptors._tensors, 'a failed set is not cached'
    descriptors.clear_cache()


@needs_cudnn
def test_the_path_is_the_file_the_dynamic_linker_loaded():
    b = cudnn.binding()
    assert cudnn.loaded_file(b.lib, api.GET_VERSION) == os.path.abspath(b.path)
    assert cudnn.loaded_file(object(), api.GET_VERSION) is None


def test_a_named_cudnn_8_is_preloaded_for_cupy_too():
    """CHAINER_TC_CUDNN_LIBRARY naming a libcudnn.so.8: preloaded in the wheel's place, so
    CuPy 13 (and Chainer's cuDNN) use the same library as chainer_tc."""
    named = _cuda_libs.preloaded().get('cudnn')
    if not named or UNDER_CUDNN9:
        pytest.skip('needs the cuDNN 8.9 wheel (preloaded)')
    code = ('import json, chainer_tc, chainer\n'
            'from chainer_tc import _cuda_libs\n'
            'from chainer_tc.cuda import cudnn\n'
            'print(json.dumps([_cuda_libs.preloaded().get("cudnn"), cudnn.binding().path, '
            'chainer.backends.cuda.cudnn_enabled, cudnn.candidates()[0].what]))')
    env = dict(os.environ, **{cudnn.LIBRARY_ENV: named})
    p = subprocess.run([sys.executable, '-c', code], env=env, cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == [named, named, True, cudnn.LIBRARY_ENV]


@needs_cudnn
def test_a_handle_needs_a_gpu_and_says_so():
    b = cudnn.binding()
    try:
        handle = b.create_handle()
    except cudnn.CuDNNError as e:
        assert str(e).startswith('cudnnCreate failed: CUDNN_STATUS_NOT_INITIALIZED'), e
    else:                               # a GPU is here: the handle is real
        b.destroy_handle(handle)
        assert handle


def test_each_thread_gets_its_own_handle_per_device_never_while_capturing(monkeypatch):
    """A call sets its handle's stream first: two threads sharing a handle could run each
    other's calls on the wrong stream, so handles are per thread (as CuPy's) and device."""
    import contextlib
    import threading
    import cupy
    made = []

    class Binding:
        def create_handle(self):
            made.append(threading.get_ident())
            return 0x100 + len(made)
    monkeypatch.setattr(cudnn, 'binding', Binding)
    monkeypatch.setattr(cupy.cuda, 'Device', lambda device: contextlib.nullcontext())
    monkeypatch.setattr(runtime, '_handles', {})
    capturing = [False]
    monkeypatch.setattr(runtime, 'is_capturing', lambda: capturing[0])
    h0, h1 = runtime.handle(0), runtime.handle(1)
    assert runtime.handle(0) == h0 and h0 != h1 and len(made) == 2
    other = []
    t = threading.Thread(target=lambda: other.append(runtime.handle(0)))
    t.start()
    t.join()
    assert other[0] not in (h0, h1) and len(made) == 3
    capturing[0] = True
    assert runtime.handle(1) == h1, 'an existing handle is used under capture'
    with pytest.raises(RuntimeError, match='cuDNN handle of device 2 is not set up yet'):
        runtime.handle(2)


def test_the_library_tests_pass_under_cudnn_9():
    """Every cudnn_library test of this module and of test_chainer_cudnn.py (Chainer's calls
    routed) again, in a process whose only cuDNN is 9's
    (CHAINER_TC_CUDNN_LIBRARY names it; the wheel's 8.9 is then not preloaded)."""
    if UNDER_CUDNN9:
        pytest.skip('this is the cuDNN 9 run')
    lib = os.path.join(_cudnn9_dir(), 'lib', 'libcudnn.so.9')
    env = dict(os.environ, **{cudnn.LIBRARY_ENV: lib, UNDER_CUDNN9_ENV: '1'})
    p = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-m',
                        'cudnn_library and not gpu', os.path.abspath(__file__),
                        os.path.join(REPO, 'tests', 'test_chainer_cudnn.py')],
                       env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
    summary = p.stdout.strip().splitlines()[-1]
    passed = re.match(r'(\d+) passed, \d+ deselected(, \d+ warnings)? in ', summary)
    assert passed and int(passed.group(1)) >= 40, summary     # none skipped, none failed


def test_scaling_factors_are_float_for_half_and_float_double_for_double():
    for dtype, ctype in ((numpy.float16, ctypes.c_float), (numpy.float32, ctypes.c_float),
                         (numpy.float64, ctypes.c_double)):
        one, zero = cudnn.scaling_factors(dtype)
        assert ctype.from_address(one).value == 1.0 and ctype.from_address(zero).value == 0.0
    assert cudnn.scaling_factors(numpy.float16) == cudnn.scaling_factors(numpy.float32)
    with pytest.raises(TypeError, match='float16, float32 and float64 data; got int32'):
        cudnn.scaling_factors(numpy.int32)


# ---- which library -------------------------------------------------------------------------------

def test_versions_are_decoded_and_only_8_9_and_9_accepted():
    assert cudnn.version_tuple(8907) == (8, 9, 7) and cudnn.version_tuple(92400) == (9, 24, 0)
    assert cudnn.version_string(90100) == '9.1.0'
    for ok in (8900, 8907, 90000, 92400):
        cudnn.check_version(ok, '/x/libcudnn.so')
    for bad, shown in ((8600, '8.6.0'), (7605, '7.6.5'), (100000, '10.0.0')):
        with pytest.raises(cudnn.CuDNNUnavailable, match=r'the cuDNN at /x/libcudnn.so is '
                           r'version {}; chainer_tc calls cuDNN 8.9.x or 9.x'.format(shown)):
            cudnn.check_version(bad, '/x/libcudnn.so')


def test_candidates_prefer_the_named_library_then_cupys_then_the_wheel(monkeypatch):
    monkeypatch.setenv(cudnn.LIBRARY_ENV, '/mine/libcudnn.so.9')
    assert [(c.what, c.path) for c in cudnn.candidates()] == [
        (cudnn.LIBRARY_ENV, '/mine/libcudnn.so.9')]
    monkeypatch.delenv(cudnn.LIBRARY_ENV)
    cupys = cudnn.Candidate("CuPy's cuDNN", '/wheel/libcudnn.so.8', object(), None)
    monkeypatch.setattr(cudnn, '_cupys_library', lambda: cupys)
    assert cudnn.candidates() == [cupys], "CuPy's cuDNN alone: one cuDNN per process"
    none = cudnn.Candidate("CuPy's cuDNN", None, None, 'not usable (ImportError: x)')
    monkeypatch.setattr(cudnn, '_cupys_library', lambda: none)
    monkeypatch.setattr(_cuda_libs, 'find_library', lambda name: '/w/nvidia/cudnn/lib/'
                        'libcudnn.so.9')
    assert [(c.what, c.path) for c in cudnn.candidates()] == [
        ("CuPy's cuDNN", None), ('the nvidia-cudnn wheel', '/w/nvidia/cudnn/lib/libcudnn.so.9'),
        ('by soname', 'libcudnn.so.9'), ('by soname', 'libcudnn.so.8')]


def test_no_usable_library_lists_what_was_tried(monkeypatch):
    monkeypatch.setattr(cudnn, 'candidates', lambda: [
        cudnn.Candidate("CuPy's cuDNN", None, None, 'not usable (ImportError: no cudnn)'),
        cudnn.Candidate('the nvidia-cudnn wheel', None, None, 'not installed'),
        cudnn.Candidate('by soname', '/nonexistent/libcudnn.so.9', None, None)])
    with pytest.raises(cudnn.CuDNNUnavailable) as e:
        cudnn.load()
    message = str(e.value)
    assert message.startswith("no usable cuDNN: CuPy's cuDNN: not usable (ImportError: no "
                              "cudnn); the nvidia-cudnn wheel: not installed; by soname "
                              "(/nonexistent/libcudnn.so.9): ")
    assert 'nvidia-cudnn-cu13 9.x' in message and cudnn.LIBRARY_ENV in message


def test_an_unsupported_or_incomplete_library_is_refused(monkeypatch):
    class Old:
        def __init__(self, version, missing=()):
            self.version, self.missing = version, missing

        def __getattr__(self, name):
            if name in self.missing:
                raise AttributeError('undefined symbol: ' + name)
            if name == api.GET_VERSION:
                return lambda: self.version
            return FakeFunction(name, [])
    assert cudnn._open(cudnn.Candidate('x', '/a', Old(8907), None))[0] is not None
    b, why = cudnn._open(cudnn.Candidate('x', '/a', Old(7605), None))
    assert b is None and 'version 7.6.5' in why
    b, why = cudnn._open(cudnn.Candidate('x', '/a', Old(8907, {'cudnnConvolutionForward'}),
                                         None))
    assert b is None and why == ('lacks a function chainer_tc calls: undefined symbol: '
                                 'cudnnConvolutionForward')


def test_a_failed_load_is_remembered_and_said_again(monkeypatch):
    monkeypatch.setattr(cudnn, '_binding', None)
    monkeypatch.setattr(cudnn, '_unavailable', None)
    calls = []
    monkeypatch.setattr(cudnn, 'load', lambda: (calls.append(1), (_ for _ in ()).throw(
        cudnn.CuDNNUnavailable('no usable cuDNN: none here')))[1])
    for _ in range(2):
        assert cudnn.unavailable_reason() == 'no usable cuDNN: none here'
    with pytest.raises(cudnn.CuDNNUnavailable, match='none here'):
        cudnn.binding()
    assert calls == [1], 'one search per process'


def test_find_library_searches_the_wheel_directories(tmp_path, monkeypatch):
    lib_dir = tmp_path / 'nvidia' / 'cudnn' / 'lib'
    lib_dir.mkdir(parents=True)
    for name in ('libcudnn.so.8', 'libcudnn_ops_infer.so.8', 'libcudnn.so.8.9.7'):
        (lib_dir / name).write_bytes(b'')
    monkeypatch.setattr(_cuda_libs, '_loaded', {})
    assert _cuda_libs.find_library('cudnn', [str(tmp_path)]) == str(lib_dir / 'libcudnn.so.8')
    assert _cuda_libs.find_library('cufft', [str(tmp_path)]) is None
    monkeypatch.setattr(_cuda_libs, '_loaded', {'cudnn': '/preloaded/libcudnn.so.8'})
    assert _cuda_libs.find_library('cudnn', [str(tmp_path)]) == '/preloaded/libcudnn.so.8'
    with pytest.raises(ValueError, match="unknown library 'cudnn9'"):
        _cuda_libs.find_library('cudnn9')


def test_a_named_cudnn_keeps_the_wheels_out_of_the_preload(monkeypatch):
    names = [n for n, _, _ in _cuda_libs._wanted()]
    assert 'cudnn' in names and 'cudnn_ops_infer' in names
    monkeypatch.setenv(cudnn.LIBRARY_ENV, '/mine/libcudnn.so.9')
    names = [n for n, _, _ in _cuda_libs._wanted()]
    assert not any(n.startswith('cudnn') for n in names) and 'cublas' in names


SETTINGS = conv.settings(auto_tune=False, tensor_core='auto', deterministic=False)


def problem(dtype=numpy.float16, n=2, h=9, w=7, cin=8, cout=16, k=3, geometry=None):
    g = geometry or conv.geometry(pad=1, stride=1)
    oh = (h + 2 * g.pad[0] - g.dilation[0] * (k - 1) - 1) // g.stride[0] + 1
    ow = (w + 2 * g.pad[1] - g.dilation[1] * (k - 1) - 1) // g.stride[1] + 1
    x = FakeArray((n, h, w, cin), dtype, 0x1000)
    W = FakeArray((cout, k, k, cin // g.groups), dtype, 0x2000)
    y = FakeArray((n, oh, ow, cout), dtype, 0x3000)
    return x, W, y, g


# ---- what the driver passes ----------------------------------------------------------------------

CUDA_DTYPES = [numpy.float16, numpy.float32, numpy.float64]


@needs_cudnn
@pytest.mark.parametrize('dtype', CUDA_DTYPES)
def test_forward_passes_what_cupyx_cudnn_would(fake, dtype):
    """cupyx.cudnn.convolution_forward (13.6) calls cudnnConvolutionForward(handle, &one, x_desc,
    x, filter_desc, W, conv_desc, algo, workspace, workspace_size, &zero, y_desc, y), alpha/beta
    float for half and float data, double for double."""
    lib = api
    fake.perfs = [perf(6, 4096, math_type=1)]
    fake.sizes = {6: 4096}
    x, W, y, g = problem(dtype, geometry=conv.geometry(pad=(1, 2), stride=(2, 1),
                                                      dilation=(1, 2), groups=2))
    conv.forward(x, W, y, g, SETTINGS)
    (n1, a1), (n2, a2) = lib_calls(fake)
    assert (n1, a1) == ('cudnnSetStream', (HANDLE, STREAM))
    assert n2 == 'cudnnConvolutionForward'
    handle, alpha, x_desc, xp, w_desc, wp, conv_desc, algo, ws, ws_size, beta, y_desc, yp = a2
    assert (handle, xp, wp, yp, algo, ws_size) == (HANDLE, 0x1000, 0x2000, 0x3000, 6, 4096)
    assert ws == 0x10000000 + 4096 and fake.allocs == [4096]
    scalar = ctypes.c_double if dtype == numpy.float64 else ctypes.c_float
    assert scalar.from_address(alpha).value == 1.0 and scalar.from_address(beta).value == 0.0
    t = descriptors.data_type(dtype)
    # NHWC fully packed: strides n = HWC, c = 1, h = WC, w = C
    assert read_tensor(x_desc) == (t, 2, 8, 9, 7, 9 * 7 * 8, 1, 7 * 8, 8)
    _, oh, ow, _ = y.shape
    assert read_tensor(y_desc) == (t, 2, 16, oh, ow, oh * ow * 16, 1, ow * 16, 16)
    assert read_filter(w_desc) == (t, lib.CUDNN_TENSOR_NHWC, 16, 4, 3, 3)
    compute = lib.CUDNN_DATA_DOUBLE if dtype == numpy.float64 else lib.CUDNN_DATA_FLOAT
    assert read_conv(conv_desc) == ((1, 2, 2, 1, 1, 2, lib.CUDNN_CROSS_CORRELATION, compute), 2,
                                    1), 'pad, stride, dilation, mode, compute type; groups; math'


@needs_cudnn
@pytest.mark.parametrize('direction', ['backward_data', 'backward_filter'])
def test_backward_calls_pass_their_operands_in_cudnns_order(fake, direction):
    x, W, y, g = problem(numpy.float32)
    fake.perfs = [perf(0, 0, math_type=0)]
    fake.sizes = {0: 0}
    if direction == 'backward_data':
        conv.backward_data(W, y, x, g, SETTINGS)          # (w, dy) -> dx
        expected = ('cudnnConvolutionBackwardData', (W, y, x), (read_filter, read_tensor,
                                                                read_tensor))
    else:
        conv.backward_filter(x, y, W, g, SETTINGS)        # (x, dy) -> dw
        expected = ('cudnnConvolutionBackwardFilter', (x, y, W), (read_tensor, read_tensor,
                                                                  read_filter))
    (_, _), (name, args) = lib_calls(fake)
    assert name == expected[0]
    assert (args[3], args[5], args[12]) == tuple(a.data.ptr for a in expected[1])
    for desc, read, arr in zip((args[2], args[4], args[11]), expected[2], expected[1]):
        dims = read(desc)
        n, h, w, c = arr.shape
        assert (dims[1:5] if read is read_tensor else dims[2:]) == (n, c, h, w)
    assert args[8] == 0 and args[9] == 0 and fake.allocs == [], 'no workspace: NULL, 0'


@needs_cudnn
@pytest.mark.parametrize('direction', ['forward', 'backward_data', 'backward_filter'])
def test_a_problem_without_nhwc_algorithms_runs_in_nchw_with_a_warning(fake, monkeypatch,
                                                                       direction):
    """cuDNN 9.19 on an H100 answers NOT_SUPPORTED (3000) for every NHWC float64
    backward-data and backward-filter algorithm: the call then runs in NCHW, its inputs transposed into contiguous
    copies and the result transposed back into the output, said once per plan."""
    x, W, y, g = problem(numpy.float64)
    statuses = []

    def answer(args):            # NHWC queries: nothing supported; NCHW: algorithm 1
        nhwc = read_tensor(args[1] if direction != 'backward_data' else args[2])[6] == 1
        statuses.append('NHWC' if nhwc else 'NCHW')
        fake.perfs = [perf(a, 0, status=3000) for a in range(3)] if nhwc else [perf(1, 0)]
    d = getattr(conv, direction.upper())
    function = getattr(fake.lib, d.get)
    query = function.effect
    function.effect = lambda args: (answer(args), query(args))
    copies, written = [], []

    def contiguous(a):
        copies.append((a.data.ptr, a.shape, a.flags.c_contiguous))
        return FakeArray(a.shape, a.dtype, 0x7000 + 0x100 * len(copies))
    monkeypatch.setattr(runtime, 'contiguous', contiguous)
    monkeypatch.setattr(runtime, 'copy_into', lambda out, a: written.append((out, a)))
    operands = {'forward': (x, W, y), 'backward_data': (W, y, x),
                'backward_filter': (x, y, W)}[direction]
    call = getattr(conv, direction)
    with pytest.warns(chainer_tc.cuda.PerformanceWarning, match='in NCHW with its operands'):
        call(*operands, g, SETTINGS)
    with warnings.catch_warnings():
        warnings.simplefilter('error')              # said once per plan
        call(*operands, g, SETTINGS)
    assert statuses == ['NHWC', 'NCHW'], 'one query in each layout, then plans'
    a, b, out = operands
    to_nchw = [(a.data.ptr, (s[0], s[3], s[1], s[2]), False) for a, s in
               ((a, a.shape), (b, b.shape))]
    assert copies == to_nchw * 2
    (name, args), = [c for c in lib_calls(fake) if c[0] != 'cudnnSetStream'][:1]
    assert args[3] == 0x7100 and args[5] == 0x7200, 'the NCHW copies go to cuDNN'
    reader = read_filter if direction == 'backward_filter' else read_tensor
    dims = reader(args[11])
    n, h, w, c = out.shape
    assert (dims[1:5] if reader is read_tensor else dims[2:]) == (n, c, h, w)
    if reader is read_tensor:
        assert dims[5:] == (c * h * w, h * w, w, 1), 'an NCHW descriptor'
    (dst, src), _ = written
    assert dst is out and src.shape == out.shape and src.data.ptr == args[12], \
        "cuDNN's NCHW result goes back into the output, transposed to NHWC"


@needs_cudnn
def test_nothing_is_created_or_queried_after_the_first_call(fake):
    x, W, y, g = problem()
    conv.forward(x, W, y, g, SETTINGS)
    conv.backward_data(W, y, x, g, SETTINGS)
    conv.backward_filter(x, y, W, g, SETTINGS)
    first = chainer_tc.cuda.counters()
    assert first['descriptors'] == 2 + 1 + 3, 'x and y tensors, the filter, a conv desc each'
    assert first['algorithm_queries'] == 3 and first['workspace_queries'] == 3
    chainer_tc.cuda.reset_counters()
    del fake.lib.log[:]
    for _ in range(3):
        conv.forward(x, W, y, g, SETTINGS)
        conv.backward_data(W, y, x, g, SETTINGS)
        conv.backward_filter(x, y, W, g, SETTINGS)
    assert chainer_tc.cuda.counters() == dict(descriptors=0, algorithm_queries=0,
                                              workspace_queries=0, cudnn_calls=18,
                                              cublas_calls=0)
    assert [n for n, _ in fake.lib.log[:2]] == ['cudnnSetStream', 'cudnnConvolutionForward']


@needs_cudnn
def test_heuristic_and_autotune_queries(fake):
    x, W, y, g = problem()
    conv.forward(x, W, y, g, SETTINGS)
    assert [n for n, _ in fake.queries] == ['cudnnGetConvolutionForwardAlgorithm_v7',
                                            'cudnnGetConvolutionForwardWorkspaceSize']
    get = fake.queries[0][1]
    assert get[0] == HANDLE and get[5] == 8, 'all 8 forward algorithms asked for'
    plan, = conv._plans.values()
    assert fake.queries[1][1][:6] == (HANDLE,) + plan.descs[:2] + (plan.conv_desc,
                                                                  plan.descs[2], 1)
    del fake.queries[:], fake.lib.log[:], fake.allocs[:]
    chainer_tc.cuda.reset_counters()
    conv.forward(x, W, y, g, conv.settings(auto_tune=True))
    assert chainer_tc.cuda.counters()['cudnn_calls'] == 2, 'the search is set-up, not a call'
    (find, args), _ = fake.queries
    assert find == 'cudnnFindConvolutionForwardAlgorithmEx'
    limit = conv.get_workspace_limit()
    assert args[2] == 0x1000 and args[4] == 0x2000 and args[7] == 0x3000
    assert args[8] == 8 and args[11:] == (0x10000000 + limit, limit), \
        'count, workspace of the limit, limit'
    assert fake.allocs[0] == limit
    assert fake.lib.log[0] == ('cudnnSetStream', (HANDLE, STREAM)), 'Find runs on our stream'


@needs_cudnn
@pytest.mark.parametrize('direction', [conv.FORWARD, conv.BACKWARD_DATA, conv.BACKWARD_FILTER],
                         ids=lambda d: d.name)
def test_queries_pass_each_directions_operands_in_cudnns_order(fake, direction):
    """The Find, heuristic and workspace queries take (a, b, conv, out) in the direction's C
    order: forward (x, w, y), backward data (w, dy, dx), backward filter (x, dy, dw)."""
    x, W, y, g = problem()
    run = {'forward': lambda s: conv.forward(x, W, y, g, s),
           'backward_data': lambda s: conv.backward_data(W, y, x, g, s),
           'backward_filter': lambda s: conv.backward_filter(x, y, W, g, s)}[direction.name]
    arrays = {'x': x, 'w': W, 'y': y}
    ptrs = tuple(arrays[slot].data.ptr for slot in direction.operands)
    run(SETTINGS)
    (get, get_args), (size, size_args) = fake.queries
    plan, = conv._plans.values()
    descs = plan.descs
    assert read_filter(descs[direction.operands.index('w')])[2:] == (16, 8, 3, 3)
    assert (get, size) == (direction.get, direction.size)
    assert get_args[:6] == (HANDLE,) + descs[:2] + (plan.conv_desc, descs[2], direction.count)
    assert size_args[:6] == (HANDLE,) + descs[:2] + (plan.conv_desc, descs[2], plan.algo)
    conv.clear_plans()
    del fake.queries[:]
    run(conv.settings(auto_tune=True))
    (find, a), _ = fake.queries
    plan, = conv._plans.values()
    d = plan.descs
    assert find == direction.find
    assert a[:9] == (HANDLE, d[0], ptrs[0], d[1], ptrs[1], plan.conv_desc, d[2], ptrs[2],
                     direction.count)


def test_algorithm_results_come_back_ranked_and_counted():
    """The binding's query methods: cuDNN fills `returned` of the `requested` slots, in rank."""
    results = [perf(5, 64, math_type=1), perf(0, 0, status=9, math_type=0)]

    def effect(args):
        write_perfs(results, args[6], args[7], args[5])
    b = cudnn.Binding(FakeLib(effects={conv.FORWARD.get: effect}))
    got = b.algorithms(conv.FORWARD.get, 1, (2, 3, 4), 5, 8)
    assert [(p.algo, p.memory, p.status, p.mathType) for p in got] == [(5, 64, 0, 1),
                                                                       (0, 0, 9, 0)]
    assert isinstance(got[0], api.AlgoPerf)


@needs_cudnn
def test_capture_refuses_set_up_but_not_a_warm_call(fake):
    x, W, y, g = problem()
    conv.forward(x, W, y, g, SETTINGS)
    fake.capturing = True
    conv.forward(x, W, y, g, SETTINGS)                              # warm: fine
    x2, W2, y2, g2 = problem(n=4)
    with pytest.raises(RuntimeError, match=r'cuDNN convolution forward of x \(4, 9, 7, 8\).*'
                                           r'run the same step once before begin_capture'):
        conv.forward(x2, W2, y2, g2, SETTINGS)


@needs_cudnn
def test_cudnn_errors_from_the_driver_name_call_and_problem(fake):
    x, W, y, g = problem()
    fake.lib.cudnnConvolutionForward.status = 9
    with pytest.raises(cudnn.CuDNNError, match=r'cudnnConvolutionForward failed: '
                                               r'CUDNN_STATUS_FAKE \(cudnnStatus_t 9\)\n  cuDNN '
                                               r'convolution forward of x \(2, 9, 7, 8\)'):
        conv.forward(x, W, y, g, SETTINGS)


@needs_cudnn
def test_operands_are_checked(fake):
    x, W, y, g = problem()
    with pytest.raises(ValueError, match='operand x must be C-contiguous'):
        conv.forward(FakeArray(x.shape, x.dtype, 1, contiguous=False), W, y, g, SETTINGS)
    with pytest.raises(TypeError, match='operand w is float32 on device 0, expected float16'):
        conv.forward(x, FakeArray(W.shape, numpy.float32, 2), y, g, SETTINGS)
    conv.forward(x, W, y, g, SETTINGS)                  # the plan exists: still checked
    with pytest.raises(TypeError, match='operand x is float32 on device 0, expected float16'):
        conv.forward(FakeArray(x.shape, numpy.float32, 1), W, y, g, SETTINGS)
    with pytest.raises(TypeError, match='operand x is float16 on device 1, expected float16 on '
                                        'device 0'):
        conv.forward(FakeArray(x.shape, x.dtype, 1, device=1), W, y, g, SETTINGS)


# ---- plans and keys ------------------------------------------------------------------------------

def test_plan_keys_differ_in_every_element():
    g = conv.geometry(pad=(1, 1), stride=(1, 1), dilation=(1, 1), groups=1)
    shapes = ((2, 9, 9, 8), (8, 3, 3, 8), (2, 9, 9, 8))
    base = dict(direction=conv.FORWARD, device_id=0, shapes=shapes, dtype=numpy.float16,
                layout='NHWC', geometry=g, settings=SETTINGS, limit=conv.DEFAULT_WORKSPACE_LIMIT)
    variants = [
        dict(direction=conv.BACKWARD_DATA), dict(direction=conv.BACKWARD_FILTER),
        dict(device_id=1), dict(dtype=numpy.float32), dict(layout='NCHW'),
        dict(limit=8 << 20),
        dict(shapes=((4, 9, 9, 8),) + shapes[1:]), dict(shapes=(shapes[0], (16, 3, 3, 8),
                                                                 shapes[2])),
        dict(shapes=shapes[:2] + ((2, 7, 7, 8),)),
        dict(geometry=g._replace(pad=(0, 1))), dict(geometry=g._replace(pad=(1, 0))),
        dict(geometry=g._replace(stride=(2, 1))), dict(geometry=g._replace(stride=(1, 2))),
        dict(geometry=g._replace(dilation=(2, 1))), dict(geometry=g._replace(dilation=(1, 2))),
        dict(geometry=g._replace(groups=2)),
        dict(settings=SETTINGS._replace(tensor_core='never')),
        dict(settings=SETTINGS._replace(deterministic=True)),
        dict(settings=SETTINGS._replace(auto_tune=True)),
    ]
    keys = [conv.plan_key(**base)] + [conv.plan_key(**dict(base, **v)) for v in variants]
    assert len(set(keys)) == len(keys)
    assert conv.plan_key(**base) == conv.plan_key(**dict(base, geometry=conv.geometry(1, 1)))
    # 'always' and 'auto' ask for the same thing: one plan
    assert conv.plan_key(**base) == conv.plan_key(**dict(
        base, settings=SETTINGS._replace(tensor_core='always')))


@needs_cudnn
def test_a_geometry_change_is_a_new_plan_through_the_driver(fake):
    x, W, y, g = problem()
    conv.forward(x, W, y, g, SETTINGS)
    conv.forward(x, W, y, g, SETTINGS)
    assert chainer_tc.cuda.counters()['algorithm_queries'] == 1
    conv.forward(x, W, y, g._replace(dilation=(1, 1), pad=(1, 1)), SETTINGS)   # the same
    assert chainer_tc.cuda.counters()['algorithm_queries'] == 1
    for other in (g._replace(stride=(1, 1), pad=(2, 1)), g._replace(groups=2)):
        W2 = FakeArray((16, 3, 3, 8 // other.groups), numpy.float16, 0x2000)
        conv.forward(x, W2, y, other, SETTINGS)
    assert chainer_tc.cuda.counters()['algorithm_queries'] == 3
    set_before = len(conv._plans)
    conv.set_workspace_limit(64 << 20)
    conv.forward(x, W, y, g, SETTINGS)
    assert len(conv._plans) == set_before + 1


def test_choose_skips_failures_nondeterministic_and_oversized():
    perfs = [perf(1, 10, status=9), perf(2, 10, determinism=0), perf(3, 1000), perf(4, 10)]
    assert conv.choose(perfs, 100, False)[0].algo == 2
    chosen, skipped = conv.choose(perfs, 100, True)
    assert chosen.algo == 4 and [p.algo for p in skipped] == [3]
    assert conv.choose(perfs, 1000, True) == (perfs[2], [])
    with pytest.raises(RuntimeError, match=r'no algorithm that is deterministic and fits the '
                                           r'workspace limit of 5 bytes.*set_workspace_limit'):
        conv.choose(perfs, 5, True)


@needs_cudnn
def test_slower_choices_warn_once_with_the_reason(fake):
    fake.perfs = [perf(7, 1 << 40), perf(1, 0, math_type=0)]
    x, W, y, g = problem()
    with pytest.warns(chainer_tc.cuda.PerformanceWarning) as record:
        conv.forward(x, W, y, g, SETTINGS)
    messages = [str(w.message) for w in record]
    assert any('prefers algorithm 7' in m and 'set_workspace_limit' in m for m in messages)
    assert any('Tensor Cores were asked for' in m for m in messages)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        conv.forward(x, W, y, g, SETTINGS)                     # the plan exists: silent


@needs_cudnn
def test_the_queried_workspace_must_fit_the_limit_too(fake):
    """cudnnGetConvolution*Algorithm_v7's memory is an estimate; the size allocated at every
    call is the workspace query's. An algorithm whose queried size exceeds the limit is skipped
    like one whose estimate does, and the warning names the queried size."""
    fake.perfs = [perf(6, 100), perf(1, 50, math_type=0)]
    fake.sizes = {6: 64 << 20, 1: 50}
    conv.set_workspace_limit(1 << 20)
    try:
        x, W, y, g = problem()
        with pytest.warns(chainer_tc.cuda.PerformanceWarning,
                          match=r'prefers algorithm 6 \(67108864 bytes of workspace\) but the '
                                r'workspace limit is 1048576 bytes, so algorithm 1 runs'):
            conv.forward(x, W, y, g, SETTINGS)
        plan, = conv._plans.values()
        assert (plan.algo, plan.workspace_size) == (1, 50)
    finally:
        conv.set_workspace_limit(conv.DEFAULT_WORKSPACE_LIMIT)
    chosen, skipped = conv.choose([api.AlgoPerf(algo=2, memory=10), api.AlgoPerf(algo=3)], 100,
                                  False, workspace=lambda p: 1000 if p.algo == 2 else 0)
    assert chosen.algo == 3 and [(p.algo, p.memory) for p in skipped] == [(2, 1000)]


def test_a_tensor_over_cudnns_int_is_refused_not_wrapped():
    with pytest.raises(ValueError, match=r'cuDNN tensor descriptor of shape \(1024, 224, 224, '
                                         r'64\): cuDNN takes at most 2\*\*31 - 1 elements'):
        descriptors.tensor_4d((1024, 224, 224, 64), numpy.float16, 'NHWC')
    with pytest.raises(ValueError, match=r'cuDNN filter descriptor of shape \(4294967297, 1, 1, '
                                         r'1\)'):
        descriptors.filter_4d((2 ** 32 + 1, 1, 1, 1), numpy.float16, 'NHWC')


def test_arguments_are_validated():
    with pytest.raises(ValueError, match='tensor_core .* must be one of'):
        conv.settings(tensor_core='sometimes')
    with pytest.raises(ValueError, match='stride must be an int or a pair of ints >= 1'):
        conv.geometry(stride=0)
    with pytest.raises(ValueError, match='groups must be an int >= 1'):
        conv.geometry(groups=0)
    with pytest.raises(ValueError, match='layout must be one of'):
        descriptors.layout_format('CHWN')
    with pytest.raises(TypeError, match='float16, float32 or float64 data; got int8'):
        descriptors.data_type(numpy.int8)
    with pytest.raises(ValueError, match='non-negative int or None'):
        conv.set_workspace_limit(-1)


def test_workspace_limit_default_follows_chainer_only_when_raised(monkeypatch):
    from chainer.backends import cuda as chainer_cuda
    monkeypatch.setattr(conv, '_limit', None)
    before = chainer_cuda.get_max_workspace_size()
    try:
        chainer_cuda.set_max_workspace_size(conv.CUPY_DEFAULT_WORKSPACE)
        assert conv.get_workspace_limit() == 512 << 20
        chainer_cuda.set_max_workspace_size(1 << 30)
        assert conv.get_workspace_limit() == 1 << 30
        conv.set_workspace_limit(100 << 20)
        assert conv.get_workspace_limit() == 100 << 20
        conv.set_workspace_limit(None)
        assert conv.get_workspace_limit() == 1 << 30
    finally:
        chainer_cuda.set_max_workspace_size(before)


def test_importing_chainer_tc_cuda_is_cheap():
    import subprocess
    import sys
    code = ('import sys, chainer_tc.cuda, chainer_tc.cuda.conv\n'
            'print(sorted(m for m in ("cupy", "chainer_tc.functions", "chainer_tc.links", '
            '"chainer_tc.static_graph", "chainer_tc.optimizers") if m in sys.modules))')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.strip() == '[]', 'chainer_tc.cuda imports nothing above it, nor CuPy'


# ---- fused batch normalization plans -------------------------------------------------------------

@needs_cudnn
def test_fused_bn_plan_is_set_up_once_per_key(fake, monkeypatch):
    lib = api
    fake.sizes = dict.fromkeys(BN_QUERIES, 256)
    monkeypatch.setattr(_bn_cudnn, '_plans', {})
    x = FakeArray((4, 7, 7, 64), numpy.float16, 0x1000)
    first = _bn_cudnn.FusedBatchNorm(x, True, True)
    assert chainer_tc.cuda.counters()['descriptors'] == 3, 'x/y/z, derived BN, ReLU'
    assert chainer_tc.cuda.counters()['workspace_queries'] == 3
    p = first.plan
    assert p.ops == lib.CUDNN_BATCHNORM_OPS_BN_ADD_ACTIVATION and p.z_desc == p.desc
    assert (p.forward_workspace, p.reserve_size, p.backward_workspace) == (256, 256, 256)
    assert read_tensor(p.desc)[1:5] == (4, 64, 7, 7)
    assert [n for n, _ in fake.queries] == list(BN_QUERIES)
    fwd, reserve, bwd = (args for _, args in fake.queries)
    assert fwd[:8] == (HANDLE, p.mode, p.ops, p.desc, p.desc, p.desc, p.bn_desc, p.act)
    assert reserve[:5] == (HANDLE, p.mode, p.ops, p.act, p.desc)
    assert bwd[:10] == (HANDLE, p.mode, p.ops) + (p.desc,) * 5 + (p.bn_desc, p.act)
    chainer_tc.cuda.reset_counters()
    second = _bn_cudnn.FusedBatchNorm(x, True, True)
    assert second.plan is p and chainer_tc.cuda.counters()['descriptors'] == 0
    assert chainer_tc.cuda.counters()['workspace_queries'] == 0
    other = _bn_cudnn.FusedBatchNorm(x, False, True)           # other bnOps: its own plan
    assert other.plan is not p and other.plan.z_desc == 0
    assert other.plan.ops == lib.CUDNN_BATCHNORM_OPS_BN_ACTIVATION
    fake.capturing = True
    with pytest.raises(RuntimeError, match='before begin_capture'):
        _bn_cudnn.FusedBatchNorm(FakeArray((2, 7, 7, 64), numpy.float16, 1), True, True)


@needs_cudnn
def test_fused_bn_calls_pass_each_buffer_where_cudnn_expects_it(fake, monkeypatch):
    lib = api
    fake.sizes = dict(zip(BN_QUERIES, (512, 128, 256)))
    monkeypatch.setattr(_bn_cudnn, '_plans', {})
    f16, f32 = numpy.float16, numpy.float32
    x, z = FakeArray((4, 7, 7, 64), f16, 0x1000), FakeArray((4, 7, 7, 64), f16, 0x2000)
    gamma, beta = FakeArray((64,), f32, 0x3000), FakeArray((64,), f32, 0x4000)
    rm, rv = FakeArray((64,), f32, 0x5000), FakeArray((64,), f32, 0x6000)
    node = _bn_cudnn.FusedBatchNorm(x, True, True)
    p = node.plan
    y = node.forward(x, z, gamma, beta, 2e-5, 0.9, rm, rv)
    (n1, a1), (n2, a2) = lib_calls(fake)
    assert (n1, a1) == ('cudnnSetStream', (HANDLE, STREAM))
    fwd = dict(zip((p for p, _ in cudnn.PROTOTYPES[n2]), a2))
    one = ctypes.c_float.from_address(fwd['alpha']).value
    zero = ctypes.c_float.from_address(fwd['beta']).value
    assert (one, zero) == (1.0, 0.0), 'float scaling factors for half data'
    assert fwd['handle'] == HANDLE and fwd['mode'] == lib.CUDNN_BATCHNORM_SPATIAL_PERSISTENT
    assert fwd['bnOps'] == lib.CUDNN_BATCHNORM_OPS_BN_ADD_ACTIVATION
    assert fwd['xDesc'] == fwd['zDesc'] == fwd['yDesc'] == p.desc
    assert fwd['bnScaleBiasMeanVarDesc'] == p.bn_desc and fwd['activationDesc'] == p.act != 0
    assert (fwd['xData'], fwd['zData'], fwd['yData']) == (0x1000, 0x2000, y.data.ptr)
    assert (fwd['bnScale'], fwd['bnBias']) == (0x3000, 0x4000)
    assert (fwd['resultRunningMean'], fwd['resultRunningVariance']) == (0x5000, 0x6000)
    assert fwd['exponentialAverageFactor'] == pytest.approx(0.1) and fwd['epsilon'] == 2e-5
    assert fwd['resultSaveMean'] == node.mean.data.ptr
    assert fwd['resultSaveInvVariance'] == node.invstd.data.ptr
    assert (fwd['workspace'], fwd['workSpaceSizeInBytes']) == (0x10000000 + 512, 512)
    assert (fwd['reserveSpace'], fwd['reserveSpaceSizeInBytes']) == (0x10000000 + 128, 128)
    assert node.reserve.ptr == fwd['reserveSpace'], 'the reserve space stays with the node'
    del fake.lib.log[:]
    gy = FakeArray(x.shape, f16, 0x7000)
    gx, ggamma, gbeta, gz = node.backward(x, y, gy, gamma, beta, 2e-5)
    (_, _), (n3, a3) = lib_calls(fake)
    bwd = dict(zip((p for p, _ in cudnn.PROTOTYPES[n3]), a3))
    assert [ctypes.c_float.from_address(bwd[k]).value for k in (
        'alphaDataDiff', 'betaDataDiff', 'alphaParamDiff', 'betaParamDiff')] == [1, 0, 1, 0]
    assert (bwd['xData'], bwd['yData'], bwd['dyData']) == (0x1000, y.data.ptr, 0x7000)
    assert (bwd['dzData'], bwd['dxData']) == (gz.data.ptr, gx.data.ptr)
    assert (bwd['bnScaleData'], bwd['bnBiasData']) == (0x3000, 0x4000)
    assert (bwd['dBnScaleData'], bwd['dBnBiasData']) == (ggamma.data.ptr, gbeta.data.ptr)
    assert (bwd['savedMean'], bwd['savedInvVariance']) == (fwd['resultSaveMean'],
                                                           fwd['resultSaveInvVariance'])
    assert (bwd['reserveSpace'], bwd['reserveSpaceSizeInBytes']) == (fwd['reserveSpace'], 128)
    assert (bwd['workSpace'], bwd['workSpaceSizeInBytes']) == (0x10000000 + 256, 256)
    assert bwd['epsilon'] == 2e-5 and bwd['activationDesc'] == p.act
    assert bwd['dzDesc'] == bwd['dxDesc'] == bwd['dyDesc'] == p.desc
    assert bwd['dBnScaleBiasDesc'] == p.bn_desc
    assert gz.shape == x.shape and ggamma.dtype == numpy.float32


@needs_cudnn
def test_plain_fused_bn_passes_null_z_activation_and_running_statistics(fake, monkeypatch):
    lib = api
    fake.sizes = dict.fromkeys(BN_QUERIES, 0)
    monkeypatch.setattr(_bn_cudnn, '_plans', {})
    x = FakeArray((2, 5, 5, 8), numpy.float16, 0x1000)
    gamma, beta = FakeArray((8,), numpy.float32, 0x3000), FakeArray((8,), numpy.float32, 0x4000)
    node = _bn_cudnn.FusedBatchNorm(x, False, False)
    y = node.forward(x, None, gamma, beta, 1e-5, 0.9, None, None)
    fwd = dict(zip((p for p, _ in cudnn.PROTOTYPES['cudnnBatchNormalizationForwardTrainingEx']),
                   lib_calls(fake)[1][1]))
    assert fwd['bnOps'] == lib.CUDNN_BATCHNORM_OPS_BN
    assert (fwd['zDesc'], fwd['zData'], fwd['activationDesc']) == (0, 0, 0)
    assert (fwd['resultRunningMean'], fwd['resultRunningVariance']) == (0, 0)
    assert fwd['exponentialAverageFactor'] == 0.0
    assert (fwd['workspace'], fwd['reserveSpace'], fwd['reserveSpaceSizeInBytes']) == (0, 0, 0)
    del fake.lib.log[:]
    gx, _, _, gz = node.backward(x, y, FakeArray(x.shape, numpy.float16, 0x7000), gamma, beta,
                                 1e-5)
    bwd = dict(zip((p for p, _ in cudnn.PROTOTYPES['cudnnBatchNormalizationBackwardEx']),
                   lib_calls(fake)[1][1]))
    assert gz is None and (bwd['dzDesc'], bwd['dzData'], bwd['activationDesc']) == (0, 0, 0)


# ---- gradients asked for only (CPU path) ---------------------------------------------------------

def test_cpu_backward_skips_gx_when_the_input_needs_none(monkeypatch):
    r = numpy.random.RandomState(0)
    x = r.randn(2, 9, 8, 4).astype(numpy.float32)
    W = (r.randn(6, 3, 3, 2) * 0.3).astype(numpy.float32)
    b = r.randn(6).astype(numpy.float32)
    kw = dict(stride=2, pad=1, groups=2, dilate=1)
    calls = []
    real = _conv_numpy._scatter             # the input gradient's only work: patches back
    monkeypatch.setattr(_conv_numpy, '_scatter',
                        lambda *a: (calls.append(1), real(*a))[1])
    for need_x in (False, True):
        del calls[:]
        xv = chainer.Variable(x, requires_grad=need_x)
        Wv, bv = chainer.Variable(W), chainer.Variable(b)
        y = TF.convolution_2d(xv, Wv, bv, **kw)
        gy = r.randn(*y.shape).astype(numpy.float32)
        y.grad = gy
        y.backward()
        assert len(calls) == (1 if need_x else 0)
        assert (xv.grad is None) == (not need_x)
        rx, rW, rb = (chainer.Variable(a) for a in (nchw(x), nchw(W), b))
        ry = F.convolution_2d(rx, rW, rb, **kw)
        ry.grad = nchw(gy)
        ry.backward()
        numpy.testing.assert_allclose(Wv.grad, nhwc(rW.grad), rtol=1e-5, atol=1e-5)
        numpy.testing.assert_allclose(bv.grad, rb.grad, rtol=1e-5, atol=1e-5)
        if need_x:
            numpy.testing.assert_allclose(xv.grad, nhwc(rx.grad), rtol=1e-5, atol=1e-5)


def test_cpu_backward_of_only_gx():
    r = numpy.random.RandomState(1)
    x = r.randn(1, 6, 6, 3).astype(numpy.float64)
    W = r.randn(4, 3, 3, 3)
    xv = chainer.Variable(x)
    y = TF.convolution_2d(xv, chainer.Variable(W, requires_grad=False), pad=1)
    y.grad = numpy.ones(y.shape)
    y.backward()
    ref = chainer.Variable(nchw(x))
    ry = F.convolution_2d(ref, nchw(W), pad=1)
    ry.grad = numpy.ones(ry.shape)
    ry.backward()
    numpy.testing.assert_allclose(xv.grad, nhwc(ref.grad), rtol=1e-12, atol=1e-12)


def test_conv1_backward_with_a_raw_input_is_at_least_1_5x_faster():
    """ResNet-50's conv1 (7x7, stride 2, 3 -> 64 channels) on one 224x224 image: without gx the
    backward is about 2x faster here. Median of 9 interleaved runs, up to 3 attempts."""
    r = numpy.random.RandomState(0)
    x = r.randn(1, 224, 224, 3).astype(numpy.float32)
    W = (r.randn(64, 7, 7, 3) * 0.1).astype(numpy.float32)

    def backward_time(need_x):
        xv = chainer.Variable(x, requires_grad=need_x)
        y = TF.convolution_2d(xv, chainer.Variable(W), stride=2, pad=3)
        y.grad = numpy.ones_like(y.array)
        t = time.perf_counter()
        y.backward()
        return time.perf_counter() - t

    ratios = []
    for _ in range(3):
        times = {True: [], False: []}
        for _ in range(9):
            for need_x in (True, False):
                times[need_x].append(backward_time(need_x))
        ratios.append(numpy.median(times[True]) / numpy.median(times[False]))
        if ratios[-1] >= 1.5:
            return
    pytest.fail('backward with gx / without gx: {}'.format(ratios))


# ---- on a GPU ------------------------------------------------------------------------------------

GPU_CASES = [  # (n, h, w, cin, cout, k, pad, stride, dilation, groups)
    (2, 9, 7, 8, 16, 3, 1, 1, 1, 1),
    (3, 15, 15, 16, 32, 1, 0, 2, 1, 1),
    (2, 10, 11, 8, 8, 3, 2, 1, 2, 1),          # dilated
    (2, 9, 9, 16, 32, 3, 1, 2, 1, 4),          # grouped
    (1, 12, 12, 8, 16, 3, 2, 1, 2, 2),         # grouped and dilated
    (2, 32, 32, 4, 64, 7, 3, 2, 1, 1),         # conv1-like
]
GPU_TOL = {numpy.float16: dict(atol=3e-2, rtol=2e-2), numpy.float32: dict(atol=1e-4, rtol=1e-4)}


def gpu_problem(case, dtype, seed=0):
    import cupy
    n, h, w, cin, cout, k, pad, stride, dilation, groups = case
    r = numpy.random.RandomState(seed)
    x = r.randn(n, h, w, cin).astype(dtype)
    W = (r.randn(cout, k, k, cin // groups) * 0.2).astype(dtype)
    g = conv.geometry(pad, stride, dilation, groups)
    oh = (h + 2 * pad - dilation * (k - 1) - 1) // stride + 1
    ow = (w + 2 * pad - dilation * (k - 1) - 1) // stride + 1
    gy = r.randn(n, oh, ow, cout).astype(dtype)
    return cupy.asarray(x), cupy.asarray(W), cupy.asarray(gy), g


def driver_results(x, W, gy, g):
    import cupy
    s = conv.chainer_settings()
    y, gx, gW = cupy.empty_like(gy), cupy.empty_like(x), cupy.empty_like(W)
    conv.forward(x, W, y, g, s)
    conv.backward_data(W, gy, gx, g, s)
    conv.backward_filter(x, gy, gW, g, s)
    return y, gx, gW


def assert_all_close(ours, theirs, dtype):
    import cupy
    for a, b in zip(ours, theirs):
        numpy.testing.assert_allclose(cupy.asnumpy(a).astype('f8'), cupy.asnumpy(b).astype('f8'),
                                      **GPU_TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize('case', GPU_CASES)
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float16])
def test_driver_equals_chainer_nchw(cudnn_stack, case, dtype):
    """Against Chainer's NCHW convolution on the same GPU (cuDNN through CuPy 13, im2col and
    cuBLAS where CuPy has no cuDNN)."""
    x, W, gy, g = gpu_problem(case, dtype)
    ours = driver_results(x, W, gy, g)
    xv, Wv = chainer.Variable(x.transpose(0, 3, 1, 2).copy()), chainer.Variable(
        W.transpose(0, 3, 1, 2).copy())
    cy = F.convolution_2d(xv, Wv, stride=g.stride, pad=g.pad, dilate=g.dilation,
                          groups=g.groups)
    cy.grad = gy.transpose(0, 3, 1, 2).copy()
    cy.backward()
    assert_all_close(ours, [a.transpose(0, 2, 3, 1) for a in (cy.array, xv.grad, Wv.grad)],
                     dtype)


@pytest.mark.gpu
@pytest.mark.parametrize('case', GPU_CASES)
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float16])
def test_driver_equals_cupyx_cudnn(cudnn_stack, cupy_cudnn, case, dtype):
    import cupy
    import cupyx.cudnn
    x, W, gy, g = gpu_problem(case, dtype)
    ours = driver_results(x, W, gy, g)
    nhwc_layout = dict(d_layout=api.CUDNN_TENSOR_NHWC, w_layout=api.CUDNN_TENSOR_NHWC,
                       auto_tune=False, tensor_core='auto')
    ry, rgx, rgW = cupy.empty_like(gy), cupy.empty_like(x), cupy.empty_like(W)
    args = (g.pad, g.stride, g.dilation, g.groups)
    cupyx.cudnn.convolution_forward(x, W, None, ry, *args, **nhwc_layout)
    cupyx.cudnn.convolution_backward_data(W, gy, None, rgx, *args, deterministic=False,
                                          **nhwc_layout)
    cupyx.cudnn.convolution_backward_filter(x, gy, rgW, *args, deterministic=False,
                                            **nhwc_layout)
    assert_all_close(ours, (ry, rgx, rgW), dtype)


@pytest.mark.gpu
def test_gpu_counters_stay_zero_after_warm_up(cudnn_stack):
    import cupy
    x, W, gy, g = gpu_problem(GPU_CASES[0], numpy.float16)
    xv, Wv = chainer.Variable(x), chainer.Variable(W)
    for i in range(2):
        if i == 1:
            chainer_tc.cuda.reset_counters()
        y = TF.convolution_2d(xv, Wv, pad=g.pad, stride=g.stride)
        y.grad = gy
        y.backward()
    cupy.cuda.get_current_stream().synchronize()
    assert chainer_tc.cuda.counters() == dict(descriptors=0, algorithm_queries=0,
                                              workspace_queries=0, cudnn_calls=6,
                                              cublas_calls=0)


@pytest.mark.gpu
def test_gpu_raw_input_gets_no_gx_and_no_backward_data_call(cudnn_stack, monkeypatch):
    x, W, gy, g = gpu_problem(GPU_CASES[5], numpy.float16)
    names = []
    b = cudnn.binding()
    for name in ('convolution_backward_data', 'convolution_backward_filter'):
        real = getattr(b, name)
        monkeypatch.setattr(b, name, lambda *a, _r=real, _n=name: (names.append(_n), _r(*a))[1])
    Wv = chainer.Variable(W)
    y = TF.convolution_2d(x, Wv, stride=g.stride, pad=g.pad)
    y.grad = gy
    y.backward()
    assert names == ['convolution_backward_filter'] and Wv.grad is not None


@pytest.mark.gpu
def test_conv_and_fused_bn_are_captured_and_the_graph_reproduces_the_eager_step(cudnn_stack):
    import cupy
    r = numpy.random.RandomState(0)
    c = 64
    x = cupy.asarray(r.randn(4, 14, 14, c).astype(numpy.float16))
    W = cupy.asarray((r.randn(c, 3, 3, c) * 0.05).astype(numpy.float16))
    gamma = cupy.asarray((r.rand(c) + 0.5).astype(numpy.float32))
    beta = cupy.asarray(r.randn(c).astype(numpy.float32))
    z = cupy.asarray(r.randn(4, 14, 14, c).astype(numpy.float16))
    gy = cupy.asarray(r.randn(4, 14, 14, c).astype(numpy.float16))

    def step():
        xv, Wv, gv, bv, zv = (chainer.Variable(a) for a in (x, W, gamma, beta, z))
        h = TF.convolution_2d(xv, Wv, pad=1)
        y = TF.batch_normalization_add_relu(h, zv, gv, bv)
        assert y.creator.cudnn_reason is None, 'the fused cuDNN path'
        y.grad = gy
        y.backward()
        return [y.array, xv.grad, Wv.grad, gv.grad, bv.grad, zv.grad]

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        step()                                               # warm-up: plans, kernels
        eager = [a.copy() for a in step()]
        stream.synchronize()
        chainer_tc.cuda.reset_counters()
        stream.begin_capture()
        try:
            captured = step()
        finally:
            graph = stream.end_capture()
        counts = chainer_tc.cuda.counters()
        assert (counts['descriptors'], counts['algorithm_queries'],
                counts['workspace_queries']) == (0, 0, 0)
        assert counts['cudnn_calls'] == 2 * 5, 'conv fwd, bn fwd, bn bwd, conv bwd data+filter'
        for a in captured:
            a.fill(0)
        graph.launch()
        stream.synchronize()
    for a, e in zip(captured, eager):
        numpy.testing.assert_allclose(cupy.asnumpy(a).astype('f8'), cupy.asnumpy(e).astype('f8'),
                                      atol=2e-2, rtol=1e-2)


@pytest.mark.gpu
def test_capture_of_a_new_shape_is_refused_with_advice():
    import cupy
    x, W, gy, g = gpu_problem((1, 23, 23, 8, 8, 3, 1, 1, 1, 1), numpy.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            with pytest.raises(RuntimeError, match='before begin_capture'):
                TF.convolution_2d(x, W, pad=1)
        finally:
            stream.end_capture()
