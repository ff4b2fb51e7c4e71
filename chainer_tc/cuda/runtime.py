"""The CuPy runtime facts the cuDNN drivers need, in one place (tests without a GPU replace them).

Per call the drivers only read the current stream and allocate workspace from the current CuPy
allocator (inside a capture that is whatever pool the capture uses). The handle and the capture
check are needed only when something is set up, outside capture.
"""
import threading


def stream_ptr():
    """The current CuPy stream as a cudaStream_t (0 for the legacy default stream)."""
    import cupy
    return cupy.cuda.get_current_stream().ptr


def is_capturing():
    """True while the current CuPy stream is capturing a CUDA graph."""
    import cupy
    stream = cupy.cuda.get_current_stream()
    return stream.ptr != 0 and stream.is_capturing()


_handles = {}
_handles_lock = threading.Lock()


def handle(device_id):
    """The calling thread's chainer_tc cuDNN handle of device ``device_id`` (``cudnnCreate`` on
    that device, once per thread and device; kept for the life of the process, as CuPy keeps
    its own). Per thread as CuPy's, since a call sets the handle's stream first: two threads
    calling cuDNN on one device at once each use their own. Plans (descriptors, algorithms,
    sizes) hold no handle and serve every thread; a thread whose id is reused after another
    ended takes over that thread's handles. Never created while a stream captures."""
    key = (threading.get_ident(), device_id)
    h = _handles.get(key)
    if h is None:
        import cupy
        from chainer_tc.cuda import cudnn
        with _handles_lock, cupy.cuda.Device(device_id):
            h = _handles.get(key)
            if h is None:
                refuse_capture('the cuDNN handle of device {}'.format(device_id))
                h = _handles[key] = cudnn.binding().create_handle()
    return h


def alloc(nbytes):
    """``nbytes`` of device memory from the current CuPy allocator, or None for 0 bytes."""
    if not nbytes:
        return None
    import cupy
    return cupy.cuda.memory.alloc(nbytes)


def empty(shape, dtype):
    """A new CuPy array (current device, current allocator)."""
    import cupy
    return cupy.empty(shape, dtype)


def contiguous(a):
    """``a`` as a C-contiguous CuPy array (a copy where it is not one)."""
    import cupy
    return cupy.ascontiguousarray(a)


def copy_into(out, a):
    """``out[...] = a`` (CuPy arrays on one device)."""
    out[...] = a


def address(memory):
    """The device address of what :func:`alloc` returned (0 for None)."""
    return 0 if memory is None else memory.ptr


def refuse_capture(what):
    """Raise if the current stream is capturing: ``what`` must be set up before capture."""
    if is_capturing():
        raise RuntimeError(
            '{} is not set up yet and cannot be while the stream is capturing (cuDNN '
            'descriptors, algorithm and workspace queries run outside capture only): run the '
            'same step once before begin_capture()'.format(what))
