"""Models: ResNet-50 v1.5 / v1 in NCHW (Chainer's links) and NHWC (chainer_tc's links, fused
BN+Add+ReLU); loading Chainer's ImageNet example's ResNet50 checkpoints."""
from chainer_tc.models.chainer_example import load_chainer_example  # NOQA
from chainer_tc.models.resnet50 import ResNet50  # NOQA
