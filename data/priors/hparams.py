"""Hyperparameter distributions, declared as data.

Each prior declares a frozen dataclass whose fields are distributions, one docstring per field (as TabICL's
prior declares its sampled hyperparameters). Every table draws one value from each, so what a prior did for a
table is a plain JSON-able dict stored in the table's metadata, and a config can swap any range without code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Union

import numpy as np


@dataclass(frozen=True)
class Fixed:
    """Always the same value (a distribution with one atom)."""

    value: Any

    def sample(self, rng: np.random.Generator) -> Any:
        return self.value

    def check(self, name: str) -> None:
        pass


@dataclass(frozen=True)
class Uniform:
    """A float uniform in [low, high]."""

    low: float
    high: float

    def sample(self, rng: np.random.Generator) -> float:
        return float(rng.uniform(self.low, self.high))

    def check(self, name: str) -> None:
        if not self.low <= self.high:
            raise ValueError(f"{name}: Uniform low={self.low} > high={self.high}; make low <= high")


@dataclass(frozen=True)
class LogUniform:
    """A positive float whose logarithm is uniform: for scales that span orders of magnitude."""

    low: float
    high: float

    def sample(self, rng: np.random.Generator) -> float:
        return float(math.exp(rng.uniform(math.log(self.low), math.log(self.high))))

    def check(self, name: str) -> None:
        if not 0 < self.low <= self.high:
            raise ValueError(f"{name}: LogUniform needs 0 < low <= high, got low={self.low}, high={self.high}")


@dataclass(frozen=True)
class IntUniform:
    """An integer uniform in [low, high], both included."""

    low: int
    high: int

    def sample(self, rng: np.random.Generator) -> int:
        return int(rng.integers(self.low, self.high + 1))

    def check(self, name: str) -> None:
        if not self.low <= self.high:
            raise ValueError(f"{name}: IntUniform low={self.low} > high={self.high}; make low <= high")


@dataclass(frozen=True)
class IntLogUniform:
    """An integer in [low, high] whose logarithm is roughly uniform: small counts are as likely as large ones."""

    low: int
    high: int

    def sample(self, rng: np.random.Generator) -> int:
        x = math.exp(rng.uniform(math.log(self.low), math.log(self.high + 1)))
        return int(min(max(math.floor(x), self.low), self.high))

    def check(self, name: str) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"{name}: IntLogUniform needs 1 <= low <= high, got low={self.low}, high={self.high}")


@dataclass(frozen=True)
class Choice:
    """One of `options`, with optional `weights` (uniform when None)."""

    options: tuple
    weights: tuple[float, ...] | None = None

    def sample(self, rng: np.random.Generator) -> Any:
        if self.weights is None:
            return self.options[int(rng.integers(len(self.options)))]
        p = np.asarray(self.weights, dtype=float)
        return self.options[int(rng.choice(len(self.options), p=p / p.sum()))]

    def check(self, name: str) -> None:
        if not self.options:
            raise ValueError(f"{name}: Choice needs at least one option")
        if self.weights is not None:
            if len(self.weights) != len(self.options):
                raise ValueError(f"{name}: Choice has {len(self.options)} options but {len(self.weights)} weights")
            if min(self.weights) < 0 or sum(self.weights) <= 0:
                raise ValueError(f"{name}: Choice weights must be >= 0 with a positive sum, got {self.weights}")


Dist = Union[Fixed, Uniform, LogUniform, IntUniform, IntLogUniform, Choice]


def sample_space(space: Any, rng: np.random.Generator) -> dict[str, Any]:
    """Draw one value per field of a hyperparameter-space dataclass, in declaration order."""
    return {f.name: getattr(space, f.name).sample(rng) for f in fields(space)}


def check_space(space: Any) -> None:
    """Raise ValueError naming the first field whose distribution is malformed."""
    for f in fields(space):
        dist = getattr(space, f.name)
        if not hasattr(dist, "sample"):
            name = f"{type(space).__name__}.{f.name}"
            raise ValueError(f"{name} must be a distribution (Uniform, Choice, ...), got {dist!r}")
        dist.check(f"{type(space).__name__}.{f.name}")
