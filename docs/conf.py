"""Sphinx configuration for the MORI documentation (Sphinx + MyST Markdown).

Build: ``python -m sphinx -W --keep-going -b html docs docs/_build/html``. The API pages are
generated from the installed mori-core, which must be importable with its ``triton`` extra (for
``mori.shmem.device`` and ``mori.shmem.kernels``); some tables are generated here from the code
(``source-read`` hook below). Nothing here needs the network.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import textwrap
from collections.abc import Callable
from typing import Any

from sphinx.util import logging

import mori.core
import mori.shmem
from mori.core import env

logger = logging.getLogger(__name__)

# -- project -------------------------------------------------------------------------------------

project = "MORI"
author = "MORI contributors"
copyright = "MORI contributors"
release = mori.core.__version__
version = release

# -- general -------------------------------------------------------------------------------------

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "examples", "Thumbs.db", ".DS_Store"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_member_order = "groupwise"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# -- HTML ----------------------------------------------------------------------------------------

html_theme = "furo" if importlib.util.find_spec("furo") else "alabaster"
html_title = f"MORI {release}"
html_static_path: list[str] = []

# -- generated content ---------------------------------------------------------------------------

#: the line in environment-variables.md that the table of mori-core's variables replaces
ENV_TABLE_MARKER = "<!-- mori-core env table -->"

# What each parser accepts, for variables that do not spell it out in ``EnvVar.accepted``.
_ACCEPTED_BY_PARSER: dict[Callable[[str], Any], str] = {
    env.parse_size: "bytes, with an optional binary suffix K, M, G or T (4096, 512M, 6G, 1.5G)",
    env.parse_bool: "1/0, on/off, true/false, yes/no",
    env.parse_positive_float: "seconds, a number > 0",
    str: "(see meaning)",
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def env_table() -> str:
    """A Markdown table of every variable in :data:`mori.core.env.ALL`, in that order."""
    lines = [
        "| variable | default | example | accepted values | meaning |",
        "|---|---|---|---|---|",
    ]
    for var in env.ALL:
        default = f"`{var.default}`" if var.default is not None else "(unset)"
        accepted = var.accepted or _ACCEPTED_BY_PARSER.get(var.parse, "")
        lines.append(
            f"| `{var.name}` | {_cell(default)} | `{_cell(var.example)}` | {_cell(accepted)} | {_cell(var.doc)} |"
        )
    return "\n".join(lines)


#: the line in api/communication.md that the reference of mori.shmem's constants replaces
SHMEM_CONSTANTS_MARKER = "<!-- mori.shmem constants -->"

# autodoc cannot show these: they are ints re-exported from submodules, so it would print int's
# own docstring. Their values come from the module at build time; their meaning is stated here.
_SHMEM_CONSTANTS: dict[str, str] = {
    "MORI_SHMEM_INIT_WITH_MPI_COMM": "``flags`` of :func:`shmem_init_attr`: ``uid`` is an mpi4py communicator "
    "(``None`` means ``COMM_WORLD``).",
    "MORI_SHMEM_INIT_WITH_UNIQUEID": "``flags`` of :func:`shmem_init_attr`: ``uid`` is the 128 bytes from "
    ":func:`shmem_get_unique_id`.",
    "SIGNAL_SET": "Signal operation: store the value in the signal word.",
    "SIGNAL_ADD": "Signal operation: add the value to the signal word.",
    "SHMEM_CMP_EQ": "Comparison for :func:`shmem_wait_until`: word ``==`` value.",
    "SHMEM_CMP_NE": "Comparison for :func:`shmem_wait_until`: word ``!=`` value.",
    "SHMEM_CMP_GT": "Comparison for :func:`shmem_wait_until`: word ``>`` value.",
    "SHMEM_CMP_GE": "Comparison for :func:`shmem_wait_until`: word ``>=`` value.",
    "SHMEM_CMP_LT": "Comparison for :func:`shmem_wait_until`: word ``<`` value.",
    "SHMEM_CMP_LE": "Comparison for :func:`shmem_wait_until`: word ``<=`` value.",
}


def shmem_constants() -> str:
    """reST ``py:data`` entries for every int constant in ``mori.shmem.__all__``."""
    out = ["```{eval-rst}", ".. currentmodule:: mori.shmem", ""]
    for name in mori.shmem.__all__:
        value = getattr(mori.shmem, name)
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        doc = _SHMEM_CONSTANTS.get(name)
        if doc is None:
            logger.warning("docs/conf.py: mori.shmem.%s has no description in _SHMEM_CONSTANTS", name)
            doc = ""
        out += [f".. py:data:: {name}", f"   :value: {value!r}", "", f"   {doc}", ""]
    for name in sorted(set(_SHMEM_CONSTANTS) - set(mori.shmem.__all__)):
        logger.warning("docs/conf.py: _SHMEM_CONSTANTS describes %s, which mori.shmem does not export", name)
    out.append("```")
    return "\n".join(out)


# -- modules with Triton functions ------------------------------------------------------------------

#: ``<!-- members: MODULE -->`` lines are replaced by the reference of every name in MODULE.__all__
MEMBERS_MARKER = re.compile(r"^<!-- members: ([\w.]+) -->$", re.MULTILINE)


def _is_triton_jit(obj: object) -> bool:
    # Checked by duck type so that this file does not import triton itself.
    return type(obj).__name__ == "JITFunction" and callable(getattr(obj, "fn", None))


def _jit_signature(fn: Callable[..., Any]) -> str:
    params = []
    for p in inspect.signature(fn).parameters.values():
        text = p.name
        if p.annotation is not inspect.Parameter.empty:
            text += f": {p.annotation if isinstance(p.annotation, str) else p.annotation.__name__}"
        if p.default is not inspect.Parameter.empty:
            default = getattr(p.default, "value", p.default)  # tl.constexpr wraps the value
            text += f" = {default!r}"
        params.append(text)
    return f"{fn.__name__}({', '.join(params)})"


def _constexpr_doc(module: str, name: str) -> str:
    doc = _SHMEM_CONSTANTS.get(name, "")
    if module == "mori.shmem.device":  # the device API's own names for the same operations
        doc = doc.replace(":func:`shmem_wait_until`", ":func:`wait_until`")
    return doc


def members_reference(module_name: str) -> str:
    """reST for every member of ``module_name.__all__``.

    autodoc cannot document ``@triton.jit`` functions (they are ``JITFunction`` objects, which it
    skips) nor ``tl.constexpr`` constants, so those are written out here from the Python functions
    they wrap; everything else goes through autodoc.
    """
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        logger.warning("docs/conf.py: cannot import %s (%s); install mori-core[triton]", module_name, e)
        return ""
    out = ["```{eval-rst}", f".. py:currentmodule:: {module_name}", ""]
    for name in module.__all__:
        obj = getattr(module, name)
        if _is_triton_jit(obj):
            doc = inspect.getdoc(obj.fn) or ""
            out += [f".. py:function:: {_jit_signature(obj.fn)}", "", textwrap.indent(doc, "   "), ""]
        elif type(obj).__name__ == "constexpr":
            out += [
                f".. py:data:: {name}",
                f"   :value: {obj.value!r}",
                "",
                f"   {_constexpr_doc(module_name, name)}",
                "",
            ]
        elif callable(obj):
            out += [f".. autofunction:: {module_name}.{name}", ""]
        else:
            out += [f".. autodata:: {module_name}.{name}", ""]
    out.append("```")
    return "\n".join(out)


# -- hooking it up ---------------------------------------------------------------------------------


def _fill_generated(app: Any, docname: str, source: list[str]) -> None:
    if ENV_TABLE_MARKER in source[0]:
        source[0] = source[0].replace(ENV_TABLE_MARKER, env_table())
    if SHMEM_CONSTANTS_MARKER in source[0]:
        source[0] = source[0].replace(SHMEM_CONSTANTS_MARKER, shmem_constants())
    source[0] = MEMBERS_MARKER.sub(lambda m: members_reference(m.group(1)), source[0])


def setup(app: Any) -> dict[str, Any]:
    app.connect("source-read", _fill_generated)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
