"""GPU memory through host staging buffers in the TCP backend, with the test copier (its "device
memory" is host memory copied with memcpy), so the whole path runs on a CPU machine."""

from __future__ import annotations

import pytest
import torch

from mori.core import test_hooks
from mori.io import MemoryLocationType, StatusCode, TcpBackendConfig

GPU, CPU = MemoryLocationType.GPU, MemoryLocationType.CPU


def _register(engine, t: torch.Tensor, loc: MemoryLocationType):
    return engine.register_memory(t.data_ptr(), t.numel(), 0 if loc == GPU else -1, loc)


@pytest.fixture
def staged_pair(make):
    cfg = TcpBackendConfig(num_connections_per_peer=3, chunk_bytes=256 << 10)
    a, b = make("a", cfg), make("b", cfg)
    a.register_remote_engine(b.get_engine_desc())
    for e in (a, b):
        test_hooks.install_copier(e._native)
    return a, b


@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize(
    ("lloc", "rloc"), [(GPU, CPU), (CPU, GPU), (GPU, GPU)], ids=["gpu-cpu", "cpu-gpu", "gpu-gpu"]
)
@pytest.mark.parametrize(("count", "size"), [(1, 8), (1, (3 << 20) + 5), (64, 4096)])
def test_staged_transfers_are_byte_exact(staged_pair, op, lloc, rloc, count, size) -> None:
    a, b = staged_pair
    n = 8 << 20
    x = torch.randint(0, 256, (n,), dtype=torch.uint8)
    y = torch.randint(0, 256, (n,), dtype=torch.uint8)
    mx, my = _register(a, x, lloc), _register(b, y, rloc)
    assert a._route_name(mx, my) == "tcp"  # never attach: device memory cannot be attached
    before_x, before_y = x.clone(), y.clone()
    offs = [(i * 2 + 1) * size for i in range(count)] if count > 1 else [17]
    sess = a.create_session(mx, my)
    if count == 1:
        st = getattr(sess, op)(offs[0], offs[0] + 3, size, 1)
        blocks = [(offs[0], offs[0] + 3, size)]
    else:
        st = getattr(sess, f"batch_{op}")(offs, offs, [size] * count, 1)
        blocks = [(o, o, size) for o in offs]
    assert st.WaitFor(60_000) and st.Succeeded(), st.Message()
    ex, ey = before_x.clone(), before_y.clone()
    for lo, ro, sz in blocks:
        if op == "write":
            ey[ro : ro + sz] = before_x[lo : lo + sz]
        else:
            ex[lo : lo + sz] = before_y[ro : ro + sz]
    assert torch.equal(x, ex) and torch.equal(y, ey)
    staged = a._counters()["staged_bytes"] + b._counters()["staged_bytes"]
    assert staged >= count * size * (2 if (lloc, rloc) == (GPU, GPU) else 1)
    assert b._counters()["served_cma"] == 0


def test_without_a_copier_gpu_memory_is_refused_on_both_sides(make, monkeypatch) -> None:
    from mori.core.errors import MoriBackendError
    from mori.io import xgmi

    def no_runtime():
        raise MoriBackendError("no usable GPU runtime (this test)")

    # as on a machine without a GPU runtime: registering GPU memory installs no copier
    monkeypatch.setattr(xgmi, "find_gpu_runtime", no_runtime)
    a, b = make("a"), make("b")
    a.register_remote_engine(b.get_engine_desc())
    x, y = torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    test_hooks.install_copier(a._native)  # the initiator could stage, the target cannot
    st = a.write(_register(a, x, CPU), 0, _register(b, y, GPU), 0, 8, 1)
    assert st.WaitFor(30_000) and st.Code() == StatusCode.ERR_INVALID_ARGS
    assert "no device copier" in st.Message()
    assert not b._native.has_device_copier()


@pytest.mark.parametrize("side", ["initiator", "target"])
@pytest.mark.parametrize("op", ["write", "read"])
def test_failing_device_copies_report_err_gpu_op(make, side: str, op: str) -> None:
    a, b = make("a"), make("b")
    a.register_remote_engine(b.get_engine_desc())
    test_hooks.install_copier(a._native, fail=side == "initiator")
    test_hooks.install_copier(b._native, fail=side == "target")
    x, y = torch.ones(4096, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)
    local, remote = (GPU, CPU) if side == "initiator" else (CPU, GPU)
    st = getattr(a, op)(_register(a, x, local), 0, _register(b, y, remote), 0, 4096, 1)
    assert st.WaitFor(30_000) and st.Code() == StatusCode.ERR_GPU_OP, st.Message()
    assert "device" in st.Message()
    # the connection survives a failed copy
    ok = a.write(_register(a, x, CPU), 0, _register(b, y, CPU), 0, 4096, 2)
    assert ok.WaitFor(30_000) and ok.Succeeded(), ok.Message()


def test_set_device_copier_checks_its_argument(make) -> None:
    import ctypes

    a = make("a")
    with pytest.raises(TypeError):
        a._native.set_device_copier(object())
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    buf = ctypes.create_string_buffer(64)  # zeroed: a DeviceCopier with null functions
    with pytest.raises(ValueError, match=r"named 'mori\.io\.DeviceCopier'"):
        a._native.set_device_copier(new_capsule(ctypes.addressof(buf), b"something.else", None))
    with pytest.raises(ValueError, match="null functions"):
        a._native.set_device_copier(new_capsule(ctypes.addressof(buf), b"mori.io.DeviceCopier", None))
    assert not a._native.has_device_copier()
