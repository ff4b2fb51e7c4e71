"""examples/imagenet/train_imagenet.py on the CPU: every valid combination of the technique flags
runs end to end on a tiny data set and writes its log, snapshots and plots; resuming gives the
bits of an uninterrupted run; invalid flags, files and devices fail with exit status 2 and a
message naming them; a crafted snapshot cannot run code; the checkpoints of this script and of
Chainer's example load with --initmodel; a short run on the demo's real images learns, in float32
and float16.

The script runs in this process (``main(argv)``) except where the command line itself is what is
tested (no traceback, CHAINER_DTYPE)."""
import contextlib
import itertools
import json
import os
import re
import subprocess
import sys
import warnings
import zipfile

import numpy
import pytest

import chainer_tc  # noqa: F401  (before chainer)
import chainer

from chainer_tc import serializers
from chainer_tc.multinode import multi_node_optimizer

import dali_data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, 'examples', 'imagenet')
sys.path.insert(0, EXAMPLE)

import dataset_util  # noqa: E402
import demo  # noqa: E402
import demo_data  # noqa: E402
import train_imagenet  # noqa: E402

SCRIPT = os.path.join(EXAMPLE, 'train_imagenet.py')
TINY = ['--width', '64', '--insize', '32', '-B', '4', '-b', '4', '--n-classes', '2',
        '--seed', '0', '-j', '0']


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    """12 images of 2 classes (JPEG and PNG, some grayscale, sizes 40-180) for training, 4 of
    them listed for validation."""
    data = dali_data.make_dataset(tmp_path_factory.mktemp('tiny'), n=12)
    val = dali_data.write_list(os.path.join(data.root, 'val.txt'), data.files[:4],
                               data.classes[:4])
    return data, val


def tiny_args(tiny, out, *flags):
    data, val = tiny
    return [str(a) for a in [data.classes_list, val, '-R', data.root, '-o', out] + TINY
            + list(flags)]


def run(argv, plots=True):
    """``main(argv)`` here: (exit status, stdout, stderr, warnings). chainer.config.dtype is
    restored afterwards (--dtype sets it)."""
    out, err = _Capture(), _Capture()
    saved = train_imagenet._matplotlib
    if not plots:
        train_imagenet._matplotlib = lambda: False
    try:
        with chainer.using_config('dtype', chainer.config.dtype), \
                warnings.catch_warnings(record=True) as caught, \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            warnings.simplefilter('always')
            try:
                status = train_imagenet.main([str(a) for a in argv])
            except SystemExit as e:         # argparse
                status = e.code
    finally:
        train_imagenet._matplotlib = saved
    return status, out.getvalue(), err.getvalue(), [str(w.message) for w in caught]


class _Capture(list):
    def write(self, s):
        self.append(s)

    def flush(self):
        pass

    def getvalue(self):
        return ''.join(self)


def log_of(out):
    with open(os.path.join(str(out), 'log')) as f:
        return json.load(f)


# ---- every valid combination --------------------------------------------------------------------

LAYOUTS = {'nchw': [], 'nhwc': ['--nhwc'], 'fused': ['--nhwc', '--fused-bn']}
UPDATES = {'chainer': [], 'batched': ['--batched-update'],
           'static': ['--batched-update', '--static-graph']}
INPUTS = {'pil': [], 'dali': ['--dali']}
DTYPES = {'fp32': [], 'fp16': ['--dtype', 'float16']}
SCALING = {'noscale': [], 'dynamic': ['--loss-scale', 'dynamic']}
COMBINATIONS = list(itertools.product(LAYOUTS, UPDATES, INPUTS, DTYPES, SCALING))


@pytest.mark.parametrize('layout,update,source,dtype,scaling', COMBINATIONS,
                         ids=['-'.join(c) for c in COMBINATIONS])
def test_every_valid_combination_trains_and_writes_log_and_snapshots(
        tiny, tmp_path, layout, update, source, dtype, scaling):
    flags = LAYOUTS[layout] + UPDATES[update] + INPUTS[source] + DTYPES[dtype] + SCALING[scaling]
    status, out, err, caught = run(tiny_args(tiny, tmp_path, '--iterations', 4, *flags),
                                   plots=False)
    assert status == 0, err
    assert 'Dtype: {}'.format('float16' if dtype == 'fp16' else 'float32') in out
    for flag in flags:
        if flag.startswith('--') and flag != '--dtype':
            assert flag in out.split('Techniques:')[1].splitlines()[0]
    entry = log_of(tmp_path)[-1]
    assert entry['iteration'] == 4 and numpy.isfinite(entry['main/loss'])
    assert 0 <= entry['validation/main/accuracy'] <= 1
    if scaling == 'dynamic':
        assert entry['loss_scale'] > 0
    for name in ('snapshot_iter_4', 'model_iter_4'):
        assert os.path.isfile(os.path.join(str(tmp_path), name))
    if update == 'static':
        assert 'Static graph: 1 of 4 steps replayed' in out
        assert not [w for w in caught if 'cannot be replayed' in w or 'cannot be captured' in w]


@pytest.mark.parametrize('arch,version,layout', [
    ('resnet50', '1', 'NCHW'), ('resnet50_v1.5', '1.5', 'NCHW'),
    ('resnet50_nhwc', '1', 'NHWC (-a resnet50_nhwc)')])
def test_architectures(tiny, tmp_path, arch, version, layout):
    flags = ['--fused-bn'] if arch == 'resnet50_nhwc' else []       # it implies --nhwc
    status, out, err, _ = run(tiny_args(tiny, tmp_path, '--iterations', 1, '-a', arch, *flags),
                              plots=False)
    assert status == 0, err
    assert 'Model: ResNet-50 v{} ('.format(version) in out
    assert '), {}, width/64, 32x32 input, 2 classes'.format(layout) in out


def test_worker_processes(tiny, tmp_path):
    """-j 2: MultiprocessIterator (Chainer's example's default loader), the crops drawn in the
    workers."""
    status, out, err, _ = run(tiny_args(tiny, tmp_path, '--iterations', 4, '-j', 2, '--nhwc',
                                        '--batched-update', '--static-graph'), plots=False)
    assert status == 0, err
    assert 'Input: PIL in 2 worker processes' in out
    assert log_of(tmp_path)[-1]['iteration'] == 4


PADDED = {
    'dali-static-fp16': ['--dali', '--nhwc', '--fused-bn', '--batched-update', '--static-graph',
                         '--dtype', 'float16', '--loss-scale', 'dynamic'],
    'pil-chainer': ['--nhwc'],
}


