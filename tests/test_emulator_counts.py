"""emulator.recording(): every access of a launch counted per array, by width, with its bytes; the
proxy the kernel tests use to show that a vector path is taken and that a kernel moves the bytes
it should."""
import numpy
import pytest

from chainer_tc.testing import emulator

CODE = r'''
extern "C" __global__ void pairs(const float2* x, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) { float2 v = x[i]; out[i] = v.x + v.y; }
}
extern "C" __global__ void bytes(const unsigned char* x, unsigned short* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = (unsigned short)(x[i] * 2);
}
extern "C" __global__ void tally(const int* x, int* total, int n) {
  __shared__ int part[64];
  part[threadIdx.x] = threadIdx.x < n ? x[threadIdx.x] : 0;
  __syncthreads();
  if (threadIdx.x == 0) {
    int s = 0;
    for (int j = 0; j < 64; ++j) s += part[j];
    atomicAdd(total, s);
  }
}
struct Table { const double* p[2]; };
extern "C" __global__ void gather(Table t, double* out) {
  out[threadIdx.x] = t.p[threadIdx.x & 1][threadIdx.x >> 1];
}
'''


@pytest.fixture(scope='module')
def mod():
    return emulator.RawModule(code=CODE)


def test_widths_and_bytes_of_each_argument(mod):
    x, out = numpy.arange(20, dtype=numpy.float32), numpy.zeros(10, numpy.float32)
    u8, u16 = numpy.arange(7, dtype=numpy.uint8), numpy.zeros(7, numpy.uint16)
    with emulator.recording() as launches:
        mod.get_function('pairs')((2,), (8,), (x, out, numpy.int32(10)))
        mod.get_function('bytes')((1,), (32,), (u8, u16, numpy.int32(7)))
    assert [la.kernel for la in launches] == ['pairs', 'bytes']
    first, second = launches
    assert (first.grid, first.block) == ((2, 1, 1), (8, 1, 1))
    assert first.of(x).reads == {8: 10} and first.of(x).writes == {}
    assert first.of(x).bytes_read == 80
    assert first.of(out).writes == {4: 10} and first.of(out).reads == {}
    assert first.bytes_moved == 120
    assert second.of(u8).reads == {1: 7} and second.of(u16).writes == {2: 7}
    assert second.bytes_moved == 7 + 14
    numpy.testing.assert_array_equal(out, x[0::2] + x[1::2])


def test_shared_memory_atomics_and_only_the_first_schedule(mod):
    x, total = numpy.arange(40, dtype=numpy.int32), numpy.zeros(1, numpy.int32)
    with emulator.checking(race=True, schedules=['forward', 'reverse', 'random:3']):
        with emulator.recording() as launches:
            mod.get_function('tally')((3,), (64,), (x, total, numpy.int32(40)))
    (la,) = launches
    assert total[0] == 3 * int(x.sum())          # every schedule starts from the inputs
    assert la.of(x).reads == {4: 3 * 40}
    assert la.of(total).atomics == {4: 3} and la.of(total).bytes_atomic == 12
    assert la.shared.writes == {4: 3 * 64} and la.shared.reads == {4: 3 * 64}


def test_pointer_table_targets_are_counted_by_allocation(mod):
    a, b = numpy.arange(4, dtype=numpy.float64), numpy.arange(4, 8, dtype=numpy.float64)
    table = numpy.array((a.ctypes.data, b.ctypes.data), numpy.uint64).view(
        numpy.dtype([('p', 'u8', (2,))]))
    out = numpy.zeros(8)
    with emulator.recording() as launches:
        mod.get_function('gather')((1,), (8,), (table, out))
    (la,) = launches
    assert la.of(a).reads == {8: 4} and la.of(b).reads == {8: 4}
    assert la.of(a).what.startswith('table target')
    with pytest.raises(KeyError):               # a struct passed by value is no array
        la.of(table)
    numpy.testing.assert_array_equal(out, [0, 4, 1, 5, 2, 6, 3, 7])


def test_nothing_is_counted_outside_a_recording(mod):
    x, out = numpy.arange(4, dtype=numpy.float32), numpy.zeros(2, numpy.float32)
    with emulator.recording() as launches:
        pass
    mod.get_function('pairs')((1,), (2,), (x, out, numpy.int32(2)))
    assert launches == []
    with emulator.recording() as outer:
        with emulator.recording() as inner:
            mod.get_function('pairs')((1,), (2,), (x, out, numpy.int32(2)))
        mod.get_function('pairs')((1,), (2,), (x, out, numpy.int32(2)))
    assert len(inner) == 1 and len(outer) == 2
    with pytest.raises(KeyError, match='kernel pairs had no array'):
        outer[0].of(numpy.zeros(3))


def test_an_array_passed_twice_is_counted_once_under_both():
    code = r'''
extern "C" __global__ void twice(const float* a, float* b, float* out) {
  out[threadIdx.x] = a[threadIdx.x] + 1.0f;
  b[threadIdx.x] = 2.0f;
}'''
    f = emulator.RawModule(code=code).get_function('twice')
    x, out = numpy.zeros(8, numpy.float32), numpy.zeros(8, numpy.float32)
    with emulator.recording() as launches:
        f((1,), (8,), (x, x.view(), out))
    (la,) = launches
    assert la.of(x).reads == {4: 8} and la.of(x).writes == {4: 8}
    assert la.arrays[1].reads == {4: 8} and la.arrays[1].same_as == 0
    assert la.bytes_moved == 32 + 32 + 32
