"""chainer_tc.serializers.load_npz: Chainer's load_npz without unpickling."""
import io
import os

import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer)
import chainer
import chainer.links as L
from chainer import training
from chainer.training import extensions

from chainer_tc import optimizers
from chainer_tc import serializers


class _CreatesMarker(object):
    """Unpickling this object creates the file ``path`` (what an attacker's payload would do)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, 'w')


def _crafted_npz(path, marker):
    good = L.Linear(3, 2)
    arrays = chainer.serializers.npz.serialize(good)
    arrays['b'] = numpy.array([_CreatesMarker(marker)], dtype=object)
    numpy.savez(path, **arrays)


def test_the_crafted_file_does_run_code_under_chainers_loader(tmp_path):
    """The control: Chainer's own load_npz unpickles, and the marker appears."""
    marker = str(tmp_path / 'chainer_marker')
    _crafted_npz(str(tmp_path / 'evil.npz'), marker)
    with pytest.raises(Exception):
        chainer.serializers.load_npz(str(tmp_path / 'evil.npz'), L.Linear(3, 2))
    assert os.path.exists(marker)


def test_object_array_refused_with_its_key_and_nothing_runs(tmp_path):
    marker = str(tmp_path / 'marker')
    _crafted_npz(str(tmp_path / 'evil.npz'), marker)
    link = L.Linear(3, 2)
    with pytest.raises(ValueError, match=r"refusing to load 'b' from .*evil\.npz.*object array"):
        serializers.load_npz(str(tmp_path / 'evil.npz'), link)
    assert not os.path.exists(marker)
    # an object array under a key that is never read is never looked at
    serializers.load_npz(str(tmp_path / 'evil.npz'), L.Linear(3, 2, nobias=True))
    assert not os.path.exists(marker)


def test_a_0d_object_array_that_is_not_none_is_refused(tmp_path):
    marker = str(tmp_path / 'marker')
    arrays = chainer.serializers.npz.serialize(L.Linear(3, 2))
    arrays['b'] = numpy.array(_CreatesMarker(marker), dtype=object)      # shape (), like None
    numpy.savez(str(tmp_path / 'evil.npz'), **arrays)
    with pytest.raises(ValueError, match="refusing to load 'b'"):
        serializers.load_npz(str(tmp_path / 'evil.npz'), L.Linear(3, 2))
    assert not os.path.exists(marker)


def test_same_values_as_chainers_loader(tmp_path):
    numpy.random.seed(1)
    src = L.Classifier(L.Linear(4, 3))
    chainer.serializers.save_npz(str(tmp_path / 'm.npz'), src)
    ours, theirs = L.Classifier(L.Linear(4, 3)), L.Classifier(L.Linear(4, 3))
    serializers.load_npz(str(tmp_path / 'm.npz'), ours)
    chainer.serializers.load_npz(str(tmp_path / 'm.npz'), theirs)
    for (n1, p1), (n2, p2) in zip(sorted(ours.namedparams()), sorted(theirs.namedparams())):
        assert n1 == n2 and numpy.array_equal(p1.array, p2.array)
    # path=, from a file object
    inner = L.Linear(4, 3)
    with open(str(tmp_path / 'm.npz'), 'rb') as f:
        serializers.load_npz(io.BytesIO(f.read()), inner, path='predictor/')
    assert numpy.array_equal(inner.W.array, src.predictor.W.array)


def test_none_values_load_as_none(tmp_path):
    """Chainer saves an uninitialised parameter as numpy.asarray(None)."""
    chainer.serializers.save_npz(str(tmp_path / 'lazy.npz'), L.Linear(None, 2))
    link = L.Linear(None, 2)
    serializers.load_npz(str(tmp_path / 'lazy.npz'), link)
    assert link.W.array is None


def test_strict_and_ignore_names(tmp_path):
    chainer.serializers.save_npz(str(tmp_path / 'nobias.npz'), L.Linear(3, 2, nobias=True))
    with pytest.raises(KeyError, match="'b'"):
        serializers.load_npz(str(tmp_path / 'nobias.npz'), L.Linear(3, 2))
    link = L.Linear(3, 2)
    b = link.b.array.copy()
    serializers.load_npz(str(tmp_path / 'nobias.npz'), link, strict=False)
    assert numpy.array_equal(link.b.array, b)
    serializers.load_npz(str(tmp_path / 'nobias.npz'), L.Linear(3, 2), ignore_names='b')


def test_not_an_npz(tmp_path):
    numpy.save(str(tmp_path / 'one.npy'), numpy.zeros(3))
    with pytest.raises(ValueError, match='single .npy array, not an .npz'):
        serializers.load_npz(str(tmp_path / 'one.npy'), L.Linear(3, 2))
    with open(str(tmp_path / 'pickle.npz'), 'wb') as f:
        f.write(b'\x80\x03cbuiltins\nprint\n.')
    with pytest.raises(ValueError, match='not a valid .npz file .*read it as a pickle, which is '
                                         'refused'):
        serializers.load_npz(str(tmp_path / 'pickle.npz'), L.Linear(3, 2))
    (tmp_path / 'text').write_text('not an archive')
    with pytest.raises(ValueError, match="'.*text' is not a valid .npz file"):
        serializers.read_npz(str(tmp_path / 'text'))
    (tmp_path / 'empty').write_bytes(b'')        # (numpy: EOFError 'No data left in file')
    for load in (lambda f: serializers.load_npz(f, L.Linear(3, 2)), serializers.read_npz):
        with pytest.raises(ValueError, match=r"'.*empty' is empty \(0 bytes\), not an .npz "
                                             r'file: a save that did not finish\?'):
            load(str(tmp_path / 'empty'))


def _trainer(out, stop):
    numpy.random.seed(3)
    r = numpy.random.RandomState(0)
    data = chainer.datasets.TupleDataset(r.randn(40, 5).astype(numpy.float32),
                                         r.randint(0, 3, 40).astype(numpy.int32))
    model = L.Classifier(L.Linear(5, 3))
    opt = optimizers.MomentumSGD(lr=0.1, weight_decay=1e-4).setup(model)
    opt.loss_scaling(interval=2)
    it = chainer.iterators.SerialIterator(data, 6, shuffle=True)
    trainer = training.Trainer(training.StandardUpdater(it, opt), (stop, 'iteration'), out=out)
    trainer.extend(extensions.LogReport(trigger=(1, 'iteration')))
    trainer.extend(extensions.ExponentialShift('lr', 0.9), trigger=(2, 'iteration'))
    trainer.extend(extensions.snapshot(filename='snap_{.updater.iteration}'),
                   trigger=(5, 'iteration'))
    return trainer, model


def test_trainer_snapshot_resumes_like_an_uninterrupted_run(tmp_path):
    full, full_model = _trainer(str(tmp_path / 'full'), 12)
    full.run()
    first, _ = _trainer(str(tmp_path / 'first'), 5)
    first.run()
    resumed, resumed_model = _trainer(str(tmp_path / 'resumed'), 12)
    serializers.load_npz(str(tmp_path / 'first' / 'snap_5'), resumed)
    assert resumed.updater.iteration == 5
    assert resumed.updater.get_optimizer('main').t == 5
    resumed.run()
    assert resumed.updater.iteration == 12
    assert resumed.updater.get_optimizer('main').lr == full.updater.get_optimizer('main').lr
    for (n1, p1), (n2, p2) in zip(sorted(full_model.namedparams()),
                                  sorted(resumed_model.namedparams())):
        numpy.testing.assert_array_equal(p1.array, p2.array, err_msg=n1)
