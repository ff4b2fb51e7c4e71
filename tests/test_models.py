"""ResNet-50 in NCHW (Chainer's links) and NHWC (chainer_tc's): same numbers, no transposes, fewer
FunctionNodes, weights interchangeable, trains with chainer_tc's optimizer."""
import collections

import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer)
import chainer
import chainer.functions as F
from chainer import serializers

from chainer_tc import optimizers
from chainer_tc.models import ResNet50


class NodeCounter(chainer.FunctionHook):
    """FunctionNodes applied, by label (forward and backward)."""
    name = 'node_counter'

    def __init__(self):
        self.counts = collections.Counter()

    def forward_preprocess(self, function, in_data):
        self.counts[function.label] += 1


def make(layout, seed=0):
    numpy.random.seed(seed)
    return ResNet50(layout, n_classes=10, width=16)


def batch(layout, n=2, seed=0):
    r = numpy.random.RandomState(seed)
    x = r.randn(n, 3, 32, 32).astype(numpy.float32)
    t = r.randint(0, 10, n).astype(numpy.int32)
    return (x.transpose(0, 2, 3, 1).copy() if layout == 'NHWC' else x), t


def step(model, layout):
    x, t = batch(layout)
    counter = NodeCounter()
    with counter:
        loss = F.softmax_cross_entropy(model(x), t)
        model.cleargrads()
        loss.backward()
    return float(loss.array), counter.counts


def test_same_loss_and_gradients_in_both_layouts():
    nchw, nhwc = make('NCHW'), make('NHWC')
    l1, _ = step(nchw, 'NCHW')
    l2, _ = step(nhwc, 'NHWC')
    assert l1 == pytest.approx(l2, rel=1e-5)
    numpy.testing.assert_allclose(nhwc.conv1.W.grad, nchw.conv1.W.grad.transpose(0, 2, 3, 1),
                                  rtol=1e-3, atol=1e-5)
    numpy.testing.assert_allclose(nhwc.fc.W.grad, nchw.fc.W.grad, rtol=1e-3, atol=1e-5)


def test_nhwc_model_has_no_transposes_and_fewer_nodes():
    _, c_nchw = step(make('NCHW'), 'NCHW')
    _, c_nhwc = step(make('NHWC'), 'NHWC')
    assert not [k for k in c_nhwc if 'Transpose' in k]
    assert 'ReLU' not in c_nhwc and 'BatchNormalization' not in c_nhwc, 'BN+Add+ReLU are fused'
    assert c_nhwc['BatchNormAddAct'] == 53
    # reported in docs/performance.md (benchmarks/framework_overhead.py)
    assert sum(c_nhwc.values()) < sum(c_nchw.values())


def test_weights_move_between_layouts(tmp_path):
    nchw = make('NCHW', seed=1)
    x, _ = batch('NCHW')
    nchw(x)
    serializers.save_npz(str(tmp_path / 'resnet.npz'), nchw)
    nhwc = make('NHWC', seed=2)
    serializers.load_npz(str(tmp_path / 'resnet.npz'), nhwc)
    with chainer.using_config('train', False):
        numpy.testing.assert_allclose(nhwc(x.transpose(0, 2, 3, 1).copy()).array,
                                      nchw(x).array, rtol=1e-4, atol=1e-5)


def test_nhwc_model_trains_with_the_batched_optimizer(monkeypatch):
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1')     # every custom kernel, emulated
    model = make('NHWC')
    opt = optimizers.MomentumSGD(lr=0.05, weight_decay=1e-4,
                                 decay_filter=optimizers.skip_bn_and_bias).setup(model)
    x, t = batch('NHWC', n=4)
    losses = []
    for _ in range(8):
        loss = F.softmax_cross_entropy(model(x), t)
        losses.append(float(loss.array))
        opt.update(lambda: loss)
    assert losses[-1] < 0.5 * losses[0]


def test_bad_layout():
    with pytest.raises(ValueError, match="layout must be 'NCHW' or 'NHWC'; got 'nhwc'"):
        ResNet50('nhwc')
