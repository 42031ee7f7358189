"""One latent variable -> one messy table column: its type, its marginal shape, and its missing cells.

Every transform is monotone in the latent (or a quantisation of it), so the mess changes how a column looks,
not what it knows: a model must undo skew, tails, integer rounding and string categories to read the signal.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from tabfm.data.config import TableConfig
from tabfm.data.priors.base import INPUT_DISTS, sample_inputs

KINDS = ("numeric", "skewed", "heavy_tailed", "integer", "categorical")
"""Column types; "categorical" columns are strings, "integer" Int64, the rest Float64."""
ROLES = ("signal", "irrelevant", "constant", "duplicate")
"""Why a column is there: a prior feature, unrelated noise, one repeated value, or a copy of another column."""
MISSING = ("none", "mcar", "value")
"""How cells go missing: never, completely at random, or with a chance that grows with the cell's own value."""


def draw_role(rng: np.random.Generator, cfg: TableConfig) -> str:
    """A column's role, with the chances `cfg` gives."""
    r = rng.random()
    chances = (("irrelevant", cfg.irrelevant_prob), ("constant", cfg.constant_prob), ("duplicate", cfg.duplicate_prob))
    for role, p in chances:
        if r < p:
            return role
        r -= p
    return "signal"


def draw_kind(rng: np.random.Generator, cfg: TableConfig) -> str:
    """A column's type: categorical with `categorical_prob`, else one of the numeric shapes."""
    if rng.random() < cfg.categorical_prob:
        return "categorical"
    r = rng.random()
    chances = (("skewed", cfg.skewed_prob), ("heavy_tailed", cfg.heavy_tailed_prob), ("integer", cfg.integer_prob))
    for kind, p in chances:
        if r < p:
            return kind
        r -= p
    return "numeric"


def noise_latent(rng: np.random.Generator, n_rows: int) -> np.ndarray:
    """[n_rows] standardized noise for an irrelevant column, from a random input family."""
    return sample_inputs(rng, n_rows, 1, INPUT_DISTS[int(rng.integers(len(INPUT_DISTS)))])[:, 0]


def render(rng: np.random.Generator, z: np.ndarray, kind: str, max_categories: int) -> np.ndarray:
    """Cell values of a column from its standardized latent z [n_rows]: float64, int64, or str (object)."""
    scale = 10.0 ** rng.uniform(-1.0, 2.0)
    zc = np.clip(z, -8.0, 8.0)  # exp and sinh of a rare extreme latent would overflow float32 downstream
    if kind == "numeric":
        return scale * z + scale * rng.normal(0.0, 2.0)
    if kind == "skewed":  # log-normal-like: prices, durations
        return scale * np.exp(rng.uniform(0.4, 1.2) * zc)
    if kind == "heavy_tailed":  # sinh stretches both tails polynomially-to-exponentially
        s = rng.uniform(1.0, 2.5)
        return scale * np.sinh(s * zc) / s + scale * rng.normal(0.0, 1.0)
    if kind == "integer":
        if rng.random() < 0.5:  # counts: non-negative and skewed
            return np.round(np.exp(rng.uniform(-0.5, 2.5) + rng.uniform(0.3, 1.0) * zc)).astype(np.int64)
        return np.round(rng.uniform(0.5, 5.0) * zc + rng.integers(0, 100)).astype(np.int64)  # ordinal levels, ages
    if kind == "categorical":
        return _quantise(rng, z, max_categories)
    raise ValueError(f"unknown column kind {kind!r}; use one of {KINDS}")


def _quantise(rng: np.random.Generator, z: np.ndarray, max_categories: int) -> np.ndarray:
    """Cut z at random quantiles into 2..max_categories bins, named in random order (nominal, not ordinal)."""
    n_bins = int(np.clip(round(np.exp(rng.uniform(np.log(2), np.log(max_categories + 1)))), 2, max_categories))
    share = rng.dirichlet(np.full(n_bins, rng.uniform(0.5, 5.0)))
    codes = np.searchsorted(np.quantile(z, np.cumsum(share)[:-1]), z, side="right")
    names = np.array([f"v{k:02d}" for k in rng.permutation(n_bins)], dtype=object)
    return names[codes]


def constant_values(rng: np.random.Generator, n_rows: int, kind: str) -> np.ndarray:
    """A column with one value in every row, of the given kind."""
    if kind == "categorical":
        return np.full(n_rows, f"v{int(rng.integers(50)):02d}", dtype=object)
    if kind == "integer":
        return np.full(n_rows, int(rng.integers(0, 100)), dtype=np.int64)
    return np.full(n_rows, float(np.round(rng.normal(0.0, 10.0), 3)))


def draw_missing(rng: np.random.Generator, cfg: TableConfig, table_has_missing: bool) -> str:
    """A column's missingness kind."""
    if not table_has_missing or rng.random() >= cfg.missing_column_prob:
        return "none"
    return "value" if rng.random() < cfg.value_missing_prob else "mcar"


def missing_mask(rng: np.random.Generator, z: np.ndarray, how: str, max_rate: float) -> np.ndarray:
    """[n_rows] bool, True where the cell is missing; at least one cell always stays observed."""
    n = z.shape[0]
    if how == "none":
        return np.zeros(n, dtype=bool)
    rate = rng.uniform(0.02, max_rate) if max_rate > 0.02 else max_rate
    if how == "mcar":
        mask = rng.random(n) < rate
    elif how == "value":  # high (or, with sign -1, low) values go missing more often: censoring, non-response
        sz = rng.choice((-1.0, 1.0)) * z
        cut = np.quantile(sz, 1.0 - rate)
        mask = rng.random(n) < 1.0 / (1.0 + np.exp(-rng.uniform(2.0, 6.0) * (sz - cut)))
    else:
        raise ValueError(f"unknown missingness {how!r}; use one of {MISSING}")
    if mask.all():
        mask[int(rng.integers(n))] = False
    return mask


def to_series(name: str, values: np.ndarray, kind: str, mask: np.ndarray) -> pl.Series:
    """A polars column with nulls at `mask`: String for categorical, Int64 for integer, else Float64."""
    if kind == "categorical":
        vals = values.copy()
        vals[mask] = None
        return pl.Series(name, vals.tolist(), dtype=pl.String)
    if kind == "integer":
        return pl.Series(name, values, dtype=pl.Int64).scatter(np.flatnonzero(mask), None)
    return pl.Series(name, np.where(mask, np.nan, values.astype(np.float64)), nan_to_null=True)
