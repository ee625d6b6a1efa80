"""Stand-in of vllm.v1.kv_offload.factory: loads the spec named by spec_name / spec_module_path."""

from __future__ import annotations

import importlib
from typing import Any

from vllm.v1.kv_offload.spec import OffloadingSpec


class OffloadingSpecFactory:
    @classmethod
    def create_spec(cls, config: Any, kv_cache_config: Any) -> OffloadingSpec:
        extra = config.kv_transfer_config.kv_connector_extra_config
        module = importlib.import_module(extra["spec_module_path"])
        spec_cls = getattr(module, extra["spec_name"])
        assert issubclass(spec_cls, OffloadingSpec)
        return spec_cls(config, kv_cache_config)
