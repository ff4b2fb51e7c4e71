"""GPU parity kit: every kernel of ``kernels/`` on the GPU and in the CPU emulator, compared and timed.

    python -m chainer_tc.testing.gpu_parity                 # awkward and ResNet-50-sized shapes
    python -m chainer_tc.testing.gpu_parity --quick         # awkward shapes only, no timing
    python -m chainer_tc.testing.gpu_parity --shapes big --family batchnorm
    python -m chainer_tc.testing.gpu_parity --json parity.json
    compute-sanitizer --tool memcheck python -m chainer_tc.testing.gpu_parity --quick

Needs only NumPy, CuPy (13 or 14, for CUDA 12 or 13) and a C++ compiler: no Chainer, no cuDNN, no
DALI, so it is the first thing to run on a machine with a GPU. Each case of
:mod:`chainer_tc.testing.kernel_cases` (a family's launches on one shape, with the arguments the
project's callers pass) runs on the GPU (CuPy, NVRTC) and in the emulator from the same initial
arrays; every output is compared (integers exactly; floats within a tolerance per dtype that
allows for NVRTC's fma contraction and ``-ftz=true``, which the emulator does not do), and each
kernel launch is timed on its own with CUDA events (median of ``--repeats``, L2 flushed between
repeats) against the device's peak memory bandwidth, counting each array it touches once. It prints a table and writes JSON. On a machine without a
GPU it says so and exits 0.

Exit status: 0 every output matches (or no GPU), 1 a mismatch, 2 a kernel failed to compile or run.
"""
import argparse
import json
import platform
import statistics
import sys
import time

import numpy

from chainer_tc import kernels
from chainer_tc.testing import kernel_cases

# rtol, atol per dtype: GPU against emulator. fp32 arithmetic differs by fma contraction and
# flushed subnormals; a float16 result may round the other way after such a difference.
TOLERANCE = {
    numpy.dtype(numpy.float16): (2e-3, 2e-3),
    numpy.dtype(numpy.float32): (2e-5, 1e-5),
    numpy.dtype(numpy.float64): (1e-11, 1e-12),
}


class CupyBackend:
    """Runs cases on the current CUDA device."""

    name = 'gpu'

    def __init__(self):
        import cupy
        self.cupy = cupy
        self.xp = cupy
        self._modules = {}
        self.includes = kernels.cuda_include_dirs()

    def module(self, case):
        key = (case.family, case.options(), case.name_expressions)
        if key not in self._modules:
            opts = case.options() + ('--std=c++17',) + tuple('-I' + d for d in self.includes)
            mod = self.cupy.RawModule(code=kernels.source(case.family), options=opts,
                                      name_expressions=list(case.name_expressions) or None)
            mod.compile()
            self._modules[key] = mod
        return self._modules[key]

    def to_device(self, a):
        return self.cupy.asarray(a)

    def address(self, a):
        return a.data.ptr

    def to_host(self, a):
        return self.cupy.asnumpy(a)

    def synchronize(self):
        self.cupy.cuda.Device().synchronize()

    def timer(self, flush_bytes=256 << 20):
        """timer(run, repeats) -> median seconds of run(), timed with CUDA events, with the L2
        cache flushed (a buffer larger than any L2 written) before each repeat."""
        cupy = self.cupy
        scratch = cupy.empty(flush_bytes, cupy.uint8)

        def timed(run, repeats):
            times = []
            for _ in range(repeats):
                scratch.fill(1)
                start, stop = cupy.cuda.Event(), cupy.cuda.Event()
                start.record()
                run()
                stop.record()
                stop.synchronize()
                times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
            return statistics.median(times)
        return timed

    def describe(self):
        cupy = self.cupy
        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        name = props.get('name', b'')
        name = name.decode() if isinstance(name, bytes) else str(name)
        return {'device': name, 'compute_capability': dev.compute_capability,
                'cupy': cupy.__version__, 'cuda_runtime': cupy.cuda.runtime.runtimeGetVersion(),
                'peak_gbps': self.peak_bandwidth(props), 'include': self.includes}

    def peak_bandwidth(self, props):
        """GB/s from the memory clock and bus width (2 transfers per clock), or measured with a
        large device-to-device copy where CUDA 13 no longer reports the clock."""
        cupy = self.cupy
        clock_khz = props.get('memoryClockRate')
        bus_bits = props.get('memoryBusWidth')
        if not clock_khz:
            try:
                attr = getattr(cupy.cuda.runtime, 'cudaDevAttrMemoryClockRate', 36)
                clock_khz = cupy.cuda.runtime.deviceGetAttribute(attr, cupy.cuda.Device().id)
            except Exception:
                clock_khz = None
        if clock_khz and bus_bits:
            return 2.0 * clock_khz * 1e3 * bus_bits / 8 / 1e9
        a = cupy.empty(1 << 30, cupy.uint8)
        b = cupy.empty_like(a)
        b[...] = a
        seconds = self.timer(64)(lambda: b.__setitem__(Ellipsis, a), 5)
        return 2.0 * a.nbytes / seconds / 1e9


