"""Stand-in of vllm.v1.kv_offload.mediums: block-id specs of GPU memory."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vllm.v1.kv_offload.abstract import LoadStoreSpec


class BlockIDsLoadStoreSpec(LoadStoreSpec):
    def __init__(self, block_ids: list[int]) -> None:
        self.block_ids = np.array(block_ids, dtype=np.int64)

    @staticmethod
    def medium() -> str:
        raise NotImplementedError


class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    def __init__(
        self, block_ids: list[int], group_sizes: Sequence[int], block_indices: Sequence[int] | None = None
    ) -> None:
        super().__init__(block_ids)
        assert sum(group_sizes) == len(block_ids)
        self.group_sizes = group_sizes
        self.block_indices = block_indices

    @staticmethod
    def medium() -> str:
        return "GPU"
