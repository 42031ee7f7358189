"""The synthetic table prior (written with polars). Knows nothing of tabfm or tabfm.parallel."""
