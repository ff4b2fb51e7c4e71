"""Rank 0's model on every rank, every parameter in its own precision.

    chainer_tc.multinode.bcast_data(comm, model)      # instead of comm.bcast_data(model)

ChainerMN's ``pure_nccl`` communicator packs a broadcast of the model into one buffer of
``chainer.get_dtype()``: float16 under ``dtype`` float16 or ``mixed16``, so a float32 parameter
(BatchNorm's, the float16 ResNet-50's classifier) comes back rounded to float16 on every rank,
rank 0 included; a float64 parameter is rounded to float32 under ``dtype`` float32. Its MPI
communicators (``naive``, ``flat``, ``non_cuda_aware``) send each parameter in its own dtype
(float16 through float32) and round nothing. :func:`bcast_data` runs the communicator's own
broadcast with ``dtype`` float32, or float64 when a parameter is float64: a type that holds every
parameter's value exactly, whatever the communicator.
"""
import numpy

import chainer

from chainer_tc.multinode import _communicator


def bcast_data(communicator, model):
    """``communicator.bcast_data(model)`` (rank 0's parameters to every rank) without rounding
    any parameter; ``chainer.config.dtype`` is what it was afterwards."""
    _communicator.check(communicator, attributes=(), methods=('bcast_data',))
    if not isinstance(model, chainer.Link):
        raise TypeError('model: expected a chainer.Link whose parameters to broadcast; got {!r}'
                        .format(model))
    _check_same_parameters(communicator, model)
    wide = numpy.dtype(numpy.float32)
    for p in model.params():
        if p.array is not None and p.array.dtype == numpy.float64:
            wide = numpy.dtype(numpy.float64)
    with chainer.using_config('dtype', wide):
        communicator.bcast_data(model)


def _check_same_parameters(communicator, model):
    """Every rank must broadcast the same parameters (names, shapes, dtypes): a lazy link one
    rank's loss called and another's did not made the ranks send different numbers of arrays,
    and MPI failed on one rank while the other waited forever (as with ChainerMN's own
    broadcast; found by an audit). Every rank raises the same error instead (one small
    exchange of the lists, which a broadcast is rare enough to afford)."""
    mpi_comm = getattr(communicator, 'mpi_comm', None)
    if mpi_comm is None or getattr(communicator, 'size', 1) == 1:
        return
    mine = [(name, tuple(p.shape), str(p.dtype)) for name, p in sorted(model.namedparams())
            if p.array is not None]
    everyone = mpi_comm.allgather(mine)
    if all(theirs == everyone[0] for theirs in everyone):
        return
    parts = []
    for rank, theirs in enumerate(everyone[1:], 1):
        if theirs == everyone[0]:
            continue
        missing = sorted(set(everyone[0]) - set(theirs))
        extra = sorted(set(theirs) - set(everyone[0]))
        parts.append('rank {} lacks {} and has {} more than rank 0'.format(
            rank, _listed(missing), _listed(extra)))
    raise ValueError('bcast_data: the ranks\' models differ in their initialised parameters ({}):'
                     ' a lazy link called on some ranks only? Call every lazy link on every '
                     'rank (or give it its input size) before the broadcast'
                     .format('; '.join(parts)))


def _listed(items):
    if not items:
        return 'none'
    said = ', '.join('{} {} {}'.format(n, s, d) for n, s, d in items[:4])
    return said + (' and {} more'.format(len(items) - 4) if len(items) > 4 else '')
