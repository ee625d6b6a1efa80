# mypy: disable-error-code="empty-body"
"""Hook specifications: the whole contract between mori-core and its plugins.

Plugins are modules (or objects) named by entry points in the group ``mori.backends`` (device
runtimes, transports, NIC providers) or ``mori.extensions`` (feature packages adding commands and
benchmarks). They implement any subset of the hooks below, decorated with
:data:`mori.core.plugins.hookimpl`. Every hook is called with keyword arguments only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence

    from mori.core.backend import DeviceRuntime, NicProvider, Transport
    from mori.core.bench import BenchSuite
    from mori.core.env import EnvVar

hookspec = pluggy.HookspecMarker("mori")

# -- discovery: called the first time core needs the list, results cached per process ------------


@hookspec
def mori_device_runtimes() -> Sequence[DeviceRuntime]:
    """Return the device runtimes this plugin provides (may be empty).

    Called once per process, when the symmetric heap is first created or ``mori backends`` runs.
    Return runtimes even when unusable here: their :meth:`~mori.core.backend.DeviceRuntime.probe`
    says why, and ``mori backends`` shows it.
    """


@hookspec
def mori_transports() -> Sequence[Transport]:
    """Return the transports this plugin provides (may be empty). Called like
    :func:`mori_device_runtimes`."""


@hookspec
def mori_nic_providers() -> Sequence[NicProvider]:
    """Return the NIC providers this plugin provides (may be empty). Called like
    :func:`mori_device_runtimes`. A NIC plugin returns a :class:`mori.core.nic.VendorNicProvider`
    made of its vendor's data; only such providers take part in device selection and ``mori check``."""


@hookspec
def mori_env_vars() -> Sequence[EnvVar[object]]:
    """Return the ``MORI_*`` variables this plugin reads, so ``mori env`` can list them."""


# -- command line: called while ``mori`` builds its parser ------------------------------------------


@hookspec
def mori_add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add sub-commands to ``mori``.

    ``subparsers``: the result of ``parser.add_subparsers()``. Each added parser must set a
    ``func`` default taking the parsed namespace and returning an exit code.
    """


@hookspec
def mori_bench_suites() -> Sequence[BenchSuite]:
    """Return benchmarks that ``mori bench NAME`` runs (NAME = :attr:`BenchSuite.name`)."""
