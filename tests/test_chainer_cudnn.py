"""Chainer's own cuDNN calls routed through chainer_tc's binding inside a TrainStep
(chainer_tc.static_graph._chainer_cudnn).

Without a GPU: the routing (per thread, restored, CuPy's code for what is not routed) and, for each
of CuPy 13.6's thirteen wrappers that Chainer's training functions call, what the routed one passes to
cuDNN, with the real library's descriptors read back by cuDNN's getters and a fake handle and
computations (tests/cudnn_fakes.py). cupyx/cudnn.pyx 13.6 is the reference for every argument.
With a GPU (marker gpu): each routed wrapper against Chainer's own non-cuDNN code, under CUDA graph
capture too, and a net of Chainer's stock links captured whole by TrainStep.
"""
import contextlib
import ctypes
import threading
import types
import warnings

import numpy
import pytest

import chainer
import chainer.functions as F

from chainer_tc.cuda import _cudnn_api as api
from chainer_tc.cuda import conv
from chainer_tc.cuda import cudnn
from chainer_tc.cuda import descriptors
from chainer_tc.cuda import runtime
from chainer_tc.static_graph import _chainer_cudnn as cc

from cudnn_fakes import HANDLE, STREAM, FakeArray, lib_calls, needs_cudnn, read_tensor
from cudnn_fakes import _getter

NCHW, NHWC = api.CUDNN_TENSOR_NCHW, api.CUDNN_TENSOR_NHWC


class Array(FakeArray):
    """A fake CuPy array that also casts (a new address) and takes in-place copies."""

    _next = [0x40000000]

    def __init__(self, shape, dtype, ptr=None, contiguous=True):
        if ptr is None:
            ptr = Array._next[0]
            Array._next[0] += 0x100000
        super().__init__(shape, dtype, ptr, contiguous=contiguous)
        self.ndim, self.size = len(self.shape), int(numpy.prod(self.shape, dtype=numpy.int64))
        self.copied_from = None

    def astype(self, dtype):
        return Array(self.shape, dtype)

    def __setitem__(self, key, value):
        assert key is Ellipsis
        self.copied_from = value


def original_module():
    """A stand-in for ``chainer.backends.cuda.cudnn``: CuPy's routed wrappers, recording calls."""
    module = types.ModuleType('fake_cupy_cudnn')
    module.calls = []
    for name in cc.ROUTED:
        def make(name):
            def original(*args, **kwargs):
                module.calls.append(name)
                return 'cupy'
            return original
        setattr(module, name, make(name))
    return module


@pytest.fixture
def routed(fake, monkeypatch):
    """(fake state, the stand-in module) with the routing active on this thread."""
    monkeypatch.setattr(runtime, 'empty', lambda shape, dtype: Array(shape, dtype))
    module = original_module()
    cc._bn_plans.clear()
    with cc.routed(module) as on:
        assert on
        yield fake, module
    cc._bn_plans.clear()


def read_pooling(desc):
    return _getter('cudnnGetPooling2dDescriptor', 8)(desc)


def scalar(dtype, address):
    c = ctypes.c_double if numpy.dtype(dtype) == numpy.float64 else ctypes.c_float
    return c.from_address(address).value


# ---- the routing ---------------------------------------------------------------------------------

@needs_cudnn
def test_routing_is_per_thread_nests_and_is_undone():
    module = original_module()
    originals = {n: getattr(module, n) for n in cc.ROUTED}
    seen = []
    with cc.routed(module):
        with cc.routed(module):
            assert all(getattr(module, n) is not originals[n] for n in cc.ROUTED)
        assert all(getattr(module, n) is not originals[n] for n in cc.ROUTED), 'still routed'
        assert cc._active()
        # another thread calls CuPy's own wrapper meanwhile
        t = threading.Thread(target=lambda: seen.append(module.softmax_forward(None, 1, 1)))
        t.start()
        t.join()
    assert seen == ['cupy'] and module.calls == ['softmax_forward']
    assert all(getattr(module, n) is originals[n] for n in cc.ROUTED) and not cc._active()


@needs_cudnn
def test_overlapping_threads_exceptions_and_foreign_patches_leave_the_module_right():
    module = original_module()
    originals = {n: getattr(module, n) for n in cc.ROUTED}
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = []

    def thread_b():
        with cc.routed(module):
            b_in.set()
            a_out.wait()
            seen.append((cc._active(), module.pooling_forward is not originals['pooling_forward']))
    with pytest.raises(ZeroDivisionError):
        with cc.routed(module):
            t = threading.Thread(target=thread_b)
            t.start()
            b_in.wait()
            a_in.set()
            raise ZeroDivisionError          # A leaves (by an exception) while B is routed
    a_out.set()
    t.join()
    assert seen == [(True, True)], 'B still routed after A left'
    assert all(getattr(module, n) is originals[n] for n in cc.ROUTED)
    # someone patches over our dispatcher inside a routed block and restores it after: the next
    # routing must not take our dispatcher for CuPy's function (no endless recursion)
    with cc.routed(module):
        ours = module.pooling_forward
        module.pooling_forward = lambda *a: 'patched'
    assert module.pooling_forward() == 'patched', 'a patch made over ours stays'
    module.pooling_forward = ours
    with cc.routed(module):
        x3 = Array((2, 4, 6, 5, 5), numpy.float32)       # 3-D: CuPy's own
        assert module.pooling_forward(x3, x3, (2, 2, 2), (2, 2, 2), (0, 0, 0), 0) == 'cupy'
    assert module.pooling_forward is originals['pooling_forward']
    with cc.routed(module):
        with pytest.raises(RuntimeError, match='one cuDNN wrapper module at a time'):
            with cc.routed(original_module()):
                pass


def test_nothing_is_routed_where_chainer_uses_no_cudnn_or_the_binding_does_not_load(monkeypatch):
    from chainer.backends import cuda
    monkeypatch.setattr(cuda, 'cudnn_enabled', False)
    assert cc.chainers_module() is None and cc.problem() is None
    with cc.routed() as on:
        assert on is False
    module = original_module()
    monkeypatch.setattr(cudnn, '_binding', None)
    monkeypatch.setattr(cudnn, '_unavailable', 'no usable cuDNN: test')
    with cc.routed(module) as on:
        assert on is False and module.softmax_forward is not None
        assert module.softmax_forward(None, 1, 1) == 'cupy'
    monkeypatch.setattr(cuda, 'cudnn_enabled', True)
    monkeypatch.setattr(cuda, 'cudnn', module, raising=False)
    assert cc.problem() == 'no usable cuDNN: test'


