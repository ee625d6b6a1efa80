"""mori-core's built-in backends. They register through the ``mori.backends`` entry-point group
exactly like third-party plugins do."""
