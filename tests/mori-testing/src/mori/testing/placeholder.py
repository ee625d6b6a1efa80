"""Checks every placeholder feature package runs on its modules: importable, empty, and honest
about it when a planned name is touched."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest


def check_empty_placeholder(module: ModuleType) -> None:
    """Exports nothing, says it is a placeholder, and is reachable as ``mori.<component>``."""
    import mori

    assert module.__all__ == []
    assert module.__status__ == "placeholder"
    component = module.__name__.rpartition(".")[2]
    assert getattr(mori, component) is module
    assert importlib.import_module(module.__name__) is module
    # private and dunder probes (copy, pickle, inspect) get the ordinary error
    with pytest.raises(AttributeError, match="has no attribute") as info:
        module.__wrapped__  # noqa: B018
    assert "placeholder" not in str(info.value)


def check_planned_name(module: ModuleType, name: str, distribution: str) -> None:
    """A public name the finished component will have raises AttributeError saying why."""
    with pytest.raises(AttributeError, match="placeholder") as info:
        getattr(module, name)
    message = str(info.value)
    assert f"{module.__name__}.{name} is not available" in message
    assert f"{distribution} " in message
    assert "not implemented yet" in message
    assert not hasattr(module, name)
