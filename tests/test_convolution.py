"""NHWC convolution_2d and the Convolution2D link against Chainer's NCHW ones on transposed data;
gradient checks; npz round trips between NCHW and NHWC models."""
import itertools
import pickle
import tracemalloc
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
from chainer_tc import links as TL


def nchw(a):
    return numpy.ascontiguousarray(a.transpose(0, 3, 1, 2))


def nhwc(a):
    return numpy.ascontiguousarray(a.transpose(0, 2, 3, 1))


# (ksize, stride, pad, dilate, groups, bias, batch, H, W): the grid, covered pairwise
GRID = [(k, s, p, d, g, b, n, h, w) for (k, s, p, d, g, b), (n, h, w) in zip(
    [(1, 1, 0, 1, 1, True), (3, 1, 1, 1, 1, False), (3, 2, 1, 1, 2, True), (7, 2, 3, 1, 1, True),
     (3, 1, 1, 2, 1, False), (3, 2, 0, 2, 2, True), (1, 2, 0, 1, 2, False), (7, 1, 3, 2, 1, False)],
    itertools.cycle([(1, 9, 7), (2, 8, 11), (3, 13, 9), (4, 7, 7)]))]
TOL = {numpy.float64: dict(atol=1e-12, rtol=1e-12),
       # float32: the same float32 BLAS calls, transposed inputs: bitwise or a few ulps
       numpy.float32: dict(atol=1e-5, rtol=1e-5),
       # float16: identical algorithm on identical float16 data; sums of up to 7*7*4 products
       # rounded to float16 (2^-11 relative of |y| ~ 10)
       numpy.float16: dict(atol=2e-2, rtol=1e-2)}


