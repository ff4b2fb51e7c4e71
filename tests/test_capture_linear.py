"""Chainer's Linear inside a capture: its products through our cuBLAS binding (on the CPU, a fake
libcublas that computes cublasGemmEx from the raw addresses, column-major, as cuBLAS does).

Found on an H100: CuPy refuses cuBLAS during stream capture, so every step with a Linear (the
ResNet-50 classifier) fell back to eager. The GPU side is tests/test_static_graph.py (gpu).
"""
import numpy
import pytest

from chainer_tc.cuda import _counters
from chainer_tc.cuda import cublas
from chainer_tc.static_graph import _gemm
from chainer_tc.static_graph import _linear
from chainer_tc.static_graph import _products

import chainer
import chainer.functions as F
from chainer import gradient_check
from chainer.functions.connection import linear as chainer_linear

from cublas_fakes import FakeCuBLAS
from cublas_fakes import fake_cublas as fake  # noqa: F401  (a fixture)


TOL = {numpy.float16: dict(rtol=2e-3, atol=2e-3),    # one float16 rounding of each output
       numpy.float32: dict(rtol=1e-6, atol=1e-6),    # NumPy's float32 sums vs float64 + rounding
       numpy.float64: dict(rtol=1e-13, atol=1e-13)}


@pytest.mark.parametrize('dtype', [numpy.float16, numpy.float32, numpy.float64])
@pytest.mark.parametrize('bias', [True, False])
@pytest.mark.parametrize('shape', [(3, 5, 7), (1, 1, 1), (8, 33, 2)])
def test_forward_and_backward_equal_chainers_products(fake, dtype, bias, shape):
    m, k, n = shape
    r = numpy.random.RandomState(1)
    x, W = r.randn(m, k).astype(dtype), r.randn(n, k).astype(dtype)
    b = r.randn(n).astype(dtype) if bias else None
    gy = r.randn(m, n).astype(dtype)

    def run():
        xv, Wv = chainer.Variable(x), chainer.Variable(W)
        bv = chainer.Variable(b) if bias else None
        y = F.linear(xv, Wv, bv)
        y.grad = gy
        y.backward()
        return y.array, xv.grad, Wv.grad
    ours = run()
    assert len(fake_gemms(fake)) == 3, 'forward, grad data, grad weight: one cublasGemmEx each'
    with _products.products_through(None):          # Chainer's own ndarray.dot
        theirs = run()
    assert len(fake_gemms(fake)) == 3
    for a, e in zip(ours, theirs):
        assert a.dtype == e.dtype and a.shape == e.shape
        numpy.testing.assert_allclose(a.astype('f8'), e.astype('f8'), **TOL[dtype])


def fake_gemms(lib):
    return [args for name, args in lib.products() if name == 'cublasGemmEx']


def test_the_gemm_arguments_are_cupys_choice(fake):
    x = numpy.ones((4, 6), numpy.float16)
    W = numpy.ones((5, 6), numpy.float16)
    F.linear(x, W)
    (args,) = fake_gemms(fake)
    handle, ta, tb, m, n, k = args[:6]
    assert (ta, tb, m, n, k) == (cublas.OP_T, cublas.OP_N, 5, 4, 6)
    assert args[8] == args[11] == args[15] == cublas.CUDA_R_16F
    assert args[17] == cublas.COMPUTE_32F and args[18] == cublas.GEMM_DEFAULT_TENSOR_OP
    names = [name for name, _ in fake.calls]
    # the stream before the workspace: cublasSetStream resets the workspace to cuBLAS's pool
    assert names[:5] == ['cublasCreate_v2', 'cublasGetVersion_v2', 'cublasSetMathMode',
                         'cublasSetStream_v2', 'cublasSetWorkspace_v2']
    assert fake.calls[2][1][1] == 3, "the math mode of CuPy's handle"
    assert fake.calls[3][1][1] == 0x77, 'the capture stream'
    assert fake.calls[4][1][1:] == (0x5000, 4 << 20)


