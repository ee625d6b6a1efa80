"""mori.ir and mori.ir.triton: kernels written for the original's IR, run under the Triton
interpreter on 4 CPU ranks, and the rules of the context those kernels reach without an argument.

The kernels (``_ir_kernels.py``) use only ``mori.ir.triton`` calls. Each multi-rank test runs one
module-level function on the ranks (mori.testing.shmem_ranks), which imports Triton after the
launcher has set ``TRITON_INTERPRET=1``. The last test (marked ``cuda``) runs the same kernels
compiled, with the ranks sharing one GPU.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

# Not importorskip: the rank functions below are pickled by reference, so every rank imports this
# module before the launcher sets TRITON_INTERPRET=1, and Triton imported then would make its own
# library functions (tl.zeros, ...) compiled ones for good.
if importlib.util.find_spec("triton") is None:
    pytest.skip("mori.ir.triton needs Triton (pip install mori-core[triton])", allow_module_level=True)

from mori.testing import load_module_file, shmem_ranks

INTERPRET = {"TRITON_INTERPRET": "1"}
TIMEOUT = 90.0  # a device wait has no timeout: a broken signal would hang the ranks
NRANKS = 4


def _ranks(fn: Any, *args: Any, nranks: int = NRANKS, env: dict[str, str] | None = None) -> list[Any]:
    return shmem_ranks(fn, nranks, *args, heap="16M", timeout=TIMEOUT, env=INTERPRET if env is None else env)


def _kernels() -> ModuleType:
    """_ir_kernels.py, loaded by path (tests are not a package)."""
    return load_module_file("mori_test_ir_kernels", Path(__file__).with_name("_ir_kernels.py"))


def _pattern(seed: int, nbytes: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).to(_device())


def _device() -> Any:
    """Where this rank's heap is (the CPU, or its GPU): a test's local tensors live there too."""
    from mori.shmem import device as shd

    return shd.shmem_device_context().device


def _bits(t: Any) -> int:
    """A one-element tensor as the int of its bits (uint64 through int64, which torch converts)."""
    import torch

    if t.dtype == torch.uint64:
        return int(t.reshape(()).view(torch.int64)) % 2**64
    return int(t.reshape(()))


# -- metadata and set-up calls (no ranks) ---------------------------------------------------------------


def test_device_functions_match_the_table() -> None:
    """Every entry of MORI_DEVICE_FUNCTIONS is a jitted function of mori.ir.triton taking exactly its
    arguments, and the table has the original's conventions."""
    import inspect

    from triton.runtime.jit import JITFunction

    import mori.ir as ir
    import mori.ir.triton as mt

    table = ir.MORI_DEVICE_FUNCTIONS
    assert len(table) == 89
    for name, meta in table.items():
        fn = getattr(mt, name)
        assert isinstance(fn, JITFunction), name
        assert len(inspect.signature(fn.fn).parameters) == len(meta["args"]), name  # type: ignore[arg-type]
        assert meta["symbol"] == f"mori_shmem_{name}"
        assert meta["ret"] in {"int32", "uint32", "int64", "uint64"}
    assert sorted(set(mt.__all__) - set(table)) == [
        "SIGNAL_ADD",
        "SIGNAL_SET",
        "get_extern_libs",
        "install_hook",
    ]
    # a few of the original's signatures, as facts
    assert table["ptr_p2p"] == {
        "symbol": "mori_shmem_ptr_p2p",
        "args": ["uint64", "int32", "int32"],
        "ret": "uint64",
    }
    assert table["n_pes"].get("pure") is True and "pure" not in table["my_pe"]
    assert table["putmem_nbi_signal_block"]["args"] == ["uint64"] * 5 + ["int32"] * 3
    assert table["atomic_uint32_fetch_thread"]["ret"] == "uint32"
    assert table["uint64_wait_until_greater_than"]["ret"] == "uint64"
    assert table["uint64_wait_until_equals"]["ret"] == "int32"
    assert table["double_p"]["args"] == ["uint64", "float64", "int32", "int32"]
    assert (ir.SIGNAL_SET, ir.SIGNAL_ADD, mt.SIGNAL_SET, mt.SIGNAL_ADD) == (9, 10, 9, 10)
    assert (ir.AMO_INC, ir.AMO_XOR, ir.AMO_FETCH, ir.AMO_COMPARE_SWAP) == (2, 7, 12, 19)


