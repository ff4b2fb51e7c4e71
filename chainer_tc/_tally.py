"""Named counts of set-up work (compiles, descriptors, lookups) that a test reads and resets: the
proof that a training step does none of it after warm-up."""


class Tally:
    """Counts of a fixed set of names: ``add(name)``, ``counters()`` (a copy), ``reset()``."""

    def __init__(self, *names):
        self._counts = dict.fromkeys(names, 0)

    def add(self, name, n=1):
        self._counts[name] += n

    def counters(self):
        """A copy of the counts since the last :meth:`reset`."""
        return dict(self._counts)

    def reset(self):
        for name in self._counts:
            self._counts[name] = 0
