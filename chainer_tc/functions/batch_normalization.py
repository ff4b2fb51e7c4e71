"""BatchNormalization, and the fused relu(BN(x) + z), over channels-last (NHWC) arrays.

    from chainer_tc import functions as TF
    y = TF.batch_normalization(x, gamma, beta, running_mean=rm, running_var=rv)    # x: (N,H,W,C)
    y = TF.batch_normalization_add_relu(x, z, gamma, beta, running_mean=rm, running_var=rv)
    y = TF.fixed_batch_normalization(x, gamma, beta, mean, var)                    # inference

Same arguments and semantics as ``chainer.functions.batch_normalization`` with ``axis=(0, 1, 2)``
(statistics over every axis but the last), except that float16 data is normalised in float32
(Chainer computes in the promoted dtype of x and gamma, i.e. float16). One FunctionNode each way:
NumPy arrays take a NumPy path. CuPy float16 NHWC data with float32 gamma/beta and C divisible by
4 (training) takes cuDNN's fused ``BatchNormalizationForwardTrainingEx``/``BackwardEx``
(``_bn_cudnn.py``); other CuPy arrays (and NumPy arrays under ``CHAINER_TC_EMULATE=1``) take
kernels/batchnorm.cu (3 launches forward in training, 3 backward). After ``apply``, the node's
``cudnn_reason`` says why cuDNN was not used (None when it was). Double backpropagation is not
supported. See docs/functions.md.
"""
import math
import warnings

import numpy

import chainer
from chainer import function_node
from chainer.utils import type_check

from chainer_tc import kernels
from chainer_tc.functions import _bn_cudnn
from chainer_tc.functions import _bn_kernels
from chainer_tc.functions import _bn_numpy

_PAIRS = {(numpy.dtype(t), numpy.dtype(p)) for t, p in _bn_kernels.PAIRS}


def _rows(a):
    return a.reshape(-1, a.shape[-1])


_WARNED_SINGLE_SAMPLE = set()


def _xp(x):
    return numpy if type(x) is numpy.ndarray else chainer.backend.get_array_module(x)


def _backend(x):
    return kernels.backend(_xp(x))


def check_eps(eps):
    """``eps`` as a float if it is a positive, finite number; else a ValueError (NaN compares
    False with everything, so ``eps <= 0`` alone lets it through and every output is NaN)."""
    try:
        value = float(eps)
    except (TypeError, ValueError):
        raise TypeError('eps must be a number; got {!r}'.format(eps)) from None
    if isinstance(eps, bool) or not (math.isfinite(value) and value > 0):
        raise ValueError('eps must be positive and finite; got {!r}'.format(eps))
    return value


def _check_decay(decay):
    try:
        value = float(decay)
    except (TypeError, ValueError):
        raise TypeError('decay must be a number; got {!r}'.format(decay)) from None
    if isinstance(decay, bool) or not 0 <= value <= 1:       # NaN fails too
        raise ValueError('decay must be a number in [0, 1] (the weight of the old running '
                         'statistics); got {!r}'.format(decay))
    return value


def _check_running(mean, var, channels):
    """The running statistics are updated in place: floating arrays of shape (C,), one dtype."""
    try:        # the common case in one expression (this runs at every eager training call)
        if mean.dtype.kind == 'f' and mean.dtype == var.dtype and \
                mean.shape == var.shape == (channels,):
            return
    except AttributeError:
        pass
    for name, a in (('running_mean', mean), ('running_var', var)):
        dtype = getattr(a, 'dtype', None)
        if dtype is None or numpy.dtype(dtype).kind != 'f':
            raise TypeError('{} must be a floating-point array (it is updated in place: integers '
                            'would truncate the statistics); got {}'.format(
                                name, 'dtype {}'.format(dtype) if dtype is not None
                                else type(a).__name__))
        if tuple(a.shape) != (channels,):
            raise ValueError('{} must have shape ({},), one value per channel of x; got {}'
                             .format(name, channels, tuple(a.shape)))
    if mean.dtype != var.dtype:
        raise TypeError('running_mean is {} and running_var {}: they must have one dtype'
                        .format(mean.dtype, var.dtype))


