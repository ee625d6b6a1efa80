"""The UMBP master: its gRPC service (:mod:`.server`), wire format (:mod:`.wire`) and state (:mod:`.store`, :mod:`.redis_store`)."""
