"""Engine integrations: :mod:`.sglang` (a HiCache storage backend) and :mod:`.vllm` (a KV offloading
spec). Each imports its engine's base classes, so it loads only where that engine is installed."""
