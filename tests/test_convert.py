"""to_nhwc / to_nchw: links replaced in place, same function on transposed data, and back."""
import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer)
import chainer
import chainer.functions as F
import chainer.links as L

from chainer_tc import links as TL

from nets import ConvertibleNet as Net


def test_to_nhwc_and_back():
    numpy.random.seed(0)
    model = Net()
    x = numpy.random.RandomState(1).randn(2, 3, 5, 5).astype(numpy.float32)
    model(x)                                          # running statistics move away from 0/1
    with chainer.using_config('train', False):
        ref = model(x).array
    TL.to_nhwc(model)
    assert isinstance(model.conv, TL.Convolution2D) and isinstance(model.bn, TL.BatchNormalization)
    assert isinstance(model.blocks[0], TL.Convolution2D) and model.blocks[0].groups == 2
    assert model.blocks[1].gamma is None
    assert sorted(n for n, _ in model.namedparams()) == [
        '/blocks/0/W', '/blocks/1/beta', '/bn/beta', '/bn/gamma', '/conv/W', '/conv/b', '/fc/W',
        '/fc/b']
    with chainer.using_config('train', False):
        out = model(x.transpose(0, 2, 3, 1).copy(), nhwc=True).array
    numpy.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    TL.to_nchw(model)
    assert type(model.conv) is L.Convolution2D and type(model.bn) is L.BatchNormalization
    with chainer.using_config('train', False):
        numpy.testing.assert_allclose(model(x).array, ref, rtol=1e-5, atol=1e-6)


def test_a_top_level_link_is_returned_converted():
    conv = TL.to_nhwc(L.Convolution2D(3, 4, 3))
    assert isinstance(conv, TL.Convolution2D)


def test_unconvertible():
    with pytest.raises(ValueError, match=r'axis \(0, 1\)'):
        TL.to_nhwc(L.BatchNormalization(axis=(0, 1)))
    with pytest.raises(ValueError, match='fuses BatchNorm, Add and ReLU'):
        TL.to_nchw(TL.BatchNormAddReLU(4))
    with pytest.raises(TypeError, match='must be a chainer.Link'):
        TL.to_nhwc(object())


def test_sequential_forward_uses_the_converted_links():
    numpy.random.seed(0)
    seq = chainer.Sequential(L.Convolution2D(3, 4, 3, pad=1), L.BatchNormalization(4), F.relu)
    x = numpy.random.randn(2, 3, 5, 5).astype(numpy.float32)
    ref = seq(x).array
    TL.to_nhwc(seq)
    assert all(a is b for a, b in zip(seq._layers[:2], seq.children()))
    assert isinstance(seq._layers[0], TL.Convolution2D)
    y = seq(x.transpose(0, 2, 3, 1).copy()).array
    numpy.testing.assert_allclose(y.transpose(0, 3, 1, 2), ref, rtol=1e-5, atol=1e-5)
    params = {id(p) for p in seq.params()}
    seq.cleargrads()
    F.sum(seq(x.transpose(0, 2, 3, 1).copy())).backward()
    assert all(p.grad is not None for p in seq.params()), 'the optimizer trains what forward uses'
    assert len(params) == 4


class Plain(chainer.Chain):
    """conv -> BN -> linear; ``extra`` links added by the tests."""

    def __init__(self):
        super().__init__()
        r = numpy.random.RandomState(0)
        with self.init_scope():
            self.conv = L.Convolution2D(3, 4, 3, pad=1, initialW=r.randn(4, 3, 3, 3) * 0.3)
            self.bn = L.BatchNormalization(4)
            self.fc = L.Linear(None, 5, initialW=r.randn(5, 4 * 5 * 5) * 0.1)

    def forward(self, x, nhwc=False):
        h = F.relu(self.bn(self.conv(x)))
        return self.fc(h.transpose(0, 3, 1, 2) if nhwc else h)


def batch(n=4, seed=1):
    r = numpy.random.RandomState(seed)
    return r.randn(n, 3, 5, 5).astype(numpy.float32), r.randint(0, 5, n).astype(numpy.int32)


