"""Chainer's matrix products inside a capture, beyond Linear: the im2col convolutions (Chainer's
GPU path where it does not use cuDNN, which is every convolution on CuPy 14), grouped ones,
Deconvolution2D, and F.matmul / F.batch_matmul, through chainer_tc's cuBLAS binding (on the
CPU, tests/cublas_fakes.py computes the products from the raw addresses as cuBLAS does).

Found on an H100 with CuPy 14 (no cuDNN): a step with a stock ``L.Convolution2D`` ran eagerly,
because ``cupy.tensordot`` refuses cuBLAS while a stream captures. The GPU side is
tests/test_static_graph.py (gpu).

On the CPU Chainer runs its CPU code, so ``gpu_cores`` routes the convolutions' CPU dispatch to
their GPU core methods, as ``forward_gpu`` does without cuDNN; those are what a capture
patches. Reference results are Chainer's own CPU code, without the routing.
"""
import contextlib
import threading

import numpy
import pytest

from chainer_tc.cuda import cublas
from chainer_tc.static_graph import _gemm
from chainer_tc.static_graph import _im2col
from chainer_tc.static_graph import _products

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import gradient_check
from chainer.functions.connection import convolution_2d as chainer_convolution_2d
from chainer.functions.connection import deconvolution_2d as chainer_deconvolution_2d

from cublas_fakes import fake_cublas as fake  # noqa: F401  (a fixture)

_CORES = (chainer_convolution_2d.Convolution2DFunction,
          chainer_convolution_2d.Convolution2DGradW,
          chainer_deconvolution_2d.Deconvolution2DFunction)

# Ours: the exact sum (the fake multiplies in float64) rounded once to the dtype. Chainer's
# CPU code: NumPy's sums in the dtype (float16: float32 accumulation, then one rounding). So
# float16 results differ by at most one float16 ulp (2^-10 relative, below 2e-3); float32 by
# the order of summation of at most 200 products of N(0, 1) values, well below 2e-5 of a
# result of magnitude up to 30; float64 by far less.
TOL = {numpy.float16: dict(rtol=2e-3, atol=2e-3),
       numpy.float32: dict(rtol=2e-5, atol=2e-5),
       numpy.float64: dict(rtol=1e-12, atol=1e-12)}


@pytest.fixture
def gpu_cores(monkeypatch):
    """Routes the CPU dispatch to the GPU cores; yields a context manager under which
    Chainer's own CPU code runs (the reference)."""
    original = {cls: vars(cls)['_forward_cpu_core'] for cls in _CORES}

    def route():
        for cls in _CORES:
            monkeypatch.setattr(cls, '_forward_cpu_core',
                                lambda self, *args, _cls=cls: _cls._forward_gpu_core(self, *args))

    @contextlib.contextmanager
    def chainers_cpu_code():
        for cls, fn in original.items():
            monkeypatch.setattr(cls, '_forward_cpu_core', fn)
        with _products.products_through(None):
            yield
        route()
    route()
    yield chainers_cpu_code


def products(lib):
    return [name for name, _ in lib.products()]


def close(ours, theirs, dtype):
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    numpy.testing.assert_allclose(ours.astype('f8'), theirs.astype('f8'), **TOL[dtype])


# ---- the product itself -----------------------------------------------------------------------

@pytest.mark.parametrize('dtype', [numpy.float16, numpy.float32, numpy.float64])
@pytest.mark.parametrize('a_shape,b_shape,ta,tb', [
    ((3, 4), (4, 5), False, False),
    ((4, 3), (4, 5), True, False),              # a seen transposed: passed with OP_T, no copy
    ((3, 4), (5, 4), False, True),
    ((4, 3), (5, 4), True, True),
    ((2, 3, 4), (2, 4, 5), False, False),       # a batch: one strided-batched product
    ((2, 4, 3), (2, 5, 4), True, True),
    ((1, 3, 4), (6, 4, 5), False, False),       # a broadcast matrix: stride 0
    ((3, 4), (2, 3, 4, 5), False, False),
    ((2, 1, 3, 4), (1, 3, 4, 5), False, False),  # a partial broadcast: made real, then batched
])
def test_matmul_is_numpys(fake, dtype, a_shape, b_shape, ta, tb):
    r = numpy.random.RandomState(0)
    a, b = r.randn(*a_shape).astype(dtype), r.randn(*b_shape).astype(dtype)
    a = a.swapaxes(-1, -2) if ta else a
    b = b.swapaxes(-1, -2) if tb else b
    c = _gemm.matmul(_gemm.current(), a, b)
    expected = numpy.matmul(a.astype('f8'), b.astype('f8')).astype(dtype)
    assert c.flags.c_contiguous
    close(c, expected, dtype)
    (name, args), = fake.products()
    batched = len(expected.shape) > 2
    assert name == ('cublasGemmStridedBatchedEx' if batched else 'cublasGemmEx')
    assert (args[1], args[2]) == (int(tb), int(ta)), 'C^T = op(B)^T op(A)^T'
    if batched and a_shape[0] == 1 and len(a_shape) == 3:
        assert args[14] == 0, "the broadcast a (cuBLAS's B) repeats with stride 0"


