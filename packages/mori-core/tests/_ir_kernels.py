"""Kernels written for the original's IR (``mori.ir.triton`` calls only), used by test_ir.py.

The first ones port the shapes of the original's IR examples (``examples/shmem/ir``): identity, an
immediate put and gets (``test_triton_shmem.py``), then a put/signal ring, then an all-reduce
written with the IR calls, by P2P loads or by put+signal (``test_triton_allreduce.py``). The
coverage kernels after them call every other function of ``mori.ir.MORI_DEVICE_FUNCTIONS``, picked
by a runtime index ``fn`` (so each kernel compiles once): the tests run every function, and
``tools/compile_kernels.py`` compiles every one for every target through them.

Imported inside the rank functions only: under the interpreter ``TRITON_INTERPRET=1`` must be set
before ``triton.jit`` runs.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from mori.core.kernels import aot
from mori.ir import SIGNAL_ADD as _SIGNAL_ADD
from mori.ir import triton as mt

SIGNAL_ADD = tl.constexpr(_SIGNAL_ADD)

#: the functions of each coverage kernel, by their index ``fn``
PUTS = [
    "putmem_nbi_thread",
    "put_uint32_nbi_thread",
    "put_uint64_nbi_thread",
    "put_float_nbi_thread",
    "put_double_nbi_thread",
    "putmem_nbi_warp",
    "put_uint32_nbi_warp",
    "put_uint64_nbi_warp",
    "put_float_nbi_warp",
    "put_double_nbi_warp",
    "putmem_nbi_block",
    "put_uint32_nbi_block",
    "put_uint64_nbi_block",
    "put_float_nbi_block",
    "put_double_nbi_block",
]
GETS_NBI = [
    "getmem_nbi_thread",
    "get_uint32_nbi_thread",
    "get_uint64_nbi_thread",
    "get_float_nbi_thread",
    "get_double_nbi_thread",
    "getmem_nbi_warp",
    "get_uint32_nbi_warp",
    "get_uint64_nbi_warp",
    "get_float_nbi_warp",
    "get_double_nbi_warp",
    "getmem_nbi_block",
    "get_uint32_nbi_block",
    "get_uint64_nbi_block",
    "get_float_nbi_block",
    "get_double_nbi_block",
]
GETS = [
    "getmem_thread",
    "get_uint32_thread",
    "get_uint64_thread",
    "get_float_thread",
    "get_double_thread",
    "getmem_warp",
    "get_uint32_warp",
    "get_uint64_warp",
    "get_float_warp",
    "get_double_warp",
    "getmem_block",
    "get_uint32_block",
    "get_uint64_block",
    "get_float_block",
    "get_double_block",
]
SIGNALS = ["putmem_nbi_signal_thread", "putmem_nbi_signal_warp", "putmem_nbi_signal_block"]
#: (name, torch dtype name of the word it stores)
VALUES = [
    ("int32_p", "int32"),
    ("int64_p", "int64"),
    ("uint32_p", "uint32"),
    ("uint64_p", "uint64"),
    ("int_p", "int32"),
    ("float_p", "float32"),
    ("double_p", "float64"),
    ("put_size_imm_nbi_thread", None),
]
#: (name, word type, returns the previous value)
ATOMICS = [
    ("atomic_uint32_nonfetch_thread", "uint32", False),
    ("atomic_uint64_nonfetch_thread", "uint64", False),
    ("atomic_int64_nonfetch_thread", "int64", False),
    ("atomic_uint32_fetch_thread", "uint32", True),
    ("atomic_uint64_fetch_thread", "uint64", True),
    ("atomic_int64_fetch_thread", "int64", True),
    ("uint32_atomic_add_thread", "uint32", False),
    ("uint32_atomic_fetch_add_thread", "uint32", True),
    ("uint64_atomic_add_thread", "uint64", False),
    ("uint64_atomic_fetch_add_thread", "uint64", True),
    ("int64_atomic_add_thread", "int64", False),
    ("int64_atomic_fetch_add_thread", "int64", True),
    ("atomic_size_nonfetch_thread", None, False),
]
#: (name, word type, compares "gt" or "eq")
WAITS = [
    (f"{w}_wait_until_{c}", w, c)
    for w in ("uint32", "uint64", "int32", "int64")
    for c in ("greater_than", "equals")
]
SYNCS = [
    "quiet_thread",
    "quiet_thread_pe",
    "quiet_thread_pe_qp",
    "fence_thread",
    "fence_thread_pe",
    "fence_thread_pe_qp",
    "barrier_all_thread",
    "barrier_all_block",
]


@aot(signature={"x_ptr": "*fp32"})
@triton.jit
def exp_kernel(x_ptr):
    """x[0] = exp(x[0]) through libdevice, which makes the NVIDIA backend link every library in
    ``extern_libs``: test_ir.py compiles it with get_extern_libs() to prove Triton takes ours."""
    tl.store(x_ptr, libdevice.exp(tl.load(x_ptr)))


# -- the shapes of the original's examples ----------------------------------------------------------


@aot(signature={"out_ptr": "*i32"})
@triton.jit
def basic_kernel(out_ptr):
    """out[0:2] = my_pe, n_pes."""
    tl.store(out_ptr, mt.my_pe())
    tl.store(out_ptr + 1, mt.n_pes())


@aot(signature={"symm_buf_ptr": "*i32", "value": "i32"})
@triton.jit
def put_kernel(symm_buf_ptr, value):
    """int32_p ``value`` into the right neighbour's buffer, then quiet."""
    me = mt.my_pe()
    mt.int32_p(symm_buf_ptr, value, (me + 1) % mt.n_pes(), 0)
    mt.quiet_thread()


