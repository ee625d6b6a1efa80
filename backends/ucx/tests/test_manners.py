"""Library manners: loading UCX and using the transport changes no signal handler of the process,
does not patch its libc (UCX's memory hooks) and leaves its environment alone; destroying an
instance stops its progress thread."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHECK = textwrap.dedent(
    """
    import ctypes, os, threading
    libc = ctypes.CDLL("libc.so.6")

    def handlers():
        out = {}
        for sig in range(1, 32):
            buf = ctypes.create_string_buffer(256)  # struct sigaction: the handler comes first
            libc.sigaction(sig, None, buf)
            out[sig] = buf.raw[:8]
        return out

    libc_fns = ("mmap", "munmap", "mremap", "brk", "sbrk", "madvise", "shmat", "shmdt")

    def code():  # the first bytes of libc's memory functions: UCX's hooks would rewrite them
        return {n: ctypes.string_at(ctypes.cast(getattr(libc, n), ctypes.c_void_p).value, 16) for n in libc_fns}

    before, env, text = handlers(), dict(os.environ), code()
    threads = len(os.listdir("/proc/self/task"))
    from mori.core import transport as T
    from mori_backend_ucx import UcxTransport
    ops = UcxTransport().ops()
    a, b = T.open_transport(ops, "tls=sm,self"), T.open_transport(ops, "tls=tcp")
    buf = (ctypes.c_uint64 * 8)()
    mem = a.register(ctypes.addressof(buf), 64)
    ep = a.connect(a.address())
    rk = ep.unpack_rkey(mem.rkey)
    ep.atomic(T.OP_ADD, T.WORD_UINT64, 1, 0, mem.addr, rk).wait(10_000)
    assert buf[0] == 1
    during = len(os.listdir("/proc/self/task"))
    del rk, ep, mem, a, b
    import gc; gc.collect()
    after = len(os.listdir("/proc/self/task"))
    changed = [s for s, h in handlers().items() if h != before[s]]
    print("signals changed:", changed)
    print("libc patched:", [n for n, c in code().items() if c != text[n]])
    print("environment changed:", sorted(set(os.environ.items()) ^ set(env.items())))
    print("threads", threads, during, after)
    """
)


def test_no_signal_handler_or_environment_changes() -> None:
    r = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    lines = dict(line.split(":", 1) if ":" in line else (line, "") for line in r.stdout.splitlines())
    assert lines["signals changed"].strip() == "[]", r.stdout
    assert lines["environment changed"].strip() == "[]", r.stdout
    assert lines["libc patched"].strip() == "[]", r.stdout
    threads, during, after = (int(x) for x in r.stdout.split("threads ")[1].split())
    assert during >= threads + 2  # a progress thread per instance (and UCX's async thread)
    assert after <= during - 2, r.stdout  # both progress threads joined at destroy
