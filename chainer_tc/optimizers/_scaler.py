"""Loss-scale state, kept on the parameters' device so that no update needs the host.

The state is a uint32[8] array (layout shared with kernels/optimizer.cu, SCALER_*):
  [0] the scale (float32 bits)   [1] clean steps since it last changed   [2] overflow flag
  [3] steps skipped so far       [4] update blocks finished this step     [5] the scale as float16
Between steps [2] and [4] are always 0. Reading ``scale`` or ``skipped`` synchronises with the GPU.

Dynamic scaling (``loss_scaling()`` with ``scale=None``): a step whose unscaled gradients hold an
inf or nan is skipped entirely and the scale halves (not below ``min_scale``); after ``interval``
clean steps in a row it doubles (not above ``max_scale``). This is the policy of NVIDIA apex and
PyTorch's GradScaler; Chainer's own grows by 2^(1/interval) every clean step instead.
"""
import warnings

import numpy

import chainer.functions

NONE, STATIC, DYNAMIC = 0, 1, 2
SCALE, CLEAN, FOUND_INF, SKIPPED, DONE, SCALE_F16 = range(6)


class _ScaledOnDevice:
    """The type of :data:`SCALED_ON_DEVICE`."""

    __slots__ = ()

    def __repr__(self):
        return 'chainer_tc.optimizers._scaler.SCALED_ON_DEVICE'

    def __reduce__(self):              # pickles and deep-copies as the one instance
        return 'SCALED_ON_DEVICE'

    def __float__(self):
        raise TypeError('this gradient was scaled by chainer_tc\'s MomentumSGD loss scale, which '
                        'lives on the device: only that optimizer can unscale it (read '
                        'optimizer.loss_scale for its value)')


#: ``param._loss_scale`` (Chainer's record of the loss scale a backward pass used for a
#: parameter's gradient) of a gradient scaled by the optimizer's own loss scale, whose value is on
#: the device: set by ``scaled_backward()`` (so by ``update(lossfun)``) and, at ``setup()``, on
#: parameters no backward pass has marked yet (gradients set by hand). See docs/optimizer.md.
SCALED_ON_DEVICE = _ScaledOnDevice()


