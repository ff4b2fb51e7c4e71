"""The cuDNN convolution driver: set up once per key, then only ctypes calls per call.

    from chainer_tc.cuda import conv
    g = conv.geometry(pad=(1, 1), stride=(1, 1))
    s = conv.chainer_settings()                 # autotune, tensor cores, determinism from config
    conv.forward(x, W, y, g, s)                 # y = x (*) W;  x (N,H,W,C), W (O,kh,kw,C/groups)
    conv.backward_data(W, gy, gx, g, s)
    conv.backward_filter(x, gy, gW, g, s)

The first call with a given key builds a *plan*: tensor and filter descriptors (shared, see
``chainer_tc.cuda.descriptors``), a convolution descriptor of its own, the algorithm and its
workspace size. The key holds everything that changes the choice: direction, device, the shapes
of x, W and y, dtype, layout, pad/stride/dilation/groups, whether Tensor Cores are asked for,
the deterministic and autotune flags and the workspace limit. The algorithm comes from
``cudnnFind*AlgorithmEx`` (``settings.auto_tune``: measured, synchronises) or
``cudnnGet*Algorithm_v7`` (heuristics); the first ranked result whose status is success, that is
deterministic when asked, and whose workspace fits the limit wins, and the descriptor takes the
math type of that result. Set-up runs through chainer_tc's cuDNN binding
(``chainer_tc.cuda.cudnn``, also where CuPy has no cuDNN) and is refused while the stream is
capturing (run one step eagerly first). Every later call allocates the workspace from the
current CuPy allocator and makes two ctypes calls (``cudnnSetStream`` to the current stream,
then the convolution): nothing is created or queried.

Compared with ``cupyx.cudnn`` 13.6: the same descriptors, compute type (float for half data) and
alpha/beta; but the algorithm cache key also holds dilation, groups, layout and the
deterministic flag (CuPy's does not), results that did not succeed are skipped, the workspace
limit defaults to 512 MiB (:func:`get_workspace_limit`), and Tensor Cores are asked for with
float16 data on every GPU unless ``use_cudnn_tensor_core`` is 'never' (CuPy 13 asks only on
compute capability 7.0, so an A100 or H100 would get CUDNN_DEFAULT_MATH). When cuDNN's preferred
algorithm needs more workspace than the limit, or the chosen one does not use Tensor Cores
although they were asked for, a :class:`~chainer_tc.cuda.PerformanceWarning` says so, once per
plan.
"""
import collections
import copy
import warnings

import numpy

from chainer_tc.cuda import PerformanceWarning
from chainer_tc.cuda import _counters
from chainer_tc.cuda import cudnn
from chainer_tc.cuda import descriptors
from chainer_tc.cuda import runtime

MiB = 1 << 20
CUPY_DEFAULT_WORKSPACE = 8 * MiB    # cupyx.cudnn's (and so Chainer's) default limit
DEFAULT_WORKSPACE_LIMIT = 512 * MiB  # what the original Chainer fp16 study used
TENSOR_CORE_MODES = ('always', 'auto', 'never')
# cudnnMathType_t values that use Tensor Cores: CUDNN_TENSOR_OP_MATH and
# CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION (cudnn_ops_infer_v8.h; CuPy 13 lacks the second name)
TENSOR_CORE_MATH = (1, 2)

_limit = None
_plans = {}


# ---- what a call is ---------------------------------------------------------------------------

Geometry = collections.namedtuple('Geometry', 'pad stride dilation groups')
Settings = collections.namedtuple('Settings', 'auto_tune tensor_core deterministic')


def _pair(v, name, least):
    v = (v, v) if isinstance(v, (int, numpy.integer)) else tuple(v)
    if len(v) != 2 or any(int(a) != a or a < least for a in v):
        raise ValueError('{} must be an int or a pair of ints >= {}; got {!r}'.format(
            name, least, v))
    return tuple(int(a) for a in v)


def geometry(pad=0, stride=1, dilation=1, groups=1):
    """A validated, hashable :class:`Geometry` (pairs of ints, as cuDNN's 2-D descriptor)."""
    if int(groups) != groups or groups < 1:
        raise ValueError('groups must be an int >= 1; got {!r}'.format(groups))
    return Geometry(_pair(pad, 'pad', 0), _pair(stride, 'stride', 1),
                    _pair(dilation, 'dilation', 1), int(groups))


