"""A per-user cache for compiled artifacts (emulator shared objects, NVRTC cubins and reports).

Compiled artifacts are executable code, so the cache is careful:

- it lives in ``$CHAINER_TC_CACHE_DIR``, else ``$XDG_CACHE_HOME/chainer_tc``, else
  ``~/.cache/chainer_tc``: never a shared temporary folder;
- the directory is created owner-only (0700) and refused if another user owns it or if others can
  write to it;
- every entry is one file, ``MAGIC + sha256(payload) + payload``, written to a temporary file in the
  same directory and moved into place with ``os.replace`` (readers never see half a file);
- an entry is verified against its checksum every time it is read: a corrupt or planted file is
  deleted and reported as a miss, so the caller rebuilds it, and is never returned.
"""
import hashlib
import os
import stat
import tempfile
import warnings

MAGIC = b'CHAINER_TC_CACHE_1\n'
_DIGEST = 32


class CacheDirError(RuntimeError):
    """The cache directory cannot be used safely."""


def cache_dir():
    """The cache root, created owner-only if missing; raises ``CacheDirError`` if unsafe."""
    root = os.environ.get('CHAINER_TC_CACHE_DIR')
    if not root:
        base = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
        root = os.path.join(base, 'chainer_tc')
    return _ensure_private_dir(os.path.abspath(root))


def _ensure_private_dir(path):
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise CacheDirError('chainer_tc cache {!r} is not a plain directory'.format(path))
    if st.st_uid != os.getuid():
        raise CacheDirError(
            'chainer_tc cache {!r} is owned by uid {}, not by you (uid {}); set '
            'CHAINER_TC_CACHE_DIR to a directory of your own'.format(path, st.st_uid, os.getuid()))
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheDirError(
            'chainer_tc cache {!r} is writable by others (mode {:o}); run `chmod 700 {}` or set '
            'CHAINER_TC_CACHE_DIR'.format(path, stat.S_IMODE(st.st_mode), path))
    return path


def _entry_path(kind, key):
    if not kind.isidentifier() or not all(c in '0123456789abcdef' for c in key):
        raise ValueError('cache kind must be an identifier and key a hex digest; got {!r}, {!r}'
                         .format(kind, key))
    return os.path.join(_ensure_private_dir(os.path.join(cache_dir(), kind)), key)


def key_of(*parts):
    """A hex key hashing every part (str or bytes), unambiguously separated."""
    h = hashlib.sha256()
    for p in parts:
        b = p.encode() if isinstance(p, str) else bytes(p)
        h.update(len(b).to_bytes(8, 'little'))
        h.update(b)
    return h.hexdigest()


def load(kind, key):
    """The payload stored under (kind, key), or None when missing, corrupt or unsafe."""
    path = _entry_path(kind, key)
    try:
        with open(path, 'rb') as f:
            st = os.fstat(f.fileno())
            data = f.read()
    except FileNotFoundError:
        return None
    reason = None
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        reason = 'not owned by you or writable by others'
    elif not data.startswith(MAGIC) or len(data) < len(MAGIC) + _DIGEST:
        reason = 'bad header'
    else:
        digest = data[len(MAGIC):len(MAGIC) + _DIGEST]
        payload = data[len(MAGIC) + _DIGEST:]
        if hashlib.sha256(payload).digest() != digest:
            reason = 'checksum mismatch'
    if reason is not None:
        warnings.warn('chainer_tc: discarding cache entry {} ({}); it will be rebuilt'
                      .format(path, reason), RuntimeWarning, stacklevel=2)
        try:
            os.unlink(path)
        except OSError:
            pass
        return None
    return payload


def store(kind, key, payload):
    """Store ``payload`` atomically under (kind, key)."""
    path = _entry_path(kind, key)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix='.tmp-')
    try:
        with os.fdopen(fd, 'wb') as f:
            f.write(MAGIC)
            f.write(hashlib.sha256(payload).digest())
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
