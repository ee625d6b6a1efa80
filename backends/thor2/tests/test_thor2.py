"""The thor2 NIC plugin: found through its entry point, its probe on fake sysfs trees of real shapes."""

from __future__ import annotations

from mori_backend_thor2 import VENDOR

from mori.testing.nic_plugin import NicPluginCase, NicPluginTests


class TestThor2(NicPluginTests):
    case = NicPluginCase(
        vendor=VENDOR,
        distribution="mori-backend-thor2",
        family="bnxt",
        driver="bnxt_re",
        first_device="bnxt_re0 (bnxt_re device 0x1760, fw ",
        env_var="MORI_BNXT_ENABLE_UDP_SPORT",
        max_send_wr=None,
        fw_low="235.2.85",
        fw_ok="235.2.86",
        fw_warning="WARNING: firmware below bnxt_re's minimum 235.2.86 on bnxt_re0 (235.2.85)",
    )