@aot(
    signature={"local_buf_ptr": "*i32", "remote_buf_ptr": "*i32", "nbytes": "i32"}, constexprs={"BLOCKING": 0}
)
@aot(
    signature={"local_buf_ptr": "*i32", "remote_buf_ptr": "*i32", "nbytes": "i32"}, constexprs={"BLOCKING": 1}
)
@triton.jit
def get_kernel(local_buf_ptr, remote_buf_ptr, nbytes, BLOCKING: tl.constexpr):
    """Get ``nbytes`` of the right neighbour's buffer: getmem_nbi_thread + quiet, or getmem_thread."""
    me = mt.my_pe()
    src_pe = (me + 1) % mt.n_pes()
    if BLOCKING:
        mt.getmem_thread(local_buf_ptr, remote_buf_ptr, nbytes, src_pe, 0)
    else:
        mt.getmem_nbi_thread(local_buf_ptr, remote_buf_ptr, nbytes, src_pe, 0)
        mt.quiet_thread()


@aot(
    signature={"buf_ptr": "*u8", "sig_ptr": "*u64", "nbytes": "i32"}, constexprs={"ROUNDS": 6, "SIGNALLED": 1}
)
@aot(
    signature={"buf_ptr": "*u8", "sig_ptr": "*u64", "nbytes": "i32"}, constexprs={"ROUNDS": 6, "SIGNALLED": 0}
)
@triton.jit
def ring_kernel(
    # symmetric [ROUNDS + 1, nbytes] bytes and a symmetric uint64 signal word (zero at the start)
    buf_ptr,
    sig_ptr,
    nbytes,
    ROUNDS: tl.constexpr,
    # 1: putmem_nbi_signal_block; 0: putmem_nbi_block, fence_thread, then an atomic add of 1
    SIGNALLED: tl.constexpr,
):
    """A put/signal ring: in round r every PE sends its row r to the right neighbour's row r + 1
    and adds 1 to its signal, then waits until its own signal exceeds r (the left neighbour's row
    r + 1 is there) before it sends that row on. Row r of PE p ends up holding row 0 of PE p - r."""
    me = mt.my_pe()
    right = (me + 1) % mt.n_pes()
    for r in range(ROUNDS):
        row = buf_ptr + r * nbytes
        if SIGNALLED:
            mt.putmem_nbi_signal_block(row + nbytes, row, nbytes, sig_ptr, 1, SIGNAL_ADD, right, 0)
        else:
            mt.putmem_nbi_block(row + nbytes, row, nbytes, right, 0)
            mt.fence_thread()
            mt.uint64_atomic_add_thread(sig_ptr, 1, right, 0)
        mt.uint64_wait_until_greater_than(sig_ptr, r)