def test_bitcode_is_an_empty_library_triton_accepts() -> None:
    """find_bitcode() is a real LLVM bitcode file, and Triton links it for both vendors (the
    interpreter test below passes it too): code that hands it to extern_libs keeps working."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import mori.ir as ir
    from mori.core.errors import MoriTypeError
    from mori.ir.triton import get_extern_libs

    path = Path(ir.find_bitcode())
    assert path.read_bytes()[:4] == b"BC\xc0\xde" and ir.get_bitcode_path(6) == str(path)
    assert get_extern_libs() == {"mori_shmem": str(path)}
    with pytest.raises(MoriTypeError, match="cov"):
        ir.find_bitcode("6")  # type: ignore[arg-type]

    for target in (GPUTarget("cuda", 90, 32), GPUTarget("hip", "gfx942", 64)):
        src = ASTSource(fn=_kernels().exp_kernel, signature={"x_ptr": "*fp32"}, constexprs={}, attrs={})
        compiled = triton.compile(src, target=target, options={"extern_libs": get_extern_libs()})
        assert compiled.asm["cubin" if target.backend == "cuda" else "hsaco"]


_COMPILED_CHECK = """
import os, sys, tempfile
os.environ.pop("TRITON_INTERPRET", None)
os.environ.update(MORI_DEVICE_RUNTIME="cpu", MORI_SHMEM_HEAP_SIZE="8M", TRITON_CACHE_DIR=tempfile.mkdtemp())
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
import mori.shmem as ms
from mori.core.errors import MoriStateError
from mori.ir.triton.context import CONTEXT
import mori.ir.triton as mt

@triton.jit
def user_kernel(out_ptr):
    triton.language.store(out_ptr, mt.my_pe())

# the kernel's launch check covers CONTEXT although only a callee reads it
_ = user_kernel.cache_key
checked = {name: repr(v) for (name, _), (v, _) in user_kernel.used_global_vals.items()}
assert checked.get("CONTEXT") == repr(CONTEXT), checked
assert repr(CONTEXT).startswith("constexpr[mori.ir context of process %d-" % os.getpid())

# Triton's own launch path, with a driver that only names a target: warmup compiles for it on this
# CPU and runs the launch check, without launching
class TargetOnly:
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_active_torch_device(self): return torch.device("cpu")

driver.set_active(TargetOnly())

def refused(match):
    try:
        user_kernel.warmup(torch.int32, grid=(1,))
    except MoriStateError as e:
        assert match in str(e), e
    else:
        raise AssertionError("the launch check let a kernel through: " + match)

def init():
    ms.shmem_init_attr(ms.MORI_SHMEM_INIT_WITH_UNIQUEID, 0, 1, ms.shmem_get_unique_id())

if sys.argv[1] == "before-init":
    # compiled without shmem: address 0 in the code, and every launch refused, even after init
    refused("before mori.shmem was initialised")
    init()
    refused("before mori.shmem was initialised")
else:
    init()
    user_kernel.warmup(torch.int32, grid=(1,))  # binds the buffer at compile time
    address, base = CONTEXT.value, ms.shmem_heap_info()["base"]
    assert CONTEXT._buffer[:3].tolist() == [0, 1, base]
    ms.shmem_finalize()
    refused("mori.shmem is not initialised")
    CONTEXT._buffer.fill_(-7)  # what a stale context would hold: the refresh must overwrite it
    init()
    new_base = ms.shmem_heap_info()["base"]
    user_kernel.warmup(torch.int32, grid=(1,))  # the launch check refreshes the buffer
    assert CONTEXT.value == address and CONTEXT._buffer[:3].tolist() == [0, 1, new_base], (base, new_base)
print("ok")
"""


@pytest.mark.parametrize("case", ["before-init", "reinit"])
def test_compiled_kernels_check_the_context_at_launch(tmp_path: Path, case: str) -> None:
    """Compiled mode on this CPU (no GPU): Triton checks CONTEXT at every launch of a kernel that
    calls mori.ir.triton; the check refuses a kernel compiled before shmem init, or launched after
    finalize, and makes the buffer current after a re-init. In a fresh process (Triton reads
    TRITON_INTERPRET once), from a file (Triton needs a kernel's source)."""
    script = tmp_path / "compiled_check.py"
    script.write_text(_COMPILED_CHECK)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, str(script), case], capture_output=True, text=True, timeout=120, env=env
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr[-3000:]


