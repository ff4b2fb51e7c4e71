#!/usr/bin/env python
"""ResNet-50 on ImageNet with chainer_tc: the command line of Chainer's
examples/imagenet/train_imagenet.py (7.8.1), plus one flag per technique.

    python examples/imagenet/train_imagenet.py train.txt val.txt -R /data/imagenet -a resnet50 \\
        -B 256 -d 0 --dtype float16 --dali --nhwc --fused-bn --batched-update --static-graph \\
        --loss-scale dynamic

A command line of Chainer's example (`-a resnet50`, `-d 0`, `--dali`, `--initmodel`, `-r`, ...)
works unchanged here: only the script's path changes. Every flag, the recipes and the errors are
in examples/imagenet/README.md.
"""
import argparse
import math
import os
import re
import sys
import tempfile

import numpy

import chainer_tc  # noqa: F401  (first: makes the pip-installed CUDA libraries visible)
import chainer
import chainer.functions as F
import chainer.links as L
from chainer import training
from chainer.training import extensions

from chainer_tc import dali
from chainer_tc import input_channels
from chainer_tc import optimizers
from chainer_tc import serializers
from chainer_tc.dali import normalisation
from chainer_tc.models import load_chainer_example
from chainer_tc.models import ResNet50
from chainer_tc import multinode
from chainer_tc.static_graph import TrainStepUpdater

import dataset_util

PROG = os.path.basename(__file__)

# name -> (ResNet-50 version, layout implied)
ARCHS = {
    'resnet50': ('1', None),            # Chainer's example's ResNet50: its checkpoints load
    'resnet50_v1.5': ('1.5', None),     # NVIDIA's / torchvision's ResNet-50 v1.5
    'resnet50_nhwc': ('1', 'NHWC'),     # Chainer's example's ResNet50_Nhwc: v1, channels last
}
DTYPES = ('float16', 'float32', 'float64')
SCHEDULES = ('constant', 'step', 'cosine')
STEP_MILESTONES = (30 / 90, 60 / 90, 80 / 90)   # x0.1 at epochs 30, 60, 80 of 90
LOG_EVERY = 1000                                # iterations, at most (Chainer's example)


class UsageError(Exception):
    """A flag, a combination of flags or an input file that cannot work: reported on stderr
    without a traceback, exit status 2."""


# ---- the command line ---------------------------------------------------------------------------

def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError('expected a positive integer; got {!r}'.format(text))
    return value


def _non_negative_int(text):
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError('expected an integer >= 0; got {!r}'.format(text))
    return value


def _number(low, high=math.inf, low_open=False):
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (value > low if low_open else value >= low) or not value < high \
                or not math.isfinite(value):
            raise argparse.ArgumentTypeError('expected a number in {}{}, {}); got {!r}'.format(
                '(' if low_open else '[', low, high, text))
        return value
    return parse


def _loss_scale(text):
    if text == 'dynamic':
        return text
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            "expected 'dynamic' or a positive number (a static scale); got {!r}".format(text))
    return value


def make_parser():
    p = argparse.ArgumentParser(
        prog=PROG, description='Train ResNet-50 on ImageNet with chainer_tc (the command line of '
        "Chainer's examples/imagenet/train_imagenet.py, one flag per technique). See "
        'examples/imagenet/README.md.')
    p.add_argument('train', help='training list file: "relative/path label" per line')
    p.add_argument('val', help='validation list file, same format')
    p.add_argument('--arch', '-a', choices=sorted(ARCHS), default='resnet50_v1.5',
                   help="resnet50: ResNet-50 v1, Chainer's example's architecture (its "
                   'checkpoints load with --initmodel); resnet50_v1.5 (default): stride on the '
                   "3x3 convolutions, NVIDIA's; resnet50_nhwc: v1 with --nhwc. Chainer's other "
                   'architectures (nin, alex, ...) are not provided')
    p.add_argument('--batchsize', '-B', type=_positive_int, default=32,
                   help='training minibatch size (default 32)')
    p.add_argument('--val_batchsize', '-b', type=_positive_int, default=250,
                   help='validation minibatch size (default 250)')
    p.add_argument('--epoch', '-E', type=_positive_int, default=10,
                   help='epochs to train (default 10)')
    p.add_argument('--iterations', type=_positive_int,
                   help='stop after this many iterations instead of --epoch epochs')
    p.add_argument('--device', '-d', type=str, default='-1',
                   help="Chainer's device specifier: -1 or @numpy (CPU, default), 0 or @cupy:0 "
                   '(GPU 0)')
    p.add_argument('--dtype', choices=DTYPES,
                   help='float16, float32 or float64 (default: chainer.config.dtype, which '
                   'CHAINER_DTYPE sets; float32 otherwise). The model follows it')
    p.add_argument('--initmodel', help="start from this model file: one saved by this script "
                   "(model_iter_N, snapshot_iter_N) or by Chainer's example")
    p.add_argument('--loaderjob', '-j', type=_non_negative_int,
                   help='data loading processes (DALI: threads; default: the CPUs). 0: load in '
                   'the training process (reproducible crops, exact resume)')
    p.add_argument('--mean', '-m', help='mean file (.npy, e.g. compute_mean.py\'s mean.npy): its '
                   'channel means are subtracted and the pixels divided by 255, as in Chainer\'s '
                   "example. Default: ImageNet's mean and standard deviation")
    p.add_argument('--resume', '-r', default='', help='resume the training from this snapshot '
                   '(snapshot_iter_N; a model file is for --initmodel)')
    p.add_argument('--out', '-o', default='result', help='output directory (default result)')
    p.add_argument('--root', '-R', default='.', help='directory the list files\' paths are '
                   'relative to (default .)')
    p.add_argument('--test', action='store_true',
                   help='evaluate, snapshot and log every iteration (as Chainer\'s example)')
    p.add_argument('--dali', action='store_true',
                   help='decode and augment with DALI (chainer_tc.dali): on the GPU with a GPU '
                   'device, on the CPU with -d -1')
    p.add_argument('--gpu', '-g', dest='device', type=int, nargs='?', const=0,
                   help='deprecated (as in Chainer\'s example): use --device')

    p.add_argument('--communicator', metavar='NAME',
                   help="data-parallel training under mpiexec with this ChainerMN communicator "
                        "('naive' on CPUs, 'pure_nccl' on GPUs: one GPU per process, "
                        'chosen by its rank on the node); each rank trains on its shard of the '
                        'data; only rank 0 reports and writes the log, plots and snapshots')
    p.add_argument('--multi-node-bn', action='store_true',
                   help="BatchNorm statistics over every rank's images, not each rank's own "
                        '(chainer_tc.multinode.create_mnbn_model): for small batches per GPU. '
                        'Needs --communicator')
    t = p.add_argument_group('chainer_tc techniques')
    t.add_argument('--nhwc', action='store_true',
                   help='channels-last model and data (chainer_tc.links); no transposes')
    t.add_argument('--fused-bn', action='store_true',
                   help='fused relu(BN(x) + shortcut) links (needs --nhwc)')
    t.add_argument('--batched-update', action='store_true',
                   help='chainer_tc.optimizers.MomentumSGD: every parameter in one kernel, fp32 '
                   'master weights, loss scaling on the device')
    t.add_argument('--static-graph', action='store_true',
                   help='trace the training step once, then replay it (a CUDA graph on a GPU; '
                   'needs --batched-update)')
    t.add_argument('--pad-channels', type=int, choices=input_channels.CHOICES, default=3,
                   help="the images' channels as the first convolution reads them: 4 or 8 "
                   'pads RGB with zeros (cuDNN\'s Tensor Core NHWC kernels want 4 or a multiple '
                   'of 8 channels in float16); with --dali the pipeline pads, otherwise the '
                   'model does. Needs --nhwc. Default 3: no padding')
    t.add_argument('--loss-scale', type=_loss_scale, metavar='{dynamic,N}',
                   help='loss scaling: dynamic, or a static scale N. With --batched-update '
                   "chainer_tc's (dynamic: from 2^15, halved on an overflow, doubled after 1000 "
                   "clean steps), otherwise Chainer's (dynamic: from 1, doubled every step "
                   'until the first overflow, then x2^(1/1000) per step; not in snapshots)')

    o = p.add_argument_group('optimisation')
    o.add_argument('--lr', type=_number(0, low_open=True), default=0.01,
                   help="base learning rate (default 0.01, Chainer's example's)")
    o.add_argument('--momentum', type=_number(0, 1), default=0.9, help='default 0.9')
    o.add_argument('--weight-decay', type=_number(0), default=0.0,
                   help='L2 weight decay of the convolution and classifier weights (not of BN '
                   'parameters or biases); default 0, as in Chainer\'s example')
    o.add_argument('--warmup-epochs', type=_number(0), default=0.0,
                   help='linear learning-rate warm-up over this many epochs, iteration by '
                   'iteration from --lr / (warm-up iterations) to --lr (default 0)')
    o.add_argument('--schedule', choices=SCHEDULES, default='constant',
                   help='after the warm-up: constant (default), step (x0.1 at 1/3, 2/3 and 8/9 '
                   'of the run: epochs 30, 60, 80 of 90) or cosine (to 0 at the end)')
    o.add_argument('--label-smoothing', type=_number(0, 1), default=0.0,
                   help='label smoothing epsilon (default 0; 0.1 is usual)')
    o.add_argument('--seed', type=_non_negative_int,
                   help='seed of the initial weights, the order and the augmentation (default: '
                   "drawn, and printed; with --resume, the snapshot's)")

    m = p.add_argument_group('model and data size')
    m.add_argument('--width', type=_positive_int, default=1,
                   help='divide every channel count by this (1, 2, 4, ..., 64): small models for '
                   'small machines (default 1)')
    m.add_argument('--insize', type=_positive_int, default=224,
                   help='input height and width (default 224; at least 32)')
    m.add_argument('--n-classes', type=_positive_int, default=1000,
                   help='classes; labels must lie in [0, N) (default 1000)')

    r = p.add_argument_group('reporting')
    r.add_argument('--val-interval', type=_positive_int,
                   help='evaluate, snapshot and save the model every N iterations (default: '
                   'every epoch); and at the end of the run, whatever N')
    r.add_argument('--log-interval', type=_positive_int,
                   help='log, print and plot every N iterations (default: every epoch or every '
                   '{} iterations, whichever is shorter); and at the end of the run, whatever '
                   'N'.format(LOG_EVERY))
    return p


