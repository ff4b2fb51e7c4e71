"""Drop-in Convolution2D link for channels-last (NHWC) input.

    from chainer_tc import links as TL
    conv = TL.Convolution2D(64, 128, 3, stride=2, pad=1, nobias=True)   # L.Convolution2D's args
    y = conv(x)                                                         # x: (N, H, W, 64)

The filter is stored as (out, kh, kw, in/groups), the layout cuDNN's NHWC convolutions read, but
it is initialised, saved and loaded in Chainer's (out, in/groups, kh, kw): the same arguments (and
random state) give the same filters as ``L.Convolution2D``, an ``initialW`` array is given in
Chainer's layout, and ``serializers.save_npz``/``load_npz`` files move between NCHW and NHWC models
both ways (loading writes into the existing array, so an optimizer's views stay valid).

    conv1 = TL.Convolution2D(3, 64, 7, stride=2, pad=3, pad_channels=4)   # W: (64, 7, 7, 4)
    y = conv1(x)                 # x: (N, H, W, 3), padded here, or (N, H, W, 4) padded already

``pad_channels`` pads the input channels with zeros to that count (cuDNN's Tensor Core NHWC
kernels want 4 or a multiple of 8 channels in float16; a 3-channel image falls back to slower
ones). The filter gets the extra input channels, initialised to zero; input whose padding
channels are zero gives them a zero gradient, so they stay zero in training (weight decay and
momentum of zero are zero). Invisible elsewhere: the filter is initialised from the unpadded
shape (the same random state gives the same filter as without padding, with zeros appended),
saved without its padding channels (the file of an unpadded link, for any Chainer link or model
to load), and a file of the unpadded filter loads with zeros appended. Only if the padding
channels are not zero (the input's were not) is the whole filter saved, with a warning: nothing
is dropped, and an unpadded link refuses that file naming why.
"""
import warnings

import numpy

import chainer
import chainer.functions as F
import chainer.links as L

from chainer_tc import functions as TF
from chainer_tc.links import _messages


def _to_nhwc(w):
    return w.transpose(0, 2, 3, 1)


def _to_nchw(w):
    return w.transpose(0, 3, 1, 2)


class PaddingWarning(UserWarning):
    """The padding channels of a ``pad_channels`` link's filter were not zero when it was
    saved: the input's padding channels carried data."""


class _ChainerLayoutFilter(chainer.Initializer):
    """Fills a channels-last filter (out, kh, kw, C) with what ``base`` draws for Chainer's
    (out, in, kh, kw) filter, transposed (the same numbers and fans as ``L.Convolution2D``), and
    zeros in the input channels past ``channels`` (the padding of ``pad_channels``; None: none).
    The link's ``W.initializer``, so ``Link.copy(mode='init')`` draws the same way."""

    def __init__(self, base, channels=None):
        super().__init__(dtype=getattr(base, 'dtype', None))
        self.base, self.channels = base, channels

    def __call__(self, array):
        out, kh, kw, c = array.shape
        n = c if self.channels is None else self.channels
        xp = chainer.backend.get_array_module(array)
        oihw = xp.empty((out, n, kh, kw), array.dtype)
        self.base(oihw)
        if n < c:
            array[..., n:] = 0
        array[..., :n] = _to_nhwc(oihw)


