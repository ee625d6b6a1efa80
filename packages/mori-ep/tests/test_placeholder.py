"""mori-ep is a placeholder: its module imports, exports nothing and says so when touched."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

import mori.ep

MODULES = [mori.ep]
#: (module, a public name the implemented component will provide)
PLANNED = [
    (mori.ep, "EpDispatchCombineOp"),
    (mori.ep, "EpDispatchCombineConfig"),
]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_module_is_an_empty_placeholder(module: ModuleType) -> None:
    assert module.__all__ == []
    assert module.__status__ == "placeholder"


@pytest.mark.parametrize(("module", "name"), PLANNED, ids=lambda v: getattr(v, "__name__", v))
def test_planned_name_raises_attribute_error_saying_placeholder(module: ModuleType, name: str) -> None:
    with pytest.raises(AttributeError, match="placeholder") as info:
        getattr(module, name)
    message = str(info.value)
    assert f"{module.__name__}.{name} is not available" in message
    assert "mori-ep " in message
    assert "not implemented yet" in message
    assert not hasattr(module, name)


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_private_and_dunder_probes_get_the_ordinary_error(module: ModuleType) -> None:
    with pytest.raises(AttributeError, match="has no attribute") as info:
        module.__wrapped__  # noqa: B018
    assert "placeholder" not in str(info.value)


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_reachable_through_the_mori_namespace(module: ModuleType) -> None:
    import mori

    component = module.__name__.rpartition(".")[2]
    assert getattr(mori, component) is module
    assert importlib.import_module(module.__name__) is module
