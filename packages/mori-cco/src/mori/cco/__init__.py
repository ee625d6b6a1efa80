"""mori.cco: explicit communicators over a flat symmetric address space. PLACEHOLDER: nothing is
implemented yet.

mori-cco 0.1.0 is an empty placeholder. The CCO component is not implemented yet; this module
provides none of its names, and accessing any of them raises :class:`AttributeError`. Progress is
tracked in the project's issues. The collectives that will use it live in :mod:`mori.ccl`, from the
same distribution and equally empty.

What it will be: communicator objects (several per process) created from a unique id, which
allocate and register memory windows that every rank can reach, and hand kernels a device-side
communicator for load/store access to peers on the node, device-initiated RDMA and copy-engine
transfers, with barriers.

Planned public names: ``Communicator``, ``UniqueId``, ``AllocatedMemory``, ``RegisteredWindow``,
``ImportedWindow``, ``DevCommHandle``, ``CCODevCommRequirements``.
"""

from __future__ import annotations

from mori.core.placeholder import placeholder_getattr

__all__: list[str] = []
__status__ = "placeholder"

__getattr__ = placeholder_getattr(__name__, "mori-cco", "CCO")
