"""A vLLM KV offloading backend on UMBP: :class:`UMBPOffloadingSpec` for vLLM's ``OffloadingConnector``.

vLLM loads it by name, without a change to vLLM::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector",
        "kv_role": "kv_both", "kv_connector_extra_config": {
            "spec_name": "UMBPOffloadingSpec", "spec_module_path": "mori.umbp.integrations.vllm",
            "umbp_ssd_dir": "/nvme/umbp", "umbp_dram_bytes": 17179869184}}'

How it maps vLLM's offloading model:

* **Worker side** (:class:`UMBPOffloadingHandler`, one per worker): a store job gathers, for each
  offloaded block, that block's page of every KV cache tensor into *one* UMBP object (key
  ``{block_hash_hex}:r{rank}``, through ``batch_put_ranges_from_ptr``), so a block becomes visible
  all at once or not at all; a load job scatters it back (``batch_get_ranges_into_ptr``). GPU
  tensors are staged through a host buffer (``torch`` copies); CPU tensors are copied directly.
  Jobs run on a background thread; ``get_finished`` reports them.
* **Scheduler side** (:class:`UMBPOffloadingManager`): ``lookup`` asks UMBP what exists. With
  ``umbp_master_address`` it asks the master (every rank's object of a block must exist). Without
  a master, each worker's client is a ``SharedSSDLeader`` writing through to
  ``{umbp_ssd_dir}/r{rank}`` and the manager holds ``SharedSSDFollower`` views of those logs.
  Stores are first-write-wins, so ``prepare_store`` only skips what exists; UMBP evicts by itself
  (``block_hashes_evicted`` is always empty), and a block evicted between ``lookup`` and the load
  fails that load (``TransferResult(success=False)``), which vLLM recovers from by recomputing.

``kv_connector_extra_config`` keys: ``umbp_dram_bytes`` (default 4 GiB), ``umbp_ssd_dir``
(default ``/tmp/umbp_vllm``), ``umbp_ssd_bytes`` (default 32 GiB), ``umbp_master_address``,
``umbp_node_address``. Offloaded blocks must equal GPU blocks (``block_size`` unset or equal).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from vllm.v1.kv_offload.abstract import LoadStoreSpec, OffloadingManager, PrepareStoreOutput
from vllm.v1.kv_offload.mediums import GPULoadStoreSpec
from vllm.v1.kv_offload.spec import OffloadingSpec
from vllm.v1.kv_offload.worker.worker import OffloadingHandler, TransferResult

from mori.umbp.client import UMBPClient
from mori.umbp.config import UMBPConfig, UMBPDistributedConfig, UMBPDurabilityMode, UMBPRole
from mori.umbp.errors import UMBPArgumentError
from mori.umbp.master_client import UMBPMasterClient

MEDIUM = "UMBP"


def _hex(block_hash: Any) -> str:
    return block_hash.hex() if isinstance(block_hash, (bytes, bytearray)) else str(block_hash)


class UMBPLoadStoreSpec(LoadStoreSpec):  # type: ignore[misc]
    """Where blocks live in UMBP: one key base per block (``{hash_hex}``), in block order."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys

    @staticmethod
    def medium() -> str:
        return MEDIUM

    def __repr__(self) -> str:
        return f"UMBPLoadStoreSpec({len(self.keys)} blocks)"


