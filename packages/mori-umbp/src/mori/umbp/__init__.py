"""mori.umbp: a tiered KV-cache pool (DRAM, SSD, HBM) with a routing master.

:class:`UMBPClient` puts and gets KV-cache blocks by key from raw pointers, one at a time or in
batches (first write wins; a put is invisible until complete). :class:`UMBPMasterClient` talks to
the master (``umbp_master ADDRESS [METRICS_PORT]``), which registers nodes, routes gets to the
peer that holds a block, and keeps the external-KV index that schedulers query for cache hits.
The names, fields and semantics are the original MORI-UMBP's; :mod:`mori.cpp` re-exports them
under the original's binding module.

Importing this module sets ``UMBP_MASTER_BIN`` to the installed ``umbp_master`` executable when
the variable is unset (as the original's package does, so its tests and launchers find it); it
loads no gRPC until a master name is used.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

from mori.umbp.client import UMBPClient
from mori.umbp.config import (
    CacheRemoteAdmission,
    UMBPConfig,
    UMBPCopyPipelineConfig,
    UMBPDeploymentMode,
    UMBPDistributedConfig,
    UMBPDramConfig,
    UMBPDurabilityConfig,
    UMBPDurabilityMode,
    UMBPEvictionConfig,
    UMBPHostBufferBacking,
    UMBPIoBackend,
    UMBPIoConfig,
    UMBPIoEngineConfig,
    UMBPMasterClientConfig,
    UMBPRole,
    UMBPSsdConfig,
    UMBPSsdLayoutMode,
    UMBPStandaloneProcessConfig,
    UMBPTierType,
)
from mori.umbp.errors import UMBPArgumentError, UMBPError, UMBPUnavailableError, UMBPUnsupportedError
from mori.umbp.host_memory import UMBPHostBuffer, UMBPHostMemAllocator

_LAZY = {
    "UMBPMasterClient": "mori.umbp.master_client",
    "UMBPExternalKvNodeMatch": "mori.umbp.master_client",
    "UMBPExternalKvHitCountEntry": "mori.umbp.master_client",
}

__all__ = [
    "CacheRemoteAdmission",
    "UMBPArgumentError",
    "UMBPClient",
    "UMBPConfig",
    "UMBPCopyPipelineConfig",
    "UMBPDeploymentMode",
    "UMBPDistributedConfig",
    "UMBPDramConfig",
    "UMBPDurabilityConfig",
    "UMBPDurabilityMode",
    "UMBPError",
    "UMBPEvictionConfig",
    "UMBPExternalKvHitCountEntry",
    "UMBPExternalKvNodeMatch",
    "UMBPHostBuffer",
    "UMBPHostBufferBacking",
    "UMBPHostMemAllocator",
    "UMBPIoBackend",
    "UMBPIoConfig",
    "UMBPIoEngineConfig",
    "UMBPMasterClient",
    "UMBPMasterClientConfig",
    "UMBPRole",
    "UMBPSsdConfig",
    "UMBPSsdLayoutMode",
    "UMBPStandaloneProcessConfig",
    "UMBPTierType",
    "UMBPUnavailableError",
    "UMBPUnsupportedError",
    "master_bin",
]


def master_bin() -> str | None:
    """Path of the installed ``umbp_master`` executable (next to this interpreter), or None."""
    here = os.path.join(os.path.dirname(sys.executable), "umbp_master")
    return here if os.access(here, os.X_OK) else shutil.which("umbp_master")


if not os.environ.get("UMBP_MASTER_BIN"):
    _bin = master_bin()
    if _bin:
        os.environ["UMBP_MASTER_BIN"] = _bin


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mori.umbp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
