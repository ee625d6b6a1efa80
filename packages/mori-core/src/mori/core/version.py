"""MORI's version: one number for every distribution, kept in the repository's ``VERSION`` file.

Each distribution's pyproject reads that file at build time (hatchling's regex version source,
scikit-build-core's regex metadata provider), so the installed metadata is the one source at run
time; :func:`installed_version` reads it, with one fallback for a source tree that is not installed.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["UNKNOWN", "installed_version"]

#: the version of a distribution that is not installed (a source tree on ``sys.path``)
UNKNOWN = "0+unknown"


def installed_version(distribution: str) -> str:
    """The installed version of ``distribution`` (e.g. ``"mori-core"``), or :data:`UNKNOWN`."""
    try:
        return version(distribution)
    except PackageNotFoundError:
        return UNKNOWN
