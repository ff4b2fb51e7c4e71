"""The CPU CUDA emulator against NumPy, on awkward sizes, and its error reporting."""
import ctypes
import signal

import numpy
import pytest

from chainer_tc.errors import CompileError
from chainer_tc.errors import KernelLaunchError
from chainer_tc.testing import emulator
from conftest import cuda_source

SIZES = [0, 1, 31, 32, 33, 1000, 4097]
BLOCK = 256


@pytest.fixture(scope='module')
def mod():
    return emulator.RawModule(path=cuda_source('selftest.cu'))


@pytest.fixture(scope='module')
def buggy():
    return emulator.RawModule(path=cuda_source('buggy.cu'))


def blocks(n, block=BLOCK):
    return max(1, -(-n // block))


def rng(seed=0):
    return numpy.random.RandomState(seed)


@pytest.mark.parametrize('n', SIZES)
def test_vector_add_grid_stride(mod, n):
    a, b = rng().rand(n).astype(numpy.float32), rng(1).rand(n).astype(numpy.float32)
    c = numpy.full(n, numpy.nan, numpy.float32)
    # fewer blocks than elements need: the grid-stride loop covers the rest
    mod.get_function('vector_add')((3,), (64,), (a, b, c, numpy.int32(n)))
    numpy.testing.assert_array_equal(c, a + b)


@pytest.mark.parametrize('n', SIZES)
def test_block_reduction_shared_memory(mod, n):
    x = rng().randn(n)
    grid = 5
    out = numpy.zeros(grid)
    mod.get_function('block_sum')((grid,), (BLOCK,), (x, out, numpy.int32(n)),
                                  shared_mem=BLOCK * 8)
    # each block's sum, in the kernel's own order, is exact to rounding of a tree sum
    expect = [x[numpy.arange(n) % (grid * BLOCK) // BLOCK == b].sum() for b in range(grid)]
    numpy.testing.assert_allclose(out, expect, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('n', SIZES)
@pytest.mark.parametrize('block', [32, 96, 256, 1024])
def test_warp_shuffle_reduction(mod, n, block):
    x = rng().randint(-1000, 1000, size=n).astype(numpy.int32)
    grid = blocks(n, block)
    out = numpy.zeros(grid, numpy.int32)
    mod.get_function('warp_sum')((grid,), (block,), (x, out, numpy.int32(n)))
    padded = numpy.zeros(grid * block, numpy.int32)
    padded[:n] = x
    numpy.testing.assert_array_equal(out, padded.reshape(grid, block).sum(axis=1))


@pytest.mark.parametrize('n', [1, 31, 32, 33, 1000])
@pytest.mark.parametrize('width', [32, 8, 1])
def test_warp_scan_and_broadcast(mod, n, width):
    x = rng().randint(-9, 9, size=n).astype(numpy.int32)
    scan, bcast = numpy.zeros(n, numpy.int32), numpy.zeros(n, numpy.int32)
    mod.get_function('warp_scan')((blocks(n, 64),), (64,),
                                  (x, scan, bcast, numpy.int32(width), numpy.int32(n)))
    padded = numpy.zeros(blocks(n, 64) * 64, numpy.int32)
    padded[:n] = x
    warps = padded.reshape(-1, 32)
    numpy.testing.assert_array_equal(scan, numpy.cumsum(warps, axis=1).ravel()[:n])
    groups = padded.reshape(-1, width)
    numpy.testing.assert_array_equal(bcast, numpy.repeat(groups[:, 0], width)[:n])


@pytest.mark.parametrize('n', [1, 31, 32, 33, 1000])
def test_warp_votes(mod, n):
    x = rng().randn(n).astype(numpy.float32)
    x[:32] = numpy.abs(x[:32]) + 1           # the first warp is all positive
    nw = blocks(n, 64) * 2
    ballot = numpy.zeros(nw, numpy.uint32)
    any_, all_ = numpy.zeros(nw, numpy.int32), numpy.zeros(nw, numpy.int32)
    mod.get_function('warp_votes')((blocks(n, 64),), (64,), (x, ballot, any_, all_, numpy.int32(n)))
    padded = numpy.zeros(nw * 32, numpy.float32)
    padded[:n] = x
    bits = (padded.reshape(nw, 32) > 0)
    expect = (bits * (numpy.uint64(1) << numpy.arange(32, dtype=numpy.uint64))).sum(axis=1)
    numpy.testing.assert_array_equal(ballot, expect.astype(numpy.uint32))
    numpy.testing.assert_array_equal(any_, bits.any(axis=1))
    numpy.testing.assert_array_equal(all_, bits.all(axis=1))


@pytest.mark.parametrize('n', SIZES)
def test_atomics(mod, n):
    x = rng().randint(-50, 50, size=n).astype(numpy.int32)
    bins = 7
    hist = numpy.zeros(bins, numpy.uint32)
    mx = numpy.array([numpy.iinfo(numpy.int32).min], numpy.int32)
    neg = numpy.zeros(1, numpy.uint64)
    fsum = numpy.zeros(1, numpy.float32)
    mod.get_function('atomics')((4,), (128,),
                                (x, hist, mx, neg, fsum, numpy.int32(bins), numpy.int32(n)))
    numpy.testing.assert_array_equal(hist, numpy.bincount(x % bins, minlength=bins))
    assert mx[0] == (x.max() if n else numpy.iinfo(numpy.int32).min)
    assert neg[0] == (x < 0).sum()
    assert fsum[0] == x.sum()     # small integers: every partial sum is exact in float32


def test_atomic_cas_lock(mod):
    lock, counter = numpy.zeros(1, numpy.int32), numpy.zeros(1, numpy.int32)
    mod.get_function('cas_lock')((37,), (64,), (lock, counter))
    assert counter[0] == 37 and lock[0] == 0


@pytest.mark.parametrize('npairs', [1, 31, 33, 1000])
def test_half2_fma(mod, npairs):
    r = rng()
    a, b, c = (r.randn(2 * npairs).astype(numpy.float16) for _ in range(3))
    out = numpy.zeros(2 * npairs, numpy.float16)
    pair_sum = numpy.zeros(npairs, numpy.float32)
    mod.get_function('half2_fma')((blocks(npairs),), (BLOCK,),
                                  (a, b, c, out, pair_sum, numpy.int32(npairs)))
    # fma rounds once: the exact a*b+c (in float64, exact for halves here) rounded to half
    expect = (a.astype(numpy.float64) * b + c).astype(numpy.float16)
    numpy.testing.assert_array_equal(out, expect)
    numpy.testing.assert_array_equal(
        pair_sum, out.astype(numpy.float32).reshape(-1, 2).sum(axis=1))


def test_float_to_half_rounds_like_numpy(mod):
    r = rng()
    x = numpy.concatenate([
        r.randn(20000).astype(numpy.float32) * numpy.float32(10) ** r.randint(-9, 6, 20000),
        # halfway cases, overflow edges, subnormals, zeros, inf, nan
        numpy.array([65504, 65519.996, 65520, 65536, 1e10, 2 ** -24, 2 ** -25, 3 * 2 ** -26,
                     2 ** -14, 2 ** -14 * (1 - 2 ** -11), 1 + 2 ** -11, 1 + 3 * 2 ** -11,
                     0.0, -0.0, numpy.inf, -numpy.inf], numpy.float32),
    ]).astype(numpy.float32)
    x = numpy.concatenate([x, -x])
    y = numpy.zeros(x.size, numpy.float16)
    mod.get_function('to_half')((blocks(x.size),), (BLOCK,), (x, y, numpy.int32(x.size)))
    with numpy.errstate(over='ignore'):
        ref = x.astype(numpy.float16)
    numpy.testing.assert_array_equal(y.view(numpy.uint16), ref.view(numpy.uint16))
    nan = numpy.array([numpy.nan], numpy.float32)
    yn = numpy.zeros(1, numpy.float16)
    mod.get_function('to_half')((1,), (32,), (nan, yn, numpy.int32(1)))
    assert numpy.isnan(yn[0])


def test_half_to_float_is_exact_for_every_half(mod):
    h = numpy.arange(65536, dtype=numpy.uint32).astype(numpy.uint16).view(numpy.float16)
    y = numpy.zeros(h.size, numpy.float32)
    mod.get_function('to_float')((blocks(h.size),), (BLOCK,), (h, y, numpy.int32(h.size)))
    ref = h.astype(numpy.float32)
    finite = ~numpy.isnan(ref)
    numpy.testing.assert_array_equal(y[finite].view(numpy.uint32), ref[finite].view(numpy.uint32))
    assert numpy.isnan(y[~finite]).all() and (~finite).sum() == 2 * 1023


def _subnormal_ops(mod, **checks):
    f = numpy.array([2.0 ** -70, 2.0 ** -70, 2.0 ** -140], numpy.float32)
    h = numpy.array([2.0 ** -20, 1.0], numpy.float16)
    d = numpy.array([2.0 ** -140, 2.0 ** -540, 2.0 ** -540])
    fo, ho, do = numpy.zeros(5, numpy.float32), numpy.zeros(1, numpy.float16), numpy.zeros(1)
    with emulator.checking(**checks):
        mod.get_function('subnormal_ops')((1,), (1,), (f, h, d, fo, ho, do))
    return fo, ho, do


def test_ftz_flushes_float32_subnormals_as_cupy_compiles():
    """CuPy compiles with -ftz=true: a float32 subnormal input reads as zero (so it is not > 0)
    and a subnormal result is zero. checking(ftz=True) does that here; float16 arithmetic keeps
    its subnormals (a GPU's does too); float64 ones flush here, which a GPU does not do (the
    documented difference). Without it every subnormal stays, as in NumPy."""
    mod = emulator.RawModule(path=cuda_source('selftest.cu'))
    tiny = numpy.float32(2.0 ** -140)
    fo, ho, do = _subnormal_ops(mod)
    numpy.testing.assert_array_equal(fo, [tiny, tiny, 1.0, 2.0 ** -70, tiny])
    assert ho[0] == numpy.float16(2.0 ** -20) and do[0] == 2.0 ** -1080
    fo, ho, do = _subnormal_ops(mod, ftz=True)
    numpy.testing.assert_array_equal(fo, [0.0, 0.0, -1.0, 2.0 ** -70, 0.0])
    assert ho[0] == numpy.float16(2.0 ** -20) and do[0] == 0.0
    # the caller's thread keeps its subnormals, after a launch and after a failed one
    assert numpy.float32(2.0 ** -70) * numpy.float32(2.0 ** -70) == tiny
    with emulator.checking(ftz=True), pytest.raises(KernelLaunchError, match='out-of-bounds'):
        mod.get_function('subnormal_ops')((1,), (1,), (fo[:1].copy(), ho, do, fo, ho, do))
    assert numpy.float32(2.0 ** -70) * numpy.float32(2.0 ** -70) == tiny
    with emulator.checking(ftz=True):
        with emulator.checking(ftz=False):
            assert not emulator.current_ftz()
        assert emulator.current_ftz()


def test_fmad_contracts_plain_products_and_never_the_rn_intrinsics(monkeypatch):
    """NVRTC contracts a * b + c into an fma by default (-fmad=true, which CuPy keeps); the
    emulator does under checking(fmad=True) or CHAINER_TC_EMULATOR_FMAD=1, with a second build of
    the module made once. (1 + 2^-12)^2 - (1 + 2^-11) is 2^-24 fused and 0 rounded first (the
    product's last bit is a tie to even); in double (1 + 2^-27)^2 - (1 + 2^-26) is 2^-54 or 0.
    __fadd_rn/__fmul_rn are never contracted, nor a plain product added by __fadd_rn."""
    mod = emulator.RawModule(path=cuda_source('selftest.cu'))
    k = mod.get_function('contraction')
    a, c = numpy.float32([1 + 2.0 ** -12]), -numpy.float32([1 + 2.0 ** -11])
    da, dc = numpy.array([1 + 2.0 ** -27]), -numpy.array([1 + 2.0 ** -26])

    def run():
        out, dout = numpy.full(3, 7, numpy.float32), numpy.full(2, 7.0)
        k((1,), (1,), (a, a, c, out, da, da, dc, dout))
        return list(out), list(dout)

    with emulator.checking(fmad=False):
        assert run() == ([0, 0, 0], [0, 0])
    with emulator.checking(fmad=True):
        assert emulator.current_fmad()
        assert run() == ([2.0 ** -24, 0, 0], [2.0 ** -54, 0])
        contracting = mod._contracting('contraction')
        assert run() and mod._contracting('contraction') is contracting   # built once
        with emulator.checking(fmad=False):
            assert run() == ([0, 0, 0], [0, 0])
    monkeypatch.setenv('CHAINER_TC_EMULATOR_FMAD', '1')
    assert run() == ([2.0 ** -24, 0, 0], [2.0 ** -54, 0])
    monkeypatch.setenv('CHAINER_TC_EMULATOR_FMAD', '0')
    assert run() == ([0, 0, 0], [0, 0])


@pytest.mark.parametrize('rows,cols', [(1, 1), (7, 33), (40, 17), (64, 64)])
def test_2d_launch(mod, rows, cols):
    x = rng().randn(rows, cols).astype(numpy.float32)
    y = numpy.zeros_like(x)
    grid = (-(-cols // 16), -(-rows // 8))
    mod.get_function('grid2d')(grid, (16, 8), (x, y, numpy.int32(rows), numpy.int32(cols),
                                               numpy.float32(1.5)))
    r, c = numpy.indices(x.shape)
    if emulator.current_fmad():     # one rounding (float64 holds x * 1.5 + (r - c) exactly here)
        want = (x.astype(numpy.float64) * 1.5 + (r - c)).astype(numpy.float32)
    else:
        want = x * numpy.float32(1.5) + (r - c).astype(numpy.float32)
    numpy.testing.assert_array_equal(y, want)


def test_3d_launch_index_mapping(mod):
    grid, block = (3, 2, 2), (4, 3, 2)
    n = 12 * 24
    out = numpy.full(4 * n, -1, numpy.int32)
    mod.get_function('coords3d')(grid, block, (out,))
    out = out.reshape(n, 4)
    numpy.testing.assert_array_equal(out[:, 0], numpy.tile(numpy.arange(24), 12))
    numpy.testing.assert_array_equal(out[:, 1], numpy.repeat(numpy.arange(12), 24))
    tz, ty, tx = numpy.unravel_index(numpy.arange(24), (2, 3, 4))
    numpy.testing.assert_array_equal(out[:24, 2], tz * 100 + ty * 10 + tx)
    bz, by, bx = numpy.unravel_index(numpy.arange(12), (2, 2, 3))
    numpy.testing.assert_array_equal(out[::24, 3], bz * 100 + by * 10 + bx)


@pytest.mark.parametrize('n', [1, 33, 1000])
def test_syncthreads_count(mod, n):
    x = rng().randn(n).astype(numpy.float32)
    g = blocks(n, 128)
    out = numpy.zeros(g, numpy.int32)
    mod.get_function('count_positive')((g,), (128,), (x, out, numpy.int32(n)))
    padded = numpy.zeros(g * 128, numpy.float32)
    padded[:n] = x
    numpy.testing.assert_array_equal(out, (padded.reshape(g, 128) > 0).sum(axis=1))


def test_same_array_twice_is_one_buffer(mod):
    x = numpy.arange(40, dtype=numpy.float32)
    mod.get_function('axpy_inplace')((1,), (64,), (x, x, numpy.int32(40)))
    numpy.testing.assert_array_equal(x, numpy.arange(40, dtype=numpy.float32) * 3)


def test_math_functions(mod):
    x = numpy.array([0, 1, -2.5, 1e-3, numpy.inf, -numpy.inf, numpy.nan, 3e38], numpy.float32)
    out = numpy.zeros(5 * x.size, numpy.float32)
    with numpy.errstate(all='ignore'):
        mod.get_function('math_funcs')((1,), (32,), (x, out, numpy.int32(x.size)))
        out = out.reshape(-1, 5)
        numpy.testing.assert_allclose(out[:, 0], 1 / numpy.sqrt(numpy.abs(x) + 1), rtol=1e-6)
        numpy.testing.assert_allclose(out[:, 1], numpy.exp(-x * x), rtol=1e-6)
    numpy.testing.assert_array_equal(out[:, 2][:-2], numpy.maximum(x, 0)[:-2])
    numpy.testing.assert_array_equal(out[:, 3], numpy.isfinite(x))
    bits = x.view(numpy.uint32)
    numpy.testing.assert_array_equal(out[:, 4], [bin(int(b)).count('1') for b in bits])


def test_templated_kernel_through_name_expressions():
    code = '''
    template <typename T> __global__ void scale(T* x, T s, int n) {
      int i = blockIdx.x * blockDim.x + threadIdx.x;
      if (i < n) x[i] = x[i] * s;
    }'''
    m = emulator.RawModule(code=code, name_expressions=['scale<float>', 'scale<double>'])
    x = numpy.arange(5, dtype=numpy.float64)
    m.get_function('scale<double>')((1,), (32,), (x, numpy.float64(2), numpy.int32(5)))
    numpy.testing.assert_array_equal(x, numpy.arange(5) * 2.0)
    with pytest.raises(TypeError, match=r'expected a float64 array; got numpy array float32'):
        m.get_function('scale<double>')((1,), (32,), (x.astype(numpy.float32), numpy.float64(2),
                                                      numpy.int32(5)))
    with pytest.raises(AttributeError, match="no kernel 'scale<int>'"):
        m.get_function('scale<int>')


def test_options_define_macros():
    code = 'extern "C" __global__ void fill(int* x) { x[threadIdx.x] = VALUE; }'
    m = emulator.RawModule(code=code, options=('-DVALUE=42', '--use_fast_math', '-arch=sm_80'))
    x = numpy.zeros(8, numpy.int32)
    m.get_function('fill')((1,), (8,), (x,))
    assert (x == 42).all()


# ---- failures are loud, precise, and leave the arrays untouched ---------------------------------

def test_out_of_bounds_past_the_end_is_caught(buggy):
    n = 1000
    a = numpy.arange(n, dtype=numpy.float32)
    b = numpy.zeros(n, numpy.float32)
    with pytest.raises(KernelLaunchError) as e:
        buggy.get_function('copy_no_bounds_check')((blocks(n),), (BLOCK,), (a, b, numpy.int32(n)))
    msg = str(e.value)
    assert "kernel 'copy_no_bounds_check'" in msg
    assert 'out-of-bounds read of argument 0 (const float*, float32 array of shape (1000,))' in msg
    assert 'element 1000 of 1000' in msg
    assert 'thread (232,0,0) of block (3,0,0)' in msg     # the first thread with i == n
    assert not b.any(), 'a failed launch must not write back'


def test_out_of_bounds_before_the_start_is_caught(buggy):
    a = numpy.arange(64, dtype=numpy.float32)
    b = numpy.zeros(64, numpy.float32)
    with pytest.raises(KernelLaunchError, match=r'read of argument 0 \(const float\*, float32 array '
                                                r'of shape \(64,\)\) at byte offset -4 \(element -1 of '
                                                r'64\) in thread \(0,0,0\) of block \(0,0,0\) \(at '
                                                r'.*buggy.cu:12\)'):
        buggy.get_function('read_before_start')((1,), (64,), (a, b, numpy.int32(64)))


def test_empty_array_access_is_caught(buggy):
    a, b = numpy.zeros(0, numpy.float32), numpy.zeros(0, numpy.float32)
    with pytest.raises(KernelLaunchError, match='element 0 of 0'):
        buggy.get_function('copy_no_bounds_check')((1,), (1,), (a, b, numpy.int32(0)))


def test_deadlock_is_reported(buggy):
    out = numpy.zeros(64, numpy.int32)
    with pytest.raises(KernelLaunchError, match=r'deadlock in block \(0,0,0\): 32 live threads, '
                                                r'16 waiting at __syncthreads, 16 in warp'):
        buggy.get_function('divergent_barrier')((1,), (64,), (out,))


def test_shuffle_from_lane_outside_mask_is_reported(buggy):
    out = numpy.zeros(32, numpy.int32)
    with pytest.raises(KernelLaunchError, match='reads lane 16, which is not in mask 0x0000ffff'):
        buggy.get_function('shuffle_outside_mask')((1,), (32,), (out,))


def test_trap_is_reported_and_emulator_stays_usable(buggy, mod):
    out = numpy.zeros(8, numpy.int32)
    with pytest.raises(KernelLaunchError, match=r'__trap\(\) called in thread \(3,0,0\)'):
        buggy.get_function('traps')((1,), (8,), (out,))
    test_vector_add_grid_stride(mod, 33)


def test_wrong_arguments_raise_before_launch(mod):
    k = mod.get_function('vector_add')
    a = numpy.zeros(4, numpy.float32)
    with pytest.raises(TypeError, match=r'vector_add\(const float\*, const float\*, float\*, int\) '
                                        r'takes 4 arguments; got 3'):
        k((1,), (4,), (a, a, a))
    with pytest.raises(TypeError, match=r'argument 3 \(int\).*expected a numpy.int32 scalar; got '
                                        r'Python int \(pass numpy.int32'):
        k((1,), (4,), (a, a, a, 4))
    with pytest.raises(TypeError, match='expected a numpy.int32 scalar; got numpy scalar int64'):
        k((1,), (4,), (a, a, a, numpy.int64(4)))
    with pytest.raises(TypeError, match=r'argument 0 \(const float\*\).*expected a float32 array; '
                                        r'got numpy array float64'):
        k((1,), (4,), (a.astype(numpy.float64), a, a, numpy.int32(4)))
    with pytest.raises(TypeError, match='expected a NumPy array; got Python list'):
        k((1,), (4,), ([0.0] * 4, a, a, numpy.int32(4)))
    with pytest.raises(ValueError, match='must be C-contiguous'):
        k((1,), (4,), (numpy.zeros(8, numpy.float32)[::2], a, a, numpy.int32(4)))
    ro = numpy.zeros(4, numpy.float32)
    ro.flags.writeable = False
    k((1,), (4,), (ro, ro, a, numpy.int32(4)))          # read-only input: fine
    with pytest.raises(ValueError, match='may write through this pointer but the array is read-only'):
        k((1,), (4,), (a, a, ro, numpy.int32(4)))
    with pytest.raises(ValueError, match='overlap'):
        big = numpy.zeros(8, numpy.float32)
        k((1,), (4,), (big[:4], a, big[2:6], numpy.int32(4)))


def test_bad_launch_shapes(mod):
    k = mod.get_function('vector_add')
    a = numpy.zeros(4, numpy.float32)
    args = (a, a, a, numpy.int32(4))
    with pytest.raises(ValueError, match='at most 1024 threads'):
        k((1,), (2048,), args)
    with pytest.raises(ValueError, match='must be >= 1'):
        k((0,), (32,), args)
    with pytest.raises(ValueError, match='shared_mem=65536'):
        k((1,), (32,), args, shared_mem=65536)


def test_compile_error_names_the_file_and_shows_the_log(tmp_path):
    src = tmp_path / 'broken.cu'
    src.write_text('extern "C" __global__ void k(float* x) {\n  x[0] = undefined_name;\n}\n')
    with pytest.raises(CompileError) as e:
        emulator.RawModule(path=str(src))
    msg = str(e.value)
    assert str(src) in msg and 'undefined_name' in msg and ':2:' in msg


def test_dynamic_shared_memory_needs_shared_mem(mod):
    x, out = numpy.ones(4), numpy.zeros(1)
    with pytest.raises(KernelLaunchError, match='extern __shared__ memory used but the launch asked '
                                                'for shared_mem=0'):
        mod.get_function('block_sum')((1,), (32,), (x, out, numpy.int32(4)))


def test_dynamic_shared_memory_overflow_is_caught():
    code = '''extern "C" __global__ void k(float* out) {
      extern __shared__ float s[];
      s[threadIdx.x] = 1.0f;            // one float per thread: overflows when shared_mem is short
      __syncthreads();
      out[threadIdx.x] = s[threadIdx.x];
    }'''
    m = emulator.RawModule(code=code)
    out = numpy.zeros(64, numpy.float32)
    m.get_function('k')((1,), (64,), (out,), shared_mem=64 * 4)
    assert (out == 1).all()
    with pytest.raises(KernelLaunchError, match=r'dynamic shared memory \(128 bytes\) at byte offset 128'):
        m.get_function('k')((1,), (64,), (out,), shared_mem=32 * 4)


def test_signature_reports_const_and_half_types(mod):
    assert mod.get_function('half2_fma').signature == (
        'half2_fma(const __half2*, const __half2*, const __half2*, __half2*, float*, int)')


def test_write_before_the_start_is_caught_at_once():
    code = '''extern "C" __global__ void k(float* x) { x[(int)threadIdx.x - 2] = 1.0f; }'''
    m = emulator.RawModule(code=code)
    x = numpy.zeros(8, numpy.float32)
    with pytest.raises(KernelLaunchError, match=r'out-of-bounds write to argument 0 \(float\*, float32 '
                                                r'array of shape \(8,\)\) at byte offset -8 \(element -2 '
                                                r'of 8\) in thread \(0,0,0\)'):
        m.get_function('k')((1,), (8,), (x,))
    assert not x.any()


# ---- barriers and warp collectives with exited threads and partial warps -------------------------

@pytest.mark.parametrize('block,live', [(64, 64), (100, 100), (100, 37), (1024, 1000)])
def test_block_votes_are_the_last_barriers(mod, block, live):
    # threads return right after __syncthreads_and: the and/or/count must still be those of the
    # barrier, not of the threads left when a slow thread resumes
    grid = 4
    pred = (rng().rand(grid, block) > 0.3).astype(numpy.int32)
    pred[1] = 1                                   # a block where every running thread votes yes
    pred[2] = 0
    out = numpy.full((grid, block, 3), -7, numpy.int32)
    mod.get_function('block_votes')((grid,), (block,), (pred, out, numpy.int32(live)))
    running = pred[:, :live]
    numpy.testing.assert_array_equal(out[:, :live, 0], numpy.repeat(running.sum(1)[:, None], live, 1))
    numpy.testing.assert_array_equal(out[:, :live, 1], numpy.repeat(running.any(1)[:, None], live, 1))
    numpy.testing.assert_array_equal(out[:, :live, 2], numpy.repeat(running.all(1)[:, None], live, 1))
    assert (out[:, live:] == -7).all()


def partial_warps_reference(x, block, live, width):
    """What the partial_warps kernel writes, computed lane by lane."""
    grid = x.size // block
    out = numpy.full((grid * block, 5), -7, numpy.int64)
    for b in range(grid):
        for w0 in range(0, block, 32):
            lanes = [t - w0 for t in range(w0, min(w0 + 32, block)) if t < live]
            if not lanes:
                continue
            v = {lane: x[b * block + w0 + lane] for lane in lanes}
            ballot = sum(1 << lane for lane in lanes if v[lane] > 0)
            trips = {lane: 0 for lane in lanes}
            for k in range(5):
                m = [lane for lane in lanes if k < lane % 5 + 1]
                for lane in m:
                    trips[lane] += len(m)
            for lane in lanes:
                g0 = lane - lane % width
                group = range(g0, g0 + width)
                s = sum(v[g] for g in group) if all(g in v for g in group) else -1
                signed = ballot - (1 << 32) if ballot >> 31 else ballot     # as the int32 written
                out[b * block + w0 + lane] = [signed, ballot != 0, all(v[l] > 0 for l in lanes), s,
                                              trips[lane]]
    return out


@pytest.mark.parametrize('block,live', [(48, 48), (100, 100), (100, 70), (64, 45), (1024, 1000)])
@pytest.mark.parametrize('width', [32, 8, 2])
def test_warp_collectives_in_partial_warps(mod, block, live, width):
    grid = 2
    x = rng(block + live).randint(-5, 6, size=grid * block).astype(numpy.int32)
    out = numpy.full((grid * block, 5), -7, numpy.int32)
    mod.get_function('partial_warps')((grid,), (block,), (x, out, numpy.int32(live),
                                                          numpy.int32(width)))
    numpy.testing.assert_array_equal(out, partial_warps_reference(x, block, live, width))


# ---- float16 against NumPy -------------------------------------------------------------------------

def every_half():
    return numpy.arange(65536, dtype=numpy.uint32).astype(numpy.uint16).view(numpy.float16)


def assert_same_halves(got, ref):
    """Bit-identical, except that any NaN matches any NaN."""
    nan = numpy.isnan(ref)
    numpy.testing.assert_array_equal(numpy.isnan(got), nan)
    numpy.testing.assert_array_equal(got[~nan].view(numpy.uint16), ref[~nan].view(numpy.uint16))


def half_max(a, b):
    """CUDA's __hmax: NaN loses to a number, and +0 > -0."""
    a32, b32 = a.astype(numpy.float32), b.astype(numpy.float32)
    pick_b = numpy.isnan(a32) | (b32 > a32) | ((a32 == b32) & numpy.signbit(a32))
    return numpy.where(pick_b, b, a)


def half_min(a, b):
    a32, b32 = a.astype(numpy.float32), b.astype(numpy.float32)
    pick_b = numpy.isnan(a32) | (b32 < a32) | ((a32 == b32) & numpy.signbit(b32))
    return numpy.where(pick_b, b, a)


def test_half_arithmetic_matches_numpy_for_every_half(mod):
    # every half against 8 random partners (and a few chosen ones), so every exponent, subnormal,
    # zero, inf and nan goes through each operation
    r = rng()
    a = numpy.tile(every_half(), 10)
    b = r.randint(0, 65536, size=a.size).astype(numpy.uint16).view(numpy.float16)
    b[-3 * 65536:] = numpy.repeat(numpy.array([0.0, -0.0, 1.0], numpy.float16), 65536)
    n = a.size
    out = numpy.zeros((7, n), numpy.float16)
    flags = numpy.zeros(n, numpy.uint8)
    mod.get_function('half_ops')((64,), (256,), (a, b, out, flags, numpy.int32(n)))
    with numpy.errstate(all='ignore'):
        # NumPy computes float16 operations in float32 and rounds once: correctly rounded, as the GPU
        refs = [a + b, a - b, a * b, a / b, half_max(a, b), half_min(a, b),
                (a.astype(numpy.float64) * b + b).astype(numpy.float16)]
    for k, ref in enumerate(refs):
        assert_same_halves(out[k], ref)
    expect = ((a < b) * 1 | (a == b) * 2 | (a > b) * 4 | (a != b) * 8 |
              ((a != b) & ~numpy.isnan(a) & ~numpy.isnan(b)) * 16 | numpy.isnan(a) * 32 |
              numpy.isinf(a) * 64)
    numpy.testing.assert_array_equal(flags, expect)


def test_hmax_hmin_signed_zeros_and_nans(mod):
    nan = numpy.float16('nan')
    a = numpy.array([0.0, -0.0, 0.0, -0.0, nan, 1.0, nan, -2.0], numpy.float16)
    b = numpy.array([-0.0, 0.0, 0.0, -0.0, 1.0, nan, nan, -3.0], numpy.float16)
    out = numpy.zeros((7, a.size), numpy.float16)
    mod.get_function('half_ops')((1,), (32,), (a, b, out, numpy.zeros(a.size, numpy.uint8),
                                               numpy.int32(a.size)))
    mx, mn = out[4], out[5]
    assert list(mx.view(numpy.uint16)[:4]) == [0x0000, 0x0000, 0x0000, 0x8000]     # +0 > -0
    assert list(mn.view(numpy.uint16)[:4]) == [0x8000, 0x8000, 0x0000, 0x8000]
    assert list(mx[4:6]) == [1.0, 1.0] and list(mn[4:6]) == [1.0, 1.0]            # nan loses
    assert mx.view(numpy.uint16)[6] == mn.view(numpy.uint16)[6] == 0x7fff          # canonical nan
    assert mx[7] == -2.0 and mn[7] == -3.0


def test_hfma_rounds_once():
    # a * b + c = 1 + 3 * 2^-11 - 2^-31: just below the midpoint between 1 + 2^-10 and 1 + 2^-9.
    # Rounded to float first it becomes the midpoint itself, and then rounds up, to even: wrong.
    a = numpy.array([1.998046875 * 2 ** -6], numpy.float16)
    b = numpy.array([1.0009765625 * 2 ** -6], numpy.float16)
    c = numpy.array([1.0009765625], numpy.float16)
    code = '''#include <cuda_fp16.h>
    extern "C" __global__ void k(const __half* a, const __half* b, const __half* c, __half* out) {
      out[0] = __hfma(a[0], b[0], c[0]);
    }'''
    out = numpy.zeros(1, numpy.float16)
    emulator.RawModule(code=code).get_function('k')((1,), (1,), (a, b, c, out))
    exact = a.astype(numpy.float64) * b + c
    assert exact[0] == 1 + 3 * 2 ** -11 - 2 ** -31
    assert out[0] == exact.astype(numpy.float16)[0] == numpy.float16(1.0009765625)


def float_to_half_boundaries():
    """Every midpoint between consecutive finite halves, one float ulp either side of it, and every
    power of two in and around the half range, one ulp either side."""
    h = every_half()
    h = h[numpy.isfinite(h) & (h.view(numpy.uint16) < 0x7bff)]          # positive, below max
    lo = h.astype(numpy.float64)
    mid = ((lo + numpy.nextafter(h, numpy.float16(numpy.inf)).astype(numpy.float64)) / 2)
    mid = mid.astype(numpy.float32)                                     # exact: 12 bits
    pow2 = numpy.float32(2.0) ** numpy.arange(-30, 18, dtype=numpy.float32)
    top = numpy.array([65504, 65520], numpy.float32)
    x = numpy.concatenate([mid, pow2, top, h.astype(numpy.float32)])
    x = numpy.concatenate([x, numpy.nextafter(x, numpy.float32(0)),
                           numpy.nextafter(x, numpy.float32(numpy.inf))])
    return numpy.concatenate([x, -x])


def test_float_to_half_rounds_at_every_boundary(mod):
    x = float_to_half_boundaries()
    y = numpy.zeros(x.size, numpy.float16)
    mod.get_function('to_half')((blocks(x.size),), (BLOCK,), (x, y, numpy.int32(x.size)))
    with numpy.errstate(over='ignore'):
        ref = x.astype(numpy.float16)
    numpy.testing.assert_array_equal(y.view(numpy.uint16), ref.view(numpy.uint16))


def test_double_to_half_rounds_once(mod):
    # the float boundaries, and the same points moved by a tiny amount that float cannot hold:
    # double -> float -> half would round those twice
    x = float_to_half_boundaries().astype(numpy.float64)
    x = numpy.concatenate([x, x * (1 + 2.0 ** -40), x * (1 - 2.0 ** -40), [numpy.inf, -numpy.inf,
                           1e300, -1e300, 5e-324, 0.0, -0.0]])
    y = numpy.zeros((x.size, 3), numpy.float16)
    mod.get_function('double_to_half')((blocks(x.size),), (BLOCK,), (x, y, numpy.int32(x.size)))
    with numpy.errstate(over='ignore'):
        ref = x.astype(numpy.float16)       # NumPy rounds float64 -> float16 directly
    for k in range(3):
        numpy.testing.assert_array_equal(y[:, k].view(numpy.uint16), ref.view(numpy.uint16))


# ---- CUDA idioms and parameter passing ---------------------------------------------------------------

@pytest.mark.parametrize('n', [1, 33, 1000])
def test_common_idioms_compile_and_run(mod, n):
    r = rng()
    x = r.randn(n).astype(numpy.float32)
    extra = r.randn(n).astype(numpy.float32)
    y = numpy.zeros(n, numpy.float32)
    h = numpy.zeros(n, numpy.float16)
    counter = numpy.zeros(1, numpy.float32)
    tickets = numpy.full(n, -1, numpy.float32)
    table = numpy.array([extra.ctypes.data], numpy.uint64)       # addresses, as CuPy's .data.ptr
    mod.get_function('idioms')((3,), (128,), (x, y, h, numpy.uint64(n), numpy.int64(3), table,
                                              counter, tickets))
    i = numpy.arange(n)
    tid = i % (3 * 128) % 128
    f32 = numpy.float32
    acc = x + x
    acc = (acc + (x + x)) + (x + x) + (x + x)      # the kernel's order, in float32
    expect = (acc + numpy.minimum(i, n - 1).astype(f32) + numpy.maximum(tid, 3).astype(f32) +
              numpy.minimum(i, 5).astype(f32) + extra)
    numpy.testing.assert_array_equal(y, expect)
    f16 = numpy.float16
    numpy.testing.assert_array_equal(h, (i.astype(f16) + f16(3)) + (f16(0.5) + f16(0)))
    assert counter[0] == n
    numpy.testing.assert_array_equal(numpy.sort(tickets), numpy.arange(n))   # each old value once


def test_float_rn_intrinsics_are_ieee(mod):
    r = rng()
    a = (r.randn(5000) * 10.0 ** r.randint(-30, 30, 5000)).astype(numpy.float32)
    b = (r.randn(5000) * 10.0 ** r.randint(-30, 30, 5000)).astype(numpy.float32)
    n = a.size
    out = numpy.zeros((7, n), numpy.float32)
    mod.get_function('float_rn')((blocks(n),), (BLOCK,), (a, b, out, numpy.int32(n)))
    with numpy.errstate(all='ignore'):
        numpy.testing.assert_array_equal(out[0], a + b)
        numpy.testing.assert_array_equal(out[1], a - b)
        numpy.testing.assert_array_equal(out[2], a * b)
        numpy.testing.assert_array_equal(out[3], a / b)
        numpy.testing.assert_array_equal(out[4], numpy.float32(1) / a)
        numpy.testing.assert_array_equal(out[5], numpy.sqrt(numpy.abs(a)))
    # fma: the exact a * b + a rounded once. With 2^-6 <= |b| <= 2^29, a * b (48 bits) + a (24 bits)
    # spans at most 53 bits, so float64 holds it exactly.
    exact_in_double = (numpy.abs(b) >= 2.0 ** -6) & (numpy.abs(b) <= 2.0 ** 29)
    with numpy.errstate(all='ignore'):
        exact = (a.astype(numpy.float64) * b + a).astype(numpy.float32)
    assert exact_in_double.sum() > 500
    numpy.testing.assert_array_equal(out[6][exact_in_double], exact[exact_in_double])


def by_value_args():
    float4 = numpy.dtype({'names': list('xyzw'), 'formats': [numpy.float32] * 4})
    half2 = numpy.dtype({'names': list('xy'), 'formats': [numpy.float16] * 2})
    affine = numpy.dtype({'names': ['scale', 'shift', 'n', 'pad'],
                          'formats': [numpy.float32, numpy.float32, numpy.int32, numpy.int32]})
    return (numpy.array((1, 2, 3, 4), float4), numpy.array((0.5, -2), half2),
            numpy.array((1.5, 0.25, 6, 0), affine))


def test_vector_types_and_structs_by_value(mod):
    # as CuPy 13 takes them: NumPy arrays of size 1 (a structured dtype) of the type's size;
    # CuPy refuses a numpy.void scalar, so the emulator does too
    k = mod.get_function('by_value')
    assert k.signature == 'by_value(float4, __half2, struct of 16 bytes, float*)'
    out = numpy.zeros(7, numpy.float32)
    v, h, a = by_value_args()
    for _ in range(20):        # the values sit at different addresses each time: alignment
        k((1,), (32,), (v, h, a, out))
        numpy.testing.assert_array_equal(out, [1, 2, 3, 4, 0.5, -2, 1.5 * 6 + 0.25])
    with pytest.raises(TypeError, match=r'argument 0 \(float4\).*expected a NumPy array of size 1 '
                                        r'holding 16 bytes.*got numpy scalar float32'):
        k((1,), (32,), (numpy.float32(1), h, a, out))
    with pytest.raises(TypeError, match=r'argument 0 \(float4\).*got numpy scalar'):
        k((1,), (32,), (v[()], h, a, out))                     # a numpy.void: CuPy refuses it
    with pytest.raises(TypeError, match=r'argument 1 \(__half2\).*holding 4 bytes.*of 2 bytes'):
        k((1,), (32,), (v, numpy.ones(1, numpy.float16), a, out))
    with pytest.raises(TypeError, match=r'argument 2 \(struct of 16 bytes\).*got Python int'):
        k((1,), (32,), (v, h, 16, out))


def test_dynamic_shared_memory_name_is_scoped_to_its_kernel():
    # `extern __shared__ float buf[]` in one kernel must not rename a `buf` of a later kernel
    code = '''
    extern "C" __global__ void first(float* out) {
      extern __shared__ float buf[];
      buf[threadIdx.x] = (float)threadIdx.x;
      __syncthreads();
      out[threadIdx.x] = buf[blockDim.x - 1 - threadIdx.x];
    }
    extern "C" __global__ void second(float* out) {
      __shared__ float buf[32];
      float local[2] = {1.0f, 2.0f};
      buf[threadIdx.x] = local[threadIdx.x % 2];
      __syncthreads();
      out[threadIdx.x] = buf[threadIdx.x];
    }'''
    m = emulator.RawModule(code=code)
    out = numpy.zeros(32, numpy.float32)
    m.get_function('first')((1,), (32,), (out,), shared_mem=32 * 4)
    numpy.testing.assert_array_equal(out, numpy.arange(32)[::-1])
    m.get_function('second')((1,), (32,), (out,))
    numpy.testing.assert_array_equal(out, numpy.tile([1, 2], 16))


def test_kernels_in_comments_are_not_entry_points():
    code = '''// extern "C" __global__ void old_kernel(float* x) {  (removed)
    /* extern "C" __global__ void older(float* x) */
    extern "C" __global__ void fill(float* x) { x[threadIdx.x] = 2.0f; }  // "quoted */ braces {"
    '''
    assert emulator.entry_points(code) == ['fill']
    x = numpy.zeros(4, numpy.float32)
    emulator.RawModule(code=code).get_function('fill')((1,), (4,), (x,))
    assert (x == 2).all()


def test_many_parameters():
    n = 100             # CUDA takes up to 4 KiB of parameters
    params = ', '.join('const float* a{}'.format(i) for i in range(n))
    body = ' + '.join('a{}[threadIdx.x]'.format(i) for i in range(n))
    code = 'extern "C" __global__ void k({}, float* out) {{ out[threadIdx.x] = {}; }}'.format(
        params, body)
    arrays = [numpy.full(8, i, numpy.float32) for i in range(n)]
    out = numpy.zeros(8, numpy.float32)
    emulator.RawModule(code=code).get_function('k')((1,), (8,), (*arrays, out))
    assert (out == sum(range(n))).all()


def test_empty_views_and_read_only_arrays(mod):
    k = mod.get_function('vector_add')
    big = numpy.arange(8, dtype=numpy.float32)
    c = numpy.zeros(0, numpy.float32)
    # empty views inside another argument overlap nothing
    inside = numpy.ndarray((0,), numpy.float32, buffer=big, offset=8)
    assert big.ctypes.data < inside.ctypes.data
    k((1,), (4,), (inside, big, c, numpy.int32(0)))
    k((1,), (4,), (big, inside, c, numpy.int32(0)))
    k((1,), (4,), (big[3:3], big[3:3], big[5:5], numpy.int32(0)))
    ro = numpy.arange(4, dtype=numpy.float32)
    ro.flags.writeable = False
    out = numpy.zeros(4, numpy.float32)
    k((1,), (4,), (ro, ro, out, numpy.int32(4)))            # the same read-only array twice
    numpy.testing.assert_array_equal(out, ro * 2)


def sigsegv_state():
    """The SIGSEGV, SIGBUS and SIGFPE handlers and flags, and this thread's alternate signal stack
    (glibc's x86-64 / aarch64 layouts: handler at 0, the kernel's 8 mask bytes at 8, flags at
    136)."""
    import ctypes.util
    libc = ctypes.CDLL(ctypes.util.find_library('c'), use_errno=True)
    state = []
    for sig in (signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE):
        buf = ctypes.create_string_buffer(512)
        assert libc.sigaction(int(sig), None, buf) == 0
        state.append((buf.raw[0:16], buf.raw[136:140]))
    ss = ctypes.create_string_buffer(64)
    assert libc.sigaltstack(None, ss) == 0
    return state + [ss.raw[:24]]


def test_fault_handlers_are_restored_after_each_launch(mod, buggy):
    import faulthandler
    faulthandler.enable()                 # its handler and alternate stack must come back
    before = sigsegv_state()
    test_vector_add_grid_stride(mod, 33)
    assert sigsegv_state() == before
    with pytest.raises(KernelLaunchError):
        buggy.get_function('copy_no_bounds_check')((4,), (BLOCK,), (numpy.zeros(1000, numpy.float32),
                                                                    numpy.zeros(1000, numpy.float32),
                                                                    numpy.int32(1000)))
    assert sigsegv_state() == before
    with pytest.raises(KernelLaunchError, match='stack overflow'):
        buggy.get_function('recurse')((1,), (2,), (numpy.zeros(2, numpy.int32),))
    assert sigsegv_state() == before
    with pytest.raises(KernelLaunchError, match=r'INT_MIN / -1\): SIGFPE'):     # the trap itself
        buggy.get_function('divide_trap')((1,), (1,), (numpy.array([-2 ** 31], numpy.int32),
                                                  numpy.array([-1], numpy.int32),
                                                  numpy.zeros(1, numpy.int32)))
    assert sigsegv_state() == before
    # and the emulator still works after all of that, faults included
    with pytest.raises(KernelLaunchError, match='element 1000 of 1000'):
        buggy.get_function('copy_no_bounds_check')((4,), (BLOCK,), (numpy.zeros(1000, numpy.float32),
                                                                    numpy.zeros(1000, numpy.float32),
                                                                    numpy.int32(1000)))
    test_vector_add_grid_stride(mod, 1000)


def test_shuffle_from_a_lane_that_does_not_exist(buggy):
    out = numpy.zeros(48, numpy.int32)
    with pytest.raises(KernelLaunchError, match=r'warp shuffle reads lane 16, which does not exist '
                                                r'\(this warp has 16 lanes: blockDim 48\) in thread '
                                                r'\(32,0,0\)'):
        buggy.get_function('reduce_partial_warp')((1,), (48,), (out,))


def test_shuffle_from_an_exited_lane(buggy):
    out = numpy.zeros(32, numpy.int32)
    with pytest.raises(KernelLaunchError, match=r'warp shuffle reads lane 20, which has exited in '
                                                r'thread \(4,0,0\)'):
        buggy.get_function('shuffle_after_return')((1,), (32,), (out,))


def test_lanes_in_different_collectives_are_reported(buggy):
    out = numpy.zeros(32, numpy.int32)
    with pytest.raises(KernelLaunchError, match=r'warp collective mismatch: lane \d+ is in .* with '
                                                r'mask 0xffffffff while lane \d+ is in '):
        buggy.get_function('mismatched_collectives')((1,), (32,), (out,))


def test_an_address_passed_as_an_integer_is_memory_the_launch_does_not_hold(buggy):
    """A GPU kernel given a host address (or a device allocation it was not given) reads
    whatever is there: the emulator refuses any access outside what the launch gave it."""
    host = numpy.arange(32, dtype=numpy.float32)
    out = numpy.zeros(32, numpy.float32)
    with pytest.raises(KernelLaunchError, match=r"kernel 'through_an_integer': a read of 4 bytes "
                                                r"at address 0x[0-9a-f]+ in thread \(0,0,0\) .*"
                                                r"memory the launch did not give the kernel"):
        buggy.get_function('through_an_integer')((1,), (32,), (numpy.uint64(host.ctypes.data),
                                                              out))
    assert (out == 0).all()


def test_a_volatile_read_modify_write_loses_updates_under_a_random_schedule(buggy):
    count = numpy.zeros(1, numpy.uint32)
    buggy.get_function('volatile_count')((4,), (64,), (count,))     # one thread at a time
    assert count[0] == 256
    with emulator.checking(race=True, schedules=['forward', 'random:1']):
        with pytest.raises(KernelLaunchError, match=r"kernel 'volatile_count': the result depends "
                                                    r"on the order in which threads run"):
            buggy.get_function('volatile_count')((4,), (64,), (numpy.zeros(1, numpy.uint32),))


def test_an_uninitialised_local_is_not_zero(buggy):
    """Fresh fiber stacks are zero, which made an uninitialised accumulator sum right: locals
    start as 0xFE bytes (-1.7e38 as a float), as garbage would on a GPU."""
    x = numpy.ones((32, 5), numpy.float32)
    out = numpy.zeros(32, numpy.float32)
    buggy.get_function('uninitialised_accumulator')((1,), (32,), (x, out, numpy.int32(5)))
    assert (numpy.abs(out) > 1e37).all(), out


def test_a_local_array_overrun_through_a_pointer_is_reported(buggy):
    x = numpy.arange(4, dtype=numpy.float32)
    out = numpy.zeros(32, numpy.float32)
    with pytest.raises(KernelLaunchError, match=r"past the end of its object \(a local or static "
                                                r"array reached through a pointer\)"):
        buggy.get_function('local_array_overrun')((1,), (32,), (x, out))


def test_blocks_and_barriers_are_fast(mod):
    import time
    x = numpy.zeros(1024 * 100, numpy.float32)
    t = time.perf_counter()
    mod.get_function('block_sum')((100,), (1024,), (x.astype(numpy.float64), numpy.zeros(100),
                                                    numpy.int32(x.size)), shared_mem=1024 * 8)
    n = 1000 * 100
    out = numpy.zeros(blocks(n, 1024), numpy.int32)
    mod.get_function('warp_sum')((blocks(n, 1024),), (1024,), (numpy.ones(n, numpy.int32), out,
                                                                numpy.int32(n)))
    elapsed = time.perf_counter() - t
    assert (out[:-1] == 1024).all()
    assert elapsed < 1.0, elapsed      # 200 blocks of 1024 threads, 11 barriers / 10 shuffles each


def test_modules_do_not_share_static_storage():
    # The same templated kernel built with different sizes: with default visibility g++ would make
    # the slot of its __shared__ array (and the emulator's runtime) one process-wide object, so one
    # module would use the other's size for the array.
    code = '''
    template <typename T> __device__ T* scratch() { __shared__ T buf[SIZE]; return buf; }
    extern "C" __global__ void fill(float* out, unsigned long long* where) {
      float* b = scratch<float>();
      for (int i = threadIdx.x; i < SIZE; i += blockDim.x) b[i] = (float)i;
      __syncthreads();
      if (threadIdx.x == 0) {
        float s = 0.0f;
        for (int i = 0; i < SIZE; ++i) s += b[i];
        out[0] = s;
        where[0] = (unsigned long long)&::ctemu::grid_dim;
      }
    }'''
    small = emulator.RawModule(code=code, options=('-DSIZE=4',))
    large = emulator.RawModule(code=code, options=('-DSIZE=4096',))
    out, a, b = numpy.zeros(1, numpy.float32), numpy.zeros(1, numpy.uint64), numpy.zeros(1, numpy.uint64)
    for _ in range(2):
        large.get_function('fill')((1,), (64,), (out, a))
        assert out[0] == 4095 * 4096 / 2
        small.get_function('fill')((1,), (64,), (out, b))
        assert out[0] == 6
    assert a[0] != b[0]


@pytest.mark.parametrize('n', [4, 10, 13, 1001])
def test_vector_loads_from_arrays_of_any_length(mod, n):
    # float4 loads need 16-byte alignment even when the array's length is not a multiple of 4
    x = numpy.arange(n, dtype=numpy.float32)
    out = numpy.zeros(1, numpy.float32)
    mod.get_function('sum_float4')((1,), (32,), (x, out, numpy.int32(n)))
    assert out[0] == x.sum()


def test_spin_wait_with_nanosleep_lets_other_threads_run(tmp_path):
    # thread 0 waits for a flag that thread 1 sets: __nanosleep must let thread 1 run (in a
    # subprocess, since the failure mode is a hang)
    script = tmp_path / 'spin.py'
    script.write_text('''
import numpy
from chainer_tc.testing import emulator
code = """extern "C" __global__ void k(int* out) {
  __shared__ volatile int flag;
  if (threadIdx.x == 0) flag = 0;       // shared memory starts as the previous block left it
  __syncthreads();
  if (threadIdx.x == 0) {
    while (flag != 7) __nanosleep(100);
    out[0] = flag;
  } else if (threadIdx.x == 1) {
    flag = 7;
    __threadfence_block();
  }
}"""
out = numpy.zeros(1, numpy.int32)
emulator.RawModule(code=code).get_function('k')((1,), (2,), (out,))
print(out[0])
''')
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=30)
    assert proc.stdout.strip() == '7', proc.stderr


def test_none_is_a_null_pointer():
    code = '''extern "C" __global__ void maybe_add(const float* a, const float* b, float* out) {
      int i = threadIdx.x;
      out[i] = a[i] + (b ? b[i] : 100.0f);
    }'''
    m = emulator.RawModule(code=code)
    a, b, out = numpy.ones(4, numpy.float32), numpy.full(4, 2, numpy.float32), numpy.zeros(4, numpy.float32)
    m.get_function('maybe_add')((1,), (4,), (a, b, out))
    assert (out == 3).all()
    m.get_function('maybe_add')((1,), (4,), (a, None, out))
    assert (out == 101).all()
    with pytest.raises(TypeError, match='expected a NumPy array; got Python int'):
        m.get_function('maybe_add')((1,), (4,), (a, 0, out))


def test_shared_declarations_of_every_form():
    # rewritten to per-block storage: file and namespace scope, qualifiers, several declarators,
    # alignment, pointers
    code = '''
    __shared__ int file_scope_counter;
    namespace ns { __shared__ float ns_buf[4]; __device__ void put() { ns_buf[1] = 2.0f; } }
    extern "C" __global__ void k(float* out) {
      static __shared__ volatile unsigned flags[2], *none;
      __shared__ __align__(16) float4 v4[2];
      if (threadIdx.x == 0) {
        file_scope_counter = 5; ns::put(); flags[1] = 3; v4[1].y = 4.0f;
        none = flags;
      }
      __syncthreads();
      out[threadIdx.x] = file_scope_counter + ns_buf[1] + none[1] + v4[1].y +
                         (float)((unsigned long long)v4 % 16);
    }'''
    m = emulator.RawModule(code=code)
    out = numpy.zeros(4, numpy.float32)
    with emulator.checking(race=True, schedules=['forward', 'reverse']):
        m.get_function('k')((1,), (4,), (out,))
    assert (out == 14).all()


@pytest.mark.parametrize('macro', [
    '#define SCRATCH __shared__ float scratch[8];',
    '#define SCRATCH(n) \\\n  __shared__ float n[8];',        # a continued line
])
def test_a_shared_declaration_inside_a_macro_is_refused(macro):
    # expanded in two kernels, twice in one, or at namespace scope: the emulator cannot tell
    # which, and one static for every block would hide races between the blocks it interleaves
    code = macro + '''
    extern "C" __global__ void k(float* out) {
      out[threadIdx.x] = 1.0f;
    }'''
    with pytest.raises(emulator.CompileError,
                       match=r'__shared__ declaration inside a macro \(line [12]\)'):
        emulator.RawModule(code=code).get_function('k')


def test_a_declaration_after_a_continued_line_is_rewritten():
    # the line before the declaration ends with a backslash but is no directive
    code = '''#define ONE 1.0f
    extern "C" __global__ void k(float* out) {
      float two = ONE + \\
        ONE; __shared__ float s[4];
      s[threadIdx.x] = two * blockIdx.x + threadIdx.x;
      __syncthreads();
      out[4 * blockIdx.x + threadIdx.x] = s[3 - threadIdx.x];
    }'''
    out = numpy.zeros(8, numpy.float32)
    with emulator.checking(race=True, schedules=['forward', 'reverse']):
        emulator.RawModule(code=code).get_function('k')((2,), (4,), (out,))
    assert out.tolist() == [3, 2, 1, 0, 5, 4, 3, 2]


def test_runtime_works_under_a_fortifying_compiler(tmp_path):
    """Ubuntu's g++ defines _FORTIFY_SOURCE at -O2, which turns the runtime's _longjmp between
    thread stacks into __longjmp_chk: every kernel with a __syncthreads aborted ('longjmp causes
    uninitialized stack frame'), first seen on the GPU machine. A compiler that fortifies by
    default, building the runtime afresh, must still run a kernel that syncs its threads."""
    import os
    import subprocess
    import sys
    cxx = tmp_path / 'g++'
    cxx.write_text('#!/bin/sh\nexec {} -D_FORTIFY_SOURCE=3 "$@"\n'.format(emulator._compiler()))
    cxx.chmod(0o755)
    env = dict(os.environ, CXX=str(cxx), CHAINER_TC_CACHE_DIR=str(tmp_path / 'cache'))
    code = '\n'.join([
        'import numpy',
        'from chainer_tc.testing import emulator',
        'from conftest import cuda_source',
        'mod = emulator.RawModule(path=cuda_source("selftest.cu"))',
        'x, out = numpy.arange(1000, dtype=numpy.float64), numpy.zeros(4)',
        'mod.get_function("block_sum")((4,), (256,), (x, out, numpy.int32(x.size)),',
        '                              shared_mem=256 * 8)',
        'print(float(out.sum()))'])
    proc = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.abspath(__file__)), timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert float(proc.stdout.split()[-1]) == float(numpy.arange(1000).sum())


def test_a_read_of_shared_memory_no_thread_wrote_is_reported(buggy):
    """Slots 4-31 of the warp maxima were never written: the 0xff bytes the emulator fills them
    with are a NaN that fmaxf drops, so the values came out right; a GPU's slots hold what the
    previous block left there."""
    x = numpy.arange(2 * 128, dtype=numpy.float32)
    out = numpy.zeros(2, numpy.float32)
    with pytest.raises(KernelLaunchError, match=r"kernel 'max_over_unwritten_slots': a read of 4 "
                                                r"bytes at offset 16 of __shared__ variable 'part' "
                                                r".* in thread \(4,0,0\) of block \(0,0,0\).* "
                                                r"reads bytes no thread of this block wrote"):
        buggy.get_function('max_over_unwritten_slots')((2,), (128,), (x, out))
    out = numpy.zeros(1, numpy.float32)        # a full block of 32 warps writes every slot
    buggy.get_function('max_over_unwritten_slots')((1,), (1024,), (x.repeat(4), out))
    assert out[0] == 255


def test_threads_at_two_different_barriers_are_reported(buggy):
    x = numpy.ones(40, numpy.float32)
    out = numpy.zeros(32, numpy.float32)
    with pytest.raises(KernelLaunchError, match=r"kernel 'barrier_in_an_uneven_loop': threads of "
                                                r"one block wait at two different __syncthreads\(\)"
                                                r": this thread at .*buggy.cu:(\d+), thread "
                                                r"\(\d+,0,0\) of block \(0,0,0\) at .*buggy.cu:"
                                                r"(?!\1)\d+"):
        buggy.get_function('barrier_in_an_uneven_loop')((1,), (32,), (x, out, numpy.int32(40)))
    x = numpy.ones(64, numpy.float32)                  # two rounds for every thread
    buggy.get_function('barrier_in_an_uneven_loop')((1,), (32,), (x, out, numpy.int32(64)))
    assert (out == 64).all()


def test_signed_overflow_in_index_arithmetic_is_reported(buggy):
    x = numpy.ones(32, numpy.float32)
    out = numpy.zeros(32, numpy.float32)
    buggy.get_function('offset_in_int')((1,), (32,), (x, out, numpy.int32(256), numpy.int32(64),
                                                      numpy.int32(112 * 112)))
    assert (out == 1).all()
    with pytest.raises(KernelLaunchError, match=r"signed integer overflow: 65472 \* 50176 does not "
                                                r"fit type 'int' at .*buggy.cu:\d+"):
        buggy.get_function('offset_in_int')((1,), (32,), (x, out, numpy.int32(1024),
                                                          numpy.int32(64), numpy.int32(224 * 224)))


def test_a_shift_by_the_type_width_is_reported(buggy):
    out = numpy.zeros(32, numpy.uint32)
    buggy.get_function('shift_by_width')((1,), (32,), (numpy.arange(32, dtype=numpy.uint32), out))
    assert (out == 1 << numpy.arange(32, dtype=numpy.uint64)).all()
    with pytest.raises(KernelLaunchError, match=r"shift exponent 32 is out of range for the 32-bit "
                                                r"type 'unsigned int'"):
        buggy.get_function('shift_by_width')((1,), (32,), (numpy.full(32, 32, numpy.uint32), out))


@pytest.mark.parametrize('value', [3e9, float('nan'), -3e9])
def test_a_float_to_int_cast_out_of_range_is_reported(buggy, value):
    x = numpy.full(32, 7.5, numpy.float32)
    out = numpy.zeros(32, numpy.int32)
    buggy.get_function('cast_out_of_range')((1,), (32,), (x, out))
    assert (out == 7).all()
    x[5] = value
    with pytest.raises(KernelLaunchError, match=r"(3e\+09|nan|-3e\+09) is outside the range of "
                                                r"'int', converted from 'float' .*buggy.cu:\d+ .*"
                                                r"in thread \(5,0,0\)"):
        buggy.get_function('cast_out_of_range')((1,), (32,), (x, out))
