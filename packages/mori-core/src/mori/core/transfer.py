"""The one-sided transfer machinery features stand on, native code in mori-core (``csrc/transfer``).

* :class:`TcpEngine`: registered memory, a listener (TCP, and a Unix socket for peers of this
  node), authenticated connections (HMAC challenge-response on a shared secret), one-sided reads
  and writes checked against the serving side's own table, cross-memory attach between processes
  of one host, inbound statuses, GPU memory staged through a :class:`GpuCopier`. mori-io's TCP
  backend is a thin adapter onto it.
* :class:`XgmiQueue`: peer copies between GPU memories of one node (XGMI / NVLink) on the device
  plugins' driver functions, with the scatter-gather kernel; mori-io's XGMI backend.
* :class:`RmaQueue`: a transfer's blocks on a network transport of the contract
  (:mod:`mori.core.transport`): checked, merged, posted and completed natively (in the waiting
  thread, or its completion thread), with the notice to the target over a :class:`TcpEngine`;
  mori-io's RDMA backend.
* :class:`TransferStatus` and :class:`StatusCode`: the state of one transfer (the original's
  names; ``set_in_progress``/``complete`` are for backends written in Python).

Every call that waits or moves bytes releases the GIL; native errors raise the MORI error
hierarchy (:class:`~mori.core.errors.MoriValueError`, :class:`~mori.core.errors.MoriBackendError`).
"""

from __future__ import annotations

from mori.core._core import (
    GpuCopier,
    RmaQueue,
    RmaSessionPost,
    SessionPost,
    StatusCode,
    TcpEngine,
    TransferStatus,
    XgmiQueue,
    XgmiSessionPost,
    XgmiToken,
    wait_all,
)
from mori.core._core import transfer_get_log_level as get_log_level
from mori.core._core import transfer_set_log_level as set_log_level

__all__ = [
    "GpuCopier",
    "RmaQueue",
    "RmaSessionPost",
    "SessionPost",
    "StatusCode",
    "TcpEngine",
    "TransferStatus",
    "XgmiQueue",
    "XgmiSessionPost",
    "XgmiToken",
    "get_log_level",
    "set_log_level",
    "wait_all",
]
