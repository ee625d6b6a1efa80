"""A GPU vendor as data: :class:`GpuVendor`, and :class:`GpuVendorPlugin`, the whole device plugin made of one.

mori-core knows no GPU vendor by name. A device plugin (``mori-backend-nvlink``, ``mori-backend-xgmi``)
describes its vendor in one :class:`GpuVendor`: the names of its runtime, transport and
distribution, its driver binding (a :class:`~mori.core.gpu.driver.CtypesDriver` subclass with the C
prototype table) and where the driver library is found, its segment handles' magic and IPC handle
size, the words its messages use, and its ``MORI_*`` variables. Everything else is mori-core's:
:class:`~mori.core.gpu.runtime.GpuRuntime` and :class:`~mori.core.gpu.transport.GpuP2PTransport`
work on the descriptor, and the plugin's ``mori.backends`` entry point names
``PLUGIN = GpuVendorPlugin(VENDOR)``, as the NIC plugins name :class:`mori.core.nic.VendorPlugin`.

Nothing here loads a library at import; :meth:`GpuVendor.load_driver` does, on first use.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mori.core.env import EnvVar
from mori.core.errors import MoriBackendError
from mori.core.gpu.driver import IPC_HANDLE_SIZE, CtypesDriver, GpuError
from mori.core.gpu.handles import SegmentHandle
from mori.core.plugins import hookimpl

if TYPE_CHECKING:
    from mori.core.backend import DeviceRuntime, Transport
    from mori.core.gpu.runtime import GpuRuntime

__all__ = ["GpuVendor", "GpuVendorPlugin", "loaded_library"]


def _no_options() -> Mapping[str, Any]:
    return {}


@dataclass(frozen=True)
class GpuVendor:
    """What MORI knows of one GPU vendor (see the module docstring). Messages quote the strings as
    they are: ``gpu_noun`` "CUDA device", ``available`` "{count} CUDA device(s), driver {version}
    ({path})", ``peer_access_query`` "cuDeviceCanAccessPeer(cuda:{index}, cuda:{other})"."""

    #: the device runtime's name (``MORI_DEVICE_RUNTIME``), the transport's, the distribution's
    runtime: str
    transport: str
    distribution: str
    #: what ``mori backends`` says of the runtime and of the transport
    runtime_description: str
    transport_description: str
    #: the ctypes binding of the driver library (its ``ERROR`` is this vendor's error class)
    driver_class: type[CtypesDriver]
    #: the variable that names the library, the libraries tried in order without it, and what is
    #: missing when none is found ("no NVIDIA driver on this machine")
    library_env: EnvVar[str]
    libraries: tuple[str, ...]
    missing: str
    #: the library's file name as it appears in /proc/self/maps, when one already loaded in the
    #: process must be preferred (HIP: a ROCm torch brings its own libamdhip64, and two HIP runtimes
    #: in one process do not share allocations); ``None``: never look
    prefer_loaded: str | None
    #: the first 4 bytes of this vendor's segment handles, and the size of the driver's IPC handle
    handle_magic: bytes
    #: how messages name: the IPC ("CUDA IPC"), a GPU ("CUDA device"), the no-device result, the
    #: device-count call, the torch build ("CUDA"), the heap's allocation, the allocation functions
    #: export_range accepts and the stream-ordered pool allocator it does not
    ipc_name: str
    gpu_noun: str
    no_device_result: str
    device_count_call: str
    torch_flavour: str
    heap_allocation: str
    alloc_functions: str
    async_pool: str
    #: the reason of a usable runtime (format fields ``count``, ``version``, ``path``) and the
    #: peer-access query that said no (fields ``index``, ``other``)
    available: str
    peer_access_query: str
    #: ``torch.version`` attribute that is set in builds for this vendor ("cuda", "hip")
    torch_version: str
    #: DLPack device type of torch's ``cuda`` device on this vendor (kDLCUDA, kDLROCM)
    dlpack_device: int
    ipc_handle_size: int = IPC_HANDLE_SIZE
    #: the driver version as ``available`` shows it
    version_text: Callable[[int], str] = str
    #: keyword arguments of the heap's ``mem_alloc``, read at each heap allocation
    heap_alloc_options: Callable[[], Mapping[str, Any]] = _no_options
    #: the vendor's variables besides ``library_env``, for ``mori env``
    env_vars: tuple[EnvVar[Any], ...] = ()
    #: the segment handle class of this vendor (made from the fields above)
    handle_class: type[SegmentHandle] = field(init=False, repr=False, compare=False)
    _loaded: dict[str, CtypesDriver] = field(default_factory=dict, init=False, repr=False, compare=False)
    _lock: Any = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.handle_magic) != 4:
            raise ValueError(f"GpuVendor: handle_magic={self.handle_magic!r} is not 4 bytes")
        attrs = {
            "MAGIC": self.handle_magic,
            "PACKAGE": self.distribution,
            "RUNTIME": self.runtime,
            "IPC_SIZE": self.ipc_handle_size,
            "__doc__": f"A decoded {self.distribution} segment handle (see :class:`~mori.core.gpu.handles.SegmentHandle`).",
        }
        cls = type(f"{self.runtime.capitalize()}SegmentHandle", (SegmentHandle,), attrs)
        object.__setattr__(self, "handle_class", cls)

    @property
    def error_class(self) -> type[GpuError]:
        """The driver's error class."""
        return self.driver_class.ERROR

    def torch_build_ok(self, torch: Any) -> bool:
        """Whether ``torch`` (the module) is a build for this vendor's GPUs."""
        return getattr(torch.version, self.torch_version, None) is not None

    # -- the driver library -----------------------------------------------------------------------

    def load_driver(self, path: str | None = None) -> CtypesDriver:
        """The process's driver binding, loading the library on first use.

        ``path``: the library to load; default: ``library_env``'s value, else one already loaded in
        the process (``prefer_loaded``), else each of ``libraries`` in turn. Raises
        :class:`~mori.core.errors.MoriBackendError` saying why none can be loaded.
        """
        explicit = path or self.library_env.get()
        with self._lock:
            for loaded in self._loaded.values():
                if explicit is None or loaded.path == explicit:
                    return loaded
            if explicit is None and self.prefer_loaded is not None:
                with contextlib.suppress(ImportError):  # a torch for this vendor loads its own copy
                    import torch  # noqa: F401
            if explicit:
                candidates = [explicit]
            else:
                found = loaded_library(self.prefer_loaded) if self.prefer_loaded else None
                candidates = [p for p in (found, *self.libraries) if p]
            errors: list[str] = []
            for candidate in candidates:
                try:
                    lib = ctypes.CDLL(candidate)
                except OSError as e:
                    errors.append(str(e))
                    continue
                drv = self.driver_class(lib, candidate)
                self._loaded.clear()
                self._loaded[candidate] = drv
                return drv
            name = explicit or self.libraries[0]
            if all("cannot open shared object file" in e or "No such file" in e for e in errors):
                raise MoriBackendError(f"{name} not found: {self.missing} (or set {self.library_env.name})")
            raise MoriBackendError(f"{name} cannot be loaded: {'; '.join(errors)}")


