"""DaliIterator: a ``chainer.dataset.Iterator`` over a DALI pipeline, and its converter.

    it = dali.DaliIterator(dali.imagenet_pipeline(root, 'train.txt'), batch_size=256)
    x, t = next(it)          # CuPy (device='gpu') or NumPy (device='cpu') arrays
    updater = chainer.training.StandardUpdater(it, opt, converter=dali.converter)

The contract: ``__next__`` returns a tuple ``(x, t)``: ``x`` the images as the pipeline makes them
(NHWC or NCHW, float16 or float32), ``t`` int32 labels of shape ``(len(x),)``, already on the
pipeline's device: ``converter`` passes them through. They are views of DALI's output buffers, no
copy: on a GPU CuPy arrays made by DLPack, ordered on CuPy's current stream (the consumer's); on
the CPU NumPy arrays.

The order of the images is decided here, not by DALI (``_order.EpochOrder``): each batch's file
paths and labels go to the pipeline through an ``external_source``; DALI runs
``prefetch_queue_depth`` batches ahead. A snapshot is the position of the last batch delivered,
so resuming from it rebuilds the pipeline there and continues with the same images.
"""
import collections
import os
import time

import numpy

import chainer

from chainer_tc.dali import _order
from chainer_tc.dali import dataset as dataset_module
from chainer_tc.dali import pipeline as pipeline_module


