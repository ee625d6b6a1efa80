# Jitted functions carry no Python annotations (Triton reads them), so mypy may not ask for them:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Device API of mori.shmem for Triton: ``@triton.jit`` functions that your own kernels call.

This is our form of the original's device bitcode: import the module and call its functions from a
``@triton.jit`` kernel; Triton inlines them. One source compiles for NVIDIA (sm_90, sm_100) and AMD
(gfx942, gfx950) GPUs and runs on CPU tensors under ``TRITON_INTERPRET=1``.

**The context.** A kernel that uses the device API takes one extra argument, the shmem context
``ctx_ptr``: the int64 tensor returned by :func:`shmem_device_context` (host side), laid out as
``[my_pe, n_pes, base_0, ..., base_{n_pes-1}]`` where ``base_p`` is the address, in this process,
of PE ``p``'s heap. Every device function that needs it takes ``ctx_ptr`` as its last runtime
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

**Reach.** Device functions use loads, stores and atomics, so the PEs they touch must be load/store
reachable from this one (``shmem_ptr_p2p`` is non-zero): all PEs of a node on the ``cpu`` runtime
and GPUs of one node over NVLink / xGMI. Remote PEs would need the proxy, which this API does not
reach yet.

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

# context tensor: [my_pe, n_pes, base_0, ..., base_{n_pes-1}]
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

# default memory order of the atomics
_ACQ_REL = tl.constexpr("acq_rel")
_SYS = tl.constexpr("sys")


# -- host side ----------------------------------------------------------------------------------------