def test_a_capture_failing_in_cudnn_says_why_chainers_calls_were_not_routed(monkeypatch):
    from chainer_tc.static_graph import _capture
    monkeypatch.setattr(cc, 'problem', lambda: 'no usable cuDNN: test')
    note = _capture._cudnn_note(NotImplementedError(
        'calling cuDNN API during stream capture is currently unsupported'))
    assert note == (" (Chainer's cuDNN calls could not go through chainer_tc's binding: no usable "
                    "cuDNN: test)")
    assert _capture._cudnn_note(RuntimeError('cuBLAS refused')) == ''
    monkeypatch.setattr(cc, 'problem', lambda: None)
    assert _capture._cudnn_note(NotImplementedError('cuDNN ...')) == ''


def test_a_trainstep_routes_its_capturable_gpu_steps_only(monkeypatch):
    from chainer_tc import optimizers
    from chainer_tc.static_graph import TrainStep
    from chainer_tc.static_graph import step as step_module
    import chainer.links as L
    model = L.Linear(3, 2)
    opt = optimizers.MomentumSGD().setup(model)
    x = numpy.zeros((2, 3), numpy.float32)
    routings = []
    monkeypatch.setattr(cc, 'routed', lambda: routings.append(1) or cc.contextlib.nullcontext())
    TrainStep(model, opt)._chainer_cudnn_routed((x,))
    assert routings == [], 'NumPy: nothing to route'
    monkeypatch.setattr(step_module, '_is_cupy', lambda arrays: True)
    TrainStep(model, opt, capture=False)._chainer_cudnn_routed((x,))
    assert routings == [], 'no capture: CuPy runs as in eager Chainer'
    TrainStep(model, opt)._chainer_cudnn_routed((x,))
    assert routings == [1]


# ---- convolutions --------------------------------------------------------------------------------

def conv_problem(dtype=numpy.float32, layout='NCHW'):
    n, c, h, w, k, kh = 2, 4, 6, 5, 8, 3
    if layout == 'NCHW':
        return (Array((n, c, h, w), dtype), Array((k, c, kh, kh), dtype),
                Array((n, k, h, w), dtype))
    return (Array((n, h, w, c), dtype), Array((k, kh, kh, c), dtype), Array((n, h, w, k), dtype))


@needs_cudnn
@pytest.mark.parametrize('dtype', [numpy.float16, numpy.float32, numpy.float64])
def test_convolution_forward_passes_nchw_descriptors_as_cupy(routed, dtype):
    fake, module = routed
    x, W, y = conv_problem(dtype)
    module.convolution_forward(x, W, None, y, (1, 1), (1, 1), (1, 1), 1, auto_tune=False,
                               tensor_core='auto', d_layout=NCHW, w_layout=NCHW)
    (n1, a1), (n2, a2) = lib_calls(fake)
    assert (n1, a1, n2) == ('cudnnSetStream', (HANDLE, STREAM), 'cudnnConvolutionForward')
    handle, alpha, x_desc, xp, w_desc, wp, _, _, _, _, beta, y_desc, yp = a2
    assert (xp, wp, yp) == (x.data.ptr, W.data.ptr, y.data.ptr)
    t = api.CUDNN_DATA_HALF if dtype == numpy.float16 else (
        api.CUDNN_DATA_FLOAT if dtype == numpy.float32 else api.CUDNN_DATA_DOUBLE)
    assert read_tensor(x_desc) == (t, 2, 4, 6, 5, 4 * 6 * 5, 6 * 5, 5, 1), 'packed NCHW'
    assert read_tensor(y_desc) == (t, 2, 8, 6, 5, 8 * 6 * 5, 6 * 5, 5, 1)
    assert _getter('cudnnGetFilter4dDescriptor', 6)(w_desc) == (t, NCHW, 8, 4, 3, 3)
    assert scalar(dtype, alpha) == 1.0 and scalar(dtype, beta) == 0.0
    assert module.calls == []


