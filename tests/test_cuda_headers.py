"""chainer_tc.cuda_headers: NVRTC finds cuda_fp16.h in every CUDA install we know of.

Found missing on a GPU machine with CuPy 14 / CUDA 13 wheels: every kernel failed to compile with
"could not open source file cuda_fp16.h" because only the CUDA 12 locations were searched.
"""
import os

from chainer_tc import cuda_headers
from chainer_tc import kernels


def header_dir(root, *parts, cudart=None):
    d = os.path.join(str(root), *parts)
    os.makedirs(d, exist_ok=True)
    open(os.path.join(d, 'cuda_fp16.h'), 'w').close()
    if cudart is not None:
        with open(os.path.join(d, 'cuda_runtime_api.h'), 'w') as f:
            f.write('#pragma once\n#define CUDART_VERSION {}\n'.format(cudart))
    return d


def test_cuda13_wheel_layout_is_found(tmp_path):
    site = tmp_path / 'site'
    d = header_dir(site, 'nvidia', 'cu13', 'include', cudart=13020)
    assert cuda_headers.include_dirs(13, path=[str(site)], environ={}) == [d]
    assert cuda_headers.include_dirs(None, path=[str(site)], environ={}) == [d]


def test_the_header_made_for_nvrtc_major_wins_over_an_earlier_one(tmp_path):
    site = tmp_path / 'site'
    c12 = header_dir(site, 'nvidia', 'cuda_runtime', 'include', cudart=12080)
    c13 = header_dir(site, 'cupy', '_core', 'include', 'cupy', '_cuda', 'cuda-13')
    header_dir(site, 'cupy', '_core', 'include', 'cupy', '_cuda', 'cuda-12')
    assert cuda_headers.include_dirs(12, path=[str(site)], environ={}) == [c12]
    assert cuda_headers.include_dirs(13, path=[str(site)], environ={}) == [c13]
    # no header made for NVRTC 14: the first found rather than none
    assert cuda_headers.include_dirs(14, path=[str(site)], environ={}) == [c12]


def test_a_toolkit_from_the_environment(tmp_path):
    toolkit = tmp_path / 'cuda'
    d = header_dir(toolkit, 'include', cudart=13000)
    assert cuda_headers.include_dirs(13, path=[], environ={'CUDA_PATH': str(toolkit)}) == [d]
    assert cuda_headers.include_dirs(13, path=[], environ={'CUDA_HOME': str(toolkit)}) == [d]


def test_major_of_reads_cudart_version_before_the_path(tmp_path):
    d = header_dir(tmp_path, 'cuda-11', cudart=12040)
    assert cuda_headers.major_of(d) == 12
    assert cuda_headers.major_of(header_dir(tmp_path, 'x', 'cuda-13')) == 13
    assert cuda_headers.major_of(header_dir(tmp_path, 'nvidia', 'cu12', 'include')) == 12
    assert cuda_headers.major_of(header_dir(tmp_path, 'plain', 'include')) is None


def test_nothing_found_is_an_empty_list(tmp_path):
    assert cuda_headers.include_dirs(12, path=[str(tmp_path)], environ={}, toolkit=None) == []
    assert cuda_headers.include_dirs(12, path=[str(tmp_path)],
                                     environ={'CUDA_PATH': str(tmp_path / 'none')},
                                     toolkit=str(tmp_path / 'cuda')) == []
    d = header_dir(tmp_path, 'cuda', 'include')
    assert cuda_headers.include_dirs(12, path=[], environ={}, toolkit=str(tmp_path / 'cuda')) == [d]


def test_versions_order_numerically_and_a_parent_directory_does_not_count(tmp_path):
    site = tmp_path / 'cu7' / 'site'            # a parent named like a version: not the header's
    c9 = header_dir(site, 'nvidia', 'cu9', 'include')
    c13 = header_dir(site, 'nvidia', 'cu13', 'include')
    assert cuda_headers.include_dirs(None, path=[str(site)], environ={}, toolkit=None) == [c13]
    assert cuda_headers.major_of(c9) == 9 and cuda_headers.major_of(c13) == 13
    assert cuda_headers.major_of(header_dir(tmp_path / 'cu7', 'plain', 'include')) is None


def test_versioned_toolkits_beside_the_default_one(tmp_path):
    base = str(tmp_path / 'cuda')
    old = header_dir(tmp_path, 'cuda-11.8', 'include')
    new = header_dir(tmp_path, 'cuda-12.4', 'include')
    assert cuda_headers.include_dirs(None, path=[], environ={}, toolkit=base) == [new]
    assert cuda_headers.include_dirs(11, path=[], environ={}, toolkit=base) == [old]


def test_the_loader_finds_a_header_for_its_nvrtc():
    from chainer_tc import _cubin
    dirs = kernels.cuda_include_dirs()
    assert len(dirs) == 1 and os.path.isfile(os.path.join(dirs[0], 'cuda_fp16.h'))
    major = _cubin.nvrtc_version()[0]
    made_for = [d for d in cuda_headers.candidates()
                if os.path.isfile(os.path.join(d, 'cuda_fp16.h'))
                and cuda_headers.major_of(d) == major]
    # the set-up installs NVRTC 12 with the CUDA 12 runtime wheel's headers: one made for it
    assert made_for, 'no CUDA {} headers among {}'.format(major, cuda_headers.candidates())
    assert dirs == made_for[:1]