def test_transposed_operands_are_not_copied(fake):
    a = numpy.ones((6, 4), numpy.float32)
    b = numpy.ones((5, 6), numpy.float32)
    _gemm.matmul(_gemm.current(), a.T, b.T)
    (_, args), = fake.products()
    assert args[7] == b.ctypes.data and args[10] == a.ctypes.data, 'the arrays themselves'
    assert (args[9], args[12]) == (6, 4), "their own rows as leading dimensions"


def test_the_fake_refuses_what_reaches_past_an_operand(fake):
    """What the fake checks (a GPU would read a neighbour's memory, or fault): a leading
    dimension, batch stride or count that reaches past the operand whose address was taken, an
    address no operand was passed at, and an output that overlaps an input."""
    h = _gemm.current().handle
    f32 = numpy.float32
    a, b, c = (numpy.zeros(shape, f32) for shape in [(2, 3, 4), (2, 4, 5), (2, 3, 5)])
    A, B, C = (_gemm.address(x) for x in (a, b, c))

    def batched(lda=5, sa=20, ldb=4, sb=12, ldc=5, sc=15, count=2, c=C):
        h.gemm_batched(0, 0, 5, 3, 4, B, lda, sa, A, ldb, sb, c, ldc, sc, count, f32)

    batched()       # C^T = B^T A^T, each batch at its own stride: inside every operand
    numpy.testing.assert_array_equal(c, 0)
    for bad, name in [(dict(lda=6), 'A'), (dict(sa=21), 'A'), (dict(ldb=5), 'B'),
                      (dict(sb=13), 'B'), (dict(ldc=6, sc=18), 'C'), (dict(count=3), 'A')]:
        with pytest.raises(AssertionError, match='^{} reaches bytes .* outside its operand'
                           .format(name)):
            batched(**bad)
    with pytest.raises(AssertionError, match='C at 0x[0-9a-f]+: no array of that address'):
        batched(c=C + 4)
    with pytest.raises(AssertionError, match='the output C overlaps the input A'):
        h.gemm(0, 0, 5, 1, 4, B, 5, A, 4, B, 5, f32)


def test_a_size_over_cublass_int_is_refused_not_wrapped(fake):
    """ctypes passes 2**32 + 5 as 5 to a C int: the handle refuses it, named (the products
    already leave such sizes to Chainer; this guards any other caller)."""
    h = _gemm.current().handle
    f32 = numpy.float32
    with pytest.raises(ValueError, match=r'^cuBLAS product: m = 4294967301 does not fit the C '
                                         r'int cuBLAS takes'):
        h.gemm(0, 0, 2 ** 32 + 5, 1, 1, 0, 1, 0, 1, 0, 1, f32)
    with pytest.raises(ValueError, match=r'^cuBLAS product: batchCount = 2147483648 does not'):
        h.gemm_batched(0, 0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 0, 1, 1, 2 ** 31, f32)
    assert fake.products() == []


def test_what_cublas_cannot_take_is_left_to_chainer(fake, monkeypatch):
    p = _gemm.current()
    f = numpy.ones((2, 3), numpy.float32)
    assert _gemm.matmul(p, f, f.T.astype(numpy.float64)) is None, 'mixed dtypes'
    assert _gemm.matmul(p, f, numpy.ones(3, numpy.float32)) is None, 'a vector'
    assert _gemm.matmul(p, f.astype(numpy.int32), f.T.astype(numpy.int32)) is None
    assert _gemm.matmul(p, numpy.ones((0, 3), numpy.float32), f.T) is None, 'empty'
    assert _gemm.matmul(p, f, f) is None, 'shapes that do not chain'
    assert _gemm.matmul(p, numpy.ones((2, 2, 3), 'f'), numpy.ones((3, 3, 2), 'f')) is None
    monkeypatch.setattr(_gemm, '_INT_MAX', 2)
    assert _gemm.matmul(p, f, f.T) is None, "a size over cuBLAS's int"
    assert fake.products() == []