def problem(case, dtype, seed=0):
    k, s, p, d, g, bias, n, h, w = case
    r = numpy.random.RandomState(seed)
    cin, cout = 4, 6
    x = r.randn(n, h, w, cin).astype(dtype)
    W = (r.randn(cout, k, k, cin // g) * 0.3).astype(dtype)
    b = r.randn(cout).astype(dtype) if bias else None
    return x, W, b, dict(stride=s, pad=p, dilate=d, groups=g)


def grads(f, inputs, gy):
    vs = [None if a is None else chainer.Variable(a) for a in inputs]
    y = f(*vs)
    y.grad = gy
    y.backward()
    return [y.array] + [None if v is None else v.grad for v in vs]


@pytest.mark.parametrize('case', GRID)
@pytest.mark.parametrize('dtype', [numpy.float64, numpy.float32, numpy.float16])
def test_matches_chainer_on_transposed_data(case, dtype):
    x, W, b, kw = problem(case, dtype)
    y = TF.convolution_2d(x, W, b, **kw)
    gy = numpy.random.RandomState(1).randn(*y.shape).astype(dtype)
    ours = grads(lambda x, W, b: TF.convolution_2d(x, W, b, **kw), (x, W, b), gy)
    ref = grads(lambda x, W, b: F.convolution_2d(x, W, b, **kw), (nchw(x), nchw(W), b), nchw(gy))
    for name, a, r in zip(('y', 'gx', 'gW', 'gb'), ours, ref):
        if a is None:
            continue
        r = r if r.ndim == 1 else nhwc(r)
        numpy.testing.assert_allclose(a.astype('f8'), r.astype('f8'), err_msg=name, **TOL[dtype])


@pytest.mark.parametrize('case', GRID[:4])
def test_gradient_check_float64(case):
    x, W, b, kw = problem(case, numpy.float64, seed=2)
    gy = numpy.random.RandomState(3).randn(*TF.convolution_2d(x, W, b, **kw).shape)
    inputs = (x, W) if b is None else (x, W, b)
    gradient_check.check_backward(lambda *a: TF.convolution_2d(*a, **kw), inputs, gy, eps=1e-6,
                                  atol=1e-7, rtol=1e-6)


# (ksize, stride, pad, dilate, groups): the input gradient as one convolution of the padded output
# gradient (stride 1, pad within the dilated window, one group) and, for the rest, the per-tap
# scatter
SPREAD = [(3, 1, 1, 1, 1), (5, 1, 1, 2, 1), (3, 1, 0, 1, 1), (2, 1, 1, 1, 1), (4, 1, 3, 1, 1)]
SCATTER = [(1, 1, 1, 1, 1), (3, 1, 3, 1, 1), (3, 2, 1, 1, 2), (3, 2, 1, 1, 1), (3, 3, 2, 1, 1),
           (4, 2, 1, 1, 1), (2, 3, 1, 2, 1), (1, 2, 0, 1, 1)]


@pytest.mark.parametrize('geometry', SPREAD + SCATTER)
@pytest.mark.parametrize('dtype', [numpy.float64, numpy.float16])
def test_input_gradient_of_both_cpu_paths_matches_chainer(geometry, dtype):
    from chainer_tc.functions import _conv_numpy
    k, s, p, d, g = geometry
    kwargs = dict(stride=s, pad=p, dilate=d, groups=g)
    spread = _conv_numpy._spread(_conv_numpy.Geometry((s, s), (p, p), (d, d), g), k, k)
    assert (spread is not None) == (geometry in SPREAD)
    r = numpy.random.RandomState(4)
    x = r.randn(2, 9, 8, 4).astype(dtype)
    W = (r.randn(6, k, k, 4 // g) * 0.3).astype(dtype)
    gy = r.randn(*TF.convolution_2d(x, W, **kwargs).shape).astype(dtype)
    ours = grads(lambda x, W: TF.convolution_2d(x, W, **kwargs), (x, W), gy)
    ref = grads(lambda x, W: F.convolution_2d(x, W, **kwargs), (nchw(x), nchw(W)), nchw(gy))
    numpy.testing.assert_allclose(ours[1].astype('f8'), nhwc(ref[1]).astype('f8'), **TOL[dtype])


@pytest.mark.parametrize('geometry', SPREAD + SCATTER)
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float16])
def test_the_patch_matrix_is_copied_once(geometry, dtype):
    # the copy of the strided patches is made in C order, so that making it 2-D is a view: a
    # copy in the view's own stride order (astype's default) was copied again by the reshape
    from chainer_tc.functions import _conv_numpy
    k, s, p, d, g = geometry
    x = numpy.random.RandomState(0).randn(2, 9, 8, 4).astype(dtype)
    geo = _conv_numpy.Geometry((s, s), (p, p), (d, d), 1)
    assert not geo.pointwise(k, k)              # (no patches there)
    tracemalloc.start()
    try:
        cols = _conv_numpy._columns(x, k, k, geo, numpy.float32)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    padded = (9 + 2 * p) * (8 + 2 * p) * 2 * 4 * x.itemsize
    assert peak < cols.nbytes + padded + 4096, (peak, cols.nbytes)    # (+ small objects)
    patches = _conv_numpy._patches(x, k, k, geo)
    numpy.testing.assert_array_equal(cols, patches.reshape(cols.shape).astype(numpy.float32))


def test_bad_input():
    x = numpy.zeros((1, 5, 5, 4), numpy.float32)
    W = numpy.zeros((6, 3, 3, 4), numpy.float32)
    with pytest.raises(chainer.utils.type_check.InvalidType):
        TF.convolution_2d(x, numpy.zeros((6, 4, 3, 3), numpy.float32))      # an OIHW filter
    with pytest.raises(ValueError, match='stride, dilate and groups must be >= 1'):
        TF.convolution_2d(x, W, stride=0)
    with pytest.raises(ValueError, match=r'leaves no output for input of shape \(1, 5, 5, 4\)'):
        TF.convolution_2d(x, numpy.zeros((6, 7, 7, 4), numpy.float32))


def test_arguments_in_chainers_order_and_types():
    """The sixth positional argument is cover_all, as in F.convolution_2d (True is refused,
    not taken for dilate); dilate and groups are keyword-only; a float or a bool is refused
    naming the argument, where int() would truncate it."""
    x = numpy.random.RandomState(0).randn(1, 7, 7, 4).astype(numpy.float32)
    W = numpy.random.RandomState(1).randn(6, 3, 3, 4).astype(numpy.float32)
    y = TF.convolution_2d(x, W, None, 2, 0, False)
    ref = F.convolution_2d(nchw(x), nchw(W), None, 2, 0, False)
    numpy.testing.assert_allclose(y.array, nhwc(ref.array), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r'cover_all=True is not supported'):
        TF.convolution_2d(x, W, None, 2, 0, True)
    with pytest.raises(TypeError):
        TF.convolution_2d(x, W, None, 1, 0, False, 2)             # dilate is keyword-only
    for kwargs, name in [(dict(stride=1.9), 'stride'), (dict(stride=(1.9, 1.9)), 'stride'),
                         (dict(stride=True), 'stride'), (dict(pad=(1.5, 1.5)), 'pad'),
                         (dict(dilate=numpy.float64(2)), 'dilate'), (dict(groups=1.9), 'groups'),
                         (dict(groups=True), 'groups')]:
        with pytest.raises(TypeError, match=r'^{} must be an int'.format(name)):
            TF.convolution_2d(x, W, **kwargs)
    with pytest.raises(TypeError, match=r'^ksize must be an int'):
        TF.max_pooling_2d(x, True)
    y = TF.convolution_2d(x, W, stride=numpy.int64(2), pad=(numpy.int32(1), 1))    # NumPy ints
    assert y.shape == (1, 4, 4, 6)


@pytest.mark.parametrize('backend', ['numpy', 'emulator'])
def test_float16_bias_gradient_is_accumulated_in_float32(monkeypatch, backend):
    """8192 rows of gradient near 1 per channel: a float16 running total stalls at 4096 (each
    row adds less than half its spacing); summed in float32 and rounded once, the bias gradient
    is within float16's rounding (2**-11) of the exact sum, as Chainer's (NCHW, pairwise)."""
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1' if backend == 'emulator' else '0')
    r = numpy.random.RandomState(0)
    x = r.randn(8, 32, 32, 8).astype(numpy.float16)
    W = (r.randn(8, 1, 1, 8) * 0.1).astype(numpy.float16)
    b = numpy.zeros(8, numpy.float16)
    gy = (r.rand(8, 32, 32, 8) + 0.5).astype(numpy.float16)
    gb = grads(lambda x, W, b: TF.convolution_2d(x, W, b), (x, W, b), gy)[3]
    exact = gy.astype(numpy.float64).reshape(-1, 8).sum(axis=0)
    assert gb.dtype == numpy.float16
    numpy.testing.assert_allclose(gb.astype(numpy.float64), exact, rtol=2 ** -11, atol=0)


# ---- the link --------------------------------------------------------------------------------------

@pytest.mark.parametrize('kwargs', [dict(ksize=3, pad=1), dict(ksize=1, stride=2, nobias=True),
                                    dict(ksize=3, pad=2, dilate=2, groups=2)])
def test_link_equals_chainer_link(kwargs):
    numpy.random.seed(7)
    ref = L.Convolution2D(4, 6, **kwargs)
    numpy.random.seed(7)
    ours = TL.Convolution2D(4, 6, **kwargs)
    numpy.testing.assert_array_equal(ours.W.array, nhwc(ref.W.array))  # same initial filters
    x = numpy.random.RandomState(0).randn(2, 4, 9, 8).astype(numpy.float32)
    numpy.testing.assert_allclose(ours(nhwc(x)).array, nhwc(ref(x).array), atol=1e-5)


@pytest.mark.parametrize('pad_channels', [None, 4, 8])
def test_copy_mode_init_draws_as_chainer_and_keeps_padding_zero(pad_channels):
    """Link.copy(mode='init') (and repeat) re-initialise W through its initializer: the numbers
    Chainer's link draws, in its layout, and the padding channels zero again."""
    numpy.random.seed(1)
    ref = L.Convolution2D(3, 8, 3)
    numpy.random.seed(1)
    ours = TL.Convolution2D(3, 8, 3, pad_channels=pad_channels)
    numpy.random.seed(2)
    ref2 = ref.copy(mode='init')
    numpy.random.seed(2)
    ours2 = ours.copy(mode='init')
    w = ours2.W.array
    assert w.shape == (8, 3, 3, pad_channels or 3)
    numpy.testing.assert_array_equal(w[..., :3], nhwc(ref2.W.array))
    assert not w[..., 3:].any() and not numpy.array_equal(w, ours.W.array)


def test_copyparams_between_paddings_says_why():
    from chainer_tc.models import ResNet50
    padded, plain = ResNet50(width=16, pad_channels=4), ResNet50(width=16)
    with pytest.raises(ValueError, match=r'copyparams: the filter conv1 has shape \(4, 7, 7, 3\) '
                                         r'and the one copied from has \(4, 7, 7, 4\).*'
                                         r'pad_channels None and 4.*save_npz and load_npz'):
        plain.copyparams(padded)
    twin = ResNet50(width=16, pad_channels=4)
    twin.copyparams(padded)                        # the same padding: as Chainer's
    numpy.testing.assert_array_equal(twin.conv1.W.array, padded.conv1.W.array)


def test_links_pickled_before_pad_channels_existed_still_work(tmp_path):
    link = TL.Convolution2D(3, 4, 3)
    del link.__dict__['pad_channels']           # as a pickle of the older class has it
    link = pickle.loads(pickle.dumps(link))
    assert link.pad_channels is None
    assert link(numpy.zeros((1, 5, 5, 3), numpy.float32)).shape == (1, 3, 3, 4)
    serializers.save_npz(str(tmp_path / 'c.npz'), link)


def test_link_lazy_in_channels_and_initialW_in_chainers_layout():
    w = numpy.arange(6 * 4 * 3 * 3, dtype=numpy.float32).reshape(6, 4, 3, 3)
    ours = TL.Convolution2D(None, 6, 3, initialW=w, initial_bias=0.5)
    ours(numpy.zeros((1, 5, 5, 4), numpy.float32))
    numpy.testing.assert_array_equal(ours.W.array, nhwc(w))
    assert (ours.b.array == 0.5).all()


@pytest.mark.parametrize('in_channels, lazy, pad_channels', [
    (3, False, None),             # (4, 3, 3, 3) in both layouts: a plain copy is silently wrong
    (5, False, None), (3, True, None), (3, False, 4)])
def test_copyparams_from_chainers_link_transposes_the_filter(in_channels, lazy, pad_channels):
    """A pretrained NCHW layer copied into the NHWC link (fine-tuning) computes the same."""
    r = numpy.random.RandomState(0)
    theirs = L.Convolution2D(in_channels, 4, 3, pad=1)
    theirs.b.array[...] = r.randn(4)
    ours = TL.Convolution2D(None if lazy else in_channels, 4, 3, pad=1,
                            pad_channels=pad_channels)
    before = None if lazy else ours.W.array
    ours.copyparams(theirs)
    assert lazy or ours.W.array is before                  # in place, as Chainer copies
    x = r.randn(2, in_channels, 5, 5).astype(numpy.float32)
    numpy.testing.assert_allclose(ours(nhwc(x)).array, nhwc(theirs(x).array), atol=1e-5)
    if pad_channels:
        assert (ours.W.array[..., in_channels:] == 0).all()


def test_npz_round_trip_nchw_to_nhwc_and_back(tmp_path):
    class Net(chainer.Chain):
        def __init__(self, conv, bn):
            super().__init__()
            with self.init_scope():
                self.conv = conv(3, 8, 3, pad=1, nobias=True)
                self.bn = bn(8)

    ref = Net(L.Convolution2D, L.BatchNormalization)
    ref.bn.avg_mean[...] = numpy.linspace(-1, 1, 8)
    x = numpy.random.RandomState(5).randn(2, 3, 6, 6).astype(numpy.float32)
    ref.conv(x)
    serializers.save_npz(str(tmp_path / 'nchw.npz'), ref)
    ours = Net(TL.Convolution2D, TL.BatchNormalization)
    serializers.load_npz(str(tmp_path / 'nchw.npz'), ours)     # lazy W: created from the file
    with chainer.using_config('train', False):
        numpy.testing.assert_allclose(ours.bn(ours.conv(nhwc(x))).array,
                                      nhwc(ref.bn(ref.conv(x)).array), atol=1e-5)
    serializers.save_npz(str(tmp_path / 'nhwc.npz'), ours)
    back = Net(L.Convolution2D, L.BatchNormalization)
    back.conv(x)
    serializers.load_npz(str(tmp_path / 'nhwc.npz'), back)
    numpy.testing.assert_array_equal(back.conv.W.array, ref.conv.W.array)


def test_loading_keeps_the_array_object(tmp_path):
    ref = L.Convolution2D(3, 4, 3)
    ref(numpy.zeros((1, 3, 5, 5), numpy.float32))
    serializers.save_npz(str(tmp_path / 'w.npz'), ref)
    ours = TL.Convolution2D(3, 4, 3)
    ours(numpy.zeros((1, 5, 5, 3), numpy.float32))
    w = ours.W.array
    serializers.load_npz(str(tmp_path / 'w.npz'), ours)
    assert ours.W.array is w, 'in place, so an optimizer holding views keeps working'
    numpy.testing.assert_array_equal(w, nhwc(ref.W.array))


def test_link_rejects_nchw_input():
    conv = TL.Convolution2D(64, 64, 3)
    with pytest.raises(ValueError, match=r'expects channels-last \(NHWC\) input with its 64 '
                                         r'channels on the last axis; got shape \(2, 64, 9, 9\)'):
        conv(numpy.zeros((2, 64, 9, 9), numpy.float32))


@pytest.mark.gpu
@pytest.mark.parametrize('case', GRID)
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float16])
def test_cudnn_path_equals_cpu(cudnn_stack, case, dtype):
    import cupy
    x, W, b, kw = problem(case, dtype)
    gy = numpy.random.RandomState(1).randn(*TF.convolution_2d(x, W, b, **kw).shape).astype(dtype)
    cpu = grads(lambda x, W, b: TF.convolution_2d(x, W, b, **kw), (x, W, b), gy)
    gpu = grads(lambda x, W, b: TF.convolution_2d(x, W, b, **kw),
                tuple(None if a is None else cupy.asarray(a) for a in (x, W, b)),
                cupy.asarray(gy))
    t = dict(atol=2e-2, rtol=1e-2) if dtype == numpy.float16 else dict(atol=1e-4, rtol=1e-4)
    for a, g in zip(cpu, gpu):
        if a is not None:
            numpy.testing.assert_allclose(cupy.asnumpy(g).astype('f8'), a.astype('f8'), **t)


