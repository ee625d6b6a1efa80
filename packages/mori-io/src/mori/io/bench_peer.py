"""The pipe from ``mori bench io``'s initiator to each of its other processes (the target, NIXL's
initiator): every answer is awaited at most ``--timeout`` seconds, a process that exits fails the
wait at once with its exit code (:class:`BenchPeerError`), and a bench process ends without the
interpreter's teardown (:func:`exit_without_teardown`)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from mori.core.errors import MoriError

__all__ = [
    "PEER_TIMEOUT_S",
    "TARGET_TIMEOUT_S",
    "BenchPeerError",
    "Peer",
    "await_target",
    "exit_without_teardown",
]

#: how long the target waits for the initiator's next message
TARGET_TIMEOUT_S = 1800.0
#: default of --timeout: how long the initiator waits for a bench process's answer
PEER_TIMEOUT_S = 120.0


class BenchPeerError(MoriError, RuntimeError):
    """A process of the benchmark (the target, or NIXL's initiator) exited or did not answer within
    ``--timeout`` seconds. Its own error, if it printed one, is above this message."""


class Peer:
    """The initiator's end of the pipe to a bench process: every answer is awaited at most
    ``timeout_s`` seconds, and a process that has exited fails the wait at once (a pipe alone would
    wait forever: this process holds both of its ends)."""

    def __init__(self, name: str, conn: Any, proc: Any, timeout_s: float) -> None:
        self.name, self.conn, self.proc, self.timeout_s = name, conn, proc, timeout_s

    def lost(self, what: str) -> BenchPeerError:
        return BenchPeerError(
            f"mori bench io: the {self.name} process exited with code {self.proc.exitcode} while the "
            f"initiator waited for {what} (its error, if it printed one, is above)"
        )

    def send(self, msg: Any) -> None:
        try:
            self.conn.send(msg)
        except OSError as e:
            raise self.lost(f"it to take {msg[0]!r}") from e

    def recv(self, what: str = "an answer", timeout_s: float | None = None) -> Any:
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        while not self.conn.poll(0.1):
            if not self.proc.is_alive():
                if self.conn.poll(0):  # it answered, then exited
                    break
                raise self.lost(what)
            if time.monotonic() > deadline:
                raise BenchPeerError(
                    f"mori bench io: the {self.name} process (pid {self.proc.pid}) did not answer within "
                    f"{limit:g} s (--timeout) while the initiator waited for {what}"
                )
        try:
            return self.conn.recv()
        except EOFError as e:
            raise self.lost(what) from e

    def ask(self, *msg: Any) -> Any:
        """Send ``msg`` and return the answer."""
        self.send(msg)
        return self.recv(f"its answer to {msg[0]!r}")

    def stop(self, failed: bool) -> None:
        """Join the process; at once (kill) when the run failed, else after up to 30 s."""
        if not failed:
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)


def await_target(conn: Any, proc: Any, timeout_s: float) -> Any:
    """The target's first message; :class:`BenchPeerError` if it exits first (with its exit code)
    or stays silent for ``timeout_s`` seconds."""
    return Peer("target", conn, proc, timeout_s).recv("its first message (ready)")


def exit_without_teardown(code: int) -> None:
    """End a child process now: NIXL 1.5.1 crashes (SIGSEGV) in interpreter teardown once an agent
    has existed in the process, so its processes skip the teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:  # C stdio buffers too (UCX's log file)
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except Exception:
        pass
    os._exit(code)
