"""Compiling one ahead-of-time variant of a kernel exactly as its first launch would, through Triton.

A Triton kernel is compiled on its first launch for the argument *specialisation* of that launch
(each pointer's type and 16-byte alignment, each integer's width and divisibility by 16, and on AMD
whether a buffer fits 32-bit offsets), with the launch's options, and the code is kept in Triton's
on-disk cache under a key of all of these. :func:`compile_variant` makes the very call a launch
makes: it runs the kernel's own argument binder on stand-in arguments that have the variant's
types and alignments (an :class:`~mori.core.kernels.AotSpec`), then ``triton.compile`` with the
same source, attributes and options, for a target given explicitly (so it runs on a machine
without that GPU). A later launch whose arguments match the variant finds the code in the cache and
compiles nothing: this is what :func:`mori.jit.precompile` and ``tools/compile_kernels.py`` use.

The binder and ``_pack_args`` are Triton's (``triton.runtime.jit``): they are internal, so this
module checks they are there and says which Triton it needs otherwise. :func:`is_cached` asks
Triton's cache the same question ``triton.compile`` asks before compiling.
"""

from __future__ import annotations

import hashlib
from typing import Any

from mori.core.errors import MoriBackendError, bad_value
from mori.core.kernels import AotSpec

__all__ = ["TARGETS", "compile_variant", "is_cached", "parse_target", "source_of", "triton_function"]

#: the targets MORI's CI compiles every kernel for (``tools/compile_kernels.py``)
TARGETS = ("cuda:90", "cuda:100", "hip:gfx942", "hip:gfx950")

# stand-in scalars with the specialisation a launch gives Python numbers: (not aligned, aligned);
# 1 is avoided (Triton makes an argument equal to 1 a constant)
_SCALARS: dict[str, tuple[Any, Any]] = {
    "i32": (7, 16),
    "i64": (2**33 + 7, 2**33 + 16),
    "u64": (2**63 + 7, 2**63 + 16),
    "fp32": (1.5, 1.5),
    "u1": (True, True),
}


def parse_target(target: Any) -> Any:
    """A ``triton.backends.compiler.GPUTarget`` from one, or from ``"cuda:90"`` / ``"hip:gfx942"``
    (AMD warp size 64 for gfx9, else 32)."""
    from triton.backends.compiler import GPUTarget

    if isinstance(target, GPUTarget):
        return target
    func = "parse_target"
    allowed = "'cuda:<sm>' (e.g. cuda:90), 'hip:<gfx arch>' (e.g. hip:gfx942) or a triton GPUTarget"
    if not isinstance(target, str) or ":" not in target:
        raise bad_value(func, "target", target, allowed)
    backend, _, arch = target.partition(":")
    if backend == "cuda" and arch.isdigit():
        return GPUTarget("cuda", int(arch), 32)
    if backend == "hip" and arch.startswith("gfx") and len(arch) > 3:
        return GPUTarget("hip", arch, 64 if arch.startswith("gfx9") else 32)
    raise bad_value(func, "target", target, allowed)


def triton_function(obj: Any) -> Any:
    """The ``JITFunction`` inside ``obj`` (itself, or under autotune / heuristics), or None."""
    from triton.runtime.jit import JITFunction

    for _ in range(8):
        if isinstance(obj, JITFunction):
            return obj
        obj = getattr(obj, "fn", None)
        if obj is None:
            return None
    return None


def _triton_internals() -> tuple[Any, Any]:
    import triton
    from triton.runtime import jit as rt

    make = getattr(rt, "create_function_from_signature", None)
    if make is None or not hasattr(rt.JITFunction, "_pack_args") or not hasattr(rt, "MockTensor"):
        raise MoriBackendError(
            f"mori.jit compiles kernels as their launch would, through Triton's argument binder, which "
            f"Triton {triton.__version__} does not have in the form mori knows (Triton 3.5 or 3.6)"
        )
    return make, rt.MockTensor


def _stand_ins(jit: Any, spec: AotSpec) -> dict[str, Any]:
    """Arguments with the specialisation of ``spec``: pointers and numbers a launch would pass."""
    import triton.language as tl

    _, mock_tensor = _triton_internals()

    class Unaligned(mock_tensor):  # type: ignore[misc, valid-type]
        @staticmethod
        def data_ptr() -> int:
            return 8  # 8-byte aligned, not 16: no divisibility hint

    args: dict[str, Any] = {}
    for name, ty in spec.signature.items():
        aligned = name in spec.aligned
        if ty.startswith("*"):
            dtype = tl.str_to_ty(ty, None).element_ty
            args[name] = mock_tensor(dtype) if aligned else Unaligned(dtype)
        elif ty in _SCALARS:
            args[name] = _SCALARS[ty][1 if aligned else 0]
        else:
            raise bad_value(
                "compile_variant",
                f"signature[{name!r}]",
                ty,
                f"a pointer type ('*fp32', ...) or a type a launch gives a Python value ({', '.join(_SCALARS)})",
            )
    args.update(spec.constexprs)
    return args


def source_of(kernel: Any, spec: AotSpec, target: Any) -> tuple[Any, dict[str, Any]]:
    """``(ASTSource, options)`` of ``spec`` for ``target``: what a launch hands ``triton.compile``."""
    import triton
    from triton.compiler import ASTSource, make_backend

    jit = triton_function(kernel)
    if jit is None:
        raise bad_value("compile_variant", "kernel", kernel, "a @triton.jit kernel")
    make_binder, _ = _triton_internals()
    backend = make_backend(parse_target(target))
    binder = make_binder(jit.signature, jit.params, backend)
    # what JITFunction.run adds before binding (triton/runtime/jit.py)
    kwargs: dict[str, Any] = {
        **_stand_ins(jit, spec),
        "num_warps": spec.num_warps,
        "debug": jit.debug or triton.knobs.runtime.debug,
        "instrumentation_mode": triton.knobs.compilation.instrumentation_mode,
    }
    bound_args, specialization, options = binder(**kwargs)
    options, signature, constexprs, attrs = jit._pack_args(
        backend, kwargs, bound_args, specialization, options
    )
    return ASTSource(jit, signature, constexprs, attrs), dict(options.__dict__)


def compile_variant(kernel: Any, spec: AotSpec, target: Any) -> Any:
    """Compile ``spec`` of ``kernel`` for ``target`` (a ``GPUTarget`` or ``"cuda:90"``...), through
    Triton's cache: the ``CompiledKernel`` a launch with matching arguments would get."""
    import triton

    src, options = source_of(kernel, spec, target)
    return triton.compile(src, target=parse_target(target), options=options)


def is_cached(src: Any, target: Any, options: dict[str, Any]) -> bool:
    """Whether Triton's cache holds the code of ``src`` for ``target`` with ``options`` (the lookup
    ``triton.compile`` makes first, triton/compiler/compiler.py)."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.compiler import make_backend
    from triton.runtime.cache import get_cache_key, get_cache_manager

    backend = make_backend(parse_target(target))
    parsed = backend.parse_options(dict(options, **src.parse_options()))
    key = get_cache_key(src, backend, parsed, env_vars=get_cache_invalidating_env_vars())
    name = f"{src.name[:150]}.json"
    group = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest()).get_group(name) or {}
    return name in group
