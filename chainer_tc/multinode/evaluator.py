"""Validation over every rank's shard: every image counts once.

    val = chainer_tc.dali.DaliIterator(
        dali.imagenet_pipeline(root, 'val.txt', train=False, shard_id=comm.rank,
                               num_shards=comm.size), 64, repeat=False)
    trainer.extend(chainer_tc.multinode.Evaluator(val, model, comm, converter=dali.converter))

Each rank evaluates its shard with means over images (``chainer_tc.dali.Evaluator``), and the
ranks combine, per reported key, ``mean * weight`` and ``weight``, where a key's weight is what
stands behind its mean on that rank: the images of the batches that reported the key (a key
reported for some batches only is averaged over those batches' images, as on one process), or
the sum of the weights the model gave in ``(value, weight)`` pairs. The result is what
``chainer_tc.dali.Evaluator`` gives on one process over the same batches, whatever the shard
sizes (DALI's shards differ by one image at most; ChainerMN's multi-node evaluator averages the
ranks' means, each rank weighing the same). A key no batch of a rank reported counts there with
weight 0. Every rank gets the same result.
"""
import warnings

import numpy

from chainer_tc.dali import evaluator as dali_evaluator


class Evaluator(dali_evaluator.Evaluator):
    """``chainer_tc.dali.Evaluator`` over the shards of all ranks of ``communicator``."""

    def __init__(self, iterator, target, communicator, **kwargs):
        super().__init__(iterator, target, **kwargs)
        self.communicator = communicator

    def evaluate(self):
        images = [0]
        original = self.eval_func
        inner = original or self._targets['main']

        def counting(*args, **kwargs):
            first = args[0] if args else next(iter(kwargs.values()))
            images[0] += len(first)
            return inner(*args, **kwargs)
        self.eval_func = counting
        try:
            means = super().evaluate()
        finally:
            if self.eval_func is counting:      # (one an eval_hook set is kept, as Chainer's)
                self.eval_func = original
        weights = self.weights
        mpi_comm = self.communicator.mpi_comm
        keys = sorted(set().union(*mpi_comm.allgather(sorted(means))))
        local = numpy.zeros(2 * len(keys) + 1, numpy.float64)
        for i, k in enumerate(keys):
            if k in means:
                local[2 * i] = float(means[k]) * weights[k]
                local[2 * i + 1] = weights[k]
        local[-1] = images[0]
        from mpi4py import MPI
        total = numpy.empty_like(local)
        mpi_comm.Allreduce(local, total, op=MPI.SUM)
        if total[-1] == 0:      # (as Chainer's Evaluator over an empty iterator: {}, said)
            warnings.warn('multinode.Evaluator: no rank evaluated any image (the validation '
                          'shards are empty)', RuntimeWarning, stacklevel=2)
            return {}
        with numpy.errstate(divide='ignore', invalid='ignore'):   # weight 0: nan, as Chainer
            return {k: total[2 * i] / total[2 * i + 1] for i, k in enumerate(keys)}
