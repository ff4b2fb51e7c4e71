"""The optimizer state of channels-last filters in files: in Chainer's layout, as the filters.

A link whose filter is stored in another layout than its file's (``chainer_tc.links
.Convolution2D``: NHWC in memory, Chainer's NCHW in files, padding channels dropped) says so
with two methods, ``filter_to_file(array)`` and ``filter_from_file(data, what)``. The
momentum ``v`` and float32 ``master`` of such a filter have its shape, so they are written
and read through the same two methods: an optimizer file then holds every array in Chainer's
layout, and it resumes an NCHW model's run in the converted NHWC model and back.

Which layout a file holds its filters' state in:

- ours (this version on): Chainer's, said by ``LAYOUT_KEY``;
- ours before it (no ``LAYOUT_KEY``, but a loss-scaling configuration): the parameter's own;
- Chainer's optimizer: the parameter's own, which is Chainer's layout for Chainer's links. It
  is read as Chainer's layout when its shape fits that, and as the parameter's own otherwise
  (the two shapes coincide only where in == kh == kw; there it is read as Chainer's).
"""
import numpy

import chainer
from chainer import serializer as serializer_module

LAYOUT_KEY = 'filter_state_in_chainer_layout'
STATE_KEYS = ('v', 'master')

IN_CHAINER_LAYOUT = 'chainer'        # the file's state is in Chainer's layout
IN_PARAM_LAYOUT = 'param'            # ... in the parameter's own layout
BY_SHAPE = 'by shape'                # ... unknown: Chainer's layout if the shape fits it


def filters_with_file_layout(target):
    """``{id(param): link}`` for the filters of ``target`` that files hold in another layout."""
    found = {}
    for link in target.links():
        if callable(getattr(link, 'filter_from_file', None)):
            param = getattr(link, 'W', None)
            if isinstance(param, chainer.Parameter):
                found[id(param)] = link
    return found


class SaveState(serializer_module.Serializer):
    """Wraps a parameter's serializer: its filter-shaped state is written in the file's layout."""

    def __init__(self, inner, link):
        self.inner, self.link = inner, link

    def __getitem__(self, key):
        return self.inner[key]

    def __call__(self, key, value):
        if key not in STATE_KEYS or value is None:
            return self.inner(key, value)
        self.inner(key, self.link.filter_to_file(value))
        return value


class LoadState(serializer_module.Deserializer):
    """Wraps a parameter's deserializer: filter-shaped state is read from ``layout`` (one of
    the module's constants) into the parameter's, in place when there is an array to fill."""

    def __init__(self, inner, link, layout, name):
        self.inner, self.link, self.layout, self.name = inner, link, layout, name

    def __getitem__(self, key):
        return self.inner[key]

    def __call__(self, key, value):
        if key not in STATE_KEYS:
            return self.inner(key, value)
        data = self.inner(key, None)
        if data is None:                  # not in the file (strict=False), or ignored
            return value
        array = self._to_param_layout(numpy.asarray(data), key)
        if value is None:
            return array
        value[...] = chainer.backend.get_device_from_array(value).send(array)
        return value

    def _to_param_layout(self, data, key):
        what = 'the optimizer state {!r} of {}'.format(key, self.name)
        have = self.link.W.shape if self.link.W.raw_array is not None else None
        if self.layout == IN_PARAM_LAYOUT:
            if have is not None and data.shape != have:
                raise ValueError(
                    '{} in the file has shape {}; this parameter has {} (the file is from an '
                    'earlier chainer_tc, which saved it in the parameter\'s layout)'.format(
                        what, data.shape, have))
            return data
        if self.layout == BY_SHAPE and have is not None and data.shape == have:
            try:                          # Chainer's layout where the shape fits it (a file of
                return self.link.filter_from_file(data, what)   # Chainer's conv), else as is
            except ValueError:
                return data
        return self.link.filter_from_file(data, what)
