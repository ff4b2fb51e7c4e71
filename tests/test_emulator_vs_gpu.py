"""One test body, two backends: the selftest kernels on the emulator and, on a GPU, on CuPy.

This is the check that the emulator's semantics are the GPU's: the same .cu text, the same
arguments, the same calling convention, results compared with each other.
"""
import numpy
import pytest

from chainer_tc.testing import emulator
from conftest import cuda_source

CASES = ['vector_add', 'warp_sum', 'block_sum', 'half2_fma', 'warp_scan', 'grid2d']


def launch_case(case, RawModule, xp):
    """Run one selftest kernel with RawModule/xp; return its outputs as NumPy arrays."""
    mod = RawModule(code=open(cuda_source('selftest.cu')).read(), options=('--std=c++17',))
    r = numpy.random.RandomState(3)
    to = xp.asarray
    if case == 'vector_add':
        n = 4097
        a, b, c = to(r.rand(n).astype('f')), to(r.rand(n).astype('f')), xp.zeros(n, 'f')
        mod.get_function(case)((5,), (128,), (a, b, c, numpy.int32(n)))
        outs = [c]
    elif case == 'warp_sum':
        n = 1000
        x, out = to(r.randint(-99, 99, n).astype(numpy.int32)), xp.zeros(4, numpy.int32)
        mod.get_function(case)((4,), (256,), (x, out, numpy.int32(n)))
        outs = [out]
    elif case == 'block_sum':
        n = 4097
        x, out = to(r.randn(n)), xp.zeros(3)
        mod.get_function(case)((3,), (256,), (x, out, numpy.int32(n)), shared_mem=256 * 8)
        outs = [out]
    elif case == 'half2_fma':
        a, b, c = (to(r.randn(66).astype(numpy.float16)) for _ in range(3))
        out, s = xp.zeros(66, numpy.float16), xp.zeros(33, numpy.float32)
        mod.get_function(case)((1,), (64,), (a, b, c, out, s, numpy.int32(33)))
        outs = [out, s]
    elif case == 'warp_scan':
        n = 100
        x = to(r.randint(-9, 9, n).astype(numpy.int32))
        scan, bcast = xp.zeros(n, numpy.int32), xp.zeros(n, numpy.int32)
        mod.get_function(case)((2,), (64,), (x, scan, bcast, numpy.int32(8), numpy.int32(n)))
        outs = [scan, bcast]
    else:
        x, y = to(r.randn(37, 45).astype('f')), xp.zeros((37, 45), 'f')
        mod.get_function(case)((3, 5), (16, 8), (x, y, numpy.int32(37), numpy.int32(45),
                                                 numpy.float32(0.5)))
        outs = [y]
    return [numpy.asarray(o.get() if hasattr(o, 'get') else o) for o in outs]


@pytest.mark.parametrize('case', CASES)
def test_emulator_runs_every_case(case):
    outs = launch_case(case, emulator.RawModule, numpy)
    assert all(o.size for o in outs)


@pytest.mark.gpu
@pytest.mark.parametrize('case', CASES)
def test_gpu_equals_emulator(case):
    import cupy

    from chainer_tc import kernels

    def gpu_module(code, options=()):
        opts = tuple(options) + tuple('-I' + d for d in kernels.cuda_include_dirs())
        return cupy.RawModule(code=code, options=opts)

    expect = launch_case(case, emulator.RawModule, numpy)
    got = launch_case(case, gpu_module, cupy)
    for e, g in zip(expect, got):
        if e.dtype == numpy.float64:        # block sums: same tree, same order
            numpy.testing.assert_allclose(g, e, rtol=1e-13)
        else:                               # integer, exact fp16/fp32 elementwise math
            numpy.testing.assert_array_equal(g, e)
