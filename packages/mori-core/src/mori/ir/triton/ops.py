# Jitted functions carry no Python annotations (Triton reads them), so mypy may not ask for them:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""The original's device functions for Triton kernels, as ``@triton.jit`` functions over
:mod:`mori.shmem.device`.

Every name of :data:`mori.ir.MORI_DEVICE_FUNCTIONS` is a function here with the original's
arguments, in the original's order, so a kernel written for the original's IR compiles and runs
unchanged, on NVIDIA and AMD GPUs and on CPU tensors under ``TRITON_INTERPRET=1``::

    from mori.ir import triton as mori_shmem_device

    @triton.jit
    def ring_kernel(buf_ptr, nbytes):
        me = mori_shmem_device.my_pe()
        peer = (me + 1) % mori_shmem_device.n_pes()
        mori_shmem_device.putmem_nbi_block(buf_ptr, buf_ptr, nbytes, peer, 0)
        mori_shmem_device.quiet_thread()

**Calling conventions** (the original's). A pointer argument is a Triton pointer or its address
in an integer (``ptr.to(tl.uint64, bitcast=True)``); a returned pointer (``ptr_p2p``, ``ptr``) is a
``uint64`` address, 0 when the PE cannot be reached; turn it into a pointer with
``addr.to(tl.pointer_type(tl.float32), bitcast=True)``. Arguments are scalars. Functions that
compute nothing return an ``int32`` status: 0 done; -1 not done, because the PE is out of range or
not load/store reachable, or an operation code is not one listed in :mod:`mori.ir.ops`. ``*mem*``
sizes are bytes, typed ones (``put_uint32_*``, ...) elements. ``qp`` (the original's queue pair) is
accepted and ignored: these functions move data with loads and stores.

**Scope.** A Triton kernel has no threads to name: every call is made by a whole program (thread
block), and ``*_thread``, ``*_warp`` and ``*_block`` do the same thing: the calling program does
the whole operation once (a copy is spread over the program's threads, 16-byte vectors when the
addresses and the size are multiples of 16). Split large copies over programs yourself, one range
each, as the original's examples do.

**Completion and order.** Puts to load/store reachable PEs are issued when they return (stronger
than the original's non-blocking ``nbi``); to PEs of other nodes they are queued to the proxy, as
``nbi`` (the source must stay unchanged until ``quiet_*``); ``quiet_*`` / ``fence_*`` order them before later writes, and
``putmem_nbi_signal_*`` sends the signal (a release atomic at system scope) only after its data.
Waits (``*_wait_until_*``) spin on this PE's own word with acquire loads and never time out: a
signal that never comes hangs the kernel. Barriers (``barrier_all_*``) must be called by one program
per PE (see :func:`mori.shmem.device.barrier_all`). Under the interpreter, a program must not wait
for a later program of the same launch.

**Reach.** Load/store reachable peers (``mori.shmem.shmem_ptr_p2p`` is non-zero: ranks of one
node on the ``cpu`` runtime, GPUs of one node over NVLink / xGMI, ranks sharing one GPU) are
reached with loads and stores; PEs of other nodes through this PE's proxy, as in
:mod:`mori.shmem.device` (the original uses RDMA there): puts, gets, signals and atomics. Immediate
puts (``*_p``) of a value need load/store reach: to another node they do nothing and return -1.
A PE out of range: nothing is done, -1.

**Context.** No function takes the shmem context: kernels reach it through a compile-time constant
of this process (:mod:`mori.ir.triton.context`), so shmem must be initialised before a kernel that
calls these functions is first compiled or run, and such kernels are compiled once per process.
"""

from __future__ import annotations

import triton
import triton.language as tl

import mori.ir.ops as abi
from mori.core.kernels import device_function
from mori.ir.triton.context import CONTEXT
from mori.shmem import device as shd

__all__ = sorted(abi.MORI_DEVICE_FUNCTIONS)

# operation codes as constexprs (jitted code reads module globals only if they are tl.constexpr)
_SIGNAL_SET = tl.constexpr(abi.SIGNAL_SET)
_SIGNAL_ADD = tl.constexpr(abi.SIGNAL_ADD)
_AMO_INC = tl.constexpr(abi.AMO_INC)
_AMO_SET = tl.constexpr(abi.AMO_SET)
_AMO_ADD = tl.constexpr(abi.AMO_ADD)
_AMO_AND = tl.constexpr(abi.AMO_AND)
_AMO_OR = tl.constexpr(abi.AMO_OR)
_AMO_XOR = tl.constexpr(abi.AMO_XOR)
_AMO_FETCH = tl.constexpr(abi.AMO_FETCH)
_AMO_FETCH_INC = tl.constexpr(abi.AMO_FETCH_INC)
_AMO_FETCH_ADD = tl.constexpr(abi.AMO_FETCH_ADD)
_AMO_FETCH_AND = tl.constexpr(abi.AMO_FETCH_AND)
_AMO_FETCH_OR = tl.constexpr(abi.AMO_FETCH_OR)
_AMO_FETCH_XOR = tl.constexpr(abi.AMO_FETCH_XOR)
_AMO_SWAP = tl.constexpr(abi.AMO_SWAP)
_AMO_COMPARE_SWAP = tl.constexpr(abi.AMO_COMPARE_SWAP)
# context buffer layout (mori.shmem.device): [my_pe, n_pes, base_0, ...]
_CTX_BASES = tl.constexpr(2)
# the transport's and / or / xor codes (mori/transport.h), for atomics through the proxy
_TP_AND = tl.constexpr(4)
_TP_OR = tl.constexpr(5)
_TP_XOR = tl.constexpr(6)
# elements a program moves per step of a copy: 4 KiB (int32) on the aligned path, 1 KiB on the other
_COPY_BLOCK = tl.constexpr(1024)


# -- helpers ------------------------------------------------------------------------------------------


@device_function
@triton.jit
def _context():
    # pointer (int64) to this process's IR context buffer, whose address is a compile-time constant
    return tl.cast(CONTEXT, tl.int64).to(tl.pointer_type(tl.int64))


@device_function
@triton.jit
def _address(x):
    # a pointer argument as a uint64 address: from a Triton pointer or from an integer
    return tl.cast(x, tl.uint64)


@device_function
@triton.jit
def _pointer(addr, DTYPE: tl.constexpr):
    # a uint64 address as a pointer to DTYPE
    return addr.to(tl.pointer_type(DTYPE), bitcast=True)


@device_function
@triton.jit
def _heap_base(pe, ctx):
    # int64 address of PE pe's heap in this process; 0 if pe is out of range or not reachable
    ok = (pe >= 0) & (pe < shd.n_pes(ctx))
    return tl.load(ctx + _CTX_BASES + pe, mask=ok, other=0)


@device_function
@triton.jit
def _served(pe, ctx):
    # PE pe is in range and reached: by loads and stores, or (another node) through the proxy
    ok = (pe >= 0) & (pe < shd.n_pes(ctx))
    return ok & ((_heap_base(pe, ctx) != 0) | (shd._ring_addr(ctx) != 0))


@device_function
@triton.jit
def _status(ok):
    # int32 status of an operation: 0 if it was done, -1 if not
    return ok.to(tl.int32) - 1


@device_function
@triton.jit
def _done():
    return tl.full([], 0, tl.int32)


# Not inlined: a kernel holds one copy of the copy loops however many puts and gets it makes (a
# kernel with 15 of them compiled 5x slower inlined), for the cost of a call per transfer.
@device_function
@triton.jit(noinline=True)
def _transfer(dest, source, nbytes, pe, TO_PEER: tl.constexpr):
    # Copy nbytes from source to dest; TO_PEER: dest is on PE pe (a put), else source is (a get).
    # Both are this PE's addresses (of a symmetric object for the remote side); mori.shmem.device
    # translates the remote one. 16-byte vectors when both addresses and the size allow them.
    ctx = _context()
    d = _address(dest)
    s = _address(source)
    n = tl.cast(nbytes, tl.uint64)
    ok = _served(pe, ctx)
    if ok:
        if ((d | s | n) & 15) == 0:
            # The hints go on the pointers, here: on the integer they would not survive the cast,
            # and on the result of a called function (_pointer) they would not survive inlining.
            dw = tl.multiple_of(d.to(tl.pointer_type(tl.int32), bitcast=True), 16)
            sw = tl.multiple_of(s.to(tl.pointer_type(tl.int32), bitcast=True), 16)
            words = (n // 4).to(tl.int64)
            if TO_PEER:
                shd.putmem_block(dw, sw, words, pe, ctx, _COPY_BLOCK)
            else:
                shd.getmem_block(dw, sw, words, pe, ctx, _COPY_BLOCK)
        else:
            # (names differ from the branch above: Triton wants one type per name across branches)
            db = _pointer(d, tl.uint8)
            sb = _pointer(s, tl.uint8)
            if TO_PEER:
                shd.putmem_block(db, sb, n.to(tl.int64), pe, ctx, _COPY_BLOCK)
            else:
                shd.getmem_block(db, sb, n.to(tl.int64), pe, ctx, _COPY_BLOCK)
    return _status(ok)


@device_function
@triton.jit
def _signal(sig_addr, signal, sig_op, pe):
    # SIGNAL_SET / SIGNAL_ADD the uint64 word sig_addr on PE pe (a release atomic); status
    ctx = _context()
    sig = _pointer(_address(sig_addr), tl.uint64)
    value = tl.cast(signal, tl.uint64)
    ok = _served(pe, ctx)
    st = _status(ok)
    if ok:
        if sig_op == _SIGNAL_SET:
            shd.signal_op(sig, value, shd.SIGNAL_SET, pe, ctx)
        elif sig_op == _SIGNAL_ADD:
            shd.signal_op(sig, value, shd.SIGNAL_ADD, pe, ctx)
        else:
            st = tl.full([], -1, tl.int32)
    return st


@device_function
@triton.jit
def _put_value(dest, value, pe, DTYPE: tl.constexpr):
    # store one DTYPE value at dest on PE pe; status
    ctx = _context()
    peer = _heap_base(pe, ctx)
    ok = peer != 0
    if ok:
        mine = _heap_base(shd.my_pe(ctx), ctx)
        addr = _address(dest) - mine.to(tl.uint64) + peer.to(tl.uint64)
        tl.store(_pointer(addr, DTYPE), tl.cast(value, DTYPE))
    return _status(ok)


@device_function
@triton.jit
def _atomic(dest, value, compare, op, pe, WORD: tl.constexpr):
    # One atomic operation op (an AMO_* / SIGNAL_* code) on the WORD at dest on PE pe, acq_rel at
    # system scope. Returns (the previous value, 0 if the operation had none; status).
    ctx = _context()
    word = _pointer(_address(dest), WORD)
    v = tl.cast(value, WORD)
    ok = _served(pe, ctx)
    near = _heap_base(pe, ctx) != 0
    old = tl.full([], 0, WORD)
    st = _status(ok)
    if ok:
        if (op == _AMO_ADD) | (op == _AMO_FETCH_ADD) | (op == _SIGNAL_ADD):
            old = shd.atomic_fetch_add(word, v, pe, ctx)
        elif (op == _AMO_INC) | (op == _AMO_FETCH_INC):
            old = shd.atomic_fetch_add(word, tl.full([], 1, WORD), pe, ctx)
        elif (op == _AMO_SET) | (op == _AMO_SWAP) | (op == _SIGNAL_SET):
            old = shd.atomic_swap(word, v, pe, ctx)
        elif op == _AMO_FETCH:
            old = shd.atomic_fetch(word, pe, ctx)
        elif op == _AMO_COMPARE_SWAP:
            old = shd.atomic_compare_swap(word, compare, v, pe, ctx)
        elif (op == _AMO_AND) | (op == _AMO_FETCH_AND):
            if near:
                old = tl.atomic_and(shd.ptr_p2p(word, pe, ctx), v, sem="acq_rel", scope="sys")
            else:
                old = shd._proxy_atomic(word, _TP_AND, v, 0, pe, ctx, True)
        elif (op == _AMO_OR) | (op == _AMO_FETCH_OR):
            if near:
                old = tl.atomic_or(shd.ptr_p2p(word, pe, ctx), v, sem="acq_rel", scope="sys")
            else:
                old = shd._proxy_atomic(word, _TP_OR, v, 0, pe, ctx, True)
        elif (op == _AMO_XOR) | (op == _AMO_FETCH_XOR):
            if near:
                old = tl.atomic_xor(shd.ptr_p2p(word, pe, ctx), v, sem="acq_rel", scope="sys")
            else:
                old = shd._proxy_atomic(word, _TP_XOR, v, 0, pe, ctx, True)
        else:
            st = tl.full([], -1, tl.int32)
    return old, st


# -- query --------------------------------------------------------------------------------------------


@device_function
@triton.jit
def my_pe():
    """This PE's number (int32)."""
    return shd.my_pe(_context()).to(tl.int32)


@device_function
@triton.jit
def n_pes():
    """The number of PEs (int32)."""
    return shd.n_pes(_context()).to(tl.int32)


# -- point to point -----------------------------------------------------------------------------------


@device_function
@triton.jit
def ptr_p2p(ptr, my_pe, dest_pe):
    """Address (uint64) of PE ``dest_pe``'s copy of the symmetric object that PE ``my_pe``'s
    pointer ``ptr`` names; 0 if either PE is out of range or not load/store reachable."""
    ctx = _context()
    peer = _heap_base(dest_pe, ctx)
    mine = _heap_base(my_pe, ctx)
    ok = (peer != 0) & (mine != 0)
    return tl.where(ok, _address(ptr) - mine.to(tl.uint64) + peer.to(tl.uint64), tl.full([], 0, tl.uint64))


@device_function
@triton.jit
def ptr(dest, dest_pe):
    """:func:`ptr_p2p` from this PE: the address (uint64) of ``dest`` on PE ``dest_pe``, or 0."""
    return ptr_p2p(dest, shd.my_pe(_context()), dest_pe)


# -- ordering and barriers ----------------------------------------------------------------------------


@device_function
@triton.jit
def quiet_thread():
    """Complete this program's puts and atomics (:func:`mori.shmem.device.quiet`). Returns 0."""
    shd.quiet(_context())
    return _done()


@device_function
@triton.jit
def quiet_thread_pe(pe):
    """:func:`quiet_thread` (it completes the operations to every PE, ``pe``'s included)."""
    shd.quiet(_context())
    return _done()


@device_function
@triton.jit
def quiet_thread_pe_qp(pe, qp):
    """:func:`quiet_thread` (``qp`` is ignored)."""
    shd.quiet(_context())
    return _done()


@device_function
@triton.jit
def fence_thread():
    """Order this program's puts and atomics (:func:`mori.shmem.device.fence`). Returns 0."""
    shd.fence(_context())
    return _done()


@device_function
@triton.jit
def fence_thread_pe(pe):
    """:func:`fence_thread` (it orders the operations to every PE, ``pe``'s included)."""
    shd.fence(_context())
    return _done()


@device_function
@triton.jit
def fence_thread_pe_qp(pe, qp):
    """:func:`fence_thread` (``qp`` is ignored)."""
    shd.fence(_context())
    return _done()


@device_function
@triton.jit
def barrier_all_thread():
    """Barrier over all PEs, called by one program per PE (:func:`mori.shmem.device.barrier_all`)."""
    shd.barrier_all(_context())
    return _done()


@device_function
@triton.jit
def barrier_all_block():
    """:func:`barrier_all_thread` (one program per PE calls it)."""
    shd.barrier_all(_context())
    return _done()


# -- puts and gets --------------------------------------------------------------------------------


@device_function
@triton.jit
def putmem_nbi_thread(dest, source, nbytes, pe, qp):
    """Put ``nbytes`` bytes to PE ``pe`` (thread scope: see the module docstring). Status."""
    return _transfer(dest, source, nbytes, pe, True)


@device_function
@triton.jit
def put_uint32_nbi_thread(dest, source, nelems, pe, qp):
    """putmem_nbi_thread of ``nelems`` uint32 elements (4 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 4, pe, True)


@device_function
@triton.jit
def put_uint64_nbi_thread(dest, source, nelems, pe, qp):
    """putmem_nbi_thread of ``nelems`` uint64 elements (8 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 8, pe, True)


@device_function
@triton.jit
def put_float_nbi_thread(dest, source, nelems, pe, qp):
    """putmem_nbi_thread of ``nelems`` float elements (4 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 4, pe, True)


@device_function
@triton.jit
def put_double_nbi_thread(dest, source, nelems, pe, qp):
    """putmem_nbi_thread of ``nelems`` double elements (8 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 8, pe, True)


@device_function
@triton.jit
def putmem_nbi_warp(dest, source, nbytes, pe, qp):
    """Put ``nbytes`` bytes to PE ``pe`` (warp scope: see the module docstring). Status."""
    return _transfer(dest, source, nbytes, pe, True)


@device_function
@triton.jit
def put_uint32_nbi_warp(dest, source, nelems, pe, qp):
    """putmem_nbi_warp of ``nelems`` uint32 elements (4 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 4, pe, True)


@device_function
@triton.jit
def put_uint64_nbi_warp(dest, source, nelems, pe, qp):
    """putmem_nbi_warp of ``nelems`` uint64 elements (8 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 8, pe, True)


@device_function
@triton.jit
def put_float_nbi_warp(dest, source, nelems, pe, qp):
    """putmem_nbi_warp of ``nelems`` float elements (4 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 4, pe, True)


@device_function
@triton.jit
def put_double_nbi_warp(dest, source, nelems, pe, qp):
    """putmem_nbi_warp of ``nelems`` double elements (8 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 8, pe, True)


@device_function
@triton.jit
def putmem_nbi_block(dest, source, nbytes, pe, qp):
    """Put ``nbytes`` bytes to PE ``pe`` (block scope: see the module docstring). Status."""
    return _transfer(dest, source, nbytes, pe, True)


@device_function
@triton.jit
def put_uint32_nbi_block(dest, source, nelems, pe, qp):
    """putmem_nbi_block of ``nelems`` uint32 elements (4 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 4, pe, True)


@device_function
@triton.jit
def put_uint64_nbi_block(dest, source, nelems, pe, qp):
    """putmem_nbi_block of ``nelems`` uint64 elements (8 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 8, pe, True)


@device_function
@triton.jit
def put_float_nbi_block(dest, source, nelems, pe, qp):
    """putmem_nbi_block of ``nelems`` float elements (4 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 4, pe, True)


@device_function
@triton.jit
def put_double_nbi_block(dest, source, nelems, pe, qp):
    """putmem_nbi_block of ``nelems`` double elements (8 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 8, pe, True)


@device_function
@triton.jit
def getmem_nbi_thread(dest, source, nbytes, pe, qp):
    """Get ``nbytes`` bytes from PE ``pe`` (thread scope: see the module docstring). Status."""
    return _transfer(dest, source, nbytes, pe, False)


@device_function
@triton.jit
def get_uint32_nbi_thread(dest, source, nelems, pe, qp):
    """getmem_nbi_thread of ``nelems`` uint32 elements (4 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 4, pe, False)


@device_function
@triton.jit
def get_uint64_nbi_thread(dest, source, nelems, pe, qp):
    """getmem_nbi_thread of ``nelems`` uint64 elements (8 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 8, pe, False)


@device_function
@triton.jit
def get_float_nbi_thread(dest, source, nelems, pe, qp):
    """getmem_nbi_thread of ``nelems`` float elements (4 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 4, pe, False)


@device_function
@triton.jit
def get_double_nbi_thread(dest, source, nelems, pe, qp):
    """getmem_nbi_thread of ``nelems`` double elements (8 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 8, pe, False)


@device_function
@triton.jit
def getmem_nbi_warp(dest, source, nbytes, pe, qp):
    """Get ``nbytes`` bytes from PE ``pe`` (warp scope: see the module docstring). Status."""
    return _transfer(dest, source, nbytes, pe, False)


@device_function
@triton.jit
def get_uint32_nbi_warp(dest, source, nelems, pe, qp):
    """getmem_nbi_warp of ``nelems`` uint32 elements (4 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 4, pe, False)


@device_function
@triton.jit
def get_uint64_nbi_warp(dest, source, nelems, pe, qp):
    """getmem_nbi_warp of ``nelems`` uint64 elements (8 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 8, pe, False)


@device_function
@triton.jit
def get_float_nbi_warp(dest, source, nelems, pe, qp):
    """getmem_nbi_warp of ``nelems`` float elements (4 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 4, pe, False)


@device_function
@triton.jit
def get_double_nbi_warp(dest, source, nelems, pe, qp):
    """getmem_nbi_warp of ``nelems`` double elements (8 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 8, pe, False)


@device_function
@triton.jit
def getmem_nbi_block(dest, source, nbytes, pe, qp):
    """Get ``nbytes`` bytes from PE ``pe`` (block scope: see the module docstring). Status."""
    return _transfer(dest, source, nbytes, pe, False)


@device_function
@triton.jit
def get_uint32_nbi_block(dest, source, nelems, pe, qp):
    """getmem_nbi_block of ``nelems`` uint32 elements (4 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 4, pe, False)


@device_function
@triton.jit
def get_uint64_nbi_block(dest, source, nelems, pe, qp):
    """getmem_nbi_block of ``nelems`` uint64 elements (8 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 8, pe, False)


@device_function
@triton.jit
def get_float_nbi_block(dest, source, nelems, pe, qp):
    """getmem_nbi_block of ``nelems`` float elements (4 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 4, pe, False)


@device_function
@triton.jit
def get_double_nbi_block(dest, source, nelems, pe, qp):
    """getmem_nbi_block of ``nelems`` double elements (8 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 8, pe, False)


@device_function
@triton.jit
def getmem_thread(dest, source, nbytes, pe, qp):
    """Get ``nbytes`` bytes from PE ``pe`` (thread scope: see the module docstring). Status."""
    return _transfer(dest, source, nbytes, pe, False)


@device_function
@triton.jit
def get_uint32_thread(dest, source, nelems, pe, qp):
    """getmem_thread of ``nelems`` uint32 elements (4 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 4, pe, False)


@device_function
@triton.jit
def get_uint64_thread(dest, source, nelems, pe, qp):
    """getmem_thread of ``nelems`` uint64 elements (8 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 8, pe, False)


@device_function
@triton.jit
def get_float_thread(dest, source, nelems, pe, qp):
    """getmem_thread of ``nelems`` float elements (4 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 4, pe, False)


@device_function
@triton.jit
def get_double_thread(dest, source, nelems, pe, qp):
    """getmem_thread of ``nelems`` double elements (8 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 8, pe, False)


@device_function
@triton.jit
def getmem_warp(dest, source, nbytes, pe, qp):
    """Get ``nbytes`` bytes from PE ``pe`` (warp scope: see the module docstring). Status."""
    return _transfer(dest, source, nbytes, pe, False)


@device_function
@triton.jit
def get_uint32_warp(dest, source, nelems, pe, qp):
    """getmem_warp of ``nelems`` uint32 elements (4 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 4, pe, False)


@device_function
@triton.jit
def get_uint64_warp(dest, source, nelems, pe, qp):
    """getmem_warp of ``nelems`` uint64 elements (8 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 8, pe, False)


@device_function
@triton.jit
def get_float_warp(dest, source, nelems, pe, qp):
    """getmem_warp of ``nelems`` float elements (4 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 4, pe, False)


@device_function
@triton.jit
def get_double_warp(dest, source, nelems, pe, qp):
    """getmem_warp of ``nelems`` double elements (8 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 8, pe, False)


@device_function
@triton.jit
def getmem_block(dest, source, nbytes, pe, qp):
    """Get ``nbytes`` bytes from PE ``pe`` (block scope: see the module docstring). Status."""
    return _transfer(dest, source, nbytes, pe, False)


@device_function
@triton.jit
def get_uint32_block(dest, source, nelems, pe, qp):
    """getmem_block of ``nelems`` uint32 elements (4 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 4, pe, False)


@device_function
@triton.jit
def get_uint64_block(dest, source, nelems, pe, qp):
    """getmem_block of ``nelems`` uint64 elements (8 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 8, pe, False)


@device_function
@triton.jit
def get_float_block(dest, source, nelems, pe, qp):
    """getmem_block of ``nelems`` float elements (4 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 4, pe, False)


@device_function
@triton.jit
def get_double_block(dest, source, nelems, pe, qp):
    """getmem_block of ``nelems`` double elements (8 bytes each). Status."""
    return _transfer(dest, source, tl.cast(nelems, tl.uint64) * 8, pe, False)


# -- put with signal ----------------------------------------------------------------------------------


@device_function
@triton.jit
def _put_signal(dest, source, nbytes, sig_addr, signal, sig_op, pe):
    st = _transfer(dest, source, nbytes, pe, True)
    if st == 0:
        # every thread of the program has issued its stores; the release atomic (one thread) is
        # cumulative, so a peer that acquires the signal sees all of them
        tl.debug_barrier()
        ctx = _context()
        if _heap_base(pe, ctx) == 0:  # through the proxy: a fence puts the signal behind the data
            shd.fence(ctx)
        st = _signal(sig_addr, signal, sig_op, pe)
    return st


@device_function
@triton.jit
def putmem_nbi_signal_thread(dest, source, nbytes, sig_addr, signal, sig_op, pe, qp):
    """Put ``nbytes`` bytes to PE ``pe``, then update its uint64 word ``sig_addr`` with ``signal``
    (``sig_op``: SIGNAL_SET or SIGNAL_ADD) once the data is there. Status."""
    return _put_signal(dest, source, nbytes, sig_addr, signal, sig_op, pe)


@device_function
@triton.jit
def putmem_nbi_signal_warp(dest, source, nbytes, sig_addr, signal, sig_op, pe, qp):
    """:func:`putmem_nbi_signal_thread` (warp scope: the same, see the module docstring)."""
    return _put_signal(dest, source, nbytes, sig_addr, signal, sig_op, pe)


@device_function
@triton.jit
def putmem_nbi_signal_block(dest, source, nbytes, sig_addr, signal, sig_op, pe, qp):
    """:func:`putmem_nbi_signal_thread` (block scope: the same, see the module docstring)."""
    return _put_signal(dest, source, nbytes, sig_addr, signal, sig_op, pe)


# -- single values ------------------------------------------------------------------------------------


@device_function
@triton.jit
def put_size_imm_nbi_thread(dest, value_addr, nbytes, pe, qp):
    """Put the ``nbytes`` bytes at ``value_addr`` (this PE's memory) to ``dest`` on PE ``pe``. Status."""
    return _transfer(dest, value_addr, nbytes, pe, True)


@device_function
@triton.jit
def int32_p(dest, value, pe, qp):
    """Store the int32 ``value`` at ``dest`` on PE ``pe``. Status."""
    return _put_value(dest, value, pe, tl.int32)


@device_function
@triton.jit
def int64_p(dest, value, pe, qp):
    """Store the int64 ``value`` at ``dest`` on PE ``pe``. Status."""
    return _put_value(dest, value, pe, tl.int64)


@device_function
@triton.jit
def uint32_p(dest, value, pe, qp):
    """Store the uint32 ``value`` at ``dest`` on PE ``pe``. Status."""
    return _put_value(dest, value, pe, tl.uint32)


@device_function
@triton.jit
def uint64_p(dest, value, pe, qp):
    """Store the uint64 ``value`` at ``dest`` on PE ``pe``. Status."""
    return _put_value(dest, value, pe, tl.uint64)


@device_function
@triton.jit
def int_p(dest, value, pe, qp):
    """Store the int (int32) ``value`` at ``dest`` on PE ``pe``. Status."""
    return _put_value(dest, value, pe, tl.int32)


@device_function
@triton.jit
def float_p(dest, value, pe, qp):
    """Store the float32 ``value`` at ``dest`` on PE ``pe``. Status."""
    return _put_value(dest, value, pe, tl.float32)


@device_function
@triton.jit
def double_p(dest, value, pe, qp):
    """Store the float64 ``value`` at ``dest`` on PE ``pe``. Status."""
    return _put_value(dest, value, pe, tl.float64)


# -- atomics ------------------------------------------------------------------------------------------
# acq_rel at system scope, one per call; ``amo_type`` is one of the AMO_* / SIGNAL_* codes of
# mori.ir.ops (fetching and non-fetching codes both work in both kinds of function)


@device_function
@triton.jit
def atomic_size_nonfetch_thread(dest, value_addr, nbytes, amo_type, pe, qp):
    """Atomic ``amo_type`` on the word of ``nbytes`` (4 or 8) bytes at ``dest`` on PE ``pe``, with the
    value read from ``value_addr`` (this PE's memory). Status (-1 for another size too)."""
    st = tl.full([], -1, tl.int32)
    if nbytes == 4:
        value32 = tl.load(_pointer(_address(value_addr), tl.uint32))
        _old32, st = _atomic(dest, value32, 0, amo_type, pe, tl.uint32)
    elif nbytes == 8:
        value64 = tl.load(_pointer(_address(value_addr), tl.uint64))
        _old64, st = _atomic(dest, value64, 0, amo_type, pe, tl.uint64)
    return st


@device_function
@triton.jit
def atomic_uint32_nonfetch_thread(dest, value, amo_type, pe, qp):
    """Atomic ``amo_type`` with ``value`` on the uint32 word at ``dest`` on PE ``pe``. Status."""
    _old, st = _atomic(dest, value, 0, amo_type, pe, tl.uint32)
    return st


@device_function
@triton.jit
def atomic_uint64_nonfetch_thread(dest, value, amo_type, pe, qp):
    """Atomic ``amo_type`` with ``value`` on the uint64 word at ``dest`` on PE ``pe``. Status."""
    _old, st = _atomic(dest, value, 0, amo_type, pe, tl.uint64)
    return st


@device_function
@triton.jit
def atomic_int64_nonfetch_thread(dest, value, amo_type, pe, qp):
    """Atomic ``amo_type`` with ``value`` on the int64 word at ``dest`` on PE ``pe``. Status."""
    _old, st = _atomic(dest, value, 0, amo_type, pe, tl.int64)
    return st


@device_function
@triton.jit
def atomic_uint32_fetch_thread(dest, value, compare, amo_type, pe, qp):
    """Atomic ``amo_type`` (``compare`` for AMO_COMPARE_SWAP) on the uint32 word at ``dest`` on PE
    ``pe``; returns the previous value (0 if the PE is not reachable or the code unknown)."""
    old, _st = _atomic(dest, value, compare, amo_type, pe, tl.uint32)
    return old


@device_function
@triton.jit
def atomic_uint64_fetch_thread(dest, value, compare, amo_type, pe, qp):
    """:func:`atomic_uint32_fetch_thread` on a uint64 word."""
    old, _st = _atomic(dest, value, compare, amo_type, pe, tl.uint64)
    return old


@device_function
@triton.jit
def atomic_int64_fetch_thread(dest, value, compare, amo_type, pe, qp):
    """:func:`atomic_uint32_fetch_thread` on an int64 word."""
    old, _st = _atomic(dest, value, compare, amo_type, pe, tl.int64)
    return old


@device_function
@triton.jit
def uint32_atomic_add_thread(dest, value, pe, qp):
    """Atomically add ``value`` to the uint32 word at ``dest`` on PE ``pe``. Status."""
    _old, st = _atomic(dest, value, 0, _AMO_ADD, pe, tl.uint32)
    return st


@device_function
@triton.jit
def uint32_atomic_fetch_add_thread(dest, value, pe, qp):
    """Atomically add ``value`` to the uint32 word at ``dest`` on PE ``pe``; the previous value."""
    old, _st = _atomic(dest, value, 0, _AMO_FETCH_ADD, pe, tl.uint32)
    return old


@device_function
@triton.jit
def uint64_atomic_add_thread(dest, value, pe, qp):
    """Atomically add ``value`` to the uint64 word at ``dest`` on PE ``pe``. Status."""
    _old, st = _atomic(dest, value, 0, _AMO_ADD, pe, tl.uint64)
    return st


@device_function
@triton.jit
def uint64_atomic_fetch_add_thread(dest, value, pe, qp):
    """Atomically add ``value`` to the uint64 word at ``dest`` on PE ``pe``; the previous value."""
    old, _st = _atomic(dest, value, 0, _AMO_FETCH_ADD, pe, tl.uint64)
    return old


@device_function
@triton.jit
def int64_atomic_add_thread(dest, value, pe, qp):
    """Atomically add ``value`` to the int64 word at ``dest`` on PE ``pe``. Status."""
    _old, st = _atomic(dest, value, 0, _AMO_ADD, pe, tl.int64)
    return st


@device_function
@triton.jit
def int64_atomic_fetch_add_thread(dest, value, pe, qp):
    """Atomically add ``value`` to the int64 word at ``dest`` on PE ``pe``; the previous value."""
    old, _st = _atomic(dest, value, 0, _AMO_FETCH_ADD, pe, tl.int64)
    return old


# -- waits on this PE's word (mori.shmem.device.wait_until: acquire, no timeout) ------------------


@device_function
@triton.jit
def uint32_wait_until_greater_than(addr, value):
    """Spin until this PE's uint32 word at ``addr`` is > ``value``; return the word."""
    return shd.wait_until(_pointer(_address(addr), tl.uint32), shd.SHMEM_CMP_GT, value)


@device_function
@triton.jit
def uint32_wait_until_equals(addr, value):
    """Spin until this PE's uint32 word at ``addr`` equals ``value``. Returns 0."""
    shd.wait_until(_pointer(_address(addr), tl.uint32), shd.SHMEM_CMP_EQ, value)
    return _done()


@device_function
@triton.jit
def uint64_wait_until_greater_than(addr, value):
    """Spin until this PE's uint64 word at ``addr`` is > ``value``; return the word."""
    return shd.wait_until(_pointer(_address(addr), tl.uint64), shd.SHMEM_CMP_GT, value)


@device_function
@triton.jit
def uint64_wait_until_equals(addr, value):
    """Spin until this PE's uint64 word at ``addr`` equals ``value``. Returns 0."""
    shd.wait_until(_pointer(_address(addr), tl.uint64), shd.SHMEM_CMP_EQ, value)
    return _done()


@device_function
@triton.jit
def int32_wait_until_greater_than(addr, value):
    """Spin until this PE's int32 word at ``addr`` is > ``value``; return the word."""
    return shd.wait_until(_pointer(_address(addr), tl.int32), shd.SHMEM_CMP_GT, value)


@device_function
@triton.jit
def int32_wait_until_equals(addr, value):
    """Spin until this PE's int32 word at ``addr`` equals ``value``. Returns 0."""
    shd.wait_until(_pointer(_address(addr), tl.int32), shd.SHMEM_CMP_EQ, value)
    return _done()


@device_function
@triton.jit
def int64_wait_until_greater_than(addr, value):
    """Spin until this PE's int64 word at ``addr`` is > ``value``; return the word."""
    return shd.wait_until(_pointer(_address(addr), tl.int64), shd.SHMEM_CMP_GT, value)


@device_function
@triton.jit
def int64_wait_until_equals(addr, value):
    """Spin until this PE's int64 word at ``addr`` equals ``value``. Returns 0."""
    shd.wait_until(_pointer(_address(addr), tl.int64), shd.SHMEM_CMP_EQ, value)
    return _done()


# Under the interpreter every read of the context constant is a run: tell it (see context.py).
CONTEXT.interpreted = not isinstance(my_pe, triton.runtime.jit.JITFunction)


def _compute_cache_keys() -> None:
    # Triton (3.6, runtime/jit.py DependenciesFinder._update_hash) merges a callee's globals into its
    # caller's launch check only if the callee's cache key was computed before the caller's. Compute
    # the keys here, callees first (they are defined first), so that every kernel that calls these
    # functions has CONTEXT among the globals Triton checks at each launch (context.py needs that).
    jitted = [f for f in globals().values() if isinstance(f, triton.runtime.jit.JITFunction)]
    for f in sorted(jitted, key=lambda f: f.fn.__code__.co_firstlineno if f.__module__ == __name__ else -1):
        _ = f.cache_key


if not CONTEXT.interpreted:
    _compute_cache_keys()
