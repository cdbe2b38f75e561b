"""One package per backend, named as registered. Each package's `__init__` registers its
implementations with their feature table and imports no kernel code; the registry finds
them here on first use (`dispatch.registry`)."""
