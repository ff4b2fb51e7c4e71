"""The per-user compile cache: private, atomic, verified; corrupt or planted entries are rebuilt."""
import os
import stat

import numpy
import pytest

from chainer_tc import _cache
from chainer_tc.testing import emulator

KERNEL = 'extern "C" __global__ void inc(int* x) {{ x[threadIdx.x] += {}; }}'


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / 'cache'
    monkeypatch.setenv('CHAINER_TC_CACHE_DIR', str(root))
    return root


def test_default_location_is_per_user(monkeypatch, tmp_path):
    monkeypatch.delenv('CHAINER_TC_CACHE_DIR', raising=False)
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'xdg'))
    assert _cache.cache_dir() == str(tmp_path / 'xdg' / 'chainer_tc')


def test_directory_is_created_owner_only(cache):
    _cache.store('unit', 'ab', b'payload')
    for d in (cache, cache / 'unit'):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert _cache.load('unit', 'ab') == b'payload'
    assert os.listdir(cache / 'unit') == ['ab'], 'no temporary files are left behind'


def test_others_writable_directory_is_refused(cache):
    cache.mkdir()
    os.chmod(cache, 0o777)
    with pytest.raises(_cache.CacheDirError, match='writable by others'):
        _cache.store('unit', 'ab', b'x')


def test_symlinked_directory_is_refused(cache, tmp_path):
    (tmp_path / 'elsewhere').mkdir(mode=0o700)
    os.symlink(tmp_path / 'elsewhere', cache)
    with pytest.raises(_cache.CacheDirError, match='not a plain directory'):
        _cache.cache_dir()


@pytest.mark.parametrize('damage', ['flip_a_byte', 'truncate', 'plant_garbage', 'loose_mode'])
def test_damaged_entry_is_a_miss_and_is_removed(cache, damage):
    _cache.store('unit', 'cd', b'the real payload')
    path = cache / 'unit' / 'cd'
    data = path.read_bytes()
    if damage == 'flip_a_byte':
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif damage == 'truncate':
        path.write_bytes(data[:10])
    elif damage == 'plant_garbage':
        path.write_bytes(b'\x7fELF not what we stored')
    else:
        os.chmod(path, 0o666)
    with pytest.warns(RuntimeWarning, match='discarding cache entry'):
        assert _cache.load('unit', 'cd') is None
    assert not path.exists()


def test_keys_are_checked():
    with pytest.raises(ValueError, match='hex digest'):
        _cache.load('unit', '../etc/passwd')


def _emulator_entries(cache):
    d = cache / 'emulator'
    return sorted(d.iterdir()) if d.exists() else []


def test_emulator_uses_the_cache_and_rebuilds_a_planted_module(cache):
    code = KERNEL.format(7)      # a source no other test compiles, so nothing is memoized yet
    x = numpy.zeros(4, numpy.int32)
    emulator.RawModule(code=code).get_function('inc')((1,), (4,), (x,))
    (entry,) = _emulator_entries(cache)
    # plant a different, valid shared object under the same key: its checksum no longer matches
    # the header we wrote, so it must be rebuilt, not loaded
    planted = bytearray(entry.read_bytes())
    planted[len(_cache.MAGIC) + 40] ^= 0xff
    entry.write_bytes(bytes(planted))
    emulator._modules.clear()
    with pytest.warns(RuntimeWarning, match='checksum mismatch'):
        emulator.RawModule(code=code).get_function('inc')((1,), (4,), (x,))
    assert (x == 14).all()
    (rebuilt,) = _emulator_entries(cache)
    assert rebuilt.read_bytes() != bytes(planted)
    assert _cache.load('emulator', rebuilt.name) is not None
