"""What this process has mapped: the address ranges of ``/proc/self/maps`` and their access.

Memory handed over by address (``shmem_buffer_register``) is checked here before any copy touches
it: a copy from an unmapped or protected page would kill the process with SIGSEGV. The check
reads the kernel's list of mappings once, so it costs the same for 4 KiB as for 1 TiB, and it
never touches (or faults in) the memory itself. It cannot stop the caller from unmapping the
memory later: deregister first.
"""

from __future__ import annotations

from dataclasses import dataclass

from mori.core.errors import MoriValueError

#: one past the last address of a 64-bit address space
ADDRESS_LIMIT = 1 << 64
_MAPS = "/proc/self/maps"


@dataclass(frozen=True)
class Region:
    """One line of ``/proc/self/maps``: ``[start, end)`` with permissions such as ``"rw-p"``."""

    start: int
    end: int
    perms: str

    @property
    def readable(self) -> bool:
        return self.perms[0] == "r"

    @property
    def writable(self) -> bool:
        return self.perms[1] == "w"


def regions() -> list[Region] | None:
    """This process's mappings in address order; None where ``/proc/self/maps`` cannot be read."""
    try:
        with open(_MAPS, encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    out = []
    for line in lines:
        span, perms = line.split(maxsplit=2)[:2]
        start, end = span.split("-")
        out.append(Region(int(start, 16), int(end, 16), perms))
    return out


def require_read_write(func: str, arg: str, addr: int, nbytes: int) -> None:
    """Raise :class:`~mori.core.errors.MoriValueError` unless every byte of ``[addr, addr+nbytes)``
    is mapped readable and writable in this process.

    ``addr``, ``nbytes``: ints, ``nbytes > 0``. Where the kernel's list of mappings cannot be read
    (no ``/proc``), only the bounds are checked.
    """
    what = f"{func}: {arg} [{addr:#x}, +{nbytes})"
    if not 0 < addr < ADDRESS_LIMIT:
        raise MoriValueError(f"{func}: {arg}={addr} is not allowed; expected an address in (0, 2**64)")
    end = addr + nbytes
    if end > ADDRESS_LIMIT:
        raise MoriValueError(f"{what} runs past the end of the address space")
    found = regions()
    if found is None:
        return
    cur = addr
    for region in found:
        if region.end <= cur:
            continue
        if region.start > cur:
            break  # a hole at cur
        if not (region.readable and region.writable):
            raise MoriValueError(
                f"{what}: {cur:#x} is not readable and writable (its mapping "
                f"[{region.start:#x}, {region.end:#x}) is {region.perms!r})"
            )
        cur = region.end
        if cur >= end:
            return
    raise MoriValueError(f"{what}: {cur:#x} is not mapped in this process")
