"""The HBM tier: objects in device memory of a GPU runtime, above the DRAM tier.

The pool is one segment from the device runtime (:meth:`mori.core.backend.DeviceRuntime.create_segment`:
for the CUDA and HIP plugins, one device allocation), split and evicted exactly as the DRAM tier
(:class:`mori.umbp.dram.DramTier` over that region). Every copy in or out goes through the
runtime's :meth:`~mori.core.backend.DeviceRuntime.copy`, which handles host and device addresses
alike (unified addressing) and is complete when it returns. Objects evicted from HBM move down to
DRAM. The runtime is found through the plugins (``mori backends``): ``auto`` takes the usable
runtime of highest priority that is not the host-memory ``cpu`` one; naming ``cpu`` explicitly
runs the tier on host memory (how the tests exercise it without a GPU).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from mori.core.backend import DeviceRuntime
from mori.core.plugins import get_plugins, select
from mori.umbp.config import UMBPDramConfig, UMBPHbmConfig
from mori.umbp.dram import DramTier
from mori.umbp.errors import UMBPUnsupportedError


def find_runtime(name: str) -> DeviceRuntime:
    found = get_plugins().runtimes()
    if name == "auto":
        gpus = [f for f in found if f.backend.name != "cpu"]
        usable = [f for f in gpus if f.availability.usable]
        if not usable:
            why = (
                "; ".join(f"{f.backend.name}: {f.availability.reason}" for f in gpus)
                or "no GPU runtime plugin installed"
            )
            raise UMBPUnsupportedError(
                f"UMBPClient: the HBM tier (hbm.capacity_bytes > 0) needs a usable GPU runtime ({why}); "
                "set hbm.capacity_bytes = 0, or install the device plugin (mori backends)"
            )
        rt = usable[0].backend
    else:
        rt = select("device runtime", found, name).backend
    if not isinstance(rt, DeviceRuntime):
        raise UMBPUnsupportedError(f"UMBPClient: {name!r} is not a device runtime")
    return rt


class HbmTier(DramTier):
    def __init__(
        self, cfg: UMBPHbmConfig, candidate_window: int, runtime: DeviceRuntime | None = None
    ) -> None:
        self.runtime = runtime or find_runtime(cfg.device_runtime)
        seg = self.runtime.create_segment(cfg.capacity_bytes, f"umbp-hbm-{os.getpid()}-{id(self):x}")
        shape = UMBPDramConfig(capacity_bytes=cfg.capacity_bytes, high_watermark=cfg.high_watermark,
                               low_watermark=cfg.low_watermark, prefault=False)  # fmt: skip
        release: Callable[[], None] = seg.close
        super().__init__(shape, candidate_window, region=(seg.addr, cfg.capacity_bytes, release))
        self.copy: Callable[[int, int, int], Any] = self.runtime.copy
