"""chainer_tc.cuda: the ctypes cuDNN binding, the convolution driver, the fused-BN plans, counters.

Without a GPU: the prototypes against cuDNN 8.9's own headers, the real libcudnn.so.8 loaded and
its error statuses (a null handle is refused before any GPU work), descriptors built through
CuPy's bindings and read back with cuDNN's getters (host-only calls), and the driver run against a
fake library and a fake runtime to check what it passes, what it caches and what it counts.
The CPU path of the convolution gradient skips gx when it is not needed. GPU-marked tests compare
against cupyx.cudnn and Chainer and capture the layers into a CUDA graph.
"""
import ctypes
import os
import re
import time
import types
import warnings

import numpy
import pytest

import chainer_tc
import chainer
import chainer.functions as F

from chainer_tc import _cuda_libs
from chainer_tc import functions as TF
from chainer_tc.cuda import conv
from chainer_tc.cuda import cudnn
from chainer_tc.cuda import descriptors
from chainer_tc.cuda import runtime
from chainer_tc.functions import _bn_cudnn
from chainer_tc.functions import _conv_numpy


def nchw(a):
    return numpy.ascontiguousarray(a.transpose(0, 3, 1, 2))


def nhwc(a):
    return numpy.ascontiguousarray(a.transpose(0, 2, 3, 1))


def _cudnn_lib_dir():
    return _cuda_libs.find_lib_dirs(_cuda_libs.default_search_paths()).get('cudnn')


needs_cudnn = pytest.mark.skipif(
    _cuda_libs.find_library('cudnn') is None,
    reason='libcudnn.so.8 is not installed (pip install nvidia-cudnn-cu12==8.9.7.29)')


# ---- the prototypes against the C declarations ---------------------------------------------------

KINDS = {ctypes.c_void_p: 'pointer', ctypes.c_int: 'int', ctypes.c_size_t: 'size_t',
         ctypes.c_double: 'double'}
# what each C parameter type is passed as (cuDNN 8.9: handles/descriptors are pointers to
# opaque structs, every enum is an int)
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


def c_declaration(name):
    """(return type, [(C type, parameter name), ...]) of ``name`` in cuDNN's v8 headers."""
    include = os.path.join(os.path.dirname(_cudnn_lib_dir()), 'include')
    for fname in sorted(os.listdir(include)):
        if not fname.endswith('_v8.h'):
            continue
        with open(os.path.join(include, fname)) as f:
            text = re.sub(r'/\*.*?\*/|//[^\n]*', ' ', f.read(), flags=re.S)
        m = re.search(r'(const\s+char\s*\*|cudnnStatus_t)\s*CUDNNWINAPI\s+' + name +
                      r'\s*\(([^;]*?)\)\s*;', text)
        if m:
            params = []
            for p in m.group(2).split(','):
                c_type, pname = re.match(r'(.*?)(\w+)\s*$', p.strip()).groups()
                params.append((c_type.strip(), pname))
            return ' '.join(m.group(1).split()), params
    raise AssertionError('{} not declared in {}'.format(name, include))


# Counted by hand from cuDNN 8.9's documentation, in case the headers are not installed.
ARITY = {'cudnnSetStream': 2, 'cudnnConvolutionForward': 13, 'cudnnConvolutionBackwardData': 13,
         'cudnnConvolutionBackwardFilter': 13, 'cudnnBatchNormalizationForwardTrainingEx': 25,
         'cudnnBatchNormalizationBackwardEx': 30}


def test_bound_exactly_the_calls_we_make():
    assert set(cudnn.PROTOTYPES) == set(ARITY)
    for name, params in cudnn.PROTOTYPES.items():
        assert len(params) == ARITY[name], name
        assert all(t in KINDS for _, t in params), name


@needs_cudnn
@pytest.mark.parametrize('name', sorted(ARITY))
def test_prototype_matches_the_c_header(name):
    restype, c_params = c_declaration(name)
    assert restype == 'cudnnStatus_t'
    ours = cudnn.PROTOTYPES[name]
    assert [p for _, p in c_params] == [p for p, _ in ours], 'parameter names, in order'
    assert [c_kind(t) for t, _ in c_params] == [KINDS[t] for _, t in ours]


@needs_cudnn
def test_error_string_prototype_matches_the_c_header():
    restype, params = c_declaration(cudnn.ERROR_STRING)
    assert restype.replace(' ', '') == 'constchar*' and [t for t, _ in params] == ['cudnnStatus_t']


