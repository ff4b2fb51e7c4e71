import os

# float32 cuDNN results are compared with NumPy's at float32 tolerances: no TF32 Tensor Core math
# (cuDNN 8's default for float32 on an A100/H100). Read when the CUDA libraries start, so here,
# before anything imports them. docs/functions.md (Convolution) says the same to users.
os.environ.setdefault('NVIDIA_TF32_OVERRIDE', '0')

import numpy  # noqa: E402
import pytest  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))


def cuda_source(name):
    """Path of a test kernel file in tests/cuda/."""
    return os.path.join(TESTS, 'cuda', name)


def _gpu_available():
    try:
        import chainer_tc  # noqa: F401  (preloads the CUDA libraries)
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_configure(config):
    config.addinivalue_line('markers', 'gpu: needs a CUDA GPU; run with `pytest -m gpu` on one')


def pytest_collection_modifyitems(config, items):
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason='needs a CUDA GPU (none found)')
    for item in items:
        if 'gpu' in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _deterministic_global_rng():
    """Every test starts from the same global NumPy random state (Chainer's initializers and
    gradient_check's random directions draw from it), so results do not depend on test order."""
    numpy.random.seed(0)
