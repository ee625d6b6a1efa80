"""Bootstrap and init lifecycle across processes: unique id, torch process group, errors."""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

import pytest

import mori.shmem as shmem
from mori.core.errors import MoriError, MoriStateError, MoriTimeoutError, MoriValueError
from mori.testing import RankError, run_ranks, shmem_ranks


def _identity(rank: int, nranks: int) -> tuple[int, int, int]:
    return shmem.shmem_mype(), shmem.shmem_npes(), shmem.shmem_num_qp_per_pe()


@pytest.mark.parametrize("nranks", [2, 4])
def test_unique_id_init_gives_each_rank_its_pe(nranks: int) -> None:
    assert shmem_ranks(_identity, nranks) == [(r, nranks, 0) for r in range(nranks)]


def _init_with(rank: int, nranks: int, uid: bytes, env: dict[str, str]) -> Any:
    os.environ.update(env)
    try:
        shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, rank, nranks, uid)
    except MoriTimeoutError as e:
        return ("timeout", e.missing, str(e))
    shmem.shmem_finalize()
    return ("ok",)


def test_missing_ranks_time_out_and_are_named(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("MORI_BOOTSTRAP_TIMEOUT", "3")
    uid = shmem.shmem_get_unique_id()
    # 3 of 4 ranks show up: each must fail after MORI_BOOTSTRAP_TIMEOUT naming rank 3.
    env = {"MORI_BOOTSTRAP_TIMEOUT": "3", "MORI_SHMEM_HEAP_SIZE": "8M"}
    results = run_ranks(_init_rank_of_four, 3, uid, env, timeout=60)
    for kind, missing, message in results:
        assert kind == "timeout" and missing == [3]
        assert "ranks 3 of 4 did not arrive within 3 s" in message and "MORI_BOOTSTRAP_TIMEOUT" in message


def _init_rank_of_four(rank: int, nranks: int, uid: bytes, env: dict[str, str]) -> Any:
    return _init_with(rank, 4, uid, env)


def test_unreachable_store_times_out_with_its_address(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("MORI_BOOTSTRAP_TIMEOUT", "1")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from mori.core.bootstrap import UniqueId

    uid = UniqueId("127.0.0.1", port, b"x" * 16).pack()
    with pytest.raises(MoriTimeoutError, match=f"127.0.0.1:{port}"):
        shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, 0, 2, uid)
    assert not shmem.shmem_is_initialized()


def _disagreeing_nranks(rank: int, nranks: int, uid: bytes) -> str:
    os.environ["MORI_BOOTSTRAP_TIMEOUT"] = "5"
    claimed = 2 if rank == 0 else 3  # rank 0 thinks the job has 2 ranks, the others 3
    try:
        shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, rank, claimed, uid)
    except (MoriValueError, MoriTimeoutError) as e:
        return type(e).__name__ + ": " + str(e)
    shmem.shmem_finalize()
    return "ok"


def test_ranks_disagreeing_on_nranks_fail() -> None:
    uid = shmem.shmem_get_unique_id()
    out = run_ranks(_disagreeing_nranks, 3, uid, timeout=60)
    assert all(o != "ok" for o in out)
    assert any("different nranks" in o for o in out), out


def test_bad_arguments_are_named(clean_env: pytest.MonkeyPatch) -> None:
    uid = shmem.shmem_get_unique_id()
    with pytest.raises(MoriValueError, match=r"rank=5 is not allowed; expected an int in \[0, 2\)"):
        shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, 5, 2, uid)
    with pytest.raises(MoriValueError, match="nranks=0"):
        shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, 0, 0, uid)
    with pytest.raises(MoriValueError, match="flags=7"):
        shmem.shmem_init_attr(7, 0, 1, uid)
    with pytest.raises(MoriValueError, match="uid"):
        shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, 0, 1, "not bytes")
    with pytest.raises(MoriValueError, match="128 bytes"):
        shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, 0, 1, b"short")


@pytest.mark.parametrize(
    "call",
    [
        lambda: shmem.shmem_mype(),
        lambda: shmem.shmem_npes(),
        lambda: shmem.shmem_malloc(64),
        lambda: shmem.shmem_barrier_all(),
        lambda: shmem.shmem_finalize(),
        lambda: shmem.shmem_putmem(0, 0, 8, 0),
        lambda: shmem.shmem_ptr_p2p(0, 0, 0),
    ],
)
def test_use_before_init_is_an_error(call: Any) -> None:
    with pytest.raises(MoriStateError, match="not initialised"):
        call()


