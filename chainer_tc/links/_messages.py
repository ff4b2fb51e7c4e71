"""The error a channels-last link raises for input that is not channels-last, with its likely
cause: NCHW data fed to an NHWC model, or an NCHW function upstream that pooled or reshaped along
the wrong axes after ``to_nhwc(model)``."""

NCHW_FUNCTIONS = (
    ('F.max_pooling_2d', 'chainer_tc.functions.max_pooling_2d'),
    ('F.average_pooling_2d', 'chainer_tc.functions.average_pooling_2d (or '
                             'global_average_pooling_2d)'),
    ('F.batch_normalization', 'chainer_tc.functions.batch_normalization'),
    ('F.convolution_2d', 'chainer_tc.functions.convolution_2d'),
)


def not_channels_last(link, channels, shape):
    """ValueError for ``link`` (which needs ``channels`` on the last axis) given ``shape``."""
    msg = ('{} expects channels-last (NHWC) input with its {} channels on the last axis; got '
           'shape {}.'.format(type(link).__name__, channels, tuple(shape)))
    if len(shape) == 4 and shape[1] == channels:
        msg += (' This looks like NCHW data (channels on axis 1): feed NHWC images, e.g. '
                'chainer_tc.links.nhwc_dataset(dataset) or StandardUpdater(..., '
                'converter=chainer_tc.links.nhwc_converter), or DALI with layout=\'NHWC\'.')
    else:
        msg += (' If this link follows to_nhwc(model), an NCHW function upstream in forward() '
                'has probably treated NHWC data as NCHW (pooling or reshaping the wrong axes); '
                'replace it: {}.'.format('; '.join('{} -> {}'.format(a, b)
                                                   for a, b in NCHW_FUNCTIONS)))
    return ValueError(msg + ' See docs/migrating.md.')
