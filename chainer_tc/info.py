"""``python -m chainer_tc info [--json]``: what is installed, what was found, what works.

Every probe is guarded: on a half-installed stack the report says what is missing instead of
crashing.  Importing this module is cheap; the heavy imports happen inside :func:`collect`.
The JSON keys are documented in ``docs/info.md``.
"""
import argparse
import importlib
import json
import os
import platform
import shutil
import sys
import warnings

SCHEMA_VERSION = 1
FEATURES = ('nhwc_cudnn_conv', 'fused_bn_add_relu_cudnn', 'cuda_graphs', 'dali_gpu_decode',
            'cuda_emulator', 'nvrtc_compile_check', 'multinode_mpi', 'multinode_nccl')
VERSION_KEYS = ('python', 'chainer', 'numpy', 'cupy', 'cudnn', 'nvrtc', 'dali', 'cuda_runtime',
                'cuda_driver', 'mpi4py')
TENSOR_CORE_CC = (7, 0)


def _error(exc):
    """One-line description of an exception: its first line that says something (CuPy's
    import error opens with a banner of '=')."""
    text = [line.strip() for line in str(exc).splitlines() if any(c.isalnum() for c in line)]
    return '%s: %s' % (type(exc).__name__, text[0]) if text else type(exc).__name__


def cudnn_version_string(v):
    """8907 -> '8.9.7' (cuDNN 8 encoding), 90100 -> '9.1.0' (cuDNN 9 encoding)."""
    from chainer_tc.cuda import cudnn
    return cudnn.version_string(v)