@needs_cudnn
@pytest.mark.parametrize('layout', [NCHW, NHWC])
def test_convolution_geometry_reaches_the_descriptor(routed, layout):
    from cudnn_fakes import read_conv
    fake, module = routed
    name = 'NCHW' if layout == NCHW else 'NHWC'
    n, c, h, w, k = 2, 4, 11, 9, 6
    x = Array((n, c, h, w) if name == 'NCHW' else (n, h, w, c), numpy.float32)
    W = Array((k, c // 2, 3, 3) if name == 'NCHW' else (k, 3, 3, c // 2), numpy.float32)
    oh, ow = (11 + 2 * 2 - 3 * 2 - 1) // 3 + 1, (9 + 2 * 1 - 1 * 2 - 1) // 2 + 1
    y = Array((n, k, oh, ow) if name == 'NCHW' else (n, oh, ow, k), numpy.float32)
    module.convolution_forward(x, W, None, y, (2, 1), (3, 2), (3, 1), 2, auto_tune=False,
                               tensor_core='auto', d_layout=layout, w_layout=layout)
    a = [a for n_, a in lib_calls(fake) if n_ == 'cudnnConvolutionForward'][0]
    assert read_conv(a[6])[:2] == ((2, 1, 3, 2, 3, 1, api.CUDNN_CROSS_CORRELATION,
                                    api.CUDNN_DATA_FLOAT), 2), 'pad, stride, dilation; groups'
    assert read_tensor(a[2])[1:5] == (n, c, h, w) and read_tensor(a[11])[1:5] == (n, k, oh, ow)
    strides = read_tensor(a[2])[5:]
    assert strides == ((c * h * w, h * w, w, 1) if name == 'NCHW' else (h * w * c, 1, w * c, c))


@needs_cudnn
def test_non_contiguous_inputs_are_copied_and_outputs_go_to_cupy(monkeypatch, routed):
    fake, module = routed
    copies = []

    class Xp:
        @staticmethod
        def ascontiguousarray(a):
            copies.append(a)
            return Array(a.shape, a.dtype)
    monkeypatch.setattr(cc, '_xp', lambda a: Xp)
    x, W, y = conv_problem()
    x_view = Array(x.shape, x.dtype, contiguous=False)
    module.convolution_forward(x_view, W, None, y, (1, 1), (1, 1), (1, 1), 1, auto_tune=False,
                               tensor_core='auto', d_layout=NCHW, w_layout=NCHW)
    a = [a for n, a in lib_calls(fake) if n == 'cudnnConvolutionForward'][0]
    assert copies == [x_view] and a[3] != x_view.data.ptr
    y_view = Array(y.shape, y.dtype, contiguous=False)
    assert module.convolution_forward(x, W, None, y_view, (1, 1), (1, 1), (1, 1), 1,
                                      auto_tune=False, tensor_core='auto', d_layout=NCHW,
                                      w_layout=NCHW) == 'cupy'
    g = Array((4,), numpy.float32)
    assert module.batch_normalization_forward_training_ex(
        x, g, g, g, g, g, None, 2e-5, 0.9, True, api.CUDNN_BATCHNORM_SPATIAL, False,
        NCHW) == 'cupy', 'mean without inv_std: CuPy says why'
    assert module.calls == ['convolution_forward', 'batch_normalization_forward_training_ex']


@needs_cudnn
def test_convolution_bias_is_added_over_the_channel_axis(monkeypatch, routed):
    _, module = routed
    monkeypatch.setattr(conv, 'forward', lambda x, W, y, g, s, layout: None)
    monkeypatch.setattr(conv, 'backward_data', lambda W, x, y, g, s, layout: None)
    b = numpy.arange(3, dtype=numpy.float32)
    for layout, shape, axis in ((NCHW, (2, 3, 4, 5), 1), (NHWC, (2, 4, 5, 3), 3)):
        for call in ('forward', 'backward_data'):
            y = numpy.ones(shape, numpy.float32)
            x, W = numpy.zeros(shape, numpy.float32), numpy.zeros((3, 3, 1, 1), numpy.float32)
            if call == 'forward':
                module.convolution_forward(x, W, b, y, (0, 0), (1, 1), (1, 1), 1,
                                           auto_tune=False, tensor_core='auto',
                                           d_layout=layout, w_layout=layout)
            else:
                module.convolution_backward_data(W, x, b, y, (0, 0), (1, 1), (1, 1), 1,
                                                 deterministic=False, auto_tune=False,
                                                 tensor_core='auto', d_layout=layout,
                                                 w_layout=layout)
            expected = 1 + b.reshape([-1 if i == axis else 1 for i in range(4)])
            numpy.testing.assert_array_equal(y, numpy.broadcast_to(expected, shape))
    assert module.calls == []


@needs_cudnn
def test_backward_calls_take_cupys_operand_order_and_tensor_core_rules(routed):
    fake, module = routed
    x, W, y = conv_problem(numpy.float16)
    gx = Array(x.shape, x.dtype)
    # CuPy's convolution_backward_data(W, x, b, y): x is the output gradient, y the result
    module.convolution_backward_data(W, y, None, gx, (1, 1), (1, 1), (1, 1), 1,
                                     deterministic=False, auto_tune=False, tensor_core='auto',
                                     d_layout=NCHW, w_layout=NCHW)
    gW = Array(W.shape, W.dtype)
    module.convolution_backward_filter(x, y, gW, (1, 1), (1, 1), (1, 1), 1, deterministic=True,
                                       auto_tune=False, tensor_core='auto', d_layout=NCHW,
                                       w_layout=NCHW)
    calls = [(n, a) for n, a in lib_calls(fake) if n != 'cudnnSetStream']
    (n1, a1), (n2, a2) = calls
    assert n1 == 'cudnnConvolutionBackwardData' and (a1[3], a1[5], a1[12]) == (
        W.data.ptr, y.data.ptr, gx.data.ptr)
    assert n2 == 'cudnnConvolutionBackwardFilter' and (a2[3], a2[5], a2[12]) == (
        x.data.ptr, y.data.ptr, gW.data.ptr)
    keys = {k[0]: k for k in conv._plans}
    # key: (direction, device, x, W, y, dtype, layout, geometry, tensor ops, deterministic, ...)
    assert keys['backward_data'][6] == 'NCHW' and keys['backward_data'][8] is True
    assert keys['backward_filter'][8] is False and keys['backward_filter'][9] is True, \
        'deterministic: no Tensor Core math (CuPy)'
    module.convolution_forward(x, W, None, y, (2, 2), (1, 1), (2, 2), 1, auto_tune=False,
                               tensor_core='auto', d_layout=NCHW, w_layout=NCHW)
    dilated = [k for k in conv._plans if k[0] == 'forward'][0]
    assert dilated[8] is False, 'dilated: no Tensor Core math (CuPy)'


@needs_cudnn
def test_what_the_routed_wrappers_do_not_take_goes_to_cupys_code(routed):
    fake, module = routed
    x, W, y = conv_problem()
    assert module.convolution_forward(x, W, None, y, (1, 1), (1, 1), (1, 1), 1, auto_tune=False,
                                      tensor_core='auto', d_layout=NHWC,
                                      w_layout=NCHW) == 'cupy'
    x3 = Array((2, 4, 6, 5, 5), numpy.float32)
    assert module.pooling_forward(x3, Array((2, 4, 3, 2, 2), numpy.float32), (2, 2, 2),
                                  (2, 2, 2), (0, 0, 0), 0) == 'cupy'
    g = Array((4,), numpy.float32)
    assert module.batch_normalization_forward_training_ex(
        x, g, g, g, g, None, None, 2e-5, 0.9, True, api.CUDNN_BATCHNORM_SPATIAL, True,
        NCHW) == 'cupy', 'debug mode'
    assert module.calls == ['convolution_forward', 'pooling_forward',
                            'batch_normalization_forward_training_ex']
    assert lib_calls(fake) == []


# ---- batch normalization -------------------------------------------------------------------------

@needs_cudnn
@pytest.mark.parametrize('param_dtype', [numpy.float16, numpy.float32])
def test_bn_forward_passes_what_cupy_passes(routed, param_dtype):
    fake, module = routed
    x = Array((4, 8, 3, 3), numpy.float16)
    gamma, beta, mean, var = (Array((8,), param_dtype) for _ in range(4))
    reserve, y, save_mean, save_inv_std = module.batch_normalization_forward_training_ex(
        x, gamma, beta, mean, var, None, None, 1e-5, 0.9, True, api.CUDNN_BATCHNORM_SPATIAL,
        False, NCHW)
    (n1, _), (n2, a) = lib_calls(fake)
    assert (n1, n2) == ('cudnnSetStream', 'cudnnBatchNormalizationForwardTrainingEx')
    (handle, mode, ops, alpha, beta_, x_desc, xp, z_desc, zp, y_desc, yp, bn_desc, gp, bp, factor,
     rm, rv, eps, sm, si, act, ws, ws_size, rs, rs_size) = a
    assert (handle, mode, ops) == (HANDLE, api.CUDNN_BATCHNORM_SPATIAL, api.CUDNN_BATCHNORM_OPS_BN)
    assert (xp, zp, yp, act, ws, ws_size, rs, rs_size) == (x.data.ptr, 0, y.data.ptr, 0,
                                                            0, 0, 0, 0)
    assert x_desc == z_desc == y_desc and factor == pytest.approx(0.1) and eps == 1e-5
    assert read_tensor(x_desc)[:5] == (api.CUDNN_DATA_HALF, 4, 8, 3, 3)
    assert read_tensor(bn_desc)[:5] == (api.CUDNN_DATA_FLOAT, 1, 8, 1, 1), 'derived: float'
    assert scalar(numpy.float32, alpha) == 1.0 and scalar(numpy.float32, beta_) == 0.0
    assert (sm, si) == (save_mean.data.ptr, save_inv_std.data.ptr) and reserve is None
    assert save_mean.dtype == numpy.float32 and y.shape == x.shape
    if param_dtype == numpy.float16:      # cast to float for cuDNN, running stats copied back
        assert gp != gamma.data.ptr and rm != mean.data.ptr
        assert mean.copied_from.data.ptr == rm and var.copied_from.data.ptr == rv
    else:
        assert (gp, bp, rm, rv) == (gamma.data.ptr, beta.data.ptr, mean.data.ptr, var.data.ptr)
        assert mean.copied_from is None
    assert reserve is None and fake.allocs == []


@needs_cudnn
def test_bn_forward_casts_each_vector_on_its_own(routed):
    """F.batch_normalization without running statistics: Chainer makes float16 dummies (x's
    dtype) next to float32 gamma. CuPy 13.6 casts only when gamma's dtype differs, so cuDNN
    would write float32 statistics into 16-byte-per-8 buffers; ours casts each vector whose
    dtype is not cuDNN's and writes the statistics back."""
    fake, module = routed
    x = Array((4, 8, 3, 3), numpy.float16)
    gamma, beta = Array((8,), numpy.float32), Array((8,), numpy.float32)
    mean, var = Array((8,), numpy.float16), Array((8,), numpy.float16)
    module.batch_normalization_forward_training_ex(
        x, gamma, beta, mean, var, None, None, 1e-5, 0.9, True, api.CUDNN_BATCHNORM_SPATIAL,
        False, NCHW)
    a = [a for n, a in lib_calls(fake) if n == 'cudnnBatchNormalizationForwardTrainingEx'][0]
    gp, bp, rm, rv = a[12], a[13], a[15], a[16]
    assert (gp, bp) == (gamma.data.ptr, beta.data.ptr), 'float32 already: passed as they are'
    assert rm != mean.data.ptr and rv != var.data.ptr, 'float16 statistics: float32 copies'
    assert mean.copied_from.data.ptr == rm and var.copied_from.data.ptr == rv, 'written back'


@needs_cudnn
def test_bn_fast_nhwc_mode_gets_cudnns_workspace_and_reserve_and_backward_reads_it(routed):
    fake, module = routed
    fake.sizes = {'cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize': 512,
                  'cudnnGetBatchNormalizationTrainingExReserveSpaceSize': 2048,
                  'cudnnGetBatchNormalizationBackwardExWorkspaceSize': 4096}
    x = Array((4, 3, 3, 8), numpy.float16)
    gamma, beta, mean, var = (Array((8,), numpy.float32) for _ in range(4))
    mode = api.CUDNN_BATCHNORM_SPATIAL_PERSISTENT
    reserve, y, m, s = module.batch_normalization_forward_training_ex(
        x, gamma, beta, mean, var, None, None, 1e-5, 0.9, True, mode, False, NHWC)
    assert reserve is not None and [q[0] for q in fake.queries] == [
        'cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize',
        'cudnnGetBatchNormalizationTrainingExReserveSpaceSize',
        'cudnnGetBatchNormalizationBackwardExWorkspaceSize']
    gy = Array(x.shape, x.dtype)
    gx, ggamma, gbeta = module.batch_normalization_backward(
        x, gamma, gy, m, s, 1e-5, True, mode, False, NHWC, reserve_space=reserve)
    calls = [a for n, a in lib_calls(fake) if n.startswith('cudnnBatch')]
    fwd, bwd = calls
    assert (fwd[22], fwd[23], fwd[24]) == (512, reserve.ptr, 2048) and fwd[21] != 0
    (handle, mode_, ops, a1, b1, a2, b2, x_desc, xp, y_desc, yp, dy_desc, dyp, dz_desc, dzp,
     dx_desc, dxp, bn_desc, gp, bp, dgp, dbp, eps, sm, si, act, ws, ws_size, rs, rs_size) = bwd
    assert (mode_, ops, xp, yp, dyp, dzp, dxp) == (mode, api.CUDNN_BATCHNORM_OPS_BN, x.data.ptr,
                                                   0, gy.data.ptr, 0, gx.data.ptr)
    assert x_desc == y_desc == dy_desc == dz_desc == dx_desc
    assert read_tensor(x_desc)[:5] == (api.CUDNN_DATA_HALF, 4, 8, 3, 3)
    assert read_tensor(x_desc)[5:] == (72, 1, 24, 8), 'NHWC strides'
    assert (gp, bp, dgp, dbp, sm, si, act) == (gamma.data.ptr, 0, ggamma.data.ptr,
                                               gbeta.data.ptr, m.data.ptr, s.data.ptr, 0)
    assert (rs, rs_size, ws_size) == (reserve.ptr, 2048, 4096) and ws != 0
    # a second call of the same problem sets up nothing
    n = len(fake.queries)
    module.batch_normalization_forward_training_ex(
        x, gamma, beta, mean, var, None, None, 1e-5, 0.9, True, mode, False, NHWC)
    assert len(fake.queries) == n


@needs_cudnn
@pytest.mark.parametrize('param_dtype', [numpy.float16, numpy.float32])
def test_fixed_bn_passes_what_cupy_passes(routed, param_dtype):
    """F.fixed_batch_normalization (a frozen BatchNorm in a training step): one
    cudnnBatchNormalizationForwardInference with the data's descriptor and cuDNN's derived one,
    float16 vectors cast to float, and nothing set up that a capture would refuse."""
    fake, module = routed
    x = Array((4, 3, 3, 8), numpy.float16)
    gamma, beta, mean, var = (Array((8,), param_dtype) for _ in range(4))
    y = module.batch_normalization_forward_inference(
        x, gamma, beta, mean, var, 2e-5, True, api.CUDNN_BATCHNORM_SPATIAL, NHWC)
    (n1, _), (n2, a) = lib_calls(fake)
    assert (n1, n2) == ('cudnnSetStream', 'cudnnBatchNormalizationForwardInference')
    handle, mode, alpha, beta_, x_desc, xp, y_desc, yp, bn_desc, gp, bp, mp, vp, eps = a
    assert (handle, mode, xp, yp, eps) == (HANDLE, api.CUDNN_BATCHNORM_SPATIAL, x.data.ptr,
                                           y.data.ptr, 2e-5)
    assert x_desc == y_desc and read_tensor(x_desc)[:5] == (api.CUDNN_DATA_HALF, 4, 8, 3, 3)
    assert read_tensor(x_desc)[5:] == (72, 1, 24, 8), 'NHWC strides'
    assert read_tensor(bn_desc)[:5] == (api.CUDNN_DATA_FLOAT, 1, 8, 1, 1), 'derived: float'
    assert scalar(numpy.float32, alpha) == 1.0 and scalar(numpy.float32, beta_) == 0.0
    given = tuple(v.data.ptr for v in (gamma, beta, mean, var))
    if param_dtype == numpy.float16:
        assert not set((gp, bp, mp, vp)) & set(given), 'cast to float, each'
    else:
        assert (gp, bp, mp, vp) == given
    assert y.shape == x.shape and y.dtype == numpy.float16 and fake.queries == []
    # 2-D data: (rows, C, 1, 1) with the per-activation mode
    x2 = Array((6, 10), numpy.float32)
    v = [Array((10,), numpy.float32) for _ in range(4)]
    module.batch_normalization_forward_inference(x2, *v, 2e-5, False,
                                                 api.CUDNN_BATCHNORM_PER_ACTIVATION, NCHW)
    a = [a for n, a in lib_calls(fake) if n == 'cudnnBatchNormalizationForwardInference'][1]
    assert a[1] == api.CUDNN_BATCHNORM_PER_ACTIVATION
    assert read_tensor(a[4])[:5] == (api.CUDNN_DATA_FLOAT, 6, 10, 1, 1)
    assert module.calls == []


@needs_cudnn
def test_group_norms_older_bn_entry_point_returns_what_cupys_does(routed):
    """F.group_normalization calls CuPy's batch_normalization_forward_training (no _ex): the
    same cuDNN call, (y, mean, inv_std) without the reserve space; (y) given mean and
    inv_std, as CuPy's."""
    fake, module = routed
    x = Array((1, 12, 20, 1), numpy.float32)       # (1, N * groups, rest, 1), as Chainer's
    g = [Array((12,), numpy.float32) for _ in range(4)]
    y, mean, inv_std = module.batch_normalization_forward_training(
        x, *g, None, None, 1e-5, 1.0, True, api.CUDNN_BATCHNORM_SPATIAL, False)
    a = [a for n, a in lib_calls(fake) if n == 'cudnnBatchNormalizationForwardTrainingEx'][0]
    assert (a[10], a[18], a[19]) == (y.data.ptr, mean.data.ptr, inv_std.data.ptr)
    assert read_tensor(a[5])[:5] == (api.CUDNN_DATA_FLOAT, 1, 12, 20, 1) and a[14] == 0.0
    m, s = Array((12,), numpy.float32), Array((12,), numpy.float32)
    y2 = module.batch_normalization_forward_training(
        x, *g, m, s, 1e-5, 1.0, True, api.CUDNN_BATCHNORM_SPATIAL, False)
    assert y2.shape == x.shape and module.calls == []
    # what the routed call does not take (debug mode) goes to CuPy's own
    assert module.batch_normalization_forward_training(
        x, *g, None, None, 1e-5, 1.0, True, api.CUDNN_BATCHNORM_SPATIAL, True) == 'cupy'
    assert module.calls == ['batch_normalization_forward_training']


@needs_cudnn
def test_bn_of_2d_data_is_described_rows_by_channels(routed):
    fake, module = routed
    x = Array((6, 10), numpy.float32)
    g = [Array((10,), numpy.float32) for _ in range(4)]
    mean, inv_std = Array((10,), numpy.float32), Array((10,), numpy.float32)
    out = module.batch_normalization_forward_training_ex(
        x, *g, mean, inv_std, 2e-5, 0.9, False, api.CUDNN_BATCHNORM_PER_ACTIVATION, False, NCHW)
    assert len(out) == 2, 'given mean and inv_std: (reserve, y), as CuPy'
    a = [a for n, a in lib_calls(fake) if n.startswith('cudnnBatch')][0]
    assert read_tensor(a[5])[:5] == (api.CUDNN_DATA_FLOAT, 6, 10, 1, 1)
    assert read_tensor(a[11])[:5] == (api.CUDNN_DATA_FLOAT, 1, 10, 1, 1)
    assert (a[18], a[19]) == (mean.data.ptr, inv_std.data.ptr)


@needs_cudnn
def test_bn_set_up_is_refused_under_capture_a_warm_call_is_not(routed):
    fake, module = routed
    x = Array((4, 8, 3, 3), numpy.float32)
    g = [Array((8,), numpy.float32) for _ in range(4)]
    args = (None, None, 1e-5, 0.9, True, api.CUDNN_BATCHNORM_SPATIAL, False, NCHW)
    fake.capturing = True
    with pytest.raises(RuntimeError, match='not set up yet.*capturing'):
        module.batch_normalization_forward_training_ex(x, *g, *args)
    fake.capturing = False
    module.batch_normalization_forward_training_ex(x, *g, *args)
    fake.capturing = True
    module.batch_normalization_forward_training_ex(x, *g, *args)


@needs_cudnn
@pytest.mark.parametrize('gamma_dtype', [numpy.float16, numpy.float64])
def test_bn_backward_casts_parameters_and_their_gradients_as_cupy(routed, gamma_dtype):
    fake, module = routed
    x, gy = Array((2, 4, 3, 3), numpy.float16), Array((2, 4, 3, 3), numpy.float16)
    gamma = Array((4,), gamma_dtype)
    m, s = Array((4,), numpy.float32), Array((4,), numpy.float32)
    gx, ggamma, gbeta = module.batch_normalization_backward(
        x, gamma, gy, m, s, 2e-5, True, api.CUDNN_BATCHNORM_SPATIAL, False, NCHW)
    a = [a for n, a in lib_calls(fake) if n.startswith('cudnnBatch')][0]
    assert a[18] != gamma.data.ptr, 'gamma cast to float'
    # CuPy casts them back to the data's dtype (Chainer then to gamma's)
    assert ggamma.dtype == gbeta.dtype == numpy.float16 and gx.dtype == numpy.float16
    assert (a[28], a[29]) == (0, 0), 'no reserve space'


# ---- softmax and pooling -------------------------------------------------------------------------

@needs_cudnn
@pytest.mark.parametrize('shape,axis,dims,mode', [
    ((4, 10), 1, (4, 10, 1, 1), api.CUDNN_SOFTMAX_MODE_CHANNEL),
    ((4, 10), -1, (4, 10, 1, 1), api.CUDNN_SOFTMAX_MODE_CHANNEL),
    ((2, 5, 3, 4), 1, (2, 5, 12, 1), api.CUDNN_SOFTMAX_MODE_CHANNEL),
    ((2, 5, 3), 2, (10, 3, 1, 1), api.CUDNN_SOFTMAX_MODE_CHANNEL),
    ((2, 5, 3), 0, (1, 2, 15, 1), api.CUDNN_SOFTMAX_MODE_CHANNEL),
    ((4, 1), 1, (4, 1, 1, 1), api.CUDNN_SOFTMAX_MODE_INSTANCE),
    ((3, 1, 1), 1, (3, 1, 1, 1), api.CUDNN_SOFTMAX_MODE_INSTANCE),
])
def test_softmax_describes_its_axis_as_cupy(routed, shape, axis, dims, mode):
    fake, module = routed
    x = Array(shape, numpy.float16)
    y = module.softmax_forward(x, axis, 2)          # CUDNN_SOFTMAX_LOG, as F.log_softmax
    gx = module.softmax_backward(y, Array(shape, numpy.float16), axis, 2)
    (_, f), (_, b) = [(n, a) for n, a in lib_calls(fake) if n.startswith('cudnnSoftmax')]
    handle, algo, mode_, alpha, x_desc, xp, beta, y_desc, yp = f
    assert (handle, algo, mode_, xp, yp) == (HANDLE, 2, mode, x.data.ptr, y.data.ptr)
    assert x_desc == y_desc and read_tensor(x_desc)[1:5] == dims
    assert scalar(numpy.float32, alpha) == 1.0 and scalar(numpy.float32, beta) == 0.0
    assert b[2] == mode and b[5] == y.data.ptr and b[10] == gx.data.ptr and gx.shape == shape
    assert b[4] == b[6] == b[9] == x_desc


def read_activation(desc):
    """(mode, NaN propagation, coef) of an activation descriptor (cuDNN's own getter)."""
    fn = cudnn.binding().lib.real.cudnnGetActivationDescriptor
    fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int),
                   ctypes.POINTER(ctypes.c_double)]
    fn.restype = ctypes.c_int
    mode, nan, coef = ctypes.c_int(), ctypes.c_int(), ctypes.c_double()
    assert fn(desc, mode, nan, coef) == 0
    return mode.value, nan.value, coef.value


