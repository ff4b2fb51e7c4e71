"""DALI input for Chainer: the ResNet-50 ImageNet pipelines and a Chainer iterator over them.

    import chainer_tc
    from chainer_tc import dali
    train = dali.DaliIterator(dali.imagenet_pipeline(root, 'train.txt', device='gpu'), 256)
    val = dali.DaliIterator(dali.imagenet_pipeline(root, 'val.txt', train=False), 256,
                            repeat=False)
    updater = chainer.training.StandardUpdater(train, opt, converter=dali.converter)
    trainer.extend(dali.Evaluator(val, model, converter=dali.converter))

See docs/dali.md. Importing this package does not import DALI; building a pipeline does.
"""
from chainer_tc.dali.dataset import DatasetError  # noqa: F401
from chainer_tc.dali.evaluator import Evaluator  # noqa: F401
from chainer_tc.dali.iterator import converter  # noqa: F401
from chainer_tc.dali.iterator import DaliIterator  # noqa: F401
from chainer_tc.dali.pipeline import imagenet_pipeline  # noqa: F401
from chainer_tc.dali.pipeline import ImagenetPipeline  # noqa: F401
from chainer_tc.dali.pipeline import IMAGENET_MEAN  # noqa: F401
from chainer_tc.dali.pipeline import IMAGENET_STD  # noqa: F401
