"""The ``MORI_*`` variables mori-backend-nvlink reads (``mori env`` lists them through the plugin).

Values are read on use, never at import. ``MORI_SHMEM_MODE``, ``MORI_SHMEM_HEAP_SIZE`` and the
other shared variables belong to mori-core (:mod:`mori.core.env`).
"""

from __future__ import annotations

from mori.core.env import EnvVar

MORI_CUDA_DRIVER_LIBRARY = EnvVar(
    "MORI_CUDA_DRIVER_LIBRARY",
    "libcuda.so.1",
    "CUDA driver library the cuda device runtime loads at run time (a name the dynamic linker finds, or a path).",
    "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
    str,
)

#: every variable this plugin reads, for the mori_env_vars hook
ALL: tuple[EnvVar[object], ...] = (MORI_CUDA_DRIVER_LIBRARY,)  # type: ignore[assignment]
