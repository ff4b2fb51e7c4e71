"""Loading ``.npz`` files (models, optimizers, Trainer snapshots) without unpickling anything.

    import chainer_tc.serializers
    chainer_tc.serializers.load_npz('result/snapshot_iter_1000', trainer)     # resume a Trainer
    chainer_tc.serializers.load_npz('model.npz', model)                       # --initmodel

``chainer.serializers.load_npz`` opens files with ``numpy.load(..., allow_pickle=True)``: an
object array in a crafted model or snapshot file is unpickled, and unpickling runs whatever code
the file names. This ``load_npz`` has Chainer's arguments and semantics (it drives Chainer's own
``NpzDeserializer``) but reads every array with ``allow_pickle=False``: numeric, bool and string
arrays load; an object array is refused with a ``ValueError`` naming its key, before any of its
bytes are unpickled. One object array is accepted: Chainer's ``DictionarySerializer`` writes a
``None`` value (an uninitialised parameter, an iterator's ``previous_epoch_detail`` before the
first batch) as ``numpy.asarray(None)``, a 0-d object array; its pickle is recognised by reading
its opcodes with ``pickletools`` (which executes nothing) and comparing them with the pickle numpy
writes for ``numpy.asarray(None)``; it loads as None. Saving needs nothing new:
``chainer.serializers.save_npz`` and ``extensions.snapshot()`` write no pickles except those Nones.
"""
import pickle
import pickletools
import zipfile

import numpy
from numpy.lib import format as npy_format

from chainer.serializers import npz as chainer_npz


def _opcodes(payload):
    """The pickle's opcodes and arguments, read (not executed); numpy 2's module names mapped to
    numpy 1's, frame lengths dropped (they follow from the names)."""
    ops = []
    for op, arg, _ in pickletools.genops(payload):
        if op.name == 'FRAME':
            arg = None
        elif isinstance(arg, str):
            arg = arg.replace('numpy._core', 'numpy.core')
        ops.append((op.name, arg))
    return ops


_NONE_PICKLES = [_opcodes(pickle.dumps(numpy.asarray(None), protocol=p)) for p in range(2, 6)]


def _is_pickled_none(payload):
    try:
        return _opcodes(payload) in _NONE_PICKLES
    except Exception:           # not a well-formed pickle: not a None either
        return False


class _SafeNpz(object):
    """The mapping ``NpzDeserializer`` reads from: an open npz, every member checked first."""

    def __init__(self, npz, name):
        self.npz, self.name = npz, name

    def __contains__(self, key):
        return key in self.npz.files

    def __getitem__(self, key):
        if key not in self.npz.files:
            raise KeyError('{!r} is not in {}'.format(key, self.name))
        with self.npz.zip.open(key + '.npy') as f:
            version = npy_format.read_magic(f)
            if version == (1, 0):
                shape, _, dtype = npy_format.read_array_header_1_0(f)
            else:
                shape, _, dtype = npy_format.read_array_header_2_0(f)
            if dtype.hasobject:
                if shape == () and _is_pickled_none(f.read()):
                    return numpy.asarray(None)
                raise ValueError(
                    'refusing to load {!r} from {}: it is an object array (shape {}), which '
                    'numpy reads by unpickling, and unpickling can run code. chainer_tc.'
                    'serializers.load_npz loads numeric, bool and string arrays only (and None '
                    'values as Chainer saves them)'.format(key, self.name, shape))
        return self.npz[key]        # allow_pickle=False: numpy refuses pickles again


def _open(file):
    name = repr(file) if isinstance(file, str) else 'the file'
    try:
        npz = numpy.load(file, allow_pickle=False)
    except zipfile.BadZipFile as e:
        raise ValueError('{} is not a valid .npz file: {}'.format(name, e)) from None
    except EOFError:                # (numpy's word for a file of 0 bytes)
        raise ValueError('{} is empty (0 bytes), not an .npz file: a save that did not '
                         'finish?'.format(name)) from None
    except ValueError as e:
        if 'pickled' not in str(e):
            raise
        # neither a zip archive nor a .npy array: numpy would take it for a pickle
        raise ValueError('{} is not a valid .npz file (not a zip archive of .npy arrays; numpy '
                         'would read it as a pickle, which is refused)'.format(name)) from None
    if not isinstance(npz, numpy.lib.npyio.NpzFile):
        raise ValueError('{} is a single .npy array, not an .npz file of named arrays; '
                         'chainer_tc.serializers.load_npz reads what save_npz writes'
                         .format(name))
    return npz, name


def read_npz(file):
    """``{key: array}`` of every array in an ``.npz`` file, read as :func:`load_npz` reads
    (nothing unpickled; an object array is refused naming its key; a saved None is None)."""
    npz, name = _open(file)
    with npz:
        safe = _SafeNpz(npz, name)
        out = {}
        for key in npz.files:
            a = safe[key]
            out[key] = None if a.dtype.hasobject else a
        return out


def load_npz(file, obj, path='', strict=True, ignore_names=None):
    """Loads ``obj`` (a Link, Optimizer, Trainer, ... anything with ``serialize``) from an
    ``.npz`` file, as ``chainer.serializers.load_npz`` does, without unpickling.

    Args:
        file (str or file-like): the ``.npz`` file (``save_npz`` output, a Trainer snapshot).
        obj: the object to fill in.
        path (str): the prefix under which ``obj`` was saved, e.g.
            ``'updater/model:main/'`` to take a model out of a Trainer snapshot.
        strict (bool): True: a value ``obj`` expects and the file lacks is an error (KeyError);
            False: it is left as it is.
        ignore_names (str, callable or list of them): keys not to load, as in Chainer.

    Raises:
        ValueError: the file holds an object array under a key that is read (named in the
            message), or is not an ``.npz`` file.
    """
    npz, name = _open(file)
    with npz:
        deserializer = chainer_npz.NpzDeserializer(
            _SafeNpz(npz, name), path=path, strict=strict, ignore_names=ignore_names)
        deserializer.load(obj)
