"""Drop-in links for channels-last (NHWC) models (see docs/functions.md)."""
from chainer_tc.links.batch_normalization import BatchNormAddReLU  # NOQA
from chainer_tc.links.batch_normalization import BatchNormalization  # NOQA
from chainer_tc.links.convolution_2d import Convolution2D  # NOQA
from chainer_tc.links.convolution_2d import PaddingWarning  # NOQA
from chainer_tc.links._messages import LayoutWarning  # NOQA
from chainer_tc.links.convert import to_nchw  # NOQA
from chainer_tc.links.convert import to_nhwc  # NOQA
from chainer_tc.links.nhwc_data import nhwc_converter  # NOQA
from chainer_tc.links.nhwc_data import nhwc_dataset  # NOQA
