"""mori-viz is a placeholder: its module imports, exports nothing and says so when touched."""

from __future__ import annotations

from types import ModuleType

import pytest

import mori.viz
from mori.testing.placeholder import check_empty_placeholder, check_planned_name

MODULES = [mori.viz]
#: (module, a public name the implemented component will provide)
PLANNED = [
    (mori.viz, "export_to_perfetto"),
]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_module_is_an_empty_placeholder(module: ModuleType) -> None:
    check_empty_placeholder(module)


@pytest.mark.parametrize(("module", "name"), PLANNED, ids=lambda v: getattr(v, "__name__", v))
def test_planned_name_raises_attribute_error_saying_placeholder(module: ModuleType, name: str) -> None:
    check_planned_name(module, name, "mori-viz")
