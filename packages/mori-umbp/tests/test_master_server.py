"""The master process: Redis state across restarts, expiry, auth, limits, metrics, fuzzed input."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
import uuid

import grpc
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from umbp_helpers import Master, RedisServer, free_port

from mori.umbp import UMBPMasterClient, UMBPTierType
from mori.umbp.master import wire

DRAM, HBM = UMBPTierType.DRAM, UMBPTierType.HBM
CAPS = {DRAM: (1 << 30, 1 << 30)}


def redis_env(redis_server: RedisServer) -> dict[str, str]:
    return {
        "UMBP_METADATA_BACKEND": "redis",
        "UMBP_REDIS_URI": redis_server.uri,
        "UMBP_REDIS_NAMESPACE": f"test-{uuid.uuid4().hex[:8]}",
    }


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def scrape_until(m: Master, want: str, timeout: float = 10.0) -> str:
    """The master's metrics text once it contains ``want`` (a call is counted just after its
    answer is sent, so a scrape right after the call may miss it)."""
    deadline = time.monotonic() + timeout
    while True:
        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{m.metrics_port}/metrics", timeout=10).read().decode()
        )
        if want in text or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def test_redis_master_restart_keeps_every_registration_and_index_entry(redis_server: RedisServer) -> None:
    m = Master(redis_env(redis_server))
    try:
        node = UMBPMasterClient(m.address, node_id="persist-node", node_address="10.9.9.9")
        node.register_self(
            CAPS, peer_address="127.0.0.1:1234", engine_desc=b"engine-bytes", tags=["role=prefill"]
        )
        assert node.heartbeat([(0, "block-a", DRAM, 4096), (0, "block-b", HBM, 8192)])
        q = UMBPMasterClient(m.address)
        q.report_external_kv_blocks("persist-node", ["h1", "h2", "h3"], DRAM)
        q.report_external_kv_blocks("persist-node", ["h1"], HBM)
        for _ in range(3):
            q.match_external_kv(["h1", "h2"], count_as_hit=True)
        m.kill()  # SIGKILL: nothing is written on the way out
        m.start()
        q = UMBPMasterClient(m.address)
        info = q.get_node("persist-node")
        assert (
            info is not None and info["node_address"] == "10.9.9.9" and info["engine_desc"] == b"engine-bytes"
        )
        assert info["tags"] == ["role=prefill"] and info["peer_address"] == "127.0.0.1:1234"
        (match,) = q.match_external_kv(["h1", "h2", "h3", "nope"])
        assert match.node_id == "persist-node" and match.peer_address == "127.0.0.1:1234"
        assert set(match.hashes_by_tier[DRAM]) == {"h1", "h2", "h3"} and match.hashes_by_tier[HBM] == ["h1"]
        assert {e.hash: e.hit_count_total for e in q.get_external_kv_hit_counts(["h1", "h2", "h3"])} == {
            "h1": 3,
            "h2": 3,
        }
        assert q.route_get(["block-a", "block-b", "block-c"]) == [
            ("persist-node", "127.0.0.1:1234", DRAM, 4096),
            ("persist-node", "127.0.0.1:1234", HBM, 8192),
            None,
        ]
        assert q.batch_lookup(["block-a", "block-c"]) == [True, False]
        # the node's heartbeat still works against the new master: it never had to re-register
        assert node.heartbeat([(1, "block-a", DRAM, 0)])
        assert q.batch_lookup(["block-a", "block-b"]) == [False, True]
    finally:
        m.stop()


def test_redis_backend_has_the_same_semantics(redis_server: RedisServer) -> None:
    m = Master(redis_env(redis_server))
    try:
        a = UMBPMasterClient(m.address, node_id="ra", node_address="ra")
        a.register_self(CAPS)
        q = UMBPMasterClient(m.address)
        q.report_external_kv_blocks("ra", ["x", "y"], DRAM)
        q.report_external_kv_blocks("ra", ["x", "y"], HBM)
        q.revoke_external_kv_blocks("ra", ["y"], HBM)
        (mt,) = q.match_external_kv(["x", "y"])
        assert set(mt.hashes_by_tier[DRAM]) == {"x", "y"} and mt.hashes_by_tier[HBM] == ["x"]
        q.revoke_all_external_kv_blocks_at_tier("ra", DRAM)
        (mt,) = q.match_external_kv(["x", "y"])
        assert list(mt.hashes_by_tier) == [HBM]
        q.report_external_kv_blocks("ghost", ["x"], DRAM)  # unknown node: ignored
        assert {x.node_id for x in q.match_external_kv(["x"])} == {"ra"}
        a.unregister_self()
        assert q.match_external_kv(["x"]) == []
        with pytest.raises(RuntimeError, match="UMBP_HIT_QUERY_MAX_BATCH"):
            q.get_external_kv_hit_counts([str(i) for i in range(4097)])
    finally:
        m.stop()


@pytest.mark.parametrize("backend", ["inmemory", "redis"])
def test_silent_nodes_expire(backend: str, redis_server: RedisServer) -> None:
    env = {"UMBP_HEARTBEAT_TTL_SEC": "1", **(redis_env(redis_server) if backend == "redis" else {})}
    m = Master(env)
    try:
        n = UMBPMasterClient(m.address, node_id="silent", node_address="silent")
        n.register_self(CAPS)
        q = UMBPMasterClient(m.address)
        q.report_external_kv_blocks("silent", ["s1"], DRAM)
        assert q.match_external_kv(["s1"])
        time.sleep(1.6)
        assert q.match_external_kv(["s1"]) == [], "an expired node is not matched"
        q.report_external_kv_blocks("silent", ["s2"], DRAM)  # ignored
        assert q.match_external_kv(["s2"]) == []
        assert not n.heartbeat(), "the master tells an expired node to register again"
    finally:
        m.stop()


def test_auth_token_is_required_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UMBP_MASTER_AUTH_TOKEN", raising=False)
    m = Master({"UMBP_MASTER_AUTH_TOKEN": "s3cret"})
    try:
        with pytest.raises(RuntimeError, match="UNAUTHENTICATED"):
            UMBPMasterClient(m.address).match_external_kv(["h"])
        with pytest.raises(RuntimeError, match="UNAUTHENTICATED"):
            UMBPMasterClient(m.address, auth_token="wrong").match_external_kv(["h"])
        assert UMBPMasterClient(m.address, auth_token="s3cret").match_external_kv(["h"]) == []
    finally:
        m.stop()


def test_refuses_to_listen_beyond_loopback_without_a_token() -> None:
    env = {k: v for k, v in os.environ.items() if k != "UMBP_MASTER_AUTH_TOKEN"}
    res = subprocess.run(
        [sys.executable, "-m", "mori.umbp.master.server", f"0.0.0.0:{free_port()}", "0"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode != 0 and "UMBP_MASTER_AUTH_TOKEN" in res.stderr


def test_prometheus_metrics() -> None:
    m = Master()
    try:
        q = UMBPMasterClient(m.address)
        q.match_external_kv(["a", "b"])
        with pytest.raises(RuntimeError):
            q.report_external_kv_blocks("n", [], DRAM)
        with pytest.raises(RuntimeError, match="INVALID_ARGUMENT"):  # refused by the master itself
            q.get_external_kv_hit_counts([str(i) for i in range(5000)])
        want = 'umbp_master_rpc_total{code="OK",method="MatchExternalKv"} 1.0'
        text = scrape_until(m, want)
        assert (
            want in text
            and 'code="INVALID_ARGUMENT",method="GetExternalKvHitCounts"} 1.0'
            in scrape_until(m, 'code="INVALID_ARGUMENT",method="GetExternalKvHitCounts"} 1.0')
        )
        assert 'umbp_master_rpc_seconds_bucket{le="0.001",method="MatchExternalKv"}' in text
    finally:
        m.stop()


def test_tables_are_bounded_and_memory_stays_flat_under_a_flood_of_reports() -> None:
    m = Master({"UMBP_MASTER_MAX_EXTERNAL_KV": "20000", "UMBP_MASTER_MAX_NODES": "4"})
    try:
        nodes = []
        for i in range(4):
            n = UMBPMasterClient(m.address, node_id=f"flood-{i}", node_address="x")
            n.register_self(CAPS)
            nodes.append(n)
        with pytest.raises(RuntimeError, match="UMBP_MASTER_MAX_NODES"):
            UMBPMasterClient(m.address, node_id="one-too-many", node_address="x").register_self(CAPS)
        q = UMBPMasterClient(m.address)
        assert m.proc is not None
        refused = 0
        for r in range(230):  # 230 x 2000 hashes offered, 20k may be kept: 10 reports fill the index
            try:
                q.report_external_kv_blocks(f"flood-{r % 4}", [f"f{r}-{j}" for j in range(2000)], DRAM)
            except RuntimeError as e:
                assert "RESOURCE_EXHAUSTED" in str(e)
                refused += 1
            if r == 29:  # the index is full and the allocator has seen 20 refused requests
                base = rss_kib(m.proc.pid)
        assert refused == 220
        grown = rss_kib(m.proc.pid) - base
        # 200 refused reports carry 400k hashes (~9 MB of strings); kept, they would cost the master
        # well over 40 MiB (a str and a set slot each). 16 MiB of slack covers allocator noise.
        assert grown < 16 * 1024, f"the master grew {grown} KiB under refused reports"
        want = 'umbp_master_rpc_total{code="RESOURCE_EXHAUSTED",method="ReportExternalKv"} 220.0'
        assert want in scrape_until(m, want)
    finally:
        m.stop()


# -- fuzzed requests -------------------------------------------------------------------------------

json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20,
)  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(method=st.sampled_from(sorted(wire.SCHEMAS)), msg=json_like)
def test_wire_check_accepts_or_raises_wire_error(method: str, msg: object) -> None:
    try:
        out = wire.check(method, msg, 1024)
    except wire.WireError:
        return
    assert set(out) == set(wire.SCHEMAS[method])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_requests_get_invalid_argument_and_the_master_survives(
    shared_master: Master, data: st.DataObject
) -> None:
    method = data.draw(st.sampled_from(sorted(wire.SCHEMAS)))
    kind = data.draw(st.sampled_from(["bytes", "msgpack", "fields"]))
    if kind == "bytes":
        raw = data.draw(st.binary(max_size=200))
    elif kind == "msgpack":
        raw = msgpack.packb(data.draw(json_like), use_bin_type=True)
    else:  # the right field names with values of any type
        raw = msgpack.packb({f: data.draw(json_like) for f in wire.SCHEMAS[method]}, use_bin_type=True)
    with grpc.insecure_channel(shared_master.address) as ch:
        call = ch.unary_unary(f"/{wire.SERVICE}/{method}")
        try:
            call(raw, timeout=10)
        except grpc.RpcError as e:
            assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), (
                e.code(),
                e.details(),
            )
    assert shared_master.proc is not None and shared_master.proc.poll() is None
    assert UMBPMasterClient(shared_master.address).match_external_kv(["alive?"]) == []


def test_oversized_and_nested_messages_are_refused(shared_master: Master) -> None:
    with grpc.insecure_channel(shared_master.address) as ch:
        call = ch.unary_unary(f"/{wire.SERVICE}/MatchExternalKv")
        deep = b"\x91" * 10000 + b"\xc0"  # 10000 nested one-element arrays
        for raw in (deep, msgpack.packb({"hashes": ["x" * 5000]}), msgpack.packb({"hashes": ["h"] * 70000})):
            with pytest.raises(grpc.RpcError) as e:
                call(raw, timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_batched_matches_on_redis_answer_each_query(redis_server: RedisServer) -> None:
    m = Master(redis_env(redis_server))
    try:
        n = UMBPMasterClient(m.address, node_id="rb", node_address="rb")
        n.register_self(CAPS)
        q = UMBPMasterClient(m.address)
        q.report_external_kv_blocks("rb", ["a", "b", "c"], DRAM)
        results = q._send_matches([(["a", "z"], True), (["z"], False), (["b", "c", "b"], True)])
        assert [[(x[0], x[2]) for x in r] for r in results] == [
            [("rb", [[2, ["a"]]])],
            [],
            [("rb", [[2, ["b", "c"]]])],
        ]
        assert {e.hash: e.hit_count_total for e in q.get_external_kv_hit_counts(["a", "b", "c"])} == {
            "a": 1,
            "b": 1,
            "c": 1,
        }
    finally:
        m.stop()