@pytest.mark.parametrize('name', sorted(PADDED))
@pytest.mark.parametrize('pad', [4, 8])
def test_pad_channels(tiny, tmp_path, name, pad):
    """--pad-channels: the DALI pipeline pads (the PIL input is padded by the model); conv1's
    filter has the extra input channels, zero after training; its file is the unpadded
    model's (3 input channels), and so is its optimizer state in the snapshot with chainer_tc's
    optimizer (Chainer's keeps the padded shape)."""
    flags = PADDED[name] + ['--pad-channels', pad]
    status, out, err, caught = run(tiny_args(tiny, tmp_path, '--iterations', 4, *flags),
                                   plots=False)
    assert status == 0, err
    assert '--pad-channels {}'.format(pad) in out.split('Techniques:')[1].splitlines()[0]
    if '--static-graph' in flags:
        assert 'Static graph: 1 of 4 steps replayed' in out
        assert not [w for w in caught if 'cannot be replayed' in w or 'cannot be captured' in w]
    assert numpy.isfinite(log_of(tmp_path)[-1]['main/loss'])
    model = serializers.read_npz(str(tmp_path / 'model_iter_4'))
    assert model['conv1/W'].shape == (1, 3, 7, 7)           # width 64: 1 filter
    snapshot = serializers.read_npz(str(tmp_path / 'snapshot_iter_4'))
    state = {k.rsplit('/', 1)[1]: a for k, a in snapshot.items()
             if k.startswith('updater/optimizer:main/predictor/conv1/W/') and a.ndim == 4}
    assert 'v' in state and ('master' in state) == ('float16' in flags)   # fp32 master weights
    for name, a in state.items():
        if '--batched-update' in flags:     # ours saves it as the filter: Chainer's, unpadded
            assert a.shape == (1, 3, 7, 7), name
        else:                               # Chainer's optimizer as it holds it
            assert a.shape == (1, 7, 7, pad) and not a[..., 3:].any(), name
    assert not [w for w in caught if 'padding channels' in w]       # they stayed zero


def test_pad_channels_initmodel_and_resume(tiny, tmp_path):
    """An unpadded run's model file starts a padded run (--initmodel: zeros appended), and its
    snapshot resumes one (weights and optimizer state are saved unpadded); a snapshot whose
    state has the padded shape (an earlier chainer_tc's) is refused by an unpadded run, named."""
    plain = tmp_path / 'plain'
    assert run(tiny_args(tiny, plain, '--iterations', 2, '--nhwc', '--batched-update'),
               plots=False)[0] == 0
    status, out, err, _ = run(tiny_args(tiny, tmp_path / 'init', '--iterations', 1, '--nhwc',
                                        '--pad-channels', 4, '--lr', '1e-30', '--initmodel',
                                        str(plain / 'model_iter_2')), plots=False)
    assert status == 0, err
    a = serializers.read_npz(str(plain / 'model_iter_2'))
    b = serializers.read_npz(str(tmp_path / 'init' / 'model_iter_1'))
    numpy.testing.assert_array_equal(a['conv1/W'], b['conv1/W'])
    status, out, err, _ = run(tiny_args(tiny, tmp_path / 'resumed', '--iterations', 4,
                                        '--nhwc', '--batched-update', '--pad-channels', 4,
                                        '-r', str(plain / 'snapshot_iter_2')), plots=False)
    assert status == 0, err
    resumed = serializers.read_npz(str(tmp_path / 'resumed' / 'model_iter_4'))
    assert resumed['conv1/W'].shape == (1, 3, 7, 7) and numpy.isfinite(resumed['conv1/W']).all()
    old = dict(serializers.read_npz(str(plain / 'snapshot_iter_2')))
    key = [k for k in old if k.endswith('predictor/conv1/W/v')][0]
    old[key] = numpy.zeros((1, 7, 7, 4), old[key].dtype)   # as an earlier chainer_tc saved it
    old.pop('updater/optimizer:main/filter_state_in_chainer_layout')
    numpy.savez(str(tmp_path / 'earlier.npz'), **old)
    status, out, err, _ = run(tiny_args(tiny, tmp_path / 'refused', '--iterations', 4,
                                        '--nhwc', '--batched-update',
                                        '-r', str(tmp_path / 'earlier.npz')), plots=False)
    assert status == 2
    assert re.search(r'does not match this run: updater/optimizer:main/\S*conv1/W/v has shape '
                     r'\(1, 7, 7, 4\) in the snapshot, \(1, 3, 7, 7\) here \(resume with the '
                     r'flags', err), err


@pytest.mark.parametrize('optimizer', [[], ['--batched-update']])
def test_static_loss_scale(tiny, tmp_path, optimizer):
    status, out, err, _ = run(tiny_args(tiny, tmp_path, '--iterations', 2, '--dtype', 'float16',
                                        '--loss-scale', '128', *optimizer), plots=False)
    assert status == 0, err
    assert log_of(tmp_path)[-1]['loss_scale'] == 128


def test_plots_in_out(tiny, tmp_path):
    status, out, err, _ = run(tiny_args(tiny, tmp_path, '--iterations', 4, '--log-interval', 2,
                                        '--nhwc', '--fused-bn', '--batched-update'))
    assert status == 0, err
    for name in ('loss.png', 'accuracy.png'):
        with open(os.path.join(str(tmp_path), name), 'rb') as f:
            assert f.read(8) == b'\x89PNG\r\n\x1a\n'
    assert [e['iteration'] for e in log_of(tmp_path)] == [2, 4]


def test_explicit_intervals_still_evaluate_snapshot_and_log_at_the_end(tiny, tmp_path):
    """--val-interval 2 --log-interval 2 in a run of 5 iterations: every 2 iterations, and at
    iteration 5, the end (as the default intervals do); the end used to be dropped."""
    status, out, err, _ = run(tiny_args(tiny, tmp_path, '--iterations', 5, '--val-interval', 2,
                                        '--log-interval', 2), plots=False)
    assert status == 0, err
    log = log_of(tmp_path)
    assert [e['iteration'] for e in log] == [2, 4, 5]
    assert all('validation/main/loss' in e for e in log)
    written = set(os.listdir(str(tmp_path)))
    assert {'snapshot_iter_{}'.format(i) for i in (2, 4, 5)} <= written
    assert {f for f in written if f.startswith('model_iter_')} == {
        'model_iter_2', 'model_iter_4', 'model_iter_5'}


def test_without_matplotlib_the_plots_are_skipped_with_a_notice(tiny, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, 'matplotlib', None)        # import matplotlib fails
    status, out, err, _ = run(tiny_args(tiny, tmp_path, '--iterations', 2))
    assert status == 0, err
    notices = [line for line in out.splitlines() if 'matplotlib' in line]
    assert notices == ['matplotlib is not installed: no loss.png or accuracy.png (pip install '
                       'matplotlib)']
    assert not [f for f in os.listdir(str(tmp_path)) if f.endswith('.png')]
    assert os.path.isfile(os.path.join(str(tmp_path), 'log'))


# ---- resume -------------------------------------------------------------------------------------

