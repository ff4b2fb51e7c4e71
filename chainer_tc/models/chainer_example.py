"""Loading the weights of Chainer's ImageNet example's ResNet50 (examples/imagenet/resnet50.py,
Chainer 7.8.1) into ``chainer_tc.models.ResNet50(version='1')``, in either layout.

    from chainer_tc.models import ResNet50, load_chainer_example
    model = ResNet50(version='1')                       # or layout='NCHW'; any dtype
    load_chainer_example('model_iter_100000', model)    # the example's --initmodel file
    load_chainer_example('snapshot_iter_100000', model, path='updater/model:main/')

The example names its parameters ``conv1``, ``bn1``, ``res2/0/conv1`` ... ``res5/2/bn3``,
``res<s>/0/conv4`` and ``bn4`` (the projection shortcut), ``fc``; ours are ``conv1``, ``bn1``,
``blocks/<k>/conv1`` ... (``k`` counts blocks over all stages), ``conv_sc``/``bn_sc``, ``fc``.
Its first convolution has a bias, ours none: a bias followed by BatchNormalization only shifts
the mean, so it is folded into ``bn1``'s running mean (``avg_mean - b``), which gives the same
outputs in inference and the same batch-normalised values in training. The file is read without
unpickling (chainer_tc.serializers); every array of the example must find its place and every
parameter of ours must be filled, with the same shapes, or nothing is loaded. A model built
with ``pad_channels=4`` (or 8) takes the example's 3-channel first filter with zeros appended.
"""
import re
import warnings

import numpy

from chainer.serializers import npz as chainer_npz

from chainer_tc import links
from chainer_tc import serializers
from chainer_tc.models import resnet50

_BLOCK = re.compile(r'^res([2-5])/(0|[1-9]\d*)/(conv|bn)([1-4])/(.+)$')   # 'a', '00': unknown
_TOP = ('conv1/W', 'bn1/gamma', 'bn1/beta', 'bn1/avg_mean', 'bn1/avg_var', 'bn1/N', 'fc/W',
        'fc/b')


def _our_key(key):
    """Our name of the example's ``key`` (None for conv1/b, folded; raises for unknown keys)."""
    if key in _TOP:
        return key
    if key == 'conv1/b':
        return None
    m = _BLOCK.match(key)
    if m is None:
        raise KeyError(key)
    stage, index, kind, number, rest = int(m.group(1)) - 2, int(m.group(2)), m.group(3), \
        m.group(4), m.group(5)
    blocks = resnet50.STAGES[stage][0]
    if index >= blocks:
        raise KeyError(key)
    k = sum(n for n, _ in resnet50.STAGES[:stage]) + index
    name = {'4': '_sc'}.get(number, number)
    return 'blocks/{}/{}{}/{}'.format(k, kind, name, rest)


def load_chainer_example(file, model, path=''):
    """Loads an ``.npz`` of Chainer's example's ResNet50 into ``model``.

    Args:
        file (str or file-like): ``save_npz``/``snapshot_object`` output of the example's model,
            or a Trainer snapshot (with ``path``).
        model (ResNet50): built with ``version='1'``, ``n_classes`` and ``width`` matching the
            file (Chainer's example: ``n_classes=1000``, ``width=1``); any layout and dtype.
        path (str): the prefix of the model's arrays in the file, e.g. ``'updater/model:main/'``
            in a Trainer snapshot of the example.
    """
    if not isinstance(model, resnet50.ResNet50):
        raise TypeError('model must be a chainer_tc.models.ResNet50; got {}'
                        .format(type(model).__name__))
    if model.version != '1':
        raise ValueError("Chainer's example's ResNet50 is ResNet-50 v1 (stride on the first 1x1 "
                         "convolution of a block): build the model with version='1' to load it; "
                         "got version={!r}".format(model.version))
    if path and not path.endswith('/'):
        path += '/'                 # 'updater/model:main' names the same group
    arrays = {k[len(path):]: v for k, v in serializers.read_npz(file).items()
              if k.startswith(path)}
    if not arrays:
        raise ValueError('no arrays under path={!r} in the file; a Trainer snapshot of the '
                         "example keeps the model under 'updater/model:main/'".format(path))
    ours, origin, unknown = {}, {}, []
    for key, value in sorted(arrays.items()):
        try:
            mine = _our_key(key)
        except KeyError:
            unknown.append(key)
            continue
        if value is None:
            raise ValueError('{} is None in the file (an uninitialised parameter): the model '
                             'was saved before its first forward pass'.format(path + key))
        if mine is not None:          # one key each: _BLOCK takes no '00' for '0'
            ours[mine], origin[mine] = value, path + key
    if unknown:
        raise ValueError("{} array(s) of the file are not parameters of Chainer's example's "
                         'ResNet50: {}{}'.format(len(unknown), ', '.join(unknown[:5]),
                                                 ' ...' if len(unknown) > 5 else '')
                         + ('' if path else "; for a Trainer snapshot pass "
                            "path='updater/model:main/'"))
    if 'conv1/b' in arrays:
        if 'bn1/avg_mean' not in ours:
            raise ValueError('the file has conv1/b but no bn1/avg_mean to fold it into')
        ours['bn1/avg_mean'] = (numpy.asarray(ours['bn1/avg_mean'], numpy.float64)
                                - numpy.asarray(arrays['conv1/b'], numpy.float64))
    expected = _expected_shapes(model)
    extra = sorted(origin[k] for k in set(ours) - set(expected))
    if extra:
        raise ValueError("{} array(s) of the file have no place in this model: {}{}".format(
            len(extra), ', '.join(extra[:5]), ' ...' if len(extra) > 5 else ''))
    missing = sorted(set(expected) - set(ours))
    if missing:
        raise ValueError('the file lacks {} array(s) this model needs: {}{}'.format(
            len(missing), ', '.join(missing[:5]), ' ...' if len(missing) > 5 else ''))
    for key, want in sorted(expected.items()):
        got = numpy.shape(ours[key])
        if got != want:
            raise ValueError(
                '{} has shape {} in the file; this model\'s {} needs {}: build ResNet50 with the '
                'n_classes and width of the saved model (this one: n_classes={}, width={})'
                .format(origin[key], got, key, want, model.n_classes, model.width))
    chainer_npz.NpzDeserializer(ours, strict=True).load(model)


def _expected_shapes(model):
    """Our names and the shapes the example's arrays must have: filters in Chainer's layout,
    conv1's without the padding channels of a ``pad_channels`` model (its link appends zeros as
    it loads, whatever the padding weights hold now)."""
    with warnings.catch_warnings():     # nonzero padding weights: they are overwritten here
        warnings.simplefilter('ignore', links.PaddingWarning)
        shapes = {k: numpy.shape(v) for k, v in chainer_npz.serialize(model).items()}
    if model.pad_channels != 3:
        o, kh, kw, _ = model.conv1.W.shape          # an NHWC link's filter
        shapes['conv1/W'] = (o, model.conv1.in_channels, kh, kw)
    return shapes
