"""Argument helpers shared by the functions."""
import numpy


def pair(v, name):
    """``v`` as a pair of ints (an int means the same for both axes)."""
    if isinstance(v, (int, numpy.integer)):
        v = (int(v), int(v))
    v = tuple(int(a) for a in v)
    if len(v) != 2:
        raise ValueError('{} must be an int or a pair of ints; got {!r}'.format(name, v))
    return v
