"""Chainer's own cuDNN calls inside a TrainStep on a GPU, through chainer_tc's cuDNN binding.

Chainer's functions call cuDNN through CuPy's wrappers (``chainer.backends.cuda.cudnn``, the
``cupy.cudnn`` module of CuPy 13): ``L.Convolution2D`` and ``L.Deconvolution2D``,
``L.BatchNormalization``, ``F.fixed_batch_normalization`` and ``F.group_normalization``,
``F.max_pooling_2d`` / ``F.average_pooling_2d``, ``F.relu`` (cuDNN's
activation for C-contiguous input under the default ``use_cudnn='auto'``; ``F.sigmoid``,
``F.tanh`` and ``F.clipped_relu`` under ``'always'``), and ``F.softmax`` / ``F.log_softmax``
(so ``F.softmax_cross_entropy``, hence ``L.Classifier``'s default loss). CuPy
13.6 refuses every cuDNN call while a stream captures, so one such call made a whole step
uncapturable. While :func:`routed` is active on a thread, the wrappers below run what CuPy 13.6's
would (same descriptors, alpha and beta, cuDNN calls, outputs, casts of float16 batch-norm
parameters) through :mod:`chainer_tc.cuda` instead, which cuDNN lets a stream capture:

=========================================== ===============================================
CuPy wrapper (``cupyx/cudnn.pyx`` 13.6)       here
=========================================== ===============================================
``convolution_forward``                     ``chainer_tc.cuda.conv.forward`` (+ bias)
``convolution_backward_data``               ``chainer_tc.cuda.conv.backward_data`` (+ bias)
``convolution_backward_filter``             ``chainer_tc.cuda.conv.backward_filter``
``batch_normalization_forward_training_ex`` ``cudnnBatchNormalizationForwardTrainingEx`` (BN)
``batch_normalization_forward_training``    the same, without the reserve space (GroupNorm)
``batch_normalization_backward``            ``cudnnBatchNormalizationBackwardEx`` (BN)
``batch_normalization_forward_inference``   ``cudnnBatchNormalizationForwardInference`` (fixed)
``softmax_forward`` / ``softmax_backward``  ``cudnnSoftmaxForward`` / ``Backward``
``activation_forward`` / ``_backward``      ``cudnnActivationForward`` / ``Backward``
``pooling_forward`` / ``pooling_backward``  ``cudnnPoolingForward`` / ``Backward`` (2-D)
=========================================== ===============================================

The differences are chainer_tc's convolution plans: the algorithm is chosen by
:mod:`chainer_tc.cuda.conv` (results that failed skipped, its workspace limit, cached per
problem), so a routed convolution may run another algorithm than CuPy's would: equal within the
rounding of a differently ordered sum. Set-up (algorithm and workspace queries) happens outside
capture only: TrainStep routes its eager steps too, so every plan exists before the capture.
A call these wrappers do not take (N-d convolution or pooling, a filter layout other than the
data's, Chainer's debug mode, which synchronises to query cuDNN's runtime errors) runs CuPy's
own code, which fails under capture with CuPy's message: the step then runs eagerly, saying why.
Other threads, and every call outside :func:`routed`, run CuPy's code unchanged.
"""
import contextlib
import threading
import warnings

import numpy

from chainer_tc.cuda import _cudnn_api as api
from chainer_tc.cuda import conv
from chainer_tc.cuda import cudnn
from chainer_tc.cuda import descriptors
from chainer_tc.cuda import runtime

_state = threading.local()
_lock = threading.Lock()
_installed = [0, None]           # users, the patched module
_originals = {}                  # name -> CuPy's function (never one of our dispatchers)


def _active():
    return getattr(_state, 'active', False)


def _xp(a):
    import cupy
    return cupy.get_array_module(a)


def _contiguous(a):
    return a if a.flags.c_contiguous else _xp(a).ascontiguousarray(a)


def _as_param(a, dtype):
    """``a`` as cuDNN reads and writes a batch-norm parameter vector: contiguous, in ``dtype``
    (a copy where it is not; a caller writes running statistics back from the copy)."""
    return _contiguous(a) if a.dtype == dtype else a.astype(dtype)


