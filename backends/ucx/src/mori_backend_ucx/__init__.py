"""mori-backend-ucx: the ``ucx`` network transport, on UCX from its maintained wheels.

The transport implements the contract ``mori/transport.h`` (register memory, remote keys, put,
get, atomics, fence, flush, requests); MORI opens it through :mod:`mori.core.transport`. UCX is
loaded at run time (:mod:`mori_backend_ucx.library`), so importing this package always works and
``mori backends`` says why the transport is unusable where it is.
"""

from __future__ import annotations

from mori_backend_ucx.transport import UcxTransport

__all__ = ["UcxTransport"]
