"""Tests of a plugin as a user installs it: pip-install it into a directory of its own, and run
Python there (the device plugins' ``test_plugin.py`` use these)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

__all__ = ["install_plugin", "run_installed"]


def install_plugin(package: Path, target: Path) -> Path:
    """Install the distribution at ``package`` (no dependencies, no build isolation) into ``target``;
    skip the test where hatchling, which that needs, is missing. Returns ``target``."""
    pytest.importorskip("hatchling", reason="installing the plugin without build isolation needs hatchling")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(package),
        ],
        check=True,
    )
    return target


def run_installed(
    site: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python *args`` with ``site`` first on the path, the caller's ``MORI_*`` variables removed
    and ``env`` added; output captured as text, 120 s at most."""
    full = {
        **{k: v for k, v in os.environ.items() if not k.startswith("MORI_")},
        **(env or {}),
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=full, timeout=120)
