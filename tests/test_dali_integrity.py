"""Data that must not lie (issue 11): labels that do not fit int32, JPEGs that decode only with a
libjpeg warning, a byte-order mark before the first path, and snapshots of the DALI iterator
resumed with other order settings or another list of the same size. CPU only; the images come from
scikit-learn's sample photographs (tests/dali_data.py)."""
import os

import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer: CUDA libraries)
from chainer import serializers

from chainer_tc import dali
from chainer_tc.dali import check
from chainer_tc.dali import dataset
from chainer_tc import serializers as tc_serializers

import dali_data


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    return dali_data.make_dataset(tmp_path_factory.mktemp('integrity'), n=13)


def write(path, text, encoding='utf-8'):
    with open(str(path), 'w', encoding=encoding) as f:
        f.write(text)
    return str(path)


# ---- labels that wrap -----------------------------------------------------------------------------

@pytest.mark.parametrize('label', [2 ** 31, 2 ** 32 - 1, 2 ** 63])
def test_label_beyond_int32_is_refused_naming_the_line(data, tmp_path, label, capsys):
    lst = write(tmp_path / 'big.txt', '{} 0\n{} {}\n'.format(data.files[0], data.files[1], label))
    with pytest.raises(dali.DatasetError,
                       match=r"big.txt:2: label {} does not fit the labels' int32: at most "
                             r"2147483647".format(label)):
        dataset.load(data.root, lst)
    assert check.main([data.root, lst, '--jobs', '1']) == 1
    assert 'big.txt:2: label {} does not fit'.format(label) in capsys.readouterr().out


def test_largest_int32_label_loads_exactly(data, tmp_path):
    lst = write(tmp_path / 'max.txt', '{} 2147483647\n'.format(data.files[0]))
    ds = dataset.load(data.root, lst)
    assert ds.labels.dtype == numpy.int32 and ds.labels.tolist() == [2 ** 31 - 1]


def test_num_classes_beyond_int32_is_refused(data, capsys):
    with pytest.raises(ValueError, match=r'num_classes must be a positive integer or None \(at '
                                         r'most 2\*\*31: labels are int32\); got 4294967296'):
        dataset.load(data.root, data.ids_list, num_classes=2 ** 32)
    with pytest.raises(SystemExit):
        check.main([data.root, data.ids_list, '--num-classes', str(2 ** 32)])
    assert '--num-classes must be a positive integer, at most 2**31' in capsys.readouterr().err


def test_dataset_refuses_labels_that_would_wrap():
    with pytest.raises(ValueError, match=r"label 2147483648 \(of image 'b.jpg'\) does not fit"):
        dataset.Dataset(['a.jpg', 'b.jpg'], [0, 2 ** 31], 2, 'test')
    with pytest.raises(ValueError, match=r"label -1 \(of image 'a.jpg'\) does not fit"):
        dataset.Dataset(['a.jpg'], numpy.array([-1]), 2, 'test')


# ---- a byte-order mark at the start of the list -------------------------------------------------

def test_byte_order_mark_before_the_first_path_is_ignored(data, tmp_path, capsys):
    text = ''.join('{} {}\n'.format(f, i) for i, f in enumerate(data.files[:3]))
    lst = write(tmp_path / 'bom.txt', text, encoding='utf-8-sig')
    assert open(lst, 'rb').read(3) == b'\xef\xbb\xbf'
    ds = dataset.load(data.root, lst)
    assert ds.paths[0] == os.path.join(data.root, data.files[0])
    assert check.main([data.root, lst, '--jobs', '1']) == 0
    assert capsys.readouterr().out.splitlines() == ['all 3 images are good']


def test_utf16_list_is_named_as_such(data, tmp_path):
    lst = write(tmp_path / 'u16.txt', '{} 0\n'.format(data.files[0]), encoding='utf-16')
    with pytest.raises(dali.DatasetError, match=r'the list is UTF-16 text .*save it as UTF-8'):
        dataset.load(data.root, lst)


# ---- JPEGs that decode only with a warning --------------------------------------------------------