@needs_cudnn
@pytest.mark.parametrize('shape,dims', [((2, 3, 4, 5), (2, 60, 1, 1)), ((7,), (7, 1, 1, 1)),
                                        ((3, 5), (3, 5, 1, 1)), ((), (1, 1, 1, 1))])
@pytest.mark.parametrize('dtype', [numpy.float16, numpy.float64])
def test_relu_passes_what_cupy_passes(routed, shape, dims, dtype):
    """F.relu on a GPU calls cuDNN's activation under the default use_cudnn='auto' (for
    C-contiguous input): cudnnActivationForward over the array as (shape[0], rest, 1, 1) NCHW,
    ReLU without NaN propagation, coef 0; its gradient (ReLUGradCudnn) passes y as x too.
    Found by reading Chainer's relu.py: CuPy refuses the call under capture, so every step
    with an F.relu ran eagerly where Chainer uses cuDNN."""
    fake, module = routed
    x = Array(shape, dtype)
    y = module.activation_forward(x, api.CUDNN_ACTIVATION_RELU)
    gy = Array(shape, dtype)
    gx = module.activation_backward(y, y, gy, api.CUDNN_ACTIVATION_RELU)
    (_, f), (_, b) = [(n, a) for n, a in lib_calls(fake) if n.startswith('cudnnActivation')]
    handle, act, alpha, x_desc, xp, beta, y_desc, yp = f
    assert (handle, xp, yp) == (HANDLE, x.data.ptr, y.data.ptr) and y.shape == shape
    assert read_activation(act) == (api.CUDNN_ACTIVATION_RELU, api.CUDNN_NOT_PROPAGATE_NAN, 0.0)
    assert x_desc == y_desc and read_tensor(x_desc)[:5] == (
        descriptors.data_type(dtype),) + dims
    c = numpy.float64 if dtype == numpy.float64 else numpy.float32
    assert scalar(c, alpha) == 1.0 and scalar(c, beta) == 0.0
    # cudnnActivationBackward(handle, act, alpha, yDesc, y, dyDesc, dy, xDesc, x, beta, dxDesc,
    # dx)
    assert b[1] == act and b[3] == b[5] == b[7] == b[10] == x_desc
    assert (b[4], b[6], b[8], b[11]) == (y.data.ptr, gy.data.ptr, y.data.ptr, gx.data.ptr)
    assert gx.shape == shape and gx.dtype == numpy.dtype(dtype)
    assert [n for n, _ in lib_calls(fake) if n == 'cudnnSetStream'], 'on the current stream'


