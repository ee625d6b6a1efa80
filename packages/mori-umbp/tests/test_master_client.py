"""UMBPMasterClient and the own-node external-KV calls of a distributed UMBPClient, against a
real ``umbp_master`` process: the cases of the original's master-client tests, and more."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from umbp_helpers import Master, RedisServer, free_port

from mori.cpp import (
    UMBPClient,
    UMBPConfig,
    UMBPDistributedConfig,
    UMBPExternalKvHitCountEntry,
    UMBPExternalKvNodeMatch,
    UMBPMasterClient,
    UMBPTierType,
)

GB = 1 << 30
CAPS = {UMBPTierType.DRAM: (GB, GB)}
DRAM, HBM, SSD = UMBPTierType.DRAM, UMBPTierType.HBM, UMBPTierType.SSD


def hashes_of(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-hash-{i:04d}" for i in range(n)]


@contextlib.contextmanager
def node_client(address: str, node_id: str) -> Iterator[UMBPClient]:
    cfg = UMBPConfig()
    cfg.dram.capacity_bytes = 8 << 20
    cfg.ssd.enabled = False
    dist = UMBPDistributedConfig()
    dist.master_config.master_address = address
    dist.master_config.node_id = node_id
    dist.master_config.node_address = node_id
    dist.master_config.auto_heartbeat = True
    cfg.distributed = dist
    client = UMBPClient(cfg)
    try:
        yield client
    finally:
        client.close()


@contextlib.contextmanager
def registered(address: str, node_id: str, caps: dict | None = None) -> Iterator[UMBPMasterClient]:  # type: ignore[type-arg]
    c = UMBPMasterClient(address, node_id=node_id, node_address=node_id)
    c.register_self(caps or CAPS)
    try:
        yield c
    finally:
        c.unregister_self()


def mine(matches: list[UMBPExternalKvNodeMatch], node_id: str) -> list[UMBPExternalKvNodeMatch]:
    return [m for m in matches if m.node_id == node_id]


def counts(client: object, hashes: list[str]) -> dict[str, int]:
    return {e.hash: e.hit_count_total for e in client.get_external_kv_hit_counts(hashes)}  # type: ignore[attr-defined]


@pytest.fixture(scope="module", params=["inmemory", "redis"])
def addr(request: pytest.FixtureRequest) -> Iterator[str]:
    """A master shared by the module's tests, with each metadata backend: the Redis one runs the
    same cases through its Lua scripts."""
    env = {}
    if request.param == "redis":
        redis_server: RedisServer = request.getfixturevalue("redis_server")
        env = {"UMBP_METADATA_BACKEND": "redis", "UMBP_REDIS_URI": redis_server.uri,
               "UMBP_REDIS_NAMESPACE": f"client-{uuid.uuid4().hex[:8]}"}  # fmt: skip
    m = Master(env)
    try:
        yield m.address
    finally:
        m.stop()


# -- construction and registration -----------------------------------------------------------------


def test_construction_is_lazy_and_never_raises() -> None:
    c = UMBPMasterClient("localhost:19999", node_id="n1", node_address="n1:8080")
    assert not c.is_registered()


def test_register_unregister(addr: str) -> None:
    c = UMBPMasterClient(addr, node_id="reg-node", node_address="reg-node:8080")
    assert not c.is_registered()
    c.register_self(CAPS)
    assert c.is_registered()
    c.unregister_self()
    assert not c.is_registered()
    c.unregister_self()  # not registered: nothing happens


def test_connection_refused_raises_runtime_error() -> None:
    port = free_port()
    with pytest.raises(RuntimeError, match="UNAVAILABLE"):
        UMBPMasterClient(f"127.0.0.1:{port}", node_id="n", node_address="n:1").register_self(CAPS)
    with pytest.raises(RuntimeError):
        UMBPMasterClient(f"127.0.0.1:{port}").match_external_kv(["some-hash"])
    cfg = UMBPConfig()
    cfg.dram.capacity_bytes = 8 << 20
    cfg.ssd.enabled = False
    cfg.distributed = UMBPDistributedConfig()
    cfg.distributed.master_config.master_address = f"127.0.0.1:{port}"
    cfg.distributed.master_config.node_id = cfg.distributed.master_config.node_address = "refused"
    with pytest.raises(RuntimeError):
        UMBPClient(cfg)


# -- external KV through UMBPMasterClient ----------------------------------------------------------


def test_empty_and_unknown_queries(addr: str) -> None:
    c = UMBPMasterClient(addr)
    assert c.match_external_kv([]) == []
    assert c.match_external_kv(hashes_of("unknown", 5)) == []
    assert c.get_external_kv_hit_counts(hashes_of("unknown-hit", 3)) == []


def test_report_round_trip(addr: str) -> None:
    hs = hashes_of("rpc-report", 3)
    with registered(addr, "rpc-report-node"):
        q = UMBPMasterClient(addr)
        q.report_external_kv_blocks("rpc-report-node", hs, DRAM)
        (m,) = mine(q.match_external_kv(hs), "rpc-report-node")
        assert set(m.hashes_by_tier[DRAM]) == set(hs) and m.matched_hash_count() == 3


def test_revoke_one_tier_keeps_the_other(addr: str) -> None:
    hs = hashes_of("rpc-revoke-tier", 4)
    with registered(addr, "rpc-revoke-tier-node", {HBM: (GB, GB), DRAM: (GB, GB)}):
        q = UMBPMasterClient(addr)
        q.report_external_kv_blocks("rpc-revoke-tier-node", hs, HBM)
        q.report_external_kv_blocks("rpc-revoke-tier-node", hs, DRAM)
        q.revoke_external_kv_blocks("rpc-revoke-tier-node", hs, HBM)
        (m,) = mine(q.match_external_kv(hs), "rpc-revoke-tier-node")
        assert HBM not in m.hashes_by_tier and set(m.hashes_by_tier[DRAM]) == set(hs)


def test_revoke_all_at_tier(addr: str) -> None:
    hs = hashes_of("rpc-revoke-all", 8)
    with registered(addr, "rpc-revoke-all-node"):
        q = UMBPMasterClient(addr)
        q.report_external_kv_blocks("rpc-revoke-all-node", hs, DRAM)
        q.report_external_kv_blocks("rpc-revoke-all-node", hs, SSD)
        q.revoke_all_external_kv_blocks_at_tier("rpc-revoke-all-node", SSD)
        (m,) = mine(q.match_external_kv(hs), "rpc-revoke-all-node")
        assert SSD not in m.hashes_by_tier and set(m.hashes_by_tier[DRAM]) == set(hs)


def test_reports_for_unknown_or_unregistered_nodes_are_ignored(addr: str) -> None:
    q = UMBPMasterClient(addr)
    q.report_external_kv_blocks("ghost-node", hashes_of("ghost", 1), DRAM)
    assert all(m.node_id != "ghost-node" for m in q.match_external_kv(hashes_of("ghost", 1)))
    c = UMBPMasterClient(addr, node_id="dead-node", node_address="dead-node")
    c.register_self(CAPS)
    c.unregister_self()
    c.report_external_kv_blocks("dead-node", hashes_of("dead", 1), DRAM)
    assert all(m.node_id != "dead-node" for m in q.match_external_kv(hashes_of("dead", 1)))
    q.revoke_external_kv_blocks("unknown-revoke-node", hashes_of("x", 2), DRAM)  # no-ops
    q.revoke_all_external_kv_blocks_at_tier("unknown-revoke-node", DRAM)


def test_empty_arguments_raise(addr: str) -> None:
    q = UMBPMasterClient(addr)
    with pytest.raises(RuntimeError, match="node_id"):
        q.report_external_kv_blocks("", ["h"], DRAM)
    with registered(addr, "empty-hashes-node"), pytest.raises(RuntimeError, match="hashes"):
        q.report_external_kv_blocks("empty-hashes-node", [], DRAM)
    with pytest.raises(ValueError, match="tier"):
        q.report_external_kv_blocks("n", ["h"], UMBPTierType.Unknown)


def test_oversized_hit_count_query_raises_naming_the_limit(addr: str) -> None:
    limit = int(os.environ.get("UMBP_HIT_QUERY_MAX_BATCH", "4096"))
    with pytest.raises(RuntimeError, match="UMBP_HIT_QUERY_MAX_BATCH"):
        UMBPMasterClient(addr).get_external_kv_hit_counts(hashes_of("too-many", limit + 1))
    assert UMBPMasterClient(addr).get_external_kv_hit_counts(hashes_of("just-enough", limit)) == []


# -- the own-node calls of a distributed UMBPClient ------------------------------------------------


def test_client_report_is_visible_and_revoke_removes_it(addr: str) -> None:
    hs = hashes_of("alias", 2)
    with node_client(addr, "alias-node") as c:
        assert c.is_distributed()
        assert c.report_external_kv_blocks(hs, DRAM)
        (m,) = mine(UMBPMasterClient(addr).match_external_kv(hs), "alias-node")
        assert set(m.hashes_by_tier[DRAM]) == set(hs)
        assert c.revoke_external_kv_blocks(hs, DRAM)
        assert all(m.node_id != "alias-node" for m in UMBPMasterClient(addr).match_external_kv(hs))
        assert c.report_external_kv_blocks([], DRAM)  # empty: nothing to do


def test_client_revoke_all_at_tier(addr: str) -> None:
    hs = hashes_of("alias-all", 3)
    with node_client(addr, "alias-all-node") as c:
        assert c.report_external_kv_blocks(hs, DRAM) and c.report_external_kv_blocks(hs, SSD)
        assert c.revoke_all_external_kv_blocks_at_tier(SSD)
        (m,) = mine(UMBPMasterClient(addr).match_external_kv(hs), "alias-all-node")
        assert SSD not in m.hashes_by_tier and set(m.hashes_by_tier[DRAM]) == set(hs)


def test_clear_removes_external_kv_at_once_and_allows_rebinding(addr: str) -> None:
    hs = hashes_of("clear", 3)
    q = UMBPMasterClient(addr)
    with node_client(addr, "clear-node") as c:
        assert c.report_external_kv_blocks(hs, DRAM)
        assert any(m.node_id == "clear-node" for m in q.match_external_kv(hs))
        assert c.clear()
        assert all(m.node_id != "clear-node" for m in q.match_external_kv(hs))
        assert c.report_external_kv_blocks(hs, DRAM)
        assert any(m.node_id == "clear-node" for m in q.match_external_kv(hs))
        assert c.clear()
        assert all(m.node_id != "clear-node" for m in q.match_external_kv(hs))


def test_match_dram_node(addr: str) -> None:
    hs = hashes_of("dram", 8)
    with node_client(addr, "match-dram-node") as c:
        assert c.report_external_kv_blocks(hs, DRAM)
        (m,) = c.match_external_kv(hs)
        assert m.node_id == "match-dram-node" and m.matched_hash_count() == 8
        assert set(m.hashes_by_tier[DRAM]) == set(hs)
        assert m.peer_address, "a distributed node advertises its peer service"


def test_hit_counting_rules(addr: str) -> None:
    hot, missing = "hit-hot", "hit-missing"
    with node_client(addr, "hit-a") as a, node_client(addr, "hit-b") as b:
        assert a.report_external_kv_blocks([hot], DRAM) and a.report_external_kv_blocks([hot], HBM)
        assert b.report_external_kv_blocks([hot], DRAM)
        for _ in range(3):  # count_as_hit=False records nothing
            assert a.match_external_kv([hot])
        assert a.get_external_kv_hit_counts([hot]) == []
        matches = a.match_external_kv([hot, hot, hot, missing], count_as_hit=True)
        assert {m.node_id for m in matches} == {"hit-a", "hit-b"}
        # one per distinct matched hash per call, whatever the copies and repeats
        assert counts(a, [hot, hot, missing]) == {hot: 1}


def test_hit_counts_accumulate_and_survive_revoke(addr: str) -> None:
    hot = "hit-revoke-hot"
    with node_client(addr, "hit-revoke-node") as c:
        assert c.report_external_kv_blocks([hot], DRAM)
        for _ in range(4):
            c.match_external_kv([hot], count_as_hit=True)
        assert counts(c, [hot]) == {hot: 4}
        assert c.revoke_external_kv_blocks([hot], DRAM)
        assert c.match_external_kv([hot], count_as_hit=True) == []
        assert counts(c, [hot]) == {hot: 4}


def test_match_returns_only_queried_reported_hashes(addr: str) -> None:
    reported, extra = hashes_of("subset-reported", 6), hashes_of("subset-extra", 4)
    with node_client(addr, "subset-node") as c:
        assert c.report_external_kv_blocks(reported, DRAM)
        got = {
            h
            for m in c.match_external_kv(reported[:3] + extra)
            for hs in m.hashes_by_tier.values()
            for h in hs
        }
        assert got == set(reported[:3])


def test_partial_revoke(addr: str) -> None:
    hs = hashes_of("partial", 10)
    with node_client(addr, "partial-node") as c:
        assert c.report_external_kv_blocks(hs, DRAM)
        assert c.revoke_external_kv_blocks(hs[:4], DRAM)
        kept = {
            h
            for m in mine(c.match_external_kv(hs[4:]), "partial-node")
            for v in m.hashes_by_tier.values()
            for h in v
        }
        gone = {
            h
            for m in mine(c.match_external_kv(hs[:4]), "partial-node")
            for v in m.hashes_by_tier.values()
            for h in v
        }
        assert kept == set(hs[4:]) and gone == set()


def test_several_nodes_and_additive_tiers(addr: str) -> None:
    hs = hashes_of("shared", 5)
    with node_client(addr, "multi-a") as a, node_client(addr, "multi-b") as b:
        assert a.report_external_kv_blocks(hs, DRAM) and a.report_external_kv_blocks(hs, HBM)
        assert b.report_external_kv_blocks(hs, HBM)
        matches = a.match_external_kv(hs)
        assert {m.node_id for m in matches} >= {"multi-a", "multi-b"}
        (ma,) = mine(matches, "multi-a")
        assert set(ma.hashes_by_tier[DRAM]) == set(hs) == set(ma.hashes_by_tier[HBM])
        assert ma.matched_hash_count() == 5, "a hash in two tiers counts once"


def test_large_batch(addr: str) -> None:
    hs = hashes_of("large", 500)
    with node_client(addr, "large-node") as c:
        assert c.report_external_kv_blocks(hs, DRAM)
        got = {h for m in c.match_external_kv(hs) for v in m.hashes_by_tier.values() for h in v}
        assert set(hs) <= got


def test_result_types_repr_and_count() -> None:
    m = UMBPExternalKvNodeMatch()
    m.node_id = "my-node"
    m.hashes_by_tier = {HBM: ["h1", "h2"]}
    assert "my-node" in repr(m) and m.matched_hash_count() == 2
    e = UMBPExternalKvHitCountEntry()
    e.hash, e.hit_count_total = "my-hash", 7
    assert "my-hash" in repr(e) and "7" in repr(e)


def test_in_memory_master_restart_loses_external_state() -> None:
    m = Master()
    try:
        hs = hashes_of("restart", 2)
        with node_client(m.address, "restart-node") as c:
            assert c.report_external_kv_blocks(hs, DRAM)
            assert mine(UMBPMasterClient(m.address).match_external_kv(hs), "restart-node")
            m.stop()
            m.start()
            assert all(x.node_id != "restart-node" for x in UMBPMasterClient(m.address).match_external_kv(hs))
    finally:
        m.stop()


def test_concurrent_matches_share_rpcs_and_each_gets_its_own_answer(addr: str) -> None:
    """Group commit: calls that wait behind an RPC in flight go together in the next one, and
    each caller gets exactly its own query's answer and hit counting."""
    import threading

    with registered(addr, "gc-node"):
        q = UMBPMasterClient(addr)
        q.report_external_kv_blocks("gc-node", [f"gc-{i}" for i in range(64)], DRAM)
        calls: list[str] = []
        real = q._call

        def counting(method: str, request: dict, timeout: float | None = None) -> dict:  # type: ignore[type-arg]
            calls.append(method)
            return real(method, request, timeout)

        q._call = counting  # type: ignore[method-assign]
        errors: list[BaseException] = []
        barrier = threading.Barrier(16)

        def work(t: int) -> None:
            try:
                barrier.wait()
                for i in range(20):
                    mine_ = [f"gc-{(t * 4 + i) % 64}", f"gc-miss-{t}"]
                    (m,) = q.match_external_kv(mine_, count_as_hit=(t == 0))
                    assert m.hashes_by_tier[DRAM] == [mine_[0]], (t, i)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(16)]
        [th.start() for th in threads]
        [th.join(30) for th in threads]
        assert not errors, errors[0]
        assert len(calls) < 16 * 20, "concurrent calls were coalesced"
        assert "MatchExternalKvBatch" in calls
        hits = counts(q, [f"gc-{i}" for i in range(64)])
        assert sum(hits.values()) == 20, "only thread 0 counted hits: one per call, none lost or doubled"


