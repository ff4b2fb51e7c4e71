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
    wide = numpy.dtype(numpy.float32)
    for p in model.params():
        if p.array is not None and p.array.dtype == numpy.float64:
            wide = numpy.dtype(numpy.float64)
    with chainer.using_config('dtype', wide):
        communicator.bcast_data(model)