RESUMABLE = {
    'fp32-static': ['--nhwc', '--fused-bn', '--batched-update', '--static-graph'],
    'fp16-static-dynamic': ['--nhwc', '--fused-bn', '--batched-update', '--static-graph',
                            '--dtype', 'float16', '--loss-scale', 'dynamic'],
    'fp32-chainer-nchw': [],
}
RECIPE = ['--lr', '0.05', '--warmup-epochs', '1', '--schedule', 'cosine', '--weight-decay',
          '1e-4', '--label-smoothing', '0.1', '--iterations', '6', '--val-interval', '3']


def whole_and_resumed(tiny, tmp_path, flags, at):
    """A run with ``flags`` (in tmp_path/whole), and the same run resumed from its
    snapshot_iter_``at`` (in tmp_path/resumed), both ending well: (whole, resumed, the resumed
    run's output)."""
    whole, resumed = tmp_path / 'whole', tmp_path / 'resumed'
    status, out, err, _ = run(tiny_args(tiny, whole, *flags), plots=False)
    assert status == 0, err
    status, out, err, _ = run(tiny_args(tiny, resumed, *flags)
                              + ['--resume', str(whole / 'snapshot_iter_{}'.format(at))],
                              plots=False)
    assert status == 0, err
    return whole, resumed, out


@pytest.mark.parametrize('name', sorted(RESUMABLE))
def test_resumed_run_ends_with_the_bits_of_an_uninterrupted_one(tiny, tmp_path, name):
    whole, resumed, out = whole_and_resumed(tiny, tmp_path, RECIPE + RESUMABLE[name], 3)
    assert 'Resumed from {} at iteration 3'.format(whole / 'snapshot_iter_3') in out
    a = serializers.read_npz(str(whole / 'snapshot_iter_6'))
    b = serializers.read_npz(str(resumed / 'snapshot_iter_6'))
    state = [k for k in a if k.startswith('updater/')]
    assert any('/predictor/fc/W' in k for k in state) and any('rng_keys' in k for k in state)
    for key in state:
        assert a[key].dtype == b[key].dtype and numpy.array_equal(a[key], b[key]), key
    assert log_of(whole)[-1]['main/loss'] == log_of(resumed)[-1]['main/loss']
    assert log_of(whole)[-1]['lr'] == log_of(resumed)[-1]['lr']


def test_resumed_run_writes_the_files_of_the_uninterrupted_one(tiny, tmp_path):
    """A run resumed from snapshot_iter_3 writes snapshot_iter_6 and model_iter_6, as the
    uninterrupted run did after iteration 3: no model_iter_4 (the snapshot was written before
    the model file's trigger had seen iteration 3, so it fired again at the first iteration)."""
    whole, resumed, _ = whole_and_resumed(tiny, tmp_path, ['--iterations', 6], 3)
    written = sorted(f for f in os.listdir(str(whole)) if f.endswith('_6')) + ['log']
    assert sorted(os.listdir(str(resumed))) == sorted(written)
    assert [e['iteration'] for e in log_of(resumed)] == [3, 6]


def test_dali_run_resumes_where_it_stopped(tiny, tmp_path):
    """DALI's random crops are not in the snapshot (docs/dali.md): the order is, so the run goes
    on from the same position, with other crops."""
    flags = ['--dali', '--nhwc', '--fused-bn', '--batched-update', '--static-graph', '--dtype',
             'float16', '--loss-scale', 'dynamic', '--iterations', '6', '--val-interval', '3']
    whole, resumed, _ = whole_and_resumed(tiny, tmp_path, flags, 3)
    a = serializers.read_npz(str(whole / 'snapshot_iter_6'))
    b = serializers.read_npz(str(resumed / 'snapshot_iter_6'))
    for key in ('updater/iterator:main/epoch', 'updater/iterator:main/current_position',
                'updater/iteration'):
        assert a[key] == b[key], key
    assert [e['iteration'] for e in log_of(resumed)] == [3, 6]


def test_worker_processes_resume_with_the_orders_of_the_uninterrupted_run(tiny, tmp_path):
    """-j 1: the shuffled order of every epoch after a resume is the uninterrupted run's (the
    crops are the workers' own). Resumed in the middle of epoch 1, the order drawn for epoch 2
    was another: ShuffleOrderSampler's random state is not in MultiprocessIterator's snapshot."""
    flags = ['-j', '1', '--iterations', '6', '--val-interval', '2']
    whole, resumed, _ = whole_and_resumed(tiny, tmp_path, flags, 4)
    key = 'updater/iterator:main/order'
    orders = [serializers.read_npz(str(d / 'snapshot_iter_6'))[key] for d in (whole, resumed)]
    assert serializers.read_npz(str(whole / 'snapshot_iter_6'))['updater/iterator:main/epoch'] \
        == 2
    numpy.testing.assert_array_equal(*orders)
    first = serializers.read_npz(str(whole / 'snapshot_iter_2'))[key]
    assert not numpy.array_equal(first, orders[0])          # a new order every epoch


def test_crafted_snapshot_cannot_run_code(tiny, tmp_path):
    """A snapshot whose object array would create a marker file when unpickled (as Chainer's
    own load_npz would) is refused by --resume, and the marker never appears."""
    good = tmp_path / 'good'
    assert run(tiny_args(tiny, good, '--iterations', 2, '--batched-update'), plots=False)[0] == 0
    marker = tmp_path / 'marker'
    crafted = tmp_path / 'crafted'
    key = 'updater/optimizer:main/t'
    with zipfile.ZipFile(str(good / 'snapshot_iter_2')) as z, \
            zipfile.ZipFile(str(crafted), 'w') as w:
        for item in z.namelist():
            if item == key + '.npy':
                w.writestr(item, _npy_bytes(numpy.array([_Marker(str(marker))], dtype=object)))
            else:
                w.writestr(item, z.read(item))
    status, out, err, _ = run(tiny_args(tiny, tmp_path / 'out', '--iterations', 4,
                                        '--batched-update', '-r', str(crafted)), plots=False)
    assert status == 2
    assert "refusing to load '{}'".format(key) in err and 'object array' in err
    assert not marker.exists()
    numpy.load(str(crafted), allow_pickle=True)[key]      # the file is what it claims to be:
    assert marker.exists()                                # unpickling it runs the code


class _Marker:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, 'w'))


def _npy_bytes(array):
    import io
    f = io.BytesIO()
    numpy.save(f, array, allow_pickle=True)
    return f.getvalue()