def check_args(args):
    """The combinations of flags that cannot work, each refused naming what it needs."""
    if args.fused_bn and not args.nhwc:
        raise UsageError('--fused-bn needs --nhwc: the fused BatchNorm+Add+ReLU links work on '
                         'channels-last (NHWC) data')
    if args.pad_channels != 3 and not args.nhwc:
        raise UsageError('--pad-channels {} needs --nhwc: padding the channels is for cuDNN\'s '
                         'channels-last Tensor Core kernels'.format(args.pad_channels))
    if args.multi_node_bn and not args.communicator:
        raise UsageError('--multi-node-bn needs --communicator: it takes the BatchNorm '
                         "statistics over the ranks' batches")
    if args.static_graph and not args.batched_update:
        raise UsageError('--static-graph needs --batched-update: the replayed step keeps the '
                         "learning rate and the loss scale in device memory, which only "
                         "chainer_tc.optimizers.MomentumSGD does")
    if args.dali and args.dtype == 'float64':
        raise UsageError('--dali needs --dtype float16 or float32: DALI outputs no float64 images')
    if 64 % args.width:
        raise UsageError('--width must divide 64 (1, 2, 4, 8, 16, 32 or 64); got {}'
                         .format(args.width))
    if args.insize < 32:
        raise UsageError('--insize must be at least 32 (ResNet-50 reduces its input 32 times); '
                         'got {}'.format(args.insize))
    if args.seed is not None and args.seed >= 2 ** 31:
        raise UsageError('--seed must be below 2**31; got {}'.format(args.seed))
    if not os.path.isdir(args.root):
        raise UsageError('--root/-R {!r} does not exist or is not a directory'.format(args.root))
    for flag, path in (('--initmodel', args.initmodel), ('--resume/-r', args.resume),
                       ('--mean/-m', args.mean)):
        if path and not os.path.isfile(path):
            raise UsageError('{} {!r} does not exist or is not a file'.format(flag, path))
    check_out(args.out)


def check_out(out):
    """``--out`` must be a directory this process can write in, or one it can create (the
    Trainer creates it): otherwise the run would fail at its first log or snapshot."""
    path = os.path.abspath(out)
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise UsageError('--out/-o {!r} is a file, not a directory'.format(out))
        try:
            tempfile.TemporaryFile(dir=path).close()
        except OSError as e:
            raise UsageError('--out/-o {!r}: cannot write in it ({})'.format(
                out, e.strerror or e)) from None
        return
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UsageError('--out/-o {!r} cannot be created: {!r} is a file, not a directory'
                         .format(out, parent))
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError('--out/-o {!r} cannot be created: {!r} is not writable'
                         .format(out, parent))


def make_communicator(name):
    """A ChainerMN communicator (``--communicator``), or None for one process."""
    if not name:
        return None
    try:
        import chainermn
        return chainermn.create_communicator(name)
    except ImportError as e:
        raise UsageError('--communicator needs mpi4py and MPI (pip install -e .[mpi]): {}'
                         .format(e)) from None
    except ValueError as e:
        raise UsageError('--communicator {!r}: {}'.format(name, e)) from None


