import os

# float32 cuDNN results are compared with NumPy's at float32 tolerances: no TF32 Tensor Core math
# (cuDNN 8's default for float32 on an A100/H100). Read when the CUDA libraries start, so here,
# before anything imports them. docs/functions.md (Convolution) says the same to users.
os.environ.setdefault('NVIDIA_TF32_OVERRIDE', '0')

import numpy  # noqa: E402
import pytest  # noqa: E402

# The CPU emulator must know every NumPy allocation a kernel's pointer table points into (the
# optimizer's gradients): its allocation tracker starts before any test makes an array.
import chainer_tc.testing.emulator  # noqa: E402,F401

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


def _cudnn_problem():
    """Why chainer_tc's cuDNN paths cannot run here, or None: its own binding must load a cuDNN
    8.9 or 9 (CuPy's cuDNN is not needed: CuPy 14 has none)."""
    import chainer_tc  # noqa: F401  (preloads the CUDA libraries)
    from chainer_tc.cuda import cudnn
    return cudnn.unavailable_reason()


def _cupy_cudnn_problem():
    """Why CuPy's own cuDNN (``cupyx.cudnn``, and Chainer's cuDNN paths) cannot be used here, or
    None: a test comparing against them needs CuPy 13 with cuDNN 8.9."""
    import chainer_tc  # noqa: F401
    try:
        import cupyx.cudnn  # noqa: F401  (removed in CuPy 14)
        from cupy_backends.cuda.libs import cudnn
        cudnn.getVersion()
    except Exception as e:
        return "CuPy's cuDNN is not usable here ({}: {})".format(type(e).__name__, e)
    import chainer
    if not chainer.backends.cuda.cudnn_enabled:
        return 'chainer.backends.cuda.cudnn_enabled is False (was cupy imported before chainer_tc?)'
    return None


@pytest.fixture
def cudnn_stack():
    """Skips the test, with the reason, where chainer_tc's cuDNN binding does not load
    (``_cudnn_problem``). Put it first among a test's arguments, before fixtures that may reach
    cuDNN."""
    why = _cudnn_problem()
    if why:
        pytest.skip(why)


@pytest.fixture
def cupy_cudnn():
    """Skips the test, with the reason, where CuPy's own cuDNN is not usable (a test that
    compares with ``cupyx.cudnn`` or with Chainer's cuDNN path)."""
    why = _cupy_cudnn_problem()
    if why:
        pytest.skip(why)


@pytest.fixture
def fake(monkeypatch):
    """chainer_tc's cuDNN drivers over the real library's host-only calls, with a fake handle,
    queries, computations and runtime (``cudnn_fakes.fake_cudnn``): its state."""
    from cudnn_fakes import fake_cudnn
    yield from fake_cudnn(monkeypatch)


def _dali_problem():
    """Why NVIDIA DALI cannot be imported here, or None."""
    try:
        import nvidia.dali  # noqa: F401
    except Exception as e:
        return 'NVIDIA DALI is not installed (pip install nvidia-dali-cuda120): {}'.format(e)
    return None


@pytest.fixture
def dali_stack():
    """Skips the test, with the reason, where DALI cannot be imported (``_dali_problem``)."""
    why = _dali_problem()
    if why:
        pytest.skip(why)


def pytest_configure(config):
    config.addinivalue_line('markers', 'gpu: needs a CUDA GPU; run with `pytest -m gpu` on one')
    config.addinivalue_line('markers', 'cudnn_library: calls the real libcudnn (host-only '
                            'calls); tests/test_cuda_cudnn.py runs these again under cuDNN 9')


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