def _double_init_then_reinit(rank: int, nranks: int, uid2: bytes) -> tuple[str, int]:
    with pytest.raises(MoriStateError, match="already initialised"):
        shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, rank, nranks, uid2)
    a = shmem.shmem_malloc(1024)
    shmem.shmem_finalize()
    with pytest.raises(MoriStateError):
        shmem.shmem_mype()
    # re-init after finalize works, with a fresh heap
    shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, rank, nranks, uid2)
    b = shmem.shmem_malloc(1024)
    shmem.shmem_barrier_all()
    return ("reinit", int(b != 0 and a != 0))


def test_double_init_fails_and_reinit_after_finalize_works() -> None:
    uid2 = shmem.shmem_get_unique_id()
    assert shmem_ranks(_double_init_then_reinit, 2, uid2) == [("reinit", 1)] * 2


def _torch_group_init(rank: int, nranks: int, port: int, name: str) -> tuple[int, int, bool]:
    import torch.distributed as dist
    from torch._C._distributed_c10d import _register_process_group

    os.environ["MORI_SHMEM_HEAP_SIZE"] = "16M"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nranks)
    try:
        if name != "default":
            _register_process_group(name, dist.group.WORLD)
        shmem.shmem_torch_process_group_init(name)
        buf = shmem.shmem_malloc(256)
        peer = (rank + 1) % nranks
        reachable = shmem.shmem_ptr_p2p(buf, rank, peer) != 0
        out = (shmem.shmem_mype(), shmem.shmem_npes(), reachable)
        shmem.shmem_finalize()
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("nranks", "name"), [(2, "default"), (4, "mori_ep_group")])
def test_torch_process_group_init(nranks: int, name: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert run_ranks(_torch_group_init, nranks, port, name, timeout=90) == [
        (r, nranks, True) for r in range(nranks)
    ]


def _unregistered_group(rank: int, nranks: int, port: int) -> str:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nranks)
    try:
        shmem.shmem_torch_process_group_init("no_such_group")
    except MoriValueError as e:
        return str(e)
    finally:
        dist.destroy_process_group()
    return "no error"


def test_torch_process_group_init_unknown_group_is_named() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for msg in run_ranks(_unregistered_group, 2, port, timeout=60):
        assert "group_name='no_such_group'" in msg and "_register_process_group" in msg


def test_torch_process_group_init_without_torch_distributed() -> None:
    with pytest.raises(MoriError, match=r"torch\.distributed is not initialised"):
        shmem.shmem_torch_process_group_init("default")


def _raises_in_rank(rank: int, nranks: int) -> None:
    if rank == 1:
        raise ValueError("boom in rank 1")


def test_launcher_reraises_the_failing_rank() -> None:
    with pytest.raises(RankError, match="rank 1 of 2 failed:\nValueError: boom in rank 1"):
        run_ranks(_raises_in_rank, 2, timeout=60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _group_init_with_an_absent_rank(rank: int, nranks: int, port: int, absent: int) -> Any:
    import torch.distributed as dist

    os.environ.update(MORI_BOOTSTRAP_TIMEOUT="2", MORI_SHMEM_HEAP_SIZE="8M")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nranks)
    try:
        if rank == absent:
            time.sleep(4)  # in the group, but never calls shmem_torch_process_group_init
            return ("absent",)
        t0 = time.monotonic()
        try:
            shmem.shmem_torch_process_group_init("default")
        except MoriTimeoutError as e:
            return ("timeout", e.missing, str(e), time.monotonic() - t0)
        shmem.shmem_finalize()
        return ("ok",)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("absent", [0, 2])
def test_torch_process_group_init_times_out_naming_an_absent_rank(absent: int) -> None:
    # Bounded by MORI_BOOTSTRAP_TIMEOUT (2 s here), not by torch's own timeout (30 min for gloo),
    # also when the absent rank is rank 0 of the group.
    out = run_ranks(_group_init_with_an_absent_rank, 3, _free_port(), absent, timeout=60)
    for rank, res in enumerate(out):
        if rank == absent:
            continue
        kind, missing, message, took = res
        assert kind == "timeout" and missing == [absent], res
        assert (
            f"ranks {absent} of 3 did not arrive within 2 s" in message
            and "MORI_BOOTSTRAP_TIMEOUT" in message
        )
        assert "in the store of process group 'default'" in message
        assert took < 10


def _init_twice_with_one_uid(rank: int, nranks: int, uid: bytes) -> tuple[str, float]:
    os.environ.update(MORI_BOOTSTRAP_TIMEOUT="10", MORI_SHMEM_HEAP_SIZE="8M")
    shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, rank, nranks, uid)
    shmem.shmem_finalize()
    t0 = time.monotonic()
    try:
        shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, rank, nranks, uid)
    except MoriValueError as e:
        return str(e), time.monotonic() - t0
    shmem.shmem_finalize()
    return "init worked", 0.0


