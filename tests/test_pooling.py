"""NHWC max/average pooling against Chainer's NCHW functions on transposed data, the emulated
kernels against the NumPy path, gradient checks."""
import importlib
import warnings

import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer)
import chainer
import chainer.functions as F
from chainer import gradient_check

from chainer_tc import functions as TF
from chainer_tc import kernels

# (shape NHWC, ksize, stride, pad, cover_all): overlapping, strided, padded, odd, global
CASES = [((2, 5, 7, 3), 2, None, 0, True), ((1, 7, 7, 4), 3, 2, 1, True),
         ((2, 6, 5, 1), 3, 2, 1, False), ((1, 9, 9, 64), 3, 1, 1, True),
         ((3, 4, 4, 2), (2, 3), (1, 2), (0, 1), True), ((2, 7, 7, 33), 7, 1, 0, False),
         ((1, 1, 1, 5), 1, 1, 0, False)]


def distinct(shape, dtype, seed=0):
    """Values with no ties (a permutation), so max pooling's gradient is well defined."""
    r = numpy.random.RandomState(seed)
    return (r.permutation(int(numpy.prod(shape))).reshape(shape) / 7.0 - 3).astype(dtype)


def nchw(a):
    return a.transpose(0, 3, 1, 2)


def nhwc(a):
    return a.transpose(0, 2, 3, 1)


@pytest.fixture(params=['numpy', 'emulator'])
def path(request, monkeypatch):
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1' if request.param == 'emulator' else '0')
    return request.param


def run(f, x, gy):
    v = chainer.Variable(x)
    y = f(v)
    y.grad = gy
    y.backward()
    return y.array, v.grad


@pytest.mark.parametrize('case', CASES)
@pytest.mark.parametrize('dtype', [numpy.float64, numpy.float32, numpy.float16])
def test_max_pooling_matches_chainer(path, case, dtype):
    shape, k, s, p, cover_all = case
    x = distinct(shape, numpy.float64).astype(dtype)
    ours_y = TF.max_pooling_2d(x, k, s, p, cover_all)
    gy = numpy.random.RandomState(1).randn(*ours_y.shape).astype(dtype)
    y, gx = run(lambda v: TF.max_pooling_2d(v, k, s, p, cover_all), x, gy)
    y_ref, gx_ref = run(lambda v: F.max_pooling_2d(v, k, s, p, cover_all),
                        nchw(x).copy(), nchw(gy).copy())
    numpy.testing.assert_array_equal(y, nhwc(y_ref))          # a max is exact
    # overlapping windows add up to kh*kw gradients per input: we add in float32 and round once,
    # Chainer adds in float16 (a rounding per term, half an ulp of 2^-11 each: 9 terms ~ 0.5%)
    t = dict(atol=1e-2, rtol=1e-2) if dtype == numpy.float16 else dict(atol=1e-6, rtol=1e-6)
    numpy.testing.assert_allclose(gx.astype('f8'), nhwc(gx_ref).astype('f8'), **t)


@pytest.mark.parametrize('case', CASES)
@pytest.mark.parametrize('dtype', [numpy.float64, numpy.float32, numpy.float16])
def test_average_pooling_matches_chainer(path, case, dtype):
    shape, k, s, p, _ = case
    x = numpy.random.RandomState(2).randn(*shape).astype(dtype)
    y0 = TF.average_pooling_2d(x, k, s, p)
    gy = numpy.random.RandomState(3).randn(*y0.shape).astype(dtype)
    y, gx = run(lambda v: TF.average_pooling_2d(v, k, s, p), x, gy)
    y_ref, gx_ref = run(lambda v: F.average_pooling_2d(v, k, s, p), nchw(x).copy(),
                        nchw(gy).copy())
    # float32 sums of up to 49 values in a different order: 1e-6; float16: we sum in float32,
    # Chainer in float16 (numpy's mean promotes, its col2im does not): half an ulp of 2^-11
    t = {numpy.float64: dict(atol=1e-12, rtol=1e-12), numpy.float32: dict(atol=1e-6, rtol=1e-6),
         numpy.float16: dict(atol=4e-3, rtol=4e-3)}[dtype]
    numpy.testing.assert_allclose(y.astype('f8'), nhwc(y_ref).astype('f8'), **t)
    numpy.testing.assert_allclose(gx.astype('f8'), nhwc(gx_ref).astype('f8'), **t)


