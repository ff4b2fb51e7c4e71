"""Models: ResNet-50 in NCHW (Chainer's links) and NHWC (chainer_tc's links, fused BN+Add+ReLU)."""
from chainer_tc.models.resnet50 import ResNet50  # NOQA