@pytest.mark.parametrize('optimizer', ['chainer', 'chainer_tc'])
def test_to_nhwc_after_optimizer_setup_keeps_training_like_the_nchw_model(optimizer):
    """Update rules go with the parameters (a frozen link, a per-parameter lr), and the
    momentum already gathered is transposed with the filter: the converted model goes on
    exactly as the NCHW one."""
    from chainer_tc import optimizers
    runs = []
    for convert in (False, True):
        model = Plain()
        make = (lambda: chainer.optimizers.MomentumSGD(lr=0.1)) if optimizer == 'chainer' \
            else (lambda: optimizers.MomentumSGD(lr=0.1))
        opt = make().setup(model)
        model.bn.disable_update()
        model.conv.b.update_rule.hyperparam.lr = 0.0
        x, t = batch()
        for i in range(4):
            if convert and i == 2:
                TL.to_nhwc(model)
            nhwc = isinstance(model.conv, TL.Convolution2D)
            xi = x.transpose(0, 2, 3, 1).copy() if nhwc else x
            opt.update(lambda: F.softmax_cross_entropy(model(xi, nhwc=nhwc), t))
        w = model.conv.W.array
        runs.append((w.transpose(0, 3, 1, 2) if convert else w, model.conv.b.array.copy(),
                     model.bn.gamma.array.copy(), model.fc.W.array.copy()))
    for a, b, what in zip(runs[0], runs[1], ('conv W', 'conv b (lr 0)', 'frozen gamma', 'fc W')):
        numpy.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=what)
    assert (runs[1][1] == 0).all() and (runs[1][2] == 1).all()


def test_initializers_go_with_the_links():
    lazy = TL.to_nhwc(L.Convolution2D(None, 4, 3, initialW=0.5, initial_bias=0.25))
    lazy(numpy.zeros((1, 5, 5, 2), numpy.float32))
    assert (lazy.W.array == 0.5).all() and (lazy.b.array == 0.25).all()
    bn = TL.to_nhwc(L.BatchNormalization(4, initial_gamma=0.0, initial_beta=2.0))
    again = bn.copy(mode='init')
    assert (again.gamma.array == 0).all() and (again.beta.array == 2).all()
    back = TL.to_nchw(TL.Convolution2D(3, 4, 3, initialW=0.5)).copy(mode='init')
    assert type(back) is L.Convolution2D and (back.W.array == 0.5).all()


class Held(chainer.Chain):
    """c0 then c1; c1 is held again in a list forward iterates, or is c0 shared by copy."""

    def __init__(self, share):
        super().__init__()
        with self.init_scope():
            self.c0 = L.Convolution2D(3, 3, 3, pad=1)
            self.c1 = self.c0.copy(mode='share') if share else L.Convolution2D(3, 3, 3, pad=1)
        self.stack = [self.c0, self.c1]

    def forward(self, x):
        for c in self.stack:
            x = c(x)
        return x


@pytest.mark.parametrize('share', [False, True])
def test_links_held_twice_and_shared_parameters_stay_so(share):
    x = batch()[0]
    numpy.random.seed(0)
    ref = Held(share)(x).array
    numpy.random.seed(0)
    model = TL.to_nhwc(Held(share))
    assert model.stack[0] is model.c0 and model.stack[1] is model.c1
    assert isinstance(model.c1, TL.Convolution2D)
    assert (model.c0.W.array is model.c1.W.array) == share
    model.c0.W.array[...] *= 2                 # one array, as after copy(mode='share')
    assert (model.c1.W.array[0, 0, 0, 0] == model.c0.W.array[0, 0, 0, 0]) == share
    model.c0.W.array[...] /= 2
    y = model(x.transpose(0, 2, 3, 1).copy()).array
    numpy.testing.assert_allclose(y.transpose(0, 3, 1, 2), ref, rtol=1e-5, atol=1e-5)


class Subclass(L.Convolution2D):
    pass


