"""Stand-in of vllm.v1.kv_offload.worker.worker: the worker-side transfer handlers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

TransferSpec = tuple[Any, Any]


@dataclass
class TransferResult:
    job_id: int
    success: bool
    transfer_size: int | None = None
    transfer_time: float | None = None
    transfer_type: tuple[str, str] | None = None


class OffloadingHandler(ABC):
    @abstractmethod
    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool: ...

    @abstractmethod
    def get_finished(self) -> list[TransferResult]: ...

    @abstractmethod
    def wait(self, job_ids: set[int]) -> None: ...

    def shutdown(self) -> None:
        return None


class OffloadingWorker:
    def __init__(self) -> None:
        self.handlers: set[OffloadingHandler] = set()
        self.by_type: dict[tuple[str, str], OffloadingHandler] = {}

    def register_handler(self, src_cls: Any, dst_cls: Any, handler: OffloadingHandler) -> None:
        t = (src_cls.medium(), dst_cls.medium())
        assert t not in self.by_type
        self.handlers.add(handler)
        self.by_type[t] = handler

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        src, dst = spec
        try:
            return self.by_type[(src.medium(), dst.medium())].transfer_async(job_id, spec)
        except Exception:
            return False

    def get_finished(self) -> list[TransferResult]:
        out: list[TransferResult] = []
        for h in self.handlers:
            out.extend(h.get_finished())
        return out

    def wait(self, job_ids: set[int]) -> None:
        for h in self.handlers:
            h.wait(job_ids)

    def shutdown(self) -> None:
        for h in self.handlers:
            h.shutdown()
