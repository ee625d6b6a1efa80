"""GPU probe of the inter-node EP kernels: 2 emulated nodes x 1 rank sharing GPU 0 (start MPS first,
DEVELOPERS.md), the far legs through the SHMEM proxy over ucx. Each kernel launch is followed by a
synchronize and a log line; a watchdog prints, every few seconds, the proxy's ring (head, completed,
error) and the op's control and signal words, read on a side stream, so a hang says where it is.

    python tools/internode_gpu_probe.py [InterNodeV1|InterNode] [rounds] [sync|async|test|test-wait]
"""

import importlib.util
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KT_NAME = sys.argv[1] if len(sys.argv) > 1 else "InterNodeV1"
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 2
# sync: each kernel launch synchronised and logged; async: the op's own launches (its KernelLoader)
# test: the GPU test's rounds (bit-exact checks) on the op's own launches
MODE = sys.argv[3] if len(sys.argv) > 3 else "sync"
SYNC = MODE == "sync"


def log(rank, msg):
    print(f"[rank {rank} {time.monotonic():.3f}] {msg}", file=sys.stderr, flush=True)


class _Logged:
    """A Triton kernel whose launches synchronize and log (the probe's step boundaries)."""

    def __init__(self, fn, name, rank):
        self.fn, self.name, self.rank = fn, name, rank

    def __getitem__(self, grid):
        import torch

        def launch(*args, **kw):
            log(self.rank, f"launch {self.name}")
            t0 = time.perf_counter()
            self.fn[grid](*args, **kw)
            torch.cuda.synchronize()
            log(self.rank, f"done {self.name} in {time.perf_counter() - t0:.3f}s")

        return launch


def _node(rank, world):
    os.environ["MORI_NODE_ID"] = f"node{rank}"  # one emulated node per rank


def body(rank, world):
    import torch

    spec = importlib.util.spec_from_file_location(
        "td", str(ROOT / "packages/mori-ep/tests/test_dispatch_combine.py")
    )
    td = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(td)
    from mori.ep import EpDispatchCombineKernelType as KT
    from mori.ep import EpDispatchCombineOp
    from mori.ep import internode_kernels as ik
    from mori.shmem.context import current

    if SYNC:  # (the wrappers have no warmup: the op's KernelLoader only launches them)
        for name in ("xd_send_kernel", "xd_fan_kernel", "xc_stage_kernel", "xc_reduce_kernel"):
            setattr(ik, name, _Logged(getattr(ik, name), name, rank))
    kt = getattr(KT, KT_NAME)
    op = EpDispatchCombineOp(td._config(rank, world, kernel_type=kt, gpu_per_node=1), impl="triton")
    assert op._ikern is not None
    net = current("probe").network
    side = torch.cuda.Stream()
    stop = threading.Event()

    def watch():
        while not stop.wait(5.0):
            p = net.proxy
            with torch.cuda.stream(side):
                xc = op._ikern.xctrl[:16].to("cpu", non_blocking=False).tolist()
                sig = op._ikern.inter.sig.view(-1)[:8].to("cpu", non_blocking=False).tolist()
            log(
                rank,
                f"watch: proxy head={p.head} completed={p.completed} error={p.error_code} "
                f"{p.error_message!r}; xctrl[:16]={xc}; sig[:8]={[hex(v) for v in sig]}",
            )

    threading.Thread(target=watch, daemon=True).start()
    log(rank, f"op built: {KT_NAME}, transport {net.tp.name}, rma_signals ring flag set")
    # test: the GPU test's own rounds (test_internode_kernels._on_gpu), stacks dumped while stuck;
    # test-wait: the same, with dispatch and combine waiting for their kernels before they return
    if MODE == "test-wait":

        def waiting(f):
            def call(*a, **k):
                f(*a, **k)
                torch.cuda.current_stream().synchronize()

            return call

        op._ikern.dispatch = waiting(op._ikern.dispatch)
        op._ikern.combine = waiting(op._ikern.combine)
    if MODE.startswith("test"):
        import faulthandler

        sys.path.insert(0, str(ROOT / "packages/mori-ep/tests"))
        import test_internode_kernels as ti

        faulthandler.dump_traceback_later(30, repeat=True)
        try:
            for seed, (pattern, dtype) in enumerate(
                [("random", torch.bfloat16), ("round_robin", torch.float32)] * 2
            ):
                log(rank, f"test round {seed}: {pattern} {dtype}")
                total = ti._round(op, None, seed, pattern, dtype)
                log(
                    rank,
                    f"test round {seed}: {total} rows, errors {op._ikern.dispatch_error('d')} {op._ikern.combine_error('c')}",
                )
        finally:
            faulthandler.cancel_dump_traceback_later()
            stop.set()
        return "ok"
    try:
        for i in range(ROUNDS):
            inputs = [td._inputs(i, s, world, "random", torch.bfloat16, td.K) for s in range(world)]
            me = td._dev(op, inputs[rank])
            t0 = time.perf_counter()
            out = op.dispatch(me["x"], me["w"], me["s"], me["idx"])
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            total = int(out[4].cpu()[0])
            log(rank, f"round {i}: dispatch {1e3 * (t1 - t0):.2f} ms, {total} rows received")
            comb = op.combine(out[0][:total], out[1][:total], me["idx"])
            torch.cuda.synchronize()
            log(
                rank,
                f"round {i}: combine {1e3 * (time.perf_counter() - t1):.2f} ms, shape {tuple(comb[0].shape)}",
            )
            err = op._ikern.dispatch_error("dispatch") or op._ikern.combine_error("combine")
            log(rank, f"round {i}: kernel error words: {err}")
    finally:
        stop.set()
    return "ok"


if __name__ == "__main__":
    from mori.testing import shmem_ranks

    print(
        shmem_ranks(
            body,
            2,
            heap="256M",
            timeout=120.0,
            before_init=_node,
            env={
                "TRITON_INTERPRET": "0",
                "CUDA_MODULE_LOADING": "EAGER",
                "MORI_DEVICE_RUNTIME": "cuda",
                "MORI_SHMEM_TRANSPORT": "ucx",
                "MORI_BOOTSTRAP_TIMEOUT": "60",
            },
        ),
        flush=True,
    )
    print("PROBE DONE", flush=True)
