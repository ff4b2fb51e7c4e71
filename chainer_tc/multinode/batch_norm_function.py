"""BatchNormalization (and relu(BN(x) + z)) of channels-last data with the statistics of the
global batch: every rank's rows.

    from chainer_tc import multinode
    y = multinode.multi_node_batch_normalization(x, gamma, beta, comm, running_mean=rm,
                                                 running_var=rv)            # x: (N, H, W, C)
    y = multinode.multi_node_batch_normalization_add_relu(x, z, gamma, beta, comm)

Training mode only (inference needs no communication: ``chainer_tc.functions.
fixed_batch_normalization``). Every rank must call it at the same point, with the same C and
dtypes; the per-rank batch sizes may differ (a rank may even have no rows).

Forward. Each rank summarises each channel of its rows as (count, mean, M2) (M2: the sum of
squared deviations from the rank's mean), the summaries of all ranks are gathered, and each rank
merges them with Chan et al.'s formula in rank order: every rank computes the same bits, and
each rank's rows weigh by their count, so unequal batches are right. With M the global count,
var = M2 / M normalises (the biased variance) and var * M / (M - 1) feeds the running variance,
as one process over the concatenated batch. ChainerMN's MultiNodeBatchNormalization instead
averages the ranks' E[x] and E[x^2] and takes var = E[x^2] - E[x]^2: that cancels (float32 data
with an offset of 1000 and unit spread keeps about 2^-24 * 1000^2 / 1 = 0.06 of its variance,
~6%, as noise), and the plain average of the ranks' means is wrong when their batch sizes
differ. The summaries here lose nothing to an offset.

Backward. With g = gy (masked by y > 0 for the ReLU), each rank sums g and g * xhat over its
rows, the 2C sums are summed over the ranks (one allreduce), and
gx = gamma * invstd * (g - (xhat * sum(g xhat) + sum(g)) / M) with the global sums and count:
the gradient one process computes over the concatenated batch. ggamma = sum(g xhat) / R and
gbeta = sum(g) / R (R ranks): the mean over the ranks of the per-rank sums, identical on every
rank, as ChainerMN's link returns them; after the optimizer's mean over the ranks (ChainerMN's
multi_node_mean_grad, multinode.TrainStep) it equals the gradient of the mean of the ranks'
losses, and on one rank it is the one-process gradient.

Paths (the same semantics):

- NumPy arrays: NumPy, and MPI through the communicator's ``mpi_comm``.
- CuPy arrays, and NumPy arrays under ``CHAINER_TC_EMULATE=1`` (the CPU emulator):
  kernels/batchnorm.cu. Forward: bn_stats_partial, bn_stats_finalize with its ``summary``
  output (the rank's row blocks merged into one summary per channel), the allgather of the
  (R, C, 3) summaries, bn_stats_finalize over them with rows = M (which also updates the
  running statistics), bn_apply. Backward: bn_backward_partial and
  bn_backward_finalize locally, the allreduce of the 2C sums, bn_backward_apply with count M.
  On a GPU the collectives are NCCL's on the current stream with a ``pure_nccl``
  communicator (no host synchronisation; capturable), else host copies and MPI
  (:mod:`chainer_tc.multinode.collectives`).

cuDNN's fused batch normalization is never used: it computes the statistics and normalises in
one call, with no place for a reduction across ranks between its passes (ChainerMN's link also
computes without cuDNN). Every call also exchanges the ranks' row counts, dtypes and channel
counts on the host (one small ``mpi_comm.allgather``, no GPU synchronisation), so that every
rank knows M, and a mismatch raises the same error on every rank instead of hanging
(multinode.TrainStep answers it from a recorded step in its replays and captures:
:func:`chainer_tc.multinode.collectives.replaying_exchanges`). Double backpropagation is not
supported.
"""
import numpy

import chainer
from chainer import function_node

from chainer_tc import kernels
from chainer_tc.functions import _bn_kernels
from chainer_tc.functions import _bn_numpy
from chainer_tc.functions.batch_normalization import _check_decay
from chainer_tc.functions.batch_normalization import _rows
from chainer_tc.functions.batch_normalization import _xp
from chainer_tc.functions.batch_normalization import check_eps
from chainer_tc.functions.batch_normalization import check_inputs
from chainer_tc.functions.batch_normalization import check_types
from chainer_tc.multinode import _communicator
from chainer_tc.multinode import collectives


