"""chainer_tc: make Chainer train ResNet-50 in fp16 on Tensor Cores as fast as the hardware allows.

Importing this package is cheap: it only makes pip-installed CUDA libraries visible to CuPy (see
``chainer_tc._cuda_libs``); no compilation and no device query happen at import.
"""
from chainer_tc import _cuda_libs

_cuda_libs.preload()

__version__ = '0.1.0'