def _layout(d_layout, w_layout=None):
    """'NCHW' or 'NHWC' from cudnnTensorFormat_t values (None where we do not take them)."""
    names = {api.CUDNN_TENSOR_NCHW: 'NCHW', api.CUDNN_TENSOR_NHWC: 'NHWC'}
    if w_layout is not None and w_layout != d_layout:
        return None
    return names.get(d_layout)


# ---- convolutions -------------------------------------------------------------------------------

def _conv_settings(auto_tune, tensor_core, dilation, deterministic=False, direction='forward'):
    """CuPy's rules: no Tensor Core math for dilated forward/backward-data convolutions (cuDNN 7
    had them only in an algorithm without dilation) nor for deterministic backward ones."""
    if tensor_core not in conv.TENSOR_CORE_MODES:
        return None
    dilated = any(d > 1 for d in dilation) and direction != 'backward_filter'
    if dilated or (deterministic and direction != 'forward'):
        tensor_core = 'never'
    return conv.settings(auto_tune, tensor_core, deterministic)


def _geometry(pad, stride, dilation, groups):
    return conv.geometry(pad, stride, (1, 1) if dilation is None else dilation, groups)


def _add_bias(y, b, layout):
    """y += b over the channel axis (CuPy: cudnnAddTensor with alpha = beta = 1)."""
    y += b.reshape((1, -1, 1, 1) if layout == 'NCHW' else (1, 1, 1, -1))


def _takes(layout, *arrays):
    return layout is not None and all(a.ndim == 4 for a in arrays)


def convolution_forward(x, W, b, y, pad, stride, dilation, groups, *, auto_tune, tensor_core,
                        d_layout=api.CUDNN_TENSOR_NCHW, w_layout=api.CUDNN_TENSOR_NCHW):
    layout = _layout(d_layout, w_layout)
    s = _conv_settings(auto_tune, tensor_core, dilation or (1, 1))
    if not _takes(layout, x, W, y) or s is None or not y.flags.c_contiguous:
        return _original('convolution_forward')(
            x, W, b, y, pad, stride, dilation, groups, auto_tune=auto_tune,
            tensor_core=tensor_core, d_layout=d_layout, w_layout=w_layout)
    conv.forward(_contiguous(x), _contiguous(W), y, _geometry(pad, stride, dilation, groups), s,
                 layout)
    if b is not None:
        _add_bias(y, b, layout)


def convolution_backward_data(W, x, b, y, pad, stride, dilation, groups, *, deterministic,
                              auto_tune, tensor_core, d_layout=api.CUDNN_TENSOR_NCHW,
                              w_layout=api.CUDNN_TENSOR_NCHW):
    """``y`` = the gradient of a convolution's input given its output gradient ``x`` (CuPy's
    names: Chainer's deconvolution, and the input gradient of its convolution)."""
    layout = _layout(d_layout, w_layout)
    s = _conv_settings(auto_tune, tensor_core, dilation or (1, 1), deterministic,
                       'backward_data')
    if not _takes(layout, W, x, y) or s is None or not y.flags.c_contiguous:
        return _original('convolution_backward_data')(
            W, x, b, y, pad, stride, dilation, groups, deterministic=deterministic,
            auto_tune=auto_tune, tensor_core=tensor_core, d_layout=d_layout, w_layout=w_layout)
    conv.backward_data(_contiguous(W), _contiguous(x), y,
                       _geometry(pad, stride, dilation, groups), s, layout)
    if b is not None:
        _add_bias(y, b, layout)


