"""The GPU path's own cubin cache (chainer_tc._cubin): NVRTC runs once per binary, not once per
process, templates (name_expressions) included. Everything up to loading into a CUDA context is
tested here with NVRTC 12 and no GPU; the loading itself is marked gpu."""
import hashlib
import json
import os
import re
import subprocess
import sys

import numpy
import pytest

from chainer_tc import _cache
from chainer_tc import _cubin
from chainer_tc import kernels
from chainer_tc.errors import CompileError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a templated family (explicit instantiations, loaded by name expressions) plus an extern "C" one
TEMPLATED = r'''// kernels/scaled.cu: scale<T>(x, a, n): x[:n] *= a; launch (n / 64 + 1,), (64,)
template <typename T>
__global__ void scale(T* x, T a, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= a;
}
template __global__ void scale<float>(float*, float, int);
template __global__ void scale<double>(double*, double, int);
extern "C" __global__ void fill(int* x) { x[threadIdx.x] = VALUE; }
'''
NAMES = ('scale<float>', 'scale<double>')
OPTS = ('-DVALUE=7', '--std=c++17', '-arch=sm_80')
ZERO = dict(nvrtc_compiles=0, cache_hits=0, modules_loaded=0, function_lookups=0)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh per-user cache and zeroed counters."""
    root = tmp_path / 'cache'
    monkeypatch.setenv('CHAINER_TC_CACHE_DIR', str(root))
    _cubin.reset_counters()
    return root


def entry_files(root):
    d = root / _cubin.KIND
    return sorted(p for p in d.iterdir() if not p.name.startswith('.')) if d.is_dir() else []


def run_python(code, **env):
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, **env))
    assert out.returncode == 0, out.stderr
    return out.stdout


# -- what to compile for ------------------------------------------------------------------------

NVRTC_12_9 = (50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 89, 90, 100, 101, 103, 120, 121)
NVRTC_12_4 = (50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 89, 90)
NVRTC_13 = (75, 80, 86, 87, 88, 89, 90, 100, 103, 110, 120, 121)


@pytest.mark.parametrize('cc, supported, use_ptx, expect', [
    ('90', NVRTC_12_9, False, ('-arch=sm_90', 'cubin')),     # the device's own arch, as CuPy
    (70, NVRTC_12_9, False, ('-arch=sm_70', 'cubin')),
    ('90', NVRTC_12_9, True, ('-arch=compute_90', 'ptx')),   # CUPY_COMPILE_WITH_PTX=1, as CuPy
    (100, NVRTC_12_4, False, ('-arch=compute_90', 'ptx')),   # NVRTC older than the device
    (120, NVRTC_12_4, False, ('-arch=compute_90', 'ptx')),
    (92, NVRTC_12_9, False, ('-arch=sm_90', 'cubin')),       # same major: a 9.0 cubin runs on 9.2
    (88, NVRTC_12_9, False, ('-arch=sm_86', 'cubin')),       # never Tegra's 8.7 for another part
    (87, NVRTC_12_9, False, ('-arch=sm_87', 'cubin')),       # Tegra gets its own
    (90, NVRTC_13, False, ('-arch=sm_90', 'cubin')),
])
def test_arch_option(cc, supported, use_ptx, expect):
    assert _cubin.arch_option(cc, supported, use_ptx) == expect


def test_arch_nvrtc_cannot_target_is_an_error():
    # CUDA 13's NVRTC no longer compiles for Volta
    with pytest.raises(CompileError, match=r'compute capability 7\.0.*sm_75 to sm_121'):
        _cubin.arch_option(70, NVRTC_13)


def test_device_arch_uses_this_nvrtc_and_cupy_compile_with_ptx(monkeypatch):
    monkeypatch.setattr(_cubin, '_memo', {})
    monkeypatch.delenv('CUPY_COMPILE_WITH_PTX', raising=False)
    assert _cubin.device_arch('80') == ('-arch=sm_80', 'cubin')
    monkeypatch.setenv('CUPY_COMPILE_WITH_PTX', '1')
    assert _cubin.device_arch('80') == ('-arch=compute_80', 'ptx')


def test_compile_options_are_cupys():
    opts = _cubin.compile_options(('-DX=1', '--std=c++17', '-I/somewhere'), '-arch=sm_90')
    assert opts.count('-DX=1') == 1 and '-I/somewhere' in opts
    assert [o for o in opts if 'std=' in o] == ['--std=c++17'], 'CuPy adds no second standard'
    assert '-ftz=true' in opts, 'CuPy always flushes float32 subnormals'
    assert opts.count('-arch=sm_90') == 1
    assert '--device-as-default-execution-space' in opts    # NVRTC 12 and later, as CuPy
    assert any(o.startswith('-I') and o.endswith(os.path.join('cupy', '_core', 'include'))
               for o in opts), 'CuPy\'s own headers are on the path'
    assert '--device-debug' not in opts


def test_compile_options_debug_switch(monkeypatch):
    monkeypatch.setenv('CUPY_CUDA_COMPILE_WITH_DEBUG', '1')
    opts = _cubin.compile_options(('--std=c++17',), '-arch=sm_90')
    assert '--device-debug' in opts and '--generate-line-info' in opts


# -- the key ------------------------------------------------------------------------------------

def test_key_changes_with_every_input(tmp_path, monkeypatch):
    include = tmp_path / 'include'
    include.mkdir()
    (include / 'cuda_fp16.h').write_text('// v1\n')
    monkeypatch.setattr(_cubin, '_memo', {})
    base = dict(code=TEMPLATED, name='kernels/scaled.cu',
                options=OPTS + ('-I' + str(include),), name_expressions=NAMES, target='cubin')
    key = _cubin.cache_key(**base)
    assert key == _cubin.cache_key(**base)
    variants = [dict(code=TEMPLATED + '\n'), dict(name='kernels/other.cu'),
                dict(options=('-DVALUE=8',) + base['options'][1:]),
                dict(options=base['options'][:2] + ('-arch=sm_90',) + base['options'][3:]),
                dict(name_expressions=NAMES[:1]), dict(name_expressions=NAMES[::-1]),
                dict(target='ptx')]
    keys = {_cubin.cache_key(**dict(base, **v)) for v in variants}
    assert key not in keys and len(keys) == len(variants)

    monkeypatch.setattr(_cubin, 'FORMAT', _cubin.FORMAT + 1)
    assert _cubin.cache_key(**base) != key
    monkeypatch.setattr(_cubin, 'FORMAT', _cubin.FORMAT - 1)
    monkeypatch.setattr(_cubin, 'nvrtc_identity', lambda: '13.0\n/usr/lib/libnvrtc.so.13 1 2')
    assert _cubin.cache_key(**base) != key
    monkeypatch.undo()

    # an upgraded header in an include directory changes the key (once the process looks again)
    monkeypatch.setattr(_cubin, '_memo', {})
    (include / 'cuda_fp16.h').write_text('// version 2\n')
    assert _cubin.cache_key(**base) != key


def test_key_is_stable_across_processes():
    args = dict(code='extern "C" __global__ void k() {}', name='kernels/k.cu',
                options=('--std=c++17', '-arch=sm_80'), name_expressions=('k',), target='cubin')
    code = 'from chainer_tc import _cubin; print(_cubin.cache_key(**{!r}))'.format(args)
    first, second = run_python(code), run_python(code)
    assert first.strip() == second.strip() == _cubin.cache_key(**args)


def test_nvrtc_identity_names_version_and_library():
    major, minor = _cubin.nvrtc_version()
    version, library = _cubin.nvrtc_identity().split('\n')
    assert version == '{}.{}'.format(major, minor)
    assert 'libnvrtc.so' in library


# -- compiling ----------------------------------------------------------------------------------

def test_compile_returns_cubin_and_lowered_names(cache):
    program = _cubin.compile_program(TEMPLATED, 'kernels/scaled.cu', OPTS, NAMES)
    assert program.binary[:4] == b'\x7fELF'
    assert set(program.lowered) == set(NAMES)
    assert program.lowered['scale<float>'] == '_Z5scaleIfEvPT_S0_i'
    assert program.lowered['scale<double>'] == '_Z5scaleIdEvPT_S0_i'
    assert _cubin.counters() == dict(ZERO, nvrtc_compiles=1)


def _elf_is_complete(binary):
    """True when the ELF header's program and section header tables (e_phoff + e_phnum *
    e_phentsize, e_shoff + e_shnum * e_shentsize) and every section's bytes lie inside
    ``binary`` (NVRTC's cubins end with the program headers: CuPy's copy cuts the last one)."""
    import struct
    phoff, shoff = struct.unpack_from('<QQ', binary, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from('<HHHH', binary, 0x36)
    if max(phoff + phnum * phentsize, shoff + shnum * shentsize) > len(binary):
        return False
    for k in range(shnum):
        kind, = struct.unpack_from('<I', binary, shoff + k * shentsize + 4)
        offset, size = struct.unpack_from('<QQ', binary, shoff + k * shentsize + 0x18)
        if kind != 8 and offset + size > len(binary):       # 8: SHT_NOBITS, no bytes in the file
            return False
    return True


def test_cubin_is_the_whole_binary(cache):
    # CuPy 13's nvrtc.getCUBIN drops the last byte (nvdisasm then rejects the ELF); the size
    # NVRTC itself reports for the same program is what compile_program must return
    import ctypes
    lib = _cubin.nvrtc()
    options = [o for o in OPTS]
    prog = lib.createProgram(TEMPLATED, 'scaled.cu', [], [])
    try:
        lib.compileProgram(prog, options)
        size = ctypes.c_size_t()
        handle, _ = _cubin._loaded_nvrtc()
        assert handle.nvrtcGetCUBINSize(ctypes.c_void_p(prog), ctypes.byref(size)) == 0
        full = _cubin._full_cubin(prog, lib.getCUBIN(prog))
    finally:
        lib.destroyProgram(prog)
    assert len(full) == size.value and _elf_is_complete(full)
    binary = _cubin.compile_program(TEMPLATED, 'kernels/scaled.cu', OPTS, NAMES).binary
    assert len(binary) == size.value and _elf_is_complete(binary)
    assert not _elf_is_complete(binary[:-1])                # the check sees CuPy's truncation


def test_cubin_without_the_ctypes_route_warns_once(cache, monkeypatch):
    monkeypatch.setitem(_cubin._memo, 'nvrtc-ctypes', (None, 'no libnvrtc.so* is mapped'))
    monkeypatch.setattr(_cubin, '_warned', set())
    with pytest.warns(RuntimeWarning, match='could not read the whole cubin.*no libnvrtc'):
        first = _cubin.compile_program(TEMPLATED, 'kernels/scaled.cu', OPTS, NAMES).binary
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        second = _cubin.compile_program(TEMPLATED, 'kernels/scaled.cu', OPTS, NAMES).binary
    assert first == second and first[:4] == b'\x7fELF'     # CuPy's bytes, still loadable


def test_compile_to_ptx(cache):
    ptx = _cubin.compile_program(TEMPLATED, 'kernels/scaled.cu',
                                 OPTS[:2] + ('-arch=compute_80',), NAMES, target='ptx').binary
    assert b'.target sm_80' in ptx and b'_Z5scaleIfEvPT_S0_i' in ptx and b'fill' in ptx


def test_compile_error_names_the_file_and_stores_nothing(cache):
    code = 'extern "C" __global__ void k(float* x) {\n  x[0] = not_declared;\n}\n'
    with pytest.raises(CompileError, match=r'(?s)kernels/broken\.cu for sm_80.*not_declared'):
        _cubin.fetch(code, 'kernels/broken.cu', OPTS)
    assert entry_files(cache) == []
    assert _cubin.counters()['nvrtc_compiles'] == 1


def test_a_compile_on_a_terminal_says_so_once(cache, monkeypatch):
    """About 2 s of NVRTC per kernel family on first use: on a terminal one line says what is
    compiling and how long it took; a cache hit and a pipe (logs, CI) say nothing."""
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    for stream, said in ((io.StringIO(), False), (Terminal(), True)):
        monkeypatch.setattr(sys, 'stderr', stream)
        code = TEMPLATED + '// {}\n'.format(said)          # a miss each time
        _cubin.fetch(code, 'kernels/scaled.cu', OPTS, NAMES)
        text = stream.getvalue()
        if said:
            assert re.fullmatch(r'chainer_tc: compiling scaled\.cu for sm_80 \(first use; cached '
                                r'for later runs\) \.\.\. \d+\.\d s\n', text), text
        else:
            assert text == ''
        stream.truncate(0)
        _cubin.fetch(code, 'kernels/scaled.cu', OPTS, NAMES)           # from the cache
        assert stream.getvalue() == ''


def test_entry_is_written_and_read_back(cache):
    _, first = _cubin.fetch(TEMPLATED, 'kernels/scaled.cu', OPTS, NAMES)
    assert not first.from_cache and _cubin.counters() == dict(ZERO, nvrtc_compiles=1)
    [path] = entry_files(cache)
    assert path.name == _cubin.cache_key(TEMPLATED, 'kernels/scaled.cu', OPTS, NAMES, 'cubin')
    assert oct(path.stat().st_mode & 0o777) == '0o600'
    head, _, binary = _cache.load(_cubin.KIND, path.name).partition(b'\0')
    meta = json.loads(head)
    assert binary == first.binary
    assert meta['lowered'] == first.lowered and meta['options'] == list(OPTS)
    assert meta['arch'] == '-arch=sm_80' and meta['target'] == 'cubin'
    assert meta['nvrtc'] == '{}.{}'.format(*_cubin.nvrtc_version())

    loaded, second = _cubin.fetch(TEMPLATED, 'kernels/scaled.cu', OPTS, NAMES)
    assert second.from_cache and loaded == second.binary == first.binary
    assert second.lowered == first.lowered
    assert _cubin.counters() == dict(ZERO, nvrtc_compiles=1, cache_hits=1)


def test_a_fresh_process_loads_the_loaders_binary_without_nvrtc(cache, tmp_path):
    # the loader's own options (kernels' and CuPy's) for a templated family; the second process
    # gets the binary and lowered names from the cache: zero NVRTC compiles
    kdir = tmp_path / 'kernels'
    kdir.mkdir()
    (kdir / 'scaled.cu').write_text(TEMPLATED)
    code = '''if True:
        import hashlib, json
        from chainer_tc import _cubin, kernels
        m = _cubin.load_module(kernels.source('scaled'), kernels.source_path('scaled'),
                               kernels._nvrtc_options(kernels._define_options({'VALUE': 7})),
                               ('scale<float>', 'scale<double>'), '90', load=bytes)
        print(json.dumps([_cubin.counters(), m.lowered, hashlib.sha256(m.module).hexdigest()]))
    '''
    env = dict(CHAINER_TC_KERNEL_DIR=str(kdir), CHAINER_TC_CACHE_DIR=str(cache))
    counts, lowered, digest = json.loads(run_python(code, **env))
    assert counts == dict(ZERO, nvrtc_compiles=1)
    assert set(lowered) == set(NAMES) and all(v.startswith('_Z5scale') for v in lowered.values())
    again = json.loads(run_python(code, **env))
    assert again == [dict(ZERO, cache_hits=1), lowered, digest]
    assert len(entry_files(cache)) == 1


def test_the_shipped_layout_family_through_the_cache(cache):
    # a real family with the loader's options, for sm_70 and sm_90: compiled once, then served
    opts = kernels._nvrtc_options(kernels._define_options({'LAYOUT_TILE': 32}))
    code, path = kernels.source('layout'), kernels.source_path('layout')
    for cc in ('70', '90'):
        m = _cubin.load_module(code, path, opts, (), cc, load=bytes)
        assert m.module[:4] == b'\x7fELF' and m.lowered == {}
    assert _cubin.counters() == dict(ZERO, nvrtc_compiles=2)
    for cc in ('70', '90'):
        _cubin.load_module(code, path, opts, (), cc, load=bytes)
    assert _cubin.counters() == dict(ZERO, nvrtc_compiles=2, cache_hits=2)


# -- damaged entries ----------------------------------------------------------------------------

def test_corrupt_entry_is_recompiled(cache):
    _, first = _cubin.fetch(TEMPLATED, 'kernels/scaled.cu', OPTS, NAMES)
    [path] = entry_files(cache)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xff
    path.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match='checksum mismatch'):
        _, second = _cubin.fetch(TEMPLATED, 'kernels/scaled.cu', OPTS, NAMES)
    assert not second.from_cache and second.binary == first.binary
    assert _cubin.counters()['nvrtc_compiles'] == 2
    _, third = _cubin.fetch(TEMPLATED, 'kernels/scaled.cu', OPTS, NAMES)
    assert third.from_cache, 'the entry was rewritten whole'


@pytest.mark.parametrize('payload', [
    b'not json\0\x7fELF',
    json.dumps({'format': _cubin.FORMAT}).encode() + b'\0\x7fELF',
    b'{"format": 1, "target": "cubin", "options": [], "name_expressions": [], "lowered": {}}',
])
def test_entry_this_version_did_not_write_is_recompiled(cache, payload):
    key = _cubin.cache_key(TEMPLATED, 'kernels/scaled.cu', OPTS, NAMES, 'cubin')
    _cache.store(_cubin.KIND, key, payload)
    with pytest.warns(RuntimeWarning, match='not one this version wrote'):
        _, entry = _cubin.fetch(TEMPLATED, 'kernels/scaled.cu', OPTS, NAMES)
    assert not entry.from_cache and set(entry.lowered) == set(NAMES)
    assert _cubin.fetch(TEMPLATED, 'kernels/scaled.cu', OPTS, NAMES)[1].from_cache


def test_binary_the_driver_rejects_is_recompiled(cache):
    _cubin.fetch(TEMPLATED, 'kernels/scaled.cu', OPTS, NAMES)
    calls = []

    def load(binary):
        calls.append(hashlib.sha256(binary).hexdigest())
        if len(calls) == 1:
            raise RuntimeError('CUDA_ERROR_INVALID_IMAGE: device kernel image is invalid')
        return 'module'

    with pytest.warns(RuntimeWarning, match='could not be loaded.*INVALID_IMAGE'):
        loaded, entry = _cubin.fetch(TEMPLATED, 'kernels/scaled.cu', OPTS, NAMES, load=load)
    assert loaded == 'module' and not entry.from_cache and len(calls) == 2
    assert _cubin.counters() == dict(ZERO, nvrtc_compiles=2)


# -- the loader's memo and counters -------------------------------------------------------------

def test_loader_counts_nothing_after_warm_up(tmp_path, monkeypatch):
    (tmp_path / 'fam.cu').write_text(
        '// kernels/fam.cu: launch (1,), (4,)\n'
        'extern "C" __global__ void k(int* x) { x[threadIdx.x] = 5; }\n'
        'extern "C" __global__ void j(int* x) { x[0] = 6; }\n')
    monkeypatch.setenv('CHAINER_TC_KERNEL_DIR', str(tmp_path))
    monkeypatch.setenv('CHAINER_TC_EMULATE', '1')
    kernels.reset_counters()
    k = kernels.get_function('fam', 'k', numpy)
    kernels.get_function('fam', 'j', numpy)
    assert kernels.counters() == dict(ZERO, modules_loaded=1, function_lookups=2)
    kernels.reset_counters()
    x = numpy.zeros(4, numpy.int32)
    for _ in range(3):
        again = kernels.get_function('fam', 'k', numpy)
        again((1,), (4,), (x,))
    assert again is k and (x == 5).all()
    assert kernels.counters() == ZERO
    with pytest.raises(AttributeError, match="no kernel 'nope'"):
        kernels.get_function('fam', 'nope', numpy)


# -- on a GPU -----------------------------------------------------------------------------------

GPU_RUN = '''if True:
    import json, numpy, chainer_tc, cupy
    from chainer_tc import kernels
    names = ('scale<float>', 'scale<double>')
    out = {}
    for dtype, ctype in ((numpy.float32, 'float'), (numpy.float64, 'double')):
        x = cupy.arange(100, dtype=dtype)
        k = kernels.get_function('scaled', 'scale<{}>'.format(ctype), cupy, {'VALUE': 7},
                                 name_expressions=names)
        k((2,), (64,), (x, dtype(3), numpy.int32(90)))
        out[numpy.dtype(dtype).name] = cupy.asnumpy(x).tolist()
    y = cupy.zeros(4, numpy.int32)
    kernels.get_function('scaled', 'fill', cupy, {'VALUE': 7}, name_expressions=names)(
        (1,), (4,), (y,))
    out['fill'] = cupy.asnumpy(y).tolist()
    out['first'] = kernels.counters()
    kernels.reset_counters()
    kernels.get_function('scaled', 'fill', cupy, {'VALUE': 7}, name_expressions=names)
    out['warm'] = kernels.counters()
    print(json.dumps(out))
'''


@pytest.mark.gpu
def test_gpu_templated_kernels_load_from_the_cache_in_a_new_process(cache, tmp_path):
    kdir = tmp_path / 'kernels'
    kdir.mkdir()
    (kdir / 'scaled.cu').write_text(TEMPLATED)
    env = dict(CHAINER_TC_KERNEL_DIR=str(kdir), CHAINER_TC_CACHE_DIR=str(cache))
    first = json.loads(run_python(GPU_RUN, **env))
    expect = numpy.arange(100.0)
    expect[:90] *= 3
    for dtype in ('float32', 'float64'):
        numpy.testing.assert_array_equal(first[dtype], expect)
    assert first['fill'] == [7, 7, 7, 7]
    assert first['first'] == dict(ZERO, nvrtc_compiles=1, modules_loaded=1, function_lookups=3)
    assert first['warm'] == ZERO, 'a kernel asked for again is a dictionary lookup'
    second = json.loads(run_python(GPU_RUN, **env))
    assert second['first'] == dict(ZERO, cache_hits=1, modules_loaded=1, function_lookups=3)
    assert {k: second[k] for k in ('float32', 'float64', 'fill')} == \
        {k: first[k] for k in ('float32', 'float64', 'fill')}


@pytest.mark.gpu
def test_gpu_layout_through_the_new_loader_equals_numpy(cache):
    import cupy
    from chainer_tc import layout
    x = numpy.random.rand(3, 5, 33, 31).astype(numpy.float32)
    y = layout.nchw_to_nhwc(cupy.asarray(x), numpy.float16)
    numpy.testing.assert_array_equal(cupy.asnumpy(y),
                                     x.transpose(0, 2, 3, 1).astype(numpy.float16))


@pytest.mark.gpu
def test_gpu_unknown_kernel_names_the_argument(tmp_path, monkeypatch, cache):
    import cupy
    (tmp_path / 'scaled.cu').write_text(TEMPLATED)
    monkeypatch.setenv('CHAINER_TC_KERNEL_DIR', str(tmp_path))
    with pytest.raises(AttributeError, match=r"no kernel 'scale<int>'.*name_expressions"):
        kernels.get_function('scaled', 'scale<int>', cupy, {'VALUE': 7}, name_expressions=NAMES)
    with pytest.raises(AttributeError, match="no kernel 'nope'"):
        kernels.get_function('scaled', 'nope', cupy, {'VALUE': 7})
