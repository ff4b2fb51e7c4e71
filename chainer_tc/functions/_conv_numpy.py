"""NHWC convolution on the CPU, directly in channels-last: one matrix product per call.

    y = forward(x, W, b, geometry)                 # x (N, H, W, C), W (O, kh, kw, C/groups)
    gx, gW, gb = backward(x, W, gy, geometry, need_x=True, need_b=True)

The patches of a channels-last image are a strided view of the (padded) input: shape
(N, oh, ow, kh, kw, C), no copy until the matrix product reads it. A 1x1 convolution with stride
1 and no padding (most of ResNet-50's) needs no patches at all. With stride 1 the input gradient
is itself one convolution (of the zero-padded output gradient with the flipped filter); otherwise
(strides, groups, a pad wider than the window) the patch gradients are scattered back with one
add per filter tap (kh * kw adds), never per pixel.

float16 data is multiplied in float32 (NumPy has no float16 BLAS) and rounded once to float16 at
the end; float32 and float64 use BLAS in their own precision. With float16, overflows (expected
under loss scaling: the optimizer skips such steps) are not warned about. The results equal Chainer's NCHW
convolution within the rounding of a differently ordered sum.
"""
import numpy


class Geometry:
    """Stride, padding, dilation, groups, and the output size for one input shape."""

    __slots__ = ('sy', 'sx', 'ph', 'pw', 'dy', 'dx', 'groups')

    def __init__(self, stride, pad, dilate, groups):
        (self.sy, self.sx), (self.ph, self.pw) = stride, pad
        (self.dy, self.dx), self.groups = dilate, groups

    def out_size(self, h, w, kh, kw):
        oh = (h + 2 * self.ph - self.dy * (kh - 1) - 1) // self.sy + 1
        ow = (w + 2 * self.pw - self.dx * (kw - 1) - 1) // self.sx + 1
        return oh, ow

    def pointwise(self, kh, kw):
        return (kh, kw, self.sy, self.sx, self.ph, self.pw) == (1, 1, 1, 1, 0, 0)


def _work_dtype(dtype):
    return numpy.float32 if dtype == numpy.float16 else dtype


def _patches(x, kh, kw, g):
    """(N, oh, ow, kh, kw, C) view of the zero-padded ``x`` (the padded copy only if padded)."""
    n, h, w, c = x.shape
    if g.ph or g.pw:
        xp = numpy.zeros((n, h + 2 * g.ph, w + 2 * g.pw, c), x.dtype)
        xp[:, g.ph:g.ph + h, g.pw:g.pw + w] = x
    else:
        xp = numpy.ascontiguousarray(x)
    oh, ow = g.out_size(h, w, kh, kw)
    s0, s1, s2, s3 = xp.strides
    # a strided view of xp (what numpy.lib.stride_tricks.as_strided makes, without its Python
    # overhead); only read
    return numpy.ndarray((n, oh, ow, kh, kw, c), xp.dtype, buffer=xp,
                         strides=(s0, g.sy * s1, g.sx * s2, g.dy * s1, g.dx * s2, s3))


def _columns(x, kh, kw, g, dtype):
    """The patch matrix (N * oh * ow, kh * kw * C) in the work dtype, C-contiguous."""
    if g.pointwise(kh, kw):
        return x.reshape(-1, x.shape[3]).astype(dtype, copy=False)
    p = _patches(x, kh, kw, g)
    # astype copies; in C order, or it keeps the view's stride order (order='K') and the
    # reshape copies the patches a second time
    return p.astype(dtype, order='C').reshape(-1, kh * kw * x.shape[3])


def _group_slices(c, o, groups):
    cg, og = c // groups, o // groups
    return [(slice(i * cg, (i + 1) * cg), slice(i * og, (i + 1) * og)) for i in range(groups)]


def forward(x, W, b, g):
    if x.dtype != numpy.float16:
        return _forward(x, W, b, g)
    with numpy.errstate(over='ignore', invalid='ignore'):   # fp16 overflow: loss scaling's
        return _forward(x, W, b, g)


def _forward(x, W, b, g):
    n, h, w, c = x.shape
    o, kh, kw, _ = W.shape
    dt = _work_dtype(x.dtype)
    oh, ow = g.out_size(h, w, kh, kw)
    wm = W.astype(dt, copy=False).reshape(o, -1)
    if g.groups == 1:
        y = _columns(x, kh, kw, g, dt) @ wm.T
    else:
        y = numpy.empty((n * oh * ow, o), dt)
        for cs, os_ in _group_slices(c, o, g.groups):
            y[:, os_] = _columns(x[..., cs], kh, kw, g, dt) @ wm[os_].T
    if b is not None:
        y += b.astype(dt, copy=False)
    return y.reshape(n, oh, ow, o).astype(x.dtype, copy=False)


