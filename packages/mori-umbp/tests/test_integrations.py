"""The SGLang HiCache backend and the vLLM offloading spec, each driven through a stand-in of its
engine's interface (tests/standins, used only where the real engine is not installed)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

STANDINS = str(Path(__file__).parent / "standins")
if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("vllm") is None:
    sys.path.insert(0, STANDINS)

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm.v1.kv_offload.mediums import GPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.spec import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor  # noqa: E402
from vllm.v1.kv_offload.worker.worker import OffloadingWorker  # noqa: E402

from mori.umbp.integrations.sglang import UMBPHiCacheStorage  # noqa: E402


class PageFirstHostPool:
    """A host KV pool in SGLang's page_first layout: kv_buffer [2, size, layers, heads, dim]."""

    layout = "page_first"

    def __init__(
        self, num_pages: int = 8, page_size: int = 4, layers: int = 2, heads: int = 2, dim: int = 8
    ) -> None:
        self.page_size = page_size
        self.size = num_pages * page_size
        self.kv_buffer = torch.zeros((2, self.size, layers, heads, dim), dtype=torch.bfloat16)
        self.token_bytes = layers * heads * dim * 2

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        base, idx = self.kv_buffer.data_ptr(), indices.tolist()
        v_off = self.size * self.token_bytes
        ptrs = []
        for i in range(0, len(idx), self.page_size):
            k = base + idx[i] * self.token_bytes
            ptrs += [k, k + v_off]
        return ptrs, [self.page_size * self.token_bytes] * len(ptrs)


def storage_config(tmp_path: Path, **extra: object) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="m",
        extra_config={"backend_name": "mori_umbp", "module_path": "mori.umbp.integrations.sglang",
                      "class_name": "UMBPHiCacheStorage", "dram_capacity_bytes": 1 << 20,
                      "ssd_storage_dir": str(tmp_path / "ssd"), "ssd_capacity_bytes": 8 << 20, **extra},
    )  # fmt: skip


def test_sglang_dynamic_backend_zero_copy_round_trip(tmp_path: Path) -> None:
    pool = PageFirstHostPool()
    store = StorageBackendFactory.create_backend("dynamic", storage_config(tmp_path), pool)
    assert isinstance(store, UMBPHiCacheStorage)
    store.register_mem_pool_host(pool)  # what HiCache's controller does next
    pool.kv_buffer.normal_()
    want = pool.kv_buffer.clone()
    keys = [f"page-{i}" for i in range(4)]
    idx = torch.arange(0, 16)  # pages 0..3
    assert store.batch_set_v1(keys, idx, HiCacheStorageExtraInfo(prefix_keys=["p0"])) == [True] * 4
    assert store.batch_exists([*keys, "page-missing"]) == 4
    assert store.batch_exists(["page-missing", *keys]) == 0
    pool.kv_buffer.zero_()
    assert store.batch_get_v1(keys, idx) == [True] * 4
    assert torch.equal(pool.kv_buffer[:, :16], want[:, :16])
    assert store.batch_get_v1(["page-missing"], torch.arange(16, 20)) == [False]
    store.close()


def test_sglang_generic_get_set_and_per_rank_keys(tmp_path: Path) -> None:
    cfg = storage_config(tmp_path)
    cfg.tp_rank, cfg.tp_size = 1, 2
    store = UMBPHiCacheStorage(cfg, None)
    value = torch.randn(64)
    assert store.set("k1", value)
    out = torch.zeros(64)
    assert store.get("k1", out) is out and torch.equal(out, value)
    assert store.get("k-missing", torch.zeros(64)) is None
    assert store.batch_set(["a", "b"], [torch.ones(8), torch.full((8,), 2.0)])
    outs = [torch.zeros(8), torch.zeros(8)]
    assert store.batch_get(["a", "b", "c"], [*outs, torch.zeros(8)]) == 2
    assert torch.equal(outs[1], torch.full((8,), 2.0))
    assert store.exists("a") and not store.exists("c")
    assert store.suffix == "_1"
    assert "ssd" in str(store.client.config.ssd.storage_dir) and "tp1" in store.client.config.ssd.storage_dir
    store.clear()
    assert not store.exists("a")
    store.close()


