"""A per-user cache for compiled artifacts (emulator shared objects, NVRTC cubins and reports).

Compiled artifacts are executable code, so the cache is careful:

- it lives in ``$CHAINER_TC_CACHE_DIR``, else ``$XDG_CACHE_HOME/chainer_tc``, else
  ``~/.cache/chainer_tc``: never a shared temporary folder;
- the directory is created owner-only (0700) and not used if another user owns it, if others can
  write to it, or if it is a symbolic link;
- every entry is one file, ``MAGIC + sha256(payload) + payload``, written to a temporary file in the
  same directory and moved into place with ``os.replace`` (readers never see half a file);
- an entry is verified every time it is read: a regular file of yours, not writable by others,
  whose checksum matches. Anything else (corrupt, truncated, another user's, a FIFO, a symbolic
  link, a directory) is deleted where possible and reported as a miss, so the caller rebuilds it.

What the checksum proves is that the file is what this module wrote, not who wrote it: an entry
with a valid checksum is loaded, whoever made it. The cache directory is therefore trusted like a
Python module of yours: whoever can write to it can run code as you. That is why it must be yours
and private, and why nothing here reads a directory that is not.

A cache that cannot be used costs speed, not function: when the directory cannot be created or
written (read-only, a file in its place, a full disk) or is not safe, one ``CacheWarning`` says why
and how to fix it, and the process keeps its artifacts in a private temporary directory of its own
(``tempfile.mkdtemp``, 0700, removed at exit), so they are rebuilt by every new process.
"""
import atexit
import errno
import hashlib
import os
import shutil
import stat
import tempfile
import threading
import warnings

MAGIC = b'CHAINER_TC_CACHE_1\n'
_DIGEST = 32

_lock = threading.Lock()
_unusable = {}          # cache root -> why it is not used (this process no longer tries it)
_unwritable = {}        # cache root -> why this process no longer writes to it (it still reads)
# write errors after which a cache's entries are still worth reading: a read-only directory or
# file system, a full disk or quota
_STILL_READ = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT}
_private = []           # [the private temporary root] once made
_warned = set()


class CacheDirError(RuntimeError):
    """The cache directory cannot be used safely."""


class CacheWarning(RuntimeWarning):
    """The compile cache could not be used as configured; work goes on without it."""


def configured_dir():
    """The cache root the environment names (not created, not checked)."""
    root = os.environ.get('CHAINER_TC_CACHE_DIR')
    if not root:
        base = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
        root = os.path.join(base, 'chainer_tc')
    return os.path.abspath(root)


def cache_dir():
    """The cache root, created owner-only if missing; raises ``CacheDirError`` if unsafe and
    ``OSError`` if it cannot be created. (``load`` and ``store`` do not raise: they fall back.)"""
    return _ensure_private_dir(configured_dir())


def _ensure_private_dir(path, create=True):
    """``path``, checked (and created if ``create``); None when it is missing and not created."""
    if create:
        os.makedirs(path, mode=0o700, exist_ok=True)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if create:
            raise
        return None
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


def _check_key(kind, key):
    if not kind.isidentifier() or not key or not all(c in '0123456789abcdef' for c in key):
        raise ValueError('cache kind must be an identifier and key a hex digest; got {!r}, {!r}'
                         .format(kind, key))


def key_of(*parts):
    """A hex key hashing every part (str or bytes), unambiguously separated."""
    h = hashlib.sha256()
    for p in parts:
        b = p.encode() if isinstance(p, str) else bytes(p)
        h.update(len(b).to_bytes(8, 'little'))
        h.update(b)
    return h.hexdigest()


def _warn_once(what, message):
    with _lock:
        if what in _warned:
            return
        _warned.add(what)
    warnings.warn(message, CacheWarning, stacklevel=4)


def _why(e):
    if isinstance(e, CacheDirError):
        return str(e)
    if isinstance(e, OSError):
        name = errno.errorcode.get(e.errno, 'error')
        where = ' ({})'.format(e.filename) if isinstance(e.filename, str) else ''
        return '{}: {}{}'.format(name, e.strerror or e, where)
    return '{}: {}'.format(type(e).__name__, e)


def _give_up(root, error, reads_too=True):
    """``root`` is not used again by this process (``reads_too=False``: not written to again,
    its entries still read: a read-only or full cache); one warning says why."""
    why = _why(error)
    with _lock:
        (_unusable if reads_too else _unwritable)[root] = why
    if _private and root == _private[0]:
        _warn_once(('private', root), 'chainer_tc: the private temporary compile cache {} failed '
                   'too ({}): compiled kernels are not cached at all (slower, not wrong)'
                   .format(root, why))
        return
    _warn_once(('root', root), (
        'chainer_tc: the compile cache {} cannot be {} ({}); {}compiled kernels are kept in a '
        'private temporary directory for this process instead, so every new process rebuilds '
        'them (slower, not wrong). To cache them again, make {} a writable directory of your own '
        '(mode 700) or set CHAINER_TC_CACHE_DIR to one.').format(
            root, 'used' if reads_too else 'written', why,
            '' if reads_too else 'the kernels it holds are still read; newly ', root))


