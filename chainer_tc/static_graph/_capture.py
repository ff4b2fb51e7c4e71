"""The GPU replay: the whole step (forward, backward, the batched update and the loss-scale
bookkeeping) captured once into a ``cupy.cuda.Graph`` and replayed with one ``launch()``.

Capture records the kernels an eager step launches, on a stream of our own (capture is refused on
the legacy default stream), with every allocation made during capture served by a memory pool
that nothing else allocates from: the graph's addresses stay valid for as long as this object
lives, and no later allocation can reuse them. What the host must write between replays is
written outside the graph, on the same stream, before the launch: the batch (into the
signature's input buffers), and the optimizer's hyperparameter table when it changed (one tiny
kernel). The loss scale and the overflow decision never leave the device.

cuDNN runs under capture through chainer_tc.cuda (CuPy 13's own cuDNN calls refuse to): its
plans (descriptors, algorithms, workspace sizes) were made by the eager steps of the same
signature, so inside the capture it only sets the stream and calls cuDNN. That holds for
Chainer's own convolutions, batch normalization, pooling and softmax too: TrainStep routes the
CuPy cuDNN wrappers they call through chainer_tc.cuda in all its GPU steps
(chainer_tc.static_graph._chainer_cudnn). CuPy refuses cuBLAS
under capture too: Chainer's Linear, its im2col convolutions (no cuDNN) and F.matmul compute
their products through chainer_tc's own cuBLAS handle for the device, bound to the capture's
stream and a workspace of the capture's (chainer_tc.static_graph._products,
chainer_tc.cuda.cublas).

A step that cannot be captured (a host synchronisation inside it, such as ``float(loss)`` or an
optimizer hook that reads a norm; a cuDNN call that could not be routed, e.g. an N-d
convolution) raises
:class:`~chainer_tc.static_graph._program.NotReplayable` with CUDA's reason, and TrainStep runs
that signature eagerly.
"""
import contextlib

import chainer

from chainer_tc.cuda import cublas
from chainer_tc.static_graph import _gemm
from chainer_tc.static_graph import _products
from chainer_tc.static_graph import _program
from chainer_tc.static_graph import _trace


