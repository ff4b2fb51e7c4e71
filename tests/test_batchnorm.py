"""NHWC BatchNormalization and the fused relu(BN(x) + z): against Chainer's NCHW-free reference
(``F.batch_normalization(axis=(0, 1, 2))``), the emulated kernels against the NumPy path,
gradient checks, the links."""
import copy
import warnings

import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer)
import chainer
import chainer.functions as F
import chainer.links as L
from chainer import gradient_check
from chainer import serializers

from chainer_tc import functions as TF
from chainer_tc import kernels
from chainer_tc import links as TL

# (x dtype, gamma dtype) pairs the kernels support
PAIRS = [(numpy.float64, numpy.float64), (numpy.float32, numpy.float32),
         (numpy.float16, numpy.float32), (numpy.float16, numpy.float16)]


def data(shape, dtype, pdtype, seed=0, with_z=True):
    r = numpy.random.RandomState(seed)
    C = shape[-1]
    x = (r.randn(*shape) * 2 + r.randn(C) * 3).astype(dtype)     # per-channel offsets
    gamma = (r.rand(C) + 0.5).astype(pdtype)
    beta = r.randn(C).astype(pdtype)
    z = r.randn(*shape).astype(dtype) if with_z else None
    return x, gamma, beta, z


def tol(dtype):
    """Forward tolerances: float64 is exact up to reduction order; float32 differs from Chainer
    by reduction order (shifted sums and Chan merges vs two-pass) and rounding of invstd (~1e-6
    relative of |y|~5); float16 output is rounded to 11 bits (relative 2^-11) of values up to ~8
    (Chainer even computes in float16)."""
    return {numpy.float64: dict(atol=1e-12, rtol=1e-12),
            numpy.float32: dict(atol=1e-5, rtol=1e-5),
            numpy.float16: dict(atol=2e-2, rtol=1e-2)}[dtype]


@pytest.fixture(params=['numpy', 'emulator'])
def path(request, monkeypatch):
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1' if request.param == 'emulator' else '0')
    return request.param


# ---- forward against Chainer --------------------------------------------------------------------

@pytest.mark.parametrize('shape', [(2, 3, 5, 7), (1, 1, 1, 3), (4, 7), (1, 2, 2, 64), (3, 1, 1, 1)])
@pytest.mark.parametrize('dtype,pdtype', PAIRS)
def test_training_forward_and_running_statistics(path, shape, dtype, pdtype):
    x, gamma, beta, _ = data(shape, dtype, pdtype)
    C = shape[-1]
    rm, rv = numpy.zeros(C, pdtype), numpy.ones(C, pdtype)
    rm_ref, rv_ref = rm.copy(), rv.copy()
    y = TF.batch_normalization(x, gamma, beta, eps=1e-3, running_mean=rm, running_var=rv,
                               decay=0.8)
    axes = tuple(range(x.ndim - 1))
    x64 = x.astype(numpy.float64)
    ref = F.batch_normalization(x64, gamma.astype(numpy.float64), beta.astype(numpy.float64),
                                eps=1e-3, running_mean=rm_ref.astype(numpy.float64),
                                running_var=rv_ref.astype(numpy.float64), decay=0.8, axis=axes)
    assert y.dtype == dtype and y.shape == x.shape
    numpy.testing.assert_allclose(y.array.astype(numpy.float64), ref.array, **tol(dtype))
    mean, var = x64.reshape(-1, C).mean(0), x64.reshape(-1, C).var(0)
    m = x.size // C
    numpy.testing.assert_allclose(rm, 0.2 * mean, **tol(pdtype))
    numpy.testing.assert_allclose(rv, 0.8 + 0.2 * var * m / max(m - 1, 1), **tol(pdtype))


@pytest.mark.parametrize('dtype,pdtype', PAIRS)
def test_fixed_forward(path, dtype, pdtype):
    x, gamma, beta, _ = data((2, 3, 4, 5), dtype, pdtype)
    mean, var = numpy.linspace(-1, 1, 5).astype(pdtype), numpy.linspace(0.5, 2, 5).astype(pdtype)
    y = TF.fixed_batch_normalization(x, gamma, beta, mean, var, eps=1e-4)
    f = [a.astype(numpy.float64) for a in (x, gamma, beta, mean, var)]
    ref = F.fixed_batch_normalization(*f, eps=1e-4, axis=(0, 1, 2))
    numpy.testing.assert_allclose(y.array.astype(numpy.float64), ref.array, **tol(dtype))


@pytest.mark.parametrize('train', [True, False])
@pytest.mark.parametrize('with_z', [True, False])
def test_fused_equals_the_three_separate_ops(path, train, with_z):
    x, gamma, beta, z = data((2, 3, 5, 6), numpy.float64, numpy.float64, with_z=with_z)
    # make some outputs exactly zero: a constant channel normalises to beta, and z = -beta there
    x[..., 2] = 4.0
    if with_z:
        z[..., 2] = -beta[2]
    rm, rv = numpy.zeros(6), numpy.ones(6)
    gy = numpy.random.RandomState(3).randn(*x.shape)

    def ours(x, gamma, beta, *z):
        zz = z[0] if z else None
        if train:
            return TF.batch_normalization_add_relu(x, zz, gamma, beta)
        return TF.fixed_batch_normalization_add_relu(x, zz, gamma, beta, rm, rv)

    def separate(x, gamma, beta, *z):
        if train:
            h = F.batch_normalization(x, gamma, beta, axis=(0, 1, 2))
        else:
            h = F.fixed_batch_normalization(x, gamma, beta, rm, rv, axis=(0, 1, 2))
        return F.relu(h + z[0]) if z else F.relu(h)

    inputs = (x, gamma, beta) + ((z,) if with_z else ())
    results = []
    for f in (ours, separate):
        vs = [chainer.Variable(a.copy()) for a in inputs]
        y = f(*vs)
        y.grad = gy
        y.backward()
        results.append((y.array, [v.grad for v in vs]))
    (y1, g1), (y2, g2) = results
    if train and with_z:
        assert (y1[..., 2] == 0).all(), 'the test must hit the ReLU kink exactly'
    numpy.testing.assert_allclose(y1, y2, atol=1e-12, rtol=1e-12)
    for a, b in zip(g1, g2):                # including the ReLU mask at exact zeros
        numpy.testing.assert_allclose(a, b, atol=1e-12, rtol=1e-10)


# ---- gradient checks ----------------------------------------------------------------------------