def test_global_average_pooling(path):
    x = numpy.random.RandomState(4).randn(2, 7, 7, 8)
    y = TF.global_average_pooling_2d(x)
    assert y.shape == (2, 1, 1, 8)
    numpy.testing.assert_allclose(y.array[:, 0, 0], x.mean(axis=(1, 2)), rtol=1e-12)


@pytest.mark.parametrize('case', CASES[:5])
def test_gradient_checks_float64(path, case):
    shape, k, s, p, cover_all = case
    x = distinct(shape, numpy.float64)
    # Both functions are piecewise linear (values 1/7 apart: eps never flips an argmax), so the
    # only error of the central difference is rounding: ~1e-16 x |sum of ~5000 terms ~ 10| / eps
    # (1e-4) ~ 5e-8 for the largest case; hence atol 1e-7, rtol 1e-6.
    gy_max = numpy.random.RandomState(5).randn(*TF.max_pooling_2d(x, k, s, p, cover_all).shape)
    gradient_check.check_backward(lambda v: TF.max_pooling_2d(v, k, s, p, cover_all), x, gy_max,
                                  eps=1e-4, atol=1e-7, rtol=1e-6)
    gy_avg = numpy.random.RandomState(6).randn(*TF.average_pooling_2d(x, k, s, p).shape)
    gradient_check.check_backward(lambda v: TF.average_pooling_2d(v, k, s, p), x, gy_avg,
                                  eps=1e-4, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize('case', CASES)
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float16])
def test_emulated_kernels_equal_numpy_path(monkeypatch, case, dtype):
    shape, k, s, p, cover_all = case
    x = distinct(shape, numpy.float64).astype(dtype)
    results = []
    for emulate in ('0', '1'):
        monkeypatch.setenv('CHAINER_TC_EMULATE', emulate)
        with kernels.count_launches() as c:
            gy = numpy.ones(TF.max_pooling_2d(x, k, s, p, cover_all).shape, dtype)
            ym, gm = run(lambda v: TF.max_pooling_2d(v, k, s, p, cover_all), x, gy)
            ga = numpy.ones(TF.average_pooling_2d(x, k, s, p).shape, dtype)
            ya, gaa = run(lambda v: TF.average_pooling_2d(v, k, s, p), x, ga)
        results.append(([ym, gm, ya, gaa], c.total))
    (r0, n0), (r1, n1) = results
    assert n0 == 0 and n1 == 6       # forward+backward of each, plus the two shape probes
    for a, b in zip(r0, r1):
        # max and its gradient are exact; averages may differ by summation order (one ulp)
        numpy.testing.assert_allclose(a.astype('f8'), b.astype('f8'), rtol=2e-3 if dtype ==
                                      numpy.float16 else 1e-6, atol=1e-7)


def test_bad_input(path):
    x = numpy.zeros((1, 4, 4, 2), numpy.float32)
    with pytest.raises(ValueError, match='ksize and stride must be >= 1'):
        TF.max_pooling_2d(x, 0)
    with pytest.raises(ValueError, match=r'leaves no output for input of shape \(1, 4, 4, 2\)'):
        TF.average_pooling_2d(x, 5)
    with pytest.raises(ValueError, match='ksize must be an int or a pair'):
        TF.max_pooling_2d(x, (2, 2, 2))
    with pytest.raises(chainer.utils.type_check.InvalidType):
        TF.max_pooling_2d(numpy.zeros((4, 4, 2), numpy.float32), 2)


