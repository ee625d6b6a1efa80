"""The XGMI backend without a GPU: the scatter-gather kernel under the Triton interpreter, and the
backend's real code on the fake CUDA and HIP drivers of mori.testing (device memory is host memory there, an
IPC open maps the same memory again at another address, two fake runtimes play two processes).

The tests marked ``gpu`` run the backend on real GPUs (two of them, either vendor) through the public API.
"""

from __future__ import annotations

import ctypes
import os
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from mori.core.errors import MoriBackendError, MoriTimeoutError, MoriValueError
from mori.io import (
    BackendType,
    EngineDesc,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    StatusCode,
    XgmiBackendConfig,
    xgmi,
)
from mori.io.xgmi import XgmiBackend
from mori.testing import load_module_file
from mori.testing.gpu_runtime import FakeRuntime, load_interpreted

ROOT = Path(__file__).resolve().parents[3]
MiB = 1 << 20
GPU = int(MemoryLocationType.GPU)


@pytest.fixture(scope="session")
def sg() -> ModuleType:
    """mori.io.xgmi_kernels compiled for the Triton interpreter (runs on CPU memory), calling an
    interpreted copy of mori.viz's device helpers (the imported ones are compiled-mode jit functions,
    which an interpreted kernel cannot call)."""
    pytest.importorskip("triton", reason="the scatter-gather kernel needs Triton")
    import triton.language.core

    import mori.io.xgmi_kernels  # noqa: F401  (Triton's own modules load compiled, not interpreted)

    module = load_interpreted("mori.io.xgmi_kernels", "mori_io_xgmi_kernels_interpreted")
    module.vd = load_interpreted("mori.viz.device", "mori_viz_device_interpreted")  # type: ignore[attr-defined]
    # Triton 3.6's interpreter patches the language modules a called device function sees and never
    # restores them for that call (only a launch restores what its kernel's module sees): the helpers
    # see triton.language.core, which the kernel's module does not, and it would stay patched, breaking
    # every later compile in this process. Seen from the kernel's module, each launch restores it.
    module.tlc = triton.language.core  # type: ignore[attr-defined]
    return module


def _bytes(addr: int, n: int) -> bytes:
    return ctypes.string_at(addr, n)


def _fill(addr: int, data: bytes) -> None:
    ctypes.memmove(addr, data, len(data))


# -- host-side helpers -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """One copy: ``size`` bytes from address ``src`` to ``dst``."""

    dst: int
    src: int
    size: int


def word_bytes(blocks: list[Block]) -> int:
    """The widest word (8, 4, 2, 1 bytes) every address and size of ``blocks`` is a multiple of."""
    acc = 0
    for blk in blocks:
        acc |= blk.dst | blk.src | blk.size
    return next((w for w in (8, 4, 2) if acc % w == 0), 1)


def test_threshold_variable_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    var = xgmi.MORI_IO_XGMI_SCATTER_GATHER_THRESHOLD
    assert var.get() == 8
    monkeypatch.setenv(var.name, "0")
    assert var.get() == 0
    monkeypatch.setenv(var.name, "-3")
    with pytest.raises(MoriValueError, match="MORI_IO_XGMI_SCATTER_GATHER_THRESHOLD='-3' is not valid"):
        var.get()


# -- the kernel under the interpreter ------------------------------------------------------------------------


