"""Optimizer files hold a channels-last filter's momentum (and float32 master) in Chainer's
layout, as the filter itself: a run resumes across to_nhwc / to_nchw through its files."""
import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer)
import chainer
import chainer.functions as F
import chainer.links as L

from chainer_tc import links as TL
from chainer_tc import optimizers
from chainer_tc.optimizers import _file_layout


class Net(chainer.Chain):
    """A 3x3 convolution on 3 channels: its NCHW and NHWC filter shapes coincide, so only the
    layout, not a shape error, tells a transposed momentum from a right one."""

    def __init__(self, nhwc, pad_channels=None):
        super().__init__()
        r = numpy.random.RandomState(0)
        w = r.randn(4, 3, 3, 3) * 0.3           # in the config's dtype, as Chainer casts it
        with self.init_scope():
            if nhwc:
                self.conv = TL.Convolution2D(3, 4, 3, pad=1, initialW=w, pad_channels=pad_channels)
            else:
                self.conv = L.Convolution2D(3, 4, 3, pad=1, initialW=w)
            self.fc = L.Linear(4 * 5 * 5, 5, initialW=r.randn(5, 100) * 0.1)
        self.nhwc = nhwc

    def forward(self, x, t):
        x = x.astype(self.fc.W.dtype)
        h = F.relu(self.conv(x.transpose(0, 2, 3, 1).copy() if self.nhwc else x))
        h = h.transpose(0, 3, 1, 2) if self.nhwc else h
        return F.softmax_cross_entropy(F.cast(self.fc(h), numpy.float32), t)


def batch(step):
    r = numpy.random.RandomState(step)
    return r.randn(4, 3, 5, 5).astype(numpy.float32), r.randint(0, 5, 4).astype(numpy.int32)


def make_optimizer(kind, model):
    cls = chainer.optimizers.MomentumSGD if kind == 'chainer' else optimizers.MomentumSGD
    opt = cls(lr=0.1, momentum=0.9)
    opt.setup(model)
    return opt


def nchw_filter(model):
    w = model.conv.W.array
    if not model.nhwc:
        return w.copy()
    return w[..., :3].transpose(0, 3, 1, 2).copy()


def train(model, opt, steps):
    for step in steps:
        opt.update(model, *batch(step))


def resumed(tmp_path, write, read):
    """Two steps in layout/optimizer ``write``, saved, loaded into ``read``, two more steps."""
    (w_layout, w_opt, w_pad), (r_layout, r_opt, r_pad) = write, read
    model = Net(w_layout == 'NHWC', w_pad)
    opt = make_optimizer(w_opt, model)
    train(model, opt, range(2))
    chainer.serializers.save_npz(str(tmp_path / 'model.npz'), model)
    chainer.serializers.save_npz(str(tmp_path / 'opt.npz'), opt)
    model = Net(r_layout == 'NHWC', r_pad)
    opt = make_optimizer(r_opt, model)
    chainer.serializers.load_npz(str(tmp_path / 'model.npz'), model)
    chainer.serializers.load_npz(str(tmp_path / 'opt.npz'), opt)
    train(model, opt, range(2, 4))
    return nchw_filter(model), model.fc.W.array.copy()


def uninterrupted():
    model = Net(False)
    opt = make_optimizer('chainer_tc', model)
    train(model, opt, range(4))
    return nchw_filter(model), model.fc.W.array.copy()


@pytest.mark.parametrize('write,read', [
    (('NCHW', 'chainer', None), ('NHWC', 'chainer_tc', None)),       # Chainer's run, migrated
    (('NCHW', 'chainer_tc', None), ('NHWC', 'chainer_tc', None)),
    (('NCHW', 'chainer_tc', None), ('NHWC', 'chainer_tc', 4)),       # padded filter
    (('NHWC', 'chainer_tc', None), ('NCHW', 'chainer_tc', None)),    # and back
    (('NHWC', 'chainer_tc', 4), ('NCHW', 'chainer', None)),          # back to Chainer's
    (('NHWC', 'chainer_tc', 4), ('NHWC', 'chainer_tc', None)),
])
def test_a_run_resumes_across_layouts_through_its_files(tmp_path, write, read):
    got = resumed(tmp_path, write, read)
    ref = uninterrupted()
    for a, b, what in zip(got, ref, ('conv W', 'fc W')):
        numpy.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=what)


def test_float16_masters_go_across_layouts_too(tmp_path):
    """The float32 master and the momentum land transposed, bit for bit, padding zeroed (the
    runs themselves differ by the float16 convolutions' summation order)."""
    with chainer.using_config('dtype', numpy.float16):
        model = Net(False)
        opt = make_optimizer('chainer_tc', model)
        train(model, opt, range(2))
        chainer.serializers.save_npz(str(tmp_path / 'opt.npz'), opt)
        other = Net(True, pad_channels=4)
        again = make_optimizer('chainer_tc', other)
        train(other, again, [5])
        chainer.serializers.load_npz(str(tmp_path / 'opt.npz'), again)
    want, got = model.conv.W.update_rule.state, other.conv.W.update_rule.state
    assert set(got) == {'v', 'master'}
    for key in ('v', 'master'):
        numpy.testing.assert_array_equal(got[key][..., :3], want[key].transpose(0, 2, 3, 1),
                                         err_msg=key)
        assert (got[key][..., 3] == 0).all()


