"""Stand-in of SGLang's HiCache storage interface: what a storage backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass
class HiCacheStorageConfig:
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    attn_cp_rank: int
    attn_cp_size: int
    is_mla_model: bool
    enable_storage_metrics: bool
    is_page_first_layout: bool
    model_name: str | None
    dp_rank: int = 0
    dp_size: int = 1
    tp_lcm_size: int | None = None
    should_split_heads: bool = False
    extra_config: dict[str, Any] | None = None


@dataclass
class HiCacheStorageExtraInfo:
    prefix_keys: list[str] | None = None
    extra_info: dict[str, Any] | None = None


class HiCacheStorage(ABC):
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        raise NotImplementedError

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        raise NotImplementedError

    @abstractmethod
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any: ...

    @abstractmethod
    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> Any: ...

    @abstractmethod
    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool: ...

    @abstractmethod
    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        for i, k in enumerate(keys):
            if not self.exists(k):
                return i
        return len(keys)

    def clear(self) -> None:
        return None

    def get_stats(self) -> Any:
        return None