def _run_kernel(sg: ModuleType, blocks: list[Block], split: int) -> None:
    word = word_bytes(blocks)
    n = len(blocks)
    table = torch.tensor(
        [[b.dst for b in blocks], [b.src for b in blocks], [b.size // word for b in blocks]],
        dtype=torch.int64,
    )
    sg.scatter_gather_kernel[(n, split)](table, n, split, WORD_BYTES=word, BLOCK=64)


@pytest.mark.parametrize("align", [8, 4, 2, 1])
@pytest.mark.parametrize("split", [1, 3])
def test_scatter_gather_kernel_copies_every_block_exactly(sg: ModuleType, align: int, split: int) -> None:
    rng = random.Random(align * 10 + split)
    src = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
    dst = torch.zeros(1 << 16, dtype=torch.uint8)
    expected = torch.zeros_like(dst)
    blocks, spans = [], []
    cursor = 0
    for _ in range(12):  # disjoint destination blocks, sizes not multiples of the kernel's BLOCK
        size = rng.randrange(1, 700) * align
        soff = rng.randrange(0, (1 << 16) - size) // align * align
        blocks.append(Block(dst.data_ptr() + cursor, src.data_ptr() + soff, size))
        spans.append((cursor, soff, size))
        cursor += size + align * rng.randrange(1, 9)  # a gap that must stay zero
    assert word_bytes(blocks) == align
    _run_kernel(sg, blocks, split)
    for d, s, n in spans:
        expected[d : d + n] = src[s : s + n]
    assert torch.equal(dst, expected)


def test_scatter_gather_kernel_carries_aot_specs_for_every_word(sg: ModuleType) -> None:
    from mori.core.kernels import aot_specs
    from mori.io import xgmi_kernels

    specs = aot_specs(xgmi_kernels.scatter_gather_kernel)
    plain = [s for s in specs if not s.constexprs["TRACE"]]
    traced = [s for s in specs if s.constexprs["TRACE"]]
    # every width untraced (trace_ptr None: not a parameter) and traced (trace_ptr an aligned pointer)
    for group in (plain, traced):
        assert sorted(s.constexprs["WORD_BYTES"] for s in group) == [1, 2, 4, 8]
    assert all(set(s.signature) == {"desc_ptr", "n_blocks", "split"} for s in plain)
    assert all(s.constexprs["trace_ptr"] is None for s in plain)
    assert all(
        s.signature == {"desc_ptr": "*i64", "n_blocks": "i32", "split": "i32", "trace_ptr": "*i64"}
        for s in traced
    )
    assert all("trace_ptr" in s.aligned for s in traced)


# -- tracing (mori.viz) -------------------------------------------------------------------------------------

SCHEMA = ROOT / "packages" / "mori-viz" / "tests" / "chrome_trace.schema.json"


def program_events() -> list[tuple[int, int]]:
    """(kind, slot) that one program of a traced launch records, in order."""
    from mori.io.xgmi_kernels import SLOTS
    from mori.viz import layout

    k, t, c = SLOTS.kernel.value, SLOTS.table.value, SLOTS.copy.value
    return [(layout.BEGIN, k), (layout.BEGIN, t), (layout.NEXT, c), (layout.END, c), (layout.END, k)]


def check_rings(buf: Any, programs: int, launches: int) -> None:
    """Rings ``[0, programs)`` of ``buf`` hold ``launches`` traced launches of every program (paired
    spans of the declared slots, in time order), the others nothing."""
    data = buf.read()
    assert list(data.written[:programs]) == [5 * launches] * programs
    assert not data.written[programs:].any() and not data.lost.any()
    for ring in range(programs):
        ev = data.events[data.events["ring"] == ring]
        assert [(int(e["kind"]), int(e["slot"])) for e in ev] == program_events() * launches
        assert [int(e["launch"]) for e in ev] == [n for n in range(launches) for _ in range(5)]
        assert (ev["ts"][1:] >= ev["ts"][:-1]).all()


def check_export(buf: Any, path: Path, spans: int) -> None:
    """export_to_perfetto of ``buf``: every begin paired (validate_pairs), valid Chrome JSON."""
    import json

    import jsonschema

    from mori import viz

    report = viz.export_to_perfetto(buf, path, validate_pairs=True, sanitize_orphans=False)
    assert (report.spans, report.orphans_dropped, report.orphans_kept, report.events_lost) == (spans, 0, 0, 0)
    doc = json.loads(path.read_text())
    jsonschema.validate(doc, json.loads(SCHEMA.read_text()))
    names = {e["name"] for e in doc["traceEvents"] if e["ph"] == "X"}
    assert names == {"kernel", "table", "copy"}


def test_traced_kernel_records_paired_spans_for_every_program(sg: ModuleType, tmp_path: Path) -> None:
    """5 blocks x split 3 = 15 programs (some copy nothing: a block smaller than its shares)."""
    from mori import viz

    src = torch.randint(0, 256, (1 << 15,), dtype=torch.uint8)
    dst = torch.zeros(1 << 15, dtype=torch.uint8)
    sizes = [8, 512, 1000, 4096, 64]
    blocks = [Block(dst.data_ptr() + i * 6000, src.data_ptr() + i * 5000, n) for i, n in enumerate(sizes)]
    buf = viz.TraceBuffer(32, 64, device="cpu", name="io")
    table = torch.tensor(
        [[b.dst for b in blocks], [b.src for b in blocks], [b.size for b in blocks]], dtype=torch.int64
    )
    for _ in range(2):
        sg.scatter_gather_kernel[(5, 3)](
            table, 5, 3, WORD_BYTES=1, BLOCK=64, trace_ptr=buf.tensor, TRACE=True
        )
    expected = torch.zeros_like(dst)
    for i, n in enumerate(sizes):
        expected[i * 6000 : i * 6000 + n] = src[i * 5000 : i * 5000 + n]
    assert torch.equal(dst, expected)
    check_rings(buf, 15, 2)
    check_export(buf, tmp_path / "sg.json", 15 * 2 * 3)


def test_untraced_kernel_compiles_to_the_uninstrumented_kernel(tmp_path: Path) -> None:
    """TRACE off (trace_ptr None, as the untraced AOT variants and the backend launch it) is the kernel
    without the instrumentation: the same TTIR as the module with every trace line removed."""
    import re

    from mori.io import xgmi_kernels

    source = Path(xgmi_kernels.__file__).read_text()
    trace_lines = ("vd.", "trace_ptr=None", "TRACE: tl.constexpr", "# trace buffer (mori.viz)")
    kept = [ln for ln in source.splitlines() if not any(t in ln for t in trace_lines)]
    # 7 helper calls, the AOT decorator, the two arguments and their comment
    assert len(kept) == len(source.splitlines()) - 11
    plain_src = "\n".join(kept)
    (tmp_path / "plain_sg.py").write_text(plain_src + "\n")
    plain = load_module_file("mori_io_plain_sg", str(tmp_path / "plain_sg.py"))
    from mori.core.kernels import AotSpec, aot_specs
    from mori.jit import compile_variant

    def ttir(fn: Any, spec: AotSpec) -> str:  # compiled as a launch with the spec's arguments would be
        text = compile_variant(fn, spec, "cuda:90").asm["ttir"]
        body = [ln for ln in text.splitlines() if not ln.startswith("#loc") and "tt.func" not in ln]
        return "\n".join(re.sub(r" loc\([^)]*\)", "", ln) for ln in body)

    specs = [s for s in aot_specs(xgmi_kernels.scatter_gather_kernel) if s.constexprs["WORD_BYTES"] == 8]
    (off_spec,) = [s for s in specs if not s.constexprs["TRACE"]]
    (on_spec,) = [s for s in specs if s.constexprs["TRACE"]]
    plain_spec = AotSpec(
        off_spec.signature, {"WORD_BYTES": 8, "BLOCK": xgmi_kernels.DEFAULT_BLOCK}, off_spec.aligned
    )
    off = ttir(xgmi_kernels.scatter_gather_kernel, off_spec)
    assert off == ttir(plain.scatter_gather_kernel, plain_spec)
    on = ttir(xgmi_kernels.scatter_gather_kernel, on_spec)
    assert "globaltimer" in on and "globaltimer" not in off


# -- the backend on the fake GPU drivers (CUDA and HIP) ----------------------------------------------------


@dataclass(frozen=True)
class Vendor:
    """One device plugin as these tests use it: its fake library on the shared tests' backend
    description, and the other vendor's handle magic."""

    name: str
    backend: Any  # mori.testing.gpu_runtime.GpuBackend
    world_class: Any
    other_magic: bytes

    def call(self, op: str) -> str:
        return str(self.backend.call(op))


# plugin directory -> package, fake module and class, the other vendor's handle magic
_VENDORS: dict[str, tuple[str, str, str, bytes]] = {
    "nvlink": ("mori_backend_nvlink", "_fake_cuda.py", "FakeCudaLib", b"MXGM"),
    "xgmi": ("mori_backend_xgmi", "_fake_hip.py", "FakeHipLib", b"MNVL"),
}


def make_vendor(name: str) -> Vendor | None:
    """The GPU device plugin ``name`` of this checkout (or installed) on its fake driver library;
    None if it is neither installed nor in this checkout."""
    import importlib

    from mori.testing.gpu_runtime import GpuBackend, source_tree

    package, fake_file, fake_class, other_magic = _VENDORS[name]
    plugin = ROOT / "backends" / name
    if importlib.util.find_spec(package) is None and not (plugin / "src").is_dir():
        return None
    source_tree(package, plugin / "src")
    vendor = importlib.import_module(package).VENDOR
    fake = load_module_file(f"mori_io_fake_{name}", str(plugin / "tests" / fake_file))
    backend = GpuBackend(
        vendor=vendor,
        fake_lib=getattr(fake, fake_class),
        no_devices_reason="",
        heap_alloc_call="",
        memcpy_failure="",
    )
    return Vendor(name, backend, fake.FakeWorld, other_magic)


@pytest.fixture(scope="session", params=sorted(_VENDORS))
def vendor(request: pytest.FixtureRequest) -> Vendor:
    """Each GPU device plugin of this checkout (or installed), on its fake driver library."""
    name = str(request.param)
    v = make_vendor(name)
    if v is None:
        pytest.skip(f"{_VENDORS[name][0]} is neither installed nor in this checkout")
    return v


class Node:
    """Fake processes of one node: ``runtime(pid, device)`` makes one, ``close()`` frees them all."""

    def __init__(self, vendor: Vendor, sg: ModuleType | None = None) -> None:
        self.vendor = vendor
        self.world = vendor.world_class()
        self.libs: list[Any] = []
        self.backends: list[XgmiBackend] = []
        self.sg = sg

    def backend(self, key: str, rt: Any, **kw: Any) -> XgmiBackend:
        """An interpreted XgmiBackend on ``rt``, closed with the node (also when a test fails:
        its native threads must not outlive the fake driver they call)."""
        assert self.sg is not None
        b = interpreted_backend_class(self.sg)(key, "node-a", rt, **kw)
        self.backends.append(b)
        return b

    def call(self, op: str) -> str:
        """The C name of driver operation ``op`` (ipc_open, ipc_close, event_synchronize, memcpy)."""
        return self.vendor.call(op)

    def runtime(self, pid: int, device: int = 0) -> Any:
        lib = self.vendor.backend.fake_lib(self.world)
        self.libs.append(lib)
        return FakeRuntime(self.vendor.backend, lib, device=device, pid=pid)

    def close(self) -> None:
        for b in self.backends:
            b.close()
        for lib in self.libs:
            lib.close()
        self.world.close()


@pytest.fixture
def node(vendor: Vendor, sg: ModuleType) -> Iterator[Node]:
    n = Node(vendor, sg)
    yield n
    n.close()


_LAUNCH = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,
    *[ctypes.c_uint] * 7,
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_void_p),
    ctypes.c_void_p,
)


#: the 'driver function' of a traced variant: its word width plus this
TRACED = 0x100


def interpreted_backend_class(sg: ModuleType) -> type[XgmiBackend]:
    """XgmiBackend whose native queue launches the interpreted kernel (the fake GPU's memory is host
    memory): the 'driver function' of a word width is the width itself (plus TRACED for the traced
    variant), and the launch entry point is a C callback that reads the kernel's parameters the way
    a driver would (a traced variant's trace buffer address after ``split``). Trace buffers are on
    the CPU."""

    class InterpretedXgmi(XgmiBackend):
        launches: list[tuple[int, int, int, int]]  # (function, blocks, split, threads) of each launch

        def _native_calls(self, drv: Any) -> dict[str, Any]:
            calls = super()._native_calls(drv)
            self.launches = []

            def launch(f: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int,
                       stream: Any, params: Any, extra: Any) -> int:  # fmt: skip
                table = ctypes.c_uint64.from_address(params[0]).value
                n = ctypes.c_int32.from_address(params[1]).value
                split = ctypes.c_int32.from_address(params[2]).value
                assert (gx, gy, gz, by, bz, shared) == (n, split, 1, 1, 1, 0) and extra is None
                self.launches.append((f, n, split, bx))
                words = (ctypes.c_int64 * (3 * n)).from_address(table)
                t = torch.frombuffer(words, dtype=torch.int64)
                if f & TRACED:  # the buffer the queue was given, found by its address
                    address = ctypes.c_uint64.from_address(params[3]).value
                    (buf,) = [b.tensor for b in self._trace_kept if b.tensor.data_ptr() == address]
                    sg.scatter_gather_kernel[(n, split)](
                        t, n, split, WORD_BYTES=f & ~TRACED, BLOCK=64, trace_ptr=buf, TRACE=True
                    )
                else:
                    sg.scatter_gather_kernel[(n, split)](t, n, split, WORD_BYTES=f, BLOCK=64)
                return 0

            self._launch_cb = _LAUNCH(launch)
            calls["launch_kernel"] = ctypes.cast(self._launch_cb, ctypes.c_void_p).value
            return calls

        def _load_kernels(self, st: Any, traced: bool = False) -> dict[int, tuple[int, int, int]]:
            return {w: (w | (TRACED if traced else 0), 128, 0) for w in (8, 4, 2, 1)}

        def _trace_device(self, st: Any) -> Any:
            return torch.device("cpu")

    return InterpretedXgmi


