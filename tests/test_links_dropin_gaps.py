"""Where the drop-in links and functions used to differ from Chainer's without a word:
to_nhwc/to_nchw dropped a link's hooks and the parameters or persistent values added to it; a
lazy convolution whose filter was filled without a first call kept an initializer drawing in the
NHWC shape; ``TL.BatchNormalization((C,))`` was refused; ``max_pooling_2d(return_indices=...)``
was an unexpected keyword; double backpropagation (refused) was documented for BN only."""
import inspect
import pickle

import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer)
import chainer
import chainer.functions as F
import chainer.link_hooks as LH
import chainer.links as L
from chainer import serializers

from chainer_tc import functions as TF
from chainer_tc import links as TL


def nhwc(x):
    return numpy.ascontiguousarray(x.transpose(0, 2, 3, 1))


# ---- to_nhwc / to_nchw refuse what a converted link carries besides its own ------------------

class Model(chainer.Chain):
    """first (a convolution with momentum gathered) -> block: conv -> bn."""

    def __init__(self, ours=False):
        super().__init__()
        conv, bn = (TL.Convolution2D, TL.BatchNormalization) if ours \
            else (L.Convolution2D, L.BatchNormalization)
        with self.init_scope():
            self.first = conv(3, 3, 3, pad=1)
            self.block = chainer.Chain()
            with self.block.init_scope():
                self.block.conv = conv(3, 4, 3, pad=1)
                self.block.bn = bn(4)
        self.optimizer = chainer.optimizers.MomentumSGD().setup(self)
        x = numpy.ones((1, 5, 5, 3) if ours else (1, 3, 5, 5), numpy.float32)
        self.optimizer.update(lambda: F.sum(self.block.bn(self.block.conv(self.first(x)))))


def add_extra_param(link, name='shift'):
    with link.init_scope():
        setattr(link, name, chainer.Parameter(numpy.zeros(4, numpy.float32)))


@pytest.mark.parametrize('add, what', [
    (lambda m: m.block.conv.add_hook(LH.SpectralNormalization()),
     r"/block/conv \(Convolution2D\) carries link hook 'SpectralNormalization' and persistent "
     r"value 'W_u', which the NHWC link replacing it would not get"),
    (lambda m: m.block.conv.add_hook(LH.WeightStandardization()),
     r"/block/conv \(Convolution2D\) carries link hook 'WeightStandardization', which"),
    (lambda m: m.block.conv.add_persistent('scale', 2.0),
     r"/block/conv \(Convolution2D\) carries persistent value 'scale', which"),
    (lambda m: add_extra_param(m.block.bn),
     r"/block/bn \(BatchNormalization\) carries parameter 'shift', which"),
    (lambda m: (add_extra_param(m.block.bn, 'b'), add_extra_param(m.block.bn, 'a')),
     r"/block/bn \(BatchNormalization\) carries parameters 'a', 'b', which"),
    (lambda m: m.block.bn.add_hook(LH.TimerHook()),
     r"/block/bn \(BatchNormalization\) carries link hook 'TimerHook', which")],
    ids=['SpectralNormalization', 'WeightStandardization', 'add_persistent', 'a BN parameter',
         'two BN parameters', 'a BN hook'])
def test_to_nhwc_refuses_hooks_and_extra_attributes_before_anything_changes(add, what):
    model = Model()
    add(model)
    hooks = dict(model.block.conv.local_link_hooks), dict(model.block.bn.local_link_hooks)
    w = model.first.W.array.copy()
    v = model.first.W.update_rule.state['v']
    with pytest.raises(ValueError, match='cannot convert the model to NHWC: ' + what +
                       r'.*nothing was changed\. Remove them from the link \(link.delete_hook'
                       r'\(name\).*convert, then add them to the new link'):
        TL.to_nhwc(model)
    assert type(model.first) is L.Convolution2D and type(model.block.conv) is L.Convolution2D
    assert type(model.block.bn) is L.BatchNormalization
    assert (dict(model.block.conv.local_link_hooks), dict(model.block.bn.local_link_hooks)) \
        == hooks
    numpy.testing.assert_array_equal(model.first.W.array, w)
    assert model.first.W.update_rule.state['v'] is v and v.shape == (3, 3, 3, 3)


