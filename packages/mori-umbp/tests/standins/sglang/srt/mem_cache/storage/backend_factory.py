"""Stand-in of SGLang's storage backend factory: the "dynamic" path that loads a backend named in
extra_config (backend_name, module_path, class_name) and calls it as cls(storage_config, kwargs)."""

from __future__ import annotations

import importlib
from typing import Any

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage


class StorageBackendFactory:
    @classmethod
    def create_backend(
        cls, backend_name: str, storage_config: Any, mem_pool_host: Any, **kwargs: Any
    ) -> HiCacheStorage:
        if backend_name != "dynamic" or storage_config.extra_config is None:
            raise ValueError(f"Unknown storage backend {backend_name!r}")
        extra = storage_config.extra_config
        for field in ("backend_name", "module_path", "class_name"):
            if field not in extra:
                raise ValueError(f"Missing required field {field!r} in backend config for 'dynamic' backend")
        backend_class = getattr(importlib.import_module(extra["module_path"]), extra["class_name"])
        if not issubclass(backend_class, HiCacheStorage):
            raise TypeError(f"Backend class {extra['class_name']} must inherit from HiCacheStorage")
        return backend_class(storage_config, kwargs)
