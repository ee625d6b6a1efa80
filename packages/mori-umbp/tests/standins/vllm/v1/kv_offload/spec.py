"""Stand-in of vllm.v1.kv_offload.spec: the spec an offloading connector is built from."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_offload.abstract import LoadStoreSpec, OffloadingManager
from vllm.v1.kv_offload.worker.worker import OffloadingHandler


@dataclass
class CanonicalKVCacheTensor:
    tensor: Any  # (num_blocks, page_size_bytes) int8
    page_size_bytes: int


@dataclass
class CanonicalKVCacheRef:
    tensor_idx: int
    page_size_bytes: int


@dataclass
class CanonicalKVCaches:
    tensors: list[CanonicalKVCacheTensor]
    group_data_refs: list[list[CanonicalKVCacheRef]]


class OffloadingSpec(ABC):
    def __init__(self, vllm_config: Any, kv_cache_config: Any) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.extra_config = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.gpu_block_size = tuple(g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups)
        self.offloaded_block_size = int(self.extra_config.get("block_size", self.gpu_block_size[0]))
        self.block_size_factors = tuple(self.offloaded_block_size // b for b in self.gpu_block_size)

    @abstractmethod
    def get_manager(self) -> OffloadingManager: ...

    @abstractmethod
    def get_handlers(
        self, kv_caches: CanonicalKVCaches
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]: ...