class UMBPOffloadingSpec(OffloadingSpec):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, kv_cache_config)
        extra = self.extra_config
        if any(f != 1 for f in getattr(self, "block_size_factors", (1,))):
            raise UMBPArgumentError(
                "UMBPOffloadingSpec: offloaded blocks must equal GPU blocks; leave kv_connector_extra_config['block_size'] unset"
            )
        pc = getattr(vllm_config, "parallel_config", None)
        self.rank = int(getattr(pc, "rank", 0) or 0)
        self.world_size = int(getattr(pc, "world_size", 1) or 1)
        self.dram_bytes = int(extra.get("umbp_dram_bytes", 4 << 30))
        self.ssd_dir = str(extra.get("umbp_ssd_dir", "/tmp/umbp_vllm"))
        self.ssd_bytes = int(extra.get("umbp_ssd_bytes", 32 << 30))
        self.master_address = extra.get("umbp_master_address") or os.environ.get("UMBP_MASTER_ADDRESS") or ""
        self.node_address = str(extra.get("umbp_node_address", "127.0.0.1"))
        self._manager: UMBPOffloadingManager | None = None

    def key(self, base: str, rank: int) -> str:
        return f"{base}:r{rank}"

    def client_config(self, rank: int, role: UMBPRole) -> UMBPConfig:
        cfg = UMBPConfig()
        cfg.dram.capacity_bytes = self.dram_bytes if role != UMBPRole.SharedSSDFollower else 1 << 20
        cfg.ssd.storage_dir = os.path.join(self.ssd_dir, f"r{rank}")
        cfg.ssd.capacity_bytes = self.ssd_bytes
        cfg.ssd.durability.mode = (
            UMBPDurabilityMode.Relaxed
        )  # a cache: a crash loses blocks, never serves torn ones
        if self.master_address:
            cfg.ssd.enabled = False
            d = UMBPDistributedConfig()
            d.master_config.master_address = self.master_address
            d.master_config.node_id = f"vllm-{self.node_address}-r{rank}-{os.getpid()}"
            d.master_config.node_address = self.node_address
            d.io_engine.host = self.node_address
            cfg.distributed = d
        else:
            cfg.role = role
        return cfg

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = UMBPOffloadingManager(self)
        return self._manager

    def get_handlers(
        self, kv_caches: Any, *_: Any
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        handler = UMBPOffloadingHandler(self, kv_caches)
        yield GPULoadStoreSpec, UMBPLoadStoreSpec, handler
        yield UMBPLoadStoreSpec, GPULoadStoreSpec, handler


class UMBPOffloadingManager(OffloadingManager):  # type: ignore[misc]
    """Scheduler side: what is offloaded, asked of UMBP itself."""

    def __init__(self, spec: UMBPOffloadingSpec) -> None:
        self.spec = spec
        self._master: UMBPMasterClient | None = None
        self._views: list[UMBPClient] = []
        if spec.master_address:
            self._master = UMBPMasterClient(spec.master_address)
        else:
            for r in range(spec.world_size):
                os.makedirs(os.path.join(spec.ssd_dir, f"r{r}"), exist_ok=True)
                self._views.append(UMBPClient(spec.client_config(r, UMBPRole.SharedSSDFollower)))

    def _present(self, bases: list[str]) -> list[bool]:
        ranks = range(self.spec.world_size)
        if self._master is not None:
            found = self._master.batch_lookup([self.spec.key(b, r) for b in bases for r in ranks])
            n = self.spec.world_size
            return [all(found[i * n : (i + 1) * n]) for i in range(len(bases))]
        per_rank = [
            v.batch_exists([self.spec.key(b, r) for b in bases])
            for r, v in zip(ranks, self._views, strict=True)
        ]
        return [all(col) for col in zip(*per_rank, strict=True)] if bases else []

    def lookup(self, block_hashes: Iterable[Any]) -> int:
        hits = self._present([_hex(h) for h in block_hashes])
        return hits.index(False) if False in hits else len(hits)

    def prepare_load(self, block_hashes: Iterable[Any]) -> LoadStoreSpec:
        return UMBPLoadStoreSpec([_hex(h) for h in block_hashes])

    def prepare_store(self, block_hashes: Iterable[Any]) -> PrepareStoreOutput | None:
        hashes = list(block_hashes)
        present = self._present([_hex(h) for h in hashes])
        todo = [h for h, p in zip(hashes, present, strict=True) if not p]
        return PrepareStoreOutput(
            block_hashes_to_store=todo,
            store_spec=UMBPLoadStoreSpec([_hex(h) for h in todo]),
            block_hashes_evicted=[],
        )

    def close(self) -> None:
        for v in self._views:
            v.close()
        if self._master is not None:
            self._master.close()


class UMBPOffloadingHandler(OffloadingHandler):  # type: ignore[misc]
    """Worker side: GPU blocks <-> UMBP objects, on a background thread."""

    def __init__(self, spec: UMBPOffloadingSpec, kv_caches: Any) -> None:
        self.spec = spec
        self.tensors = [t.tensor for t in kv_caches.tensors]
        self.page_bytes = [int(t.page_size_bytes) for t in kv_caches.tensors]
        self.block_bytes = sum(self.page_bytes)
        self.client = UMBPClient(spec.client_config(spec.rank, UMBPRole.SharedSSDLeader))
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="umbp-vllm")
        self._lock = threading.Lock()
        self._jobs: dict[int, Future[TransferResult]] = {}
        self._done: list[TransferResult] = []

    def _pieces(self, block_id: int) -> tuple[list[int], list[int], list[int]]:
        ptrs, sizes, offs, off = [], [], [], 0
        for t, n in zip(self.tensors, self.page_bytes, strict=True):
            row = t[block_id]
            ptrs.append(int(row.data_ptr()))
            sizes.append(n)
            offs.append(off)
            off += n
        return ptrs, sizes, offs

    def _on_gpu(self) -> bool:
        return any(getattr(t, "is_cuda", False) for t in self.tensors)

    def _run(self, job_id: int, src: Any, dst: Any) -> TransferResult:
        t0 = time.perf_counter()
        store = isinstance(dst, UMBPLoadStoreSpec)
        gpu, spec = (src, dst) if store else (dst, src)
        block_ids = [int(b) for b in gpu.block_ids]
        keys = [self.spec.key(k, self.spec.rank) for k in spec.keys]
        if len(block_ids) != len(keys):
            return TransferResult(job_id, False)
        if self._on_gpu():
            ok = self._run_staged(store, block_ids, keys)
        else:
            pieces = [self._pieces(b) for b in block_ids]
            if store:
                res = self.client.batch_put_ranges_from_ptr(
                    keys,
                    [self.block_bytes] * len(keys),
                    [p[0] for p in pieces],
                    [p[1] for p in pieces],
                    [p[2] for p in pieces],
                )
            else:
                res = self.client.batch_get_ranges_into_ptr(
                    keys, [p[0] for p in pieces], [p[1] for p in pieces], [p[2] for p in pieces]
                )
            ok = all(res)
        kind = ("GPU", MEDIUM) if store else (MEDIUM, "GPU")
        return TransferResult(job_id, ok, self.block_bytes * len(keys), time.perf_counter() - t0, kind)

    def _run_staged(self, store: bool, block_ids: list[int], keys: list[str]) -> bool:
        import torch

        host = torch.empty(self.block_bytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        ok = True
        for b, key in zip(block_ids, keys, strict=True):
            off = 0
            if store:
                for t, n in zip(self.tensors, self.page_bytes, strict=True):
                    host[off : off + n].copy_(t[b].view(torch.uint8).reshape(-1)[:n])
                    off += n
                torch.cuda.current_stream().synchronize()
                ok &= self.client.put_from_ptr(key, int(host.data_ptr()), self.block_bytes)
            else:
                if not self.client.get_into_ptr(key, int(host.data_ptr()), self.block_bytes):
                    ok = False
                    continue
                for t, n in zip(self.tensors, self.page_bytes, strict=True):
                    t[b].view(torch.uint8).reshape(-1)[:n].copy_(host[off : off + n])
                    off += n
                torch.cuda.current_stream().synchronize()
        return ok

    def transfer_async(self, job_id: int, spec: Any) -> bool:
        src, dst = spec
        if not (isinstance(src, UMBPLoadStoreSpec) or isinstance(dst, UMBPLoadStoreSpec)):
            return False
        fut = self._pool.submit(self._run, job_id, src, dst)
        with self._lock:
            self._jobs[job_id] = fut

        def done(f: Future[TransferResult]) -> None:
            try:
                r = f.result()
            except Exception:
                r = TransferResult(job_id, False)
            with self._lock:
                self._done.append(r)
                self._jobs.pop(job_id, None)

        fut.add_done_callback(done)
        return True

    def get_finished(self) -> list[TransferResult]:
        with self._lock:
            out, self._done = self._done, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        with self._lock:
            futs = [self._jobs[j] for j in job_ids if j in self._jobs]
        for f in futs:
            f.exception()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        self.client.close()
