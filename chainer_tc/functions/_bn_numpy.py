"""BatchNormalization (+ Add + ReLU) over channels-last arrays in NumPy: the CPU path.

Same semantics as kernels/batchnorm.cu: statistics and arithmetic in float32 for float16/float32
data (float64 for float64), the biased variance normalises, the unbiased one feeds running_var,
invstd = 1 / sqrt(var + eps). Arrays are 2-D views (rows, C) of the NHWC data.
"""
import numpy


def acc_dtype(dtype):
    return numpy.float64 if dtype == numpy.float64 else numpy.float32


def forward(x, z, gamma, beta, mean, invstd, relu):
    a = acc_dtype(x.dtype)
    y = gamma.astype(a) * ((x.astype(a) - mean) * invstd) + beta.astype(a)
    if z is not None:
        y += z.astype(a)
    if relu:
        y = numpy.where(y > 0, y, a(0))
    return y.astype(x.dtype)


def statistics(x, eps):
    """(mean, invstd, var) of each column, in the accumulation dtype."""
    a = acc_dtype(x.dtype)
    xa = x.astype(a)
    mean = xa.mean(axis=0)
    var = ((xa - mean) ** 2).mean(axis=0)
    invstd = numpy.reciprocal(numpy.sqrt(var + a(eps)))
    return mean, invstd, var


def update_running(running_mean, running_var, mean, var, rows, decay):
    a = mean.dtype.type
    d, adjust = a(decay), a(rows) / a(max(rows - 1, 1))
    running_mean[...] = running_mean.astype(a) * d + (a(1) - d) * mean
    running_var[...] = running_var.astype(a) * d + (a(1) - d) * adjust * var


def backward(gy, y, x, gamma, mean, invstd, relu, fixed):
    """(gx, ggamma, gbeta, g) where g is gy through the ReLU mask (the residual's gradient).

    With loss scaling, float16 gradients overflow to inf now and then (expected: the optimizer
    skips the step); the arithmetic on them then makes inf and nan without NumPy's warnings."""
    with numpy.errstate(over='ignore', invalid='ignore'):
        return _backward(gy, y, x, gamma, mean, invstd, relu, fixed)


def _backward(gy, y, x, gamma, mean, invstd, relu, fixed):
    a = acc_dtype(x.dtype)
    g = gy.astype(a)
    if relu:
        g = numpy.where(y > 0, g, a(0))
    xhat = (x.astype(a) - mean) * invstd
    sum_g = g.sum(axis=0)
    sum_gx = (g * xhat).sum(axis=0)
    if fixed:
        gx = gamma.astype(a) * invstd * g
    else:
        gx = gamma.astype(a) * invstd * (g - (xhat * sum_gx + sum_g) * (a(1) / a(x.shape[0])))
    return (gx.astype(x.dtype), sum_gx.astype(gamma.dtype), sum_g.astype(gamma.dtype),
            g.astype(x.dtype))
