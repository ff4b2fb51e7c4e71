"""What Chainer users do with an iterator and its Evaluator, done with chainer_tc.dali (found by
an audit of DaliIterator as a drop-in for Chainer's iterators): a copy is an iterator of its own;
settings the pipeline was built for cannot be changed silently; an Evaluator over a repeating
DaliIterator warns as Chainer's does for its own; an eval_hook's eval_func is kept; float16
values are summed without overflow; NumPy's global seed repeats a run; an error that is not
DALI's passes through as it is. CPU pipelines over a small generated image set."""
import copy
import gc
import warnings

import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer)
import chainer
from chainer import training

from chainer_tc import dali

import dali_data

N = 7


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    return dali_data.make_dataset(tmp_path_factory.mktemp('dali_dropin'), n=N)


def make(data, batch=2, repeat=False, **kwargs):
    pipe = dali.imagenet_pipeline(data.root, data.ids_list, device='cpu', crop=32, seed=7,
                                  num_threads=1, train=False, **kwargs)
    return dali.DaliIterator(pipe, batch, repeat=repeat)


def labels(iterator):
    return [int(t) for _, ts in iterator for t in ts]


def test_a_copy_is_an_iterator_of_its_own_at_the_same_position(data):
    """Chainer's Evaluator docstring has users copy an iterator to reuse it (a SerialIterator's
    copy is independent; MultiprocessIterator's __copy__ makes a new one). A shallow copy of a
    DaliIterator shared its pipeline: iterating it used up the original (an Evaluator over a
    copy saw no batch) and collecting it shut the original's pipeline down."""
    base = make(data)
    first = next(base)[1].tolist()
    passes = [labels(copy.copy(base)) for _ in range(3)]
    assert passes == [list(range(2, N))] * 3
    other = copy.copy(base)
    del other
    gc.collect()
    assert (base.epoch, base.current_position) == (0, 2)
    assert first + labels(base) == list(range(N))


def test_a_deep_copy_is_one_too_and_pickling_says_what_to_do(data):
    import pickle
    base = make(data)
    next(base)
    assert labels(copy.deepcopy(base)) == list(range(2, N))
    assert labels(base) == list(range(2, N))
    with pytest.raises(TypeError, match=r'a DaliIterator holds a running DALI pipeline and '
                                        r'cannot be pickled: save its position'):
        pickle.dumps(base)


def test_settings_the_pipeline_was_built_for_refuse_a_new_value(data):
    it = make(data)
    for name, value in (('batch_size', 3), ('repeat', True), ('shuffle', True),
                        ('last_batch', 'drop')):
        with pytest.raises(AttributeError, match=r'DaliIterator\.{} is fixed when the '
                                                 r'iterator is made'.format(name)):
            setattr(it, name, value)
    assert (it.batch_size, it.repeat, it.shuffle) == (2, False, False)
    assert [len(ts) for _, ts in it] == [2, 2, 2, 1]


class Mean(chainer.Link):
    def forward(self, x, t):
        chainer.report({'label': numpy.asarray(t, numpy.float64).mean()}, self)


def test_an_evaluator_over_a_repeating_dali_iterator_warns_as_chainer_s_does(data):
    with pytest.warns(UserWarning, match=r"the DaliIterator 'main' of this Evaluator repeats "
                                         r'\(repeat=True, the default\)'):
        dali.Evaluator(make(data, repeat=True), Mean(), converter=dali.converter)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        dali.Evaluator(make(data), Mean(), converter=dali.converter)


@pytest.mark.parametrize('multinode', [False, True])
def test_an_eval_func_an_eval_hook_sets_is_kept_as_chainer_keeps_it(data, multinode):
    """Chainer's Evaluator reads eval_func before calling eval_hook: what the hook sets is used
    from the next evaluation. Ours put its own back over it (multinode.Evaluator too: found by
    review; one process, COMM_SELF)."""
    def other(x, t):
        chainer.report({'label': numpy.asarray(t, numpy.float64).mean()})

    def hook(evaluator):
        evaluator.eval_func = other
    if multinode:
        import chainermn
        from mpi4py import MPI
        from chainer_tc import multinode as mn
        ev = mn.Evaluator(make(data), Mean(), chainermn.create_communicator('naive',
                                                                            MPI.COMM_SELF),
                          converter=dali.converter, eval_hook=hook)
    else:
        ev = dali.Evaluator(make(data), Mean(), converter=dali.converter, eval_hook=hook)
    first, second = ev(), ev()
    assert ev.eval_func is other
    assert list(first) == ['main/label'] and list(second) == ['label']
    assert second['label'] == pytest.approx((N - 1) / 2.0)


class Seven(chainer.Link):
    """Reports float16 values (as a float16 model's loss is), on the device of its input."""

    def forward(self, x):
        xp = chainer.backend.get_array_module(x)
        chainer.report({'v': xp.asarray(7.0, numpy.float16),
                        'v2': chainer.Variable(xp.asarray(0.5, numpy.float16))}, self)