class EmulatorAsDevice(kernel_cases.EmulatorBackend):
    """The emulator standing in for the GPU (--self-test): every step of the kit runs on a machine
    without one; the 'device' side runs its threads in reverse order."""

    name = 'emulator (reverse schedule)'

    def module(self, case):
        mod = super().module(case)
        return _Scheduled(mod, self._emulator, ['reverse'])

    def timer(self):
        def timed(run, repeats):
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                run()
                times.append(time.perf_counter() - t)
            return statistics.median(times)
        return timed

    def describe(self):
        return {'device': 'none: the emulator stands in (--self-test)', 'peak_gbps': None,
                'machine': platform.machine()}


class _Scheduled:
    def __init__(self, mod, emulator, schedules):
        self._mod, self._emulator, self._schedules = mod, emulator, schedules

    def get_function(self, name):
        f = self._mod.get_function(name)
        emulator, schedules = self._emulator, self._schedules

        def call(*args, **kwargs):
            with emulator.checking(race=False, schedules=schedules):
                return f(*args, **kwargs)
        return call


def compare(expected, got, sums=None):
    """(ok, worst error, where): outputs of one case, emulator against device. ``sums``:
    (sum of |terms|, chain) per element for an output that is a sum (Case.sums); its elements
    may also differ by 4 * u * sqrt(chain) * sum|terms| (u the accumulation's unit roundoff:
    2^-53 for float64 outputs, else 2^-24; chain the longest run of additions into the element),
    the rounding that terms rounded differently (an fma on one backend) leave in a sum, whatever
    the sum's own size."""
    if expected.shape != got.shape or expected.dtype != got.dtype:
        return False, None, 'shape/dtype {} {} vs {} {}'.format(expected.shape, expected.dtype,
                                                                 got.shape, got.dtype)
    if expected.dtype.kind != 'f':
        bad = numpy.flatnonzero(expected.reshape(-1) != got.reshape(-1))
        if bad.size:
            i = int(bad[0])
            return False, None, '{} elements differ, first at {}: {} vs {}'.format(
                bad.size, i, expected.reshape(-1)[i], got.reshape(-1)[i])
        return True, 0.0, ''
    rtol, atol = TOLERANCE[expected.dtype]
    if sums is not None:
        magnitude, chain = sums
        u = 2.0 ** -53 if expected.dtype == numpy.float64 else 2.0 ** -24
        atol = atol + 4 * u * numpy.sqrt(chain) * numpy.asarray(magnitude,
                                                                numpy.float64).reshape(-1)
    e = expected.astype(numpy.float64).reshape(-1)
    g = got.astype(numpy.float64).reshape(-1)
    same = (e == g) | (numpy.isnan(e) & numpy.isnan(g))
    with numpy.errstate(invalid='ignore'):
        err = numpy.where(same, 0.0, numpy.abs(e - g))
        bad = ~same & ~(err <= atol + rtol * numpy.abs(e))
    worst = float(numpy.nanmax(numpy.where(numpy.isnan(err), numpy.inf, err))) if err.size else 0.0
    if bad.any():
        i = int(numpy.flatnonzero(bad)[0])
        return False, worst, '{} elements differ, first at {}: {!r} (emulator) vs {!r} (device)' \
            .format(int(bad.sum()), i, float(e[i]), float(g[i]))
    return True, worst, ''


def run_case(case, device, emulator, repeats):
    row = {'family': case.family, 'case': case.name, 'big': case.big, 'bytes': case.bytes,
           'kernels': case.kernel_names()}
    try:
        t = time.perf_counter()
        got, timings = kernel_cases.run(case, device, repeats=repeats, timer=device.timer()
                                        if repeats else None)
        row['launches'] = timings
        row['device_wall'] = time.perf_counter() - t
    except Exception as e:
        row.update(ok=False, error='device: {}: {}'.format(type(e).__name__, e))
        return row
    if emulator is not None:
        try:
            t = time.perf_counter()
            expected, _ = kernel_cases.run(case, emulator)
            row['emulator_seconds'] = time.perf_counter() - t
        except Exception as e:
            row.update(ok=False, error='emulator: {}: {}'.format(type(e).__name__, e))
            return row
        row['outputs'] = {}
        ok = True
        sums = case.sums(case.arrays) if case.sums else {}
        for name in case.outputs:
            good, worst, where = compare(expected[name], got[name], sums.get(name))
            row['outputs'][name] = {'ok': good, 'max_abs_err': worst, 'detail': where}
            ok &= good
        row['ok'] = ok
    else:
        row['ok'] = None
    return row


