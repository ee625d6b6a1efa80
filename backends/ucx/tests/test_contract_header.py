"""The package builds against mori-core's contract header itself (a symlink the sdist resolves)."""

from __future__ import annotations

from pathlib import Path

from mori.core import transport as T

HERE = Path(__file__).resolve().parents[1]


def test_contract_symlink_is_mori_cores_header() -> None:
    link = HERE / "contract" / "mori" / "transport.h"
    assert link.is_symlink()
    assert link.resolve() == (HERE.parents[1] / "packages" / "mori-core" / "include" / "mori" / "transport.h")
    installed = Path(T.include_dir()) / "mori" / "transport.h"
    assert link.read_bytes() == installed.read_bytes(), "the installed mori-core has another contract"


def test_native_module_speaks_this_abi() -> None:
    from mori_backend_ucx import _native

    assert T.ABI == _native.ABI
