"""The error a channels-last link raises for input that is not channels-last, with its likely
cause: NCHW data fed to an NHWC model, or an NCHW function upstream that pooled or reshaped along
the wrong axes after ``to_nhwc(model)``; and the warning of a lazy link (``size=None``,
``in_channels=None``) whose first input looks NCHW."""
import warnings

NCHW_FUNCTIONS = (
    ('F.max_pooling_2d', 'chainer_tc.functions.max_pooling_2d'),
    ('F.average_pooling_2d', 'chainer_tc.functions.average_pooling_2d (or '
                             'global_average_pooling_2d)'),
    ('F.batch_normalization', 'chainer_tc.functions.batch_normalization'),
    ('F.convolution_2d', 'chainer_tc.functions.convolution_2d'),
)


def not_channels_last(link, channels, shape, unpadded=None):
    """ValueError for ``link`` (which needs ``channels`` on the last axis, or ``unpadded``
    channels that it pads to ``channels``) given ``shape``."""
    msg = ('{} expects channels-last (NHWC) input with its {} channels on the last axis; got '
           'shape {}.'.format(type(link).__name__, channels if unpadded is None else
                              '{} (or {}, padded with zeros)'.format(unpadded, channels),
                              tuple(shape)))
    if len(shape) == 4 and shape[1] in (channels, unpadded):
        msg += (' This looks like NCHW data (channels on axis 1): feed NHWC images, e.g. '
                'chainer_tc.links.nhwc_dataset(dataset) or StandardUpdater(..., '
                'converter=chainer_tc.links.nhwc_converter), or DALI with layout=\'NHWC\'.')
    elif unpadded is None and channels == 3 and len(shape) == 4 and shape[3] in (4, 8):
        msg += (' These look like RGB images padded with zero channels (chainer_tc.dali\'s '
                'pad_channels={}): build the first convolution (ResNet50) with the same '
                'pad_channels, or the pipeline without it.'.format(shape[3]))
    else:
        msg += (' If this link follows to_nhwc(model), an NCHW function upstream in forward() '
                'has probably treated NHWC data as NCHW (pooling or reshaping the wrong axes); '
                'replace it: {}.'.format('; '.join('{} -> {}'.format(a, b)
                                                   for a, b in NCHW_FUNCTIONS)))
    return ValueError(msg + ' See docs/migrating.md.')


class LayoutWarning(UserWarning):
    """A lazy channels-last link took its channel count from input that looks NCHW."""


def looks_nchw(shape):
    """Whether a 4-D ``shape`` looks like NCHW rather than NHWC: its last two axes are equal
    (square images, H == W) and axis 1 is smaller (few channels). NHWC data of square images has
    H == W on axes 1 and 2 instead; a false alarm needs an NHWC map whose width equals its
    channel count and exceeds its height."""
    return len(shape) == 4 and shape[2] == shape[3] and shape[1] < shape[3]


def warn_if_lazy_nchw(link, shape):
    """Warns once, at a lazy link's initialisation, when its first input looks NCHW: the link
    would take W for the channel count and run on the wrong axis without an error."""
    if looks_nchw(shape):
        warnings.warn(
            '{} was created without its channel count and takes it from the last axis of its '
            'first input: {} from shape {}, which looks like NCHW data (channels on axis 1, '
            'square images on axes 2 and 3). If it is, this link now computes over the wrong '
            'axis without an error: feed NHWC data (chainer_tc.links.nhwc_dataset / '
            'nhwc_converter, DALI with layout=\'NHWC\'). Give the channel count when creating the '
            'link to make this check exact (then NCHW input is an error). See docs/trust.md.'
            .format(type(link).__name__, shape[-1], tuple(shape)), LayoutWarning, stacklevel=4)