@pytest.mark.gpu
@pytest.mark.parametrize('case', CASES)
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float16])
def test_gpu_equals_numpy_path(case, dtype):
    import cupy
    shape, k, s, p, cover_all = case
    x = distinct(shape, numpy.float64).astype(dtype)
    for f in (lambda v: TF.max_pooling_2d(v, k, s, p, cover_all),
              lambda v: TF.average_pooling_2d(v, k, s, p)):
        y0 = f(x).array
        gy = numpy.random.RandomState(7).randn(*y0.shape).astype(dtype)
        a = run(f, x, gy)
        b = run(f, cupy.asarray(x), cupy.asarray(gy))
        # An average sums its window (its backward, the covering outputs' gradients) in the
        # kernel's order, NumPy's path in another. Each float32 order is off by at most
        # (n - 1) * 2^-24 * sum|terms|, n <= kh*kw terms, and sum|terms| / (kh*kw) <= max|v|:
        # two orders differ by at most kh*kw * max|v| * 2^-23, v = x for y and gy for gx (seen
        # on an H100: 1.8e-7 where |gy| <= 3.3, a 3x3 backward sum that cancels to 0.04; the
        # bound is 3.5e-6).
        kh, kw = (k, k) if isinstance(k, int) else k
        for u, w, v in zip(a, b, (x, gy)):
            numpy.testing.assert_allclose(cupy.asnumpy(w).astype('f8'), u.astype('f8'),
                                          rtol=2e-3 if dtype == numpy.float16 else 1e-6,
                                          atol=1e-7 if dtype == numpy.float16 else
                                          float(abs(v).max()) * kh * kw * 2.0 ** -23)


# ---- the two kernel paths: two channels per thread (vector loads) and one -----------------------

def _launched(c):
    """The pooling kernels a count_launches() block ran, as {name without template: width}."""
    return {k.split('<')[0]: k.rsplit(', ', 1)[1].rstrip('>') for k in c.per_kernel}


def offset_view(a):
    """``a`` copied into an array that starts one element after an aligned allocation: C-contiguous,
    but not aligned to two elements (what a flat slice ``base[1:]`` gives)."""
    base = numpy.empty(a.size + 1, a.dtype)
    assert base.ctypes.data % (2 * a.dtype.itemsize) == 0
    view = base[1:].reshape(a.shape)
    view[...] = a
    return view


@pytest.mark.parametrize('dtype', [numpy.float64, numpy.float32, numpy.float16])
@pytest.mark.parametrize('shape,width', [((2, 7, 9, 6), '2'), ((2, 7, 9, 64), '2'),
                                         ((2, 7, 9, 5), '1'), ((1, 3, 4, 2), '2')])
def test_vector_path_is_chosen_by_the_channel_count_and_equals_numpy(monkeypatch, dtype, shape,
                                                                     width):
    x = distinct(shape, numpy.float64).astype(dtype)
    out = {}
    for emulate in ('0', '1'):
        monkeypatch.setenv('CHAINER_TC_EMULATE', emulate)
        with kernels.count_launches() as c:
            v = chainer.Variable(x)
            y = TF.max_pooling_2d(v, 3, 2, 1)
            y.grad = numpy.random.RandomState(2).randn(*y.shape).astype(dtype)
            y.backward()
            va = chainer.Variable(x)
            ya = TF.average_pooling_2d(va, 3, 2, 1)
            ya.grad = numpy.ones_like(ya.array)
            ya.backward()
        out[emulate] = (y.array, v.grad, ya.array, va.grad)
        if emulate == '1':
            assert _launched(c) == {k: width for k in ('max_pool_forward', 'max_pool_backward',
                                                       'avg_pool_forward', 'avg_pool_backward')}
    # the max and the average (the same additions in the same order; padding adds nothing) are
    # bitwise the NumPy path's; gradients add the outputs of overlapping windows in another order
    for i in (0, 2):
        numpy.testing.assert_array_equal(out['1'][i], out['0'][i])
    for i in (1, 3):
        numpy.testing.assert_allclose(out['1'][i].astype('f8'), out['0'][i].astype('f8'),
                                      rtol=2e-3 if dtype == numpy.float16 else 1e-6, atol=1e-7)


