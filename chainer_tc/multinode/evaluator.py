"""Validation over every rank's shard: every image counts once.

    val = chainer_tc.dali.DaliIterator(
        dali.imagenet_pipeline(root, 'val.txt', train=False, shard_id=comm.rank,
                               num_shards=comm.size), 64, repeat=False)
    trainer.extend(chainer_tc.multinode.Evaluator(val, model, comm, converter=dali.converter))

Each rank evaluates its shard with means over images (``chainer_tc.dali.Evaluator``), and the
ranks combine ``mean * images`` and ``images`` per reported key: the result is the mean over
the whole validation set, whatever the shard sizes (DALI's shards differ by one image at most;
ChainerMN's multi-node evaluator averages the ranks' means, each rank weighing the same).
Every rank gets the same result.
"""
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
            self.eval_func = original
        keys = sorted(means)
        local = numpy.array([float(means[k]) * images[0] for k in keys] + [images[0]],
                            numpy.float64)
        keys_everywhere = self.communicator.mpi_comm.allgather(keys)
        if any(k != keys for k in keys_everywhere):
            raise RuntimeError('the ranks reported different values during evaluation: {}'
                               .format(keys_everywhere))
        from mpi4py import MPI
        total = numpy.empty_like(local)
        self.communicator.mpi_comm.Allreduce(local, total, op=MPI.SUM)
        if total[-1] == 0:
            raise RuntimeError('no rank evaluated any image: the validation shards are empty')
        return {k: total[i] / total[-1] for i, k in enumerate(keys)}
