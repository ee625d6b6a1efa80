"""mori.cco: explicit communicators over symmetric memory, and device communicators for kernels.

The original's names and semantics (NCCL's device API is the model):

* :class:`Communicator`: ``get_unique_id()`` -> :class:`UniqueId`; ``init(nranks, rank, uid,
  per_rank_vmm=4 GiB)`` (collective, a context manager, ``destroy()``); several per process,
  thread-safe; ``alloc_mem`` -> :class:`AllocatedMemory`; ``register_window`` (collective) ->
  :class:`RegisteredWindow`; ``register_external_window`` -> :class:`ImportedWindow` (another
  process's shared memory on CPU, a torch symmetric-memory tensor on GPU); ``create_dev_comm``
  (:class:`CCODevCommRequirements`) -> :class:`DevCommHandle`; ``barrier()``.
* Transports: **LSA** (load/store to peers of the node: POSIX shared memory on the ``cpu``
  runtime, NVLink / xGMI on GPUs) and the **copy-engine queues** (:mod:`mori.cco.sdma`).
  **GDA** (device-initiated RDMA to other nodes) is served through the proxy of the transport
  layer (issue 14), not in this build: calls that need it say so.
* Device side for Triton kernels: :mod:`mori.cco.device` (needs triton).

Built on mori-core's bootstrap (torch ``TCPStore`` unique id), device runtimes and transports.
"""

from mori.cco.communicator import DEFAULT_PER_RANK_VMM, Communicator
from mori.cco.devcomm import (
    GDA_CONNECTION_CROSSNODE,
    GDA_CONNECTION_FULL,
    GDA_CONNECTION_NONE,
    GDA_CONNECTION_RAIL,
    CCODevCommRequirements,
    DevCommHandle,
)
from mori.cco.sdma import SdmaQueue
from mori.cco.unique_id import UNIQUE_ID_BYTES, UniqueId
from mori.cco.windows import AllocatedMemory, ImportedWindow, RegisteredWindow

__all__ = [
    "DEFAULT_PER_RANK_VMM",
    "GDA_CONNECTION_CROSSNODE",
    "GDA_CONNECTION_FULL",
    "GDA_CONNECTION_NONE",
    "GDA_CONNECTION_RAIL",
    "UNIQUE_ID_BYTES",
    "AllocatedMemory",
    "CCODevCommRequirements",
    "Communicator",
    "DevCommHandle",
    "ImportedWindow",
    "RegisteredWindow",
    "SdmaQueue",
    "UniqueId",
]
