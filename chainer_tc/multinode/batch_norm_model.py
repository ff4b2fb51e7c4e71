"""A copy of a model whose BatchNormalization links use the statistics of the global batch:
ChainerMN's ``create_mnbn_model`` for models built from chainer_tc's NHWC links.

    model = chainer_tc.multinode.create_mnbn_model(ResNet50('NHWC'), comm)

The contract of ``chainermn.links.create_mnbn_model(link, comm, communication_backend)``: a
copy of ``link`` (``link`` itself is left untouched) in which

- ``chainer_tc.links.BatchNormalization`` becomes :class:`MultiNodeBatchNormalization` and
  ``chainer_tc.links.BatchNormAddReLU`` becomes :class:`MultiNodeBatchNormAddReLU` (channels
  last, the same size, decay, eps, dtype, use_gamma and use_beta, the parameters and
  persistent values copied; a lazy link stays lazy, with its initializers);
- Chainer's own ``L.BatchNormalization`` (NCHW) becomes ChainerMN's
  ``MultiNodeBatchNormalization``, by ChainerMN's own ``create_mnbn_model`` (delegated to:
  whatever ChainerMN does to it, this does);
- chainer_tc's multi-node links already in the model are copied, given ``comm`` and
  ``communication_backend``; every other link and the chains around them are deep copies.

As in ChainerMN's, the replaced BatchNormalization links are new links: their parameters are
new ``Parameter`` objects without update rules (set the optimizer up on the copy), while every
other parameter is a deep copy, update rule and hyperparameters included. A subclass of
chainer_tc's NHWC links is refused (its own ``forward`` would be lost), naming it.

ChainerMN's own ``create_mnbn_model`` on a chainer_tc model is wrong: it replaces every
``L.BatchNormalization``, and chainer_tc's ``TL.BatchNormalization`` and ``TL.BatchNormAddReLU``
are subclasses of it, by its NCHW link, which normalises over axis 1 (the height of NHWC data):
an error when H != C, wrong statistics without an error when H == C, and the fused link's
``z`` taken for ChainerMN's ``finetune`` argument. Nothing in chainer_tc's links can make
that function refuse them without changing ChainerMN (it reads only their attributes): use
this one. It leaves chainer_tc's multi-node links alone (they are not ``L.BatchNormalization``).
"""
import copy

import chainer
import chainer.links as L

from chainer_tc import links as TL
from chainer_tc.multinode import _communicator
from chainer_tc.multinode import collectives
from chainer_tc.multinode.batch_norm_link import MultiNodeBatchNormAddReLU
from chainer_tc.multinode.batch_norm_link import MultiNodeBatchNormalization


def create_mnbn_model(link, comm, communication_backend='auto'):
    """A copy of ``link`` whose BatchNormalization links are multi-node ones over ``comm``
    (see the module's docstring); ``link`` is unchanged.

    Raises TypeError naming the argument for a ``link`` that is not a ``chainer.Link`` or a
    ``comm`` that is not a ChainerMN communicator, and for a subclass of chainer_tc's NHWC
    BatchNormalization links in the model; ValueError for a bad ``communication_backend`` and
    for Chainer ``L.BatchNormalization`` links ChainerMN's function cannot convert (lazy, or
    without gamma or beta: it fails on them with an AttributeError or a KeyError)."""
    if not isinstance(link, chainer.Link):
        raise TypeError('link: expected a chainer.Link (the model to copy); got {!r}'
                        .format(link))
    _communicator.check(comm, 'comm')
    collectives.backend(comm, communication_backend)
    _check_links(link)
    return _convert(link, comm, communication_backend)