def local_summary(x):
    """(C, 3) (count, mean, M2) of each column of the NumPy (rows, C) array ``x``, in the
    accumulation dtype: two passes (the mean, then the squared deviations from it; on small
    channel counts over the folded view, as :func:`chainer_tc.functions._bn_numpy.statistics`:
    the same elementwise results)."""
    a = _bn_numpy.acc_dtype(x.dtype)
    rows, c = x.shape
    out = numpy.zeros((c, 3), a)
    if rows == 0:
        return out
    xa = numpy.ascontiguousarray(x).astype(a, copy=False)
    mean = _bn_numpy.colsum(xa) / a(rows)
    m = _bn_numpy._fold(rows, c)
    d = _bn_numpy._wide(xa, m) - _bn_numpy._tile(mean, m)
    out[:, 0] = rows
    out[:, 1] = mean
    out[:, 2] = _bn_numpy.colsum(numpy.multiply(d, d, out=d).reshape(rows, c))
    return out


def merge_summaries(summaries):
    """(count, mean, M2) per channel of the (R, C, 3) ``summaries`` merged in order with Chan
    et al.'s formula (the merge of kernels/batchnorm.cu: an empty summary is skipped). A
    summary's count is its rows, the same in every channel (as :func:`local_summary` and the
    kernels make it): the count is a scalar here, each step rounded as the kernel rounds it."""
    a = summaries.dtype.type
    c = summaries.shape[1]
    n, mean, m2 = a(0), numpy.zeros(c, a), numpy.zeros(c, a)
    for s in summaries:
        nb = s[0, 0] if c else a(0)
        if not nb:
            continue
        total = n + nb
        delta = s[:, 1] - mean
        mean = mean + delta * (nb / total)
        m2 = m2 + (s[:, 2] + delta * delta * (n * nb / total))
        n = total
    return numpy.full(c, n, a), mean, m2


class MultiNodeBatchNormAddAct(function_node.FunctionNode):
    """y = act(gamma * (x - mean) * invstd + beta [+ z]) over the last axis of x, with the
    statistics of every rank's rows; the running statistics (if given) are updated in place
    with them."""

    def __init__(self, comm, eps, relu, has_z, decay=0.9, running_mean=None, running_var=None,
                 communication_backend='auto'):
        self.comm = _communicator.check(comm, 'comm')
        self.backend = collectives.backend(comm, communication_backend)
        self.eps = check_eps(eps)
        self.decay = _check_decay(decay) if running_mean is not None else decay
        self.relu, self.has_z = bool(relu), bool(has_z)
        self.running_mean, self.running_var = running_mean, running_var

    def check_type_forward(self, in_types):
        check_types(in_types, self.has_z)

    def _global_count(self, x, gamma):
        """M, the rows of every rank, after checking that every rank has x's channels and
        dtypes: the same error on every rank (one raising alone would leave the others
        waiting in the next collective)."""
        rows = x.size // x.shape[-1] if x.shape[-1] else 0
        mine = (int(rows), int(x.shape[-1]), x.dtype.str, gamma.dtype.str)
        everyone = collectives.allgather_objects(self.comm, mine)
        if any(o[1:] != everyone[0][1:] for o in everyone):
            raise ValueError(
                'multi-node batch normalization: the ranks differ in channels or dtypes (rank: '
                '(rows, C, x dtype, gamma dtype)): {}'.format(
                    ', '.join('{}: {}'.format(r, o) for r, o in enumerate(everyone))))
        total = sum(o[0] for o in everyone)
        if total < 1:
            raise ValueError('batch statistics need at least one row over all ranks; every rank '
                             'has x of shape {} (no rows)'.format(x.shape))
        return total

    def forward(self, inputs):
        x, gamma, beta = inputs[:3]
        z = inputs[3] if self.has_z else None
        check_inputs(x, gamma, self.running_mean, self.running_var)
        xp = _xp(x)
        self._path = kernels.backend(xp)
        self.count = self._global_count(x, gamma)
        self.ranks = self.comm.size
        rm, rv = self.running_mean, self.running_var
        a = _bn_numpy.acc_dtype(x.dtype)
        if self._path == 'numpy':
            self.retain_inputs((1, 2))          # xhat is kept instead of x, as in TF's path
            x2, z2 = _rows(x), None if z is None else _rows(z)
            everyone = collectives.allgather(self.comm, local_summary(x2), self.backend)
            _, self.mean, m2 = merge_summaries(everyone)
            var = m2 / a(self.count)
            self.invstd = numpy.reciprocal(numpy.sqrt(var + a(self.eps)))
            if rm is not None:
                _bn_numpy.update_running(rm, rv, self.mean, var, self.count, self.decay)
            y, self.xhat = _bn_numpy.forward(x2, z2, gamma, beta, self.mean, self.invstd,
                                             self.relu,
                                             keep_xhat=chainer.config.enable_backprop)
        else:
            self.retain_inputs((0, 1, 2))
            x = xp.ascontiguousarray(x)
            z = None if z is None else xp.ascontiguousarray(z)
            gamma, beta = xp.ascontiguousarray(gamma), xp.ascontiguousarray(beta)
            if rm is not None and not (rm.flags.c_contiguous and rv.flags.c_contiguous):
                rm, rv = xp.ascontiguousarray(rm), xp.ascontiguousarray(rv)
            x2, z2 = _rows(x), None if z is None else _rows(z)
            everyone = collectives.allgather(self.comm, _bn_kernels.summary(x2, xp),
                                             self.backend)
            self.mean, self.invstd = _bn_kernels.finalize(
                everyone, self.count, self.eps, self.decay, rm, rv, xp, x.dtype)
            if rm is not self.running_mean:     # strided statistics: updated in copies
                self.running_mean[...] = rm
                self.running_var[...] = rv
            y = _bn_kernels.forward(x2, z2, gamma, beta, self.mean, self.invstd, self.relu,
                                    xp) if x2.shape[0] else xp.empty_like(x2)
        self.retain_outputs((0,))
        return y.reshape(x.shape),

    def backward(self, indexes, grad_outputs):
        y, = self.get_retained_outputs()
        retained = self.get_retained_inputs()
        if len(retained) == 2:          # the NumPy path kept xhat: y stands in for x's shape
            (gamma, beta), x = retained, y
        else:
            x, gamma, beta = retained
        gy, = grad_outputs
        grads = MultiNodeBatchNormAddActGrad(self).apply((x, gamma, beta, y, gy))
        return tuple(grads[i] for i in indexes)


