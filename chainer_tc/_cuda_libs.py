"""Make pip-installed CUDA libraries (``site-packages/nvidia/<pkg>/lib``) visible to CuPy.

CuPy 13 wheels link ``libcublas.so.12``, ``libcudnn.so.8``, ``libnvrtc.so.12`` ... by soname and
do not search the ``nvidia-*-cu12`` wheel directories, so ``import cupy`` fails unless
``LD_LIBRARY_PATH`` is set.  Loading each library once by full path with ``RTLD_GLOBAL`` makes
the dynamic linker reuse it for every later lookup of the same soname (including cuDNN's own
``dlopen`` of its sub-libraries and of NVRTC).

Call :func:`preload` before CuPy is imported (``chainer_tc/__init__.py`` does).  It never raises
and never prints; set ``CHAINER_TC_NO_PRELOAD=1`` to turn it off.  Where
``CHAINER_TC_CUDNN_LIBRARY`` names a cuDNN for chainer_tc (``chainer_tc.cuda.cudnn``), the wheel's
cuDNN is not preloaded: a named ``libcudnn.so.8`` is preloaded in its place (so CuPy 13, which
links that soname, uses it too); a named cuDNN 9 leaves CuPy 13 without cuDNN unless the dynamic
linker finds a ``libcudnn.so.8`` by itself (then the process holds two cuDNNs, each used with its
own handles and descriptors).
"""
import ctypes
import glob
import os
import site
import sys

OPT_OUT_ENV = 'CHAINER_TC_NO_PRELOAD'
CUDNN_ENV = 'CHAINER_TC_CUDNN_LIBRARY'      # read by chainer_tc.cuda.cudnn too

# (name, nvidia package dir, file glob), in dependency order.  Every entry is optional.
LIBRARIES = (
    ('cudart', 'cuda_runtime', 'libcudart.so.*'),
    ('nvjitlink', 'nvjitlink', 'libnvJitLink.so.*'),
    ('cublasLt', 'cublas', 'libcublasLt.so.*'),
    ('cublas', 'cublas', 'libcublas.so.*'),
    ('nvrtc-builtins', 'cuda_nvrtc', 'libnvrtc-builtins.so.*'),
    ('nvrtc', 'cuda_nvrtc', 'libnvrtc.so.*'),
    ('curand', 'curand', 'libcurand.so.*'),
    ('cufft', 'cufft', 'libcufft.so.*'),
    ('cusparse', 'cusparse', 'libcusparse.so.*'),
    ('cusolver', 'cusolver', 'libcusolver.so.*'),
    # cuDNN 8: the sub-libraries first (ops -> cnn -> adv), then the front library.
    ('cudnn_ops_infer', 'cudnn', 'libcudnn_ops_infer.so.*'),
    ('cudnn_ops_train', 'cudnn', 'libcudnn_ops_train.so.*'),
    ('cudnn_cnn_infer', 'cudnn', 'libcudnn_cnn_infer.so.*'),
    ('cudnn_cnn_train', 'cudnn', 'libcudnn_cnn_train.so.*'),
    ('cudnn_adv_infer', 'cudnn', 'libcudnn_adv_infer.so.*'),
    ('cudnn_adv_train', 'cudnn', 'libcudnn_adv_train.so.*'),
    ('cudnn', 'cudnn', 'libcudnn.so.*'),
    ('nccl', 'nccl', 'libnccl.so.*'),
    ('cutensor', 'cutensor', 'libcutensor.so.*'),
)

_loaded = {}
_errors = {}
_done = False


def default_search_paths():
    """Directories that may contain an ``nvidia/`` namespace package (sys.path + site dirs)."""
    paths = list(sys.path)
    try:
        paths += site.getsitepackages()
    except Exception:  # some virtualenv/embedded setups lack it
        pass
    try:
        paths.append(site.getusersitepackages())
    except Exception:
        pass
    return paths


