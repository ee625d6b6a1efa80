"""The cx7 NIC plugin: found through its entry point, its probe on fake sysfs trees of real shapes."""

from __future__ import annotations

from mori_backend_cx7 import VENDOR

from mori.testing.nic_plugin import NicPluginCase, NicPluginTests


class TestCx7(NicPluginTests):
    case = NicPluginCase(
        vendor=VENDOR,
        distribution="mori-backend-cx7",
        family="mlx5",
        driver="mlx5",
        first_device="mlx5_0 (ConnectX-7, fw ",
        env_var="MORI_MLX5_ENABLE_UDP_SPORT",
        max_send_wr=None,
    )