@pytest.fixture(scope='module')
def damaged(tmp_path_factory):
    d = tmp_path_factory.mktemp('damaged')
    good = dali_data.photo_jpeg(d / 'good.jpg')
    dali_data.zero_block(good, str(d / 'zeroed.jpg'))
    dali_data.cut_and_reterminate(good, str(d / 'cut.jpg'))
    return d


@pytest.mark.parametrize('name,said', [
    ('zeroed.jpg', 'extraneous bytes before marker 0xd9'),
    ('cut.jpg', 'premature end of data segment'),
])
def test_jpeg_that_decodes_only_with_a_warning_is_bad(damaged, tmp_path, name, said, capsys):
    from PIL import Image
    path = str(damaged / name)
    with Image.open(path) as im:        # what the check used to rely on: Pillow says nothing
        im.load()
    assert dataset.content_problem(path) is None        # header and end marker intact
    problem = dataset.decode_problem(path)
    assert problem is not None and 'Corrupt JPEG data' in problem and said in problem
    lst = write(tmp_path / 'list.txt', 'good.jpg 0\n{} 1\n'.format(name))
    assert check.main([str(damaged), lst, '--jobs', '1']) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith('{}: cannot be decoded: Corrupt JPEG data'.format(path)), out
    assert out[-1] == '0 line(s) of the list and 1 of 2 image(s) are bad'


def test_good_jpegs_of_every_colour_space_pass(tmp_path):
    from PIL import Image
    photo = Image.fromarray(dali_data.sample_photos()[1])
    for mode in ('RGB', 'L', 'CMYK'):
        path = str(tmp_path / '{}.jpg'.format(mode))
        photo.convert(mode).save(path, quality=85)
        assert dataset.decode_problem(path) is None, mode
    path = str(tmp_path / 'progressive.jpg')
    photo.save(path, quality=85, progressive=True)
    assert dataset.decode_problem(path) is None


def test_missing_strict_decoder_is_said(monkeypatch, data, capsys):
    monkeypatch.setattr(dataset, 'have_simplejpeg', lambda: False)
    assert check.main([data.root, data.ids_list, '--jobs', '1']) == 0
    assert 'simplejpeg is not installed: JPEGs are decoded by Pillow, which does not report ' \
        'damaged entropy-coded data' in capsys.readouterr().err


# ---- resuming the DALI iterator -------------------------------------------------------------------

def pipeline(root, lst, **kwargs):
    args = dict(device='cpu', crop=32, seed=7, num_threads=1, train=False)
    args.update(kwargs)
    return dali.imagenet_pipeline(root, lst, **args)


def snapshot(data, tmp_path, batches=4, **kwargs):
    """The .npz of an iterator over ``data`` after ``batches`` batches of 3, and the labels of
    the (up to) 5 batches that came next."""
    it = dali.DaliIterator(pipeline(data.root, data.ids_list), batch_size=3, **kwargs)
    for _ in range(batches):
        next(it)
    path = str(tmp_path / 'it.npz')
    serializers.save_npz(path, it)
    rest = [t.tolist() for _, (_, t) in zip(range(5), it)]
    it.finalize()
    return path, rest


@pytest.mark.parametrize('saved,here,said', [
    (dict(), dict(shuffle=False), 'shuffle is True in the snapshot, False here'),
    (dict(shuffle=False), dict(shuffle=True), 'shuffle is False in the snapshot, True here'),
    (dict(repeat=False, shuffle=True), dict(repeat=True, shuffle=True, last_batch='partial'),
     'repeat is False in the snapshot, True here'),
    (dict(), dict(last_batch='partial'), "last_batch is 'fill' in the snapshot, 'partial' here"),
    (dict(last_batch='drop'), dict(last_batch='fill'), "last_batch is 'drop' in the snapshot"),
])
def test_resume_with_other_order_settings_is_refused(data, tmp_path, saved, here, said):
    path, _ = snapshot(data, tmp_path, **saved)
    other = dali.DaliIterator(pipeline(data.root, data.ids_list), batch_size=3, **here)
    with pytest.raises(ValueError, match='cannot resume this DaliIterator .*would repeat or skip '
                                         'images: .*' + said):
        serializers.load_npz(path, other)
    other.finalize()