@aot(
    signature={"data_ptr": "*bf16", "result_ptr": "*bf16", "npes": "i32", "N": "i32"},
    constexprs={"BLOCK_SIZE": 1024, "MAX_PES": 8},
    aligned=("data_ptr", "result_ptr"),
)
@triton.jit
def allreduce_p2p_kernel(data_ptr, result_ptr, npes, N, BLOCK_SIZE: tl.constexpr, MAX_PES: tl.constexpr):
    """Sum of every PE's bf16 ``data`` (symmetric, N elements) into ``result``: each program loads
    its block from every PE through ``ptr_p2p`` and accumulates in float32."""
    pid = tl.program_id(0)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < N
    mype = mt.my_pe()
    data_ptr_int = data_ptr.to(tl.uint64, bitcast=True)
    acc = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
    for i in tl.static_range(MAX_PES):
        if i < npes:
            if i == mype:
                data = tl.load(data_ptr + offs, mask=mask, other=0.0)
            else:
                remote_int = mt.ptr_p2p(data_ptr_int, mype, i)
                remote_ptr = remote_int.to(tl.pointer_type(tl.bfloat16), bitcast=True)
                data = tl.load(remote_ptr + offs, mask=mask, other=0.0)
            acc += data.to(tl.float32)
    tl.store(result_ptr + offs, acc.to(tl.bfloat16), mask=mask)


def _put_signal_variants() -> list[dict[str, object]]:
    sig = {
        "input_ptr": "*bf16",
        "recv_ptr": "*bf16",
        "output_ptr": "*bf16",
        "signal_ptr": "*i64",
        "mype": "i32",
        "npes": "i32",
        "N": "i32",
    }
    return [
        {
            "signature": sig,
            "constexprs": {
                "CHUNK_SIZE": 2048,
                "MAX_PES": 8,
                "CHUNKS_PER_PE": 2,
                "BLOCK_SIZE": 1024,
                "PHASES": p,
            },
            "aligned": ("input_ptr", "recv_ptr", "output_ptr", "signal_ptr"),
        }
        for p in (1, 2, 3)
    ]


