"""What MORI knows about these NICs, as data (:class:`mori.core.nic.NicVendor`): core's code reads
sysfs, matches devices, checks firmware and configures the transports from it."""

from __future__ import annotations

from mori.core.env import EnvVar, parse_bool
from mori.core.nic import NicVendor

MORI_DISABLE_IONIC_CCQE = EnvVar(
    "MORI_DISABLE_IONIC_CCQE",
    "0",
    "ionic (pollara): do not use collapsed completion-queue entries even where the firmware offers "
    "them (the original detects CCQE at run time; this is its opt-out).",
    "1",
    parse_bool,
)

VENDOR = NicVendor(
    name="pollara",
    family="ionic",
    description="AMD Pensando Pollara 400 (AINIC) RDMA NICs",
    drivers=("ionic", "ionic_rdma"),
    pci_vendors=(0x1DD8,),
    name_prefixes=("ionic_",),
    libraries=("libionic",),
    firmware_minimums=("1.117.5-a-45",),
    # the NIC refuses larger send queues: the original caps max_send_wr here
    max_send_wr=32767,
    udp_sport_spreading=False,
    udp_sport_env=None,
    quirks={
        "ccqe": "collapsed CQEs where the firmware has them (MORI_DISABLE_IONIC_CCQE=1 turns them off)",
        "dmabuf_offsets": "dmabuf registrations must start at the buffer's own offset (a bug the original fixed)",
    },
    env_vars=(MORI_DISABLE_IONIC_CCQE,),  # type: ignore[arg-type]
)