@needs_cudnn
def test_binding_loads_the_wheels_library_and_sets_the_prototypes():
    assert cudnn.library_path() == os.path.join(_cudnn_lib_dir(), 'libcudnn.so.8')
    b = cudnn.binding()
    assert b is cudnn.binding()
    for name, params in cudnn.PROTOTYPES.items():
        fn = b._fn[name]
        assert list(fn.argtypes) == [t for _, t in params] and fn.restype is ctypes.c_int
    assert b.error_string(3) == 'CUDNN_STATUS_BAD_PARAM'


@needs_cudnn
@pytest.mark.parametrize('name', sorted(ARITY))
def test_errors_name_the_call_and_cudnns_message(name):
    """A null handle: the real library refuses it with CUDNN_STATUS_BAD_PARAM, no GPU touched."""
    args = [0.0 if t is ctypes.c_double else 0 for _, t in cudnn.PROTOTYPES[name]]
    with pytest.raises(cudnn.CuDNNError) as e:
        cudnn.binding()._call(name, *args)
    assert str(e.value) == '{} failed: CUDNN_STATUS_BAD_PARAM (cudnnStatus_t 3)'.format(name)
    assert e.value.call == name and e.value.status == 3


def test_scaling_factors_are_float_for_half_and_float_double_for_double():
    for dtype, ctype in ((numpy.float16, ctypes.c_float), (numpy.float32, ctypes.c_float),
                         (numpy.float64, ctypes.c_double)):
        one, zero = cudnn.scaling_factors(dtype)
        assert ctype.from_address(one).value == 1.0 and ctype.from_address(zero).value == 0.0
    assert cudnn.scaling_factors(numpy.float16) == cudnn.scaling_factors(numpy.float32)
    with pytest.raises(TypeError, match='float16, float32 and float64 data; got int32'):
        cudnn.scaling_factors(numpy.int32)


def test_missing_library_says_what_to_install(monkeypatch):
    monkeypatch.setattr(cudnn, '_binding', None)
    monkeypatch.setattr(cudnn, 'library_path', lambda: '/nonexistent/libcudnn.so.8')
    with pytest.raises(cudnn.CuDNNUnavailable, match='nvidia-cudnn-cu12'):
        cudnn.binding()


def test_a_cudnn_other_than_cupys_is_refused():
    """Seen on an H100 machine: the file search found a cuDNN 9 beside CuPy 14 (which has no
    cuDNN bindings); the binding loaded it. Our calls take CuPy's descriptors, so the library
    must be CuPy's own."""
    cudnn.check_same_as_cupys('/x/libcudnn.so.8', 8907, 8907)
    with pytest.raises(cudnn.CuDNNUnavailable, match=r'/x/libcudnn.so.9 is version 90100, but '
                       r'CuPy calls version 8907'):
        cudnn.check_same_as_cupys('/x/libcudnn.so.9', 90100, 8907)
    with pytest.raises(cudnn.CuDNNUnavailable, match="CuPy's cuDNN bindings are not usable "
                       r'\(ImportError: no cudnn\).*CuPy 13 with cuDNN 8.9'):
        cudnn.check_same_as_cupys('/x/libcudnn.so.9', 90100, 'ImportError: no cudnn')
    with pytest.raises(cudnn.CuDNNUnavailable, match=r'another copy than the libcudnn.so.8 '
                       r'CuPy loaded \(the same version 8907\)'):
        cudnn.check_same_as_cupys('/y/libcudnn.so.8', 8907, 8907, same_object=False)


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


# ---- a fake library and runtime ------------------------------------------------------------------

class FakeFunction:
    """Records calls after converting each argument the way ctypes would (wrong kinds raise)."""

    def __init__(self, name, log):
        self.name, self.log, self.argtypes, self.restype, self.status = name, log, None, None, 0

    def __call__(self, *args):
        if self.name == cudnn.ERROR_STRING:
            return b'CUDNN_STATUS_FAKE'
        assert len(args) == len(self.argtypes), self.name
        for t, a in zip(self.argtypes, args):
            t.from_param(a)
        self.log.append((self.name, args))
        return self.status


class FakeLib:
    def __init__(self):
        self.log = []

    def __getattr__(self, name):
        if not name.startswith('cudnn'):
            raise AttributeError(name)
        f = FakeFunction(name, self.log)
        setattr(self, name, f)
        return f


