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

What a Chainer user set on the old links goes with them: initializers (a lazy link, a
``copy(mode='init')``), update rules (a frozen link, a per-parameter lr; an optimizer set up
before the conversion goes on training them, its momentum transposed with the filter), a link
held in two places (one link, converted once; also in a list attribute ``forward`` iterates),
and parameters shared by ``copy(mode='share')`` (still shared). A link that works on the
channel axis and has no counterpart (a subclass of Chainer's convolution or BatchNormalization,
``L.DepthwiseConvolution2D``, ``L.Deconvolution2D``, ...) is refused, naming it, before anything
changes: the converted model would feed it data in the other layout. So is a link to convert
that carries what its replacement would not get (link hooks such as SpectralNormalization,
parameters or persistent values added to it): dropped, they would change the outputs without an
error; remove them, convert, and add them to the new link.
"""
import copy

import numpy

import chainer
import chainer.links as L

from chainer_tc.links.batch_normalization import BatchNormAddReLU
from chainer_tc.links.batch_normalization import BatchNormalization
from chainer_tc.links.convolution_2d import Convolution2D
from chainer_tc.links.convolution_2d import _ChainerLayoutFilter

# Chainer links that compute along the channel axis of NCHW data and have no NHWC counterpart
# here (a converted model would feed them NHWC data); subclasses of the two converted links
# are refused too (their own forward is not ours)
_CHANNEL_AXIS_LINKS = tuple(getattr(L, n) for n in (
    'Convolution1D', 'Convolution3D', 'ConvolutionND', 'Deconvolution1D', 'Deconvolution2D',
    'Deconvolution3D', 'DeconvolutionND', 'DeformableConvolution2D', 'DepthwiseConvolution2D',
    'DilatedConvolution2D', 'LocalConvolution2D', 'GroupNormalization',
    'DecorrelatedBatchNormalization') if hasattr(L, n))

# the parameters and persistent values the converted links register themselves (Chainer's and
# ours alike); anything else a link to convert carries (a user's add_param / add_persistent,
# what a link hook registered) has no place in its replacement, and neither have its link hooks
_OWN_ATTRIBUTES = {L.Convolution2D: ({'W', 'b'}, set()),
                   L.BatchNormalization: ({'gamma', 'beta'}, {'avg_mean', 'avg_var', 'N'})}


def _unconvertible(link, to_nhwc):
    """Why ``link`` cannot be left as it is nor converted, or None."""
    cls = type(link)
    if to_nhwc:
        if cls in (L.Convolution2D, L.BatchNormalization) or isinstance(
                link, (Convolution2D, BatchNormalization)):
            return None
        if isinstance(link, (L.Convolution2D, L.BatchNormalization)):
            return ('a subclass of {}, whose forward reads NCHW data; to_nhwc converts the '
                    "class itself only (convert it by hand: chainer_tc.links' link of the same "
                    'arguments, its weights moved with copyparams)'.format(
                        'L.Convolution2D' if isinstance(link, L.Convolution2D)
                        else 'L.BatchNormalization'))
        if isinstance(link, _CHANNEL_AXIS_LINKS) or _is_chainermn_bn(cls):
            return 'a link that computes along the channel axis of NCHW data, with no NHWC ' \
                'counterpart'
        return None         # (chainer_tc.multinode's BatchNorm links are NHWC already)
    if cls in (Convolution2D, BatchNormalization, BatchNormAddReLU):
        return None
    if cls.__module__.startswith('chainer_tc.multinode'):
        return ("chainer_tc.multinode's NHWC BatchNormalization over every rank's batch, with "
                'no NCHW counterpart here: convert the model before chainer_tc.multinode.'
                'create_mnbn_model (whose NCHW counterpart is ChainerMN\'s own '
                'create_mnbn_model)')
    if isinstance(link, (Convolution2D, BatchNormalization)):
        return "a subclass of chainer_tc's NHWC link; to_nchw converts the class itself only"
    return None


def _is_chainermn_bn(cls):
    """ChainerMN's MultiNodeBatchNormalization (NCHW), told from chainer_tc.multinode's NHWC
    link of the same name by its module."""
    return cls.__name__ == 'MultiNodeBatchNormalization' and \
        cls.__module__.split('.')[0] == 'chainermn'


class _Converter:
    """One conversion: each link converted once, shared parameters and arrays kept shared."""

    def __init__(self, to_nhwc):
        self.to_nhwc = to_nhwc
        self.links = {}          # id(old link) -> new link (or the old one, unchanged)
        self.params = {}         # id(old Parameter's array holder) -> new Parameter
        self.arrays = {}         # id(old persistent array) -> new array
        self.rules = {}          # id(update rule) -> rule, whose state is already converted

    def check(self, model):
        """Every refusal, before anything is changed (a conversion refused half way would leave
        a model of two layouts, and update rules whose state is already converted)."""
        for path, link in model.namedlinks():
            why = _unconvertible(link, self.to_nhwc)
            if why is not None:
                raise TypeError('cannot convert the model to {}: {} ({}) is {}; nothing was '
                                'changed'.format('NHWC' if self.to_nhwc else 'NCHW',
                                                 path or '/', type(link).__name__, why))
            if self._replaced(link):
                self._refuse_extras(path or '/', link)
                self._refuse(link)

    def _replaced(self, link):
        if self.to_nhwc:
            return type(link) in (L.Convolution2D, L.BatchNormalization)
        return isinstance(link, (Convolution2D, BatchNormalization))

    def replacement(self, link):
        if not self._replaced(link):
            return None
        return self._conv(link) if isinstance(link, L.Convolution2D) else self._bn(link)

    def _refuse_extras(self, path, link):
        """A ValueError naming what ``link`` (at ``path``), which this conversion replaces,
        carries that its replacement would not get: link hooks (SpectralNormalization,
        WeightStandardization, ...), parameters and persistent values besides its own. Dropped,
        they would change the model's outputs without a word."""
        conv = isinstance(link, L.Convolution2D)
        own_params, own_persistent = _OWN_ATTRIBUTES[
            L.Convolution2D if conv else L.BatchNormalization]
        hooks = list(link._local_link_hooks or ())
        params = sorted(set(link._params) - own_params)
        persistent = sorted(set(link._persistent) - own_persistent)
        if not (hooks or params or persistent):
            return
        carried = []
        for what, names in (('link hook', hooks), ('parameter', params),
                            ('persistent value', persistent)):
            if names:
                carried.append('{}{} {}'.format(what, 's' if len(names) > 1 else '',
                                                ', '.join(map(repr, names))))
        carried = ' and '.join(filter(None, (', '.join(carried[:-1]), carried[-1])))
        layout = 'NHWC' if self.to_nhwc else 'NCHW'
        note = ''
        if conv:
            note = ('; a hook that computes on W sees the filter as the new link holds it, {} '
                    '(SpectralNormalization and WeightStandardization, over axis 0, compute the '
                    'same), and a value that follows the filter\'s layout must be transposed'
                    .format('(out, kh, kw, in/groups)' if self.to_nhwc
                            else '(out, in/groups, kh, kw)'))
        raise ValueError(
            'cannot convert the model to {}: {} ({}) carries {}, which the {} link replacing it '
            'would not get (its outputs would change without an error); nothing was changed. '
            'Remove them from the link (link.delete_hook(name) removes a hook and what it '
            'registered, such as SpectralNormalization\'s W_u; delattr(link, name) a parameter or '
            'persistent value of your own), convert, then add them to the new link{}'.format(
                layout, path, type(link).__name__, carried, layout, note))

    def _refuse(self, link):
        """A ValueError naming why ``link``, which this conversion replaces, cannot be."""
        to_nhwc = self.to_nhwc
        if isinstance(link, L.Convolution2D):
            if not to_nhwc and link.W.array is not None:
                try:            # a pad_channels link becomes the unpadded Chainer link
                    link.unpadded_W()
                except ValueError as e:
                    raise ValueError('cannot convert {} to NCHW: {}'.format(_name(link), e)) \
                        from None
            return
        if getattr(link, '_relu', False):
            raise ValueError('{} fuses BatchNorm, Add and ReLU; it has no single NCHW link to '
                             'become'.format(_name(link)))
        if to_nhwc and link.axis not in (None, (0, 2, 3)):
            raise ValueError('cannot convert a BatchNormalization over axis {} to NHWC: it must '
                             'normalise the channels of NCHW input (axis None or (0, 2, 3))'
                             .format(link.axis))
        if link.avg_mean is None:
            raise ValueError('cannot convert {}: its size is not known yet (built with size=None '
                             'and never called); call the model once first'.format(_name(link)))
        if link.avg_mean.ndim != 1:
            raise ValueError('cannot convert {}: it normalises each of {} elements (size={}), '
                             'not channels; only per-channel BatchNormalization has an NHWC '
                             'counterpart'.format(_name(link), link.avg_mean.size,
                                                  link.avg_mean.shape))

    def _conv(self, old):
        to_nhwc = self.to_nhwc
        cls = Convolution2D if to_nhwc else L.Convolution2D
        init_w = old.W.initializer
        if isinstance(init_w, _ChainerLayoutFilter):
            init_w = init_w.base
        new = cls(old.in_channels, old.out_channels, old.ksize, old.stride, old.pad,
                  nobias=old.b is None, initialW=init_w,
                  initial_bias=None if old.b is None else old.b.initializer,
                  dilate=old.dilate, groups=old.groups)
        new.to_device(old.device)
        xp = old.W.device.xp
        if to_nhwc:
            def layout(a):
                return xp.ascontiguousarray(a.transpose(0, 2, 3, 1))
        else:
            unpad = old.in_channels if old.pad_channels is not None else None

            def layout(a):
                return xp.ascontiguousarray(a[..., :unpad].transpose(0, 3, 1, 2))
        if old.W.array is not None:
            new.W.array = layout(old.W.array)
        self._carry(old, new, 'W', layout)
        if old.b is not None:
            new.b.array = old.b.array.copy()
            self._carry(old, new, 'b', lambda a: a.copy())
        return new

    def _bn(self, old):
        to_nhwc = self.to_nhwc
        dtype = old.avg_mean.dtype
        if to_nhwc and dtype == numpy.float16:   # exact: float32 holds every float16 value
            dtype = numpy.dtype(numpy.float32)
        cls = BatchNormalization if to_nhwc else L.BatchNormalization
        inits = {}
        for name in ('gamma', 'beta'):
            param = getattr(old, name)
            if param is not None:      # (a copy: Chainer's link sets the initializer's dtype)
                inits['initial_' + name] = copy.copy(param.initializer)
        new = cls(old.avg_mean.shape[0], decay=old.decay, eps=old.eps, dtype=dtype,
                  use_gamma=old.gamma is not None, use_beta=old.beta is not None, **inits)
        new.to_device(old.device)
        for name in ('gamma', 'beta'):
            if getattr(old, name) is not None:
                getattr(new, name).array = getattr(old, name).array.astype(dtype)
                self._carry(old, new, name, lambda a: a.astype(dtype))
        for name in ('avg_mean', 'avg_var'):
            a = getattr(old, name)
            shared = self.arrays.get(id(a))
            if shared is None:
                shared = self.arrays[id(a)] = a.astype(dtype)
            setattr(new, name, shared)
        new.N = old.N
        return new

    def _carry(self, old_link, new_link, name, layout):
        """What the old parameter had besides its values: its update rule (its state in the
        new layout), its loss-scale mark, and whom it shared its array with."""
        old, new = getattr(old_link, name), getattr(new_link, name)
        twin = self.params.get(id(old._data))
        if twin is not None:            # Link.copy(mode='share'): the same array, again
            new = copy.copy(twin)
            new.grad = None
            delattr(new_link, name)
            with new_link.init_scope():
                setattr(new_link, name, new)
        else:
            self.params[id(old._data)] = new
        rule = old.update_rule
        if rule is not None and id(rule) not in self.rules:     # (one rule for share-copies)
            self.rules[id(rule)] = rule
            state = rule._state
            if state is not None:
                rule._state = {k: layout(v) for k, v in state.items()}
            fp32 = getattr(rule, '_fp32_param', None)      # Chainer's use_fp32_update master
            if fp32 is not None and fp32.array is not None:
                fp32.array = layout(fp32.array)
        new.update_rule = rule
        new._loss_scale = old._loss_scale

    def convert(self, model):
        done = self.links.get(id(model))
        if done is not None:
            return done
        top = self.replacement(model)
        if top is not None:
            self.links[id(model)] = top
            return top
        self.links[id(model)] = model
        if isinstance(model, chainer.ChainList):
            for i, child in enumerate(list(model.children())):
                new = self.convert(child)
                if new is not child:
                    new.name = child.name
                    model._children[i] = new
        elif isinstance(model, chainer.Chain):
            for name in list(model._children):
                child = getattr(model, name)
                new = self.convert(child)
                if new is not child:
                    delattr(model, name)
                    with model.init_scope():
                        setattr(model, name, new)
        return model

    def relink(self, model):
        """Lists and tuples of links kept in attributes (chainer.Sequential's layers, a
        model's own list that forward iterates) hold the converted links."""
        for link in model.links():
            for key, value in list(link.__dict__.items()):
                if key in ('_children', '_params', '_persistent') or not isinstance(
                        value, (list, tuple)):
                    continue
                new = [self.links.get(id(v), v) if isinstance(v, chainer.Link) else v
                       for v in value]
                if any(a is not b for a, b in zip(new, value)):
                    if isinstance(value, list):
                        value[:] = new
                    else:
                        link.__dict__[key] = type(value)(new) if type(value) is tuple \
                            else type(value)(*new)


def _name(link):
    return link.name or type(link).__name__


def _convert(model, to_nhwc):
    if not isinstance(model, chainer.Link):
        raise TypeError('model must be a chainer.Link; got {}'.format(type(model).__name__))
    converter = _Converter(to_nhwc)
    converter.check(model)
    out = converter.convert(model)
    converter.relink(out)
    return out


def to_nhwc(model):
    """Replace every ``L.Convolution2D`` and ``L.BatchNormalization`` by its NHWC counterpart."""
    return _convert(model, True)


def to_nchw(model):
    """Replace chainer_tc's NHWC convolution and BatchNormalization links by Chainer's."""
    return _convert(model, False)