def test_sglang_rejects_a_layer_first_pool(tmp_path: Path) -> None:
    store = UMBPHiCacheStorage(storage_config(tmp_path), None)
    pool = PageFirstHostPool()
    pool.layout = "layer_first"  # type: ignore[misc]
    with pytest.raises(ValueError, match="layout"):
        store.register_mem_pool_host(pool)
    store.close()


def vllm_config(tmp_path: Path, **extra: object) -> tuple[SimpleNamespace, SimpleNamespace]:
    vcfg = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={
            "spec_name": "UMBPOffloadingSpec", "spec_module_path": "mori.umbp.integrations.vllm",
            "umbp_dram_bytes": 1 << 20, "umbp_ssd_dir": str(tmp_path / "vllm"), "umbp_ssd_bytes": 16 << 20, **extra}),
        parallel_config=SimpleNamespace(rank=0, world_size=1),
    )  # fmt: skip
    kcfg = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=16))])
    return vcfg, kcfg


def run_vllm_round_trip(tmp_path: Path, **extra: object) -> None:
    vcfg, kcfg = vllm_config(tmp_path, **extra)
    spec = OffloadingSpecFactory.create_spec(vcfg, kcfg)
    manager = spec.get_manager()
    # two KV tensors (say K and V of a layer group), 6 GPU blocks of 4 KiB pages each
    tensors = [torch.randint(-128, 127, (6, 4096), dtype=torch.int8) for _ in range(2)]
    kv = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, 4096) for t in tensors],
        [[CanonicalKVCacheRef(0, 4096), CanonicalKVCacheRef(1, 4096)]],
    )
    worker = OffloadingWorker()
    for src, dst, handler in spec.get_handlers(kv):
        worker.register_handler(src, dst, handler)
    hashes = [bytes([i]) * 32 for i in range(3)]
    assert manager.lookup(hashes) == 0
    out = manager.prepare_store(hashes)
    assert out is not None and out.block_hashes_to_store == hashes
    want = [t[[1, 3, 5]].clone() for t in tensors]
    assert worker.transfer_async(1, (GPULoadStoreSpec([1, 3, 5], [3]), out.store_spec))
    worker.wait({1})
    (res,) = worker.get_finished()
    assert res.job_id == 1 and res.success and res.transfer_size == 3 * 8192
    manager.complete_store(hashes)
    for h in worker.handlers:
        h.client.flush()  # the leader's write-through reaches the log the scheduler reads
    assert manager.lookup([*hashes, b"\xff" * 32]) == 3
    assert manager.prepare_store(hashes).block_hashes_to_store == []  # already offloaded
    for t in tensors:
        t.zero_()
    load = manager.prepare_load(hashes)
    assert worker.transfer_async(2, (load, GPULoadStoreSpec([0, 2, 4], [3])))
    worker.wait({2})
    (res,) = worker.get_finished()
    assert res.success
    for t, w in zip(tensors, want, strict=True):
        assert torch.equal(t[[0, 2, 4]], w)
    bad = manager.prepare_load([b"\xee" * 32])
    assert worker.transfer_async(3, (bad, GPULoadStoreSpec([0], [1])))
    worker.wait({3})
    assert [r.success for r in worker.get_finished()] == [False]
    worker.shutdown()
    manager.close()


def test_vllm_offloading_spec_local(tmp_path: Path) -> None:
    run_vllm_round_trip(tmp_path)


def test_vllm_offloading_spec_with_a_master(tmp_path: Path, master) -> None:  # type: ignore[no-untyped-def]
    run_vllm_round_trip(tmp_path, umbp_master_address=master.address)
