"""ResNet-50 v1.5 or v1, in either memory layout, in the dtype of ``chainer.config.dtype``.

    from chainer_tc.models import ResNet50
    model = ResNet50()                         # NHWC, v1.5, 1000 classes, float32
    model = ResNet50(layout='NCHW')            # Chainer's own links: the baseline
    model = ResNet50(version='1')              # Chainer's example's architecture
    model = ResNet50(pad_channels=4)           # conv1 reads 4 channels (Tensor Cores, float16)
    logits = model(x)                          # x in the model's layout: (N, 224, 224, 3) for NHWC

    CHAINER_DTYPE=float16 python train.py      # or: with chainer.using_config('dtype', float16):
                                               #         model = ResNet50()
"""
import numpy

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import initializers

from chainer_tc import functions as TF
from chainer_tc import input_channels
from chainer_tc import links as TL

STAGES = ((3, 64), (4, 128), (6, 256), (3, 512))     # (blocks, bottleneck channels)
VERSIONS = ('1', '1.5')


class _Ops:
    """The links and functions of one layout and version."""

    def __init__(self, layout, version, fused):
        if layout not in ('NCHW', 'NHWC'):
            raise ValueError("layout must be 'NCHW' or 'NHWC'; got {!r}".format(layout))
        self.nhwc = layout == 'NHWC'
        self.version = version
        self.fused = fused

    def conv(self, in_ch, out_ch, ksize, stride=1, pad=0, pad_channels=None):
        if self.nhwc:
            return TL.Convolution2D(in_ch, out_ch, ksize, stride=stride, pad=pad, nobias=True,
                                    initialW=initializers.HeNormal(), pad_channels=pad_channels)
        return L.Convolution2D(in_ch, out_ch, ksize, stride=stride, pad=pad, nobias=True,
                               initialW=initializers.HeNormal())

    def bn(self, ch, relu, zero_gamma=False):
        gamma = 0 if zero_gamma else None
        if self.nhwc:
            cls = TL.BatchNormAddReLU if relu and self.fused else TL.BatchNormalization
            return cls(ch, initial_gamma=gamma)
        return L.BatchNormalization(ch, initial_gamma=gamma)

    def bn_act(self, bn, x, z=None):
        """relu(bn(x) + z): one fused op in NHWC (fused), up to three otherwise."""
        if self.fused:
            return bn(x, z)
        h = bn(x)
        return F.relu(h if z is None else h + z)

    def max_pool(self, x):
        f = (TF if self.nhwc else F).max_pooling_2d
        if self.version == '1':         # Chainer's example: no padding, cover_all (ceil mode)
            return f(x, 3, stride=2)
        return f(x, 3, stride=2, pad=1, cover_all=False)

    def global_pool(self, x):
        if self.nhwc:
            h = TF.global_average_pooling_2d(x)
        else:
            h = F.average_pooling_2d(x, x.shape[2:])
        return F.reshape(h, (x.shape[0], -1))


class BottleNeck(chainer.Chain):
    """1x1 -> 3x3 -> 1x1 convolutions, each with BN; projection shortcut (conv_sc, bn_sc) where
    the shape changes. The stride sits on the 3x3 convolution (v1.5) or on the first 1x1 (v1)."""

    def __init__(self, ops, in_ch, ch, stride, zero_init_residual):
        super().__init__()
        self.ops = ops
        out_ch = 4 * ch
        s1, s2 = (stride, 1) if ops.version == '1' else (1, stride)
        with self.init_scope():
            self.conv1 = ops.conv(in_ch, ch, 1, stride=s1)
            self.bn1 = ops.bn(ch, relu=True)
            self.conv2 = ops.conv(ch, ch, 3, stride=s2, pad=1)
            self.bn2 = ops.bn(ch, relu=True)
            self.conv3 = ops.conv(ch, out_ch, 1)
            self.bn3 = ops.bn(out_ch, relu=True, zero_gamma=zero_init_residual)
            if stride != 1 or in_ch != out_ch:
                self.conv_sc = ops.conv(in_ch, out_ch, 1, stride=stride)
                self.bn_sc = ops.bn(out_ch, relu=False)

    def forward(self, x):
        ops = self.ops
        h = ops.bn_act(self.bn1, self.conv1(x))
        h = ops.bn_act(self.bn2, self.conv2(h))
        shortcut = self.bn_sc(self.conv_sc(x)) if hasattr(self, 'conv_sc') else x
        return ops.bn_act(self.bn3, self.conv3(h), shortcut)