class FakeArray:
    """What the driver reads of a CuPy array."""

    def __init__(self, shape, dtype, ptr, device=0, contiguous=True):
        self.shape, self.dtype = tuple(shape), numpy.dtype(dtype)
        self.data = types.SimpleNamespace(ptr=ptr, device_id=device)
        self.flags = types.SimpleNamespace(c_contiguous=contiguous)


def perf(algo, memory=0, status=0, determinism=1, math_type=1):
    return types.SimpleNamespace(algo=algo, status=status, time=1.0, memory=memory,
                                 determinism=determinism, mathType=math_type)


HANDLE, STREAM = 0x4A00, 0x5700


@pytest.fixture
def fake(monkeypatch):
    """The driver with a fake cuDNN binding, fake handle/stream/allocator and fake algorithm
    queries; descriptors are real (CuPy's bindings, host-only)."""
    from cupy_backends.cuda.libs import cudnn as lib
    state = types.SimpleNamespace(lib=FakeLib(), allocs=[], capturing=False, queries=[],
                                  perfs=[perf(1, 1024)], sizes={})
    monkeypatch.setattr(cudnn, '_binding', cudnn.Binding(state.lib))
    monkeypatch.setattr(runtime, 'handle', lambda device: HANDLE + device)
    monkeypatch.setattr(runtime, 'stream_ptr', lambda: STREAM)
    monkeypatch.setattr(runtime, 'is_capturing', lambda: state.capturing)

    def alloc(nbytes):
        if not nbytes:
            return None
        state.allocs.append(nbytes)
        return types.SimpleNamespace(ptr=0x10000000 + nbytes)
    monkeypatch.setattr(runtime, 'alloc', alloc)
    counter = iter(range(0x20000000, 0x30000000, 0x100000))
    monkeypatch.setattr(runtime, 'empty',
                        lambda shape, dtype: FakeArray(shape, dtype, next(counter)))

    def query(name):
        def f(*args):
            state.queries.append((name, args))
            if 'WorkspaceSize' in name:
                return state.sizes.get(args[-1], 1024)
            return list(state.perfs)
        return f
    for d in (conv.FORWARD, conv.BACKWARD_DATA, conv.BACKWARD_FILTER):
        for name in (d.get, d.find, d.size):
            monkeypatch.setattr(lib, name, query(name))
    conv.clear_plans()
    descriptors.clear_cache()
    monkeypatch.setattr(conv, '_limit', None)
    chainer_tc.cuda.reset_counters()
    yield state
    conv.clear_plans()


def lib_calls(state):
    return [(name, args) for name, args in state.lib.log]


# cuDNN's getters, to read back what a descriptor holds (host-only calls, no GPU needed)
def _getter(name, n_out):
    fn = getattr(ctypes.CDLL(cudnn.library_path()), name)
    fn.argtypes = [ctypes.c_void_p] + [ctypes.POINTER(ctypes.c_int)] * n_out
    fn.restype = ctypes.c_int

    def read(desc):
        out = [ctypes.c_int() for _ in range(n_out)]
        assert fn(desc, *out) == 0, name
        return tuple(o.value for o in out)
    return read


def read_tensor(desc):
    return _getter('cudnnGetTensor4dDescriptor', 9)(desc)


def read_filter(desc):
    return _getter('cudnnGetFilter4dDescriptor', 6)(desc)


