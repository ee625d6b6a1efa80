"""UMBP's errors, in MORI's hierarchy (:class:`mori.core.errors.MoriError`).

The original raises ``RuntimeError`` from every binding, and code written for it catches that;
so every UMBP error is also a :class:`RuntimeError`, and argument errors are in addition
:class:`ValueError` (as every MORI argument error is).
"""

from __future__ import annotations

from typing import Any

from mori.core.errors import MoriBackendError, MoriError, MoriValueError


class UMBPError(MoriError, RuntimeError):
    """A UMBP operation failed: the master refused or could not be reached, a peer failed, ..."""


class UMBPArgumentError(MoriValueError, RuntimeError):
    """An argument is not allowed (empty ``node_id``, empty ``hashes``, an oversized batch, ...)."""


class UMBPUnavailableError(MoriBackendError):
    """The master or a peer could not be reached within its deadline (connection refused, timeout)."""


class UMBPUnsupportedError(MoriBackendError):
    """A configured feature needs hardware or software this machine does not have (SPDK, a GPU)."""


def bad_arg(func: str, arg: str, value: Any, allowed: str) -> UMBPArgumentError:
    """The standard argument error: names the function, the argument, the value and what is allowed."""
    shown = value if not isinstance(value, (list, tuple)) or len(value) <= 4 else f"<{len(value)} items>"
    return UMBPArgumentError(f"{func}: {arg}={shown!r} is not allowed; expected {allowed}")
