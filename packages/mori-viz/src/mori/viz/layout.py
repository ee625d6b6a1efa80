"""The trace buffer's memory layout and the packing of one event, shared by the device helpers,
the host recorders and the parsers.

A trace buffer is one int64 array (a torch tensor on the device that runs the kernels, or host
memory for host threads)::

    [0, HEADER_WORDS)                         header: MAGIC, VERSION, n_rings, capacity, recording, 0...
    [HEADER_WORDS, HEADER_WORDS + 2*n_rings)  per ring: (events written ever, launches ever)
    [events_offset(n_rings), ...)             per ring: capacity events of 2 words each
    [buffer_words(...), device_words(...))    device buffers only: padding, never written

A *ring* belongs to one writer: one program of a launch on the device (ring = flattened program
id), one thread on the host. Its writer appends events at ``written % capacity`` and counts them,
so after a wrap the ring holds the newest ``capacity`` events and the parser knows which those are.

An event is two int64 words, ``(timestamp, meta)``: the timestamp in the writer's clock ticks, and

====== ======= ===============================================================================
bits   field   meaning
====== ======= ===============================================================================
0-1    type    0 begin, 1 end, 2 instant, 3 next (ends the innermost open span, begins ``slot``)
2-15   slot    the slot id (1..16383; 0 is never declared)
16-31  warp    warp within the program (0 from Triton code, which has no warps of its own)
32-63  launch  the ring's launch count when the event was written (low 32 bits)
====== ======= ===============================================================================

The first three fields are the original's (type[0:2], slot[2:16], warp[16:32]); the launch number
is ours, so that events of CUDA-graph replays can be told apart.
"""

from __future__ import annotations

__all__ = [
    "BEGIN",
    "END",
    "EVENT_WORDS",
    "HEADER_WORDS",
    "INSTANT",
    "MAGIC",
    "MAX_CAPACITY",
    "MAX_RINGS",
    "MAX_SLOT",
    "NEXT",
    "RING_WORDS",
    "VERSION",
    "MIN_DEVICE_WORDS",
    "buffer_words",
    "device_words",
    "events_offset",
    "pack_meta",
    "unpack_meta",
]

#: "MORIVIZ1" as a little-endian int64: marks a trace buffer
MAGIC = int.from_bytes(b"MORIVIZ1", "little", signed=True)
#: layout version in header word 1
VERSION = 1
#: header words before the ring table (word 2: n_rings, word 3: capacity, word 4: a host ring's
#: "recording" flag; the rest are zero)
HEADER_WORDS = 8
H_MAGIC, H_VERSION, H_RINGS, H_CAPACITY, H_RECORDING = 0, 1, 2, 3, 4
#: words per ring in the ring table: events written ever, launches ever
RING_WORDS = 2
#: words per event: timestamp, meta
EVENT_WORDS = 2

#: event types (meta bits 0-1)
BEGIN, END, INSTANT, NEXT = 0, 1, 2, 3
TYPE_NAMES = {BEGIN: "begin", END: "end", INSTANT: "instant", NEXT: "next"}

SLOT_SHIFT, SLOT_BITS = 2, 14
WARP_SHIFT, WARP_BITS = 16, 16
LAUNCH_SHIFT, LAUNCH_BITS = 32, 32
#: largest slot id
MAX_SLOT = (1 << SLOT_BITS) - 1
#: limits of one buffer: rings (the warp field's width) and events per ring (a power of two)
MAX_RINGS = 1 << 16
MAX_CAPACITY = 1 << 24


def events_offset(n_rings: int) -> int:
    """Word offset of ring 0's first event (a multiple of 2 words, so events are 16-byte aligned)."""
    return HEADER_WORDS + RING_WORDS * n_rings


def buffer_words(n_rings: int, capacity: int) -> int:
    """Words of a buffer with ``n_rings`` rings of ``capacity`` events."""
    return events_offset(n_rings) + n_rings * capacity * EVENT_WORDS


#: words a buffer that kernels record into is allocated with at least. A program reads its row of
#: the ring table together with the header, before it knows ``n_rings`` (one memory round trip
#: where a row read only after ``n_rings`` arrived took two: 0.14 us of a traced launch's 0.37 us
#: fixed cost on an H200), so every row a program id below :data:`MAX_RINGS` names lies inside the
#: allocation; rows past ``n_rings`` are read and ignored, never written.
MIN_DEVICE_WORDS = HEADER_WORDS + RING_WORDS * MAX_RINGS


def device_words(n_rings: int, capacity: int) -> int:
    """Words to allocate for a buffer kernels record into: :func:`buffer_words`, padded at the end
    to :data:`MIN_DEVICE_WORDS` (1 MiB and 64 bytes; a buffer of 256 rings x 4096 events needs no padding)."""
    return max(buffer_words(n_rings, capacity), MIN_DEVICE_WORDS)


def pack_meta(kind: int, slot: int, warp: int = 0, launch: int = 0) -> int:
    """The meta word of an event, as a signed int64 (what the buffer stores)."""
    word = (
        (kind & 3)
        | ((slot & MAX_SLOT) << SLOT_SHIFT)
        | ((warp & 0xFFFF) << WARP_SHIFT)
        | ((launch & 0xFFFFFFFF) << LAUNCH_SHIFT)
    )
    return word - (1 << 64) if word >= 1 << 63 else word


def unpack_meta(meta: int) -> tuple[int, int, int, int]:
    """``(type, slot, warp, launch)`` of a meta word (signed or unsigned)."""
    meta &= (1 << 64) - 1
    return (
        meta & 3,
        (meta >> SLOT_SHIFT) & MAX_SLOT,
        (meta >> WARP_SHIFT) & 0xFFFF,
        (meta >> LAUNCH_SHIFT) & 0xFFFFFFFF,
    )
