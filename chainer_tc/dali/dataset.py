"""Image data sets for the DALI pipelines: the list file of Chainer's ImageNet example and a
class-per-directory tree, read and checked in Python so that bad input is a Python error that names
the file or the line.

    ds = dataset.load('/data/imagenet/train', 'train.txt', num_classes=1000)
    ds.paths[0], ds.labels[0]

List file: one ``relative/path label`` per line (the path may contain spaces: the label is the last
field; blank lines are skipped), paths relative to ``root``. Tree: ``root/<class>/<image>``, classes
numbered in sorted order of their directory names, images with the extensions in
IMAGE_EXTENSIONS in sorted order.
"""
import os
import stat

import numpy

IMAGE_EXTENSIONS = ('.jpg', '.jpeg', '.png')
JPEG_MAGIC = b'\xff\xd8\xff'
PNG_MAGIC = b'\x89PNG\r\n\x1a\n'
_TAIL = 1024        # the end-of-image marker must lie in the last _TAIL bytes
MAX_LISTED = 10     # problems spelled out in an exception message


class DatasetError(ValueError):
    """Bad input data. ``problems`` holds every ``(where, what)`` found: where is ``path`` or
    ``list_file:line``."""

    def __init__(self, problems, hint=''):
        self.problems = list(problems)
        lines = ['{}: {}'.format(w, p) for w, p in self.problems[:MAX_LISTED]]
        if len(self.problems) > MAX_LISTED:
            lines.append('... and {} more'.format(len(self.problems) - MAX_LISTED))
        head = '{} problem(s) in the data set'.format(len(self.problems))
        super().__init__(head + ':\n  ' + '\n  '.join(lines) + (('\n' + hint) if hint else ''))


class Dataset(object):
    """Images and labels: ``paths`` (list of str, root joined), ``labels`` (int32 array),
    ``num_classes``, ``source`` (what was read, for messages)."""

    def __init__(self, paths, labels, num_classes, source):
        self.paths = list(paths)
        self.labels = numpy.asarray(labels, dtype=numpy.int32)
        self.num_classes = int(num_classes)
        self.source = source

    def __len__(self):
        return len(self.paths)


def load(root, list_file=None, num_classes=None, check_files=True):
    """Reads a data set: the list file ``list_file`` with paths relative to ``root``, or the
    class-per-directory tree under ``root`` when ``list_file`` is None. With ``check_files``,
    also checks that every image exists and is a non-empty file (one ``stat`` each).

    Raises FileNotFoundError for a missing ``root`` or ``list_file``, DatasetError for anything
    wrong inside them."""
    _check_dir('root', root)
    if num_classes is not None and (isinstance(num_classes, bool)
                                    or not isinstance(num_classes, (int, numpy.integer))
                                    or num_classes < 1):
        raise ValueError('num_classes must be a positive integer or None; got {!r}'
                         .format(num_classes))
    if list_file is None:
        ds = read_tree(root, num_classes)
    else:
        ds, problems = parse_list(list_file, root, num_classes)
        if problems:
            raise DatasetError(problems, hint(root, list_file))
    if check_files:
        problems = [(p, why) for p in ds.paths for why in [stat_problem(p)] if why]
        if problems:
            raise DatasetError(problems, hint(root, list_file))
    return ds


def hint(root, list_file=None):
    """The command that lists every bad line and file of a data set."""
    args = [root, list_file] if list_file is not None else [root]
    return 'python -m chainer_tc dali-check {} lists every bad line and file'.format(
        ' '.join(str(a) for a in args))


