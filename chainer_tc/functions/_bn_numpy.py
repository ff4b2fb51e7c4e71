"""BatchNormalization (+ Add + ReLU) over channels-last arrays in NumPy: the CPU path.

Same semantics as kernels/batchnorm.cu: statistics and arithmetic in float32 for float16/float32
data (float64 for float64), the biased variance normalises, the unbiased one feeds running_var,
invstd = 1 / sqrt(var + eps). Arrays are 2-D views (rows, C) of the NHWC data.

Speed on small channel counts: a per-channel vector broadcast over (rows, C) makes NumPy loop
over C elements at a time (4 for the first stage of a width/16 ResNet-50), so the broadcasting
operations work on the same memory viewed as (rows / m, C * m) against the vector tiled m times
(the same elementwise results), and column sums are BLAS matrix-vector products.
"""
import numpy


def acc_dtype(dtype):
    return numpy.float64 if dtype == numpy.float64 else numpy.float32


_NARROW = 16        # channel counts below this are folded (above, tiling costs more than it saves)
_WIDE = 64          # ... up to this many elements per innermost NumPy loop


def _fold(rows, c):
    """m such that (rows, c) is viewed as (rows // m, c * m)."""
    m = 1
    if c >= _NARROW:
        return m
    while rows and c * m < _WIDE and rows % (2 * m) == 0:
        m *= 2
    return m


