"""MORI NIC provider for AMD Pollara (AINIC) RDMA NICs (ionic): the vendor's data (:data:`mori_backend_pollara.vendor.VENDOR`)."""

from mori_backend_pollara.vendor import VENDOR

__all__ = ["VENDOR"]
