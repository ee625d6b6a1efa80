"""Stand-in of vLLM's scheduler-side offloading interface (vllm.v1.kv_offload.abstract)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


class LoadStoreSpec(ABC):
    @staticmethod
    @abstractmethod
    def medium() -> str: ...


@dataclass
class PrepareStoreOutput:
    block_hashes_to_store: list[Any]
    store_spec: LoadStoreSpec
    block_hashes_evicted: list[Any]


@dataclass
class OffloadingEvent:
    block_hashes: list[Any]
    block_size: int
    medium: str
    removed: bool


class OffloadingManager(ABC):
    @abstractmethod
    def lookup(self, block_hashes: Iterable[Any]) -> int: ...

    @abstractmethod
    def prepare_load(self, block_hashes: Iterable[Any]) -> LoadStoreSpec: ...

    def touch(self, block_hashes: Iterable[Any]) -> None:
        return None

    def complete_load(self, block_hashes: Iterable[Any]) -> None:
        return None

    @abstractmethod
    def prepare_store(self, block_hashes: Iterable[Any]) -> PrepareStoreOutput | None: ...

    def complete_store(self, block_hashes: Iterable[Any], success: bool = True) -> None:
        return None

    def take_events(self) -> Iterable[OffloadingEvent]:
        return ()
