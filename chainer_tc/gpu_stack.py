"""``python -m chainer_tc check-gpu-stack``: CI check of the GPU install, no GPU needed.

Checks that the pip-installed CUDA stack is complete and loadable the way chainer_tc uses it:
cuDNN 8.9 from CuPy, chainer_tc's cuDNN binding on that same library, Chainer seeing CuPy and
cuDNN, and NVRTC 12 compiling a kernel.  Prints one PASS/FAIL line per check; exit code 1 if any fails.
"""
import argparse
import sys


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


def check_cudnn_binding():
    """chainer_tc's own cuDNN binding loads, with every function it calls, and it is the very
    library object CuPy uses."""
    from chainer_tc.cuda import cudnn
    b = cudnn.binding()
    cupys = cudnn._cupys_library()
    if cupys.lib is None:
        raise CheckFailed("chainer_tc binds %s, but CuPy's cuDNN: %s" % (b.path, cupys.skipped))
    if cupys.lib._handle != b.lib._handle:
        raise CheckFailed("chainer_tc binds %s, another library than CuPy's %s" % (
            b.path, cupys.path))
    return '%d functions bound in %s (cuDNN %s), the library CuPy uses' % (
        len(cudnn.PROTOTYPES), b.path, cudnn.version_string(b.version()))


def check_chainer():
    from chainer.backends import cuda
    if not (cuda.available and cuda.cudnn_enabled):
        raise CheckFailed('chainer.backends.cuda.available=%s cudnn_enabled=%s (was cupy '
                          'imported before chainer_tc?)' % (cuda.available, cuda.cudnn_enabled))
    return 'available=True cudnn_enabled=True'


def check_nvrtc():
    from cupy_backends.cuda.libs import nvrtc

    from chainer_tc import _cubin
    from chainer_tc import kernels
    from chainer_tc import nvrtc_check
    major, minor = nvrtc.getVersion()
    if major != 12:
        raise CheckFailed('NVRTC %d.%d, need 12.x' % (major, minor))
    # a real project kernel, for the oldest architecture we support, compiled now (not read
    # from the compile cache: an install whose NVRTC loads but cannot compile, e.g. without
    # libnvrtc-builtins, must fail here)
    program = _cubin.compile_program(kernels.source('layout'), 'kernels/layout.cu',
                                     nvrtc_check.compile_options('sm_70'))
    cubin, log = program.binary, program.log
    if 'batched_transpose_f32_f16' not in nvrtc_check.parse_ptxas_log(log):
        raise CheckFailed('NVRTC compiled kernels/layout.cu without its kernels')
    return 'NVRTC %d.%d compiled kernels/layout.cu for sm_70 (%d-byte cubin)' % (
        major, minor, len(cubin))


CHECKS = (
    ('cudnn-version', check_cudnn_version),
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
