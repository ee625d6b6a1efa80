"""Options: every bad one is refused with a message naming the key, the value and what is allowed;
the documented limits hold."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

from mori.core import transport as T
from mori.core.errors import MoriBackendError, MoriValueError


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ("colour=blue", "unknown option 'colour'"),
        ("tls", "option 'tls' has no value"),
        ("=tcp", "has no key"),
        ("tls=", "option tls=''"),
        ("tls=tcp;tls=sm", "option tls is given twice"),
        ("progress_thread=maybe", "option progress_thread='maybe'"),
        ("max_requests=0", "option max_requests='0': expected an integer from 1"),
        ("max_endpoints=lots", "option max_endpoints='lots'"),
        ("connect_timeout_ms=-5", "option connect_timeout_ms='-5'"),
        ("keepalive_ms=1.5", "option keepalive_ms='1.5'"),
        ("error_handling=sometimes", "option error_handling='sometimes': expected none or peer"),
        ("UCX_TLS=tcp", "use tls"),
        ("UCX_ATOMIC_MODE=device", "UCX_ATOMIC_MODE"),
        ("UCX_NOT_A_SETTING=1", "option UCX_NOT_A_SETTING='1': UCX refused it"),
        ("UCX_RNDV_THRESH=banana", "option UCX_RNDV_THRESH='banana'"),
        ("tls=nosuchtransport", "option tls='nosuchtransport'"),
    ],
)
def test_bad_option_is_named(ops: Any, options: str, named: str) -> None:
    with pytest.raises(MoriValueError) as e:
        T.open_transport(ops, options)
    assert named in str(e.value)


def test_good_options_open(ops: Any) -> None:
    tp = T.open_transport(
        ops, " tls=tcp ; net_devices=lo;progress_thread=0;connect_timeout_ms=5000;UCX_RNDV_THRESH=64k;"
    )
    assert tp.name == "ucx" and len(tp.address()) > 64


def test_caps_say_what_this_ucx_does(ops: Any) -> None:
    caps = T.open_transport(ops, "").caps
    assert caps & T.CAP_RMA and caps & T.CAP_ATOMIC64 and caps & T.CAP_ATOMIC32 and caps & T.CAP_ATOMIC_NATIVE
    from mori_backend_ucx.transport import inventory

    assert bool(caps & T.CAP_CUDA_MEMORY) == ("cuda" in inventory().memory_types)
    assert not caps & T.CAP_ROCM_MEMORY  # the PyPI wheels have no ROCm
    # UCX_ATOMIC_MODE=cpu: the target's CPU executes atomics, and it cannot touch GPU memory
    assert not caps & T.CAP_DEVICE_ATOMIC


def test_gpu_memory_without_ucx_support_is_enotsup(ops: Any) -> None:
    tp = T.open_transport(ops, "")
    if tp.caps & T.CAP_CUDA_MEMORY:
        pytest.skip("this UCX supports CUDA memory here")
    buf = (ctypes.c_uint8 * 4096)()
    with pytest.raises(MoriBackendError) as e:
        tp.register(ctypes.addressof(buf), 4096, T.MEM_CUDA, 0)
    assert "cannot register cuda memory" in str(e.value) and "code -4" in str(e.value)
    with pytest.raises(MoriBackendError) as e:
        tp.register(ctypes.addressof(buf), 4096, T.MEM_ROCM, 0)
    assert "built without ROCm" in str(e.value)
    with pytest.raises(MoriValueError, match="host memory takes device -1"):
        tp.register(ctypes.addressof(buf), 4096, T.MEM_HOST, 0)


def test_max_requests_bounds_untested_requests(ops: Any) -> None:
    """Completed atomics keep their slot until tested (their old value is collected then); the
    table is bounded and says so, and testing frees slots."""
    a = T.open_transport(ops, "tls=sm,self;max_requests=4")
    b = T.open_transport(ops, "tls=sm,self")
    buf = (ctypes.c_uint64 * 8)()
    mem = b.register(ctypes.addressof(buf), 64)
    ep = a.connect(b.address())
    rk = ep.unpack_rkey(mem.rkey)
    held = [ep.atomic(T.OP_ADD, T.WORD_UINT64, 1, 0, mem.addr, rk) for _ in range(3)]  # + none pending
    fourth = ep.atomic(T.OP_ADD, T.WORD_UINT64, 1, 0, mem.addr, rk)
    with pytest.raises(MoriBackendError, match=r"max_requests=4"):
        ep.atomic(T.OP_ADD, T.WORD_UINT64, 1, 0, mem.addr, rk)
    for r in (*held, fourth):
        r.wait(10_000)
    assert sorted(r.old for r in (*held, fourth)) == [0, 1, 2, 3]
    ep.atomic(T.OP_ADD, T.WORD_UINT64, 1, 0, mem.addr, rk).wait(10_000)  # slots are free again
    assert buf[0] == 5


def test_max_endpoints(ops: Any) -> None:
    a = T.open_transport(ops, "tls=sm,self;max_endpoints=1")
    b = T.open_transport(ops, "tls=sm,self")
    keep = a.connect(b.address())
    with pytest.raises(MoriBackendError, match=r"max_endpoints=1"):
        a.connect(b.address())
    del keep