def _wide(a, m):
    return a.reshape(a.shape[0] // m, -1) if m > 1 else a


def _tile(v, m):
    """``v`` repeated ``m`` times (numpy.tile's result, without its Python overhead)."""
    if m == 1:
        return v
    out = numpy.empty((m, v.shape[0]), v.dtype)
    out[...] = v
    return out.reshape(-1)


_ONES = {}


def colsum(a):
    """Per-column sums of a C-contiguous (rows, C) array: one BLAS matrix-vector product."""
    key = (a.shape[0], a.dtype)
    ones = _ONES.get(key)
    if ones is None:
        if len(_ONES) > 256:
            _ONES.clear()
        ones = _ONES[key] = numpy.ones(a.shape[0], a.dtype)
    return ones @ a


def forward(x, z, gamma, beta, mean, invstd, relu, centered=None, keep_xhat=True):
    """(y, xhat): y = act(gamma * xhat + beta [+ z]) and xhat = (x - mean) * invstd, folded and
    in the accumulation dtype (what :func:`backward` needs; without ``keep_xhat`` None, and y is
    computed in its memory); ``centered``: x - mean as :func:`statistics` returns it (folded), if
    already computed (it becomes xhat)."""
    a = acc_dtype(x.dtype)
    rows, c = x.shape
    m = _fold(rows, c)
    if centered is None:
        centered = numpy.subtract(_wide(numpy.ascontiguousarray(x).astype(a, copy=False), m),
                                  _tile(mean, m))
    xhat = centered                                       # each step rounded as written
    xhat *= _tile(invstd, m)
    if keep_xhat:
        y = xhat * _tile(gamma.astype(a, copy=False), m)
    else:
        y, xhat = xhat, None
        y *= _tile(gamma.astype(a, copy=False), m)
    y += _tile(beta.astype(a, copy=False), m)
    if z is not None:
        y += _wide(numpy.ascontiguousarray(z).astype(a, copy=False), m)
    if relu:
        numpy.maximum(y, a(0), out=y)      # as Chainer's relu: NaN stays NaN, -0 stays -0
    return y.reshape(rows, c).astype(x.dtype, copy=False), xhat


def statistics(x, eps, keep_centered=False):
    """(mean, invstd, var) of each column, in the accumulation dtype; with ``keep_centered``,
    also x - mean (folded, for :func:`forward`)."""
    a = acc_dtype(x.dtype)
    xa = numpy.ascontiguousarray(x).astype(a, copy=False)
    rows, c = xa.shape
    n = a(rows)
    m = _fold(rows, c)
    mean = colsum(xa) / n
    d = _wide(xa, m) - _tile(mean, m)
    sq = d * d if keep_centered else numpy.multiply(d, d, out=d)
    var = colsum(sq.reshape(rows, c)) / n
    invstd = numpy.reciprocal(numpy.sqrt(var + a(eps)))
    if keep_centered:
        return mean, invstd, var, d
    return mean, invstd, var


def update_running(running_mean, running_var, mean, var, rows, decay):
    a = mean.dtype.type
    d, adjust = a(decay), a(rows) / a(max(rows - 1, 1))
    w_mean = a(1) - d                   # the batch statistics' weights, rounded as before:
    w_var = w_mean * adjust             # (1 - d) * mean and ((1 - d) * adjust) * var
    if running_mean.dtype == a and running_var.dtype == a:    # in place: the same roundings
        running_mean *= d
        running_mean += w_mean * mean
        running_var *= d
        running_var += w_var * var
        return
    running_mean[...] = running_mean.astype(a) * d + w_mean * mean
    running_var[...] = running_var.astype(a) * d + w_var * var


def backward(gy, y, xhat, gamma, invstd, relu, fixed, want_gz):
    """(gx, ggamma, gbeta, gz) from ``xhat`` as :func:`forward` returned it: gz is gy through
    the ReLU mask (the residual's gradient), or None without ``want_gz`` (as the kernels' path:
    no (rows, C) array made for nobody).

    With loss scaling, float16 gradients overflow to inf now and then (expected: the optimizer
    skips the step); the arithmetic on them then makes inf and nan without NumPy's warnings."""
    if gy.dtype != numpy.float16:
        return _backward(gy, y, xhat, gamma, invstd, relu, fixed, want_gz)
    with numpy.errstate(over='ignore', invalid='ignore'):
        return _backward(gy, y, xhat, gamma, invstd, relu, fixed, want_gz)


def _backward(gy, y, xhat, gamma, invstd, relu, fixed, want_gz):
    rows, c = y.shape
    g, sum_g, sum_gx, prod = backward_sums(gy, y, xhat, relu)
    gx = backward_apply(g, xhat, prod, gamma, invstd, sum_g, sum_gx, rows, fixed)
    return (gx.reshape(rows, c).astype(y.dtype, copy=False),
            sum_gx.astype(gamma.dtype, copy=False), sum_g.astype(gamma.dtype, copy=False),
            _own(g, gy).reshape(rows, c).astype(y.dtype, copy=False) if want_gz else None)


def backward_sums(gy, y, xhat, relu):
    """(g, sum_g, sum_gx, prod): g = gy through the ReLU mask (y > 0) when ``relu``, folded, in
    the accumulation dtype (it may be a view of gy); the column sums of g and of g * xhat; prod
    = xhat * g (folded), the buffer :func:`backward_apply` writes gx into. Float16 gy: call
    under ``numpy.errstate`` as :func:`backward` does."""
    a = acc_dtype(y.dtype)          # y has x's shape and dtype
    rows, c = y.shape
    m = _fold(rows, c)
    g = _wide(numpy.ascontiguousarray(gy).astype(a, copy=False), m)
    if relu:
        g = numpy.where(_wide(numpy.ascontiguousarray(y), m) > 0, g, a(0))
    sum_g = colsum(g.reshape(rows, c))
    prod = xhat * g
    sum_gx = colsum(prod.reshape(rows, c))
    return g, sum_g, sum_gx, prod


def backward_apply(g, xhat, prod, gamma, invstd, sum_g, sum_gx, count, fixed):
    """gx (folded, in ``prod``'s memory) from :func:`backward_sums`' results: gamma * invstd *
    (g - (xhat * sum_gx + sum_g) / count), or gamma * invstd * g when ``fixed``; ``count``: the
    rows the statistics and the sums were taken over."""
    a = prod.dtype.type
    m = prod.shape[1] // invstd.shape[0]         # the fold of backward_sums
    coef = gamma.astype(a, copy=False) * invstd
    if fixed:
        return numpy.multiply(g, _tile(coef, m), out=prod)
    # gamma * invstd * (g - (xhat * sum_gx + sum_g) / count), each step rounded as written
    gx = numpy.multiply(xhat, _tile(sum_gx, m), out=prod)
    gx += _tile(sum_g, m)
    gx *= a(1) / a(count)
    numpy.subtract(g, gx, out=gx)
    gx *= _tile(coef, m)
    return gx


def _own(g, gy):
    """``g``, copied if it is (a view of) ``gy``: a gradient must not alias another."""
    return g.copy() if numpy.may_share_memory(g, gy) else g