def loaded_library(name: str) -> str | None:
    """Path of a library whose file name starts with ``name`` already mapped into this process
    (``/proc/self/maps``), None if there is none."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and f"/{name}" in parts[5]:
                    return parts[5].strip()
    except OSError:
        pass
    return None


class GpuVendorPlugin:
    """The whole device plugin of a GPU vendor, from its descriptor: the device runtime
    (``mori_device_runtimes``), the same-node load/store transport over it (``mori_transports``)
    and the vendor's variables (``mori_env_vars``). The plugin's ``mori.backends`` entry point names
    one: ``mygpu = "my_mori_gpu.plugin:PLUGIN"`` with ``PLUGIN = GpuVendorPlugin(VENDOR)``. Making
    it loads nothing; the runtime loads the driver when first probed or used."""

    def __init__(self, vendor: GpuVendor) -> None:
        from mori.core.gpu.runtime import GpuRuntime

        self.vendor = vendor
        #: the plugin's one runtime (the transport maps heaps of this runtime)
        self.runtime: GpuRuntime = GpuRuntime(vendor)

    @hookimpl
    def mori_device_runtimes(self) -> Sequence[DeviceRuntime]:
        return [self.runtime]

    @hookimpl
    def mori_transports(self) -> Sequence[Transport]:
        from mori.core.gpu.transport import GpuP2PTransport

        return [GpuP2PTransport(self.runtime)]

    @hookimpl
    def mori_env_vars(self) -> Sequence[EnvVar[object]]:
        return [self.vendor.library_env, *self.vendor.env_vars]
