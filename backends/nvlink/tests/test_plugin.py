"""The plugin as a user installs it: found through the entry point, unavailable here with a reason
(:class:`mori.testing.gpu_plugin.GpuPluginTests` over this backend's descriptor)."""

from __future__ import annotations

from pathlib import Path

from mori_backend_nvlink import VENDOR

from mori.testing.gpu_plugin import GpuPluginTests


class TestNvlinkPlugin(GpuPluginTests):
    vendor = VENDOR
    entry_point = "nvlink"
    directory = Path(__file__).parent.parent
    reasons = ("libcuda.so.1 not found", "no CUDA device", "not a CUDA build")
