"""Lazy re-exports across distributions, for mori.cpp and mori.kernel_profiler: a name of one
component served by the module of another, with an error that names the distribution to install
when that module is missing."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingDistributionError(ModuleNotFoundError):
    """A name is served by a component whose distribution is not installed (``pip install ...``)."""


def component(module: str, wanted: str) -> ModuleType:
    """``module`` (``"mori.io"``), imported; ``wanted`` says what needed it, for the error."""
    import mori

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if missing != module and not module.startswith(missing + "."):
            raise  # something mori.<x> itself needs is missing: its own error says what
        dist = mori.COMPONENTS.get(module.partition(".")[2].partition(".")[0], module)
        raise MissingDistributionError(
            f"{wanted} is provided by {module} (distribution '{dist}'), which is not installed: pip install {dist}",
            name=module,
        ) from e


class UnavailableNameError(ImportError):
    """A name an alias module promises is not provided (yet) by the installed component: the
    message says why. An ImportError, so that ``from mori.cpp import X`` shows it (Python replaces
    an AttributeError there with its own "cannot import name")."""


def forward(module: str, name: str, wanted: str) -> object:
    """``module.name``, for the alias name ``wanted``, with the errors above."""
    provider = component(module, wanted)
    try:
        return getattr(provider, name)
    except AttributeError as e:
        raise UnavailableNameError(f"{wanted}: {e}", name=module) from e