def test_a_convolution_refusal_says_in_which_layout_a_hook_sees_the_filter():
    model = Model()
    model.block.conv.add_hook(LH.SpectralNormalization())
    with pytest.raises(ValueError, match=r'a hook that computes on W sees the filter as the new '
                                         r'link holds it, \(out, kh, kw, in/groups\)'):
        TL.to_nhwc(model)
    ours = Model(ours=True)
    ours.block.conv.add_hook(LH.SpectralNormalization())
    with pytest.raises(ValueError, match=r"cannot convert the model to NCHW: /block/conv "
                                         r"\(Convolution2D\) carries link hook "
                                         r"'SpectralNormalization'.*NCHW link.*"
                                         r'\(out, in/groups, kh, kw\)'):
        TL.to_nchw(ours)
    assert type(ours.first) is TL.Convolution2D and type(ours.block.conv) is TL.Convolution2D


def test_a_top_level_link_is_refused_by_its_path_naming_all_it_carries():
    conv = L.Convolution2D(3, 4, 3)
    conv.add_hook(LH.SpectralNormalization())
    conv.add_persistent('scale', 2.0)
    add_extra_param(conv)
    with pytest.raises(ValueError, match=r"NHWC: / \(Convolution2D\) carries link hook "
                                         r"'SpectralNormalization', parameter 'shift' and "
                                         r"persistent values 'W_u', 'scale', which"):
        TL.to_nhwc(conv)


@pytest.mark.parametrize('hook', [LH.SpectralNormalization, LH.WeightStandardization])
def test_the_advice_works_remove_the_hook_convert_and_add_it_again(hook):
    """What the refusal says to do gives the NCHW model's outputs (SpectralNormalization's
    vector W_u carried over by hand; both hooks work over axis 0, the same in either layout)."""
    numpy.random.seed(0)
    model = chainer.Sequential(L.Convolution2D(3, 4, 3, pad=1), L.BatchNormalization(4))
    model[0].add_hook(hook())
    x = numpy.random.RandomState(1).randn(2, 3, 5, 5).astype(numpy.float32)
    u = getattr(model[0], 'W_u', None)
    u = None if u is None else u.copy()
    ref = model(x).array
    model[0].delete_hook(hook.name)
    TL.to_nhwc(model)
    model[0].add_hook(hook())
    if u is not None:
        model[0].W_u[...] = u
    y = model(nhwc(x)).array
    numpy.testing.assert_allclose(y.transpose(0, 3, 1, 2), ref, rtol=1e-5, atol=1e-5)


def test_links_without_extras_still_convert_both_ways():
    """Chainer's own attributes (a bias-free convolution, BN without gamma/beta, a lazy BN
    called once) are not extras."""
    model = chainer.Sequential(L.Convolution2D(3, 4, 3, nobias=True),
                               L.BatchNormalization(4, use_gamma=False, use_beta=False),
                               L.BatchNormalization(axis=(0, 2, 3)))
    model[2](numpy.ones((2, 4, 3, 3), numpy.float32))
    TL.to_nhwc(model)
    assert [type(c) for c in model] == [TL.Convolution2D, TL.BatchNormalization,
                                        TL.BatchNormalization]
    TL.to_nchw(model)
    assert [type(c) for c in model] == [L.Convolution2D, L.BatchNormalization,
                                        L.BatchNormalization]


# ---- a lazy convolution's initializer draws in Chainer's layout, however W was filled --------

G = chainer.initializers.GlorotUniform
ARRAY = numpy.random.RandomState(3).randn(6, 3, 1, 7).astype(numpy.float32)


def fill_by(how, make_init, tmp_path):
    """A lazy NHWC link (6 outputs, a 1x7 window) whose filter was given its shape by ``how``
    (for 3 input channels), without a call unless ``how`` is 'call'."""
    source = L.Convolution2D(3, 6, (1, 7), initialW=make_init())
    if how == 'to_nhwc':
        lazy = L.Convolution2D(None, 6, (1, 7), initialW=make_init())
        lazy(numpy.zeros((1, 3, 2, 8), numpy.float32))
        return TL.to_nhwc(lazy)
    link = TL.Convolution2D(None, 6, (1, 7), initialW=make_init())
    if how == 'call':
        link(numpy.zeros((1, 2, 8, 3), numpy.float32))
    elif how == 'load_npz':
        serializers.save_npz(str(tmp_path / 'conv.npz'), source)
        serializers.load_npz(str(tmp_path / 'conv.npz'), link)
    elif how == 'copyparams from L.Convolution2D':
        link.copyparams(source)
    elif how == 'copyparams from TL.Convolution2D':
        link.copyparams(TL.Convolution2D(3, 6, (1, 7), initialW=make_init()))
    return link


