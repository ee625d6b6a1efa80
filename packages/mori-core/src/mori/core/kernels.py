"""How every Triton function in the repo says whether, and how, it is compiled ahead of time.

Each ``@triton.jit`` function is one of two things, and says which:

* a **kernel** (launched from the host) lists its ahead-of-time variants with :func:`aot`, one
  decorator per variant, placed above ``@triton.jit``::

      @aot(signature={"x_ptr": "*fp32", "n": "i32"}, constexprs={"BLOCK": 1024}, aligned=("x_ptr",))
      @aot(signature={"x_ptr": "*bf16", "n": "i32"}, constexprs={"BLOCK": 1024}, aligned=("x_ptr",))
      @triton.jit
      def scale_kernel(x_ptr, n, BLOCK: tl.constexpr): ...

  (:func:`aot_variants` takes a list of them at once). ``signature`` gives a Triton type
  (``*fp32``, ``*u8``, ``i32``, ``i64``, ...) to every runtime argument and ``constexprs`` a value
  to every ``tl.constexpr`` argument (one with a default may be left out); ``aligned`` names the
  arguments that Triton's JIT would specialise as divisible by 16 (16-byte aligned pointers), so
  the ahead-of-time code is the code a typical launch gets;
* a **device function** (called only from other jitted functions, as everything in
  :mod:`mori.shmem.device`) is marked :func:`device_function`; it is compiled through the kernels
  that call it.

``tools/compile_kernels.py`` (``nox -s kernels``) finds every ``@triton.jit`` function under
``packages/``, ``backends/`` and ``tests/``, compiles each variant of each kernel for every target
(sm_90, sm_100, gfx942, gfx950) and fails on a function that is neither marked nor given variants,
and on a device function that no kernel calls, so nothing can be skipped silently.

:func:`launch_config` hands a compiled kernel to code that launches it with the driver's own call
(mori-io's native XGMI queue). This module does not import Triton: the decorators only attach data
to the function object.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mori.core.errors import MoriBackendError, bad_value

__all__ = [
    "AotSpec",
    "aot",
    "aot_specs",
    "aot_variants",
    "device_function",
    "is_device_function",
    "launch_config",
    "load_compiled",
]

F = TypeVar("F")

_SPECS_ATTR = "__mori_aot__"
_DEVICE_ATTR = "__mori_device_function__"


@dataclass(frozen=True)
class AotSpec:
    """One ahead-of-time variant of a kernel (see the module docstring for the fields)."""

    signature: Mapping[str, str]
    constexprs: Mapping[str, Any] = field(default_factory=dict)
    aligned: tuple[str, ...] = ()
    num_warps: int = 4
    label: str = ""

    def describe(self) -> str:
        """Short text for tables: the label, or the constexprs and pointer types."""
        if self.label:
            return self.label
        ptrs = sorted({t for t in self.signature.values() if t.startswith("*")})
        parts = [",".join(ptrs)] if ptrs else []
        parts += [f"{k}={v}" for k, v in self.constexprs.items()]
        return " ".join(parts)


def aot(
    *,
    signature: Mapping[str, str],
    constexprs: Mapping[str, Any] | None = None,
    aligned: tuple[str, ...] | list[str] = (),
    num_warps: int = 4,
    label: str = "",
) -> Callable[[F], F]:
    """Declare one ahead-of-time variant of the kernel below; stack one decorator per variant."""
    func = "aot"
    if not isinstance(signature, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in signature.items()
    ):
        raise bad_value(func, "signature", signature, "a mapping of argument name -> Triton type string")
    if constexprs is not None and not isinstance(constexprs, Mapping):
        raise bad_value(func, "constexprs", constexprs, "a mapping of constexpr argument name -> value")
    if (
        isinstance(num_warps, bool)
        or not isinstance(num_warps, int)
        or num_warps <= 0
        or num_warps & (num_warps - 1)
    ):
        raise bad_value(func, "num_warps", num_warps, "a power of two > 0")
    spec = AotSpec(dict(signature), dict(constexprs or {}), tuple(aligned), num_warps, label)

    def mark(fn: F) -> F:
        # Decorators apply bottom-up; keep the variants in the order they are written.
        specs = [spec, *getattr(fn, _SPECS_ATTR, [])]
        setattr(fn, _SPECS_ATTR, specs)
        return fn

    return mark


def aot_variants(variants: Iterable[Mapping[str, Any]]) -> Callable[[F], F]:
    """Declare several variants at once: one :func:`aot` per mapping of its keyword arguments
    (handy when the variants are generated, e.g. one per dtype)."""
    marks = [aot(**v) for v in variants]

    def mark(fn: F) -> F:
        for m in reversed(marks):
            fn = m(fn)
        return fn

    return mark


def device_function(fn: F) -> F:
    """Mark a jitted function as a device function: called by kernels, never launched itself."""
    setattr(fn, _DEVICE_ATTR, True)
    return fn


def _layers(obj: Any) -> list[Any]:
    # triton.autotune / heuristics wrap a JITFunction in objects with ``.fn``; JITFunction and the
    # interpreter's InterpretedFunction keep the Python function in ``.fn`` too.
    out = [obj]
    while hasattr(out[-1], "fn") and len(out) < 8:
        out.append(out[-1].fn)
    return out


def aot_specs(obj: Any) -> list[AotSpec]:
    """The variants declared on a kernel (whatever the decorator order), or ``[]``."""
    for layer in _layers(obj):
        specs = getattr(layer, _SPECS_ATTR, None)
        if specs:
            return list(specs)
    return []


def is_device_function(obj: Any) -> bool:
    """Whether ``obj`` (a jitted function, or what wraps one) is marked :func:`device_function`."""
    return any(getattr(layer, _DEVICE_ATTR, False) for layer in _layers(obj))


def load_compiled(compiled: Any) -> Any:
    """Load a compiled Triton kernel (what ``kernel.warmup(...)`` returns) into the current
    context, as its first launch would, and return it: ``compiled.function`` is then the driver's
    handle (:func:`launch_config`, :class:`mori.core.relaunch.Relaunch`).

    This is the one place MORI calls a private method of Triton: ``CompiledKernel._init_handles()``,
    which loads the code object and sets ``function``. Triton has no public call that does this
    without launching the kernel (its launcher calls it on the first launch)."""
    compiled._init_handles()
    return compiled


def launch_config(compiled: Any) -> tuple[int, int, int]:
    """``(driver function handle, threads per program, shared memory bytes)`` of a compiled Triton
    kernel (what ``kernel.warmup(...)`` returns), loaded into the current context, for a plain
    driver launch (``cuLaunchKernel`` / ``hipModuleLaunchKernel``). Raises
    :class:`~mori.core.errors.MoriBackendError` if the kernel needs more than such a launch gives
    (global or profile scratch memory, clusters, a cooperative or programmatic-dependent launch).
    A driver launch needs the handle before any launch: :func:`load_compiled` loads the kernel."""
    md = compiled.metadata
    for attr, plain in (
        ("global_scratch_size", 0),
        ("profile_scratch_size", 0),
        ("num_ctas", 1),
        ("launch_cooperative_grid", False),
        ("launch_pdl", False),
    ):
        value = getattr(md, attr, plain)
        if value != plain:
            raise MoriBackendError(
                f"the compiled kernel has {attr}={value!r}: it needs more than a plain launch"
            )
    load_compiled(compiled)
    warp = int(getattr(md, "warp_size", 32) or 32)
    return int(compiled.function), warp * int(md.num_warps), int(md.shared)