def gpu_alloc(rt: Any, size: int) -> int:
    """Device memory from the fake driver (what torch's allocator would hand out)."""
    st = rt.bound_device()
    with st.active():
        return int(st.drv.mem_alloc(size))


class Side:
    """One fake process: a backend and a registered GPU region at ``base + offset``."""

    ids = iter(range(1, 1 << 30))

    def __init__(self, backend: XgmiBackend, rt: Any, key: str, alloc: int, offset: int, size: int) -> None:
        self.backend, self.rt, self.key = backend, rt, key
        self.base = alloc + offset
        desc = MemoryDesc(key, next(Side.ids), 0, "", self.base, size, GPU, -1, b"")
        handle = backend.on_register_memory(desc)
        assert handle is not None
        self.desc = MemoryDesc(**{**desc.__dict__, "ipc_handle": handle})


def make_side(
    node: Node, sg: ModuleType, key: str, pid: int, *, size: int = MiB, offset: int = 0, **kw: Any
) -> Side:
    rt = node.runtime(pid, device=pid % 2)
    backend = node.backend(key, rt, **kw)
    alloc = gpu_alloc(rt, size + offset + 4096)
    return Side(backend, rt, key, alloc, offset, size)


def connect(a: Side, b: Side, node_id: str = "node-a") -> None:
    a.backend.on_register_remote_engine(EngineDesc(b.key, node_id, "h", "127.0.0.1", 1, 2))
    b.backend.on_register_remote_engine(EngineDesc(a.key, node_id, "h", "127.0.0.1", 1, 2))


def wait_ok(st: Any) -> None:
    assert st.WaitFor(5000), "the transfer did not finish within 5 s"
    assert st.Succeeded(), (st.Code(), st.Message())


