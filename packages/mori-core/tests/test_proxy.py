"""The proxy: the SHMEM device API (Triton kernels, under the interpreter on CPU) on PEs that loads
and stores cannot reach, at 2 emulated nodes x 2 ranks over every network transport installed;
the proxy's checks (bad PE, address outside the heap, unregistered memory) and a full ring.

Kernels live in ``_proxy_kernels.py`` (loaded by path after the launcher set TRITON_INTERPRET=1).
The tests marked ``cuda`` run the same kernels compiled on one GPU, two PEs over the proxy, and a
launch loop through :class:`mori.shmem.loading.KernelLoader`; the last test runs the kernels of
the two-node GPU benchmark (:mod:`mori.shmem.bench_proxy`) under the interpreter.
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("triton", reason="the device API needs Triton (pip install mori-core[triton])")

from mori.testing import load_module_file, shmem_ranks
from mori.testing.gpu_shmem import cuda_memory_transport

TIMEOUT = 150.0  # a device wait has no timeout: a broken proxy would hang the ranks
BASE_ENV = {"TRITON_INTERPRET": "1", "MORI_BOOTSTRAP_TIMEOUT": "60"}
#: the cuda tests: compiled kernels, two PEs on one GPU, every peer through the proxy over ucx
GPU_ENV = {
    "TRITON_INTERPRET": "0",
    "CUDA_MODULE_LOADING": "EAGER",
    "MORI_DEVICE_RUNTIME": "cuda",
    "MORI_DISABLE_P2P": "1",
    "MORI_SHMEM_TRANSPORT": "ucx",
}


def _kernels() -> ModuleType:
    return load_module_file("mori_test_proxy_kernels", Path(__file__).with_name("_proxy_kernels.py"))


def _two_nodes(rank: int, nranks: int) -> None:
    os.environ["MORI_NODE_ID"] = f"node{rank // 2}"


def _node_per_rank(rank: int, nranks: int) -> None:
    os.environ["MORI_NODE_ID"] = f"node{rank}"


def _network_transports() -> list[str]:
    from mori.core.transport import find_network_transport

    out = ["tcp"]
    try:  # mori-backend-ucx, when installed and usable here
        find_network_transport("ucx")
        out.append("ucx")
    except Exception:
        pass
    return out


def _run(fn: Any, nranks: int, *args: Any, env: dict[str, str], before_init: Any = _two_nodes) -> list[Any]:
    return shmem_ranks(
        fn, nranks, *args, heap="8M", timeout=TIMEOUT, env={**BASE_ENV, **env}, before_init=before_init
    )


def _far(rank: int, nranks: int) -> int:
    """The PE of the other node with the same index (rank 0 <-> 2, 1 <-> 3)."""
    return (rank + 2) % nranks


# -- the device API across nodes ----------------------------------------------------------------------


def _device_api(rank: int, nranks: int) -> dict[str, Any]:
    import torch

    import mori.shmem as sh
    from mori.shmem import device as shd
    from mori.shmem.context import current

    tk = _kernels()
    ctx = shd.shmem_device_context()
    net = current("test").network
    assert net is not None
    far = _far(rank, nranks)
    near = rank ^ 1
    assert ctx.tolist()[-1] == net.ring.device_addr != 0, "the context's last word is the ring"

    # shmem_ptr_p2p: 0 for a PE of the other node, on the host and on the device
    n = 3000  # int32 elements: several proxy pieces (MORI_SHMEM_PROXY_PIECE=4096)
    buf = sh.shmem_malloc(4 * n)
    assert sh.shmem_ptr_p2p(buf, rank, far) == 0 and sh.shmem_ptr_p2p(buf, rank, near) != 0
    dst = sh.shmem_tensor_view(buf, (n,), torch.int32)
    dst.zero_()
    addrs = torch.zeros(nranks, dtype=torch.int64)
    tk.ptr_p2p_kernel[(1,)](dst, addrs, ctx)
    assert [a != 0 for a in addrs.tolist()] == [p // 2 == rank // 2 for p in range(nranks)], addrs
    assert addrs[near] == sh.shmem_ptr_p2p(buf, rank, near)

    # put (split into pieces), quiet, get back: the bytes, and the ring's counters after quiet
    src = sh.shmem_tensor_view(sh.shmem_malloc(4 * n), (n,), torch.int32)
    src.copy_(torch.arange(n, dtype=torch.int32) * 7 + rank)
    back = torch.zeros(n, dtype=torch.int32)
    sh.shmem_buffer_register(back.data_ptr(), back.numel() * 4)
    counters = torch.zeros(2, dtype=torch.int64)
    sh.shmem_barrier_all()
    tk.put_quiet_get_kernel[(1,)](dst, src, back, counters, n, far, ctx, BLOCK=1024)
    issued, completed = counters.tolist()
    assert issued >= 1 and completed >= issued, counters  # quiet returned only once all were done
    assert torch.equal(back, src), "get after quiet reads what the put wrote"
    sh.shmem_barrier_all()
    assert torch.equal(dst, torch.arange(n, dtype=torch.int32) * 7 + far), "the far PE's put arrived"

    # put with signal; the target waits on its own signal word in a kernel
    sig = sh.shmem_tensor_view(sh.shmem_malloc(8 * nranks), (nranks,), torch.int64)
    sig.zero_()
    dst.zero_()
    sh.shmem_barrier_all()
    src.copy_(torch.arange(n, dtype=torch.int32) - rank * 1000)
    tk.put_signal_kernel[(1,)](dst, src, sig[rank:], n, 100 + rank, far, ctx, BLOCK=1024)
    seen = torch.zeros(1, dtype=torch.int64)
    tk.wait_kernel[(1,)](sig[far:], 100 + far, seen)
    assert int(seen) == 100 + far
    assert torch.equal(dst, torch.arange(n, dtype=torch.int32) - far * 1000), "data before the signal"
    sh.shmem_barrier_all()

    # atomics on PE 0's words from every PE (two of them are on the other node)
    words = sh.shmem_tensor_view(sh.shmem_malloc(8 * 4), (4,), torch.int64)
    word32 = sh.shmem_tensor_view(sh.shmem_malloc(8), (2,), torch.int32)
    words.zero_()
    word32.zero_()
    sh.shmem_barrier_all()
    out = torch.full((8,), -1, dtype=torch.int64)
    tk.atomics_kernel[(1,)](words, word32, out, rank, 0, ctx)
    sh.shmem_barrier_all()
    if rank == 0:
        assert words[0] == sum(1000 + r for r in range(nranks)), words
        assert words[1] == nranks and words[2] == -7 and words[3] == 42, words
        assert word32[0] == -3 and word32[1] == 0, word32
    result = {"fetch_add": int(out[0])}
    if rank == nranks - 1:  # PE 3, on the other node than PE 0
        assert out[1:6].tolist() == [0, 5, 0, 42, -3], out
        assert int(out[6]) >= 1000 + rank
    sh.shmem_barrier_all()

    # device barrier across nodes, three rounds
    box = sh.shmem_tensor_view(sh.shmem_malloc(8 * nranks), (nranks,), torch.int64)
    box.fill_(-1)
    sh.shmem_barrier_all()
    rounds = 3
    seen_all = torch.zeros(rounds, nranks, dtype=torch.int64)
    tk.barrier_kernel[(1,)](box, seen_all, ctx, ROUNDS=rounds)
    want = torch.tensor([[r * 100 + p for p in range(nranks)] for r in range(rounds)], dtype=torch.int64)
    assert torch.equal(seen_all, want), seen_all
    sh.shmem_barrier_all()
    sh.shmem_buffer_deregister(back.data_ptr(), back.numel() * 4)
    result["transport"] = net.tp.name
    return result


@pytest.mark.parametrize("transport", _network_transports())
def test_device_api_across_two_nodes(transport: str) -> None:
    got = _run(_device_api, 4, env={"MORI_SHMEM_TRANSPORT": transport, "MORI_SHMEM_PROXY_PIECE": "4096"})
    assert all(r["transport"] == transport for r in got)
    # the fetch-adds on PE 0's word saw each earlier value once: 0, 1, 2, 3 in some order
    assert sorted(r["fetch_add"] for r in got) == [0, 1, 2, 3]


def _all_through_proxy(rank: int, nranks: int) -> None:
    import torch

    import mori.shmem as sh
    from mori.shmem import device as shd

    tk = _kernels()
    ctx = shd.shmem_device_context()
    buf = sh.shmem_malloc(64)
    addrs = torch.full((nranks,), -1, dtype=torch.int64)
    tk.ptr_p2p_kernel[(1,)](sh.shmem_tensor_view(buf, (16,), torch.int32), addrs, ctx)
    # MORI_DISABLE_P2P: no peer is load/store reachable, on the host or the device, not even on this node
    assert [sh.shmem_ptr_p2p(buf, rank, p) != 0 for p in range(nranks)] == [p == rank for p in range(nranks)]
    assert [a != 0 for a in addrs.tolist()] == [p == rank for p in range(nranks)], addrs
    words = sh.shmem_tensor_view(sh.shmem_malloc(32), (4,), torch.int64)
    words.zero_()
    word32 = sh.shmem_tensor_view(sh.shmem_malloc(8), (2,), torch.int32)
    out = torch.zeros(8, dtype=torch.int64)
    sh.shmem_barrier_all()
    tk.atomics_kernel[(1,)](words, word32, out, rank, 0, ctx)
    sh.shmem_barrier_all()
    if rank == 0:
        assert words[0] == sum(1000 + r for r in range(nranks)) and words[1] == nranks, words


def test_disable_p2p_sends_every_peer_through_the_proxy() -> None:
    _run(_all_through_proxy, 2, env={"MORI_DISABLE_P2P": "1"}, before_init=None)


# -- the proxy's checks: a bad request is refused, never executed -------------------------------------


def _bad_requests(rank: int, nranks: int, case: str) -> str:
    import torch

    import mori.shmem as sh
    from mori.core.errors import MoriBackendError
    from mori.shmem import device as shd

    tk = _kernels()
    ctx = shd.shmem_device_context()
    heap = sh.shmem_heap_info()
    dst = sh.shmem_tensor_view(sh.shmem_malloc(4096), (1024,), torch.int32)
    src = sh.shmem_tensor_view(sh.shmem_malloc(4096), (1024,), torch.int32)
    done = sh.shmem_malloc(8)
    sh.shmem_tensor_view(done, (1,), torch.int64).zero_()
    dst.fill_(11)
    src.fill_(22)
    sh.shmem_barrier_all()
    message = ""
    if rank == 0:
        peer = 1
        local = torch.zeros(1024, dtype=torch.int32)  # not symmetric, not registered
        # the heap's last 64 bytes: a 4 KiB put from there would run past the end
        tail = sh.shmem_tensor_view(heap["base"] + heap["size"] - 64, (16,), torch.int32)
        if case == "pe":
            tk.raw_put_kernel[(1,)](dst, src, 1024, nranks + 97, ctx, BLOCK=256)
        elif case == "negative_pe":
            tk.raw_put_kernel[(1,)](dst, src, 1024, -1, ctx, BLOCK=256)
        elif case == "outside_heap":
            tk.raw_put_kernel[(1,)](local, src, 1024, peer, ctx, BLOCK=256)
        elif case == "past_heap_end":
            tk.raw_put_kernel[(1,)](tail, src, 1024, peer, ctx, BLOCK=256)
        elif case == "unregistered_source":
            tk.raw_put_kernel[(1,)](dst, local, 1024, peer, ctx, BLOCK=256)
        tk.raw_put_kernel[(1,)](dst, src, 1024, peer, ctx, BLOCK=256)  # a good put after: never runs
        try:
            sh.shmem_quiet()
        except MoriBackendError as e:
            message = str(e)
        with pytest.raises(MoriBackendError, match="refused"):  # the failure stays
            sh.shmem_fence()
        sh.shmem_atomic_set(done, 1, peer)  # host atomics do not go through the proxy
    else:
        sh.shmem_wait_until(done, sh.SHMEM_CMP_EQ, 1)
        # nothing arrived: the refused put never ran, nor the good one queued after it
        assert bool((dst == 11).all()), dst
    return message


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("pe", r"PE 99 is not in \[0, 2\)"),
        ("negative_pe", r"PE -1 is not in \[0, 2\)"),
        ("outside_heap", r"destination \[0x[0-9a-f]+, \+4096\) is outside the symmetric heap"),
        ("past_heap_end", r"destination \[0x[0-9a-f]+, \+4096\) is outside the symmetric heap"),
        ("unregistered_source", r"source .* is neither in the symmetric heap nor in a buffer registered"),
    ],
)
def test_proxy_refuses_bad_requests(case: str, words: str) -> None:
    got = _run(_bad_requests, 2, case, env={"MORI_SHMEM_TRANSPORT": "tcp"}, before_init=_node_per_rank)
    assert re.search(
        r"shmem_quiet: proxy of PE 0: request #\d+ \(put to PE -?\d+\) refused: " + words, got[0]
    ), got[0]


# -- bounds: a full ring makes producers wait; a stopped proxy turns into an error -------------------


def _ring_words(net: Any, first: int, count: int) -> list[int]:
    import ctypes

    return list((ctypes.c_int64 * count).from_address(net.ring.host_addr + first))


def _full_ring(rank: int, nranks: int) -> int:
    import torch

    import mori.shmem as sh
    from mori.shmem import device as shd
    from mori.shmem import layout
    from mori.shmem.context import current

    tk = _kernels()
    ctx = shd.shmem_device_context()
    word = sh.shmem_tensor_view(sh.shmem_malloc(8), (1,), torch.int64)
    word.zero_()
    sh.shmem_barrier_all()
    if rank == 0:
        net = current("test").network
        assert net is not None
        net.proxy.set_paused(True)  # the proxy takes nothing: the 4-slot ring fills up
        kernel = threading.Thread(target=lambda: tk.many_adds_kernel[(1,)](word, 10, 1, ctx))
        kernel.start()
        deadline = time.monotonic() + 60
        while net.proxy.head < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        # tickets 0-3 fill the slots, ticket 4 is reserved and waits: nothing more, nothing overwritten
        assert net.proxy.head == 5 and net.proxy.completed == 0 and kernel.is_alive()
        slot = layout.RING_SLOTS
        seqs = [_ring_words(net, slot + i * layout.RING_SLOT_BYTES, 1)[0] for i in range(4)]
        values = [
            _ring_words(net, slot + i * layout.RING_SLOT_BYTES + 8 * layout.W_VALUE, 1)[0] for i in range(4)
        ]
        assert seqs == [1, 2, 3, 4] and values == [1, 2, 3, 4], (seqs, values)
        net.proxy.set_paused(False)
        kernel.join(60)
        assert not kernel.is_alive()
        sh.shmem_quiet()
        assert net.proxy.completed == 10
    sh.shmem_barrier_all()
    return int(word[0])


def test_a_full_ring_makes_the_device_wait() -> None:
    got = _run(_full_ring, 2, env={"MORI_SHMEM_PROXY_SLOTS": "4"}, before_init=_node_per_rank)
    assert got[1] == sum(range(1, 11)), got  # all ten adds arrived, once each


def _host_gives_up(rank: int, nranks: int) -> str:
    import mori.shmem as sh
    from mori.core.errors import MoriBackendError, MoriTimeoutError
    from mori.shmem import layout
    from mori.shmem.context import current

    word = sh.shmem_malloc(8)
    sh.shmem_barrier_all()
    message = ""
    if rank == 0:
        net = current("test").network
        assert net is not None
        net.proxy.set_paused(True)
        for _ in range(4):  # fills the ring
            net.proxy.submit(layout.OP_AMO, 1, dst=word, amo=2, word=2, value=1, timeout_s=5)
        start = time.monotonic()
        with pytest.raises(MoriTimeoutError, match=r"the ring stayed full for 0\.5"):
            net.proxy.submit(layout.OP_AMO, 1, dst=word, amo=2, word=2, value=1, timeout_s=0.5)
        assert 0.4 < time.monotonic() - start < 5
        with pytest.raises(MoriBackendError, match=r"request #4, atomic to PE 1 gave up") as e:
            sh.shmem_quiet()
        message = str(e.value)
    return message


def test_a_producer_that_gives_up_on_a_full_ring_fails_loudly() -> None:
    got = _run(_host_gives_up, 2, env={"MORI_SHMEM_PROXY_SLOTS": "4"}, before_init=_node_per_rank)
    assert got[0].startswith("shmem_quiet: proxy of PE 0"), got[0]


def _stopped_proxy(rank: int, nranks: int) -> None:
    import torch

    import mori.shmem as sh
    from mori.core.errors import MoriBackendError
    from mori.shmem import device as shd
    from mori.shmem.context import current

    tk = _kernels()
    ctx = shd.shmem_device_context()
    word = sh.shmem_tensor_view(sh.shmem_malloc(8), (1,), torch.int64)
    word.zero_()
    sh.shmem_barrier_all()
    if rank == 0:
        net = current("test").network
        assert net is not None
        net.proxy.stop()
        assert not net.proxy.running
        # the kernel queues three adds and quiets: with no proxy it must return, not hang
        tk.many_adds_kernel[(1,)](word, 3, 1, ctx)
        tk.quiet_kernel[(1,)](ctx)
        with pytest.raises(MoriBackendError, match="proxy of PE 0: not running"):
            sh.shmem_quiet()
        sh.shmem_atomic_set(word.data_ptr(), 7, 1)  # tell PE 1 (host atomics: no proxy)
    else:
        sh.shmem_wait_until(word.data_ptr(), sh.SHMEM_CMP_EQ, 7)
        assert int(word[0]) == 7  # none of the three adds ran


def test_a_stopped_proxy_does_not_hang_the_device() -> None:
    _run(_stopped_proxy, 2, env={}, before_init=_node_per_rank)


def test_ring_layout_matches_the_native_proxy() -> None:
    from mori.core import _core
    from mori.shmem import layout

    for name, value in _core.PROXY_LAYOUT.items():
        ours = name if name.startswith(("W_", "OP_", "FLAG_")) else f"RING_{name}"
        assert getattr(layout, ours) == value, name
    assert _core.Proxy.ring_size(4) == layout.RING_SLOTS + 4 * layout.RING_SLOT_BYTES


# -- on one GPU: two PEs that share it, every peer through the proxy ---------------------------------


def _gpu_through_proxy(rank: int, nranks: int) -> None:
    # ucx moves the GPU heaps (cuda_ipc here), but its atomics run on the target's CPU, which
    # cannot touch GPU memory: the proxy carries signals, sets and fetches by puts and gets, and
    # refuses other atomics (a read-modify-write on device memory) by name
    import torch

    import mori.shmem as sh
    from mori.core.errors import MoriBackendError
    from mori.shmem import device as shd

    tk = _kernels()
    ctx = shd.shmem_device_context()
    peer = 1 - rank
    n = 4096
    dst = sh.mori_shmem_create_tensor((n,), torch.int32)
    src = sh.mori_shmem_create_tensor((n,), torch.int32)
    sig = sh.mori_shmem_create_tensor((nranks,), torch.int64)
    dst.zero_()
    sig.zero_()
    src.copy_(torch.arange(n, dtype=torch.int32, device=src.device) + 1000 * rank)
    torch.cuda.synchronize()
    sh.shmem_barrier_all()
    tk.put_signal_kernel[(1,)](dst, src, sig[rank:], n, 5 + rank, peer, ctx, BLOCK=1024)
    seen = torch.zeros(1, dtype=torch.int64, device=dst.device)
    tk.wait_kernel[(1,)](sig[peer:], 5 + peer, seen)
    torch.cuda.synchronize()
    assert int(seen) == 5 + peer, "the peer's signal (SIGNAL_SET) arrived"
    assert torch.equal(dst.cpu(), torch.arange(n, dtype=torch.int32) + 1000 * peer), "before it, its data"
    words = sh.mori_shmem_create_tensor((1,), torch.int64)
    word32 = sh.mori_shmem_create_tensor((1,), torch.int32)
    back = sh.mori_shmem_create_tensor((2,), torch.int64)
    words.zero_()
    word32.zero_()
    torch.cuda.synchronize()
    sh.shmem_barrier_all()
    tk.set_fetch_kernel[(1,)](words, word32, back, 70 + rank, peer, ctx)
    torch.cuda.synchronize()
    assert back.cpu().tolist() == [70 + rank, -70 - rank], "sets, then fetches, on the peer's GPU words"
    sh.shmem_barrier_all()
    assert int(words) == 70 + peer and int(word32) == -70 - peer, "the peer's sets landed here"
    sh.shmem_barrier_all()
    if rank == 1:  # an add on PE 0's GPU word: refused, never executed (it crashed PE 0 before)
        tk.many_adds_kernel[(1,)](words, 3, 0, ctx)
        torch.cuda.synchronize()
        with pytest.raises(
            MoriBackendError, match=r"add on PE 0's device memory: the ucx transport has no atomics"
        ):
            sh.shmem_quiet()


@pytest.mark.cuda  # NVIDIA only: the proxy moves device memory through ucx's CUDA memory support
@pytest.mark.skipif(
    cuda_memory_transport() is None, reason="needs an NVIDIA GPU and a transport that moves CUDA memory (ucx)"
)
def test_device_api_through_the_proxy_on_one_gpu() -> None:
    shmem_ranks(
        _gpu_through_proxy,
        2,
        heap="64M",
        timeout=TIMEOUT,
        env=GPU_ENV,
    )


def _gpu_pingpong_through_the_loader(rank: int, nranks: int) -> list[int]:
    # One launch per step, the signal value as a kernel argument: values 1, 2 and 16 are three
    # Triton specialisations, each loaded at its first use. Loaded while the previous step's wait
    # runs, the load never returns (measured on an H200); the loader loads them first.
    import torch

    import mori.shmem as sh
    from mori.shmem import device as shd
    from mori.shmem.loading import KernelLoader

    tk = _kernels()
    ctx = shd.shmem_device_context()
    peer = 1 - rank
    dst = sh.mori_shmem_create_tensor((256,), torch.int32)
    src = sh.mori_shmem_create_tensor((256,), torch.int32)
    sig = sh.mori_shmem_create_tensor((2,), torch.int64)
    seen = torch.zeros(1, dtype=torch.int64, device=dst.device)
    src.fill_(rank + 1)
    sig.zero_()
    torch.cuda.synchronize()
    sh.shmem_barrier_all()
    loader = KernelLoader()
    for i in range(1, 41):
        put = (tk.put_signal_kernel, (1,), (dst, src, sig[rank:], 256, i, peer, ctx), {"BLOCK": 256})
        wait = (tk.wait_kernel, (1,), (sig[peer:], i, seen), {})
        loader.launch([put, wait] if rank == 0 else [wait, put])
    torch.cuda.synchronize()
    sh.shmem_barrier_all()
    assert bool((dst == peer + 1).all()), "the last put did not land"
    # Triton 3.6 specialises an int argument as 1, a multiple of 16, or neither: 3 per kernel
    assert loader.loaded == 6, f"{loader.loaded} compiled kernels loaded, expected 3 per kernel"
    return sig.cpu().tolist()


@pytest.mark.cuda  # NVIDIA only: the proxy moves device memory through ucx's CUDA memory support
@pytest.mark.skipif(
    cuda_memory_transport() is None, reason="needs an NVIDIA GPU and a transport that moves CUDA memory (ucx)"
)
def test_kernel_loader_keeps_a_launch_loop_through_the_proxy_going_on_one_gpu() -> None:
    got = shmem_ranks(
        _gpu_pingpong_through_the_loader,
        2,
        heap="64M",
        timeout=TIMEOUT,
        env=GPU_ENV,
    )
    assert got == [[0, 40], [40, 0]]  # each PE's word of the peer holds the last step


# -- the native proxy alone, in one process: two tcp instances over loopback -------------------------


def test_proxy_alone_host_requests_replies_and_a_transport_failure() -> None:
    import torch

    from mori.core import _core
    from mori.core.errors import MoriBackendError
    from mori.core.transport import OP_ADD, WORD_INT64, find_network_transport, open_transport
    from mori.shmem import layout

    tcp = find_network_transport("tcp")
    mine, theirs = open_transport(tcp.ops(), tcp.options()), open_transport(tcp.ops(), tcp.options())
    heap = torch.zeros(1 << 16, dtype=torch.uint8)
    peer_heap = torch.zeros(4096, dtype=torch.uint8)  # the peer registered less than this PE's heap
    heap_mem = mine.register(heap.data_ptr(), heap.numel())
    peer_mem = theirs.register(peer_heap.data_ptr(), peer_heap.numel())
    ep = mine.connect(theirs.address())
    nslots = 4
    ring = torch.zeros(_core.Proxy.ring_size(nslots) + 64, dtype=torch.uint8)
    ring_addr = (ring.data_ptr() + 63) // 64 * 64
    base = heap.data_ptr()
    proxy = _core.Proxy(
        mine, 0, 2, base, heap.numel(), heap_mem, ring_addr, _core.Proxy.ring_size(nslots), nslots, 64, 10.0
    )
    proxy.add_peer(1, ep, ep.unpack_rkey(peer_mem.rkey), peer_heap.data_ptr())
    proxy.start()
    try:
        heap[:200] = torch.arange(200, dtype=torch.uint8)
        proxy.submit(layout.OP_PUT, 1, dst=base, src=base, nbytes=200)  # 4 pieces of 64 bytes
        proxy.quiet(10)
        assert torch.equal(peer_heap[:200], heap[:200]) and int(peer_heap[200]) == 0
        olds = [
            proxy.submit(layout.OP_AMO, 1, dst=base + 1024, amo=OP_ADD, word=WORD_INT64, value=5, reply=True)[
                1
            ]
            for _ in range(6)
        ]
        assert olds == [0, 5, 10, 15, 20, 25]  # more replies than slots: each slot freed after its reply
        assert proxy.completed == proxy.head == 7  # one ticket per request, not per piece
        # inside this PE's heap (the proxy's check passes), outside the peer's registration: the
        # transport fails the request, and the failure names the request and its PE
        proxy.submit(layout.OP_PUT, 1, dst=base + 8192, src=base, nbytes=64)
        with pytest.raises(
            MoriBackendError,
            match=r"proxy of PE 0: request #7 \(put to PE 1\): tcp put failed: remote range .* is outside the peer.s registered memory",
        ):
            proxy.quiet(10)
        assert proxy.error_code == layout.RING_ERR_TRANSPORT
        with pytest.raises(MoriBackendError, match="request #7"):  # it stays, and nothing more runs
            proxy.submit(layout.OP_PUT, 1, dst=base, src=base, nbytes=8)
    finally:
        proxy.stop()
    assert not proxy.running


def _proxy_pair(nslots: int, rma_signals: bool) -> tuple[Any, Any, Any, int, tuple[Any, ...]]:
    """A started proxy of PE 0 over tcp on loopback (its heap and PE 1's are CPU tensors of 64 KiB),
    both heaps, the heap's base, and the objects the proxy uses (keep them alive with it)."""
    import torch

    from mori.core import _core
    from mori.core.transport import find_network_transport, open_transport

    tcp = find_network_transport("tcp")
    mine, theirs = open_transport(tcp.ops(), tcp.options()), open_transport(tcp.ops(), tcp.options())
    heap, peer_heap = torch.zeros(1 << 16, dtype=torch.uint8), torch.zeros(1 << 16, dtype=torch.uint8)
    heap_mem, peer_mem = (
        mine.register(heap.data_ptr(), heap.numel()),
        theirs.register(peer_heap.data_ptr(), 1 << 16),
    )
    ep = mine.connect(theirs.address())
    ring = torch.zeros(_core.Proxy.ring_size(nslots) + 64, dtype=torch.uint8)
    ring_addr = (ring.data_ptr() + 63) // 64 * 64
    proxy = _core.Proxy(
        mine,
        0,
        2,
        heap.data_ptr(),
        heap.numel(),
        heap_mem,
        ring_addr,
        _core.Proxy.ring_size(nslots),
        nslots,
        64,
        10.0,
        rma_signals=rma_signals,
    )
    proxy.add_peer(1, ep, ep.unpack_rkey(peer_mem.rkey), peer_heap.data_ptr())
    proxy.start()
    return proxy, heap, peer_heap, heap.data_ptr(), (mine, theirs, heap_mem, peer_mem, ep, ring)


def test_proxy_rma_signals_carries_sets_fetches_and_signals_by_puts_and_gets() -> None:
    """rma_signals (a GPU heap on a transport without atomics on device memory, as ucx without
    RDMA): signals and sets are puts of the slot's value word, fetches gets into its result word;
    every slot stays taken until its request is complete, so more requests than slots still work."""
    import torch

    from mori.core.transport import OP_FETCH, OP_SET, WORD_INT32, WORD_INT64
    from mori.shmem import layout

    proxy, heap, peer_heap, base, _keep = _proxy_pair(4, True)
    try:
        heap[:100] = torch.arange(100, dtype=torch.uint8) + 1
        proxy.submit(
            layout.OP_PUT_SIGNAL,
            1,
            dst=base,
            src=base,
            nbytes=100,
            amo=OP_SET,
            word=WORD_INT64,
            value=9,
            sig_addr=base + 2048,
        )
        proxy.quiet(10)
        assert torch.equal(peer_heap[:100], heap[:100]), "the data of put-with-signal"
        assert int(peer_heap[2048:2056].view(torch.int64)) == 9, "the signal, as a put of its value word"
        for i in range(10):  # more sets than slots: each slot is freed once its put is complete
            proxy.submit(
                layout.OP_AMO, 1, dst=base + 3000, amo=OP_SET, word=WORD_INT32, value=(-3 - i) & 0xFFFFFFFF
            )
        proxy.quiet(10)
        assert int(peer_heap[3000:3004].view(torch.int32)) == -12, "the last of ten 32-bit sets"
        assert int(peer_heap[3004]) == 0 and int(peer_heap[2999]) == 0, "a 32-bit set writes 4 bytes"
        fetched = [
            proxy.submit(layout.OP_AMO, 1, dst=base + 2048, amo=OP_FETCH, word=WORD_INT64, reply=True)[1]
            for _ in range(6)
        ]
        assert fetched == [9] * 6, "fetches are gets into the slot's result word (more replies than slots)"
        old32 = proxy.submit(layout.OP_AMO, 1, dst=base + 3000, amo=OP_FETCH, word=WORD_INT32, reply=True)[1]
        assert old32 == -12 & 0xFFFFFFFFFFFFFFFF, (
            "a 32-bit fetch is sign-extended, as the transport's atomics"
        )
    finally:
        proxy.stop()


@pytest.mark.parametrize("request_kind", ["add", "swap", "signal-add"])
def test_proxy_rma_signals_refuses_read_modify_writes_by_name(request_kind: str) -> None:
    """Without atomics on device memory an add, swap, ... cannot be carried: refused (never
    executed, never emulated by a racy get and put), naming the operation, PE and why."""
    import torch

    from mori.core.errors import MoriBackendError
    from mori.core.transport import OP_ADD, OP_SWAP, WORD_INT64
    from mori.shmem import layout

    proxy, _, peer_heap, base, _keep = _proxy_pair(4, True)
    try:
        if request_kind == "signal-add":
            proxy.submit(
                layout.OP_PUT_SIGNAL,
                1,
                dst=base,
                src=base,
                nbytes=8,
                amo=OP_ADD,
                word=WORD_INT64,
                value=1,
                sig_addr=base + 2048,
            )
            name = "signal add"
        else:
            amo = OP_ADD if request_kind == "add" else OP_SWAP
            proxy.submit(layout.OP_AMO, 1, dst=base + 2048, amo=amo, word=WORD_INT64, value=5)
            name = request_kind
        with pytest.raises(
            MoriBackendError, match=rf"{name} on PE 1's device memory: the tcp transport has no atomics"
        ):
            proxy.quiet(10)
        assert proxy.error_code == layout.RING_ERR_REFUSED
        assert int(peer_heap[2048:2056].view(torch.int64)) == 0, "nothing was executed"
    finally:
        proxy.stop()


def test_proxy_without_rma_signals_still_uses_the_transports_atomics() -> None:
    """The default (CPU heaps, or a transport with device atomics): an add is the transport's atomic."""
    import torch

    from mori.core.transport import OP_ADD, WORD_INT64
    from mori.shmem import layout

    proxy, _, peer_heap, base, _keep = _proxy_pair(4, False)
    try:
        for _ in range(3):
            proxy.submit(layout.OP_AMO, 1, dst=base + 2048, amo=OP_ADD, word=WORD_INT64, value=5)
        proxy.quiet(10)
        assert int(peer_heap[2048:2056].view(torch.int64)) == 15
    finally:
        proxy.stop()


def _under_rma_signals(rank: int, nranks: int) -> None:
    # what a GPU heap on ucx without RDMA gets, on CPU heaps: device producers stage values in
    # their heap (the proxy's puts and gets start and end there), read-modify-writes are refused
    import torch

    import mori.shmem as sh
    from mori.core.errors import MoriBackendError
    from mori.shmem import device as shd

    tk = _kernels()
    ctx = shd.shmem_device_context()
    far = _far(rank, nranks)
    n = 300
    dst, src = sh.mori_shmem_create_tensor((n,), torch.int32), sh.mori_shmem_create_tensor((n,), torch.int32)
    sig = sh.mori_shmem_create_tensor((nranks,), torch.int64)
    dst.zero_()
    sig.zero_()
    src.copy_(torch.arange(n, dtype=torch.int32) + 1000 * rank)
    sh.shmem_barrier_all()
    tk.put_signal_kernel[(1,)](dst, src, sig[rank:], n, 5 + rank, far, ctx, BLOCK=1024)
    sh.shmem_wait_until(sig[far : far + 1].data_ptr(), sh.SHMEM_CMP_EQ, 5 + far)
    assert torch.equal(dst, torch.arange(n, dtype=torch.int32) + 1000 * far), (
        "the data came before its signal"
    )
    words, word32 = (
        sh.mori_shmem_create_tensor((1,), torch.int64),
        sh.mori_shmem_create_tensor((1,), torch.int32),
    )
    back = sh.mori_shmem_create_tensor((2,), torch.int64)
    words.zero_()
    word32.zero_()
    sh.shmem_barrier_all()
    tk.set_fetch_kernel[(1,)](words, word32, back, 70 + rank, far, ctx)
    assert back.tolist() == [70 + rank, -70 - rank], "sets, then fetches (both staged in this PE's heap)"
    sh.shmem_barrier_all()
    assert int(words) == 70 + far and int(word32) == -70 - far, "the far PE's sets landed here"
    box, seen = (
        sh.mori_shmem_create_tensor((nranks,), torch.int64),
        torch.zeros(3 * nranks, dtype=torch.int64),
    )
    box.zero_()
    sh.shmem_barrier_all()
    tk.barrier_kernel[(1,)](box, seen, ctx, ROUNDS=3)  # the device barrier's arrivals are sets
    assert seen.view(3, nranks).tolist() == [[r * 100 + p for p in range(nranks)] for r in range(3)]
    sh.shmem_barrier_all()
    if rank == 1:  # an add to the other node: refused by name, never executed
        tk.many_adds_kernel[(1,)](words, 3, far, ctx)
        with pytest.raises(
            MoriBackendError, match=r"add on PE 3's device memory: the tcp transport has no atomics"
        ):
            sh.shmem_quiet()


def test_device_api_under_rma_signals_across_two_nodes() -> None:
    """MORI_SHMEM_PROXY_ATOMICS=rma on CPU: the restriction a GPU heap has on ucx without RDMA."""
    _run(_under_rma_signals, 4, env={"MORI_SHMEM_TRANSPORT": "tcp", "MORI_SHMEM_PROXY_ATOMICS": "rma"})


# -- the ready-made kernels (mori.shmem.kernels) across nodes -----------------------------------------


def _library_kernels(rank: int, nranks: int) -> None:
    import torch

    import mori.shmem as sh
    from mori.core.errors import MoriValueError
    from mori.shmem import kernels as K

    far = _far(rank, nranks)
    n = 5000  # int16 after the host's word pick: several programs, several pieces
    dst = sh.mori_shmem_create_tensor((n,), torch.int16)
    src = sh.mori_shmem_create_tensor((n,), torch.int16)
    sig = sh.mori_shmem_create_tensor((nranks,), torch.int64)
    dst.zero_()
    sig.zero_()
    src.copy_(torch.arange(n, dtype=torch.int16) + rank)
    sh.shmem_barrier_all()
    K.put(dst, src, far, block=256, max_programs=4)
    K.barrier()  # the device barrier, across nodes
    assert torch.equal(dst, torch.arange(n, dtype=torch.int16) + far), "put, then the device barrier"
    back = sh.mori_shmem_create_tensor((n,), torch.int16)
    K.get(back, dst, far, block=256, max_programs=4)
    assert torch.equal(back, src), "get reads what this PE put there"
    sh.shmem_barrier_all()  # every get is done before anyone clears dst
    dst.zero_()
    sh.shmem_barrier_all()
    K.put_signal(dst, src, sig[rank : rank + 1], 77, sh.SIGNAL_ADD, far, block=256, max_programs=4)
    sh.shmem_wait_until(sig[far : far + 1].data_ptr(), sh.SHMEM_CMP_EQ, 77)
    assert torch.equal(dst, torch.arange(n, dtype=torch.int16) + far), "the signal came after the data"
    with pytest.raises(
        MoriValueError, match=r"src=.* neither symmetric heap memory nor inside a buffer registered"
    ):
        K.put(dst, torch.ones(n, dtype=torch.int16), far)  # the proxy could not read it: refused up front
    sh.shmem_barrier_all()


def test_library_kernels_across_two_nodes() -> None:
    _run(_library_kernels, 4, env={"MORI_SHMEM_TRANSPORT": "tcp", "MORI_SHMEM_PROXY_PIECE": "4096"})


# -- the original's device functions (mori.ir.triton) across nodes ------------------------------------


def _ir_ring(rank: int, nranks: int) -> None:
    import torch

    import mori.shmem as sh

    k = _ir_kernels()
    rounds, nbytes = 4, 1000  # the right neighbour of PEs 1 and 3 is on the other node
    for signalled in (1, 0):  # putmem_nbi_signal_block; putmem_nbi_block, fence_thread, atomic add
        rows = sh.mori_shmem_create_tensor((rounds + 1, nbytes), torch.uint8)
        rows.zero_()
        rows[0] = torch.full((nbytes,), rank + 1, dtype=torch.uint8)
        sig = sh.mori_shmem_create_tensor((1,), torch.uint64)
        sig.zero_()
        sh.shmem_barrier_all()
        k.ring_kernel[(1,)](rows, sig, nbytes, ROUNDS=rounds, SIGNALLED=signalled)
        sh.shmem_barrier_all()
        for r in range(rounds + 1):
            assert bool((rows[r] == (rank - r) % nranks + 1).all()), f"row {r} (signalled={signalled})"
        sh.shmem_barrier_all()


def _ir_kernels() -> ModuleType:
    return load_module_file("mori_test_ir_kernels", Path(__file__).with_name("_ir_kernels.py"))


def test_ir_device_functions_across_two_nodes() -> None:
    _run(_ir_ring, 4, env={"MORI_SHMEM_TRANSPORT": "tcp"})


# -- the two-node GPU benchmark's kernels and the kernel loader, under the interpreter ----------------


def _bench_kernels(rank: int, nranks: int) -> tuple[int, int]:
    import torch

    import mori.shmem as shmem
    from mori.shmem import bench_proxy as bp
    from mori.shmem import device as shd
    from mori.shmem.loading import KernelLoader

    ctx = shd.shmem_device_context()
    src = shmem.mori_shmem_create_tensor(4096, torch.uint8)
    dst = shmem.mori_shmem_create_tensor(4096, torch.uint8)
    words = shmem.mori_shmem_create_tensor(8, torch.int64)
    sig = shmem.mori_shmem_create_tensor(1, torch.int64)
    src.fill_(rank + 1)
    dst.zero_()
    words.fill_(10 + rank)
    sig.zero_()
    shmem.shmem_barrier_all()
    loader = KernelLoader()
    if rank == 0:  # 3000 bytes, complete at PE 1 when the kernel ends (its quiet)
        loader.launch([(bp.proxy_put_kernel, (1,), (dst, src, 3000, 1, ctx), {"BLOCK": 1024})])
    shmem.shmem_barrier_all()
    if rank == 1:
        assert bool((dst[:3000] == 1).all()) and not bool(dst[3000:].any()), "the put moved other bytes"
    call = (bp.proxy_pingpong_kernel, (1,), (words[4:], words, sig, ctx, 5, 100), {"INITIATOR": rank == 0})
    loader.launch([call])
    shmem.shmem_barrier_all()
    assert loader.loaded == 0, "the interpreter loads nothing"
    return int(sig[0]), int(words[4])


def test_bench_proxy_kernels_put_and_bounce_through_the_proxy() -> None:
    """The kernels of `mori bench shmem --device cuda --nodes 2`: the put lands exactly, the
    ping-pong ends with the last signal (start + n) and the peer's 8 bytes on both PEs."""
    got = _run(_bench_kernels, 2, env={"MORI_SHMEM_TRANSPORT": "tcp"}, before_init=_node_per_rank)
    assert got == [(105, 11), (105, 10)]