def settings(auto_tune=False, tensor_core='auto', deterministic=False):
    """A validated :class:`Settings`; ``tensor_core`` is 'always', 'auto' or 'never'."""
    if tensor_core not in TENSOR_CORE_MODES:
        raise ValueError('tensor_core (chainer.config.use_cudnn_tensor_core) must be one of {}; '
                         'got {!r}'.format(TENSOR_CORE_MODES, tensor_core))
    return Settings(bool(auto_tune), tensor_core, bool(deterministic))


def chainer_settings():
    """:class:`Settings` from ``chainer.config``: ``autotune``, ``use_cudnn_tensor_core``,
    ``cudnn_deterministic``."""
    import chainer
    c = chainer.config
    return settings(c.autotune, c.use_cudnn_tensor_core, c.cudnn_deterministic)


def tensor_ops(mode, dtype):
    """Whether Tensor Core math is asked for: float16 data unless ``mode`` is 'never'."""
    return mode != 'never' and numpy.dtype(dtype).char == 'e'


# ---- the workspace limit ----------------------------------------------------------------------

def set_workspace_limit(nbytes):
    """Cap the workspace an algorithm may use at ``nbytes``; None restores the default."""
    global _limit
    if nbytes is not None and (int(nbytes) != nbytes or nbytes < 0):
        raise ValueError('nbytes must be a non-negative int or None; got {!r}'.format(nbytes))
    _limit = None if nbytes is None else int(nbytes)


def get_workspace_limit():
    """The workspace limit in bytes.

    Set by :func:`set_workspace_limit`; by default
    ``chainer.backends.cuda.get_max_workspace_size()`` when the user raised it above CuPy's 8 MiB
    default, else 512 MiB, the limit the original Chainer fp16 study used: algorithms whose
    scratch exceeds the limit are skipped, and 8 MiB rules out many of cuDNN's fast ones.
    """
    if _limit is not None:
        return _limit
    import chainer.backends.cuda
    chainer_limit = chainer.backends.cuda.get_max_workspace_size()
    return chainer_limit if chainer_limit > CUPY_DEFAULT_WORKSPACE else DEFAULT_WORKSPACE_LIMIT


# ---- the three directions ---------------------------------------------------------------------

class _Direction(collections.namedtuple(
        '_Direction', 'name call get find size count operands')):
    """One convolution call: its binding method, the C names of its queries, how many
    algorithms cuDNN has for it (CUDNN_CONVOLUTION_*_ALGO_COUNT), and its operands (a, b, out) as
    slots of the forward problem: x (data), w (filter), y (output)."""


def _direction(name, c_name, count, operands):
    return _Direction(name, 'convolution_' + name, 'cudnnGetConvolution{}Algorithm_v7'.format(
        c_name), 'cudnnFindConvolution{}AlgorithmEx'.format(c_name),
        'cudnnGetConvolution{}WorkspaceSize'.format(c_name), count, operands)


FORWARD = _direction('forward', 'Forward', 8, ('x', 'w', 'y'))
BACKWARD_DATA = _direction('backward_data', 'BackwardData', 6, ('w', 'y', 'x'))
BACKWARD_FILTER = _direction('backward_filter', 'BackwardFilter', 7, ('x', 'y', 'w'))


def forward(x, W, y, geometry, settings, layout='NHWC'):
    """y = conv(x, W) into the preallocated ``y`` (all C-contiguous, one dtype, one device)."""
    _run(FORWARD, (x, W, y), (x.shape, W.shape, y.shape), geometry, settings, layout)


def backward_data(W, gy, gx, geometry, settings, layout='NHWC'):
    """gx = the gradient of conv(x, W) with respect to x, given gy, into ``gx``."""
    _run(BACKWARD_DATA, (W, gy, gx), (gx.shape, W.shape, gy.shape), geometry, settings, layout)


def backward_filter(x, gy, gW, geometry, settings, layout='NHWC'):
    """gW = the gradient of conv(x, W) with respect to W, given gy, into ``gW``."""
    _run(BACKWARD_FILTER, (x, gy, gW), (x.shape, gW.shape, gy.shape), geometry, settings,
         layout)


def plan_key(direction, device_id, shapes, dtype, layout, geometry, settings, limit):
    """The key a plan is cached under (``shapes``: those of x, W and y)."""
    x_shape, w_shape, y_shape = shapes
    return (direction.name, device_id, tuple(x_shape), tuple(w_shape), tuple(y_shape),
            numpy.dtype(dtype).char, layout, geometry, tensor_ops(settings.tensor_core, dtype),
            settings.deterministic, settings.auto_tune, limit)


def clear_plans():
    """Forget every plan (the next call of each key sets up again)."""
    _plans.clear()


