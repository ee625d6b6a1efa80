"""The device functions of ``mori.ir``: their names, argument and return types, as the original's.

:data:`MORI_DEVICE_FUNCTIONS` maps each name to ``{"symbol", "args", "ret"}`` (and ``"pure": True``
where the function has no side effects): ``symbol`` is the C symbol the original exports from its
device bitcode (kept so that tools keyed on it keep working; there is no such symbol here), ``args``
the argument types in order, ``ret`` the return type. Types are ``"int32"``, ``"uint32"``,
``"int64"``, ``"uint64"``, ``"float32"``, ``"float64"``; pointers travel as ``"uint64"``.

Every entry is a ``@triton.jit`` function of the same name in :mod:`mori.ir.triton` that takes
exactly these arguments, a pointer either as a Triton pointer or as its address in an integer.
Functions that return ``int32`` and compute nothing return a status: 0 done, -1 not done (the
target PE is not load/store reachable, or an operation code is not one of those listed below).

This module does not import Triton.
"""

from __future__ import annotations

from typing import Final

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
]

# Operation codes: the values of the original's ``mori::core::atomicType`` (OpenSHMEM's numbering).
# The signal operations of ``putmem_nbi_signal_*`` ...
SIGNAL_SET: Final = 9
SIGNAL_ADD: Final = 10
# ... and the atomics of ``atomic_*_nonfetch_thread`` (INC..XOR, SIGNAL_SET/ADD) and
# ``atomic_*_fetch_thread`` (FETCH..COMPARE_SWAP, and the non-fetching ones, which then return the
# previous value too).
AMO_INC: Final = 2
AMO_SET: Final = 3
AMO_ADD: Final = 4
AMO_AND: Final = 5
AMO_OR: Final = 6
AMO_XOR: Final = 7
AMO_FETCH: Final = 12
AMO_FETCH_INC: Final = 13
AMO_FETCH_ADD: Final = 14
AMO_FETCH_AND: Final = 15
AMO_FETCH_OR: Final = 16
AMO_FETCH_XOR: Final = 17
AMO_SWAP: Final = 18
AMO_COMPARE_SWAP: Final = 19

_PTR = "uint64"
#: (dest, source, bytes or elements, pe, qp): every put and get
_TRANSFER = [_PTR, _PTR, "uint64", "int32", "int32"]
#: the typed transfers and the C type each is named after
_TYPED = {"uint32": "uint32", "uint64": "uint64", "float": "float32", "double": "float64"}


def _table() -> dict[str, dict[str, object]]:
    t: dict[str, dict[str, object]] = {}

    def add(name: str, args: list[str], ret: str = "int32", *, pure: bool = False) -> None:
        entry: dict[str, object] = {"symbol": f"mori_shmem_{name}", "args": list(args), "ret": ret}
        if pure:
            entry["pure"] = True
        t[name] = entry

    # query
    add("my_pe", [])
    add("n_pes", [], pure=True)
    # point to point
    add("ptr_p2p", [_PTR, "int32", "int32"], "uint64")
    add("ptr", [_PTR, "int32"], "uint64")
    # ordering and barriers
    for what in ("quiet", "fence"):
        add(f"{what}_thread", [])
        add(f"{what}_thread_pe", ["int32"])
        add(f"{what}_thread_pe_qp", ["int32", "int32"])
    add("barrier_all_thread", [])
    add("barrier_all_block", [])
    # puts (non-blocking), gets (non-blocking), gets (blocking); bytes for *mem*, elements otherwise
    for op, prefix, suffix in (("put", "putmem", "_nbi"), ("get", "getmem", "_nbi"), ("get", "getmem", "")):
        for scope in ("thread", "warp", "block"):
            add(f"{prefix}{suffix}_{scope}", _TRANSFER)
            for ctype in _TYPED:
                add(f"{op}_{ctype}{suffix}_{scope}", _TRANSFER)
    # put with signal: dest, source, bytes, signal word, signal value, signal op, pe, qp
    for scope in ("thread", "warp", "block"):
        add(f"putmem_nbi_signal_{scope}", [_PTR, _PTR, "uint64", _PTR, "uint64", "int32", "int32", "int32"])
    # single values: put_size_imm copies ``bytes`` bytes from a pointer; the *_p store a value
    add("put_size_imm_nbi_thread", [_PTR, _PTR, "uint64", "int32", "int32"])
    for name, value in (
        ("int32_p", "int32"),
        ("int64_p", "int64"),
        ("uint32_p", "uint32"),
        ("uint64_p", "uint64"),
        ("int_p", "int32"),
        ("float_p", "float32"),
        ("double_p", "float64"),
    ):
        add(name, [_PTR, value, "int32", "int32"])
    # atomics: (dest, value[, compare], op, pe, qp); size_nonfetch reads the value from a pointer
    add("atomic_size_nonfetch_thread", [_PTR, _PTR, "uint64", "int32", "int32", "int32"])
    for word in ("uint32", "uint64", "int64"):
        add(f"atomic_{word}_nonfetch_thread", [_PTR, word, "int32", "int32", "int32"])
    for word in ("uint32", "uint64", "int64"):
        add(f"atomic_{word}_fetch_thread", [_PTR, word, word, "int32", "int32", "int32"], word)
    for word in ("uint32", "uint64", "int64"):
        add(f"{word}_atomic_add_thread", [_PTR, word, "int32", "int32"])
        add(f"{word}_atomic_fetch_add_thread", [_PTR, word, "int32", "int32"], word)
    # waits on this PE's word: greater_than returns the value seen, equals returns 0
    for word in ("uint32", "uint64", "int32", "int64"):
        add(f"{word}_wait_until_greater_than", [_PTR, word], word)
        add(f"{word}_wait_until_equals", [_PTR, word])
    return t


#: name -> {"symbol": str, "args": [type, ...], "ret": type[, "pure": True]}
MORI_DEVICE_FUNCTIONS: Final[dict[str, dict[str, object]]] = _table()
