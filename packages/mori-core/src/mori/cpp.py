"""mori.cpp: the original's module of native classes, under its names, from the installed packages.

In the original, ``mori.cpp`` is the pybind11 extension that every component's classes come from
(``from mori.cpp import TransferStatus`` in SGLang's and vLLM's MORI connectors). Here each
component ships its own classes; this module re-exports them under the original's names, importing
a component only when one of its names is first used:

* mori.io (mori-io): ``TransferStatus``, ``StatusCode``, ``BackendType``, ``IOEngine``, ...
* mori.ops (mori-ep): ``EpDispatchCombineConfig``, ``EpDispatchCombineKernelType``
* mori.umbp (mori-umbp): ``UMBPClient``, ``UMBPConfig``, ``UMBPMasterClient``, ...
* mori.viz (mori-viz): ``get_debug_time_buf``, ``get_debug_time_offset``, ``ALL_PROFILER_SLOTS``
* mori.shmem (mori-core): the host API, ``shmem_init_attr``, ``shmem_malloc``, ...

:data:`PROVIDERS` lists every name and its module.

A name whose distribution is not installed raises ``ModuleNotFoundError`` saying ``pip install
<distribution>``; a name its installed component does not provide (yet) raises ``ImportError``
saying why. Both are ImportErrors, so ``try: from mori.cpp import X / except ImportError`` works;
``hasattr(mori.cpp, X)`` raises them too rather than answer False. Names not listed are
AttributeErrors, as in any module.
"""

from __future__ import annotations

from mori._forward import forward

_IO = (
    "BackendType",
    "EngineDesc",
    "FabricBackendConfig",
    "IOEngine",
    "IOEngineConfig",
    "IOEngineSession",
    "MemoryDesc",
    "MemoryLocationType",
    "PollCqMode",
    "RdmaBackendConfig",
    "StatusCode",
    "TransferStatus",
    "XgmiBackendConfig",
)
_EP = ("EpDispatchCombineConfig", "EpDispatchCombineKernelType")
_UMBP = (
    "UMBPClient",
    "UMBPConfig",
    "UMBPDeploymentMode",
    "UMBPDistributedConfig",
    "UMBPExternalKvHitCountEntry",
    "UMBPExternalKvNodeMatch",
    "UMBPHostMemAllocator",
    "UMBPMasterClient",
    "UMBPStandaloneProcessConfig",
    "UMBPTierType",
)
_VIZ = ("ALL_PROFILER_SLOTS", "get_debug_time_buf", "get_debug_time_offset")
_SHMEM = (
    "shmem_barrier_all",
    "shmem_barrier_on_stream",
    "shmem_buffer_deregister",
    "shmem_buffer_register",
    "shmem_finalize",
    "shmem_free",
    "shmem_get_unique_id",
    "shmem_init_attr",
    "shmem_malloc",
    "shmem_malloc_align",
    "shmem_mpi_init",
    "shmem_mype",
    "shmem_npes",
    "shmem_num_qp_per_pe",
    "shmem_ptr_p2p",
    "shmem_torch_process_group_init",
)

#: name -> the module that provides it
PROVIDERS: dict[str, str] = {
    **dict.fromkeys(_IO, "mori.io"),
    **dict.fromkeys(_EP, "mori.ops"),
    **dict.fromkeys(_UMBP, "mori.umbp"),
    **dict.fromkeys(_VIZ, "mori.viz"),
    **dict.fromkeys(_SHMEM, "mori.shmem"),
}

__all__ = sorted(PROVIDERS)


def __getattr__(name: str) -> object:
    module = PROVIDERS.get(name)
    if module is None and name.startswith("UMBP"):
        module = "mori.umbp"  # every UMBP config object and enum, as the original binds them all
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}", name=name)
    value = forward(module, name, f"{__name__}.{name}")
    globals()[name] = value  # once found, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *PROVIDERS})