def read_conv(desc):
    return (_getter('cudnnGetConvolution2dDescriptor', 8)(desc),
            _getter('cudnnGetConvolutionGroupCount', 1)(desc)[0],
            _getter('cudnnGetConvolutionMathType', 1)(desc)[0])


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
    from cupy_backends.cuda.libs import cudnn as lib
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
    assert [n for n, _ in fake.queries] == ['getConvolutionForwardAlgorithm_v7',
                                            'getConvolutionForwardWorkspaceSize']
    assert fake.queries[0][1][0] == HANDLE and fake.queries[0][1][-1] == 8, 'all 8 fwd algos'
    del fake.queries[:], fake.lib.log[:], fake.allocs[:]
    conv.forward(x, W, y, g, conv.settings(auto_tune=True))
    (find, args), _ = fake.queries
    assert find == 'findConvolutionForwardAlgorithmEx_v7'
    limit = conv.get_workspace_limit()
    assert args[2] == 0x1000 and args[4] == 0x2000 and args[7] == 0x3000
    assert args[8:] == (8, 0x10000000 + limit, limit), 'count, workspace of the limit, limit'
    assert fake.allocs[0] == limit
    assert fake.lib.log[0] == ('cudnnSetStream', (HANDLE, STREAM)), 'Find runs on our stream'


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
    from cupy_backends.cuda.libs import cudnn as lib
    sizes = []
    for name in ('getBatchNormalizationForwardTrainingExWorkspaceSize',
                 'getBatchNormalizationTrainingExReserveSpaceSize',
                 'getBatchNormalizationBackwardExWorkspaceSize'):
        monkeypatch.setattr(lib, name, lambda *a, _n=name: (sizes.append((_n, a)), 256)[1])
    monkeypatch.setattr(_bn_cudnn, '_plans', {})
    x = FakeArray((4, 7, 7, 64), numpy.float16, 0x1000)
    first = _bn_cudnn.FusedBatchNorm(x, True, True)
    assert chainer_tc.cuda.counters()['descriptors'] == 3, 'x/y/z, derived BN, ReLU'
    assert chainer_tc.cuda.counters()['workspace_queries'] == 3
    p = first.plan
    assert p.ops == lib.CUDNN_BATCHNORM_OPS_BN_ADD_ACTIVATION and p.z_desc == p.desc
    assert (p.forward_workspace, p.reserve_size, p.backward_workspace) == (256, 256, 256)
    assert read_tensor(p.desc)[1:5] == (4, 64, 7, 7)
    assert sizes[0][1][0] == HANDLE
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
    from cupy_backends.cuda.libs import cudnn as lib
    for name, size in (('getBatchNormalizationForwardTrainingExWorkspaceSize', 512),
                       ('getBatchNormalizationTrainingExReserveSpaceSize', 128),
                       ('getBatchNormalizationBackwardExWorkspaceSize', 256)):
        monkeypatch.setattr(lib, name, lambda *a, _s=size: _s)
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
    from cupy_backends.cuda.libs import cudnn as lib
    for name in ('getBatchNormalizationForwardTrainingExWorkspaceSize',
                 'getBatchNormalizationTrainingExReserveSpaceSize',
                 'getBatchNormalizationBackwardExWorkspaceSize'):
        monkeypatch.setattr(lib, name, lambda *a: 0)
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


@pytest.mark.gpu
@pytest.mark.parametrize('case', GPU_CASES)
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float16])
def test_driver_equals_cupyx_cudnn_and_chainer_nchw(cudnn_stack, case, dtype):
    import cupy
    import cupyx.cudnn
    from cupy_backends.cuda.libs import cudnn as lib
    x, W, gy, g = gpu_problem(case, dtype)
    s = conv.chainer_settings()
    y, gx, gW = cupy.empty_like(gy), cupy.empty_like(x), cupy.empty_like(W)
    conv.forward(x, W, y, g, s)
    conv.backward_data(W, gy, gx, g, s)
    conv.backward_filter(x, gy, gW, g, s)
    nhwc_layout = dict(d_layout=lib.CUDNN_TENSOR_NHWC, w_layout=lib.CUDNN_TENSOR_NHWC,
                       auto_tune=False, tensor_core='auto')
    ry, rgx, rgW = cupy.empty_like(gy), cupy.empty_like(x), cupy.empty_like(W)
    args = (g.pad, g.stride, g.dilation, g.groups)
    cupyx.cudnn.convolution_forward(x, W, None, ry, *args, **nhwc_layout)
    cupyx.cudnn.convolution_backward_data(W, gy, None, rgx, *args, deterministic=False,
                                          **nhwc_layout)
    cupyx.cudnn.convolution_backward_filter(x, gy, rgW, *args, deterministic=False,
                                            **nhwc_layout)
    xv, Wv = chainer.Variable(x.transpose(0, 3, 1, 2).copy()), chainer.Variable(
        W.transpose(0, 3, 1, 2).copy())
    cy = F.convolution_2d(xv, Wv, stride=g.stride, pad=g.pad, dilate=g.dilation,
                          groups=g.groups)
    cy.grad = gy.transpose(0, 3, 1, 2).copy()
    cy.backward()
    chainer_nhwc = [a.transpose(0, 2, 3, 1) for a in (cy.array, xv.grad, Wv.grad)]
    for ours, theirs, ref in zip((y, gx, gW), (ry, rgx, rgW), chainer_nhwc):
        numpy.testing.assert_allclose(cupy.asnumpy(ours).astype('f8'),
                                      cupy.asnumpy(theirs).astype('f8'), **GPU_TOL[dtype])
        numpy.testing.assert_allclose(cupy.asnumpy(ours).astype('f8'),
                                      cupy.asnumpy(ref).astype('f8'), **GPU_TOL[dtype])


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
