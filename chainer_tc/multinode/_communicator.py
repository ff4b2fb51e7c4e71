"""The one check of a ChainerMN communicator argument, for every entry point of
chainer_tc.multinode: what it must have depends on what the caller uses of it."""

#: What chainer_tc.multinode's own collectives use (allreduce, the BatchNorm's collectives).
COLLECTIVES = ('mpi_comm', 'size', 'rank')


def check(communicator, name='communicator', attributes=COLLECTIVES, methods=()):
    """``communicator`` if it has ``attributes`` and callable ``methods``; else a TypeError
    naming the argument ``name`` and what is missing."""
    missing = [a for a in attributes if not hasattr(communicator, a)] + \
        [m for m in methods if not callable(getattr(communicator, m, None))]
    if communicator is None or missing:
        raise TypeError('{}: expected a ChainerMN communicator (chainermn.create_communicator'
                        '(...)), with {}; got {!r}'.format(
                            name, _listed(tuple(attributes) + tuple(methods)), communicator))
    return communicator


def _listed(names):
    return names[0] if len(names) == 1 else '{} and {}'.format(', '.join(names[:-1]), names[-1])
