"""Image data sets for the DALI pipelines: the list file of Chainer's ImageNet example and a
class-per-directory tree, read and checked in Python so that bad input is a Python error that names
the file or the line.

    ds = dataset.load('/data/imagenet/train', 'train.txt', num_classes=1000)
    ds.paths[0], ds.labels[0]

List file: one ``relative/path label`` per line (the path may contain spaces: the label is the last
field; blank lines are skipped), paths relative to ``root``, UTF-8 (a byte-order mark at the start,
as some Windows editors write, is ignored); labels are int32, so at most 2**31 - 1. Tree: ``root/<class>/<image>``, classes
numbered in sorted order of their directory names, images with the extensions in
IMAGE_EXTENSIONS in sorted order.
"""
import hashlib
import os
import stat

import numpy

IMAGE_EXTENSIONS = ('.jpg', '.jpeg', '.png')
JPEG_MAGIC = b'\xff\xd8\xff'
PNG_MAGIC = b'\x89PNG\r\n\x1a\n'
_TAIL = 1024        # the end-of-image marker must lie in the last _TAIL bytes
MAX_LISTED = 10     # problems spelled out in an exception message
LABEL_DTYPE = numpy.dtype(numpy.int32)      # what the pipelines feed DALI and the model reads
MAX_LABEL = int(numpy.iinfo(LABEL_DTYPE).max)
_BOM = '\ufeff'


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
    ``num_classes``, ``source`` (what was read, for messages), ``root`` (the directory the paths
    were joined to, or None)."""

    def __init__(self, paths, labels, num_classes, source, root=None):
        self.root = None if root is None else os.fspath(root)
        self.paths = list(paths)
        labels = numpy.asarray(labels)
        if labels.dtype.kind not in 'iu' and labels.size:
            raise TypeError('labels must be integers; got an array of {}'.format(labels.dtype))
        bad = numpy.flatnonzero((labels < 0) | (labels > MAX_LABEL)) if labels.size else ()
        if len(bad):
            raise ValueError('label {} (of image {!r}) does not fit the labels\' {} (0..{})'
                             .format(labels[bad[0]], self.paths[bad[0]], LABEL_DTYPE, MAX_LABEL))
        self.labels = labels.astype(LABEL_DTYPE)
        self.num_classes = int(num_classes)
        self.source = source

    def __len__(self):
        return len(self.paths)

    def fingerprint(self):
        """SHA-256 (hex) of the list: every path relative to ``root`` and every label, in order.
        The same list under another root (a data set moved or mounted elsewhere) has the same
        fingerprint; another list of the same size, or the same images in another order or with
        other labels, has another. About 0.4 s for ImageNet's 1.28 million images: computed when
        a snapshot is saved or loaded, never per batch."""
        prefix = None if self.root is None else os.path.join(self.root, '')
        names = self.paths if prefix is None else [
            p[len(prefix):] if p.startswith(prefix) else p for p in self.paths]
        h = hashlib.sha256()
        h.update(len(names).to_bytes(8, 'little'))
        h.update('\0'.join(names).encode('utf-8', 'surrogateescape'))
        h.update(b'\0')
        h.update(self.labels.astype('<i4').tobytes())
        return h.hexdigest()


def load(root, list_file=None, num_classes=None, check_files=True):
    """Reads a data set: the list file ``list_file`` with paths relative to ``root``, or the
    class-per-directory tree under ``root`` when ``list_file`` is None. With ``check_files``,
    also checks that every image exists and is a non-empty file (one ``stat`` each).

    Raises FileNotFoundError for a missing ``root`` or ``list_file``, DatasetError for anything
    wrong inside them."""
    _check_dir('root', root)
    if num_classes is not None and (isinstance(num_classes, bool)
                                    or not isinstance(num_classes, (int, numpy.integer))
                                    or not 1 <= num_classes <= MAX_LABEL + 1):
        raise ValueError('num_classes must be a positive integer or None (at most 2**31: labels '
                         'are {}); got {!r}'.format(LABEL_DTYPE, num_classes))
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
            if number == 1 and raw.startswith((b'\xff\xfe', b'\xfe\xff')):
                problems.append((list_file, 'the list is UTF-16 text (it starts with the byte-order '
                                            'mark {!r}); save it as UTF-8'.format(raw[:2])))
                break
            try:
                line = list_line(raw, number)
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
            if label > MAX_LABEL:       # it would wrap to a negative int32 in DALI and the model
                problems.append((where, 'label {} does not fit the labels\' {}: at most {}'
                                 .format(label, LABEL_DTYPE, MAX_LABEL)))
                continue
            paths.append(os.path.join(root, path))
            labels.append(label)
    if not paths and not problems:
        problems.append((list_file, 'the list is empty: no image listed'))
    if problems:
        return None, problems
    n = num_classes if num_classes is not None else max(labels) + 1
    return Dataset(paths, labels, n, list_file, root), []


def list_line(raw, number):
    """Line ``number`` (from 1) of a list file, decoded from UTF-8 and stripped; the byte-order
    mark some editors put at the start of the first line is dropped (it would otherwise become an
    invisible first character of the first path). Raises UnicodeDecodeError."""
    line = raw.decode('utf-8')
    if number == 1 and line.startswith(_BOM):
        line = line[len(_BOM):]
    return line.strip()


def read_tree(root, num_classes=None):
    """Dataset of the class-per-directory tree under ``root``."""
    _check_dir('root', root)
    # hidden directories (.ipynb_checkpoints, .git) are not classes: each would shift the labels
    classes = sorted(d for d in os.listdir(root)
                     if not d.startswith('.') and os.path.isdir(os.path.join(root, d)))
    if not classes:
        raise DatasetError([(root, 'no class directories (expected root/<class>/<image>)')])
    if num_classes is not None and num_classes != len(classes):
        raise DatasetError([(root, '{} class directories, but num_classes={}'
                             .format(len(classes), num_classes))])
    paths, labels, empty = [], [], []
    for label, c in enumerate(classes):
        d = os.path.join(root, c)
        names = sorted(n for n in os.listdir(d) if n.lower().endswith(IMAGE_EXTENSIONS))
        paths += [os.path.join(d, n) for n in names]
        labels += [label] * len(names)
        if not names:
            empty.append(d)
    if not paths:
        raise DatasetError([(root, 'no images ({}) in its {} class directories'
                             .format('/'.join(IMAGE_EXTENSIONS), len(classes)))])
    if empty:       # a class without images (lost+found, a stray folder) shifts the labels after it
        raise DatasetError([(d, 'a class directory without images ({}): it would be class {} and '
                             'shift the labels of the classes after it; remove it, or give a '
                             'list file'.format('/'.join(IMAGE_EXTENSIONS), classes.index(
                                 os.path.basename(d)))) for d in empty])
    return Dataset(paths, labels, len(classes), root, root)


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
    """content_problem, then a full decode; None when the image is good.

    JPEGs are decoded by libjpeg-turbo through simplejpeg with ``strict=True``: libjpeg's
    warnings ("Corrupt JPEG data: premature end of data segment", "... extraneous bytes before
    marker") are errors here. libjpeg only warns about damaged entropy-coded data and fills the
    rest with grey, and Pillow and DALI's CPU decoder (libjpeg-turbo too) then return an image
    without an error, so a JPEG with a block zeroed in the middle, or cut and re-terminated, would
    pass a Pillow decode. PNGs (and JPEGs when simplejpeg is missing) are decoded fully by Pillow.
    The decoders that are not installed are skipped: :func:`missing_decoders` says which."""
    problem = content_problem(path)
    if problem:
        return problem
    try:
        with open(path, 'rb') as f:
            data = f.read()
    except OSError as e:
        return 'cannot read the image file: {}'.format(e.strerror or e)
    if data.startswith(JPEG_MAGIC) and have_simplejpeg():
        return _strict_jpeg_problem(data)
    if not have_pil():
        return None
    import io
    from PIL import Image
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
    except Exception as e:      # PIL raises OSError, SyntaxError, ValueError... on bad data
        return 'cannot be decoded: {}'.format(e)
    return None


# simplejpeg's colour spaces to decode into: the file's own (no conversion can fail)
_JPEG_SPACES = {'Gray': 'GRAY', 'CMYK': 'CMYK', 'YCCK': 'CMYK'}


def _strict_jpeg_problem(data):
    import simplejpeg
    try:
        space = simplejpeg.decode_jpeg_header(data)[2]
        simplejpeg.decode_jpeg(data, colorspace=_JPEG_SPACES.get(space, 'RGB'), strict=True)
    except ValueError as e:     # simplejpeg's errors, libjpeg's warnings included
        return 'cannot be decoded: {} (libjpeg-turbo, warnings counted as errors)'.format(
            str(e).strip().rstrip('.'))
    return None


def have_pil():
    """Whether Pillow can be imported (decode_problem decodes PNGs with it)."""
    try:
        import PIL  # noqa: F401
    except ImportError:
        return False
    return True


def have_simplejpeg():
    """Whether simplejpeg can be imported (decode_problem decodes JPEGs with it, strictly)."""
    try:
        import simplejpeg  # noqa: F401
    except ImportError:
        return False
    return True


def missing_decoders():
    """What :func:`decode_problem` cannot check here, one line per missing decoder (empty when
    everything is checked)."""
    out = []
    if not have_simplejpeg():
        out.append('simplejpeg is not installed: JPEGs are decoded by Pillow, which does not '
                   'report damaged entropy-coded data (a block zeroed, a file cut and '
                   're-terminated): pip install simplejpeg')
    if not have_pil():
        out.append('Pillow is not installed: {}PNGs are checked by their headers and ends only, '
                   'not decoded: pip install pillow'
                   .format('' if have_simplejpeg() else 'JPEGs and '))
    return out


def _check_dir(name, path):
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError('{} must be a directory path; got {!r}'.format(name, path))
    if not os.path.isdir(path):
        raise FileNotFoundError('{} {!r} does not exist or is not a directory'.format(name, path))
