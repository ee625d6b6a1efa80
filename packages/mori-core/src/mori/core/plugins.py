"""Plugin discovery and backend selection.

Plugins come from the entry-point groups ``mori.backends`` and ``mori.extensions``; core's own
backends register through the same group, so nothing here knows any plugin by name. A plugin that
fails to load is recorded with its error (``mori backends`` shows it) instead of breaking core.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import pluggy

from mori.core import hookspecs
from mori.core.backend import Availability, DeviceRuntime, NicProvider, Transport
from mori.core.errors import MoriBackendError

hookimpl = pluggy.HookimplMarker("mori")

BACKEND_GROUP = "mori.backends"
EXTENSION_GROUP = "mori.extensions"


@dataclass(frozen=True)
class PluginRecord:
    """One entry point found at discovery: where it came from and whether it loaded."""

    name: str
    group: str
    value: str
    distribution: str
    version: str
    error: str = ""


class Found:
    """A backend object together with the plugin that provided it and its probe result.

    The probe runs on the first read of :attr:`availability`, once: a caller that needs only some
    kinds of backend (a single-node SHMEM job needs no network transport) never starts the others
    (a network library's probe loads it, and may spawn threads or map shared memory).
    """

    __slots__ = ("_availability", "_lock", "backend", "plugin")

    def __init__(self, backend: DeviceRuntime | Transport | NicProvider, plugin: PluginRecord) -> None:
        self.backend = backend
        self.plugin = plugin
        self._availability: Availability | None = None
        self._lock = threading.Lock()

    @property
    def availability(self) -> Availability:
        with self._lock:
            if self._availability is None:
                try:
                    self._availability = self.backend.probe()
                except Exception as e:
                    self._availability = Availability(False, f"probe failed: {type(e).__name__}: {e}")
            return self._availability

    def __repr__(self) -> str:
        return f"Found({self.backend.name!r}, plugin={self.plugin.name!r})"


class Plugins:
    """A plugin manager plus what discovery found. Use :func:`get_plugins` for the process-wide one."""

    def __init__(self, groups: Iterable[str] = (BACKEND_GROUP, EXTENSION_GROUP)) -> None:
        self.pm = pluggy.PluginManager("mori")
        self.pm.add_hookspecs(hookspecs)
        self.records: list[PluginRecord] = []
        for group in groups:
            for ep in sorted(metadata.entry_points(group=group), key=lambda e: e.name):
                self._load(ep, group)
        self._drop_plugins_with_unknown_hooks()
        self._lock = threading.Lock()
        self._found: dict[str, list[Found]] = {}

    def _load(self, ep: metadata.EntryPoint, group: str) -> None:
        dist = ep.dist.name if ep.dist is not None else "?"
        version = ep.dist.version if ep.dist is not None else "?"
        if self.pm.get_plugin(ep.name) is not None:
            self.records.append(
                PluginRecord(ep.name, group, ep.value, dist, version, f"name '{ep.name}' is already taken")
            )
            return
        try:
            self.pm.register(ep.load(), name=ep.name)
        except Exception as e:  # a broken plugin must not break core: show it instead
            self.records.append(
                PluginRecord(ep.name, group, ep.value, dist, version, f"{type(e).__name__}: {e}")
            )
            return
        self.records.append(PluginRecord(ep.name, group, ep.value, dist, version))

    def _drop_plugins_with_unknown_hooks(self) -> None:
        # A mori_* function that matches no hookspec is a typo or a version mismatch: name it,
        # and keep the plugin out instead of silently never calling it.
        while True:
            try:
                self.pm.check_pending()
                return
            except pluggy.PluginValidationError as e:
                name = self.pm.get_name(e.plugin)
                self.pm.unregister(e.plugin)
                self.records = [
                    PluginRecord(r.name, r.group, r.value, r.distribution, r.version, str(e))
                    if r.name == name
                    else r
                    for r in self.records
                ]

    def record_of(self, plugin: object) -> PluginRecord:
        name = self.pm.get_name(plugin)
        for rec in self.records:
            if rec.name == name:
                return rec
        return PluginRecord(str(name), "", "", "?", "?")

    def _collect(self, hook: str) -> list[Found]:
        with self._lock:
            if hook in self._found:
                return self._found[hook]
            found: list[Found] = []
            caller = getattr(self.pm.hook, hook)
            for impl in caller.get_hookimpls():
                rec = self.record_of(impl.plugin)
                try:
                    items = impl.function()
                except Exception as e:
                    raise MoriBackendError(
                        f"plugin '{rec.name}' ({rec.distribution} {rec.version}) failed in hook {hook}(): "
                        f"{type(e).__name__}: {e}"
                    ) from e
                found.extend(Found(item, rec) for item in items or ())
            # by declared priority; a probe may raise a backend's priority (ucx with RDMA), so a
            # caller choosing among several re-sorts the usable ones after probing them
            found.sort(key=lambda f: (-getattr(f.backend, "priority", 0), f.backend.name))
            self._found[hook] = found
            return found

    def runtimes(self) -> list[Found]:
        return self._collect("mori_device_runtimes")

    def transports(self) -> list[Found]:
        return self._collect("mori_transports")

    def nic_providers(self) -> list[Found]:
        return self._collect("mori_nic_providers")

    def call(self, hook: str, **kwargs: Any) -> list[Any]:
        result: list[Any] = getattr(self.pm.hook, hook)(**kwargs)
        return result


_plugins: Plugins | None = None
_plugins_lock = threading.Lock()


def get_plugins() -> Plugins:
    """The process-wide plugin set, discovered on first use."""
    global _plugins
    with _plugins_lock:
        if _plugins is None:
            _plugins = Plugins()
        return _plugins


def reset_plugins() -> None:
    """Forget discovery (tests install plugins and look again)."""
    global _plugins
    with _plugins_lock:
        _plugins = None


def select(kind: str, found: Sequence[Found], name: str) -> Found:
    """Pick the backend called ``name`` (or, for ``auto``, the usable one of highest priority).

    Raises :class:`MoriBackendError` naming what was asked, what exists and why it is unusable.
    """
    if name == "auto":
        for f in found:
            if f.availability.usable:
                return f
        detail = "; ".join(f"{f.backend.name}: {f.availability.reason}" for f in found) or "none installed"
        raise MoriBackendError(f"no usable {kind} found ({detail}); run `mori backends`")
    for f in found:
        if f.backend.name == name:
            if not f.availability.usable:
                raise MoriBackendError(
                    f"{kind} '{name}' (from {f.plugin.distribution} {f.plugin.version}) is not usable here: "
                    f"{f.availability.reason}"
                )
            return f
    known = ", ".join(f.backend.name for f in found) or "none"
    raise MoriBackendError(f"{kind} '{name}' not found: misspelled or not installed (installed: {known})")
