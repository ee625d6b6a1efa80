"""Test-only hooks of the native extension, present only in a test build of mori-core.

A test build compiles them in with the CMake option ``MORI_TEST_HOOKS`` (``nox -s tests`` does; by
hand: ``pip install --no-build-isolation -Ccmake.define.MORI_TEST_HOOKS=ON ./packages/mori-core``).
The wheels users get do not carry them: there the engine's test modes are constants the compiler
folds away, and every function here raises :class:`~mori.core.errors.MoriStateError` saying how to
build them in. :data:`AVAILABLE` tells which build this is.

* :func:`parse_message`: the TCP engine's own wire parser, for the fuzz tests.
* :func:`install_copier`: a device copier that treats "device" addresses as host memory.
* :func:`refuse_cma`, :func:`refuse_direct`, :func:`direct_delay_ms`: the engine's test modes
  (failover to the socket, a refused direct probe, a copy that sleeps inside its bounds check).
* :func:`move_off_cpu`: the copy threads' move off the poster's CPU, on any thread.
"""

from __future__ import annotations

from typing import Any, cast

from mori.core import _core
from mori.core.errors import MoriStateError

__all__ = [
    "AVAILABLE",
    "direct_delay_ms",
    "install_copier",
    "move_off_cpu",
    "parse_message",
    "refuse_cma",
    "refuse_direct",
]

_HOOKS: Any = getattr(_core, "_testing", None)

#: whether this build of mori-core has the hooks (a test build)
AVAILABLE: bool = _HOOKS is not None


def _hooks() -> Any:
    if _HOOKS is None:
        raise MoriStateError(
            "mori.core.test_hooks: this mori-core was built without its test hooks; rebuild it with "
            "`pip install --no-build-isolation -Ccmake.define.MORI_TEST_HOOKS=ON ./packages/mori-core` "
            "(nox -s tests does)"
        )
    return _HOOKS


def parse_message(data: bytes) -> dict[str, object]:
    """Parse one complete TCP-engine wire message (header, body, payload) with the engine's own
    parser; raises ``ValueError`` naming the defect when it is malformed."""
    return cast("dict[str, object]", _hooks().parse_message(data))


def install_copier(engine: _core.TcpEngine, *, fail: bool = False) -> None:
    """Install in ``engine`` a device copier that treats "device" addresses as host memory;
    ``fail=True``: every copy fails (``ERR_GPU_OP``)."""
    _hooks().install_copier(engine, fail)


def refuse_cma(engine: _core.TcpEngine, on: bool) -> None:
    """As a target, refuse cross-memory attach and grant no table, so initiators fail over to the socket."""
    _hooks().refuse_cma(engine, on)


def refuse_direct(engine: _core.TcpEngine, on: bool) -> None:
    """As an initiator, fail the direct path's probe as if the OS refused attach (connections opened afterwards)."""
    _hooks().refuse_direct(engine, on)


def direct_delay_ms(engine: _core.TcpEngine, ms: int) -> None:
    """As an initiator, sleep ``ms`` milliseconds inside each direct copy, after its bounds check."""
    _hooks().direct_delay_ms(engine, ms)


def move_off_cpu(tid: int, cpu: int) -> bool:
    """Move thread ``tid`` (0: the calling one) off CPU ``cpu``, its affinity mask left as it was;
    ``False`` when that is the only CPU it may run on."""
    return bool(_hooks().move_off_cpu(tid, cpu))