def test_batched_products_use_gemms_types(fake):
    a = numpy.ones((2, 3, 4), numpy.float16)
    _gemm.matmul(_gemm.current(), a, a.swapaxes(1, 2))
    (_, args), = fake.products()
    assert args[8] == args[12] == args[17] == cublas.CUDA_R_16F
    assert args[21] == cublas.COMPUTE_32F and args[22] == cublas.GEMM_DEFAULT_TENSOR_OP
    assert (args[10], args[14], args[19], args[20]) == (12, 12, 9, 2)


# ---- convolutions -----------------------------------------------------------------------------

CONVOLUTIONS = [
    dict(ksize=3, stride=1, pad=1),
    dict(ksize=1, stride=2, pad=0),
    dict(ksize=3, stride=2, pad=1, dilate=2),
    dict(ksize=(3, 2), stride=(2, 1), pad=(0, 1)),
    dict(ksize=3, stride=2, pad=0, cover_all=True),   # cuDNN cannot: Chainer always uses im2col
    dict(ksize=3, stride=1, pad=1, groups=2),
]


def _convolution(kw, bias, x, W, b, gy):
    xv, Wv = chainer.Variable(x), chainer.Variable(W)
    bv = chainer.Variable(b) if bias else None
    y = F.convolution_2d(xv, Wv, bv, **kw)
    y.grad = gy
    y.backward()
    return [y.array, xv.grad, Wv.grad] + ([bv.grad] if bias else [])


