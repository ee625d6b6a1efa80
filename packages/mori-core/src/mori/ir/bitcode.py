"""Where the original keeps its device bitcode, and what there is here instead.

The original compiles its device API to LLVM bitcode (``libmori_shmem_device.bc``) that kernels
link. MORI's device functions are **Triton functions**, not bitcode: :mod:`mori.ir.triton` (the
original's names) and :mod:`mori.shmem.device` (ours) are ``@triton.jit`` functions that Triton
inlines into every kernel that calls them, for NVIDIA and AMD GPUs alike and under the CPU
interpreter. There is nothing to link.

So that code written for the original keeps working, :func:`find_bitcode` returns the path of a
real bitcode file that contains no functions: passing it to Triton (``extern_libs``, which is what
:func:`mori.ir.triton.get_extern_libs` does) or to ``llvm-link`` is valid and adds nothing. A
program that links it and then calls a ``mori_shmem_*`` symbol from non-Triton code gets an
undefined-symbol error at link time: that path does not exist here.

The file was made with ``llvm-as`` from a one-line module (a comment); any LLVM reads it.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["BITCODE_FILENAME", "find_bitcode", "get_bitcode_path"]

BITCODE_FILENAME = "libmori_shmem_device.bc"
_PATH = Path(__file__).with_name(BITCODE_FILENAME)


def find_bitcode(cov: int | None = None) -> str:
    """Path of ``libmori_shmem_device.bc``: a valid LLVM bitcode file with **no functions**.

    MORI's device functions are Triton functions (:mod:`mori.ir.triton`), inlined by Triton, so
    there is no device library to link; this file only keeps code that passes the path to Triton's
    ``extern_libs`` or to ``llvm-link`` working. ``cov`` (the original's code-object version) is
    accepted and ignored: the file holds no code.
    """
    if cov is not None and (isinstance(cov, bool) or not isinstance(cov, int)):
        from mori.core.errors import bad_type

        raise bad_type("find_bitcode", "cov", cov, "an int (code-object version) or None")
    if not _PATH.is_file():  # a broken install: say so rather than hand out a path that is not there
        from mori.core.errors import MoriStateError

        raise MoriStateError(f"find_bitcode: {_PATH} is missing: reinstall mori-core")
    return str(_PATH)


def get_bitcode_path(cov: int | None = None) -> str:
    """The same as :func:`find_bitcode` (the original has both names)."""
    return find_bitcode(cov)
