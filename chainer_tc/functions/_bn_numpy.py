"""BatchNormalization (+ Add + ReLU) over channels-last arrays in NumPy: the CPU path.

Same semantics as kernels/batchnorm.cu: statistics and arithmetic in float32 for float16/float32
data (float64 for float64), the biased variance normalises, the unbiased one feeds running_var,
invstd = 1 / sqrt(var + eps). Arrays are 2-D views (rows, C) of the NHWC data.
"""
import numpy


def acc_dtype(dtype):
    return numpy.float64 if dtype == numpy.float64 else numpy.float32


def forward(x, z, gamma, beta, mean, invstd, relu, centered=None):
    """act(gamma * ((x - mean) * invstd) + beta [+ z]); ``centered``: x - mean if already
    computed (by :func:`statistics`), in the accumulation dtype."""
    a = acc_dtype(x.dtype)
    if centered is None:
        centered = numpy.subtract(x.astype(a, copy=False), mean)
    y = centered                                          # each step rounded as written, in
    y *= invstd                                           # place
    y *= gamma.astype(a, copy=False)
    y += beta.astype(a, copy=False)
    if z is not None:
        y += z.astype(a, copy=False)
    if relu:
        numpy.maximum(y, a(0), out=y)      # as Chainer's relu: NaN stays NaN, -0 stays -0
    return y.astype(x.dtype, copy=False)


def statistics(x, eps, keep_centered=False):
    """(mean, invstd, var) of each column, in the accumulation dtype; with ``keep_centered``,
    also x - mean (which :func:`forward` can reuse)."""
    a = acc_dtype(x.dtype)
    xa = x.astype(a, copy=False)
    n = a(x.shape[0])
    mean = xa.sum(axis=0) / n                       # what ndarray.mean computes, bit for bit
    d = xa - mean
    sq = d * d if keep_centered else numpy.multiply(d, d, out=d)
    var = sq.sum(axis=0) / n
    invstd = numpy.reciprocal(numpy.sqrt(var + a(eps)))
    if keep_centered:
        return mean, invstd, var, d
    return mean, invstd, var


def update_running(running_mean, running_var, mean, var, rows, decay):
    a = mean.dtype.type
    d, adjust = a(decay), a(rows) / a(max(rows - 1, 1))
    if running_mean.dtype == a and running_var.dtype == a:    # in place: the same roundings
        running_mean *= d
        running_mean += (a(1) - d) * mean
        running_var *= d
        running_var += (a(1) - d) * adjust * var
        return
    running_mean[...] = running_mean.astype(a) * d + (a(1) - d) * mean
    running_var[...] = running_var.astype(a) * d + (a(1) - d) * adjust * var


def backward(gy, y, x, gamma, mean, invstd, relu, fixed):
    """(gx, ggamma, gbeta, g) where g is gy through the ReLU mask (the residual's gradient).

    With loss scaling, float16 gradients overflow to inf now and then (expected: the optimizer
    skips the step); the arithmetic on them then makes inf and nan without NumPy's warnings."""
    if gy.dtype != numpy.float16:
        return _backward(gy, y, x, gamma, mean, invstd, relu, fixed)
    with numpy.errstate(over='ignore', invalid='ignore'):
        return _backward(gy, y, x, gamma, mean, invstd, relu, fixed)


def _backward(gy, y, x, gamma, mean, invstd, relu, fixed):
    a = acc_dtype(x.dtype)
    g = gy.astype(a, copy=False)
    if relu:
        g = numpy.where(y > 0, g, a(0))
    coef = gamma.astype(a, copy=False) * invstd
    if fixed:
        gx = coef * g
        sum_g = g.sum(axis=0)
        xhat = numpy.subtract(x.astype(a, copy=False), mean)
        xhat *= invstd
        xhat *= g
        sum_gx = xhat.sum(axis=0)
    else:
        xhat = numpy.subtract(x.astype(a, copy=False), mean)
        xhat *= invstd
        sum_g = g.sum(axis=0)
        gx = xhat * g
        sum_gx = gx.sum(axis=0)
        # gamma * invstd * (g - (xhat * sum_gx + sum_g) / rows), each step rounded as written
        numpy.multiply(xhat, sum_gx, out=gx)
        gx += sum_g
        gx *= a(1) / a(x.shape[0])
        numpy.subtract(g, gx, out=gx)
        gx *= coef
    return (gx.astype(x.dtype, copy=False), sum_gx.astype(gamma.dtype, copy=False),
            sum_g.astype(gamma.dtype, copy=False), g.astype(x.dtype))