def is_reporter(args):
    """Whether this process reports and writes files: the only one, or rank 0."""
    return args.comm is None or args.comm.rank == 0


def get_device(spec):
    """Chainer's device for ``spec``, checked: NumPy or a CuPy GPU that exists."""
    spec = str(spec)
    try:
        device = chainer.get_device(spec)
    except Exception as e:      # ValueError, RuntimeError (ChainerX, iDeep unavailable), ...
        raise UsageError('--device/-d {!r} is not a device here: {} (expected -1 or @numpy for '
                         'the CPU, or a GPU: 0 or @cupy:0)'.format(spec, e)) from None
    if device.xp is numpy:
        return device
    if device.xp is not chainer.backends.cuda.cupy:
        raise UsageError('--device/-d {!r}: chainer_tc runs on NumPy (-1, @numpy) or CuPy '
                         '(0, @cupy:0) devices; {} is not supported'.format(spec, device))
    try:
        count = chainer.backends.cuda.cupy.cuda.runtime.getDeviceCount()
        why = '{} GPU(s) found'.format(count)
    except Exception as e:      # no driver, ...
        count, why = 0, 'CUDA: {}'.format(e)
    if device.device.id >= count:
        raise UsageError('--device/-d {!r}: there is no CUDA GPU {} on this machine ({}); use '
                         '-d -1 for the CPU'.format(spec, device.device.id, why))
    return device


def resolve_dtype(args):
    if args.dtype is not None:
        chainer.config.dtype = numpy.dtype(args.dtype)
    dtype = chainer.get_dtype()         # mixed16 (CHAINER_DTYPE) counts as float16
    if dtype not in (numpy.float16, numpy.float32, numpy.float64):
        raise UsageError('the model dtype is {}; use --dtype float16, float32 or float64'
                         .format(dtype))
    if args.dali and dtype == numpy.float64:
        raise UsageError('--dali needs float16 or float32 (CHAINER_DTYPE is float64): DALI '
                         'outputs no float64 images; pass --dtype')
    return numpy.dtype(dtype)


# ---- model and optimizer ------------------------------------------------------------------------

def smoothed_cross_entropy(eps):
    """Softmax cross entropy against labels smoothed by ``eps``: (1 - eps) of the weight on the
    label, eps spread evenly over all classes. Built from Chainer functions of the logits and the
    labels only, so the static-graph replay recomputes it."""
    def lossfun(y, t):
        loss = F.softmax_cross_entropy(y, t)
        return (1 - eps) * loss - eps * F.mean(F.log_softmax(y))
    return lossfun


def make_model(args, layout):
    version = ARCHS[args.arch][0]
    predictor = ResNet50(layout, n_classes=args.n_classes, width=args.width, version=version,
                         fused=args.fused_bn if layout == 'NHWC' else None,
                         pad_channels=args.pad_channels)
    predictor.insize = args.insize
    lossfun = smoothed_cross_entropy(args.label_smoothing) if args.label_smoothing \
        else F.softmax_cross_entropy
    return L.Classifier(predictor, lossfun=lossfun)


def load_initmodel(path, model, args, facts):
    """Loads ``path`` into ``model.predictor``: a file of Chainer's example's ResNet50 (its
    names, ``res2/0/conv1/W``...) through ``load_chainer_example``, ours through
    ``chainer_tc.serializers.load_npz``; either a model file or a Trainer snapshot. A file of
    this script that records another architecture or input normalisation than ``facts`` is
    refused (an earlier version's file, which records none, loads as before)."""
    flag = '--initmodel {!r}'.format(path)
    keys, small = peek_npz(path, flag, (RECORD + '/', 'extensions/{}/'.format(RECORD)))
    check_facts(flag, recorded(small), facts)
    prefixes = ('', 'predictor/', 'updater/model:main/', 'updater/model:main/predictor/')
    try:
        for prefix in prefixes:
            if prefix + 'res2/0/conv1/W' in keys:
                if ARCHS[args.arch][0] != '1':
                    raise UsageError(
                        "--initmodel {!r} is a checkpoint of Chainer's example's ResNet50 "
                        '(v1): train it with -a resnet50 (or resnet50_nhwc), not -a {}'
                        .format(path, args.arch))
                load_chainer_example(path, model.predictor, path=prefix)
                return "Chainer's example's ResNet50"
            if prefix + 'blocks/0/conv1/W' in keys:
                serializers.load_npz(path, model.predictor, path=prefix)
                return 'chainer_tc ResNet50'
    except (ValueError, KeyError) as e:
        raise UsageError('--initmodel {!r} does not fit this model ({}, --width {}, '
                         '--n-classes {}): {}'.format(path, args.arch, args.width,
                                                      args.n_classes, _message(e))) from None
    raise UsageError("--initmodel {!r} holds no ResNet-50 (neither this script's nor Chainer's "
                     "example's parameter names, e.g. blocks/0/conv1/W or res2/0/conv1/W)"
                     .format(path))


# ---- what the files record ----------------------------------------------------------------------

RECORD = 'run'      # model files: run/<fact>; trainer snapshots: extensions/run/<fact>


def run_facts(args, mean, std):
    """What gives the weights their meaning and does not show in their shapes: the ResNet-50
    version (v1 and v1.5 have the same arrays) and the input's normalisation (per channel, on
    the 0-255 scale). Recorded in every model file and snapshot, checked when one is loaded."""
    return {'arch': args.arch, 'resnet50_version': ARCHS[args.arch][0],
            'mean': numpy.asarray(mean, numpy.float64), 'std': numpy.asarray(std, numpy.float64)}


def _write_facts(serializer, facts):
    for key in sorted(facts):
        serializer(key, numpy.asarray(facts[key]))


class ModelFile:
    """What a ``model_iter_N`` file holds: the ResNet-50's arrays, as ``save_npz(predictor)``
    writes them (``chainer_tc.serializers.load_npz(file, ResNet50(...))`` loads it), and the
    facts of the run under ``run/``."""

    def __init__(self, predictor, facts):
        self.predictor, self.facts = predictor, facts

    def serialize(self, serializer):
        self.predictor.serialize(serializer)
        if isinstance(serializer, chainer.serializer.Serializer):
            _write_facts(serializer[RECORD], self.facts)


class RunRecord(training.Extension):
    """Writes the facts of the run and its seed into the Trainer's snapshots
    (``extensions/run/...``). Loading reads nothing: ``-r`` checks the file's record before
    anything is built (and a snapshot of an earlier version has none)."""

    priority = training.PRIORITY_READER

    def __init__(self, facts):
        self.facts = facts

    def __call__(self, trainer):
        pass

    def serialize(self, serializer):
        if isinstance(serializer, chainer.serializer.Serializer):
            _write_facts(serializer, self.facts)


def _never(trainer):
    return False


