"""The synthetic table prior (written with polars). Knows nothing of tabfm or tabfm.parallel.

    priors/    latent tables: SCM, MLP and tree-ensemble priors, their mix, hyperparameter distributions as data
    columns.py one latent -> one messy column (types, skew, categories, missing cells)
    targets.py latent targets -> classes or a regression target; the train/test split
    tables.py  a prior sample -> a polars DataFrame + TableMeta
    encode.py  tables -> padded tensors (a Batch)
    loader.py  batches per (seed, step, data-parallel rank); DataLoader with worker processes
    dump.py    Parquet + JSON shards, read back as a fixed dataset
    config.py  the typed `data:` config sections
"""
