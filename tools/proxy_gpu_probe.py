"""GPU probe of the SHMEM proxy: each operation on a PE of another (emulated) node in its own step, then a
put+signal ping-pong. Two PEs share GPU 0, MORI_DISABLE_P2P=1 so every peer goes through the proxy over
ucx; start MPS first (DEVELOPERS.md). Usage: python tools/proxy_gpu_probe.py put,get,sigset,rtt"""

import importlib.util
import sys
import threading
import time
from pathlib import Path

STEPS = sys.argv[1].split(",") if len(sys.argv) > 1 else ["put", "get", "sigset", "sigadd", "amo"]


def log(rank, msg):
    print(f"[rank {rank} {time.monotonic():.3f}] {msg}", file=sys.stderr, flush=True)


def watch(rank, sig, every=3.0):
    """Every few seconds: the proxy's ring (head, completed, error) and the signal words, read on a
    side stream (the default stream may be busy with a kernel that waits), so a hang says where."""
    import torch

    from mori.shmem.context import current

    proxy = current("probe").network.proxy
    side = torch.cuda.Stream()

    def loop():
        while True:
            time.sleep(every)
            with torch.cuda.stream(side):
                words = sig.to("cpu").tolist()
            log(
                rank,
                f"watch: head={proxy.head} completed={proxy.completed} error={proxy.error_code} sig={words}",
            )

    threading.Thread(target=loop, daemon=True).start()


def body(rank, nranks):
    import torch

    import mori.shmem as sh
    from mori.shmem import device as shd
    from mori.shmem.loading import KernelLoader

    spec = importlib.util.spec_from_file_location(
        "_pk", str(Path(__file__).resolve().parents[1] / "packages/mori-core/tests/_proxy_kernels.py")
    )
    tk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tk)
    ctx = shd.shmem_device_context()
    log(rank, f"ctx={ctx.cpu().tolist()}")
    peer = 1 - rank
    n = 4096
    dst = sh.mori_shmem_create_tensor((n,), torch.int32)
    src = sh.mori_shmem_create_tensor((n,), torch.int32)
    back = sh.mori_shmem_create_tensor((n,), torch.int32)
    sig = sh.mori_shmem_create_tensor((nranks,), torch.int64)
    out = torch.zeros(8, dtype=torch.int64, device=dst.device)
    dst.zero_()
    sig.zero_()
    back.zero_()
    src.copy_(torch.arange(n, dtype=torch.int32, device=src.device) + 1000 * rank)
    torch.cuda.synchronize()
    sh.shmem_barrier_all()
    watch(rank, sig)
    for step in STEPS:
        log(rank, f"step {step}: start")
        t0 = time.perf_counter()
        if step == "put":
            tk.raw_put_kernel[(1,)](dst, src, n, peer, ctx, BLOCK=256)
            tk.quiet_kernel[(1,)](ctx)
            torch.cuda.synchronize()
            sh.shmem_barrier_all()
            ok = torch.equal(dst.cpu(), torch.arange(n, dtype=torch.int32) + 1000 * peer)
        elif step == "get":
            tk.put_quiet_get_kernel[(1,)](dst, src, back, out, n, peer, ctx, BLOCK=1024)
            torch.cuda.synchronize()
            sh.shmem_barrier_all()
            ok = torch.equal(back.cpu(), torch.arange(n, dtype=torch.int32) + 1000 * rank)
        elif step in ("sigset",):
            tk.put_signal_kernel[(1,)](dst, src, sig[rank:], n, 5 + rank, peer, ctx, BLOCK=1024)
            seen = torch.zeros(1, dtype=torch.int64, device=dst.device)
            tk.wait_kernel[(1,)](sig[peer:], 5 + peer, seen)
            torch.cuda.synchronize()
            sh.shmem_barrier_all()
            ok = int(seen) == 5 + peer
        elif step == "sigadd":
            w = sh.mori_shmem_create_tensor((1,), torch.int64)
            w.zero_()
            torch.cuda.synchronize()
            sh.shmem_barrier_all()
            tk.many_adds_kernel[(1,)](w, 10, peer, ctx)
            tk.quiet_kernel[(1,)](ctx)
            torch.cuda.synchronize()
            sh.shmem_barrier_all()
            ok = int(w) == 55
        elif step == "amo":
            words = sh.mori_shmem_create_tensor((4,), torch.int64)
            word32 = sh.mori_shmem_create_tensor((2,), torch.int32)
            words.zero_()
            word32.zero_()
            torch.cuda.synchronize()
            sh.shmem_barrier_all()
            tk.atomics_kernel[(1,)](words, word32, out, rank, 0, ctx)
            torch.cuda.synchronize()
            sh.shmem_barrier_all()
            ok = rank != 0 or (int(words[0]) == 2001 and int(words[1]) == 2)
        elif step == "rtt":
            # put+signal ping-pong, 1 KiB: rank 0 sends, rank 1 answers
            iters = 200
            sig.zero_()
            torch.cuda.synchronize()
            sh.shmem_barrier_all()
            seen = torch.zeros(1, dtype=torch.int64, device=dst.device)
            # through the loader: a new specialisation of `i` (1, multiples of 16) loads while the
            # previous wait runs otherwise, and that never returns (mori.shmem.loading)
            loader = KernelLoader()
            for i in range(1, 20 + iters + 1):
                if i == 21:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                put = (tk.put_signal_kernel, (1,), (dst, src, sig[rank:], 256, i, peer, ctx), {"BLOCK": 256})
                wait = (tk.wait_kernel, (1,), (sig[peer:], i, seen), {})
                loader.launch([put, wait] if rank == 0 else [wait, put])
            torch.cuda.synchronize()
            log(
                rank,
                f"rtt: {(time.perf_counter() - t0) / iters * 1e6:.1f} us per round trip (1 KiB put+signal, {iters} iters, incl. launches)",
            )
            ok = True
        log(rank, f"step {step}: ok={ok} {time.perf_counter() - t0:.3f}s")
    sh.shmem_barrier_all()


if __name__ == "__main__":
    from mori.testing import shmem_ranks

    shmem_ranks(
        body,
        2,
        heap="64M",
        timeout=150.0,
        env={
            "TRITON_INTERPRET": "0",
            "CUDA_MODULE_LOADING": "EAGER",
            "MORI_DEVICE_RUNTIME": "cuda",
            "MORI_DISABLE_P2P": "1",
            "MORI_SHMEM_TRANSPORT": "ucx",
            "MORI_BOOTSTRAP_TIMEOUT": "60",
        },
    )
    print("PROBE DONE", flush=True)