@pytest.mark.parametrize("threshold", ["0", "4"])
def test_write_and_read_between_two_processes(
    node: Node, sg: ModuleType, threshold: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MORI_IO_XGMI_SCATTER_GATHER_THRESHOLD", threshold)
    # b's region is a sub-range (offset 4096) of a larger allocation, as per-layer KV views are
    a = make_side(node, sg, "a", 1000, num_streams=3)
    b = make_side(node, sg, "b", 1001, offset=4096)
    connect(a, b)
    assert a.backend.supports(a.desc, b.desc) and b.backend.supports(b.desc, a.desc)
    payload = bytes(random.Random(1).randrange(256) for _ in range(64 * 1024))
    _fill(a.base, payload)
    # batch of 16 strided 1 KiB blocks, a -> b
    loffs = [i * 4096 for i in range(16)]
    roffs = [i * 2048 + 8 for i in range(16)]
    st = a.backend.post("write", a.desc, loffs, b.desc, roffs, [1024] * 16, 7)
    wait_ok(st)
    for lo, ro in zip(loffs, roffs, strict=True):
        assert _bytes(b.base + ro, 1024) == payload[lo : lo + 1024]
    assert _bytes(b.base, 8) == bytes(8)  # nothing before the first block
    kernel = a.backend.counters["kernel_launches"]
    assert kernel == (1 if threshold == "4" else 0)
    assert a.backend.counters["copies"] == (0 if threshold == "4" else 16)
    # read it back into another place of a, one block and a batch
    st = a.backend.post("read", a.desc, [512 * 1024], b.desc, [8], [1024], 8)
    wait_ok(st)
    assert _bytes(a.base + 512 * 1024, 1024) == payload[:1024]
    st = a.backend.post(
        "read", a.desc, [600 * 1024 + i * 100 for i in range(5)], b.desc, roffs[:5], [100] * 5, 9
    )
    wait_ok(st)
    for i in range(5):
        assert _bytes(a.base + 600 * 1024 + i * 100, 100) == payload[loffs[i] : loffs[i] + 100]
    for s in (a, b):
        s.backend.close()


def test_contiguous_blocks_merge_into_one_copy(node: Node, sg: ModuleType) -> None:
    a = make_side(node, sg, "a", 1000)
    b = make_side(node, sg, "b", 1001)
    connect(a, b)
    _fill(a.base, bytes(range(256)) * 256)
    offs = [i * 4096 for i in range(16)]
    wait_ok(a.backend.post("write", a.desc, offs, b.desc, offs, [4096] * 16, 1))
    assert a.backend.counters == {"copies": 1, "kernel_launches": 0, "kernel_blocks": 0, "transfers": 1}
    assert _bytes(b.base, 65536) == bytes(range(256)) * 256
    a.backend.close()
    b.backend.close()


def test_large_blocks_use_copy_engines_next_to_the_kernel(node: Node, sg: ModuleType) -> None:
    a = make_side(node, sg, "a", 1000, size=4 * MiB)
    b = make_side(node, sg, "b", 1001, size=4 * MiB)
    connect(a, b)
    data = os.urandom(4 * MiB)
    _fill(a.base, data)
    # 8 small strided blocks and one 2 MiB block
    loffs = [i * 8192 for i in range(8)] + [2 * MiB]
    sizes = [4096] * 8 + [2 * MiB]
    wait_ok(a.backend.post("write", a.desc, loffs, b.desc, loffs, sizes, 3))
    for lo, n in zip(loffs, sizes, strict=True):
        assert _bytes(b.base + lo, n) == data[lo : lo + n]
    c = a.backend.counters
    assert (c["kernel_launches"], c["kernel_blocks"], c["copies"]) == (1, 8, 1)
    assert a.backend.launches == [(8, 8, 1, 128)]  # word 8, 8 blocks, one program each
    a.backend.close()
    b.backend.close()


def test_tracing_launches_the_traced_kernel_until_disabled(
    node: Node, sg: ModuleType, tmp_path: Path
) -> None:
    """enable_tracing: the queue launches the traced variants with the buffer's address (every
    program records its spans); disable_tracing: the untraced ones again, recording nothing; the
    data is byte-exact either way."""
    from mori import viz
    from mori.core.errors import MoriStateError, MoriTypeError

    a = make_side(node, sg, "a", 1000)
    b = make_side(node, sg, "b", 1001)
    connect(a, b)
    data = os.urandom(256 * 1024)
    _fill(a.base, data)
    offs = [i * 8192 for i in range(16)]

    def batch(uid: int, remote: int) -> None:
        roffs = [remote + o // 2 for o in offs]
        wait_ok(a.backend.post("write", a.desc, offs, b.desc, roffs, [1000] * 16, uid))
        for lo, ro in zip(offs, roffs, strict=True):
            assert _bytes(b.base + ro, 1000) == data[lo : lo + 1000]

    assert a.backend.trace_buffer is None
    with pytest.raises(MoriTypeError, match=r"enable_tracing.*buffer"):
        a.backend.enable_tracing(viz.TraceBuffer(4, 8, device="meta", calibrate=False))
    buf = a.backend.enable_tracing(n_rings=32, capacity=16)
    assert a.backend.trace_buffer is buf and buf.device == torch.device("cpu")
    batch(1, 0)
    assert a.backend.launches[-1] == (8 | TRACED, 16, 1, 128)
    check_rings(buf, 16, 1)
    a.backend.disable_tracing()
    assert a.backend.trace_buffer is None
    batch(2, 256 * 1024)
    assert a.backend.launches[-1] == (8, 16, 1, 128)  # the untraced variant, which records nothing
    check_rings(buf, 16, 1)
    assert a.backend.enable_tracing(buf) is buf  # the same buffer again: its rings go on
    batch(3, 512 * 1024)
    check_rings(buf, 16, 2)
    check_export(buf, tmp_path / "io.json", 16 * 2 * 3)
    a.backend.close()
    with pytest.raises(MoriStateError, match="enable_tracing: the XGMI backend was removed"):
        a.backend.enable_tracing()
    b.backend.close()


def test_replaced_trace_buffers_are_released_and_bounded(
    node: Node, sg: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trace buffer replaced by a later enable/disable_tracing is held only while transfers are
    pending (they may still record into it), and at most TRACE_KEPT_REPLACED of them: replacing
    one more first waits for the queue to drain, with a timeout that names the variable."""
    import gc
    import weakref

    from mori import viz

    a = make_side(node, sg, "a", 1000)
    first = a.backend.enable_tracing(n_rings=8, capacity=8)
    gone = weakref.ref(first)
    for _ in range(2 * xgmi.TRACE_KEPT_REPLACED):  # nothing pending: each replaced one is let go
        a.backend.enable_tracing(viz.TraceBuffer(8, 8, device="cpu", calibrate=False))
        assert len(a.backend._trace_kept) == 1
    del first
    gc.collect()
    assert gone() is None
    a.backend.disable_tracing()
    assert a.backend._trace_kept == []

    queue, pending = a.backend._queue, {"n": 1}

    class Busy:  # the native queue, with a transfer reported pending
        def __getattr__(self, name: str) -> Any:
            return getattr(queue, name)

        def counters(self) -> dict[str, int]:
            return {**queue.counters(), "pending": pending["n"]}

    monkeypatch.setattr(a.backend, "_queue", Busy())
    monkeypatch.setenv("MORI_IO_CP_TIMEOUT_MS", "50")
    kept = [a.backend.enable_tracing(n_rings=8, capacity=8) for _ in range(xgmi.TRACE_KEPT_REPLACED + 1)]
    assert [id(b) for b in a.backend._trace_kept] == [id(b) for b in kept]  # the current one + 4 replaced
    with pytest.raises(MoriTimeoutError, match="MORI_IO_CP_TIMEOUT_MS=50 ms"):
        a.backend.enable_tracing(n_rings=8, capacity=8)
    assert a.backend.trace_buffer is kept[-1] and len(a.backend._trace_kept) == len(kept)  # unchanged
    pending["n"] = 0
    last = a.backend.enable_tracing(n_rings=8, capacity=8)
    assert a.backend._trace_kept == [last]
    monkeypatch.setattr(a.backend, "_queue", queue)
    a.backend.close()


def test_statuses_complete_without_wait_and_mappings_are_cached(node: Node, sg: ModuleType) -> None:
    a = make_side(node, sg, "a", 1000)
    b = make_side(node, sg, "b", 1001)
    connect(a, b)
    statuses = [a.backend.post("write", a.desc, [0], b.desc, [i * 64], [64], i) for i in range(20)]
    deadline = time.monotonic() + 5
    while not all(s.Succeeded() for s in statuses) and time.monotonic() < deadline:
        time.sleep(0.001)  # nobody calls Wait(): the completion thread finishes them
    assert all(s.Succeeded() for s in statuses)
    assert a.rt.lib.calls.count(node.call("ipc_open")) == 1
    # forgetting the remote engine unmaps its regions
    a.backend.on_deregister_remote_engine(EngineDesc("b", "node-a", "h", "127.0.0.1", 1, 2))
    assert a.rt.lib.opened == {}
    assert not a.backend.supports(a.desc, b.desc)  # b's node is unknown now
    a.backend.close()
    b.backend.close()


def test_concurrent_posts_from_several_threads(
    node: Node, sg: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    monkeypatch.setenv(
        "MORI_IO_XGMI_SCATTER_GATHER_THRESHOLD", "0"
    )  # copies only (the interpreter is not thread-safe)
    a = make_side(node, sg, "a", 1000, num_streams=4, num_events=2)
    b = make_side(node, sg, "b", 1001)
    connect(a, b)
    data = os.urandom(MiB)
    _fill(a.base, data)
    errors: list[str] = []

    def worker(t: int) -> None:
        for i in range(50):
            off = (t * 50 + i) * 1024
            st = a.backend.post(
                "write", a.desc, [off, off + 512], b.desc, [off, off + 512 + 256], [256, 256], i
            )
            if not st.WaitFor(5000) or not st.Succeeded():
                errors.append(st.Message())

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    for k in range(200):
        off = k * 1024
        assert _bytes(b.base + off, 256) == data[off : off + 256]
        assert _bytes(b.base + off + 768, 256) == data[off + 512 : off + 768]
    assert a.backend.counters["transfers"] == 200 and a.backend.counters["copies"] == 400
    c = a.backend._queue.counters()
    # 2 events made up front; more only while that many are in use (4 threads x at most 2 streams)
    assert c["pending"] == 0 and 2 <= c["events"] <= 8
    assert a.rt.lib.calls.count(node.call("ipc_open")) <= 4
    a.backend.close()
    b.backend.close()


def test_two_threads_mapping_one_region_at_once_both_succeed(
    node: Node, sg: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two first posts to one remote region, both opening its mapping: the first mapping recorded
    stays (a post may already hold its token) and the other is closed. Forced order: "late" opens
    first and records its mapping only after "early" opened, recorded and is about to post. (The
    late one used to replace the early one's mapping and retire its token: the early post failed
    with "a region was deregistered".)"""
    monkeypatch.setenv("MORI_IO_XGMI_SCATTER_GATHER_THRESHOLD", "0")
    a = make_side(node, sg, "a", 1000, num_streams=2)
    b = make_side(node, sg, "b", 1001)
    connect(a, b)
    data = os.urandom(8192)
    _fill(a.base, data)
    late_opening, early_posting, late_posting = threading.Event(), threading.Event(), threading.Event()
    real_open, queue = a.backend.runtime.open_range, a.backend._queue

    def open_range(handle: bytes) -> Any:
        seg = real_open(handle)
        if threading.current_thread().name == "late":
            late_opening.set()
            assert early_posting.wait(10)
        return seg

    class Queue:  # the native queue, with the early post held until the late one posted
        def __getattr__(self, name: str) -> Any:
            return getattr(queue, name)

        def post(self, *args: Any) -> Any:
            if threading.current_thread().name == "early":
                early_posting.set()
                assert late_posting.wait(10)
            else:
                late_posting.set()
            return queue.post(*args)

    monkeypatch.setattr(a.backend.runtime, "open_range", open_range)
    monkeypatch.setattr(a.backend, "_queue", Queue())
    results: dict[str, tuple[bool, str]] = {}

    def worker(t: int) -> None:
        st = a.backend.post("write", a.desc, [t * 4096], b.desc, [t * 4096], [4096], t)
        results[threading.current_thread().name] = (st.WaitFor(5000) and st.Succeeded(), st.Message())

    late = threading.Thread(target=worker, args=(1,), name="late")
    early = threading.Thread(target=worker, args=(0,), name="early")
    late.start()
    assert late_opening.wait(10)
    early.start()
    for th in (late, early):
        th.join()
    assert sorted(results) == ["early", "late"] and all(ok for ok, _ in results.values()), results
    assert _bytes(b.base, 8192) == data
    assert len(a.backend._mapped) == 1
    monkeypatch.setattr(a.backend, "_queue", queue)
    monkeypatch.setattr(a.backend.runtime, "open_range", real_open)
    wait_ok(a.backend.post("write", a.desc, [0], b.desc, [0], [64], 9))  # later posts reuse the kept one
    # both opens share one driver mapping (refcounted): it is unmapped at close only if the spare
    # segment was closed as well
    assert a.rt.lib.calls.count(node.call("ipc_open")) == 1
    assert a.rt.lib.calls.count(node.call("ipc_close")) == 0
    a.backend.close()
    assert a.rt.lib.calls.count(node.call("ipc_close")) == 1
    b.backend.close()


def test_supports_only_gpu_pairs_of_one_node_with_matching_handles(node: Node, sg: ModuleType) -> None:
    a = make_side(node, sg, "a", 1000)
    b = make_side(node, sg, "b", 1001)
    c = make_side(node, sg, "c", 1002)
    connect(a, b)
    a.backend.on_register_remote_engine(EngineDesc("c", "node-b", "h", "127.0.0.1", 1, 2))
    assert a.backend.supports(a.desc, b.desc)
    assert not a.backend.supports(a.desc, c.desc)  # another node
    cpu = MemoryDesc(**{**b.desc.__dict__, "loc": int(MemoryLocationType.CPU)})
    assert not a.backend.supports(a.desc, cpu)
    bigger = MemoryDesc(**{**b.desc.__dict__, "size": b.desc.size + 1})  # claims more than was exported
    assert not a.backend.supports(a.desc, bigger)
    moved = MemoryDesc(**{**b.desc.__dict__, "data": b.desc.data - 64})
    assert not a.backend.supports(a.desc, moved)
    foreign = MemoryDesc(**{**b.desc.__dict__, "ipc_handle": node.vendor.other_magic + b.desc.ipc_handle[4:]})
    assert not a.backend.supports(a.desc, foreign)
    assert not a.backend.supports(b.desc, b.desc)  # local_desc must be this engine's
    assert a.backend.on_register_memory(MemoryDesc("a", 99, -1, "", 4096, 64, 1, -1, b"")) is None
    for s in (a, b, c):
        s.backend.close()


def test_memory_ipc_cannot_share_is_registered_but_not_served(node: Node, sg: ModuleType) -> None:
    a = make_side(node, sg, "a", 1000)
    b = make_side(node, sg, "b", 1001)
    connect(a, b)
    host = (ctypes.c_uint8 * 4096)()  # not memory of the GPU driver: export_range refuses it
    desc = MemoryDesc("a", 4242, 0, "", ctypes.addressof(host), 4096, GPU, -1, b"")
    assert a.backend.on_register_memory(desc) is None
    assert "is not GPU memory allocated with" in a.backend.export_errors[4242]
    assert not a.backend.supports(desc, b.desc)
    a.backend.on_deregister_memory(desc)
    assert 4242 not in a.backend.export_errors
    a.backend.close()
    b.backend.close()


def test_a_failed_copy_fails_the_status_with_the_driver_message(node: Node, sg: ModuleType) -> None:
    a = make_side(node, sg, "a", 1000)
    b = make_side(node, sg, "b", 1001)
    connect(a, b)
    memcpy, sync = node.call("memcpy"), node.call("event_synchronize")
    a.rt.lib.fail[memcpy] = 700
    st = a.backend.post("write", a.desc, [0], b.desc, [0], [4096], 5)
    assert st.Failed() and st.Code() == StatusCode.ERR_GPU_OP
    assert f"{memcpy} failed" in st.Message() and "uid 5" in st.Message()
    del a.rt.lib.fail[memcpy]
    # an error the GPU reports later: every event call fails (as a sticky error does)
    query = node.call("event_query")
    a.rt.lib.fail[sync] = a.rt.lib.fail[query] = 700
    st = a.backend.post("write", a.desc, [0], b.desc, [0], [4096], 6)
    assert st.WaitFor(5000) and st.Code() == StatusCode.ERR_GPU_OP and "uid 6" in st.Message()
    assert sync in st.Message() or query in st.Message()
    st = a.backend.post("write", a.desc, [0], b.desc, [0], [4096], 7)
    st.Wait()  # Wait() (or the completion thread) synchronizes the event
    assert st.Code() == StatusCode.ERR_GPU_OP and sync in st.Message() and "uid 7" in st.Message()
    del a.rt.lib.fail[sync], a.rt.lib.fail[query]
    wait_ok(a.backend.post("write", a.desc, [0], b.desc, [0], [4096], 7))  # the backend still works
    a.backend.close()
    b.backend.close()


def test_blocks_outside_either_region_fail_and_copy_nothing(node: Node, sg: ModuleType) -> None:
    a = make_side(node, sg, "a", 1000, size=64 * 1024)
    b = make_side(node, sg, "b", 1001, size=64 * 1024)
    connect(a, b)
    assert a.backend.checks_ranges
    _fill(a.base, b"\x11" * 4096)
    for loffs, roffs, sizes, side in (
        ([0], [64 * 1024 - 8], [16], "remote"),
        ([64 * 1024 - 8], [0], [16], "local"),
        ([i * 64 for i in range(20)], [i * 64 for i in range(19)] + [1 << 20], [64] * 20, "remote"),
    ):
        st = a.backend.post("write", a.desc, loffs, b.desc, roffs, sizes, 9)
        assert st.Failed() and st.Code() == StatusCode.ERR_INVALID_ARGS
        assert st.Message().startswith(
            f"XGMI write uid 9 ({len(sizes)} blocks) with engine 'b': {side} block"
        )
    assert _bytes(b.base, 4096) == bytes(4096)  # nothing was copied
    assert a.backend.counters["transfers"] == 0
    a.backend.close()
    b.backend.close()


def test_an_unmappable_region_raises_for_failover(node: Node, sg: ModuleType) -> None:
    a = make_side(node, sg, "a", 1000)
    b = make_side(node, sg, "b", 1001)
    connect(a, b)
    a.rt.lib.fail[node.call("ipc_open")] = 1
    with pytest.raises(MoriBackendError, match=r"XGMI: cannot map region .* of engine 'b'"):
        a.backend.post("write", a.desc, [0], b.desc, [0], [64], 1)
    a.backend.close()
    b.backend.close()


def test_same_process_regions_are_used_without_ipc(node: Node, sg: ModuleType) -> None:
    rt = node.runtime(1000)
    backend = node.backend("a", rt)
    alloc = gpu_alloc(rt, 2 * MiB)
    x = Side(backend, rt, "a", alloc, 0, MiB)
    y = Side(backend, rt, "a", alloc, MiB, MiB)  # another region of the same allocation
    _fill(x.base, b"hello xgmi")
    wait_ok(backend.post("write", x.desc, [0], y.desc, [100], [10], 1))
    assert _bytes(y.base + 100, 10) == b"hello xgmi"
    assert node.call("ipc_open") not in rt.lib.calls
    backend.close()


def test_kernel_reaches_own_gpu_and_ipc_mappings_only() -> None:
    from mori.core.gpu.handles import KIND_RANGE, PciAddress, SegmentHandle

    gpu0, gpu1 = PciAddress.parse("0000:1b:00.0"), PciAddress.parse("0000:2c:00.0")

    def h(pci: PciAddress, pid: int) -> SegmentHandle:
        return SegmentHandle(KIND_RANGE, pid, 0, pci, 4096, 0, 64, bytes(64))

    assert xgmi.kernel_reaches(h(gpu0, 7), gpu0, 7)  # this GPU, this process
    assert xgmi.kernel_reaches(h(gpu1, 8), gpu0, 7)  # another process: IPC enables peer access
    assert not xgmi.kernel_reaches(h(gpu1, 7), gpu0, 7)  # another GPU of this process: maybe no peer access


def test_descriptor_tables_are_reused_only_after_their_kernel(
    node: Node, sg: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MORI_IO_XGMI_SCATTER_GATHER_THRESHOLD", "4")
    monkeypatch.setattr(xgmi, "TABLE_ENTRIES", 64)  # small tables: a batch of 74 blocks needs two
    a = make_side(node, sg, "a", 1000)
    b = make_side(node, sg, "b", 1001)
    connect(a, b)
    _fill(a.base, bytes(range(256)) * 64)
    offs = [i * 512 for i in range(8)]

    def batch(uid: int) -> None:
        wait_ok(a.backend.post("write", a.desc, offs, b.desc, [o + uid for o in offs], [256] * 8, uid))
        for o in offs:
            assert _bytes(b.base + o + uid, 256) == (bytes(range(256)) * 64)[o : o + 256]

    batch(1)  # table 0 of the ring
    first = a.backend._tables[0][2]  # its event, recorded after the kernel that read it
    a.rt.lib.not_ready.add(first)  # as if that kernel still ran
    for uid in range(2, xgmi.NUM_TABLES + 1):  # the other tables of the ring
        batch(uid)
    assert first in a.rt.lib.not_ready  # nobody waited for it yet
    batch(xgmi.NUM_TABLES + 1)  # table 0 again: only after its kernel (the fake's sync clears it)
    assert first not in a.rt.lib.not_ready
    assert a.backend.counters["kernel_launches"] == xgmi.NUM_TABLES + 1
    # a batch larger than a table: one launch per table's worth of blocks
    many = [i * 16 for i in range(74)]
    _fill(a.base, os.urandom(74 * 16))
    wait_ok(a.backend.post("write", a.desc, many, b.desc, many, [8] * len(many), 99))
    assert [n for _, n, _, _ in a.backend.launches[-2:]] == [64, 10]
    assert all(_bytes(b.base + o, 8) == _bytes(a.base + o, 8) for o in many)
    a.backend.close()
    b.backend.close()
    assert first not in a.rt.lib.events  # tables (and their events) are freed on close


def _held_events(rt: Any) -> Any:
    """Make the fake driver's event synchronize block while its event is in ``not_ready`` (as a
    real one blocks while the GPU works); before the backend binds its driver functions."""
    lib = rt.lib
    sync = lib.op_event_synchronize

    def held(name: str, event: int) -> int:
        deadline = time.monotonic() + 10
        while event in lib.not_ready and time.monotonic() < deadline:
            time.sleep(0.001)
        return int(sync(name, event))

    lib.op_event_synchronize = held
    return lib


def test_wait_completes_in_the_calling_thread_and_wait_for_polls(node: Node, sg: ModuleType) -> None:
    rt = node.runtime(1000)
    lib = _held_events(rt)
    backend = node.backend("a", rt)
    a = Side(backend, rt, "a", gpu_alloc(rt, MiB + 4096), 0, MiB)
    b = make_side(node, sg, "b", 1001)
    connect(a, b)
    _fill(a.base, b"0123456789abcdef")
    st = a.backend.post("write", a.desc, [0], b.desc, [64], [16], 1)
    st.Wait()
    assert st.Succeeded() and _bytes(b.base + 64, 16) == b"0123456789abcdef"
    # the GPU "still works": WaitFor polls the events -> False after the timeout, True once done
    lib.not_ready.update(lib.events)
    st = a.backend.post("read", a.desc, [128], b.desc, [64], [16], 2)
    assert not st.WaitFor(0) and not st.WaitFor(20) and st.InProgress()
    lib.not_ready.clear()
    assert st.WaitFor(1000) and st.Succeeded() and _bytes(a.base + 128, 16) == b"0123456789abcdef"
    # Wait() blocks until the events are done, wherever the completion happens
    lib.not_ready.update(lib.events)
    st = a.backend.post("write", a.desc, [0], b.desc, [256], [16], 3)
    returned = threading.Event()
    waiter = threading.Thread(target=lambda: (st.Wait(), returned.set()))
    waiter.start()
    assert not returned.wait(0.2) and st.InProgress(), "Wait() returned before the copies finished"
    lib.not_ready.clear()
    assert returned.wait(5) and st.Succeeded()
    waiter.join()
    # statuses nobody waits for complete by themselves, and Wait() on them returns
    statuses = [a.backend.post("write", a.desc, [0], b.desc, [i * 16], [16], 10 + i) for i in range(8)]
    deadline = time.monotonic() + 5
    while not all(x.Succeeded() for x in statuses) and time.monotonic() < deadline:
        time.sleep(0.001)
    for x in statuses:
        x.Wait()
        assert x.Succeeded()
    assert a.backend._queue.counters()["pending"] == 0
    a.backend.close()
    b.backend.close()


def test_deregistration_fails_new_transfers_and_waits_for_those_in_flight(node: Node, sg: ModuleType) -> None:
    rt = node.runtime(1000)
    lib = _held_events(rt)
    backend = node.backend("a", rt)
    a = Side(backend, rt, "a", gpu_alloc(rt, MiB + 4096), 0, MiB)
    b = make_side(node, sg, "b", 1001)
    connect(a, b)
    fast = backend.session_post(a.desc, b.desc)  # what an IOEngineSession posts through
    wait_ok(fast.write(0, 0, 64, 1))
    lib.not_ready.update(lib.events)  # the next copy "runs" until cleared
    st = fast.write(0, 64, 64, 2)
    done = threading.Event()
    dereg = threading.Thread(target=lambda: (backend.on_deregister_memory(a.desc), done.set()))
    dereg.start()
    assert not done.wait(0.2), "deregistration returned while a transfer on the region was in flight"
    assert st.InProgress()
    lib.not_ready.clear()
    assert done.wait(5)
    dereg.join()
    assert st.Succeeded()
    late = fast.write(0, 128, 64, 3)  # the session still holds the region's address: refused
    assert late.Failed() and late.Code() == StatusCode.ERR_INVALID_ARGS
    assert "a region was deregistered" in late.Message()
    with pytest.raises(MoriBackendError, match="not exported"):
        backend.post("write", a.desc, [0], b.desc, [0], [8], 4)
    # the remote side: forgetting the engine retires its mappings the same way
    fast_b = b.backend.session_post(b.desc, a.desc)
    b.backend.on_deregister_remote_engine(EngineDesc("a", "node-a", "h", "127.0.0.1", 1, 2))
    assert fast_b.read(0, 0, 8, 5).Code() == StatusCode.ERR_INVALID_ARGS
    a.backend.close()
    b.backend.close()


def test_a_queue_dropped_without_close_completes_its_transfers_first(node: Node, sg: ModuleType) -> None:
    a = make_side(node, sg, "a", 1000)
    b = make_side(node, sg, "b", 1001)
    connect(a, b)
    statuses = [a.backend.post("write", a.desc, [0], b.desc, [i * 8], [8], i) for i in range(50)]
    a.backend._queue = None  # the last reference: the native queue is destroyed here
    assert all(st.Succeeded() for st in statuses)
    for st in statuses:
        st.Wait()  # its waiter finds no queue, and a completed status
    a.backend.close()
    b.backend.close()


def test_blocks_merge_only_where_they_continue_on_both_sides(node: Node, sg: ModuleType) -> None:
    a = make_side(node, sg, "a", 1000)
    b = make_side(node, sg, "b", 1001)
    connect(a, b)
    data = os.urandom(8192)
    _fill(a.base, data)
    # 0+1 continue on both sides; 2 continues the local side only; 3 is empty; 4 starts anew
    loffs, roffs, sizes = [0, 100, 200, 300, 300], [1000, 1100, 1300, 1400, 2000], [100, 100, 100, 0, 50]
    wait_ok(a.backend.post("write", a.desc, loffs, b.desc, roffs, sizes, 1))
    assert a.backend.counters["copies"] == 3  # [0,200) as one, 200, 300
    for lo, ro, n in zip(loffs, roffs, sizes, strict=True):
        assert _bytes(b.base + ro, n) == data[lo : lo + n]
    wait_ok(a.backend.post("write", a.desc, [0, 8], b.desc, [0, 8], [0, 0], 2))  # nothing to copy
    a.backend.close()
    b.backend.close()


def test_batches_to_another_gpu_of_this_process_use_copy_engines(
    node: Node, sg: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MORI_IO_XGMI_SCATTER_GATHER_THRESHOLD", "2")
    rt = node.runtime(1000, device=0)
    backend = node.backend("a", rt)
    here = Side(backend, rt, "a", gpu_alloc(rt, MiB), 0, MiB)
    st = rt.bound_device()
    with st.active():  # memory of GPU 1, allocated by this same process
        ctx1 = st.drv.primary_context_retain(st.drv.device(1))
        prev = st.drv.current_context()
        st.drv.set_current_context(ctx1)
        other = st.drv.mem_alloc(MiB)
        st.drv.set_current_context(prev)
    there = Side(backend, rt, "a", other, 0, MiB)
    _fill(here.base, bytes(range(256)) * 16)
    offs = [i * 512 for i in range(8)]
    wait_ok(backend.post("write", here.desc, offs, there.desc, offs, [256] * 8, 1))
    assert (backend.counters["kernel_launches"], backend.counters["copies"]) == (0, 8)
    for o in offs:
        assert _bytes(there.base + o, 256) == (bytes(range(256)) * 16)[o : o + 256]
    # within GPU 0 the kernel is used
    wait_ok(backend.post("write", here.desc, offs, here.desc, [MiB // 2 + o for o in offs], [256] * 8, 2))
    assert backend.counters["kernel_launches"] == 1
    backend.close()


# -- through IOEngine ------------------------------------------------------------------------------------------


def test_create_backend_says_why_there_is_no_gpu_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    def none() -> Any:
        raise MoriBackendError(
            "create_backend(XGMI): no usable GPU runtime: cuda (mori-backend-nvlink): no GPU"
        )

    monkeypatch.setattr(xgmi, "find_gpu_runtime", none)
    with (
        IOEngine("x", IOEngineConfig("127.0.0.1", 0)) as engine,
        pytest.raises(MoriBackendError, match="no usable GPU runtime"),
    ):
        engine.create_backend(BackendType.XGMI, XgmiBackendConfig(num_streams=2))


def test_find_gpu_runtime_on_this_machine() -> None:
    try:
        rt = xgmi.find_gpu_runtime()
    except MoriBackendError as e:
        assert "no usable GPU runtime" in str(e)
    else:
        assert rt.name in ("cuda", "hip")


def test_io_engines_route_gpu_memory_through_xgmi(
    node: Node, sg: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two engines of one (real) process, each on its own fake 'process' runtime: the public API end to end."""
    runtimes = iter([node.runtime(1000, device=0), node.runtime(1001, device=1)])
    monkeypatch.setattr(xgmi, "find_gpu_runtime", lambda: next(runtimes))
    monkeypatch.setattr(xgmi, "XgmiBackend", interpreted_backend_class(sg))
    with (
        IOEngine("ea", IOEngineConfig("127.0.0.1", 0)) as ea,
        IOEngine("eb", IOEngineConfig("127.0.0.1", 0)) as eb,
    ):
        ea.create_backend(BackendType.XGMI, XgmiBackendConfig(num_streams=4, num_events=4))
        eb.create_backend(BackendType.XGMI)
        ba, bb = ea._backends[BackendType.XGMI], eb._backends[BackendType.XGMI]
        assert isinstance(ba, XgmiBackend) and isinstance(bb, XgmiBackend)
        pa, pb = gpu_alloc(ba.runtime, 2 * MiB), gpu_alloc(bb.runtime, 2 * MiB)
        da = ea.register_memory(pa, MiB, 0, MemoryLocationType.GPU)
        db = eb.register_memory(pb + 8192, MiB, 1, MemoryLocationType.GPU)
        assert da.ipc_handle and db.ipc_handle
        ea.register_remote_engine(eb.get_engine_desc())
        eb.register_remote_engine(ea.get_engine_desc())
        remote = MemoryDesc.unpack(db.pack())  # as it travels between processes
        _fill(pa, bytes(range(256)) * 64)
        sess = ea.create_session(da, remote)
        assert sess is not None
        assert type(sess._fast).__name__ == "XgmiSessionPost"  # posts go straight to the native queue
        wait_ok(sess.batch_write([i * 512 for i in range(32)], [i * 1024 for i in range(32)], [256] * 32, 1))
        assert ba.counters["transfers"] == 1 and ba.counters["kernel_launches"] == 1
        for i in range(32):
            assert _bytes(pb + 8192 + i * 1024, 256) == (bytes(range(256)) * 64)[i * 512 : i * 512 + 256]
        wait_ok(ea.read(da, MiB - 256, remote, 0, 256, ea.allocate_transfer_uid()))
        assert _bytes(pa + MiB - 256, 256) == bytes(range(256))
        assert ea._route_name(da, remote) == "InterpretedXgmi"
        # traced through the engine: the same batch again, every program records
        buf = ea.enable_tracing(n_rings=64, capacity=16)
        assert ea.trace_buffer is buf and eb.trace_buffer is None
        wait_ok(sess.batch_write([i * 512 for i in range(32)], [i * 1024 for i in range(32)], [256] * 32, 2))
        check_rings(buf, 32, 1)
        ea.disable_tracing()
        assert ea.trace_buffer is None
        # out of range: the engine refuses before the backend
        st = ea.write(da, 0, remote, MiB - 8, 16, ea.allocate_transfer_uid())
        assert st.Failed() and st.Code() == StatusCode.ERR_INVALID_ARGS
        assert eb.pop_inbound_transfer_status("ea", 1) is None  # XGMI has no notifications
        ea.deregister_memory(da)
        eb.deregister_memory(db)


def test_io_engine_tracing_needs_an_xgmi_backend() -> None:
    from mori.core.errors import MoriStateError

    with IOEngine("nt", IOEngineConfig("127.0.0.1", 0)) as engine:
        engine.create_backend(BackendType.TCP)
        with pytest.raises(MoriStateError, match=r"enable_tracing: engine 'nt' has no XGMI backend \(TCP\)"):
            engine.enable_tracing()
        engine.disable_tracing()  # nothing to turn off
        assert engine.trace_buffer is None


def test_tcp_carries_gpu_memory_through_the_runtime_copier(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No XGMI backend: the first GPU registration installs mori.io.staging's copier on the
    runtime, and the TCP backend moves GPU regions through host staging, byte-exact both ways."""
    ra, rb = node.runtime(1000, device=0), node.runtime(1001, device=1)
    runtimes = iter([ra, rb])
    monkeypatch.setattr(xgmi, "find_gpu_runtime", lambda: next(runtimes))
    size = 3 * MiB + 512  # several staging pieces, the last one partial
    pa, pb = gpu_alloc(ra, size), gpu_alloc(rb, size)
    with (
        IOEngine("ta", IOEngineConfig("127.0.0.1", 0)) as ea,
        IOEngine("tb", IOEngineConfig("127.0.0.1", 0)) as eb,
    ):
        assert not ea._native.has_device_copier()
        ea.create_backend(BackendType.TCP)
        eb.create_backend(BackendType.TCP)
        da = ea.register_memory(pa, size, 0, MemoryLocationType.GPU)
        db = eb.register_memory(pb, size, 1, MemoryLocationType.GPU)
        assert ea._native.has_device_copier() and eb._native.has_device_copier()
        # each copies for the GPUs it holds regions on, no other (no context made on the rest)
        assert ea._device_copier.devices == {0} and eb._device_copier.devices == {1}
        ea.register_remote_engine(eb.get_engine_desc())
        eb.register_remote_engine(ea.get_engine_desc())
        remote = MemoryDesc.unpack(db.pack())
        assert ea._route_name(da, remote).startswith("tcp")
        pattern = bytes(range(251)) * (size // 251 + 1)
        _fill(pa, pattern[:size])
        wait_ok(ea.write(da, 0, remote, 0, size, ea.allocate_transfer_uid()))
        assert _bytes(pb, size) == pattern[:size]
        _fill(pb + MiB, b"\x5a" * 4096)
        wait_ok(ea.read(da, 100, remote, MiB, 4096, ea.allocate_transfer_uid()))
        assert _bytes(pa + 100, 4096) == b"\x5a" * 4096
        copied = ea._device_copier.copies + eb._device_copier.copies
        assert copied >= 2 * 4 + 2, f"the copier staged {copied} pieces"
        ea.deregister_memory(da)
        eb.deregister_memory(db)


# -- real GPUs -------------------------------------------------------------------------------------------------


def _two_gpus() -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")


@pytest.mark.gpu
def test_gpu_kernel_matches_on_device() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from mori.io import xgmi_kernels

    src = torch.randint(0, 256, (1 << 22,), dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros(1 << 22, dtype=torch.uint8, device="cuda:0")
    blocks = [Block(dst.data_ptr() + i * 32768, src.data_ptr() + i * 16384, 16384) for i in range(128)]
    table = torch.tensor(
        [[b.dst for b in blocks], [b.src for b in blocks], [b.size // 8 for b in blocks]],
        dtype=torch.int64,
        device="cuda:0",
    )
    torch.cuda.set_device(0)
    xgmi_kernels.scatter_gather_kernel[(128, 1)](table, 128, 1, WORD_BYTES=8, BLOCK=1024)
    torch.cuda.synchronize(0)
    for i in range(128):
        assert torch.equal(dst[i * 32768 : i * 32768 + 16384].cpu(), src[i * 16384 : (i + 1) * 16384].cpu())


@pytest.mark.gpu
def test_gpu_two_engines_of_one_process_on_one_gpu() -> None:
    """No IPC: the kernel path and the copy path through the public API on one GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    torch.cuda.set_device(0)
    src = torch.randint(0, 256, (4 * MiB,), dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros(8 * MiB, dtype=torch.uint8, device="cuda:0")
    with (
        IOEngine("x", IOEngineConfig("127.0.0.1", 0)) as ex,
        IOEngine("y", IOEngineConfig("127.0.0.1", 0)) as ey,
    ):
        ex.create_backend(BackendType.XGMI, XgmiBackendConfig(num_streams=8, num_events=8))
        ey.create_backend(BackendType.XGMI)
        ds, dd = ex.register_torch_tensor(src), ey.register_torch_tensor(dst[MiB:])  # a sub-range
        ex.register_remote_engine(ey.get_engine_desc())
        offs = [i * 16384 for i in range(128)]
        remote_offs = [2 * o for o in offs]
        st = ex.batch_write([ds], [offs], [dd], [remote_offs], [[16384] * 128], [1])[0]
        wait_ok(st)
        backend = ex._backends[BackendType.XGMI]
        assert isinstance(backend, XgmiBackend) and backend.counters["kernel_launches"] == 1
        torch.cuda.synchronize()
        for o, r in zip(offs, remote_offs, strict=True):
            assert torch.equal(dst[MiB + r : MiB + r + 16384], src[o : o + 16384])
        wait_ok(ex.write(ds, 2 * MiB, dd, 5 * MiB, 2 * MiB, 2))  # dst[6 MiB, 8 MiB)
        torch.cuda.synchronize()
        assert torch.equal(dst[6 * MiB :], src[2 * MiB :])
        wait_ok(ex.read(ds, 0, dd, 5 * MiB, MiB, 3))
        torch.cuda.synchronize()
        assert torch.equal(src[:MiB], src[2 * MiB : 3 * MiB])


@pytest.mark.gpu
def test_gpu_traced_batches_record_every_program(tmp_path: Path) -> None:
    """IOEngine.enable_tracing on a real GPU: the driver launches the traced variant (the trace
    buffer through the native launch arguments), each of the 128 programs records kernel/table/copy,
    the export validates; after disable_tracing the untraced kernel records nothing. Data exact."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    torch.cuda.set_device(0)
    src = torch.randint(0, 256, (4 * MiB,), dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros(8 * MiB, dtype=torch.uint8, device="cuda:0")
    with (
        IOEngine("tx", IOEngineConfig("127.0.0.1", 0)) as ex,
        IOEngine("ty", IOEngineConfig("127.0.0.1", 0)) as ey,
    ):
        ex.create_backend(BackendType.XGMI)
        ey.create_backend(BackendType.XGMI)
        ds, dd = ex.register_torch_tensor(src), ey.register_torch_tensor(dst)
        ex.register_remote_engine(ey.get_engine_desc())
        buf = ex.enable_tracing(n_rings=256, capacity=64)
        assert buf.device == torch.device("cuda", 0)
        offs = [i * 16384 for i in range(128)]

        def batch(uid: int, base: int) -> None:
            roffs = [base + 2 * o for o in offs]
            wait_ok(ex.batch_write([ds], [offs], [dd], [roffs], [[16384] * 128], [uid])[0])
            torch.cuda.synchronize()
            for o, r in zip(offs, roffs, strict=True):
                assert torch.equal(dst[r : r + 16384], src[o : o + 16384])

        batch(1, 0)
        batch(2, 4 * MiB)
        backend = ex._backends[BackendType.XGMI]
        assert isinstance(backend, XgmiBackend) and backend.counters["kernel_launches"] == 2
        check_rings(buf, 128, 2)  # 16 KiB blocks: one program each
        check_export(buf, tmp_path / "io.json", 128 * 2 * 3)
        ex.disable_tracing()
        dst.zero_()
        batch(3, 0)
        assert backend.counters["kernel_launches"] == 3
        check_rings(buf, 128, 2)


@pytest.mark.gpu
def test_gpu_threads_post_singles_and_batches_at_once() -> None:
    """Four threads post into one XGMI queue at once (single blocks of many sizes and kernel
    batches), statuses waited for in any order; every byte lands where it should. Both regions on
    one GPU, so batches go through the kernel (another GPU of this same process: copy engines)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    torch.cuda.set_device(0)
    n_threads, per_thread, span = 4, 200, 256 * 1024
    src = torch.randint(0, 256, (n_threads * span,), dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros(n_threads * span, dtype=torch.uint8, device="cuda:0")
    with (
        IOEngine("tx", IOEngineConfig("127.0.0.1", 0)) as ex,
        IOEngine("ty", IOEngineConfig("127.0.0.1", 0)) as ey,
    ):
        ex.create_backend(BackendType.XGMI, XgmiBackendConfig(num_streams=8, num_events=4))
        ey.create_backend(BackendType.XGMI)
        ds, dd = ex.register_torch_tensor(src), ey.register_torch_tensor(dst)
        ex.register_remote_engine(ey.get_engine_desc())
        torch.cuda.synchronize()
        errors: list[str] = []
        written: list[tuple[int, int]] = []  # (offset, size): the same offset on both sides

        def worker(t: int) -> None:
            torch.cuda.set_device(0)
            sess = ex.create_session(ds, dd)
            assert sess is not None
            rng = random.Random(t)
            base = t * span
            pending = []
            for i in range(per_thread):
                if i % 3 == 0:  # a batch of 16 strided blocks through the kernel
                    offs = [base + k * 8192 + 8 * rng.randrange(64) for k in range(16)]
                    size = rng.choice([64, 1000, 4096])
                    pending.append(sess.batch_write(offs, offs, [size] * 16, i))
                    written.extend((o, size) for o in offs)
                else:
                    off = base + rng.randrange(0, span - 65536)
                    size = rng.choice([1, 7, 4096, 65536])
                    pending.append(sess.write(off, off, size, i))
                    written.append((off, size))
                if len(pending) > 8:
                    st = pending.pop(rng.randrange(len(pending)))
                    if not st.WaitFor(10000) or not st.Succeeded():
                        errors.append(st.Message())
            for st in pending:
                st.Wait()
                if not st.Succeeded():
                    errors.append(st.Message())

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert errors == []
        backend = ex._backends[BackendType.XGMI]
        assert backend.counters["transfers"] == n_threads * per_thread
        assert backend.counters["kernel_launches"] >= n_threads * (per_thread // 3)
        assert backend._queue.counters()["pending"] == 0
        torch.cuda.synchronize()
        mask = torch.zeros(n_threads * span, dtype=torch.bool)
        for off, size in written:
            mask[off : off + size] = True
        got, want = dst.cpu(), src.cpu()
        assert torch.equal(got[mask], want[mask])  # every block arrived
        assert not got[~mask].any()  # and nothing else was touched


@pytest.mark.gpu
def test_gpu_tcp_stages_gpu_memory_through_the_runtime_copier() -> None:
    """Only the TCP backend: GPU regions move through host staging (mori.io.staging's copier on
    the real driver), both ways, byte-exact, several pieces per transfer."""
    _two_gpus()
    torch.cuda.set_device(0)
    size = 3 * MiB + 512  # several 1 MiB pieces, the last one partial
    a = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda:0")
    b = torch.zeros(size, dtype=torch.uint8, device="cuda:1")
    with (
        IOEngine("ga", IOEngineConfig("127.0.0.1", 0)) as ea,
        IOEngine("gb", IOEngineConfig("127.0.0.1", 0)) as eb,
    ):
        ea.create_backend(BackendType.TCP)
        eb.create_backend(BackendType.TCP)
        da, db = ea.register_torch_tensor(a), eb.register_torch_tensor(b)
        ea.register_remote_engine(eb.get_engine_desc())
        eb.register_remote_engine(ea.get_engine_desc())
        remote = MemoryDesc.unpack(db.pack())
        assert ea._route_name(da, remote).startswith("tcp")
        torch.cuda.synchronize()
        wait_ok(ea.write(da, 0, remote, 0, size, ea.allocate_transfer_uid()))
        assert torch.equal(b.cpu(), a.cpu())
        b[MiB : 2 * MiB] = 7
        torch.cuda.synchronize()
        wait_ok(ea.read(da, 100, remote, MiB, MiB, ea.allocate_transfer_uid()))
        assert bool((a[100 : 100 + MiB] == 7).all())
        assert ea._device_copier.copies + eb._device_copier.copies >= 2 * 4 + 2
        ea.deregister_memory(da)
        eb.deregister_memory(db)


def _gpu_peer(conn: Any) -> None:
    torch.cuda.set_device(1)
    buf = torch.zeros(64 * MiB, dtype=torch.uint8, device="cuda:1")
    with IOEngine("peer", IOEngineConfig("127.0.0.1", 0)) as e:
        e.create_backend(BackendType.XGMI)
        # a sub-range of a larger allocation, as per-layer KV views
        d = e.register_torch_tensor(buf[MiB:])
        conn.send((e.get_engine_desc().pack(), d.pack()))
        conn.recv()
        conn.send(buf[MiB : MiB + 8 * MiB].cpu())
        conn.recv()


@pytest.mark.gpu
def test_gpu_two_processes_write_read_batch() -> None:
    _two_gpus()
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_gpu_peer, args=(child,))
    p.start()
    try:
        ed, md = parent.recv()
        torch.cuda.set_device(0)
        src = torch.randint(0, 256, (8 * MiB,), dtype=torch.uint8, device="cuda:0")
        with IOEngine("init", IOEngineConfig("127.0.0.1", 0)) as e:
            e.create_backend(BackendType.XGMI)
            local = e.register_torch_tensor(src)
            remote = MemoryDesc.unpack(md)
            e.register_remote_engine(EngineDesc.unpack(ed))
            wait_ok(e.write(local, 0, remote, 0, 2 * MiB, e.allocate_transfer_uid()))
            offs = [i * 16384 for i in range(128)]
            st = e.batch_write(
                [local],
                [[2 * MiB + o for o in offs]],
                [remote],
                [[2 * MiB + 2 * o for o in offs]],
                [[8192] * 128],
                [1],
            )[0]
            wait_ok(st)
            parent.send("copy")
            got = parent.recv()
            host = src.cpu()
            assert torch.equal(got[: 2 * MiB], host[: 2 * MiB])
            for o in offs:
                assert torch.equal(
                    got[2 * MiB + 2 * o : 2 * MiB + 2 * o + 8192], host[2 * MiB + o : 2 * MiB + o + 8192]
                )
            wait_ok(e.read(local, 4 * MiB, remote, 0, 2 * MiB, e.allocate_transfer_uid()))
            torch.cuda.synchronize()
            assert torch.equal(src[4 * MiB : 6 * MiB], src[: 2 * MiB])
            parent.send("done")
    finally:
        p.join(60)
