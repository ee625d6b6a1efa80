"""What MORI knows about these NICs, as data (:class:`mori.core.nic.NicVendor`): core's code reads
sysfs, matches devices, checks firmware and configures the transports from it."""

from __future__ import annotations

from mori.core.env import EnvVar, parse_bool
from mori.core.nic import NicVendor

MORI_BNXT_ENABLE_UDP_SPORT = EnvVar(
    "MORI_BNXT_ENABLE_UDP_SPORT",
    "0",
    "bnxt (thor2): spread RoCE v2 UDP source ports over queue pairs so ECMP fabrics use more paths; "
    "off: the NIC's default source port, as the original's default.",
    "1",
    parse_bool,
)

VENDOR = NicVendor(
    name="thor2",
    family="bnxt_re",
    description="Broadcom Thor2 (BCM576xx) RDMA NICs",
    # bnxt_en drives the PCI function, bnxt_re the RDMA device on the auxiliary bus
    drivers=("bnxt_en", "bnxt_re"),
    pci_vendors=(0x14E4,),
    name_prefixes=("bnxt_re",),
    libraries=("libbnxt_re",),
    # one minimum per firmware branch (the original's: 235.2.86 on the 235 line, 237.1.137 on 237)
    firmware_minimums=("235.2.86", "237.1.137"),
    max_send_wr=None,
    udp_sport_spreading=False,
    udp_sport_env=MORI_BNXT_ENABLE_UDP_SPORT,
    quirks={
        "cq_coalescing": "the original ships a script that tunes completion-queue coalescing; not applied "
        "by MORI (it changes the NIC for every process)",
    },
    env_vars=(MORI_BNXT_ENABLE_UDP_SPORT,),  # type: ignore[arg-type]
)
