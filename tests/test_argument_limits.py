"""Arguments that used to be taken silently (issue 11, 'smaller'): pooling geometry beyond the
kernels' 32-bit ints, CHAINER_TC_KERNEL_DIR pointing elsewhere or nowhere, BatchNormalization's
eps=nan and integer running statistics, lazy NHWC links given NCHW data. NumPy and emulator paths
must refuse alike."""
import math
import warnings

import numpy
import pytest

import chainer_tc  # noqa: F401
import chainer

from chainer_tc import functions as TF
from chainer_tc import kernels
from chainer_tc import links as TL
from chainer_tc.errors import CompileError
from chainer_tc.links import _messages

BIG = 2 ** 31


@pytest.fixture(params=['numpy', 'emulator'])
def path(request, monkeypatch):
    if request.param == 'emulator':
        monkeypatch.setenv('CHAINER_TC_EMULATE', '1')
    else:
        monkeypatch.delenv('CHAINER_TC_EMULATE', raising=False)
    return request.param


# ---- pooling geometry -----------------------------------------------------------------------------

@pytest.mark.parametrize('kwargs,message', [
    # each wraps to a small int32 in the kernels' PoolShape (2**32 + 2 -> 2; 2**31 -> -2**31)
    (dict(ksize=2 ** 32 + 2, stride=1, pad=BIG), r'ksize must be at most 2\*\*31 - 1'),
    (dict(ksize=2, stride=2 ** 32 + 1), r'stride must be at most 2\*\*31 - 1'),
    (dict(ksize=2, stride=1, pad=BIG), r'pad must be at most 2\*\*31 - 1'),
    (dict(ksize=(1, BIG - 1), stride=1, pad=(0, BIG // 2)), r'ksize \(1, 2147483647\)|width'),
    (dict(ksize=(2 ** 16, 2 ** 16), stride=1, pad=2 ** 15), 'elements per window'),
    (dict(ksize=3, stride=1, pad=2 ** 30), r'height 4 with ksize 3, stride 1 and pad 1073741824 '
                                           r'spans 2147483652 padded positions'),
])
def test_pooling_geometry_beyond_int32_is_refused(path, kwargs, message):
    x = numpy.arange(16, dtype=numpy.float32).reshape(1, 4, 4, 1)
    for f in (TF.max_pooling_2d, TF.average_pooling_2d):
        with pytest.raises(ValueError, match=message):
            f(x, **kwargs)


def test_pooling_largest_geometry_still_runs(path):
    x = numpy.arange(16, dtype=numpy.float32).reshape(1, 4, 4, 1)
    y = TF.max_pooling_2d(x, 4, stride=BIG - 1)         # one window, a huge stride: fine
    assert y.shape == (1, 1, 1, 1) and y.array[0, 0, 0, 0] == 15


# ---- CHAINER_TC_KERNEL_DIR ------------------------------------------------------------------------

def test_missing_kernel_dir_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv('CHAINER_TC_KERNEL_DIR', str(tmp_path / 'nowhere'))
    for call in (kernels.families, lambda: kernels.source('layout')):
        with pytest.raises(FileNotFoundError,
                           match=r"CHAINER_TC_KERNEL_DIR='.*nowhere' is not a directory"):
            call()


def test_compile_error_names_the_real_file(monkeypatch, tmp_path):
    monkeypatch.setenv('CHAINER_TC_KERNEL_DIR', str(tmp_path))
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1')
    (tmp_path / 'oops.cu').write_text('extern "C" __global__ void k(int* x) {\n'
                                      '  x[0] = undeclared_thing;\n}\n')
    with pytest.raises(CompileError) as e:
        kernels.get_function('oops', 'k', numpy)
    message = str(e.value)
    assert '{}:2'.format(tmp_path / 'oops.cu') in message and 'undeclared_thing' in message
    assert 'kernels/oops.cu' not in message


def test_shipped_kernels_keep_their_short_names(monkeypatch):
    monkeypatch.delenv('CHAINER_TC_KERNEL_DIR', raising=False)
    assert kernels.source('pooling').startswith('#line 1 "kernels/pooling.cu"')


# ---- BatchNormalization arguments -----------------------------------------------------------------

def _bn_data(c=3):
    r = numpy.random.RandomState(0)
    return (r.randn(4, 2, 2, c).astype(numpy.float32), numpy.ones(c, numpy.float32),
            numpy.zeros(c, numpy.float32))


@pytest.mark.parametrize('eps', [math.nan, math.inf, -1e-5, 0.0])
def test_bn_eps_must_be_positive_and_finite(path, eps):
    x, gamma, beta = _bn_data()
    for call in (lambda: TF.batch_normalization(x, gamma, beta, eps=eps),
                 lambda: TF.fixed_batch_normalization(x, gamma, beta, beta, gamma, eps=eps),
                 lambda: TL.BatchNormalization(3, eps=eps),
                 lambda: TL.BatchNormAddReLU(3, eps=eps)):
        with pytest.raises(ValueError, match='eps must be positive and finite'):
            call()


@pytest.mark.parametrize('dtype', [numpy.int32, numpy.int64, numpy.uint8])
def test_bn_integer_running_statistics_are_refused(path, dtype):
    x, gamma, beta = _bn_data()
    mean, var = numpy.zeros(3, dtype), numpy.ones(3, dtype)
    with pytest.raises(TypeError, match='running_mean must be a floating-point array .*integers '
                                        'would truncate'):
        TF.batch_normalization(x, gamma, beta, running_mean=mean, running_var=var)
    assert mean.tolist() == [0, 0, 0]
    with pytest.raises(TypeError, match='running_var must be a floating-point array'):
        TF.batch_normalization(x, gamma, beta, running_mean=mean.astype(numpy.float32),
                               running_var=var)
    with pytest.raises(TypeError, match='dtype must be a floating-point type'):
        TL.BatchNormalization(3, dtype=dtype)


def test_bn_running_statistics_checks(path):
    x, gamma, beta = _bn_data()
    mean, var = numpy.zeros(3, numpy.float32), numpy.ones(3, numpy.float32)
    with pytest.raises(ValueError, match='running_mean and running_var go together'):
        TF.batch_normalization(x, gamma, beta, running_mean=mean)
    with pytest.raises(ValueError, match=r'running_var must have shape \(3,\)'):
        TF.batch_normalization(x, gamma, beta, running_mean=mean, running_var=var[:2])
    with pytest.raises(TypeError, match='running_mean is float32 and running_var float64'):
        TF.batch_normalization(x, gamma, beta, running_mean=mean,
                               running_var=var.astype(numpy.float64))
    with pytest.raises(ValueError, match=r'decay must be a number in \[0, 1\]'):
        TF.batch_normalization(x, gamma, beta, running_mean=mean, running_var=var,
                               decay=math.nan)


# ---- lazy NHWC links given NCHW data --------------------------------------------------------------

@pytest.mark.parametrize('make', [lambda: TL.Convolution2D(None, 4, 3, pad=1),
                                  lambda: TL.BatchNormalization(), lambda: TL.BatchNormAddReLU()])
def test_lazy_link_warns_when_its_first_input_looks_nchw(make):
    nchw = numpy.random.RandomState(0).randn(2, 3, 8, 8).astype(numpy.float32)
    link = make()
    with pytest.warns(TL.LayoutWarning, match=r'takes it from the last axis of its first '
                                                     r'input: 8 from shape \(2, 3, 8, 8\), which '
                                                     r'looks like NCHW'):
        link(nchw)
    link = make()
    with warnings.catch_warnings():
        warnings.simplefilter('error', TL.LayoutWarning)
        link(nchw.transpose(0, 2, 3, 1))                 # NHWC: no warning
        link(nchw.transpose(0, 2, 3, 1))


def test_sized_link_refuses_nchw_data():
    nchw = numpy.zeros((2, 3, 8, 8), numpy.float32)
    with pytest.raises(ValueError, match='looks like NCHW data'):
        TL.Convolution2D(3, 4, 3)(nchw)
    with chainer.using_config('train', True), pytest.raises(ValueError, match='looks like NCHW'):
        TL.BatchNormalization(3)(nchw)


@pytest.mark.parametrize('shape,nchw', [
    ((2, 3, 224, 224), True), ((2, 1, 28, 28), True), ((2, 224, 224, 3), False),
    ((2, 56, 56, 256), False), ((2, 7, 7, 2048), False), ((2, 3, 3, 2048), False),
    ((2, 8, 8, 8), False), ((2, 3, 4), False)])
def test_what_looks_nchw(shape, nchw):
    assert _messages.looks_nchw(shape) == nchw
