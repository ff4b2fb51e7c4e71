"""chainer_tc: make Chainer train ResNet-50 in fp16 on Tensor Cores as fast as the hardware allows.

Importing this package is cheap: it only makes pip-installed CUDA libraries visible to CuPy (see
``chainer_tc._cuda_libs``); no compilation and no device query happen at import (but under
``CHAINER_TC_EMULATE=1``, where the CPU emulator's allocation tracker starts). Import it before
``chainer``: Chainer decides whether CUDA is available when it is first imported.
"""
import sys
import warnings

from chainer_tc import _cuda_libs

_cuda_libs.preload()


def _warn_if_chainer_came_first():
    cuda = sys.modules.get('chainer.backends.cuda')
    if cuda is not None and not getattr(cuda, 'available', True) and 'cublas' in \
            _cuda_libs.preloaded():
        warnings.warn(
            'chainer was imported before chainer_tc, before the pip-installed CUDA libraries '
            'were visible, so chainer.backends.cuda.available is False for this process. '
            'Import chainer_tc first.', RuntimeWarning, stacklevel=3)


_warn_if_chainer_came_first()


def _track_allocations_for_the_emulator():
    """Under CHAINER_TC_EMULATE=1 kernels run in the CPU emulator, which must know every NumPy
    allocation a kernel's pointer table points into (the optimizer's gradients): its tracker
    starts here, before the user's arrays exist (one cached g++ build the first time)."""
    import os
    if os.environ.get('CHAINER_TC_EMULATE') == '1':
        from chainer_tc.testing import emulator  # noqa: F401  (installs the tracker)


_track_allocations_for_the_emulator()

__version__ = '0.1.0'
