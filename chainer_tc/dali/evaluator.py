"""Evaluator: Chainer's Evaluator with means over images instead of means over batches.

Chainer's Evaluator averages what the model reports batch by batch, each batch weighing the same.
With a short last batch that is not the mean over the images: 7 images at batch 2, all right but
the last, give (1 + 1 + 1 + 0) / 4 = 0.75 instead of 6/7 = 0.857. This one weighs every reported
value by its batch's size, so the result is the mean over the images: exact accuracy with
``DaliIterator(..., repeat=False)``.

    trainer.extend(dali.Evaluator(val_iter, model, converter=dali.converter))

A value the model reports as a ``(value, weight)`` pair (``chainer.DictSummary``'s own form) was
weighted by the model: it is passed on unchanged, with the model's weight, and its mean is the one
Chainer's Evaluator gives.
"""
import warnings

import numpy

import chainer
from chainer.training import extensions

from chainer_tc.dali import iterator as iterator_module


class Evaluator(extensions.Evaluator):
    """``chainer.training.extensions.Evaluator`` whose reported means are per image: each value
    the target reports for a batch is weighted by the batch's size (``len`` of the first input);
    a ``(value, weight)`` pair keeps the target's weight. Same arguments as Chainer's.

    After :meth:`evaluate`, ``weights`` holds the total weight behind each reported key (the
    images of the batches that reported it, or the sum of the target's own weights), as floats.
    """

    weights = None

    def __init__(self, iterator, target, *args, **kwargs):
        super().__init__(iterator, target, *args, **kwargs)
        for name, it in self._iterators.items():
            # (Chainer's Evaluator says so for its own iterators; a DaliIterator repeats by
            # default, and an evaluation over one never ends)
            if isinstance(it, iterator_module.DaliIterator) and it.repeat:
                warnings.warn('the DaliIterator {!r} of this Evaluator repeats (repeat=True, '
                              'the default): an evaluation sweeps an iterator until it stops, '
                              'and this one never does. Make it with repeat=False'
                              .format(name), stacklevel=2)

    def evaluate(self):
        original = self.eval_func
        weights = {}
        self.eval_func = weighted = _weighted_by_batch(original or self._targets['main'],
                                                       weights)
        try:
            result = super().evaluate()
        finally:
            if self.eval_func is weighted:      # (an eval_hook may have set its own: kept,
                self.eval_func = original       # used from the next evaluation, as Chainer's)
        self.weights = weights
        return result


def _weighted_by_batch(target, weights=None):
    """``target`` reporting each value with its batch's size as weight; ``weights`` (a dict), if
    given, adds up each key's weight as ``chainer.DictSummary`` does."""
    def eval_func(*args, **kwargs):
        first = args[0] if args else next(iter(kwargs.values()))
        observed = {}
        with chainer.reporter.report_scope(observed):
            target(*args, **kwargs)
        weighted = {}
        for k, v in observed.items():
            # (value, weight): the target weighted it itself (DictSummary's protocol): kept,
            # but for a weight of 0 (a batch with nothing to count), which adds nothing: a key
            # only such batches report is absent, not 0 / 0 (which DictSummary makes a
            # ZeroDivisionError or a nan; on one rank only, the others waited forever)
            if isinstance(v, tuple) and _is_zero(v[1]):
                continue
            weighted[k] = v if isinstance(v, tuple) else (_widened(v), len(first))
            value, weight = weighted[k][:2]
            if weights is not None and _summarised(value) and _summarised(weight):
                # (a weight that is not a scalar: DictSummary raises, naming the key)
                weights[k] = weights.get(k, 0.0) + float(_array(weight))
        chainer.reporter.report(weighted)
    return eval_func


def _is_zero(weight):
    """Whether a weight is 0 as seen on the host (a number, or a NumPy array; a device array
    is not read: that would wait for the device)."""
    w = _array(weight)
    return (numpy.isscalar(w) or isinstance(w, numpy.ndarray)) and numpy.ndim(w) == 0 \
        and w == 0


def _widened(value):
    """A float16 value as float32 (on its device, no synchronisation): DictSummary adds up
    value * weight in the value's dtype, and a float16 sum of values times batch sizes passes
    65504 after a few hundred batches (an inf where Chainer's per-batch sum stays finite)."""
    a = _array(value)
    if getattr(a, 'dtype', None) == numpy.float16:
        return a.astype(numpy.float32)
    return value


def _array(v):
    return v.array if isinstance(v, chainer.Variable) else v


def _summarised(value):
    """Whether chainer.DictSummary accumulates this value (a scalar or 0-d array); it ignores
    others, so their weights are not counted either."""
    value = _array(value)
    return numpy.isscalar(value) or getattr(value, 'ndim', -1) == 0
