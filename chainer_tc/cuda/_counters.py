"""How much cuDNN set-up work the process has done: a test asserts it stays zero after warm-up."""

_counts = {
    'descriptors': 0,           # cuDNN descriptors created (tensor, filter, convolution, ...)
    'algorithm_queries': 0,     # cudnnFind*/cudnnGet*_v7 convolution algorithm searches
    'workspace_queries': 0,     # workspace and reserve-space size queries
    'cudnn_calls': 0,           # calls through chainer_tc.cuda.cudnn (the per-call work)
}


def add(name, n=1):
    _counts[name] += n


def counters():
    """A copy of the counts since the last :func:`reset_counters`."""
    return dict(_counts)


def reset_counters():
    for name in _counts:
        _counts[name] = 0
