"""chainer_tc.dali on the CPU: the pipelines' outputs against a NumPy/PIL reference, the iterator's
epochs, coverage, shards, resume and reset, bad input, dali-check, and a Chainer Trainer with an
Evaluator. The data set is generated from the photographs scikit-learn ships (tests/dali_data.py);
GPU behaviour is in the tests marked ``gpu``."""
import os
import time

import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer: CUDA libraries)
import chainer
import chainer.functions as F
import chainer.links as L
from chainer import serializers
from chainer import training

from chainer_tc import dali
from chainer_tc.dali import check

import dali_data

N = 29              # images: not a multiple of any batch size used here
CROP, RESIZE = 64, 73


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    return dali_data.make_dataset(tmp_path_factory.mktemp('dali'), n=N)


def pipeline(data, list_file='ids', **kwargs):
    """A small CPU pipeline over ``data``: list_file 'ids' (labels name the images), 'classes'
    (china 0, flower 1), None (the tree) or a path."""
    args = dict(device='cpu', crop=32, seed=7, num_threads=2)
    args.update(kwargs)
    lst = {'ids': data.ids_list, 'classes': data.classes_list}.get(list_file, list_file)
    return dali.imagenet_pipeline(data.root, lst, **args)


def threads():
    return len(os.listdir('/proc/self/task'))


# ---- outputs -------------------------------------------------------------------------------------

def reference(path, crop, resize):
    """The validation transform in NumPy: PIL decodes; the shorter side is resized to ``resize``
    by a triangle (bilinear, antialiased when shrinking) filter, both axes by the same scale, the
    longer side rounded half up, pixel centres aligned about the image centre; centre crop
    (offset rounded half up); ImageNet normalisation. float64, HWC."""
    from PIL import Image
    im = numpy.asarray(Image.open(path).convert('RGB'), dtype=numpy.float64)
    h, w = im.shape[:2]
    scale = min(h, w) / resize                      # source pixels per output pixel
    nh, nw = (int(numpy.floor(s / scale + 0.5)) for s in (h, w))

    def weights(n_in, n_out):
        centre = n_in / 2 + (numpy.arange(n_out) + 0.5 - n_out / 2) * scale
        radius = max(1.0, scale)
        x = numpy.arange(n_in) + 0.5
        wt = numpy.clip(1 - numpy.abs(x[None, :] - centre[:, None]) / radius, 0, None)
        return wt / wt.sum(1, keepdims=True)
    r = numpy.einsum('ij,jkc->ikc', weights(h, nh), im)
    r = numpy.einsum('ij,kjc->kic', weights(w, nw), r)
    top, left = (nh - crop + 1) // 2, (nw - crop + 1) // 2
    r = r[top:top + crop, left:left + crop]
    return (r - 255 * numpy.array(dali.IMAGENET_MEAN)) / (255 * numpy.array(dali.IMAGENET_STD))


@pytest.fixture(scope='module')
def references(data):
    return numpy.stack([reference(os.path.join(data.root, f), CROP, RESIZE) for f in data.files])


@pytest.mark.parametrize('dtype,layout', [(numpy.float32, 'NHWC'), (numpy.float16, 'NCHW')])
def test_validation_values_match_numpy_pil_reference(data, references, dtype, layout):
    p = pipeline(data, train=False, crop=CROP, dtype=dtype, layout=layout)
    assert p.resize == RESIZE                           # round(64 * 256 / 224)
    it = dali.DaliIterator(p, batch_size=8, repeat=False)
    xs, ts = zip(*it)
    assert [len(x) for x in xs] == [8, 8, 8, 5]
    for x, t in zip(xs, ts):
        assert x.dtype == dtype and t.dtype == numpy.int32 and t.shape == (len(x),)
        assert x.shape[1:] == ((CROP, CROP, 3) if layout == 'NHWC' else (3, CROP, CROP))
    x = numpy.concatenate(xs).astype(numpy.float64)
    if layout == 'NCHW':
        x = x.transpose(0, 2, 3, 1)
    assert numpy.concatenate(ts).tolist() == list(range(N))
    # Compared in grey levels (0..255 before normalisation). Both sides decode with
    # libjpeg-turbo (islow IDCT, fancy upsampling), which agree to the bit here; DALI rounds its
    # resized image to uint8 (<= 0.5 level) and our reference does not; another decoder build
    # may differ by a level on some pixels: hence 1 level at most, and 0.35 on average (the
    # rounding alone averages 0.25). float16 adds its rounding: |x| * 2**-11 in normalised
    # units, below 0.1 level here. A wrong mean, std, channel order, crop offset or resize scale
    # moves pixels by many levels.
    levels = numpy.abs(x - references) * 255 * numpy.array(dali.IMAGENET_STD)
    fp16 = (numpy.abs(references) * 2.0 ** -11 * 255 * numpy.array(dali.IMAGENET_STD)
            if dtype == numpy.float16 else 0)
    assert (levels - fp16).max() <= 1.0
    assert levels.mean() <= 0.35


