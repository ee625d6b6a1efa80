"""Stand-in of the engine for the mori-umbp tests (see ../README)."""
