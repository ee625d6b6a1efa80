"""The rest of the original's module surface: lazy ``mori.<name>`` components, mori.cpp,
mori.kernel_profiler and mori.tensor_utils."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import subprocess
import sys
import types
from typing import Any

import pytest

import mori

# the names the original's `mori/__init__.py` exposes lazily (but jax), and who provides each
ORIGINAL_LAZY_NAMES = {
    "ops": "mori-ep",
    "io": "mori-io",
    "shmem": "mori-core",
    "ir": "mori-core",
    "ccl": "mori-cco",
    "jit": "mori-core",
    "kernel_profiler": "mori-core",
    "cpp": "mori-core",
    "tensor_utils": "mori-core",
}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the mori finder: the distribution is missing
        return False


# -- lazy names ---------------------------------------------------------------------------------------


def test_lazy_names_map_to_their_distributions() -> None:
    for name, dist in ORIGINAL_LAZY_NAMES.items():
        assert mori.COMPONENTS[name] == dist, name
        assert name in dir(mori)
        if _installed(f"mori.{name}"):
            assert getattr(mori, name) is importlib.import_module(f"mori.{name}")
        else:
            with pytest.raises(ModuleNotFoundError, match=f"pip install {dist}"):
                getattr(mori, name)


def test_import_mori_and_mori_ir_pull_in_neither_triton_nor_torch() -> None:
    code = (
        "import sys, mori, mori.ir, mori.jit, mori.cpp, mori.kernel_profiler; "
        "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"


# -- mori.cpp -----------------------------------------------------------------------------------------


@pytest.fixture
def cpp(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """mori.cpp with the names it has cached dropped, so each test resolves them again."""
    module = importlib.import_module("mori.cpp")
    for name in module.PROVIDERS:
        monkeypatch.delitem(vars(module), name, raising=False)
    return module


def test_cpp_reexports_the_native_classes(cpp: types.ModuleType) -> None:
    import mori.shmem

    assert cpp.shmem_malloc is mori.shmem.shmem_malloc and cpp.shmem_init_attr is mori.shmem.shmem_init_attr
    assert cpp.__all__ == sorted(cpp.PROVIDERS) and "TransferStatus" in dir(cpp)
    for name, module in cpp.PROVIDERS.items():
        if not _installed(module):
            with pytest.raises(ModuleNotFoundError, match=f"pip install {mori.COMPONENTS[module[5:]]}"):
                getattr(cpp, name)
            continue
        provider = importlib.import_module(module)
        if getattr(provider, "__status__", "") == "placeholder":
            with pytest.raises(ImportError, match="placeholder"):
                getattr(cpp, name)
        else:
            assert getattr(cpp, name) is getattr(provider, name), name
    with pytest.raises(AttributeError, match="no attribute 'NotAClass'"):
        _ = cpp.NotAClass


def test_cpp_names_the_missing_distribution(cpp: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mori.io", None)  # what import sees when mori-io is not installed
    with pytest.raises(ModuleNotFoundError, match="pip install mori-io") as info:
        exec("from mori.cpp import TransferStatus", {})  # the connectors' line
    assert "mori.cpp.TransferStatus is provided by mori.io" in str(info.value)


class _BrokenViz(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """mori.viz whose own dependency is missing."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        return importlib.util.spec_from_loader(fullname, self) if fullname == "mori.viz" else None

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: Any) -> None:
        raise ModuleNotFoundError("No module named 'perfetto'", name="perfetto")


def test_kernel_profiler_forwards_to_mori_viz(monkeypatch: pytest.MonkeyPatch) -> None:
    import mori.kernel_profiler as kp

    # whatever mori.viz holds is what kernel_profiler serves
    fake = types.ModuleType("mori.viz")
    fake.export_to_perfetto = lambda *a, **k: ("exported", a, k)  # type: ignore[attr-defined]
    fake.__all__ = ["export_to_perfetto", "TraceBuffer"]  # type: ignore[attr-defined]
    fake.TraceBuffer = object  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mori.viz", fake)
    assert kp.export_to_perfetto is fake.export_to_perfetto
    from mori.kernel_profiler import TraceBuffer, export_to_perfetto

    assert export_to_perfetto("buf", "trace.json", gpu_freq_ghz=2.1) == (
        "exported",
        ("buf", "trace.json"),
        {"gpu_freq_ghz": 2.1},
    )
    assert TraceBuffer is object and {"export_to_perfetto", "TraceBuffer"} <= set(dir(kp))
    # not installed: says which distribution
    monkeypatch.setitem(sys.modules, "mori.viz", None)
    with pytest.raises(ModuleNotFoundError, match="pip install mori-viz"):
        exec("from mori.kernel_profiler import export_to_perfetto", {})
    assert "export_to_perfetto" in dir(kp)
    # installed but broken: its own error, not a false "install mori-viz"
    monkeypatch.delitem(sys.modules, "mori.viz")
    monkeypatch.setattr(sys, "meta_path", [_BrokenViz(), *sys.meta_path])
    with pytest.raises(ModuleNotFoundError, match="perfetto") as info:
        _ = kp.export_to_perfetto
    assert "pip install mori-viz" not in str(info.value)


def test_kernel_profiler_on_the_installed_mori_viz() -> None:
    import mori.kernel_profiler as kp

    if not _installed("mori.viz"):
        with pytest.raises(ModuleNotFoundError, match="pip install mori-viz"):
            _ = kp.export_to_perfetto
        return
    viz = importlib.import_module("mori.viz")
    if getattr(viz, "__status__", "") == "placeholder":
        with pytest.raises(ImportError, match="placeholder"):
            _ = kp.export_to_perfetto
    else:
        assert kp.export_to_perfetto is viz.export_to_perfetto


