"""FP4 (OCP e2m1) for the EP wire: exact software rounding, blockwise scales, two values a byte.

``float4_e2m1fn_x2`` tokens travel through dispatch as bytes, unchanged (two e2m1 values per
byte, the first in the low nibble; ``hidden`` counts bytes, i.e. half the values). The
``fp4_blockwise`` combine wire quantises bf16 rows in blocks of :data:`FP4_BLOCK` values: each
block is divided by ``scale = max|x| / 6`` (1 for an all-zero block; 6 is e2m1's largest value),
rounded to the nearest e2m1 value (ties to even), packed, and sent with its fp32 scale; the
receiver multiplies back. So each value is off by at most ``scale`` (half the widest step, 4 to 6)
and a block's largest value is exact up to the scale's own rounding.

No hardware fp4 conversion is used on any target (NVIDIA sm_90 has none; sm_100 and gfx950 do,
with their own rounding modes): the rounding below is done with comparisons against the midpoints
of the e2m1 grid, on the host path in torch and in the Triton kernels (``_e2m1_code`` in
:mod:`mori.ep.kernels`) the same way, so every target produces the same bits.
"""

from __future__ import annotations

import torch

__all__ = ["E2M1_MAX", "FP4_BLOCK", "decode", "encode", "pack", "quantise", "dequantise", "unpack"]

#: values per fp4 combine block (each with one fp32 scale)
FP4_BLOCK = 32
#: largest e2m1 magnitude
E2M1_MAX = 6.0
#: e2m1 magnitudes by code 0..7
_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: midpoints between consecutive magnitudes, and whether a tie there rounds up (to the even code)
MIDPOINTS = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)


def encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> e2m1 codes (uint8 0..15, sign in bit 3), round to nearest, ties to even,
    saturating at +-6. NaN encodes as 0."""
    a = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for mid, tie_up in MIDPOINTS:
        code += (a >= mid if tie_up else a > mid).to(torch.uint8)
    neg = (x < 0) & (code > 0)  # (-0 and values rounding to 0 encode as +0)
    return code | (neg.to(torch.uint8) << 3)


def decode(code: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8 0..15) -> fp32 values."""
    grid = torch.tensor(_GRID, dtype=torch.float32, device=code.device)
    mag = grid[(code & 7).long()]
    return torch.where((code & 8) != 0, -mag, mag)


def pack(code: torch.Tensor) -> torch.Tensor:
    """codes [..., 2n] -> bytes [..., n]: element 2i in the low nibble, 2i + 1 in the high one."""
    return code[..., 0::2] | (code[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., n] -> codes [..., 2n]."""
    lo, hi = packed & 15, packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def quantise(x: torch.Tensor, block: int = FP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, h] values (h a multiple of ``block``) -> (packed bytes uint8 [n, h / 2], fp32 scales
    [n, h / block]): see the module docstring."""
    n, h = x.shape
    b = x.float().view(n, h // block, block)
    amax = b.abs().amax(dim=2)
    scale = torch.where(amax > 0, amax / E2M1_MAX, torch.ones_like(amax))
    return pack(encode((b / scale[:, :, None]).view(n, h))), scale


def dequantise(packed: torch.Tensor, scale: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """Inverse of :func:`quantise`: fp32 [n, h]."""
    v = decode(unpack(packed))
    n, h = v.shape
    return (v.view(n, h // block, block) * scale[:, :, None]).view(n, h)
