"""The pollara NIC plugin: found through its entry point, its probe on fake sysfs trees of real shapes."""

from __future__ import annotations

from mori_backend_pollara import VENDOR

from mori.testing.nic_plugin import NicPluginCase, NicPluginTests


class TestPollara(NicPluginTests):
    case = NicPluginCase(
        vendor=VENDOR,
        distribution="mori-backend-pollara",
        family="ionic",
        driver="ionic",
        first_device="ionic_0 (ionic device 0x1002, fw ",
        env_var="MORI_DISABLE_IONIC_CCQE",
        max_send_wr=32767,
        fw_low="1.117.5-a-44",
        fw_ok="1.117.5-a-45",
        fw_warning="WARNING: firmware below ionic's minimum 1.117.5-a-45 on ionic_0 (1.117.5-a-44)",
    )
