"""Small real-image data sets for the DALI tests, cut from the two photographs scikit-learn ships
(``load_sample_images``: china.jpg and flower.jpg, 640x427): crops of varied sizes and aspect
ratios, saved as JPEG (a few grayscale) and PNG, in a class-per-directory tree with two list
files over the same images.

    data = make_dataset(tmp_path, n=29)
    data.root, data.ids_list, data.classes_list, data.files
"""
import collections
import os

import numpy

DataSet = collections.namedtuple('DataSet', ['root', 'ids_list', 'classes_list', 'files',
                                             'classes'])
DataSet.__doc__ = """``files``: paths relative to ``root`` in list order; ``ids_list``: label i for
the i-th file (labels name the image); ``classes_list``: 0 for china, 1 for flower (the tree's
classes too); ``classes``: those labels."""


def sample_photos():
    from sklearn.datasets import load_sample_images
    return load_sample_images().images          # two uint8 (427, 640, 3) arrays


def make_dataset(directory, n=29, seed=0, min_side=40, max_side=180):
    """``n`` images under ``directory``: image i comes from photo i % 2 (0 china, 1 flower), a
    random crop of random size resized to sides in [min_side, max_side]; every 7th is grayscale,
    every 11th a PNG."""
    from PIL import Image
    photos = sample_photos()
    r = numpy.random.RandomState(seed)
    files, classes = [], []
    for i in range(n):
        cls = i % 2
        src = photos[cls]
        ch, cw = r.randint(100, src.shape[0]), r.randint(100, src.shape[1])
        y, x = r.randint(0, src.shape[0] - ch + 1), r.randint(0, src.shape[1] - cw + 1)
        w, h = r.randint(min_side, max_side + 1), r.randint(min_side, max_side + 1)
        im = Image.fromarray(src[y:y + ch, x:x + cw]).resize((w, h), Image.BILINEAR)
        if i % 7 == 3:
            im = im.convert('L')
        name = os.path.join(('china', 'flower')[cls],
                            '{:03d}.{}'.format(i, 'png' if i % 11 == 5 else 'jpg'))
        os.makedirs(os.path.join(directory, os.path.dirname(name)), exist_ok=True)
        im.save(os.path.join(directory, name), quality=90)
        files.append(name)
        classes.append(cls)
    ids_list = write_list(os.path.join(directory, 'ids.txt'), files, range(n))
    classes_list = write_list(os.path.join(directory, 'classes.txt'), files, classes)
    return DataSet(str(directory), ids_list, classes_list, files, classes)


def write_list(path, files, labels):
    """A list file in the format of Chainer's ImageNet example."""
    with open(path, 'w') as f:
        for name, label in zip(files, labels):
            f.write('{} {}\n'.format(name, label))
    return str(path)


def truncate(src, dst, keep=0.4):
    """Copy of the JPEG ``src`` cut after ``keep`` of its bytes."""
    with open(src, 'rb') as f:
        data = f.read()
    with open(dst, 'wb') as f:
        f.write(data[:int(len(data) * keep)])


def corrupt(src, dst):
    """Copy of the JPEG ``src`` with its first Huffman table overwritten: it still starts and
    ends like a JPEG, and decoders (PIL, DALI) refuse it."""
    with open(src, 'rb') as f:
        data = bytearray(f.read())
    dht = data.index(b'\xff\xc4')
    data[dht + 5:dht + 25] = b'\xff' * 20
    with open(dst, 'wb') as f:
        f.write(bytes(data))


def _scan_data(data):
    """[start, end) of the entropy-coded data of a baseline JPEG's (first) scan."""
    sos = data.index(b'\xff\xda')
    start = sos + 2 + int.from_bytes(data[sos + 2:sos + 4], 'big')
    return start, data.rindex(b'\xff\xd9')


def zero_block(src, dst, size=2000):
    """Copy of the JPEG ``src`` with ``size`` bytes in the middle of its entropy-coded data set to
    zero: header, tables and end marker intact. libjpeg decodes it with only a warning
    ("Corrupt JPEG data: ... extraneous bytes before marker"), Pillow without a word."""
    with open(src, 'rb') as f:
        data = bytearray(f.read())
    start, end = _scan_data(data)
    mid = (start + end) // 2
    assert end - start > 2 * size, 'image too small to zero a block of {} bytes'.format(size)
    data[mid:mid + size] = bytes(size)
    with open(dst, 'wb') as f:
        f.write(bytes(data))


def cut_and_reterminate(src, dst, keep=0.5):
    """Copy of the JPEG ``src`` cut in the middle of its entropy-coded data and ended with an
    end-of-image marker (FF D9): it starts and ends like a good JPEG; libjpeg warns "premature
    end of data segment" and fills the rest with grey."""
    with open(src, 'rb') as f:
        data = f.read()
    start, end = _scan_data(data)
    cut = start + int((end - start) * keep)
    if data[cut - 1] == 0xff:           # do not leave half a marker or stuffed byte
        cut -= 1
    with open(dst, 'wb') as f:
        f.write(data[:cut] + b'\xff\xd9')


def photo_jpeg(path, which=0, quality=90):
    """One of the sample photographs (640x427) saved whole as a baseline JPEG at ``path``."""
    from PIL import Image
    Image.fromarray(sample_photos()[which]).save(str(path), quality=quality)
    return str(path)
