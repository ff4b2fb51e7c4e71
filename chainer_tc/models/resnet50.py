"""ResNet-50 (v1.5: the stride sits on the 3x3 convolution), in either memory layout.

    from chainer_tc.models import ResNet50
    model = ResNet50(layout='NHWC')            # chainer_tc links, fused BN+Add+ReLU, no transposes
    model = ResNet50(layout='NCHW')            # Chainer's own links: the baseline
    logits = model(x)                          # x in the model's layout: (N, 224, 224, 3) for NHWC

``width`` divides every channel count (``width=16`` gives a tiny model for tests and CPU
benchmarks); ``n_classes`` sizes the classifier. Parameter names are the same in both layouts, so
``serializers.save_npz`` of one loads into the other.
"""
import chainer
import chainer.functions as F
import chainer.links as L

from chainer_tc import functions as TF
from chainer_tc import links as TL

STAGES = ((3, 64), (4, 128), (6, 256), (3, 512))     # (blocks, bottleneck channels)


class _Ops:
    """The links and functions of one layout."""

    def __init__(self, layout):
        if layout not in ('NCHW', 'NHWC'):
            raise ValueError("layout must be 'NCHW' or 'NHWC'; got {!r}".format(layout))
        self.nhwc = layout == 'NHWC'
        self.conv = TL.Convolution2D if self.nhwc else L.Convolution2D

    def bn(self, ch, relu):
        if self.nhwc:
            return TL.BatchNormAddReLU(ch) if relu else TL.BatchNormalization(ch)
        return L.BatchNormalization(ch)

    def bn_act(self, bn, x, z=None):
        """relu(bn(x) + z): one fused op in NHWC, three in NCHW."""
        if self.nhwc:
            return bn(x, z)
        h = bn(x)
        return F.relu(h if z is None else h + z)

    def max_pool(self, x):
        return (TF if self.nhwc else F).max_pooling_2d(x, 3, stride=2, pad=1, cover_all=False)

    def global_pool(self, x):
        if self.nhwc:
            h = TF.global_average_pooling_2d(x)
        else:
            h = F.average_pooling_2d(x, x.shape[2:])
        return F.reshape(h, (x.shape[0], -1))


class BottleNeck(chainer.Chain):
    """1x1 -> 3x3 (stride) -> 1x1 convolutions, each with BN; projection shortcut if needed."""

    def __init__(self, ops, in_ch, ch, stride):
        super().__init__()
        self.ops = ops
        out_ch = 4 * ch
        with self.init_scope():
            self.conv1 = ops.conv(in_ch, ch, 1, nobias=True)
            self.bn1 = ops.bn(ch, relu=True)
            self.conv2 = ops.conv(ch, ch, 3, stride=stride, pad=1, nobias=True)
            self.bn2 = ops.bn(ch, relu=True)
            self.conv3 = ops.conv(ch, out_ch, 1, nobias=True)
            self.bn3 = ops.bn(out_ch, relu=True)
            if stride != 1 or in_ch != out_ch:
                self.conv_sc = ops.conv(in_ch, out_ch, 1, stride=stride, nobias=True)
                self.bn_sc = ops.bn(out_ch, relu=False)

    def forward(self, x):
        ops = self.ops
        h = ops.bn_act(self.bn1, self.conv1(x))
        h = ops.bn_act(self.bn2, self.conv2(h))
        shortcut = self.bn_sc(self.conv_sc(x)) if hasattr(self, 'conv_sc') else x
        return ops.bn_act(self.bn3, self.conv3(h), shortcut)


class ResNet50(chainer.Chain):

    def __init__(self, layout='NHWC', n_classes=1000, width=1):
        super().__init__()
        self.layout = layout
        ops = self.ops = _Ops(layout)
        c = 64 // width
        with self.init_scope():
            self.conv1 = ops.conv(3, c, 7, stride=2, pad=3, nobias=True)
            self.bn1 = ops.bn(c, relu=True)
            blocks, in_ch = [], c
            for stage, (n, ch) in enumerate(STAGES):
                ch //= width
                for i in range(n):
                    blocks.append(BottleNeck(ops, in_ch, ch, 2 if i == 0 and stage > 0 else 1))
                    in_ch = 4 * ch
            self.blocks = chainer.ChainList(*blocks)
            self.fc = L.Linear(in_ch, n_classes)

    def forward(self, x):
        ops = self.ops
        h = ops.max_pool(ops.bn_act(self.bn1, self.conv1(x)))
        for block in self.blocks:
            h = block(h)
        return self.fc(ops.global_pool(h))
