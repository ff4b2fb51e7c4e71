"""A Chainer updater that runs each iteration through a :class:`TrainStep`.

    from chainer_tc.static_graph import TrainStepUpdater
    updater = TrainStepUpdater(train_iter, optimizer, device=device)   # StandardUpdater's args
    trainer = training.Trainer(updater, (90, 'epoch'), out='result')

Everything a ``StandardUpdater`` does stays: the converter and device, ``loss_func``,
``auto_new_epoch``, serialization (so ``extensions.snapshot`` and resume), and the reports made
inside the loss function (``L.Classifier``'s loss and accuracy reach ``LogReport``). As with
``StandardUpdater``, ``updater.loss_func`` and the optimizer's target are read at every
iteration: a new one (``updater.loss_func = ...``, ``optimizer.setup(other_model)``) gets a new
TrainStep, which traces again (said once per change).
"""
import warnings

from chainer.training import updaters

from chainer_tc.static_graph import step as step_module


class TrainStepUpdater(updaters.StandardUpdater):
    """``StandardUpdater`` whose update is a :class:`TrainStep` (same arguments, plus
    ``step_options``, a dict of TrainStep's keyword arguments such as ``warmup``)."""

    def __init__(self, iterator, optimizer, converter=None, device=None, loss_func=None,
                 step_options=None, **kwargs):
        if converter is None:
            from chainer.dataset import convert
            converter = convert.concat_examples
        super().__init__(iterator, optimizer, converter=converter, device=device,
                         loss_func=loss_func, **kwargs)
        self.step_options = dict(step_options or {})
        self.step = None

    def update_core(self):
        iterator = self._iterators['main']
        batch = iterator.next()
        from chainer.dataset import convert
        in_arrays = convert._call_converter(self.converter, batch, self.input_device)
        optimizer = self._optimizers['main']
        if self.step is not None and (self.step.optimizer is not optimizer
                                      or self.step.model is not optimizer.target
                                      or self.step.lossfun is not (self.loss_func
                                                                   or optimizer.target)):
            warnings.warn('TrainStepUpdater: {} changed since the step was made (found at '
                          'iteration {}): a new TrainStep traces it again'
                          .format(self._what_changed(optimizer), self.iteration),
                          RuntimeWarning, stacklevel=3)
            self.step = None
        if self.step is None:
            self.step = self._make_step(optimizer)
        if isinstance(in_arrays, tuple):
            self.step(*in_arrays)
        elif isinstance(in_arrays, dict):
            self.step(**in_arrays)
        else:
            self.step(in_arrays)
        if self.auto_new_epoch and iterator.is_new_epoch:
            optimizer.new_epoch(auto=True)

    def _what_changed(self, optimizer):
        if self.step.optimizer is not optimizer:
            return "the updater's optimizer"
        if self.step.model is not optimizer.target:
            return "the optimizer's target (optimizer.setup())"
        return 'updater.loss_func'

    def _make_step(self, optimizer):
        return step_module.TrainStep(optimizer.target, optimizer,
                                     self.loss_func or optimizer.target, **self.step_options)