@pytest.mark.parametrize('made,resumed,message', [
    (['--dali'], [], r"does not match this run: the snapshot's input is DALI \(--dali\), this "
                     r"run's PIL in this process \(-j 0\) \(resume with the flags"),
    (['--width', '32'], [], r'does not match this run: updater/model:main/predictor/\S+ has '
                            r'shape \(2,\) in the snapshot, \(1,\) here \(resume with'),
])
def test_resume_from_another_configuration_is_refused(tiny, tmp_path, made, resumed, message):
    assert run(tiny_args(tiny, tmp_path / 'a', '--iterations', 2, *made), plots=False)[0] == 0
    status, out, err, _ = run(tiny_args(tiny, tmp_path / 'b', '--iterations', 2, *resumed)
                              + ['-r', str(tmp_path / 'a' / 'snapshot_iter_2')], plots=False)
    assert status == 2
    assert re.search(message, err), err


@pytest.mark.parametrize('made,resumed', [
    (['--nhwc', '--pad-channels', '4'], []), ([], ['--nhwc', '--pad-channels', '8'])],
    ids=['nhwc-padded-to-nchw', 'nchw-to-nhwc-padded'])
def test_chainer_optimizer_resumes_across_layout_and_padding(tiny, tmp_path, made, resumed):
    """Chainer's MomentumSGD (no --batched-update) saves its momentum v in the parameter's shape:
    channels-last and padded with --nhwc --pad-channels. A run of another layout or padding
    turns it into its own, as the filters are (its first update used to fail on the shapes).
    With an lr of 1e-30 the resumed update is v <- 0.9 v: the file's v, moved."""
    a, b = tmp_path / 'a', tmp_path / 'b'
    assert run(tiny_args(tiny, a, '--iterations', 2, *made), plots=False)[0] == 0
    status, out, err, _ = run(tiny_args(tiny, b, '--iterations', 3, '--lr', '1e-30', *resumed)
                              + ['-r', str(a / 'snapshot_iter_2')], plots=False)
    assert status == 0, err
    key = 'updater/optimizer:main/predictor/conv1/W/v'
    before = serializers.read_npz(str(a / 'snapshot_iter_2'))[key]
    after = serializers.read_npz(str(b / 'snapshot_iter_3'))[key]
    if made:                                # (out, kh, kw, 4) -> (out, 3, kh, kw)
        assert before.shape == (1, 7, 7, 4) and after.shape == (1, 3, 7, 7)
        expected = before[..., :3].transpose(0, 3, 1, 2)
    else:                                   # (out, 3, kh, kw) -> (out, kh, kw, 8)
        assert before.shape == (1, 3, 7, 7) and after.shape == (1, 7, 7, 8)
        assert not after[..., 3:].any()
        expected, after = before.transpose(0, 2, 3, 1), after[..., :3]
    assert numpy.abs(expected).max() > 0
    numpy.testing.assert_allclose(after, 0.9 * expected, rtol=1e-6, atol=1e-30)


def test_files_record_the_architecture_and_normalisation(tiny, tmp_path):
    """Snapshots and model files of -a resnet50_v1.5 and -a resnet50 have the same arrays: the
    file records the architecture and the input normalisation, and a run of another one, or
    with another --mean, refuses it (it loaded without a word). A file without the record (an
    earlier version's) loads as before."""
    a = tmp_path / 'a'
    assert run(tiny_args(tiny, a, '--iterations', 2), plots=False)[0] == 0
    mean = tmp_path / 'mean.npy'
    numpy.save(str(mean), numpy.full(3, 120.0))
    refused = [
        (['-a', 'resnet50', '-r', a / 'snapshot_iter_2'],
         r"--resume/-r '.*snapshot_iter_2' holds a ResNet-50 v1\.5 \(-a resnet50_v1\.5\); this "
         r'run is -a resnet50, a ResNet-50 v1: .* Use -a resnet50_v1\.5'),
        (['-a', 'resnet50', '--initmodel', a / 'model_iter_2'],
         r"--initmodel '.*model_iter_2' holds a ResNet-50 v1\.5"),
        (['-a', 'resnet50_nhwc', '--initmodel', a / 'snapshot_iter_2'],
         r"--initmodel '.*snapshot_iter_2' holds a ResNet-50 v1\.5"),
        (['-m', mean, '-r', a / 'snapshot_iter_2'],
         r"was trained on images normalised with mean \(123\.675, 116\.28, 103\.53\) and std "
         r'\(58\.395, 57\.12, 57\.375\) per channel .* this run normalises with mean '
         r'\(120, 120, 120\) and std \(255, 255, 255\)'),
    ]
    for flags, message in refused:
        status, out, err, _ = run(tiny_args(tiny, tmp_path / 'b', '--iterations', 3, *flags),
                                  plots=False)
        assert status == 2, flags
        assert re.search(message, err), err
        assert 'Traceback' not in err
    model = serializers.read_npz(str(a / 'model_iter_2'))
    assert str(model['run/resnet50_version']) == '1.5' and model['run/mean'].shape == (3,)
    earlier = tmp_path / 'earlier.npz'
    numpy.savez(str(earlier), **{k: v for k, v in model.items() if not k.startswith('run/')})
    status, out, err, _ = run(tiny_args(tiny, tmp_path / 'c', '--iterations', 1, '-a',
                                        'resnet50', '--initmodel', earlier), plots=False)
    assert status == 0, err


def _chainer_example_snapshot(path):
    """A Trainer snapshot as Chainer's example writes it: its ResNet50's names."""
    from chainer import training
    from chainer.training import extensions
    from test_chainer_example import ExampleLikeResNet50
    model = chainer.links.Classifier(ExampleLikeResNet50(64, 2))
    r = numpy.random.RandomState(0)
    data = [(r.randn(3, 32, 32).astype(numpy.float32), numpy.int32(i % 2)) for i in range(4)]
    opt = chainer.optimizers.MomentumSGD()
    opt.setup(model)
    updater = training.updaters.StandardUpdater(chainer.iterators.SerialIterator(data, 2), opt)
    trainer = training.Trainer(updater, (1, 'iteration'), out=os.path.dirname(path))
    trainer.extend(extensions.snapshot(filename=os.path.basename(path)),
                   trigger=(1, 'iteration'))
    trainer.run()


def test_resume_from_what_is_not_this_scripts_snapshot_says_what_it_is(tiny, tmp_path):
    """-r given a model file (use --initmodel), a snapshot of another input, or a snapshot of
    Chainer's example: one message saying what the file is and what to do (it said
    "'<key>' is not in '<file>' is missing (resume with the flags ...)")."""
    a = tmp_path / 'a'
    assert run(tiny_args(tiny, a, '--iterations', 2), plots=False)[0] == 0
    chainers = str(tmp_path / 'chainer_snapshot')
    _chainer_example_snapshot(chainers)
    cases = [
        ([a / 'model_iter_2'], r"--resume/-r '.*model_iter_2' is a model file \(this script's "
                               r'ResNet-50\), not a Trainer snapshot: .* use --initmodel '),
        ([a / 'snapshot_iter_2', '--dali'],
         r"--resume/-r '.*snapshot_iter_2' does not match this run: the snapshot's input is "
         r"PIL in this process \(-j 0\), this run's DALI \(--dali\) \(resume with the flags "
         r'the snapshot was made with\)'),
        ([chainers], r"--resume/-r '.*chainer_snapshot' is a Trainer snapshot of Chainer's "
                     r'example .* use --initmodel .*chainer_snapshot -a resnet50'),
    ]
    for flags, message in cases:
        status, out, err, _ = run(tiny_args(tiny, tmp_path / 'b', '--iterations', 3, '-r',
                                            *flags), plots=False)
        assert status == 2, flags
        assert re.search(message, err), err
        assert 'is not in' not in err and 'is missing' not in err and 'Traceback' not in err


