"""mori.io: one-sided point-to-point transfer engine. PLACEHOLDER: nothing is implemented yet.

mori-io 0.1.0 is an empty placeholder. The IO component is not implemented yet; this module
provides none of its names, and accessing any of them raises :class:`AttributeError`. Progress is
tracked in the project's issues.

What it will be: an engine per process that registers local memory, exchanges engine and memory
descriptors with remote engines, and moves bytes between registered regions with asynchronous
one-sided reads and writes (single, batched, or through a session), for example to move KV caches
between prefill and decode servers. The data path is chosen per pair of memories.

Planned public names: ``IOEngine``, ``IOEngineConfig``, ``IOEngineSession``, ``TransferStatus``,
``BackendType``, ``MemoryLocationType``, ``StatusCode``, ``PollCqMode``, ``RdmaBackendConfig``,
``XgmiBackendConfig``, ``FabricBackendConfig``, ``EngineDesc``, ``MemoryDesc``, ``set_log_level``.
"""

from __future__ import annotations

from mori.core.placeholder import placeholder_getattr

__all__: list[str] = []
__status__ = "placeholder"

__getattr__ = placeholder_getattr(__name__, "mori-io", "IO")