def find_lib_dirs(search_paths):
    """Return ``{package: lib_dir}`` for every ``<path>/nvidia/<package>/lib`` (first wins)."""
    found = {}
    for path in search_paths:
        if not isinstance(path, str) or not path:
            continue
        for lib_dir in sorted(glob.glob(os.path.join(path, 'nvidia', '*', 'lib'))):
            package = os.path.basename(os.path.dirname(lib_dir))
            if os.path.isdir(lib_dir):
                found.setdefault(package, lib_dir)
    return found


def _pick(lib_dir, pattern):
    """The file in ``lib_dir`` matching ``pattern``; the shortest name (the soname) wins."""
    names = [p for p in glob.glob(os.path.join(lib_dir, pattern)) if os.path.isfile(p)]
    return min(names, key=lambda p: (len(p), p)) if names else None


def _already_loaded(path):
    """True if a library with this file's soname is already in the process."""
    try:
        ctypes.CDLL(os.path.basename(path), mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)
        return True
    except OSError:
        return False


def _wanted():
    """The :data:`LIBRARIES` to preload: all, but the wheel's cuDNN where the user named one."""
    skip_cudnn = bool(os.environ.get(CUDNN_ENV))
    return tuple(e for e in LIBRARIES if not (skip_cudnn and e[1] == 'cudnn'))


def _named_cudnn8():
    """The ``libcudnn.so.8`` file ``CHAINER_TC_CUDNN_LIBRARY`` names, or None."""
    named = os.environ.get(CUDNN_ENV, '')
    return named if os.path.basename(named).startswith('libcudnn.so.8') else None


def load_from(search_paths):
    """Load the libraries found under ``search_paths``; return ``(loaded, errors)`` dicts.

    A library whose soname is already loaded (e.g. found earlier through ``LD_LIBRARY_PATH``) is
    left alone so that the process never holds two copies of it.
    """
    loaded, errors = {}, {}
    lib_dirs = find_lib_dirs(search_paths)
    for name, package, pattern in _wanted():
        lib_dir = lib_dirs.get(package)
        path = _pick(lib_dir, pattern) if lib_dir else None
        if path is None:
            continue
        try:
            if not _already_loaded(path):
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                loaded[name] = path
        except OSError as e:
            errors[name] = '%s: %s' % (path, e)
    named = _named_cudnn8()
    if named and not _already_loaded(named):
        try:
            ctypes.CDLL(named, mode=ctypes.RTLD_GLOBAL)
            loaded['cudnn'] = named
        except OSError as e:
            errors['cudnn'] = '%s: %s' % (named, e)
    return loaded, errors


def find_library(name, search_paths=None):
    """Full path of the library ``name`` (a name in :data:`LIBRARIES`), or None if absent.

    The path :func:`preload` loaded wins; otherwise the wheel directories under ``search_paths``
    (default: :func:`default_search_paths`) are searched the same way.
    """
    entries = {n: (package, pattern) for n, package, pattern in LIBRARIES}
    if name not in entries:
        raise ValueError('unknown library %r; expected one of %s' % (name, ', '.join(entries)))
    if name in _loaded:
        return _loaded[name]
    package, pattern = entries[name]
    lib_dir = find_lib_dirs(default_search_paths() if search_paths is None else
                            search_paths).get(package)
    return _pick(lib_dir, pattern) if lib_dir else None


def preload():
    """Preload the CUDA libraries once per process (no-op when opted out or already done)."""
    global _done
    if _done:
        return
    _done = True
    if os.environ.get(OPT_OUT_ENV, '') not in ('', '0'):
        return
    try:
        loaded, errors = load_from(default_search_paths())
    except Exception as e:  # never let an import of chainer_tc fail because of this
        loaded, errors = {}, {'preload': repr(e)}
    _loaded.update(loaded)
    _errors.update(errors)


def preloaded():
    """``{name: path}`` of the libraries :func:`preload` loaded."""
    return dict(_loaded)


def preload_errors():
    """``{name: error message}`` of the libraries that were found but failed to load."""
    return dict(_errors)
