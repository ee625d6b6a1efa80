# Jitted functions carry no Python annotations (Triton reads them), so mypy may not ask for them:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""The scatter-gather copy kernel of the XGMI backend: many small blocks in one launch.

Algorithm. A batch of ``n`` copies is a descriptor table of int64 words ``[3, n]``: row 0 the
destination addresses, row 1 the source addresses, row 2 the sizes in *words* of ``WORD_BYTES``
bytes (the host picks the widest word, 8/4/2/1 bytes, that every address and size of the batch is
a multiple of). The grid is ``(n, split)``: program ``(i, j)`` copies the ``j``-th of ``split``
equal shares of block ``i`` (shares are rounded up to ``BLOCK`` words, so some programs of a small
block copy nothing), ``BLOCK`` words per iteration. Addresses are unified virtual addresses: local
GPU memory, a peer GPU's memory mapped with IPC (the loads or stores then cross NVLink/xGMI), or
under ``TRITON_INTERPRET=1`` host memory. No program waits for another, so any launch order is
correct, the interpreter's included.

The table lives in memory the GPU can read: pinned host memory mapped into the device (no copy
before the launch) or device memory. Every load and store is masked to its block's length, so
blocks of any size, and padding programs, touch nothing outside the blocks.

Tracing (mori.viz). With ``TRACE=True`` and a :class:`mori.viz.TraceBuffer`'s tensor as
``trace_ptr``, program ``(i, j)`` records into ring ``i + j * n`` one ``kernel`` span of
``io.scatter_gather`` with two phases nested in it: ``table`` (loading its block's descriptor) and
``copy`` (the copy loop of its share; empty for a padding program). With ``TRACE=False`` (and
``trace_ptr`` left at None) none of it is compiled: the kernel is the uninstrumented one.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from mori.core.kernels import aot_variants, device_function
from mori.viz import device as vd
from mori.viz.slots import declare_slots

__all__ = ["DEFAULT_BLOCK", "SLOTS", "WORD_TYPES", "scatter_gather_kernel"]

#: words per iteration of one program
DEFAULT_BLOCK = 1024
#: word width in bytes -> the Triton type the kernel copies it as
WORD_TYPES = {8: "i64", 4: "i32", 2: "i16", 1: "u8"}
#: the phases a program records when the kernel's TRACE constexpr is on (mori.viz)
SLOTS = declare_slots("io.scatter_gather", ["kernel", "table", "copy"])


def _variants() -> list[dict[str, Any]]:
    # one variant per word width the host launches with (the table is 16-byte aligned); each traced
    # too, as a backend with tracing on loads every width's traced variant
    return [
        {
            "signature": {"desc_ptr": "*i64", "n_blocks": "i32", "split": "i32"},
            "constexprs": {"WORD_BYTES": word, "BLOCK": DEFAULT_BLOCK},
            "aligned": ("desc_ptr",),
            "label": f"{WORD_TYPES[word]} BLOCK={DEFAULT_BLOCK}",
        }
        for word in WORD_TYPES
    ]


@device_function
@triton.jit
def _as_word_pointer(addr, WORD_BYTES: tl.constexpr):
    """The int64 address ``addr`` as a pointer to words of ``WORD_BYTES`` bytes."""
    if WORD_BYTES == 8:
        ptr = addr.to(tl.pointer_type(tl.int64), bitcast=True)
    elif WORD_BYTES == 4:
        ptr = addr.to(tl.pointer_type(tl.int32), bitcast=True)
    elif WORD_BYTES == 2:
        ptr = addr.to(tl.pointer_type(tl.int16), bitcast=True)
    else:
        ptr = addr.to(tl.pointer_type(tl.uint8), bitcast=True)
    return ptr


# n_blocks and split are not specialized (Triton would compile other variants for 1 and multiples
# of 16): one compiled kernel per word width, which the backend then launches directly
@aot_variants(vd.traced_variants(_variants(), traced=len(WORD_TYPES)))
@triton.jit(do_not_specialize=["n_blocks", "split"])
def scatter_gather_kernel(
    # pointer: the descriptor table, int64 [3, n_blocks] (dst addresses, src addresses, sizes in words)
    desc_ptr,
    # sizes: blocks in the table, programs per block (grid = (n_blocks, split))
    n_blocks,
    split,
    # word width in bytes (8, 4, 2, 1) and words per iteration
    WORD_BYTES: tl.constexpr,
    BLOCK: tl.constexpr,
    # trace buffer (mori.viz) when TRACE; None otherwise
    trace_ptr=None,
    TRACE: tl.constexpr = False,
):
    """Program ``(i, j)`` copies share ``j`` of block ``i`` (see the module docstring)."""
    tr = vd.open_trace(trace_ptr, TRACE)
    tr = vd.begin(tr, SLOTS.kernel)
    tr = vd.begin(tr, SLOTS.table)
    i = tl.program_id(0)
    j = tl.program_id(1)
    dst_addr = tl.load(desc_ptr + i)
    src_addr = tl.load(desc_ptr + n_blocks + i)
    n_words = tl.load(desc_ptr + 2 * n_blocks + i)
    dst = _as_word_pointer(dst_addr, WORD_BYTES)
    src = _as_word_pointer(src_addr, WORD_BYTES)
    # share of this program: a multiple of BLOCK words, so every iteration but a block's last is full
    # (plain integer arithmetic, not tl.cdiv: the kernel then also runs in the interpreter of a process
    # whose Triton was imported for compiling)
    per_program = (n_words + split - 1) // split
    share = (per_program + BLOCK - 1) // BLOCK * BLOCK
    start = j.to(tl.int64) * share
    end = tl.minimum(start + share, n_words)
    offs = tl.arange(0, BLOCK)
    base = start
    tr = vd.next_span(tr, SLOTS.copy)
    while base < end:
        idx = base + offs
        mask = idx < end  # the block's tail (and nothing past its end) is copied
        tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)
        base += BLOCK
    tr = vd.end(tr, SLOTS.copy)
    tr = vd.end(tr, SLOTS.kernel)
    vd.close_trace(tr)