def cuda_version_string(v):
    """12090 -> '12.9'."""
    return '%d.%d' % (v // 1000, v % 1000 // 10)


def _feature(*checks):
    """{"available", "reason"} from (ok, reason) pairs: the first failing one gives the reason."""
    for ok, reason in checks:
        if not ok:
            return {'available': False, 'reason': reason}
    return {'available': True, 'reason': None}


class _Probe(object):
    """Collects results; ``run(key, fn)`` stores an exception message under ``errors[key]``."""

    def __init__(self):
        self.errors = {}

    def run(self, key, fn, default=None):
        try:
            return fn()
        except (Exception, SystemExit) as e:  # never let a probe crash the report
            self.errors[key] = _error(e)
            return default

    def module(self, key, name):
        """Import ``name``; None (and an ``errors[key]`` entry) when that fails."""
        return self.run(key, lambda: importlib.import_module(name))


def _gpus(probe, cupy):
    """``(gpus, why_none)``: the GPUs CUDA sees and, when there are none, why."""
    if cupy is None:
        return [], 'CuPy not importable'
    runtime = cupy.cuda.runtime
    try:
        count = runtime.getDeviceCount()
    except Exception as e:
        detail = _error(e)
        probe.errors['gpus'] = detail
        return [], detail
    gpus = []
    for i in range(count):
        def props(i=i):
            p = runtime.getDeviceProperties(i)
            name = p['name']
            return {'index': i,
                    'name': name.decode() if isinstance(name, bytes) else str(name),
                    'compute_capability': '%d.%d' % (p['major'], p['minor']),
                    'memory_bytes': int(p['totalGlobalMem'])}
        g = probe.run('gpu%d' % i, props)
        if g is not None:
            gpus.append(g)
    return gpus, (None if gpus else 'device count is 0')


def collect():
    """Return the report as a JSON-serialisable dict (see docs/info.md)."""
    from chainer_tc import _cuda_libs
    probe = _Probe()
    versions = dict.fromkeys(VERSION_KEYS)
    versions['python'] = platform.python_version()

    with warnings.catch_warnings(record=True) as caught:
        numpy = probe.module('numpy', 'numpy')
        cupy = probe.module('cupy', 'cupy')
        chainer = probe.module('chainer', 'chainer')
        nvrtc_lib = probe.module('nvrtc', 'cupy_backends.cuda.libs.nvrtc')
        dali = probe.module('dali', 'nvidia.dali')
        chainermn = probe.module('chainermn', 'chainermn')
        versions['mpi4py'] = probe.run('mpi4py', lambda: _distribution_version('mpi4py'))

        versions['numpy'] = getattr(numpy, '__version__', None)
        versions['cupy'] = getattr(cupy, '__version__', None)
        versions['chainer'] = getattr(chainer, '__version__', None)
        versions['dali'] = getattr(dali, '__version__', None)
        # the cuDNN chainer_tc's own binding calls (CuPy's where CuPy has one)
        cudnn = probe.run('cudnn', lambda: importlib.import_module(
            'chainer_tc.cuda.cudnn').binding())
        cudnn_int = cudnn.version() if cudnn is not None else None
        if cudnn_int is not None:
            versions['cudnn'] = cudnn_version_string(cudnn_int)
        if nvrtc_lib is not None:
            v = probe.run('nvrtc', nvrtc_lib.getVersion)
            versions['nvrtc'] = '%d.%d' % tuple(v) if v is not None else None
        rt = probe.run('cuda_runtime', lambda: cupy.cuda.runtime) if cupy else None
        if rt is not None:
            v = probe.run('cuda_runtime', rt.runtimeGetVersion)
            versions['cuda_runtime'] = cuda_version_string(v) if v else None
            v = probe.run('cuda_driver', rt.driverGetVersion)
            versions['cuda_driver'] = cuda_version_string(v) if v else None  # 0: no driver
        gpus, no_gpu_detail = probe.run('gpus', lambda: _gpus(probe, cupy), ([], 'probe failed'))

        chainer_cuda = {'available': False, 'cudnn_enabled': False}
        if chainer is not None:
            cuda = probe.run('chainer.backends.cuda', lambda: chainer.backends.cuda)
            chainer_cuda = {'available': bool(getattr(cuda, 'available', False)),
                            'cudnn_enabled': bool(getattr(cuda, 'cudnn_enabled', False))}
            why = getattr(cuda, '_resolution_error', None)  # Chainer keeps its import error
            if why is not None:
                probe.errors['chainer.backends.cuda'] = _error(why)
            elif chainer_cuda['available'] and not chainer_cuda['cudnn_enabled']:
                probe.errors['chainer.backends.cuda'] = 'cuDNN disabled (CHAINER_CUDNN=0?)'

    # Shared requirements, as (ok, reason) pairs.
    has_cupy = (cupy is not None, 'CuPy not importable: %s' % probe.errors.get('cupy'))
    has_cudnn = (cudnn_int is not None, 'cuDNN not loadable: %s' % probe.errors.get('cudnn'))
    if rt is not None and versions['cuda_driver'] is None and 'cuda_driver' not in probe.errors:
        no_gpu_detail = 'no CUDA driver installed'
    has_gpu = (bool(gpus), 'no CUDA GPU found (%s)' % no_gpu_detail)
    best = max((tuple(int(x) for x in g['compute_capability'].split('.')) for g in gpus),
               default=None)
    tensor_cores = (best is None or best >= TENSOR_CORE_CC,
                    'GPU compute capability %s < %d.%d (Tensor Cores need Volta)'
                    % ('%d.%d' % best if best else '?', TENSOR_CORE_CC[0], TENSOR_CORE_CC[1]))

    has_dali = (dali is not None, 'DALI not importable: %s' % probe.errors.get('dali'))
    graphs = hasattr(getattr(getattr(cupy, 'cuda', None), 'Stream', None), 'begin_capture')
    compiler = shutil.which('g++')
    nvrtc_ok = versions['nvrtc'] is not None

    # without importing mpi4py.MPI, which would start MPI in this process
    mpi = (chainermn is not None and versions['mpi4py'] is not None and _mpiexec() is not None,
           'ChainerMN not importable: %s' % probe.errors.get('chainermn') if chainermn is None
           else 'mpi4py not installed (pip install -e \'.[mpi]\')' if versions['mpi4py'] is None
           else 'no mpiexec on PATH or in %s' % os.path.join(sys.prefix, 'bin'))
    nccl = probe.run('nccl', lambda: bool(importlib.import_module('cupy.cuda.nccl').available),
                     False) if cupy is not None else False

    features = {
        # chainer_tc's cuDNN binding (8.9 or 9, every function it calls) serves both
        'nhwc_cudnn_conv': _feature(has_cupy, has_cudnn, has_gpu, tensor_cores),
        'fused_bn_add_relu_cudnn': _feature(has_cupy, has_cudnn, has_gpu, tensor_cores),
        # a training step with convolutions is capturable only through our own cuDNN binding,
        # one with a Linear only through our own cuBLAS handle: CuPy refuses both under capture
        'cuda_graphs': _feature(has_cupy, (graphs, 'CuPy lacks Stream.begin_capture'),
                                has_cudnn, _capture_cublas(), has_gpu),
        'dali_gpu_decode': _feature(has_dali, has_gpu),
        'cuda_emulator': _feature((compiler is not None, 'no C++ compiler (g++) on PATH')),
        'nvrtc_compile_check': _feature(
            (nvrtc_ok, 'NVRTC not loadable: %s' % probe.errors.get('nvrtc'))),
        # chainer_tc.multinode and the example's mpiexec runs: ChainerMN over MPI (CPU too)
        'multinode_mpi': _feature(mpi),
        # ChainerMN's GPU communicators (pure_nccl, the example's default on GPUs)
        'multinode_nccl': _feature(mpi, has_cupy, (nccl, 'CuPy has no NCCL: %s' % (
            probe.errors.get('nccl') or 'cupy.cuda.nccl.available is False')), has_gpu),
    }

    return {
        'schema': SCHEMA_VERSION,
        'chainer_tc': _chainer_tc_version(),
        'platform': platform.platform(),
        'versions': versions,
        'gpus': gpus,
        'chainer_cuda': chainer_cuda,
        'cudnn_library': getattr(cudnn, 'path', None),
        'preloaded_libraries': _cuda_libs.preloaded(),
        'preload_errors': _cuda_libs.preload_errors(),
        'features': features,
        'errors': probe.errors,
        'warnings': sorted({'%s: %s' % (w.category.__name__, w.message) for w in caught}),
    }


def _capture_cublas():
    """(ok, reason): chainer_tc's capture-safe cuBLAS binding (Linear's products) loads."""
    return _binding_loads('cublas', 'cuBLAS')


def _binding_loads(module, library):
    try:
        importlib.import_module('chainer_tc.cuda.' + module).binding()
        return True, None
    except Exception as e:
        return False, 'the capture-safe {} binding (chainer_tc.cuda.{}) does not load: {}'.format(
            library, module, e)


def _distribution_version(name):
    """The installed version of distribution ``name`` (None when it is not installed)."""
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _mpiexec():
    """mpiexec on PATH, or in this environment's bin (where the mpi extra installs it)."""
    here = os.path.join(sys.prefix, 'bin', 'mpiexec')
    return shutil.which('mpiexec') or (here if os.access(here, os.X_OK) else None)


def _chainer_tc_version():
    import chainer_tc
    return getattr(chainer_tc, '__version__', None)


def _yes(flag):
    return 'yes' if flag else 'no'


def format_text(report):
    """Human-readable, aligned rendering of a :func:`collect` report."""
    rows = []  # (section or '', key, value)

    def section(title, items):
        rows.append((title, '', ''))
        for key, value in items:
            rows.append(('', key, '' if value is None else str(value)))

    section('chainer_tc %s' % report['chainer_tc'], [('platform', report['platform'])])
    section('versions', [(k, v if v is not None else '-') for k, v in report['versions'].items()])
    gpus = report['gpus']
    section('GPUs', [('%d' % g['index'], '%s  sm_%s  %.1f GiB' % (
        g['name'], g['compute_capability'].replace('.', ''), g['memory_bytes'] / 2.0 ** 30))
        for g in gpus] or [('(none)', report['errors'].get('gpus')
                            or report['errors'].get('cupy', ''))])
    section('chainer.backends.cuda', [(k, v) for k, v in report['chainer_cuda'].items()])
    section('preloaded libraries', sorted(report['preloaded_libraries'].items())
            or [('(none)', '')])
    if report['preload_errors']:
        section('preload errors', sorted(report['preload_errors'].items()))
    section('features', [(name, _yes(f['available']) + ('' if f['available']
                                                        else '  ' + f['reason']))
                         for name, f in report['features'].items()])
    if report['errors']:
        section('errors', sorted(report['errors'].items()))
    if report['warnings']:
        section('warnings', [('', w) for w in report['warnings']])

    width = max(len(k) for _, k, _ in rows) + 2
    lines = []
    for title, key, value in rows:
        lines.append(title if title else ('  ' + key.ljust(width) + value).rstrip())
    return '\n'.join(lines) + '\n'


def main(argv=None):
    """Entry point of ``python -m chainer_tc info``; returns the exit code."""
    parser = argparse.ArgumentParser(prog='python -m chainer_tc info',
                                     description='Report the installed GPU stack and which '
                                                 'chainer_tc features can work here.')
    parser.add_argument('--json', action='store_true', help='print the report as JSON')
    args = parser.parse_args(argv)
    report = collect()
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2, sort_keys=True) + '\n')
    else:
        sys.stdout.write(format_text(report))
    return 0