def test_group_commit_wakes_every_caller_and_hands_errors_to_their_batch() -> None:
    """The group commit alone, with a fake RPC: every caller returns (an answered call is woken
    by the next sender, so a lost hand-off would leave it waiting), with its own answer; an RPC
    that fails raises in exactly the calls it carried, and the calls after it still go through."""
    import threading
    import time

    from mori.umbp.master_client import _GroupCommit

    sent: list[int] = []

    def send(queries: list[int]) -> list[int]:
        sent.append(len(queries))
        time.sleep(0.002)  # an RPC in flight: the others queue up behind it
        if any(q % 97 == 0 for q in queries):
            raise ConnectionError("this batch failed", list(queries))
        return [q * 2 for q in queries]

    gc = _GroupCommit(send, max_calls=8, max_items=1 << 20)
    results: dict[int, object] = {}

    def work(t: int) -> None:
        for i in range(30):
            q = t * 1000 + i + 1
            try:
                results[q] = gc(q, 1)
            except ConnectionError as e:
                results[q] = e

    threads = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(12)]
    [th.start() for th in threads]
    deadline = time.monotonic() + 30  # the whole run takes well under a second
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    assert not any(th.is_alive() for th in threads), "a caller was never woken"
    assert len(results) == 12 * 30 and max(sent) > 1 and max(sent) <= 8
    failed = {q for q, r in results.items() if isinstance(r, ConnectionError)}
    assert all(results[q] == q * 2 for q in results if q not in failed)
    bad = {q for q in results if q % 97 == 0}
    assert bad <= failed, "the failing query's caller raised"
    for q in failed:  # raised the error of the RPC that carried it, which carried a failing query
        batch = results[q].args[1]  # type: ignore[union-attr]
        assert q in batch and any(b in bad for b in batch), "only its batch raised"
    assert gc(5, 1) == 10 and not gc._busy, "the group commit is idle and usable afterwards"


