"""The per-user compile cache: private, atomic, verified; corrupt or planted entries are rebuilt."""
import errno
import hashlib
import os
import stat
import subprocess
import sys
import tempfile
import warnings

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


def test_others_writable_directory_is_not_used(cache, fresh):
    cache.mkdir()
    os.chmod(cache, 0o777)
    with pytest.warns(_cache.CacheWarning, match='writable by others.*private temporary'):
        _cache.store('unit', 'ab', b'x')
    assert os.listdir(cache) == [], 'nothing written where others can plant entries'
    assert _cache.load('unit', 'ab') == b'x'            # from the private temporary cache


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


# ---- faults: a cache that cannot be used costs speed, not function --------------------------------

@pytest.fixture
def fresh(monkeypatch):
    """Forget what this process learnt about unusable caches (each test starts clean)."""
    monkeypatch.setattr(_cache, '_unusable', {})
    monkeypatch.setattr(_cache, '_unwritable', {})
    monkeypatch.setattr(_cache, '_private', [])
    monkeypatch.setattr(_cache, '_warned', set())


def _store_and_load(kind='unit', key='ef', payload=b'built'):
    _cache.store(kind, key, payload)
    return _cache.load(kind, key)


def test_file_where_the_cache_directory_should_be(cache, fresh):
    cache.write_text('not a directory')
    with pytest.warns(_cache.CacheWarning, match=r'cannot be used .*private temporary directory'):
        assert _store_and_load() == b'built'
    assert cache.read_text() == 'not a directory'


def test_file_where_a_parent_should_be(tmp_path, monkeypatch, fresh):
    (tmp_path / 'home').write_text('a file where HOME/.cache should be a directory')
    monkeypatch.delenv('CHAINER_TC_CACHE_DIR', raising=False)
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'home' / '.cache'))
    with pytest.warns(_cache.CacheWarning, match='ENOTDIR'):
        assert _store_and_load() == b'built'


@pytest.mark.parametrize('err', [errno.EACCES, errno.EROFS])
def test_read_only_cache_or_home(cache, fresh, monkeypatch, err):
    # as root a chmod 500 directory is still writable, so the refusal the kernel would give a
    # user (EACCES) or a read-only file system (EROFS) is raised where the cache creates things
    real = os.makedirs

    def makedirs(path, *args, **kwargs):
        if str(path).startswith(str(cache)):
            raise OSError(err, os.strerror(err), str(path))
        return real(path, *args, **kwargs)
    monkeypatch.setattr(os, 'makedirs', makedirs)
    with pytest.warns(_cache.CacheWarning) as w:
        assert _store_and_load() == b'built'
        assert _store_and_load('unit', 'aa', b'second') == b'second'
    assert len(w) == 1, 'warned once'
    assert errno.errorcode[err] in str(w[0].message) and str(cache) in str(w[0].message)


@pytest.mark.parametrize('err', [errno.EACCES, errno.EROFS, errno.ENOSPC])
def test_a_cache_that_cannot_be_written_is_still_read(cache, fresh, monkeypatch, err):
    """A pre-filled read-only cache (a container image's), or a full disk: the first miss
    cannot be stored, and every later load must still find what the cache holds (it used to
    stop reading it, so every family was rebuilt). New entries go to the private directory."""
    _cache.store('unit', 'ab', b'kept')
    real = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):
        if str(dir).startswith(str(cache)):
            raise OSError(err, os.strerror(err), str(dir))
        return real(*args, dir=dir, **kwargs)
    monkeypatch.setattr(tempfile, 'mkstemp', mkstemp)
    with pytest.warns(_cache.CacheWarning, match=r'cannot be written .*the kernels it holds are '
                                                 r'still read'):
        _cache.store('unit', 'cd', b'new')
    assert _cache.load('unit', 'ab') == b'kept'
    assert _cache.load('unit', 'cd') == b'new'              # from the private directory
    assert not (cache / 'unit' / 'cd').exists()
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        _cache.store('unit', 'ef', b'later')                  # no retry, no second warning
    assert _cache.load('unit', 'ab') == b'kept' and _cache.load('unit', 'ef') == b'later'