def peek_npz(path, flag, prefixes=()):
    """(the keys of the .npz file ``path``, ``{key: array}`` for its keys that start with one of
    ``prefixes``), read without unpickling anything (numpy refuses object arrays) and without
    reading the other arrays. A file that is not an .npz: UsageError naming ``flag``."""
    try:
        npz = numpy.load(path, allow_pickle=False)
    except Exception:               # not a zip, empty, a pickle, ...: read_npz says which
        npz = None
    if isinstance(npz, numpy.lib.npyio.NpzFile):
        with npz:
            keys = list(npz.files)
            try:
                return keys, {k: npz[k] for k in keys
                              if prefixes and k.startswith(tuple(prefixes))}
            except ValueError:      # an object array among them: read_npz names it
                pass
    try:
        serializers.read_npz(path)
    except ValueError as e:
        raise UsageError('{}: {}'.format(flag, e)) from None
    raise UsageError('{}: cannot read it as an .npz file'.format(flag))


def recorded(arrays):
    """The facts recorded in ``arrays`` (``peek_npz``'s), under ``run/`` (a model file) or
    ``extensions/run/`` (a snapshot), as Python values: {} for a file without them."""
    facts = {}
    for prefix in ('extensions/{}/'.format(RECORD), RECORD + '/'):
        for key, value in arrays.items():
            if key.startswith(prefix) and key.count('/') == prefix.count('/'):
                value = numpy.asarray(value)
                facts.setdefault(key[len(prefix):], value.item() if value.ndim == 0 else value)
    return facts


def _archs(version):
    return ' or '.join('-a ' + a for a in sorted(ARCHS) if ARCHS[a][0] == version)


def _normalisation(mean, std):
    return 'mean ({}) and std ({})'.format(', '.join('{:.6g}'.format(m) for m in mean),
                                           ', '.join('{:.6g}'.format(s) for s in std))


def check_facts(flag, theirs, ours):
    """UsageError naming ``flag`` when a file's record (``theirs``) says its weights mean
    something else than this run's (``ours``): another ResNet-50 version, another input
    normalisation. A file without a record passes."""
    version = theirs.get('resnet50_version')
    if version is not None and str(version) != ours['resnet50_version']:
        version = str(version)
        theirs_arch = '-a {}'.format(theirs['arch']) if 'arch' in theirs else _archs(version)
        raise UsageError(
            '{} holds a ResNet-50 v{} ({}); this run is -a {}, a ResNet-50 v{}: the same arrays '
            'compute another function. Use {}'.format(flag, version, theirs_arch, ours['arch'],
                                                      ours['resnet50_version'], _archs(version)))
    if 'mean' in theirs and 'std' in theirs:
        mean, std = numpy.asarray(theirs['mean']), numpy.asarray(theirs['std'])
        if mean.shape != (3,) or std.shape != (3,) or not (
                numpy.allclose(mean, ours['mean'], rtol=1e-6, atol=0)
                and numpy.allclose(std, ours['std'], rtol=1e-6, atol=0)):
            raise UsageError(
                '{} was trained on images normalised with {} per channel (0-255 scale); this '
                'run normalises with {}. Give the --mean/-m of the run that made it (none: '
                "ImageNet's mean and std)".format(flag, _normalisation(mean.ravel(), std.ravel()),
                                                  _normalisation(ours['mean'], ours['std'])))


def make_optimizer(args, model, dtype):
    opt = make_single_optimizer(args, model, dtype)
    if args.comm is not None and not args.static_graph:
        # ChainerMN's own wrapper (it averages the gradients itself), its broadcasts of the
        # model exact: pure_nccl's own rounds float32 parameters to float16 under --dtype float16
        opt = multinode.create_multi_node_optimizer(opt, args.comm)
    return opt


def make_single_optimizer(args, model, dtype):
    if args.batched_update:
        opt = optimizers.MomentumSGD(lr=args.lr, momentum=args.momentum,
                                     weight_decay=args.weight_decay,
                                     decay_filter=optimizers.skip_bn_and_bias)
        opt.setup(model)
        if args.loss_scale == 'dynamic':
            opt.loss_scaling()
        elif args.loss_scale is not None:
            opt.loss_scaling(scale=args.loss_scale)
        return opt
    opt = chainer.optimizers.MomentumSGD(lr=args.lr, momentum=args.momentum)
    opt.setup(model)
    if args.weight_decay:
        # the same parameters as the batched update's skip_bn_and_bias: weights, not BN or biases
        for _, param in model.namedparams():
            if param.ndim > 1:
                param.update_rule.add_hook(chainer.optimizer_hooks.WeightDecay(args.weight_decay))
    if dtype == numpy.float16:
        opt.use_fp32_update()
    if args.loss_scale == 'dynamic':
        opt.loss_scaling()
    elif args.loss_scale is not None:
        opt.set_loss_scale(args.loss_scale)
    return opt


# ---- input --------------------------------------------------------------------------------------

def make_iterators(args, device, layout, dtype, mean, std, seed):
    """(train_iter, val_iter, converter, what) for DALI or PIL + Chainer's iterators."""
    lists = (('train', args.train, True, args.batchsize), ('val', args.val, False,
                                                           args.val_batchsize))
    if args.dali:
        gpu = device.xp is not numpy
        common = dict(crop=args.insize, device='gpu' if gpu else 'cpu',
                      device_id=device.device.id if gpu else None, dtype=dtype, layout=layout,
                      num_classes=args.n_classes, seed=seed, num_threads=args.loaderjob or None,
                      mean=mean, std=std, pad_channels=args.pad_channels)
        if args.comm is not None:           # each rank reads its shard (disjoint, complete)
            common.update(shard_id=args.comm.rank, num_shards=args.comm.size)
        its = []
        for name, path, train, batch in lists:
            with _naming(name, path):
                pipe = dali.imagenet_pipeline(args.root, path, train=train, **common)
            its.append(dali.DaliIterator(pipe, batch, repeat=train))
        what = 'DALI, {} pipeline'.format('GPU' if gpu else 'CPU')
        return its[0], its[1], dali.converter, what
    # crops, flips and the shard's shuffling: each rank draws its own (one seed cuts the shards)
    rng = numpy.random.RandomState(seed if args.comm is None else [seed, args.comm.rank])
    datasets = []
    for name, path, train, _ in lists:
        with _naming(name, path):
            datasets.append(dataset_util.ImageListDataset(
                args.root, path, args.insize, train, rng=rng if train else None, mean=mean,
                std=std, layout=layout, dtype=dtype, num_classes=args.n_classes))
    train, val = datasets
    if args.comm is not None:               # each rank builds its own shard, here: its
        train = shard(train, args.comm, seed)   # random state is this rank's (snapshots keep
        val = shard(val, args.comm)             # it), unlike chainermn.scatter_dataset's copies
    if args.loaderjob == 0:
        train_iter = dataset_util.ReproducibleSerialIterator(train, args.batchsize, rng)
        val_iter = chainer.iterators.SerialIterator(val, args.val_batchsize, repeat=False,
                                                    shuffle=False)
        what = 'PIL in this process'
    else:
        # the workers hand back what they could not read (the converter raises it here: a
        # worker that raises hangs the iterator); the orders are a chain from the seed, which
        # the iterator's snapshot resumes (its prefetch thread draws ahead of the batches)
        train_iter = chainer.iterators.MultiprocessIterator(
            dataset_util.InWorkers(train), args.batchsize, n_processes=args.loaderjob,
            order_sampler=dataset_util.ChainedOrderSampler(
                seed if args.comm is None else [seed, args.comm.rank]))
        val_iter = chainer.iterators.MultiprocessIterator(
            dataset_util.InWorkers(val), args.val_batchsize, repeat=False, shuffle=False,
            n_processes=args.loaderjob)
        what = 'PIL in {} worker processes'.format(args.loaderjob or os.cpu_count())
    return train_iter, val_iter, dataset_util.concat_examples, what