def check_inputs(x, gamma, running_mean, running_var):
    """The dtypes of ``x`` and ``gamma`` (a supported pair), and the running statistics (both
    or neither; floating arrays of shape (C,) in x's accumulation dtype, updated in place)."""
    if (x.dtype, gamma.dtype) not in _PAIRS:
        raise TypeError('x is {} and gamma {}; supported (x, gamma) dtypes: {}'.format(
            x.dtype, gamma.dtype, ', '.join(sorted('({}, {})'.format(t, p) for t, p in
                                                   _PAIRS))))
    if (running_mean is None) != (running_var is None):
        raise ValueError('running_mean and running_var go together; got {} without {}'
                         .format(*(('running_mean', 'running_var') if running_var is None
                                   else ('running_var', 'running_mean'))))
    if running_mean is None:
        return
    _check_running(running_mean, running_var, x.shape[-1])
    if _bn_numpy.acc_dtype(running_mean.dtype) != _bn_numpy.acc_dtype(x.dtype):
        raise TypeError('running_mean is {} but x is {}: statistics of {} data accumulate in '
                        '{}, so the running statistics must be float16/float32 for float16/'
                        'float32 data and float64 for float64 data'.format(
                            running_mean.dtype, x.dtype, x.dtype,
                            numpy.dtype(_bn_numpy.acc_dtype(x.dtype)).name))


def _check_statistics(mean, var, x):
    """fixed_batch_normalization's ``mean`` and ``var``: floating arrays of shape (C,), in x's
    dtype or its accumulation dtype (float32 statistics for float16 data), as Chainer's type
    check asks (it refuses a (1,) or scalar mean that NumPy would broadcast, and integers)."""
    channels = x.shape[-1]
    for name, a in (('mean', mean), ('var', var)):
        if a.dtype.kind != 'f':
            raise TypeError('{} must be a floating-point array of shape ({},); got dtype {}'
                            .format(name, channels, a.dtype))
        if tuple(a.shape) != (channels,):
            raise ValueError('{} must have shape ({},), one value per channel of x; got {}'
                             .format(name, channels, tuple(a.shape)))
        if a.dtype not in (x.dtype, numpy.dtype(_bn_numpy.acc_dtype(x.dtype))):
            raise TypeError('{} is {} but x is {}: the statistics must be {}'.format(
                name, a.dtype, x.dtype, ' or '.join(sorted({x.dtype.name, numpy.dtype(
                    _bn_numpy.acc_dtype(x.dtype)).name}))))


def _check_rows(shape):
    """Batch statistics need a row; one row per channel is legal but almost always a mistake.
    Checked before any path is chosen, so cuDNN, the kernels and NumPy refuse and warn alike."""
    rows = 1
    for n in shape[:-1]:
        rows *= n
    if rows < 1:
        raise ValueError('batch statistics need at least one row; got x of shape {}'
                         .format(shape))
    if rows == 1 and shape not in _WARNED_SINGLE_SAMPLE:
        _WARNED_SINGLE_SAMPLE.add(shape)        # once per shape: it would come every step
        warnings.warn('batch normalization of a single sample per channel (x of shape {}) '
                      'outputs beta: is chainer.config.train meant to be True here?'
                      .format(shape), UserWarning, stacklevel=5)


def check_types(in_types, has_z):
    """Chainer's type check of the NHWC BatchNorm functions' inputs (x, gamma, beta[, z]):
    gamma and beta of shape (C,) with C the last axis of x, z shaped as x."""
    type_check._argname(in_types, ('x', 'gamma', 'beta') + (('z',) if has_z else ()))
    x_type, gamma_type, beta_type = in_types[:3]
    type_check.expect(
        x_type.dtype.kind == 'f',
        x_type.ndim >= 2,
        gamma_type.ndim == 1,
        gamma_type.shape[0] == x_type.shape[x_type.ndim - 1],
        beta_type.shape == gamma_type.shape,
        beta_type.dtype == gamma_type.dtype,
    )
    if has_z:
        type_check.expect(in_types[3].shape == x_type.shape,
                          in_types[3].dtype == x_type.dtype)


