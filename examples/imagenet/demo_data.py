"""A small real image data set for the demo and the tests, made from the two photographs
scikit-learn ships (``sklearn.datasets.load_sample_images``: china.jpg and flower.jpg, 640x427),
so nothing is downloaded.

    python examples/imagenet/demo_data.py result/demo/data      # or: make(directory)

Six classes, each a region of one photograph with its own content: the sky, the pagoda, the lake
and the trees of china.jpg, the dahlia's petals and the dark leaves behind it in flower.jpg.
Every image is a random crop (40-100% of the shorter side of its part of the region) resized to
a side of 72-112 pixels and saved as a JPEG. Held out for real: each region is cut in two along
its longer side, the training images come from the first 70% and the validation images from the
rest, so no validation pixel was seen in training. Files: ``root/<class>/<nnn>.jpg``,
``train.txt`` and ``val.txt`` in the format of Chainer's ImageNet example.
"""
import collections
import os
import sys

import numpy

# class name -> (photograph, (left, top, right, bottom)) in the 640x427 photographs
REGIONS = collections.OrderedDict([
    ('sky', ('china', (360, 0, 640, 140))),
    ('pagoda', ('china', (90, 100, 340, 330))),
    ('lake', ('china', (340, 225, 550, 305))),
    ('trees', ('china', (330, 300, 640, 427))),
    ('petals', ('flower', (190, 100, 430, 340))),
    ('leaves', ('flower', (0, 0, 170, 300))),
])
TRAIN_PART = 0.7

DataSet = collections.namedtuple('DataSet', ['root', 'train', 'val', 'classes'])


def photographs():
    """{'china': array, 'flower': array}, uint8 (427, 640, 3)."""
    from sklearn.datasets import load_sample_images
    images = load_sample_images()
    names = [os.path.splitext(os.path.basename(f))[0] for f in images.filenames]
    return dict(zip(names, images.images))


def _part(box, train):
    """The training (first 70%) or validation (the rest) part of a region, cut across its
    longer side."""
    left, top, right, bottom = box
    if right - left >= bottom - top:
        cut = left + int(round((right - left) * TRAIN_PART))
        return (left, top, cut, bottom) if train else (cut, top, right, bottom)
    cut = top + int(round((bottom - top) * TRAIN_PART))
    return (left, top, right, cut) if train else (left, cut, right, bottom)


def make(directory, n_train=32, n_val=8, seed=0, classes=None):
    """Writes the data set under ``directory`` (made if needed): ``n_train`` training and
    ``n_val`` validation images per class. ``classes``: a subset of REGIONS' names (default all
    six), labelled in that order. Returns a DataSet (root, train list, val list, class names)."""
    from PIL import Image
    classes = list(classes or REGIONS)
    unknown = [c for c in classes if c not in REGIONS]
    if unknown:
        raise ValueError('unknown classes {}; the classes are {}'.format(unknown, list(REGIONS)))
    photos = photographs()
    rng = numpy.random.RandomState(seed)
    lines = {'train': [], 'val': []}
    for label, name in enumerate(classes):
        photo, box = REGIONS[name]
        os.makedirs(os.path.join(directory, name), exist_ok=True)
        for split, count in (('train', n_train), ('val', n_val)):
            left, top, right, bottom = _part(box, split == 'train')
            w, h = right - left, bottom - top
            for i in range(count):
                side = int(min(w, h) * rng.uniform(0.4, 1.0))
                x = left + rng.randint(0, w - side + 1)
                y = top + rng.randint(0, h - side + 1)
                out = rng.randint(72, 113)
                crop = photos[photo][y:y + side, x:x + side]
                image = Image.fromarray(crop).resize((out, out), Image.BILINEAR)
                rel = '{}/{}{:03d}.jpg'.format(name, split, i)
                image.save(os.path.join(directory, rel), quality=90)
                lines[split].append('{} {}\n'.format(rel, label))
    paths = {}
    for split, entries in lines.items():
        paths[split] = os.path.join(directory, split + '.txt')
        with open(paths[split], 'w') as f:
            f.writelines(entries)
    return DataSet(str(directory), paths['train'], paths['val'], classes)


if __name__ == '__main__':
    if len(sys.argv) != 2:
        sys.exit('usage: python demo_data.py DIRECTORY')
    data = make(sys.argv[1])
    print('{} classes ({}) in {}: {} and {}'.format(len(data.classes), ', '.join(data.classes),
                                                   data.root, data.train, data.val))
