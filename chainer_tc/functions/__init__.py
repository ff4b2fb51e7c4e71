"""Chainer functions over channels-last (NHWC) arrays (see docs/functions.md)."""
from chainer_tc.functions.batch_normalization import batch_normalization  # NOQA
from chainer_tc.functions.batch_normalization import batch_normalization_add_relu  # NOQA
from chainer_tc.functions.batch_normalization import fixed_batch_normalization  # NOQA
from chainer_tc.functions.batch_normalization import fixed_batch_normalization_add_relu  # NOQA
from chainer_tc.functions.pooling import average_pooling_2d  # NOQA
from chainer_tc.functions.pooling import global_average_pooling_2d  # NOQA
from chainer_tc.functions.pooling import max_pooling_2d  # NOQA
from chainer_tc.functions.convolution_2d import convolution_2d  # NOQA
from chainer_tc.functions.cast import cast  # NOQA