# -- the shapes of the original's examples, on 4 ranks ------------------------------------------------


def _examples(rank: int, n: int) -> None:
    import torch

    import mori.shmem as ms
    from mori.ir.triton import get_extern_libs, install_hook

    k = _kernels()
    dev = _device()
    install_hook()
    libs = get_extern_libs()
    right, left = (rank + 1) % n, (rank - 1) % n

    # test_triton_shmem.py: identity, an immediate put, a non-blocking and a blocking get
    out = torch.zeros(2, dtype=torch.int32, device=dev)
    k.basic_kernel[(1,)](out, extern_libs=libs)
    assert out.tolist() == [rank, n]

    buf = ms.mori_shmem_create_tensor((1,), torch.int32)
    buf.fill_(-1)
    ms.shmem_barrier_all()
    k.put_kernel[(1,)](buf, rank * 100 + 42, extern_libs=libs)
    ms.shmem_barrier_all()
    assert buf.item() == left * 100 + 42

    for blocking in (0, 1):
        remote = ms.mori_shmem_create_tensor((5,), torch.int32)
        remote.copy_(torch.arange(5, dtype=torch.int32, device=dev) + rank * 200 + blocking)
        local = ms.mori_shmem_create_tensor((5,), torch.int32)
        local.fill_(-1)
        ms.shmem_barrier_all()
        k.get_kernel[(1,)](local, remote, 12, BLOCKING=blocking, extern_libs=libs)  # 3 of 5 ints
        want = torch.arange(5, dtype=torch.int32, device=dev) + right * 200 + blocking
        assert local[:3].tolist() == want[:3].tolist() and local[3:].tolist() == [-1, -1]
        ms.shmem_barrier_all()

    # a put/signal ring, both ways of ordering data and signal; odd sizes take the byte path
    rounds = 6
    for signalled, nbytes in ((1, 1000), (0, 64), (1, 4096 + 3)):
        rows = ms.mori_shmem_create_tensor((rounds + 1, nbytes), torch.uint8)
        rows.zero_()
        rows[0] = _pattern(rank, nbytes)
        sig = ms.mori_shmem_create_tensor((1,), torch.uint64)
        sig.zero_()
        ms.shmem_barrier_all()
        k.ring_kernel[(1,)](rows, sig, nbytes, ROUNDS=rounds, SIGNALLED=signalled)
        ms.shmem_barrier_all()
        for r in range(rounds + 1):
            assert torch.equal(rows[r], _pattern((rank - r) % n, nbytes)), f"row {r} (signalled={signalled})"
        assert _bits(sig) == rounds
        ms.shmem_barrier_all()

    # test_triton_allreduce.py: bf16 all-reduce by P2P loads and by put+signal; N not a multiple of
    # the block. The kernels add the ranks in rank order in float32, as the reference does, so the
    # sums are equal to the bit; only the final rounding to bf16 may differ: to nearest on a GPU,
    # toward zero under the interpreter (its float32 -> bf16 conversion truncates).
    N = 3000
    data = [
        torch.randn(N, generator=torch.Generator().manual_seed(7 + p)).to(torch.bfloat16).to(dev)
        for p in range(n)
    ]
    acc = torch.zeros(N, dtype=torch.float32, device=dev)
    for p in range(n):
        acc += data[p].float()
    nearest = acc.to(torch.bfloat16)
    toward_zero = (acc.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)  # exact

    def is_sum(result: Any) -> bool:
        return bool(((result == nearest) | (result == toward_zero)).all())

    symm = ms.mori_shmem_create_tensor((N,), torch.bfloat16)
    symm.copy_(data[rank])
    ms.shmem_barrier_all()
    result = torch.empty(N, dtype=torch.bfloat16, device=dev)
    k.allreduce_p2p_kernel[(triton_cdiv(N, 1024),)](
        symm, result, n, N, BLOCK_SIZE=1024, MAX_PES=8, extern_libs=libs
    )
    assert is_sum(result), "allreduce_p2p_kernel"

    recv = ms.mori_shmem_create_tensor((n * N,), torch.bfloat16)
    signal = ms.mori_shmem_create_tensor((n,), torch.int64)
    for run in range(2):  # twice: the signals are reset between runs, as in the original
        recv.zero_()
        signal.zero_()
        output = torch.empty(N, dtype=torch.bfloat16, device=dev)
        ms.shmem_barrier_all()
        meta = {"CHUNK_SIZE": 2048, "MAX_PES": 8, "CHUNKS_PER_PE": 2, "BLOCK_SIZE": 1024, "extern_libs": libs}
        # one launch on a GPU; the interpreter needs the phases in two (see the kernel)
        for phases in (1, 2) if os.environ.get("TRITON_INTERPRET") == "1" else (3,):
            k.allreduce_put_signal_kernel[(16,)](
                symm, recv, output, signal, rank, n, N, PHASES=phases, **meta
            )
        assert is_sum(output), f"allreduce_put_signal_kernel, run {run}"
        assert signal.tolist() == [2] * n
        ms.shmem_barrier_all()


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def test_original_examples_on_4_ranks() -> None:
    _ranks(_examples)


