# Jitted functions carry no Python annotations (Triton reads them), so mypy may not ask for them:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Device API of mori.shmem for Triton: ``@triton.jit`` functions that your own kernels call.

This is our form of the original's device bitcode: import the module and call its functions from a
``@triton.jit`` kernel; Triton inlines them. One source compiles for NVIDIA (sm_90, sm_100) and AMD
(gfx942, gfx950) GPUs and runs on CPU tensors under ``TRITON_INTERPRET=1``.

**The context.** A kernel that uses the device API takes one extra argument, the shmem context
``ctx_ptr``: the int64 tensor returned by :func:`shmem_device_context` (host side), laid out as
``[my_pe, n_pes, base_0, ..., base_{n_pes-1}, ring]`` where ``base_p`` is the address, in this
process, of PE ``p``'s heap (0 if loads and stores cannot reach it) and ``ring`` the address of this
PE's proxy ring (0 if every PE is load/store reachable). Every device function that needs it takes ``ctx_ptr`` as its last runtime
argument (before any ``tl.constexpr`` ones)::

    from mori.shmem import device as shd

    @triton.jit
    def ring_kernel(buf_ptr, n, ctx_ptr, BLOCK: tl.constexpr):
        peer = (shd.my_pe(ctx_ptr) + 1) % shd.n_pes(ctx_ptr)
        shd.putmem_block(buf_ptr, buf_ptr, n, peer, ctx_ptr, BLOCK)

    ring_kernel[(1,)](buf, buf.numel(), shd.shmem_device_context(), BLOCK=1024)

**Addresses.** A symmetric object is named by this PE's pointer to it (a tensor from
:func:`~mori.shmem.mori_shmem_create_tensor` or :func:`~mori.shmem.shmem_tensor_view`) plus a PE;
:func:`ptr_p2p` turns it into a pointer to that PE's copy, which plain loads and stores reach.
Pointers are typed: sizes are in elements of the pointer's type unless a name says bytes.

**Reach.** A PE that loads and stores reach (``shmem_ptr_p2p`` is non-zero: all PEs of a node on
the ``cpu`` runtime, GPUs of one node over NVLink / xGMI) is accessed directly. Any other PE (another
node, or every peer with ``MORI_DISABLE_P2P=1``) is served by this PE's **proxy**: the function
writes a request into the proxy's ring (a 128-byte slot: reserve a ticket with a fetch-add on the
ring's head, wait while the slot is still in use -- a full ring waits, it never overwrites -- write
the fields, publish with a release store of the slot's sequence word) and a host thread executes it
on the network transport (``csrc/proxy.cpp``). Then:

* :func:`putmem_block`, :func:`put_signal_block`, :func:`signal_op`, :func:`atomic_set` and
  :func:`atomic_add` return once the request is queued: the source of a put must not change
  until :func:`quiet` (the original's ``nbi`` semantics); local buffers must be symmetric heap
  memory or registered with ``shmem_buffer_register``;
* :func:`getmem_block` and the fetching atomics wait for the proxy's answer;
* :func:`fence` orders the proxy's operations, :func:`quiet` waits until the proxy has completed
  every request issued before (the ring's completed counter reaches the head), and
  :func:`barrier_all` quiets first;
* the proxy checks every request (PE, heap range, registered local memory) and refuses bad ones.
  A kernel cannot raise: after a refusal or a transport failure the proxy executes nothing more,
  device waits on it stop (results are then undefined) and the next host call that waits on the
  proxy (``shmem_quiet``, ``shmem_barrier_all``, ...) raises
  :class:`~mori.core.errors.MoriBackendError` naming the PE.

**GPU heaps without atomics on device memory** (a transport without
``CAP_DEVICE_ATOMIC``, such as ``ucx`` without RDMA, whose atomics run on the target's CPU): the
proxy carries signals (``SIGNAL_SET``), :func:`atomic_set` and :func:`atomic_fetch` as puts and
gets of a staging word in this PE's heap (device to device memory), and refuses every other atomic
and ``SIGNAL_ADD`` (a read-modify-write) by name. ``MORI_SHMEM_PROXY_ATOMICS=rma`` applies the same
restriction on any heap, to check a kernel on CPU.

Run under the Triton interpreter on CPU (2 emulated nodes x 2 ranks over ``tcp`` and ``ucx``) and
on one H200 (two PEs sharing it, ``MORI_DISABLE_P2P=1``, ``ucx`` over cuda_ipc: a 1 KiB
put+signal ping-pong took 190 µs per round trip, kernel launches included).

**Memory order.** Atomics take ``SEM`` (``"relaxed"``, ``"acquire"``, ``"release"``,
``"acq_rel"``) and ``SCOPE`` (``"cta"``, ``"gpu"``, ``"sys"``); the default is ``"acq_rel"`` at
``"sys"`` scope, because peers are other processes and other GPUs. Publish data with a release
(:func:`signal_op`, :func:`put_signal_block`, the atomics) and consume it after an acquire
(:func:`wait_until`): that chain is what orders memory between PEs.

**Scope of one call.** A call is made by one *program* (a block of threads); "block" in a name
means all threads of the calling program take part (the original's ``*_block`` functions).

**No timeouts on the device.** :func:`wait_until` and :func:`barrier_all` spin until the condition
holds: a kernel cannot raise, so a peer that never arrives hangs the kernel. Under the interpreter
the programs of one launch run one after another: a program must never wait for a later program of
the same launch (waiting for other processes is fine). On a GPU, a kernel that waits for another
kernel *of the same process* (two streams) can deadlock if the second one's module is loaded while
the first spins (CUDA documents that loading may wait for the device to be idle): launch each such
kernel once beforehand, with the same argument specialisations, or set ``CUDA_MODULE_LOADING=EAGER``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

try:
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "mori.shmem.device needs Triton: install it with `pip install mori-core[triton]` "
        "(torch wheels for NVIDIA GPUs bring it already)"
    ) from e

from mori.core.errors import MoriValueError
from mori.core.kernels import device_function
from mori.shmem import host, layout
from mori.shmem.context import current

if TYPE_CHECKING:
    import torch

__all__ = [
    "SHMEM_CMP_EQ",
    "SHMEM_CMP_GE",
    "SHMEM_CMP_GT",
    "SHMEM_CMP_LE",
    "SHMEM_CMP_LT",
    "SHMEM_CMP_NE",
    "SIGNAL_ADD",
    "SIGNAL_SET",
    "atomic_add",
    "atomic_compare_swap",
    "atomic_fetch",
    "atomic_fetch_add",
    "atomic_set",
    "atomic_swap",
    "barrier_all",
    "fence",
    "getmem_block",
    "my_pe",
    "n_pes",
    "ptr_p2p",
    "put_signal_block",
    "putmem_block",
    "quiet",
    "shmem_device_context",
    "signal_op",
    "wait_until",
]

# -- constants (usable inside jitted code: module-level tl.constexpr) ---------------------------------

#: signal operations for signal_op / put_signal_block (the host API's values)
SIGNAL_SET = tl.constexpr(host.SIGNAL_SET)
SIGNAL_ADD = tl.constexpr(host.SIGNAL_ADD)
#: comparisons for wait_until (the host API's values)
SHMEM_CMP_EQ = tl.constexpr(host.SHMEM_CMP_EQ)
SHMEM_CMP_NE = tl.constexpr(host.SHMEM_CMP_NE)
SHMEM_CMP_GT = tl.constexpr(host.SHMEM_CMP_GT)
SHMEM_CMP_GE = tl.constexpr(host.SHMEM_CMP_GE)
SHMEM_CMP_LT = tl.constexpr(host.SHMEM_CMP_LT)
SHMEM_CMP_LE = tl.constexpr(host.SHMEM_CMP_LE)

# context tensor: [my_pe, n_pes, base_0, ..., base_{n_pes-1}, ring]
_CTX_MY_PE = tl.constexpr(0)
_CTX_N_PES = tl.constexpr(1)
_CTX_BASES = tl.constexpr(2)
# heap bases are at least this aligned (checked by shmem_device_context), so a translated pointer
# keeps the alignment of the original and copies stay vectorised
_BASE_ALIGN = 16
_BASE_ALIGN_C = tl.constexpr(_BASE_ALIGN)

# reserved region of every heap (mori.shmem.layout)
_DEVICE_BARRIER_OFF = tl.constexpr(layout.DEVICE_BARRIER_OFF)
_DEVICE_BARRIER_EPOCH_OFF = tl.constexpr(layout.DEVICE_BARRIER_EPOCH_OFF)
_SLOT_BYTES = tl.constexpr(layout.SLOT_BYTES)

# the proxy's ring (mori.shmem.layout), as int64 word indices
_RING_HEAD = tl.constexpr(layout.RING_HEAD // 8)
_RING_COMPLETED = tl.constexpr(layout.RING_COMPLETED // 8)
_RING_ERROR = tl.constexpr(layout.RING_ERROR // 8)
_RING_SLOT_COUNT = tl.constexpr(layout.RING_SLOT_COUNT // 8)
_RING_RMA_SIGNALS = tl.constexpr(layout.RING_RMA_SIGNALS // 8)
_RING_STAGE_OFF = tl.constexpr(layout.RING_STAGE_OFF)
_RING_SLOTS = tl.constexpr(layout.RING_SLOTS // 8)
_RING_SLOT_WORDS = tl.constexpr(layout.RING_SLOT_BYTES // 8)
_W_SEQ = tl.constexpr(layout.W_SEQ)
_W_OP = tl.constexpr(layout.W_OP)
_W_PE = tl.constexpr(layout.W_PE)
_W_FLAGS = tl.constexpr(layout.W_FLAGS)
_W_AMO = tl.constexpr(layout.W_AMO)
_W_WORD = tl.constexpr(layout.W_WORD)
_W_DST = tl.constexpr(layout.W_DST)
_W_SRC = tl.constexpr(layout.W_SRC)
_W_NBYTES = tl.constexpr(layout.W_NBYTES)
_W_VALUE = tl.constexpr(layout.W_VALUE)
_W_COMPARE = tl.constexpr(layout.W_COMPARE)
_W_SIG_ADDR = tl.constexpr(layout.W_SIG_ADDR)
_W_RESULT = tl.constexpr(layout.W_RESULT)
_OP_PUT = tl.constexpr(layout.OP_PUT)
_OP_GET = tl.constexpr(layout.OP_GET)
_OP_AMO = tl.constexpr(layout.OP_AMO)
_OP_PUT_SIGNAL = tl.constexpr(layout.OP_PUT_SIGNAL)
_OP_FENCE = tl.constexpr(layout.OP_FENCE)
_FLAG_REPLY = tl.constexpr(layout.FLAG_REPLY)
_FLAG_STAGED = tl.constexpr(layout.FLAG_STAGED)
# the transport's atomic codes (mori/transport.h)
_TP_FETCH = tl.constexpr(0)
_TP_SET = tl.constexpr(1)
_TP_ADD = tl.constexpr(2)
_TP_SWAP = tl.constexpr(3)
_TP_OR = tl.constexpr(5)
_TP_CSWAP = tl.constexpr(7)

# default memory order of the atomics
_ACQ_REL = tl.constexpr("acq_rel")
_SYS = tl.constexpr("sys")


# -- host side ----------------------------------------------------------------------------------------


def shmem_device_context() -> torch.Tensor:
    """The context tensor that kernels using this API take as ``ctx_ptr``.

    int64 tensor ``[3 + n_pes]`` on the runtime's torch device (``cpu`` or ``cuda``):
    ``[my_pe, n_pes, base_0, ..., base_{n_pes-1}, ring]``, ``base_p`` = address of PE ``p``'s heap
    in this process, ``0`` if PE ``p`` is not load/store reachable; ``ring`` = the device address of
    this PE's proxy ring, ``0`` without one. Made once per ``shmem_init`` and cached; do not modify
    it. Not collective.
    """
    import torch

    func = "shmem_device_context"
    ctx = current(func)
    cached = ctx.device_context
    if cached is None:
        odd = [p for p, b in enumerate(ctx.bases) if b % _BASE_ALIGN]
        if odd:
            raise MoriValueError(
                f"{func}: the heaps of PEs {odd} are mapped at addresses that are not {_BASE_ALIGN}-byte "
                f"aligned ({[hex(ctx.bases[p]) for p in odd]}); the device API needs aligned heaps"
            )
        ring = ctx.network.ring.device_addr if ctx.network is not None else 0
        values = [ctx.my_pe, ctx.n_pes, *ctx.bases, ring]
        cached = torch.tensor(values, dtype=torch.int64, device=ctx.runtime.torch_device_of_heap())
        ctx.device_context = cached
    return cached  # type: ignore[no-any-return]


# -- identity and addresses ---------------------------------------------------------------------------


@device_function
@triton.jit
def my_pe(ctx_ptr):
    """This PE's number, an int64 scalar in ``[0, n_pes)``."""
    return tl.load(ctx_ptr + _CTX_MY_PE)


@device_function
@triton.jit
def n_pes(ctx_ptr):
    """The number of PEs in the job, an int64 scalar."""
    return tl.load(ctx_ptr + _CTX_N_PES)


@device_function
@triton.jit
def _heap_base(pe, ctx_ptr):
    # address (int64) of PE pe's heap in this process; 0 if it is not load/store reachable or pe is
    # out of range (then the proxy gets the request, and refuses it)
    ok = (pe >= 0) & (pe < n_pes(ctx_ptr))
    return tl.load(ctx_ptr + _CTX_BASES + pe, mask=ok, other=0)


@device_function
@triton.jit
def _translate(ptr, pe, ctx_ptr):
    # ptr moved to PE pe's heap (pe load/store reachable)
    delta = _heap_base(pe, ctx_ptr) - _heap_base(my_pe(ctx_ptr), ctx_ptr)
    # Both bases are 16-byte aligned, so the byte distance is a whole number of elements: move the
    # pointer by elements (not through an int64), so the compiler still knows the result's
    # alignment and keeps the accesses vectorised.
    delta = tl.multiple_of(delta, _BASE_ALIGN_C)
    ELEM_BYTES: tl.constexpr = (ptr.dtype.element_ty.primitive_bitwidth + 7) // 8
    return ptr + delta // ELEM_BYTES


@device_function
@triton.jit
def ptr_p2p(ptr, pe, ctx_ptr):
    """Pointer to PE ``pe``'s copy of the symmetric object that ``ptr`` points to on this PE.

    ``ptr``: a pointer (or a block of pointers) into this PE's heap; the result has the same type
    and shape. Heaps are symmetric, so the translation adds ``base_pe - base_me`` bytes. The result
    is null if ``pe`` is not load/store reachable (another node: use the put/get/atomic functions,
    which go through the proxy) or out of range: address 0 when ``ptr`` is 16-byte aligned (every
    ``shmem_malloc`` block is), as the original's ``ShmemPtrP2p``, else ``ptr % 16``, inside the
    never-mapped first page.
    """
    peer = _heap_base(pe, ctx_ptr)
    ELEM_BYTES: tl.constexpr = (ptr.dtype.element_ty.primitive_bitwidth + 7) // 8
    STEP: tl.constexpr = _BASE_ALIGN_C // ELEM_BYTES  # elements in 16 bytes (every element is <= 8 bytes)
    # Reachable: move by the heaps' distance (a multiple of 16 bytes). Unreachable: move by minus
    # the address rounded down to 16 bytes, which lands on address (ptr % 16): 0 for an aligned
    # pointer, inside the never-mapped first page otherwise. Both offsets are whole 16-byte steps,
    # so the hint below is true either way and accesses through the result stay vectorised; the
    # choice is made on the offset, not between two pointers (a select of pointers breaks AMD's
    # pointer canonicalisation).
    delta = (peer - _heap_base(my_pe(ctx_ptr), ctx_ptr)) // ELEM_BYTES
    to_null = -(ptr.to(tl.int64, bitcast=True) // _BASE_ALIGN_C) * STEP
    return ptr + tl.multiple_of(tl.where(peer != 0, delta, to_null), STEP)


# -- the proxy ------------------------------------------------------------------------------------


@device_function
@triton.jit
def _ring_addr(ctx_ptr):
    # address (int64) of this PE's proxy ring; 0 without one
    return tl.load(ctx_ptr + _CTX_BASES + n_pes(ctx_ptr))


@device_function
@triton.jit
def _ring(ctx_ptr):
    # int64 pointer to this PE's proxy ring
    return _ring_addr(ctx_ptr).to(tl.pointer_type(tl.int64))


@device_function
@triton.jit
def _ring_wait(word_ptr, target, ring):
    # Spin until the ring word at word_ptr is >= target (acquire), or the proxy has failed (its
    # error word is set: then nothing more completes, and the host raises).
    v = tl.atomic_add(word_ptr, 0, sem="acquire", scope="sys")
    err = tl.load(ring + _RING_ERROR, volatile=True)
    while (v < target) & (err == 0):
        v = tl.atomic_add(word_ptr, 0, sem="acquire", scope="sys")
        err = tl.load(ring + _RING_ERROR, volatile=True)
    return v


@device_function
@triton.jit
def _address(ptr):
    # a pointer as an int64 address
    return tl.cast(ptr, tl.int64)


@device_function
@triton.jit
def _word_code(ptr):
    # the transport's word type of ptr's element: int32 0, uint32 1, int64 2, uint64 3
    ty: tl.constexpr = ptr.dtype.element_ty
    tl.static_assert(
        ty.is_int() & ((ty.primitive_bitwidth == 32) | (ty.primitive_bitwidth == 64)),
        "atomics and signals take int32, uint32, int64 or uint64 words",
    )
    CODE: tl.constexpr = (ty.primitive_bitwidth // 32 - 1) * 2 + ty.is_int_unsigned()
    return CODE


@device_function
@triton.jit
def _proxy_request(
    # the context (this PE's ring and heap), the operation (_OP_*) and the target PE
    ctx_ptr,
    op,
    pe,
    # addresses (int64): symmetric ones as this PE sees them, local ones in registered memory
    dst,
    src,
    nbytes,
    # atomics and signals: transport operation and word type, operands, signal word
    amo,
    word,
    value,
    compare,
    sig_addr,
    # wait for the proxy's answer and return it (get, fetching atomics)
    REPLY: tl.constexpr,
):
    # Algorithm (csrc/proxy.cpp has the proxy's half): reserve ticket t with a fetch-add on the
    # head; wait until slot t % N is free (its sequence word is t); write the fields; publish with
    # a release store of seq = t + 1. With REPLY, wait for seq = t + 2 (the proxy wrote the
    # result), read the result, free the slot with seq = t + N. Returns the result (int64; 0
    # without REPLY; undefined if the proxy failed). A proxy with rma_signals (a GPU heap, no
    # atomics on device memory) moves the value of an atomic or signal from the slot's staging
    # word in this PE's heap, and a fetch's result into it: device memory to device memory.
    ring = _ring(ctx_ptr)
    nslots = tl.load(ring + _RING_SLOT_COUNT)
    t = tl.atomic_add(ring + _RING_HEAD, 1, sem="relaxed", scope="sys")
    slot = ring + _RING_SLOTS + (t % nslots) * _RING_SLOT_WORDS
    _ring_wait(slot + _W_SEQ, t, ring)
    staged = (tl.load(ring + _RING_RMA_SIGNALS) != 0) & ((op == _OP_AMO) | (op == _OP_PUT_SIGNAL))
    stage = (_heap_base(my_pe(ctx_ptr), ctx_ptr) + _RING_STAGE_OFF + (t % nslots) * 8).to(
        tl.pointer_type(tl.int64)
    )
    if staged:
        tl.store(stage, tl.cast(value, tl.int64))
    flags = tl.where(staged, _FLAG_STAGED, 0) + (_FLAG_REPLY if REPLY else 0)
    tl.store(slot + _W_OP, tl.cast(op, tl.int64))
    tl.store(slot + _W_PE, tl.cast(pe, tl.int64))
    tl.store(slot + _W_FLAGS, tl.cast(flags, tl.int64))
    tl.store(slot + _W_AMO, tl.cast(amo, tl.int64))
    tl.store(slot + _W_WORD, tl.cast(word, tl.int64))
    tl.store(slot + _W_DST, tl.cast(dst, tl.int64))
    tl.store(slot + _W_SRC, tl.cast(src, tl.int64))
    tl.store(slot + _W_NBYTES, tl.cast(nbytes, tl.int64))
    tl.store(slot + _W_VALUE, tl.cast(value, tl.int64))
    tl.store(slot + _W_COMPARE, tl.cast(compare, tl.int64))
    tl.store(slot + _W_SIG_ADDR, tl.cast(sig_addr, tl.int64))
    tl.debug_barrier()  # every thread's stores are issued before the release below (one thread)
    tl.atomic_xchg(slot + _W_SEQ, t + 1, sem="release", scope="sys")
    result = tl.cast(0, tl.int64)
    if REPLY:
        _ring_wait(slot + _W_SEQ, t + 2, ring)
        if staged:  # the proxy's get wrote the staging word
            result = tl.load(stage, volatile=True)
        else:
            result = tl.load(slot + _W_RESULT, volatile=True)
        tl.atomic_xchg(slot + _W_SEQ, t + nslots, sem="release", scope="sys")
    return result


@device_function
@triton.jit
def _proxy_atomic(ptr, amo, value, compare, pe, ctx_ptr, REPLY: tl.constexpr):
    # an atomic on the word at ptr on PE pe through the proxy; returns the old value (REPLY)
    old = _proxy_request(
        ctx_ptr,
        _OP_AMO,
        pe,
        _address(ptr),
        0,
        0,
        amo,
        _word_code(ptr),
        tl.cast(value, ptr.dtype.element_ty),
        tl.cast(compare, ptr.dtype.element_ty),
        0,
        REPLY,
    )
    return tl.cast(old, ptr.dtype.element_ty)


# -- block copies -------------------------------------------------------------------------------------


@device_function
@triton.jit
def _copy_block(
    # pointers, same element type: destination and source, either may be a peer's
    dst_ptr,
    src_ptr,
    # elements to copy
    n_elems,
    # elements per iteration (a power of two)
    BLOCK: tl.constexpr,
):
    # Whole blocks first, with no mask: block i covers [i*BLOCK, (i+1)*BLOCK) <= n_elems, and an
    # unmasked access at an offset that is a multiple of BLOCK compiles to full-width vector loads
    # and stores. Then at most one partial block, masked so nothing past n_elems is touched.
    # (while, not range: a runtime loop bound is a 1-element array under the interpreter. The `if`
    # drops the loop when n_elems < BLOCK is known at compile time: Triton 3.6's TritonGPUCoalesce
    # pass asserts on a `while` whose condition folds to false, e.g. put_signal_block(..., 1, ...).)
    offs = tl.arange(0, BLOCK)
    n_full = n_elems // BLOCK
    if n_full > 0:
        i = tl.cast(0, tl.int64)
        while i < n_full:
            start = i * BLOCK
            tl.store(dst_ptr + start + offs, tl.load(src_ptr + start + offs))
            i += 1
    start = tl.cast(n_full, tl.int64) * BLOCK
    if start < n_elems:
        mask = start + offs < n_elems
        tl.store(dst_ptr + start + offs, tl.load(src_ptr + start + offs, mask=mask), mask=mask)


@device_function
@triton.jit
def putmem_block(
    # pointers, same element type: destination (this PE's address of a symmetric object), source
    # (any memory of this PE)
    dst_ptr,
    src_ptr,
    # elements to copy
    n_elems,
    # target PE and shmem context
    pe,
    ctx_ptr,
    # elements per iteration of the calling program (a power of two, e.g. 1024)
    BLOCK: tl.constexpr,
):
    """Copy ``n_elems`` elements from local ``src_ptr`` to ``dst_ptr`` on PE ``pe``. Block scope.

    The calling program copies the whole range with vectorised loads and stores, ``BLOCK`` elements
    per step; split a large copy over programs by giving each its own sub-range. The stores are
    issued when it returns; use :func:`put_signal_block` (or :func:`quiet` and a release atomic)
    to tell the peer, or the end of the kernel. A PE on another node: one request to the proxy
    (``src_ptr`` in the heap or a registered buffer, unchanged until :func:`quiet`).
    """
    if _heap_base(pe, ctx_ptr) == 0:
        ELEM_BYTES: tl.constexpr = (dst_ptr.dtype.element_ty.primitive_bitwidth + 7) // 8
        _proxy_request(
            ctx_ptr,
            _OP_PUT,
            pe,
            _address(dst_ptr),
            _address(src_ptr),
            n_elems * ELEM_BYTES,
            0,
            0,
            0,
            0,
            0,
            False,
        )
    else:
        _copy_block(_translate(dst_ptr, pe, ctx_ptr), src_ptr, n_elems, BLOCK)


@device_function
@triton.jit
def getmem_block(
    # pointers, same element type: destination (any memory of this PE), source (this PE's address
    # of a symmetric object)
    dst_ptr,
    src_ptr,
    # elements to copy
    n_elems,
    # source PE and shmem context
    pe,
    ctx_ptr,
    # elements per iteration of the calling program (a power of two)
    BLOCK: tl.constexpr,
):
    """Copy ``n_elems`` elements from ``src_ptr`` on PE ``pe`` to local ``dst_ptr``. Block scope.

    The data has arrived when it returns (loads complete before the stores that use them; from a
    PE on another node, the proxy answered; ``dst_ptr`` must be in the heap or a registered buffer).
    """
    if _heap_base(pe, ctx_ptr) == 0:
        ELEM_BYTES: tl.constexpr = (dst_ptr.dtype.element_ty.primitive_bitwidth + 7) // 8
        _proxy_request(
            ctx_ptr,
            _OP_GET,
            pe,
            _address(dst_ptr),
            _address(src_ptr),
            n_elems * ELEM_BYTES,
            0,
            0,
            0,
            0,
            0,
            True,
        )
    else:
        _copy_block(dst_ptr, _translate(src_ptr, pe, ctx_ptr), n_elems, BLOCK)


# -- signals ------------------------------------------------------------------------------------------


@device_function
@triton.jit
def signal_op(sig_ptr, signal, SIG_OP: tl.constexpr, pe, ctx_ptr):
    """Update the signal word ``sig_ptr`` (uint64 or int64, symmetric) on PE ``pe``. Thread scope.

    ``SIG_OP``: :data:`SIGNAL_SET` stores ``signal``, :data:`SIGNAL_ADD` adds it; either is an
    atomic with release semantics at system scope, so everything this program wrote before is
    visible to a peer that sees the new value with :func:`wait_until`.
    """
    # (not "in (...)": Triton's code generator does not take it on constexprs)
    tl.static_assert(
        (SIG_OP == SIGNAL_SET) | (SIG_OP == SIGNAL_ADD), "SIG_OP must be SIGNAL_SET or SIGNAL_ADD"
    )
    if _heap_base(pe, ctx_ptr) == 0:
        _proxy_atomic(sig_ptr, _TP_SET if SIG_OP == SIGNAL_SET else _TP_ADD, signal, 0, pe, ctx_ptr, False)
    else:
        peer_sig = _translate(sig_ptr, pe, ctx_ptr)
        if SIG_OP == SIGNAL_SET:
            tl.atomic_xchg(peer_sig, signal, sem="release", scope="sys")
        else:
            tl.atomic_add(peer_sig, signal, sem="release", scope="sys")


@device_function
@triton.jit
def put_signal_block(
    # pointers: destination (symmetric), source (local), signal word (symmetric, uint64 or int64)
    dst_ptr,
    src_ptr,
    sig_ptr,
    # elements to copy
    n_elems,
    # signal value, target PE, shmem context
    signal,
    pe,
    ctx_ptr,
    # SIGNAL_SET or SIGNAL_ADD; elements per iteration
    SIG_OP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """:func:`putmem_block`, then :func:`signal_op` on PE ``pe`` once the data is there. Block scope.

    A peer that waits for the signal (:func:`wait_until`, or ``shmem_wait_until`` on the host)
    then reads the whole range. Only this program's copy is covered: when several programs share a
    transfer, let the last one to finish send the signal (see ``put_signal_kernel`` in
    :mod:`mori.shmem.kernels`).
    """
    if _heap_base(pe, ctx_ptr) == 0:
        # one request: the proxy puts, fences, then updates the signal
        ELEM_BYTES: tl.constexpr = (dst_ptr.dtype.element_ty.primitive_bitwidth + 7) // 8
        _proxy_request(
            ctx_ptr,
            _OP_PUT_SIGNAL,
            pe,
            _address(dst_ptr),
            _address(src_ptr),
            n_elems * ELEM_BYTES,
            _TP_SET if SIG_OP == SIGNAL_SET else _TP_ADD,
            _word_code(sig_ptr),
            tl.cast(signal, sig_ptr.dtype.element_ty),
            0,
            _address(sig_ptr),
            False,
        )
    else:
        putmem_block(dst_ptr, src_ptr, n_elems, pe, ctx_ptr, BLOCK)
        # Every thread of the program has issued its stores; the release atomic below (one
        # thread) is cumulative, so the peer that acquires the signal sees all of them.
        tl.debug_barrier()
        signal_op(sig_ptr, signal, SIG_OP, pe, ctx_ptr)


@device_function
@triton.jit
def _satisfies(v, CMP: tl.constexpr, value):
    # v <CMP> value, with CMP one of SHMEM_CMP_*
    if CMP == SHMEM_CMP_EQ:
        ok = v == value
    elif CMP == SHMEM_CMP_NE:
        ok = v != value
    elif CMP == SHMEM_CMP_GT:
        ok = v > value
    elif CMP == SHMEM_CMP_GE:
        ok = v >= value
    elif CMP == SHMEM_CMP_LT:
        ok = v < value
    else:
        ok = v <= value
    return ok


@device_function
@triton.jit
def wait_until(ptr, CMP: tl.constexpr, value):
    """Spin until this PE's word ``*ptr`` satisfies ``word <CMP> value``; return the word.

    ``ptr``: int32, uint32, int64 or uint64 word of this PE (a peer's store or atomic changes it);
    ``CMP``: one of ``SHMEM_CMP_EQ/NE/GT/GE/LT/LE``; ``value`` is converted to the word's type.
    Thread scope (all threads of the program may call it). The value returned was read with
    acquire semantics at system scope, so what the writer published before its release is
    visible after the return. There is no timeout on the device: if the condition never holds,
    the kernel never ends.
    """
    tl.static_assert(CMP >= 0 and CMP <= 5, "CMP must be one of SHMEM_CMP_EQ/NE/GT/GE/LT/LE")
    target = tl.cast(value, ptr.dtype.element_ty)
    # The outer reads are acquires: Triton has no acquire load, but lowers an acquire atomic add
    # of 0 to one (ld.acquire.sys on NVIDIA, a system-coherent load plus cache invalidate on AMD).
    # Their value must be used, or the compiler drops them. The inner spin uses volatile loads,
    # which every thread does on its own (a scalar atomic is done by one thread and broadcast
    # through shared memory, with a CTA barrier each time).
    v = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
    while not _satisfies(v, CMP, target):
        w = tl.load(ptr, volatile=True)
        while not _satisfies(w, CMP, target):
            w = tl.load(ptr, volatile=True)
        v = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
    return v


# -- atomics on a peer's word ---------------------------------------------------------------------
# ptr: this PE's address of a symmetric int32/uint32/int64/uint64 word (the pointer's type picks
# the width); value/cond are converted to that type. Thread scope: the calling program does one
# atomic. SEM / SCOPE: see the module docstring (default acq_rel, system scope). A PE on another
# node: the proxy does the atomic (the transport's; SEM / SCOPE do not apply), the fetching ones
# wait for its answer.


@device_function
@triton.jit
def atomic_fetch(ptr, pe, ctx_ptr, SEM: tl.constexpr = _ACQ_REL, SCOPE: tl.constexpr = _SYS):
    """Atomically read the word at ``ptr`` on PE ``pe`` (a read-modify-write that ors 0)."""
    if _heap_base(pe, ctx_ptr) == 0:
        old = _proxy_atomic(ptr, _TP_FETCH, 0, 0, pe, ctx_ptr, True)
    else:
        old = tl.atomic_or(_translate(ptr, pe, ctx_ptr), 0, sem=SEM, scope=SCOPE)
    return old


@device_function
@triton.jit
def atomic_set(ptr, value, pe, ctx_ptr, SEM: tl.constexpr = _ACQ_REL, SCOPE: tl.constexpr = _SYS):
    """Atomically store ``value`` into the word at ``ptr`` on PE ``pe``."""
    if _heap_base(pe, ctx_ptr) == 0:
        _proxy_atomic(ptr, _TP_SET, value, 0, pe, ctx_ptr, False)
    else:
        tl.atomic_xchg(_translate(ptr, pe, ctx_ptr), value, sem=SEM, scope=SCOPE)


@device_function
@triton.jit
def atomic_add(ptr, value, pe, ctx_ptr, SEM: tl.constexpr = _ACQ_REL, SCOPE: tl.constexpr = _SYS):
    """Atomically add ``value`` to the word at ``ptr`` on PE ``pe`` (wraps on overflow)."""
    if _heap_base(pe, ctx_ptr) == 0:
        _proxy_atomic(ptr, _TP_ADD, value, 0, pe, ctx_ptr, False)
    else:
        tl.atomic_add(_translate(ptr, pe, ctx_ptr), value, sem=SEM, scope=SCOPE)


@device_function
@triton.jit
def atomic_fetch_add(ptr, value, pe, ctx_ptr, SEM: tl.constexpr = _ACQ_REL, SCOPE: tl.constexpr = _SYS):
    """Atomically add ``value`` to the word at ``ptr`` on PE ``pe``; return the previous value."""
    if _heap_base(pe, ctx_ptr) == 0:
        old = _proxy_atomic(ptr, _TP_ADD, value, 0, pe, ctx_ptr, True)
    else:
        old = tl.atomic_add(_translate(ptr, pe, ctx_ptr), value, sem=SEM, scope=SCOPE)
    return old


@device_function
@triton.jit
def atomic_swap(ptr, value, pe, ctx_ptr, SEM: tl.constexpr = _ACQ_REL, SCOPE: tl.constexpr = _SYS):
    """Atomically replace the word at ``ptr`` on PE ``pe`` with ``value``; return the previous value."""
    if _heap_base(pe, ctx_ptr) == 0:
        old = _proxy_atomic(ptr, _TP_SWAP, value, 0, pe, ctx_ptr, True)
    else:
        old = tl.atomic_xchg(_translate(ptr, pe, ctx_ptr), value, sem=SEM, scope=SCOPE)
    return old


@device_function
@triton.jit
def atomic_compare_swap(
    ptr, cond, value, pe, ctx_ptr, SEM: tl.constexpr = _ACQ_REL, SCOPE: tl.constexpr = _SYS
):
    """If the word at ``ptr`` on PE ``pe`` equals ``cond``, replace it with ``value``.

    Returns the value found: equal to ``cond`` exactly when the swap happened.
    """
    word = ptr.dtype.element_ty
    if _heap_base(pe, ctx_ptr) == 0:
        old = _proxy_atomic(ptr, _TP_CSWAP, value, cond, pe, ctx_ptr, True)
    else:
        old = tl.atomic_cas(
            _translate(ptr, pe, ctx_ptr), tl.cast(cond, word), tl.cast(value, word), sem=SEM, scope=SCOPE
        )
    return old


# -- ordering -----------------------------------------------------------------------------------------
# OpenSHMEM: fence orders this PE's puts to each peer (earlier ones arrive first), quiet completes
# all of them. With load/store transports both come down to one system-scope memory fence. Triton
# has no fence instruction (and the interpreter no inline asm), so both are built from what it has:
#   1. tl.debug_barrier(): every thread of the program has issued its earlier stores (CTA order);
#   2. one acq_rel read-modify-write at system scope (or 0 into the context's my_pe word, whose
#      value never changes; not "add 0", which Triton turns into a plain acquire load). Its
#      release half orders all earlier accesses of the program before it, its acquire half all
#      later ones after it. sm_90 code: MEMBAR.ALL.SYS; ATOMG.OR.STRONG.SYS; CCTL.IVALL, i.e.
#      __threadfence_system(); gfx942: buffer_wbl2 sc0 sc1 (write back to system scope), the
#      atomic, buffer_inv sc0 sc1. By the memory models a peer is ordered only through a
#      release/acquire chain, which is what signal_op / the atomics and wait_until give;
#   3. tl.debug_barrier() again, so that no thread starts a later access before the fence is done.
# On the CPU interpreter programs run one at a time and every atomic is sequentially consistent,
# so both are no-ops in effect there.


@device_function
@triton.jit
def fence(ctx_ptr):
    """Order this program's puts and atomics: those before reach their targets before those after.

    Block scope (all threads of the program call it). With a proxy (PEs on other nodes) it also
    queues a fence request: the proxy's operations before it reach their targets first.
    """
    tl.debug_barrier()
    tl.atomic_or(ctx_ptr + _CTX_MY_PE, 0, sem="acq_rel", scope="sys")
    tl.debug_barrier()
    if _ring_addr(ctx_ptr) != 0:
        _proxy_request(ctx_ptr, _OP_FENCE, 0, 0, 0, 0, 0, 0, 0, 0, 0, False)


@device_function
@triton.jit
def quiet(ctx_ptr):
    """Complete this program's puts and atomics: everything before is visible at its target to a
    peer that synchronises with a later release of this program. Block scope.

    With a proxy (PEs on other nodes): waits until the proxy has completed every request issued
    on this PE before the call (its completed counter reaches the head), or has failed."""
    tl.debug_barrier()
    tl.atomic_or(ctx_ptr + _CTX_MY_PE, 0, sem="acq_rel", scope="sys")
    tl.debug_barrier()
    if _ring_addr(ctx_ptr) != 0:
        ring = _ring(ctx_ptr)
        issued = tl.atomic_add(ring + _RING_HEAD, 0, sem="acquire", scope="sys")
        _ring_wait(ring + _RING_COMPLETED, issued, ring)
        tl.debug_barrier()


# -- barrier ------------------------------------------------------------------------------------------


@device_function
@triton.jit
def barrier_all(ctx_ptr):
    """Barrier over all PEs, called by ONE program per PE (e.g. program 0 of a launch, or a launch
    of one program). Block scope; every PE must call it the same number of times.

    Returns once every PE has arrived; memory this program wrote before it is visible to every PE
    after it. It does not wait for the other programs of the launch (that would need a program to
    wait for later ones): to cover their writes, end the kernel first. No timeout (see the module
    docstring). PEs on other nodes are reached through the proxy (it quiets first, then sends
    the arrival as a proxy atomic).
    """
    # Algorithm: every PE counts its barriers in its own epoch word (only it touches that word).
    # Arriving at barrier number e, it writes e with a release atomic into its slot (slot my_pe)
    # of every PE's DEVICE_BARRIER_OFF array, then waits until each slot of its own array is >= e
    # (acquire). Slot p is only ever written by PE p, epochs only grow, and ">=" lets a fast PE
    # that already reached barrier e+1 count for e.
    me = my_pe(ctx_ptr)
    npes = n_pes(ctx_ptr)
    my_base = _heap_base(me, ctx_ptr)
    epoch_ptr = (my_base + _DEVICE_BARRIER_EPOCH_OFF).to(tl.pointer_type(tl.int64))
    epoch = tl.load(epoch_ptr, volatile=True) + 1
    tl.store(epoch_ptr, epoch)
    quiet(ctx_ptr)  # the whole program's earlier stores are issued, the proxy's requests complete
    p = tl.cast(0, tl.int64)
    while p < npes:
        base = _heap_base(p, ctx_ptr)
        if base == 0:  # my slot of PE p's array, named by its symmetric address here
            my_slot = my_base + _DEVICE_BARRIER_OFF + me * _SLOT_BYTES
            _proxy_atomic(my_slot.to(tl.pointer_type(tl.int64)), _TP_SET, epoch, 0, p, ctx_ptr, False)
        else:
            slot = base + _DEVICE_BARRIER_OFF + me * _SLOT_BYTES
            tl.atomic_xchg(slot.to(tl.pointer_type(tl.int64)), epoch, sem="release", scope="sys")
        p += 1
    p = tl.cast(0, tl.int64)
    while p < npes:
        slot = my_base + _DEVICE_BARRIER_OFF + p * _SLOT_BYTES
        wait_until(slot.to(tl.pointer_type(tl.int64)), SHMEM_CMP_GE, epoch)
        p += 1
    tl.debug_barrier()  # no thread of the program runs ahead of the waits
