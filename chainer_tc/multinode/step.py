"""A TrainStep for data-parallel training over ChainerMN's ranks.

    comm = chainermn.create_communicator('pure_nccl')       # 'naive' on CPUs
    step = chainer_tc.multinode.TrainStep(model, optimizer, comm, lossfun)
    loss = step(x, t)                                       # this rank's shard of the batch

Before the first step the model is broadcast from rank 0, every parameter in its own precision
(:func:`chainer_tc.multinode.bcast.bcast_data`). Every step (eager, recorded, replayed
or captured) averages the gradients over the ranks with one collective on one buffer
(:class:`~chainer_tc.multinode.allreduce.GradientAllreduce`) before the batched update. The
dynamic loss scale stays identical on every rank: an inf or nan on one rank reaches every rank
through the mean, so every rank skips that step and halves its scale.
"""
import chainer

from chainer_tc.multinode import allreduce
from chainer_tc.multinode.bcast import bcast_data
from chainer_tc.static_graph import step as step_module


class TrainStep(step_module.TrainStep):
    """``chainer_tc.static_graph.TrainStep`` with the gradients averaged over the ranks of
    ``communicator`` (a ChainerMN communicator). ``allreduce_dtype``: see
    :class:`~chainer_tc.multinode.allreduce.GradientAllreduce`; other keyword arguments are
    TrainStep's."""

    def __init__(self, model, optimizer, communicator, lossfun=None, allreduce_dtype=None,
                 **options):
        if 'reduce_gradients' in options:
            raise TypeError('multinode.TrainStep makes its own reduce_gradients')
        self.communicator = communicator
        self.allreduce = allreduce.GradientAllreduce(communicator, allreduce_dtype)
        super().__init__(model, optimizer, lossfun, reduce_gradients=self.allreduce,
                         **options)
        self._broadcast = False
        self._broadcast_names = None      # the initialised parameters rank 0 last sent

    def __call__(self, *args, **kwargs):
        if not self._broadcast:
            self._broadcast_model(args, kwargs)
        return super().__call__(*args, **kwargs)

    def _broadcast_model(self, args, kwargs):
        """Rank 0's parameters everywhere (lazy links are initialised by a forward first)."""
        if any(p.array is None for p in self.optimizer.target.params()):
            with chainer.using_config('train', False), chainer.no_backprop_mode():
                self.lossfun(*args, **kwargs)
        bcast_data(self.communicator, self.optimizer.target)
        self._broadcast_names = _initialized(self.optimizer.target)
        self._broadcast = True

    def _update(self, grads):
        """The update of an eager step (warm-up, recorded, checks: the steps that can run a
        link for the first time). Parameters that came into being since rank 0's were last
        sent (a lazy link first called in training, such as an auxiliary head the test-mode
        forward of the first broadcast does not call; a link added, then ``optimizer.setup``
        again) have values of each rank's own: rank 0's are sent before the update, as
        ChainerMN's multi-node optimizer sends them when its model changes, so that the
        averaged update and the momentum are the same on every rank."""
        names = _initialized(self.optimizer.target)
        if names != self._broadcast_names:
            bcast_data(self.communicator, self.optimizer.target)
            self._broadcast_names = names
        super()._update(grads)


def _initialized(target):
    return sorted(name for name, p in target.namedparams() if p.array is not None)
