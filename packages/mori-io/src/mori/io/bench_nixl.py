"""The NIXL baseline of ``mori bench io --device cpu``: NIXL agents (UCX backend) on the same
buffers (:func:`make_nixl`), NIXL's initiator in a process of its own (:func:`nixl_initiator`: NIXL
1.5.1 crashes in interpreter teardown once an agent existed, so NIXL never runs in the ``mori``
command's process), driven from there through :class:`NixlBaseline`, and the UCX transports NIXL
used, read from UCX's own log (:func:`ucx_transports`)."""

from __future__ import annotations

import gc
import glob
import os
import re
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mori.core.bench import time_transfers
from mori.io.bench_buffers import cpu_buffer, digest, huge_fraction
from mori.io.bench_peer import TARGET_TIMEOUT_S, Peer, exit_without_teardown

__all__ = ["NixlBaseline", "make_nixl", "nixl_initiator", "nixl_missing", "ucx_transports"]


def ucx_transports(log_dir: str) -> list[str]:
    """The UCX endpoint configurations (lanes and transports) written to UCX's log files."""
    seen: list[str] = []
    for path in sorted(glob.glob(os.path.join(log_dir, "ucx.*.log"))):
        for line in Path(path).read_text(errors="replace").splitlines():
            m = re.search(r"(intra-node|self|inter-node) cfg#\d+\s+(.*)$", line)
            if m and m.group(1) != "self":
                cfg = re.sub(r"\s+", " ", m.group(2).strip())
                if cfg not in seen:
                    seen.append(cfg)
    return seen


def nixl_missing() -> str:
    """``""`` if NIXL's Python API imports, else why not."""
    try:
        import nixl._api  # noqa: F401
    except Exception as e:  # not installed, or installed without a usable backend
        return f"nixl is not importable ({type(e).__name__}: {e}); pip install nixl"
    return ""


def make_nixl(name: str, buf: Any, progress_thread: bool = True) -> tuple[Any, str]:
    """A NIXL agent (UCX backend) with ``buf`` registered, or (None, why not). ``progress_thread``:
    NIXL's own progress thread (a passive target needs it; it keeps a core busy while it lives)."""
    why = nixl_missing()
    if why:
        return None, why
    from nixl._api import nixl_agent, nixl_agent_config

    try:
        agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"]))
        if "UCX" not in agent.backends:
            return None, "nixl has no UCX backend plugin here"
        agent.register_memory(agent.get_reg_descs([(buf.data_ptr(), buf.numel(), 0, "")], "DRAM"))
        return agent, ""
    except Exception as e:
        return None, f"nixl agent creation failed: {type(e).__name__}: {e}"


def nixl_initiator(conn: Any, nbytes: int, env: dict[str, str], progress_thread: bool, buffers: str) -> None:
    """NIXL's initiator, in a process of its own (NIXL never runs in the ``mori`` command's
    process): an agent per NIXL phase, prepared transfers, the same stop-and-wait timing."""
    os.environ.update(env)
    code = 0
    try:
        import torch

        gen = torch.Generator().manual_seed(11)
        buf = cpu_buffer(nbytes, buffers)
        buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen))
        agent: Any = None
        peer, raddr = "", 0

        def wait(posted: tuple[str, Any]) -> None:
            state, handle = posted
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"NIXL transfer failed: state {state}")

        def one(op: str, loff: int, roff: int, n: int) -> None:
            h = agent.initialize_xfer(
                op,
                agent.get_xfer_descs([(buf.data_ptr() + loff, n, 0)], "DRAM"),
                agent.get_xfer_descs([(raddr + roff, n, 0)], "DRAM"),
                peer,
            )
            wait((agent.transfer(h), h))
            agent.release_xfer_handle(h)

        conn.send(("ready", huge_fraction(buf)))
        while conn.poll(TARGET_TIMEOUT_S):
            msg = conn.recv()
            if msg[0] == "up":
                _, meta, raddr = msg
                agent, why = make_nixl("bench-initiator", buf, progress_thread)
                if agent is not None:
                    peer = agent.add_remote_agent(meta)
                conn.send(why)
            elif msg[0] == "write":  # check: our [0, n) to the target's [0, n); our digest of it
                n = msg[1]
                one("WRITE", 0, 0, n)
                conn.send(digest(buf[:n].numpy()))
            elif msg[0] == "read_back":  # check: the target's [0, n) into our [n, 2n)
                n = msg[1]
                buf[n : 2 * n].zero_()
                one("READ", n, 0, n)
                conn.send(bool((buf[n : 2 * n] == buf[:n]).all()))
            elif msg[0] == "measure":
                _, pts, counts = msg
                out = {}
                for (op, block, batch), iters in zip(pts, counts, strict=True):
                    idx = list(range(batch))
                    local = agent.prep_xfer_dlist(
                        "NIXL_INIT_AGENT", [(buf.data_ptr() + i * block, block, 0) for i in idx], "DRAM"
                    )
                    remote = agent.prep_xfer_dlist(peer, [(raddr + i * block, block, 0) for i in idx], "DRAM")
                    handle = agent.make_prepped_xfer(op.upper(), local, idx, remote, idx)

                    def post(handle: Any = handle, agent: Any = agent) -> tuple[str, Any]:
                        return agent.transfer(handle), handle

                    time_transfers(post, wait, max(2, iters // 10))
                    out[(op, block, batch)] = time_transfers(post, wait, iters)
                    handle.release()
                    local.release()
                    remote.release()
                conn.send(out)
            elif msg[0] == "down":
                agent = None
                gc.collect()
                conn.send("ok")
            elif msg[0] == "stop":
                break
        conn.send("bye")
    except BaseException:
        traceback.print_exc()
        code = 1
    exit_without_teardown(code)


class NixlBaseline:
    """The NIXL side, driven from the ``mori`` process: its initiator process, and the target's
    agent (through the target's pipe)."""

    def __init__(
        self,
        ctx: Any,
        target: Peer,
        nbytes: int,
        env: dict[str, str],
        progress_thread: bool,
        buffers: str,
    ) -> None:
        self.target = target
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=nixl_initiator, args=(child, nbytes, env, progress_thread, buffers))
        proc.start()
        self.peer = Peer("NIXL initiator", conn, proc, target.timeout_s)
        self.proc = proc
        _, self.huge = self.peer.recv("its first message (ready)")

    def _ask(self, *msg: Any) -> Any:
        return self.peer.ask(*msg)

    def up(self, remote_addr: int) -> str:
        """Create and connect both agents; ``""`` or why not."""
        meta, why = self.target.ask("nixl_up")
        if meta is None:
            return str(why)
        why = self._ask("up", meta, remote_addr)
        if why:
            self.down()
        return str(why)

    def verify(self, n: int) -> bool:
        mine = self._ask("write", n)
        wrote = self.target.ask("digest", 0, n) == mine
        return bool(wrote and self._ask("read_back", n))

    def measure(self, pts: Sequence[tuple[str, int, int]], iters: Sequence[int]) -> dict[Any, Any]:
        """Time every point (``iters[i]`` transfers of ``pts[i]``, after a tenth of that untimed) in
        NIXL's initiator: ``{point: (latencies_s, post_times_s)}``."""
        out: dict[Any, Any] = self._ask("measure", list(pts), list(iters))
        return out

    def down(self) -> None:
        self._ask("down")
        self.target.ask("nixl_down")

    def stop(self) -> None:
        try:
            self._ask("stop")
        finally:
            self.peer.stop(failed=False)