def test_a_unique_id_serves_one_init(clean_env: pytest.MonkeyPatch) -> None:
    uid = shmem.shmem_get_unique_id()
    for message, took in run_ranks(_init_twice_with_one_uid, 2, uid, timeout=60):
        assert "uid has already been used" in message and "call shmem_get_unique_id() again" in message
        assert took < 2  # said at once, not after MORI_BOOTSTRAP_TIMEOUT
    # a process that never used it (a restarted rank) is told the same, by the store
    clean_env.setenv("MORI_BOOTSTRAP_TIMEOUT", "10")
    with pytest.raises(MoriValueError, match="uid has already been used by a job of 2 ranks"):
        shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, 1, 2, uid)
    assert not shmem.shmem_is_initialized()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _each_rank_makes_its_own_uid(rank: int, nranks: int) -> tuple[str, list[str]]:
    os.environ.update(MORI_BOOTSTRAP_TIMEOUT="2", MORI_SHMEM_HEAP_SIZE="8M")
    records = _Records()
    logging.getLogger("mori").addHandler(records)
    uid = shmem.shmem_get_unique_id()  # the mistake: every rank should get one process's id
    try:
        shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, rank, nranks, uid)
    except MoriTimeoutError as e:
        return str(e), records.messages
    return "no error", records.messages


def test_a_rank_waiting_alone_on_its_own_uid_is_told_why() -> None:
    for message, logged in run_ranks(_each_rank_makes_its_own_uid, 2, timeout=60):
        assert "did not arrive within 2 s" in message
        assert "no other rank reached the rendezvous store this process started" in message
        # said early too, while it still waits, not only when the timeout fires
        assert any("no other rank reached the rendezvous store" in m for m in logged), logged


_SHORT_LIVED_UID = """
import sys, time
import mori.shmem as shmem
print(shmem.shmem_get_unique_id().hex(), flush=True)
sys.stdin.readline()  # exits when told to
"""


def _join_then_lose_the_store(rank: int, nranks: int, uid: bytes, signal_path: str) -> str:
    import pathlib

    os.environ.update(MORI_BOOTSTRAP_TIMEOUT="3", MORI_SHMEM_HEAP_SIZE="8M")
    pathlib.Path(signal_path).touch()  # connected (or about to): the test now ends the store's process
    try:
        shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, rank, 2, uid)  # rank 1 never comes
    except MoriError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_losing_the_store_is_a_named_error_not_a_torch_one(
    tmp_path: Any, clean_env: pytest.MonkeyPatch
) -> None:
    import subprocess
    import sys

    maker = subprocess.Popen(
        [sys.executable, "-c", _SHORT_LIVED_UID], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert maker.stdout is not None and maker.stdin is not None
    uid = bytes.fromhex(maker.stdout.readline().strip())
    flag = tmp_path / "joined"

    def end_the_store() -> None:
        while not flag.exists():
            time.sleep(0.05)
        time.sleep(0.5)
        maker.stdin.close()  # type: ignore[union-attr]
        maker.wait()

    import threading

    killer = threading.Thread(target=end_the_store)
    killer.start()
    try:
        (message,) = run_ranks(_join_then_lose_the_store, 1, uid, str(flag), timeout=60)
    finally:
        killer.join()
        maker.stdout.close()
    assert message.startswith("MoriBackendError: the rendezvous store at"), message
    assert "has the process that serves it exited?" in message


def _listening_addresses(port: int) -> set[str]:
    """The local addresses this host listens on at ``port`` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                local, _, state = line.split()[1:4]
                addr, hexport = local.split(":")
                if state == "0A" and int(hexport, 16) == port:
                    found.add(addr)
    return found


def test_the_rendezvous_store_listens_on_the_configured_interface_only(clean_env: pytest.MonkeyPatch) -> None:
    """torch's TCPStore alone would listen on every interface; the store of a unique id listens on
    the address MORI_SOCKET_IFNAME names (here the loopback interface), nowhere else."""
    from mori.core.bootstrap import UniqueId

    clean_env.setenv("MORI_SOCKET_IFNAME", "lo")
    uid = UniqueId.unpack(shmem.shmem_get_unique_id())
    assert uid.host == "127.0.0.1"
    assert _listening_addresses(uid.port) == {"0100007F"}  # 127.0.0.1, not 0.0.0.0 nor ::
    shmem_ranks_result = run_ranks(_init_with_uid, 2, bytes(uid.pack()))
    assert shmem_ranks_result == [0, 1]


def _init_with_uid(rank: int, nranks: int, uid: bytes) -> int:
    shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, rank, nranks, uid)
    try:
        return shmem.shmem_mype()
    finally:
        shmem.shmem_finalize()