# ---- use_cudnn='never' on a GPU: Chainer's own convolution on NCHW copies ----------------------

@pytest.mark.parametrize('case', GRID)
@pytest.mark.parametrize('dtype', [numpy.float64, numpy.float32])
def test_the_path_without_cudnn_maps_nhwc_onto_chainers_convolution(case, dtype):
    """The GPU path taken under use_cudnn='never' is written for any array module: on NumPy it
    must give the CPU path's results (same geometry, the NHWC<->NCHW copies right), with only
    the gradients asked for."""
    from chainer_tc.functions import _conv_without_cudnn as without
    import importlib
    conv_module = importlib.import_module('chainer_tc.functions.convolution_2d')
    x, W, b, kw = problem(case, dtype)
    f = conv_module.Convolution2DNHWC(kw['stride'], kw['pad'], kw['dilate'], kw['groups'])
    y = without.forward(f, x, W, b)
    numpy.testing.assert_allclose(y, TF.convolution_2d(x, W, b, **kw).array, **TOL[dtype])
    assert y.flags.c_contiguous and y.dtype == dtype
    gy = numpy.random.RandomState(1).randn(*y.shape).astype(dtype)
    _, gx, gW = grads(lambda x, W: TF.convolution_2d(x, W, None, **kw), (x, W), gy)
    out = without.grads(f, x, W, gy, (0, 1))
    numpy.testing.assert_allclose(out[0], gx, **TOL[dtype])
    numpy.testing.assert_allclose(out[1], gW, **TOL[dtype])
    assert set(without.grads(f, x, W, gy, (1,))) == {1}