def shmem_device_context() -> torch.Tensor:
    """The context tensor that kernels using this API take as ``ctx_ptr``.

    int64 tensor ``[2 + n_pes]`` on the runtime's torch device (``cpu`` or ``cuda``):
    ``[my_pe, n_pes, base_0, ..., base_{n_pes-1}]``, ``base_p`` = address of PE ``p``'s heap in this
    process, ``0`` if PE ``p`` is not load/store reachable. Made once per ``shmem_init`` and cached;
    do not modify it. Not collective.
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
        values = [ctx.my_pe, ctx.n_pes, *ctx.bases]
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
    # address (int64) of PE pe's heap in this process; 0 if it is not reachable
    return tl.load(ctx_ptr + _CTX_BASES + pe)


@device_function
@triton.jit
def ptr_p2p(ptr, pe, ctx_ptr):
    """Pointer to PE ``pe``'s copy of the symmetric object that ``ptr`` points to on this PE.

    ``ptr``: a pointer (or a block of pointers) into this PE's heap; the result has the same type
    and shape. Heaps are symmetric, so the translation adds ``base_pe - base_me`` bytes. The result
    is meaningless if ``pe`` is not load/store reachable (its base in the context is 0).
    """
    delta = _heap_base(pe, ctx_ptr) - _heap_base(my_pe(ctx_ptr), ctx_ptr)
    # Both bases are 16-byte aligned, so the byte distance is a whole number of elements: move the
    # pointer by elements (not through an int64), so the compiler still knows the result's
    # alignment and keeps the accesses vectorised.
    delta = tl.multiple_of(delta, _BASE_ALIGN_C)
    ELEM_BYTES: tl.constexpr = (ptr.dtype.element_ty.primitive_bitwidth + 7) // 8
    return ptr + delta // ELEM_BYTES


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
    # (while, not range: a runtime loop bound is a 1-element array under the interpreter.)
    offs = tl.arange(0, BLOCK)
    n_full = n_elems // BLOCK
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
    to tell the peer, or the end of the kernel.
    """
    _copy_block(ptr_p2p(dst_ptr, pe, ctx_ptr), src_ptr, n_elems, BLOCK)


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

    The data has arrived when it returns (loads complete before the stores that use them).
    """
    _copy_block(dst_ptr, ptr_p2p(src_ptr, pe, ctx_ptr), n_elems, BLOCK)


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
    peer_sig = ptr_p2p(sig_ptr, pe, ctx_ptr)
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
    putmem_block(dst_ptr, src_ptr, n_elems, pe, ctx_ptr, BLOCK)
    # Every thread of the program has issued its stores; the release atomic below (one thread)
    # is cumulative, so the peer that acquires the signal sees all of them.
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
# atomic. SEM / SCOPE: see the module docstring (default acq_rel, system scope).


@device_function
@triton.jit
def atomic_fetch(ptr, pe, ctx_ptr, SEM: tl.constexpr = _ACQ_REL, SCOPE: tl.constexpr = _SYS):
    """Atomically read the word at ``ptr`` on PE ``pe`` (a read-modify-write that ors 0)."""
    return tl.atomic_or(ptr_p2p(ptr, pe, ctx_ptr), 0, sem=SEM, scope=SCOPE)


@device_function
@triton.jit
def atomic_set(ptr, value, pe, ctx_ptr, SEM: tl.constexpr = _ACQ_REL, SCOPE: tl.constexpr = _SYS):
    """Atomically store ``value`` into the word at ``ptr`` on PE ``pe``."""
    tl.atomic_xchg(ptr_p2p(ptr, pe, ctx_ptr), value, sem=SEM, scope=SCOPE)


@device_function
@triton.jit
def atomic_add(ptr, value, pe, ctx_ptr, SEM: tl.constexpr = _ACQ_REL, SCOPE: tl.constexpr = _SYS):
    """Atomically add ``value`` to the word at ``ptr`` on PE ``pe`` (wraps on overflow)."""
    tl.atomic_add(ptr_p2p(ptr, pe, ctx_ptr), value, sem=SEM, scope=SCOPE)


@device_function
@triton.jit
def atomic_fetch_add(ptr, value, pe, ctx_ptr, SEM: tl.constexpr = _ACQ_REL, SCOPE: tl.constexpr = _SYS):
    """Atomically add ``value`` to the word at ``ptr`` on PE ``pe``; return the previous value."""
    return tl.atomic_add(ptr_p2p(ptr, pe, ctx_ptr), value, sem=SEM, scope=SCOPE)


@device_function
@triton.jit
def atomic_swap(ptr, value, pe, ctx_ptr, SEM: tl.constexpr = _ACQ_REL, SCOPE: tl.constexpr = _SYS):
    """Atomically replace the word at ``ptr`` on PE ``pe`` with ``value``; return the previous value."""
    return tl.atomic_xchg(ptr_p2p(ptr, pe, ctx_ptr), value, sem=SEM, scope=SCOPE)


@device_function
@triton.jit
def atomic_compare_swap(
    ptr, cond, value, pe, ctx_ptr, SEM: tl.constexpr = _ACQ_REL, SCOPE: tl.constexpr = _SYS
):
    """If the word at ``ptr`` on PE ``pe`` equals ``cond``, replace it with ``value``.

    Returns the value found: equal to ``cond`` exactly when the swap happened.
    """
    word = ptr.dtype.element_ty
    return tl.atomic_cas(
        ptr_p2p(ptr, pe, ctx_ptr), tl.cast(cond, word), tl.cast(value, word), sem=SEM, scope=SCOPE
    )


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

    Block scope (all threads of the program call it).
    """
    tl.debug_barrier()
    tl.atomic_or(ctx_ptr + _CTX_MY_PE, 0, sem="acq_rel", scope="sys")
    tl.debug_barrier()


@device_function
@triton.jit
def quiet(ctx_ptr):
    """Complete this program's puts and atomics: everything before is visible at its target to a
    peer that synchronises with a later release of this program. Block scope."""
    tl.debug_barrier()
    tl.atomic_or(ctx_ptr + _CTX_MY_PE, 0, sem="acq_rel", scope="sys")
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
    docstring). Every PE must be load/store reachable.
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
    tl.debug_barrier()  # the whole program has issued its earlier stores before the releases
    p = tl.cast(0, tl.int64)
    while p < npes:
        slot = _heap_base(p, ctx_ptr) + _DEVICE_BARRIER_OFF + me * _SLOT_BYTES
        tl.atomic_xchg(slot.to(tl.pointer_type(tl.int64)), epoch, sem="release", scope="sys")
        p += 1
    p = tl.cast(0, tl.int64)
    while p < npes:
        slot = my_base + _DEVICE_BARRIER_OFF + p * _SLOT_BYTES
        wait_until(slot.to(tl.pointer_type(tl.int64)), SHMEM_CMP_GE, epoch)
        p += 1
    tl.debug_barrier()  # no thread of the program runs ahead of the waits
