"""Small models shared by several test files (imported by name, as dali_data)."""
import numpy

import chainer
import chainer.functions as F
import chainer.links as L


class SizesNet(chainer.Link):
    """1-D parameters of the given sizes (awkward ones: around the optimizer kernel's chunk,
    2048, and alignment, 128, boundaries)."""

    def __init__(self, sizes, dtype, seed=0):
        super().__init__()
        r = numpy.random.RandomState(seed)
        with self.init_scope():
            for i, n in enumerate(sizes):
                setattr(self, 'p{}'.format(i), chainer.Parameter(r.randn(n).astype(dtype)))

    def set_grads(self, seed, scale=1.0):
        """Gradients as a loss scaled by ``scale`` would give them: the unscaled values, rounded
        to the parameter's dtype, times the scale (exact for a power of two). Drawn by NumPy
        whatever the device, so a GPU model gets the same numbers as a CPU one, on its device."""
        r = numpy.random.RandomState(seed)
        for _, p in sorted(self.namedparams()):
            p.grad = p.device.send(r.randn(*p.shape).astype(p.dtype) * p.dtype.type(scale))


class ConvBNLinear(chainer.Chain):
    """conv 3->4 (3x3, bias), BN, ReLU, linear to 5 classes, for (N, 3, 6, 6) input: a real
    backward pass through Chainer's stock links."""

    def __init__(self, dtype=numpy.float32, seed=0):
        super().__init__()
        init = chainer.initializers.Normal(0.3, dtype=dtype, rng=numpy.random.RandomState(seed))
        with self.init_scope():
            self.conv = L.Convolution2D(3, 4, 3, initialW=init,
                                        initial_bias=chainer.initializers.Zero(dtype))
            self.bn = L.BatchNormalization(4, dtype=dtype)
            self.fc = L.Linear(4 * 4 * 4, 5, initialW=init,
                               initial_bias=chainer.initializers.Zero(dtype))

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))))


class ConvertibleNet(chainer.Chain):
    """Every link kind ``to_nhwc`` converts: conv (bias, padding), BN, a grouped 1x1 conv, BN
    without gamma, linear; ``forward(x, nhwc)`` in either layout."""

    def __init__(self, bn_dtype=None):
        super().__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(3, 8, 3, pad=1)
            self.bn = L.BatchNormalization(8, dtype=bn_dtype)
            self.blocks = chainer.ChainList(L.Convolution2D(8, 8, 1, nobias=True, groups=2),
                                            L.BatchNormalization(8, use_gamma=False))
            self.fc = L.Linear(8, 4)

    def forward(self, x, nhwc=False):
        h = F.relu(self.bn(self.conv(x)))
        h = self.blocks[1](self.blocks[0](h))
        return self.fc(F.mean(h, axis=(1, 2) if nhwc else (2, 3)))
