"""``python -m chainer_tc dali-check ROOT LIST`` (or ``dali-check ROOT`` for a class-per-directory
tree): scans a data set and lists every bad line of the list and every bad image (missing, empty,
not a JPEG or PNG, truncated, not decodable, or decodable only with a decoder warning: libjpeg's
"Corrupt JPEG data" warnings are errors here), with a progress bar on stderr. Exit status 0 when all
is well, 1 when anything is bad, 2 for bad arguments (a missing LIST or ROOT). ROOT comes first,
as in ``imagenet_pipeline(root, list_file)``; the old order LIST ROOT (a file, then a directory)
still works, with a deprecation notice.

    python -m chainer_tc dali-check /data/imagenet/train train.txt --num-classes 1000
"""
import argparse
import collections
import concurrent.futures
import os
import sys
import time
import warnings

from chainer_tc.dali import dataset


def main(argv=None):
    p = argparse.ArgumentParser(
        prog='python -m chainer_tc dali-check',
        usage='%(prog)s ROOT [LIST] [--num-classes N] [--jobs J] [--no-decode]',
        description='Check an image data set for the DALI pipelines: every bad list line and '
                    'image is listed; exit status 1 if any.')
    p.add_argument('paths', nargs='+', metavar='ROOT [LIST]',
                   help="the image root and the list file (lines 'relative/path label'); or "
                        "ROOT alone for a class-per-directory tree")
    p.add_argument('--num-classes', type=int, default=None, metavar='N',
                   help='labels must lie in [0, N)')
    p.add_argument('--jobs', type=int, default=len(os.sched_getaffinity(0)), metavar='J',
                   help='images checked in parallel (default: the CPUs available)')
    p.add_argument('--no-decode', action='store_true',
                   help='check headers and ends of files only, without decoding them')
    args = p.parse_args(argv)
    if args.num_classes is not None and not 1 <= args.num_classes <= dataset.MAX_LABEL + 1:
        p.error('--num-classes must be a positive integer, at most 2**31 (labels are {}); got {}'
                .format(dataset.LABEL_DTYPE, args.num_classes))
    if len(args.paths) > 2:
        p.error('expected ROOT LIST or ROOT; got {} paths'.format(len(args.paths)))
    root, list_file = args.paths if len(args.paths) == 2 else (args.paths[0], None)
    if list_file is not None and os.path.isfile(root) and os.path.isdir(list_file):
        note = ('dali-check takes ROOT LIST; got the list file {!r} first and the root {!r} '
                'second: taken in that order for now'.format(root, list_file))
        print('dali-check: deprecated: {}'.format(note), file=sys.stderr)
        warnings.warn(note, DeprecationWarning, stacklevel=2)
        root, list_file = list_file, root
    try:
        if not os.path.isdir(root):
            raise FileNotFoundError('root {!r} does not exist or is not a directory'.format(root))
        if list_file is None:
            problems, paths = [], dataset.read_tree(root, args.num_classes).paths
        else:
            problems, paths = _parse_all(list_file, root, args.num_classes)
    except (FileNotFoundError, dataset.DatasetError) as e:
        print('dali-check: {}'.format(e), file=sys.stderr)
        return 2 if isinstance(e, FileNotFoundError) else 1
    for where, what in problems:
        print('{}: {}'.format(where, what))
    if not args.no_decode:
        for line in dataset.missing_decoders():
            print('dali-check: {}'.format(line), file=sys.stderr)
    check = dataset.content_problem if args.no_decode else dataset.decode_problem
    bad = _scan(paths, check, max(1, args.jobs))
    print('{} line(s) of the list and {} of {} image(s) are bad'.format(
        len(problems), bad, len(paths)) if problems or bad else
        'all {} images are good'.format(len(paths)))
    return 1 if problems or bad else 0


def _parse_all(list_file, root, num_classes):
    """Every line problem, and the paths of every line that names an image (good or bad label),
    so that the images are checked too."""
    ds, problems = dataset.parse_list(list_file, root, num_classes)
    if ds is not None:
        return [], ds.paths
    paths = []
    with open(list_file, 'rb') as f:
        for number, raw in enumerate(f, 1):
            try:
                line = dataset.list_line(raw, number)
            except UnicodeDecodeError:
                line = raw.decode('utf-8', 'replace').strip()
            fields = line.rsplit(None, 1)
            if len(fields) == 2:
                paths.append(os.path.join(root, fields[0]))
    return problems, paths


def _scan(paths, check, jobs):
    """Checks every path on ``jobs`` threads (PIL and file reads release the GIL); prints each
    bad one as it is found; returns how many were bad."""
    bar = _Progress(len(paths))
    bad = 0
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        for path, problem in _in_order(pool, check, paths, window=16 * jobs):
            if problem:
                bad += 1
                bar.clear()
                print('{}: {}'.format(path, problem), flush=True)
            bar.update(bad)
    bar.close()
    return bad


def _in_order(pool, f, items, window):
    """``(item, f(item))`` in order, at most ``window`` calls queued at a time (pool.map would
    queue one future per image: too many for ImageNet)."""
    pending = collections.deque()
    for item in items:
        pending.append((item, pool.submit(f, item)))
        if len(pending) >= window:
            item, future = pending.popleft()
            yield item, future.result()
    while pending:
        item, future = pending.popleft()
        yield item, future.result()


class _Progress(object):
    """``[#####.....]  512/1000 images, 2 bad, 803 images/s`` on stderr, redrawn at most 5 times
    a second on a terminal; otherwise a line per 10% at most once a second, and the last."""

    def __init__(self, total, stream=None):
        self.total, self.done = total, 0
        self.stream = sys.stderr if stream is None else stream
        self.tty = getattr(self.stream, 'isatty', lambda: False)()
        self.start = self.last = time.perf_counter()
        self.decile = -1

    def update(self, bad):
        self.done += 1
        now = time.perf_counter()
        decile = 10 * self.done // max(1, self.total)
        if self.tty and now - self.last < 0.2 and self.done < self.total:
            return
        if not self.tty and self.done < self.total and (decile == self.decile
                                                         or now - self.last < 1.0):
            return
        self.last, self.decile = now, decile
        filled = 30 * self.done // max(1, self.total)
        line = '[{}{}] {:>{w}}/{} images, {} bad, {:.0f} images/s'.format(
            '#' * filled, '.' * (30 - filled), self.done, self.total, bad,
            self.done / max(now - self.start, 1e-9), w=len(str(self.total)))
        self.stream.write(('\r' + line) if self.tty else line + '\n')
        self.stream.flush()

    def clear(self):
        if self.tty:
            self.stream.write('\r\033[K')

    def close(self):
        if self.tty:
            self.stream.write('\n')
        self.stream.flush()


if __name__ == '__main__':
    sys.exit(main())