class Plan:
    """What a call needs after set-up: descriptors of (a, b, out), the convolution descriptor,
    algorithm, workspace size, alpha and beta (the handle is the calling thread's)."""

    __slots__ = ('descs', 'conv_desc', 'algo', 'math_type', 'workspace_size', 'one',
                 'zero', 'what', '_keep')


def _run(direction, operands, shapes, geometry, settings, layout):
    a, b, out = operands
    dtype, device_id = out.dtype, out.data.device_id
    for name, arr in zip(direction.operands, operands):
        if not arr.flags.c_contiguous:
            raise ValueError('cuDNN convolution {}: operand {} must be C-contiguous'.format(
                direction.name, name))
        if arr.dtype != dtype or arr.data.device_id != device_id:    # every call: the plan's
            raise TypeError('cuDNN convolution {}: operand {} is {} on device {}, expected {} '
                            'on device {} (as the output)'.format(    # key has out's only
                                direction.name, name, arr.dtype, arr.data.device_id, dtype,
                                device_id))
    key = plan_key(direction, device_id, shapes, dtype, layout, geometry, settings,
                   get_workspace_limit())
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _make_plan(direction, key, operands, shapes, geometry, settings,
                                        layout)
    if plan is IN_NCHW:
        _run_in_nchw(direction, operands, shapes, geometry, settings)
        return
    lib = cudnn.binding()
    workspace = runtime.alloc(plan.workspace_size)
    handle = runtime.handle(out.data.device_id)
    lib.set_stream(handle, runtime.stream_ptr())
    try:
        getattr(lib, direction.call)(
            handle, plan.one, plan.descs[0], a.data.ptr, plan.descs[1], b.data.ptr,
            plan.conv_desc, plan.algo, runtime.address(workspace), plan.workspace_size,
            plan.zero, plan.descs[2], out.data.ptr)
    except cudnn.CuDNNError as e:
        raise e.add_context(plan.what)


def _describe(direction, shapes, dtype, layout, geometry, settings):
    return ('cuDNN convolution {} of x {}, W {}, y {} ({}, {}, pad {}, stride {}, dilation {}, '
            'groups {}, {})'.format(direction.name, *shapes, numpy.dtype(dtype).name, layout,
                                    geometry.pad, geometry.stride, geometry.dilation,
                                    geometry.groups, settings))


def _make_plan(direction, key, operands, shapes, geometry, settings, layout):
    out = operands[2]
    dtype, device_id, limit = out.dtype, key[1], key[-1]
    what = _describe(direction, shapes, dtype, layout, geometry, settings)
    runtime.refuse_capture(what)
    lib = cudnn.binding()
    x_shape, w_shape, y_shape = shapes
    by_slot = {'x': descriptors.tensor_4d(x_shape, dtype, layout),
               'w': descriptors.filter_4d(w_shape, dtype, layout),
               'y': descriptors.tensor_4d(y_shape, dtype, layout)}
    descs = tuple(by_slot[s] for s in direction.operands)
    use_tc = tensor_ops(settings.tensor_core, dtype)
    conv_desc = descriptors.convolution(geometry.pad, geometry.stride, geometry.dilation,
                                        geometry.groups, dtype, use_tc)
    handle = runtime.handle(device_id)
    perfs = _query(direction, lib, handle, descs, conv_desc, operands, settings.auto_tune, limit,
                   what)
    if layout == 'NHWC' and perfs and not any(p.status == 0 for p in perfs):
        # cuDNN 9.19 has no NHWC float64 backward-data or backward-filter algorithm (each
        # result says NOT_SUPPORTED, seen on an H100): the problem in NCHW, transposed
        warnings.warn(
            '{}: cuDNN {} has no algorithm for this problem in NHWC (statuses {}), so it runs '
            'in NCHW with its operands transposed around the call (slower: three extra copies)'
            .format(what, cudnn.version_string(lib.version()),
                    sorted({p.status for p in perfs})),
            PerformanceWarning, stacklevel=4)
        return IN_NCHW
    sizes = {}

    def workspace(perf):        # what the call will need with this algorithm and math type
        descriptors.set_math_type(conv_desc, perf.mathType)
        _counters.add('workspace_queries')
        sizes[perf.algo] = lib.size(direction.size, handle, descs[0].value, descs[1].value,
                                    conv_desc.value, descs[2].value, perf.algo)
        return sizes[perf.algo]
    chosen, skipped = choose(perfs, limit, settings.deterministic, what, workspace)
    if skipped:
        warnings.warn(
            '{}: cuDNN prefers algorithm {} ({} bytes of workspace) but the workspace limit is {} '
            'bytes, so algorithm {} runs instead; raise the limit with '
            'chainer_tc.cuda.conv.set_workspace_limit()'.format(
                what, skipped[0].algo, skipped[0].memory, limit, chosen.algo),
            PerformanceWarning, stacklevel=4)
    if use_tc and chosen.mathType not in TENSOR_CORE_MATH:
        warnings.warn('{}: Tensor Cores were asked for but cuDNN chose algorithm {}, which does '
                      'not use them (math type {})'.format(what, chosen.algo, chosen.mathType),
                      PerformanceWarning, stacklevel=4)
    descriptors.set_math_type(conv_desc, chosen.mathType)
    size = sizes[chosen.algo]
    plan = Plan()
    plan.what = what
    plan.descs = tuple(d.value for d in descs)
    plan.conv_desc, plan.algo, plan.math_type = conv_desc.value, chosen.algo, chosen.mathType
    plan.workspace_size = size
    plan.one, plan.zero = cudnn.scaling_factors(dtype)
    plan._keep = descs + (conv_desc,)          # the descriptors live as long as the plan
    return plan