@needs_cudnn
def test_activation_modes_coefficients_and_strided_or_empty_input(monkeypatch, routed):
    """A clipped ReLU (use_cudnn='always'): its ceiling in the descriptor, in the backward
    rounded to float32 as CuPy's signature takes it; strided input is copied first; an empty
    array goes to CuPy's code (whose descriptor would divide by its zero first dimension)."""
    fake, module = routed

    class Xp:
        @staticmethod
        def ascontiguousarray(a):
            return Array(a.shape, a.dtype)
    monkeypatch.setattr(cc, '_xp', lambda a: Xp)
    clipped = 2
    x = Array((4, 6), numpy.float32, contiguous=False)
    y = module.activation_forward(x, clipped, 0.1)
    module.activation_backward(y, y, Array((4, 6), numpy.float32), clipped, 0.1)
    (_, f), (_, b) = [(n, a) for n, a in lib_calls(fake) if n.startswith('cudnnActivation')]
    assert read_activation(f[1]) == (clipped, api.CUDNN_NOT_PROPAGATE_NAN, 0.1)
    assert read_activation(b[1]) == (clipped, api.CUDNN_NOT_PROPAGATE_NAN,
                                     float(numpy.float32(0.1)))
    assert f[4] != x.data.ptr, 'a contiguous copy is passed'
    empty = Array((0, 3), numpy.float32)
    assert module.activation_forward(empty, 1) == 'cupy'
    assert module.activation_backward(empty, empty, empty, 1) == 'cupy'
    assert module.calls == ['activation_forward', 'activation_backward']


