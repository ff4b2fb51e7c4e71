"""Argument helpers shared by the functions."""
import numpy


def integer(v, name):
    """``v`` as an int: an int or NumPy integer, not a bool or a float (which would truncate)."""
    if isinstance(v, (bool, numpy.bool_)) or not isinstance(v, (int, numpy.integer)):
        raise TypeError('{} must be an int; got {!r}'.format(name, v))
    return int(v)


def pair(v, name):
    """``v`` as a pair of ints (an int means the same for both axes)."""
    if isinstance(v, (int, numpy.integer)) and not isinstance(v, (bool, numpy.bool_)):
        return int(v), int(v)
    try:
        v = tuple(v)
    except TypeError:
        raise TypeError('{} must be an int or a pair of ints; got {!r}'.format(name, v)) from None
    if len(v) != 2:
        raise ValueError('{} must be an int or a pair of ints; got {!r}'.format(name, v))
    try:
        return tuple(integer(a, name) for a in v)
    except TypeError:
        raise TypeError('{} must be an int or a pair of ints; got {!r}'.format(name, v)) from None
