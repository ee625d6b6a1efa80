"""mori.core: what every MORI component stands on.

Layers: :mod:`~mori.core.bootstrap` (rendezvous), :mod:`~mori.core.topology` (node identity, GPUs,
NICs, NUMA and GPU-to-NIC matching), :mod:`~mori.core.nic` (RDMA NICs, vendors as data),
:mod:`~mori.core.plugins` with :mod:`~mori.core.hookspecs` and :mod:`~mori.core.backend` (device
runtimes, transports, NIC providers), :mod:`~mori.core.env` (``MORI_*`` variables) and
:mod:`~mori.core.errors`. The native helpers live in the private ``mori.core._core``.
"""

from importlib.metadata import PackageNotFoundError, version

from mori.core.errors import (
    MoriBackendError,
    MoriError,
    MoriOutOfMemoryError,
    MoriStateError,
    MoriTimeoutError,
    MoriTypeError,
    MoriValueError,
)

try:
    __version__ = version("mori-core")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "MoriBackendError",
    "MoriError",
    "MoriOutOfMemoryError",
    "MoriStateError",
    "MoriTimeoutError",
    "MoriTypeError",
    "MoriValueError",
    "__version__",
]
