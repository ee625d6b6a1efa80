"""The device helpers (mori.viz.device) in real kernels under the Triton interpreter, on CPU
ranks: what a ring holds after traced launches, that untraced launches touch nothing and compile
to the uninstrumented kernel, ring wrap-around, clock pairs, and cross-rank ordering facts of a
put/signal ping-pong over mori.shmem that the exported trace must keep.

Kernels run in spawned ranks with ``TRITON_INTERPRET=1`` (the interpreter is chosen when
``triton.jit`` runs, so this process never imports them interpreted); the test kernels live in
``_viz_kernels.py``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

# (find_spec, not importorskip: spawned ranks import this module before they set TRITON_INTERPRET,
# and Triton chooses the interpreter for its own jitted helpers, such as tl.cdiv, when it is imported)
if importlib.util.find_spec("triton") is None:
    pytest.skip("the device helpers need Triton (pip install mori-core[triton])", allow_module_level=True)

from mori.testing import run_ranks, shmem_ranks

INTERPRET = {"TRITON_INTERPRET": "1"}
TIMEOUT = 90.0  # a device wait has no timeout: a broken signal would hang the ranks


def _kernels() -> ModuleType:
    """_viz_kernels.py, loaded by path (tests are not a package)."""
    name = "mori_viz_test_kernels"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("_viz_kernels.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


# -- one rank: what the rings hold --------------------------------------------------------------------


def _copy_program_events(k: ModuleType, chunks: int) -> list[tuple[int, int]]:
    """(kind, slot) that one program of copy_kernel writes per launch, in order."""
    from mori.viz import layout

    c = k.COPY
    one = [(layout.BEGIN, c.chunk.value), (layout.BEGIN, c.load.value), (layout.NEXT, c.store.value)]
    one += [(layout.END, c.store.value), (layout.END, c.chunk.value)]
    return [
        (layout.BEGIN, c.kernel.value),
        *one * chunks,
        (layout.INSTANT, c.done.value),
        (layout.END, c.kernel.value),
    ]


def _rings_after_traced_and_untraced_launches(rank: int, n: int, out_dir: str) -> dict[str, Any]:
    import numpy as np
    import torch

    from mori import viz
    from mori.viz import layout

    k = _kernels()
    src = torch.arange(3 * 3 * 64 - 17, dtype=torch.int32)  # the last program's last chunk is partial
    dst = torch.zeros_like(src)
    buf = viz.TraceBuffer(n_rings=2, capacity=64, device="cpu", name="copy")  # 3 programs, 2 rings
    for _ in range(2):
        k.copy_kernel[(3,)](dst, src, src.numel(), buf.tensor, TRACE=True, CHUNKS=3, BLOCK=64)
    assert torch.equal(dst, src)

    data = buf.read()
    want = _copy_program_events(k, 3)
    assert data.written.tolist() == [2 * len(want)] * 2 and data.lost.tolist() == [0, 0]
    for ring in (0, 1):
        ev = data.events[data.events["ring"] == ring]
        assert list(zip(ev["kind"].tolist(), ev["slot"].tolist(), strict=True)) == want * 2
        assert ev["launch"].tolist() == [0] * len(want) + [1] * len(want)
        assert (np.diff(ev["ts"]) >= 0).all(), "one program's timestamps never go back"
    table = buf.tensor[layout.HEADER_WORDS : layout.events_offset(2)].view(2, 2)
    assert table[:, 1].tolist() == [2, 2], "launch counts"

    # untraced: same results, and not one word of the buffer changes
    before = buf.words()
    dst.zero_()
    k.copy_kernel[(3,)](dst, src, src.numel(), buf.tensor, TRACE=False, CHUNKS=3, BLOCK=64)
    dst2 = torch.zeros_like(src)
    k.copy_kernel[(3,)](dst2, src, src.numel(), None, TRACE=False, CHUNKS=3, BLOCK=64)
    assert torch.equal(dst, src) and torch.equal(dst2, src)
    assert np.array_equal(buf.words(), before)

    # a small ring wraps: it keeps the newest events and counts the rest
    small = viz.TraceBuffer(n_rings=1, capacity=8, device="cpu", name="loop")
    out = torch.zeros(1, dtype=torch.int64)
    k.loop_kernel[(1,)](out, 20, small.tensor, TRACE=True)
    d = small.read()
    assert out.tolist() == [20] and d.written.tolist() == [20] and d.lost.tolist() == [12]
    assert d.events["seq"].tolist() == list(range(12, 20))

    # export what this rank recorded, with a host span around a launch
    viz.record_host()
    with viz.span("launch copy"):
        k.copy_kernel[(3,)](dst, src, src.numel(), buf.tensor, TRACE=True, CHUNKS=3, BLOCK=64)
    trace = viz.capture([buf])
    viz.stop_host_recording()
    report = viz.export_to_perfetto(trace, f"{out_dir}/one.json")
    return {
        "spans": report.spans,
        "instants": report.instants,
        "tracks": report.tracks,
        "clock": report.clock,
    }


def test_rings_after_traced_and_untraced_launches(tmp_path: Path) -> None:
    (res,) = run_ranks(
        _rings_after_traced_and_untraced_launches, 1, str(tmp_path), timeout=TIMEOUT, env=INTERPRET
    )
    # 2 rings x 3 launches x (kernel + 3 chunks x (chunk, load, store)) + 1 host span
    assert res["spans"] == 2 * 3 * 10 + 1 and res["instants"] == 2 * 3 and res["tracks"] == 3
    doc = json.loads((tmp_path / "one.json").read_text())
    x = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    host = [e for e in x if e["name"] == "launch copy"]
    last = [e for e in x if e["name"] == "kernel" and e["args"]["launch"] == 2]
    assert len(host) == 1 and len(last) == 2
    # the device spans of the launch lie inside the host span around it (one clock)
    h0, h1 = host[0]["ts"], host[0]["ts"] + host[0]["dur"]
    assert all(h0 <= e["ts"] and e["ts"] + e["dur"] <= h1 for e in last)


def test_untraced_kernel_compiles_to_the_uninstrumented_kernel() -> None:
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    k = _kernels()
    sig = {"dst_ptr": "*i32", "src_ptr": "*i32", "n": "i32"}

    def ttir(fn: Any, signature: dict[str, str], constexprs: dict[str, Any]) -> str:
        sig_all = {**signature, **{c: "constexpr" for c in constexprs}}
        src = ASTSource(fn=fn, signature=sig_all, constexprs=constexprs)
        text = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ttir"]
        body = [ln for ln in text.splitlines() if not ln.startswith("#loc") and "tt.func" not in ln]
        return "\n".join(re.sub(r" loc\([^)]*\)", "", ln) for ln in body)

    consts = {"CHUNKS": 3, "BLOCK": 64}
    plain = ttir(k.plain_copy_kernel, sig, consts)
    off = ttir(k.copy_kernel, {**sig, "trace_ptr": "*i64"}, {**consts, "TRACE": False})
    on = ttir(k.copy_kernel, {**sig, "trace_ptr": "*i64"}, {**consts, "TRACE": True})
    assert off == plain
    assert (
        on != plain and on.count("tt.store") == plain.count("tt.store") + 2 * 18 + 2
    )  # 18 events, then the close
    assert "globaltimer" in on and "globaltimer" not in off


# -- clock pairs ----------------------------------------------------------------------------------


def _clock_pairs_on_the_interpreter(rank: int, n: int) -> None:
    import numpy as np
    import torch

    from mori.viz import clock
    from mori.viz.device import clock_ping_kernel

    cpu = torch.device("cpu")
    same = clock.measure_pair(cpu)
    assert same.method == "same-clock" and same.ticks == same.host_ns and same.error_ns == 0
    launch = clock.measure_pair(cpu, method="launch", samples=3)
    # the interpreter's clock is the host's: the true offset is 0, which the bracket must contain
    assert launch.method == "launch" and abs(launch.ticks - launch.host_ns) <= launch.error_ns
    with pytest.raises(ValueError, match="method"):
        clock.measure_pair(cpu, method="guess")

    # the ping protocol, with the kernel in another thread (on a GPU it runs beside the host)
    flag, out = torch.zeros(1, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    t = threading.Thread(target=lambda: clock_ping_kernel[(1,)](flag, out, 4))
    t.start()
    pair = clock.ping_rounds(flag.numpy(), out.numpy(), 4, timeout_s=30.0)
    t.join(30)
    assert not t.is_alive() and pair is not None and pair.method == "ping"
    assert abs(pair.ticks - pair.host_ns) <= pair.error_ns
    assert (np.diff(out.numpy()) > 0).all()
    # no kernel answering: the round times out, and the flag releases a kernel that would wait
    flag.zero_()
    out.zero_()
    assert clock.ping_rounds(flag.numpy(), out.numpy(), 3, timeout_s=0.05) is None
    assert flag.item() == 3


def test_clock_pairs_on_the_interpreter() -> None:
    run_ranks(_clock_pairs_on_the_interpreter, 1, timeout=TIMEOUT, env=INTERPRET)


# -- two ranks: ordering facts ----------------------------------------------------------------------

ROUNDS = 3


def _pingpong(rank: int, n: int, out_dir: str) -> str:
    import torch

    import mori.shmem as sh
    from mori import viz
    from mori.shmem import device as shd

    k = _kernels()
    block = 16
    buf = sh.shmem_tensor_view(sh.shmem_malloc(block * 8), block, torch.int64)
    sig = sh.shmem_tensor_view(sh.shmem_malloc(2 * 8), 2, torch.int64)
    buf.fill_(rank)
    sig.zero_()
    tb = viz.TraceBuffer(n_rings=1, capacity=256)  # cpu and this PE's rank, from mori.shmem
    assert tb.device.type == "cpu" and tb.rank == rank
    viz.record_host()
    tb.calibrate(barrier=sh.shmem_barrier_all)
    with viz.span("pingpong"):
        k.pingpong_kernel[(1,)](
            buf, sig, shd.shmem_device_context(), ROUNDS, tb.tensor, TRACE=True, BLOCK=block
        )
    sh.shmem_barrier_all()
    if rank == 1:
        assert buf.tolist() == [0] * block, "PE 0's payload arrived"
    return str(viz.capture([tb], world_size=n).save(Path(out_dir) / f"rank{rank}"))


def _instants(tl: Any, name: str) -> dict[int, list[int]]:
    """Timeline ns of instant ``name`` per rank, in order."""
    out: dict[int, list[int]] = {}
    for i in sorted(tl.instants, key=lambda i: i.ts_ns):
        if tl.slot_label(i.slot)[0] == name:
            out.setdefault(tl.tracks[i.track].rank, []).append(i.ts_ns)
    return out


def _ordering_violations(sent: dict[int, list[float]], received: dict[int, list[float]]) -> list[str]:
    """Round r: PE 1 receives after PE 0 sent, and PE 0 receives after PE 1 answered."""
    bad = []
    for r in range(ROUNDS):
        if not sent[0][r] < received[1][r]:
            bad.append(f"round {r}: PE 1 received at {received[1][r]} before PE 0 sent at {sent[0][r]}")
        if not sent[1][r] < received[0][r]:
            bad.append(f"round {r}: PE 0 received at {received[0][r]} before PE 1 sent at {sent[1][r]}")
    return bad


def test_receiver_events_follow_sender_events_across_ranks(tmp_path: Path) -> None:
    import dataclasses

    from mori import viz
    from mori.viz.clock import ClockPair
    from mori.viz.timeline import build_timeline

    shmem_ranks(_pingpong, 2, str(tmp_path), heap="4M", timeout=TIMEOUT, env=INTERPRET)
    traces = viz.load_traces(tmp_path)
    assert [t.rank for t in traces] == [0, 1] and all(t.world_size == 2 for t in traces)
    tl = build_timeline(traces)
    sent, received = _instants(tl, "sent"), _instants(tl, "received")
    assert (
        {r: len(v) for r, v in sent.items()}
        == {0: ROUNDS, 1: ROUNDS}
        == {r: len(v) for r, v in received.items()}
    )
    assert _ordering_violations(sent, received) == []
    # each rank's kernel spans lie inside its host span around the launch
    for rank in (0, 1):
        host = [
            s for s in tl.spans if tl.tracks[s.track].rank == rank and tl.slot_label(s.slot)[0] == "pingpong"
        ]
        dev = [s for s in tl.spans if tl.tracks[s.track].rank == rank and tl.tracks[s.track].kind == "device"]
        assert len(host) == 1 and len(dev) == 2 * ROUNDS  # a round span and a wait span per round
        assert all(host[0].start_ns <= s.start_ns and s.end_ns <= host[0].end_ns for s in dev)

    # the same facts in the exported files
    viz.export_to_perfetto(traces, tmp_path / "pp.json")
    doc = json.loads((tmp_path / "pp.json").read_text())
    js: dict[str, dict[int, list[float]]] = {"sent": {}, "received": {}}
    for e in sorted((e for e in doc["traceEvents"] if e["ph"] == "i"), key=lambda e: e["ts"]):
        js[e["name"]].setdefault(e["pid"], []).append(e["ts"])
    assert _ordering_violations(js["sent"], js["received"]) == []

    # the check can fail: rank 1's clock pairs 2x the longest sent->received gap off
    gap = max(max(b - a for a, b in zip(sent[p], received[1 - p], strict=True)) for p in (0, 1))
    skew = 2 * gap + 1_000_000
    r1 = traces[1]
    src = r1.sources[0]
    bad_src = dataclasses.replace(
        src, clock_pairs=[ClockPair(p.host_ns - skew, p.ticks, 0, p.method) for p in src.clock_pairs]
    )
    skewed = build_timeline([traces[0], dataclasses.replace(r1, sources=[bad_src, *r1.sources[1:]])])
    assert _ordering_violations(_instants(skewed, "sent"), _instants(skewed, "received"))


_PRECOMPILED_IS_LAUNCHED = """
import os, torch, triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

