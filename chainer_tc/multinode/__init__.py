"""Data-parallel training with ChainerMN: chainer_tc's pieces with one allreduce per step.

Two ways in (docs/multinode.md): ``create_multi_node_optimizer``, ChainerMN's own wrapper around
any optimizer (chainer_tc's MomentumSGD included; one allreduce per parameter, ChainerMN's way)
with its broadcasts of the model exact; or ``TrainStep``, which averages all gradients in one
collective on one buffer. ``bcast_data(comm, model)``: rank 0's model on every rank, no
parameter rounded, whatever ``chainer.config.dtype`` is.
"""
from chainer_tc.multinode.allreduce import GradientAllreduce  # NOQA
from chainer_tc.multinode.bcast import bcast_data  # NOQA
from chainer_tc.multinode.evaluator import Evaluator  # NOQA
from chainer_tc.multinode.multi_node_optimizer import create_multi_node_optimizer  # NOQA
from chainer_tc.multinode.step import TrainStep  # NOQA
from chainer_tc.multinode.updater import TrainStepUpdater  # NOQA