@pytest.mark.parametrize("role", ["next sender", "answered call"])
def test_group_commit_caller_interrupted_while_waiting_leaves_nobody_waiting(role: str) -> None:
    """A caller interrupted while it waits (Ctrl-C reaches the main thread alone) raises, and the
    calls queued with it still get their answers: what the interrupted call would have done when
    woken (send the next RPC, or wake the next answered call of its RPC) is still done."""
    import os
    import signal
    import threading
    import time

    from mori.umbp.master_client import _GroupCommit

    class Interrupted(BaseException):
        pass

    rpcs = [threading.Event() for _ in range(3)]
    sent: list[list[int]] = []

    def send(queries: list[int]) -> list[int]:
        sent.append(list(queries))
        rpcs[len(sent) - 1].wait(10)  # in flight until the test lets it return
        return [q * 2 for q in queries]

    gc = _GroupCommit(send, max_calls=8, max_items=1 << 20)
    results: dict[int, int] = {}

    def call(q: int) -> None:
        results[q] = gc(q, 1)

    def until(cond: Any) -> None:
        deadline = time.monotonic() + 10
        while not cond():
            assert time.monotonic() < deadline, f"stuck at {sent} with queue {len(gc._queue)}"
            time.sleep(0.005)

    def start(q: int) -> threading.Thread:
        th = threading.Thread(target=call, args=(q,), daemon=True)
        th.start()
        return th

    def driver() -> None:
        until(lambda: len(gc._queue) == queued_before_main + 1)  # the main thread waits
        others.append(start(3))  # queued behind it
        until(lambda: len(gc._queue) == queued_before_main + 2)
        if role == "next sender":
            time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGINT)  # while the main thread waits to send RPC 2
            time.sleep(0.05)
            rpcs[0].set()
        else:
            rpcs[0].set()  # RPC 2 ([10, 2, 3], sent by 10) carries the main thread's call
            until(lambda: len(sent) == 2)
            time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGINT)  # while it waits for RPC 2's answer
            time.sleep(0.05)
        rpcs[1].set()
        rpcs[2].set()

    def interrupt(signum: int, frame: Any) -> None:
        raise Interrupted

    old = signal.signal(signal.SIGINT, interrupt)
    try:
        others = [start(1)]  # sends RPC 1
        until(lambda: len(sent) == 1)
        if role == "answered call":
            others.append(start(10))  # sends RPC 2
            until(lambda: len(gc._queue) == 1)
        queued_before_main = len(gc._queue)
        threading.Thread(target=driver, daemon=True).start()
        with pytest.raises(Interrupted):
            gc(2, 1)
    finally:
        signal.signal(signal.SIGINT, old)
    until(lambda: len(others) == (2 if role == "next sender" else 3))
    for th in others:
        th.join(10)
    assert not any(th.is_alive() for th in others), f"a call queued with the interrupted one hangs ({sent})"
    assert results == {1: 2, 3: 6} | ({10: 20} if role == "answered call" else {})
    assert gc(5, 1) == 10 and not gc._busy, "the group commit is idle and usable afterwards"


def test_a_malformed_match_answer_is_a_named_error() -> None:
    """An answer naming a tier that does not exist (a broken or hostile master) raises UMBPError,
    not a KeyError from inside the client."""
    from mori.umbp.errors import UMBPError

    q = UMBPMasterClient("127.0.0.1:1")
    q._match = lambda query, items: [["node", "10.0.0.1:1", [[9, ["h0"]]]]]  # type: ignore[method-assign]
    with pytest.raises(UMBPError, match="malformed answer"):
        q.match_external_kv(["h0"])
    q._match = lambda query, items: [["node", "10.0.0.1:1", [[2, ["h0"]]]]]  # type: ignore[method-assign]
    (m,) = q.match_external_kv(["h0"])
    assert m.hashes_by_tier == {UMBPTierType.DRAM: ["h0"]}