class Shard(chainer.dataset.DatasetMixin):
    """The examples of ``dataset`` at ``indices``."""

    def __init__(self, dataset, indices):
        self.dataset, self.indices = dataset, indices

    def __len__(self):
        return len(self.indices)

    def get_example(self, i):
        return self.dataset[int(self.indices[i])]


def shard(dataset, comm, seed=None):
    """This rank's part of ``dataset``. With ``seed`` (training): a seeded permutation cut in
    equal parts, the last ones completed from its start, so every rank takes as many steps per
    epoch. Without (validation): contiguous parts that together hold every example once."""
    n, size, rank = len(dataset), comm.size, comm.rank
    if seed is None:
        return Shard(dataset, numpy.arange(n * rank // size, n * (rank + 1) // size))
    order = numpy.random.RandomState(seed).permutation(n)
    per = -(-n // size)
    order = numpy.concatenate([order, order[:per * size - n]])
    return Shard(dataset, order[rank * per:(rank + 1) * per])


class _naming:
    """Turns the data set errors of one list file into a UsageError naming the argument."""

    def __init__(self, name, path):
        self.name, self.path = name, path

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if isinstance(e, (FileNotFoundError, dali.DatasetError)):
            raise UsageError('{} list {!r}: {}'.format(self.name, self.path, _message(e))) \
                from None


def normalisation_of(args):
    """(mean, std) per channel on the 0-255 scale: ImageNet's, or --mean's channel means and
    255 (Chainer's example subtracts its mean image and divides by 255)."""
    if not args.mean:
        return normalisation.channel_mean(None), normalisation.channel_std(None)
    try:
        return normalisation.channel_mean(args.mean), normalisation.channel_std(255)
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise UsageError('--mean/-m: {}'.format(e)) from None


# ---- the trainer --------------------------------------------------------------------------------

class LearningRate(training.Extension):
    """Sets the optimizer's lr before every iteration from the position in the run: a linear
    warm-up over ``warmup`` epochs, then constant, step or cosine. A function of
    ``updater.epoch_detail`` only, so a resumed run follows the same curve."""

    trigger = (1, 'iteration')
    priority = training.PRIORITY_READER       # after observe_lr recorded the lr just used

    def __init__(self, base, schedule, warmup, total, epochs_per_iteration):
        self.base, self.schedule, self.warmup = base, schedule, warmup
        self.total, self.step = total, epochs_per_iteration

    def lr_at(self, epoch):
        """The lr of the iteration that starts at ``epoch`` (epochs done, a fraction)."""
        if epoch < self.warmup:
            return self.base * min(1.0, (epoch + self.step) / self.warmup)
        if self.schedule == 'step':
            return self.base * 0.1 ** sum(epoch >= m * self.total for m in STEP_MILESTONES)
        if self.schedule == 'cosine':
            done = (epoch - self.warmup) / max(self.total - self.warmup, 1e-12)
            return self.base * 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))
        return self.base

    def initialize(self, trainer):
        self(trainer)

    def __call__(self, trainer):
        trainer.updater.get_optimizer('main').lr = self.lr_at(trainer.updater.epoch_detail)


class AnyOf:
    """A trigger that fires when any of ``triggers`` fires (all are asked, every time)."""

    def __init__(self, *triggers):
        self.triggers = [training.trigger.get_trigger(t) for t in triggers]

    def __call__(self, trainer):
        return any([t(trainer) for t in self.triggers])

    def serialize(self, serializer):
        for i, t in enumerate(self.triggers):
            if hasattr(t, 'serialize'):
                t.serialize(serializer[str(i)])


class AlsoAtTheEnd:
    """``trigger``, and the last iteration of the run, ``stop`` ((n, 'iteration') or (n,
    'epoch'), the Trainer's stop trigger) too. The end is read from the updater's position,
    so only ``trigger`` has state to save: the snapshot keys are ``trigger``'s alone, as in
    snapshots written before this wrapper."""

    def __init__(self, trigger, stop):
        self.trigger = training.trigger.get_trigger(trigger)
        self.length, self.unit = stop

    def __call__(self, trainer):
        fire = self.trigger(trainer)        # always asked: its state follows every iteration
        updater = trainer.updater
        position = updater.iteration if self.unit == 'iteration' else updater.epoch_detail
        return fire or position >= self.length

    def serialize(self, serializer):
        self.trigger.serialize(serializer)


def make_trainer(args, model, optimizer, train_iter, val_iter, converter, device, epoch_size,
                 plots, facts):
    if args.static_graph and args.comm is not None:
        updater = multinode.TrainStepUpdater(train_iter, optimizer, args.comm,
                                             converter=converter, device=device)
    elif args.static_graph:
        updater = TrainStepUpdater(train_iter, optimizer, converter=converter, device=device)
    else:
        updater = training.updaters.StandardUpdater(train_iter, optimizer, converter=converter,
                                                    device=device)
    iters_per_epoch = epoch_size / args.batchsize
    if args.iterations:
        stop, total_epochs = (args.iterations, 'iteration'), args.iterations / iters_per_epoch
    else:
        stop, total_epochs = (args.epoch, 'epoch'), float(args.epoch)
    if args.warmup_epochs and args.warmup_epochs >= total_epochs:
        raise UsageError('--warmup-epochs {} is not shorter than the run ({:g} epochs): the '
                         'learning rate would never reach --lr'.format(args.warmup_epochs,
                                                                        total_epochs))
    trainer = training.Trainer(updater, stop, out=args.out)

    def val_interval():
        """A new trigger per extension (Chainer's interval triggers keep state): every
        --val-interval iterations, or every epoch; and at the end."""
        if args.test:
            return (1, 'iteration')
        if args.val_interval:
            return AlsoAtTheEnd((args.val_interval, 'iteration'), stop)
        return AnyOf((1, 'epoch'), stop)

    def log_interval():
        """Every --log-interval iterations, or every epoch (at most LOG_EVERY iterations); and
        at the end."""
        if args.test:
            return (1, 'iteration')
        if args.log_interval:
            return AlsoAtTheEnd((args.log_interval, 'iteration'), stop)
        return AnyOf((1, 'epoch') if iters_per_epoch <= LOG_EVERY else (LOG_EVERY, 'iteration'),
                     stop)

    trainer.extend(LearningRate(args.lr, args.schedule, args.warmup_epochs, total_epochs,
                                1 / iters_per_epoch))
    # dali.Evaluator: the mean over images (Chainer's weighs every batch the same); over every
    # rank's shard with a communicator (each image once)
    if args.comm is not None:
        evaluator = multinode.Evaluator(val_iter, model, args.comm, converter=converter,
                                        device=device)
    else:
        evaluator = dali.Evaluator(val_iter, model, converter=converter, device=device)
    trainer.extend(evaluator, trigger=val_interval())
    if not is_reporter(args):
        # the other ranks keep what is their own next to rank 0's snapshot: their shard's
        # position and the BatchNorm statistics of their batches
        trainer.extend(extensions.snapshot_object(
            RankState(train_iter, model),
            'snapshot_iter_{{.updater.iteration}}.rank{}'.format(args.comm.rank)),
            trigger=val_interval())
        return trainer
    snapshot = extensions.snapshot()
    trainer.extend(snapshot, trigger=val_interval())
    # the model file is written before the trainer's snapshot (a higher priority; the order
    # of extend keeps the names, _Snapshot and _Snapshot_1, that earlier snapshots hold): the
    # snapshot then holds the model file trigger's state after this iteration, and a resumed
    # run writes its model files where the uninterrupted run does
    model_facts = {k: v for k, v in facts.items() if k != 'seed'}
    trainer.extend(extensions.snapshot_object(ModelFile(model.predictor, model_facts),
                                              'model_iter_{.updater.iteration}'),
                   trigger=val_interval(), priority=snapshot.priority + 1)
    trainer.extend(RunRecord(facts), name=RECORD, trigger=_never)     # in the snapshots
    trainer.extend(extensions.LogReport(trigger=log_interval()))
    trainer.extend(extensions.observe_lr(), trigger=log_interval())
    columns = ['epoch', 'iteration', 'main/loss', 'validation/main/loss', 'main/accuracy',
               'validation/main/accuracy', 'lr']
    if args.loss_scale is not None:
        trainer.extend(extensions.observe_value(
            'loss_scale', lambda trainer: float(optimizer._loss_scale)), trigger=log_interval())
        columns.append('loss_scale')
    trainer.extend(extensions.PrintReport(columns + ['elapsed_time']), trigger=log_interval())
    trainer.extend(extensions.ProgressBar(update_interval=10, out=sys.stdout))
    if plots:
        trainer.extend(extensions.PlotReport(['main/loss', 'validation/main/loss'], 'iteration',
                                             trigger=log_interval(), file_name='loss.png'))
        trainer.extend(extensions.PlotReport(['main/accuracy', 'validation/main/accuracy'],
                                             'iteration', trigger=log_interval(),
                                             file_name='accuracy.png'))
    return trainer


class RankState:
    """What differs between the ranks of a multi-node run: the position of the rank's training
    iterator over its shard, and the running statistics BatchNorm took from its own batches
    (with --multi-node-bn every rank's are the same)."""

    def __init__(self, iterator, model):
        self.iterator, self.model = iterator, model

    def serialize(self, serializer):
        self.iterator.serialize(serializer['iterator'])
        for path, link in self.model.namedlinks():
            d = link.__dict__
            for name in sorted(link._persistent):
                d[name] = serializer['persistent' + path](name, d[name])


def _matplotlib():
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use('Agg')           # files only: no display needed
    return True


def inspect_snapshot(path, facts):
    """Checks the ``-r`` file before anything is built on it: a Trainer snapshot of this
    script (not a model file, not a snapshot of Chainer's example) whose record, if it has one,
    matches ``facts``. Returns the record ({} for a snapshot of an earlier version)."""
    flag = '--resume/-r {!r}'.format(path)
    iterator = 'updater/iterator:main/'
    keys, small = peek_npz(path, flag, ('extensions/{}/'.format(RECORD), iterator + 'seed'))
    models = [k for k in keys if k.endswith(('blocks/0/conv1/W', 'res2/0/conv1/W'))]
    if 'updater/iteration' not in keys:
        if models and not models[0].startswith('updater/'):
            whose = ("Chainer's example's ResNet50, for -a resnet50" if 'res2' in models[0]
                     else "this script's ResNet-50")
            raise UsageError(
                '{} is a model file ({}), not a Trainer snapshot: -r resumes a snapshot_iter_N '
                'with its optimizer, position and log. To start a run from this model, use '
                '--initmodel {}'.format(flag, whose, path))
        raise UsageError('{} is not a Trainer snapshot (snapshot_iter_N): it has no '
                         'updater/iteration'.format(flag))
    if any('res2/0/conv1/W' in k for k in models):
        raise UsageError(
            "{} is a Trainer snapshot of Chainer's example (its ResNet50's names, "
            'res2/0/conv1/W, ...), which this script cannot resume. To start a run from its '
            'model, use --initmodel {} -a resnet50 (the optimizer, the position and the log '
            'start afresh)'.format(flag, path))
    record = recorded(small)
    check_facts(flag, record, facts)
    if 'seed' not in record and iterator + 'seed' in small:     # DALI's, which it adopts
        record['seed'] = int(small[iterator + 'seed'])
    return record


def resume(trainer, path, comm=None):
    """``chainer_tc.serializers.load_npz``: Chainer's loader without unpickling anything. With a
    communicator, every rank loads rank 0's snapshot (the model, the optimizer, the trainer)
    and its own iterator's position (``<snapshot>.rank<k>``, written next to it)."""
    hint = 'resume with the flags the snapshot was made with'
    flag = '--resume/-r {!r}'.format(path)
    ignore = [_unmade_momentum(peek_npz(path, flag)[0])]
    try:
        if comm is None or comm.rank == 0:
            serializers.load_npz(path, trainer, ignore_names=ignore)
        else:
            iterator = 'updater/iterator:main/'
            ignore.append(lambda k: k.startswith(iterator))
            serializers.load_npz(path, trainer, ignore_names=ignore)
            own = '{}.rank{}'.format(path, comm.rank)
            if not os.path.isfile(own):
                raise UsageError('--resume/-r: rank {} needs its own snapshot {!r} (written by '
                                 'that rank next to rank 0\'s)'.format(comm.rank, own))
            model = trainer.updater.get_optimizer('main').target
            serializers.load_npz(own, RankState(trainer.updater.get_iterator('main'), model))
    except KeyError as e:
        raise UsageError('{} does not match this run: {}'.format(
            flag, _missing(path, trainer, e, hint))) from None
    except (ValueError, TypeError) as e:
        mismatch = _shape_mismatch(path, trainer)
        if mismatch:
            raise UsageError('{} does not match this run: {} has shape {} in the snapshot, {} '
                             'here ({})'.format(flag, *mismatch, hint)) from None
        raise UsageError('{}: {}'.format(flag, _message(e))) from None
    fit_optimizer_state(trainer.updater.get_optimizer('main'), flag)


def _unmade_momentum(keys):
    """``ignore_names`` for the momentum of a snapshot whose optimizer has made none: ChainerMN's
    multi-node optimizer spends its first update on broadcasting rank 0's model, and a
    snapshot after it holds no ``v``, which Chainer's update rules refuse as missing. Ignored,
    they stay unmade, and are made at their first update, as in the run that wrote it."""
    prefix = 'updater/optimizer:main/'
    made = any(k.startswith(prefix) and k.endswith('/v') for k in keys)
    return lambda k: not made and k.startswith(prefix) and k.endswith('/v')


def _updater_keys(trainer):
    """``{key: array}`` of what this run's updater saves (the model, the optimizer, the
    iterator), under the snapshot's names."""
    here = chainer.serializers.DictionarySerializer(path='updater/')
    here.save(trainer.updater)
    return here.target


# what the keys of a snapshot's iterator say about the flags that made it
_INPUTS = (('dataset_fingerprint', 'DALI (--dali)'), ('rng_keys', 'PIL in this process (-j 0)'),
           ('order', 'PIL in worker processes (-j N)'))


def _input_of(keys):
    for key, kind in _INPUTS:
        if 'updater/iterator:main/' + key in keys:
            return kind
    return 'another'


def _missing(path, trainer, error, hint):
    """What the snapshot lacks that this run loads, in flags where its keys tell them."""
    theirs = set(peek_npz(path, '--resume/-r {!r}'.format(path))[0])
    ours = _updater_keys(trainer)
    if _input_of(theirs) != _input_of(ours):
        return "the snapshot's input is {}, this run's {} ({})".format(
            _input_of(theirs), _input_of(ours), hint)
    key = next((k for k in sorted(ours) if k not in theirs), None)
    if key is None:             # not the updater's: a trainer extension's
        found = re.match(r"'([^']*)' is not in ", _message(error))
        key = found.group(1) if found else _message(error)
    return 'the snapshot has no {} ({})'.format(key, hint)


def fit_optimizer_state(optimizer, flag):
    """Chainer's MomentumSGD saves its momentum ``v`` in the shape of the parameter, and a
    channels-last filter (``--nhwc``: (out, kh, kw, in), ``--pad-channels``: ``in`` padded) is
    another shape than Chainer's (out, in, kh, kw), in which the filters themselves are saved.
    A snapshot of another layout or padding loads its ``v`` as it was saved; here it is turned
    into this model's shape, as the filters are: a filter's state in the other layout or
    padding is read as such (the two layouts have one shape only where in == kh == kw, which
    no ResNet-50 filter has: 1x1 filters of one input channel are the same either way).
    chainer_tc's optimizer (``--batched-update``) saves its state as the filters and needs
    none of this. What fits neither is refused, naming the parameter."""
    optimizer = getattr(optimizer, 'actual_optimizer', optimizer)     # ChainerMN's wrapper
    if isinstance(optimizer, optimizers.MomentumSGD) or not isinstance(
            getattr(optimizer, 'target', None), chainer.Link):
        return
    links = {id(getattr(link, 'W', None)): link for link in optimizer.target.links()}
    for name, param in optimizer.target.namedparams():
        rule = getattr(param, 'update_rule', None)
        state = getattr(rule, 'state', None)
        if not state or param.array is None:
            continue
        for key, value in list(state.items()):
            if value is None or value.shape == param.shape:
                continue
            link = links.get(id(param))
            fitted = _fit_filter_state(value, param, link) if link is not None else None
            if fitted is None:
                raise UsageError(
                    "{} does not match this run: Chainer's optimizer saved the state {!r} of {} "
                    'with shape {}, the parameter here has {} (resume with the --nhwc and '
                    '--pad-channels the snapshot was made with, or use --batched-update, which '
                    'saves its state as the filters)'.format(flag, key, name, value.shape,
                                                             param.shape))
            rule.state[key] = fitted


def _fit_filter_state(value, param, link):
    """``value``, a filter's optimizer state in the other layout or padding, in the shape of
    ``param`` (the filter of ``link``); None when it is neither."""
    host = chainer.backend.CpuDevice().send(value)
    nhwc_here = callable(getattr(link, 'filter_from_file', None))
    if nhwc_here:                       # Chainer's shape, unpadded: (out, in, kh, kw)
        out, kh, kw, _ = param.shape
        chainer_shape = (out, link.in_channels, kh, kw)
    else:
        chainer_shape = param.shape
    out, cin, kh, kw = chainer_shape
    if host.ndim != 4:
        return None
    if host.shape == chainer_shape:                 # saved by an NCHW run
        chainer_layout = host
    elif host.shape[:3] == (out, kh, kw) and host.shape[3] >= cin:     # an NHWC run, padded?
        if host[..., cin:].any():
            return None
        chainer_layout = host[..., :cin].transpose(0, 3, 1, 2)
    else:
        return None
    fitted = link.filter_from_file(chainer_layout, 'the optimizer state') if nhwc_here \
        else numpy.ascontiguousarray(chainer_layout)
    if fitted.shape != param.shape:
        return None
    return chainer.backend.get_device_from_array(value).send(fitted.astype(value.dtype))


def _shape_mismatch(path, trainer):
    """(key, shape in the file, shape here) of the first array whose shapes differ, or None."""
    try:
        arrays = serializers.read_npz(path)
    except ValueError:
        return None
    here = _updater_keys(trainer)       # the model, the optimizer, the iterator
    for key in sorted(here):
        theirs, ours = arrays.get(key), here[key]
        if theirs is not None and ours is not None and numpy.shape(theirs) != numpy.shape(ours):
            return key, numpy.shape(theirs), numpy.shape(ours)
    return None


def _message(e):
    return e.args[0] if isinstance(e, KeyError) and e.args else str(e)


# ---- main ---------------------------------------------------------------------------------------

def describe(args, device, dtype, layout, seed, loader, mean):
    version = ARCHS[args.arch][0]
    techniques = [name for name, on in (
        ('--nhwc', layout == 'NHWC'), ('--fused-bn', args.fused_bn),
        ('--batched-update', args.batched_update), ('--static-graph', args.static_graph),
        ('--multi-node-bn', args.multi_node_bn),
        ('--pad-channels {}'.format(args.pad_channels), args.pad_channels != 3),
        ('--loss-scale {}'.format(args.loss_scale), args.loss_scale is not None),
        ('--dali', args.dali)) if on]
    print('Device: {}'.format(device))
    if chainer.config.dtype is chainer.mixed16:
        print('Dtype: mixed16 (float16, with BatchNormalization\'s parameters and statistics in '
              'float32)')
    else:
        print('Dtype: {}'.format(dtype.name))
    if args.comm is None:
        print('# Minibatch-size: {}'.format(args.batchsize))
    else:
        print('Communicator: {}, {} processes (ranks)'.format(args.communicator, args.comm.size))
        print('# Minibatch-size: {} per process, {} in all'.format(
            args.batchsize, args.batchsize * args.comm.size))
    print('# {}: {}'.format(*(('iterations', args.iterations) if args.iterations
                              else ('epoch', args.epoch))))
    print('Model: ResNet-50 v{} ({}), {}, width/{}, {}x{} input, {} classes'.format(
        version, 'Chainer\'s example\'s architecture' if version == '1' else 'NVIDIA\'s',
        layout + (' (-a {})'.format(args.arch) if ARCHS[args.arch][1] else ''),
        args.width, args.insize, args.insize, args.n_classes))
    print('Techniques: {}'.format(' '.join(techniques) or 'none (vanilla Chainer)'))
    if args.mean:
        normalised = 'mean file {} (channel means {}), pixels / 255'.format(
            args.mean, ', '.join('{:.6g}'.format(m) for m in mean))
    else:
        normalised = "ImageNet's mean and standard deviation"
    print('Input: {}; {}'.format(loader, normalised))
    print('Optimiser: lr {:g} ({}{}), momentum {:g}, weight decay {:g}, label smoothing {:g}, '
          'seed {}'.format(args.lr, args.schedule, ', {:g} warm-up epochs'.format(
              args.warmup_epochs) if args.warmup_epochs else '', args.momentum,
              args.weight_decay, args.label_smoothing, seed))
    print('')
    sys.stdout.flush()


def choose_seed(args, record):
    """(the seed, and how it was chosen): on resume the snapshot's (its shards, its orders;
    DALI adopts it anyway), else --seed, else drawn."""
    if 'seed' in record:
        seed = int(record['seed'])
        if args.seed is not None and args.seed != seed:
            return seed, "the snapshot's; --seed {} is not used when resuming".format(args.seed)
        return seed, "the snapshot's"
    if args.seed is not None:
        return args.seed, None
    seed = int(numpy.random.randint(2 ** 31))
    return seed, 'drawn' + ('; the snapshot records none' if args.resume else '')


def set_up(args):
    """Everything before ``trainer.run()``; raises UsageError for anything that cannot work."""
    if ARCHS[args.arch][1] == 'NHWC':
        args.nhwc = True                    # -a resnet50_nhwc: Chainer's example's NHWC model
    check_args(args)
    args.comm = make_communicator(args.communicator)
    device = get_device(args.device)
    if args.comm is not None and device.xp is not numpy:
        device = get_device('@cupy:{}'.format(args.comm.intra_rank))
    dtype = resolve_dtype(args)
    layout = 'NHWC' if args.nhwc else 'NCHW'
    mean, std = normalisation_of(args)
    facts = run_facts(args, mean, std)
    record = inspect_snapshot(args.resume, facts) if args.resume else {}
    seed, how = choose_seed(args, record)
    if args.comm is not None:               # one seed for all ranks: their shards of one order
        seed, how = args.comm.bcast_obj((seed, how) if args.comm.rank == 0 else None)
    numpy.random.seed(seed)                 # the initial weights
    # the data first: a bad list file is reported before minutes of model building
    train_iter, val_iter, converter, loader = make_iterators(args, device, layout, dtype, mean,
                                                             std, seed)
    try:
        model = make_model(args, layout)
        loaded = load_initmodel(args.initmodel, model, args, facts) if args.initmodel else None
        if args.multi_node_bn:          # a copy whose BatchNorm links reduce over the ranks
            model = multinode.create_mnbn_model(model, args.comm)
        model.to_device(device)
        device.use()
        epoch_size = getattr(train_iter, 'epoch_size', None) or len(train_iter.dataset)
        optimizer = make_optimizer(args, model, dtype)
        plots = _matplotlib()
        trainer = make_trainer(args, model, optimizer, train_iter, val_iter, converter, device,
                               epoch_size, plots, dict(facts, seed=seed))
        reporter = is_reporter(args)
        if reporter:
            describe(args, device, dtype, layout,
                     '{} ({})'.format(seed, how) if how else seed, loader, mean)
        if not plots and reporter:
            print('matplotlib is not installed: no loss.png or accuracy.png (pip install '
                  'matplotlib)')
        if loaded and reporter:
            print('Loaded the model from {} ({})'.format(args.initmodel, loaded))
        if args.resume:
            agreed(args.comm, lambda: resume(trainer, args.resume, args.comm))
            if reporter:
                print('Resumed from {} at iteration {}'.format(args.resume,
                                                              trainer.updater.iteration))
    except BaseException:
        train_iter.finalize()
        val_iter.finalize()
        raise
    return trainer, (train_iter, val_iter)


def agreed(comm, work):
    """``work()``, then with a communicator every rank learns whether any rank failed: a
    rank that goes on alone would wait forever in the first collective (a missing
    ``snapshot_iter_N.rank<k>`` on one rank). The failing rank raises its own error, the
    others a UsageError saying which rank failed."""
    error = None
    try:
        work()
    except UsageError as e:
        error = e
    if comm is not None:
        failed = comm.mpi_comm.allgather(error is not None)
        if error is None and any(failed):
            error = UsageError('rank {} could not set up (its message says why)'.format(
                failed.index(True)))
    if error is not None:
        raise error


def fail(message):
    sys.stdout.flush()
    sys.stderr.write('{}: error: {}\n'.format(PROG, message))
    return 2


def main(argv=None):
    args = make_parser().parse_args(argv)
    try:
        trainer, iterators = set_up(args)
    except UsageError as e:
        return fail(e)
    try:
        trainer.run(show_loop_exception_msg=False)     # what fails is reported once, below
    except (dataset_util.ImageError, dali.DatasetError) as e:
        return fail(e)          # an image that cannot be decoded: named, no traceback
    finally:
        for it in iterators:
            it.finalize()
    step = getattr(trainer.updater, 'step', None)
    if step is not None and is_reporter(args):
        print('Static graph: {} of {} steps replayed ({} eager: warm-up and tracing, and {} '
              'checks of the trace)'.format(step.replays, step.replays + step.eager_steps,
                                            step.eager_steps - step.checks, step.checks))
    return 0


if __name__ == '__main__':
    sys.exit(main())
