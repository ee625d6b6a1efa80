"""One error hierarchy for every MORI component, rooted at :class:`MoriError`.

Argument errors are also :class:`ValueError`/:class:`TypeError`, timeouts also
:class:`TimeoutError`, so callers can catch either the MORI class or the builtin one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class MoriError(Exception):
    """Root of every error raised by MORI."""


class MoriValueError(MoriError, ValueError):
    """An argument or environment variable has a value that is not allowed."""


class MoriTypeError(MoriError, TypeError):
    """An argument has a type that is not allowed."""


class MoriStateError(MoriError, RuntimeError):
    """A call came in the wrong state: before init, after finalize, twice, ..."""


class MoriOutOfMemoryError(MoriError, MemoryError):
    """The symmetric heap (or another pool) cannot satisfy an allocation."""


class MoriBackendError(MoriError, RuntimeError):
    """A backend (device runtime, transport, NIC provider) is missing, unusable or failed."""


class MoriOSError(MoriError, OSError):
    """An operating-system call failed; ``errno`` and ``strerror`` say how (as for :class:`OSError`)."""


class MoriTimeoutError(MoriError, TimeoutError):
    """A blocking wait ran out of time. ``missing`` lists the ranks that did not arrive, if known."""

    def __init__(self, message: str, missing: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.missing: list[int] = sorted(missing)


def bad_value(func: str, arg: str, value: Any, allowed: str) -> MoriValueError:
    """Build the standard argument error: names function, argument, value and what is allowed."""
    return MoriValueError(f"{func}: {arg}={value!r} is not allowed; expected {allowed}")


def bad_type(func: str, arg: str, value: Any, allowed: str) -> MoriTypeError:
    return MoriTypeError(f"{func}: {arg} has type {type(value).__name__}; expected {allowed}")


def format_ranks(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``: short enough for an error message about 1024 ranks."""
    out: list[str] = []
    run: list[int] = []
    for r in sorted(set(ranks)):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)))
        run = [r]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)))
    return ", ".join(out)
