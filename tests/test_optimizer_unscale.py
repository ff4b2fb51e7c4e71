"""kernels/optimizer.cu's unscaling, launched directly in the emulator against a NumPy reference,
bit for bit: a power-of-two divisor whose reciprocal is normal is applied as a multiplication
(GRAD_MUL), any other divisor keeps the IEEE division (GRAD_DIV); both must give the bits of
grad / divisor for every gradient, including quotients that overflow, underflow to subnormals or
zero, signed zeros, inf and nan. The update's two element paths (pairs, where every array of a
chunk is aligned to two elements, and one element at a time) must agree with the reference too,
and the check must flag exactly the gradients whose quotient is not finite.

By default the emulator, like NumPy, keeps float32 subnormals; a GPU under CuPy's -ftz=true
flushes them in both the division and the multiplication (docs/optimizer.md). The float16 and
float32 launches are also run flushing them (emulator.checking(ftz=True)) against a reference
that flushes each float32 operation: what a GPU computes, bit for bit.
"""
import numpy
import pytest

from chainer_tc import kernels
from chainer_tc.testing import emulator
from chainer_tc.testing import kernel_cases

f16, f32, f64 = numpy.float16, numpy.float32, numpy.float64
LR, MOMENTUM, WD = 0.05, 0.9, 1e-3
SCALE_STATIC, SCALE_DYNAMIC = 1, 2


@pytest.fixture(scope='module')
def module():
    return emulator.RawModule(code=kernels.source('optimizer'),
                              options=tuple('-D{}={}'.format(k, v)
                                            for k, v in kernel_cases.OPT.items()))


def special_gradient(dtype, n, seed):
    """Random gradients with the values that matter for unscaling mixed in: the largest finite
    value (overflows once divided by a d < 1), the smallest normal and subnormal ones (underflow
    once divided by a large d), signed zeros."""
    r = numpy.random.RandomState(seed)
    info = numpy.finfo(dtype)
    g = (r.randn(n) * 100).astype(dtype)
    special = numpy.array([info.max, -info.max, info.tiny, -info.tiny,
                           info.smallest_subnormal, -info.smallest_subnormal, 0.0, -0.0,
                           info.max / 3, info.tiny * 3], dtype)
    at = r.choice(n, min(n, special.size), replace=False)
    g[at] = special[:at.size]
    return g


def flush(x):
    """A GPU under -ftz=true: float32 subnormals read and written as zeros of their sign."""
    x = numpy.asarray(x)
    if x.dtype != f32:
        return x
    return numpy.where(numpy.abs(x) < numpy.finfo(f32).tiny, numpy.copysign(f32(0), x), x)


def reference(p, v, g, d, dtype, divide=True, p16=None, ftz=False):
    """The kernel's arithmetic in NumPy, each operation rounded once; with ``ftz``, each float32
    operation's inputs and result flushed as on a GPU. (The result is flushed after rounding;
    the CPU's FTZ, which the emulator uses, flushes one that is below 2^-126 before rounding, so
    the two differ for exact results in [2^-126 - 2^-150, 2^-126), which these tests' values
    never give; which of the two a GPU does is left for a GPU to show.)"""
    t = f64 if dtype == f64 else f32
    fz = flush if ftz else numpy.asarray

    def mul(a, b):
        return fz(fz(a) * fz(b))

    def add(a, b):
        return fz(fz(a) + fz(b))

    with numpy.errstate(all='ignore'):
        grad = g.astype(t)
        if divide:
            grad = fz(fz(grad) / fz(t(d)))
        p = p.copy()
        if p16 is not None:          # adopt float16 values written from outside
            stale = p.astype(f16).view(numpy.uint16) != p16.view(numpy.uint16)
            p[stale] = p16[stale].astype(f32)
        grad = add(grad, mul(t(WD), p))
        v = fz(mul(v, t(MOMENTUM)) - mul(t(LR), grad))
        p = add(p, v)
        return p, v, (p.astype(f16) if p16 is not None else None)


