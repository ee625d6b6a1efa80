"""What a feature package that is not implemented yet puts in its module: honest errors.

A placeholder module sets ``__all__ = []``, ``__status__ = "placeholder"`` and
``__getattr__ = placeholder_getattr(__name__, "mori-x", "X")``: touching any public name then
raises AttributeError saying the component is not implemented, instead of pretending.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

from mori.core.version import installed_version


def placeholder_getattr(module: str, distribution: str, component: str) -> Callable[[str], NoReturn]:
    """A module ``__getattr__`` for the placeholder ``module`` of ``distribution``."""

    def __getattr__(name: str) -> NoReturn:
        if name.startswith("_"):  # dunder probes (copy, inspect, pytest) get the ordinary error
            raise AttributeError(f"module {module!r} has no attribute {name!r}", name=name)
        raise AttributeError(
            f"{module}.{name} is not available: {distribution} {installed_version(distribution)} is a placeholder; "
            f"the {component} component is not implemented yet (see the project's issues)",
            name=name,
        )

    return __getattr__
