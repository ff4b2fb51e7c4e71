"""Drop-in BatchNormalization links for channels-last (NHWC) input.

    from chainer_tc import links as TL
    bn = TL.BatchNormalization(64)            # same arguments as L.BatchNormalization
    y = bn(x)                                 # x: (N, H, W, 64)
    bnr = TL.BatchNormAddReLU(64)
    y = bnr(x, z)                             # relu(bn(x) + z); bnr(x) is relu(bn(x))

Same parameters and persistent values (gamma, beta, avg_mean, avg_var, N) as
``chainer.links.BatchNormalization``, so weights load from either with ``serializers.load_npz``.

One difference in defaults: with ``dtype=None`` and ``chainer.config.dtype`` float16 (or
mixed16), gamma, beta and the running statistics are float32, as Chainer's link makes them under
mixed16 only. The functions normalise float16 data in float32 anyway, and cuDNN's fused
BN+Add+ReLU path takes float32 scale, bias and statistics for float16 data. ``dtype=numpy.float16``
still gives float16 parameters.
"""
import numpy

import chainer
import chainer.links as L
from chainer.utils import argument

from chainer_tc import functions as bn_functions
from chainer_tc.functions.batch_normalization import check_eps
from chainer_tc.links import _messages


class BatchNormalization(L.BatchNormalization):
    """``L.BatchNormalization`` over the channels (last axis) of NHWC input.

    ``axis`` is not accepted: the statistics are always over every axis but the last. ``size``
    is the channel count C, ``(C,)`` (taken as C, as Chainer's link does) or None.
    """

    _relu = False

    def __init__(self, size=None, decay=0.9, eps=2e-5, dtype=None, use_gamma=True,
                 use_beta=True, initial_gamma=None, initial_beta=None, axis=None,
                 initial_avg_mean=None, initial_avg_var=None):
        if axis is not None:
            raise ValueError('{} normalises NHWC input over every axis but the last (the '
                             'channels); axis={} is not supported'
                             .format(type(self).__name__, axis))
        size = channel_count(size, type(self).__name__)
        eps = check_eps(eps)
        dtype = parameter_dtype(dtype, type(self).__name__)
        # Chainer needs an axis to defer the size; ours comes from x.shape[-1] at the first call
        super().__init__(size, decay, eps, dtype, use_gamma, use_beta, initial_gamma,
                         initial_beta, axis=(0,) if size is None else None,
                         initial_avg_mean=initial_avg_mean, initial_avg_var=initial_avg_var)

    def forward(self, x, z=None, finetune=False, **kwargs):
        check_call_kwargs(kwargs)
        if self.avg_mean is None:
            _messages.warn_if_lazy_nchw(self, x.shape)
            self._initialize_params((x.shape[-1],))
        channels = self.avg_mean.shape[0]
        if x.ndim < 2 or x.shape[-1] != channels:
            raise _messages.not_channels_last(self, channels, x.shape)
        if z is not None and not self._relu:
            raise TypeError('BatchNormalization takes no residual z; use BatchNormAddReLU')
        gamma = self.gamma if self.gamma is not None else self._get_gamma()[0]
        beta = self.beta if self.beta is not None else self._get_beta()[0]
        if not chainer.config.train:
            return with_running_statistics(self, x, z, gamma, beta)
        decay, mean, var = training_statistics(self, finetune)
        if self._relu:
            return bn_functions.batch_normalization_add_relu(
                x, z, gamma, beta, self.eps, mean, var, decay)
        return bn_functions.batch_normalization(x, gamma, beta, self.eps, mean, var, decay)


class BatchNormAddReLU(BatchNormalization):
    """``relu(BatchNormalization(x) + z)`` in one pass; called as ``link(x, z=None)``."""

    _relu = True


# ---- what the NHWC BatchNorm links share (chainer_tc.multinode's too) ------------------------

def check_call_kwargs(kwargs):
    """Chainer's refusal of a BatchNorm link's old ``test=`` argument and of unknown ones."""
    if kwargs:
        argument.check_unexpected_kwargs(
            kwargs, test='test argument is not supported anymore. Use '
                         "chainer.using_config('train', False)")
        argument.assert_kwargs_empty(kwargs)


def training_statistics(link, finetune):
    """(decay, running mean, running var) for a training call of the BatchNorm ``link``, as
    Chainer's link: with ``finetune`` N counts the calls and decay is 1 - 1 / N; on
    recomputation (``chainer.config.in_recomputing``) nothing is updated (None, N as it was)."""
    if finetune:
        link.N += 1
        decay = 1. - 1. / link.N
    else:
        decay = link.decay
    mean, var = link.avg_mean, link.avg_var
    if chainer.config.in_recomputing:
        if finetune:
            link.N -= 1
        mean = var = None
    return decay, mean, var


def with_running_statistics(link, x, z, gamma, beta):
    """The test-mode output of the BatchNorm ``link`` (``link._relu``: the fused one): x
    normalised with its running statistics."""
    if link._relu:
        return bn_functions.fixed_batch_normalization_add_relu(
            x, z, gamma, beta, link.avg_mean, link.avg_var, link.eps)
    return bn_functions.fixed_batch_normalization(x, gamma, beta, link.avg_mean,
                                                  link.avg_var, link.eps)


def channel_count(size, owner):
    """The channel count an NHWC BatchNorm link is built with: ``size`` itself when it is None
    or an int C, and C for ``(C,)`` (per channel in ``L.BatchNormalization`` too). A TypeError
    naming ``owner`` (the link's class) for anything else: a size of more axes normalises each
    element, which has no channels-last form."""
    def is_int(v):
        return not isinstance(v, bool) and isinstance(v, (int, numpy.integer))

    if size is None or is_int(size):
        return size
    if isinstance(size, (tuple, list)) and len(size) == 1 and is_int(size[0]):
        return int(size[0])
    if isinstance(size, (tuple, list)) and len(size) > 1:
        why = (', a size of {} axes: a BatchNormalization of each element has no channels-last '
               'form (use L.BatchNormalization); a 1-tuple (C,) is taken as C'.format(len(size)))
    else:
        why = ' (a 1-tuple (C,) is taken as C)'
    raise TypeError('{}: size must be the channel count (an int) or None; got {!r}{}'
                    .format(owner, size, why))


def parameter_dtype(dtype, owner):
    """The dtype of an NHWC BatchNorm link's parameters and statistics: ``dtype``, or with None
    ``chainer.get_dtype()`` with float16 (and mixed16) data given float32 ones; a TypeError
    naming ``owner`` (the link's class) for a dtype that is not floating-point."""
    if dtype is None:
        dtype = chainer.get_dtype(None, map_mixed16=numpy.float32)
        return numpy.dtype(numpy.float32) if dtype == numpy.float16 else numpy.dtype(dtype)
    if numpy.dtype(dtype).kind != 'f':
        raise TypeError('{}: dtype must be a floating-point type (gamma, beta and the running '
                        'statistics, updated in place); got {}'.format(owner, numpy.dtype(dtype)))
    return numpy.dtype(dtype)
