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

__all__ = ["install"]


def install(native: Any, runtime: Any) -> Any:
    """Install the staging copier of ``runtime``'s driver into the native engine ``native``; it
    copies to and from every GPU this process sees. Returns it (``copies``: pieces copied)."""
    st = runtime._state if runtime._state is not None else runtime._bind()
    drv = st.drv
    contexts = {i: int(drv.primary_context_retain(drv.device(i))) for i in range(drv.device_count())}
    return native.set_gpu_copier(drv.native_calls(), contexts)
