"""The ``MORI_*`` variables mori-backend-xgmi reads (``mori env`` lists them through the plugin).

Values are read on use, never at import. ``MORI_SHMEM_MODE``, ``MORI_SHMEM_HEAP_SIZE`` and the
other shared variables belong to mori-core (:mod:`mori.core.env`).
"""

from __future__ import annotations

from mori.core.env import EnvVar, choice

MORI_HIP_LIBRARY = EnvVar(
    "MORI_HIP_LIBRARY",
    None,
    "HIP runtime library the hip device runtime loads at run time. Default: the libamdhip64 already "
    "loaded in the process (a ROCm build of torch brings one), else libamdhip64.so from the linker's path "
    "or /opt/rocm/lib.",
    "/opt/rocm/lib/libamdhip64.so",
    str,
)
MORI_SHMEM_HEAP_TYPE = EnvVar(
    "MORI_SHMEM_HEAP_TYPE",
    "uncached",
    "Memory of the hip runtime's symmetric heap: uncached (fine-grained, hipExtMallocWithFlags with "
    "hipDeviceMallocUncached: coherent for flags polled across GPUs, as in the original MORI) or normal "
    "(hipMalloc, coarse-grained: faster for bulk data, coherent only at kernel boundaries).",
    "normal",
    choice("normal", "uncached"),
    "normal, uncached",
)

#: every variable this plugin reads, for the mori_env_vars hook
ALL: tuple[EnvVar[object], ...] = (MORI_HIP_LIBRARY, MORI_SHMEM_HEAP_TYPE)  # type: ignore[assignment]
