"""Asynchronous copies on the GPU's copy engines (DMA): :mod:`mori.core.gpu.copy_engine`, shared by
the GPU plugins. Get the one of a runtime with :meth:`HipRuntime.copy_engine()
<mori_backend_xgmi.runtime.HipRuntime.copy_engine>`."""

from __future__ import annotations

from mori.core.gpu.copy_engine import DEFAULT_STREAMS, CopyEngine, CopyTicket

__all__ = ["CopyEngine", "CopyTicket"]
_ = DEFAULT_STREAMS
