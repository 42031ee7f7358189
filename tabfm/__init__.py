"""tabfm: a tabular foundation model with ATP adaptive 2D tensor parallelism built in.

The public surface is what this module exports; everything else is internal.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
