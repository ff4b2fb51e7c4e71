"""Which images each batch holds, epoch after epoch, for one shard: the framework-independent part
of the DALI iterator (epoch size, sharding, shuffling, the last-batch policy, the position to resume
from). No DALI and no Chainer here.

Epoch ``e``'s order is a permutation of the whole data set drawn from ``(seed, e)`` alone (the
identity when not shuffling); shard ``k`` of ``S`` takes its ``k``-th contiguous slice.

With ``repeat=True`` every shard's epoch has the same length, so that the ranks of a multi-node
run see their epochs end (``is_new_epoch``, epoch triggers, a learning-rate schedule by epoch,
a collective Evaluator) at the same iteration: a slice one image shorter than the longest takes
one more, the first image of the next slice (wrapping around), and with 'drop' every shard
delivers as many whole batches as the shortest can. With ``repeat=False`` (a pass over the
data, validation) the slices are delivered as they are: every image exactly once. An epoch's
order is therefore known from the seed and the epoch number, and a position is three numbers
(epoch, images of that epoch already delivered, whether the last batch started an epoch): that is
all a snapshot needs to resume exactly.

Last-batch policies, for 7 images (0..6, not shuffled) at batch size 2; ``|`` marks where
``is_new_epoch`` is True, epochs 0 and 1 shown:

    policy     repeat=True                               repeat=False
    'fill'     [0 1] [2 3] [4 5] [6 0]| [1 2] [3 4] ...   (not allowed)
    'partial'  [0 1] [2 3] [4 5] [6]| [0 1] [2 3] ...     [0 1] [2 3] [4 5] [6]|, then StopIteration
    'drop'     [0 1] [2 3] [4 5]| [0 1] [2 3] ...          [0 1] [2 3] [4 5]|, then StopIteration

'fill' completes the epoch's last batch with the start of the next epoch (Chainer's SerialIterator
with ``repeat=True``); 'partial' ends every epoch with a short batch (with ``repeat=False``: every
image exactly once, as SerialIterator); 'drop' leaves out the images that do not fill a batch (a
fixed batch shape; with shuffling, different images each epoch).
"""
import collections

import numpy

POLICIES = ('fill', 'partial', 'drop')

Position = collections.namedtuple(
    'Position', ['epoch', 'current_position', 'is_new_epoch', 'previous_epoch_detail'])
Position.__doc__ = """Where an iterator stands: completed epochs, images of the current epoch
already delivered, whether the last batch completed an epoch, and epoch_detail before the last
batch (-1.0 before the first)."""

START = Position(0, 0, False, -1.0)


def shard_range(size, shard_id, num_shards):
    """[lo, hi): shard ``shard_id``'s slice of an epoch's order of ``size`` images (as DALI's
    readers cut shards: sizes differ by at most one)."""
    return size * shard_id // num_shards, size * (shard_id + 1) // num_shards


