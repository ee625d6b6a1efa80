"""Host-side cost of the XGMI backend, measured on the fake CUDA driver (no GPU needed).

    python3 packages/mori-io/tests/xgmi_host_overhead.py [--iters 10000] [--vendor nvlink]
        [--stub-driver] [--xgmi-module OLD_XGMI.PY]

Two engines of this process, each on its own fake "process" runtime, one IOEngineSession between
them, as ``mori bench io --device cuda`` posts. The fake driver copies synchronously and its events
are complete at once, so what is timed is Python and (fake) driver-call work only:

* ``post``: the session call, until it returns the status;
* ``complete``: from then until ``Wait()`` returns (the completion hand-off);
* ``pipelined``: ``iters`` posts back to back, then every ``Wait()``, per transfer.

Rows: one 4 KiB block (one async copy), and a batch of 128 strided 16 KiB blocks (one kernel
launch). The kernel launch itself is replaced by a stub that does nothing, so Triton's own launch
cost (a GPU matter) is not in these figures; the driver calls around it are. Absolute numbers are
this machine's Python; compare before/after on one machine (``--xgmi-module`` loads another
version of ``mori/io/xgmi.py``, e.g. ``git show HEAD~3:packages/mori-io/src/mori/io/xgmi.py``).

``--stub-driver``: the hot driver calls (records, waits, copies, queries) do nothing at all, so
the figures are the backend's own Python; without it each call costs what the fake library's
Python costs (more than a real ctypes call). ``calls`` is the number of driver calls per
transfer, which is what a real driver charges for.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _load_xgmi(path: str) -> None:
    """Make ``path`` the module mori.io.xgmi (before anything imports it)."""
    spec = importlib.util.spec_from_file_location("mori.io.xgmi", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["mori.io.xgmi"] = mod
    spec.loader.exec_module(mod)


if "--xgmi-module" in sys.argv[:-1]:
    _load_xgmi(sys.argv[sys.argv.index("--xgmi-module") + 1])

import test_xgmi as tx  # noqa: E402  (the fake vendors and helpers of the XGMI tests)

from mori.io import (  # noqa: E402
    BackendType,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    XgmiBackendConfig,
    xgmi,
)

MiB = 1 << 20


class StubKernelXgmi(xgmi.XgmiBackend):
    """The real backend, but a kernel launch does nothing (no GPU, no interpreter)."""

    def _launch_kernel(self, stream: int, table: Any, n: int, split: int, word: int) -> None:
        return None


def _us(xs: list[float]) -> str:
    xs = sorted(xs)
    return (
        f"median {statistics.median(xs) * 1e6:7.2f}  mean {statistics.fmean(xs) * 1e6:7.2f}  "
        f"p99 {xs[int(len(xs) * 0.99) - 1] * 1e6:7.2f}"
    )


def measure(post: Any, iters: int) -> tuple[list[float], list[float], float]:
    clock = time.perf_counter
    posts, completes = [], []
    for _ in range(max(10, iters // 20)):  # warm-up
        post().Wait()
    gc.collect()
    for _ in range(iters):
        t0 = clock()
        st = post()
        t1 = clock()
        st.Wait()
        t2 = clock()
        posts.append(t1 - t0)
        completes.append(t2 - t1)
        if not st.Succeeded():
            raise RuntimeError(f"transfer failed: {st.Code()} {st.Message()}")
    n = min(iters, 2000)
    t0 = clock()
    handles = [post() for _ in range(n)]
    for h in handles:
        h.Wait()
    piped = (clock() - t0) / n
    return posts, completes, piped


def stub_driver(drv: Any, ctx: int) -> None:
    """Make the calls of the transfer path free (no fake-library work)."""
    ids = iter(range(1 << 40, 1 << 41))
    for name in ("event_record", "stream_wait_event", "memcpy_async", "event_synchronize", "restore_context"):
        setattr(drv, name, lambda *a, **k: None)
    drv.event_query = lambda ev: True
    drv.current_context = lambda: ctx
    drv.event_create = lambda: next(ids)


def run(vendor_name: str, iters: int, stub: bool) -> None:
    v = tx.make_vendor(vendor_name)
    if v is None:
        raise SystemExit(f"{vendor_name}: plugin not found")
    node = tx.Node(v)
    runtimes = iter([node.runtime(1000, device=0), node.runtime(1001, device=1)])
    xgmi.find_gpu_runtime = lambda: next(runtimes)  # type: ignore[assignment]
    xgmi.XgmiBackend = StubKernelXgmi  # type: ignore[misc]
    with (
        IOEngine("ea", IOEngineConfig("127.0.0.1", 0)) as ea,
        IOEngine("eb", IOEngineConfig("127.0.0.1", 0)) as eb,
    ):
        ea.create_backend(BackendType.XGMI, XgmiBackendConfig())
        eb.create_backend(BackendType.XGMI)
        ba, bb = ea._backends[BackendType.XGMI], eb._backends[BackendType.XGMI]
        pa, pb = tx.gpu_alloc(ba.runtime, 8 * MiB), tx.gpu_alloc(bb.runtime, 8 * MiB)
        da = ea.register_memory(pa, 8 * MiB, 0, MemoryLocationType.GPU)
        db = eb.register_memory(pb, 8 * MiB, 1, MemoryLocationType.GPU)
        ea.register_remote_engine(eb.get_engine_desc())
        eb.register_remote_engine(ea.get_engine_desc())
        sess = ea.create_session(da, MemoryDesc.unpack(db.pack()))
        assert sess is not None
        sess.write(0, 0, 64, 0).Wait()  # maps the remote region, binds the device
        if stub:
            st = ba._dev
            stub_driver(st.drv, st.ctx)
        lib = ba.runtime.lib
        uid = ea.allocate_transfer_uid
        offs = [i * 32768 for i in range(128)]
        sizes = [16384] * 128
        cases = {
            "write 1 x 4 KiB": lambda: sess.write(0, 0, 4096, uid()),
            "read 1 x 4 KiB": lambda: sess.read(0, 0, 4096, uid()),
            "write 128 x 16 KiB (kernel)": lambda: sess.batch_write(offs, offs, sizes, uid()),
            "read 128 x 16 KiB (kernel)": lambda: sess.batch_read(offs, offs, sizes, uid()),
        }
        print(f"XGMI host overhead, fake {vendor_name} driver, {iters} transfers per row (us)")
        for name, post in cases.items():
            n = iters if "128" not in name else max(1, iters // 5)
            before = len(lib.calls)
            post().Wait()
            calls = len(lib.calls) - before
            posts, completes, piped = measure(post, n)
            print(f"{name:30s} post     {_us(posts)}   calls {calls if not stub else '-'}")
            print(f"{'':30s} complete {_us(completes)}")
            print(f"{'':30s} pipelined {piped * 1e6:7.2f} per transfer")
        print("counters:", ba.counters)
    node.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=10000)
    ap.add_argument("--vendor", default="nvlink", choices=sorted(tx._VENDORS))
    ap.add_argument(
        "--stub-driver", action="store_true", help="driver calls of the transfer path cost nothing"
    )
    ap.add_argument(
        "--xgmi-module",
        default=None,
        help="another mori/io/xgmi.py to measure (read before the other arguments)",
    )
    args = ap.parse_args()
    run(args.vendor, args.iters, args.stub_driver)


if __name__ == "__main__":
    main()
