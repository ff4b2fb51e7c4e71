"""Whole-step replay: a training step traced once and replayed without Chainer's per-node Python
work (CPU), or as one CUDA graph launch (GPU). See docs/static_graph.md."""
from chainer_tc.static_graph.step import TrainStep  # NOQA
from chainer_tc.static_graph.updater import TrainStepUpdater  # NOQA