def test_the_file_holds_chainer_layout_and_says_so(tmp_path):
    model = Net(True, pad_channels=4)
    opt = make_optimizer('chainer_tc', model)
    train(model, opt, range(2))
    saved = {}
    chainer.serializers.DictionarySerializer(saved).save(opt)
    assert bool(saved[_file_layout.LAYOUT_KEY])
    v = model.conv.W.update_rule.state['v']
    assert saved['conv/W/v'].shape == (4, 3, 3, 3)
    numpy.testing.assert_array_equal(saved['conv/W/v'], v[..., :3].transpose(0, 3, 1, 2))
    assert (v[..., 3] == 0).all()


def test_an_earlier_chainer_tc_file_is_read_in_the_parameters_layout(tmp_path):
    """Files written before the layout key held the state as the parameter (NHWC)."""
    model = Net(True)
    opt = make_optimizer('chainer_tc', model)
    train(model, opt, range(2))
    saved = {}
    chainer.serializers.DictionarySerializer(saved).save(opt)
    del saved[_file_layout.LAYOUT_KEY]
    saved['conv/W/v'] = model.conv.W.update_rule.state['v'].copy()       # as it was written
    other = Net(True)
    again = make_optimizer('chainer_tc', other)
    train(other, again, [7])                   # a different momentum, to be overwritten
    again.serialize(chainer.serializers.NpzDeserializer(saved))
    numpy.testing.assert_array_equal(other.conv.W.update_rule.state['v'],
                                     model.conv.W.update_rule.state['v'])


def test_a_state_of_another_shape_is_refused_naming_it_and_nothing_changes():
    model = Net(True)
    opt = make_optimizer('chainer_tc', model)
    train(model, opt, range(2))
    saved = {}
    chainer.serializers.DictionarySerializer(saved).save(opt)
    saved['conv/W/v'] = numpy.zeros((4, 2, 3, 3), numpy.float32)
    v = model.conv.W.update_rule.state['v'].copy()
    t = opt.t
    with pytest.raises(ValueError, match=r"optimizer state 'v' of /conv/W .*\(4, 2, 3, 3\)"):
        opt.serialize(chainer.serializers.NpzDeserializer(saved))
    numpy.testing.assert_array_equal(model.conv.W.update_rule.state['v'], v)
    assert opt.t == t


def test_before_the_first_update_the_state_waits_in_the_parameters_layout(tmp_path):
    """A fresh optimizer (no buffers yet) takes the file's momentum at its first update."""
    got = []
    for load_before_update in (False, True):
        model = Net(False)
        opt = make_optimizer('chainer_tc', model)
        train(model, opt, range(2))
        chainer.serializers.save_npz(str(tmp_path / 'opt.npz'), opt)
        chainer.serializers.save_npz(str(tmp_path / 'model.npz'), model)
        other = Net(True)
        again = make_optimizer('chainer_tc', other)
        if not load_before_update:
            train(other, again, [9])
        chainer.serializers.load_npz(str(tmp_path / 'model.npz'), other)
        chainer.serializers.load_npz(str(tmp_path / 'opt.npz'), again)
        train(other, again, range(2, 4))
        got.append(nchw_filter(other))
    numpy.testing.assert_array_equal(got[0], got[1])


def test_chainers_optimizer_file_of_an_nhwc_model_is_read_in_the_parameters_layout():
    """Chainer's MomentumSGD saves our NHWC filter's momentum as it holds it: where that shape
    is not Chainer's layout's (in != kh), it is read as it is, and the run goes on as with
    Chainer's optimizer."""
    x = numpy.random.RandomState(1).randn(2, 5, 5, 4).astype(numpy.float32)
    convs = []
    for _ in range(2):
        conv = TL.Convolution2D(4, 2, 3)
        conv.W.array[...] = numpy.random.RandomState(0).randn(*conv.W.shape)
        opt = chainer.optimizers.MomentumSGD(lr=0.01).setup(conv)
        opt.update(lambda: F.sum(conv(x) ** 2))
        convs.append((conv, opt))
    (a, chainers), (b, _) = convs
    saved = {}
    chainer.serializers.DictionarySerializer(saved).save(chainers)
    assert saved['W/v'].shape == (2, 3, 3, 4)
    ours = optimizers.MomentumSGD(lr=0.01).setup(b)
    ours.serialize(chainer.serializers.NpzDeserializer(saved))
    chainers.update(lambda: F.sum(a(x) ** 2))
    ours.update(lambda: F.sum(b(x) ** 2))
    numpy.testing.assert_allclose(b.W.array, a.W.array, rtol=1e-5, atol=1e-6)