class CapturedStep:
    """One input signature's step as a CUDA graph, captured (not run) by the constructor;
    :meth:`first_launch` then performs the current step, and :meth:`validate` checks that the
    graph may be replayed."""

    def __init__(self, step, entry):
        try:
            self._make(step, entry)
        except _program.NotReplayable:
            raise
        except Exception as e:
            # what surrounds the capture (the capture's pool, the cuBLAS workspace from it,
            # the graph's upload) failing, e.g. out of memory: the step can still run eagerly
            raise _program.NotReplayable('preparing the capture of the step failed: {}: {}'
                                         .format(type(e).__name__, e)) from e

    def _make(self, step, entry):
        import cupy
        opt = step.optimizer
        flat = opt._flat
        self.cupy = cupy
        self.pool = cupy.cuda.MemoryPool()
        self.hooks = opt._has_hooks('pre') or opt._has_hooks('post')
        self.cublas_problem = None
        with flat.device_scope():
            # with a gradient reduction (e.g. NCCL's allreduce, which captures), the gradients
            # are copied into flat buffers made before the capture, reduced, and updated from
            reduce = step.reduce_gradients
            buffers, views = flat.grad_buffers() if reduce is not None else (None, None)
            # non-blocking: while a blocking stream captures, any use of the legacy default
            # stream (by any thread: a data loader's copy) would synchronise with it and
            # invalidate the capture; every order this step needs is an explicit event wait
            self.stream = cupy.cuda.Stream(non_blocking=True)
            opt._table.refresh(opt.hyperparam, opt._versions, opt._set_globals)
            caller = cupy.cuda.get_current_stream()
            with self.stream, cupy.cuda.using_allocator(self.pool.malloc):
                self.stream.wait_event(caller.record())     # the batch was loaded there
                handle = self._cublas_handle(cupy)
                with handle.lock if handle is not None else contextlib.nullcontext():
                    products = None
                    if handle is not None:
                        try:
                            handle.bind(self.stream.ptr, self.cublas_workspace.data.ptr,
                                        self.cublas_workspace.nbytes)
                            products = _gemm.Products(handle, cupy)
                        except cublas.CuBLASError as e:     # said if a product needs it
                            self.cublas_problem = '{}: {}'.format(type(e).__name__, e)
                    self.stream.synchronize()
                    graph, rec, loss, recorded_grads, grads = self._record(
                        step, entry, products, reduce, buffers, views)
        trace = rec.trace
        trace.grads, trace.loss, trace.inputs = recorded_grads, loss.array, entry.buffers
        self.buffers = buffers           # referenced by the graph
        self.graph = graph
        self.trace = trace               # keeps every array the graph touches referenced
        self.loss = loss.array
        # each parameter holds its gradient as computed (a strided one gets its quotient
        # copied back in the graph), or with a reduction its flat view, a view two parameters
        # share once (the first sharer's): as after an eager step
        self.grads = list(zip((e.param for e in flat.entries), recorded_grads if reduce is None
                              else _program.shared_once(views, recorded_grads)))
        self.refill = _program.leaves_none(flat, recorded_grads)
        self.marks = [(e.param, e.param._loss_scale) for e in flat.entries]
        self.flat = flat
        self.program = None
        self.graph.upload(self.stream)
        self._rec = rec

    def first_launch(self, step):
        """The captured step's loss, run by the graph's first launch. The reports made while
        capturing hold the graph's arrays, valid once it ran and overwritten by every later
        launch: they are given copies after this one."""
        loss = self._launch(step, report=False)
        with self.flat.device_scope(), self.stream:
            _trace.detach_reports(self._rec.trace.reports, self._rec.outer)
        self._rec = None
        return loss

    def _record(self, step, entry, products, reduce, buffers, views):
        """Capture forward, backward and (without hooks) the update on self.stream: (graph,
        recorder, loss, the gradients as computed, the gradients the update reads)."""
        opt = step.optimizer
        flat = opt._flat
        self.stream.begin_capture()
        try:
            with _trace.Recorder() as rec, _products.products_through(products):
                loss = step._call_lossfun(entry.buffers)
                opt.target.cleargrads()
                rec.trace.leftover_grads = _trace.leftover_grads(loss)
                opt.scaled_backward(loss)
            rec.trace.untrained_grads = untrained = flat.untrained_grads()
            recorded_grads = flat.grads(contiguous=False)      # checked as the CPU replay's
            copied = []
            # a strided one copied, in the graph, for the kernel (its quotient copied back)
            grads = flat.grads(copied=copied)
            if reduce is not None:
                for view, g in zip(views, grads):
                    if g is None:
                        view.fill(0)
                    else:
                        view[...] = g
                reduce(buffers)
                grads, copied = views, []
                # reduced in the graph too: the parameters hold these after a launch, the
                # overflow check of dynamic loss scaling (in the graph) and hooks read them
                untrained = _program.reduce_untrained(step, untrained)
            self.untrained = list(untrained)
            # kept as long as the graph: copies it makes (of gradients that share memory) come
            # from the capture's pool, and the graph reads them
            self.plan = plan = opt._plan(flat, grads, copied=copied,
                                         untrained=opt._untrained_grads(flat, None, untrained))
            if not self.hooks:
                plan()
        except Exception as e:
            _abandon(self.stream)
            raise _program.NotReplayable(
                'capturing the step into a CUDA graph failed: {}: {}{}{}'.format(
                    type(e).__name__, e, '' if self.cublas_problem is None else
                    " (no cuBLAS handle for the capture's matrix products: {})"
                    .format(self.cublas_problem), _cudnn_note(e))) from e
        return _end_capture(self.stream), rec, loss, recorded_grads, grads

    def _cublas_handle(self, cupy):
        """The device's capture cuBLAS handle, and this capture's workspace for it from the
        capture's pool (kept as long as the graph); None (and the reason kept) where it cannot
        be had: a step without matrix products still captures, one with them fails in CuPy,
        said then."""
        device = cupy.cuda.Device()
        try:
            handle = cublas.capture_handle(device)
        except (cublas.CuBLASUnavailable, cublas.CuBLASError, ImportError) as e:
            self.cublas_problem = '{}: {}'.format(type(e).__name__, e)
            return None
        self.cublas_workspace = cupy.empty(cublas.workspace_bytes(handle.compute_capability),
                                           cupy.uint8)
        return handle

    def validate(self, first, externals_first, externals):
        """The same checks as the CPU replay, on the values this step computed (so after its
        launch): a value frozen into the graph must be a constant. Raises NotReplayable.
        ``externals_first``, ``externals``: the step's inputs, parameters and state arrays, as
        the first recorded step and the captured one saw them."""
        self.stream.synchronize()
        self.program = _program.Program(first, self.trace, externals_first, externals)

    def _launch(self, step, report=True):
        """Replay: host-side writes, then the graph; with optimizer hooks, the graph holds
        forward and backward, and the update runs eagerly after it (hooks may synchronise).
        The caller's stream (where the batch was loaded) and the graph's stream wait for each
        other, whatever stream the caller uses."""
        with self.flat.device_scope():
            caller = self.cupy.cuda.get_current_stream()
            result = self._launch_on_stream(step, report, caller)
            caller.wait_event(self.stream.record())         # what follows sees this step
            return result

    def _launch_on_stream(self, step, report, caller):
        opt = step.optimizer
        with self.stream:
            self.stream.wait_event(caller.record())         # the batch was loaded there
            opt._table.refresh(opt.hyperparam, opt._versions, opt._set_globals)
            self.graph.launch(self.stream)
            _program.give_grads(self.grads + self.untrained)
            if self.hooks:
                _program.give_marks(self.marks)
                opt.update()
            else:
                opt._clock.step()           # t += 1, and the rules' own count
                # skipped steps are said as after an eager update (an asynchronous copy of the
                # scaler's state every few hundred steps: no synchronisation here)
                opt._skip_watch.after_step(opt._scaler, opt.t, stacklevel=4)
                if self.refill:             # as update(): zeros where there was no gradient
                    opt.reallocate_cleared_grads()
            if report:
                self.program.report()
            return chainer.Variable(self.loss.copy(), requires_grad=False)

    def run(self, step):
        return self._launch(step)


def _cudnn_note(error):
    """Why Chainer's cuDNN calls were not routed through chainer_tc's binding, where a cuDNN
    call is what failed and they were not ('' otherwise)."""
    if 'cuDNN' not in str(error):
        return ''
    from chainer_tc.static_graph import _chainer_cudnn
    why = _chainer_cudnn.problem()
    return '' if why is None else (" (Chainer's cuDNN calls could not go through chainer_tc's "
                                   'binding: {})'.format(why))


def _end_capture(stream):
    """The captured graph, instantiated. Some failures show only here (a capture invalidated
    by an unjoined side stream or a legacy-stream call, an instantiation the driver refuses):
    they are NotReplayable too, so the step runs eagerly with one warning instead of stopping."""
    try:
        return stream.end_capture()
    except Exception as e:
        _abandon(stream)
        raise _program.NotReplayable(
            'ending the capture of the step (instantiating its CUDA graph) failed: {}: {}'
            .format(type(e).__name__, e)) from e


def _abandon(stream):
    """End a failed capture so that the stream is usable again."""
    try:
        stream.end_capture()
    except Exception:
        pass
