"""Byte and word layouts that the host side of mori.cco and the device API share.

Two layouts live here once, so host code (:mod:`mori.cco.communicator`, :mod:`mori.cco.devcomm`)
and the Triton functions (:mod:`mori.cco.device`) cannot drift apart:

* the **reserved head** of every rank's heap (the first :data:`USER_OFF` bytes, never handed out by
  ``alloc_mem``): the host barrier's slots;
* the **device communicator**: the int64 words of the tensor a kernel takes as ``devcomm``. A fixed
  header, then tables whose positions the header gives (so a kernel needs no constexpr per world
  size). Every table entry is one int64 word.

Device communicator header (word index: meaning):

====  ==========================================================================================
0     ``rank``: this rank in the communicator, ``[0, world_size)``
1     ``world_size``
2     ``lsa_size``: ranks of this rank's LSA team (same node, load/store reachable)
3     ``lsa_rank``: this rank's index in the LSA team
4     ``flat_base``: 0 (peers' heaps are mapped separately, see :class:`~mori.cco.DevCommHandle`)
5     ``per_rank_size``: bytes of every rank's heap
6     ``lsa_barrier_count``
7     ``barrier_count`` (world barriers; on one node they are LSA barriers over every rank)
8     ``sdma_queue_count``
9     ``sdma_queue_depth``: entries of each copy-engine queue's ring
10    word index of ``lsa_ranks[lsa_size]``: global rank of every LSA team member
11    word index of ``heap_bases[lsa_size]``: address, in this process, of each member's heap
12    word index of ``lsa_barrier_slots[lsa_size]``: address, in this process, of each member's
      LSA barrier slots (``[lsa_barrier_count][lsa_size]`` int64: slot ``[b][i]`` is the last
      epoch member ``i`` arrived at barrier ``b`` with)
13    address of this rank's LSA barrier epochs (``[lsa_barrier_count]`` int64, only this rank
      touches them)
14    word index of ``world_barrier_slots[lsa_size]`` (as 12, ``[barrier_count][world_size]``)
15    address of this rank's world barrier epochs (``[barrier_count]`` int64)
16    word index of ``sdma_signal_slots[lsa_size]``: address, in this process, of each member's
      copy-engine signal counters (``[sdma_queue_count][lsa_size]`` int64: ``[q][i]`` counts
      the puts of member ``i`` on queue ``q`` that have landed in this member's memory)
17    address of the copy-engine rings (host-visible memory of this rank, see
      :mod:`mori.cco.sdma`)
18    address of the copy-engine doorbell (int64, host-visible)
19    address of this rank's copy-engine reservation counters (``[sdma_queue_count]`` int64, in
      the heap: producers take entry numbers from them with an atomic add)
====  ==========================================================================================
"""

from __future__ import annotations

#: most ranks a communicator may have (every per-rank table is bounded by it)
MAX_RANKS = 1024
SLOT_BYTES = 8

# -- reserved head of every heap ------------------------------------------------------------------

#: host barrier: slot p holds the number of the last host barrier rank p arrived at
HOST_BARRIER_OFF = 4096
#: first byte that alloc_mem hands out (everything below is reserved)
USER_OFF = 64 * 1024

assert HOST_BARRIER_OFF + MAX_RANKS * SLOT_BYTES <= USER_OFF

# -- device communicator words --------------------------------------------------------------------

DC_RANK = 0
DC_WORLD_SIZE = 1
DC_LSA_SIZE = 2
DC_LSA_RANK = 3
DC_FLAT_BASE = 4
DC_PER_RANK_SIZE = 5
DC_LSA_BARRIER_COUNT = 6
DC_BARRIER_COUNT = 7
DC_SDMA_QUEUE_COUNT = 8
DC_SDMA_QUEUE_DEPTH = 9
DC_LSA_RANKS_AT = 10
DC_HEAP_BASES_AT = 11
DC_LSA_BARRIER_SLOTS_AT = 12
DC_LSA_BARRIER_EPOCHS = 13
DC_WORLD_BARRIER_SLOTS_AT = 14
DC_WORLD_BARRIER_EPOCHS = 15
DC_SDMA_SIGNALS_AT = 16
DC_SDMA_RINGS = 17
DC_SDMA_DOORBELL = 18
DC_SDMA_RESERVED = 19
#: words of the header; the tables follow
DC_HEADER_WORDS = 32

# -- copy-engine rings (mori.cco.sdma) --------------------------------------------------------------
# Each queue's ring (host-visible memory of its rank): a header of RING_HEADER_WORDS int64, then
# `depth` entries of ENTRY_WORDS. Entry numbers come from the queue's reservation counter (in the
# heap, DC_SDMA_RESERVED); entry n lives at index n % depth.
#   header word 0: completed (the copy thread counts the entries it has finished, in order)
# entry words: 0 seq (entry number + 1, written last, after a fence: the entry is then valid),
#              1 op | peer << 8, 2 dst address, 3 src address, 4 bytes, 5 signal value (the copy
#              thread's scratch: the count it stores into the destination's signal slot)

RING_COMPLETED = 0
RING_HEADER_WORDS = 8
ENTRY_SEQ = 0
ENTRY_OP = 1
ENTRY_DST = 2
ENTRY_SRC = 3
ENTRY_BYTES = 4
ENTRY_SIGNAL = 5
ENTRY_WORDS = 8
#: entry ops
SDMA_OP_PUT = 1
SDMA_OP_GET = 2