@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float16])
def test_misaligned_input_takes_the_one_channel_path_once_warned(monkeypatch, dtype):
    from chainer_tc import _tiles
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1')
    monkeypatch.setattr(_tiles, '_WARNED', set())
    x = distinct((2, 5, 6, 8), numpy.float64).astype(dtype)
    gy = numpy.random.RandomState(3).randn(2, 3, 4, 8).astype(dtype)
    results = []
    for inp in (x, offset_view(x)):
        with kernels.count_launches() as c, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            v = chainer.Variable(inp)
            y = TF.max_pooling_2d(v, 3, 2, 1)
            y.grad = gy
            y.backward()
        results.append((y.array, v.grad, _launched(c),
                        [str(w.message) for w in caught
                         if issubclass(w.category, chainer.warnings.PerformanceWarning)]))
    (y0, g0, k0, w0), (y1, g1, k1, w1) = results
    assert k0 == {'max_pool_forward': '2', 'max_pool_backward': '2'} and not w0
    # only the launch that reads the misaligned array is held back; gy, argmax, gx are ours
    assert k1 == {'max_pool_forward': '1', 'max_pool_backward': '2'}
    assert len(w1) == 1 and 'max_pool_forward takes one channel per thread' in w1[0]
    assert 'x starts at an address that is not a multiple of {} bytes'.format(
        2 * numpy.dtype(dtype).itemsize) in w1[0]
    numpy.testing.assert_array_equal(y0, y1)
    numpy.testing.assert_array_equal(g0, g1)
    with warnings.catch_warnings(record=True) as again:       # once per kernel and reason
        warnings.simplefilter('always')
        TF.max_pooling_2d(offset_view(x), 3, 2, 1)
    assert not [w for w in again if 'one channel per thread' in str(w.message)]


@pytest.mark.parametrize('dtype', [numpy.float16, numpy.float32, numpy.float64])
def test_nan_in_one_channel_of_a_pair(monkeypatch, dtype):
    """Two channels per thread keep each channel's own max, argmax and first NaN."""
    r = numpy.random.RandomState(4)
    x = r.randn(2, 6, 7, 4).astype(dtype)
    x[0, 1, 2, 0] = numpy.nan           # channel 0 of pair (0, 1)
    x[1, 3, 3, 3] = numpy.nan           # channel 3 of pair (2, 3)
    x[1, 3, 4, 3] = numpy.nan           # a second NaN in the same window: the first one wins
    x[1, 4, 4, 2] = numpy.inf           # its pair partner: a maximum, not a NaN
    gy = r.randn(2, 4, 4, 4).astype(dtype)
    t = {numpy.float16: '__half', numpy.float32: 'float', numpy.float64: 'double'}[dtype]
    out = []
    for emulate in ('0', '1'):
        monkeypatch.setenv('CHAINER_TC_EMULATE', emulate)
        with kernels.count_launches() as c:
            v = chainer.Variable(x)
            y = TF.max_pooling_2d(v, 3, 2, 1)
            y.grad = gy
            y.backward()
        out.append((y.array, v.grad, y.creator.argmax))
    assert c.per_kernel == {'max_pool_forward<{}, unsigned char, 2>'.format(t): 1,
                            'max_pool_backward<{}, unsigned char, 2>'.format(t): 1}
    (y0, g0, a0), (y1, g1, a1) = out
    assert numpy.isnan(y1[..., 0]).any() and numpy.isnan(y1[..., 3]).any()
    assert not numpy.isnan(y1[..., 1]).any() and not numpy.isnan(y1[..., 2]).any()
    assert numpy.isinf(y1[..., 2]).any()
    numpy.testing.assert_array_equal(y1, y0)                  # NaN where NaN, exact elsewhere
    numpy.testing.assert_array_equal(a1, a0)                  # the first NaN's window offset
    # overlapping windows add gradients in another order: a rounding apart
    numpy.testing.assert_allclose(g1.astype('f8'), g0.astype('f8'),
                                  rtol=2e-3 if dtype == numpy.float16 else 1e-6, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float16])
