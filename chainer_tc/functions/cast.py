"""``chainer.functions.cast`` whose backward lets a float16 gradient overflow quietly.

    from chainer_tc import functions as TF
    logits = TF.cast(h, numpy.float32)     # forward: float16 -> float32, never overflows

The backward casts the gradient back to the input's dtype. With loss scaling, a float32 gradient
too large for float16 is expected now and then: it becomes inf, and the optimizer's overflow
check skips the step and lowers the scale. NumPy warns ("overflow encountered in cast") each time;
this cast's backward does not. Its forward warns as NumPy does: an overflow there is not expected.
Any array module; differentiable any number of times.
"""
import numpy

import chainer
from chainer import function_node
from chainer.utils import type_check


class Cast(function_node.FunctionNode):

    def __init__(self, dtype, quiet_overflow=False):
        self.dtype = numpy.dtype(dtype)
        self.quiet_overflow = quiet_overflow

    def check_type_forward(self, in_types):
        type_check._argname(in_types, ('x',))
        type_check.expect(in_types.size() == 1)

    def forward(self, inputs):
        x, = inputs
        self._in_dtype = x.dtype
        if self.quiet_overflow:
            with numpy.errstate(over='ignore'):       # NumPy; CuPy never warns
                return x.astype(self.dtype, copy=False),
        return x.astype(self.dtype, copy=False),

    def backward(self, indexes, grad_outputs):
        gy, = grad_outputs
        return Cast(self._in_dtype, quiet_overflow=True).apply((gy,))


def cast(x, dtype):
    """``x`` as ``dtype`` (a new node even when the dtype is unchanged, as Chainer's with
    backprop enabled); the gradient comes back in ``x``'s dtype, overflowing quietly to inf."""
    dtype = numpy.dtype(dtype)
    if dtype.kind != 'f':
        raise TypeError('cast is differentiable to floating dtypes only; got dtype {}'
                        .format(dtype))
    if chainer.as_array(x).dtype.kind != 'f':
        raise TypeError('cast takes floating-point x; got {}'.format(chainer.as_array(x).dtype))
    return Cast(dtype).apply((x,))[0]