@pytest.mark.parametrize('dtype', [numpy.float16, numpy.float32, numpy.float64])
@pytest.mark.parametrize('bias', [True, False])
@pytest.mark.parametrize('kw', CONVOLUTIONS)
def test_convolution_forward_and_backward_equal_chainers(fake, gpu_cores, dtype, bias, kw):
    r = numpy.random.RandomState(2)
    groups = kw.get('groups', 1)
    kw = dict(kw)
    ksize = kw.pop('ksize')
    ksize = ksize if isinstance(ksize, tuple) else (ksize, ksize)
    x = r.randn(2, 4, 9, 8).astype(dtype)
    W = r.randn(6, 4 // groups, *ksize).astype(dtype)
    b = r.randn(6).astype(dtype)
    shape = F.convolution_2d(x, W, **kw).shape
    assert fake.products() != []
    del fake.calls[:]
    gy = r.randn(*shape).astype(dtype)
    ours = _convolution(kw, bias, x, W, b, gy)
    names = products(fake)
    with gpu_cores():
        theirs = _convolution(kw, bias, x, W, b, gy)
    for a, e in zip(ours, theirs):
        close(a, e, dtype)
    if groups == 1:     # forward and input gradient: per sample, W repeated; weight: one product
        assert names == ['cublasGemmStridedBatchedEx', 'cublasGemmStridedBatchedEx',
                         'cublasGemmEx']
    else:               # through convolution_2d._matmul: per group
        assert names == ['cublasGemmStridedBatchedEx'] * 3


@pytest.mark.parametrize('dtype', [numpy.float16, numpy.float32, numpy.float64])
@pytest.mark.parametrize('groups', [1, 2])
def test_deconvolution_link_equals_chainers(fake, gpu_cores, dtype, groups):
    r = numpy.random.RandomState(4)
    x = r.randn(2, 4, 5, 6).astype(dtype)

    def run():
        with chainer.using_config('dtype', dtype):
            link = L.Deconvolution2D(4, 6, ksize=3, stride=2, pad=1, groups=groups,
                                     initialW=numpy.random.RandomState(5).randn(
                                         4, 6 // groups, 3, 3), initial_bias=0.5)
        assert link.W.dtype == dtype
        xv = chainer.Variable(x)
        y = link(xv)
        y.grad = numpy.random.RandomState(6).randn(*y.shape).astype(dtype)
        y.backward()
        return y.array, xv.grad, link.W.grad, link.b.grad
    ours = run()
    assert len(fake.products()) == 3
    with gpu_cores():
        theirs = run()
    for a, e in zip(ours, theirs):
        close(a, e, dtype)


@pytest.mark.parametrize('dtype,tol', [
    (numpy.float64, dict(atol=1e-7, rtol=1e-7)),
    # central differences of sums of products, relative step 1e-3 (float32), 2e-2 (float16)
    (numpy.float32, dict(atol=1e-3, rtol=1e-3, eps=1e-3)),
    (numpy.float16, dict(atol=5e-2, rtol=5e-2, eps=2e-2)),
])
@pytest.mark.parametrize('groups', [1, 2])
def test_gradient_check_through_the_convolution_products(fake, gpu_cores, dtype, tol, groups):
    r = numpy.random.RandomState(7)
    x = r.randn(1, 2, 5, 5).astype(dtype)
    W = r.randn(2, 2 // groups, 3, 3).astype(dtype)
    b = r.randn(2).astype(dtype)
    gy = r.randn(1, 2, 3, 3).astype(dtype)
    gradient_check.check_backward(
        lambda x, W, b: F.convolution_2d(x, W, b, stride=2, pad=1, groups=groups),
        (x, W, b), gy, dtype=numpy.float64 if dtype == numpy.float16 else None, **tol)
    assert len(fake.products()) > 3


def test_a_mixed_dtype_convolution_runs_chainers_core(fake, gpu_cores, monkeypatch):
    called = []
    monkeypatch.setitem(_im2col._ORIGINAL, 'Convolution2DFunction',
                        lambda self, x, W, b: called.append((x.dtype, W.dtype)) or (x,))
    F.convolution_2d(numpy.ones((1, 2, 3, 3), numpy.float32), numpy.ones((2, 2, 1, 1),
                                                                           numpy.float16))
    assert called == [(numpy.float32, numpy.float16)] and fake.products() == []


def test_another_thread_runs_chainers_code_meanwhile(fake, gpu_cores, monkeypatch):
    """While this thread captures, another thread's convolution is Chainer's own."""
    called = []
    monkeypatch.setitem(_im2col._ORIGINAL, 'Convolution2DFunction',
                        lambda self, x, W, b: called.append(threading.get_ident()) or (x,))
    x, W = numpy.ones((1, 2, 3, 3), numpy.float32), numpy.ones((2, 2, 1, 1), numpy.float32)
    t = threading.Thread(target=F.convolution_2d, args=(x, W))
    t.start()
    t.join()
    assert called == [t.ident] and fake.products() == []
    F.convolution_2d(x, W)
    assert called == [t.ident] and len(fake.products()) == 1


# ---- F.matmul and F.batch_matmul --------------------------------------------------------------

@pytest.mark.parametrize('dtype', [numpy.float16, numpy.float32, numpy.float64])
@pytest.mark.parametrize('a_shape,b_shape,transa,transb', [
    ((3, 4), (4, 5), False, False),
    ((4, 3), (4, 5), True, False),
    ((3, 4), (5, 4), False, True),
    ((2, 3, 4), (2, 5, 4), False, True),
    ((2, 4, 3), (2, 4, 5), True, False),
])
def test_matmul_forward_and_backward_equal_chainers(fake, dtype, a_shape, b_shape, transa,
                                                    transb):
    r = numpy.random.RandomState(8)
    a, b = r.randn(*a_shape).astype(dtype), r.randn(*b_shape).astype(dtype)

    def run():
        av, bv = chainer.Variable(a), chainer.Variable(b)
        y = F.matmul(av, bv, transa=transa, transb=transb)
        y.grad = numpy.random.RandomState(9).randn(*y.shape).astype(dtype)
        y.backward()
        return y.array, av.grad, bv.grad
    ours = run()
    assert len(fake.products()) == 3, 'forward and two gradients'
    with _products.products_through(None):
        theirs = run()
    assert len(fake.products()) == 3
    for o, t in zip(ours, theirs):
        close(o, t, dtype)


def test_batch_matmul_goes_through_the_products(fake):
    r = numpy.random.RandomState(10)
    a, b = r.randn(3, 2, 4).astype('f'), r.randn(3, 4, 5).astype('f')
    with pytest.warns(DeprecationWarning):
        y = F.batch_matmul(a, b)
    close(y.array, numpy.matmul(a, b), numpy.float32)
    (name, args), = fake.products()
    assert name == 'cublasGemmStridedBatchedEx' and args[20] == 3


def test_a_vector_operand_runs_chainers_code(fake):
    a = numpy.ones((2, 3), numpy.float32)
    y = F.matmul(a, numpy.ones((3, 4), numpy.float32))
    assert len(fake.products()) == 1
    numpy.testing.assert_array_equal(y.array, numpy.full((2, 4), 3, numpy.float32))
    v = F.matmul(a, numpy.ones(3, numpy.float32))                # a 1-d operand: NumPy's code
    assert len(fake.products()) == 1
    numpy.testing.assert_array_equal(v.array, numpy.full(2, 3, numpy.float32))


def test_a_product_too_large_for_cublas_runs_chainers_code(fake, gpu_cores, monkeypatch):
    monkeypatch.setattr(_gemm, '_INT_MAX', 2)
    x, W = numpy.ones((3, 4), numpy.float32), numpy.ones((5, 4), numpy.float32)
    xv, Wv = chainer.Variable(x), chainer.Variable(W)
    y = F.linear(xv, Wv, numpy.zeros(5, numpy.float32))
    y.grad = numpy.ones_like(y.array)
    y.backward()
    numpy.testing.assert_array_equal(y.array, numpy.full((3, 5), 4, numpy.float32))
    numpy.testing.assert_array_equal(xv.grad, numpy.full((3, 4), 5, numpy.float32))
    numpy.testing.assert_array_equal(Wv.grad, numpy.full((5, 4), 3, numpy.float32))
    z = F.matmul(x, W, transb=True)
    numpy.testing.assert_array_equal(z.array, y.array)
    assert fake.products() == []


def test_a_users_own_patch_is_put_back_after_the_capture(monkeypatch):
    mine = object()
    monkeypatch.setattr(chainer_convolution_2d.Convolution2DFunction, '_forward_gpu_core', mine)
    with _products.products_through(None):
        assert (chainer_convolution_2d.Convolution2DFunction._forward_gpu_core is
                _im2col._convolution_forward)
    assert chainer_convolution_2d.Convolution2DFunction._forward_gpu_core is mine


def test_the_patches_are_installed_only_inside_a_block():
    for owner, name, fn in _products.PATCHES:
        assert getattr(owner, name) is not fn
    with _products.products_through(None):
        for owner, name, fn in _products.PATCHES:
            assert getattr(owner, name) is fn
    for owner, name, fn in _products.PATCHES:
        assert getattr(owner, name) is not fn


# ---- GPU ----------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize('dtype', [numpy.float16, numpy.float32, numpy.float64])
@pytest.mark.parametrize('a_shape,b_shape,ta,tb', [
    ((33, 17), (17, 9), False, False),
    ((17, 33), (9, 17), True, True),
    ((4, 33, 17), (4, 17, 9), False, False),
    ((1, 33, 17), (4, 9, 17), False, True),
    ((2, 1, 5, 6), (1, 3, 6, 7), False, False),
])
def test_products_on_the_capture_handle_equal_cupys_on_a_gpu(dtype, a_shape, b_shape, ta, tb):
    """The real cuBLAS through our binding (both entry points) against cupy.matmul."""
    import cupy
    r = numpy.random.RandomState(11)
    a = cupy.asarray(r.randn(*a_shape).astype(dtype))
    b = cupy.asarray(r.randn(*b_shape).astype(dtype))
    a = a.swapaxes(-1, -2) if ta else a
    b = b.swapaxes(-1, -2) if tb else b
    handle = cublas.capture_handle(cupy.cuda.Device())
    stream = cupy.cuda.Stream(non_blocking=True)
    workspace = cupy.empty(cublas.workspace_bytes(handle.compute_capability), cupy.uint8)
    with handle.lock, stream:
        handle.bind(stream.ptr, workspace.data.ptr, workspace.nbytes)
        c = _gemm.matmul(_gemm.Products(handle, cupy), a, b)
        stream.synchronize()
    expected = cupy.matmul(a, b)
    # float32 accumulation in both (float16: CuPy's batch in float32 data, ours in float16 data
    # with float32 sums; one rounding to float16 each); other algorithms may sum in other orders
    tol = {numpy.float16: 2e-3, numpy.float32: 1e-5, numpy.float64: 1e-12}[dtype]
    cupy.testing.assert_allclose(c, expected, rtol=tol, atol=tol)
