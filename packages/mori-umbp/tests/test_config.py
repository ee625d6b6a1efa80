"""Config objects and enums: the original's names, fields, defaults and environment overlay."""

from __future__ import annotations

import pytest

import mori.cpp
import mori.umbp as umbp
from mori.core.errors import MoriValueError


def test_defaults_are_the_originals() -> None:
    cfg = umbp.UMBPConfig()
    assert cfg.dram.capacity_bytes == 4 << 30
    assert (cfg.dram.high_watermark, cfg.dram.low_watermark) == (0.9, 0.7)
    assert cfg.dram.use_shared_memory is False and cfg.dram.prefault is True
    assert cfg.ssd.enabled is True and cfg.ssd.storage_dir == "/tmp/umbp_ssd"
    assert cfg.ssd.capacity_bytes == 32 << 30 and cfg.ssd.segment_size_bytes == 256 << 20
    assert cfg.ssd.io.backend == umbp.UMBPIoBackend.IoUring and cfg.ssd.io.queue_depth == 4096
    assert cfg.ssd.durability.mode == umbp.UMBPDurabilityMode.Strict
    assert cfg.ssd.ssd_backend == "file"
    assert cfg.eviction.policy == "lru" and cfg.eviction.candidate_window == 16
    assert cfg.eviction.auto_promote_on_read is True
    cp = cfg.copy_pipeline
    assert (cp.async_enabled, cp.queue_depth, cp.worker_threads, cp.batch_max_ops) == (True, 4096, 2, 128)
    assert cfg.role == umbp.UMBPRole.Standalone and cfg.distributed is None and cfg.standalone_process is None
    d = umbp.UMBPDistributedConfig()
    assert d.staging_buffer_size == 64 << 20 and d.cache_remote_fetches is True
    assert d.cache_remote_admission == umbp.CacheRemoteAdmission.SIZE and d.dram_page_size == 0
    assert d.master_config.auto_heartbeat is True and d.io_engine.port == 0


def test_enum_values_are_the_originals() -> None:
    assert [int(t) for t in umbp.UMBPTierType] == [0, 1, 2, 3]
    assert [t.name for t in umbp.UMBPTierType] == ["Unknown", "HBM", "DRAM", "SSD"]
    assert int(umbp.UMBPRole.SharedSSDLeader) == 1 and int(umbp.UMBPRole.SharedSSDFollower) == 2
    assert int(umbp.UMBPDurabilityMode.Relaxed) == 1 and int(umbp.UMBPIoBackend.Posix) == 0
    assert umbp.UMBPDeploymentMode.StandaloneProcess.name == "StandaloneProcess"


def test_every_field_sglang_sets_exists() -> None:
    """The attributes SGLang's UMBPStore assigns (python/sglang/srt/mem_cache/storage/umbp/umbp_store.py)."""
    cfg = umbp.UMBPConfig.from_environment()
    for path in [
        "dram.capacity_bytes", "ssd.enabled", "ssd.storage_dir", "ssd.capacity_bytes",
        "copy_pipeline.async_enabled", "copy_pipeline.queue_depth", "ssd.segment_size_bytes",
        "copy_pipeline.batch_max_ops", "ssd.io.queue_depth", "copy_pipeline.worker_threads",
        "eviction.auto_promote_on_read", "eviction.policy", "eviction.candidate_window", "ssd.io.backend",
        "ssd.durability.mode", "ssd.ssd_backend", "ssd.spdk_nvme_pci_addr", "ssd.spdk_proxy_shm_name",
        "ssd.spdk_proxy_startup_timeout_ms", "ssd.spdk_proxy_bin", "ssd.spdk_proxy_tenant_id",
        "ssd.spdk_proxy_tenant_quota_bytes", "ssd.spdk_proxy_max_channels", "ssd.spdk_proxy_data_per_channel_mb",
        "ssd.spdk_proxy_auto_start", "ssd.spdk_proxy_idle_exit_timeout_ms", "ssd.spdk_proxy_allow_borrow",
        "ssd.spdk_proxy_reserved_shared_bytes", "ssd.high_watermark", "ssd.low_watermark", "role",
    ]:  # fmt: skip
        obj = cfg
        *parents, leaf = path.split(".")
        for p in parents:
            obj = getattr(obj, p)
        setattr(obj, leaf, getattr(obj, leaf))
    dist = umbp.UMBPDistributedConfig()
    for path in [
        "master_config.master_address", "master_config.node_address", "master_config.node_id",
        "master_config.tags", "master_config.auto_heartbeat", "io_engine.host", "io_engine.port",
        "staging_buffer_size", "ranged_scratch_size", "ssd_staging_buffer_size", "ssd_staging_buffer_slots",
        "peer_service_port", "cache_remote_fetches", "dram_page_size",
    ]:  # fmt: skip
        obj = dist
        *parents, leaf = path.split(".")
        for p in parents:
            obj = getattr(obj, p)
        setattr(obj, leaf, getattr(obj, leaf))
    sp = umbp.UMBPStandaloneProcessConfig()
    for name in (
        "address",
        "auto_start",
        "startup_timeout_ms",
        "worker_node_address",
        "worker_node_id",
        "tags",
    ):
        assert hasattr(sp, name)


