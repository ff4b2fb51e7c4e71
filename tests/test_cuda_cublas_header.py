"""chainer_tc.cuda.cublas's prototypes and constants against cuBLAS 12's own header
(``cublas_api.h`` from the nvidia-cublas-cu12 wheel, installed with the test extras): a ctypes
binding has no compiler to catch a parameter out of order or an ``int`` where the C function
takes ``long long``."""
import ctypes
import importlib
import os
import re

import pytest

from chainer_tc.cuda import cublas


def _header():
    # cuBLAS 12's wheel (the test extras) keeps it in nvidia/cublas/include; CUDA 13's wheels
    # (a lent GPU machine's image) in nvidia/cu13/include: the binding runs on both
    roots = []
    for package in ('nvidia.cublas', 'nvidia.cu13'):
        try:
            roots += list(importlib.import_module(package).__path__)
        except ImportError:
            pass
    if not roots:
        pytest.skip('no cuBLAS wheel (nvidia-cublas-cu12 or CUDA 13\'s) to read cublas_api.h '
                    'from', allow_module_level=True)
    for root in roots:
        path = os.path.join(root, 'include', 'cublas_api.h')
        if os.path.isfile(path):
            with open(path) as f:
                return re.sub(r'/\*.*?\*/|//[^\n]*', ' ', f.read(), flags=re.S)
    raise AssertionError('cublas_api.h not found in the cuBLAS wheel at %s' % roots)


HEADER = _header()

# what each C parameter type is passed as
_KINDS = {ctypes.c_void_p: 'pointer', ctypes.c_int: 'int', ctypes.c_size_t: 'size_t',
          ctypes.c_longlong: 'int64'}


def _c_kind(c_type):
    t = ' '.join(c_type.replace('const', ' ').split())
    if '*' in t or t in ('cublasHandle_t', 'cudaStream_t'):
        return 'pointer'
    if t == 'size_t':
        return 'size_t'
    if t in ('long long int', 'long long', 'int64_t'):
        return 'int64'
    if t in ('int', 'cudaDataType', 'cudaDataType_t') or (t.startswith('cublas') and
                                                            t.endswith('_t')):
        return 'int'
    raise AssertionError('unexpected C type {!r}'.format(c_type))


def _declaration(name):
    m = re.search(r'CUBLASAPI\s+(cublasStatus_t|const\s+char\s*\*)\s*CUBLASWINAPI\s+' + name +
                  r'\s*\(([^;]*?)\)\s*;', HEADER)
    assert m, '{} is not declared in cublas_api.h'.format(name)
    params = [re.match(r'(.*?)(\w+)\s*$', p.strip()).groups() for p in m.group(2).split(',')
              if p.strip() not in ('', 'void')]
    return ' '.join(m.group(1).split()), [(t.strip(), n) for t, n in params]


@pytest.mark.parametrize('name', sorted(cublas.PROTOTYPES))
def test_prototype_matches_the_c_header(name):
    restype, params = _declaration(name)
    assert restype == 'cublasStatus_t'
    ours = cublas.PROTOTYPES[name]
    assert [n for n, _ in ours] == [n for _, n in params], 'parameter names, in order'
    kinds = ['pointer' if isinstance(t, type) and issubclass(t, ctypes._Pointer) else _KINDS[t]
             for _, t in ours]
    assert kinds == [_c_kind(t) for t, _ in params]


def test_the_status_string_function_matches_the_c_header():
    restype, params = _declaration(cublas.STATUS_STRING)
    assert restype.replace(' ', '') == 'constchar*'
    assert [t for t, _ in params] == ['cublasStatus_t']


@pytest.mark.parametrize('ours,c_name', [
    ('OP_N', 'CUBLAS_OP_N'), ('OP_T', 'CUBLAS_OP_T'),
    ('COMPUTE_32F', 'CUBLAS_COMPUTE_32F'), ('COMPUTE_32F_PEDANTIC', 'CUBLAS_COMPUTE_32F_PEDANTIC'),
    ('COMPUTE_32F_FAST_TF32', 'CUBLAS_COMPUTE_32F_FAST_TF32'),
    ('COMPUTE_64F', 'CUBLAS_COMPUTE_64F'),
    ('COMPUTE_64F_PEDANTIC', 'CUBLAS_COMPUTE_64F_PEDANTIC'),
    ('GEMM_DEFAULT', 'CUBLAS_GEMM_DEFAULT'),
    ('GEMM_DEFAULT_TENSOR_OP', 'CUBLAS_GEMM_DEFAULT_TENSOR_OP')])
def test_constants_match_the_c_header(ours, c_name):
    m = re.search(r'\b' + c_name + r'\s*=\s*(-?\d+)', HEADER)
    assert m, c_name
    assert getattr(cublas, ours) == int(m.group(1))
