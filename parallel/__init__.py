"""ATP adaptive 2D tensor parallelism. Nothing here knows about tables."""