class BatchNormAddAct(function_node.FunctionNode):
    """y = act(gamma * (x - mean) * invstd + beta [+ z]) over the last axis of x.

    ``mean``/``var`` given: inference with those statistics; else batch statistics, and the
    running statistics (if given) are updated in place.
    """

    def __init__(self, eps, relu, has_z, decay=0.9, running_mean=None, running_var=None,
                 mean=None, var=None, fixed=False):
        eps = check_eps(eps)
        if running_mean is not None:        # decay weighs the running statistics
            decay = _check_decay(decay)
        self.eps, self.relu, self.has_z, self.decay = eps, bool(relu), bool(has_z), decay
        self.running_mean, self.running_var = running_mean, running_var
        self.fixed = bool(fixed)
        if self.fixed:
            for name, v in (('mean', mean), ('var', var)):
                if isinstance(v, chainer.Variable):
                    raise TypeError('{} is a Variable: the NHWC fixed_batch_normalization takes '
                                    'the statistics as arrays and gives them no gradient; pass '
                                    '{}.array'.format(name, name))
                if getattr(v, 'dtype', None) is None or getattr(v, 'ndim', None) is None:
                    raise TypeError('{} must be an array of shape (C,) (the statistics to '
                                    'normalise with); got {}'.format(name, type(v).__name__))
        elif mean is not None or var is not None:
            raise ValueError('mean and var are the statistics of fixed batch normalization: '
                             'use fixed_batch_normalization')
        self.fixed_mean, self.fixed_var = mean, var

    def check_type_forward(self, in_types):
        check_types(in_types, self.has_z)

    def forward(self, inputs):
        x, gamma, beta = inputs[:3]
        z = inputs[3] if self.has_z else None
        check_inputs(x, gamma, self.running_mean, self.running_var)
        if self.fixed:
            _check_statistics(self.fixed_mean, self.fixed_var, x)
        else:
            _check_rows(x.shape)
        xp = _xp(x)
        running_dtype = None if self.running_mean is None else self.running_mean.dtype
        use_cudnn, self.cudnn_reason = _bn_cudnn.eligibility(
            xp.__name__ == 'cupy', x.dtype, x.shape, gamma.dtype, running_dtype, self.relu,
            self.eps, self.fixed)
        rm, rv = self.running_mean, self.running_var
        path = 'cudnn' if use_cudnn else _backend(x)
        if path != 'numpy':                          # raw pointers: contiguous (C,) vectors
            gamma, beta = xp.ascontiguousarray(gamma), xp.ascontiguousarray(beta)
            if rm is not None and not (rm.flags.c_contiguous and rv.flags.c_contiguous):
                rm, rv = xp.ascontiguousarray(rm), xp.ascontiguousarray(rv)   # written back below
        if use_cudnn:
            self._path = 'cudnn'
            self.retain_inputs((0, 1, 2))
            x = xp.ascontiguousarray(x)
            self._fused = _bn_cudnn.FusedBatchNorm(x, self.has_z, self.relu)
            y = self._fused.forward(x, None if z is None else xp.ascontiguousarray(z), gamma, beta,
                                    self.eps, self.decay, rm, rv)
            self._write_back(rm, rv)
            self.retain_outputs((0,))
            return y,
        self._path = path
        # the NumPy path keeps xhat for backward (below), so x itself need not be kept
        self.retain_inputs((1, 2) if self._path == 'numpy' else (0, 1, 2))
        if self._path != 'numpy':          # the kernels index (row, channel) of contiguous data
            x = xp.ascontiguousarray(x)
            z = None if z is None else xp.ascontiguousarray(z)
        x2, z2 = _rows(x), None if z is None else _rows(z)
        a = _bn_numpy.acc_dtype(x.dtype)
        centered = None
        if self.fixed:
            self.mean = xp.ascontiguousarray(self.fixed_mean, a)
            self.invstd = xp.reciprocal(xp.sqrt(xp.asarray(self.fixed_var, a) + a(self.eps)))
        elif self._path == 'numpy':
            self.mean, self.invstd, var, centered = _bn_numpy.statistics(x2, self.eps, True)
            if self.running_mean is not None:
                _bn_numpy.update_running(self.running_mean, self.running_var, self.mean, var,
                                         x2.shape[0], self.decay)
        else:
            self.mean, self.invstd = _bn_kernels.statistics(x2, self.eps, self.decay, rm, rv, xp)
            self._write_back(rm, rv)
        if self._path == 'numpy':
            # xhat kept for backward (not recomputed from x there; x is not retained: in float32
            # and float64 xhat takes x's place, for float16 data it is float32, twice x's size);
            # without backprop nothing is kept and y is computed in xhat's memory
            y, self.xhat = _bn_numpy.forward(x2, z2, gamma, beta, self.mean, self.invstd,
                                             self.relu, centered,
                                             keep_xhat=chainer.config.enable_backprop)
        else:
            y = _bn_kernels.forward(x2, z2, gamma, beta, self.mean, self.invstd, self.relu, xp)
        self.retain_outputs((0,))
        return y.reshape(x.shape),

    def _write_back(self, rm, rv):
        """Strided running statistics (views into a bigger buffer) were updated in contiguous
        copies: the results go back into the caller's arrays."""
        if rm is not self.running_mean:
            self.running_mean[...] = rm
            self.running_var[...] = rv

    def backward(self, indexes, grad_outputs):
        y, = self.get_retained_outputs()
        retained = self.get_retained_inputs()
        if len(retained) == 2:      # the NumPy path kept xhat, not x: y (same shape and dtype)
            (gamma, beta), x = retained, y      # stands in for it, only its shape is read
        else:
            x, gamma, beta = retained
        gy, = grad_outputs
        grads = BatchNormAddActGrad(self).apply((x, gamma, beta, y, gy))
        return tuple(grads[i] for i in indexes)


