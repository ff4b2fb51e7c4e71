"""``python -m chainer_tc check-gpu-stack``: CI check of the GPU install, no GPU needed.

Checks that the pip-installed CUDA stack is complete and loadable the way chainer_tc uses it:
cuDNN 8.9 with the entry points and constants chainer_tc calls, Chainer seeing CuPy and cuDNN,
and NVRTC 12 compiling a kernel.  Prints one PASS/FAIL line per check; exit code 1 if any fails.
"""
import argparse
import ctypes
import sys

CUDNN_SONAME = 'libcudnn.so.8'
# C entry point chainer_tc calls -> its name in cupy_backends.cuda.libs.cudnn.  CuPy 13 keeps
# the historical '_v3' suffix for the two backward convolutions (same C functions).
CUDNN_SYMBOLS = {
    'cudnnBatchNormalizationForwardTrainingEx': 'batchNormalizationForwardTrainingEx',
    'cudnnBatchNormalizationBackwardEx': 'batchNormalizationBackwardEx',
    'cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize':
        'getBatchNormalizationForwardTrainingExWorkspaceSize',
    'cudnnGetBatchNormalizationBackwardExWorkspaceSize':
        'getBatchNormalizationBackwardExWorkspaceSize',
    'cudnnGetBatchNormalizationTrainingExReserveSpaceSize':
        'getBatchNormalizationTrainingExReserveSpaceSize',
    'cudnnConvolutionForward': 'convolutionForward',
    'cudnnConvolutionBackwardData': 'convolutionBackwardData_v3',
    'cudnnConvolutionBackwardFilter': 'convolutionBackwardFilter_v3',
    'cudnnBatchNormalizationForwardInference': 'batchNormalizationForwardInference',
}
CUDNN_CONSTANTS = ('CUDNN_TENSOR_NHWC', 'CUDNN_BATCHNORM_SPATIAL_PERSISTENT',
                   'CUDNN_BATCHNORM_OPS_BN_ADD_ACTIVATION')


class CheckFailed(Exception):
    """A check ran and found the stack wrong; the message says how."""


def check_cudnn_version():
    import cupyx.cudnn  # noqa: F401  (the wrappers chainer uses)
    from cupy_backends.cuda.libs import cudnn
    from chainer_tc.info import cudnn_version_string
    v = cudnn.getVersion()
    if not 8900 <= v < 9000:
        raise CheckFailed('cuDNN %s, need 8.9.x' % cudnn_version_string(v))
    return 'cuDNN %s' % cudnn_version_string(v)


def check_cudnn_symbols():
    from chainer_tc import _cuda_libs
    path = _cuda_libs.preloaded().get('cudnn')
    where = path or '%s (by soname, not preloaded)' % CUDNN_SONAME
    lib = ctypes.CDLL(path or CUDNN_SONAME)
    missing = [s for s in CUDNN_SYMBOLS if not hasattr(lib, s)]
    if missing:
        raise CheckFailed('%s lacks %s' % (where, ', '.join(missing)))
    return '%d symbols in %s' % (len(CUDNN_SYMBOLS), where)


def check_cudnn_binding():
    from cupy_backends.cuda.libs import cudnn
    names = list(CUDNN_SYMBOLS.values()) + list(CUDNN_CONSTANTS)
    missing = [n for n in names if not hasattr(cudnn, n)]
    if missing:
        raise CheckFailed('cupy_backends.cuda.libs.cudnn lacks %s' % ', '.join(missing))
    return '%d functions, %s' % (len(CUDNN_SYMBOLS), ', '.join(
        '%s=%d' % (n, getattr(cudnn, n)) for n in CUDNN_CONSTANTS))


def check_chainer():
    from chainer.backends import cuda
    if not (cuda.available and cuda.cudnn_enabled):
        raise CheckFailed('chainer.backends.cuda.available=%s cudnn_enabled=%s (was cupy '
                          'imported before chainer_tc?)' % (cuda.available, cuda.cudnn_enabled))
    return 'available=True cudnn_enabled=True'


def check_nvrtc():
    from cupy_backends.cuda.libs import nvrtc

    from chainer_tc import kernels
    from chainer_tc import nvrtc_check
    major, minor = nvrtc.getVersion()
    if major != 12:
        raise CheckFailed('NVRTC %d.%d, need 12.x' % (major, minor))
    # a real project kernel, for the oldest architecture we support
    cubin, log = nvrtc_check.compile_source(kernels.source('layout'), 'kernels/layout.cu', 'sm_70')
    if 'batched_transpose_f32_f16' not in nvrtc_check.parse_ptxas_log(log):
        raise CheckFailed('NVRTC compiled kernels/layout.cu without its kernels')
    return 'NVRTC %d.%d compiled kernels/layout.cu for sm_70 (%d-byte cubin)' % (
        major, minor, len(cubin))


CHECKS = (
    ('cudnn-version', check_cudnn_version),
    ('cudnn-symbols', check_cudnn_symbols),
    ('cudnn-binding', check_cudnn_binding),
    ('chainer-cuda', check_chainer),
    ('nvrtc', check_nvrtc),
)


def run_checks():
    """Run every check; return a list of (name, passed, detail)."""
    results = []
    for name, check in CHECKS:
        try:
            results.append((name, True, check()))
        except Exception as e:
            detail = str(e) if isinstance(e, CheckFailed) else '%s: %s' % (type(e).__name__, e)
            results.append((name, False, detail))
    return results


def main(argv=None):
    """Entry point of ``python -m chainer_tc check-gpu-stack``; returns the exit code."""
    argparse.ArgumentParser(prog='python -m chainer_tc check-gpu-stack',
                            description=__doc__.splitlines()[0]).parse_args(argv)
    results = run_checks()
    width = max(len(name) for name, _, _ in results)
    for name, ok, detail in results:
        sys.stdout.write('%s  %s  %s\n' % ('PASS' if ok else 'FAIL', name.ljust(width), detail))
    failed = sum(1 for _, ok, _ in results if not ok)
    sys.stdout.write('%d/%d checks passed\n' % (len(results) - failed, len(results)))
    return 1 if failed else 0
