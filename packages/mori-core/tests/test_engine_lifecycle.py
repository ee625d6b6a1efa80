"""The TCP engine's end of life: collecting it from Python joins its threads without the GIL."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# Engine `a` stages "device" memory through a copier written in Python (ctypes callbacks), so its
# sender thread needs the GIL to run it. The copy is caught half way (the callback sleeps, the GIL
# free), the last reference to `a` goes, and its destructor joins that thread: holding the GIL
# there, the join waits for a thread that waits for the GIL, for ever. Run in a child process:
# a process deadlocked with the GIL held cannot be stopped by pytest-timeout from inside.
_CHILD = textwrap.dedent(
    """
    import ctypes, threading, time
    from mori.core import transfer

    TO_HOST = ctypes.CFUNCTYPE(
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int
    )
    FROM_HOST = ctypes.CFUNCTYPE(
        ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int
    )

    class DeviceCopier(ctypes.Structure):  # csrc/transfer/engine.hpp
        _fields_ = [
            ("to_host", TO_HOST),
            ("from_host", FROM_HOST),
            ("ctx", ctypes.c_void_p),
            ("host_alloc", ctypes.c_void_p),
            ("host_free", ctypes.c_void_p),
        ]

    entered = threading.Event()

    def to_host(ctx, dst, src, n, device):
        entered.set()
        time.sleep(0.5)  # the GIL is free meanwhile; getting it back needs the collector to let go
        ctypes.memmove(dst, src, n)
        return 0

    def from_host(ctx, dst, src, n, device):
        ctypes.memmove(dst, src, n)
        return 0

    copier = DeviceCopier(TO_HOST(to_host), FROM_HOST(from_host), None, None, None)
    NAME = b"mori.io.DeviceCopier"
    capsule_new = ctypes.pythonapi.PyCapsule_New
    capsule_new.restype = ctypes.py_object
    capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

    N = 256 << 10  # above the 64 KiB a poster sends itself: the sender thread stages it
    src, dst = ctypes.create_string_buffer(b"x" * N, N), ctypes.create_string_buffer(N)
    a = transfer.TcpEngine("a", "127.0.0.1", 0, "node-a", "", 10000)
    b = transfer.TcpEngine("b", "127.0.0.1", 0, "node-b", "", 10000)
    a.set_device_copier(capsule_new(ctypes.addressof(copier), NAME, None))
    local = a.register_memory(ctypes.addressof(src), N, 2, 0)  # "GPU" memory: staged by the copier
    remote = b.register_memory(ctypes.addressof(dst), N, 1, -1)
    a.add_peer("b", "127.0.0.1", b.port, False)
    st = a.post("write", local, "b", remote, [0], [0], [N], 1, True, N)
    assert entered.wait(20), "the copier was never called"
    del a  # the last reference: Python collects the engine while its sender thread copies
    assert st.WaitFor(20000), "the transfer was not completed by the engine's shutdown"
    print("collected", st.Code())
    """
)


@pytest.mark.timeout(120)
def test_collecting_an_engine_joins_its_threads_without_the_gil() -> None:
    try:
        out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as e:
        pytest.fail(
            f"collecting a TcpEngine deadlocked (its destructor joined a thread with the GIL held): {e}"
        )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "collected" in out.stdout, out.stdout + out.stderr
