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

#: the proxy's staging words (rma_signals: a GPU heap on a transport without atomics on device
#: memory): one int64 per ring slot, the local end of a signal's, set's or fetch's put or get
RING_STAGE_OFF = 32 * 1024
#: at most this many ring slots then (MORI_SHMEM_PROXY_SLOTS)
RING_STAGE_MAX_SLOTS = 4096

#: first byte handed out by shmem_malloc
USER_OFF = 64 * 1024

assert CALL_RECORD_OFF + 2 * CALL_RECORD_WORDS * SLOT_BYTES <= RING_STAGE_OFF
assert RING_STAGE_OFF + RING_STAGE_MAX_SLOTS * SLOT_BYTES <= USER_OFF

# -- the proxy's request ring (csrc/proxy.cpp; mori.core._core.PROXY_LAYOUT has the same numbers,
# checked by a test). Byte offsets from the ring's base; every word is 64-bit.

#: next ticket: producers reserve a slot with a fetch-add
RING_HEAD = 0
#: tickets below this are complete at their target (the proxy writes it)
RING_COMPLETED = 64
#: 0, or the first failure's code (RING_ERR_*); then the PE and the ticket it concerned
RING_ERROR = 128
RING_ERROR_PE = 136
RING_ERROR_TICKET = 144
#: number of slots N (a power of two, >= 4)
RING_SLOT_COUNT = 192
#: 1 if the proxy carries signals, sets and fetches by puts and gets (rma_signals), else 0
RING_RMA_SIGNALS = 200
#: first slot; each is RING_SLOT_BYTES long, its words numbered W_*
RING_SLOTS = 256
RING_SLOT_BYTES = 128
(
    W_SEQ,
    W_OP,
    W_PE,
    W_FLAGS,
    W_AMO,
    W_WORD,
    W_DST,
    W_SRC,
    W_NBYTES,
    W_VALUE,
    W_COMPARE,
    W_SIG_ADDR,
    W_RESULT,
) = range(13)
#: request operations
OP_PUT, OP_GET, OP_AMO, OP_PUT_SIGNAL, OP_FENCE = range(1, 6)
#: W_FLAGS bit: the producer waits for the result (slot kept until it read it)
FLAG_REPLY = 1
#: W_FLAGS bit: the value is also in the producer's staging word (rma_signals; RING_STAGE_OFF)
FLAG_STAGED = 2
#: error codes: refused (a bad request), transport failure, stopped, a producer gave up, proxy died
RING_ERR_REFUSED, RING_ERR_TRANSPORT, RING_ERR_STOPPED, RING_ERR_PRODUCER, RING_ERR_DIED = range(1, 6)