def parse_list(list_file, root, num_classes=None):
    """``(Dataset or None, problems)`` from a list file; problems are ``('list:line', what)``, all
    of them (for dali-check). Raises FileNotFoundError when ``list_file`` does not exist."""
    if not os.path.isfile(list_file):
        raise FileNotFoundError('list_file {!r} does not exist or is not a file'.format(list_file))
    paths, labels, problems = [], [], []
    with open(list_file, 'rb') as f:
        for number, raw in enumerate(f, 1):
            where = '{}:{}'.format(list_file, number)
            try:
                line = raw.decode('utf-8').strip()
            except UnicodeDecodeError:
                problems.append((where, 'not UTF-8 text: {!r}'.format(raw[:60])))
                continue
            if not line:
                continue
            fields = line.rsplit(None, 1)
            if len(fields) < 2:
                problems.append((where, "{!r} has no label (expected 'PATH LABEL')".format(line)))
                continue
            path, label = fields
            try:
                label = int(label)
            except ValueError:
                problems.append((where, 'label {!r} is not an integer'.format(label)))
                continue
            if label < 0 or (num_classes is not None and label >= num_classes):
                problems.append((where, 'label {} is out of range {}'.format(
                    label, '0..{} (num_classes={})'.format(num_classes - 1, num_classes)
                    if num_classes is not None else '(labels must be >= 0)')))
                continue
            paths.append(os.path.join(root, path))
            labels.append(label)
    if not paths and not problems:
        problems.append((list_file, 'the list is empty: no image listed'))
    if problems:
        return None, problems
    n = num_classes if num_classes is not None else max(labels) + 1
    return Dataset(paths, labels, n, list_file), []


def read_tree(root, num_classes=None):
    """Dataset of the class-per-directory tree under ``root``."""
    _check_dir('root', root)
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    if not classes:
        raise DatasetError([(root, 'no class directories (expected root/<class>/<image>)')])
    if num_classes is not None and num_classes != len(classes):
        raise DatasetError([(root, '{} class directories, but num_classes={}'
                             .format(len(classes), num_classes))])
    paths, labels = [], []
    for label, c in enumerate(classes):
        d = os.path.join(root, c)
        names = sorted(n for n in os.listdir(d) if n.lower().endswith(IMAGE_EXTENSIONS))
        paths += [os.path.join(d, n) for n in names]
        labels += [label] * len(names)
    if not paths:
        raise DatasetError([(root, 'no images ({}) in its {} class directories'
                             .format('/'.join(IMAGE_EXTENSIONS), len(classes)))])
    return Dataset(paths, labels, len(classes), root)


def stat_problem(path):
    """What is wrong with ``path`` that a ``stat`` shows (missing, not a file, empty), or None."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return 'image file does not exist'
    except OSError as e:
        return 'cannot stat the image file: {}'.format(e.strerror or e)
    if not stat.S_ISREG(st.st_mode):
        return 'not a regular file'
    if st.st_size == 0:
        return 'empty file (0 bytes)'
    return None


def content_problem(path):
    """What is wrong with the bytes of ``path`` (unreadable, not a JPEG or PNG, truncated), or
    None. Reads the first and last bytes only; see decode_problem for a full decode."""
    problem = stat_problem(path)
    if problem:
        return problem
    try:
        with open(path, 'rb') as f:
            head = f.read(16)
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - _TAIL))
            tail = f.read()
    except OSError as e:
        return 'cannot read the image file: {}'.format(e.strerror or e)
    if head.startswith(JPEG_MAGIC):
        if b'\xff\xd9' not in tail:
            return 'truncated JPEG: no end-of-image marker (FF D9) in its last {} bytes'.format(
                min(size, _TAIL))
        return None
    if head.startswith(PNG_MAGIC):
        if b'IEND' not in tail[-12:]:
            return 'truncated PNG: no IEND chunk at its end'
        return None
    return 'not a JPEG or PNG image (it starts with {!r})'.format(head[:8])


def decode_problem(path):
    """content_problem, then a full decode with PIL (at 1/8 scale: every coefficient is still
    entropy-decoded, so corrupt or truncated data is found, at a fraction of the cost). None when
    the image is good; 'PIL' checks are skipped when Pillow is not installed."""
    problem = content_problem(path)
    if problem or not have_pil():
        return problem
    from PIL import Image
    try:
        with Image.open(path) as im:
            im.draft('RGB', (max(1, im.size[0] // 8), max(1, im.size[1] // 8)))
            im.load()
    except Exception as e:      # PIL raises OSError, SyntaxError, ValueError... on bad data
        return 'cannot be decoded: {}'.format(e)
    return None


def have_pil():
    """Whether Pillow can be imported (decode_problem decodes with it)."""
    try:
        import PIL  # noqa: F401
    except ImportError:
        return False
    return True


def _check_dir(name, path):
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError('{} must be a directory path; got {!r}'.format(name, path))
    if not os.path.isdir(path):
        raise FileNotFoundError('{} {!r} does not exist or is not a directory'.format(name, path))