def _check_links(model):
    """Refuses, naming the link, what would be lost or fail obscurely on the way."""
    for path, link in model.namedlinks():
        if isinstance(link, L.BatchNormalization) and not isinstance(link, TL.BatchNormalization):
            # ChainerMN's create_mnbn_model reads link.avg_mean.shape (AttributeError for a lazy
            # link) and hasattr(link, 'gamma'), True even without gamma (L.BatchNormalization
            # has a class attribute gamma = None), then copies a gamma that is not there
            # (KeyError)
            why = None
            if link.avg_mean is None:
                why = ('has no size yet (size=None): ChainerMN\'s MultiNodeBatchNormalization '
                       'needs it; call the model once first')
            elif link.gamma is None or link.beta is None:
                why = ('has no {}: chainermn.links.create_mnbn_model cannot convert it (it gives '
                       'every link gamma and beta, then copies them from this one)'.format(
                           'gamma' if link.gamma is None else 'beta'))
            if why is not None:
                raise ValueError('create_mnbn_model: {} ({}) {}'.format(
                    path or '/', type(link).__name__, why))
        if isinstance(link, TL.BatchNormalization) and type(link) not in (
                TL.BatchNormalization, TL.BatchNormAddReLU):
            raise TypeError(
                'create_mnbn_model: {} ({}) is a subclass of chainer_tc.links.{}, whose own '
                'forward a multi-node link would not run; replace it by hand (build '
                'chainer_tc.multinode.MultiNodeBatchNormalization or MultiNodeBatchNormAddReLU '
                'with the same arguments and copyparams)'.format(
                    path or '/', type(link).__name__,
                    'BatchNormAddReLU' if link._relu else 'BatchNormalization'))


def _convert(link, comm, backend):
    if type(link) in (TL.BatchNormalization, TL.BatchNormAddReLU):
        return _multi_node(link, comm, backend)
    if isinstance(link, MultiNodeBatchNormalization):
        new = copy.deepcopy(link)
        new.comm = comm
        new._communication_backend = collectives.backend(comm, backend)
        return new
    if isinstance(link, L.BatchNormalization):        # Chainer's NCHW link: ChainerMN's way
        from chainermn.links import create_mnbn_model as chainermn_create_mnbn_model
        return chainermn_create_mnbn_model(link, comm, backend)
    if isinstance(link, chainer.Chain):
        children = [(name, _convert(link.__dict__[name], comm, backend))
                    for name in link._children]
        new = copy.deepcopy(link)
        for name, child in children:
            child.name = name
            new.__dict__[name] = child
        return new
    if isinstance(link, chainer.Sequential):
        new = copy.deepcopy(link)
        for i, item in enumerate(link):
            new[i] = _convert(item, comm, backend)
        return new
    if isinstance(link, chainer.ChainList):
        children = [_convert(child, comm, backend) for child in link]
        new = copy.deepcopy(link)
        for i, child in enumerate(children):
            child.name = str(i)
            new._children[i] = child
        return new
    return copy.deepcopy(link)


def _multi_node(link, comm, backend):
    """The multi-node link of ``link`` (a chainer_tc NHWC BatchNormalization or
    BatchNormAddReLU): the same arguments, parameters and persistent values."""
    cls = MultiNodeBatchNormAddReLU if link._relu else MultiNodeBatchNormalization
    lazy = link.avg_mean is None

    def initializer(param):
        if param is None or not lazy:
            return None
        return copy.deepcopy(param.initializer)

    new = cls(None if lazy else int(link.avg_mean.shape[0]), comm, decay=link.decay,
              eps=link.eps, dtype=link._highprec_dtype, use_gamma=link.gamma is not None,
              use_beta=link.beta is not None, initial_gamma=initializer(link.gamma),
              initial_beta=initializer(link.beta), communication_backend=backend,
              initial_avg_mean=copy.deepcopy(getattr(link, '_initial_avg_mean', None)),
              initial_avg_var=copy.deepcopy(getattr(link, '_initial_avg_var', None)))
    new.to_device(link.device)
    if lazy:                # copyparams would initialise the source's parameters
        new.N = copy.deepcopy(link.N)
    else:
        new.copyparams(link)
    return new