class MultiNodeBatchNormAddActGrad(function_node.FunctionNode):
    """Gradients of MultiNodeBatchNormAddAct: (gx, ggamma, gbeta[, gz]), one allreduce of 2C
    sums. Not differentiable again."""

    def __init__(self, f):
        self.f = f

    def forward(self, inputs):
        x, gamma, beta, y, gy = inputs
        f = self.f
        c = x.shape[-1]
        x2, y2, gy2 = _rows(x), _rows(y), _rows(gy)
        if f._path == 'numpy':
            with numpy.errstate(over='ignore', invalid='ignore'):    # see _bn_numpy.backward
                g, sum_g, sum_gx, prod = _bn_numpy.backward_sums(gy2, y2, f.xhat, f.relu)
                sums = numpy.concatenate([sum_g, sum_gx])
                collectives.allreduce_sum(f.comm, sums, f.backend)
                gx = _bn_numpy.backward_apply(g, f.xhat, prod, gamma, f.invstd, sums[:c],
                                              sums[c:], f.count, False)
            gx = gx.reshape(x.shape).astype(x.dtype, copy=False)
            gz = _bn_numpy._own(g, gy).reshape(x.shape).astype(x.dtype, copy=False) \
                if f.has_z else None
        else:
            xp = chainer.backend.get_array_module(x)
            gamma = xp.ascontiguousarray(gamma)
            gy2, x2 = xp.ascontiguousarray(gy2), xp.ascontiguousarray(x2)
            sums, _, _ = _bn_kernels.backward_sums(gy2, y2, x2, gamma, f.mean, f.invstd, f.relu,
                                                   xp)
            collectives.allreduce_sum(f.comm, sums, f.backend)
            gx, gz = _bn_kernels.backward_apply(gy2, y2, x2, gamma, f.mean, f.invstd, sums,
                                                f.count, f.relu, f.has_z, xp)
            gx = gx.reshape(x.shape)
            gz = None if gz is None else gz.reshape(x.shape)
        ranks = sums.dtype.type(f.ranks)
        ggamma = (sums[c:] / ranks).astype(gamma.dtype, copy=False)
        gbeta = (sums[:c] / ranks).astype(gamma.dtype, copy=False)
        return (gx, ggamma, gbeta) + ((gz,) if f.has_z else ())

    def backward(self, indexes, grad_outputs):
        raise NotImplementedError('chainer_tc: double backpropagation through the multi-node '
                                  'BatchNormalization is not supported')


def multi_node_batch_normalization(x, gamma, beta, comm, eps=2e-5, running_mean=None,
                                   running_var=None, decay=0.9, communication_backend='auto'):
    """BatchNormalization of NHWC ``x`` with the statistics of every rank of ``comm``."""
    return MultiNodeBatchNormAddAct(comm, eps, False, False, decay, running_mean, running_var,
                                    communication_backend).apply((x, gamma, beta))[0]


def multi_node_batch_normalization_add_relu(x, z, gamma, beta, comm, eps=2e-5,
                                            running_mean=None, running_var=None, decay=0.9,
                                            communication_backend='auto'):
    """relu(BN(x) + z) (``z=None``: relu(BN(x))) with the statistics of every rank of
    ``comm``."""
    inputs = (x, gamma, beta) if z is None else (x, gamma, beta, z)
    return MultiNodeBatchNormAddAct(comm, eps, True, z is not None, decay, running_mean,
                                    running_var, communication_backend).apply(inputs)[0]
