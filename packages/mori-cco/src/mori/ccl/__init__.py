"""mori.ccl: collective operations (allgather, all-to-all, allreduce). PLACEHOLDER: nothing is
implemented yet.

mori-cco 0.1.0 is an empty placeholder. The CCL component is not implemented yet; this module
provides none of its names, and accessing any of them raises :class:`AttributeError`. Progress is
tracked in the project's issues.

What it will be: collective operations on symmetric memory, each an object constructed once per
rank with its buffer sizes and then called per step: allgather, all-to-all and allreduce over copy
engines, a ring allgather across nodes, sub-group variants, and a hierarchical allgather (within a
node, then across nodes) that matches ``torch.distributed.all_gather_into_tensor`` bit for bit.

Planned public names: ``AllgatherSdma``, ``All2allSdma``, ``AllreduceSdma``,
``AllGatherIntoTensor``, ``InterNodeRingAllgather``, ``IntraNodeSubGroupAllgatherSdma``,
``IntraNodeSubGroupBroadcastSdma``, ``HierAllGather``, ``HostProxyHierAllGather``,
``hier_allgather_reference``.
"""

from __future__ import annotations

from mori.core.placeholder import placeholder_getattr

__all__: list[str] = []
__status__ = "placeholder"

__getattr__ = placeholder_getattr(__name__, "mori-cco", "CCL")