class BatchNormAddActGrad(function_node.FunctionNode):
    """Gradients of BatchNormAddAct: (gx, ggamma, gbeta[, gz]). Not differentiable again."""

    def __init__(self, f):
        self.f = f

    def forward(self, inputs):
        x, gamma, beta, y, gy = inputs
        f = self.f
        x2, y2, gy2 = _rows(x), _rows(y), _rows(gy)
        if f._path != 'numpy':                  # raw pointers, as in forward
            xp = chainer.backend.get_array_module(x)
            gamma, beta = xp.ascontiguousarray(gamma), xp.ascontiguousarray(beta)
        if f._path == 'cudnn':
            gx, ggamma, gbeta, g = f._fused.backward(
                xp.ascontiguousarray(x), y, xp.ascontiguousarray(gy), gamma, beta, f.eps)
            out = (gx, ggamma, gbeta)
            return out + ((g,) if f.has_z else ())
        if f._path == 'numpy':
            gx, ggamma, gbeta, g = _bn_numpy.backward(gy2, y2, f.xhat, gamma, f.invstd,
                                                      f.relu, f.fixed, f.has_z)
        else:
            gx, ggamma, gbeta, g = _bn_kernels.backward(
                xp.ascontiguousarray(gy2), y2, xp.ascontiguousarray(x2), gamma, f.mean, f.invstd,
                f.relu, f.fixed, f.has_z, xp)
        out = (gx.reshape(x.shape), ggamma, gbeta)
        if f.has_z:
            out += (g.reshape(x.shape),)
        return out

    def backward(self, indexes, grad_outputs):
        raise NotImplementedError('chainer_tc: double backpropagation through BatchNormalization '
                                  'is not supported')


def batch_normalization(x, gamma, beta, eps=2e-5, running_mean=None, running_var=None,
                        decay=0.9):
    """BatchNormalization of NHWC ``x`` over all axes but the last (training statistics)."""
    return BatchNormAddAct(eps, False, False, decay, running_mean, running_var).apply(
        (x, gamma, beta))[0]


def batch_normalization_add_relu(x, z, gamma, beta, eps=2e-5, running_mean=None,
                                 running_var=None, decay=0.9):
    """relu(BN(x) + z) in one pass (``z=None``: relu(BN(x)))."""
    inputs = (x, gamma, beta) if z is None else (x, gamma, beta, z)
    return BatchNormAddAct(eps, True, z is not None, decay, running_mean,
                           running_var).apply(inputs)[0]


def fixed_batch_normalization(x, gamma, beta, mean, var, eps=2e-5):
    """BatchNormalization with given statistics (inference); no gradient for mean and var."""
    return BatchNormAddAct(eps, False, False, mean=mean, var=var, fixed=True).apply(
        (x, gamma, beta))[0]


def fixed_batch_normalization_add_relu(x, z, gamma, beta, mean, var, eps=2e-5):
    """relu(fixed BN(x) + z) (``z=None``: relu(fixed BN(x)))."""
    inputs = (x, gamma, beta) if z is None else (x, gamma, beta, z)
    return BatchNormAddAct(eps, True, z is not None, mean=mean, var=var, fixed=True).apply(
        inputs)[0]
