"""The test kernel of test_relaunch.py (imported inside the rank functions only: under the
interpreter, ``TRITON_INTERPRET=1`` must be set before ``triton.jit`` runs)."""

from __future__ import annotations

import triton
import triton.language as tl

from mori.core.kernels import aot


@aot(signature={"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "add": "i32"}, constexprs={"BLOCK": 64})
@triton.jit
def shift_kernel(x_ptr, y_ptr, n, add, BLOCK: tl.constexpr):
    """y[i] = x[i] + add for i < n."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n) + add, mask=i < n)