def _bn_mode(train, with_z, mean, var):
    """f(x, gamma, beta[, z]) of one BN mode, for check_backward: training or fixed (with
    ``mean``/``var``, cast to x's dtype), with or without the fused Add + ReLU."""
    def f(x, gamma, beta, *z):
        zz = z[0] if z else None
        if train:
            return TF.batch_normalization_add_relu(x, zz, gamma, beta) if with_z else \
                TF.batch_normalization(x, gamma, beta)
        m, v = mean.astype(x.dtype), var.astype(x.dtype)
        return TF.fixed_batch_normalization_add_relu(x, zz, gamma, beta, m, v) if with_z \
            else TF.fixed_batch_normalization(x, gamma, beta, m, v)
    return f


@pytest.mark.parametrize('with_z', [True, False])
@pytest.mark.parametrize('train', [True, False])
def test_gradient_check_float64(path, with_z, train):
    x, gamma, beta, z = data((2, 2, 3, 4), numpy.float64, numpy.float64, seed=5, with_z=with_z)
    if with_z:
        z += 4.0            # keep BN(x) + z away from the ReLU kink: finite differences
    gy = numpy.random.RandomState(6).randn(*x.shape)
    f = _bn_mode(train, with_z, numpy.full(4, 0.3), numpy.full(4, 1.7))
    inputs = (x, gamma, beta) + ((z,) if with_z else ())
    gradient_check.check_backward(f, inputs, gy, eps=1e-6, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize('with_z', [True, False])
@pytest.mark.parametrize('train', [True, False])
def test_gradient_check_float32(path, with_z, train):
    """float32 analytic gradients against float64 central differences (``dtype=float64``: the
    finite differences are taken in float64, so their own error is the truncation, about
    eps**2 = 1e-6 relative). The analytic side rounds in float32 (2**-24 relative) through
    sums of 12 rows per channel whose terms are up to |gy| * |xhat| ~ 10 where the result may
    cancel to near zero: at most ~1e-5 absolute. atol 1e-4 and rtol 1e-3 cover both with room;
    a gradient off by 1% fails."""
    x, gamma, beta, z = data((2, 2, 3, 4), numpy.float32, numpy.float32, seed=7, with_z=with_z)
    if with_z:
        z += 4.0            # keep BN(x) + z away from the ReLU kink: finite differences
    gy = numpy.random.RandomState(8).randn(*x.shape).astype(numpy.float32)
    f = _bn_mode(train, with_z, numpy.full(4, 0.3), numpy.full(4, 1.7))
    inputs = (x, gamma, beta) + ((z,) if with_z else ())
    gradient_check.check_backward(f, inputs, gy, eps=1e-3, atol=1e-4, rtol=1e-3,
                                  dtype=numpy.float64)


@pytest.mark.parametrize('pdtype', [numpy.float16, numpy.float32])
def test_float16_gradients_follow_float64(path, pdtype):
    """float16 data: the analytic gradients equal the float64 ones on the same (float16-exact)
    inputs up to the rounding of each result to float16 (2**-11 relative: rtol 1e-3) and the
    float32 accumulation of 96 rows per channel (~1e-6 of the largest term: atol 1e-4 of the
    gradient's scale, which also covers float16's subnormal spacing). z + 4 keeps every output
    far from the ReLU kink, so the masks agree. A gradient off by 0.3% fails."""
    x, gamma, beta, z = data((2, 3, 4, 8), numpy.float16, pdtype, seed=9)
    z += numpy.float16(4)
    gy = numpy.random.RandomState(10).randn(*x.shape).astype(numpy.float16)
    grads = []
    for as64 in (False, True):
        vs = [chainer.Variable(a.astype(numpy.float64) if as64 else a)
              for a in (x, gamma, beta, z)]
        y = TF.batch_normalization_add_relu(vs[0], vs[3], vs[1], vs[2])
        y.grad = gy.astype(y.dtype)
        y.backward()
        grads.append([v.grad.astype(numpy.float64) for v in vs])
    for name, a, b in zip(('x', 'gamma', 'beta', 'z'), *grads):
        scale = max(1.0, numpy.abs(b).max())
        numpy.testing.assert_allclose(a, b, atol=1e-4 * scale, rtol=1e-3, err_msg=name)


# ---- the emulated kernels against the NumPy path, awkward shapes ---------------------------------

@pytest.mark.parametrize('rows,C', [(1, 1), (7, 3), (4097, 1), (4097, 4), (7, 64), (1, 2048),
                                    (7, 2048), (300, 33)])
@pytest.mark.parametrize('dtype,pdtype', [(numpy.float32, numpy.float32),
                                          (numpy.float16, numpy.float32),
                                          (numpy.float16, numpy.float16)])
def test_emulated_kernels_equal_numpy_path(monkeypatch, rows, C, dtype, pdtype):
    x, gamma, beta, z = data((rows, C), dtype, pdtype, seed=rows + C)
    gy = numpy.random.RandomState(1).randn(rows, C).astype(dtype)
    out = []
    for emulate in ('0', '1'):
        monkeypatch.setenv('CHAINER_TC_EMULATE', emulate)
        rm, rv = numpy.zeros(C, pdtype), numpy.ones(C, pdtype)
        vs = [chainer.Variable(a.copy()) for a in (x, gamma, beta, z)]
        with kernels.count_launches() as c:
            y = TF.batch_normalization_add_relu(vs[0], vs[3], vs[1], vs[2], running_mean=rm,
                                                running_var=rv)
            y.grad = gy
            y.backward()
        out.append((y.array, rm, rv, [v.grad for v in vs], c.total))
    (y0, rm0, rv0, g0, n0), (y1, rm1, rv1, g1, n1) = out
    assert n0 == 0 and n1 == 6, 'three launches forward, three backward'
    # shifted sums in blocks vs NumPy's two-pass mean: statistics agree to ~1e-6 relative in
    # float32, which moves float16 outputs by at most one ulp
    t = dict(atol=2e-6 * numpy.sqrt(rows), rtol=1e-5) if dtype == numpy.float32 else \
        dict(atol=4e-3, rtol=2e-3)
    numpy.testing.assert_allclose(y1.astype('f8'), y0.astype('f8'), **t)
    numpy.testing.assert_allclose(rm1.astype('f8'), rm0.astype('f8'), **t)
    numpy.testing.assert_allclose(rv1.astype('f8'), rv0.astype('f8'), **t)
    for name, a, b in zip(('x', 'gamma', 'beta', 'z'), g1, g0):
        scale = max(1.0, float(numpy.abs(b.astype('f8')).max()))
        numpy.testing.assert_allclose(a.astype('f8'), b.astype('f8'), atol=t['atol'] * scale * 4,
                                      rtol=t['rtol'] * 4, err_msg=name)


def test_fixed_statistics_are_checked(path):
    """fixed_batch_normalization's mean and var: arrays of shape (C,), floating, in x's dtype or
    its accumulation dtype. A missing one used to mean batch statistics (silently), a (1,) mean
    broadcast on NumPy and read past its end in the kernels, an integer mean was accepted."""
    x, gamma, beta, _ = data((3, 2, 2, 16), numpy.float32, numpy.float32)
    good = numpy.zeros(16, numpy.float32), numpy.ones(16, numpy.float32)
    for mean, var, error, message in [
            (None, good[1], TypeError, r'^mean must be an array of shape \(C,\)'),
            (good[0], None, TypeError, r'^var must be an array of shape \(C,\)'),
            (None, None, TypeError, r'^mean must be an array'),
            (numpy.zeros(1, numpy.float32), good[1], ValueError,
             r'^mean must have shape \(16,\), one value per channel of x; got \(1,\)'),
            (good[0], numpy.float32(1), ValueError, r'^var must have shape \(16,\)'),
            (numpy.zeros(16, numpy.int32), good[1], TypeError,
             r'^mean must be a floating-point array of shape \(16,\); got dtype int32'),
            (good[0], numpy.ones(16, numpy.float64), TypeError,
             r'^var is float64 but x is float32: the statistics must be float32')]:
        with pytest.raises(error, match=message):
            TF.fixed_batch_normalization(x, gamma, beta, mean, var)
        with pytest.raises(error, match=message):
            TF.fixed_batch_normalization_add_relu(x, None, gamma, beta, mean, var)
    x16 = x.astype(numpy.float16)          # float32 statistics for float16 data, or float16
    for m, v in (good, (good[0].astype(numpy.float16), good[1].astype(numpy.float16))):
        y = TF.fixed_batch_normalization(x16, gamma, beta, m, v)
        assert y.dtype == numpy.float16


def test_argument_names_in_type_errors(path):
    x, gamma, beta, z = data((2, 3, 3, 4), numpy.float32, numpy.float32)
    with pytest.raises(chainer.utils.type_check.InvalidType, match=r'z\.shape == x\.shape'):
        TF.batch_normalization_add_relu(x, z[:1], gamma, beta)
    with pytest.raises(chainer.utils.type_check.InvalidType, match=r'gamma\.shape\[0\]'):
        TF.batch_normalization(x, gamma[:3], beta[:3])


@pytest.mark.parametrize('fixed', [False, True])
def test_strided_parameters_and_statistics(path, fixed):
    """gamma, beta and the running statistics as strided views into bigger buffers (a flat
    parameter store): the kernels and cuDNN take raw pointers, so they are given contiguous
    copies, and the updated running statistics are written back into the views. The results
    equal those of contiguous arrays, and the buffers' other elements are untouched."""
    x, gamma, beta, z = data((3, 2, 2, 6), numpy.float32, numpy.float32, seed=3)
    gy = numpy.random.RandomState(4).randn(*x.shape).astype(numpy.float32)
    params = numpy.full(24, 7.0, numpy.float32)
    params[0::4], params[1::4] = gamma, beta
    stats = numpy.full(24, 5.0, numpy.float32)
    stats[0::4], stats[1::4] = 0.25, 2.0
    runs = []
    for strided in (True, False):
        g, b = (params[0::4], params[1::4]) if strided else (gamma.copy(), beta.copy())
        rm, rv = (stats[0::4], stats[1::4]) if strided else (numpy.full(6, 0.25, 'f'),
                                                              numpy.full(6, 2.0, 'f'))
        vs = [chainer.Variable(a) for a in (x, g, b, z)]
        if fixed:
            y = TF.fixed_batch_normalization_add_relu(vs[0], vs[3], vs[1], vs[2], rm, rv)
        else:
            y = TF.batch_normalization_add_relu(vs[0], vs[3], vs[1], vs[2], running_mean=rm,
                                                running_var=rv)
        y.grad = gy
        y.backward()
        runs.append([y.array, rm.copy(), rv.copy()] + [v.grad for v in vs])
    for name, a, b in zip(('y', 'running_mean', 'running_var', 'gx', 'ggamma', 'gbeta', 'gz'),
                          *runs):
        numpy.testing.assert_array_equal(a, b, err_msg=name)
    if not fixed:
        assert (stats[0::4] != 0.25).all() and (stats[1::4] != 2.0).all(), 'not written back'
    assert (stats[2::4] == 5).all() and (stats[3::4] == 5).all()
    assert (params[2::4] == 7).all() and (params[3::4] == 7).all()


def test_fixed_mode_launches(monkeypatch):
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1')
    x, gamma, beta, _ = data((3, 5), numpy.float32, numpy.float32)
    with kernels.count_launches() as c:
        TF.fixed_batch_normalization(x, gamma, beta, numpy.zeros(5, 'f'), numpy.ones(5, 'f'))
    assert c.per_kernel == {'bn_apply<float, float, 1>': 1}     # C = 5: one channel per thread


# ---- bad input ----------------------------------------------------------------------------------

def test_bad_input(path):
    x, gamma, beta, _ = data((2, 3, 4), numpy.float32, numpy.float32)
    with pytest.raises(chainer.utils.type_check.InvalidType):
        TF.batch_normalization(x, gamma[:3], beta[:3])
    with pytest.raises(ValueError, match='eps must be positive'):
        TF.batch_normalization(x, gamma, beta, eps=0)
    with pytest.raises(TypeError, match=r'x is float32 and gamma float16; supported \(x, gamma\)'):
        TF.batch_normalization(x, gamma.astype(numpy.float16), beta.astype(numpy.float16))
    with pytest.raises(ValueError, match='at least one row'):
        TF.batch_normalization(x[:0], gamma, beta)


# ---- links ----------------------------------------------------------------------------------------

def test_link_matches_chainer_link_on_transposed_data(path):
    r = numpy.random.RandomState(0)
    nchw = L.BatchNormalization(6, decay=0.7, eps=1e-4)
    nchw.gamma.array[...] = r.rand(6) + 0.5
    nchw.beta.array[...] = r.randn(6)
    nhwc = TL.BatchNormalization(6, decay=0.7, eps=1e-4)
    nhwc.copyparams(nchw)
    x = r.randn(3, 6, 4, 5).astype(numpy.float32)
    for _ in range(3):
        y_ref = nchw(x)
        y = nhwc(x.transpose(0, 2, 3, 1))
        numpy.testing.assert_allclose(y.array, y_ref.array.transpose(0, 2, 3, 1), atol=1e-5)
    numpy.testing.assert_allclose(nhwc.avg_mean, nchw.avg_mean, rtol=1e-5, atol=1e-7)
    numpy.testing.assert_allclose(nhwc.avg_var, nchw.avg_var, rtol=1e-5)
    with chainer.using_config('train', False):
        numpy.testing.assert_allclose(nhwc(x.transpose(0, 2, 3, 1)).array,
                                      nchw(x).array.transpose(0, 2, 3, 1), atol=1e-5)


def test_link_finetune_and_lazy_size(path):
    x = numpy.random.RandomState(1).randn(4, 2, 2, 3).astype(numpy.float32)
    ref = L.BatchNormalization(axis=(0, 1, 2))
    ours = TL.BatchNormalization()
    for _ in range(3):
        ref(x, finetune=True)
        ours(x, finetune=True)
    assert ours.N == ref.N == 3
    numpy.testing.assert_allclose(ours.avg_mean, ref.avg_mean, rtol=1e-6, atol=1e-7)
    numpy.testing.assert_allclose(ours.avg_var, ref.avg_var, rtol=1e-6)


def test_link_has_chainers_arguments_and_names(tmp_path):
    ours = TL.BatchNormAddReLU(5, decay=0.8, eps=1e-3, use_gamma=False, initial_beta=0.5,
                               dtype=numpy.float16)
    assert ours.gamma is None and ours.beta.dtype == numpy.float16
    assert (ours.beta.array == numpy.float16(0.5)).all()
    ref = L.BatchNormalization(5)
    ref.avg_mean[...] = 3
    serializers.save_npz(str(tmp_path / 'bn.npz'), ref)
    mine = TL.BatchNormalization(5)
    serializers.load_npz(str(tmp_path / 'bn.npz'), mine)
    assert (mine.avg_mean == 3).all()
    assert sorted(n for n, _ in mine.namedparams()) == sorted(n for n, _ in ref.namedparams())
    with pytest.raises(ValueError, match='axis=.* is not supported'):
        TL.BatchNormalization(5, axis=(0, 2, 3))


def test_link_rejects_nchw_input_with_a_clear_message():
    bn = TL.BatchNormAddReLU(64)
    with pytest.raises(ValueError, match=r'expects channels-last \(NHWC\) input with its 64 '
                                         r'channels on the last axis; got shape \(2, 64, 7, 7\)'):
        bn(numpy.zeros((2, 64, 7, 7), numpy.float32))


def test_add_relu_link(path):
    x, gamma, beta, z = data((2, 3, 3, 4), numpy.float32, numpy.float32)
    link = TL.BatchNormAddReLU(4)
    link.gamma.array[...], link.beta.array[...] = gamma, beta
    ref = copy.deepcopy(link)
    y = link(x, z)
    y_ref = F.relu(F.batch_normalization(x, gamma, beta, axis=(0, 1, 2)) + z)
    numpy.testing.assert_allclose(y.array, y_ref.array, atol=1e-5)
    numpy.testing.assert_allclose(link(x).array, F.relu(F.batch_normalization(
        x, gamma, beta, axis=(0, 1, 2))).array, atol=1e-5)
    assert ref.N == 0


# ---- GPU ----------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize('dtype,pdtype', PAIRS)
def test_gpu_kernels_equal_numpy_path(dtype, pdtype):
    import cupy
    x, gamma, beta, z = data((4, 7, 7, 64), dtype, pdtype)
    gy = numpy.random.RandomState(2).randn(*x.shape).astype(dtype)
    out = []
    for xp in (numpy, cupy):
        rm, rv = xp.zeros(64, pdtype), xp.ones(64, pdtype)
        vs = [chainer.Variable(xp.asarray(a)) for a in (x, gamma, beta, z)]
        y = TF.batch_normalization_add_relu(vs[0], vs[3], vs[1], vs[2], running_mean=rm,
                                            running_var=rv)
        y.grad = xp.asarray(gy)
        y.backward()
        out.append([chainer.backends.cuda.to_cpu(a) for a in
                    [y.array, rm, rv] + [v.grad for v in vs]])
    t = tol(dtype)
    for a, b in zip(*out):
        numpy.testing.assert_allclose(b.astype('f8'), a.astype('f8'), atol=t['atol'] * 10,
                                      rtol=t['rtol'] * 10)


def test_numpy_path_keeps_xhat_instead_of_x():
    """The NumPy path's backward reads xhat = (x - mean) * invstd, kept by forward, so x itself is
    not retained: an intermediate input is freed after forward (memory: in float32 xhat takes x's
    place), and the gradients are those of a run that keeps x alive. Without backprop nothing is
    kept."""
    import gc
    import weakref
    from chainer_tc import functions as TF
    r = numpy.random.RandomState(3)
    x0 = r.randn(4, 3, 3, 8).astype(numpy.float32)
    g, b = r.rand(8).astype(numpy.float32) + 0.5, r.randn(8).astype(numpy.float32)
    gy = r.randn(*x0.shape).astype(numpy.float32)

    def run(keep):
        xv = chainer.Variable(x0.copy())
        h = xv * 2                        # an intermediate: only BN could keep its array alive
        alive = weakref.ref(h.array)
        y = TF.batch_normalization_add_relu(h, None, g, b)
        kept = h if keep else None
        del h
        gc.collect()
        freed = alive() is None
        y.grad = gy
        y.backward()
        del kept
        return freed, xv.grad

    freed, gx = run(keep=False)
    _, gx_kept = run(keep=True)
    assert freed, 'BN kept x alive'
    assert numpy.array_equal(gx, gx_kept)
    y = TF.batch_normalization_add_relu(x0, None, g, b)
    with chainer.no_backprop_mode():
        y_nograd = TF.batch_normalization_add_relu(x0, None, g, b)
    assert y_nograd.creator is None and numpy.array_equal(y_nograd.array, y.array)
    assert y.creator.xhat is not None


# ---- the cuDNN fused path: when it applies ----------------------------------------------------------

from chainer_tc.functions import _bn_cudnn  # noqa: E402


@pytest.mark.parametrize('kwargs,reason', [
    (dict(), None),
    (dict(is_cupy=False), 'not a CuPy array'),
    (dict(fixed=True), 'inference'),
    (dict(x_dtype=numpy.float32), 'float16 data only'),
    (dict(x_shape=(8, 64)), 'needs 4-D NHWC data'),
    (dict(x_shape=(8, 7, 7, 66)), 'channel count divisible by 4'),
    (dict(gamma_dtype=numpy.float16), 'float32 gamma'),
    (dict(running_dtype=numpy.float16), 'float32 running statistics'),
    (dict(eps=-1.0), 'below CUDNN_BN_MIN_EPSILON'),
    (dict(x_shape=(1, 1, 1, 64)), 'single row per channel'),
])
def test_cudnn_eligibility(kwargs, reason):
    args = dict(is_cupy=True, x_dtype=numpy.float16, x_shape=(8, 7, 7, 64),
                gamma_dtype=numpy.float32, running_dtype=numpy.float32, relu=True, eps=2e-5,
                fixed=False)
    args.update(kwargs)
    ok, why = _bn_cudnn.eligibility(**args)
    assert ok == (reason is None)
    if reason:
        assert reason in why
    with chainer.using_config('use_cudnn', 'never'):
        assert _bn_cudnn.eligibility(**dict(args, **kwargs))[0] is False


def test_cudnn_eligibility_says_why_no_cudnn_loads(monkeypatch):
    from chainer_tc.cuda import cudnn
    monkeypatch.setattr(cudnn, 'unavailable_reason', lambda: 'no usable cuDNN: none here')
    ok, why = _bn_cudnn.eligibility(True, numpy.float16, (8, 7, 7, 64), numpy.float32,
                                    numpy.float32, True, 2e-5, False)
    assert (ok, why) == (False, 'no usable cuDNN: none here')


class _CudnnChosen:
    """Stands in for cuDNN's fused path on NumPy arrays: records that it was reached."""
    calls = 0

    def __init__(self, x, has_z, relu):
        type(self).calls += 1

    def forward(self, x, z, gamma, beta, eps, decay, running_mean, running_var):
        return numpy.zeros_like(x)


@pytest.fixture
def cudnn_chosen(monkeypatch):
    """Every training call is declared eligible for cuDNN (as a CuPy float16 call would be)."""
    _CudnnChosen.calls = 0
    monkeypatch.setattr(_bn_cudnn, 'eligibility', lambda *a: (True, None))
    monkeypatch.setattr(_bn_cudnn, 'FusedBatchNorm', _CudnnChosen)
    return _CudnnChosen


def test_cudnn_branch_refuses_an_empty_batch_before_calling_cudnn(cudnn_chosen):
    from chainer_tc import functions as TF
    x = numpy.zeros((0, 2, 2, 8), numpy.float16)
    g, b = numpy.ones(8, numpy.float32), numpy.zeros(8, numpy.float32)
    with pytest.raises(ValueError, match='at least one row'):
        TF.batch_normalization_add_relu(x, None, g, b)
    assert cudnn_chosen.calls == 0
    TF.batch_normalization_add_relu(numpy.ones((2, 2, 2, 8), numpy.float16), None, g, b)
    assert cudnn_chosen.calls == 1, 'the stand-in is reached for a legal batch'


def test_cudnn_branch_warns_of_a_single_row_like_the_other_paths(cudnn_chosen):
    import sys
    import warnings
    from chainer_tc import functions as TF
    sys.modules['chainer_tc.functions.batch_normalization']._WARNED_SINGLE_SAMPLE.clear()
    g, b = numpy.ones(8, numpy.float32), numpy.zeros(8, numpy.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        TF.batch_normalization_add_relu(numpy.ones((1, 1, 1, 8), numpy.float16), None, g, b)
    assert [w for w in caught if 'single sample' in str(w.message)]
    assert caught[0].filename == __file__, 'the warning points at the caller of the function'


@pytest.mark.gpu
@pytest.mark.parametrize('with_z', [True, False])
def test_cudnn_ex_path_is_taken_and_matches(cudnn_stack, monkeypatch, with_z):
    import cupy
    from chainer_tc.cuda import cudnn
    calls = []
    lib = cudnn.binding()       # our ctypes binding: the calls that may run under capture
    for name in ('batch_normalization_forward_training_ex', 'batch_normalization_backward_ex'):
        real = getattr(lib, name)
        monkeypatch.setattr(lib, name, lambda *a, _real=real, _n=name: (calls.append(_n),
                                                                         _real(*a))[1])
    x, gamma, beta, z = data((4, 7, 7, 64), numpy.float16, numpy.float32, with_z=with_z)
    gy = numpy.random.RandomState(2).randn(*x.shape).astype(numpy.float16)
    out = []
    for xp in (numpy, cupy):
        rm, rv = xp.zeros(64, numpy.float32), xp.ones(64, numpy.float32)
        vs = [chainer.Variable(xp.asarray(a)) for a in (x, gamma, beta)]
        zv = chainer.Variable(xp.asarray(z)) if with_z else None
        y = TF.batch_normalization_add_relu(vs[0], zv, vs[1], vs[2], running_mean=rm,
                                            running_var=rv)
        y.grad = xp.asarray(gy)
        y.backward()
        grads = [v.grad for v in vs] + ([zv.grad] if with_z else [])
        out.append([chainer.backends.cuda.to_cpu(a) for a in [y.array, rm, rv] + grads])
    assert calls == ['batch_normalization_forward_training_ex',
                     'batch_normalization_backward_ex']
    for a, b in zip(*out):
        numpy.testing.assert_allclose(b.astype('f8'), a.astype('f8'), atol=3e-2, rtol=2e-2)


@pytest.mark.gpu
def test_cudnn_ex_path_not_taken_for_float32(cudnn_stack, monkeypatch):
    import cupy
    from chainer_tc.cuda import cudnn
    monkeypatch.setattr(cudnn.binding(), 'batch_normalization_forward_training_ex',
                        lambda *a: pytest.fail('cuDNN Ex must not be used for float32'))
    x, gamma, beta, z = data((2, 3, 3, 8), numpy.float32, numpy.float32)
    y = TF.batch_normalization_add_relu(cupy.asarray(x), cupy.asarray(z), cupy.asarray(gamma),
                                        cupy.asarray(beta))
    assert y.creator.cudnn_reason.startswith('cuDNN fuses BN+Add+ReLU for float16 data only')


def test_non_contiguous_input(path):
    base = numpy.random.RandomState(0).randn(2, 3, 3, 16).astype(numpy.float32)
    x = base[..., :8]                                  # a channel slice: not C-contiguous
    gamma, beta = numpy.ones(8, numpy.float32), numpy.zeros(8, numpy.float32)
    y = TF.batch_normalization(x, gamma, beta)
    numpy.testing.assert_allclose(y.array, TF.batch_normalization(x.copy(), gamma, beta).array,
                                  rtol=1e-6, atol=1e-6)


def test_running_statistics_dtype_must_match_the_accumulation(path):
    x, gamma, beta, _ = data((2, 3, 3, 8), numpy.float64, numpy.float64)
    with pytest.raises(TypeError, match='running_mean is float32 but x is float64'):
        TF.batch_normalization(x, gamma, beta, running_mean=numpy.zeros(8, numpy.float32),
                               running_var=numpy.ones(8, numpy.float32))


def test_empty_batch_in_inference(path):
    x = numpy.zeros((0, 2, 2, 8), numpy.float32)
    g, b = numpy.ones(8, numpy.float32), numpy.zeros(8, numpy.float32)
    xv = chainer.Variable(x)
    y = TF.fixed_batch_normalization(xv, g, b, numpy.zeros(8, 'f'), numpy.ones(8, 'f'))
    y.grad = numpy.zeros_like(x)
    y.backward()
    assert y.shape == x.shape and xv.grad.shape == x.shape


def test_single_sample_batch_statistics_warn_once_per_shape():
    import sys
    import warnings
    from chainer_tc import functions as TF
    sys.modules['chainer_tc.functions.batch_normalization']._WARNED_SINGLE_SAMPLE.clear()
    x = numpy.ones((1, 1, 1, 3), numpy.float32)
    g, b = numpy.ones(3, numpy.float32), numpy.zeros(3, numpy.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for _ in range(3):
            TF.batch_normalization(x, g, b)
        TF.batch_normalization(numpy.ones((1, 1, 1, 5), numpy.float32), numpy.ones(5, 'f'),
                               numpy.zeros(5, 'f'))
    messages = [str(w.message) for w in caught if 'single sample' in str(w.message)]
    assert len(messages) == 2 and '(1, 1, 1, 3)' in messages[0]


# ---- the two kernel paths: two channels per thread (vector accesses) and one ----------------------

def _offset_copy(a):
    """``a`` in an array that starts one element past an aligned allocation (a flat slice
    ``base[1:]``): C-contiguous, not aligned to two elements."""
    base = numpy.empty(a.size + 1, a.dtype)
    assert base.ctypes.data % (2 * a.dtype.itemsize) == 0
    view = base[1:].reshape(a.shape)
    view[...] = a
    return view


def _apply_widths(counts, kinds=('bn_apply', 'bn_backward_apply')):
    """{'bn_apply': width, 'bn_backward_apply': width} of the launches counted (or of ``kinds``)."""
    return {k.split('<')[0]: k.rsplit(', ', 1)[1].rstrip('>') for k in counts
            if k.split('<')[0] in kinds}


_DATA_KERNELS = ('bn_stats_partial', 'bn_apply', 'bn_backward_partial', 'bn_backward_apply')


@pytest.mark.parametrize('dtype,pdtype', PAIRS)
@pytest.mark.parametrize('relu,with_z', [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize('shape', [(3, 5, 7, 64), (2, 3, 3, 2048), (37, 6), (9, 2)])
def test_misaligned_data_takes_the_one_channel_path_with_the_same_bits(monkeypatch, dtype, pdtype,
                                                                       relu, with_z, shape):
    """An even C takes two channels per thread (one vector access), in the reductions and the
    elementwise kernels; an offset view of x holds the launches that read it to one, with a
    warning each, and every output (the statistics too) is bitwise the same."""
    from chainer_tc import _tiles
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1')
    monkeypatch.setattr(_tiles, '_WARNED', set())
    x, gamma, beta, z = data(shape, dtype, pdtype, seed=11, with_z=with_z)
    gy = numpy.random.RandomState(12).randn(*shape).astype(dtype)
    out = []
    for inp in (x, _offset_copy(x)):
        rm, rv = numpy.zeros(shape[-1], pdtype), numpy.ones(shape[-1], pdtype)
        vs = [chainer.Variable(a) for a in (inp, gamma, beta) + ((z,) if with_z else ())]
        with kernels.count_launches() as c, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            zz = vs[3] if with_z else None
            if relu:
                y = TF.batch_normalization_add_relu(vs[0], zz, vs[1], vs[2], running_mean=rm,
                                                    running_var=rv)
            else:
                y = TF.batch_normalization(vs[0], vs[1], vs[2], running_mean=rm, running_var=rv)
            y.grad = gy
            y.backward()
        slow = [str(w.message) for w in caught
                if issubclass(w.category, chainer.warnings.PerformanceWarning)]
        out.append(([y.array, rm, rv] + [v.grad for v in vs],
                    _apply_widths(c.per_kernel, _DATA_KERNELS), slow))
    (r0, k0, w0), (r1, k1, w1) = out
    assert k0 == {k: '2' for k in _DATA_KERNELS} and not w0
    assert k1 == {k: '1' for k in _DATA_KERNELS}
    assert [m.split(' takes')[0] for m in w1] == ['chainer_tc: ' + k for k in _DATA_KERNELS]
    assert all('x starts at an address that is not a multiple of {} bytes'.format(
        2 * numpy.dtype(dtype).itemsize) in m for m in w1)
    for a, b in zip(r0, r1):
        numpy.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('C,width', [(3, '1'), (33, '1'), (2, '2'), (64, '2'), (2048, '2')])
def test_channel_count_chooses_the_path_and_matches_numpy(monkeypatch, C, width):
    """Odd C: one channel per thread, silently (the only path there); even C: two, in the
    statistics' reduction and the elementwise launch. Both match the NumPy path; the fixed
    (inference) launch too."""
    x, gamma, beta, z = data((7, C), numpy.float32, numpy.float32, seed=C)
    mean, var = numpy.linspace(-1, 1, C).astype('f'), numpy.linspace(0.5, 2, C).astype('f')
    out = []
    for emulate in ('0', '1'):
        monkeypatch.setenv('CHAINER_TC_EMULATE', emulate)
        with kernels.count_launches() as c, warnings.catch_warnings():
            warnings.simplefilter('error', chainer.warnings.PerformanceWarning)
            y = TF.batch_normalization_add_relu(x, z, gamma, beta).array
            yf = TF.fixed_batch_normalization(x, gamma, beta, mean, var).array
        out.append((y, yf))
    assert _apply_widths(c.per_kernel, _DATA_KERNELS) == {'bn_stats_partial': width,
                                                           'bn_apply': width}
    for a, b in zip(*out):
        numpy.testing.assert_allclose(b, a, rtol=1e-5, atol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize('dtype,pdtype', PAIRS)
def test_gpu_aligned_and_offset_data_give_the_same_bits(dtype, pdtype):
    import cupy
    x, gamma, beta, z = data((4, 7, 7, 64), dtype, pdtype)
    gy = numpy.random.RandomState(2).randn(*x.shape).astype(dtype)
    base = cupy.empty(x.size + 1, dtype)
    view = base[1:].reshape(x.shape)          # data.ptr one element past an aligned allocation
    view[...] = cupy.asarray(x)
    out = []
    for inp in (cupy.asarray(x), view):
        vs = [chainer.Variable(a) for a in (inp, cupy.asarray(gamma), cupy.asarray(beta))]
        with kernels.count_launches() as c:
            # fixed statistics: our kernels on every path (training float16 may go to cuDNN)
            y = TF.fixed_batch_normalization(vs[0], vs[1], vs[2], cupy.zeros(64, pdtype),
                                             cupy.ones(64, pdtype))
            y.grad = cupy.asarray(gy)
            y.backward()
        out.append(([cupy.asnumpy(a) for a in [y.array] + [v.grad for v in vs]],
                    _apply_widths(c.per_kernel)))
    assert out[0][1] == {'bn_apply': '2', 'bn_backward_apply': '2'}
    assert out[1][1] == {'bn_apply': '1', 'bn_backward_apply': '1'}
    for a, b in zip(out[0][0], out[1][0]):
        numpy.testing.assert_array_equal(a, b)


# ---- the partial reductions: shifted sums, two channels per thread -------------------------------

def _partial(x, per, width):
    """bn_stats_partial<T, width> of ``x`` (rows, C) in row blocks of ``per`` rows, emulated:
    the (count, mean, M2) array, shape (blocks, C, 3)."""
    from chainer_tc.functions import _bn_kernels as K
    rows, C = x.shape
    blocks = -(-rows // per)
    partial = numpy.full((blocks, C, 3), numpy.nan, K.acc_dtype(x.dtype))
    K._kernel('bn_stats_partial', x.dtype, xp=numpy, width=width)(
        (-(-C // (width * K.TILE_C)), blocks), (K.TILE_C, K.ROWS),
        (x, numpy.int64(rows), numpy.int32(C), numpy.int64(per), partial))
    return partial


def _reference_partial(x, per):
    """(exact, mean bound, M2 bound) of bn_stats_partial's (count, mean, M2) per row block of
    ``per`` rows and channel.

    exact: float64, computed around the block's first value (so that v - K0 is exact, also for
    float64 data near 1e8, where a plain float64 mean would be off by more than our bound).

    The bounds follow the kernel's arithmetic: each of the BN_ROWS threads sums its n values
    d = v - K (K its first value; d exact for these data: v and K within a factor 2, or float16/32
    values in float64), s1 = sum d and s2 = sum d^2 by recursive summation, which errs by at most
    (n - 1) u sum|terms| each. M2 = s2 - s1 * (s1 / n) then errs by at most ~3 n u s2 (s1's
    error enters as 2 |s1| err(s1) / n <= 2 (n - 1) u s2, since |s1| sum|d| <= n s2), and the
    mean K + s1 / n by u sum|d| plus its roundings (of thread means, |mean| + delta). K is one of
    the thread's values, so s2 <= (n + 1) M2_thread: that part is ~n^2 u of the spread whatever
    the offset. The 7 Chan merges of a block's threads (as before the shifted sums) add a few u
    of M2 and of |mean|, and, in delta^2 n nb / total with delta the difference of two thread
    means, each rounded to u |mean|: 2 |delta| (2 u |mean| + u |delta|) n nb / total per merge,
    n nb / total <= rows / 4 (for data far from 0 this term, not the sums, is the larger:
    1e8 + N(0, 1) in float64)."""
    u = numpy.finfo(numpy.float64 if x.dtype == numpy.float64 else numpy.float32).eps / 2
    rows_step = 8                           # BN_ROWS: thread t of a block reads rows t, t + 8, ...
    v = x.astype(numpy.float64)
    exact, mean_bound, m2_bound = [], [], []
    for b0 in range(0, v.shape[0], per):
        block = v[b0:b0 + per]
        d0 = block - block[0]
        dmean = d0.mean(0)
        mean, m2 = block[0] + dmean, ((d0 - dmean) ** 2).sum(0)
        exact.append(numpy.stack([numpy.full(v.shape[1], len(block), numpy.float64), mean, m2], 1))
        s2_err, s1_err = numpy.zeros(v.shape[1]), numpy.zeros(v.shape[1])
        spread = numpy.zeros(v.shape[1])    # the largest |thread mean - block mean|
        for t in range(rows_step):
            vals = block[t::rows_step]
            if len(vals):
                d = vals - vals[0]
                s2_err += 3 * len(vals) * u * (d * d).sum(0)
                s1_err = numpy.maximum(s1_err, u * numpy.abs(d).sum(0))
                spread = numpy.maximum(spread, numpy.abs(d.mean(0) + vals[0] - mean))
        delta = 2 * spread
        merges = ((rows_step - 1) * 2 * delta * (2 * u * numpy.abs(mean) + u * delta)
                  * len(block) / 4)
        m2_bound.append(s2_err + merges + 16 * u * m2)
        mean_bound.append(s1_err + 10 * u * (numpy.abs(mean) + delta))
    return numpy.array(exact), numpy.array(mean_bound), numpy.array(m2_bound)


@pytest.mark.parametrize('dtype,loc,scale,C', [
    (numpy.float32, 1000.0, 1.0, 6),        # 1000 + N(0, 1): mean/std 1000
    (numpy.float16, 60000.0, 100.0, 6),     # float16 near its largest (65504), spacing 32
    (numpy.float32, 0.5, 2.0, 5),           # the usual spread; odd C: one channel per thread
    (numpy.float64, 1e8, 1.0, 4),
])
@pytest.mark.parametrize('per', [4001, 37])
def test_shifted_sums_match_float64_despite_a_large_offset(monkeypatch, dtype, loc, scale, C, per):
    """The partial statistics (count, mean, M2) of data far from 0 relative to its spread, where a
    plain sum of squares in float32 loses every digit, against NumPy's float64 of the same
    values: within the bounds of _reference_partial (one block of 4001 rows: 500 values per
    thread; blocks of 37 rows: 4 or 5)."""
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1')
    r = numpy.random.RandomState(3)
    x = (loc + scale * r.randn(4001, C)).astype(dtype)
    exact, mean_bound, bound = _reference_partial(x, per)
    assert (bound <= 2e-2 * exact[:, :, 2]).all(), 'the bound says something'
    widths = (1, 2) if C % 2 == 0 else (1,)
    got = {w: _partial(x, per, w) for w in widths}
    for w in widths:
        numpy.testing.assert_array_equal(got[w][:, :, 0], exact[:, :, 0])
        assert (numpy.abs(got[w][:, :, 1] - exact[:, :, 1]) <= mean_bound).all(), w
        assert (numpy.abs(got[w][:, :, 2] - exact[:, :, 2]) <= bound).all(), w
    if len(widths) == 2:
        numpy.testing.assert_array_equal(got[2], got[1])
    if dtype == numpy.float32 and loc == 1000.0:
        # the data is hard: sum v^2 - (sum v)^2 / n in float32 is off by orders of magnitude
        v = x[:per].astype(numpy.float32)
        naive = (v * v).sum(0, dtype=numpy.float32) - v.sum(0, dtype=numpy.float32) ** 2 / len(v)
        assert (numpy.abs(naive - exact[0, :, 2]) > 10 * bound[0]).any()


@pytest.mark.parametrize('dtype,pdtype', PAIRS)
def test_statistics_of_large_offset_data_through_the_callers_path(monkeypatch, dtype, pdtype):
    """1000 + N(0, 1) (float16: 1000 + 8 N(0, 1), spacing 0.5 there) through the training
    forward's statistics (1000 row blocks of 40 rows, 5 rows per thread, merged in chains of up
    to 8, then 63 + 16 by the finalize): running mean and variance (decay 0: this batch's)
    against NumPy's float64 of the same values. The merges dominate at this offset: each adds
    delta^2 w (w = n nb / total, delta ~ sigma / sqrt(w) the difference of two means, each
    rounded to u |mean|), an error of up to 4 u |mean| |delta| w ~ 4 u (|mean| / sigma) sigma^2
    sqrt(w); over ~1000 merges of blocks of 40 rows (w <= 40) against M2 = 40000 sigma^2 that is
    at most 4 u 1000 * 1000 sqrt(40) / 40000 = 4e-5 in float32 (measured: 9e-7, the roundings'
    signs vary); float64 1e-12; float16 running statistics their own rounding, 2^-11."""
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1')
    r = numpy.random.RandomState(4)
    scale = 8.0 if dtype == numpy.float16 else 1.0
    x = (1000 + scale * r.randn(40000, 4)).astype(dtype)
    gamma, beta = numpy.ones(4, pdtype), numpy.zeros(4, pdtype)
    rm, rv = numpy.zeros(4, pdtype), numpy.zeros(4, pdtype)
    with kernels.count_launches() as c:
        TF.batch_normalization(x, gamma, beta, running_mean=rm, running_var=rv, decay=0.0)
    assert 'bn_stats_partial<{}, 2>'.format(
        {numpy.float16: '__half', numpy.float32: 'float', numpy.float64: 'double'}[dtype]) \
        in c.per_kernel
    v = x.astype(numpy.float64)
    rtol = {numpy.float64: 1e-12, numpy.float32: 4e-5, numpy.float16: 1e-3}[pdtype]
    numpy.testing.assert_allclose(rm.astype('f8'), v.mean(0), rtol=max(rtol, 1e-7))
    numpy.testing.assert_allclose(rv.astype('f8'), v.var(0, ddof=1), rtol=rtol)


@pytest.mark.parametrize('C', [4, 5])
@pytest.mark.parametrize('rows', [9, 300])
def test_nan_and_inf_reach_the_statistics(monkeypatch, rows, C):
    """A NaN or an inf anywhere in a channel (a thread's first value, its shift K, or a later
    one; a thread with one value) makes that channel's variance NaN, hence invstd and every
    output of the channel NaN, and its mean NaN or inf, as NumPy's (and Chainer's) statistics;
    the other channels stay finite and match NumPy's float64."""
    from chainer_tc.functions import _bn_kernels as K
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1')
    x = numpy.random.RandomState(5).randn(rows, C).astype(numpy.float32)
    if rows == 9:            # one block of 9 rows: thread 0 has rows 0 and 8, threads 1-7 one
        x[0, 0] = numpy.nan      # thread 0's shift K
        x[8, 1] = numpy.inf      # a later value
        x[3, 2] = -numpy.inf     # the only value of thread 3
    else:                    # 10 blocks of 30 rows
        x[30, 0] = numpy.nan     # block 1, thread 0's first row
        x[45, 1] = numpy.inf     # block 1, thread 7's second row
        x[299, 2] = -numpy.inf   # the last block's last row
    rm, rv = numpy.zeros(C, numpy.float32), numpy.ones(C, numpy.float32)
    mean, invstd = K.statistics(x, 2e-5, 0.9, rm, rv, numpy)
    with numpy.errstate(invalid='ignore'):
        var64 = x.astype(numpy.float64).var(0)
    bad = numpy.isnan(var64)
    assert bad[:3].all() and not bad[3:].any()
    numpy.testing.assert_array_equal(numpy.isnan(invstd), bad)
    numpy.testing.assert_array_equal(numpy.isnan(rv), bad)
    assert (numpy.isnan(mean[bad]) | numpy.isinf(mean[bad])).all()
    good = ~bad
    numpy.testing.assert_allclose(mean[good], x[:, good].astype('f8').mean(0), rtol=1e-5,
                                  atol=1e-6)
    numpy.testing.assert_allclose(invstd[good], 1 / numpy.sqrt(var64[good] + 2e-5), rtol=1e-5)
    y = TF.batch_normalization(x, numpy.ones(C, 'f'), numpy.zeros(C, 'f')).array
    assert numpy.isnan(y[:, bad]).all() and numpy.isfinite(y[:, good]).all()


@pytest.mark.parametrize('dtype,pdtype', PAIRS)
@pytest.mark.parametrize('relu', [1, 0])
def test_partial_kernels_two_channels_give_the_bits_of_one(dtype, pdtype, relu):
    """bn_stats_partial and bn_backward_partial with two channels per thread compute each channel
    as with one, bit for bit: two row blocks of 151 and 150 rows (18 or 19 rows per thread, so
    the loops that load several rows before adding them run, with their remainders), every
    output of the six launches compared."""
    from chainer_tc.testing import kernel_cases
    backend = kernel_cases.EmulatorBackend()
    out = {}
    for w in (1, 2):
        case = kernel_cases._batchnorm(301, 6, dtype, pdtype, relu=relu, width=w, row_blocks=2)
        assert {k.kernel for k in case.launches if 'partial' in k.kernel} == {
            'bn_stats_partial<{}, {}>'.format(kernel_cases._CTYPE[numpy.dtype(dtype)], w),
            'bn_backward_partial<{}, {}>'.format(kernel_cases._CTYPE[numpy.dtype(dtype)], w)}
        out[w], _ = kernel_cases.run(case, backend)
        for name, (expected, rtol, atol) in case.reference(case.arrays).items():
            numpy.testing.assert_allclose(out[w][name].astype('f8'), expected, rtol=rtol,
                                          atol=atol, err_msg=name)
    for name in out[1]:
        numpy.testing.assert_array_equal(out[2][name], out[1][name], err_msg=name)


def test_chainers_old_test_argument_and_variable_statistics_are_refused_with_the_reason():
    bn = TL.BatchNormalization(3)
    x = numpy.zeros((2, 2, 2, 3), numpy.float32)
    with pytest.raises(ValueError, match=r"test argument is not supported anymore. Use "
                                         r"chainer.using_config\('train', False\)"):
        bn(x, test=True)
    with pytest.raises(TypeError, match='unexpected keyword argument'):
        bn(x, finetne=True)
    mean, var = chainer.Variable(numpy.zeros(3, numpy.float32)), numpy.ones(3, numpy.float32)
    with pytest.raises(TypeError, match=r'mean is a Variable: .* pass mean.array'):
        TF.fixed_batch_normalization(x, bn.gamma, bn.beta, mean, var)
