"""Channels-last BatchNormalization links whose training statistics are those of the global
batch (every rank's rows).

    comm = chainermn.create_communicator('pure_nccl')          # 'naive' on CPUs
    bn = chainer_tc.multinode.MultiNodeBatchNormalization(64, comm)
    y = bn(x)                                                   # x: (N, H, W, 64), this rank's
    bnr = chainer_tc.multinode.MultiNodeBatchNormAddReLU(64, comm)
    y = bnr(x, z)                                               # relu(bn(x) + z)

The parameters and persistent values (gamma, beta, avg_mean, avg_var, N), their dtypes and the
arguments are those of ``chainer_tc.links.BatchNormalization`` (float32 parameters and
statistics for float16 data by default; ``size=None`` takes C from the first input), so weights
move between the two with ``copyparams`` or ``serializers.load_npz``. Training mode computes
with :mod:`chainer_tc.multinode.batch_norm_function` (collectives in forward and backward:
every rank must call the link at the same point); ``chainer.config.train = False`` normalises
with the running statistics and communicates nothing; ``finetune=True`` and
``start_finetuning()`` work as in Chainer's link.

These links are not subclasses of ``chainer.links.BatchNormalization`` (ChainerMN's own
MultiNodeBatchNormalization is not either): ChainerMN's ``create_mnbn_model`` replaces every
``L.BatchNormalization`` by its NCHW link, and leaves these as they are (deep copies, with the
communicator kept).

The communicator: ``copy.deepcopy`` and ``link.copy()`` keep the same communicator object (as
ChainerMN's link does: a communicator cannot be copied). Pickling leaves it out (an MPI or NCCL
communicator cannot be pickled): an unpickled link has ``comm = None``, normalises with its
running statistics in test mode, and refuses to train until a communicator is assigned
(``link.comm = comm``). ``serializers.save_npz`` / ``load_npz`` carry the parameters and
statistics only, as for any link.
"""
import copy

import numpy

import chainer
from chainer import initializers
from chainer import variable

from chainer_tc.functions.batch_normalization import check_eps
from chainer_tc.links import _messages
from chainer_tc.links import batch_normalization as bn_links
from chainer_tc.multinode import _communicator
from chainer_tc.multinode import batch_norm_function
from chainer_tc.multinode import collectives


def _check_decay(decay):
    try:
        value = float(decay)
    except (TypeError, ValueError):
        raise TypeError('decay: expected a number in [0, 1]; got {!r}'.format(decay)) from None
    if isinstance(decay, bool) or not 0 <= value <= 1:
        raise ValueError('decay: expected a number in [0, 1] (the weight of the old running '
                         'statistics); got {!r}'.format(decay))
    return value


