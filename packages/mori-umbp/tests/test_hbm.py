"""The HBM tier. On CPU machines it runs over the ``cpu`` device runtime (host memory standing in
for device memory: the same tier code, the same runtime calls); the ``cuda`` test runs it on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
from umbp_helpers import Buf, local_config, rand_buf

import mori.umbp as umbp


def hbm_config(
    hbm: int, dram: int = 1 << 20, ssd_dir: object = None, runtime: str = "cpu"
) -> umbp.UMBPConfig:
    cfg = local_config(dram=dram, ssd_dir=ssd_dir)
    cfg.hbm.capacity_bytes = hbm
    cfg.hbm.device_runtime = runtime
    return cfg


def test_puts_land_in_hbm_and_evictions_move_down_to_dram(tmp_path: Path) -> None:
    c = umbp.UMBPClient(hbm_config(64 << 10, dram=64 << 10, ssd_dir=tmp_path / "ssd"))
    try:
        data = [rand_buf(8 << 10) for _ in range(20)]
        for i, d in enumerate(data):
            assert c.put_from_ptr(f"h{i}", d.ptr, d.n)
        s = c.stats()
        assert s["hbm_objects"] >= 1 and s["hbm_used_bytes"] <= 0.9 * (64 << 10)
        assert s["dram_objects"] >= 1, "HBM evictions move down to DRAM"
        assert s["ssd_objects"] >= 1, "and DRAM evictions on to SSD"
        for i, d in enumerate(data):  # nothing was lost on the way down
            out = Buf(d.n)
            assert c.get_into_ptr(f"h{i}", out.ptr, d.n), i
            assert out.bytes() == d.bytes()
        first, out = Buf(8 << 10).fill(1), Buf(8 << 10)
        assert c.put_from_ptr("h19", first.ptr, first.n)  # first write wins across tiers too
        assert c.get_into_ptr("h19", out.ptr, out.n) and out.bytes() == data[19].bytes()
        assert c.clear() and c.stats()["hbm_objects"] == 0
    finally:
        c.close()


def test_an_object_larger_than_hbm_goes_to_dram() -> None:
    c = umbp.UMBPClient(hbm_config(16 << 10, dram=1 << 20))
    try:
        big = rand_buf(64 << 10)
        assert c.put_from_ptr("big", big.ptr, big.n)
        assert c.stats()["hbm_objects"] == 0 and c.stats()["dram_objects"] == 1
        ranges = [Buf(1024), Buf(1024)]
        assert c.batch_get_ranges_into_ptr(
            ["big"], [[r.ptr for r in ranges]], [[1024, 1024]], [[0, 4096]]
        ) == [True]
        assert ranges[1].bytes() == big.bytes()[4096:5120]
    finally:
        c.close()


def test_auto_without_a_gpu_runtime_says_what_is_missing() -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: auto finds it")
    with pytest.raises(umbp.UMBPUnsupportedError, match="GPU runtime"):
        umbp.UMBPClient(hbm_config(1 << 20, runtime="auto"))


@pytest.mark.gpu  # any vendor: runtime="auto" finds this machine's GPU runtime
def test_hbm_tier_on_a_gpu_round_trips_host_and_device_pointers() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip(f"needs a GPU: torch {torch.__version__} has torch.cuda.is_available() = False")
    c = umbp.UMBPClient(hbm_config(64 << 20, dram=64 << 20, runtime="auto"))
    try:
        host = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8)
        dev = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, device="cuda")
        assert c.put_from_ptr("host", host.data_ptr(), host.numel())
        assert c.put_from_ptr("dev", dev.data_ptr(), dev.numel())
        torch.cuda.synchronize()
        assert c.stats()["hbm_objects"] == 2
        out_dev = torch.zeros_like(dev)
        out_host = torch.zeros_like(host)
        assert c.get_into_ptr("host", out_dev.data_ptr(), out_dev.numel())  # HBM -> device memory
        assert c.get_into_ptr("dev", out_host.data_ptr(), out_host.numel())  # HBM -> host memory
        torch.cuda.synchronize()
        assert torch.equal(out_dev.cpu(), host) and torch.equal(out_host, dev.cpu())
        for i in range(80):  # 80 MiB through a 64 MiB HBM tier: evictions go to DRAM and back
            assert c.put_from_ptr(f"fill{i}", dev.data_ptr(), dev.numel())
        assert c.stats()["dram_objects"] >= 1
        assert c.get_into_ptr("host", out_dev.data_ptr(), out_dev.numel())
        torch.cuda.synchronize()
        assert torch.equal(out_dev.cpu(), host)
    finally:
        c.close()