class LossScaler:
    """Configuration (host) and state (device array) of loss scaling."""

    def __init__(self):
        self.mode = NONE
        self.interval = 1000
        self.min_scale = 1.0
        self.max_scale = 2.0 ** 24
        self.state = _initial_state(1.0)

    def configure(self, interval, scale, initial_scale, min_scale, max_scale):
        if scale is None:
            n = number('interval', interval)
            if not n.is_integer():
                raise ValueError('interval must be a whole number of steps >= 1; got {!r}'
                                 .format(interval))
            if n < 1:
                raise ValueError('interval must be >= 1; got {}'.format(interval))
            initial_scale = number('initial_scale', initial_scale)
            min_scale = number('min_scale', min_scale)
            max_scale = number('max_scale', max_scale)
            if not 0 < min_scale <= initial_scale <= max_scale < numpy.inf:
                raise ValueError('need 0 < min_scale <= initial_scale <= max_scale < inf; got '
                                 'min_scale={}, initial_scale={}, max_scale={}'
                                 .format(min_scale, initial_scale, max_scale))
            self.mode, self.interval = DYNAMIC, int(interval)
            self.min_scale, self.max_scale = float(min_scale), float(max_scale)
            value = initial_scale
        else:
            scale = number('scale', scale)
            if not 0 < scale < numpy.inf:
                raise ValueError('scale (the loss scale) must be a positive finite number; got {}'
                                 .format(scale))
            self.mode, value = STATIC, scale
        host = _initial_state(value)
        if isinstance(self.state, numpy.ndarray):
            self.state[...] = host
        else:
            self.state.set(host)

    def validate(self):
        """Raise ValueError, naming the snapshot key and its value, for a configuration or state
        the update cannot work with (e.g. from a tampered or corrupted snapshot)."""
        if self.mode not in (NONE, STATIC, DYNAMIC):
            raise ValueError('loss_scaling_mode must be 0 (none), 1 (static) or 2 (dynamic); '
                             'got {}'.format(self.mode))
        if self.mode == NONE:
            return
        if self.mode == DYNAMIC:
            if self.interval < 1:
                raise ValueError('loss_scaling_interval must be >= 1; got {}'
                                 .format(self.interval))
            if not 0 < self.min_scale <= self.max_scale < numpy.inf:
                raise ValueError('need 0 < loss_scaling_min <= loss_scaling_max < inf; got {} '
                                 'and {}'.format(self.min_scale, self.max_scale))
        host = _host(self.state)
        scale = float(host[SCALE:SCALE + 1].view(numpy.float32)[0])
        if not 0 < scale < numpy.inf:
            raise ValueError('loss_scaler holds the loss scale {}: it must be a positive finite '
                             'number'.format(scale))
        if self.mode == DYNAMIC and not self.min_scale <= scale <= self.max_scale:
            raise ValueError('loss_scaler holds the loss scale {}, outside [loss_scaling_min, '
                             'loss_scaling_max] = [{}, {}]'.format(scale, self.min_scale,
                                                                   self.max_scale))
        if host[FOUND_INF] or host[DONE]:
            raise ValueError('loss_scaler holds a step in progress (overflow flag {}, block '
                             'counter {}); a saved state has both 0'.format(host[FOUND_INF],
                                                                        host[DONE]))

    def why_not_resumed(self, saved):
        """None where the state of ``saved`` (a file's LossScaler, validated) can go on under
        this configuration, else why not: another mode, another static scale, or a dynamic
        scale outside [min_scale, max_scale] (reading the scale synchronises)."""
        there, here = _describe(saved), _describe(self)
        if saved.mode != self.mode:
            return 'it is {}, this optimizer\'s (set in code) {}'.format(there, here)
        if self.mode == STATIC and saved.scale != self.scale:
            return 'it is {}, this optimizer\'s (set in code) {}'.format(there, here)
        if self.mode == DYNAMIC and not self.min_scale <= saved.scale <= self.max_scale:
            return ('its scale {} lies outside this optimizer\'s [min_scale, max_scale] = '
                    '[{}, {}] (set in code)'.format(saved.scale, self.min_scale, self.max_scale))
        return None

    def resume(self, host):
        """Take the state ``host`` (uint32[8], a file's) as this scaler's."""
        host = numpy.array(host, numpy.uint32)
        with numpy.errstate(over='ignore'):      # (the float16 copy, from the float32 scale)
            host[SCALE_F16] = numpy.float16(host[SCALE:SCALE + 1].view(numpy.float32)[0]) \
                .view(numpy.uint16)
        if isinstance(self.state, numpy.ndarray):
            self.state[...] = host
        else:
            with self.state.device:
                self.state.set(host)

    def to_device(self, xp):
        """Move the state next to the parameters (numpy, or cupy on the current device: the
        caller makes the parameters' device current), also from one GPU to another."""
        if isinstance(self.state, xp.ndarray) and (
                xp is numpy or self.state.device.id == xp.cuda.Device().id):
            return
        self.state = xp.asarray(_host(self.state))

    @property
    def scale(self):
        return float(_host(self.state)[SCALE:SCALE + 1].view(numpy.float32)[0])

    @property
    def skipped(self):
        return int(_host(self.state)[SKIPPED])

    def seed(self, loss):
        """The initial gradient for ``loss.backward()``: the scale, on the device, no host trip.

        A new array each step, made by a Chainer function: a backward may write into its
        gradient (``F.hinge`` divides it in place), which must not reach the state, and a
        recorded step (chainer_tc.static_graph) recomputes it from the scale at each replay."""
        dtype = loss.dtype
        if dtype == numpy.float16:
            s = self.state.view(numpy.float16)[2 * SCALE_F16:2 * SCALE_F16 + 1]
        else:
            s = self.state[SCALE:SCALE + 1].view(numpy.float32)
        s = chainer.Variable(s, requires_grad=False)
        s = s * 1 if s.dtype == dtype else chainer.functions.cast(s, dtype)
        return s.array.reshape(loss.shape)

    def clear_flag(self):
        """Clear the overflow flag (a check ran and the step it was for did not): a write on
        the state's device, no synchronisation."""
        self.state[FOUND_INF] = 0

    def finish_step_host(self, found_inf):
        """The bookkeeping of the kernel's last block, on a NumPy state (the CPU path)."""
        st = self.state
        scale = st[SCALE:SCALE + 1].view(numpy.float32)[0]
        if found_inf:
            scale = max(scale * numpy.float32(0.5), numpy.float32(self.min_scale))
            st[CLEAN] = 0
            st[SKIPPED] += 1
        else:
            st[CLEAN] += 1
            if st[CLEAN] >= self.interval:
                scale = min(scale * numpy.float32(2), numpy.float32(self.max_scale))
                st[CLEAN] = 0
        st[SCALE] = numpy.float32(scale).view(numpy.uint32)
        with numpy.errstate(over='ignore'):      # above 65504 the float16 seed is inf, on purpose
            st[SCALE_F16] = numpy.float16(scale).view(numpy.uint16)
        st[FOUND_INF] = 0
        st[DONE] = 0