def _spread(g, kh, kw):
    """(qh, qw): where the input gradient is computed as a convolution of the output gradient,
    the offset of its first row and column in the array :func:`_input_grad` builds; None where
    :func:`_scatter` computes it: groups above 1, a pad beyond the dilated window, and strides
    above 1 (spread out by a stride s, the output gradient is s * s times larger, mostly zeros:
    the product would do s * s times the scatter's arithmetic, which costs more than the
    scatter's kh * kw adds on any but tiny images)."""
    if g.groups != 1 or g.sy != 1 or g.sx != 1:
        return None
    qh, qw = g.dy * (kh - 1) - g.ph, g.dx * (kw - 1) - g.pw
    if qh < 0 or qw < 0:
        return None
    return qh, qw


def _input_grad(gy, W, x_shape, g, dtype):
    """The input gradient as one convolution: gy spread out by the stride (zeros between its
    rows and columns, as a transposed convolution) at offset q = dilate * (ksize - 1) - pad in a
    (N, H + dilate * (kh - 1), W + dilate * (kw - 1), O) array of zeros, correlated (stride 1, no
    pad) with the flipped filter W2[c, i, j, o] = W[o, kh - 1 - i, kw - 1 - j, c]: one patch copy
    and one matrix product, where :func:`_scatter` makes kh * kw strided adds (each slow for
    NumPy when C is small). Needs q >= 0 (:func:`_spread`); then the last spread row,
    q + sy * (oh - 1) <= H + ph - 1, is inside the array."""
    n, h, w, c = x_shape
    o, kh, kw, _ = W.shape
    qh, qw = _spread(g, kh, kw)
    oh, ow = gy.shape[1:3]
    spread = numpy.zeros((n, h + g.dy * (kh - 1), w + g.dx * (kw - 1), o), dtype)
    spread[:, qh:qh + g.sy * (oh - 1) + 1:g.sy, qw:qw + g.sx * (ow - 1) + 1:g.sx] = gy
    w2 = W.astype(dtype, copy=False)[:, ::-1, ::-1, :].transpose(3, 1, 2, 0)
    unit = Geometry((1, 1), (0, 0), (g.dy, g.dx), 1)
    return (_columns(spread, kh, kw, unit, dtype) @ w2.reshape(c, -1).T).reshape(x_shape)


def _scatter(gcol, x_shape, kh, kw, g, dtype):
    """The input gradient: the patch gradients (N, oh, ow, kh, kw, C) added back into place."""
    n, h, w, c = x_shape
    if g.pointwise(kh, kw):
        return gcol.reshape(x_shape)
    oh, ow = gcol.shape[1:3]
    gxp = numpy.zeros((n, h + 2 * g.ph, w + 2 * g.pw, c), dtype)
    for i in range(kh):
        y0 = i * g.dy
        for j in range(kw):
            x0 = j * g.dx
            gxp[:, y0:y0 + g.sy * (oh - 1) + 1:g.sy, x0:x0 + g.sx * (ow - 1) + 1:g.sx] += \
                gcol[:, :, :, i, j]
    return gxp[:, g.ph:g.ph + h, g.pw:g.pw + w]


def backward(x, W, gy, g, need_x=True, need_W=True, need_b=False):
    """(gx, gW, gb), each None where not needed. Overflows and the NaN they make are not warned
    about: with float16 and loss scaling they are expected, and the optimizer skips the step."""
    if x.dtype != numpy.float16:
        return _backward(x, W, gy, g, need_x, need_W, need_b)
    with numpy.errstate(over='ignore', invalid='ignore'):
        return _backward(x, W, gy, g, need_x, need_W, need_b)


def _backward(x, W, gy, g, need_x, need_W, need_b):
    n, h, w, c = x.shape
    o, kh, kw, cg = W.shape
    dt = _work_dtype(x.dtype)
    oh, ow = gy.shape[1:3]
    gy2 = gy.reshape(-1, o).astype(dt, copy=False)
    wm = W.astype(dt, copy=False).reshape(o, -1)
    gx = gW = gb = None
    groups = _group_slices(c, o, g.groups) if g.groups > 1 else None
    if need_W:
        if g.groups == 1:
            gW = gy2.T @ _columns(x, kh, kw, g, dt)
        else:
            gW = numpy.empty((o, kh * kw * cg), dt)
            for cs, os_ in groups:
                gW[os_] = gy2[:, os_].T @ _columns(x[..., cs], kh, kw, g, dt)
        gW = gW.reshape(W.shape).astype(W.dtype, copy=False)
    if need_x and not g.pointwise(kh, kw) and _spread(g, kh, kw) is not None:
        gx = _input_grad(gy, W, x.shape, g, dt).astype(x.dtype, copy=False)
    elif need_x:
        if g.groups == 1:
            gcol = gy2 @ wm
        else:
            gcol = numpy.empty((n * oh * ow, kh * kw, c), dt)
            for cs, os_ in groups:
                gcol[:, :, cs] = (gy2[:, os_] @ wm[os_]).reshape(-1, kh * kw, cg)
        gcol = gcol.reshape(n, oh, ow, kh, kw, c)
        gx = numpy.ascontiguousarray(_scatter(gcol, x.shape, kh, kw, g, dt)) \
            .astype(x.dtype, copy=False)
    if need_b:
        gb = gy2.sum(axis=0).astype(gy.dtype, copy=False)
    return gx, gW, gb