class DaliIterator(chainer.dataset.Iterator):
    """Batches of a DALI pipeline, with Chainer's iterator protocol.

    Args:
        pipeline: an :class:`ImagenetPipeline` from :func:`imagenet_pipeline`, or a dict of
            keyword arguments for it.
        batch_size (int): images per batch (the last one of an epoch may be shorter, see
            ``last_batch``).
        repeat (bool): epoch after epoch (training), or one pass then StopIteration (evaluation).
        shuffle (bool): a new order every epoch, the same on every shard. Default: ``repeat``.
        last_batch (str): 'fill' (default with ``repeat``: the last batch of an epoch is completed
            with the next epoch's first images), 'partial' (default without: a short last batch,
            every image exactly once) or 'drop' (images that do not fill a batch are left out).

    Attributes: ``epoch``, ``epoch_detail``, ``previous_epoch_detail``, ``is_new_epoch``,
    ``current_position`` (Chainer's meanings), ``epoch_size`` (images per epoch of this shard),
    ``last_indices`` (dataset indices of the last batch), ``wait_seconds`` (total time
    ``__next__`` waited for DALI), ``batches`` (batches delivered).
    """

    def __init__(self, pipeline, batch_size, repeat=True, shuffle=None, last_batch=None):
        self._pipe = None                               # finalize() works whatever fails below
        if isinstance(pipeline, dict):
            pipeline = pipeline_module.imagenet_pipeline(**pipeline)
        if not isinstance(pipeline, pipeline_module.ImagenetPipeline):
            raise TypeError('pipeline must be an ImagenetPipeline (chainer_tc.dali.'
                            'imagenet_pipeline) or a dict of its arguments; got {!r}'
                            .format(type(pipeline)))
        self.pipeline = pipeline
        self.dataset = pipeline.dataset
        self._batch_size = batch_size
        self._repeat = bool(repeat)
        self._shuffle = self.repeat if shuffle is None else bool(shuffle)
        self._last_batch = last_batch
        if self.shuffle and pipeline.num_shards > 1 and getattr(pipeline, 'seed_drawn', False):
            raise ValueError('the pipeline\'s seed was drawn (seed=None), in each process its '
                             'own, and shuffled shards of different seeds overlap and leave images '
                             'out (each cuts its own permutation): with num_shards={} give every '
                             'shard the same seed (e.g. rank 0\'s, sent with comm.bcast_obj)'
                             .format(pipeline.num_shards))
        self._order = self._make_order(pipeline.seed)
        self._position = _order.START
        self._feeder = None
        self.last_indices = None
        self.wait_seconds = 0.0
        self.batches = 0
        self._restart()

    def _make_order(self, seed):
        p = self.pipeline
        return _order.EpochOrder(len(self.dataset), self.batch_size, self.repeat, self.shuffle,
                                 self._last_batch, seed, p.shard_id, p.num_shards)

    # what the pipeline and the order were made for: fixed (an assignment, which Chainer's
    # SerialIterator follows for batch_size, would be silently ignored here)
    batch_size = property(lambda self: self._batch_size, lambda self, v: _fixed('batch_size'))
    repeat = property(lambda self: self._repeat, lambda self, v: _fixed('repeat'))
    shuffle = property(lambda self: self._shuffle, lambda self, v: _fixed('shuffle'))
    last_batch = property(lambda self: self._last_batch, lambda self, v: _fixed('last_batch'))

    def __copy__(self):
        """An iterator of its own at this one's position (as Chainer's MultiprocessIterator
        copies): a new DALI pipeline, the same order and seed. A shallow copy shared the
        pipeline, so iterating one used up the other (an Evaluator over a copy saw no batch)."""
        other = type(self).__new__(type(self))
        other.__dict__.update(self.__dict__)
        other._pipe = other._feeder = None
        other._order = other._make_order(self._order.seed)
        other.last_indices = None if self.last_indices is None else self.last_indices.copy()
        other._restart()
        return other

    def __deepcopy__(self, memo):
        """As :meth:`__copy__` (the pipeline's settings are shared: they are not changed)."""
        return self.__copy__()

    def __reduce__(self):
        raise TypeError('a DaliIterator holds a running DALI pipeline and cannot be pickled: '
                        'save its position with chainer.serializers (a trainer snapshot), and '
                        'make the iterator anew from the pipeline\'s arguments to load it')

    # ---- iteration ------------------------------------------------------------------------------

    def __next__(self):
        if self._pipe is None:
            raise RuntimeError('this DaliIterator was finalized (after finalize() or an error); '
                               'call reset() to start it again')
        if not self._feeder.in_flight:                  # repeat=False: the pass is over
            p = self._position
            self._position = p._replace(previous_epoch_detail=self._order.epoch_detail_of(p))
            raise StopIteration
        t = time.perf_counter()
        before = self._position
        try:
            out = self._pipe.outputs(cuda_stream=_consumer_stream(self.pipeline))
        except RuntimeError as e:           # (DALI's errors; another, a signal's, as it is)
            self._fail(e)
        except BaseException:
            self._resync(before)
            raise
        waited = time.perf_counter() - t
        indices, self._position = self._feeder.in_flight.popleft()
        batch = self._convert(out)
        self._schedule(before)                          # keep prefetch_queue_depth in flight
        self.last_indices = indices
        self.wait_seconds += waited
        self.batches += 1
        return batch

    next = __next__

    def _convert(self, out):
        """Views of DALI's output buffers, no copy: DALI's default (dynamic) executor gives every
        batch its own memory, kept alive by the view."""
        x, t = out[0].as_tensor(), out[1].as_tensor()
        if self.pipeline.device == 'gpu':
            import cupy
            with cupy.cuda.Device(self.pipeline.device_id):
                return cupy.from_dlpack(x), cupy.from_dlpack(t)
        return numpy.asarray(x), numpy.asarray(t)

    def _schedule(self, before=None):
        try:
            self._pipe.schedule_run()
        except RuntimeError as e:
            self._fail(e)
        except BaseException:
            self._resync(self._position if before is None else before)
            raise

    def _resync(self, position):
        """After an exception that is not DALI's, raised while the iterator waited on it (a
        signal handler's, at DALI's next line of Python): DALI may have handed over a batch
        the iterator did not deliver (it would be skipped, and the later ones counted wrong:
        found by review). The pipeline is rebuilt at ``position``, the last batch delivered,
        so the call is as if not made; if that fails, the iterator is finalized."""
        self._position = position
        try:
            self._restart()
        except BaseException:
            self._shutdown()

    def _fail(self, error):
        """Turns a failure inside DALI into an error naming the bad files: every image of the
        batches in flight is checked (header, then a full decode, as dali-check does)."""
        paths = list(dict.fromkeys(self.dataset.paths[i]
                                   for indices, _ in self._feeder.in_flight for i in indices))
        self.finalize()
        problems = [(p, why) for p in paths for why in [dataset_module.decode_problem(p)] if why]
        if problems:
            raise dataset_module.DatasetError(
                problems, dataset_module.hint(self.pipeline.root, self.pipeline.list_file)) \
                from error
        said = str(error).strip().splitlines()
        raise RuntimeError('DALI failed on a batch of {} image(s) ({}{}), none of which shows a '
                           'problem when checked; DALI said: {}'.format(
                               len(paths), ', '.join(paths[:3]), ', ...' if len(paths) > 3 else '',
                               ' / '.join(s.strip() for s in said if s.strip())[:2000])) \
            from error

    # ---- position -------------------------------------------------------------------------------

    @property
    def epoch(self):
        return self._position.epoch

    @property
    def current_position(self):
        return self._position.current_position

    @property
    def is_new_epoch(self):
        return self._position.is_new_epoch

    @property
    def epoch_detail(self):
        return self._order.epoch_detail_of(self._position)

    @property
    def previous_epoch_detail(self):
        previous = self._position.previous_epoch_detail
        return None if previous < 0 else previous

    @property
    def epoch_size(self):
        return self._order.epoch_size

    @property
    def _epoch_size(self):
        """(SerialIterator's name, which Chainer's Evaluator progress bar reads for its total.)"""
        return self._order.epoch_size

    def reset(self):
        """Back to the start of epoch 0 (the same order as the first pass). Cheap after a
        ``repeat=False`` pass; otherwise the DALI pipeline is rebuilt."""
        if self._pipe is not None and self._position == _order.START \
                and self._feeder.started_at == _order.START:
            return                                      # nothing delivered yet
        self._position = _order.START
        if self._pipe is not None and self._feeder.exhausted and not self._feeder.in_flight:
            self._pipe.reset()
            self._order.reset()
            self._feeder.restart()
            self._schedule()
        else:
            self._restart()

    def _restart(self):
        """A new DALI pipeline, fed from ``self._position`` on."""
        self._shutdown()
        self._order.set_position(self._position)
        self._feeder = _Feeder(self.dataset, self._order)
        p = self._position
        self._pipe = self.pipeline.build(self.batch_size, self._feeder,
                                         pipeline_module.augmentation_seed(
                                             self._order.seed, self.pipeline.shard_id, p.epoch,
                                             p.current_position))
        self._schedule()

    def serialize(self, serializer):
        """Saves or loads the position of the last batch delivered, the shuffling seed, what
        decides the order (data-set size, shards, ``shuffle``, ``repeat``, ``last_batch``, the
        epoch size) and a fingerprint of the list (paths relative to the root, and labels). A
        load adopts the seed, refuses a snapshot whose order settings or list differ from this
        iterator's (``ValueError`` naming each: resuming would repeat or skip images), and
        rebuilds the pipeline at the position: the next batch is the one that came next."""
        p = self._position
        epoch = serializer('epoch', p.epoch)
        current = serializer('current_position', p.current_position)
        is_new = serializer('is_new_epoch', p.is_new_epoch)
        previous = serializer('previous_epoch_detail', p.previous_epoch_detail)
        seed = serializer('seed', self._order.seed)
        here = self._order.settings()
        here['dataset_fingerprint'] = self.dataset.fingerprint()
        saved = collections.OrderedDict()
        loading = isinstance(serializer, chainer.serializer.Deserializer)
        for key, value in here.items():
            try:
                if not isinstance(value, str):
                    saved[key] = serializer(key, value)
                elif not loading:       # HDF5 (save_hdf5) stores no str arrays: UTF-8 bytes
                    serializer(key, value.encode('utf-8') if _is_hdf5(serializer) else value)
                else:                   # as stored: str (npz), or bytes (HDF5)
                    saved[key] = _text(serializer(key, None), value)
            except KeyError:
                if key in ('dataset_size', 'num_shards'):
                    raise
                raise KeyError('{!r} is not in the snapshot: it was saved by a chainer_tc that '
                               'did not record the order settings and the list of a DaliIterator, '
                               'so resuming from it cannot be checked (load with strict=False to '
                               'take this iterator\'s own settings unchecked)'.format(key)) \
                    from None
        if not loading:
            return
        saved = collections.OrderedDict(
            (k, type(here[k])(v)) for k, v in saved.items())
        self._check_resume(saved, here)
        self._order = self._make_order(int(seed))
        self._position = _order.Position(int(epoch), int(current), bool(is_new), float(previous))
        self._restart()

    def _check_resume(self, saved, here):
        wrong = _order.mismatches(saved, here)
        if not wrong:
            return
        keys = [k for k, _, _ in wrong]
        lines = []
        if 'dataset_size' in keys or 'num_shards' in keys:
            lines.append('the snapshot is of an iterator over {} images in {} shard(s); this one '
                         'has {} images in {} shard(s)'.format(
                             saved['dataset_size'], saved['num_shards'], here['dataset_size'],
                             here['num_shards']))
        for key, theirs, ours in wrong:
            if key in ('dataset_size', 'num_shards'):
                continue
            if key == 'dataset_fingerprint':
                if 'dataset_size' not in keys:
                    lines.append('the list of images differs (paths relative to the root, or '
                                 'labels, or their order: fingerprint {}... in the snapshot, {}... '
                                 'for {})'.format(theirs[:12], ours[:12], self.dataset.source))
            elif key == 'epoch_size' and not {'num_shards', 'shard_id', 'last_batch'} & set(keys):
                why = ('last_batch=\'drop\' with another batch_size leaves out other images'
                       if here['last_batch'] == 'drop' else
                       'the snapshot is from an earlier chainer_tc, whose training shards of '
                       'unequal size had epochs of unequal length')
                lines.append('epoch_size is {} in the snapshot, {} here ({})'
                             .format(theirs, ours, why))
            elif key != 'epoch_size':
                lines.append('{} is {!r} in the snapshot, {!r} here'.format(key, theirs, ours))
        if 'shard_id' in keys:
            lines.append('each shard resumes from its own snapshot')
        raise ValueError('cannot resume this DaliIterator from the snapshot: it would repeat or '
                         'skip images: {}. Build the iterator with the settings and the list the '
                         'snapshot was made with'.format('; '.join(lines)))

    def finalize(self):
        """Stops the DALI pipeline and its threads; ``reset()`` starts a new one."""
        self._shutdown()

    def _shutdown(self):
        pipe, self._pipe = getattr(self, '_pipe', None), None
        if pipe is not None:
            pipe._shutdown()            # what Pipeline.__del__ does: stops DALI's threads now