def test_float16_values_are_weighted_in_float32():
    """Each value is weighted by its batch's size, and DictSummary sums value * weight in the
    value's dtype: in float16 (CuPy keeps it), 300 batches of 250 images reporting 7.0 pass
    65504 (inf), where Chainer's per-batch sum stays finite. (NumPy happens to widen it: the
    overflow itself is the GPU test below.)"""
    from chainer_tc.dali import evaluator
    model = Seven()
    reporter = chainer.Reporter()
    reporter.add_observer('main', model)
    observed = {}
    with reporter.scope(observed):
        evaluator._weighted_by_batch(model)(numpy.zeros((250, 1), numpy.float32))
    for key, want in (('main/v', 7.0), ('main/v2', 0.5)):
        value, weight = observed[key]
        assert (value.dtype, float(value), weight) == (numpy.float32, want, 250), key


@pytest.mark.gpu
def test_float16_values_weighted_by_batch_size_do_not_overflow_on_the_gpu():
    import cupy
    x = cupy.zeros((300 * 250, 1), numpy.float32)
    it = chainer.iterators.SerialIterator(x, 250, repeat=False, shuffle=False)
    result = dali.Evaluator(it, Seven(), device='@cupy:0')()
    assert (float(result['main/v']), float(result['main/v2'])) == (7.0, 0.5)


def test_numpy_s_global_seed_repeats_a_drawn_seed(data):
    """With seed=None the seed came from the OS: numpy.random.seed(n), which repeats Chainer's
    shuffling iterators, did not repeat a DaliIterator's order."""
    orders = []
    for _ in range(2):
        numpy.random.seed(0)
        pipe = dali.imagenet_pipeline(data.root, data.ids_list, device='cpu', crop=32,
                                      num_threads=1, train=False)
        it = dali.DaliIterator(pipe, N, repeat=True, shuffle=True)
        orders.append((pipe.seed, [next(it)[1].tolist() for _ in range(3)]))
    assert orders[0] == orders[1]
    assert orders[0][1][0] != orders[0][1][1]            # (shuffled anew each epoch)


@pytest.mark.parametrize('when', ['before DALI gave the batch', 'after it',
                                  'while scheduling the next'])
def test_an_error_that_is_not_dali_s_passes_through_and_the_iterator_goes_on(data, when):
    """A signal handler's exception (a watchdog's TimeoutError) raised while the iterator waits
    for DALI was reported as a DALI failure on the images in flight, after decoding all of
    them, and the iterator was finalized. It passes through now, and the iterator goes on from
    the last batch it delivered, also when DALI had handed over the next one (a signal lands
    at DALI's next line of Python: that batch was lost, and later ones counted wrong)."""
    it = make(data)
    next(it)
    pipe = it._pipe
    real = pipe.outputs if when != 'while scheduling the next' else pipe.schedule_run

    def interrupted(*args, **kwargs):
        if when == 'after it':
            real(*args, **kwargs)
        raise TimeoutError('watchdog')
    setattr(pipe, 'outputs' if when != 'while scheduling the next' else 'schedule_run',
            interrupted)
    with pytest.raises(TimeoutError, match='watchdog'):
        next(it)
    assert it._pipe is not None and it._pipe is not pipe        # rebuilt at the position
    assert (it.epoch, it.current_position, it.last_indices.tolist()) == (0, 2, [0, 1])
    rest = [next(it)[1].tolist() for _ in range(3)]
    assert rest == [[2, 3], [4, 5], [6]] and it.last_indices.tolist() == [6]
    with pytest.raises(StopIteration):
        next(it)
    assert it.is_new_epoch and it.epoch == 1


def test_a_copy_of_a_subclass_is_of_the_subclass(data):
    class Mine(dali.DaliIterator):
        pass
    pipe = dali.imagenet_pipeline(data.root, data.ids_list, device='cpu', crop=32, seed=7,
                                  num_threads=1, train=False)
    it = Mine(pipe, 2, repeat=False)
    assert type(copy.copy(it)) is Mine and type(copy.deepcopy(it)) is Mine


@pytest.mark.parametrize('how', ['hdf5', 'npz', 'npz of bytes'])
def test_a_snapshot_round_trips_through_hdf5_and_npz(data, tmp_path, how):
    """The snapshot's text settings (last_batch, the list's fingerprint) were str, which HDF5
    cannot store: save_hdf5 failed (at the first snapshot of a run). HDF5 gets UTF-8 bytes (npz
    keeps str, which earlier chainer_tc versions read); bytes in an npz load too."""
    from chainer import serializers
    it = make(data, repeat=True, batch=3)
    next(it), next(it)
    path = str(tmp_path / 'snap')
    if how == 'hdf5':
        serializers.save_hdf5(path, it)
    else:
        serializers.save_npz(path, it)
    if how == 'npz of bytes':
        with numpy.load(path) as f:
            stored = dict(f)
        assert stored['last_batch'].dtype.kind == 'U'
        for key in ('last_batch', 'dataset_fingerprint'):
            stored[key] = numpy.asarray(stored[key].item().encode())
        with open(path, 'wb') as f:
            numpy.savez(f, **stored)
    resumed = make(data, repeat=True, batch=3)
    (serializers.load_hdf5 if how == 'hdf5' else serializers.load_npz)(path, resumed)
    assert (resumed.epoch, resumed.current_position) == (it.epoch, it.current_position)
    assert next(resumed)[1].tolist() == next(it)[1].tolist()


def test_an_evaluator_progress_bar_shows_the_total_as_with_serial_iterator(data):
    from chainer.training.extensions import evaluator
    it = make(data)
    next(it), next(it)
    lines = evaluator._IteratorProgressBar(iterator=it).get_lines()
    assert '         4 / 7 iterations\n' in lines, lines