def test_a_misspelt_field_raises_instead_of_being_ignored() -> None:
    cfg = umbp.UMBPConfig()
    with pytest.raises(AttributeError):
        cfg.dram.capacity = 1  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        cfg.ssd.io.depth = 1  # type: ignore[attr-defined]


def test_from_environment_overlays_the_original_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID", "UMBP_ROLE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("UMBP_DRAM_CAPACITY", "64M")
    monkeypatch.setenv("UMBP_SSD_ENABLED", "0")
    monkeypatch.setenv("UMBP_SSD_DIR", "/nvme/x")
    monkeypatch.setenv("UMBP_DRAM_HIGH_WM", "0.8")
    cfg = umbp.UMBPConfig.from_environment()
    assert cfg.dram.capacity_bytes == 64 << 20 and cfg.ssd.enabled is False
    assert cfg.ssd.storage_dir == "/nvme/x" and cfg.dram.high_watermark == 0.8
    assert cfg.role == umbp.UMBPRole.Standalone
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert umbp.UMBPConfig.from_environment().role == umbp.UMBPRole.SharedSSDLeader
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert umbp.UMBPConfig.from_environment().role == umbp.UMBPRole.SharedSSDFollower
    monkeypatch.setenv("UMBP_ROLE", "standalone")
    assert umbp.UMBPConfig.from_environment().role == umbp.UMBPRole.Standalone
    monkeypatch.setenv("UMBP_SPDK_NVME_PCI", "0000:47:00.0")
    assert umbp.UMBPConfig.from_environment().ssd.ssd_backend == "spdk"


def test_from_environment_names_a_bad_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UMBP_DRAM_CAPACITY", "lots")
    with pytest.raises(MoriValueError, match="UMBP_DRAM_CAPACITY"):
        umbp.UMBPConfig.from_environment()


def test_numa_config_environment_and_properties(monkeypatch: pytest.MonkeyPatch) -> None:
    """The original's allocator test of the NUMA fields, unchanged in substance."""
    monkeypatch.setenv("UMBP_DRAM_NUMA_NODE", "0,1")
    monkeypatch.setenv("UMBP_DRAM_NUMA_STRICT", "1")
    monkeypatch.setenv("UMBP_DRAM_PREFAULT_THREADS", "4")
    cfg = umbp.UMBPConfig.from_environment()
    assert cfg.dram.numa_nodes == [0, 1] and cfg.dram.numa_strict and cfg.dram.prefault_threads == 4
    cfg.dram.numa_node = 1
    assert cfg.dram.numa_nodes == [1]
    cfg.dram.numa_node = -1
    assert cfg.dram.numa_nodes == [] and cfg.dram.numa_node == -1
    with pytest.raises(ValueError):
        cfg.dram.numa_nodes = [0, 0]
    monkeypatch.setenv("UMBP_DRAM_NUMA_NODE", "0,-1")
    with pytest.raises(ValueError):
        umbp.UMBPConfig.from_environment()


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("dram.capacity_bytes", 0, "dram.capacity_bytes"),
        ("dram.low_watermark", 0.95, "watermark"),
        ("ssd.segment_size_bytes", 0, "ssd.segment_size_bytes"),
        ("ssd.ssd_backend", "tape", "ssd.ssd_backend"),
        ("copy_pipeline.worker_threads", 0, "copy_pipeline.worker_threads"),
        ("eviction.policy", "fifo", "eviction.policy"),
        ("role", 7, "role"),
    ],
)
def test_validate_names_the_bad_field(field: str, value: object, match: str) -> None:
    cfg = umbp.UMBPConfig()
    obj = cfg
    *parents, leaf = field.split(".")
    for p in parents:
        obj = getattr(obj, p)
    setattr(obj, leaf, value)
    with pytest.raises(ValueError, match=match):
        cfg.validate()


def test_distributed_needs_address_node_id_and_node_address() -> None:
    cfg = umbp.UMBPConfig()
    cfg.distributed = umbp.UMBPDistributedConfig()
    with pytest.raises(ValueError, match="master_address"):
        cfg.validate()


def test_mori_cpp_reexports_the_same_objects() -> None:
    for name in ("UMBPClient", "UMBPConfig", "UMBPDistributedConfig", "UMBPMasterClient", "UMBPTierType",
                 "UMBPExternalKvNodeMatch", "UMBPExternalKvHitCountEntry", "UMBPHostMemAllocator"):  # fmt: skip
        assert getattr(mori.cpp, name) is getattr(umbp, name)
