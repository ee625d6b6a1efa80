"""Memory of a communicator: local allocations and windows that every LSA peer can reach.

* :class:`AllocatedMemory`: bytes of this rank's heap (``Communicator.alloc_mem``), local.
* :class:`RegisteredWindow`: a range every rank registered together (``register_window``); each
  rank knows where every LSA peer's copy is mapped in its own address space.
* :class:`ImportedWindow`: the same for memory the communicator did not allocate
  (``register_external_window``): another process's POSIX shared memory on the CPU, a torch
  symmetric-memory tensor on a GPU. Zero-copy: peers map the original memory.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mori.core.errors import MoriValueError, bad_value

if TYPE_CHECKING:
    import torch

__all__ = ["AllocatedMemory", "ImportedWindow", "RegisteredWindow"]

SHM_DIR = "/dev/shm"
#: what a shared-memory file name may be: one path component, no tricks
_SHM_NAME = re.compile(r"^[A-Za-z0-9._@+=-]{1,255}$")


@dataclass(frozen=True)
class AllocatedMemory:
    """``size`` bytes of this rank's communicator heap at address ``ptr`` (from ``alloc_mem``).

    Local, not collective: other ranks can reach it once it is (part of) a registered window.
    Contents are undefined until written. Freed by ``Communicator.free_mem`` or ``destroy``.
    """

    ptr: int
    size: int


class RegisteredWindow:
    """A window: ``size`` bytes at ``local_ptr`` on every rank, registered collectively.

    Attributes:
        handle: the window as a kernel takes it: the address of :attr:`table`, an int64 tensor
            ``[lsa_size]`` on the communicator's device whose entry ``i`` is the address, in this
            process, of LSA peer ``i``'s copy of the window (``mori.cco.device.get_lsa_peer_ptr``
            reads it). Pass :attr:`table` itself as the kernel argument.
        local_ptr: this rank's copy (the address it registered).
        size: bytes, the same on every rank.
        peer_ptrs: ``[lsa_size]`` addresses of every LSA peer's copy in this process
            (``peer_ptrs[lsa_rank] == local_ptr``).
    """

    kind = "registered"

    def __init__(
        self,
        comm: Any,
        local_ptr: int,
        size: int,
        peer_ptrs: list[int],
        table: torch.Tensor,
        closers: list[Any],
    ) -> None:
        self._comm = comm
        self.local_ptr = local_ptr
        self.size = size
        self.peer_ptrs: tuple[int, ...] = tuple(peer_ptrs)
        self.table = table
        self.handle = int(table.data_ptr())
        self._closers = closers
        self.closed = False

    def peer_ptr(self, lsa_rank: int, offset: int = 0) -> int:
        """Address, in this process, of byte ``offset`` of LSA peer ``lsa_rank``'s copy."""
        func = f"{type(self).__name__}.peer_ptr"
        self._check_open(func)
        n = len(self.peer_ptrs)
        if isinstance(lsa_rank, bool) or not isinstance(lsa_rank, int) or not 0 <= lsa_rank < n:
            raise bad_value(func, "lsa_rank", lsa_rank, f"an LSA rank in [0, {n})")
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= self.size:
            raise bad_value(func, "offset", offset, f"a byte offset in [0, {self.size}]")
        return self.peer_ptrs[lsa_rank] + offset

    def view(
        self,
        lsa_rank: int | None = None,
        dtype: torch.dtype | None = None,
        *,
        offset: int = 0,
        numel: int | None = None,
    ) -> torch.Tensor:
        """A 1-D tensor over LSA peer ``lsa_rank``'s copy (default: this rank's), no copy.

        ``dtype`` (default uint8) elements from byte ``offset``; ``numel`` elements (default: up to
        the end of the window). Stores through a peer's view change that peer's memory.
        """
        import torch

        func = f"{type(self).__name__}.view"
        self._check_open(func)
        dt = torch.uint8 if dtype is None else dtype
        rank = self._comm.lsa_rank if lsa_rank is None else lsa_rank
        start = self.peer_ptr(rank, offset)
        item = dt.itemsize
        count = (self.size - offset) // item if numel is None else numel
        if (
            isinstance(count, bool)
            or not isinstance(count, int)
            or count < 0
            or offset + count * item > self.size
        ):
            raise bad_value(func, "numel", numel, f"at most {(self.size - offset) // item} {dt} elements")
        if start % item:
            raise bad_value(func, "offset", offset, f"a multiple of {item} (the size of {dt})")
        view: torch.Tensor = self._comm._runtime.byte_view(start, count * item).view(dt)
        return view

    def _check_open(self, func: str) -> None:
        if self.closed:
            raise MoriValueError(f"{func}: the window was deregistered (or its communicator destroyed)")

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for close in reversed(self._closers):
            close()
        self._closers.clear()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self.peer_ptrs)} LSA peers"
        return f"{type(self).__name__}(local_ptr={self.local_ptr:#x}, size={self.size}, {state})"


