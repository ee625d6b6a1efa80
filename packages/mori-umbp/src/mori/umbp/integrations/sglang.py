"""An SGLang HiCache storage backend (L3) on UMBP: :class:`UMBPHiCacheStorage`.

SGLang loads it through its dynamic backend option, without a change to SGLang::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "mori_umbp",
            "module_path": "mori.umbp.integrations.sglang", "class_name": "UMBPHiCacheStorage",
            "dram_capacity_bytes": 34359738368, "ssd_storage_dir": "/nvme/umbp"}'

(SGLang's built-in ``--hicache-storage-backend mori`` imports ``mori.umbp`` through its own
``UMBPStore``; that path works too, since this package keeps the original's API.)

It implements SGLang's ``HiCacheStorage`` interface: ``get``/``set``/``exists``/``batch_get``/
``batch_set``/``batch_exists`` and the zero-copy v1 path ``batch_get_v1``/``batch_set_v1`` over
the registered host KV pool (``mem_pool_host.get_page_buffer_meta(indices)`` gives one pointer
and size per page component: K and V for MHA, one for MLA). Keys get a per-rank suffix so TP
ranks never collide: ``{page_hash}_{tp_rank}_k`` / ``_v`` for MHA, ``{page_hash}_k`` for MLA
(one copy serves every rank). A page counts as present only when all its components are.

``extra_config`` keys (all optional): ``dram_capacity_bytes``, ``ssd_enabled``,
``ssd_storage_dir`` (a per-rank subdirectory is added), ``ssd_capacity_bytes``,
``ssd_durability_mode`` (strict|relaxed), and for distributed mode ``master_address``,
``node_id``, ``node_address``, ``io_engine_host``, ``io_engine_port``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from mori.umbp.client import UMBPClient
from mori.umbp.config import UMBPConfig, UMBPDistributedConfig, UMBPDurabilityMode, UMBPRole
from mori.umbp.errors import bad_arg

log = logging.getLogger("mori.umbp.sglang")

_LAYOUTS = ("page_first", "page_first_direct", "page_head")


def _bool(key: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    t = str(v).strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise bad_arg(
        "UMBPHiCacheStorage", f"extra_config[{key!r}]", v, "a boolean (true/false, 1/0, yes/no, on/off)"
    )


def _ptr_size(target: Any, size: Any, what: str) -> tuple[int, int]:
    """A (pointer, bytes) from a torch tensor or from an explicit pointer and size."""
    if hasattr(target, "data_ptr") and hasattr(target, "element_size"):
        if not target.is_contiguous():
            raise bad_arg("UMBPHiCacheStorage", what, "<non-contiguous tensor>", "a contiguous tensor")
        return int(target.data_ptr()), int(target.numel() * target.element_size())
    return int(target), int(size)


class UMBPHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """HiCache L3 storage on a :class:`mori.umbp.UMBPClient` (one per SGLang worker process)."""

    def __init__(self, storage_config: HiCacheStorageConfig | None = None, mem_pool_host: Any = None) -> None:
        # SGLang's dynamic loader passes its **kwargs dict as the second argument, and registers
        # the host pool afterwards with register_mem_pool_host.
        if isinstance(mem_pool_host, dict):
            mem_pool_host = None
        extra: dict[str, Any] = dict(getattr(storage_config, "extra_config", None) or {})
        self.tp_rank = int(getattr(storage_config, "tp_rank", 0) or 0)
        self.tp_size = int(getattr(storage_config, "tp_size", 1) or 1)
        self.pp_rank = int(getattr(storage_config, "pp_rank", 0) or 0)
        self.pp_size = int(getattr(storage_config, "pp_size", 1) or 1)
        self.is_mla = bool(getattr(storage_config, "is_mla_model", False))
        self.mla_follower = self.is_mla and self.tp_rank != 0  # one rank stores an MLA page for all
        cfg = UMBPConfig.from_environment()
        cfg.role = UMBPRole.Standalone  # the engine's ranks are separate caches, not a shared SSD
        if "dram_capacity_bytes" in extra:
            cfg.dram.capacity_bytes = int(extra["dram_capacity_bytes"])
        if "ssd_enabled" in extra:
            cfg.ssd.enabled = _bool("ssd_enabled", extra["ssd_enabled"])
        if "ssd_storage_dir" in extra:
            cfg.ssd.storage_dir = str(extra["ssd_storage_dir"])
        if "ssd_capacity_bytes" in extra:
            cfg.ssd.capacity_bytes = int(extra["ssd_capacity_bytes"])
        if "ssd_durability_mode" in extra:
            mode = str(extra["ssd_durability_mode"]).strip().lower()
            if mode not in ("strict", "sync", "relaxed", "async"):
                raise bad_arg(
                    "UMBPHiCacheStorage", "extra_config['ssd_durability_mode']", mode, "strict or relaxed"
                )
            cfg.ssd.durability.mode = (
                UMBPDurabilityMode.Strict if mode in ("strict", "sync") else UMBPDurabilityMode.Relaxed
            )
        if cfg.ssd.enabled and (self.tp_size > 1 or self.pp_size > 1):
            cfg.ssd.storage_dir = os.path.join(cfg.ssd.storage_dir, f"pp{self.pp_rank}_tp{self.tp_rank}")
        master = extra.get("master_address") or os.environ.get("UMBP_MASTER_ADDRESS")
        if master:
            d = UMBPDistributedConfig()
            d.master_config.master_address = str(master)
            node_address = str(
                extra.get("node_address") or os.environ.get("UMBP_NODE_ADDRESS") or "127.0.0.1"
            )
            d.master_config.node_address = node_address
            d.master_config.node_id = str(
                extra.get("node_id") or f"{node_address}:pp{self.pp_rank}:tp{self.tp_rank}:{os.getpid()}"
            )
            d.io_engine.host = str(extra.get("io_engine_host") or "127.0.0.1")
            if "io_engine_port" in extra:
                d.io_engine.port = int(extra["io_engine_port"]) + self.tp_rank
            cfg.distributed = d
        self.client: UMBPClient | None = UMBPClient(cfg)
        self.suffix = (
            ""
            if self.is_mla
            else f"_{self.tp_rank}"
            if self.pp_size == 1
            else f"_{self.tp_rank}_{self.pp_rank}"
        )
        self._registered_ptr = 0
        if mem_pool_host is not None:
            self.register_mem_pool_host(mem_pool_host)

    # -- host pool -------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        layout = getattr(mem_pool_host, "layout", "page_first")
        if layout not in _LAYOUTS:
            raise bad_arg("UMBPHiCacheStorage.register_mem_pool_host", "mem_pool_host.layout", layout,
                          f"one of {', '.join(_LAYOUTS)} (zero-copy pages)")  # fmt: skip
        super().register_mem_pool_host(mem_pool_host)
        buf = getattr(mem_pool_host, "kv_buffer", None)
        if (
            self.client is not None
            and self.client.is_distributed()
            and buf is not None
            and hasattr(buf, "data_ptr")
        ):
            storage = buf.untyped_storage()
            ptr, size = int(storage.data_ptr()), int(storage.nbytes())
            if self.client.register_memory(ptr, size):  # fetches from peers land in it directly
                self._registered_ptr = ptr

    def _parts(self) -> tuple[str, ...]:
        return ("k",) if self.is_mla else ("k", "v")

    def _keys(self, keys: list[str]) -> list[str]:
        return [f"{k}{self.suffix}_{p}" for k in keys for p in self._parts()]

    def _meta(self, keys: list[str], host_indices: Any) -> tuple[list[str], list[int], list[int]]:
        pool = self.mem_pool_host
        if len(host_indices) != len(keys) * pool.page_size:
            raise bad_arg("UMBPHiCacheStorage", "host_indices", f"<{len(host_indices)} indices>",
                          f"{len(keys)} keys x page_size {pool.page_size}")  # fmt: skip
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        ukeys = self._keys(keys)
        if isinstance(sizes, int):
            sizes = [sizes] * len(ptrs)
        if not len(ukeys) == len(ptrs) == len(sizes):
            raise bad_arg("UMBPHiCacheStorage", "get_page_buffer_meta()", f"<{len(ptrs)} pointers>",
                          f"{len(ukeys)}: one per page component")  # fmt: skip
        return ukeys, [int(p) for p in ptrs], [int(s) for s in sizes]

    def _per_page(self, results: list[bool]) -> list[bool]:
        n = len(self._parts())
        return [all(results[i : i + n]) for i in range(0, len(results), n)]

    # -- zero-copy v1 ----------------------------------------------------------------------------

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: HiCacheStorageExtraInfo | None = None
                     ) -> list[bool]:  # fmt: skip
        assert self.client is not None
        if not keys:
            return []
        ukeys, ptrs, sizes = self._meta(keys, host_indices)
        return self._per_page(self.client.batch_get_into_ptr(ukeys, ptrs, sizes))

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: HiCacheStorageExtraInfo | None = None
                     ) -> list[bool]:  # fmt: skip
        assert self.client is not None
        if not keys:
            return []
        if self.mla_follower:
            return [True] * len(keys)  # rank 0 stores the one MLA copy
        ukeys, ptrs, sizes = self._meta(keys, host_indices)
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        if prefix is not None:
            depths = [len(prefix) + i for i in range(len(keys)) for _ in self._parts()]
            res = self.client.batch_put_from_ptr_with_depth(ukeys, ptrs, sizes, depths)
        else:
            res = self.client.batch_put_from_ptr(ukeys, ptrs, sizes)
        return self._per_page(res)

    # -- generic interface -----------------------------------------------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """Read ``key`` into ``target_location`` (a tensor, or a pointer with ``target_sizes`` bytes).
        Returns the target, or None when the key is absent."""
        assert self.client is not None
        if target_location is None:
            return None
        ptr, size = _ptr_size(target_location, target_sizes, "target_location")
        return target_location if self.client.get_into_ptr(key, ptr, size) else None

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> int:
        """Read keys in order; returns how many from the start were read."""
        assert self.client is not None
        if not keys or target_locations is None:
            return 0
        sizes = list(target_sizes) if target_sizes is not None else [None] * len(keys)
        pairs = [_ptr_size(t, s, "target_locations[i]") for t, s in zip(target_locations, sizes, strict=True)]
        res = self.client.batch_get_into_ptr(list(keys), [p for p, _ in pairs], [s for _, s in pairs])
        return res.index(False) if False in res else len(res)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        assert self.client is not None
        if self.mla_follower:
            return True
        src = value if value is not None else target_location
        if src is None:
            return False
        ptr, size = _ptr_size(src, target_sizes, "value")
        return self.client.put_from_ptr(key, ptr, size)

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
                  ) -> bool:  # fmt: skip
        assert self.client is not None
        if not keys:
            return False
        if self.mla_follower:
            return True
        srcs = values if values is not None else target_locations
        if srcs is None:
            return False
        sizes = list(target_sizes) if target_sizes is not None else [None] * len(keys)
        pairs = [_ptr_size(v, s, "values[i]") for v, s in zip(srcs, sizes, strict=True)]
        return all(self.client.batch_put_from_ptr(list(keys), [p for p, _ in pairs], [s for _, s in pairs]))

    def exists(self, key: str) -> bool:
        assert self.client is not None
        return self.client.exists(key)

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Pages from the start whose every component is stored (HiCache's prefix semantics)."""
        assert self.client is not None
        if not keys:
            return 0
        hits = self.client.batch_exists_consecutive(self._keys(list(keys)))
        return hits // len(self._parts())

    def clear(self) -> None:
        if self.client is not None:
            self.client.clear()

    def get_stats(self) -> dict[str, int] | None:
        return self.client.stats() if self.client is not None else None

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
