"""The hyperparameter table the update kernel reads from device memory (kernels/optimizer.cu).

    double[(1 + parameters), 4]
    row 0:     the optimizer's lr, momentum, weight_decay, 0
    row 1 + i: parameter i's own lr, momentum, weight_decay, flags (ENABLED, OWN_*)

A parameter's value is used only where its OWN_* flag is set (it was set on its update rule, or on
a Hyperparameter between the rule and the optimizer: every one of those is tracked once the table
is built, so a later assignment on it rebuilds the rows); otherwise the kernel reads row 0. So a
learning-rate schedule that moves the optimizer's lr every step writes row 0 alone: on a GPU one
tiny kernel launch (``momentum_sgd_set_globals``, no host synchronisation, outside any captured
graph), on the CPU three stores. The per-parameter rows are rebuilt only when something per
parameter changed (``Versions.entries``), with one copy of the table.

Values are float64, as Chainer keeps them; the float32 update rounds them to float32 first, as
NumPy does when Chainer's update multiplies a float32 array by a Python float.
"""
import numpy

from chainer_tc.optimizers import _rule

ENABLED, OWN_LR, OWN_MOMENTUM, OWN_WD = 1, 2, 4, 8
_OWN = (OWN_LR, OWN_MOMENTUM, OWN_WD)

GLOBALS = numpy.dtype([('lr', '<f8'), ('momentum', '<f8'), ('weight_decay', '<f8')])


class HyperTable:
    """Host and device copies of the table for one FlatParams."""

    def __init__(self, flat, kernel_path):
        self.flat = flat
        self.host = numpy.zeros((1 + len(flat.entries), 4), numpy.float64)
        # the NumPy path reads the host table itself; the kernels (GPU, or emulated) a copy
        self.device = self.host if kernel_path is False else _copy(self.host, flat)
        self.values = []
        self._seen = (None, None)

    def refresh(self, root, versions, set_globals):
        """Bring the device table up to date with ``root`` (the optimizer's Hyperparameter) and
        every rule; ``set_globals(row0)`` writes row 0 on the device. Returns True if anything
        was written."""
        seen_globals, seen_entries = self._seen
        if versions.entries != seen_entries:
            self._rebuild(root, versions)
            self._upload()
        elif versions.globals != seen_globals:
            self.host[0, :3] = self._globals(root)
            set_globals(self.host[0])
        else:
            return False
        self._seen = (versions.globals, versions.entries)
        self.values = self._effective()
        return True

    def _upload(self):
        if self.device is self.host:
            return
        if isinstance(self.device, numpy.ndarray):
            self.device[...] = self.host
        else:
            with self.flat.device_scope():
                self.device.set(self.host)

    @staticmethod
    def _globals(root):
        return [_rule.resolve_root(root, name) for name in _rule.HYPERPARAMETERS]

    def _rebuild(self, root, versions):
        host = self.host
        # a Hyperparameter between a rule and the optimizer's (a "parameter group"), or above
        # the optimizer's, reports its assignments from now on: tracked here, since every
        # change of a chain (a rule's hyperparam replaced, a _parent assigned, a new rule)
        # moves Versions.entries, which brings the table here
        try:
            _rule.track_chain(root.__dict__.get('_parent'), versions)
        except (TypeError, ValueError) as err:
            raise type(err)("the optimizer's hyperparam: {}".format(err)) from None
        host[0, :3] = self._globals(root)
        host[0, 3] = 0
        for i, e in enumerate(self.flat.entries, 1):
            rule = e.param.update_rule
            flags = ENABLED if rule.enabled else 0
            try:
                _rule.track_chain(rule.hyperparam, versions, stop=root)
            except (TypeError, ValueError) as err:
                raise type(err)('parameter {}: {}'.format(e.name, err)) from None
            for j, name in enumerate(_rule.HYPERPARAMETERS):
                try:
                    value, own = _rule.resolve(rule.hyperparam, name, root)
                except AttributeError as err:
                    raise AttributeError('parameter {}: {}'.format(e.name, err)) from None
                except TypeError as err:
                    raise TypeError('parameter {}: update_rule.{}'.format(e.name, err)) from None
                if own:
                    flags |= _OWN[j]
                    host[i, j] = value
                else:
                    host[i, j] = 0.0
            host[i, 3] = flags

    def _effective(self):
        """Per entry (lr, momentum, weight_decay, enabled) from the host table: the CPU path."""
        host = self.host
        g = host[0]
        out = []
        for row in host[1:]:
            flags = int(row[3])
            out.append(tuple(row[j] if flags & _OWN[j] else g[j] for j in range(3))
                       + (bool(flags & ENABLED),))
        return out


def _copy(host, flat):
    with flat.device_scope():
        return host.copy() if flat.xp is numpy else flat.xp.asarray(host)
