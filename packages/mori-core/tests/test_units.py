"""Single-process units: errors, env parsing, the allocator, the unique id, the namespace."""

from __future__ import annotations

import importlib
import subprocess
import sys
from typing import Any

import pytest

import mori
from mori.core import env
from mori.core.bootstrap import UNIQUE_ID_BYTES, UniqueId
from mori.core.errors import MoriError, MoriValueError, format_ranks
from mori.shmem.heap import MIN_ALIGN, HeapAllocator


def test_format_ranks_compresses_runs() -> None:
    assert format_ranks([5, 0, 1, 2, 9, 10]) == "0-2, 5, 9, 10"
    assert format_ranks([]) == ""
    assert format_ranks([3]) == "3"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("6G", 6 << 30),
        ("512M", 512 << 20),
        ("1.5G", 3 << 29),
        ("64KiB", 64 << 10),
        ("2t", 2 << 40),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert env.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "6X", "-1G", "0", "G", "1e3"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        env.parse_size(text)


def test_env_var_error_names_variable_and_example(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("MORI_SHMEM_HEAP_SIZE", "6X")
    with pytest.raises(MoriValueError, match=r"MORI_SHMEM_HEAP_SIZE='6X' is not valid.*example: 6G"):
        env.MORI_SHMEM_HEAP_SIZE.get()
    clean_env.setenv("MORI_SHMEM_MODE", "vmm")
    with pytest.raises(MoriValueError, match="static_heap, vmm_heap, isolation"):
        env.MORI_SHMEM_MODE.get()
    clean_env.delenv("MORI_SHMEM_HEAP_SIZE")
    assert env.MORI_SHMEM_HEAP_SIZE.get() == 4 << 30  # the original's default


def test_allocator_first_fit_alignment_and_coalescing() -> None:
    a = HeapAllocator(1024, 1024 + 64 * MIN_ALIGN)
    b1 = a.allocate(1)
    assert b1 is not None and b1.offset % MIN_ALIGN == 0 and b1.size == MIN_ALIGN
    b2 = a.allocate(3 * MIN_ALIGN, align=4096)
    assert b2 is not None and b2.offset % 4096 == 0
    b3 = a.allocate(MIN_ALIGN)
    assert b3 is not None
    assert a.containing(b2.offset + 5) == b2
    assert a.allocate(10**9) is None  # out of heap: caller reports
    for b in (b1, b2, b3):
        a.release(b.offset)
    assert a.free_bytes == 64 * MIN_ALIGN and a.largest_free == 64 * MIN_ALIGN  # fully coalesced
    assert b1.offset in a.freed
    with pytest.raises(KeyError):
        a.release(b1.offset)


def test_allocator_is_deterministic() -> None:
    def run() -> list[int]:
        a = HeapAllocator(0, 1 << 20)
        offs = [a.allocate(s).offset for s in (100, 5000, 7, 256)]  # type: ignore[union-attr]
        a.release(offs[1])
        offs.append(a.allocate(300).offset)  # type: ignore[union-attr]
        return offs

    assert run() == run()


def test_unique_id_round_trip_and_rejects() -> None:
    uid = UniqueId("10.1.2.3", 4242, b"n" * 16)
    raw = uid.pack()
    assert len(raw) == UNIQUE_ID_BYTES == 128
    assert UniqueId.unpack(raw) == uid
    with pytest.raises(MoriValueError, match="128 bytes"):
        UniqueId.unpack(raw[:100])
    with pytest.raises(MoriValueError, match="shmem_get_unique_id"):
        UniqueId.unpack(b"X" * 128)


def test_namespace_components_resolve_lazily() -> None:
    assert mori.shmem.shmem_malloc is importlib.import_module("mori.shmem").shmem_malloc
    assert "shmem" in dir(mori) and "ep" in dir(mori)
    with pytest.raises(AttributeError):
        _ = mori.not_a_component  # type: ignore[attr-defined]


def test_missing_component_names_its_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every real component may be installed in the test venv, so register one that never is.
    monkeypatch.setitem(mori.COMPONENTS, "zzz", "mori-zzz")
    with pytest.raises(ModuleNotFoundError, match="pip install mori-zzz"):
        importlib.import_module("mori.zzz")
    with pytest.raises(ModuleNotFoundError, match="pip install mori-zzz"):
        _ = mori.zzz  # type: ignore[attr-defined]


def test_import_writes_no_env_and_loads_no_torch() -> None:
    code = "import os, sys; before = dict(os.environ); import mori, mori.core; assert dict(os.environ) == before; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_errors_share_one_root() -> None:
    from mori.core import errors

    for name in (
        "MoriValueError",
        "MoriTypeError",
        "MoriStateError",
        "MoriTimeoutError",
        "MoriOutOfMemoryError",
        "MoriBackendError",
    ):
        assert issubclass(getattr(errors, name), MoriError)
    assert issubclass(errors.MoriValueError, ValueError) and issubclass(errors.MoriTimeoutError, TimeoutError)


def test_native_stub_matches_the_built_module() -> None:
    """_core.pyi names every function, constant, class and method of the built module, no more."""
    import ast
    from pathlib import Path

    from mori.core import _core

    tree = ast.parse(Path(mori.core.__file__).with_name("_core.pyi").read_text())
    stubbed: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            stubbed.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            stubbed.add(node.target.id)
        elif isinstance(node, ast.ClassDef):
            stubbed.add(node.name)
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name != "__init__":
                    stubbed.add(f"{node.name}.{item.name}")
                elif isinstance(item, ast.Assign):
                    stubbed.update(f"{node.name}.{t.id}" for t in item.targets if isinstance(t, ast.Name))
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    stubbed.add(f"{node.name}.{item.target.id}")
    built: set[str] = set()
    for name in dir(_core):
        if name.startswith("_"):
            continue
        built.add(name)
        obj = getattr(_core, name)
        if isinstance(obj, type):
            members = obj.__members__ if name == "StatusCode" else vars(obj)
            built.update(f"{name}.{m}" for m in members if not m.startswith("__") and "pybind11" not in m)
    built -= {"StatusCode.name", "StatusCode.value"}  # pybind11 enum plumbing
    assert stubbed == built


def test_native_errors_are_mori_errors() -> None:
    # The native module converts its arguments itself: a wrong type or range is a named MORI error,
    # never pybind11's TypeError ("incompatible function arguments") or RuntimeError ("Unable to cast").
    import ctypes
    import errno

    from mori.core import _core, errors

    word = ctypes.c_uint64(0)
    addr = ctypes.addressof(word)
    cases: list[tuple[Any, type[errors.MoriError], str]] = [
        (lambda: _core.atomic_rmw(addr, 1, 3, -1), errors.MoriValueError, "value -1 does not fit"),
        (lambda: _core.atomic_rmw(addr, 1, 3, 2**64), errors.MoriValueError, "does not fit"),
        (lambda: _core.atomic_compare_swap(addr, 3, -1, 0), errors.MoriValueError, "does not fit"),
        (lambda: _core.atomic_rmw(-1, 1, 3, 0), errors.MoriValueError, "addr=-1 is not allowed"),
        (lambda: _core.atomic_rmw(2**64, 1, 3, 0), errors.MoriValueError, "addr=18446744073709551616"),
        (lambda: _core.atomic_rmw("x", 1, 3, 0), errors.MoriTypeError, "addr has type str"),
        (lambda: _core.atomic_rmw(addr, 1, 3, 1.5), errors.MoriTypeError, "value has type float"),
        (lambda: _core.atomic_rmw(addr, True, 3, 0), errors.MoriTypeError, "op has type bool"),
        (lambda: _core.atomic_rmw(addr, 9, 3, 0), errors.MoriValueError, "unknown atomic op 9"),
        (lambda: _core.atomic_rmw(addr + 1, 1, 3, 0), errors.MoriValueError, "not aligned to 8 bytes"),
        (lambda: _core.wait_until(addr, 0, 3, 1, "1"), errors.MoriTypeError, "timeout_s has type str"),
        (lambda: _core.wait_until(addr, 7, 3, 1, 0.0), errors.MoriValueError, "unknown comparison 7"),
        (lambda: _core.copy(addr, 0, 8), errors.MoriValueError, "null address"),
        (lambda: _core.copy(addr, addr, -1), errors.MoriValueError, "nbytes=-1"),
        (lambda: _core.copy(2**64 - 4, addr, 8), errors.MoriValueError, "past the end of the address space"),
        (lambda: _core.shm_unlink(5), errors.MoriTypeError, "name has type int"),
        (lambda: _core.transport_open(b"x"), errors.MoriTypeError, "ops has type bytes; expected a capsule"),
    ]
    for call, kind, text in cases:
        with pytest.raises(kind, match=text):
            call()
    with pytest.raises(errors.MoriOSError, match="No such file") as info:
        _core.SharedMemory.open("/mori-test-no-such-segment", 4096)
    assert isinstance(info.value, OSError) and info.value.errno == errno.ENOENT
    assert word.value == 0  # nothing was written by a rejected call


def test_mori_core_declares_numpy() -> None:
    # torch's CPU wheels do not depend on numpy, yet warn "Failed to initialize NumPy" on every
    # import without it: twice per `mori demo` in a venv holding only mori-core and torch.
    import importlib.metadata
    import re

    requires = importlib.metadata.requires("mori-core") or []
    assert [r for r in requires if re.match(r"numpy\b", r) and "extra ==" not in r], requires
