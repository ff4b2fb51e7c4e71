"""ChainerMN's own multi-node optimizer, its broadcasts of the model exact.

    comm = chainermn.create_communicator('pure_nccl')
    opt = chainer_tc.multinode.create_multi_node_optimizer(
        chainer_tc.optimizers.MomentumSGD(lr=0.1).setup(model), comm)
    opt.update(lossfun, x, t)

The same arguments as ``chainermn.create_multi_node_optimizer``, and what it returns: ChainerMN's
wrapper, which broadcasts rank 0's model at its first update (and again whenever the model's
parameters change: a lazy link initialised, a link added), then averages the gradients over the
ranks before each update of the optimizer it wraps. One thing differs: the wrapper's
``communicator`` is an :class:`ExactBroadcast` around ``communicator``, whose ``bcast_data`` is
:func:`chainer_tc.multinode.bcast.bcast_data`. ChainerMN's ``pure_nccl`` communicator packs that
broadcast in ``chainer.get_dtype()``, so under ``dtype`` float16 or ``mixed16`` every float32
parameter (BatchNorm's, the float16 ResNet-50's classifier) came out rounded to float16 on every
rank, at the first update and at every resume; here each keeps its value to the bit.

Everything else the wrapper asks of its communicator (``multi_node_mean_grad``, and the
double-buffering path's own calls) goes to ``communicator`` unchanged, and ``communicator``
itself is left as it is: hand it to ``chainermn.scatter_dataset``, evaluators and
``chainermn.links`` as before (some of them check its class).
"""
import numpy

import chainer

from chainer_tc.multinode import _communicator
from chainer_tc.multinode import bcast

#: what ChainerMN's wrapper calls on its communicator
_USED = ('bcast_data', 'multi_node_mean_grad')


class ExactBroadcast:
    """``communicator`` with an exact ``bcast_data`` (and ``broadcast_data``, ChainerMN's old
    name for it); every other attribute, read or written, is ``communicator``'s. ``split``
    gives ChainerMN's communicator, not an ``ExactBroadcast``."""

    def __init__(self, communicator):
        _communicator.check(communicator, attributes=(), methods=_USED)
        object.__setattr__(self, 'communicator', communicator)

    def bcast_data(self, model):
        bcast.bcast_data(self.communicator, model)

    def broadcast_data(self, model):
        self.bcast_data(model)

    def __getattr__(self, name):
        if name == 'communicator':          # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.communicator, name)

    def __setattr__(self, name, value):
        setattr(self.communicator, name, value)

    def __repr__(self):
        return 'ExactBroadcast({!r})'.format(self.communicator)


def create_multi_node_optimizer(actual_optimizer, communicator, double_buffering=False,
                                zero_fill=True):
    """``chainermn.create_multi_node_optimizer(actual_optimizer, communicator,
    double_buffering, zero_fill)`` whose broadcasts of the model round no parameter.

    Raises TypeError naming the argument for an ``actual_optimizer`` that is not a
    ``chainer.Optimizer`` (or is already a multi-node optimizer), a ``communicator`` that is not
    a ChainerMN communicator, or flags that are not booleans; ValueError for
    ``double_buffering=True`` with a communicator other than ``pure_nccl``."""
    if isinstance(communicator, ExactBroadcast):
        communicator = communicator.communicator
    _check(actual_optimizer, communicator, double_buffering, zero_fill)
    import chainermn        # here: chainer_tc.multinode imports without MPI
    wrapper = chainermn.create_multi_node_optimizer(
        actual_optimizer, communicator, double_buffering=bool(double_buffering),
        zero_fill=bool(zero_fill))
    if vars(wrapper).get('communicator') is not communicator:
        raise RuntimeError(
            'chainermn.create_multi_node_optimizer returned a {} without its communicator in '
            "the attribute 'communicator' (Chainer {}): chainer_tc.multinode cannot make its "
            'broadcasts exact'.format(type(wrapper).__name__, chainer.__version__))
    # the wrapper's own __setattr__ sets attributes of the optimizer it wraps
    object.__setattr__(wrapper, 'communicator', ExactBroadcast(communicator))
    return wrapper


def _check(actual_optimizer, communicator, double_buffering, zero_fill):
    if 'actual_optimizer' in getattr(actual_optimizer, '__dict__', {}):
        raise TypeError(
            'actual_optimizer: expected the optimizer to wrap; got {}, already a multi-node '
            'optimizer (pass its actual_optimizer: wrapped twice, it would average the '
            'gradients twice per update)'.format(type(actual_optimizer).__name__))
    if not isinstance(actual_optimizer, chainer.Optimizer):
        raise TypeError(
            'actual_optimizer: expected a chainer.Optimizer, such as '
            'chainer_tc.optimizers.MomentumSGD(...); got {!r}'.format(actual_optimizer))
    _communicator.check(communicator, attributes=(), methods=_USED)
    for name, value in (('double_buffering', double_buffering), ('zero_fill', zero_fill)):
        if not isinstance(value, (bool, numpy.bool_)):
            raise TypeError('{}: expected True or False; got {!r}'.format(name, value))
    if double_buffering:
        from chainermn.communicators import pure_nccl_communicator
        if not isinstance(communicator, pure_nccl_communicator.PureNcclCommunicator):
            raise ValueError(
                "double_buffering=True: expected ChainerMN's pure_nccl communicator "
                "(chainermn.create_communicator('pure_nccl')), the only one that double-buffers; "
                'got {}'.format(type(communicator).__name__))
