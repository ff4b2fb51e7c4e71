"""How much cuDNN set-up work the process has done (a test asserts it stays zero after warm-up),
and how many calls went through chainer_tc's cuDNN and cuBLAS bindings."""
from chainer_tc import _tally

_counts = _tally.Tally(
    'descriptors',              # cuDNN descriptors created (tensor, filter, convolution, ...)
    'algorithm_queries',        # cudnnFind*/cudnnGet*_v7 convolution algorithm searches
    'workspace_queries',        # workspace and reserve-space size queries
    'cudnn_calls',              # a step's calls through chainer_tc.cuda.cudnn (set stream,
                                # convolutions, fused BN; set-up is counted above)
    'cublas_calls',             # calls through chainer_tc.cuda.cublas (handle set-up, products)
)
add = _counts.add
counters = _counts.counters
reset_counters = _counts.reset
