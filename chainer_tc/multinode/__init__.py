"""Data-parallel training with ChainerMN: chainer_tc's pieces with one allreduce per step.

chainer_tc's MomentumSGD also works unchanged inside ChainerMN's own
``chainermn.create_multi_node_optimizer`` (one allreduce per parameter, ChainerMN's way); this
package adds a TrainStep that averages all gradients in one collective on one buffer. See
docs/multinode.md.
"""
from chainer_tc.multinode.allreduce import GradientAllreduce  # NOQA
from chainer_tc.multinode.evaluator import Evaluator  # NOQA
from chainer_tc.multinode.step import TrainStep  # NOQA
from chainer_tc.multinode.updater import TrainStepUpdater  # NOQA
