"""BatchNormalization (+ Add + ReLU) through cuDNN's fused NHWC kernels.

``cudnnBatchNormalizationForwardTrainingEx`` / ``cudnnBatchNormalizationBackwardEx`` (cuDNN 8.9,
through ``chainer_tc.cuda.cudnn``, so they can run under CUDA stream capture), with bnOps
``CUDNN_BATCHNORM_OPS_BN_ADD_ACTIVATION`` (residual z), ``..._BN_ACTIVATION`` (ReLU) or
``..._BN`` (plain), in ``CUDNN_BATCHNORM_SPATIAL_PERSISTENT`` mode. The cuDNN documentation
requires, for the activation variants: NHWC fully packed half data, a ReLU activation descriptor,
the persistent mode, and C a multiple of 4; scale, bias and statistics are float32 for half data
(the derived BN descriptor), and epsilon >= CUDNN_BN_MIN_EPSILON. The reserve space written by the
forward call (the ReLU mask and more) must reach the backward call unchanged: it lives on the
forward node's :class:`FusedBatchNorm`. Descriptors and workspace/reserve sizes are set up once per
(device, shape, dtype, bnOps), outside capture; a later call with the same
key creates and queries nothing (``chainer_tc.cuda.counters()``).

:func:`eligibility` decides, from dtypes and shapes alone, whether a call can take this path (and
says why not); everything else falls to kernels/batchnorm.cu, which handles every case.
"""
import numpy

import chainer

from chainer_tc.cuda import _counters
from chainer_tc.cuda import _cudnn_api as api
from chainer_tc.cuda import cudnn
from chainer_tc.cuda import descriptors
from chainer_tc.cuda import runtime


def eligibility(is_cupy, x_dtype, x_shape, gamma_dtype, running_dtype, relu, eps, fixed):
    """(True, None) if cuDNN's fused NHWC batch normalization applies, else (False, reason)."""
    if not is_cupy:
        return False, 'not a CuPy array'
    if fixed:
        return False, 'inference uses its own single-pass kernel'
    if chainer.config.use_cudnn == 'never':
        return False, "chainer.config.use_cudnn is 'never'"
    why = cudnn.unavailable_reason()
    if why:
        return False, why
    if numpy.dtype(x_dtype) != numpy.float16:
        return False, 'cuDNN fuses BN+Add+ReLU for float16 data only (got {})'.format(x_dtype)
    if len(x_shape) != 4:
        return False, 'needs 4-D NHWC data (got {}-D)'.format(len(x_shape))
    if x_shape[0] * x_shape[1] * x_shape[2] < 2:
        # cuDNN updates the running variance with the unbiased variance, var * rows / (rows - 1):
        # a division by zero here, where Chainer (and our kernels) divide by max(rows - 1, 1).
        return False, ('a single row per channel (cuDNN\'s unbiased running variance would '
                       'divide by 0)')
    if x_shape[-1] % 4:
        return False, 'needs a channel count divisible by 4 (got {})'.format(x_shape[-1])
    if numpy.dtype(gamma_dtype) != numpy.float32:
        return False, 'needs float32 gamma and beta with float16 data (got {})'.format(gamma_dtype)
    if running_dtype is not None and numpy.dtype(running_dtype) != numpy.float32:
        return False, 'needs float32 running statistics (got {})'.format(running_dtype)
    if eps < api.CUDNN_BN_MIN_EPSILON:
        return False, 'eps {} is below CUDNN_BN_MIN_EPSILON ({})'.format(
            eps, api.CUDNN_BN_MIN_EPSILON)
    return True, None