@pytest.mark.parametrize('make, what', [
    (lambda: Subclass(3, 3, 3), r'/c \(Subclass\) is a subclass of L.Convolution2D'),
    (lambda: L.DepthwiseConvolution2D(3, 1, 3), r'/c \(DepthwiseConvolution2D\) is a link that computes along'),
    (lambda: L.BatchRenormalization(3), r'/c \(BatchRenormalization\) is a subclass of '
                                        r'L.BatchNormalization'),
    (lambda: L.Deconvolution2D(3, 3, 3), r'/c \(Deconvolution2D\) is a link that computes')])
def test_a_channel_axis_link_without_counterpart_is_refused_before_anything_changes(make, what):
    model = chainer.Chain()
    with model.init_scope():
        model.a = L.Convolution2D(3, 3, 3)
        model.c = make()
    with pytest.raises(TypeError, match='cannot convert the model to NHWC: ' + what +
                                        r'.*nothing was changed'):
        TL.to_nhwc(model)
    assert type(model.a) is L.Convolution2D


def test_per_element_batch_normalization_is_refused_by_name():
    with pytest.raises(ValueError, match=r'cannot convert BatchNormalization: it normalises each '
                                         r'of 48 elements \(size=\(3, 4, 4\)\)'):
        TL.to_nhwc(L.BatchNormalization((3, 4, 4)))
    with pytest.raises(TypeError, match=r'size must be the channel count \(an int\) or None; '
                                        r'got \(4, 4, 3\)'):
        TL.BatchNormalization((4, 4, 3))


def test_a_refusal_found_late_in_the_model_still_changes_nothing():
    """The BN that cannot be converted comes after a convolution that can, whose optimizer
    state a conversion transposes: the refusal is made before any of it."""
    model = chainer.Sequential(TL.Convolution2D(3, 4, 3), TL.BatchNormAddReLU(4))
    rule = chainer.optimizers.MomentumSGD().setup(model)
    x = numpy.ones((1, 5, 5, 3), numpy.float32)
    rule.update(lambda: F.sum(model(x)))
    v = model[0].W.update_rule.state['v']
    with pytest.raises(ValueError, match='fuses BatchNorm, Add and ReLU'):
        TL.to_nchw(model)
    assert isinstance(model[0], TL.Convolution2D) and model[0].W.update_rule.state['v'] is v


@pytest.mark.filterwarnings(
    'ignore:chainermn.links.MultiNodeBatchNormalization is experimental:FutureWarning')
def test_multi_node_batch_normalization_links_are_told_apart_by_their_layout():
    """ChainerMN's MultiNodeBatchNormalization (NCHW) is refused by to_nhwc; chainer_tc's
    multinode link of the same name is NHWC already: to_nhwc leaves it (it was refused with
    the reason meant for ChainerMN's, while MultiNodeBatchNormAddReLU went through), and
    to_nchw refuses it, naming the order to convert in."""
    chainermn = pytest.importorskip('chainermn')
    from mpi4py import MPI
    from chainer_tc import multinode
    comm = chainermn.create_communicator('naive', MPI.COMM_SELF)
    model = chainer.Sequential(L.Convolution2D(3, 4, 3),
                               chainermn.links.MultiNodeBatchNormalization(4, comm))
    with pytest.raises(TypeError, match=r'/1 \(MultiNodeBatchNormalization\) is a link that '
                                        r'computes along the channel axis of NCHW data'):
        TL.to_nhwc(model)
    for cls in (multinode.MultiNodeBatchNormalization, multinode.MultiNodeBatchNormAddReLU):
        ours = chainer.Sequential(L.Convolution2D(3, 4, 3), cls(4, comm))
        mn = ours[1]
        TL.to_nhwc(ours)
        assert type(ours[0]) is TL.Convolution2D and ours[1] is mn
        with pytest.raises(TypeError, match=r'cannot convert the model to NCHW: /1 \({}\) is '
                                            r"chainer_tc.multinode's NHWC BatchNormalization.*"
                                            r'convert the model before chainer_tc.multinode.'
                                            r'create_mnbn_model'.format(cls.__name__)):
            TL.to_nchw(ours)
        assert type(ours[0]) is TL.Convolution2D
