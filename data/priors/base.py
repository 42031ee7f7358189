"""What every prior returns, and the pieces the priors share (activations, input distributions).

A prior only produces latent numbers: x [n_rows, n_features] and y [n_rows, n_targets]. Turning them into a
messy table (column types, missing cells, classes) is tables.py's job, so every prior gets the same mess.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


@dataclass
class PriorSample:
    """Latent features and targets of one table, with the hyperparameters that made them."""

    x: np.ndarray
    """[n_rows, n_features] float64 latent features."""
    y: np.ndarray
    """[n_rows, n_targets] float64 latent targets (one per class score, or one)."""
    prior: str
    """Name of the prior family that drew the table ("scm", "mlp", "trees")."""
    hparams: dict[str, Any]
    """The hyperparameters drawn for this table (JSON-able)."""


class Prior(Protocol):
    """A family of tables: `sample` draws one table's latent features and targets from `rng`."""

    name: str

    def sample(self, rng: np.random.Generator, n_rows: int, n_features: int, n_targets: int) -> PriorSample: ...


def standardize(a: np.ndarray) -> np.ndarray:
    """Zero mean, unit variance per column; a constant column becomes zeros (not NaN)."""
    a = a - a.mean(axis=0)
    std = a.std(axis=0)
    return a / np.where(std > 1e-12, std, 1.0)


def _step(a: np.ndarray) -> np.ndarray:
    return (a > 0).astype(np.float64)


ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "identity": lambda a: a,
    "tanh": np.tanh,
    "relu": lambda a: np.maximum(a, 0.0),
    "leaky_relu": lambda a: np.where(a > 0, a, 0.1 * a),
    "sin": np.sin,
    "step": _step,
    "square": lambda a: a * a,
    "cube": lambda a: a * a * a,
    "abs": np.abs,
    "sigmoid": lambda a: 1.0 / (1.0 + np.exp(-a)),
    "gauss": lambda a: np.exp(-a * a),
    "softplus": lambda a: np.logaddexp(0.0, a),
}
"""Elementwise nonlinearities the priors pick from, by name (names go into the metadata)."""


INPUT_DISTS = ("normal", "uniform", "mixture", "correlated", "student_t")
"""Ways to draw independent inputs (root causes, MLP and tree inputs)."""


def sample_inputs(rng: np.random.Generator, n_rows: int, n_cols: int, kind: str) -> np.ndarray:
    """[n_rows, n_cols] standardized inputs of one distribution family; varied families vary the marginals."""
    if kind == "normal":
        x = rng.standard_normal((n_rows, n_cols))
    elif kind == "uniform":
        x = rng.uniform(-1.0, 1.0, (n_rows, n_cols))
    elif kind == "mixture":  # clusters: a few Gaussian blobs
        k = int(rng.integers(2, 6))
        centres = rng.standard_normal((k, n_cols)) * 2.0
        x = centres[rng.integers(k, size=n_rows)] + rng.standard_normal((n_rows, n_cols))
    elif kind == "correlated":  # a random linear mix makes the columns depend on each other
        mix = rng.standard_normal((n_cols, n_cols)) / np.sqrt(n_cols) + np.eye(n_cols)
        x = rng.standard_normal((n_rows, n_cols)) @ mix
    elif kind == "student_t":
        x = rng.standard_t(3.0, (n_rows, n_cols))
    else:
        raise ValueError(f"unknown input distribution {kind!r}; use one of {INPUT_DISTS}")
    return standardize(x)