class Convolution2D(L.Convolution2D):
    """``L.Convolution2D`` on NHWC input; filter (out, kh, kw, in/groups).

    ``pad_channels`` (keyword only; default None, no padding): pad the input channels with zeros
    to this count, which needs ``in_channels`` (not a lazy link) and ``groups=1``; see the
    module's docstring. ``in_channels`` stays the unpadded count; ``W`` has ``pad_channels``
    input channels.
    """

    pad_channels = None     # a class default too: links pickled before pad_channels existed

    def __init__(self, in_channels, out_channels, ksize=None, stride=1, pad=0, nobias=False,
                 initialW=None, initial_bias=None, *, pad_channels=None, **kwargs):
        self.pad_channels = None
        if pad_channels is not None:
            if isinstance(pad_channels, bool) \
                    or not isinstance(pad_channels, (int, numpy.integer)):
                raise TypeError('pad_channels must be an int (the input channels after padding) '
                                'or None; got {!r}'.format(pad_channels))
            if ksize is None or in_channels is None:
                raise ValueError('pad_channels needs in_channels: a lazy link (in_channels=None) '
                                 'cannot know what to pad')
            if kwargs.get('groups', 1) != 1:
                raise ValueError('pad_channels needs groups=1; got groups={!r}'
                                 .format(kwargs['groups']))
            if pad_channels < in_channels:
                raise ValueError('pad_channels={} is smaller than in_channels={}: padding adds '
                                 'channels'.format(pad_channels, in_channels))
            if pad_channels > in_channels:
                self.pad_channels = int(pad_channels)
        # compute_mode='cudnn_fast' gives Chainer's link a channels-last filter layout that it
        # transposes to; this link's data and filter are channels-last already
        with chainer.using_config('compute_mode', None):
            super().__init__(in_channels, out_channels, ksize, stride, pad, nobias, initialW,
                             initial_bias, **kwargs)
        # a lazy link's filter gets its shape at the first call, or from what fills it without
        # one (load_npz, copyparams, to_nhwc): its initializer draws in Chainer's layout either way
        self._wrap_initializer()

    def __setstate__(self, state):
        # a lazy link pickled by an earlier version, its filter filled by load_npz or
        # copyparams, kept the raw initializer, which would draw in this link's layout
        self.__dict__.update(state)
        self._wrap_initializer()

    def _wrap_initializer(self):
        """Makes ``W.initializer`` a :class:`_ChainerLayoutFilter` (once), so that whatever
        initialises the filter (the link's first call, ``Link.copy(mode='init')``, ``repeat``)
        draws Chainer's (out, in, kh, kw) filter with its fans, transposed."""
        init = self.W.initializer
        if init is not None and not isinstance(init, _ChainerLayoutFilter):
            self.W.initializer = _ChainerLayoutFilter(
                init, self.in_channels if self.pad_channels is not None else None)

    @property
    def printable_specs(self):
        yield from super().printable_specs
        if self.pad_channels is not None:
            yield 'pad_channels', self.pad_channels

    def _initialize_params(self, in_channels):
        if self.out_channels % self.groups != 0:
            raise ValueError('the number of output channels ({}) must be divisible by the number '
                             'of groups ({})'.format(self.out_channels, self.groups))
        if in_channels % self.groups != 0:
            raise ValueError('the number of input channels ({}) must be divisible by the number '
                             'of groups ({})'.format(in_channels, self.groups))
        kh, kw = self.ksize if hasattr(self.ksize, '__getitem__') else (self.ksize, self.ksize)
        self._wrap_initializer()    # (L.Convolution2D's __init__ calls this method first)
        self.W.initialize((self.out_channels, kh, kw,
                           self.pad_channels or in_channels // self.groups))

    def __call__(self, *args, **kwargs):
        # a lazy filter is made from the input's last axis before the link hooks run: Chainer's
        # SpectralNormalization, added before the first call, initialises a lazy link itself,
        # from axis 1 (NCHW's channels: the image height here)
        if self.W.raw_array is None and args and len(getattr(args[0], 'shape', ())) == 4:
            self._initialize_lazy(args[0].shape)
        return super().__call__(*args, **kwargs)

    def _initialize_lazy(self, shape):
        _messages.warn_if_lazy_nchw(self, shape)
        self._initialize_params(shape[-1])

    def forward(self, x):
        if self.W.raw_array is None:
            self._initialize_lazy(x.shape)
        in_channels = self.W.shape[3] * self.groups
        if self.pad_channels is not None and x.ndim == 4 and x.shape[3] == self.in_channels:
            x = F.pad(x, ((0, 0), (0, 0), (0, 0), (0, in_channels - self.in_channels)),
                      'constant')
        elif x.ndim != 4 or x.shape[3] != in_channels:
            raise _messages.not_channels_last(self, in_channels, x.shape,
                                              unpadded=self.in_channels
                                              if self.pad_channels is not None else None)
        return TF.convolution_2d(x, self.W, self.b, self.stride, self.pad, dilate=self.dilate,
                                 groups=self.groups)

    def copyparams(self, link, copy_persistent=True):
        """``Link.copyparams``. From Chainer's (NCHW) ``L.Convolution2D`` (a pretrained model's
        layer) the filter is transposed into this link's layout, as ``load_npz`` of that
        link's file does (padding channels zeroed). Between links of different
        ``pad_channels`` (their filters' shapes differ) a ValueError saying so, where NumPy
        would only say it cannot broadcast. (The other way, Chainer's link cannot know: move
        the weights with ``save_npz``/``load_npz``, or convert with ``to_nchw``.)"""
        if isinstance(link, L.Convolution2D) and not isinstance(link, Convolution2D):
            saved = {}
            link.serialize(chainer.serializers.DictionarySerializer(saved))
            self.serialize(chainer.serializers.NpzDeserializer(saved))
            return
        w, v = self.W.raw_array, getattr(getattr(link, 'W', None), 'raw_array', None)
        if w is not None and v is not None and w.shape != v.shape and (
                self.pad_channels is not None or getattr(link, 'pad_channels', None)):
            raise ValueError(
                'copyparams: the filter {} has shape {} and the one copied from has {}: their '
                'input channels are padded differently (pad_channels {} and {}); move the weights '
                'with serializers.save_npz and load_npz, which unpad and pad them'.format(
                    self.name or type(self).__name__, tuple(w.shape), tuple(v.shape),
                    self.pad_channels, getattr(link, 'pad_channels', None)))
        super().copyparams(link, copy_persistent)

    def unpadded_W(self):
        """The filter without its padding channels, (out, kh, kw, in_channels) in this link's
        layout, on its device (``W.array`` itself when it has none). Raises ValueError when the
        padding channels are not all zero (one host synchronisation to check)."""
        w = self.W.array
        if self.pad_channels is None or w is None:
            return w
        if _padding_is_nonzero(w, self.in_channels):
            raise ValueError(self._nonzero_padding_message(w))
        return w[..., :self.in_channels]

    def _nonzero_padding_message(self, w):
        return ('the weights of its padding channels ({}..{} of the filter\'s input channels) '
                'are not zero, so the input\'s padding channels were not zero and the filter is '
                'not the padded {}-channel one; pad_channels pads with zeros (as '
                'chainer_tc.dali\'s pipelines do)'.format(self.in_channels, w.shape[3] - 1,
                                                          self.in_channels))

    def _nchw_to_save(self):
        """The filter as it is saved: see :meth:`filter_to_file`, with a PaddingWarning when
        its padding channels are not zero."""
        w = chainer.backend.CpuDevice().send(self.W.array)
        if self.pad_channels is not None and _padding_is_nonzero(w, self.in_channels):
            warnings.warn('{}: {}: saved with them ({} input channels), which a link '
                          'without that padding cannot load'.format(
                              self.name or type(self).__name__,
                              self._nonzero_padding_message(w), w.shape[3]),
                          PaddingWarning, stacklevel=4)
        return self.filter_to_file(w)

    def filter_to_file(self, array):
        """An array shaped as this link's filter (the filter itself, or an optimizer's state
        that follows it) as files hold it: Chainer's (out, in, kh, kw) on the host, without
        the padding channels when they are all zero (all of them otherwise)."""
        w = chainer.backend.CpuDevice().send(array)
        if self.pad_channels is not None and not _padding_is_nonzero(w, self.in_channels):
            w = w[..., :self.in_channels]
        return numpy.ascontiguousarray(_to_nchw(w))

    def filter_from_file(self, data, what='W'):
        """The inverse of :meth:`filter_to_file`: ``data`` in Chainer's layout (without the
        padding channels, which come back as zeros, or with them) as a host array of this
        link's filter shape. Before the filter has a shape (a lazy link), only transposed.
        ValueError naming ``what`` when the shape fits neither."""
        w = numpy.asarray(data)
        have = self.W.shape if self.W.raw_array is not None else None
        if have is None and w.ndim == 4:
            return numpy.ascontiguousarray(_to_nhwc(w))
        if have is not None and w.shape == _nchw_shape(have):
            return numpy.ascontiguousarray(_to_nhwc(w))
        if have is not None and self.pad_channels is not None \
                and w.shape == _nchw_shape(have[:3] + (self.in_channels,)):
            out = numpy.zeros(have, w.dtype)
            out[..., :self.in_channels] = _to_nhwc(w)
            return out
        if have is None:
            raise ValueError('{} in the file has shape {}; a filter (out, in, kh, kw) has 4 axes'
                             .format(what, w.shape))
        if self.pad_channels is not None:
            need = '{} (or {} with its padding channels)'.format(
                _nchw_shape(have[:3] + (self.in_channels,)), _nchw_shape(have))
        else:
            need = str(_nchw_shape(have))
        why = ''
        if w.ndim == 4 and w.shape[0] == have[0] and w.shape[2:] == have[1:3] \
                and w.shape[1] > have[3]:
            why = ('; the file\'s filter has more input channels: a link with pad_channels={} '
                   'saves them all when its padding channels are not zero (a PaddingWarning '
                   'says so), and their weights have no input here'.format(w.shape[1]))
        raise ValueError('{} in the file has shape {} (out, in, kh, kw); this link needs {}{}'
                         .format(what, w.shape, need, why))

    def serialize(self, serializer):
        d = self.__dict__
        for name in self._params:
            param = d[name]
            if name != 'W':
                data = serializer(name, param.array)
                if param.array is None and data is not None:
                    param.initialize(data.shape)
                    param.array[...] = param.device.send(data)
                continue
            if isinstance(serializer, chainer.serializer.Serializer):      # saving
                serializer('W', None if param.array is None else self._nchw_to_save())
                continue
            data = serializer('W', None)                                 # loading
            if data is None:
                continue
            w = self.filter_from_file(data)
            if param.array is None:             # in the parameter's dtype, as Chainer loads
                dtype = getattr(param.initializer, 'dtype', None) or chainer.get_dtype()
                param.array = param.device.send(w.astype(dtype))
            else:                               # in place: an optimizer's views stay valid
                param.array[...] = param.device.send(w)
        for name in self._persistent:
            d[name] = serializer(name, d[name])


def _nchw_shape(nhwc_shape):
    o, kh, kw, c = nhwc_shape
    return (o, c, kh, kw)


def _padding_is_nonzero(w, in_channels):
    """Whether the padding channels of the NHWC filter ``w`` hold anything but zeros (NaN
    included)."""
    return bool((w[..., in_channels:] != 0).any())
