"""MORI NIC provider for Broadcom Thor2 RDMA NICs (bnxt_re): the vendor's data (:data:`mori_backend_thor2.vendor.VENDOR`)."""

from mori_backend_thor2.vendor import VENDOR

__all__ = ["VENDOR"]
