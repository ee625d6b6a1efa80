"""Slots: the names of the spans and instants that kernels and host code record.

A slot group is declared once, next to the kernel that records it, and the kernel refers to its
slots by attribute::

    from mori import viz
    from mori.viz import device as vd

    SLOTS = viz.declare_slots("ep.dispatch", ["wait_ready", "reserve", "send", "fence", "done"])

    @triton.jit
    def dispatch_kernel(..., trace_ptr, TRACE: tl.constexpr):
        tr = vd.open(trace_ptr, TRACE)
        tr = vd.begin(tr, SLOTS.wait_ready)
        ...

:func:`declare_slots` returns a namespace whose attributes are ``tl.constexpr`` slot ids (a
module object: the kind of global a Triton kernel may read), and enters every slot into the
process-wide table, :func:`slot_table`, from which every trace takes its names (a saved trace
carries the table, so reading it needs none of the kernel modules).

**Ids** are a function of the group and slot names alone (a CRC-32 folded into 14 bits), not of
the order in which modules are imported or names are listed: Triton caches compiled kernels by
their source, and an id that changed without the kernel's source changing would label events
with the wrong names. Two names that fold to the same id are refused when the second is
declared, naming both; rename one (this is deterministic, so it shows in the first test run).
"""

from __future__ import annotations

import re
import threading
import types
import zlib
from collections.abc import Iterable, Mapping

from mori.core.errors import MoriValueError, bad_type, bad_value
from mori.viz.layout import MAX_SLOT

__all__ = ["SlotInfo", "declare_slots", "intern_slot", "slot_id", "slot_table"]

_GROUP_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
#: most slots per group, and names per process (the id space has 16383 values: stay sparse)
MAX_SLOTS_PER_GROUP = 256
MAX_SLOTS = 4096


class SlotInfo(tuple[str, str]):
    """``(group, name)`` of a slot; ``str()`` is ``"group/name"``."""

    __slots__ = ()

    @property
    def group(self) -> str:
        return self[0]

    @property
    def name(self) -> str:
        return self[1]

    def __str__(self) -> str:
        return f"{self[0]}/{self[1]}"


_lock = threading.Lock()
_by_id: dict[int, SlotInfo] = {}
_by_name: dict[tuple[str, str], int] = {}


def slot_id(group: str, name: str) -> int:
    """The id that ``name`` of ``group`` has (whether or not it is declared): 1..16383."""
    return zlib.crc32(f"{group}/{name}".encode()) % MAX_SLOT + 1


def _constexpr(value: int) -> object:
    try:
        import triton.language as tl
    except ImportError:  # host-only use (reading traces): plain ints
        return value
    return tl.constexpr(value)


def _check_group(func: str, group: object) -> str:
    if not isinstance(group, str):
        raise bad_type(func, "group", group, "a str such as 'ep.dispatch'")
    if not _GROUP_RE.match(group):
        raise bad_value(func, "group", group, "dotted identifiers, e.g. 'ep.dispatch'")
    return group


def _register(func: str, group: str, names: list[str]) -> dict[str, int]:
    """Enter ``names`` of ``group`` in the table (idempotent); their ids."""
    ids: dict[str, int] = {}
    with _lock:
        new = [n for n in names if (group, n) not in _by_name]
        if len(_by_id) + len(new) > MAX_SLOTS:
            raise MoriValueError(
                f"{func}: {len(_by_id) + len(new)} slots would be declared in this process, more than "
                f"{MAX_SLOTS}; declare slot groups once, at module level"
            )
        for n in names:
            sid = slot_id(group, n)
            other = _by_id.get(sid)
            if other is not None and other != (group, n):
                raise MoriValueError(
                    f"{func}: slot {group}/{n} has id {sid}, which {other} already has; rename one of them"
                )
            ids[n] = sid
        for n in names:
            _by_id[ids[n]] = SlotInfo((group, n))
            _by_name[(group, n)] = ids[n]
    return ids


def declare_slots(group: str, names: Iterable[str] | str) -> types.ModuleType:
    """Declare the slots ``names`` of ``group``; return a namespace of their ids.

    ``group``: dotted identifiers naming the kernel or component (``"ep.dispatch"``); shown as the
    category of its events. ``names``: slot names (identifiers, no leading underscore), a list or
    one space-separated string, at most 256, no repeats. The result has one ``tl.constexpr``
    attribute per name (plain ints where Triton is not installed), readable from ``@triton.jit``
    code, plus ``GROUP`` (the group) and ``NAMES`` (the names in order; host code only).
    Declaring a group again with the same or more names is allowed (a module reload).
    """
    func = "declare_slots"
    _check_group(func, group)
    if isinstance(names, str):
        names = names.split()
    if not isinstance(names, Iterable):
        raise bad_type(func, "names", names, "a list of slot names or a space-separated str")
    listed = list(names)
    for n in listed:
        if not isinstance(n, str) or not _NAME_RE.match(n) or n in ("GROUP", "NAMES"):
            raise bad_value(
                func, "names", n, "identifiers that do not start with '_' (and are not GROUP or NAMES)"
            )
    if not listed:
        raise bad_value(func, "names", listed, "at least one slot name")
    if len(set(listed)) != len(listed):
        dup = sorted({n for n in listed if listed.count(n) > 1})
        raise bad_value(func, "names", dup, "each name once")
    if len(listed) > MAX_SLOTS_PER_GROUP:
        raise bad_value(func, "names", f"{len(listed)} names", f"at most {MAX_SLOTS_PER_GROUP} per group")
    ids = _register(func, group, listed)
    ns = types.ModuleType(f"mori.viz.slots[{group}]", f"Slots of {group}: {', '.join(listed)}.")
    for n in listed:
        setattr(ns, n, _constexpr(ids[n]))
    ns.GROUP = group  # type: ignore[attr-defined]
    ns.NAMES = tuple(listed)  # type: ignore[attr-defined]
    return ns


def intern_slot(group: str, name: str) -> int:
    """Declare one slot on the fly (host spans named at run time); return its id."""
    func = "intern_slot"
    _check_group(func, group)
    if not isinstance(name, str) or not name or len(name) > 200 or not name.isprintable():
        raise bad_value(func, "name", name, "a printable str of 1 to 200 characters")
    known = _by_name.get((group, name))
    if known is not None:
        return known
    return _register(func, group, [name])[name]


def slot_table() -> Mapping[int, SlotInfo]:
    """Every slot declared in this process: id -> :class:`SlotInfo` (a copy)."""
    with _lock:
        return dict(_by_id)