class EpochOrder(object):
    """The sequence of batches of one shard, as dataset indices.

    Args:
        size (int): images in the whole data set (all shards).
        batch_size (int): images per batch.
        repeat (bool): go on epoch after epoch; otherwise stop after one.
        shuffle (bool): a new permutation every epoch; otherwise the data set's order.
        last_batch (str): 'fill', 'partial' or 'drop' (see the module docstring); default 'fill'
            with ``repeat``, 'partial' without.
        seed (int): seed of the permutations (the same on every shard).
        shard_id, num_shards (int): this shard and how many there are.
    """

    def __init__(self, size, batch_size, repeat=True, shuffle=True, last_batch=None, seed=0,
                 shard_id=0, num_shards=1):
        if last_batch is None:
            last_batch = 'fill' if repeat else 'partial'
        _check_int('size', size, 1)
        _check_int('batch_size', batch_size, 1)
        _check_int('num_shards', num_shards, 1)
        _check_int('seed', seed, 0)
        if not isinstance(shard_id, (int, numpy.integer)) or not 0 <= shard_id < num_shards:
            raise ValueError('shard_id must be an integer in [0, num_shards={}); got {!r}'
                             .format(num_shards, shard_id))
        if num_shards > size:
            raise ValueError('num_shards={} is more than the {} images of the data set: a shard '
                             'would be empty'.format(num_shards, size))
        if last_batch not in POLICIES:
            raise ValueError('last_batch must be one of {}; got {!r}'.format(POLICIES, last_batch))
        if last_batch == 'fill' and not repeat:
            raise ValueError("last_batch='fill' needs repeat=True (it takes images from the next "
                             "epoch); use 'partial' or 'drop' with repeat=False")
        self.size = int(size)
        self.batch_size = int(batch_size)
        self.repeat = bool(repeat)
        self.shuffle = bool(shuffle)
        self.last_batch = last_batch
        self.seed = int(seed)
        self.shard_id, self.num_shards = int(shard_id), int(num_shards)
        lo, hi = shard_range(self.size, self.shard_id, self.num_shards)
        self.shard_size = hi - lo
        if self.repeat:                  # every shard alike: the longest, or the shortest's batches
            longest = -(-self.size // self.num_shards)
            shortest = self.size // self.num_shards
        else:
            longest = shortest = self.shard_size
        if last_batch == 'drop':
            self.epoch_size = shortest - shortest % self.batch_size
            if self.epoch_size == 0:
                raise ValueError("last_batch='drop' with batch_size={} and a shard of {} images "
                                 "gives no batch at all".format(batch_size, shortest))
        else:
            self.epoch_size = longest
        self._cached = (None, None)
        self.position = START

    def settings(self):
        """What decides which image comes when, besides the seed (which a resume adopts): a
        resumed iterator must have the same, or it repeats or skips images. ``batch_size`` enters
        only through ``epoch_size`` (with 'drop'); otherwise a resume may change it, as with
        Chainer's iterators."""
        return collections.OrderedDict([
            ('dataset_size', self.size), ('num_shards', self.num_shards),
            ('shard_id', self.shard_id), ('shuffle', self.shuffle), ('repeat', self.repeat),
            ('last_batch', self.last_batch), ('epoch_size', self.epoch_size)])

    def order(self, epoch):
        """Dataset indices of this shard's epoch ``epoch``, in delivery order (int64)."""
        if self._cached[0] != epoch:
            if self.shuffle:
                state = numpy.random.SeedSequence([self.seed, epoch]).generate_state(1)[0]
                perm = numpy.random.RandomState(state).permutation(self.size)
            else:
                perm = numpy.arange(self.size)
            lo, hi = shard_range(self.size, self.shard_id, self.num_shards)
            part = perm[lo:hi]
            if len(part) < self.epoch_size:              # one short: the next slice's first
                part = numpy.append(part, perm[hi % self.size])
            self._cached = (epoch, part[:self.epoch_size])
        return self._cached[1]

    def epoch_detail_of(self, position):
        return position.epoch + position.current_position / self.epoch_size

    def next_batch(self):
        """Indices of the next batch; advances the position. StopIteration after the one epoch of
        ``repeat=False``."""
        epoch, i = self.position.epoch, self.position.current_position
        if not self.repeat and epoch > 0:
            raise StopIteration
        previous = self.epoch_detail_of(self.position)
        n, need, parts, new_epoch = self.epoch_size, self.batch_size, [], False
        while need > 0:
            part = self.order(epoch)[i:i + need]
            parts.append(part)
            need -= len(part)
            i += len(part)
            if i == n:
                epoch, i, new_epoch = epoch + 1, 0, True
                if self.last_batch != 'fill':
                    break
        self.position = Position(epoch, i, new_epoch, previous)
        return numpy.concatenate(parts)

    def reset(self):
        """Back to the start of epoch 0 (the same order as the first time)."""
        self.position = START

    def set_position(self, position):
        """Resume from ``position`` (a Position, e.g. from a snapshot)."""
        epoch, current, new, previous = position
        _check_int('epoch', epoch, 0)
        if not isinstance(current, (int, numpy.integer)) or not 0 <= current < self.epoch_size:
            raise ValueError('current_position must be an integer in [0, {}) for this shard; '
                             'got {!r}'.format(self.epoch_size, current))
        self.position = Position(int(epoch), int(current), bool(new), float(previous))


def mismatches(saved, here):
    """``[(key, saved value, value here)]`` of the settings (``EpochOrder.settings()``) that
    differ."""
    return [(k, saved[k], v) for k, v in here.items() if saved[k] != v]


def _check_int(name, value, low):
    if isinstance(value, bool) or not isinstance(value, (int, numpy.integer)) or value < low:
        raise ValueError('{} must be an integer >= {}; got {!r}'.format(name, low, value))