# -- every other function --------------------------------------------------------------------------


def _families(rank: int, n: int) -> None:
    import torch

    import mori.ir as ir
    import mori.shmem as ms
    from mori.shmem import device as shd

    k = _kernels()
    dev = _device()
    right, left = (rank + 1) % n, (rank - 1) % n
    status = torch.zeros(1, dtype=torch.int32, device=dev)
    size = 300  # bytes of each buffer; copies land at an offset inside, guarded on both sides
    dst = ms.mori_shmem_create_tensor((size,), torch.uint8)
    src = ms.mori_shmem_create_tensor((size,), torch.uint8)
    mine = _pattern(1000 + rank, size)

    # puts and gets: every function, an aligned copy (16-byte vectors) and an odd one (bytes)
    families = [(k.put_family_kernel, k.PUTS, True), (k.get_nbi_family_kernel, k.GETS_NBI, False)]
    families.append((k.get_family_kernel, k.GETS, False))
    for kernel, names, is_put in families:
        for fn, name in enumerate(names):
            elem = (
                1
                if "mem" in name
                else {"uint32": 4, "float": 4, "uint64": 8, "double": 8}[name.split("_")[1]]
            )
            for offset, count in ((16, 256 // elem), (8, 40 // elem if elem > 1 else 37)):
                nbytes = count * elem
                dst.fill_(0xEE)
                src.copy_(mine)
                ms.shmem_barrier_all()
                pe = right if is_put else left
                d, s = dst[offset:], src[offset:]
                kernel[(1,)](d, s, count, pe, fn, status)
                assert status.item() == 0, name
                if is_put:
                    ms.shmem_barrier_all()  # the left neighbour has put into my dst
                # either way dst now holds the left neighbour's src there, and nothing else changed
                want = torch.full((size,), 0xEE, dtype=torch.uint8, device=dev)
                want[offset : offset + nbytes] = _pattern(1000 + left, size)[offset : offset + nbytes]
                assert torch.equal(dst, want), f"{name}: {count} x {elem} bytes at offset {offset}"
                ms.shmem_barrier_all()
            # a PE that does not exist: nothing is done, status -1
            dst.fill_(0xEE)
            for bad in (n, -1, 1 << 20):
                kernel[(1,)](dst, src, 8, bad, fn, status)
                assert status.item() == -1, f"{name} to PE {bad}"
            assert bool((dst == 0xEE).all()), f"{name} wrote for a PE that does not exist"

    # put with signal: each scope, SET then ADD; an unknown signal op is refused after the put
    sig = ms.mori_shmem_create_tensor((1,), torch.uint64)
    sig.zero_()
    ms.shmem_barrier_all()
    expect = 0
    for fn, name in enumerate(k.SIGNALS):
        for op, value in ((ir.SIGNAL_SET, 2**63 + fn), (ir.SIGNAL_ADD, 3)):
            src.copy_(_pattern(50 * fn + op + rank, size))
            k.signal_family_kernel[(1,)](
                dst, src, 100, sig, value - (2**64 if value >= 2**63 else 0), op, right, fn, status
            )
            assert status.item() == 0, name
            expect = value if op == ir.SIGNAL_SET else expect + value
            ms.shmem_barrier_all()
            assert _bits(sig) == expect, f"{name} op {op}"
            assert torch.equal(dst[:100], _pattern(50 * fn + op + left, size)[:100]), f"{name} op {op}"
            ms.shmem_barrier_all()
        k.signal_family_kernel[(1,)](dst, src, 100, sig, 1, ir.AMO_ADD, right, fn, status)
        assert status.item() == -1, f"{name} with signal op AMO_ADD"
        k.signal_family_kernel[(1,)](dst, src, 100, sig, 1, ir.SIGNAL_ADD, n, fn, status)
        assert status.item() == -1, f"{name} to PE {n}"
        ms.shmem_barrier_all()
        assert _bits(sig) == expect, "a refused signal changed the word"

    # single values, stored into the right neighbour's word
    word = ms.mori_shmem_create_tensor((2,), torch.int64)
    ivalue, fvalue = -123456789012, 2.75
    raw = torch.tensor([0x0102030405060708], dtype=torch.int64, device=dev)
    for fn, (name, dtype_name) in enumerate(k.VALUES):
        word.fill_(-1)
        ms.shmem_barrier_all()
        k.value_family_kernel[(1,)](word, ivalue, fvalue, raw, 6, right, fn, status)
        assert status.item() == 0, name
        ms.shmem_barrier_all()
        got = word.view(torch.uint8)
        if dtype_name is None:  # put_size_imm_nbi_thread: 6 bytes of raw
            want = torch.cat(
                [raw.view(torch.uint8)[:6], torch.full((10,), 0xFF, dtype=torch.uint8, device=dev)]
            )
        else:
            dtype = getattr(torch, dtype_name)
            v = fvalue if dtype.is_floating_point else ivalue
            one = torch.tensor(
                [v], dtype=torch.float64 if dtype.is_floating_point else torch.int64, device=dev
            ).to(dtype)
            want = torch.full((16,), 0xFF, dtype=torch.uint8, device=dev)
            want[: dtype.itemsize] = one.view(torch.uint8)
        assert torch.equal(got, want), f"{name}: {got.tolist()}"
        k.value_family_kernel[(1,)](word, ivalue, fvalue, raw, 6, n + 3, fn, status)
        assert status.item() == -1, f"{name} to PE {n + 3}"
        ms.shmem_barrier_all()

    # atomics: every function on PE 0's word from every rank, 8 programs each
    progs = 8
    words = ms.mori_shmem_create_tensor((4,), torch.int64)
    outs = torch.zeros(progs, dtype=torch.int64, device=dev)
    for fn, (name, wname, fetches) in enumerate(k.ATOMICS):
        words.zero_()
        ms.shmem_barrier_all()
        value = torch.tensor([5], dtype=torch.int64, device=dev)  # for atomic_size_nonfetch_thread (8 bytes)
        k.atomic_family_kernel[(progs,)](words, 5, 0, ir.AMO_ADD, value, 8, 0, fn, outs)
        ms.shmem_barrier_all()
        if rank == 0:
            total = _bits(words[:1]) if wname != "uint32" else int(words.view(torch.uint32)[0])
            assert total == 5 * progs * n, f"{name}: {total}"
        if fetches:  # previous values are distinct multiples of 5
            assert len(set(outs.tolist())) == progs and all(v % 5 == 0 for v in outs.tolist()), name
        else:
            assert outs.tolist() == [0] * progs, f"{name}: status {outs.tolist()}"
        k.atomic_family_kernel[(1,)](words, 5, 0, ir.AMO_ADD, value, 8, n, fn, outs)
        assert outs[0].item() == (0 if fetches else -1), f"{name} to PE {n}"
        ms.shmem_barrier_all()

    # every operation code, on this rank's own uint64 slot of the right neighbour's words, with the
    # fetching function (fn 4 returns the previous value) and the non-fetching one (fn 1, a status)
    slot = words[rank : rank + 1]  # NRANKS == len(words)
    value_t = torch.tensor([0], dtype=torch.int64, device=dev)

    def amo(op: int, value: int, compare: int = 0, fn: int = 4) -> int:
        k.atomic_family_kernel[(1,)](slot, value, compare, op, value_t, 8, right, fn, outs)
        return int(outs[0]) % 2**64

    words.zero_()
    ms.shmem_barrier_all()
    steps = [  # (op, value, compare, the previous value it must return)
        (ir.AMO_SET, 12, 0, 0),
        (ir.AMO_FETCH, 0, 0, 12),
        (ir.AMO_INC, 0, 0, 12),
        (ir.AMO_FETCH_INC, 0, 0, 13),
        (ir.AMO_ADD, 10, 0, 14),
        (ir.AMO_FETCH_ADD, 10, 0, 24),
        (ir.AMO_AND, 0b1100, 0, 34),  # 34 & 12 = 0
        (ir.AMO_OR, 0b1010, 0, 0),
        (ir.AMO_FETCH_OR, 0b0101, 0, 10),
        (ir.AMO_XOR, 0b0011, 0, 15),
        (ir.AMO_FETCH_XOR, 0b1111, 0, 12),
        (ir.AMO_FETCH_AND, 0b0010, 0, 3),
        (ir.AMO_SWAP, 99, 0, 2),
        (ir.AMO_COMPARE_SWAP, 7, 98, 99),  # fails: 99 != 98
        (ir.AMO_COMPARE_SWAP, 7, 99, 99),  # succeeds
        (ir.SIGNAL_SET, 2**64 - 1, 0, 7),
        (ir.SIGNAL_ADD, 2, 0, 2**64 - 1),  # wraps to 1
        (ir.AMO_FETCH, 0, 0, 1),
    ]
    for op, value, compare, previous in steps:
        assert amo(op, value - 2**64 if value >= 2**63 else value, compare) == previous, (
            f"op {op} with {value}"
        )
    assert amo(ir.AMO_ADD, 1, fn=1) == 0 and amo(ir.AMO_FETCH, 0) == 2, "the non-fetching form"
    assert amo(1, 1) == 0 and amo(1, 1, fn=1) == 2**64 - 1, "an unknown code does nothing"
    assert amo(ir.AMO_FETCH, 0) == 2
    ms.shmem_barrier_all()
    # atomic_size_nonfetch_thread: a 4-byte value on a uint32 word, and a size it refuses
    words.zero_()
    ms.shmem_barrier_all()
    four = torch.tensor([6], dtype=torch.int32, device=dev)
    k.atomic_family_kernel[(1,)](slot, 0, 0, ir.AMO_ADD, four, 4, right, 12, outs)
    assert outs[0].item() == 0
    k.atomic_family_kernel[(1,)](slot, 0, 0, ir.AMO_ADD, four, 2, right, 12, outs)
    assert outs[0].item() == -1, "a 2-byte atomic"
    ms.shmem_barrier_all()
    assert words.view(torch.int32).tolist() == [6 if q == 2 * left else 0 for q in range(8)]
    ms.shmem_barrier_all()

    # waits: the word already satisfies the wait (greater_than returns it), then a wait that the
    # left neighbour satisfies later with an immediate put
    w = ms.mori_shmem_create_tensor((1,), torch.int64)
    got = torch.zeros(1, dtype=torch.int64, device=dev)
    for fn, (name, wname, cmp) in enumerate(k.WAITS):
        dtype = getattr(torch, wname)
        w.zero_()
        w.view(dtype)[0] = 41
        k.wait_family_kernel[(1,)](w, 41 if cmp == "equals" else 40, fn, got)
        assert got.item() == (41 if cmp == "greater_than" else 0), name
        ms.shmem_barrier_all()
    w.zero_()
    ms.shmem_barrier_all()
    k.value_family_kernel[(1,)](w, 77, 0.0, raw, 0, right, 1, status)  # int64_p 77 to the right
    k.wait_family_kernel[(1,)](w, 77, 7, got)  # int64_wait_until_equals
    assert got.item() == 0 and w.item() == 77
    ms.shmem_barrier_all()

    # ordering and barriers; ptr / ptr_p2p against the host's shmem_ptr_p2p
    cell = ms.mori_shmem_create_tensor((1,), torch.int64)
    ptrs = torch.zeros(3, dtype=torch.int64, device=dev)
    out = torch.zeros(2, dtype=torch.int32, device=dev)
    for fn, name in enumerate(k.SYNCS):
        cell.fill_(-5)
        ms.shmem_barrier_all()
        k.sync_family_kernel[(1,)](cell, ptrs, right, fn, out)
        assert out[0].item() == 0, name
        if "barrier" in name:
            assert out[1].item() == left, f"{name}: the left neighbour's store is not visible after it"
        ms.shmem_barrier_all()
        assert cell.item() == left
        addr = cell.data_ptr()
        want = ms.shmem_ptr_p2p(addr, rank, right)
        assert ptrs.tolist()[:2] == [want, want], name
        bases = shd.shmem_device_context().tolist()[2:]
        assert ptrs[2].item() == addr - bases[right] + bases[rank], "ptr_p2p from another PE's view"
        ms.shmem_barrier_all()
    for bad in (n, -1):
        k.sync_family_kernel[(1,)](cell, ptrs, bad, 0, out)
        assert ptrs.tolist() == [0, 0, 0], f"ptr_p2p / ptr to PE {bad}"
    ms.shmem_barrier_all()


def test_every_device_function_on_4_ranks() -> None:
    _ranks(_families)


# -- the context: before init, after finalize, across a re-init --------------------------------------


def _refused(launch: Any, match: str) -> None:
    """``launch()`` raises MoriStateError with ``match`` in it (the interpreter wraps what a kernel
    raises in its InterpreterError, ``from`` the original)."""
    from mori.core.errors import MoriStateError

    with pytest.raises(Exception) as info:
        launch()
    e: BaseException | None = info.value
    while e is not None and not isinstance(e, MoriStateError):
        e = e.__cause__
    assert e is not None and match in str(e), repr(info.value)


def _launch_before_init(rank: int, n: int) -> None:
    import torch

    out = torch.zeros(2, dtype=torch.int32)  # before init: there is no heap device yet
    _refused(lambda: _kernels().basic_kernel[(1,)](out), "mori.shmem is not initialised")


def _lifecycle(rank: int, n: int, uid: bytes) -> None:
    import torch

    import mori.shmem as ms
    from mori.ir.triton import install_hook
    from mori.ir.triton.context import CONTEXT
    from mori.shmem import device as shd

    k = _kernels()
    dev = _device()
    out = torch.zeros(2, dtype=torch.int32, device=dev)
    install_hook()  # shmem is up: binds the buffer now
    address = CONTEXT.value
    k.basic_kernel[(1,)](out)
    assert out.tolist() == [rank, n]
    ms.shmem_barrier_all()
    ms.shmem_finalize()
    _refused(lambda: k.basic_kernel[(1,)](out), "mori.shmem is not initialised")
    # a second job in the same process, ranks renumbered, a heap of another size: the kernels follow
    os.environ["MORI_SHMEM_HEAP_SIZE"] = "24M"
    new_rank = (rank + 1) % n
    ms.shmem_init_attr(ms.MORI_SHMEM_INIT_WITH_UNIQUEID, new_rank, n, uid)
    k.basic_kernel[(1,)](out)
    assert out.tolist() == [new_rank, n]
    assert CONTEXT.value == address, "the buffer never moves: compiled code holds its address"
    ctx = shd.shmem_device_context()
    assert CONTEXT._buffer is not None and CONTEXT._buffer[: ctx.numel()].tolist() == ctx.tolist()
    buf = ms.mori_shmem_create_tensor((1,), torch.int32)
    buf.fill_(-1)
    ms.shmem_barrier_all()
    k.put_kernel[(1,)](buf, new_rank, extern_libs={})
    ms.shmem_barrier_all()
    assert buf.item() == (new_rank - 1) % n


def test_context_before_init_after_finalize_and_across_reinit() -> None:
    import mori.shmem as ms

    shmem_ranks(
        _lifecycle,
        NRANKS,
        ms.shmem_get_unique_id(),
        heap="16M",
        timeout=TIMEOUT,
        env=INTERPRET,
        before_init=_launch_before_init,
    )


# -- the same kernels compiled, on ranks that share one GPU -------------------------------------------


def _first_gpu(rank: int, nranks: int) -> None:
    import torch

    torch.cuda.set_device(0)


def _on_gpu(rank: int, n: int) -> None:
    _examples(rank, n)
    _families(rank, n)


@pytest.mark.gpu
def test_ir_kernels_on_ranks_sharing_one_gpu() -> None:
    """The examples and every function, compiled, on MORI_TEST_IR_GPU_RANKS (default 4) ranks that all
    use GPU 0: their kernels spin waiting for each other, so they must run at the same time (start
    an MPS daemon first for real concurrency; without it the GPU time-slices them, slowly). Every rank
    compiles each kernel once (the context address is per process), hence the long timeout."""
    from mori.testing.gpu_shmem import machine_gpu_runtime

    runtime = machine_gpu_runtime()  # skips without a GPU, fails without a plugin serving it
    nranks = int(os.environ.get("MORI_TEST_IR_GPU_RANKS", "4"))
    env = {"MORI_DEVICE_RUNTIME": str(runtime), "MORI_SHMEM_HEAP_SIZE": "256M"}
    shmem_ranks(_on_gpu, nranks, heap="256M", timeout=400.0, env=env, before_init=_first_gpu)