@needs_cudnn
@pytest.mark.parametrize('mode', [api.CUDNN_POOLING_MAX, 1])   # max, average (with padding)
def test_pooling_passes_its_window_and_operands_as_cupy(routed, mode):
    fake, module = routed
    x = Array((2, 3, 7, 6), numpy.float32)
    y = Array((2, 3, 4, 3), numpy.float32)
    assert module.pooling_forward(x, y, (3, 2), (2, 2), (1, 0), mode) is y
    gy = Array(y.shape, y.dtype)
    gx = module.pooling_backward(x, y, gy, (3, 2), (2, 2), (1, 0), mode)
    (_, f), (_, b) = [(n, a) for n, a in lib_calls(fake) if n.startswith('cudnnPooling')]
    handle, pool, alpha, x_desc, xp, beta, y_desc, yp = f
    assert (handle, xp, yp) == (HANDLE, x.data.ptr, y.data.ptr)
    assert read_pooling(pool) == (mode, api.CUDNN_NOT_PROPAGATE_NAN, 3, 2, 1, 0, 2, 2)
    assert read_tensor(x_desc)[1:5] == (2, 3, 7, 6) and read_tensor(y_desc)[1:5] == (2, 3, 4, 3)
    # cudnnPoolingBackward(handle, pool, alpha, yDesc, y, dyDesc, dy, xDesc, x, beta, dxDesc, dx)
    assert b[1] == pool and (b[3], b[4], b[5], b[6]) == (y_desc, y.data.ptr, y_desc, gy.data.ptr)
    assert (b[7], b[8], b[10], b[11]) == (x_desc, x.data.ptr, x_desc, gx.data.ptr)
    assert gx.shape == x.shape


