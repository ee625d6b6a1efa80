# Jitted functions carry no Python annotations (Triton reads them), so mypy may not ask for them:
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""The host's atomics on GPU memory: one system-scope atomic per launch, run by the GPU.

The host cannot do read-modify-writes on device memory itself, so :meth:`GpuRuntime.atomic_rmw
<mori.core.gpu.runtime.GpuRuntime.atomic_rmw>` launches :func:`host_atomic_kernel` with one program on the runtime's own stream and waits for it.
Imported only when the first host atomic runs (it imports Triton).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mori.core.kernels import aot_variants

#: OP codes: mori.core.backend.OP_FETCH .. OP_XOR, and compare-and-swap
OP_FETCH, OP_SET, OP_ADD, OP_SWAP, OP_AND, OP_OR, OP_XOR, OP_CAS = (tl.constexpr(i) for i in range(8))


def _variants() -> list[dict[str, object]]:
    # every op on int64 words, and the arithmetic ones on the other word types
    sig = {"lo": "i32", "hi": "i32", "cond_lo": "i32", "cond_hi": "i32"}
    out: list[dict[str, object]] = [
        {
            "signature": {"word_ptr": "*i64", "out_ptr": "*i64", **sig},
            "constexprs": {"OP": op},
            "num_warps": 1,
        }
        for op in range(8)
    ]
    out += [
        {"signature": {"word_ptr": t, "out_ptr": t, **sig}, "constexprs": {"OP": op}, "num_warps": 1}
        for t in ("*i32", "*u32", "*u64")
        for op in (OP_ADD.value, OP_CAS.value)
    ]
    return out


@aot_variants(_variants())
# Nothing is specialised on values: not the operands, and not the pointers' alignment (a word is
# 4- or 8-byte aligned, which the kernel gains nothing from), so one compiled kernel per word type
# and OP serves every call.
@triton.jit(do_not_specialize=["word_ptr", "out_ptr", "lo", "hi", "cond_lo", "cond_hi"])
def host_atomic_kernel(
    # pointers: the word (its type is the word type: int32, uint32, int64 or uint64) and where to
    # put the value it held before (same type; pinned host memory mapped into the GPU's space)
    word_ptr,
    out_ptr,
    # operand and compare value, each as the low and high 32 bits of its 64-bit pattern (int32
    # halves never change the kernel's signature, so one compiled kernel serves every value)
    lo,
    hi,
    cond_lo,
    cond_hi,
    # OP_*
    OP: tl.constexpr,
):
    """``*out_ptr = OP(*word_ptr, value[, cond])``: one atomic, acq_rel at system scope, so that it
    is ordered with every process's and every GPU's accesses to the word. Launch with one program."""
    # Algorithm: rebuild the 64-bit operands from their halves, narrow them to the word type
    # (truncation keeps the low bits: the host checked the range), do the atomic, store the old
    # value. Scalar atomics are done by one thread of the program.
    word = word_ptr.dtype.element_ty
    value = ((hi.to(tl.int64) << 32) | (lo.to(tl.int64) & 0xFFFFFFFF)).to(word)
    cond = ((cond_hi.to(tl.int64) << 32) | (cond_lo.to(tl.int64) & 0xFFFFFFFF)).to(word)
    if OP == OP_FETCH:
        old = tl.atomic_or(word_ptr, 0, sem="acq_rel", scope="sys")  # a read-modify-write that reads
    elif OP == OP_SET:
        old = tl.atomic_xchg(word_ptr, value, sem="acq_rel", scope="sys")
    elif OP == OP_ADD:
        old = tl.atomic_add(word_ptr, value, sem="acq_rel", scope="sys")
    elif OP == OP_SWAP:
        old = tl.atomic_xchg(word_ptr, value, sem="acq_rel", scope="sys")
    elif OP == OP_AND:
        old = tl.atomic_and(word_ptr, value, sem="acq_rel", scope="sys")
    elif OP == OP_OR:
        old = tl.atomic_or(word_ptr, value, sem="acq_rel", scope="sys")
    elif OP == OP_XOR:
        old = tl.atomic_xor(word_ptr, value, sem="acq_rel", scope="sys")
    else:
        old = tl.atomic_cas(word_ptr, cond, value, sem="acq_rel", scope="sys")
    tl.store(out_ptr, old)