def test_a_workspace_set_before_the_stream_would_be_lost():
    """What the fake checks: binding in the wrong order leaves cuBLAS's default pool in effect,
    and the product (under capture: an allocation cuBLAS would make) is refused."""
    lib = FakeCuBLAS()
    h = cublas.Handle(cublas.Binding(lib), 90)
    h.binding.set_workspace(h.handle, 0x5000, 4 << 20)
    h.binding.set_stream(h.handle, 0x77)
    x = numpy.ones((2, 3), numpy.float32)
    with _products.products_through(_gemm.Products(h, numpy)):
        with pytest.raises(AssertionError, match="the capture's workspace"):
            F.linear(x, x)


def test_mixed_dtypes_and_non_matrices_take_chainers_code(fake):
    x = numpy.ones((2, 3), numpy.float32)
    F.linear(x, numpy.ones((4, 3), numpy.float64).astype(numpy.float32))
    assert len(fake_gemms(fake)) == 1
    y = F.linear(x, numpy.ones((4, 3), numpy.float16))        # Chainer's mixed-dtype product
    assert len(fake_gemms(fake)) == 1 and y.dtype == numpy.float32
    numpy.testing.assert_array_equal(y.array, numpy.full((2, 4), 3, numpy.float32))
    F.linear(numpy.ones((0, 3), numpy.float32), numpy.ones((4, 3), numpy.float32))
    assert len(fake_gemms(fake)) == 1, 'an empty batch is not a cuBLAS product'


def test_the_classes_are_restored_after_the_block_even_on_an_error():
    def attributes():
        return [vars(owner).get(name) for owner, name, _ in _products.PATCHES]
    before = attributes()
    with pytest.raises(KeyError):
        with _products.products_through(None):
            with _products.products_through(None):
                assert chainer_linear.LinearFunction.forward is _linear._linear_forward
            assert chainer_linear.LinearFunction.forward is _linear._linear_forward
            raise KeyError('inside')
    assert attributes() == before and _products.installed() == 0
    assert all(value is not fn for value, (_, _, fn) in zip(before, _products.PATCHES))


@pytest.mark.parametrize('dtype,tol', [
    (numpy.float64, dict(atol=1e-7, rtol=1e-7)),
    # float32/16: central differences of a sum of products, relative step 1e-3 (32) and 2e-2 (16)
    (numpy.float32, dict(atol=1e-3, rtol=1e-3, eps=1e-3)),
    (numpy.float16, dict(atol=5e-2, rtol=5e-2, eps=2e-2)),
])
def test_gradient_check_through_the_products(fake, dtype, tol):
    r = numpy.random.RandomState(3)
    x, W, b = r.randn(3, 4).astype(dtype), r.randn(2, 4).astype(dtype), r.randn(2).astype(dtype)
    gy = r.randn(3, 2).astype(dtype)
    gradient_check.check_backward(F.linear, (x, W, b), gy, dtype=numpy.float64
                                  if dtype == numpy.float16 else None, **tol)
    assert len(fake_gemms(fake)) > 3


def test_a_failing_call_names_itself_and_cublas_reason():
    lib = FakeCuBLAS(fail='cublasSetMathMode')
    with pytest.raises(cublas.CuBLASError, match='cublasSetMathMode failed: '
                       'CUBLAS_STATUS_FAKE_ERROR'):
        cublas.Handle(cublas.Binding(lib), 80, math_mode=0)
    assert lib.calls[-1][0] == 'cublasDestroy_v2', 'the half-made handle is destroyed'


def test_a_cublas_other_than_cupys_is_refused():
    lib = FakeCuBLAS(version=130100)
    with pytest.raises(cublas.CuBLASUnavailable, match='version 130100, but CuPy calls '
                       'version 120405'):
        cublas.Handle(cublas.Binding(lib), 90, version=120405)
    assert lib.calls[-1][0] == 'cublasDestroy_v2'