def test_gpu_vector_and_scalar_paths_equal_numpy(dtype):
    import cupy
    from chainer_tc import _tiles
    x = distinct((2, 7, 9, 64), numpy.float64).astype(dtype)
    gy = numpy.random.RandomState(8).randn(2, 4, 5, 64).astype(dtype)
    ref = run(lambda v: TF.max_pooling_2d(v, 3, 2, 1), x, gy)
    base = cupy.empty(x.size + 1, dtype)
    view = base[1:].reshape(x.shape)              # data.ptr one element past an aligned one
    view[...] = cupy.asarray(x)
    assert _tiles.vector_width(64, {'x': cupy.asarray(x)})[0] == 2
    assert _tiles.vector_width(64, {'x': view})[0] == 1
    for inp in (cupy.asarray(x), view):
        with kernels.count_launches() as c:
            got = run(lambda v: TF.max_pooling_2d(v, 3, 2, 1), inp, cupy.asarray(gy))
        assert any(k.startswith('max_pool_forward') and k.endswith(
            ', {}>'.format(2 if inp is not view else 1)) for k in c.per_kernel)
        numpy.testing.assert_array_equal(cupy.asnumpy(got[0]), ref[0])      # the max: exact
        # gradients of overlapping windows are added in another order than the NumPy path's
        numpy.testing.assert_allclose(cupy.asnumpy(got[1]).astype('f8'), ref[1].astype('f8'),
                                      rtol=2e-3 if dtype == numpy.float16 else 1e-6, atol=1e-7)


# ---- window offsets in one byte, and the backward's order of additions ---------------------------

@pytest.mark.parametrize('shape,ksize,stride,pad,index', [
    ((2, 7, 9, 4), 3, 2, 1, 'unsigned char'),
    ((2, 16, 16, 3), 16, 1, 0, 'unsigned char'),       # 256 elements: offsets up to 255
    ((1, 3, 260, 2), (1, 256), (1, 3), 0, 'unsigned char'),
    ((2, 17, 17, 6), 17, 1, 0, 'int'),                  # global pooling of 289 elements
    ((2, 19, 20, 4), 17, 1, 1, 'int'),                  # overlapping 289-element windows
    ((1, 3, 260, 3), (1, 257), (1, 2), 0, 'int'),
])
@pytest.mark.parametrize('dtype', [numpy.float16, numpy.float32])
def test_argmax_is_one_byte_where_the_window_allows(monkeypatch, shape, ksize, stride, pad, index,
                                                    dtype):
    """argmax is uint8 for windows of at most 256 elements and int32 beyond, on both paths, with
    the same values; the kernels take the matching instantiation."""
    x = distinct(shape, numpy.float64).astype(dtype)
    expected = numpy.uint8 if index == 'unsigned char' else numpy.int32
    out = {}
    for emulate in ('0', '1'):
        monkeypatch.setenv('CHAINER_TC_EMULATE', emulate)
        with kernels.count_launches() as c:
            v = chainer.Variable(x)
            y = TF.max_pooling_2d(v, ksize, stride, pad)
            y.grad = numpy.random.RandomState(9).randn(*y.shape).astype(dtype)
            y.backward()
        argmax = y.creator.argmax
        assert argmax.dtype == expected and argmax.shape == y.shape
        kh, kw = (ksize, ksize) if isinstance(ksize, int) else ksize
        assert argmax.min() >= 0 and argmax.max() < kh * kw
        out[emulate] = (y.array, argmax, v.grad)
        if emulate == '1':
            assert {k.split('<')[0]: k.split(', ')[1] for k in c.per_kernel} == {
                'max_pool_forward': index, 'max_pool_backward': index}
    numpy.testing.assert_array_equal(out['1'][0], out['0'][0])
    numpy.testing.assert_array_equal(out['1'][1], out['0'][1])
    numpy.testing.assert_allclose(out['1'][2].astype('f8'), out['0'][2].astype('f8'),
                                  rtol=2e-3 if dtype == numpy.float16 else 1e-6, atol=1e-6)