# ---- --initmodel --------------------------------------------------------------------------------

def test_initmodel_loads_this_scripts_model_files(tiny, tmp_path):
    assert run(tiny_args(tiny, tmp_path / 'a', '--iterations', 2, '--nhwc'),
               plots=False)[0] == 0
    saved = tmp_path / 'a' / 'model_iter_2'
    # an NCHW model from the NHWC run's file; lr so small that nothing moves
    status, out, err, _ = run(tiny_args(tiny, tmp_path / 'b', '--iterations', 1, '--lr', '1e-30',
                                        '--initmodel', str(saved)), plots=False)
    assert status == 0, err
    assert 'Loaded the model from {} (chainer_tc ResNet50)'.format(saved) in out
    a = serializers.read_npz(str(saved))
    b = serializers.read_npz(str(tmp_path / 'b' / 'model_iter_1'))
    weights = [k for k in a if k.endswith('/W')]
    assert len(weights) == 54
    for key in weights:
        numpy.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_initmodel_loads_chainer_examples_checkpoints(tiny, tmp_path):
    from chainer.serializers import save_npz
    from test_chainer_example import ExampleLikeResNet50
    path = str(tmp_path / 'example_model.npz')
    save_npz(path, ExampleLikeResNet50(16, 7))
    common = ['--iterations', 1, '--width', 16, '--n-classes', 7, '--initmodel', path]
    status, out, err, _ = run(tiny_args(tiny, tmp_path / 'a', '-a', 'resnet50', *common),
                              plots=False)
    assert status == 0, err
    assert "(Chainer's example's ResNet50)" in out
    status, out, err, _ = run(tiny_args(tiny, tmp_path / 'b', *common), plots=False)
    assert status == 2
    assert "checkpoint of Chainer's example's ResNet50 (v1): train it with -a resnet50" in err
    status, out, err, _ = run(tiny_args(tiny, tmp_path / 'c', '-a', 'resnet50', '--width', 16,
                                        '--initmodel', path), plots=False)
    assert status == 2
    assert 'does not fit this model (resnet50, --width 16, --n-classes 2)' in err


def test_initmodel_that_is_not_a_model(tiny, tmp_path):
    bad = tmp_path / 'bad.npz'
    numpy.savez(str(bad), something=numpy.zeros(3))
    status, _, err, _ = run(tiny_args(tiny, tmp_path, '--initmodel', bad), plots=False)
    assert status == 2 and 'holds no ResNet-50' in err
    (tmp_path / 'text').write_text('not a zip')
    status, _, err, _ = run(tiny_args(tiny, tmp_path, '--initmodel', tmp_path / 'text'),
                            plots=False)
    assert status == 2 and 'is not a valid .npz file' in err


# ---- errors -------------------------------------------------------------------------------------

FLAG_ERRORS = [
    (['--fused-bn'], '--fused-bn needs --nhwc'),
    (['--pad-channels', '4'], '--pad-channels 4 needs --nhwc'),
    (['--nhwc', '--pad-channels', '5'], r"argument --pad-channels: invalid choice: 5 \(choose "
                                        r"from 3, 4, 8\)"),
    (['--static-graph'], '--static-graph needs --batched-update'),
    (['--multi-node-bn'], '--multi-node-bn needs --communicator'),
    (['--nhwc', '--static-graph'], '--static-graph needs --batched-update'),
    (['--dali', '--dtype', 'float64'], '--dali needs --dtype float16 or float32'),
    (['--width', '3'], '--width must divide 64'),
    (['--insize', '16'], '--insize must be at least 32'),
    (['--momentum', '1'], r"argument --momentum: expected a number in \[0, 1\); got '1'"),
    (['--label-smoothing', '-0.1'], r'argument --label-smoothing: expected a number in \[0, 1\)'),
    (['--iterations', '4', '--warmup-epochs', '2'], r'--warmup-epochs 2.0 is not shorter than '
                                                    r'the run \(1\.33333 epochs\)'),
    (['--loss-scale', 'sometimes'], "argument --loss-scale: expected 'dynamic' or a positive "
                                    "number"),
    (['--loss-scale', '0'], "argument --loss-scale: expected 'dynamic' or a positive number"),
    (['-B', '0'], r'argument --batchsize/-B: expected a positive integer'),
    (['--lr', '0'], r'argument --lr: expected a number in \(0'),
    (['-a', 'nin'], r"argument --arch/-a: invalid choice: 'nin'"),
    (['-j', '-1'], r'argument --loaderjob/-j: expected an integer >= 0'),
    (['--device', 'native:0'], r"--device/-d 'native:0' is not a device here: .*ChainerX"),
    (['--device', '@intel64'], r"--device/-d '@intel64' is not a device here"),
    (['--device', '@cupy:63'], r"--device/-d '@cupy:63': there is no CUDA GPU 63 on this "
                               r"machine"),
    (['--root', '/nonexistent'], r"--root/-R '/nonexistent' does not exist"),
    (['--resume', '/nonexistent'], r"--resume/-r '/nonexistent' does not exist"),
    (['--initmodel', '/nonexistent'], r"--initmodel '/nonexistent' does not exist"),
    (['--mean', '/nonexistent'], r"--mean/-m '/nonexistent' does not exist"),
]


@pytest.mark.parametrize('flags,message', FLAG_ERRORS, ids=[' '.join(f) for f, _ in FLAG_ERRORS])
def test_flags_that_cannot_work_exit_2_naming_the_flag(tiny, tmp_path, flags, message):
    status, out, err, _ = run(tiny_args(tiny, tmp_path, *flags), plots=False)
    assert status == 2
    assert re.search(message, err), err
    assert 'Traceback' not in err
    assert not os.path.exists(str(tmp_path / 'log'))