def _private_root():
    """The process's private temporary cache root (made on first need), or None."""
    with _lock:
        if _private:
            return _private[0]
        try:
            root = tempfile.mkdtemp(prefix='chainer_tc_cache_')
        except OSError as e:
            _unusable[None] = _why(e)
            failed = e
        else:
            _private.append(root)
            atexit.register(shutil.rmtree, root, True)
            return root
    _warn_once(('private', None), 'chainer_tc: the compile cache cannot be used and no private '
               'temporary directory can be made either ({}): compiled kernels are not cached at '
               'all (slower, not wrong)'.format(_why(failed)))
    return None


def _roots(writing=False):
    """Where to look (or write), in order: the configured root unless given up (for writing:
    or no longer written), then the private one once it exists (``load``) or is needed
    (``store``)."""
    root = configured_dir()
    with _lock:
        usable = root not in _unusable and not (writing and root in _unwritable)
        private = _private[0] if _private and _private[0] not in _unusable else None
    return ([root] if usable else []), private


def load(kind, key):
    """The payload stored under (kind, key), or None when missing, damaged, unsafe or unreadable.
    Never raises for the state of the cache."""
    _check_key(kind, key)
    primary, private = _roots()
    for root in primary + ([private] if private else []):
        try:
            directory = _ensure_private_dir(root, create=False)
            if directory is not None:
                directory = _ensure_private_dir(os.path.join(root, kind), create=False)
        except (CacheDirError, OSError) as e:
            _give_up(root, e)
            continue
        if directory is None:
            continue
        payload = _read_entry(os.path.join(directory, key))
        if payload is not None:
            return payload
    return None


def _read_entry(path):
    # O_NONBLOCK: opening a FIFO planted as an entry must not wait for a writer; O_NOFOLLOW: a
    # symbolic link is not followed (ELOOP), whatever it points to
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, 'O_CLOEXEC', 0)
    reason = None
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno != errno.ELOOP:
            _warn_once(('read', path), 'chainer_tc: cannot read the compile cache entry {} ({}); '
                       'it will be rebuilt'.format(path, _why(e)))
            return None
        reason = 'a symbolic link'
    if reason is None:
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                reason = 'not a regular file'
            elif st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                reason = 'not owned by you or writable by others'
            else:
                with os.fdopen(fd, 'rb') as f:
                    fd = None
                    data = f.read()
        except OSError as e:
            _warn_once(('read', path), 'chainer_tc: cannot read the compile cache entry {} ({}); '
                       'it will be rebuilt'.format(path, _why(e)))
            return None
        finally:
            if fd is not None:
                os.close(fd)
    if reason is None:
        if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _DIGEST:
            reason = 'bad header'
        else:
            digest = data[len(MAGIC):len(MAGIC) + _DIGEST]
            payload = data[len(MAGIC) + _DIGEST:]
            if hashlib.sha256(payload).digest() != digest:
                reason = 'checksum mismatch'
    if reason is None:
        return payload
    warnings.warn('chainer_tc: discarding cache entry {} ({}); it will be rebuilt'
                  .format(path, reason), RuntimeWarning, stacklevel=3)
    try:
        os.unlink(path)         # a directory planted as an entry stays: it is never read
    except OSError:
        pass
    return None


def store(kind, key, payload):
    """Store ``payload`` atomically under (kind, key): in the configured cache, or, when that
    cannot be written, in the process's private temporary one (one ``CacheWarning`` says why).
    Never raises for the state of the cache."""
    _check_key(kind, key)
    primary, _ = _roots(writing=True)
    for root in primary + [None]:
        if root is None:
            root = _private_root()
            if root is None or root in _unusable:
                return
        try:
            _write_entry(root, kind, key, payload)
            return
        except CacheDirError as e:          # not safe: neither read nor written again
            _give_up(root, e)
        except OSError as e:                # read-only, full: what it holds is still read
            _give_up(root, e, reads_too=root in _private or e.errno not in _STILL_READ)


def _write_entry(root, kind, key, payload):
    _ensure_private_dir(root)
    directory = _ensure_private_dir(os.path.join(root, kind))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix='.tmp-')
    try:
        with os.fdopen(fd, 'wb') as f:
            f.write(MAGIC)
            f.write(hashlib.sha256(payload).digest())
            f.write(payload)
        os.replace(tmp, os.path.join(directory, key))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
