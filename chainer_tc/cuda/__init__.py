"""What CuPy lacks for a captured training step: cuDNN and cuBLAS bindings usable under capture.

``cudnn``       chainer_tc's ctypes binding to cuDNN 8.9 or 9: every call its convolutions and
                fused batch norm make (C declarations in ``_cudnn_api``), usable under capture
``cublas``      a ctypes binding to libcublas: a handle of its own per device and
                cublasGemmEx, for the matrix products of Chainer's Linear inside a capture
``descriptors`` cuDNN descriptors built once, through that binding, outside capture
``conv``        the convolution driver: descriptors and algorithm chosen once per key, then
                only ctypes calls per call
``runtime``     the few CuPy runtime facts the drivers need per call

:func:`counters` says how many descriptors were created and how many algorithm and workspace
queries were made, so a test can assert that nothing is created after warm-up. Importing this
package imports neither CuPy nor cuDNN. Nothing here imports chainer_tc.functions, links, models,
optimizers or static_graph.
"""
from chainer_tc.cuda._counters import counters  # NOQA
from chainer_tc.cuda._counters import reset_counters  # NOQA


class PerformanceWarning(UserWarning):
    """cuDNN had to take a slower path than asked for (said once, with the reason)."""
