"""What MORI knows about these NICs, as data (:class:`mori.core.nic.NicVendor`): core's code reads
sysfs, matches devices, checks firmware and configures the transports from it."""

from __future__ import annotations

from mori.core.env import EnvVar, parse_bool
from mori.core.nic import NicVendor

MORI_MLX5_ENABLE_UDP_SPORT = EnvVar(
    "MORI_MLX5_ENABLE_UDP_SPORT",
    "0",
    "mlx5 (cx7): spread RoCE v2 UDP source ports over queue pairs (one per QP) so ECMP fabrics use "
    "more paths; off: one fixed source port, as the original's default.",
    "1",
    parse_bool,
)

VENDOR = NicVendor(
    name="cx7",
    family="mlx5",
    description="NVIDIA (Mellanox) ConnectX-7 and other mlx5 RDMA NICs",
    drivers=("mlx5_core", "mlx5_ib"),
    pci_vendors=(0x15B3,),
    name_prefixes=("mlx5_",),
    libraries=("libmlx5",),
    models={0x101B: "ConnectX-6", 0x101D: "ConnectX-6 Dx", 0x1021: "ConnectX-7"},
    # the original documents no firmware minimum for mlx5: none is claimed here
    firmware_minimums=(),
    max_send_wr=None,
    udp_sport_spreading=False,
    udp_sport_env=MORI_MLX5_ENABLE_UDP_SPORT,
    quirks={
        "roce_qos": "RoCE QoS from MORI_RDMA_TC / MORI_RDMA_SL (set them as the fabric's PFC/DSCP plan says)",
        "other_mlx5": "every mlx5 device (ConnectX-4 on, BlueField) is driven; tuned and tested for ConnectX-7",
    },
    env_vars=(MORI_MLX5_ENABLE_UDP_SPORT,),  # type: ignore[arg-type]
)