def _covering(size, k, s, p, out):
    """First and last output along an axis whose window covers each input position."""
    q = numpy.arange(size) + p
    lo = numpy.where(q < k, 0, (q - k) // s + 1)
    return lo, numpy.minimum(q // s, out - 1)


def gathered(gy, argmax, in_hw, ksize, stride, pad):
    """gx as the kernels compute it, bit for bit: each input position adds the gy of the outputs
    whose windows cover it (max pooling, ``argmax`` given: those whose argmax is the position;
    average, ``argmax=None``: all, the sum then divided by kh*kw), in order of oh, then ow, in
    float32 (float64 for float64 data), rounded to the data type once. The NumPy path's max
    pooling adds in this order too (numpy.add.at over the outputs); its average pooling adds by
    window offset, so that can differ in the last bit where three or more outputs meet. Skipped outputs add +0 here, which changes no sum: a sum that starts at +0 is
    never -0."""
    (kh, kw), (sy, sx), (ph, pw) = ksize, stride, pad
    n, oh_n, ow_n, c = gy.shape
    h, w = in_hw
    a = numpy.float64 if gy.dtype == numpy.float64 else numpy.float32
    lo_h, hi_h = _covering(h, kh, sy, ph, oh_n)
    lo_w, hi_w = _covering(w, kw, sx, pw, ow_n)
    g = gy.astype(a)
    total = numpy.zeros((n, h, w, c), a)
    for dr in range(-(-kh // sy)):             # at most ceil(k / s) windows cover a position
        oh = lo_h + dr
        ohc = numpy.minimum(oh, oh_n - 1)
        for dq in range(-(-kw // sx)):
            ow = lo_w + dq
            owc = numpy.minimum(ow, ow_n - 1)
            take = ((oh <= hi_h)[:, None] & (ow <= hi_w)[None, :])[None, :, :, None]
            if argmax is not None:
                offset = ((numpy.arange(h) + ph - oh * sy)[:, None] * kw
                          + (numpy.arange(w) + pw - ow * sx)[None, :])
                take = take & (argmax[:, ohc][:, :, owc] == offset[None, :, :, None])
            total += numpy.where(take, g[:, ohc][:, :, owc], a(0))
    return (total if argmax is not None else total / a(kh * kw)).astype(gy.dtype)


GRIDS = [(k, s, p, cover_all) for k in (1, 2, 3, 4) for s in (1, 2, 3)
         for p in sorted({0, 1, k - 1}) for cover_all in (True, False)]


@pytest.mark.parametrize('ksize,stride,pad,cover_all', GRIDS)
@pytest.mark.parametrize('shape,dtype', [((2, 7, 9, 4), numpy.float16),     # two channels
                                         ((1, 5, 37, 3), numpy.float32)])   # one; 3 runs a row
def test_backward_adds_the_covering_outputs_in_order(monkeypatch, ksize, stride, pad, cover_all,
                                                     shape, dtype):
    """Both backward kernels, and the NumPy path's max pooling, equal, bit for bit, the gather in
    order of oh, then ow (what the kernels computed before they walked runs of columns), on
    padded, strided, overlapping and gapped grids, windows with NaN included."""
    r = numpy.random.RandomState(ksize * 100 + stride * 10 + pad)
    x = r.randn(*shape).astype(dtype)
    x[r.rand(*shape) < 0.05] = numpy.nan
    x[:, ::3] = numpy.round(x[:, ::3])                 # ties
    try:
        y0 = TF.max_pooling_2d(x, ksize, stride, pad, cover_all)
    except ValueError as e:                            # no output for this geometry
        assert 'leaves no output' in str(e)
        return
    gy = r.randn(*y0.shape).astype(dtype)
    k2, s2, p2 = (ksize, ksize), (stride, stride), (pad, pad)
    for emulate in ('0', '1'):
        monkeypatch.setenv('CHAINER_TC_EMULATE', emulate)
        v = chainer.Variable(x)
        y = TF.max_pooling_2d(v, ksize, stride, pad, cover_all)
        y.grad = gy
        y.backward()
        numpy.testing.assert_array_equal(v.grad, gathered(gy, y.creator.argmax, shape[1:3], k2,
                                                           s2, p2), err_msg=emulate)
    if cover_all:
        return
    va = chainer.Variable(x)
    ya = TF.average_pooling_2d(va, ksize, stride, pad)
    ya.grad = gy
    ya.backward()
    numpy.testing.assert_array_equal(va.grad, gathered(gy, None, shape[1:3], k2, s2, p2))


@pytest.mark.parametrize('dtype', [numpy.float16, numpy.float64])
def test_backward_gather_order_on_big_windows_and_both_widths(monkeypatch, dtype):
    """17x17 windows (int32 offsets, up to 9 outputs per input here), two channels per thread
    and one (offset views of the same x and gy): each equals the ordered gather bit for bit."""
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1')
    r = numpy.random.RandomState(11)
    x = numpy.round(r.randn(2, 19, 20, 4) * 2).astype(dtype)    # many ties
    gy = r.randn(2, 3, 4, 4).astype(dtype)
    t = {numpy.float16: '__half', numpy.float64: 'double'}[dtype]
    grads = []
    for width, (inp, g) in ((2, (x, gy)), (1, (offset_view(x), offset_view(gy)))):
        with kernels.count_launches() as c, warnings.catch_warnings():
            warnings.simplefilter('ignore', chainer.warnings.PerformanceWarning)
            v = chainer.Variable(inp)
            y = TF.max_pooling_2d(v, 17, 1, 0)
            y.grad = g
            y.backward()
        assert c.per_kernel == {'max_pool_forward<{}, int, {}>'.format(t, width): 1,
                                'max_pool_backward<{}, int, {}>'.format(t, width): 1}
        gx = gathered(gy, y.creator.argmax, (19, 20), (17, 17), (1, 1), (0, 0))
        numpy.testing.assert_array_equal(v.grad, gx)
        grads.append(v.grad)
    numpy.testing.assert_array_equal(grads[0], grads[1])


def test_numpy_max_pooling_takes_a_few_images_at_a_time(monkeypatch):
    """The NumPy path bounds its temporaries (_WINDOW_BYTES): forward the window copy, backward
    the scatter indices; bounds of one image, below one and of a few give the results of one
    pass over all."""
    pooling = importlib.import_module('chainer_tc.functions.pooling')
    monkeypatch.setenv('CHAINER_TC_EMULATE', '0')
    r = numpy.random.RandomState(5)
    x = r.randn(5, 9, 7, 3).astype(numpy.float32)
    x[1, 2, 3, 1] = numpy.nan
    x[2, :4] = 1.0                                        # ties: overlapping windows share maxima
    f = pooling.MaxPooling2D(3, 2, 1, True)
    y_all, = f.forward((x,))
    a_all = f.argmax
    gy = r.randn(*y_all.shape).astype(numpy.float32)
    gx_all, = pooling._PoolingGrad(f, True).forward((gy,))
    windows, indices = 5 * 4 * 3 * 4 * 9, 3 * 8 * 5 * 4 * 3     # per image: (OH, OW, C) = 5, 4, 3
    for limit in (windows, windows - 1, 3 * windows, indices, indices - 1, 2 * indices):
        monkeypatch.setattr(pooling, '_WINDOW_BYTES', limit)
        y, = f.forward((x,))
        numpy.testing.assert_array_equal(y, y_all)
        numpy.testing.assert_array_equal(f.argmax, a_all)
        gx, = pooling._PoolingGrad(f, True).forward((gy,))
        numpy.testing.assert_array_equal(gx, gx_all)