def test_training_outputs_shapes_values_and_seed(data):
    a = dali.DaliIterator(pipeline(data, 'classes', crop=32, seed=11), batch_size=8)
    b = dali.DaliIterator(pipeline(data, 'classes', crop=32, seed=11), batch_size=8)
    c = dali.DaliIterator(pipeline(data, 'classes', crop=32, seed=12), batch_size=8)
    xa, ta = next(a)
    xb, tb = next(b)
    xc, _ = next(c)
    assert xa.shape == (8, 32, 32, 3) and xa.dtype == numpy.float32    # chainer.config.dtype
    assert ta.dtype == numpy.int32 and set(ta.tolist()) <= {0, 1}
    assert numpy.array_equal(xa, xb) and numpy.array_equal(ta, tb)     # same seed, same batch
    assert not numpy.array_equal(xa, xc)
    lo = (0 - 255 * numpy.array(dali.IMAGENET_MEAN)) / (255 * numpy.array(dali.IMAGENET_STD))
    hi = (255 - 255 * numpy.array(dali.IMAGENET_MEAN)) / (255 * numpy.array(dali.IMAGENET_STD))
    x = xa.astype(numpy.float32)
    assert (x >= lo - 1e-2).all() and (x <= hi + 1e-2).all()
    # Random crops and flips: the same images (a whole epoch per batch, in order) come out
    # differently from one epoch to the next, each one of them.
    it = dali.DaliIterator(pipeline(data, 'ids', crop=32, seed=3), batch_size=N, shuffle=False)
    (first, t1), (second, t2) = next(it), next(it)
    assert numpy.array_equal(t1, t2)
    assert all(not numpy.array_equal(p, q) for p, q in zip(first, second))
    for i in (a, b, c, it):
        i.finalize()


def test_class_per_directory_tree(data):
    p = pipeline(data, list_file=None)
    assert p.dataset.num_classes == 2 and len(p.dataset) == N
    by_name = dict(zip(p.dataset.paths, p.dataset.labels.tolist()))
    for f, cls in zip(data.files, data.classes):
        assert by_name[os.path.join(data.root, f)] == cls


def test_a_tree_skips_hidden_directories_and_refuses_classes_without_images(data, tmp_path):
    """A hidden directory (.ipynb_checkpoints) or an empty one (lost+found) sorted among the
    classes would shift every label after it, and differently in the train and val trees."""
    import shutil
    for c in ('cat', 'dog'):
        os.makedirs(str(tmp_path / 'tree' / c))
        shutil.copy(os.path.join(data.root, data.files[0]), str(tmp_path / 'tree' / c / 'a.jpg'))
    os.makedirs(str(tmp_path / 'tree' / '.ipynb_checkpoints'))
    p = dali.imagenet_pipeline(str(tmp_path / 'tree'), device='cpu', seed=0)
    assert p.dataset.num_classes == 2
    assert [(os.path.basename(os.path.dirname(f)), int(t)) for f, t in
            zip(p.dataset.paths, p.dataset.labels)] == [('cat', 0), ('dog', 1)]
    os.makedirs(str(tmp_path / 'tree' / 'bird'))
    with pytest.raises(dali.DatasetError, match=r'bird: a class directory without images .*'
                                                r'class 0 and shift the labels'):
        dali.imagenet_pipeline(str(tmp_path / 'tree'), device='cpu', seed=0)


# ---- epochs, coverage, shards, resume ------------------------------------------------------------