class _Plan:
    """Descriptors and buffer sizes of one (device, shape, dtype, bnOps): set up once, outside
    stream capture, then shared by every call with that key."""

    def __init__(self, device_id, shape, dtype, has_z, relu):
        what = 'cuDNN fused batch normalization of x {} {} (z: {}, relu: {})'.format(
            shape, numpy.dtype(dtype).name, has_z, relu)
        runtime.refuse_capture(what)
        self.device_id = device_id
        handle = runtime.handle(device_id)
        self.mode = api.CUDNN_BATCHNORM_SPATIAL_PERSISTENT
        self.ops = (api.CUDNN_BATCHNORM_OPS_BN_ADD_ACTIVATION if has_z else
                    api.CUDNN_BATCHNORM_OPS_BN_ACTIVATION if relu else api.CUDNN_BATCHNORM_OPS_BN)
        desc = descriptors.tensor_4d(shape, dtype, 'NHWC')          # x, y, z and their grads
        bn_desc = descriptors.batch_norm(shape, dtype, 'NHWC', self.mode)
        act = descriptors.relu() if relu or has_z else None
        self._keep = (desc, bn_desc, act)
        self.desc, self.bn_desc = desc.value, bn_desc.value
        self.z_desc = desc.value if has_z else 0
        self.act = act.value if act is not None else 0
        self.one, self.zero = cudnn.scaling_factors(dtype)     # float for half data
        _counters.add('workspace_queries', 3)
        lib = cudnn.binding()
        self.forward_workspace = lib.size(
            'cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize', handle, self.mode,
            self.ops, self.desc, self.z_desc, self.desc, self.bn_desc, self.act)
        self.reserve_size = lib.size(
            'cudnnGetBatchNormalizationTrainingExReserveSpaceSize', handle, self.mode,
            self.ops, self.act, self.desc)
        self.backward_workspace = lib.size(
            'cudnnGetBatchNormalizationBackwardExWorkspaceSize', handle, self.mode, self.ops,
            self.desc, self.desc, self.desc, self.z_desc, self.desc, self.bn_desc, self.act)


_plans = {}


def _plan(x, has_z, relu):
    key = (x.data.device_id, x.shape, x.dtype.char, has_z, relu)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _Plan(x.data.device_id, x.shape, x.dtype, has_z, relu)
    return plan


def _ptr(a):
    return 0 if a is None else a.data.ptr


class FusedBatchNorm:
    """One call's buffers, kept from forward to backward: the saved mean and inverse standard
    deviation and the reserve space (read by the backward call); the plan is shared."""

    def __init__(self, x, has_z, relu):
        self.plan = _plan(x, has_z, relu)
        self.has_z = has_z

    def forward(self, x, z, gamma, beta, eps, decay, running_mean, running_var):
        p = self.plan
        y = runtime.empty(x.shape, x.dtype)
        self.mean = runtime.empty(x.shape[-1:], numpy.float32)
        self.invstd = runtime.empty(x.shape[-1:], numpy.float32)
        workspace = runtime.alloc(p.forward_workspace)
        self.reserve = runtime.alloc(p.reserve_size)
        update = running_mean is not None
        lib = cudnn.binding()
        handle = runtime.handle(p.device_id)
        lib.set_stream(handle, runtime.stream_ptr())
        lib.batch_normalization_forward_training_ex(
            handle, p.mode, p.ops, p.one, p.zero, p.desc, x.data.ptr, p.z_desc,
            _ptr(z) if self.has_z else 0, p.desc, y.data.ptr, p.bn_desc, gamma.data.ptr,
            beta.data.ptr, 1.0 - decay if update else 0.0, _ptr(running_mean),
            _ptr(running_var), eps, self.mean.data.ptr, self.invstd.data.ptr, p.act,
            runtime.address(workspace), p.forward_workspace, runtime.address(self.reserve),
            p.reserve_size)
        return y

    def backward(self, x, y, gy, gamma, beta, eps):
        p = self.plan
        gx = runtime.empty(x.shape, x.dtype)
        gz = runtime.empty(x.shape, x.dtype) if self.has_z else None
        ggamma, gbeta = runtime.empty(gamma.shape, gamma.dtype), runtime.empty(beta.shape,
                                                                               beta.dtype)
        workspace = runtime.alloc(p.backward_workspace)
        lib = cudnn.binding()
        handle = runtime.handle(p.device_id)
        lib.set_stream(handle, runtime.stream_ptr())
        lib.batch_normalization_backward_ex(
            handle, p.mode, p.ops, p.one, p.zero, p.one, p.zero, p.desc, x.data.ptr,
            p.desc, y.data.ptr, p.desc, gy.data.ptr, p.z_desc, _ptr(gz), p.desc, gx.data.ptr,
            p.bn_desc, gamma.data.ptr, beta.data.ptr, ggamma.data.ptr, gbeta.data.ptr, eps,
            self.mean.data.ptr, self.invstd.data.ptr, p.act, runtime.address(workspace),
            p.backward_workspace, runtime.address(self.reserve), p.reserve_size)
        return gx, ggamma, gbeta, gz
