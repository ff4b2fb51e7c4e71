"""A TrainStep for data-parallel training over ChainerMN's ranks.

    comm = chainermn.create_communicator('pure_nccl')       # 'naive' on CPUs
    step = chainer_tc.multinode.TrainStep(model, optimizer, comm, lossfun)
    loss = step(x, t)                                       # this rank's shard of the batch

Before the first step the model is broadcast from rank 0, every parameter in its own precision
(:func:`chainer_tc.multinode.bcast.bcast_data`). Every step (eager, recorded, replayed
or captured) averages the gradients over the ranks with one collective on one buffer
(:class:`~chainer_tc.multinode.allreduce.GradientAllreduce`) before the batched update. The
dynamic loss scale stays identical on every rank: an inf or nan on one rank reaches every rank
through the mean, so every rank skips that step and halves its scale.

Every rank runs each step the same way (replayed, captured, recorded or eager): before each
step the ranks compare their input signatures and what they are about to do, in one small
host collective (an MPI allreduce of two integers). A replay makes only the collectives it
recorded (on a GPU a CUDA graph makes its NCCL calls, and no host code runs), while an eager
step makes others (the multi-node BatchNorm's exchange of row counts on the host): a rank
replaying next to a rank stepping eagerly would wait for it forever. Where the ranks differ
(a last partial batch on some ranks only), every rank runs that step eagerly, and says so once;
where they differ with one signature (a trace kept by some ranks only), its traces are dropped
on every rank and recorded again together.

What each rank finds when it builds a replay or checks one is shared too (a host allreduce of
one integer at each check and each stage of a build; none in replays): where the build fails
on one rank (a capture that runs out of memory on one GPU, a value that changed on one rank
only), or one rank's check sees the step change, every rank runs that signature as that rank
does. A capture makes no host exchange over the step's MPI communicator: the multi-node
BatchNorm's exchanges of row counts are answered from the recorded step before it
(:func:`chainer_tc.multinode.collectives.replaying_exchanges`), so that a capture failing
halfway on one rank leaves no rank waiting in an exchange. A CPU replay answers them so too
(every rank replays the signature its exchanges were recorded at).
"""
import contextlib
import hashlib

import numpy

import chainer

from chainer_tc.multinode import allreduce
from chainer_tc.multinode import collectives
from chainer_tc.multinode.bcast import bcast_data
from chainer_tc.static_graph import step as step_module