@pytest.mark.skipif(os.getuid() == 0, reason='root writes to read-only directories')
def test_read_only_directory_for_real(cache, fresh):
    _cache.store('unit', 'ab', b'kept')
    os.chmod(cache / 'unit', 0o500)
    try:
        with pytest.warns(_cache.CacheWarning, match='EACCES'):
            _cache.store('unit', 'cd', b'new')
        assert _cache.load('unit', 'ab') == b'kept'     # what is there is still read
        assert _cache.load('unit', 'cd') == b'new'
    finally:
        os.chmod(cache / 'unit', 0o700)


def test_full_disk(cache, fresh, monkeypatch):
    # the entry's temporary file is /dev/full: every write fails with ENOSPC, as on a full disk
    made = []

    def mkstemp(dir=None, prefix=None):
        path = os.path.join(dir, prefix + 'full')
        open(path, 'wb').close()
        made.append(path)
        return os.open('/dev/full', os.O_WRONLY), path
    monkeypatch.setattr(tempfile, 'mkstemp', mkstemp)
    with pytest.warns(_cache.CacheWarning, match='ENOSPC'):
        _cache.store('unit', 'ab', b'x' * 100000)
    monkeypatch.undo()
    assert not os.path.exists(made[0]), 'the partial file is removed'
    assert not (cache / 'unit' / 'ab').exists()


def test_planted_fifo_is_discarded_without_waiting(cache, fresh):
    _cache.store('unit', 'ab', b'x')
    os.unlink(cache / 'unit' / 'ab')
    os.mkfifo(cache / 'unit' / 'ab', 0o600)
    code = ('import warnings; warnings.simplefilter("ignore"); from chainer_tc import _cache; '
            'print(_cache.load("unit", "ab"))')
    env = dict(os.environ, CHAINER_TC_CACHE_DIR=str(cache))
    try:
        out = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True,
                             text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail('loading a FIFO planted as a cache entry hangs')
    assert out.returncode == 0 and out.stdout.strip() == 'None', out.stderr
    assert not (cache / 'unit' / 'ab').exists()


@pytest.mark.parametrize('plant', ['symlink', 'directory'])
def test_planted_symlink_or_directory_is_a_miss(cache, fresh, tmp_path, plant):
    _cache.store('unit', 'ab', b'real')
    good = (cache / 'unit' / 'ab').read_bytes()
    os.unlink(cache / 'unit' / 'ab')
    if plant == 'symlink':
        (tmp_path / 'elsewhere').write_bytes(good)          # a valid entry, but through a link
        os.symlink(tmp_path / 'elsewhere', cache / 'unit' / 'ab')
    else:
        (cache / 'unit' / 'ab').mkdir()
    with pytest.warns(RuntimeWarning, match='discarding cache entry'):
        assert _cache.load('unit', 'ab') is None


def test_entry_with_a_valid_checksum_is_trusted(cache, fresh):
    """What docs/kernels.md and docs/trust.md state: the checksum finds damage, not authorship;
    whoever can write to the (owner-only) cache can run code, as with a Python module."""
    _cache.store('unit', 'ab', b'ours')
    os.unlink(cache / 'unit' / 'ab')
    planted = _cache.MAGIC + hashlib.sha256(b'planted').digest() + b'planted'
    (cache / 'unit' / 'ab').write_bytes(planted)
    os.chmod(cache / 'unit' / 'ab', 0o600)
    assert _cache.load('unit', 'ab') == b'planted'


def test_emulator_runs_with_a_file_as_its_cache(cache, fresh):
    cache.write_text('in the way')
    code = KERNEL.format(11)
    x = numpy.zeros(4, numpy.int32)
    emulator._modules.clear()
    with pytest.warns(_cache.CacheWarning, match='cannot be used'):
        emulator.RawModule(code=code).get_function('inc')((1,), (4,), (x,))
    assert (x == 11).all()


def test_kernels_cli_with_an_unusable_cache_exits_0(tmp_path):
    bad = tmp_path / 'cache'
    bad.write_text('in the way')
    env = dict(os.environ, CHAINER_TC_CACHE_DIR=str(bad))
    out = subprocess.run([sys.executable, '-m', 'chainer_tc', 'kernels', 'layout', '--arch',
                          'sm_80'], env=env, capture_output=True, text=True, timeout=300)
    if 'NVRTC is not available' in out.stderr:
        pytest.skip('NVRTC (the gpu extra) is not installed')
    assert out.returncode == 0, out.stderr
    assert 'CacheWarning' in out.stderr and 'cannot be used' in out.stderr
    assert 'Traceback' not in out.stderr