class MultiNodeBatchNormalization(chainer.Link):
    """``chainer_tc.links.BatchNormalization`` (NHWC, statistics over every axis but the last)
    with the training statistics of every rank of ``comm``.

    Args:
        size (int, (C,) or None): the channel count C; None takes it from the first input.
        comm: a ChainerMN communicator (``chainermn.create_communicator(...)``).
        decay, eps, dtype, use_gamma, use_beta, initial_gamma, initial_beta: as
            ``chainer_tc.links.BatchNormalization`` (``dtype=None``: float32 under a float16
            or mixed16 ``chainer.config.dtype``).
        communication_backend (str): 'auto' (NCCL with a ``pure_nccl`` communicator, else MPI),
            'mpi' or 'nccl', as ChainerMN's link. NumPy arrays always go through MPI.
    """

    _relu = False
    gamma = None            # as chainer.links.BatchNormalization: None without use_gamma
    beta = None

    def __init__(self, size=None, comm=None, decay=0.9, eps=2e-5, dtype=None, use_gamma=True,
                 use_beta=True, initial_gamma=None, initial_beta=None,
                 communication_backend='auto', initial_avg_mean=None, initial_avg_var=None):
        super().__init__()
        name = type(self).__name__
        if isinstance(size, (tuple, list)) and len(size) == 1:
            size = size[0]                  # (C,): per channel, as in L.BatchNormalization
        if size is not None and (isinstance(size, bool) or
                                 not isinstance(size, (int, numpy.integer)) or size < 1):
            raise TypeError('{}: size: expected the channel count (a positive int, or (C,)) or '
                            'None; got {!r}'.format(name, size))
        _communicator.check(comm, 'comm')
        self._communication_backend = collectives.backend(comm, communication_backend)
        self.comm = comm
        self.decay = _check_decay(decay)
        self.eps = check_eps(eps)
        self._highprec_dtype = bn_links.parameter_dtype(dtype, name)
        for flag, value in (('use_gamma', use_gamma), ('use_beta', use_beta)):
            if not isinstance(value, (bool, numpy.bool_)):
                raise TypeError('{}: {}: expected True or False; got {!r}'.format(
                    name, flag, value))
        self.N = 0
        self.register_persistent('N')
        with self.init_scope():
            if use_gamma:
                init = initializers._get_initializer(1 if initial_gamma is None
                                                     else initial_gamma)
                init.dtype = self._highprec_dtype
                self.gamma = variable.Parameter(init)
            if use_beta:
                init = initializers._get_initializer(0 if initial_beta is None else initial_beta)
                init.dtype = self._highprec_dtype
                self.beta = variable.Parameter(init)
        self.avg_mean = self.avg_var = None
        # (as L.BatchNormalization: initializers or values of the running statistics, used
        # when they are made, then dropped)
        self._initial_avg_mean, self._initial_avg_var = initial_avg_mean, initial_avg_var
        if size is not None:
            self._initialize_params(int(size))
        self.register_persistent('avg_mean')
        self.register_persistent('avg_var')

    def _initialize_params(self, channels):
        with chainer.using_device(self.device):
            self.avg_mean = self._running(self._initial_avg_mean, 0, channels)
            self.avg_var = self._running(self._initial_avg_var, 1, channels)
        self._initial_avg_mean = self._initial_avg_var = None
        for p in (self.gamma, self.beta):
            if p is not None:
                p.initialize((channels,))

    def _running(self, initial, default, channels):
        init = initializers._get_initializer(default if initial is None else initial)
        return initializers.generate_array(init, (channels,), self.xp,
                                           dtype=self._highprec_dtype, device=self.device)

    @property
    def printable_specs(self):
        yield 'size', None if self.avg_mean is None else self.avg_mean.shape[0]
        yield 'decay', self.decay
        yield 'eps', self.eps
        yield 'dtype', self._highprec_dtype
        yield 'use_gamma', self.gamma is not None
        yield 'use_beta', self.beta is not None
        yield 'communication_backend', self._communication_backend

    def _constant(self, value):
        with chainer.using_device(self.device):
            return self.xp.full(self.avg_mean.shape, value, self._highprec_dtype)

    def forward(self, x, z=None, finetune=False, **kwargs):
        bn_links.check_call_kwargs(kwargs)
        if z is not None and not self._relu:
            raise TypeError('{} takes no residual z; use MultiNodeBatchNormAddReLU'
                            .format(type(self).__name__))
        if self.avg_mean is None:
            _messages.warn_if_lazy_nchw(self, x.shape)
            self._initialize_params(x.shape[-1])
        channels = self.avg_mean.shape[0]
        if x.ndim < 2 or x.shape[-1] != channels:
            raise _messages.not_channels_last(self, channels, x.shape)
        gamma = self.gamma if self.gamma is not None else self._constant(1)
        beta = self.beta if self.beta is not None else self._constant(0)
        if not chainer.config.train:
            return bn_links.with_running_statistics(self, x, z, gamma, beta)
        if self.comm is None:
            raise RuntimeError('{} has no communicator (links are pickled without it): assign '
                               'one before training, link.comm = comm'.format(type(self).__name__))
        decay, mean, var = bn_links.training_statistics(self, finetune)
        if self._relu:
            return batch_norm_function.multi_node_batch_normalization_add_relu(
                x, z, gamma, beta, self.comm, self.eps, mean, var, decay,
                self._communication_backend)
        return batch_norm_function.multi_node_batch_normalization(
            x, gamma, beta, self.comm, self.eps, mean, var, decay, self._communication_backend)

    def start_finetuning(self):
        """Resets the population count for collecting population statistics (as Chainer's
        link): call it before fine-tuning again."""
        self.N = 0

    # ---- the communicator: shared by copies, left out of pickles -----------------------------

    def __copy__(self):
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self, memo):
        memo[id(self.comm)] = self.comm         # kept, not copied (as ChainerMN's link)
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        return new

    def __getstate__(self):
        state = dict(self.__dict__)
        state['comm'] = None                    # an MPI/NCCL communicator does not pickle
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)


class MultiNodeBatchNormAddReLU(MultiNodeBatchNormalization):
    """``relu(MultiNodeBatchNormalization(x) + z)`` in one pass, called as ``link(x, z=None)``:
    ``chainer_tc.links.BatchNormAddReLU`` with the statistics of every rank."""

    _relu = True