class TargetOnly:  # names a target, so that warmup compiles for it on this CPU
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_active_torch_device(self): return torch.device("cpu")

driver.set_active(TargetOnly())
from mori.core.kernels import aot_variants
from mori.jit import kernels_in, precompile
from mori.viz import device as vd

@aot_variants(vd.traced_variants([{"signature": {"x_ptr": "*i32"}, "constexprs": {}, "aligned": ("x_ptr",)}]))
@triton.jit
def toy(x_ptr, trace_ptr=None, TRACE: tl.constexpr = False):
    tr = vd.open_trace(trace_ptr, TRACE)
    tl.store(x_ptr, 1)
    tr = vd.instant(tr, 1)
    vd.close_trace(tr)

cache = os.environ["TRITON_CACHE_DIR"]
def compiled():
    return sum(any(f.endswith(".ttir") for f in os.listdir(os.path.join(cache, d))) for d in os.listdir(cache))

import sys
report = precompile(kernels=kernels_in(sys.modules[__name__]), targets=["cuda:90"], progress=None)
assert report.count("compiled") == 2, report.summary()
toy.warmup(torch.int32, grid=(1,))  # tracing off: trace_ptr left at None
toy.warmup(torch.int32, torch.int64, TRACE=True, grid=(1,))  # on: a TraceBuffer's aligned tensor
print(compiled())
"""


def test_traced_variants_are_what_launches_look_up(tmp_path: Path) -> None:
    # An untraced variant that declared trace_ptr a pointer compiled code no launch (which leaves
    # it None) ever found: precompiled EP kernels were compiled again at their first launch.
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "MORI_"))}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    script = tmp_path / "toy.py"
    script.write_text(_PRECOMPILED_IS_LAUNCHED)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "2", "a launch compiled a variant precompile had made"