#: updates between two looks at a device state's skipped count (:class:`SkipWatch`)
WATCH_EVERY = 200


class SkipWatch:
    """Says when dynamic loss scaling skipped steps (Chainer warns at each one), without a
    per-step synchronisation: a NumPy state (the CPU and emulated paths) is read after every
    step; a GPU state is copied to the host asynchronously every ``WATCH_EVERY`` updates and
    read once that copy is done, and synchronously where the caller synchronises anyway
    (``new_epoch()``, saving a snapshot). One warning per burst of skipped steps, and another
    when the scale reaches ``min_scale`` while steps are still skipped."""

    def __init__(self):
        self.seen = 0            # the skipped count at the last look
        self.burst = False       # the last look found new skipped steps
        self.at_min = False      # ... with the scale at min_scale
        self._probe = None       # (pinned host copy, event) of a copy under way

    def __getstate__(self):
        state = self.__dict__.copy()
        state['_probe'] = None
        return state

    def rebase(self, skipped):
        """The count starts again from ``skipped`` (a new configuration, a loaded snapshot)."""
        self.seen, self.burst, self.at_min, self._probe = int(skipped), False, False, None

    def after_step(self, scaler, t, stacklevel):
        if scaler.mode != DYNAMIC:
            return
        state = scaler.state
        if self._on_host(state):
            self._look(scaler, state, t, stacklevel + 1)
            return
        probe = self._probe
        if probe is not None:
            if probe[1].done:
                self._probe = None
                self._look(scaler, probe[0], t, stacklevel + 1)
        elif t % WATCH_EVERY == 0:
            self._start(state)

    def now(self, scaler, t, stacklevel):
        """Look now (synchronises with a GPU state)."""
        if scaler.mode == DYNAMIC:
            self._probe = None
            self._look(scaler, _host(scaler.state), t, stacklevel + 1)

    @staticmethod
    def _on_host(state):
        return isinstance(state, numpy.ndarray)

    def _start(self, state):
        import cupy
        import cupyx
        with cupy.cuda.Device(state.device.id):
            if cupy.cuda.get_current_stream().is_capturing():
                return                              # (never inside a captured graph)
            host = cupyx.empty_pinned(state.shape, state.dtype)
            state.get(out=host, blocking=False)
            event = cupy.cuda.Event(disable_timing=True)
            event.record()
        self._probe = (host, event)

    def _look(self, scaler, host, t, stacklevel):
        skipped = int(host[SKIPPED])
        new = skipped - self.seen
        self.seen = skipped
        if new <= 0:
            self.burst = self.at_min = False
            return
        scale = float(host[SCALE:SCALE + 1].view(numpy.float32)[0])
        at_min = scale <= scaler.min_scale
        if self.burst and (self.at_min or not at_min):
            return
        self.burst, self.at_min = True, at_min
        message = ('dynamic loss scaling skipped {} update step(s) for an inf or nan gradient '
                   '(iteration {}, {} skipped so far; loss scale now {})'
                   .format(new, t, skipped, scale))
        if at_min:
            message += ('; the scale is at min_scale={}: the gradients are not finite even '
                        'unscaled that far, which usually means that the model diverged (a '
                        'nan or inf loss); parameters are not updated while this '
                        'lasts'.format(scaler.min_scale))
        warnings.warn(message, UserWarning, stacklevel=stacklevel + 1)


def _describe(scaler):
    if scaler.mode == NONE:
        return 'no loss scaling'
    if scaler.mode == STATIC:
        return 'static loss scaling, scale {}'.format(scaler.scale)
    return 'dynamic loss scaling, scale {}'.format(scaler.scale)


def number(name, value):
    """``value`` as a float, or a TypeError naming ``name`` (None, a string, an array of several
    elements are not numbers)."""
    if value is None or isinstance(value, (str, bytes)):
        raise TypeError('{} must be a number; got {!r}'.format(name, value))
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError('{} must be a number; got {!r}'.format(name, value)) from None


def _initial_state(scale):
    host = numpy.zeros(8, numpy.uint32)
    host[SCALE] = numpy.float32(scale).view(numpy.uint32)
    with numpy.errstate(over='ignore'):
        host[SCALE_F16] = numpy.float16(scale).view(numpy.uint16)
    return host


def _host(a):
    return a if isinstance(a, numpy.ndarray) else a.get()
