"""UMBP's configuration objects and enums, with the original's names, fields and defaults.

Every config is a mutable object with a fixed set of attributes (a misspelt attribute raises
:class:`AttributeError`, as the original's bindings do), so code written for the original, such as
SGLang's UMBP store (``cfg.ssd.io.queue_depth = ...``, ``cfg.copy_pipeline.worker_threads = ...``),
runs unchanged. :meth:`UMBPConfig.validate` checks types and ranges; :class:`mori.umbp.UMBPClient`
calls it before it touches anything.

Sizes are bytes, durations milliseconds unless a name says otherwise.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from typing import Any

from mori.umbp import env
from mori.umbp.errors import UMBPArgumentError, bad_arg

# ---------------------------------------------------------------------------------------------
# enums (values are the original's)
# ---------------------------------------------------------------------------------------------


class UMBPRole(enum.IntEnum):
    """Who writes the SSD tier when ranks of one host share it (MLA with TP > 1)."""

    Standalone = 0  #: this client owns its DRAM and SSD tiers
    SharedSSDLeader = 1  #: writes, and copies every DRAM write to the shared SSD tier
    SharedSSDFollower = 2  #: never writes; reads what the leader stored on the shared SSD tier


class UMBPSsdLayoutMode(enum.IntEnum):
    SegmentedLog = 1  #: append-only segments with per-record checksums


class UMBPIoBackend(enum.IntEnum):
    """How the SSD tier issues its reads and writes."""

    Posix = 0  #: pread/pwrite on a pool of threads
    IoUring = 1  #: io_uring where the kernel allows (this build uses the Posix path; see the guide)


class UMBPDurabilityMode(enum.IntEnum):
    Strict = 0  #: every completed put is on stable storage (fsync) before it is acknowledged
    Relaxed = 1  #: no fsync on the put path; ``flush()`` makes everything durable


class UMBPTierType(enum.IntEnum):
    Unknown = 0
    HBM = 1
    DRAM = 2
    SSD = 3


class UMBPDeploymentMode(enum.IntEnum):
    """What :meth:`mori.umbp.UMBPClient.get_deployment_mode` reports."""

    Local = 0  #: tiers in this process, no master
    StandaloneProcess = 1  #: a per-host server process (not in this build)
    Distributed = 2  #: local tiers plus a master and peers


class CacheRemoteAdmission(enum.IntEnum):
    """Which blocks fetched from a peer are kept in the local DRAM tier (``cache_remote_fetches``)."""

    SIZE = 0  #: blocks of at most ``admission_max_block_bytes`` when DRAM has room
    NEVER = 1
    ALWAYS = 2


class UMBPHostBufferBacking(enum.IntEnum):
    """Memory behind a :class:`mori.umbp.UMBPHostMemAllocator` buffer."""

    Anonymous = 0  #: private anonymous pages
    AnonymousHugetlb = 1  #: huge pages; demoted to Anonymous when the system has none free
    AnonymousShm = 2  #: POSIX shared memory (another process on the host can map it)


def _enum(func: str, name: str, value: Any, cls: type[enum.IntEnum]) -> None:
    if not isinstance(value, cls):
        raise bad_arg(func, name, value, f"a {cls.__name__} ({', '.join(m.name for m in cls)})")


def _int(func: str, name: str, value: Any, *, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise bad_arg(func, name, value, f"an int >= {minimum}")


def _bool(func: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise bad_arg(func, name, value, "True or False")


def _str(func: str, name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise bad_arg(func, name, value, "a str")


def _watermarks(func: str, prefix: str, high: Any, low: Any) -> None:
    for n, v in (("high_watermark", high), ("low_watermark", low)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise bad_arg(func, f"{prefix}.{n}", v, "a float")
    if not (0.0 < low < high <= 1.0):
        raise bad_arg(func, f"{prefix}.low_watermark/high_watermark", (low, high), "0 < low < high <= 1")


# ---------------------------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class UMBPDramConfig:
    """The DRAM tier: one pool of host memory that every object of this client lives in."""

    capacity_bytes: int = 4 << 30
    #: back the pool with POSIX shared memory named ``shm_name`` (another process can map it)
    use_shared_memory: bool = False
    shm_name: str = "/umbp_dram"
    high_watermark: float = 0.9
    low_watermark: float = 0.7
    use_hugepages: bool = False
    hugepage_size: int = 2 << 20
    #: touch every page at start, so no put takes a page fault (MAP_POPULATE)
    prefault: bool = True
    prefault_threads: int = 1
    #: fail instead of falling back to unbound memory when the NUMA binding fails
    numa_strict: bool = False
    _numa_nodes: list[int] = field(default_factory=list)

    @property
    def numa_nodes(self) -> list[int]:
        """NUMA nodes of the pool; ``[]`` is no binding. Ids are distinct and >= 0."""
        return list(self._numa_nodes)

    @numa_nodes.setter
    def numa_nodes(self, nodes: list[int]) -> None:
        nodes = list(nodes)
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in nodes) or len(
            set(nodes)
        ) != len(nodes):
            raise bad_arg("UMBPDramConfig", "numa_nodes", nodes, "distinct NUMA node ids >= 0")
        self._numa_nodes = nodes

    @property
    def numa_node(self) -> int:
        """The first NUMA node, ``-1`` for none (the original's single-node field)."""
        return self._numa_nodes[0] if self._numa_nodes else -1

    @numa_node.setter
    def numa_node(self, node: int) -> None:
        self.numa_nodes = [] if node == -1 else [node]


@dataclass(slots=True)
class UMBPHbmConfig:
    """The HBM tier (this build's addition; the original keeps HBM in its distributed peers):
    device memory of ``capacity_bytes`` from the GPU runtime ``device_runtime`` (a name from
    ``mori backends``; ``auto``: the usable GPU runtime of highest priority). 0 bytes: no HBM tier."""

    capacity_bytes: int = 0
    device_runtime: str = "auto"
    high_watermark: float = 0.9
    low_watermark: float = 0.7


@dataclass(slots=True)
class UMBPIoConfig:
    backend: UMBPIoBackend = UMBPIoBackend.IoUring
    #: most SSD operations in flight at once
    queue_depth: int = 4096


@dataclass(slots=True)
class UMBPDurabilityConfig:
    mode: UMBPDurabilityMode = UMBPDurabilityMode.Strict
    #: drop dead records of old segments in the background (segments are dropped whole here)
    enable_background_gc: bool = True


@dataclass(slots=True)
class UMBPSsdConfig:
    """The SSD tier: a segmented log under ``storage_dir``."""

    enabled: bool = True
    storage_dir: str = "/tmp/umbp_ssd"
    capacity_bytes: int = 32 << 30
    layout_mode: UMBPSsdLayoutMode = UMBPSsdLayoutMode.SegmentedLog
    segment_size_bytes: int = 256 << 20
    io: UMBPIoConfig = field(default_factory=UMBPIoConfig)
    durability: UMBPDurabilityConfig = field(default_factory=UMBPDurabilityConfig)
    high_watermark: float = 0.9
    low_watermark: float = 0.7
    #: "file" (this build); "spdk" / "spdk_proxy" need SPDK and fail when the tier is created
    ssd_backend: str = "file"
    spdk_bdev_name: str = ""
    spdk_reactor_mask: str = "0x1"
    spdk_mem_size_mb: int = 256
    spdk_nvme_pci_addr: str = ""
    spdk_nvme_ctrl_name: str = "NVMe0"
    spdk_io_workers: int = 4
    spdk_proxy_shm_name: str = "/umbp_spdk_proxy"
    spdk_proxy_tenant_id: int = 0
    spdk_proxy_tenant_quota_bytes: int = 0
    spdk_proxy_max_channels: int = 8
    spdk_proxy_data_per_channel_mb: int = 32
    spdk_proxy_bin: str = ""
    spdk_proxy_startup_timeout_ms: int = 30000
    spdk_proxy_auto_start: bool = True
    spdk_proxy_idle_exit_timeout_ms: int = 30000
    spdk_proxy_allow_borrow: bool = False
    spdk_proxy_reserved_shared_bytes: int = 0


@dataclass(slots=True)
class UMBPEvictionConfig:
    policy: str = "lru"
    #: least recently used objects looked at per eviction step
    candidate_window: int = 16
    #: a get served from SSD copies the object back into DRAM
    auto_promote_on_read: bool = True


@dataclass(slots=True)
class UMBPCopyPipelineConfig:
    """Background copies from DRAM to SSD (leader write-through, ``force_ssd_copy_on_write``)."""

    async_enabled: bool = True
    #: most copies waiting; a put beyond it copies synchronously instead of queueing
    queue_depth: int = 4096
    worker_threads: int = 2
    batch_max_ops: int = 128


@dataclass(slots=True)
class UMBPMasterClientConfig:
    master_address: str = ""
    node_id: str = ""
    node_address: str = ""
    auto_heartbeat: bool = True
    #: opaque ``key=value`` labels sent on registration
    tags: list[str] = field(default_factory=list)
    #: the master's shared secret; ``""`` reads ``UMBP_MASTER_AUTH_TOKEN``
    auth_token: str = ""


@dataclass(slots=True)
class UMBPIoEngineConfig:
    """Where this node's mori-io engine listens (peers read blocks from it)."""

    host: str = ""
    port: int = 0  #: 0: any free port
    #: the IO engines' shared secret; "" reads MORI_IO_AUTH_TOKEN (needed beyond loopback)
    auth_token: str = ""


@dataclass(slots=True)
class UMBPDistributedConfig:
    """Distributed mode: set ``UMBPConfig.distributed`` to one of these."""

    master_config: UMBPMasterClientConfig = field(default_factory=UMBPMasterClientConfig)
    io_engine: UMBPIoEngineConfig = field(default_factory=UMBPIoEngineConfig)
    #: host memory a fetch from a peer lands in when the destination is not registered
    staging_buffer_size: int = 64 << 20
    ranged_scratch_size: int = 0
    ssd_staging_buffer_size: int = 256 << 20
    ssd_staging_buffer_slots: int = 16
    #: port of this node's peer service (gRPC); 0: any free port
    peer_service_port: int = 0
    cache_remote_fetches: bool = True
    cache_remote_admission: CacheRemoteAdmission = CacheRemoteAdmission.SIZE
    admission_max_block_bytes: int = 16 << 20
    #: page size reported to the master; 0: the master's default
    dram_page_size: int = 0


@dataclass(slots=True)
class UMBPStandaloneProcessConfig:
    """Standalone-process mode (one UMBP server per host). Accepted; not in this build."""

    address: str = ""
    auto_start: bool = False
    startup_timeout_ms: int = 30000
    worker_node_address: str = ""
    worker_node_id: str = ""
    tags: list[str] = field(default_factory=list)


@dataclass(slots=True)
class UMBPConfig:
    """Everything a :class:`mori.umbp.UMBPClient` is built from."""

    dram: UMBPDramConfig = field(default_factory=UMBPDramConfig)
    hbm: UMBPHbmConfig = field(default_factory=UMBPHbmConfig)
    ssd: UMBPSsdConfig = field(default_factory=UMBPSsdConfig)
    eviction: UMBPEvictionConfig = field(default_factory=UMBPEvictionConfig)
    copy_pipeline: UMBPCopyPipelineConfig = field(default_factory=UMBPCopyPipelineConfig)
    role: UMBPRole = UMBPRole.Standalone
    #: the original's older spellings of ``role``: follower_mode -> SharedSSDFollower,
    #: force_ssd_copy_on_write -> SharedSSDLeader (``role`` wins when it is not Standalone)
    follower_mode: bool = False
    force_ssd_copy_on_write: bool = False
    distributed: UMBPDistributedConfig | None = None
    standalone_process: UMBPStandaloneProcessConfig | None = None
    #: allocation unit reported to a master; the local pool allocates at 64-byte granularity
    page_size: int = 2 << 20
    #: JSON tier policy of the original's standalone server (not in this build; must stay "")
    backend_policy_path: str = ""

    def resolve_role(self) -> UMBPRole:
        if self.role != UMBPRole.Standalone:
            return self.role
        if self.follower_mode:
            return UMBPRole.SharedSSDFollower
        if self.force_ssd_copy_on_write:
            return UMBPRole.SharedSSDLeader
        return UMBPRole.Standalone

    def validate(self) -> None:
        """Raise :class:`mori.umbp.errors.UMBPArgumentError` (a ValueError) naming the first bad field."""
        f = "UMBPConfig"
        d, s = self.dram, self.ssd
        _int(f, "dram.capacity_bytes", d.capacity_bytes, minimum=1)
        _bool(f, "dram.use_shared_memory", d.use_shared_memory)
        _str(f, "dram.shm_name", d.shm_name)
        _watermarks(f, "dram", d.high_watermark, d.low_watermark)
        _bool(f, "dram.use_hugepages", d.use_hugepages)
        _int(f, "dram.hugepage_size", d.hugepage_size, minimum=4096)
        if d.hugepage_size & (d.hugepage_size - 1):
            raise bad_arg(f, "dram.hugepage_size", d.hugepage_size, "a power of two")
        _bool(f, "dram.prefault", d.prefault)
        _int(f, "dram.prefault_threads", d.prefault_threads, minimum=1)
        _int(f, "hbm.capacity_bytes", self.hbm.capacity_bytes)
        if self.hbm.capacity_bytes:
            _str(f, "hbm.device_runtime", self.hbm.device_runtime)
            _watermarks(f, "hbm", self.hbm.high_watermark, self.hbm.low_watermark)
        _bool(f, "ssd.enabled", s.enabled)
        if s.enabled:
            _str(f, "ssd.storage_dir", s.storage_dir)
            if not s.storage_dir:
                raise bad_arg(f, "ssd.storage_dir", s.storage_dir, "a directory path")
            _int(f, "ssd.capacity_bytes", s.capacity_bytes, minimum=1)
            _int(f, "ssd.segment_size_bytes", s.segment_size_bytes, minimum=4096)
            _enum(f, "ssd.layout_mode", s.layout_mode, UMBPSsdLayoutMode)
            _enum(f, "ssd.io.backend", s.io.backend, UMBPIoBackend)
            _int(f, "ssd.io.queue_depth", s.io.queue_depth, minimum=1)
            _enum(f, "ssd.durability.mode", s.durability.mode, UMBPDurabilityMode)
            _watermarks(f, "ssd", s.high_watermark, s.low_watermark)
            if s.ssd_backend not in ("file", "spdk", "spdk_proxy", "dummy_storage"):
                raise bad_arg(f, "ssd.ssd_backend", s.ssd_backend, "file, spdk, spdk_proxy or dummy_storage")
            _int(f, "ssd.spdk_proxy_max_channels", s.spdk_proxy_max_channels, minimum=1)
        if self.eviction.policy != "lru":
            raise bad_arg(f, "eviction.policy", self.eviction.policy, "'lru'")
        _int(f, "eviction.candidate_window", self.eviction.candidate_window, minimum=1)
        _bool(f, "eviction.auto_promote_on_read", self.eviction.auto_promote_on_read)
        cp = self.copy_pipeline
        _bool(f, "copy_pipeline.async_enabled", cp.async_enabled)
        for name in ("queue_depth", "worker_threads", "batch_max_ops"):
            _int(f, f"copy_pipeline.{name}", getattr(cp, name), minimum=1)
        _enum(f, "role", self.role, UMBPRole)
        _int(f, "page_size", self.page_size, minimum=1)
        if self.distributed is not None:
            if not isinstance(self.distributed, UMBPDistributedConfig):
                raise bad_arg(f, "distributed", self.distributed, "a UMBPDistributedConfig or None")
            mc = self.distributed.master_config
            for name in ("master_address", "node_id", "node_address"):
                value = getattr(mc, name)
                if not isinstance(value, str) or not value:
                    raise bad_arg(f, f"distributed.master_config.{name}", value, "a non-empty str")
            _int(f, "distributed.staging_buffer_size", self.distributed.staging_buffer_size, minimum=4096)
            _int(f, "distributed.io_engine.port", self.distributed.io_engine.port)
            _enum(
                f,
                "distributed.cache_remote_admission",
                self.distributed.cache_remote_admission,
                CacheRemoteAdmission,
            )
        if self.distributed is not None and self.standalone_process is not None:
            raise UMBPArgumentError(
                "UMBPConfig: distributed and standalone_process are mutually exclusive; set one of them"
            )

    @staticmethod
    def from_environment() -> UMBPConfig:
        """The defaults overlaid with the ``UMBP_*`` variables (see :mod:`mori.umbp.env`).

        ``UMBP_ROLE`` unset: a local rank (``LOCAL_RANK``, ``OMPI_COMM_WORLD_LOCAL_RANK``,
        ``SLURM_LOCALID``, ``MPI_LOCALRANKID``) of 0 makes this a SharedSSDLeader, any other a
        SharedSSDFollower, as in the original. A variable that does not parse raises
        :class:`mori.core.errors.MoriValueError` (a ValueError) naming it.
        """
        cfg = UMBPConfig()
        d, s = cfg.dram, cfg.ssd

        def get(var: Any, current: Any) -> Any:
            value = var.get() if var.raw() is not None else None
            return current if value is None else value

        d.capacity_bytes = get(env.UMBP_DRAM_CAPACITY, d.capacity_bytes)
        d.high_watermark = get(env.UMBP_DRAM_HIGH_WM, d.high_watermark)
        d.low_watermark = get(env.UMBP_DRAM_LOW_WM, d.low_watermark)
        d.use_hugepages = get(env.UMBP_DRAM_USE_HUGEPAGES, d.use_hugepages)
        d.hugepage_size = get(env.UMBP_DRAM_HUGEPAGE_SIZE, d.hugepage_size)
        d.numa_nodes = get(env.UMBP_DRAM_NUMA_NODE, d.numa_nodes)
        d.numa_strict = get(env.UMBP_DRAM_NUMA_STRICT, d.numa_strict)
        d.prefault = get(env.UMBP_DRAM_PREFAULT, d.prefault)
        d.prefault_threads = get(env.UMBP_DRAM_PREFAULT_THREADS, d.prefault_threads)
        s.enabled = get(env.UMBP_SSD_ENABLED, s.enabled)
        s.storage_dir = get(env.UMBP_SSD_DIR, s.storage_dir)
        s.capacity_bytes = get(env.UMBP_SSD_CAPACITY, s.capacity_bytes)
        s.high_watermark = get(env.UMBP_SSD_HIGH_WM, s.high_watermark)
        s.low_watermark = get(env.UMBP_SSD_LOW_WM, s.low_watermark)
        s.ssd_backend = get(env.UMBP_SSD_BACKEND, s.ssd_backend)
        s.spdk_nvme_pci_addr = get(env.UMBP_SPDK_NVME_PCI, s.spdk_nvme_pci_addr)
        if env.UMBP_SSD_BACKEND.raw() is None and s.spdk_nvme_pci_addr:
            s.ssd_backend = "spdk"
        cfg.eviction.policy = get(env.UMBP_EVICTION_POLICY, cfg.eviction.policy)
        role = env.UMBP_ROLE.get()
        if role is not None:
            cfg.role = {
                "leader": UMBPRole.SharedSSDLeader,
                "follower": UMBPRole.SharedSSDFollower,
                "standalone": UMBPRole.Standalone,
            }[role]
        else:
            for name in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID"):
                text = os.environ.get(name)
                if text is not None:
                    try:
                        rank = int(text)
                    except ValueError:
                        raise UMBPArgumentError(
                            f"UMBPConfig.from_environment: {name}={text!r} is not a whole number"
                        ) from None
                    cfg.role = UMBPRole.SharedSSDLeader if rank == 0 else UMBPRole.SharedSSDFollower
                    break
        return cfg