def test_epoch_accounting_matches_serial_iterator_over_several_epochs(data):
    it = dali.DaliIterator(pipeline(data, train=False), batch_size=4, shuffle=False)
    ref = chainer.iterators.SerialIterator(list(range(N)), 4, shuffle=False)
    assert it.previous_epoch_detail is None and it.epoch_detail == 0
    kept = next(it)                                       # a view of DALI's buffer: kept intact
    saved = kept[0].copy()
    next(ref)
    for _ in range(3 * N // 4 + 1):                       # three epochs and a bit
        x, t = next(it)
        assert t.tolist() == next(ref)                    # the labels name the images
        assert len(x) == 4
        assert (it.epoch, it.is_new_epoch) == (ref.epoch, ref.is_new_epoch)
        assert it.epoch_detail == pytest.approx(ref.epoch_detail)
        assert it.previous_epoch_detail == pytest.approx(ref.previous_epoch_detail)
    assert it.epoch == 3 and it.batches == 3 * N // 4 + 2
    assert numpy.array_equal(kept[0], saved) and kept[1].tolist() == [0, 1, 2, 3]
    it.finalize()


def test_shuffled_epochs_each_cover_the_set(data):
    it = dali.DaliIterator(pipeline(data, train=False), batch_size=4)     # shuffle: default
    seen = numpy.concatenate([next(it)[1] for _ in range(3 * N // 4 + 1)])[:3 * N]
    epochs = seen.reshape(3, N)
    for e in epochs:
        assert sorted(e.tolist()) == list(range(N))
    assert len({tuple(e) for e in epochs}) == 3
    it.finalize()


def test_repeat_false_sees_every_image_once_also_after_reset(data):
    it = dali.DaliIterator(pipeline(data, train=False), batch_size=4, repeat=False)
    for attempt in range(2):
        batches = list(it)
        assert [len(t) for _, t in batches] == [4] * 7 + [1]
        assert sorted(numpy.concatenate([t for _, t in batches]).tolist()) == list(range(N))
        assert it.epoch == 1 and it.is_new_epoch and it.epoch_detail == 1.0
        with pytest.raises(StopIteration):
            next(it)
        it.reset()                                       # after a full pass: cheap reset
        assert it.epoch == 0 and it.previous_epoch_detail is None
    next(it)
    next(it)
    it.reset()                                           # in the middle: the pipeline is rebuilt
    assert sorted(numpy.concatenate([t for _, t in it]).tolist()) == list(range(N))
    it.finalize()


def test_drop_policy_gives_full_batches_only(data):
    it = dali.DaliIterator(pipeline(data, train=False), batch_size=4, repeat=False,
                           last_batch='drop')
    sizes = [len(t) for _, t in it]
    assert sizes == [4] * 7 and it.epoch_size == 28
    it.finalize()


def test_two_shards_cover_the_set_without_overlap(data):
    parts = []
    for shard in range(2):
        it = dali.DaliIterator(pipeline(data, train=False, shard_id=shard, num_shards=2),
                               batch_size=4, repeat=False, shuffle=True)
        parts.append(numpy.concatenate([t for _, t in it]).tolist())
        assert it.epoch_size == len(parts[-1])
        it.finalize()
    assert sorted(len(p) for p in parts) == [14, 15]
    assert not set(parts[0]) & set(parts[1])
    assert sorted(parts[0] + parts[1]) == list(range(N))


def test_serialize_and_resume_mid_epoch_continues_where_it_stopped(data, tmp_path):
    a = dali.DaliIterator(pipeline(data, train=False), batch_size=4)         # shuffled
    for _ in range(10):                                  # 40 images: into the second epoch
        next(a)
    path = str(tmp_path / 'it.npz')
    serializers.save_npz(path, a)
    saved = (a.epoch, a.epoch_detail, a.previous_epoch_detail, a.is_new_epoch)
    rest = [next(a) for _ in range(8)]                  # crosses into the third epoch
    b = dali.DaliIterator(pipeline(data, train=False, seed=99), batch_size=4)
    next(b)
    serializers.load_npz(path, b)
    assert (b.epoch, b.epoch_detail, b.previous_epoch_detail, b.is_new_epoch) == saved
    for x, t in rest:
        xb, tb = next(b)
        assert numpy.array_equal(tb, t) and numpy.array_equal(xb, x)
    assert (b.epoch, b.epoch_detail) == (a.epoch, a.epoch_detail)
    other = dali.DaliIterator(pipeline(data, train=False, shard_id=0, num_shards=2), 4)
    with pytest.raises(ValueError, match='29 images in 1 shard.*29 images in 2 shard'):
        serializers.load_npz(path, other)
    for i in (a, b, other):
        i.finalize()


def test_shards_and_resumed_runs_draw_their_own_crops_and_flips(data, tmp_path):
    """Every entry is one photo, so only the random crops and flips tell samples apart. With one
    seed on every shard (as the order needs) the k-th image of each batch was cropped and
    flipped alike on every GPU; and a resumed run drew the run's first crops again."""
    lst = str(tmp_path / 'same.txt')
    with open(lst, 'w') as f:
        f.write(''.join('{} 0\n'.format(data.files[1]) for _ in range(16)))
    batches = []
    for shard in (0, 1):
        it = dali.DaliIterator(pipeline(data, lst, shard_id=shard, num_shards=2), batch_size=4)
        batches.append([next(it)[0] for _ in range(2)])
        it.finalize()
    for a, b in zip(*batches):
        assert not any(numpy.array_equal(x, y) for x, y in zip(a, b))
    run = dali.DaliIterator(pipeline(data, lst), batch_size=4)
    first = [next(run)[0] for _ in range(3)]
    path = str(tmp_path / 'it.npz')
    serializers.save_npz(path, run)
    resumed = dali.DaliIterator(pipeline(data, lst), batch_size=4)
    serializers.load_npz(path, resumed)
    again = [next(resumed)[0] for _ in range(3)]
    assert not any(numpy.array_equal(x, y) for a, b in zip(first, again) for x, y in zip(a, b))
    resumed.reset()                          # back to the start: the run's first draws
    for a, b in zip(first, [next(resumed)[0] for _ in range(3)]):
        assert numpy.array_equal(a, b)
    for i in (run, resumed):
        i.finalize()


# ---- overlap, finalize, converter ----------------------------------------------------------------

def test_prefetch_overlaps_a_slow_consumer_and_the_wait_is_counted(data):
    it = dali.DaliIterator(pipeline(data, 'classes', crop=64, prefetch_queue_depth=2),
                           batch_size=N)
    for _ in range(3):
        next(it)
    w = it.wait_seconds
    for _ in range(6):                      # a consumer faster than DALI waits for every batch
        next(it)
    busy = (it.wait_seconds - w) / 6
    w = it.wait_seconds
    for _ in range(4):                      # a training step 10 times longer than a batch takes
        time.sleep(max(0.05, 10 * busy))    # DALI, which prepares the next ones meanwhile
        next(it)
    idle = (it.wait_seconds - w) / 4
    # Waiting idle is the cost of the call alone (~0.2 ms here), busy a batch's work (~6 ms).
    assert busy > 0 and idle < 0.2 * busy, (busy, idle)
    assert it.batches == 13
    it.finalize()


def test_finalize_stops_the_threads_and_reset_starts_again(data):
    before = threads()
    it = dali.DaliIterator(pipeline(data, train=False), batch_size=4)
    assert threads() > before
    next(it)
    it.finalize()
    it.finalize()                                       # twice is fine
    assert threads() == before
    with pytest.raises(RuntimeError, match='finalized'):
        next(it)
    it.reset()
    assert next(it)[1].shape == (4,)
    it.finalize()


def test_converter_passes_batches_through(data):
    x, t = numpy.zeros((2, 4, 4, 3), numpy.float16), numpy.array([0, 1], numpy.int32)
    xs, ts = dali.converter((x, t))
    assert xs is x and ts is t
    xs, ts = dali.converter((x, t), chainer.get_device('@numpy'))
    assert xs is x and ts is t
    with pytest.raises(TypeError, match=r'expects the \(images, labels\) tuple'):
        dali.converter([x, t])


# ---- bad input -----------------------------------------------------------------------------------

def bad_list(data, tmp_path, lines):
    path = tmp_path / 'bad.txt'
    path.write_text(''.join(line + '\n' for line in lines))
    return str(path)


def test_missing_root_and_missing_list(data, tmp_path):
    with pytest.raises(FileNotFoundError, match="root '.*nowhere' does not exist"):
        dali.imagenet_pipeline(str(tmp_path / 'nowhere'), data.ids_list, device='cpu')
    with pytest.raises(FileNotFoundError, match="list_file '.*nolist.txt' does not exist"):
        dali.imagenet_pipeline(data.root, str(tmp_path / 'nolist.txt'), device='cpu')


@pytest.mark.parametrize('lines,num_classes,message', [
    ([], None, 'bad.txt: the list is empty'),
    (['\n', '  '], None, 'bad.txt: the list is empty'),
    (['{0} 0', '{0}'], None, "bad.txt:2: '.*000.jpg' has no label"),
    (['{0} 0', '{0} 0', '{0} cat'], None, "bad.txt:3: label 'cat' is not an integer"),
    (['{0} 1.5'], None, "bad.txt:1: label '1.5' is not an integer"),
    (['{0} 0', '{0} 5'], 5, r'bad.txt:2: label 5 is out of range 0..4 \(num_classes=5\)'),
    (['{0} -1'], None, r'bad.txt:1: label -1 is out of range \(labels must be >= 0\)'),
])
def test_bad_list_lines_name_the_line(data, tmp_path, lines, num_classes, message):
    lst = bad_list(data, tmp_path, [line.format(data.files[0]) for line in lines])
    t = time.perf_counter()
    with pytest.raises(dali.DatasetError, match=message) as e:
        dali.imagenet_pipeline(data.root, lst, device='cpu', num_classes=num_classes)
    assert time.perf_counter() - t < 5
    assert 'dali-check' in str(e.value) and len(e.value.problems) == 1


def test_missing_image_is_found_up_front(data, tmp_path):
    lst = bad_list(data, tmp_path, ['{} 0'.format(f) for f in data.files[:5]]
                   + ['china/gone.jpg 0', 'flower/also_gone.jpg 1'])
    with pytest.raises(dali.DatasetError, match='gone.jpg: image file does not exist') as e:
        dali.imagenet_pipeline(data.root, lst, device='cpu')
    assert [os.path.basename(w) for w, _ in e.value.problems] == ['gone.jpg', 'also_gone.jpg']


def bad_file(data, kind):
    """A bad image beside the good ones: 'truncated' (a JPEG cut at 40%), 'corrupt' (a JPEG
    whose Huffman table is overwritten: magic bytes and end marker intact), 'text' (HTML saved
    as .jpg), 'empty', 'missing'."""
    name = os.path.join(data.root, 'bad_{}.jpg'.format(kind))
    if kind == 'truncated':
        dali_data.truncate(os.path.join(data.root, data.files[0]), name)
    elif kind == 'corrupt':
        dali_data.corrupt(os.path.join(data.root, data.files[0]), name)
    elif kind == 'text':
        with open(name, 'w') as f:
            f.write('<html><body>404 Not Found</body></html>\n')
    elif kind == 'empty':
        open(name, 'wb').close()
    return name


@pytest.mark.parametrize('kind,check_files,message', [
    ('truncated', True, r'bad_truncated.jpg: truncated JPEG: no end-of-image marker'),
    ('text', True, r"bad_text.jpg: not a JPEG or PNG image \(it starts with b'<html><b'\)"),
    ('missing', False, 'bad_missing.jpg: image file does not exist'),
    ('corrupt', True, 'bad_corrupt.jpg: cannot be decoded: .*Could not determine subsampling'),
])
def test_bad_image_fails_fast_naming_the_file_and_stops_the_threads(data, tmp_path, kind,
                                                                     check_files, message):
    bad = bad_file(data, kind)
    files = data.files[:9] + [os.path.relpath(bad, data.root)] + data.files[9:]
    lst = dali_data.write_list(str(tmp_path / 'list.txt'), files, range(len(files)))
    before = threads()
    t = time.perf_counter()
    with pytest.raises(dali.DatasetError, match=message):
        it = dali.DaliIterator(pipeline(data, lst, check_files=check_files), batch_size=4)
        for _ in range(2 * len(files)):
            next(it)
    assert time.perf_counter() - t < 10
    assert threads() == before
    if kind != 'missing':
        os.remove(bad)


def test_empty_image_is_found_up_front(data, tmp_path):
    bad = bad_file(data, 'empty')
    lst = bad_list(data, tmp_path, ['{} 0'.format(os.path.relpath(bad, data.root))])
    with pytest.raises(dali.DatasetError, match=r'bad_empty.jpg: empty file \(0 bytes\)'):
        dali.imagenet_pipeline(data.root, lst, device='cpu')
    os.remove(bad)


@pytest.mark.parametrize('kwargs,error,message', [
    (dict(device='tpu'), ValueError, r"device must be one of \('gpu', 'cpu'\) or None; got 'tpu'"),
    (dict(dtype='int8'), ValueError, 'dtype must be float16 or float32'),
    (dict(layout='HWC'), ValueError, r"layout must be one of \('NHWC', 'NCHW'\)"),
    (dict(crop=0), ValueError, 'crop must be a positive integer; got 0'),
    (dict(train=False, crop=64, resize=60), ValueError, 'resize=60 is smaller than crop=64'),
    (dict(prefetch_queue_depth=0), ValueError, 'prefetch_queue_depth must be a positive'),
    (dict(shard_id=2, num_shards=2), ValueError, r'shard_id must be an integer in \[0, num_'),
    (dict(seed=-3), ValueError, r'seed must be an integer in \[0, 2\*\*31\)'),
    (dict(num_classes=0), ValueError, 'num_classes must be a positive integer or None'),
    (dict(area=(0.5, 0.1)), ValueError, r'area must be a range \(lo, hi\)'),
])
def test_bad_arguments_name_the_argument(data, kwargs, error, message):
    with pytest.raises(error, match=message):
        pipeline(data, **kwargs)


def test_shuffled_shards_need_one_seed(data):
    """seed=None draws a seed in each process: shuffled shards of different permutations
    overlap and leave images out. A pass in the list's order does not care."""
    with pytest.raises(ValueError, match=r"seed was drawn \(seed=None\).*num_shards=2 give "
                                         r"every shard the same seed"):
        dali.DaliIterator(pipeline(data, seed=None, shard_id=1, num_shards=2), 4)
    it = dali.DaliIterator(pipeline(data, train=False, seed=None, shard_id=1, num_shards=2), 4,
                           repeat=False)
    assert len(numpy.concatenate([t for _, t in it])) == N - N // 2
    it.finalize()


def test_iterator_argument_errors(data):
    with pytest.raises(TypeError, match='pipeline must be an ImagenetPipeline'):
        dali.DaliIterator('train.txt', 4)
    with pytest.raises(ValueError, match="last_batch='fill' needs repeat=True"):
        dali.DaliIterator(pipeline(data), 4, repeat=False, last_batch='fill')


def test_gpu_device_without_a_gpu_is_a_clear_error(data):
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            pytest.skip('a GPU is present: the GPU tests cover device="gpu"')
    except Exception:
        pass
    with pytest.raises(RuntimeError, match="device='gpu' needs .*use device='cpu'"):
        pipeline(data, device='gpu')


def test_outputs_are_ordered_on_the_current_stream_of_the_pipelines_device(monkeypatch):
    """A pipeline on GPU 1 used while GPU 0 is current: DALI must get GPU 1's current stream
    (the outputs are wrapped on GPU 1), not GPU 0's."""
    import types
    cupy = pytest.importorskip('cupy')
    from chainer_tc.dali import iterator
    asked = []

    def get_current_stream(device_id=-1):
        asked.append(device_id)
        return types.SimpleNamespace(ptr={-1: 0xd0, 1: 0xd1}.get(device_id, 0))

    monkeypatch.setattr(cupy.cuda, 'get_current_stream', get_current_stream)
    gpu1 = types.SimpleNamespace(device='gpu', device_id=1)
    assert iterator._consumer_stream(gpu1) == 0xd1 and asked == [1]
    # the null stream (ptr 0) goes to DALI as cudaStreamLegacy (1): DALI reads 0 as no stream
    assert iterator._consumer_stream(types.SimpleNamespace(device='gpu', device_id=0)) == 1
    assert iterator._consumer_stream(types.SimpleNamespace(device='cpu', device_id=None)) is None


# ---- dali-check ----------------------------------------------------------------------------------

def test_dali_check_lists_every_bad_line_and_file(data, tmp_path, capsys):
    bads = [bad_file(data, k) for k in ('truncated', 'text', 'empty')]
    rel = [os.path.relpath(b, data.root) for b in bads]
    lines = ['{} 0'.format(f) for f in data.files[:6]] + [
        '{} 1'.format(rel[0]),                  # 7: truncated
        data.files[6],                          # 8: no label
        '{} x'.format(data.files[7]),           # 9: not an integer
        '{} 1'.format(rel[1]),                  # 10: HTML
        '{} 3'.format(data.files[8]),           # 11: out of range for --num-classes 2
        'china/missing.jpg 0',                  # 12: missing
        '{} 0'.format(rel[2]),                  # 13: empty
    ]
    lst = bad_list(data, tmp_path, lines)
    assert check.main([data.root, lst, '--num-classes', '2', '--jobs', '2']) == 1
    out = capsys.readouterr()
    report = out.out.splitlines()
    for expected in ('bad.txt:8: ', 'bad.txt:9: ', 'bad.txt:11: label 3 is out of range',
                     'bad_truncated.jpg: truncated JPEG', 'bad_text.jpg: not a JPEG or PNG',
                     'missing.jpg: image file does not exist', 'bad_empty.jpg: empty file'):
        assert sum(expected in line for line in report) == 1, (expected, report)
    assert report[-1] == '3 line(s) of the list and 4 of 12 image(s) are bad'
    assert '12/12 images' in out.err                    # the progress bar's last state
    for b in bads:
        os.remove(b)


def test_dali_check_decodes_to_find_corrupt_data(data, tmp_path, capsys):
    bad = bad_file(data, 'corrupt')         # header and end intact: only a decode finds it
    lst = bad_list(data, tmp_path, ['{} 0'.format(bad)])
    assert check.main([data.root, lst, '--no-decode']) == 0
    assert check.main([data.root, lst]) == 1
    assert 'bad_corrupt.jpg: cannot be decoded: ' in capsys.readouterr().out
    os.remove(bad)


def test_dali_check_redraws_one_bar_on_a_terminal(monkeypatch):
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    monkeypatch.setattr(sys, 'stderr', Terminal())
    bar = check._Progress(10)                 # on stderr, as dali-check makes it
    assert bar.tty


def test_dali_check_good_sets_and_missing_paths(data, tmp_path, capsys):
    assert check.main([data.root, data.ids_list]) == 0
    assert check.main([data.root]) == 0                  # class-per-directory tree
    assert capsys.readouterr().out.splitlines() == ['all 29 images are good'] * 2
    assert check.main([data.root, str(tmp_path / 'none.txt')]) == 2
    assert check.main([str(tmp_path / 'nowhere'), data.ids_list]) == 2
    assert 'does not exist' in capsys.readouterr().err


# ---- Chainer Trainer with Evaluator --------------------------------------------------------------

class TinyNet(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(3, 8, 3, stride=2,
                                        initialW=chainer.initializers.HeNormal(
                                            rng=numpy.random.RandomState(0)))
            self.fc = L.Linear(8, 2, initialW=chainer.initializers.HeNormal(
                rng=numpy.random.RandomState(1)))

    def forward(self, x):
        h = F.relu(self.conv(x))
        return self.fc(F.average(h, axis=(2, 3)))


def test_trainer_with_evaluator_gives_exact_accuracy(data, tmp_path):
    common = dict(list_file='classes', crop=32, layout='NCHW', dtype=numpy.float32)
    train = dali.DaliIterator(pipeline(data, **common), batch_size=8)
    val = dali.DaliIterator(pipeline(data, train=False, **common), batch_size=8, repeat=False)
    model = L.Classifier(TinyNet())
    opt = chainer.optimizers.MomentumSGD(lr=0.05).setup(model)
    updater = training.StandardUpdater(train, opt, converter=dali.converter)
    trainer = training.Trainer(updater, (2, 'epoch'), out=str(tmp_path))
    ours = dali.Evaluator(val, model, converter=dali.converter)
    chainers = training.extensions.Evaluator(val, model, converter=dali.converter)
    trainer.extend(ours, name='ours', trigger=(2, 'epoch'))
    trainer.extend(chainers, name='chainers', trigger=(2, 'epoch'))
    trainer.run()
    assert updater.iteration == 8                        # 2 epochs of 29 at batch 8
    assert train.epoch == 2
    # By hand: every validation image once, in batches of 8, 8, 8, 5.
    val.reset()
    correct, batch_means = [], []
    with chainer.using_config('train', False), chainer.no_backprop_mode():
        for x, t in val:
            ok = (model.predictor(x).array.argmax(axis=1) == t)
            correct.append(ok)
            batch_means.append(ok.mean())
    assert [len(c) for c in correct] == [8, 8, 8, 5]
    exact = numpy.concatenate(correct).mean()
    obs = trainer.observation
    assert obs['ours/main/accuracy'] == pytest.approx(exact, abs=1e-6)
    assert obs['chainers/main/accuracy'] == pytest.approx(numpy.mean(batch_means), abs=1e-6)
    train.finalize()
    val.finalize()


def test_evaluator_keeps_values_the_model_weighted_itself(data):
    """A (value, weight) pair (chainer.DictSummary's own form) keeps the model's weight: its mean
    is the one Chainer's Evaluator gives (the key was dropped: ((value, weight), images) is not a
    scalar to DictSummary). Plain values are still weighted by the batch's images. Found by
    review."""
    class Reporting(chainer.Link):
        def forward(self, x, t):
            t = numpy.asarray(t).astype(numpy.float64)
            even = t[t % 2 == 0]
            chainer.report({'label': chainer.Variable(numpy.asarray(t.mean())),
                            'even': (even.mean() if even.size else 0.0, even.size),
                            'even_v': (chainer.Variable(numpy.asarray(even.sum())),
                                       chainer.Variable(numpy.asarray(float(max(even.size, 1)))))},
                           self)

    val = dali.DaliIterator(pipeline(data, train=False), batch_size=8, repeat=False)
    ours = dali.Evaluator(val, Reporting(), converter=dali.converter)
    chainers = training.extensions.Evaluator(val, Reporting(), converter=dali.converter)
    got, want = ours(), chainers()
    val.reset()
    labels = [numpy.asarray(t) for _, t in (dali.converter(b) for b in val)]
    assert [len(t) for t in labels] == [8, 8, 8, 5]
    every = numpy.concatenate(labels)
    assert sorted(got) == sorted(want) == ['main/even', 'main/even_v', 'main/label']
    assert float(got['main/even']) == float(want['main/even'])
    assert float(got['main/even']) == pytest.approx(every[every % 2 == 0].mean(), rel=1e-12)
    assert float(got['main/even_v']) == float(want['main/even_v'])
    assert float(got['main/label']) == pytest.approx(every.mean(), rel=1e-12)
    assert float(want['main/label']) != pytest.approx(every.mean(), rel=1e-3)
    assert ours.weights == {'main/label': len(every), 'main/even': (every % 2 == 0).sum(),
                            'main/even_v': sum(max((t % 2 == 0).sum(), 1) for t in labels)}
    val.finalize()


# ---- GPU -----------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_pipeline_gives_cupy_arrays_without_a_copy_on_the_consumer_stream(dali_stack, data):
    import cupy
    it = dali.DaliIterator(pipeline(data, train=False, device='gpu', crop=CROP,
                                    dtype=numpy.float16), batch_size=8, repeat=False)
    pool = cupy.get_default_memory_pool()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        used = pool.used_bytes()
        x, t = next(it)
        # DLPack views of DALI's buffers: nothing allocated from CuPy's pool (a copy would be).
        assert pool.used_bytes() == used
        assert isinstance(x, cupy.ndarray) and isinstance(t, cupy.ndarray)
        assert x.dtype == numpy.float16 and x.shape == (8, CROP, CROP, 3)
        assert t.dtype == numpy.int32 and t.tolist() == list(range(8))
        mean = float(x.astype(cupy.float32).mean())     # runs on `stream`, after DALI's work
    cpu = dali.DaliIterator(pipeline(data, train=False, crop=CROP), batch_size=8, repeat=False)
    xc = next(cpu)[0].astype(numpy.float32)
    assert mean == pytest.approx(float(xc.mean()), abs=0.05)     # 3 grey levels: nvJPEG
    it.finalize()
    cpu.finalize()


@pytest.mark.gpu
def test_gpu_pipeline_on_another_device_than_the_current_one(dali_stack, data):
    import cupy
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip('needs two gpus')
    it = dali.DaliIterator(pipeline(data, train=False, device='gpu', device_id=1, crop=CROP,
                                    dtype=numpy.float16), batch_size=8, repeat=False)
    cpu = dali.DaliIterator(pipeline(data, train=False, crop=CROP), batch_size=8, repeat=False)
    with cupy.cuda.Device(0):
        x, t = next(it)
        assert x.device.id == 1 and t.device.id == 1
    with cupy.cuda.Device(1):
        mean = float(x.astype(cupy.float32).mean())
    assert mean == pytest.approx(float(next(cpu)[0].astype(numpy.float32).mean()), abs=0.05)
    it.finalize()
    cpu.finalize()


@pytest.mark.gpu
def test_gpu_validation_values_close_to_the_cpu_pipeline(dali_stack, data, references):
    import cupy
    it = dali.DaliIterator(pipeline(data, train=False, device='gpu', crop=CROP,
                                    dtype=numpy.float32), batch_size=8, repeat=False)
    x = numpy.concatenate([cupy.asnumpy(b[0]) for b in it]).astype(numpy.float64)
    # nvJPEG upsamples chroma differently from libjpeg-turbo and its resize may differ by a
    # rounding: per-image channel means agree to 2 grey levels, pixels correlate closely.
    levels = (x - references) * 255 * numpy.array(dali.IMAGENET_STD)
    assert numpy.abs(levels.mean(axis=(1, 2))).max() <= 2.0
    assert numpy.corrcoef(x.ravel(), references.ravel())[0, 1] > 0.98
    it.finalize()


@pytest.mark.gpu
def test_gpu_training_steps_with_the_trainer(dali_stack, data, tmp_path):
    import cupy
    train = dali.DaliIterator(pipeline(data, 'classes', device='gpu', layout='NCHW',
                                       dtype=numpy.float32), batch_size=8)
    model = L.Classifier(TinyNet())
    model.to_device('@cupy:{}'.format(cupy.cuda.Device().id))
    opt = chainer.optimizers.MomentumSGD(lr=0.05).setup(model)
    updater = training.StandardUpdater(train, opt, converter=dali.converter)
    trainer = training.Trainer(updater, (4, 'iteration'), out=str(tmp_path))
    trainer.run()
    assert numpy.isfinite(float(trainer.observation['main/loss'].array))
    train.finalize()