# ---- GPU -----------------------------------------------------------------------------------------

def _gpu_cases(dtype):
    r = numpy.random.RandomState(0)
    x = r.randn(2, 4, 7, 6).astype(dtype)
    W = (r.randn(8, 4, 3, 3) * 0.3).astype(dtype)
    b = r.randn(8).astype(dtype)
    return x, W, b


def _tol(dtype):
    return dict(rtol=1e-4, atol=1e-4) if dtype == numpy.float32 else dict(rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float16])
def test_routed_wrappers_equal_chainers_own_gpu_code(cudnn_stack, dtype):
    """Each routed wrapper against Chainer's non-cuDNN code (use_cudnn='never') on the GPU."""
    import cupy
    x, W, b = (cupy.asarray(a) for a in _gpu_cases(dtype))
    tol = _tol(dtype)
    with chainer.using_config('use_cudnn', 'never'):
        xv, Wv, bv = (chainer.Variable(a) for a in (x, W, b))
        y = F.convolution_2d(xv, Wv, bv, pad=1)
        gy = cupy.asarray(numpy.random.RandomState(1).randn(*y.shape).astype(dtype))
        y.grad = gy
        y.backward()
    ours = cupy.empty(y.shape, dtype)
    cc.convolution_forward(x, W, b, ours, (1, 1), (1, 1), (1, 1), 1, auto_tune=False,
                           tensor_core='auto')
    cupy.testing.assert_allclose(ours, y.array, **tol)
    gx = cupy.empty(x.shape, dtype)
    cc.convolution_backward_data(W, gy, None, gx, (1, 1), (1, 1), (1, 1), 1, deterministic=False,
                                 auto_tune=False, tensor_core='auto')
    cupy.testing.assert_allclose(gx, xv.grad, **tol)
    gW = cupy.empty(W.shape, dtype)
    cc.convolution_backward_filter(x, gy, gW, (1, 1), (1, 1), (1, 1), 1, deterministic=False,
                                   auto_tune=False, tensor_core='auto')
    cupy.testing.assert_allclose(gW, Wv.grad, **tol)

    # batch normalization (training) and its gradients, running statistics included
    gamma = cupy.asarray(numpy.random.RandomState(2).rand(4).astype(numpy.float32) + 0.5)
    beta = cupy.asarray(numpy.random.RandomState(3).randn(4).astype(numpy.float32))
    rm, rv = cupy.zeros(4, numpy.float32), cupy.ones(4, numpy.float32)
    rm2, rv2 = rm.copy(), rv.copy()
    with chainer.using_config('use_cudnn', 'never'):
        xv = chainer.Variable(x.astype(numpy.float32))
        gv, bv2 = chainer.Variable(gamma), chainer.Variable(beta)
        yb = F.batch_normalization(xv, gv, bv2, eps=2e-5, running_mean=rm, running_var=rv,
                                   decay=0.9)
        gyb = cupy.asarray(numpy.random.RandomState(4).randn(*x.shape).astype(numpy.float32))
        yb.grad = gyb
        yb.backward()
    reserve, y2, m, s = cc.batch_normalization_forward_training_ex(
        x, gamma, beta, rm2, rv2, None, None, 2e-5, 0.9, True, api.CUDNN_BATCHNORM_SPATIAL, False)
    cupy.testing.assert_allclose(y2, yb.array, **tol)
    cupy.testing.assert_allclose(rm2, rm, **tol)
    cupy.testing.assert_allclose(rv2, rv, **tol)
    g2, gg, gb = cc.batch_normalization_backward(x, gamma, gyb.astype(dtype), m, s, 2e-5, True,
                                                 api.CUDNN_BATCHNORM_SPATIAL, False,
                                                 reserve_space=reserve)
    cupy.testing.assert_allclose(g2, xv.grad, **tol)
    cupy.testing.assert_allclose(gg, gv.grad, **tol)
    cupy.testing.assert_allclose(gb, bv2.grad, **tol)

    # fixed batch normalization (a frozen BatchNorm), with the running statistics just taken
    with chainer.using_config('use_cudnn', 'never'):
        yf = F.fixed_batch_normalization(x.astype(numpy.float32), gamma, beta, rm, rv, 2e-5)
    y6 = cc.batch_normalization_forward_inference(x.astype(numpy.float32), gamma, beta, rm, rv,
                                                  2e-5, True, api.CUDNN_BATCHNORM_SPATIAL)
    cupy.testing.assert_allclose(y6, yf.array, **tol)

    # group normalization: Chainer's cuDNN path routed (it calls the older BN entry point),
    # against its own code without cuDNN, forward and backward
    outs = []
    for use, routing in (('never', False), ('auto', True)):
        with chainer.using_config('use_cudnn', use), \
                (cc.routed() if routing else contextlib.nullcontext()):
            xv = chainer.Variable(x.astype(numpy.float32))
            yg = F.group_normalization(xv, 2, gamma, beta)
            yg.grad = gyb
            yg.backward()
        outs.append((yg.array, xv.grad))
    for a, b in zip(*outs):
        cupy.testing.assert_allclose(a, b, **tol)

    # log-softmax over the classes, and pooling
    z = cupy.asarray(numpy.random.RandomState(5).randn(6, 10).astype(dtype))
    with chainer.using_config('use_cudnn', 'never'):
        zv = chainer.Variable(z)
        ls = F.log_softmax(zv)
        gz = cupy.ones_like(z)
        ls.grad = gz
        ls.backward()
    y3 = cc.softmax_forward(z, 1, 2)
    cupy.testing.assert_allclose(y3, ls.array, **tol)
    cupy.testing.assert_allclose(cc.softmax_backward(y3, gz, 1, 2), zv.grad, **tol)
    for pool, mode in ((F.max_pooling_2d, 0), (F.average_pooling_2d, 1)):
        with chainer.using_config('use_cudnn', 'never'):
            xv = chainer.Variable(x)
            yp = pool(xv, 3, 2, 1)
            gyp = cupy.ones_like(yp.array)
            yp.grad = gyp
            yp.backward()
        y4 = cupy.empty(yp.shape, dtype)
        cc.pooling_forward(x, y4, (3, 3), (2, 2), (1, 1), mode)
        cupy.testing.assert_allclose(y4, yp.array, **tol)
        cupy.testing.assert_allclose(cc.pooling_backward(x, y4, gyp, (3, 3), (2, 2), (1, 1),
                                                         mode), xv.grad, **tol)

    # ReLU (exact: a maximum, and a mask)
    with chainer.using_config('use_cudnn', 'never'):
        xv = chainer.Variable(x)
        yr = F.relu(xv)
        yr.grad = gyp = cupy.asarray(numpy.random.RandomState(6).randn(*x.shape).astype(dtype))
        yr.backward()
    y5 = cc.activation_forward(x, api.CUDNN_ACTIVATION_RELU)
    cupy.testing.assert_array_equal(y5, yr.array)
    cupy.testing.assert_array_equal(cc.activation_backward(y5, y5, gyp,
                                                           api.CUDNN_ACTIVATION_RELU), xv.grad)


