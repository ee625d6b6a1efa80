"""GPU memory over the TCP backend: the engine's staging copier on the GPU runtime's driver.

The native TCP backend moves GPU memory through host staging buffers once a ``DeviceCopier`` is
installed (``csrc/engine.hpp``). :func:`install` installs the native one of ``csrc/gpu_copier.hpp``
on the usable GPU runtime of the installed device plugins (CUDA from mori-backend-nvlink, HIP from
mori-backend-xgmi), so a plain ``IOEngine`` with only the TCP backend can serve and move GPU regions
between hosts. The engine installs it on its first GPU registration.

The copier calls the driver's own functions (their addresses from
:meth:`~mori.core.gpu.driver.CtypesDriver.native_calls`), never Python: no GIL on the data path.
Each piece of a transfer (``TcpBackendConfig.chunk_bytes``, 1 MiB by default) is copied between the
region's GPU and a pinned staging buffer on a stream of the engine thread that handles it, and
waited for; the engine pipelines by running pieces on several connections at once.
"""

from __future__ import annotations

from typing import Any

__all__ = ["StagingCopier", "install"]


class StagingCopier:
    """The native staging copier installed in one engine, and the GPUs it copies for: a GPU is
    added on the first registration of a region on it (a CUDA context on a GPU this process does
    not use would cost memory there)."""

    def __init__(self, native: Any, runtime: Any) -> None:
        st = runtime.bound_device()
        self.drv = st.drv
        self.devices = {st.index}
        self.native = native.set_gpu_copier(self.drv.native_calls(), {st.index: int(st.ctx)})

    @property
    def copies(self) -> int:
        """Pieces copied between device and host memory."""
        return int(self.native.copies)

    def add_device(self, device: int) -> None:
        """Copy for GPU ``device`` too (its primary context retained once)."""
        if device in self.devices:
            return
        drv = self.drv
        self.native.add_context(device, int(drv.primary_context_retain(drv.device(device))))
        self.devices.add(device)


def install(native: Any, runtime: Any) -> StagingCopier:
    """Install the staging copier of ``runtime``'s driver into the native engine ``native``, for
    the GPU the runtime is bound to (:meth:`StagingCopier.add_device` adds others)."""
    return StagingCopier(native, runtime)