@pytest.mark.parametrize('make_init', [G, chainer.initializers.HeNormal, lambda: ARRAY],
                         ids=['GlorotUniform', 'HeNormal', 'array'])
@pytest.mark.parametrize('how', ['call', 'load_npz', 'copyparams from L.Convolution2D',
                                 'copyparams from TL.Convolution2D', 'to_nhwc'])
def test_copy_init_of_a_lazy_link_draws_chainers_filter(how, make_init, tmp_path):
    """The same random state gives the filter Chainer's link draws, transposed (the fans of
    Chainer's (out, in, kh, kw) shape; an array initialW is in Chainer's layout)."""
    link = fill_by(how, make_init, tmp_path)
    assert link.W.shape == (6, 1, 7, 3)
    ref = L.Convolution2D(3, 6, (1, 7), initialW=make_init())
    numpy.random.seed(0)
    want = ref.copy(mode='init').W.array
    numpy.random.seed(0)
    got = link.copy(mode='init').W.array
    numpy.testing.assert_array_equal(got.transpose(0, 3, 1, 2), want)
    numpy.random.seed(1)
    want = [c.W.array for c in ref.repeat(2, mode='init')]
    numpy.random.seed(1)
    got = [c.W.array.transpose(0, 3, 1, 2) for c in link.repeat(2, mode='init')]
    numpy.testing.assert_array_equal(got, want)


def test_a_lazy_link_pickled_with_the_raw_initializer_draws_chainers_filter(tmp_path):
    """A lazy link filled by load_npz and pickled before the initializer was wrapped at
    construction (its W.initializer the raw GlorotUniform) is wrapped when unpickled."""
    link = fill_by('load_npz', G, tmp_path)
    link.W.initializer = link.W.initializer.base            # as an earlier version left it
    link = pickle.loads(pickle.dumps(link))
    ref = L.Convolution2D(3, 6, (1, 7), initialW=G())
    numpy.random.seed(0)
    want = ref.copy(mode='init').W.array
    numpy.random.seed(0)
    numpy.testing.assert_array_equal(link.copy(mode='init').W.array.transpose(0, 3, 1, 2), want)


def test_to_nchw_of_a_lazy_link_gives_chainer_its_own_initializer():
    link = TL.Convolution2D(None, 6, (1, 7), initialW=G())
    link(numpy.zeros((1, 2, 8, 3), numpy.float32))
    back = TL.to_nchw(link)
    assert type(back.W.initializer) is G
    ref = L.Convolution2D(3, 6, (1, 7), initialW=G())
    numpy.random.seed(0)
    want = ref.copy(mode='init').W.array
    numpy.random.seed(0)
    numpy.testing.assert_array_equal(back.copy(mode='init').W.array, want)


# ---- BatchNormalization of size (C,) ---------------------------------------------------------

@pytest.mark.parametrize('size', [(4,), [4], (numpy.int64(4),)])
@pytest.mark.parametrize('cls', [TL.BatchNormalization, TL.BatchNormAddReLU])
def test_a_one_tuple_size_is_the_channel_count(cls, size):
    """``L.BatchNormalization((4,))`` is per channel, as size=4; so is ours."""
    link = cls(size)
    assert link.avg_mean.shape == link.gamma.shape == (4,)
    ref = L.BatchNormalization((4,))
    x = numpy.random.RandomState(0).randn(3, 4, 2, 2).astype(numpy.float32)
    ref.gamma.array[...] = link.gamma.array[...] = [1, 2, 3, 4]
    want = ref(x).array
    if cls is TL.BatchNormAddReLU:
        want = numpy.maximum(want, 0)
    numpy.testing.assert_allclose(link(nhwc(x)).array.transpose(0, 3, 1, 2), want,
                                  rtol=1e-5, atol=1e-5)
    numpy.testing.assert_allclose(link.avg_mean, ref.avg_mean, rtol=1e-6)


