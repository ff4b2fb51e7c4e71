"""Optimizers that update every parameter with one kernel launch (see docs/optimizer.md)."""
from chainer_tc.optimizers.momentum_sgd import MomentumSGD  # NOQA
from chainer_tc.optimizers.momentum_sgd import decay_all  # NOQA
from chainer_tc.optimizers.momentum_sgd import skip_bn_and_bias  # NOQA
