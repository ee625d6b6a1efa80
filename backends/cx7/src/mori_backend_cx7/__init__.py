"""MORI NIC provider for NVIDIA (Mellanox) ConnectX-7 RDMA NICs (mlx5): the vendor's data (:data:`mori_backend_cx7.vendor.VENDOR`)."""

from mori_backend_cx7.vendor import VENDOR

__all__ = ["VENDOR"]