class TrainStep(step_module.TrainStep):
    """``chainer_tc.static_graph.TrainStep`` with the gradients averaged over the ranks of
    ``communicator`` (a ChainerMN communicator). ``allreduce_dtype``: see
    :class:`~chainer_tc.multinode.allreduce.GradientAllreduce`; other keyword arguments are
    TrainStep's.

    Attributes (besides TrainStep's):
        disagreements (int): steps every rank ran eagerly because the ranks' signatures or
            modes differed (see the module's docstring).
    """

    def __init__(self, model, optimizer, communicator, lossfun=None, allreduce_dtype=None,
                 **options):
        if 'reduce_gradients' in options:
            raise TypeError('multinode.TrainStep makes its own reduce_gradients')
        self.communicator = communicator
        self.allreduce = allreduce.GradientAllreduce(communicator, allreduce_dtype)
        super().__init__(model, optimizer, lossfun, reduce_gradients=self.allreduce,
                         **options)
        self._broadcast = False
        self._broadcast_names = None      # the initialised parameters rank 0 last sent
        self.disagreements = 0

    def __call__(self, *args, **kwargs):
        if not self._broadcast:
            self._broadcast_model(args, kwargs)
        return super().__call__(*args, **kwargs)

    def _agreed(self, key, entry, mode):
        """``mode`` where every rank is about to run this step with the same signature and
        mode, else 'eager' on every rank (one host allreduce; a second collective, of the
        signatures, only where they differ)."""
        comm = self.communicator
        if comm.size == 1:
            return mode
        mine = _digest(key, mode)
        from mpi4py import MPI
        span = numpy.array([mine, -mine], numpy.int64)
        comm.mpi_comm.Allreduce(MPI.IN_PLACE, span, op=MPI.MAX)
        if span[0] == -span[1]:               # the largest digest is the smallest: all equal
            return mode
        self.disagreements += 1
        everyone = collectives.allgather_objects(comm, (key, mode))
        ranks = '; '.join('rank {}: {}, {}'.format(r, step_module.describe_signature(k),
                                                   _MODES[m])
                          for r, (k, m) in enumerate(everyone))
        first = everyone[0][0]
        parts = []
        for k, _ in everyone[1:]:
            parts += [p for p in step_module.signature_change([first], k)[0] if p not in parts]
        if not parts:
            # one signature, different states (a trace that one rank dropped after a check):
            # every rank records it again, together
            entry.forget()
            self._warn('ranks:mode', 'multinode.TrainStep: the ranks were about to run a step '
                                     'of one signature differently ({}): it runs eagerly on '
                                     'every rank, and its traces are recorded again on every '
                                     'rank'.format(ranks))
        else:
            self._warn('ranks:' + ','.join(parts),
                       'multinode.TrainStep: the ranks differ in {} at this step ({}): it runs '
                       'eagerly on every rank (a rank replaying its trace would wait in its '
                       'collectives for a rank that steps eagerly); give every rank batches '
                       'of one shape (a last partial batch on some ranks only does this) and '
                       'the same settings to keep every step replayed'
                       .format(' and '.join(parts), ranks))
        return 'eager'

    def _shared_failure(self, failure):
        """``failure`` (why this rank's build or check failed, or None) joined with every other
        rank's: 'rank R: why; ...' where any rank failed, else None (one host allreduce; the
        reasons are gathered only where one failed)."""
        comm = self.communicator
        if comm.size == 1:
            return failure
        from mpi4py import MPI
        failed = numpy.array([failure is not None], numpy.int64)
        comm.mpi_comm.Allreduce(MPI.IN_PLACE, failed, op=MPI.MAX)
        if not failed[0]:
            return None
        everyone = collectives.allgather_objects(comm, failure)
        return '; '.join('rank {}: {}'.format(r, why) for r, why in enumerate(everyone)
                         if why is not None)

    def _recorded(self, inputs, buffers=None, previous=None):
        """A recorded step, with the host exchanges its functions made (for the capture or
        the CPU replay of its signature)."""
        if self.communicator.size == 1:
            return super()._recorded(inputs, buffers, previous)
        with collectives.recording_exchanges(self.communicator) as exchanges:
            trace, result = super()._recorded(inputs, buffers, previous)
        trace.exchanges = exchanges
        return trace, result

    def _exchanges_answered(self, trace):
        if trace.exchanges is None:       # one rank; a GPU replay (no host code runs)
            return contextlib.nullcontext()
        return collectives.replaying_exchanges(self.communicator, trace.exchanges)

    def _broadcast_model(self, args, kwargs):
        """Rank 0's parameters everywhere (lazy links are initialised by a forward first: in
        test mode, without backprop, its reports discarded)."""
        if any(p.array is None for p in self.optimizer.target.params()):
            # (the current reporter, its observers registered, with an observation of its own)
            discard = chainer.reporter.get_current_reporter().scope({}) \
                if chainer.reporter._get_reporters() else contextlib.nullcontext()
            with chainer.using_config('train', False), chainer.no_backprop_mode(), discard:
                self.lossfun(*args, **kwargs)
        bcast_data(self.communicator, self.optimizer.target)
        self._broadcast_names = _initialized(self.optimizer.target)
        self._broadcast = True

    def _update(self, grads):
        """The update of an eager step (warm-up, recorded, checks: the steps that can run a
        link for the first time). Parameters that came into being since rank 0's were last
        sent (a lazy link first called in training, such as an auxiliary head the test-mode
        forward of the first broadcast does not call; a link added, then ``optimizer.setup``
        again) have values of each rank's own: rank 0's are sent before the update, as
        ChainerMN's multi-node optimizer sends them when its model changes, so that the
        averaged update and the momentum are the same on every rank."""
        names = _initialized(self.optimizer.target)
        if names != self._broadcast_names:
            bcast_data(self.communicator, self.optimizer.target)
            self._broadcast_names = names
        super()._update(grads)


def _initialized(target):
    return sorted(name for name, p in target.namedparams() if p.array is not None)


_MODES = {'replay': 'a replay', 'check': 'a check of the replay', 'eager': 'an eager step',
          'record': 'a first recorded step',
          'build': 'a second recorded step (which builds the replay; on a GPU, the capture)'}


def _digest(key, mode):
    """A 62-bit integer of the signature ``key`` and ``mode``, the same in every process
    (Python's ``hash`` of a string is not: it is salted per process)."""
    h = hashlib.blake2b(repr((key, mode)).encode(), digest_size=8).digest()
    return int.from_bytes(h, 'little') >> 2
