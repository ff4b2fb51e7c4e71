"""Evaluator: Chainer's Evaluator with means over images instead of means over batches.

Chainer's Evaluator averages what the model reports batch by batch, each batch weighing the same.
With a short last batch that is not the mean over the images: 7 images at batch 2, all right but
the last, give (1 + 1 + 1 + 0) / 4 = 0.75 instead of 6/7 = 0.857. This one weighs every reported
value by its batch's size, so the result is the mean over the images: exact accuracy with
``DaliIterator(..., repeat=False)``.

    trainer.extend(dali.Evaluator(val_iter, model, converter=dali.converter))
"""
import chainer
from chainer.training import extensions


class Evaluator(extensions.Evaluator):
    """``chainer.training.extensions.Evaluator`` whose reported means are per image: each value
    the target reports for a batch is weighted by the batch's size (``len`` of the first input).
    Same arguments as Chainer's."""

    def evaluate(self):
        original = self.eval_func
        self.eval_func = _weighted_by_batch(original or self._targets['main'])
        try:
            return super().evaluate()
        finally:
            self.eval_func = original


def _weighted_by_batch(target):
    def eval_func(*args, **kwargs):
        first = args[0] if args else next(iter(kwargs.values()))
        observed = {}
        with chainer.reporter.report_scope(observed):
            target(*args, **kwargs)
        chainer.reporter.report({k: (v, len(first)) for k, v in observed.items()})
    return eval_func
