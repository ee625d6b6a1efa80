"""mori.umbp: tiered KV-cache pool with a routing master. PLACEHOLDER: nothing is implemented yet.

mori-umbp 0.1.0 is an empty placeholder. The UMBP component is not implemented yet; this module
provides none of its names, and accessing any of them raises :class:`AttributeError`. Progress is
tracked in the project's issues.

What it will be: a key-value store for KV-cache blocks over device memory, host memory and SSD,
with a client that puts and gets blocks by key from raw pointers (first write wins), and an
optional master server that tells clients which node holds which blocks (it advises routing; each
node owns its memory) and keeps an index of blocks held by external caches.

Planned public names: ``UMBPClient``, ``UMBPConfig``, ``UMBPDistributedConfig``,
``UMBPHostMemAllocator``, ``UMBPMasterClient``, ``UMBPTierType``, ``UMBPExternalKvNodeMatch``,
``UMBPExternalKvHitCountEntry``.
"""

from __future__ import annotations

from mori.core.placeholder import placeholder_getattr

__all__: list[str] = []
__status__ = "placeholder"

__getattr__ = placeholder_getattr(__name__, "mori-umbp", "UMBP")