@aot(**_put_signal_variants()[0])
@aot(**_put_signal_variants()[1])
@aot(**_put_signal_variants()[2])
@triton.jit
def allreduce_put_signal_kernel(
    # symmetric: input [N], recv [npes * N], signal [npes] (int64, zero at the start); local output [N]
    input_ptr,
    recv_ptr,
    output_ptr,
    signal_ptr,
    mype,
    npes,
    N,
    CHUNK_SIZE: tl.constexpr,
    MAX_PES: tl.constexpr,
    CHUNKS_PER_PE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    # 1: phase 1 only, 2: phases 2-3 only, 3: all three in one launch
    PHASES: tl.constexpr,
):
    """All-reduce by put+signal, launched with MAX_PES * CHUNKS_PER_PE programs. Phase 1: program b
    sends chunk b % CHUNKS_PER_PE of the input to PE b // CHUNKS_PER_PE's recv row ``mype`` and adds
    1 to that PE's signal ``mype`` (a local copy for its own row). Phase 2: wait until every signal is
    CHUNKS_PER_PE. Phase 3: the programs sum the rows. The interpreter runs the programs of a launch
    one after another, so there a program of phase 2 would wait for a later one of phase 1: it
    launches phase 1 and phases 2-3 separately (PHASES 1, then 2); a GPU runs them in one (3)."""
    bid = tl.program_id(0)
    if (PHASES & 1) != 0:
        target_pe = bid // CHUNKS_PER_PE
        chunk_offset = (bid % CHUNKS_PER_PE) * CHUNK_SIZE
        chunk_elems = tl.minimum(CHUNK_SIZE, N - chunk_offset)
        if (target_pe < npes) & (chunk_elems > 0):
            if target_pe == mype:
                for off in range(0, CHUNK_SIZE, BLOCK_SIZE):
                    o = chunk_offset + off + tl.arange(0, BLOCK_SIZE)
                    m = o < N
                    tl.store(recv_ptr + mype * N + o, tl.load(input_ptr + o, mask=m), mask=m)
                tl.debug_barrier()
                tl.atomic_add(signal_ptr + mype, 1, sem="release", scope="sys")
            else:
                mt.putmem_nbi_signal_block(
                    recv_ptr + mype * N + chunk_offset,
                    input_ptr + chunk_offset,
                    tl.cast(chunk_elems * 2, tl.uint64),
                    signal_ptr + mype,
                    tl.full([], 1, tl.uint64),
                    SIGNAL_ADD,
                    target_pe,
                    0,
                )
                mt.quiet_thread()
    if (PHASES & 2) != 0:
        # chunks that lie past N are never sent: count only those that exist
        n_chunks = tl.minimum(tl.cdiv(N, CHUNK_SIZE), CHUNKS_PER_PE)
        for i in tl.static_range(MAX_PES):
            if i < npes:
                mt.uint64_wait_until_equals(signal_ptr + i, tl.cast(n_chunks, tl.uint64))
        # (while, not range: a runtime range bound is a 1-element array under the interpreter,
        # which NumPy 2 does not turn into an int)
        base = bid * BLOCK_SIZE
        while base < N:
            offs = base + tl.arange(0, BLOCK_SIZE)
            mask = offs < N
            acc = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
            for pe in tl.static_range(MAX_PES):
                if pe < npes:
                    acc += tl.load(recv_ptr + pe * N + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(output_ptr + offs, acc.to(tl.bfloat16), mask=mask)
            base += MAX_PES * CHUNKS_PER_PE * BLOCK_SIZE


# -- coverage: every other function, by index ---------------------------------------------------------

_TRANSFER = {"dest_ptr": "*u8", "source_ptr": "*u8", "n": "i32", "pe": "i32", "fn": "i32", "out_ptr": "*i32"}


@aot(signature=_TRANSFER)
@triton.jit
def put_family_kernel(dest_ptr, source_ptr, n, pe, fn, out_ptr):
    """out[0] = PUTS[fn](dest, source, n, pe, 0): n bytes for putmem_*, elements otherwise."""
    st = tl.full([], 99, tl.int32)
    if fn == 0:
        st = mt.putmem_nbi_thread(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 1:
        st = mt.put_uint32_nbi_thread(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 2:
        st = mt.put_uint64_nbi_thread(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 3:
        st = mt.put_float_nbi_thread(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 4:
        st = mt.put_double_nbi_thread(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 5:
        st = mt.putmem_nbi_warp(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 6:
        st = mt.put_uint32_nbi_warp(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 7:
        st = mt.put_uint64_nbi_warp(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 8:
        st = mt.put_float_nbi_warp(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 9:
        st = mt.put_double_nbi_warp(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 10:
        st = mt.putmem_nbi_block(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 11:
        st = mt.put_uint32_nbi_block(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 12:
        st = mt.put_uint64_nbi_block(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 13:
        st = mt.put_float_nbi_block(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 14:
        st = mt.put_double_nbi_block(dest_ptr, source_ptr, n, pe, 0)
    tl.store(out_ptr, st)


@aot(signature=_TRANSFER)
@triton.jit
def get_nbi_family_kernel(dest_ptr, source_ptr, n, pe, fn, out_ptr):
    """out[0] = GETS_NBI[fn](dest, source, n, pe, 0), then quiet_thread."""
    st = tl.full([], 99, tl.int32)
    if fn == 0:
        st = mt.getmem_nbi_thread(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 1:
        st = mt.get_uint32_nbi_thread(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 2:
        st = mt.get_uint64_nbi_thread(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 3:
        st = mt.get_float_nbi_thread(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 4:
        st = mt.get_double_nbi_thread(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 5:
        st = mt.getmem_nbi_warp(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 6:
        st = mt.get_uint32_nbi_warp(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 7:
        st = mt.get_uint64_nbi_warp(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 8:
        st = mt.get_float_nbi_warp(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 9:
        st = mt.get_double_nbi_warp(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 10:
        st = mt.getmem_nbi_block(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 11:
        st = mt.get_uint32_nbi_block(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 12:
        st = mt.get_uint64_nbi_block(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 13:
        st = mt.get_float_nbi_block(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 14:
        st = mt.get_double_nbi_block(dest_ptr, source_ptr, n, pe, 0)
    mt.quiet_thread()
    tl.store(out_ptr, st)


@aot(signature=_TRANSFER)
@triton.jit
def get_family_kernel(dest_ptr, source_ptr, n, pe, fn, out_ptr):
    """out[0] = GETS[fn](dest, source, n, pe, 0)."""
    st = tl.full([], 99, tl.int32)
    if fn == 0:
        st = mt.getmem_thread(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 1:
        st = mt.get_uint32_thread(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 2:
        st = mt.get_uint64_thread(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 3:
        st = mt.get_float_thread(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 4:
        st = mt.get_double_thread(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 5:
        st = mt.getmem_warp(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 6:
        st = mt.get_uint32_warp(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 7:
        st = mt.get_uint64_warp(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 8:
        st = mt.get_float_warp(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 9:
        st = mt.get_double_warp(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 10:
        st = mt.getmem_block(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 11:
        st = mt.get_uint32_block(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 12:
        st = mt.get_uint64_block(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 13:
        st = mt.get_float_block(dest_ptr, source_ptr, n, pe, 0)
    elif fn == 14:
        st = mt.get_double_block(dest_ptr, source_ptr, n, pe, 0)
    tl.store(out_ptr, st)


@aot(
    signature={
        "dest_ptr": "*u8",
        "source_ptr": "*u8",
        "nbytes": "i32",
        "sig_ptr": "*u64",
        "signal": "i64",
        "sig_op": "i32",
        "pe": "i32",
        "fn": "i32",
        "out_ptr": "*i32",
    }
)
@triton.jit
def signal_family_kernel(dest_ptr, source_ptr, nbytes, sig_ptr, signal, sig_op, pe, fn, out_ptr):
    """out[0] = SIGNALS[fn](dest, source, nbytes, sig, signal, sig_op, pe, 0)."""
    st = tl.full([], 99, tl.int32)
    if fn == 0:
        st = mt.putmem_nbi_signal_thread(dest_ptr, source_ptr, nbytes, sig_ptr, signal, sig_op, pe, 0)
    elif fn == 1:
        st = mt.putmem_nbi_signal_warp(dest_ptr, source_ptr, nbytes, sig_ptr, signal, sig_op, pe, 0)
    elif fn == 2:
        st = mt.putmem_nbi_signal_block(dest_ptr, source_ptr, nbytes, sig_ptr, signal, sig_op, pe, 0)
    tl.store(out_ptr, st)


@aot(
    signature={
        "dest_ptr": "*u8",
        "ivalue": "i64",
        "fvalue": "fp32",
        "value_ptr": "*u8",
        "nbytes": "i32",
        "pe": "i32",
        "fn": "i32",
        "out_ptr": "*i32",
    }
)
@triton.jit
def value_family_kernel(dest_ptr, ivalue, fvalue, value_ptr, nbytes, pe, fn, out_ptr):
    """out[0] = VALUES[fn] into dest on pe: the integer ones store ivalue, float_p / double_p fvalue,
    put_size_imm_nbi_thread the nbytes at value_ptr."""
    st = tl.full([], 99, tl.int32)
    if fn == 0:
        st = mt.int32_p(dest_ptr, ivalue, pe, 0)
    elif fn == 1:
        st = mt.int64_p(dest_ptr, ivalue, pe, 0)
    elif fn == 2:
        st = mt.uint32_p(dest_ptr, ivalue, pe, 0)
    elif fn == 3:
        st = mt.uint64_p(dest_ptr, ivalue, pe, 0)
    elif fn == 4:
        st = mt.int_p(dest_ptr, ivalue, pe, 0)
    elif fn == 5:
        st = mt.float_p(dest_ptr, fvalue, pe, 0)
    elif fn == 6:
        st = mt.double_p(dest_ptr, fvalue, pe, 0)
    elif fn == 7:
        st = mt.put_size_imm_nbi_thread(dest_ptr, value_ptr, nbytes, pe, 0)
    mt.quiet_thread()
    tl.store(out_ptr, st)


@aot(
    signature={
        "word_ptr": "*u8",
        "value": "i64",
        "compare": "i64",
        "amo": "i32",
        "value_ptr": "*u8",
        "nbytes": "i32",
        "pe": "i32",
        "fn": "i32",
        "out_ptr": "*i64",
    }
)
@triton.jit
def atomic_family_kernel(word_ptr, value, compare, amo, value_ptr, nbytes, pe, fn, out_ptr):
    """Every program calls ATOMICS[fn] once on PE pe's word; out[pid] = what it returned (the
    previous value or a status) as int64 (bits of a uint64)."""
    got = tl.full([], 99, tl.int64)
    if fn == 0:
        got = mt.atomic_uint32_nonfetch_thread(word_ptr, value, amo, pe, 0).to(tl.int64)
    elif fn == 1:
        got = mt.atomic_uint64_nonfetch_thread(word_ptr, value, amo, pe, 0).to(tl.int64)
    elif fn == 2:
        got = mt.atomic_int64_nonfetch_thread(word_ptr, value, amo, pe, 0).to(tl.int64)
    elif fn == 3:
        got = mt.atomic_uint32_fetch_thread(word_ptr, value, compare, amo, pe, 0).to(tl.int64)
    elif fn == 4:
        got = mt.atomic_uint64_fetch_thread(word_ptr, value, compare, amo, pe, 0).to(tl.int64, bitcast=True)
    elif fn == 5:
        got = mt.atomic_int64_fetch_thread(word_ptr, value, compare, amo, pe, 0)
    elif fn == 6:
        got = mt.uint32_atomic_add_thread(word_ptr, value, pe, 0).to(tl.int64)
    elif fn == 7:
        got = mt.uint32_atomic_fetch_add_thread(word_ptr, value, pe, 0).to(tl.int64)
    elif fn == 8:
        got = mt.uint64_atomic_add_thread(word_ptr, value, pe, 0).to(tl.int64)
    elif fn == 9:
        got = mt.uint64_atomic_fetch_add_thread(word_ptr, value, pe, 0).to(tl.int64, bitcast=True)
    elif fn == 10:
        got = mt.int64_atomic_add_thread(word_ptr, value, pe, 0).to(tl.int64)
    elif fn == 11:
        got = mt.int64_atomic_fetch_add_thread(word_ptr, value, pe, 0)
    elif fn == 12:
        got = mt.atomic_size_nonfetch_thread(word_ptr, value_ptr, nbytes, amo, pe, 0).to(tl.int64)
    tl.store(out_ptr + tl.program_id(0), got)


@aot(signature={"word_ptr": "*u8", "value": "i64", "fn": "i32", "out_ptr": "*i64"})
@triton.jit
def wait_family_kernel(word_ptr, value, fn, out_ptr):
    """out[0] = WAITS[fn](word, value) as int64 (the word seen, or the 0 of *_equals)."""
    got = tl.full([], 99, tl.int64)
    if fn == 0:
        got = mt.uint32_wait_until_greater_than(word_ptr, value).to(tl.int64)
    elif fn == 1:
        got = mt.uint32_wait_until_equals(word_ptr, value).to(tl.int64)
    elif fn == 2:
        got = mt.uint64_wait_until_greater_than(word_ptr, value).to(tl.int64, bitcast=True)
    elif fn == 3:
        got = mt.uint64_wait_until_equals(word_ptr, value).to(tl.int64)
    elif fn == 4:
        got = mt.int32_wait_until_greater_than(word_ptr, value).to(tl.int64)
    elif fn == 5:
        got = mt.int32_wait_until_equals(word_ptr, value).to(tl.int64)
    elif fn == 6:
        got = mt.int64_wait_until_greater_than(word_ptr, value)
    elif fn == 7:
        got = mt.int64_wait_until_equals(word_ptr, value).to(tl.int64)
    tl.store(out_ptr, got)


@aot(signature={"buf_ptr": "*i64", "ptr_out": "*i64", "pe": "i32", "fn": "i32", "out_ptr": "*i32"})
@triton.jit
def sync_family_kernel(buf_ptr, ptr_out, pe, fn, out_ptr):
    """Store my_pe into the right neighbour's word through ``ptr``, call SYNCS[fn] (out[0] = its
    status), then read my own word into out[1]; ptr_out[0:3] = ptr_p2p(buf, my_pe, pe), ptr(buf, pe)
    and ptr_p2p(buf, pe, my_pe). After a barrier the word must hold the left neighbour's number."""
    me = mt.my_pe()
    right = (me + 1) % mt.n_pes()
    peer = mt.ptr(buf_ptr, right).to(tl.pointer_type(tl.int64), bitcast=True)
    tl.store(peer, me.to(tl.int64))
    st = tl.full([], 99, tl.int32)
    if fn == 0:
        st = mt.quiet_thread()
    elif fn == 1:
        st = mt.quiet_thread_pe(pe)
    elif fn == 2:
        st = mt.quiet_thread_pe_qp(pe, 0)
    elif fn == 3:
        st = mt.fence_thread()
    elif fn == 4:
        st = mt.fence_thread_pe(pe)
    elif fn == 5:
        st = mt.fence_thread_pe_qp(pe, 0)
    elif fn == 6:
        st = mt.barrier_all_thread()
    elif fn == 7:
        st = mt.barrier_all_block()
    tl.store(out_ptr, st)
    tl.store(out_ptr + 1, tl.load(buf_ptr, volatile=True).to(tl.int32))
    tl.store(ptr_out, mt.ptr_p2p(buf_ptr, me, pe).to(tl.int64, bitcast=True))
    tl.store(ptr_out + 1, mt.ptr(buf_ptr, pe).to(tl.int64, bitcast=True))
    tl.store(ptr_out + 2, mt.ptr_p2p(buf_ptr, pe, me).to(tl.int64, bitcast=True))