def launch(module, dtype, grads, scale, scaling=SCALE_STATIC, grad_divisor=0.0, offset=0,
           divide=True, adopt=False, write=None, divisors=None):
    """One check + update over the gradients ``grads`` (one parameter each, laid out one after
    another from flat element ``offset``) with loss scale ``scale``; returns the outputs and the
    inputs they started from. ``write`` (default: divided float32 and float64 gradients, as the
    optimizer asks): set bit 1, the quotients written back; they are returned as
    ``out['grad']`` (``offset`` zeros first) and ``grads`` are given back as they were.
    ``divisors``: each gradient's divisor (0: the device scale), with grad_divisor -1."""
    if write is None:
        write = divide and dtype != f16
    sizes = [g.size for g in grads]
    total = offset + sum(sizes)
    r = numpy.random.RandomState(len(sizes) + total)
    group = {f32: 0, f16: 1, f64: 2}[dtype]
    a = {'p32': numpy.zeros(1, f32), 'p16': numpy.zeros(1, f16), 'master': numpy.zeros(1, f32),
         'mom32': numpy.zeros(1, f32), 'mom16': numpy.zeros(1, f32), 'p64': numpy.zeros(1, f64),
         'mom64': numpy.zeros(1, f64)}
    t = f64 if dtype == f64 else f32
    p = r.randn(total).astype(t)
    v = (r.randn(total) * 0.1).astype(t)
    if dtype == f16:
        a['p16'] = p.astype(f16)
        if adopt:                    # every third float16 parameter written from outside
            a['p16'][::3] = (r.randn(a['p16'][::3].size)).astype(f16)
        a['master'], a['mom16'] = p, v
    elif dtype == f32:
        a['p32'], a['mom32'] = p, v
    else:
        a['p64'], a['mom64'] = p, v
    start = {k: x.copy() for k, x in a.items()}
    rows, off = [], offset
    for i, n in enumerate(sizes):
        for inner in range(0, n, kernel_cases.OPT_CHUNK):
            rows.append((off + inner, inner, min(kernel_cases.OPT_CHUNK, n - inner),
                         i | (group << 16) | (i << 32)))
        off += n
    chunks = numpy.array(rows, numpy.int64).reshape(-1, 4)
    hyper = numpy.zeros((1 + len(sizes), 4))
    hyper[0, :3] = (LR, MOMENTUM, WD)
    hyper[1:, 3] = 1                 # enabled, the optimizer's hyperparameters
    hyper = hyper.reshape(-1)
    scaler = numpy.zeros(8, numpy.uint32)
    scaler[0] = f32(scale).view(numpy.uint32)
    sp = numpy.zeros(1, kernel_cases.STEP_PARAMS)
    sp['scaling'], sp['interval'] = scaling, 1000
    sp['min_scale'], sp['max_scale'] = 2.0 ** -126, 2.0 ** 127
    sp['total_blocks'] = chunks.shape[0]
    sp['grad_divisor'] = grad_divisor
    for i, g in enumerate(grads):
        sp['grad'][0, i] = g.ctypes.data | (1 if divide else 0) | (2 if write else 0)
    div = numpy.zeros(len(grads)) if divisors is None else numpy.array(divisors, f64)
    before = [g.copy() for g in grads]
    start['grad'] = numpy.concatenate([numpy.zeros(offset, dtype)] + before)
    block = (kernel_cases.OPT['OPT_BLOCK'],)
    with emulator.checking(race=True, schedules=['forward', 'reverse', 'random:5']):
        if scaling == SCALE_DYNAMIC:
            module.get_function('momentum_sgd_check')((chunks.shape[0],), block,
                                                      (sp, chunks, div, scaler))
        module.get_function('momentum_sgd_update')(
            (chunks.shape[0],), block,
            (sp, chunks, div, a['p32'], a['p16'], a['master'], a['mom32'], a['mom16'], a['p64'],
             a['mom64'], hyper, scaler))
    a['grad'] = numpy.concatenate([numpy.zeros(offset, dtype)] + [g.copy() for g in grads])
    for g, b in zip(grads, before):
        g[...] = b
    return a, start, scaler


def expected(dtype, grads, d, start, offset=0, divide=True, ftz=False):
    """The reference's outputs; ``d``: the divisor, or one per gradient. The gradients as the
    update leaves them: float32 and float64 ones divided (written back), float16 ones as they
    were."""
    p_name, v_name = {f32: ('p32', 'mom32'), f16: ('master', 'mom16'), f64: ('p64', 'mom64')}[dtype]
    g = numpy.concatenate([numpy.zeros(offset, grads[0].dtype)] + list(grads))
    if numpy.ndim(d):
        d = numpy.concatenate([numpy.ones(offset)] + [numpy.full(x.size, s)
                                                      for x, s in zip(grads, d)])
    p, v, p16 = reference(start[p_name], start[v_name], g, d, dtype, divide,
                          start['p16'] if dtype == f16 else None, ftz)
    out = {p_name: p, v_name: v, 'grad': g}
    if dtype == f16:
        out['p16'] = p16
    elif divide:
        t = f64 if dtype == f64 else f32
        fz = flush if ftz else numpy.asarray
        with numpy.errstate(all='ignore'):
            out['grad'] = fz(fz(g) / fz(numpy.asarray(d).astype(t))).astype(dtype)
    return {k: x[offset:] for k, x in out.items()}


