"""Data-parallel training with ChainerMN: chainer_tc's pieces with one allreduce per step.

Two ways in (docs/multinode.md): ``create_multi_node_optimizer``, ChainerMN's own wrapper around
any optimizer (chainer_tc's MomentumSGD included; one allreduce per parameter, ChainerMN's way)
with its broadcasts of the model exact; or ``TrainStep``, which averages all gradients in one
collective on one buffer. ``bcast_data(comm, model)``: rank 0's model on every rank, no
parameter rounded, whatever ``chainer.config.dtype`` is.

BatchNormalization over the global batch (every rank's rows), channels last:
``MultiNodeBatchNormalization`` and ``MultiNodeBatchNormAddReLU`` (links),
``multi_node_batch_normalization`` and ``multi_node_batch_normalization_add_relu`` (functions),
and ``create_mnbn_model(model, comm)``, which makes a copy of a model with them (ChainerMN's
function of that name would give an NHWC model NCHW links).
"""
from chainer_tc.multinode.allreduce import GradientAllreduce  # NOQA
from chainer_tc.multinode.batch_norm_function import multi_node_batch_normalization  # NOQA
from chainer_tc.multinode.batch_norm_function import \
    multi_node_batch_normalization_add_relu  # NOQA
from chainer_tc.multinode.batch_norm_link import MultiNodeBatchNormAddReLU  # NOQA
from chainer_tc.multinode.batch_norm_link import MultiNodeBatchNormalization  # NOQA
from chainer_tc.multinode.batch_norm_model import create_mnbn_model  # NOQA
from chainer_tc.multinode.bcast import bcast_data  # NOQA
from chainer_tc.multinode.evaluator import Evaluator  # NOQA
from chainer_tc.multinode.multi_node_optimizer import create_multi_node_optimizer  # NOQA
from chainer_tc.multinode.step import TrainStep  # NOQA
from chainer_tc.multinode.updater import TrainStepUpdater  # NOQA
