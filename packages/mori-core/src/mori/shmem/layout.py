"""Byte layout of the reserved region at the start of every rank's heap segment.

The host API (:mod:`mori.shmem.api`) and the device API (:mod:`mori.shmem.device`) both use it,
so the numbers live here once. Offsets are from the segment base; each array has one int64 slot
per PE, written only by that PE (no two writers ever share a word).
"""

MAX_PES = 1024
SLOT_BYTES = 8

#: host barrier: slot p holds the number of the last host barrier PE p arrived at
HOST_BARRIER_OFF = 4096
#: device barrier (Triton): slot p holds the number of the last device barrier PE p arrived at
DEVICE_BARRIER_OFF = HOST_BARRIER_OFF + MAX_PES * SLOT_BYTES
#: device barrier counter of this PE (only the owner reads and writes it)
DEVICE_BARRIER_EPOCH_OFF = DEVICE_BARRIER_OFF + MAX_PES * SLOT_BYTES
#: collective-call check: two records (by call parity) of 4 int64: seq, kind, offset, size
CALL_RECORD_OFF = DEVICE_BARRIER_EPOCH_OFF + 64
CALL_RECORD_WORDS = 4

#: first byte handed out by shmem_malloc
USER_OFF = 64 * 1024

assert CALL_RECORD_OFF + 2 * CALL_RECORD_WORDS * SLOT_BYTES <= USER_OFF
