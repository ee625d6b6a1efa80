"""Finding and loading UCX at run time.

The plugin links nothing of UCX: ``load()`` dlopens it (once per process) from the libucx wheel, a
system installation, or a path (``MORI_UCX_LIBRARY``), and raises :class:`MoriBackendError` with
the reason when that is not possible, so importing the plugin never fails for want of UCX.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from mori.core.errors import MoriBackendError
from mori_backend_ucx import _native
from mori_backend_ucx.env import MORI_UCX_LIBRARY

#: the wheel's libraries, in the order their sonames must be bound (libucp needs the other three)
_WHEEL_LIBS = ("libucs.so.0", "libucm.so.0", "libuct.so.0", "libucp.so.0")


@dataclass(frozen=True)
class LoadedUcx:
    """The UCX this process loaded."""

    version: str
    libucp: str
    libucs: str
    source: str  # "wheel libucx-cu12 1.22.0", "system", or the path given

    @property
    def has_verbs_build(self) -> bool:
        """Whether this UCX ships its RDMA verbs module (the PyPI wheels do not)."""
        return any(
            (Path(self.libucp).parent / "ucx" / name).exists() for name in ("libuct_ib.so.0", "libuct_ib.so")
        )


def _wheel_libraries() -> tuple[list[str], str]:
    try:
        import libucx  # the libucx-cu12 wheel's module
    except ImportError as e:
        raise MoriBackendError(
            f"the libucx wheel is not installed ({e}): pip install libucx-cu12, or set "
            "MORI_UCX_LIBRARY=system to use a system UCX"
        ) from None
    libdir = Path(libucx.__file__).parent / "lib"
    missing = [name for name in _WHEEL_LIBS if not (libdir / name).is_file()]
    if missing:
        raise MoriBackendError(f"the libucx wheel at {libdir} lacks {', '.join(missing)}")
    try:
        from importlib.metadata import version

        source = f"wheel libucx-cu12 {version('libucx-cu12')}"
    except Exception:
        source = f"wheel {libdir}"
    return [str(libdir / name) for name in _WHEEL_LIBS], source


def _requested() -> tuple[list[str], str]:
    choice = MORI_UCX_LIBRARY.get() or "wheel"
    if choice == "wheel":
        return _wheel_libraries()
    if choice == "system":
        return ["libucp.so.0"], "system"
    path = Path(choice)
    if path.is_dir():
        path = path / "libucp.so.0"
    if not path.exists():
        raise MoriBackendError(f"MORI_UCX_LIBRARY={choice!r}: {path} does not exist")
    return [os.fspath(path)], str(path)


_loaded: LoadedUcx | None = None


def load() -> LoadedUcx:
    """Load UCX (once per process) and return what was loaded; raises MoriBackendError with why not."""
    global _loaded
    if _loaded is not None:
        return _loaded
    libraries, source = _requested()
    error = _native.load(libraries)
    if error:
        raise MoriBackendError(f"cannot load UCX ({source}): {error}")
    info = _native.version()
    assert info is not None  # load succeeded
    major, minor, release, libucp, libucs = info
    if Path(libucp).parent != Path(libucs).parent:
        # another UCX was already in the process and UCX's sonames bound to it: mixed versions
        raise MoriBackendError(
            f"UCX loaded from {source} is mixed: libucp from {libucp} but libucs from {libucs} "
            "(another UCX was loaded in this process first); set MORI_UCX_LIBRARY to that UCX"
        )
    _loaded = LoadedUcx(f"{major}.{minor}.{release}", libucp, libucs, source)
    return _loaded
