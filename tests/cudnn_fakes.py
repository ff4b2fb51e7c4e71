"""Fakes for testing chainer_tc's cuDNN drivers without a GPU: the real library's host-only calls
(descriptors, messages), fake handle, queries and computations, a fake runtime (stream, allocator,
arrays), and cuDNN's own getters to read back what a descriptor holds."""
import ctypes
import types

import numpy
import pytest

import chainer_tc
from chainer_tc.cuda import _cudnn_api as api
from chainer_tc.cuda import conv
from chainer_tc.cuda import cudnn
from chainer_tc.cuda import descriptors
from chainer_tc.cuda import runtime


def needs_cudnn(test):
    """A test that calls the real libcudnn (host-only calls): skipped, with the reason, where
    no cuDNN loads; run again under cuDNN 9 by test_the_library_tests_pass_under_cudnn_9."""
    why = cudnn.unavailable_reason()
    return pytest.mark.cudnn_library(pytest.mark.skipif(why is not None, reason=str(why))(test))


# ---- a fake library and runtime ------------------------------------------------------------------

class FakeFunction:
    """Records calls after converting each argument the way ctypes would (wrong kinds raise);
    ``effect(args)`` may write the call's outputs."""

    def __init__(self, name, log, effect=None):
        self.name, self.log, self.effect = name, log, effect
        self.argtypes, self.restype, self.status = None, None, 0

    def __call__(self, *args):
        if self.name == cudnn.ERROR_STRING:
            return b'CUDNN_STATUS_FAKE'
        assert len(args) == len(self.argtypes), self.name
        for t, a in zip(self.argtypes, args):
            t.from_param(a)
        self.log.append((self.name, args))
        if self.effect is not None and not self.status:
            self.effect(args)
        return self.status


class FakeLib:
    """cuDNN with the real library's host-only calls (descriptors, messages: the real thing,
    no GPU needed) and fakes for the rest (handle, queries, computations): ``effects`` maps a
    C name to what its fake writes."""

    def __init__(self, real=None, effects=None):
        self.log, self.real, self.effects = [], real, effects or {}

    def __getattr__(self, name):
        if not name.startswith('cudnn'):
            raise AttributeError(name)
        if self.real is not None and name in api.HOST_ONLY and name != cudnn.ERROR_STRING:
            f = getattr(self.real, name)
        else:
            f = FakeFunction(name, self.log, self.effects.get(name))
        setattr(self, name, f)
        return f


class FakeArray:
    """What the driver reads of a CuPy array."""

    def __init__(self, shape, dtype, ptr, device=0, contiguous=True):
        self.shape, self.dtype = tuple(shape), numpy.dtype(dtype)
        self.data = types.SimpleNamespace(ptr=ptr, device_id=device)
        self.flags = types.SimpleNamespace(c_contiguous=contiguous)

    def transpose(self, *axes):
        """A view with its axes permuted (not contiguous, as CuPy's)."""
        return FakeArray([self.shape[i] for i in axes], self.dtype, self.data.ptr,
                         self.data.device_id, contiguous=False)


def perf(algo, memory=0, status=0, determinism=1, math_type=1):
    return types.SimpleNamespace(algo=algo, status=status, time=1.0, memory=memory,
                                 determinism=determinism, mathType=math_type)


HANDLE, STREAM = 0x4A00, 0x5700


def write_perfs(perfs, returned_addr, perfs_addr, requested):
    out = (api.AlgoPerf * requested).from_address(perfs_addr)
    for slot, p in zip(out, perfs[:requested]):
        slot.algo, slot.status, slot.time, slot.memory = p.algo, p.status, p.time, p.memory
        slot.determinism, slot.mathType = p.determinism, p.mathType
    ctypes.c_int.from_address(returned_addr).value = min(len(perfs), requested)


def fake_cudnn(monkeypatch):
    """(A generator, the ``fake`` fixture of conftest.py.) The driver with a cuDNN binding whose descriptors are real (host-only calls) and whose
    handle, queries and computations are fake, and a fake runtime (stream, allocator)."""
    state = types.SimpleNamespace(allocs=[], capturing=False, queries=[],
                                  perfs=[perf(1, 1024)], sizes={})

    def algorithms(name):
        def effect(args):
            state.queries.append((name, args))
            if 'Find' in name:
                write_perfs(state.perfs, args[9], args[10], args[8])
            else:
                write_perfs(state.perfs, args[6], args[7], args[5])
        return effect

    def size(name):
        def effect(args):
            state.queries.append((name, args))
            key = args[5] if 'Convolution' in name else name
            ctypes.c_size_t.from_address(args[-1]).value = state.sizes.get(key, 1024)
        return effect
    effects = {}
    for d in (conv.FORWARD, conv.BACKWARD_DATA, conv.BACKWARD_FILTER):
        effects[d.get], effects[d.find] = algorithms(d.get), algorithms(d.find)
        effects[d.size] = size(d.size)
    for name in BN_QUERIES:
        effects[name] = size(name)
    state.lib = FakeLib(cudnn.binding().lib, effects)
    monkeypatch.setattr(cudnn, '_binding', cudnn.Binding(state.lib))
    monkeypatch.setattr(runtime, 'handle', lambda device: HANDLE + device)
    monkeypatch.setattr(runtime, 'stream_ptr', lambda: STREAM)
    monkeypatch.setattr(runtime, 'is_capturing', lambda: state.capturing)

    def alloc(nbytes):
        if not nbytes:
            return None
        state.allocs.append(nbytes)
        return types.SimpleNamespace(ptr=0x10000000 + nbytes)
    monkeypatch.setattr(runtime, 'alloc', alloc)
    counter = iter(range(0x20000000, 0x30000000, 0x100000))
    monkeypatch.setattr(runtime, 'empty',
                        lambda shape, dtype: FakeArray(shape, dtype, next(counter)))
    conv.clear_plans()
    descriptors.clear_cache()
    monkeypatch.setattr(conv, '_limit', None)
    chainer_tc.cuda.reset_counters()
    yield state
    conv.clear_plans()
    descriptors.clear_cache()


BN_QUERIES = ('cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize',
              'cudnnGetBatchNormalizationTrainingExReserveSpaceSize',
              'cudnnGetBatchNormalizationBackwardExWorkspaceSize')


def lib_calls(state):
    """The fake (GPU-side) calls, in order; queries not included."""
    return [(name, args) for name, args in state.lib.log
            if 'Get' not in name and 'Find' not in name]


# cuDNN's getters, to read back what a descriptor holds (host-only calls, no GPU needed)
def _getter(name, n_out):
    fn = getattr(cudnn.binding().lib if not isinstance(cudnn.binding().lib, FakeLib)
                 else cudnn.binding().lib.real, name)
    fn.argtypes = [ctypes.c_void_p] + [ctypes.POINTER(ctypes.c_int)] * n_out
    fn.restype = ctypes.c_int

    def read(desc):
        out = [ctypes.c_int() for _ in range(n_out)]
        assert fn(desc, *out) == 0, name
        return tuple(o.value for o in out)
    return read


def read_tensor(desc):
    return _getter('cudnnGetTensor4dDescriptor', 9)(desc)


def read_filter(desc):
    return _getter('cudnnGetFilter4dDescriptor', 6)(desc)


def read_conv(desc):
    return (_getter('cudnnGetConvolution2dDescriptor', 8)(desc),
            _getter('cudnnGetConvolutionGroupCount', 1)(desc)[0],
            _getter('cudnnGetConvolutionMathType', 1)(desc)[0])
