"""Drop-in Convolution2D link for channels-last (NHWC) input.

    from chainer_tc import links as TL
    conv = TL.Convolution2D(64, 128, 3, stride=2, pad=1, nobias=True)   # L.Convolution2D's args
    y = conv(x)                                                         # x: (N, H, W, 64)

The filter is stored as (out, kh, kw, in/groups), the layout cuDNN's NHWC convolutions read, but
it is initialised, saved and loaded in Chainer's (out, in/groups, kh, kw): the same arguments (and
random state) give the same filters as ``L.Convolution2D``, an ``initialW`` array is given in
Chainer's layout, and ``serializers.save_npz``/``load_npz`` files move between NCHW and NHWC models
both ways (loading writes into the existing array, so an optimizer's views stay valid).
"""
import numpy

import chainer
import chainer.links as L
from chainer import initializers

from chainer_tc import functions as TF
from chainer_tc.links import _messages


def _to_nhwc(w):
    return w.transpose(0, 2, 3, 1)


def _to_nchw(w):
    return w.transpose(0, 3, 1, 2)


class Convolution2D(L.Convolution2D):
    """``L.Convolution2D`` on NHWC input; filter (out, kh, kw, in/groups)."""

    def _initialize_params(self, in_channels):
        if self.out_channels % self.groups != 0:
            raise ValueError('the number of output channels ({}) must be divisible by the number '
                             'of groups ({})'.format(self.out_channels, self.groups))
        if in_channels % self.groups != 0:
            raise ValueError('the number of input channels ({}) must be divisible by the number '
                             'of groups ({})'.format(in_channels, self.groups))
        kh, kw = self.ksize if hasattr(self.ksize, '__getitem__') else (self.ksize, self.ksize)
        device = self.W.device
        oihw = initializers.generate_array(
            self.W.initializer, (self.out_channels, in_channels // self.groups, kh, kw),
            device.xp, device=device)
        self.W.array = device.xp.ascontiguousarray(_to_nhwc(oihw))

    def forward(self, x):
        if self.W.raw_array is None:
            _messages.warn_if_lazy_nchw(self, x.shape)
            self._initialize_params(x.shape[-1])
        in_channels = self.W.shape[3] * self.groups
        if x.ndim != 4 or x.shape[3] != in_channels:
            raise _messages.not_channels_last(self, in_channels, x.shape)
        return TF.convolution_2d(x, self.W, self.b, self.stride, self.pad, self.dilate,
                                 self.groups)

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
                w = param.array
                serializer('W', None if w is None else
                           numpy.ascontiguousarray(_to_nchw(chainer.backend.CpuDevice().send(w))))
                continue
            data = serializer('W', None)                                 # loading
            if data is None:
                continue
            w = numpy.ascontiguousarray(_to_nhwc(numpy.asarray(data)))
            if param.array is None:             # in the parameter's dtype, as Chainer loads
                dtype = getattr(param.initializer, 'dtype', None) or chainer.get_dtype()
                param.array = param.device.send(w.astype(dtype))
            elif param.array.shape != w.shape:
                raise ValueError('W in the file has shape {} (out, in, kh, kw); this link needs '
                                 '{}'.format(data.shape, _to_nchw(param.array).shape))
            else:
                param.array[...] = param.device.send(w)
        for name in self._persistent:
            d[name] = serializer(name, d[name])