@pytest.mark.gpu
def test_use_cudnn_never_runs_chainers_convolution_on_the_gpu_and_warns_once(cudnn_stack):
    import cupy
    from chainer_tc.cuda import PerformanceWarning
    from chainer_tc.functions import _conv_without_cudnn as without
    x, W, b, kw = problem(GRID[2], numpy.float32)
    gy = numpy.random.RandomState(1).randn(*TF.convolution_2d(x, W, b, **kw).shape).astype(
        numpy.float32)
    args = tuple(cupy.asarray(a) for a in (x, W, b))
    ours = grads(lambda x, W, b: TF.convolution_2d(x, W, b, **kw), args, cupy.asarray(gy))
    without._warned.clear()
    with chainer.using_config('use_cudnn', 'never'):
        with pytest.warns(PerformanceWarning, match="use_cudnn is 'never'.*im2col"):
            plain = grads(lambda x, W, b: TF.convolution_2d(x, W, b, **kw), args,
                          cupy.asarray(gy))
    for a, g in zip(ours, plain):
        cupy.testing.assert_allclose(a, g, atol=1e-4, rtol=1e-4)


def test_compute_mode_cudnn_fast_leaves_the_nhwc_link_as_it_is():
    """Chainer's cudnn_fast mode gives its link a channels-last filter layout; ours is
    channels-last already and would refuse a filter with a layout."""
    with chainer.using_config('compute_mode', 'cudnn_fast'):
        link = TL.Convolution2D(3, 4, 3)
    assert link.W.layout is None and not link.cudnn_fast
    assert link(numpy.zeros((1, 5, 5, 3), numpy.float32)).shape == (1, 3, 3, 4)


def test_float16_bias_gradient_overflow_is_inf_without_a_warning():
    with chainer.using_config('dtype', numpy.float16):
        link = TL.Convolution2D(2, 2, 1)
    link.cleargrads()
    y = link(numpy.ones((4, 8, 8, 2), numpy.float16))
    y.grad = numpy.full(y.shape, 60000, numpy.float16)
    with warnings.catch_warnings():
        warnings.simplefilter('error', RuntimeWarning)
        y.backward()
    assert numpy.isinf(link.b.grad).all()