def assert_bits(out, want, offset=0):
    for k, w in want.items():
        numpy.testing.assert_array_equal(out[k][offset:].view(numpy.uint8), w.view(numpy.uint8),
                                         err_msg=k)


# 3 and 1000: divided (not powers of two); 2^-127: a subnormal divisor, 2^127: a subnormal
# reciprocal, both divided; the others multiplied by their exact reciprocal
SCALES = [3.0, 1000.0, 2.0 ** -126, 2.0 ** -127, 0.5, 1.0, 2.0 ** 15, 2.0 ** 24, 2.0 ** 126,
          2.0 ** 127]


@pytest.mark.parametrize('scale', SCALES, ids=lambda s: '{:g}'.format(s))
@pytest.mark.parametrize('dtype', [f16, f32, f64], ids=lambda d: d.__name__)
def test_unscaled_update_is_the_quotient_bit_for_bit(module, dtype, scale):
    """The device scale (float32) divides the gradients: 2049 elements (a pair path with an odd
    tail chunk) and 31 (one chunk, odd), special values included."""
    grads = [special_gradient(dtype, 2049, 1), special_gradient(dtype, 31, 2)]
    out, start, _ = launch(module, dtype, grads, scale, adopt=True)
    assert_bits(out, expected(dtype, grads, scale, start))


@pytest.mark.parametrize('scale', [3.0, 2.0 ** 15], ids=lambda s: '{:g}'.format(s))
@pytest.mark.parametrize('dtype', [f16, f32, f64], ids=lambda d: d.__name__)
def test_update_keeps_numpys_bits_where_a_gpu_contracts(module, dtype, scale):
    """NVRTC contracts a * b + c into an fma unless told not to (CuPy compiles with its default
    -fmad=true): the update writes every operation with an _rn intrinsic, so that a GPU rounds
    each one as NumPy does. Under emulator.checking(fmad=True) the emulator contracts as NVRTC
    does; written with plain operators the update differs from NumPy there (the mutation tool's
    plain_arithmetic mutant), and this is the only test that sees it."""
    grads = [special_gradient(dtype, 2049, 1), special_gradient(dtype, 31, 2)]
    with emulator.checking(fmad=True):
        out, start, _ = launch(module, dtype, grads, scale, adopt=True)
    assert_bits(out, expected(dtype, grads, scale, start))


@pytest.mark.parametrize('scale', SCALES, ids=lambda s: '{:g}'.format(s))
@pytest.mark.parametrize('dtype', [f16, f32], ids=lambda d: d.__name__)
def test_unscaled_update_under_ftz_is_what_a_gpu_computes(module, dtype, scale):
    """The same launches with float32 subnormals flushed, as CuPy's -ftz=true makes a GPU do,
    against the reference with each float32 operation flushed: the multiplication by an exact
    reciprocal still gives the quotient's bits. A subnormal divisor (2^-127) is zero there, so
    its quotients are infinite (or nan for a zero gradient), which NumPy's path does not give;
    and 2^127, whose reciprocal would flush to zero, must keep the division: the mutation that
    lets it multiply is caught here by its results (float32 gradients of magnitude 2 or more). (float64 is left out: the emulator flushes
    float64 subnormals too, a GPU does not.)"""
    grads = [special_gradient(dtype, 2049, 1), special_gradient(dtype, 31, 2)]
    with emulator.checking(ftz=True):
        out, start, _ = launch(module, dtype, grads, scale, adopt=True)
    assert_bits(out, expected(dtype, grads, scale, start, ftz=True))
    if scale == 2.0 ** -127:
        p = out['master' if dtype == f16 else 'p32']
        assert not numpy.isfinite(p).any()


@pytest.mark.parametrize('divisor', [10.0, 2.0 ** -1022, 2.0 ** -1023, 2.0 ** 1022, 2.0 ** 1023,
                                     2.0 ** -200, 2.0 ** 100],
                         ids=lambda s: '{:g}'.format(s))
def test_host_divisor_of_float64_gradients(module, divisor):
    """A backward's loss_scale (StepParams.grad_divisor, a double): float64 parameters divide by
    it in float64, where the exact-reciprocal range is [2^-1022, 2^1022]."""
    grads = [special_gradient(f64, 700, 3)]
    out, start, _ = launch(module, f64, grads, 1.0, grad_divisor=divisor)
    assert_bits(out, expected(f64, grads, divisor, start))