def test_an_output_directory_that_cannot_be_written_is_refused_before_training(tiny, tmp_path):
    """-o naming a file, or a directory under a file, or one that cannot be written in: exit
    status 2 naming it, before training (it failed at the first log write, with a
    traceback)."""
    afile = tmp_path / 'afile'
    afile.write_text('')
    cases = [(afile, r"--out/-o '.*afile' is a file, not a directory"),
             (afile / 'sub', r"--out/-o '.*afile/sub' cannot be created: '.*afile' is a file")]
    if os.geteuid() != 0:               # root writes anywhere
        locked = tmp_path / 'locked'
        locked.mkdir(mode=0o500)
        cases.append((locked, r"--out/-o '.*locked': cannot write in it"))
    for out, message in cases:
        status, stdout, err, _ = run(tiny_args(tiny, tmp_path / 'unused', '--iterations', 1)
                                     + ['-o', out], plots=False)
        assert status == 2, (out, err)
        assert re.search(message, err), err
        assert 'Traceback' not in err and 'Techniques:' not in stdout


def test_no_gpu_device_here(tiny, tmp_path):
    if _gpus():
        pytest.skip('this machine has a gpu: the no-gpu error cannot be shown')
    status, _, err, _ = run(tiny_args(tiny, tmp_path, '-d', '0'), plots=False)
    assert status == 2
    assert "--device/-d '0': there is no CUDA GPU 0 on this machine" in err


def _gpus():
    try:
        return chainer.backends.cuda.cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def test_mean_file(tiny, tmp_path):
    mean = tmp_path / 'mean.npy'
    numpy.save(str(mean), numpy.full((3, 8, 8), 120, numpy.float32))
    status, _, err, _ = run(tiny_args(tiny, tmp_path, '--iterations', 1, '-m', mean),
                            plots=False)
    assert status == 0, err
    numpy.save(str(mean), numpy.full(3, 0.45))
    status, _, err, _ = run(tiny_args(tiny, tmp_path, '-m', mean), plots=False)
    assert status == 2 and err.startswith('train_imagenet.py: error: --mean/-m: mean is on the '
                                          '0-255 scale')


def _bad_lists(tiny, directory):
    data, _ = tiny
    first = data.files[0]
    lists = {
        'no label': ('{} 0\n{}\n'.format(first, first), r":2: '.*' has no label"),
        'not an integer': ('{} zero\n'.format(first), r":1: label 'zero' is not an integer"),
        'out of range': ('{} 0\n{} 5\n'.format(first, first),
                         r':2: label 5 is out of range 0..1 \(num_classes=2\)'),
        'empty': ('\n', r'the list is empty'),
        'missing image': ('{} 0\nnothing/here.jpg 1\n'.format(first),
                          r'nothing/here.jpg: image file does not exist'),
    }
    out = []
    for name, (text, message) in lists.items():
        path = os.path.join(str(directory), name.replace(' ', '_') + '.txt')
        with open(path, 'w') as f:
            f.write(text)
        out.append((name, path, message))
    return out


@pytest.mark.parametrize('source', ['pil', 'dali'])
@pytest.mark.parametrize('which', ['train', 'val'])
def test_bad_list_files_are_named_with_the_line(tiny, tmp_path, source, which):
    data, val = tiny
    cases = _bad_lists(tiny, tmp_path) + [('missing list', str(tmp_path / 'none.txt'),
                                           r"list_file '.*none.txt' does not exist")]
    for name, path, message in cases:
        lists = [path, val] if which == 'train' else [data.classes_list, path]
        argv = lists + ['-R', data.root, '-o', str(tmp_path / 'out')] + TINY + INPUTS[source]
        status, out, err, _ = run(argv, plots=False)
        assert status == 2, name
        assert err.startswith("train_imagenet.py: error: {} list '{}'".format(which, path)), err
        assert re.search(message, err), (name, err)


@pytest.mark.parametrize('source', ['pil', 'dali'])
def test_an_image_that_does_not_decode_is_named(tiny, tmp_path, source):
    data, val = tiny
    fake = tmp_path / 'fake.jpg'
    fake.write_text('<html>not an image</html>')
    good = ''.join('{} {}\n'.format(os.path.join(data.root, f), c)
                   for f, c in zip(data.files[:3], data.classes))
    (tmp_path / 'train.txt').write_text(good + '{} 1\n'.format(fake))    # one batch of 4
    (tmp_path / 'val.txt').write_text(good)
    status, out, err, _ = run([tmp_path / 'train.txt', tmp_path / 'val.txt', '-R', '/', '-o',
                               tmp_path / 'out'] + TINY + ['--iterations', 2] + INPUTS[source],
                              plots=False)
    assert status == 2
    assert str(fake) in err and 'Traceback' not in err


@pytest.mark.parametrize('which', ['train', 'val'])
def test_worker_processes_name_an_image_that_does_not_decode(tiny, tmp_path, which):
    """-j 1 (MultiprocessIterator): a corrupt JPEG stops the run with exit status 2 naming it,
    as -j 0 does, whether a worker process reads it or the iterator itself (its first batch, to
    measure the examples). Reading raised there: a worker's error killed the iterator's
    prefetch thread and the run waited forever ('Stalled dataset'); in the first batch, the
    iterator failed on None with a traceback. A real command line, so that a hang is a
    timeout."""
    data, val = tiny
    bad = str(tmp_path / 'corrupt.jpg')
    dali_data.corrupt(os.path.join(data.root, data.files[0]), bad)
    files = [os.path.join(data.root, f) for f in data.files]
    labels = list(data.classes)
    if which == 'train':        # in the second batch of the first epoch: read by a worker
        at = int(dataset_util.ChainedOrderSampler(0)(numpy.arange(len(files) + 1), 0)[4])
        train = dali_data.write_list(tmp_path / 'train.txt', files[:at] + [bad] + files[at:],
                                     labels[:at] + [1] + labels[at:])
        lists = [train, val]
    else:                       # the first batch: read by the iterator itself (it measures)
        lists = [data.classes_list, dali_data.write_list(tmp_path / 'val.txt', files[:3] + [bad],
                                                         labels[:3] + [1])]
    argv = lists + ['-R', data.root, '-o', str(tmp_path / 'out')] + TINY[:-2] + [
        '-j', '1', '--iterations', '4']
    p = subprocess.run([sys.executable, SCRIPT] + argv, capture_output=True, text=True,
                       timeout=90)
    assert p.returncode == 2, p.stderr[-3000:]
    assert 'Traceback' not in p.stderr
    assert re.search(r'error: {}: cannot decode the image listed at \S+:{}:'.format(
        re.escape(bad), at + 1 if which == 'train' else 4), p.stderr), p.stderr