# -- mori.tensor_utils --------------------------------------------------------------------------------


def test_from_gpu_ptr_views_host_memory_on_cpu() -> None:
    import torch

    from mori.tensor_utils import from_gpu_ptr

    base = torch.arange(24, dtype=torch.float32)
    view = from_gpu_ptr(base.data_ptr(), (2, 3, 4), torch.float32, device="cpu")
    assert view.shape == (2, 3, 4) and view.dtype == torch.float32 and view.device.type == "cpu"
    assert torch.equal(view.flatten(), base)
    view[1, 2, 3] = -1.0  # the same memory
    assert base[23].item() == -1.0
    if not torch.cuda.is_available():  # the default device is the CPU where torch sees no GPU
        assert from_gpu_ptr(base.data_ptr(), 24, torch.float32).data_ptr() == base.data_ptr()
    raw = torch.arange(16, dtype=torch.uint8)
    for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.int64):
        v = from_gpu_ptr(raw.data_ptr(), 16 // dtype.itemsize, dtype, device="cpu")
        assert torch.equal(v.view(torch.uint8), raw), dtype
    assert from_gpu_ptr(0, (0, 5), torch.float16, device="cpu").shape == (0, 5)


def test_from_gpu_ptr_rejects_bad_arguments() -> None:
    import torch

    from mori.core.errors import MoriTypeError, MoriValueError
    from mori.tensor_utils import from_gpu_ptr, gpu_tensor_view

    t = torch.zeros(4)
    p = t.data_ptr()
    cases: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"ptr": True}, MoriTypeError, "ptr"),
        ({"ptr": 1.5}, MoriTypeError, "ptr"),
        ({"ptr": -8}, MoriValueError, "ptr"),
        ({"ptr": 0}, MoriValueError, "non-null"),
        ({"shape": (2, -1)}, MoriValueError, "shape"),
        ({"shape": "4"}, MoriValueError, "shape"),
        ({"dtype": "float32"}, MoriTypeError, "dtype"),
        ({"framework": "numpy"}, MoriValueError, "framework"),
        ({"device": "mps"}, MoriValueError, "device"),
        ({"device": "nonsense"}, MoriValueError, "device"),
    ]
    for change, error, match in cases:
        args = {"ptr": p, "shape": 4, "dtype": torch.float32, "device": "cpu", **change}
        with pytest.raises(error, match=match):
            from_gpu_ptr(args.pop("ptr"), args.pop("shape"), args.pop("dtype"), **args)
    if not torch.cuda.is_available():
        with pytest.raises(MoriValueError, match="torch sees none"):
            from_gpu_ptr(p, 4, torch.float32, device="cuda")
        with pytest.raises(MoriValueError, match="torch sees none"):
            gpu_tensor_view(p, 4, torch.float32)
    with pytest.raises(MoriValueError, match="device_id"):
        gpu_tensor_view(p, 4, torch.float32, device_id=-1)
    if importlib.util.find_spec("jax") is None:
        with pytest.raises(ImportError, match="pip install jax"):
            from_gpu_ptr(p, 4, torch.float32, framework="jax", device="cpu")


def test_gpu_tensor_view_speaks_dlpack() -> None:
    import torch

    from mori.tensor_utils import GpuTensorView

    base = torch.arange(6, dtype=torch.int32)
    view = GpuTensorView(base.data_ptr(), (2, 3), torch.int32, device="cpu")
    assert view.__dlpack_device__() == (1, 0) and view.device == "cpu"
    t = torch.from_dlpack(view)
    assert t.data_ptr() == base.data_ptr() and t.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert not hasattr(view, "__cuda_array_interface__")  # host memory has none
    assert "ptr=0x" in repr(view)


def test_dtype_to_int_is_the_originals() -> None:
    import torch

    from mori.core.errors import MoriTypeError, MoriValueError
    from mori.tensor_utils import dtype_to_int

    assert [dtype_to_int(d) for d in (torch.float32, torch.bfloat16, torch.float8_e4m3fn)] == [0, 1, 2]
    assert [dtype_to_int(d) for d in (torch.float8_e4m3fnuz, torch.int32)] == [3, 4]
    if hasattr(torch, "float4_e2m1fn_x2"):
        assert dtype_to_int(torch.float4_e2m1fn_x2) == 5
    with pytest.raises(MoriValueError, match=r"torch\.float32"):
        dtype_to_int(torch.float16)
    with pytest.raises(MoriTypeError, match=r"torch\.dtype"):
        dtype_to_int("float32")  # type: ignore[arg-type]


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu  # any vendor: torch's ROCm builds call their GPUs "cuda" too
@pytest.mark.skipif(not _cuda_available(), reason="needs a GPU (torch.cuda.is_available() is False)")
def test_from_gpu_ptr_on_the_gpu() -> None:
    import torch

    from mori.tensor_utils import GpuTensorView, from_gpu_ptr, gpu_tensor_view

    base = torch.arange(32, dtype=torch.bfloat16, device="cuda")
    view = from_gpu_ptr(base.data_ptr(), (4, 8), torch.bfloat16)
    assert view.device == base.device and view.data_ptr() == base.data_ptr()
    view.fill_(3.0)
    torch.cuda.synchronize()
    assert bool((base == 3.0).all())
    gv = gpu_tensor_view(base.data_ptr(), 32, torch.bfloat16, device_id=base.device.index or 0)
    assert gv.__cuda_array_interface__["typestr"] == "<u2" and gv.__cuda_array_interface__["shape"] == (32,)
    f32 = torch.zeros(5, device="cuda")
    assert torch.as_tensor(GpuTensorView(f32.data_ptr(), 5, torch.float32)).data_ptr() == f32.data_ptr()
    assert torch.from_dlpack(gv).data_ptr() == base.data_ptr()
