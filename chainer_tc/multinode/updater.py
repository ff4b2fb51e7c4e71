"""A Chainer updater whose iterations are multi-node TrainSteps.

    updater = chainer_tc.multinode.TrainStepUpdater(train_iter, optimizer, comm, device=device)

StandardUpdater's arguments plus the ChainerMN communicator: each iteration is a
:class:`chainer_tc.multinode.TrainStep` (the gradients averaged over the ranks in one collective
per step). Give each rank its shard of the data (see docs/multinode.md).
"""
from chainer_tc.multinode import step as multinode_step
from chainer_tc.static_graph import updater as static_updater


class TrainStepUpdater(static_updater.TrainStepUpdater):
    """``chainer_tc.static_graph.TrainStepUpdater`` over the ranks of ``communicator``;
    ``allreduce_dtype``: see :class:`~chainer_tc.multinode.allreduce.GradientAllreduce`."""

    def __init__(self, iterator, optimizer, communicator, allreduce_dtype=None, **kwargs):
        super().__init__(iterator, optimizer, **kwargs)
        self.communicator = communicator
        self.allreduce_dtype = allreduce_dtype

    def _make_step(self, optimizer):
        return multinode_step.TrainStep(optimizer.target, optimizer, self.communicator,
                                        self.loss_func or optimizer.target,
                                        allreduce_dtype=self.allreduce_dtype,
                                        **self.step_options)
