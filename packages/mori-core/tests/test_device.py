"""The Triton device API (mori.shmem.device) and its kernels (mori.shmem.kernels), run under the
Triton interpreter on CPU tensors in the symmetric heap, across processes.

Each test runs a module-level function on N ranks (mori.testing.shmem_ranks). Triton is imported
only inside those functions, after the launcher has set ``TRITON_INTERPRET=1`` in the rank: the
interpreter is chosen when ``triton.jit`` runs. The test kernels live in ``_device_kernels.py``.
The last test (marked ``gpu``, any vendor) runs the same kernels compiled, on one GPU, with two simulated PEs.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("triton", reason="the device API needs Triton (pip install mori-core[triton])")

from mori.testing import load_module_file, shmem_ranks

INTERPRET = {"TRITON_INTERPRET": "1"}
TIMEOUT = 90.0  # a device wait has no timeout: a broken barrier or signal would hang the ranks
HEAP = "16M"


def _ranks(fn: Any, nranks: int, *args: Any, env: dict[str, str] | None = None) -> list[Any]:
    return shmem_ranks(fn, nranks, *args, heap=HEAP, timeout=TIMEOUT, env=INTERPRET if env is None else env)


def _test_kernels() -> ModuleType:
    """_device_kernels.py, loaded by path (tests are not a package)."""
    return load_module_file("mori_test_device_kernels", Path(__file__).with_name("_device_kernels.py"))


def _int(t: Any) -> int:
    """A one-element tensor as an int; uint64 as its int64 bits (torch cannot convert big uint64)."""
    import torch

    return int(t.reshape(()).view(torch.int64)) if t.dtype == torch.uint64 else int(t.reshape(()))


def _pattern(seed: int, numel: int, dtype: Any) -> Any:
    """Deterministic data that any rank can rebuild: random bytes viewed as dtype."""
    import torch

    g = torch.Generator().manual_seed(seed)
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).view(dtype)


# -- identity, context, pointer translation --------------------------------------------------------


def _identity_and_p2p(rank: int, n: int) -> None:
    import torch

    import mori.shmem as sh
    from mori.shmem import device as shd

    tk = _test_kernels()
    ctx = shd.shmem_device_context()
    assert ctx is shd.shmem_device_context(), "the context tensor is cached"
    buf_addr = sh.shmem_malloc(n * 64 * 4)
    off = buf_addr - sh.shmem_heap_info()["base"]
    # the last word is the proxy's ring: 0, every PE is on this node
    expected = [rank, n] + [sh.shmem_ptr_p2p(buf_addr, rank, p) - off for p in range(n)] + [0]
    assert ctx.dtype == torch.int64 and ctx.tolist() == expected

    out = torch.zeros(2, dtype=torch.int64)
    tk.identity_kernel[(1,)](out, ctx)
    assert out.tolist() == [rank, n]

    # every PE writes 37 values and a marker into its own slot of every PE's copy
    buf = sh.shmem_tensor_view(buf_addr, n * 64, torch.int32)
    buf.fill_(0x5A5A5A5A)
    sh.shmem_barrier_all()
    tk.p2p_store_kernel[(1,)](buf, ctx, 37, BLOCK=64)
    sh.shmem_barrier_all()
    want = torch.full((n * 64,), 0x5A5A5A5A, dtype=torch.int32)
    for q in range(n):
        want[q * 64 : q * 64 + 37] = q * 100000 + torch.arange(37, dtype=torch.int32)
        want[q * 64 + 37] = -1 - q
    assert torch.equal(buf.view(torch.uint8), want.view(torch.uint8)), f"PE {rank}: {buf.view(n, 64)}"
    sh.shmem_free(buf_addr)


@pytest.mark.parametrize("nranks", [2, 4])
def test_identity_context_and_ptr_p2p(nranks: int) -> None:
    _ranks(_identity_and_p2p, nranks)


# -- put / get ----------------------------------------------------------------------------------------

# (dtype name, elements, byte offset into the buffer): odd sizes, none a multiple of BLOCK; an odd
# offset forces the byte path, an even one lets the host pick wider words
_COPY_CASES = [
    ("uint8", 1, 0),
    ("uint8", 7, 1),
    ("uint8", 1001, 3),
    ("int16", 33, 2),
    ("int32", 257, 4),
    ("float32", 100, 8),
    ("int64", 13, 8),
    ("bfloat16", 999, 0),
]
_GUARD = 64  # bytes around each copy that must stay untouched


def _put_get(rank: int, n: int) -> None:
    import torch

    import mori.shmem as sh
    from mori.shmem import kernels as K

    right, left = (rank + 1) % n, (rank - 1) % n
    for case, (name, numel, offset) in enumerate(_COPY_CASES):
        dtype = getattr(torch, name)
        nbytes = numel * dtype.itemsize
        total = nbytes + 2 * _GUARD
        dst_raw = sh.mori_shmem_create_tensor(total, torch.uint8)
        src_sym_raw = sh.mori_shmem_create_tensor(total, torch.uint8)
        dst_raw.fill_(0xAB)
        start = _GUARD + offset - (offset % dtype.itemsize)
        dst = dst_raw[start : start + nbytes].view(dtype)
        src_sym = src_sym_raw[start : start + nbytes].view(dtype)
        src_sym.copy_(_pattern(1000 * rank + case, numel, dtype))
        sh.shmem_barrier_all()

        # put: my pattern into the right neighbour's dst; I receive the left neighbour's
        src = _pattern(1000 * rank + case, numel, dtype)
        K.put(dst, src, right, block=16, max_programs=3)
        sh.shmem_barrier_all()
        got = dst_raw[start : start + nbytes]
        want = _pattern(1000 * left + case, numel, dtype).view(torch.uint8)
        assert torch.equal(got, want), f"put {name}[{numel}] from PE {left}"
        assert bool((dst_raw[:start] == 0xAB).all()) and bool((dst_raw[start + nbytes :] == 0xAB).all()), (
            f"put {name}[{numel}] wrote outside its range"
        )

        # get: the right neighbour's src_sym into a local tensor (with guards)
        local_raw = torch.full((total,), 0xCD, dtype=torch.uint8)
        local = local_raw[start : start + nbytes].view(dtype)
        K.get(local, src_sym, right, block=16, max_programs=4)
        want = _pattern(1000 * right + case, numel, dtype).view(torch.uint8)
        assert torch.equal(local_raw[start : start + nbytes], want), f"get {name}[{numel}] from PE {right}"
        assert bool((local_raw[:start] == 0xCD).all()) and bool((local_raw[start + nbytes :] == 0xCD).all())
        sh.shmem_barrier_all()
        sh.mori_shmem_free_tensor(src_sym_raw)
        sh.mori_shmem_free_tensor(dst_raw)


@pytest.mark.parametrize("nranks", [2, 4])
def test_put_get_odd_sizes(nranks: int) -> None:
    _ranks(_put_get, nranks)


# -- put with signal ----------------------------------------------------------------------------------


def _put_signal(rank: int, n: int) -> None:
    import torch

    import mori.shmem as sh
    from mori.shmem import device as shd
    from mori.shmem import kernels as K

    tk = _test_kernels()
    ctx = shd.shmem_device_context()
    right, left = (rank + 1) % n, (rank - 1) % n

    # 1. host wrapper, several programs, SIGNAL_SET with a new value each round; host wait
    data = sh.mori_shmem_create_tensor(301, torch.int32)
    sig = sh.mori_shmem_create_tensor(1, torch.uint64)
    sig.zero_()
    sh.shmem_barrier_all()
    for rnd in range(3):
        K.put_signal(
            data,
            _pattern(rank * 10 + rnd, 301, torch.int32),
            sig,
            100 + rnd,
            sh.SIGNAL_SET,
            right,
            block=16,
            max_programs=5,
        )
        seen = sh.shmem_wait_until(sig.data_ptr(), sh.SHMEM_CMP_EQ, 100 + rnd, dtype="uint64", timeout=30)
        assert seen == 100 + rnd
        assert torch.equal(data, _pattern(left * 10 + rnd, 301, torch.int32)), f"round {rnd}"
        sh.shmem_barrier_all()  # the next round overwrites data

    # 2. every PE sends its own region to PE 0 with SIGNAL_ADD 1; then a signal-only put of a
    # value beyond the int64 range
    regions = sh.mori_shmem_create_tensor((n, 77), torch.uint8)
    count = sh.mori_shmem_create_tensor(1, torch.uint64)
    count.zero_()
    sh.shmem_barrier_all()
    K.put_signal(regions[rank], _pattern(500 + rank, 77, torch.uint8), count, 1, sh.SIGNAL_ADD, 0, block=16)
    if rank == 0:
        sh.shmem_wait_until(count.data_ptr(), sh.SHMEM_CMP_GE, n, dtype="uint64", timeout=30)
        for q in range(n):
            assert torch.equal(regions[q], _pattern(500 + q, 77, torch.uint8)), f"region of PE {q}"
        assert _int(count) == n
    sh.shmem_barrier_all()
    big = 2**63 + 5
    K.put_signal(regions[rank][:0], regions[rank][:0], count, big, sh.SIGNAL_SET, right)  # signal only
    sh.shmem_wait_until(count.data_ptr(), sh.SHMEM_CMP_EQ, big, dtype="uint64", timeout=30)
    sh.shmem_barrier_all()

    # 3. in kernels: send_kernel (three orderings) to the right, recv_kernel waits on the device
    cases = [
        (torch.uint8, 333, shd.SIGNAL_SET.value, tk.ORDER_PUT_SIGNAL.value, torch.uint64),
        (torch.uint8, 64, shd.SIGNAL_ADD.value, tk.ORDER_QUIET.value, torch.uint64),
        (torch.int64, 45, shd.SIGNAL_ADD.value, tk.ORDER_FENCE.value, torch.int64),
    ]
    for i, (dtype, numel, op, order, sig_dtype) in enumerate(cases):
        inbox = sh.mori_shmem_create_tensor(numel, dtype)
        s = sh.mori_shmem_create_tensor(1, sig_dtype)
        s.zero_()
        sh.shmem_barrier_all()
        src = _pattern(700 + 10 * rank + i, numel, dtype)
        tk.send_kernel[(1,)](inbox, src, s, ctx, numel, 7, right, SIG_OP=op, ORDER=order, BLOCK=64)
        out = torch.zeros(numel, dtype=dtype)
        tk.recv_kernel[(1,)](s, inbox, out, numel, 7, BLOCK=64)
        assert torch.equal(out, _pattern(700 + 10 * left + i, numel, dtype)), f"device case {i}"
        assert _int(s) == 7
        sh.shmem_barrier_all()


@pytest.mark.parametrize("nranks", [2, 4])
def test_put_signal(nranks: int) -> None:
    _ranks(_put_signal, nranks)


# -- atomics --------------------------------------------------------------------------------------------

_CONTENDED = 25  # programs per rank hitting one word


def _atomics(rank: int, n: int) -> dict[str, Any]:
    import torch

    import mori.shmem as sh
    from mori.shmem import device as shd

    tk = _test_kernels()
    ctx = shd.shmem_device_context()
    right, left = (rank + 1) % n, (rank - 1) % n

    def op(word: Any, code: Any, value: int = 0, cond: int = 0, pe: int = right) -> int:
        o = torch.zeros(1, dtype=word.dtype)
        tk.atomic_kernel[(1,)](word, o, ctx, value, cond, pe, OP=code.value)
        return _int(o)

    # 1. every op on the right neighbour's word (one slot per sender); the owner checks afterwards
    for dtype in (torch.int32, torch.int64, torch.uint64):
        words = sh.mori_shmem_create_tensor(n, dtype)
        words.zero_()
        sh.shmem_barrier_all()
        w = words[rank : rank + 1]
        op(w, tk.OP_SET, 5)
        assert op(w, tk.OP_FETCH) == 5
        op(w, tk.OP_ADD, 3)
        assert op(w, tk.OP_FETCH_ADD, 2) == 8
        assert op(w, tk.OP_FETCH) == 10
        assert op(w, tk.OP_SWAP, 42) == 10
        assert op(w, tk.OP_COMPARE_SWAP, value=7, cond=41) == 42, "compare-swap must fail: 42 != 41"
        assert op(w, tk.OP_FETCH) == 42, "a failed compare-swap leaves the word alone"
        assert op(w, tk.OP_COMPARE_SWAP, value=7, cond=42) == 42, "compare-swap must succeed"
        assert op(w, tk.OP_FETCH) == 7
        if dtype == torch.int32:  # wraps, and keeps the sign
            op(w, tk.OP_SET, 2**31 - 1)
            op(w, tk.OP_ADD, 1)
            assert op(w, tk.OP_FETCH) == -(2**31)
            op(w, tk.OP_SET, 7)
        if dtype == torch.uint64:  # the full unsigned range; the kernel takes the i64 bits
            op(w, tk.OP_SET, -1)
            assert op(w, tk.OP_FETCH) == -1
            assert sh.shmem_atomic_fetch(w.data_ptr(), right, dtype="uint64") == 2**64 - 1
            op(w, tk.OP_SET, 7)
        sh.shmem_barrier_all()
        assert _int(words[left]) == 7
        assert all(_int(words[q]) == 0 for q in range(n) if q != left)
        sh.shmem_barrier_all()

    # 2. contention: every rank, _CONTENDED programs each, fetch_add 1 on PE 0's word
    ctr = sh.mori_shmem_create_tensor(1, torch.int64)
    ctr.zero_()
    sh.shmem_barrier_all()
    fetched = torch.zeros(_CONTENDED, dtype=torch.int64)
    tk.atomic_kernel[(_CONTENDED,)](ctr, fetched, ctx, 1, 0, 0, OP=tk.OP_FETCH_ADD.value)
    # 3. compare-swap loops: every program adds 1 to PE 0's int32 word, retrying when it loses
    ctr32 = sh.mori_shmem_create_tensor(1, torch.int32)
    ctr32.zero_()
    flag = sh.mori_shmem_create_tensor(1, torch.int64)
    flag.zero_()
    sh.shmem_barrier_all()
    tk.cas_increment_kernel[(_CONTENDED,)](ctr32, ctx, 0)
    # 4. one compare-swap each on PE 0's flag: exactly one rank wins
    got = op(flag, tk.OP_COMPARE_SWAP, value=rank + 1, cond=0, pe=0)
    sh.shmem_barrier_all()
    totals = (int(ctr), int(ctr32), int(flag)) if rank == 0 else None
    return {"fetched": fetched.tolist(), "cas": got, "totals": totals}


@pytest.mark.parametrize("nranks", [2, 4])
def test_atomics(nranks: int) -> None:
    res = _ranks(_atomics, nranks)
    fetched = sorted(v for r in res for v in r["fetched"])
    assert fetched == list(range(nranks * _CONTENDED)), "every fetch_add saw a distinct previous value"
    ctr, ctr32, flag = res[0]["totals"]
    assert ctr == nranks * _CONTENDED and ctr32 == nranks * _CONTENDED
    winners = [r for r in range(nranks) if res[r]["cas"] == 0]
    assert len(winners) == 1 and flag == winners[0] + 1
    assert all(res[r]["cas"] == flag for r in range(nranks) if r != winners[0])


# -- wait_until -----------------------------------------------------------------------------------------

# (cmp, initial, a value that does not satisfy, a value that does, compare with)
_WAITS = [
    ("EQ", 0, 4, 5, 5),
    ("NE", 0, None, 3, 0),
    ("GT", 0, 4, 5, 4),
    ("GE", 0, 4, 5, 5),
    ("LT", 10, 0, -3, 0),
    ("LE", 10, 6, 5, 5),
]


def _wait_until(rank: int, n: int) -> None:
    import torch

    import mori.shmem as sh

    tk = _test_kernels()
    partner = rank ^ 1  # pairs (0, 1), (2, 3): each rank of a pair waits on its words, then sets
    ready = sh.mori_shmem_create_tensor(1, torch.int64)  # waits the partner has started
    ready.zero_()
    expected = 0  # partner's waits started, as the setter should see them
    for dtype in (torch.int32, torch.int64, torch.uint64):
        words = sh.mori_shmem_create_tensor(len(_WAITS), dtype)
        inits = torch.tensor([w[1] for w in _WAITS]).to(dtype)
        words.copy_(inits)
        sh.shmem_barrier_all()
        name = str(dtype).removeprefix("torch.")
        for waiter in (0, 1):
            for i, (cmp, _, early, final, against) in enumerate(_WAITS):
                if dtype == torch.uint64 and final < 0:
                    early, final, against = 5, 2, 5  # unsigned: LT 5
                if rank % 2 == waiter:
                    out = torch.zeros(1, dtype=dtype)
                    sh.shmem_atomic_add(ready.data_ptr(), 1, partner)
                    tk.wait_kernel[(1,)](words[i : i + 1], out, against, CMP=getattr(sh, f"SHMEM_CMP_{cmp}"))
                    assert _int(out) == final, f"{name} {cmp} {against}: returned {_int(out)}, not {final}"
                else:
                    # once the waiter is about to spin: a value that must not release it, then one
                    # that must
                    expected += 1
                    sh.shmem_wait_until(ready.data_ptr(), sh.SHMEM_CMP_GE, expected, timeout=30)
                    addr = words[i : i + 1].data_ptr()
                    if early is not None:
                        sh.shmem_atomic_set(addr, early, partner, dtype=name)
                    time.sleep(0.05)
                    sh.shmem_atomic_set(addr, final, partner, dtype=name)
            sh.shmem_barrier_all()
            words.copy_(inits)
            sh.shmem_barrier_all()


@pytest.mark.parametrize("nranks", [2, 4])
def test_wait_until_each_comparison(nranks: int) -> None:
    _ranks(_wait_until, nranks)


# -- device barrier -------------------------------------------------------------------------------------

_ROUNDS = 20


def _barrier(rank: int, n: int) -> None:
    import ctypes

    import torch

    import mori.shmem as sh
    from mori.shmem import device as shd
    from mori.shmem import kernels as K
    from mori.shmem import layout

    tk = _test_kernels()
    ctx = shd.shmem_device_context()
    left = (rank - 1) % n
    word = sh.mori_shmem_create_tensor(1, torch.int64)
    word.fill_(-1)
    sh.shmem_barrier_all()

    # 1. in one kernel: ROUNDS x (write to the right neighbour, barrier, read, barrier)
    out = torch.full((_ROUNDS,), -7, dtype=torch.int64)
    tk.barrier_ring_kernel[(1,)](word, out, ctx, ROUNDS=_ROUNDS)
    assert out.tolist() == [r * 1000 + left for r in range(_ROUNDS)], f"PE {rank}: {out.tolist()}"

    # 2. the host wrapper, checked on the host each round
    right_word = sh.symm_mori_shmem_tensor(word, (rank + 1) % n)
    for r in range(_ROUNDS):
        right_word.fill_(10**6 + r * 1000 + rank)
        K.barrier()
        assert int(word) == 10**6 + r * 1000 + left, f"PE {rank} round {r}: {int(word)}"
        K.barrier()

    # every PE passed the same number of device barriers: epoch and every slot agree
    base = sh.shmem_heap_info()["base"]
    epoch = ctypes.c_int64.from_address(base + layout.DEVICE_BARRIER_EPOCH_OFF).value
    slots = list((ctypes.c_int64 * n).from_address(base + layout.DEVICE_BARRIER_OFF))
    assert epoch == 4 * _ROUNDS and slots == [4 * _ROUNDS] * n, (epoch, slots)
    sh.shmem_barrier_all()


@pytest.mark.parametrize("nranks", [2, 4])
def test_device_barrier_repeated(nranks: int) -> None:
    _ranks(_barrier, nranks)


# -- host wrappers: argument checks (no interpreter: the checks come before any launch) ----------------


def _validation(rank: int, n: int) -> None:
    import os

    os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels on the cpu runtime: must refuse
    import torch

    import mori.shmem as sh
    from mori.core.errors import MoriStateError, MoriTypeError, MoriValueError
    from mori.shmem import kernels as K

    sym = sh.mori_shmem_create_tensor(64, torch.int32)
    sig = sh.mori_shmem_create_tensor(1, torch.uint64)
    local = torch.zeros(64, dtype=torch.int32)

    def fails(exc: type[Exception], words: tuple[str, ...], fn: Any, *args: Any, **kw: Any) -> None:
        with pytest.raises(exc) as info:
            fn(*args, **kw)
        assert all(w in str(info.value) for w in words), str(info.value)

    fails(MoriValueError, ("put", "dst="), K.put, local, local, 0)  # dst not symmetric
    fails(MoriValueError, ("get", "src="), K.get, local, local, 0)  # src not symmetric
    fails(MoriTypeError, ("put", "dst"), K.put, [1, 2], local, 0)
    fails(MoriValueError, ("src=", "int64[64]"), K.put, sym, local.to(torch.int64), 0)
    fails(MoriValueError, ("src=",), K.put, sym, local[:10], 0)
    fails(MoriValueError, ("pe=5",), K.put, sym, local, 5)
    fails(MoriValueError, ("pe=True",), K.put, sym, local, True)
    fails(MoriValueError, ("block=24",), K.put, sym, local, 0, block=24)
    fails(MoriValueError, ("max_programs=0",), K.get, local, sym, 0, max_programs=0)
    fails(MoriValueError, ("dst=", "contiguous"), K.put, sym.view(8, 8).t(), local.view(8, 8), 0)
    fails(MoriValueError, ("sig=", "uint64"), K.put_signal, sym, local, sym[:2], 1, sh.SIGNAL_SET, 0)
    fails(
        MoriValueError,
        ("sig=",),
        K.put_signal,
        sym,
        local,
        torch.zeros(1, dtype=torch.int64),
        1,
        sh.SIGNAL_SET,
        0,
    )
    fails(MoriValueError, ("sig_op=3",), K.put_signal, sym, local, sig, 1, 3, 0)
    fails(MoriValueError, ("signal=",), K.put_signal, sym, local, sig, -1, sh.SIGNAL_SET, 0)
    # valid arguments, but Triton was imported without the interpreter on the cpu runtime
    fails(MoriStateError, ("TRITON_INTERPRET=1",), K.put, sym, local, 0)
    fails(MoriStateError, ("TRITON_INTERPRET=1",), K.barrier)


def test_host_wrappers_validate_arguments() -> None:
    _ranks(_validation, 1, env={})


# -- AOT declarations ---------------------------------------------------------------------------------


def test_aot_declarations() -> None:
    from mori.core.errors import MoriValueError
    from mori.core.kernels import aot, aot_specs, aot_variants, device_function, is_device_function

    def kernel() -> None: ...

    k = aot(signature={"x": "*fp32"}, label="a")(aot(signature={"x": "*bf16"}, label="b")(kernel))
    assert [s.label for s in aot_specs(k)] == ["a", "b"], "variants keep the order they are written in"
    k2 = aot_variants([{"signature": {"x": t}, "constexprs": {"B": 4}} for t in ("*i8", "*i16")])(
        lambda: None
    )
    assert [s.signature["x"] for s in aot_specs(k2)] == ["*i8", "*i16"]
    assert aot_specs(k2)[0].describe() == "*i8 B=4"

    class Wrapped:  # what triton.autotune / triton.jit look like: the function under .fn
        fn = device_function(lambda: None)

    assert is_device_function(Wrapped()) and not is_device_function(k) and aot_specs(Wrapped()) == []
    with pytest.raises(MoriValueError, match="signature"):
        aot(signature={"x": 1})  # type: ignore[dict-item]
    with pytest.raises(MoriValueError, match="num_warps=3"):
        aot(signature={}, num_warps=3)


# -- one GPU, two simulated PEs -------------------------------------------------------------------------
# Without a GPU runtime plugin the heaps cannot be shared between processes yet, so this runs the same
# kernels in one process: two heaps on one GPU and a hand-made context per PE, one stream per PE, so
# the two PEs' kernels run at the same time and really wait for each other.


def _one_gpu_two_pes(rank: int, n: int) -> None:
    import torch
    import triton

    from mori.shmem import device as shd
    from mori.shmem import kernels as K
    from mori.shmem import layout

    tk = _test_kernels()
    dev = "cuda"
    heaps = [torch.zeros(16 << 20, dtype=torch.uint8, device=dev) for _ in range(2)]
    ctxs = [
        torch.tensor([p, 2, *(h.data_ptr() for h in heaps)], dtype=torch.int64, device=dev) for p in range(2)
    ]
    streams = [torch.cuda.Stream() for _ in range(2)]

    def sym(pe: int, off: int, numel: int, dtype: Any) -> Any:
        start = layout.USER_OFF + off
        return heaps[pe][start : start + numel * dtype.itemsize].view(dtype)

    def grid(numel: int) -> tuple[int, int]:
        per = triton.cdiv(triton.cdiv(numel, 1024), 64) * 1024
        return triton.cdiv(numel, per), per

    # heap layout (offsets into the user region): signal 0, data 256 (8 MiB), put/get 9 MiB,
    # atomic word 10 MiB, ring word 10 MiB + 4 KiB
    sig = [sym(p, 0, 1, torch.int64) for p in range(2)]
    data = [sym(p, 256, 1 << 20, torch.int64) for p in range(2)]
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    src = torch.randint(-(2**40), 2**40, (1 << 20,), device=dev)
    out = torch.zeros_like(src)
    g, per = grid(src.numel())
    # A kernel first launched while another one spins for it can deadlock: loading its module may
    # wait for the device to be idle (CUDA lazy loading). Launch each one once beforehand, with the
    # argument specialisations (value 1, multiple of 16, i32/i64) of the real launches.
    sig[1].fill_(1 << 40)
    tk.recv_kernel[(1,)](sig[1], data[1], out, 0, 0, BLOCK=1024)
    K.put_signal_kernel[(1,)](
        data[0], src, sig[0], counter, ctxs[0], 0, 1024, 2, 1, SIG_OP=shd.SIGNAL_ADD.value, BLOCK=1024
    )
    torch.cuda.synchronize()

    # put / get of an odd size, through ptr_p2p
    for numel in (1, 1001):
        K.put_kernel[(1,)](
            sym(0, 9 << 20, numel, torch.uint8),
            src.view(torch.uint8)[:numel],
            ctxs[0],
            numel,
            1024,
            1,
            BLOCK=1024,
        )
        back = torch.zeros(numel, dtype=torch.uint8, device=dev)
        K.get_kernel[(1,)](back, sym(0, 9 << 20, numel, torch.uint8), ctxs[0], numel, 1024, 1, BLOCK=1024)
        torch.cuda.synchronize()
        assert torch.equal(back, src.view(torch.uint8)[:numel]) and torch.equal(
            sym(1, 9 << 20, numel, torch.uint8), back
        )

    # put with signal, many programs, against a receiver that is already spinning on PE 1
    for rnd in range(5):
        sig[1].zero_()
        src.add_(1)
        torch.cuda.synchronize()
        with torch.cuda.stream(streams[1]):
            tk.recv_kernel[(1,)](sig[1], data[1], out, src.numel(), 2, BLOCK=1024)
        with torch.cuda.stream(streams[0]):
            K.put_signal_kernel[(g,)](
                data[0],
                src,
                sig[0],
                counter,
                ctxs[0],
                src.numel(),
                per,
                2,
                1,
                SIG_OP=shd.SIGNAL_ADD.value,
                BLOCK=1024,
            )
        torch.cuda.synchronize()
        assert torch.equal(out, src), f"round {rnd}: {int((out != src).sum())} elements were stale"

    # contended fetch_add from both PEs on PE 1's word
    word = [sym(p, 10 << 20, 1, torch.int64) for p in range(2)]
    word[1].zero_()
    fetched = [torch.zeros(5000, dtype=torch.int64, device=dev) for _ in range(2)]
    for p in range(2):
        with torch.cuda.stream(streams[p]):
            tk.atomic_kernel[(5000,)](word[p], fetched[p], ctxs[p], 1, 0, 1, OP=tk.OP_FETCH_ADD.value)
    torch.cuda.synchronize()
    assert torch.equal(torch.sort(torch.cat(fetched)).values, torch.arange(10000, device=dev))

    # the device barrier between two kernels that run at the same time
    ring = [sym(p, (10 << 20) + 4096, 1, torch.int64) for p in range(2)]
    got = [torch.full((_ROUNDS,), -7, dtype=torch.int64, device=dev) for _ in range(2)]
    for p in range(2):
        with torch.cuda.stream(streams[p]):
            tk.barrier_ring_kernel[(1,)](ring[p], got[p], ctxs[p], ROUNDS=_ROUNDS)
    torch.cuda.synchronize()
    for p in range(2):
        assert got[p].tolist() == [r * 1000 + 1 - p for r in range(_ROUNDS)], f"PE {p}: {got[p].tolist()}"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu  # any vendor: Triton kernels on torch tensors (CUDA_MODULE_LOADING is ignored on ROCm)
@pytest.mark.skipif(not _cuda_available(), reason="needs a GPU (torch.cuda.is_available() is False)")
def test_device_api_on_one_gpu() -> None:
    from mori.testing import run_ranks

    run_ranks(
        _one_gpu_two_pes, 1, timeout=TIMEOUT, env={"TRITON_INTERPRET": "0", "CUDA_MODULE_LOADING": "EAGER"}
    )
