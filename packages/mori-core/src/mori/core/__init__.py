"""mori.core: what every MORI component stands on.

Layers: :mod:`~mori.core.bootstrap` (rendezvous), :mod:`~mori.core.topology` (node identity, GPUs,
NICs, NUMA and GPU-to-NIC matching), :mod:`~mori.core.nic` (RDMA NICs, vendors as data),
:mod:`~mori.core.plugins` with :mod:`~mori.core.hookspecs` and :mod:`~mori.core.backend` (device
runtimes, transports, NIC providers), :mod:`~mori.core.env` (``MORI_*`` variables) and
:mod:`~mori.core.errors`. The native helpers live in the private ``mori.core._core``.
"""

from mori.core.errors import (
    MoriBackendError,
    MoriError,
    MoriOutOfMemoryError,
    MoriStateError,
    MoriTimeoutError,
    MoriTypeError,
    MoriValueError,
)
from mori.core.version import installed_version

__version__ = installed_version("mori-core")

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
