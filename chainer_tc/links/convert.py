"""Convert a model's convolution and BatchNormalization links between NCHW and NHWC, in place.

    model = chainer_tc.links.to_nhwc(model)     # L.Convolution2D -> TL.Convolution2D, and BN
    model = chainer_tc.links.to_nchw(model)     # and back, e.g. for export

Weights, biases, BN parameters and running statistics are carried over (filters transposed), so
the converted link computes the same function on transposed data. float16 BatchNormalization
parameters and statistics become float32 in NHWC (what the NHWC link makes for float16 data, and
what cuDNN's fused path needs); going back to NCHW keeps their dtype. A convolution built with
``pad_channels`` becomes Chainer's unpadded link (its padding channels dropped; refused if they
are not zero). Only the links change: a model's ``forward`` that reshapes, concatenates or pools
along fixed axes must itself be written for the layout it receives (chainer_tc.models.ResNet50
takes ``layout=``).
"""
import numpy

import chainer
import chainer.links as L

from chainer_tc.links.batch_normalization import BatchNormalization
from chainer_tc.links.convolution_2d import Convolution2D


def _conv(old, to_nhwc):
    cls = Convolution2D if to_nhwc else L.Convolution2D
    new = cls(old.in_channels, old.out_channels, old.ksize, old.stride, old.pad,
              nobias=old.b is None, dilate=old.dilate, groups=old.groups)
    new.to_device(old.device)
    if old.W.array is not None:
        if to_nhwc:
            w = old.W.array.transpose(0, 2, 3, 1)
        else:
            try:                # a pad_channels link becomes the unpadded Chainer link
                w = old.unpadded_W().transpose(0, 3, 1, 2)
            except ValueError as e:
                raise ValueError('cannot convert {} to NCHW: {}'.format(old.name, e)) from None
        new.W.array = old.W.device.xp.ascontiguousarray(w)
    if old.b is not None:
        new.b.array = old.b.array.copy()
    return new


def _bn(old, to_nhwc):
    if to_nhwc and old.axis not in (None, (0, 2, 3)):
        raise ValueError('cannot convert a BatchNormalization over axis {} to NHWC: it must '
                         'normalise the channels of NCHW input (axis None or (0, 2, 3))'
                         .format(old.axis))
    if old.avg_mean is None:
        raise ValueError('cannot convert {}: its size is not known yet (built with size=None '
                         'and never called); call the model once first'.format(old.name))
    dtype = old.avg_mean.dtype
    if not to_nhwc:
        new = L.BatchNormalization(old.avg_mean.shape[0], decay=old.decay, eps=old.eps,
                                   dtype=dtype, use_gamma=old.gamma is not None,
                                   use_beta=old.beta is not None)
    else:
        if dtype == numpy.float16:      # exact: float32 holds every float16 value
            dtype = numpy.dtype(numpy.float32)
        new = BatchNormalization(old.avg_mean.shape[0], decay=old.decay, eps=old.eps,
                                 dtype=dtype, use_gamma=old.gamma is not None,
                                 use_beta=old.beta is not None)
    new.to_device(old.device)
    for name in ('gamma', 'beta'):
        if getattr(old, name) is not None:
            getattr(new, name).array = getattr(old, name).array.astype(dtype)
    new.avg_mean, new.avg_var = old.avg_mean.astype(dtype), old.avg_var.astype(dtype)
    new.N = old.N
    return new


def _replacement(link, to_nhwc):
    if to_nhwc:
        if type(link) is L.Convolution2D:
            return _conv(link, True)
        if type(link) is L.BatchNormalization:
            return _bn(link, True)
    else:
        if isinstance(link, Convolution2D):
            return _conv(link, False)
        if isinstance(link, BatchNormalization):
            if getattr(link, '_relu', False):
                raise ValueError('{} fuses BatchNorm, Add and ReLU; it has no single NCHW link '
                                 'to become'.format(link.name))
            return _bn(link, False)
    return None


def _convert(model, to_nhwc):
    if not isinstance(model, chainer.Link):
        raise TypeError('model must be a chainer.Link; got {}'.format(type(model).__name__))
    top = _replacement(model, to_nhwc)
    if top is not None:
        return top
    if isinstance(model, chainer.ChainList):
        replaced = {}
        for i, child in enumerate(list(model.children())):
            new = _convert(child, to_nhwc)
            if new is not child:
                new.name = child.name
                model._children[i] = new
                replaced[id(child)] = new
        layers = getattr(model, '_layers', None)        # chainer.Sequential calls these
        if replaced and isinstance(layers, list):
            model._layers = [replaced.get(id(layer), layer) for layer in layers]
    elif isinstance(model, chainer.Chain):
        for name in list(model._children):
            child = getattr(model, name)
            new = _convert(child, to_nhwc)
            if new is not child:
                delattr(model, name)
                with model.init_scope():
                    setattr(model, name, new)
    return model


def to_nhwc(model):
    """Replace every ``L.Convolution2D`` and ``L.BatchNormalization`` by its NHWC counterpart."""
    return _convert(model, True)


def to_nchw(model):
    """Replace chainer_tc's NHWC convolution and BatchNormalization links by Chainer's."""
    return _convert(model, False)