@pytest.mark.gpu
def test_routed_wrappers_run_inside_a_cuda_graph(cudnn_stack):
    """The same calls captured into a CUDA graph (after one eager call set them up) and replayed
    on new data: the results of eager calls on that data."""
    import cupy
    x, W, b = (cupy.asarray(a) for a in _gpu_cases(numpy.float32))
    gamma, beta = cupy.ones(4, numpy.float32), cupy.zeros(4, numpy.float32)

    def step(x):
        y = cupy.empty((2, 8, 7, 6), numpy.float32)
        cc.convolution_forward(x, W, b, y, (1, 1), (1, 1), (1, 1), 1, auto_tune=False,
                               tensor_core='auto')
        _, h, _, _ = cc.batch_normalization_forward_training_ex(
            x, gamma, beta, cupy.zeros(4, numpy.float32), cupy.ones(4, numpy.float32), None,
            None, 2e-5, 0.9, True, api.CUDNN_BATCHNORM_SPATIAL, False)
        p = cupy.empty((2, 4, 4, 3), numpy.float32)
        cc.pooling_forward(h, p, (3, 3), (2, 2), (1, 1), 0)
        r = cc.activation_forward(p, api.CUDNN_ACTIVATION_RELU)
        return y, cc.softmax_forward(r.reshape(2, -1), 1, 2)

    expected_first = step(x)
    stream = cupy.cuda.Stream(non_blocking=True)
    pool = cupy.cuda.MemoryPool()
    buf = x.copy()
    with stream, cupy.cuda.using_allocator(pool.malloc):
        stream.begin_capture()
        outs = step(buf)
        graph = stream.end_capture()
    x2 = x * 0.5 + 1
    buf[...] = x2
    graph.launch(stream)
    stream.synchronize()
    for a, e in zip(outs, step(x2)):
        cupy.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-6)
    assert not cupy.allclose(outs[0], expected_first[0])


def _stock_twins(dtype):
    from chainer_tc import optimizers
    from test_static_graph import StockNet
    models = [StockNet(dtype) for _ in range(2)]
    opts = []
    for m in models:
        m.to_device('@cupy:0')
        opts.append(optimizers.MomentumSGD(lr=0.05, weight_decay=1e-3).setup(m))
    return models, opts


@pytest.mark.gpu
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float16])
def test_a_stock_link_net_is_captured_whole_where_chainer_uses_cudnn(cupy_cudnn, dtype):
    """L.Convolution2D, L.BatchNormalization, F.max_pooling_2d and softmax_cross_entropy (cuDNN
    through CuPy in eager Chainer) inside one CUDA graph, equal to eager Chainer's steps."""
    import cupy
    from test_static_graph import batches, run_eager, run_step
    data = [(cupy.asarray(x.astype(dtype)), cupy.asarray(t)) for x, t in batches(8)]
    (m1, m2), (o1, o2) = _stock_twins(dtype)
    l1 = run_eager(m1, o1, data)
    with warnings.catch_warnings():
        warnings.simplefilter('error', RuntimeWarning)      # no "runs eagerly"
        l2, step = run_step(m2, o2, data)
    assert step.traces == 1 and step.replays == 6
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == numpy.float32 else dict(rtol=3e-2, atol=3e-3)
    for a, b in zip(l1, l2):
        cupy.testing.assert_allclose(a, b, **tol)
    for (n, p), (_, q) in zip(sorted(m1.namedparams()), sorted(m2.namedparams())):
        cupy.testing.assert_allclose(p.array, q.array, err_msg=n, **tol)
    cupy.testing.assert_allclose(m1.bn.avg_mean, m2.bn.avg_mean, **tol)
    cupy.testing.assert_allclose(m1.bn.avg_var, m2.bn.avg_var, **tol)
