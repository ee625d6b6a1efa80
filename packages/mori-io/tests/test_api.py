"""The public surface: names, enums, configs, descriptors, backends, argument errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import mori.io
from mori.core.errors import MoriBackendError, MoriStateError, MoriTypeError, MoriValueError
from mori.io import (
    BackendType,
    EngineDesc,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    PollCqMode,
    RdmaBackendConfig,
    StatusCode,
    TcpBackendConfig,
    TransferStatus,
    XgmiBackendConfig,
)

SPEC_NAMES = {
    "IOEngine",
    "IOEngineConfig",
    "IOEngineSession",
    "TransferStatus",
    "BackendType",
    "MemoryLocationType",
    "StatusCode",
    "PollCqMode",
    "RdmaBackendConfig",
    "XgmiBackendConfig",
    "FabricBackendConfig",
    "EngineDesc",
    "MemoryDesc",
    "set_log_level",
}


def test_public_names_cover_the_spec() -> None:
    assert set(mori.io.__all__) >= SPEC_NAMES
    for name in mori.io.__all__:
        assert getattr(mori.io, name) is not None


def test_enum_members() -> None:
    assert [m.name for m in BackendType] == ["Unknown", "XGMI", "RDMA", "TCP", "FABRIC"]
    assert [m.name for m in MemoryLocationType] == ["Unknown", "CPU", "GPU"]
    assert [m.name for m in PollCqMode] == ["POLLING", "EVENT"]
    assert list(StatusCode.__members__) == [
        "SUCCESS",
        "INIT",
        "IN_PROGRESS",
        "ERR_INVALID_ARGS",
        "ERR_NOT_FOUND",
        "ERR_RDMA_OP",
        "ERR_BAD_STATE",
        "ERR_GPU_OP",
    ]


def test_engine_desc_pack_roundtrip_and_equality() -> None:
    with IOEngine("desc", IOEngineConfig("127.0.0.1", 0)) as e:
        d = e.get_engine_desc()
        assert d.port > 0 and d.host == "127.0.0.1" and d.key == "desc"
        assert EngineDesc.unpack(d.pack()) == d
        assert EngineDesc.unpack(d.pack()) != EngineDesc(**{**d.__dict__, "port": d.port + 1})
        x = torch.zeros(64, dtype=torch.uint8)
        m = e.register_torch_tensor(x)
        assert (
            m.data == x.data_ptr() and m.size == 64 and m.loc == MemoryLocationType.CPU and m.device_id == -1
        )
        assert MemoryDesc.unpack(m.pack()) == m


def test_port_zero_picks_distinct_free_ports() -> None:
    with (
        IOEngine("p1", IOEngineConfig("127.0.0.1", 0)) as a,
        IOEngine("p2", IOEngineConfig("127.0.0.1", 0)) as b,
    ):
        assert a.get_engine_desc().port != b.get_engine_desc().port
        port = a.get_engine_desc().port
        with pytest.raises(MoriBackendError, match="cannot listen"):
            IOEngine("p3", IOEngineConfig("127.0.0.1", port))


def test_node_id_comes_from_mori_node_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MORI_NODE_ID", "rack1-node9")
    with IOEngine("n", IOEngineConfig("127.0.0.1", 0)) as e:
        assert e.get_engine_desc().node_id == "rack1-node9"


@pytest.mark.parametrize(
    "data", [b"", b"\xc1", b"not msgpack at all", EngineDesc("k", "n", "h", "x", 1, 2).pack()[:-1]]
)
def test_unpack_rejects_garbage(data: bytes) -> None:
    with pytest.raises(MoriValueError, match="unpack"):
        EngineDesc.unpack(data)


def test_unpack_rejects_wrong_field_types() -> None:
    import msgpack

    with pytest.raises(MoriValueError, match="field port"):
        EngineDesc.unpack(msgpack.packb(["k", "n", "h", "x", "not-a-port", 2]))
    with pytest.raises(MoriValueError, match="expected 9 fields"):
        MemoryDesc.unpack(EngineDesc("k", "n", "h", "x", 1, 2).pack())
    with pytest.raises(MoriTypeError, match="data"):
        MemoryDesc.unpack("text")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [
        ({"port": -1}, "port"),
        ({"port": 70000}, "port"),
        ({"host": 5}, "host"),
    ],
)
def test_engine_config_rejects_bad_values(kwargs: dict[str, object], arg: str) -> None:
    with pytest.raises((MoriValueError, MoriTypeError), match=f"IOEngineConfig: {arg}"):
        IOEngineConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [
        ({"num_connections_per_peer": 0}, "num_connections_per_peer"),
        ({"chunk_bytes": 100}, "chunk_bytes"),
        ({"socket_buffer_bytes": -1}, "socket_buffer_bytes"),
        ({"enable_cma": 1}, "enable_cma"),
    ],
)
def test_tcp_config_rejects_bad_values(kwargs: dict[str, object], arg: str) -> None:
    with pytest.raises((MoriValueError, MoriTypeError), match=f"TcpBackendConfig: {arg}"):
        TcpBackendConfig(**kwargs)  # type: ignore[arg-type]


def test_spec_configs_have_the_spec_defaults() -> None:
    r = RdmaBackendConfig()
    assert (r.qp_per_transfer, r.post_batch_size, r.num_worker_threads, r.poll_cq_mode) == (
        1,
        -1,
        -1,
        PollCqMode.POLLING,
    )
    assert (r.enable_notification, r.notif_per_qp, r.enable_transfer_chunking) == (True, 1024, False)
    assert (r.chunk_bytes, r.max_chunks_per_transfer, r.num_nics_per_transfer) == (65536, 64, 1)
    assert (XgmiBackendConfig().num_streams, XgmiBackendConfig().num_events) == (64, 64)


def test_create_backend_errors() -> None:
    with IOEngine("be", IOEngineConfig("127.0.0.1", 0)) as e:
        with pytest.raises(MoriBackendError, match="FABRIC backend is not available"):
            e.create_backend(BackendType.FABRIC)
        with pytest.raises(MoriTypeError, match=r"config.*RdmaBackendConfig"):
            e.create_backend(BackendType.RDMA, XgmiBackendConfig())
        with pytest.raises(MoriValueError, match="type"):
            e.create_backend(BackendType.Unknown)
        with pytest.raises(MoriTypeError, match="type"):
            e.create_backend("TCP")  # type: ignore[arg-type]
        with pytest.raises(MoriTypeError, match="config"):
            e.create_backend(BackendType.TCP, RdmaBackendConfig())
        e.create_backend(BackendType.TCP)
        with pytest.raises(MoriStateError, match="already exists"):
            e.create_backend(BackendType.TCP)
        e.remove_backend(BackendType.TCP)
        with pytest.raises(MoriValueError, match="a created backend"):
            e.remove_backend(BackendType.TCP)


def test_backend_whose_module_is_missing_says_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    from mori.io import backend_api

    monkeypatch.setattr(backend_api, "backend_modules", lambda: {"XGMI": "mori_io_no_such_backend_module"})
    monkeypatch.setattr("mori.io.engine.backend_modules", backend_api.backend_modules)
    with (
        IOEngine("x", IOEngineConfig("127.0.0.1", 0)) as e,
        pytest.raises(MoriBackendError, match="XGMI backend is not installed"),
    ):
        e.create_backend(BackendType.XGMI)


def test_register_memory_errors() -> None:
    with IOEngine("reg", IOEngineConfig("127.0.0.1", 0)) as e:
        with pytest.raises(MoriValueError, match="register_memory: ptr"):
            e.register_memory(0, 10, -1, MemoryLocationType.CPU)
        with pytest.raises(MoriValueError, match="register_memory: size"):
            e.register_memory(4096, 0, -1, MemoryLocationType.CPU)
        with pytest.raises(MoriTypeError, match="register_memory: size"):
            e.register_memory(4096, 1.5, -1, MemoryLocationType.CPU)  # type: ignore[arg-type]
        with pytest.raises(MoriValueError, match="mem_loc"):
            e.register_memory(4096, 10, -1, MemoryLocationType.Unknown)
        with pytest.raises(MoriValueError, match="contiguous"):
            e.register_torch_tensor(torch.zeros(8, 8)[:, 0])
        with pytest.raises(MoriTypeError, match=r"torch\.Tensor"):
            e.register_torch_tensor([1, 2, 3])
        m = e.register_torch_tensor(torch.zeros(8))
        e.deregister_memory(m)
        with pytest.raises(MoriValueError, match=r"desc\.id"):
            e.deregister_memory(m)
        with pytest.raises(MoriValueError, match="engine_key"):
            e.deregister_memory(MemoryDesc(**{**m.__dict__, "engine_key": "other"}))


def test_engine_key_and_config_are_checked() -> None:
    with pytest.raises(MoriValueError, match="IOEngine: key"):
        IOEngine("", IOEngineConfig())
    with pytest.raises(MoriTypeError, match="IOEngine: config"):
        IOEngine("k", ("127.0.0.1", 0))  # type: ignore[arg-type]


def test_shut_down_engine_refuses_work() -> None:
    e = IOEngine("closed", IOEngineConfig("127.0.0.1", 0))
    e.shutdown()
    e.shutdown()
    with pytest.raises(MoriStateError, match="shut down"):
        e.register_memory(4096, 1, -1, MemoryLocationType.CPU)


def test_set_log_level() -> None:
    from mori.core import transfer

    mori.io.set_log_level("DEBUG")
    assert transfer.get_log_level() == 10
    mori.io.set_log_level(40)
    assert transfer.get_log_level() == 40
    mori.io.set_log_level("warning")
    with pytest.raises(MoriValueError, match="level"):
        mori.io.set_log_level("loud")


def test_status_lifecycle_for_python_backends() -> None:
    st = TransferStatus()
    assert st.Init() and not st.InProgress() and not st.WaitFor(0)
    st.set_in_progress()
    assert st.InProgress() and not st.WaitFor(10)
    assert st.complete(int(StatusCode.ERR_GPU_OP), "copy failed")
    assert not st.complete(int(StatusCode.SUCCESS))
    assert st.Failed() and st.Code() == StatusCode.ERR_GPU_OP and st.Message() == "copy failed"
    assert "ERR_GPU_OP" in repr(st)


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("MORI_IO_CP_TIMEOUT_MS", "0"),
        ("MORI_IO_LOG_LEVEL", "loud"),
        ("MORI_IO_CHUNK_BYTES", "x"),
        ("MORI_IO_CMA_THREADS", "0"),
        ("MORI_IO_CMA_THREADS", "65"),
        ("MORI_IO_CMA_SPLIT_BYTES", "4095"),
        ("MORI_IO_CMA_SPLIT_BYTES", "2G"),
        ("MORI_IO_CMA_SPLIT_BYTES", "big"),
    ],
)
def test_bad_environment_names_the_variable(monkeypatch: pytest.MonkeyPatch, var: str, value: str) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(MoriValueError, match=var):
        e = IOEngine("env", IOEngineConfig("127.0.0.1", 0))
        try:
            e.create_backend(BackendType.TCP)
        finally:
            e.shutdown()


def test_mori_env_lists_the_io_variables() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "from mori.core.cli import main; raise SystemExit(main(['env']))"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    for name in ("MORI_IO_CP_TIMEOUT_MS", "MORI_IO_AUTH_TOKEN", "MORI_IO_CHUNK_BYTES"):
        assert name in out.stdout, out.stdout + out.stderr