def _is_hdf5(serializer):
    try:
        from chainer.serializers import hdf5
    except ImportError:             # (no h5py: no HDF5 serializer either)
        return False
    return isinstance(serializer, hdf5.HDF5Serializer)


def _text(stored, default):
    """A text setting as a snapshot holds it: a str (a '<U' array: npz, readable by earlier
    chainer_tc versions too), UTF-8 bytes (an 'S' array: HDF5), or None (absent, loaded with
    strict=False)."""
    if stored is None:
        return default
    item = numpy.asarray(stored).item()
    return item.decode('utf-8') if isinstance(item, bytes) else str(item)


def _fixed(name):
    raise AttributeError('DaliIterator.{} is fixed when the iterator is made (its pipeline and '
                         'order are built for it): make a new DaliIterator'.format(name))


class _Feeder(object):
    """DALI's ``external_source`` callback: the next batch's file paths (UTF-8, uint8 arrays) and
    labels in ``order``'s order. Remembers each batch fed, ``(indices, position after it)``, in
    ``in_flight`` until the iterator delivers it."""

    def __init__(self, dataset, order):
        self.dataset, self.order = dataset, order
        self.in_flight = collections.deque()
        self.started_at = order.position
        self.exhausted = False

    def restart(self):
        self.in_flight.clear()
        self.started_at = self.order.position
        self.exhausted = False

    def __call__(self):
        try:
            indices = self.order.next_batch()
        except StopIteration:
            self.exhausted = True
            raise
        self.in_flight.append((indices, self.order.position))
        paths = [numpy.frombuffer(os.fsencode(self.dataset.paths[i]), numpy.uint8)
                 for i in indices]
        return paths, self.dataset.labels[indices]


def _consumer_stream(pipeline):
    """CuPy's current stream on the pipeline's device, to which DALI orders the outputs (None on
    the CPU). The pipeline's device, not the current one: the outputs live there and are wrapped
    there (``_convert``), and a stream of another device cannot order them. The null stream is
    passed as 1 (cudaStreamLegacy): DALI reads 0 as no stream."""
    if pipeline.device != 'gpu':
        return None
    import cupy
    return cupy.cuda.get_current_stream(pipeline.device_id).ptr or 1


class _PassThrough(chainer.dataset.Converter):
    """The converter of DaliIterator batches: ``(x, t)`` is already a batch of arrays on the
    pipeline's device; sent to ``device`` when one is given (no copy when it is already there)."""

    def __call__(self, batch, device=None):
        if not (isinstance(batch, tuple) and len(batch) == 2):
            raise TypeError('chainer_tc.dali.converter expects the (images, labels) tuple of a '
                            'DaliIterator; got {!r}'.format(type(batch)))
        if device is None:
            return batch
        device = chainer.get_device(device)
        return tuple(device.send(a) for a in batch)


converter = _PassThrough()
