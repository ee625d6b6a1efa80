"""mori.ir: the original's device-function layer for kernel compilers, on MORI's Triton device API.

* :data:`MORI_DEVICE_FUNCTIONS`: every device function with the original's name, argument and
  return types (:mod:`mori.ir.ops`); :data:`SIGNAL_SET` / :data:`SIGNAL_ADD` and the ``AMO_*``
  operation codes;
* :func:`find_bitcode` / :func:`get_bitcode_path`: our device functions are **Triton functions,
  not bitcode**; these return a valid bitcode file with no functions, so code that hands the path
  to Triton or ``llvm-link`` keeps working (:mod:`mori.ir.bitcode` says why);
* :mod:`mori.ir.triton`: the device functions themselves, ``@triton.jit`` functions under the
  original's names and calling conventions (pointers as ``uint64`` or Triton pointers, ``int32``
  status returns), plus ``get_extern_libs()`` and ``install_hook()``. It imports Triton; this
  module does not.
"""

from __future__ import annotations

from mori.ir.bitcode import find_bitcode, get_bitcode_path
from mori.ir.ops import (
    AMO_ADD,
    AMO_AND,
    AMO_COMPARE_SWAP,
    AMO_FETCH,
    AMO_FETCH_ADD,
    AMO_FETCH_AND,
    AMO_FETCH_INC,
    AMO_FETCH_OR,
    AMO_FETCH_XOR,
    AMO_INC,
    AMO_OR,
    AMO_SET,
    AMO_SWAP,
    AMO_XOR,
    MORI_DEVICE_FUNCTIONS,
    SIGNAL_ADD,
    SIGNAL_SET,
)

__all__ = [
    "AMO_ADD",
    "AMO_AND",
    "AMO_COMPARE_SWAP",
    "AMO_FETCH",
    "AMO_FETCH_ADD",
    "AMO_FETCH_AND",
    "AMO_FETCH_INC",
    "AMO_FETCH_OR",
    "AMO_FETCH_XOR",
    "AMO_INC",
    "AMO_OR",
    "AMO_SET",
    "AMO_SWAP",
    "AMO_XOR",
    "MORI_DEVICE_FUNCTIONS",
    "SIGNAL_ADD",
    "SIGNAL_SET",
    "find_bitcode",
    "get_bitcode_path",
]
