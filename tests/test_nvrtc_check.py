"""Every kernel compiles with NVRTC 12 for sm_70/80/90, without a GPU, and spills nothing."""
import json
import subprocess
import sys
import time

import pytest

from chainer_tc import kernels
from chainer_tc import nvrtc_check
from chainer_tc.errors import CompileError
from chainer_tc.testing import emulator
from conftest import cuda_source


@pytest.fixture(scope='module')
def rows():
    return nvrtc_check.check()


def test_every_kernel_compiles_for_every_arch_without_spills(rows):
    assert {r['arch'] for r in rows} == set(nvrtc_check.ARCHS)
    for family in kernels.families():
        entries = set(emulator.entry_points(kernels.source(family)))
        for arch in nvrtc_check.ARCHS:
            got = {r['kernel'] for r in rows if r['arch'] == arch and r['file'].endswith(family + '.cu')}
            assert entries <= got, (family, arch, entries - got)
    spills = [r for r in rows if r['spill_stores'] or r['spill_loads']]
    assert not spills, spills
    for r in rows:
        assert set(r) == set(nvrtc_check.FIELDS)
        assert 0 < r['registers'] <= 255


def test_layout_kernels_use_the_documented_shared_tile(rows):
    # LAYOUT_TILE x (LAYOUT_TILE + 1) floats
    for r in rows:
        if r['kernel'].startswith('batched_transpose_'):
            assert r['shared_bytes'] == 32 * 33 * 4


def test_emulator_selftest_kernels_are_valid_cuda():
    with open(cuda_source('selftest.cu')) as f:
        code = f.read()
    _, log = nvrtc_check.compile_source(code, 'tests/cuda/selftest.cu', 'sm_70')
    assert 'warp_sum' in nvrtc_check.parse_ptxas_log(log)


def test_parse_ptxas_log():
    log = ("ptxas info    : Compiling entry function 'k' for 'sm_80'\n"
           "ptxas info    : Function properties for k\n"
           "ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 70 registers, used 1 barriers, 4224 bytes smem, 380 bytes cmem[0]\n")
    assert nvrtc_check.parse_ptxas_log(log) == {
        'k': {'registers': 70, 'spill_stores': 8, 'spill_loads': 4, 'shared_bytes': 4224}}


def test_compile_error_exits_nonzero_with_the_log_and_file(tmp_path, monkeypatch, capsys):
    (tmp_path / 'broken.cu').write_text(
        'extern "C" __global__ void k(float* x) {\n  x[0] = not_declared;\n}\n')
    monkeypatch.setenv('CHAINER_TC_KERNEL_DIR', str(tmp_path))
    with pytest.raises(CompileError, match=r'broken.cu for sm_70'):
        nvrtc_check.check(archs=('sm_70',))
    assert nvrtc_check.main(['--arch', 'sm_70']) == 1
    err = capsys.readouterr().err
    assert 'broken.cu' in err and 'not_declared' in err and 'identifier' in err


def test_spilling_kernel_exits_2(tmp_path, monkeypatch, capsys):
    # 64 live float4 accumulators under a 32-register cap: ptxas must spill
    (tmp_path / 'spills.cu').write_text('''
extern "C" __global__ void __launch_bounds__(1024, 2) heavy(const float4* x, float4* y, int n) {
  float4 acc[64];
  #pragma unroll
  for (int j = 0; j < 64; ++j) acc[j] = x[(threadIdx.x + j * 97) % n];
  #pragma unroll
  for (int k = 0; k < 8; ++k)
    #pragma unroll
    for (int j = 0; j < 64; ++j) { acc[j].x = acc[j].x * acc[(j + k) % 64].y + acc[j].w; }
  float4 s = acc[0];
  #pragma unroll
  for (int j = 1; j < 64; ++j) { s.x += acc[j].x; s.y += acc[j].y; s.z += acc[j].z; s.w += acc[j].w; }
  y[threadIdx.x] = s;
}
''')
    monkeypatch.setenv('CHAINER_TC_KERNEL_DIR', str(tmp_path))
    assert nvrtc_check.main(['--arch', 'sm_80']) == 2
    assert 'register spills in: heavy (sm_80)' in capsys.readouterr().err


def test_cli_json():
    out = subprocess.run([sys.executable, '-m', 'chainer_tc', 'kernels', '--json', '--arch', 'sm_90'],
                         capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    assert rows and all(r['arch'] == 'sm_90' for r in rows)
    assert all(list(r) == list(nvrtc_check.FIELDS) for r in rows)


def test_the_report_cache_keys_on_nvrtcs_build_and_the_headers(monkeypatch):
    """A patch release of NVRTC, another build of one minor version, or an upgraded
    cuda_fp16.h compiles differently: the registers and spills reported must not come from an
    older build's cache entry (the key used to hold only major.minor)."""
    from chainer_tc import _cubin
    code = ('extern "C" __global__ void k(float* x) { x[threadIdx.x] *= 2.0f; }  // '
            + str(time.time_ns()))             # a source no earlier run cached
    compiled = []
    real = _cubin.compile_program

    def counting(*args, **kwargs):
        compiled.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(_cubin, 'compile_program', counting)
    nvrtc_check.compile_source(code, 'probe.cu', 'sm_70')
    nvrtc_check.compile_source(code, 'probe.cu', 'sm_70')
    assert len(compiled) == 1, 'cached'
    monkeypatch.setattr(_cubin, 'nvrtc_identity', lambda: '12.9 another build')
    nvrtc_check.compile_source(code, 'probe.cu', 'sm_70')
    assert len(compiled) == 2
    monkeypatch.setattr(_cubin, 'include_fingerprint', lambda options: 'a newer cuda_fp16.h')
    nvrtc_check.compile_source(code, 'probe.cu', 'sm_70')
    assert len(compiled) == 3
