"""BatchNormalization (+ Add + ReLU) through cuDNN's fused NHWC kernels.

``cudnnBatchNormalizationForwardTrainingEx`` / ``cudnnBatchNormalizationBackwardEx`` (cuDNN 8.9,
through CuPy 13's raw bindings ``cupy_backends.cuda.libs.cudnn``), with bnOps
``CUDNN_BATCHNORM_OPS_BN_ADD_ACTIVATION`` (residual z), ``..._BN_ACTIVATION`` (ReLU) or
``..._BN`` (plain), in ``CUDNN_BATCHNORM_SPATIAL_PERSISTENT`` mode. The cuDNN documentation
requires, for the activation variants: NHWC fully packed half data, a ReLU activation descriptor,
the persistent mode, and C a multiple of 4; scale, bias and statistics are float32 for half data
(the derived BN descriptor), and epsilon >= CUDNN_BN_MIN_EPSILON. The reserve space written by the
forward call (the ReLU mask and more) must reach the backward call unchanged.

:func:`eligibility` decides, from dtypes and shapes alone, whether a call can take this path (and
says why not); everything else falls to kernels/batchnorm.cu, which handles every case.
"""
import numpy

import chainer



def _min_eps():
    """CUDNN_BN_MIN_EPSILON as the loaded binding defines it (0.0 in cuDNN 8.9)."""
    try:
        from cupy_backends.cuda.libs import cudnn as lib
        return lib.CUDNN_BN_MIN_EPSILON
    except Exception:       # no CuPy: irrelevant, the data cannot be CuPy arrays either
        return 1e-5


def eligibility(is_cupy, x_dtype, x_shape, gamma_dtype, running_dtype, relu, eps, fixed):
    """(True, None) if cuDNN's fused NHWC batch normalization applies, else (False, reason)."""
    if not is_cupy:
        return False, 'not a CuPy array'
    if fixed:
        return False, 'inference uses its own single-pass kernel'
    if not chainer.should_use_cudnn('>=auto'):
        return False, 'cuDNN disabled by chainer.config.use_cudnn'
    if numpy.dtype(x_dtype) != numpy.float16:
        return False, 'cuDNN fuses BN+Add+ReLU for float16 data only (got {})'.format(x_dtype)
    if len(x_shape) != 4:
        return False, 'needs 4-D NHWC data (got {}-D)'.format(len(x_shape))
    if x_shape[-1] % 4:
        return False, 'needs a channel count divisible by 4 (got {})'.format(x_shape[-1])
    if numpy.dtype(gamma_dtype) != numpy.float32:
        return False, 'needs float32 gamma and beta with float16 data (got {})'.format(gamma_dtype)
    if running_dtype is not None and numpy.dtype(running_dtype) != numpy.float32:
        return False, 'needs float32 running statistics (got {})'.format(running_dtype)
    if eps < _min_eps():
        return False, 'eps {} is below CUDNN_BN_MIN_EPSILON ({})'.format(eps, _min_eps())
    return True, None


class FusedBatchNorm:
    """One call's descriptors and buffers, kept from forward to backward."""

    def __init__(self, x, has_z, relu):
        import cupy
        import cupyx.cudnn as cudnn
        from cupy_backends.cuda.libs import cudnn as lib
        self.cupy, self.lib = cupy, lib
        self.handle = cudnn.get_handle()            # the current device's, stream set per call
        self.mode = lib.CUDNN_BATCHNORM_SPATIAL_PERSISTENT
        self.ops = (lib.CUDNN_BATCHNORM_OPS_BN_ADD_ACTIVATION if has_z else
                    lib.CUDNN_BATCHNORM_OPS_BN_ACTIVATION if relu else lib.CUDNN_BATCHNORM_OPS_BN)
        self.desc = cudnn.create_tensor_descriptor(x, lib.CUDNN_TENSOR_NHWC)   # x, y, z alike
        self.bn_desc = cudnn.create_uninitialized_tensor_descriptor()
        lib.deriveBNTensorDescriptor(self.bn_desc.value, self.desc.value, self.mode)
        self.act = cudnn.create_activation_descriptor(lib.CUDNN_ACTIVATION_RELU) \
            if relu or has_z else None
        self.has_z = has_z
        self.one = numpy.ones((), numpy.float32)       # scaling factors: float for half data
        self.zero = numpy.zeros((), numpy.float32)

    def _z_desc(self):
        return self.desc.value if self.has_z else 0

    def _act(self):
        return self.act.value if self.act is not None else 0

    def forward(self, x, z, gamma, beta, eps, decay, running_mean, running_var):
        cupy, lib = self.cupy, self.lib
        C = x.shape[-1]
        y = cupy.empty_like(x)
        self.mean = cupy.empty(C, numpy.float32)
        self.invstd = cupy.empty(C, numpy.float32)
        ws_size = lib.getBatchNormalizationForwardTrainingExWorkspaceSize(
            self.handle, self.mode, self.ops, self.desc.value, self._z_desc(), self.desc.value,
            self.bn_desc.value, self._act())
        rs_size = lib.getBatchNormalizationTrainingExReserveSpaceSize(
            self.handle, self.mode, self.ops, self._act(), self.desc.value)
        workspace = cupy.empty(max(ws_size, 1), numpy.uint8)
        self.reserve = cupy.empty(max(rs_size, 1), numpy.uint8)
        self.reserve_size = rs_size
        update = running_mean is not None
        lib.batchNormalizationForwardTrainingEx(
            self.handle, self.mode, self.ops, self.one.ctypes.data, self.zero.ctypes.data,
            self.desc.value, x.data.ptr, self._z_desc(), z.data.ptr if self.has_z else 0,
            self.desc.value, y.data.ptr, self.bn_desc.value, gamma.data.ptr, beta.data.ptr,
            1.0 - decay if update else 0.0,
            running_mean.data.ptr if update else 0, running_var.data.ptr if update else 0,
            eps, self.mean.data.ptr, self.invstd.data.ptr, self._act(), workspace.data.ptr,
            ws_size, self.reserve.data.ptr, rs_size)
        return y

    def backward(self, x, y, gy, gamma, beta, eps):
        cupy, lib = self.cupy, self.lib
        gx = cupy.empty_like(x)
        gz = cupy.empty_like(x) if self.has_z else None
        ggamma, gbeta = cupy.empty_like(gamma), cupy.empty_like(beta)
        ws_size = lib.getBatchNormalizationBackwardExWorkspaceSize(
            self.handle, self.mode, self.ops, self.desc.value, self.desc.value, self.desc.value,
            self._z_desc(), self.desc.value, self.bn_desc.value, self._act())
        workspace = cupy.empty(max(ws_size, 1), numpy.uint8)
        lib.batchNormalizationBackwardEx(
            self.handle, self.mode, self.ops, self.one.ctypes.data, self.zero.ctypes.data,
            self.one.ctypes.data, self.zero.ctypes.data, self.desc.value, x.data.ptr,
            self.desc.value, y.data.ptr, self.desc.value, gy.data.ptr, self._z_desc(),
            gz.data.ptr if self.has_z else 0, self.desc.value, gx.data.ptr, self.bn_desc.value,
            gamma.data.ptr, beta.data.ptr, ggamma.data.ptr, gbeta.data.ptr, eps,
            self.mean.data.ptr, self.invstd.data.ptr, self._act(), workspace.data.ptr, ws_size,
            self.reserve.data.ptr, self.reserve_size)
        return gx, ggamma, gbeta, gz
