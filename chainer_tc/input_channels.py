"""How many channels the images have when they reach conv1: 3, or padded with zeros to 4 or 8
(cuDNN's float16 Tensor Core NHWC convolutions want 4, or a multiple of 8). The model
(``ResNet50(pad_channels=)``), the DALI pipeline (``imagenet_pipeline(pad_channels=)``) and the
example's ``--pad-channels`` accept the same values, checked here."""
import numpy

CHOICES = (3, 4, 8)        # 3: no padding


def check(pad_channels):
    """``pad_channels`` as an int of :data:`CHOICES` (None means 3); a TypeError for what is not
    an int (as ``TL.Convolution2D(pad_channels=)`` says), a ValueError for another int."""
    if pad_channels is None:
        return 3
    message = 'pad_channels must be 3 (no padding), 4 or 8, or None (3); got {!r}'.format(
        pad_channels)
    if isinstance(pad_channels, bool) or not isinstance(pad_channels, (int, numpy.integer)):
        raise TypeError(message)
    if pad_channels not in CHOICES:
        raise ValueError(message)
    return int(pad_channels)