IN_NCHW = 'in NCHW'     # a plan that says: cuDNN has no NHWC algorithm, transpose to NCHW


def _nchw(a):
    """A C-contiguous NCHW copy of the NHWC array ``a`` (a filter (O, kh, kw, I) likewise)."""
    return runtime.contiguous(a.transpose(0, 3, 1, 2))


def _run_in_nchw(direction, operands, shapes, geometry, settings):
    """The call in NCHW: its two inputs transposed to NCHW, the output computed there and
    transposed back into ``out``."""
    a, b, out = operands
    nchw = tuple((s[0], s[3], s[1], s[2]) for s in shapes)
    result = runtime.empty((out.shape[0], out.shape[3], out.shape[1], out.shape[2]), out.dtype)
    _run(direction, (_nchw(a), _nchw(b), result), nchw, geometry, settings, 'NCHW')
    runtime.copy_into(out, result.transpose(0, 2, 3, 1))


def _query(direction, lib, handle, descs, conv_desc, operands, auto_tune, limit, what):
    """cuDNN's ranked algorithm results for this problem (``AlgoPerf`` structures)."""
    _counters.add('algorithm_queries')
    values = tuple(d.value for d in descs)
    if not auto_tune:
        return lib.algorithms(direction.get, handle, values, conv_desc.value, direction.count)
    # cudnnFind* runs every algorithm on the handle's stream, with up to `limit` bytes of scratch
    lib.set_stream(handle, runtime.stream_ptr(), setup=True)
    try:
        workspace = runtime.alloc(limit)
    except Exception as e:
        raise RuntimeError('{}: autotuning needs a workspace of the limit, {} bytes, and '
                           'allocating it failed ({}); lower it with chainer_tc.cuda.conv.'
                           'set_workspace_limit()'.format(what, limit, e)) from e
    return lib.find_algorithms(direction.find, handle, values, tuple(a.data.ptr for a in operands),
                               conv_desc.value, direction.count, runtime.address(workspace),
                               limit)


def choose(perfs, limit, deterministic, what='cuDNN convolution', workspace=None):
    """(the chosen result, the better-ranked results skipped only for their workspace).

    The first of cuDNN's ranked ``perfs`` whose status is CUDNN_STATUS_SUCCESS, that is
    deterministic if ``deterministic``, and whose workspace fits ``limit``: its ``memory`` and,
    given ``workspace(perf)``, the size that query returns (the one allocated at every call;
    the heuristics' ``memory`` is an estimate). A result skipped for the queried size is listed
    with that size as its ``memory``.
    """
    skipped = []
    for perf in perfs:
        if perf.status != 0 or (deterministic and not perf.determinism):
            continue
        if perf.memory > limit:
            skipped.append(perf)
            continue
        if workspace is not None:
            size = workspace(perf)
            if size > limit:
                perf = copy.copy(perf)
                perf.memory = size
                skipped.append(perf)
                continue
        return perf, skipped
    raise RuntimeError(
        '{}: no algorithm {}fits the workspace limit of {} bytes (cuDNN returned {}); raise '
        'it with chainer_tc.cuda.conv.set_workspace_limit()'.format(
            what, 'that is deterministic and ' if deterministic else '', limit,
            ', '.join('algo {} status {} memory {}'.format(p.algo, p.status, p.memory)
                      for p in perfs) or 'nothing'))