@pytest.mark.parametrize('dtype', [f16, f32, f64], ids=lambda d: d.__name__)
@pytest.mark.parametrize('scale', [3.0, 2.0 ** 10], ids=['div', 'mul'])
@pytest.mark.parametrize('where', ['aligned', 'odd offset', 'gradient view'])
def test_pair_and_scalar_paths_give_the_same_bits(module, dtype, scale, where):
    """Pairs need the chunk's flat offset, and the gradient's address, aligned to two elements:
    an odd flat offset or a gradient that is a view at an odd element takes the scalar path (the
    emulator keeps a view's offset, so it is misaligned here as on a GPU), and so does a divided
    gradient. Which path ran is read from the accesses' widths: the pair path reads each two
    gradient elements with one access of twice their width (a __half2, float2 or double2) and
    writes the momenta and float16 parameters the same way."""
    base = special_gradient(dtype, 4099, 4)
    grads = [base[1:] if where == 'gradient view' else base[:4098]]
    offset = 1 if where == 'odd offset' else 0
    with emulator.recording() as launches:
        out, start, _ = launch(module, dtype, grads, scale, offset=offset, adopt=True)
    assert_bits(out, expected(dtype, grads, scale, start, offset), offset)
    (update,) = launches
    pairs = where == 'aligned' and scale != 3.0
    g, t = numpy.dtype(dtype).itemsize, 8 if dtype == f64 else 4
    width, n = (2, 2049) if pairs else (1, 4098)
    assert update.of(grads[0]).reads == {width * g: n}
    # the quotients written back (bit 1), the same way; never a float16 gradient
    assert update.of(grads[0]).writes == ({} if dtype == f16 else {width * g: n})
    momentum = {f16: 'mom16', f32: 'mom32', f64: 'mom64'}[dtype]
    assert update.of(out[momentum]).writes == {width * t: n}
    if dtype == f16:
        assert update.of(out['p16']).writes == {width * 2: n}


@pytest.mark.parametrize('dtype', [f16, f32, f64], ids=lambda d: d.__name__)
def test_each_gradient_divided_by_its_own_divisor(module, dtype):
    """A step whose gradients carry different loss scales (StepParams.grad_divisor -1): each is
    divided by its parameter's entry of ``divisors`` (0: the device scale), a float16 one in
    float32 as Chainer's use_fp32_update divides a float32 copy."""
    grads = [special_gradient(dtype, 700, 7), special_gradient(dtype, 300, 8),
             special_gradient(dtype, 41, 9)]
    scale = 2.0 ** 10
    divisors = [3.0, 0.0, 2.0 ** -3]
    out, start, _ = launch(module, dtype, grads, scale, grad_divisor=-1.0, divisors=divisors)
    assert_bits(out, expected(dtype, grads, [3.0, scale, 2.0 ** -3], start))


@pytest.mark.parametrize('dtype', [f32, f64], ids=lambda d: d.__name__)
def test_quotients_are_written_back_only_where_asked(module, dtype):
    """Bit 1 clear: a divided float32 or float64 gradient is read, not written (the host clears
    it where another gradient shares the memory)."""
    grads = [special_gradient(dtype, 2049, 10)]
    with emulator.recording() as launches:
        out, start, _ = launch(module, dtype, grads, 2.0 ** 10, write=False)
    want = expected(dtype, grads, 2.0 ** 10, start)
    want['grad'] = start['grad']
    assert_bits(out, want)
    assert launches[0].of(grads[0]).writes == {}


@pytest.mark.parametrize('dtype', [f16, f32, f64], ids=lambda d: d.__name__)
def test_unmarked_gradients_are_used_as_they_are(module, dtype):
    grads = [special_gradient(dtype, 300, 5)]
    out, start, _ = launch(module, dtype, grads, 2.0 ** 10, divide=False)
    assert_bits(out, expected(dtype, grads, 1.0, start, divide=False))