def test_a_library_missing_a_function_is_unavailable_not_a_crash(monkeypatch):
    class Old:
        def __getattr__(self, name):
            if name == 'cublasGetVersion_v2':
                raise AttributeError('undefined symbol: ' + name)
            return lambda *a: 0
    monkeypatch.setattr(cublas, '_binding', None)
    monkeypatch.setattr(cublas, 'library_path', lambda: '/old/libcublas.so.11')
    monkeypatch.setattr(cublas.ctypes, 'CDLL', lambda path: Old())
    with pytest.raises(cublas.CuBLASUnavailable, match='lacks a function.*cublasGetVersion_v2'):
        cublas.binding()


def test_handle_close_is_idempotent_and_counted():
    lib = FakeCuBLAS()
    before = _counters.counters()['cublas_calls']
    h = cublas.Handle(cublas.Binding(lib), 80)
    h.bind(1, 2, 3)
    h.close()
    h.close()
    assert [n for n, _ in lib.calls] == ['cublasCreate_v2', 'cublasSetStream_v2',
                                         'cublasSetWorkspace_v2', 'cublasDestroy_v2']
    assert _counters.counters()['cublas_calls'] - before == 4


def test_cupys_type_choices():
    f16, f32, f64 = numpy.float16, numpy.float32, numpy.float64
    assert cublas.compute_type(f16, 'default') == cublas.COMPUTE_32F
    assert cublas.compute_type(f32, 'default') == cublas.COMPUTE_32F
    assert cublas.compute_type(f32, 'tf32') == cublas.COMPUTE_32F_FAST_TF32
    assert cublas.compute_type(f16, 'tf32') == cublas.COMPUTE_32F
    assert cublas.compute_type(f64, 'tf32') == cublas.COMPUTE_64F
    assert cublas.compute_type(f32, 'pedantic') == cublas.COMPUTE_32F_PEDANTIC
    assert cublas.compute_type(f64, 'pedantic') == cublas.COMPUTE_64F_PEDANTIC
    assert cublas.compute_type(f32) == cublas.COMPUTE_32F, "CuPy's own default, read from it"
    assert cublas.algorithm(f32, 70) == cublas.GEMM_DEFAULT
    assert cublas.algorithm(f16, 70) == cublas.GEMM_DEFAULT_TENSOR_OP
    assert cublas.algorithm(f64, 90) == cublas.GEMM_DEFAULT_TENSOR_OP
    assert cublas.workspace_bytes(90) == 32 << 20 and cublas.workspace_bytes(80) == 4 << 20
    with pytest.raises(TypeError, match='int32'):
        cublas.Handle(cublas.Binding(FakeCuBLAS()), 80).gemm(
            0, 0, 1, 1, 1, 0, 1, 0, 1, 0, 1, numpy.int32)


def test_a_method_fetched_while_patched_still_works_after_the_patch_is_gone():
    """Another thread may have read LinearFunction.forward (the patch) just before the last
    capture ended: calling it later must run Chainer's code, not fail."""
    with _products.products_through(None):
        fetched = chainer_linear.LinearFunction.forward
    assert fetched is _linear._linear_forward
    x = numpy.ones((2, 3), numpy.float32)
    node = chainer_linear.LinearFunction()
    y, = fetched(node, (x, x))
    numpy.testing.assert_array_equal(y, numpy.full((2, 2), 3, numpy.float32))


def test_library_path_is_the_wheels_or_the_cuda_major_soname(monkeypatch):
    from chainer_tc import _cuda_libs
    monkeypatch.setattr(_cuda_libs, 'find_library', lambda name: None)
    assert cublas.library_path(13) == 'libcublas.so.13'
    monkeypatch.setattr(_cuda_libs, 'find_library', lambda name: '/w/libcublas.so.12')
    assert cublas.library_path(13) == '/w/libcublas.so.12'