def test_the_command_line_reports_errors_without_a_traceback(tiny, tmp_path):
    data, val = tiny
    bad = tmp_path / 'bad.txt'
    bad.write_text('{} 0\n{}\n'.format(data.files[0], data.files[1]))
    p = subprocess.run([sys.executable, SCRIPT, str(bad), val, '-R', data.root, '-o',
                        str(tmp_path / 'out')] + TINY, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2
    assert 'Traceback' not in p.stderr
    assert p.stderr.startswith("train_imagenet.py: error: train list '{}': 1 problem(s) in the "
                               "data set:\n  {}:2: ".format(bad, bad)), p.stderr


def test_chainer_dtype_environment_variable_sets_the_precision(tiny, tmp_path):
    env = dict(os.environ, CHAINER_DTYPE='float16')
    p = subprocess.run([sys.executable, SCRIPT] + tiny_args(tiny, tmp_path, '--iterations', 1,
                                                            '--nhwc', '--fused-bn', '-g', '-1'),
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    assert 'Device: @numpy' in p.stdout and 'Dtype: float16' in p.stdout


def test_the_configuration_printed_is_the_one_in_use(tiny, tmp_path):
    """The set-up printed says what the run uses: on resume without --seed, the snapshot's seed
    (a fresh one was printed); with -m, the mean file (nothing said so); under
    CHAINER_DTYPE=mixed16, mixed16 and what it means (it printed float16)."""
    data, val = tiny
    no_seed = [str(a) for a in [data.classes_list, val, '-R', data.root] + TINY[:-4] + ['-j', 0]]
    a = tmp_path / 'a'
    assert run(no_seed + ['-o', a, '--iterations', 2, '--seed', 7], plots=False)[0] == 0
    status, out, err, _ = run(no_seed + ['-o', tmp_path / 'b', '--iterations', 3,
                                         '-r', a / 'snapshot_iter_2'], plots=False)
    assert status == 0, err
    assert "seed 7 (the snapshot's)" in out
    mean = tmp_path / 'mean.npy'
    numpy.save(str(mean), numpy.full(3, 120.0))
    with chainer.using_config('dtype', chainer.mixed16):
        status, out, err, _ = run(tiny_args(tiny, tmp_path / 'c', '--iterations', 1, '-m', mean),
                                  plots=False)
    assert status == 0, err
    assert "Input: PIL in this process; mean file {} (channel means 120, 120, 120), pixels / " \
        "255".format(mean) in out
    assert "Dtype: mixed16 (float16, with BatchNormalization's parameters and statistics in " \
        'float32)' in out
    model = serializers.read_npz(str(tmp_path / 'c' / 'model_iter_1'))
    assert model['conv1/W'].dtype == numpy.float16
    assert model['bn1/gamma'].dtype == model['bn1/avg_mean'].dtype == numpy.float32
    status, out, err, _ = run(tiny_args(tiny, tmp_path / 'd', '--iterations', 1), plots=False)
    assert "Input: PIL in this process; ImageNet's mean and standard deviation" in out


MPIEXEC = os.path.join(os.path.dirname(sys.executable), 'mpiexec')


@pytest.mark.skipif(not os.path.exists(MPIEXEC), reason='no mpiexec (pip install -e .[mpi])')
def test_under_mpi_rank_0_says_the_communicator_and_alone_what_it_loaded(tiny, tmp_path):
    """mpiexec -n 2 --communicator naive: the set-up names the communicator, the processes and
    the global batch; 'Loaded the model from' and 'Resumed from' are printed once, by rank 0
    (every rank printed them); a snapshot of the first iteration resumes."""
    def mpirun(out, *flags):
        p = subprocess.run([MPIEXEC, '--allow-run-as-root', '--oversubscribe', '-n', '2',
                            sys.executable, SCRIPT] + tiny_args(tiny, out, '--communicator',
                                                                'naive', *flags),
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        return p.stdout

    out = mpirun(tmp_path / 'a', '--iterations', 1)
    assert out.count('Communicator: naive, 2 processes (ranks)\n') == 1
    assert out.count('# Minibatch-size: 4 per process, 8 in all\n') == 1
    # after one iteration ChainerMN's multi-node optimizer has only broadcast the model: the
    # snapshot holds no momentum, which Chainer's optimizer refused as missing
    out = mpirun(tmp_path / 'b', '--iterations', 2, '--initmodel',
                 tmp_path / 'a' / 'model_iter_1', '-r', tmp_path / 'a' / 'snapshot_iter_1')
    assert out.count('Loaded the model from') == 1 and out.count('Resumed from') == 1


# ---- pieces -------------------------------------------------------------------------------------

class _PackingInConfigDtype:
    """A one-rank stand-in for ChainerMN's pure_nccl communicator: ``bcast_data`` packs every
    parameter in ``chainer.get_dtype()`` and unpacks it (pure_nccl_communicator.py), recording
    that dtype; the mean of the gradients over one rank is the gradient."""

    size, rank, intra_rank = 1, 0, 0

    def __init__(self):
        self.packed = []

    def bcast_data(self, model):
        packed = chainer.get_dtype()
        self.packed.append(packed)
        for p in model.params():
            if p.array is not None:
                p.array[...] = p.array.astype(packed).astype(p.array.dtype)

    def multi_node_mean_grad(self, model, zero_fill=False):
        pass


@pytest.mark.parametrize('flags, config_dtype', [
    (['--nhwc'], numpy.float16),                 # NHWC: float32 BatchNorm under float16
    (['--batched-update', '--loss-scale', 'dynamic'], chainer.mixed16)],
    ids=['chainer-float16-nhwc', 'batched-mixed16'])
def test_the_chainermn_wrapper_path_broadcasts_the_float16_model_exactly(flags, config_dtype):
    """``--communicator`` without ``--static-graph``: ChainerMN's multi-node optimizer, whose
    first update broadcasts rank 0's model; with pure_nccl under --dtype float16 ChainerMN's own
    broadcast rounded the float32 parameters (BatchNorm's, the classifier's) to float16 on every
    rank. make_optimizer's wrapper broadcasts with dtype float32: every parameter keeps its
    bits. Found by review."""
    args = train_imagenet.make_parser().parse_args(['train.txt', 'val.txt'] + TINY + flags)
    args.comm = comm = _PackingInConfigDtype()
    layout = 'NHWC' if args.nhwc else 'NCHW'
    r = numpy.random.RandomState(0)
    with chainer.using_config('dtype', config_dtype):
        model = train_imagenet.make_model(args, layout)
        float32 = [n for n, p in model.namedparams() if p.array.dtype == numpy.float32]
        assert any('/fc/' in n for n in float32) and any(n.endswith('/gamma') for n in float32)
        for name, p in model.namedparams():
            if p.array.dtype == numpy.float32:          # no float16 number (BN's gamma is 1)
                p.array[...] += r.uniform(1e-3, 2e-3, p.shape).astype(numpy.float32)
        start = {n: p.array.copy() for n, p in model.namedparams()}
        opt = train_imagenet.make_optimizer(args, model, numpy.dtype(numpy.float16))
        shape = (2, 32, 32, 3) if layout == 'NHWC' else (2, 3, 32, 32)
        opt.update(model, r.randn(*shape).astype(numpy.float16),
                   r.randint(0, 2, 2).astype(numpy.int32))
        assert chainer.config.dtype is config_dtype
    for name, p in model.namedparams():
        numpy.testing.assert_array_equal(p.array, start[name], err_msg=name)
        if name in float32:
            assert not numpy.array_equal(start[name].astype(numpy.float16).astype(numpy.float32),
                                         start[name]), name + ' holds float16 numbers'
    assert comm.packed == [numpy.float32]
    assert isinstance(opt.communicator, multi_node_optimizer.ExactBroadcast)


def test_the_help_says_what_the_flags_do(tiny, tmp_path):
    """--loss-scale: Chainer's dynamic scale doubles every step until the first overflow (the
    help said every 1000 steps), as the log shows; --warmup-epochs starts from lr / (warm-up
    iterations), not 0; the intervals end with the run whatever N."""
    text = ' '.join(train_imagenet.make_parser().format_help().split())
    assert "otherwise Chainer's (dynamic: from 1, doubled every step until the first " \
        'overflow, then x2^(1/1000) per step; not in snapshots)' in text
    assert 'iteration by iteration from --lr / (warm-up iterations) to --lr' in text
    assert text.count('and at the end of the run, whatever N') == 2
    status, out, err, _ = run(tiny_args(tiny, tmp_path, '--iterations', 3, '--log-interval', 1,
                                        '--loss-scale', 'dynamic'), plots=False)
    assert status == 0, err
    assert [e['loss_scale'] for e in log_of(tmp_path)] == [2, 4, 8]


def test_learning_rate_schedules():
    lr = train_imagenet.LearningRate
    warm = lr(0.4, 'constant', 2, 10, 0.25)
    assert [warm.lr_at(e) for e in (0, 0.25, 1.75, 2, 9)] == [0.05, 0.1, 0.4, 0.4, 0.4]
    step = lr(1.0, 'step', 0, 90, 0.01)
    assert [step.lr_at(e) for e in (0, 29.99, 30, 59.99, 60, 80, 89.99)] == pytest.approx(
        [1, 1, 0.1, 0.1, 0.01, 0.001, 0.001])
    cosine = lr(1.0, 'cosine', 1, 11, 0.1)
    assert cosine.lr_at(1) == 1.0 and cosine.lr_at(6) == pytest.approx(0.5)
    assert cosine.lr_at(11) == pytest.approx(0.0, abs=1e-15)


def test_label_smoothing_loss():
    r = numpy.random.RandomState(0)
    y = r.randn(5, 4).astype(numpy.float32)
    t = r.randint(0, 4, 5).astype(numpy.int32)
    eps = 0.1
    target = numpy.full((5, 4), eps / 4)
    target[numpy.arange(5), t] += 1 - eps
    logp = y - numpy.log(numpy.exp(y).sum(1, keepdims=True))
    expected = -(target * logp).sum(1).mean()
    got = train_imagenet.smoothed_cross_entropy(eps)(y, t)
    assert float(got.array) == pytest.approx(expected, rel=1e-6)


def test_pil_validation_images_match_dali_s(tiny):
    """The input without --dali is DALI's validation transform: at most 1 grey level apart (both
    resize with an antialiased triangle filter and round to uint8; same geometry)."""
    from chainer_tc import dali
    data, val = tiny
    mean, std = numpy.array(dali.IMAGENET_MEAN) * 255, numpy.array(dali.IMAGENET_STD) * 255
    ours = dataset_util.ImageListDataset(data.root, data.classes_list, 48, False, mean=mean,
                                         std=std)
    it = dali.DaliIterator(dali.imagenet_pipeline(data.root, data.classes_list, train=False,
                                                  crop=48, device='cpu', dtype=numpy.float32),
                           12, repeat=False)
    x, t = next(it)
    it.finalize()
    mine = numpy.stack([ours[i][0] for i in range(12)])
    assert mine.shape == x.shape == (12, 48, 48, 3)
    numpy.testing.assert_array_equal(t, [ours[i][1] for i in range(12)])
    levels = numpy.abs(mine - x) * std            # grey levels
    assert levels.max() < 1.001 and levels.mean() < 0.3


def test_pil_training_images(tiny):
    data, _ = tiny
    rng = numpy.random.RandomState(0)
    ds = dataset_util.ImageListDataset(data.root, data.classes_list, 32, True, rng=rng,
                                       layout='NCHW', dtype=numpy.float16)
    x, t = ds[3]                                    # a grayscale image
    assert x.shape == (3, 32, 32) and x.dtype == numpy.float16 and t.dtype == numpy.int32
    again = dataset_util.ImageListDataset(data.root, data.classes_list, 32, True,
                                          rng=numpy.random.RandomState(0), layout='NCHW',
                                          dtype=numpy.float16)
    numpy.testing.assert_array_equal(again[3][0], x)        # the same draws, the same crop
    assert not numpy.array_equal(ds[3][0], x)               # the next draw, another crop


@pytest.mark.gpu
@pytest.mark.parametrize('pad', [[], ['--pad-channels', 4]])
def test_every_technique_on_the_gpu(cudnn_stack, dali_stack, tiny, tmp_path, pad):
    """The fast path: DALI's mixed pipeline, the captured step, float16 with loss scaling; and
    the same with the images padded to 4 channels by DALI."""
    flags = ['--iterations', 6, '-d', '@cupy:0', '--dali', '--nhwc', '--fused-bn',
             '--batched-update', '--static-graph', '--dtype', 'float16', '--loss-scale',
             'dynamic'] + pad
    status, out, err, caught = run(tiny_args(tiny, tmp_path, *flags), plots=False)
    assert status == 0, err
    assert 'Device: @cupy:0' in out and 'Input: DALI, GPU pipeline' in out
    assert 'Static graph: 4 of 6 steps replayed' in out        # warm-up, record, then the graph
    assert not [w for w in caught if 'cannot be replayed' in w or 'cannot be captured' in w]
    entry = log_of(tmp_path)[-1]
    assert numpy.isfinite(entry['main/loss']) and entry['loss_scale'] > 0


# ---- it learns ----------------------------------------------------------------------------------

@pytest.fixture(scope='module')
def real(tmp_path_factory):
    return demo_data.make(str(tmp_path_factory.mktemp('real')))


@pytest.mark.parametrize('dtype', ['float32', 'float16'])
def test_learns_real_images_better_than_chance(real, tmp_path, dtype):
    """The demo's configuration (every technique on), shortened: 12 epochs at width/16 and
    48x48 instead of 20 at width/8 and 64x64."""
    argv = demo.train_args(real, str(tmp_path), epochs=12, dtype=dtype, width=16, insize=48)
    status, out, err, _ = run(argv, plots=False)
    assert status == 0, err
    passed, line = demo.verdict(str(tmp_path / 'log'), len(real.classes))
    assert passed, line
    assert log_of(tmp_path)[-1]['validation/main/accuracy'] >= 0.5     # chance: 1/6