def _table(rows, peak):
    """One line per case (do the outputs match), one per timed launch under it."""
    head = '{:10s} {:52s} {:>6s} {:>10s} {:>9s} {:>8s} {:>7s}'.format(
        'family', 'case / kernel', 'match', 'max err', 'GPU ms', 'GB/s', '% peak')
    lines = [head, '-' * len(head)]
    for r in rows:
        errs = [o['max_abs_err'] for o in r.get('outputs', {}).values()
                if o['max_abs_err'] is not None]
        lines.append('{:10s} {:52s} {:>6s} {:>10s}'.format(
            r['family'], r['case'][:52], {True: 'yes', False: 'NO', None: '-'}[r.get('ok')],
            '{:.2e}'.format(max(errs)) if errs else '-'))
        if r.get('error'):
            lines.append('    ' + r['error'][:2000])
        for name, o in r.get('outputs', {}).items():
            if not o['ok']:
                lines.append('    {}: {}'.format(name, o['detail']))
        for t in r.get('launches') or ():
            s = t['seconds']
            gbps = t['bytes'] / s / 1e9 if s else None
            lines.append('{:10s}   {:50s} {:>6s} {:>10s} {:>9s} {:>8s} {:>7s}'.format(
                '', t['kernel'][:50], '', '', '{:.3f}'.format(s * 1e3) if s else '-',
                '{:.0f}'.format(gbps) if gbps else '-',
                '{:.0f}'.format(100 * gbps / peak) if gbps and peak else '-'))
    return '\n'.join(lines)


def gpu_available():
    """(True, '') or (False, why)."""
    try:
        import cupy
    except Exception as e:
        return False, 'CuPy cannot be imported ({}: {})'.format(type(e).__name__, e)
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return False, 'CuPy finds no CUDA driver or device ({}: {})'.format(type(e).__name__, e)
    if n < 1:
        return False, 'CuPy sees no CUDA device'
    return True, ''


def main(argv=None):
    parser = argparse.ArgumentParser(prog='python -m chainer_tc.testing.gpu_parity',
                                     description=__doc__.split('\n\n')[0])
    parser.add_argument('--quick', action='store_true',
                        help='awkward shapes only, no timing (for compute-sanitizer): '
                             'the same as --shapes awkward --repeats 0')
    parser.add_argument('--shapes', choices=('awkward', 'big', 'all'), default='all',
                        help='awkward shapes, ResNet-50-sized ones (batch 256), or both')
    parser.add_argument('--family', action='append', help='only this kernel family (repeatable)')
    parser.add_argument('--repeats', type=int, default=20, help='timed runs per case (median)')
    parser.add_argument('--no-emulator', action='store_true',
                        help='time the GPU only (no comparison with the emulator)')
    parser.add_argument('--json', help='write the results here')
    parser.add_argument('--self-test', action='store_true', help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.self_test:
        device = EmulatorAsDevice()
    else:
        ok, why = gpu_available()
        if not ok:
            print('gpu_parity: no CUDA GPU here: {}. Nothing to compare; run this on a machine '
                  'with a GPU (it needs only NumPy, CuPy and a C++ compiler).'.format(why))
            if args.json:
                with open(args.json, 'w') as f:
                    json.dump({'gpu': False, 'reason': why}, f, indent=1)
            return 0
        device = CupyBackend()
    emulator = None if args.no_emulator else kernel_cases.EmulatorBackend()
    if args.quick:
        args.shapes, args.repeats = 'awkward', 0
    selected = kernel_cases.cases(big=args.shapes != 'awkward', awkward=args.shapes != 'big')
    if args.family:
        selected = [c for c in selected if c.family in args.family]
    info = device.describe()
    peak = info.get('peak_gbps')
    print('device: {}; peak memory bandwidth: {}'.format(
        info.get('device'), '{:.0f} GB/s'.format(peak) if peak else 'unknown'))
    repeats = args.repeats
    rows = []
    for case in selected:
        rows.append(run_case(case, device, emulator, repeats))
        if hasattr(case, 'release'):          # ResNet-50-sized arrays: gigabytes, one case at a time
            case.release()
        r = rows[-1]
        print('  {} {}: {}'.format(case.family, case.name,
                                   'error' if r.get('error') else
                                   {True: 'match', False: 'MISMATCH', None: 'ran'}[r['ok']]),
              flush=True)
    print()
    print(_table(rows, peak))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump({'gpu': not args.self_test, 'info': info, 'cases': rows}, f, indent=1,
                      default=str)
    if any(r.get('error') for r in rows):
        return 2
    return 1 if any(r.get('ok') is False for r in rows) else 0


if __name__ == '__main__':
    sys.exit(main())
