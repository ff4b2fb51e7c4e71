"""Chainer functions over channels-last (NHWC) arrays (see docs/functions.md)."""
from chainer_tc.functions.batch_normalization import batch_normalization  # NOQA
from chainer_tc.functions.batch_normalization import batch_normalization_add_relu  # NOQA
from chainer_tc.functions.batch_normalization import fixed_batch_normalization  # NOQA
from chainer_tc.functions.batch_normalization import fixed_batch_normalization_add_relu  # NOQA