@pytest.mark.parametrize('size, why', [
    ((4, 4, 3), r'got \(4, 4, 3\), a size of 3 axes: a BatchNormalization of each element has '
                r'no channels-last form \(use L.BatchNormalization\); a 1-tuple \(C,\) is '
                r'taken as C'),
    ((), r'got \(\) \(a 1-tuple \(C,\) is taken as C\)'),
    ((4.0,), r'got \(4.0,\) \(a 1-tuple'),
    ((True,), r'got \(True,\) \(a 1-tuple'),
    ('4', r"got '4' \(a 1-tuple")])
def test_other_sizes_are_refused_saying_what_is_accepted(size, why):
    with pytest.raises(TypeError, match=r'BatchNormalization: size must be the channel count '
                                        r'\(an int\) or None; ' + why):
        TL.BatchNormalization(size)


# ---- max_pooling_2d(return_indices=...) -------------------------------------------------------

def test_max_pooling_takes_chainers_arguments_and_refuses_return_indices():
    assert list(inspect.signature(TF.max_pooling_2d).parameters) == \
        list(inspect.signature(F.max_pooling_2d).parameters)
    x = numpy.random.RandomState(0).randn(2, 4, 4, 3).astype(numpy.float32)
    numpy.testing.assert_array_equal(TF.max_pooling_2d(x, 2, return_indices=False).array,
                                     TF.max_pooling_2d(x, 2).array)
    for call in (lambda: TF.max_pooling_2d(x, 2, return_indices=True),
                 lambda: TF.max_pooling_2d(x, 2, 2, 0, True, True)):
        with pytest.raises(NotImplementedError, match=r'max_pooling_2d: return_indices=True is '
                                                      r'not supported.*F.upsampling_2d.*'
                                                      r'F.max_pooling_2d\(F.transpose\(x, '
                                                      r'\(0, 3, 1, 2\)\)'):
            call()


# ---- double backpropagation: refused, as docs/functions.md says ------------------------------

@pytest.mark.parametrize('f', [
    lambda x: TF.convolution_2d(x, numpy.ones((2, 3, 3, 3), numpy.float32), pad=1),
    lambda x: TF.max_pooling_2d(x, 2),
    lambda x: TF.average_pooling_2d(x, 2)], ids=['convolution', 'max', 'average'])
def test_double_backpropagation_raises(f):
    """A gradient penalty: the first gradient with enable_double_backprop, then backward."""
    x = chainer.Variable(numpy.random.RandomState(0).randn(2, 4, 4, 3).astype(numpy.float32))
    gx, = chainer.grad([F.sum(f(x) ** 2)], [x], enable_double_backprop=True)
    with pytest.raises(NotImplementedError, match='double backpropagation'):
        F.sum(gx ** 2).backward()


@pytest.mark.parametrize('height', [8, 3])
def test_spectral_normalization_added_before_a_lazy_links_first_call_equals_chainers(height):
    """Chainer's SpectralNormalization initialises a lazy link itself at the first call, from
    the input's axis 1 (NCHW's channels): on an NHWC link that is the image height, and the
    call failed with a misleading layout error (or, with as many rows as channels, only
    happened to work). The link now makes its filter from the input's last axis before its
    hooks run: the same outputs, filter and W_u as Chainer's link on NCHW data."""
    x = numpy.random.RandomState(0).randn(2, 3, height, 5).astype(numpy.float32)
    out = {}
    for name, make, data in (('chainer', L.Convolution2D, x), ('ours', TL.Convolution2D, nhwc(x))):
        link = make(None, 4, 3, pad=1,
                    initialW=chainer.initializers.Normal(0.3, rng=numpy.random.RandomState(1)))
        link.add_hook(LH.SpectralNormalization())
        numpy.random.seed(2)                            # (W_u is drawn at the first call)
        y = link(data).array
        out[name] = (y if name == 'chainer' else y.transpose(0, 3, 1, 2), link.W_u.copy(),
                     link.W.array if name == 'chainer' else link.W.array.transpose(0, 3, 1, 2))
    for a, b, what in zip(out['chainer'], out['ours'], ('y', 'W_u', 'W')):
        numpy.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=what)