@pytest.mark.parametrize('dtype', [f16, f32, f64], ids=lambda d: d.__name__)
@pytest.mark.parametrize('scale', [0.5, 0.75, 2.0 ** -126, 2.0 ** 10, 3.0])
@pytest.mark.parametrize('bad', [None, 'overflow', 'inf', '-inf', 'nan'])
def test_check_flags_exactly_the_nonfinite_quotients(module, dtype, scale, bad):
    """Dynamic scaling: the check flags a gradient whose quotient is inf or nan (a finite value
    that overflows once divided by a scale below 1 included), and then the update writes nothing
    at all; a gradient whose quotient stays finite is not flagged and the step is applied."""
    info = numpy.finfo(dtype)
    r = numpy.random.RandomState(6)
    g = (r.randn(2100) * 10).astype(dtype)
    g[5] = info.max * dtype(0.99) if scale >= 1 else dtype(info.max * scale * 0.5)  # finite quotient
    if bad is not None:
        g[1500] = {'overflow': info.max, 'inf': numpy.inf, '-inf': -numpy.inf,
                   'nan': numpy.nan}[bad]
    with numpy.errstate(all='ignore'):
        t = f64 if dtype == f64 else f32
        quotient_finite = bool(numpy.isfinite(g.astype(t) / t(scale)).all())
    out, start, scaler = launch(module, dtype, [g], scale, scaling=SCALE_DYNAMIC)
    flagged = bool(scaler[3])            # SCALER_SKIPPED: the step counted as skipped
    assert flagged == (not quotient_finite)
    if bad == 'overflow':
        if dtype != f16:             # float16's max, unscaled in float32, need not overflow
            assert flagged == (scale < 1), 'max / d overflows exactly when d < 1'
    elif bad is not None:
        assert flagged
    if flagged:
        for k in start:
            numpy.testing.assert_array_equal(out[k].view(numpy.uint8),
                                             start[k].view(numpy.uint8), err_msg=k)
    else:
        assert_bits(out, expected(dtype, [g], scale, start))


_PROBE = r'''
extern "C" __global__ void probe_exact_reciprocal(const float* f, int* mf, const double* d,
                                                  int* md, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    mf[i] = opt::exact_reciprocal(f[i]);
    md[i] = opt::exact_reciprocal(d[i]);
  }
}
'''


def test_the_multiplication_is_chosen_only_where_a_gpu_flushes_nothing(source=None):
    """Which divisors become a multiplication: the bound that only -ftz=true needs (a subnormal
    divisor or reciprocal is 0 on a GPU, so 2^127 and 2^-127 must keep the division). Only the
    float32 upper bound shows in results under checking(ftz=True) (test above): multiplying by
    2^-127 flushed to 0 loses the quotient, while 2^-127 as a multiplier would give r = inf, and
    x * inf has the bits of x / 0. The float64 bounds cannot (the emulator flushes float64
    subnormals too, a GPU does not), so the decision itself is checked. float32: 2^-126 .. 2^126; float64: 2^-1022 .. 2^1022; powers of two only, either
    sign; never 0, inf, nan or a subnormal."""
    m = emulator.RawModule(code=(source or kernels.source('optimizer')) + _PROBE,
                           options=tuple('-D{}={}'.format(k, v)
                                         for k, v in kernel_cases.OPT.items()))
    both = [(1.0, 1, 1), (2.0, 1, 1), (0.5, 1, 1), (-4.0, 1, 1), (2.0 ** 15, 1, 1),
            (2.0 ** 126, 1, 1), (2.0 ** -126, 1, 1), (2.0 ** 127, 0, 1), (2.0 ** -127, 0, 1),
            (2.0 ** -149, 0, 1), (3.0, 0, 0), (1000.0, 0, 0), (1.0 + 2.0 ** -23, 0, 0),
            (0.0, 0, 0), (-0.0, 0, 0), (numpy.inf, 0, 0), (numpy.nan, 0, 0)]
    double_only = [(2.0 ** 1022, 1), (2.0 ** -1022, 1), (2.0 ** 1023, 0), (2.0 ** -1023, 0),
                   (2.0 ** -1074, 0), (1.0 + 2.0 ** -52, 0)]
    f = numpy.array([v for v, _, _ in both] + [1.0] * len(double_only), f32)
    want_f = numpy.array([w for _, w, _ in both] + [1] * len(double_only), numpy.int32)
    d = numpy.array([v for v, _, _ in both] + [v for v, _ in double_only], f64)
    want_d = numpy.array([w for _, _, w in both] + [w for _, w in double_only], numpy.int32)
    mf, md = numpy.full(len(f), -1, numpy.int32), numpy.full(len(d), -1, numpy.int32)
    m.get_function('probe_exact_reciprocal')((1,), (64,), (f, mf, d, md, numpy.int32(len(f))))
    numpy.testing.assert_array_equal(mf, want_f, err_msg=str(f))
    numpy.testing.assert_array_equal(md, want_d, err_msg=str(d))
