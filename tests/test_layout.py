"""NCHW <-> NHWC conversion: NumPy path, emulated kernel path, GPU path; all bit-identical."""
import numpy
import pytest

from chainer_tc import kernels
from chainer_tc import layout

# awkward shapes: ones, non-multiples of the 32-wide tile on both axes, many images, wide C
SHAPES = [(1, 1, 1, 1), (2, 3, 5, 7), (1, 33, 1, 31), (3, 32, 4, 8), (2, 64, 7, 7),
          (1, 2048, 1, 1), (1, 3, 64, 65), (70, 3, 2, 2), (0, 3, 4, 4), (2, 0, 4, 4)]
DTYPES = [numpy.float32, numpy.float16]


def sample(shape, dtype, seed=0):
    x = numpy.random.RandomState(seed).randn(*shape) * 300   # float16 overflows past 65504
    x = x.astype(numpy.float32)
    if x.size:
        x.flat[0] = 70000.0                                     # -> inf in float16
        x.flat[-1] = 1 + 2 ** -11                               # a halfway case
    with numpy.errstate(over='ignore'):
        return x.astype(dtype)


def reference(x, axes, dtype):
    with numpy.errstate(over='ignore'):
        return numpy.ascontiguousarray(x.transpose(axes)).astype(dtype or x.dtype)


@pytest.fixture(params=['numpy', 'emulator'])
def path(request, monkeypatch):
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1' if request.param == 'emulator' else '0')
    return request.param


@pytest.mark.parametrize('shape', SHAPES)
@pytest.mark.parametrize('src_dtype', DTYPES)
@pytest.mark.parametrize('dst_dtype', DTYPES + [None])
def test_nchw_to_nhwc_and_back(path, shape, src_dtype, dst_dtype):
    x = sample(shape, src_dtype)
    y = layout.nchw_to_nhwc(x, dst_dtype)
    ref = reference(x, (0, 2, 3, 1), dst_dtype)
    assert y.shape == ref.shape and y.dtype == ref.dtype and y.flags.c_contiguous
    numpy.testing.assert_array_equal(y, ref)
    z = layout.nhwc_to_nchw(y, src_dtype)
    numpy.testing.assert_array_equal(z, reference(ref, (0, 3, 1, 2), src_dtype))


def test_emulated_path_is_one_launch_per_call(monkeypatch):
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1')
    x = sample((2, 3, 5, 7), numpy.float32)
    with kernels.count_launches() as c:
        layout.nchw_to_nhwc(x, numpy.float16)
        layout.nhwc_to_nchw(numpy.zeros((2, 5, 7, 3), numpy.float16))
    assert c.per_kernel == {'batched_transpose_f32_f16': 1, 'batched_transpose_f16_f16': 1}
    with kernels.count_launches() as c:
        layout.nchw_to_nhwc(numpy.zeros((0, 3, 4, 4), numpy.float32))
    assert c.total == 0, 'an empty array needs no launch'


def test_numpy_path_launches_nothing(monkeypatch):
    monkeypatch.delenv('CHAINER_TC_EMULATE', raising=False)
    with kernels.count_launches() as c:
        layout.nchw_to_nhwc(sample((2, 3, 5, 7), numpy.float32))
    assert c.total == 0


def test_batch_larger_than_grid_z_limit(monkeypatch):
    # blocks stride over the batch with gridDim.z; the launch caps grid z at 65535, so shrink it
    # to make the stride visible on a small array
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1')
    x = sample((9, 3, 2, 5), numpy.float32)
    k = kernels.get_function('layout', 'batched_transpose_f32_f32', numpy,
                             defines={'LAYOUT_TILE': layout.TILE,
                                      'LAYOUT_BLOCK_ROWS': layout.BLOCK_ROWS})
    y = numpy.zeros((9, 2, 5, 3), numpy.float32)
    k((1, 1, 4), (layout.TILE, layout.BLOCK_ROWS),
      (x, y, numpy.int32(3), numpy.int32(10), numpy.int64(9)))
    numpy.testing.assert_array_equal(y, reference(x, (0, 2, 3, 1), None))


@pytest.mark.parametrize('bad,err,msg', [
    (numpy.zeros((2, 3, 4)), ValueError, r'x must be a 4-D array \(N, C, H, W\); got shape \(2, 3, 4\)'),
    (numpy.zeros((1, 2, 3, 4), numpy.float64), TypeError, 'x must be float16 or float32; got float64'),
    ([[[[1.0]]]], ValueError, 'x must be a 4-D array'),
])
def test_bad_input(path, bad, err, msg):
    with pytest.raises(err, match=msg):
        layout.nchw_to_nhwc(bad)


def test_bad_dtype(path):
    with pytest.raises(TypeError, match='dtype must be float16 or float32; got int32'):
        layout.nhwc_to_nchw(numpy.zeros((1, 2, 2, 3), numpy.float32), numpy.int32)


@pytest.mark.parametrize('dtype, msg', [
    ('mixed16', r"dtype must be float16 or float32 \(a NumPy dtype or its name\); got 'mixed16' "
                r"\(mixed16 is Chainer's configuration .* pass numpy.float16\)"),
    ('half-ish', r"dtype must be float16 or float32 \(a NumPy dtype or its name\); got 'half-ish'"),
])
def test_a_dtype_numpy_does_not_know_is_named(path, dtype, msg):
    """NumPy's own "data type 'mixed16' not understood" named neither the argument nor what
    it takes. Found by review."""
    with pytest.raises(TypeError, match=msg):
        layout.nchw_to_nhwc(numpy.zeros((1, 2, 2, 3), numpy.float32), dtype)


@pytest.mark.parametrize('src', ['>f4', '>f2', '<f4'])
@pytest.mark.parametrize('dst', [None, '>f4', numpy.float16])
def test_other_byte_orders_are_the_same_values(path, src, dst):
    """A big-endian array (read from a file written elsewhere) holds float32 or float16 values:
    converted to the native order, transposed, and given back in the byte order asked for
    (``dtype``, else the input's), as NumPy's transpose and astype would. It was refused as
    "x must be float16 or float32; got >f4". Found by review."""
    x = sample((2, 3, 5, 7), numpy.dtype(src).newbyteorder('='))
    with numpy.errstate(over='ignore'):
        ref = reference(x, (0, 2, 3, 1), numpy.dtype(dst or src))
    y = layout.nchw_to_nhwc(x.astype(src), dst)
    assert y.dtype == ref.dtype == numpy.dtype(dst or src) and y.flags.c_contiguous
    numpy.testing.assert_array_equal(y, ref)
    back = layout.nhwc_to_nchw(y, src)
    assert back.dtype == numpy.dtype(src)
    numpy.testing.assert_array_equal(back, reference(ref, (0, 3, 1, 2), numpy.dtype(src)))


@pytest.mark.gpu
@pytest.mark.parametrize('shape', SHAPES)
@pytest.mark.parametrize('src_dtype', DTYPES)
@pytest.mark.parametrize('dst_dtype', DTYPES)
def test_gpu_matches_numpy(shape, src_dtype, dst_dtype):
    import cupy
    x = sample(shape, src_dtype)
    ref = layout.nchw_to_nhwc(x, dst_dtype)
    y = layout.nchw_to_nhwc(cupy.asarray(x), dst_dtype)
    assert isinstance(y, cupy.ndarray)
    numpy.testing.assert_array_equal(cupy.asnumpy(y), ref)
    back = layout.nhwc_to_nchw(y, src_dtype)
    numpy.testing.assert_array_equal(cupy.asnumpy(back), layout.nhwc_to_nchw(ref, src_dtype))