def test_resume_with_another_list_of_the_same_size_is_refused(data, tmp_path):
    path, _ = snapshot(data, tmp_path)
    n = len(data.files)
    cases = {   # same size as ids.txt: its images in another order, or other labels
        'reordered': [(f, i) for i, f in reversed(list(enumerate(data.files)))],
        'relabelled': [(f, n - 1 - i) for i, f in enumerate(data.files)],
        'classes': list(zip(data.files, data.classes)),
    }
    for name, rows in cases.items():
        lst = write(tmp_path / (name + '.txt'), ''.join('{} {}\n'.format(*r) for r in rows))
        other = dali.DaliIterator(pipeline(data.root, lst), batch_size=3)
        with pytest.raises(ValueError, match=r'the list of images differs .*fingerprint'):
            serializers.load_npz(path, other)
        other.finalize()


def test_resume_under_another_root_and_batch_size_continues(data, tmp_path):
    path, rest = snapshot(data, tmp_path)
    moved = str(tmp_path / 'moved')
    os.symlink(data.root, moved)                         # the same files mounted elsewhere
    lst = write(tmp_path / 'ids.txt', open(data.ids_list).read())
    it = dali.DaliIterator(pipeline(moved, lst), batch_size=5)      # batch size may change
    serializers.load_npz(path, it)
    got = numpy.concatenate([next(it)[1] for _ in range(3)]).tolist()
    assert got == sum(rest, [])
    it.finalize()


def test_resume_of_another_shard_is_refused(data, tmp_path):
    it = dali.DaliIterator(pipeline(data.root, data.ids_list, shard_id=1, num_shards=2), 3)
    next(it)
    path = str(tmp_path / 'shard1.npz')
    serializers.save_npz(path, it)
    other = dali.DaliIterator(pipeline(data.root, data.ids_list, shard_id=0, num_shards=2), 3)
    with pytest.raises(ValueError, match=r'shard_id is 1 in the snapshot, 0 here; each shard '
                                         r'resumes from its own snapshot'):
        serializers.load_npz(path, other)
    for i in (it, other):
        i.finalize()


def test_resume_with_drop_and_another_epoch_size_is_refused(data, tmp_path):
    path, _ = snapshot(data, tmp_path, last_batch='drop')           # 13 images: epochs of 12
    other = dali.DaliIterator(pipeline(data.root, data.ids_list), batch_size=5, last_batch='drop')
    with pytest.raises(ValueError, match=r"epoch_size is 12 in the snapshot, 10 here "
                                         r"\(last_batch='drop' with another batch_size"):
        serializers.load_npz(path, other)
    other.finalize()
    same = dali.DaliIterator(pipeline(data.root, data.ids_list), batch_size=4, last_batch='drop')
    serializers.load_npz(path, same)                     # 12 % 4 == 0: the same epochs
    same.finalize()


def test_snapshot_without_the_order_settings_is_named(data, tmp_path):
    path, _ = snapshot(data, tmp_path)
    with numpy.load(path) as f:
        old = {k: f[k] for k in f.files if k not in ('shuffle', 'dataset_fingerprint')}
    numpy.savez(path, **old)
    other = dali.DaliIterator(pipeline(data.root, data.ids_list), batch_size=3)
    with pytest.raises(KeyError, match="'shard_id' is not in the snapshot|'shuffle' is not in "
                                       "the snapshot"):
        tc_serializers.load_npz(path, other)
    other.finalize()


def test_fingerprint_cost_is_paid_at_snapshots_only(monkeypatch, data):
    calls = []
    real = dataset.Dataset.fingerprint
    monkeypatch.setattr(dataset.Dataset, 'fingerprint', lambda self: calls.append(1) or real(self))
    it = dali.DaliIterator(pipeline(data.root, data.ids_list), batch_size=3)
    for _ in range(10):
        next(it)
    it.finalize()
    assert calls == []