class ImportedWindow(RegisteredWindow):
    """A window over memory the communicator did not allocate (``register_external_window``).

    ``source`` says what was imported: ``"shm:/dev/shm/NAME"`` (a POSIX shared-memory file, cpu
    runtime) or ``"torch.symm_mem"`` (a torch symmetric-memory tensor, GPU runtimes).
    """

    kind = "imported"

    def __init__(self, *args: Any, source: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.source = source


# -- POSIX shared memory of another process (cpu runtime) ---------------------------------------------


@dataclass(frozen=True)
class ShmRange:
    """Where a local address range lives: the shared-memory file ``name`` under /dev/shm, at
    byte ``file_offset`` of it."""

    name: str
    file_offset: int


def find_shm_range(func: str, ptr: int, size: int) -> ShmRange:
    """The POSIX shared-memory file that ``[ptr, ptr+size)`` is a shared mapping of, from
    ``/proc/self/maps``. The range must lie in one mapping of a file under /dev/shm that still
    has its name (peers open it by name)."""
    end = ptr + size
    try:
        with open("/proc/self/maps") as fh:
            lines = fh.readlines()
    except OSError as e:  # pragma: no cover - every Linux has it
        raise MoriValueError(f"{func}: cannot read /proc/self/maps to find ext_ptr's memory ({e})") from None
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 5:
            continue
        lo, _, hi = parts[0].partition("-")
        start, stop = int(lo, 16), int(hi, 16)
        if not start <= ptr < stop:
            continue
        path = parts[5].strip() if len(parts) == 6 else ""
        what = f"[{ptr:#x}, +{size}) is in the mapping {parts[0]} ({path or 'anonymous'})"
        if end > stop:
            raise MoriValueError(f"{func}: {what}, which ends before the range does")
        if "s" not in parts[1]:
            raise MoriValueError(f"{func}: {what}, a private mapping: peers cannot see its pages")
        if path.endswith(" (deleted)"):
            raise MoriValueError(
                f"{func}: {what}, whose name was already unlinked: peers can only open shared memory "
                f"that still has a name under {SHM_DIR}"
            )
        if not path.startswith(SHM_DIR + "/") or not _SHM_NAME.match(path[len(SHM_DIR) + 1 :]):
            raise MoriValueError(
                f"{func}: {what}, not a POSIX shared-memory file under {SHM_DIR}; on the cpu runtime "
                f"only such memory can be imported (or use alloc_mem + register_window)"
            )
        return ShmRange(path[len(SHM_DIR) + 1 :], int(parts[2], 16) + ptr - start)
    raise MoriValueError(f"{func}: ext_ptr={ptr:#x} is not mapped in this process")


class ShmImport:
    """A peer's shared-memory range mapped here (read-write, shared). ``addr``: its first byte."""

    def __init__(self, func: str, peer: int, name: Any, file_offset: Any, size: int) -> None:
        # the name and offset come from a peer: check them before touching the file system
        if not isinstance(name, str) or not _SHM_NAME.match(name) or name in (".", ".."):
            raise MoriValueError(
                f"{func}: rank {peer} sent the shared-memory name {name!r}, which is not one"
            )
        if isinstance(file_offset, bool) or not isinstance(file_offset, int) or file_offset < 0:
            raise MoriValueError(f"{func}: rank {peer} sent the file offset {file_offset!r}")
        path = f"{SHM_DIR}/{name}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise MoriValueError(f"{func}: cannot open rank {peer}'s shared memory {path}: {e}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise MoriValueError(f"{func}: rank {peer}'s {path} is not a regular file")
            if st.st_size < file_offset + size:
                raise MoriValueError(
                    f"{func}: rank {peer}'s {path} holds {st.st_size} bytes, fewer than offset "
                    f"{file_offset} + size {size}"
                )
            page = mmap.ALLOCATIONGRANULARITY
            base = file_offset - file_offset % page
            self._map = mmap.mmap(fd, file_offset - base + size, mmap.MAP_SHARED, offset=base)
        finally:
            os.close(fd)
        # ctypes pins the buffer (mmap.close refuses while it is exported): dropped in close()
        self._anchor: Any = ctypes.c_char.from_buffer(self._map)
        self.addr = ctypes.addressof(self._anchor) + file_offset - base
        self.size = size

    def close(self) -> None:
        if self._anchor is not None:
            self._anchor = None
            self._map.close()