def convolution_backward_filter(x, gy, gW, pad, stride, dilation, groups, *, deterministic,
                                auto_tune, tensor_core, d_layout=api.CUDNN_TENSOR_NCHW,
                                w_layout=api.CUDNN_TENSOR_NCHW):
    layout = _layout(d_layout, w_layout)
    s = _conv_settings(auto_tune, tensor_core, dilation or (1, 1), deterministic,
                       'backward_filter')
    if not _takes(layout, x, gy, gW) or s is None or not gW.flags.c_contiguous:
        return _original('convolution_backward_filter')(
            x, gy, gW, pad, stride, dilation, groups, deterministic=deterministic,
            auto_tune=auto_tune, tensor_core=tensor_core, d_layout=d_layout, w_layout=w_layout)
    conv.backward_filter(_contiguous(x), _contiguous(gy), gW,
                         _geometry(pad, stride, dilation, groups), s, layout)


# ---- batch normalization ------------------------------------------------------------------------

def _bn_shape(x, is_for_conv2d, layout):
    """(shape, layout) of the 4-D descriptor CuPy describes ``x`` with: the array itself for
    convolution data, else (rows, channels, 1, 1) NCHW with the channels last in ``x``."""
    if is_for_conv2d:
        return x.shape, layout
    c = x.shape[-1] if x.ndim else 1
    return (x.size // c, c, 1, 1), 'NCHW'


def _param_dtype(dtype):
    """The dtype of cuDNN's derived scale/bias/statistics descriptor: float for half data."""
    return numpy.dtype(numpy.float32) if dtype == numpy.float16 else numpy.dtype(dtype)


class _BNPlan:
    """Descriptors and buffer sizes of one batch normalization problem, set up once (outside
    capture). The forward workspace and reserve space exist where CuPy allocates them: the
    persistent mode on NHWC float16 data with C % 4 == 0 (cuDNN's fast NHWC kernel)."""

    def __init__(self, device_id, shape, dtype, layout, mode):
        what = 'cuDNN batch normalization of x {} {} ({}, mode {})'.format(
            shape, numpy.dtype(dtype).name, layout, mode)
        runtime.refuse_capture(what)
        self.what, self.mode = what, mode
        self.device_id = device_id
        handle = runtime.handle(device_id)
        desc = descriptors.tensor_4d(shape, dtype, layout)
        bn_desc = descriptors.batch_norm(shape, dtype, layout, mode)
        self._keep = (desc, bn_desc)
        self.desc, self.bn_desc = desc.value, bn_desc.value
        self.one, self.zero = cudnn.scaling_factors(dtype)
        lib, ops = cudnn.binding(), api.CUDNN_BATCHNORM_OPS_BN
        fast = (mode == api.CUDNN_BATCHNORM_SPATIAL_PERSISTENT and layout == 'NHWC'
                and numpy.dtype(dtype) == numpy.float16 and shape[3] % 4 == 0)
        self.forward_workspace = self.reserve_size = 0
        if fast:
            self.forward_workspace = lib.size(
                'cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize', handle, mode,
                ops, self.desc, self.desc, self.desc, self.bn_desc, 0)
            self.reserve_size = lib.size(
                'cudnnGetBatchNormalizationTrainingExReserveSpaceSize', handle, mode, ops,
                0, self.desc)
        self.backward_workspace = lib.size(
            'cudnnGetBatchNormalizationBackwardExWorkspaceSize', handle, mode, ops,
            self.desc, self.desc, self.desc, self.desc, self.desc, self.bn_desc, 0)


_bn_plans = {}


def _bn_plan(x, is_for_conv2d, mode, d_layout):
    layout = _layout(d_layout)
    shape, layout = _bn_shape(x, is_for_conv2d, layout)
    key = (x.data.device_id, shape, x.dtype.char, layout, mode)
    plan = _bn_plans.get(key)
    if plan is None:
        plan = _bn_plans[key] = _BNPlan(x.data.device_id, shape, x.dtype, layout, mode)
    return plan


def _bn_takes(x, is_for_conv2d, debug, d_layout):
    """4-D convolution data in NCHW or NHWC, or other data described as (rows, C, 1, 1). Not in
    debug mode: CuPy then asks cuDNN for runtime errors, a blocking query (no capture)."""
    if debug or _layout(d_layout) is None:
        return False
    return x.ndim == 4 if is_for_conv2d else x.ndim >= 1


def _bn_forward_takes(x, mean, inv_std, is_for_conv2d, debug, d_layout):
    """What the routed training forward takes: :func:`_bn_takes`, and the batch statistics'
    outputs given both or neither (CuPy says why otherwise)."""
    return _bn_takes(x, is_for_conv2d, debug, d_layout) and (mean is None) == (inv_std is None)


def batch_normalization_forward_training_ex(x, gamma, beta, running_mean, running_var, mean,
                                            inv_std, eps, decay, is_for_conv2d, cudnn_mode,
                                            debug, d_layout=api.CUDNN_TENSOR_NCHW):
    if not _bn_forward_takes(x, mean, inv_std, is_for_conv2d, debug, d_layout):
        return _original('batch_normalization_forward_training_ex')(
            x, gamma, beta, running_mean, running_var, mean, inv_std, eps, decay,
            is_for_conv2d, cudnn_mode, debug, d_layout)
    x = _contiguous(x)
    p = _bn_plan(x, is_for_conv2d, cudnn_mode, d_layout)
    dtype = _param_dtype(x.dtype)
    # each vector in cuDNN's parameter dtype, contiguous, on its own: Chainer's dummy running
    # statistics are in x's dtype (float16) next to float32 gamma, and cuDNN would write float32
    # statistics into them (CuPy 13.6's wrapper looks at gamma's dtype only)
    gamma, beta, mean_tmp, var_tmp = (_as_param(a, dtype) for a in
                                      (gamma, beta, running_mean, running_var))
    y = runtime.empty(x.shape, x.dtype)
    if mean is None:
        save_mean, save_inv_std = runtime.empty(gamma.shape, dtype), runtime.empty(gamma.shape,
                                                                                   dtype)
    else:
        save_mean, save_inv_std = mean, inv_std
    workspace = runtime.alloc(p.forward_workspace)
    reserve = runtime.alloc(p.reserve_size)
    lib = cudnn.binding()
    handle = runtime.handle(p.device_id)
    lib.set_stream(handle, runtime.stream_ptr())
    try:
        lib.batch_normalization_forward_training_ex(
            handle, p.mode, api.CUDNN_BATCHNORM_OPS_BN, p.one, p.zero, p.desc, x.data.ptr,
            p.desc, 0, p.desc, y.data.ptr, p.bn_desc, gamma.data.ptr, beta.data.ptr,
            1.0 - decay, mean_tmp.data.ptr, var_tmp.data.ptr, eps, save_mean.data.ptr,
            save_inv_std.data.ptr, 0, runtime.address(workspace), p.forward_workspace,
            runtime.address(reserve), p.reserve_size)
    except cudnn.CuDNNError as e:
        raise e.add_context(p.what)
    if mean_tmp is not running_mean:
        running_mean[...] = mean_tmp
        running_var[...] = var_tmp
    if mean is None:
        return reserve, y, save_mean, save_inv_std
    return reserve, y


def batch_normalization_forward_training(x, gamma, beta, running_mean, running_var, mean,
                                         inv_std, eps, decay, is_for_conv2d, cudnn_mode, debug,
                                         d_layout=api.CUDNN_TENSOR_NCHW):
    """CuPy's older entry point (F.group_normalization calls it): the ``_ex`` call without the
    reserve space in what it returns, and CuPy's PerformanceWarning where there was one."""
    if not _bn_forward_takes(x, mean, inv_std, is_for_conv2d, debug, d_layout):
        return _original('batch_normalization_forward_training')(
            x, gamma, beta, running_mean, running_var, mean, inv_std, eps, decay,
            is_for_conv2d, cudnn_mode, debug, d_layout)
    out = batch_normalization_forward_training_ex(
        x, gamma, beta, running_mean, running_var, mean, inv_std, eps, decay, is_for_conv2d,
        cudnn_mode, debug, d_layout)
    if out[0] is not None:
        from cupy import _util
        warnings.warn('Could be faster by calling batch_normalization_forward_training_ex() '
                      'instead of batch_normalization_forward_training().',
                      _util.PerformanceWarning)
    return out[1:] if mean is None else out[1]


def batch_normalization_backward(x, gamma, gy, mean, inv_std, eps, is_for_conv2d, cudnn_mode,
                                 debug, d_layout=api.CUDNN_TENSOR_NCHW, *, reserve_space=None):
    if not _bn_takes(x, is_for_conv2d, debug, d_layout):
        return _original('batch_normalization_backward')(
            x, gamma, gy, mean, inv_std, eps, is_for_conv2d, cudnn_mode, debug, d_layout,
            reserve_space=reserve_space)
    x, gy = _contiguous(x), _contiguous(gy)
    p = _bn_plan(x, is_for_conv2d, cudnn_mode, d_layout)
    dtype = _param_dtype(x.dtype)
    cast = gamma.dtype != dtype
    gamma = gamma.astype(dtype) if cast else _contiguous(gamma)
    gx = runtime.empty(x.shape, x.dtype)
    ggamma, gbeta = runtime.empty(gamma.shape, dtype), runtime.empty(gamma.shape, dtype)
    workspace = runtime.alloc(p.backward_workspace)
    reserve_size = 0 if reserve_space is None else p.reserve_size
    lib = cudnn.binding()
    handle = runtime.handle(p.device_id)
    lib.set_stream(handle, runtime.stream_ptr())
    try:
        lib.batch_normalization_backward_ex(
            handle, p.mode, api.CUDNN_BATCHNORM_OPS_BN, p.one, p.zero, p.one, p.zero, p.desc,
            x.data.ptr, p.desc, 0, p.desc, gy.data.ptr, p.desc, 0, p.desc, gx.data.ptr,
            p.bn_desc, gamma.data.ptr, 0, ggamma.data.ptr, gbeta.data.ptr, eps, mean.data.ptr,
            inv_std.data.ptr, 0, runtime.address(workspace), p.backward_workspace,
            runtime.address(reserve_space), reserve_size)
    except cudnn.CuDNNError as e:
        raise e.add_context(p.what)
    if cast:                         # CuPy casts them to the data's dtype (Chainer then to gamma's)
        ggamma, gbeta = ggamma.astype(x.dtype), gbeta.astype(x.dtype)
    return gx, ggamma, gbeta


def batch_normalization_forward_inference(x, gamma, beta, mean, var, eps, is_for_conv2d,
                                          cudnn_mode, d_layout=api.CUDNN_TENSOR_NCHW):
    """F.fixed_batch_normalization (a frozen BatchNorm in a training step). No set-up to plan:
    its two descriptors are host objects, cached. Every vector goes to cuDNN in its parameter
    dtype, contiguous (CuPy 13.6 makes mean and var contiguous only when it casts them)."""
    if not _bn_takes(x, is_for_conv2d, False, d_layout):
        return _original('batch_normalization_forward_inference')(
            x, gamma, beta, mean, var, eps, is_for_conv2d, cudnn_mode, d_layout)
    x = _contiguous(x)
    shape, layout = _bn_shape(x, is_for_conv2d, _layout(d_layout))
    desc = descriptors.tensor_4d(shape, x.dtype, layout)
    bn_desc = descriptors.batch_norm(shape, x.dtype, layout, cudnn_mode)
    dtype = _param_dtype(x.dtype)
    gamma, beta, mean, var = (_as_param(a, dtype) for a in (gamma, beta, mean, var))
    y = runtime.empty(x.shape, x.dtype)
    one, zero = cudnn.scaling_factors(x.dtype)
    _call('cudnnBatchNormalizationForwardInference', x, cudnn_mode, one, zero, desc.value,
          x.data.ptr, desc.value, y.data.ptr, bn_desc.value, gamma.data.ptr, beta.data.ptr,
          mean.data.ptr, var.data.ptr, eps)
    return y


# ---- softmax, activations and pooling ----------------------------------------------------------

def _softmax_descriptor(x, axis):
    """CuPy's: (left, axis, right, 1) NCHW around ``axis``; the mode is CHANNEL (over the axis,
    for each left and right position), INSTANCE where the axis and all after it are of size 1."""
    axis = axis + x.ndim if axis < 0 else axis
    left = int(numpy.prod(x.shape[:axis], dtype=numpy.int64))
    center = x.shape[axis]
    right = int(numpy.prod(x.shape[axis + 1:], dtype=numpy.int64))
    mode = (api.CUDNN_SOFTMAX_MODE_INSTANCE if center == 1 and right == 1
            else api.CUDNN_SOFTMAX_MODE_CHANNEL)
    return descriptors.tensor_4d((left, center, right, 1), x.dtype, 'NCHW'), mode


def _call(name, x, *args):
    """``name``(handle, *args) on x's device's handle, on the current stream."""
    lib = cudnn.binding()
    handle = runtime.handle(x.data.device_id)
    lib.set_stream(handle, runtime.stream_ptr())
    lib.call(name, handle, *args)


def softmax_forward(x, axis, algorithm):
    x = _contiguous(x)
    y = runtime.empty(x.shape, x.dtype)
    desc, mode = _softmax_descriptor(x, axis)
    one, zero = cudnn.scaling_factors(x.dtype)
    _call('cudnnSoftmaxForward', x, algorithm, mode, one, desc.value, x.data.ptr, zero,
          desc.value, y.data.ptr)
    return y


def softmax_backward(y, gy, axis, algorithm):
    y, gy = _contiguous(y), _contiguous(gy)
    gx = runtime.empty(y.shape, y.dtype)
    desc, mode = _softmax_descriptor(y, axis)
    one, zero = cudnn.scaling_factors(y.dtype)
    _call('cudnnSoftmaxBackward', y, algorithm, mode, one, desc.value, y.data.ptr, desc.value,
          gy.data.ptr, zero, desc.value, gx.data.ptr)
    return gx


def _as_rows(x):
    """CuPy's ``_create_tensor_descriptor_as4darray``: (shape[0], size / shape[0], 1, 1) NCHW
    (elementwise calls: only the element count matters)."""
    rows = x.shape[0] if x.ndim else 1
    return descriptors.tensor_4d((rows, x.size // rows, 1, 1), x.dtype, 'NCHW')


def activation_forward(x, mode, coef=0.0):
    if x.size == 0:                  # (CuPy's divides by the zero first dimension)
        return _original('activation_forward')(x, mode, coef)
    x = _contiguous(x)
    y = runtime.empty(x.shape, x.dtype)
    desc = _as_rows(x)
    act = descriptors.activation(mode, api.CUDNN_NOT_PROPAGATE_NAN, coef)
    one, zero = cudnn.scaling_factors(x.dtype)
    _call('cudnnActivationForward', x, act.value, one, desc.value, x.data.ptr, zero,
          desc.value, y.data.ptr)
    return y


def activation_backward(x, y, gy, mode, coef=0.0):
    if x.size == 0:
        return _original('activation_backward')(x, y, gy, mode, coef)
    gx = runtime.empty(x.shape, x.dtype)
    x, y, gy = _contiguous(x), _contiguous(y), _contiguous(gy)
    desc = _as_rows(y)
    # (CuPy's signature takes coef as a C float: rounded to float32 before the descriptor)
    act = descriptors.activation(mode, api.CUDNN_NOT_PROPAGATE_NAN, float(numpy.float32(coef)))
    one, zero = cudnn.scaling_factors(x.dtype)
    _call('cudnnActivationBackward', y, act.value, one, desc.value, y.data.ptr, desc.value,
          gy.data.ptr, desc.value, x.data.ptr, zero, desc.value, gx.data.ptr)
    return gx


def _pooling_takes(x, ksize):
    return x.ndim == 4 and len(ksize) == 2


def pooling_forward(x, y, ksize, stride, pad, mode):
    if not _pooling_takes(x, ksize) or not y.flags.c_contiguous:
        return _original('pooling_forward')(x, y, ksize, stride, pad, mode)
    x = _contiguous(x)
    pool = descriptors.pooling_2d(mode, ksize, stride, pad)
    x_desc = descriptors.tensor_4d(x.shape, x.dtype, 'NCHW')
    y_desc = descriptors.tensor_4d(y.shape, y.dtype, 'NCHW')
    one, zero = cudnn.scaling_factors(x.dtype)
    _call('cudnnPoolingForward', x, pool.value, one, x_desc.value, x.data.ptr, zero,
          y_desc.value, y.data.ptr)
    return y


def pooling_backward(x, y, gy, ksize, stride, pad, mode):
    if not _pooling_takes(x, ksize):
        return _original('pooling_backward')(x, y, gy, ksize, stride, pad, mode)
    gx = runtime.empty(x.shape, x.dtype)
    x, y, gy = _contiguous(x), _contiguous(y), _contiguous(gy)
    pool = descriptors.pooling_2d(mode, ksize, stride, pad)
    x_desc = descriptors.tensor_4d(x.shape, x.dtype, 'NCHW')
    y_desc = descriptors.tensor_4d(y.shape, y.dtype, 'NCHW')
    one, zero = cudnn.scaling_factors(x.dtype)
    _call('cudnnPoolingBackward', x, pool.value, one, y_desc.value, y.data.ptr, y_desc.value,
          gy.data.ptr, x_desc.value, x.data.ptr, zero, x_desc.value, gx.data.ptr)
    return gx


# ---- routing ------------------------------------------------------------------------------------

ROUTED = ('convolution_forward', 'convolution_backward_data', 'convolution_backward_filter',
          'batch_normalization_forward_training_ex', 'batch_normalization_forward_training',
          'batch_normalization_backward', 'batch_normalization_forward_inference',
          'softmax_forward', 'softmax_backward', 'activation_forward', 'activation_backward',
          'pooling_forward', 'pooling_backward')


def _original(name):
    return _originals[name]


def _dispatcher(name, original):
    ours = globals()[name]

    def dispatch(*args, **kwargs):
        if _active():
            return ours(*args, **kwargs)
        return original(*args, **kwargs)
    dispatch.__name__ = dispatch.__qualname__ = name
    dispatch.__doc__ = 'CuPy\'s {}, through chainer_tc.cuda while routed on this thread'.format(
        name)
    dispatch.chainer_tc_original = original
    return dispatch


def chainers_module():
    """The module Chainer calls cuDNN through (``chainer.backends.cuda.cudnn``), or None where
    Chainer uses no cuDNN (CuPy 14, ``CHAINER_CUDNN=0``)."""
    from chainer.backends import cuda
    return cuda.cudnn if cuda.cudnn_enabled else None


def problem():
    """Why Chainer's cuDNN calls cannot be routed here (a string), or None: None also where
    Chainer makes none (nothing to route)."""
    if chainers_module() is None:
        return None
    return cudnn.unavailable_reason()


@contextlib.contextmanager
def routed(module=None):
    """Within this block, on this thread, the wrappers of ``module`` (default: Chainer's
    :func:`chainers_module`) listed in :data:`ROUTED` run through chainer_tc's binding. Where
    there is no such module, or chainer_tc's binding does not load, nothing changes."""
    module = chainers_module() if module is None else module
    if module is None or cudnn.unavailable_reason() is not None:
        yield False
        return
    with _lock:
        if _installed[0] == 0:
            _installed[1] = module
            for name in ROUTED:
                fn = getattr(module, name)
                # a dispatcher left behind (someone patched over ours, then restored it)
                original = getattr(fn, 'chainer_tc_original', fn)
                _originals[name] = original
                setattr(module, name, _dispatcher(name, original))
        elif _installed[1] is not module:
            raise RuntimeError('chainer_tc routes one cuDNN wrapper module at a time')
        _installed[0] += 1
    previous = _active()
    _state.active = True
    try:
        yield True
    finally:
        _state.active = previous
        with _lock:
            _installed[0] -= 1
            if _installed[0] == 0:
                for name in ROUTED:        # ours only: a patch made over ours stays
                    fn = getattr(module, name)
                    if getattr(fn, 'chainer_tc_original', None) is _originals[name]:
                        setattr(module, name, _originals[name])
                _installed[1] = None