class ResNet50(chainer.Chain):
    """ResNet-50 (He et al. 2016) for ``insize`` x ``insize`` images; returns the logits.

    Args:
        layout (str): 'NHWC' (default): chainer_tc's links, BN+Add+ReLU fused, no transposes,
            input (N, H, W, 3). 'NCHW': Chainer's own links, input (N, 3, H, W): the baseline.
        n_classes (int): outputs of the classifier (default 1000).
        width (int): divides every channel count (64 // width channels after the first
            convolution): ``width=16`` gives a tiny model for tests and CPU runs; 1, 2, 4, 8, 16,
            32 or 64.
        version (str): '1.5' (default): the stride of a down-sampling block sits on its 3x3
            convolution, max pooling 3x3/2 with padding 1 (NVIDIA's and torchvision's ResNet-50).
            '1': the stride sits on the block's first 1x1 convolution and the max pooling is
            3x3/2 without padding, rounding up (``cover_all``): the architecture of Chainer's
            ImageNet example, whose checkpoints :func:`load_chainer_example` loads.
        fused (bool): NHWC only: relu(BN(x) + z) as one fused op (``TL.BatchNormAddReLU``).
            Default (None): True for NHWC. False: NHWC ``TL.BatchNormalization`` followed by
            Chainer's add and ReLU (the unfused NHWC model, for ablations); the parameters and
            their names are the same either way.
        zero_init_residual (bool): initialise the last BN's gamma of every block to 0, so each
            residual block starts as the identity (Goyal et al. 2017). Default (None): True for
            version '1.5' (NVIDIA's recipe), False for '1' (Chainer's example).
        pad_channels (int): NHWC only: 4 or 8 pads the images' 3 channels with zeros to that
            many for the first convolution, whose filter gets the extra input channels, zero
            (cuDNN's Tensor Core NHWC kernels want 4, or a multiple of 8, channels in float16;
            3 channels fall back to slower kernels). The model then takes (N, H, W, 3) images,
            padding them itself (one ``F.pad``: a copy of the input, one memory-bound pass; no
            warning, since the result is the fast path), or images already padded with zeros
            (by ``chainer_tc.dali.imagenet_pipeline(..., pad_channels=4)``: no copy). Default
            (None): 3, no padding (the first convolution's optimizer state in a snapshot has
            the shape of its filter, so a default that padded would not resume older runs).
            The padding is invisible: the same logits as the unpadded model with the same
            weights, the same initial weights for the same random state, and the same ``.npz``
            files (saved without the padding channels; see ``TL.Convolution2D``).

    Precision. The model takes its dtype from ``chainer.config.dtype`` when it is built
    (``CHAINER_DTYPE=float16`` in the environment, or ``chainer.using_config('dtype',
    numpy.float16)`` around the constructor; mixed16 counts as float16), kept in ``self.dtype``:

    =========================================  =========  =========  =========
    parameter                                  float32    float16    float16
                                                          NHWC       NCHW
    =========================================  =========  =========  =========
    convolution filters, fc W and b            float32    float16    float16
    BN gamma, beta, avg_mean, avg_var          float32    float32    float16*
    =========================================  =========  =========  =========

    (*) Chainer's ``L.BatchNormalization`` rule: float16 under float16, float32 under mixed16.
    In NHWC the BN parameters and statistics are float32 (``TL.BatchNormalization``'s default
    for float16 data): the statistics are computed in float32 anyway, and cuDNN's fused
    BN+Add+ReLU kernel takes float32 scale, bias and statistics with float16 data.

    The input is cast to ``self.dtype`` where it enters ``forward`` (one ``F.cast``, none when it
    already has that dtype, e.g. float16 images from ``chainer_tc.dali``); the activations stay
    in ``self.dtype``; a float16 model casts the classifier's output to float32, so the logits,
    ``softmax_cross_entropy`` and the loss are float32 (and ``loss.backward`` starts in float32).
    A float32 and a float16 run of the same script differ only in ``chainer.config.dtype``.

    Filters are HeNormal-initialised (as in Chainer's example), the classifier is Chainer's
    default ``L.Linear``. Parameter names (``conv1``, ``bn1``, ``blocks/<i>/conv1..3``,
    ``bn1..3``, ``conv_sc``, ``bn_sc``, ``fc``) are the same in both layouts, so an npz saved from
    one loads into the other; Chainer's example names its parameters differently (``res2/0/...``):
    use :func:`load_chainer_example` for its files.
    """

    pad_channels = 3        # a class default too: models pickled before pad_channels existed

    insize = 224

    def __init__(self, layout='NHWC', n_classes=1000, width=1, version='1.5',
                 zero_init_residual=None, fused=None, pad_channels=None):
        super().__init__()
        if version not in VERSIONS:
            raise ValueError("version must be '1.5' or '1' (a str); got {!r}".format(version))
        if isinstance(width, bool) or not isinstance(width, (int, numpy.integer)) \
                or width < 1 or 64 % width:
            raise ValueError('width must be a positive integer dividing 64 (1, 2, 4, ..., 64); '
                             'got {!r}'.format(width))
        if isinstance(n_classes, bool) or not isinstance(n_classes, (int, numpy.integer)) \
                or n_classes < 1:
            raise ValueError('n_classes must be a positive integer; got {!r}'.format(n_classes))
        if zero_init_residual is None:
            zero_init_residual = version == '1.5'
        if not isinstance(zero_init_residual, bool):
            raise TypeError('zero_init_residual must be True, False or None (the default of the '
                            'version); got {!r}'.format(zero_init_residual))
        if fused is None:
            fused = layout == 'NHWC'
        if not isinstance(fused, bool):
            raise TypeError('fused must be True, False or None (True for NHWC); got {!r}'
                            .format(fused))
        if fused and layout != 'NHWC':
            raise ValueError("fused=True needs layout='NHWC': the fused BN+Add+ReLU links are "
                             "channels-last; got layout={!r}".format(layout))
        pad_channels = input_channels.check(pad_channels)
        if pad_channels != 3 and layout == 'NCHW':
            raise ValueError("pad_channels={} needs layout='NHWC': padding the channels is for "
                             "cuDNN's channels-last Tensor Core kernels, and Chainer's NCHW "
                             'links cannot hide it; got layout={!r}'.format(pad_channels, layout))
        self.layout, self.version, self.width = layout, version, int(width)
        self.pad_channels = int(pad_channels)
        self.fused = fused
        self.n_classes, self.zero_init_residual = int(n_classes), zero_init_residual
        self.dtype = chainer.get_dtype()
        self.head_dtype = numpy.dtype(numpy.float32) if self.dtype == numpy.float16 \
            else self.dtype
        ops = self.ops = _Ops(layout, version, fused)
        c = 64 // width
        with self.init_scope():
            self.conv1 = ops.conv(3, c, 7, stride=2, pad=3, pad_channels=self.pad_channels)
            self.bn1 = ops.bn(c, relu=True)
            blocks, in_ch = [], c
            for stage, (n, ch) in enumerate(STAGES):
                ch //= width
                for i in range(n):
                    stride = 2 if i == 0 and stage > 0 else 1
                    blocks.append(BottleNeck(ops, in_ch, ch, stride, zero_init_residual))
                    in_ch = 4 * ch
            self.blocks = chainer.ChainList(*blocks)
            self.fc = L.Linear(in_ch, n_classes,
                               initialW=initializers.LeCunNormal(dtype=self.head_dtype),
                               initial_bias=initializers.Zero(dtype=self.head_dtype))

    def forward(self, x):
        """Logits (N, n_classes) of images ``x`` in the model's layout (NHWC with
        ``pad_channels``: 3 channels, or ``pad_channels`` padded with zeros); float32 for float16
        models, else the model's dtype."""
        ops = self.ops
        if x.dtype != self.dtype:           # the one cast of the input
            x = F.cast(x, self.dtype)
        h = ops.max_pool(ops.bn_act(self.bn1, self.conv1(x)))
        for block in self.blocks:
            h = block(h)
        h = ops.global_pool(h)
        if h.dtype != self.head_dtype:      # float16 model: classifier, logits, loss in float32
            h = TF.cast(h, self.head_dtype)
        return self.fc(h)
