"""The prior config section, the mixture of prior families, and `make_prior` that builds either."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tabfm.data.priors.base import Prior, PriorSample
from tabfm.data.priors.mlp import MLPPrior, MLPSpace
from tabfm.data.priors.scm import SCMPrior, SCMSpace
from tabfm.data.priors.trees import TreesPrior, TreesSpace

FAMILIES = ("scm", "mlp", "trees")
PRIOR_NAMES = (*FAMILIES, "mix")


@dataclass
class PriorConfig:
    """Which prior draws the tables, and the hyperparameter distributions of each family."""

    name: str = "mix"
    """"scm", "mlp", "trees", or "mix" (one family drawn per table with `weights`)."""
    weights: dict[str, float] = field(default_factory=lambda: {"scm": 0.4, "mlp": 0.3, "trees": 0.3})
    """Chance of each family under "mix" (normalised; a family with weight 0 is never drawn)."""
    scm: SCMSpace = field(default_factory=SCMSpace)
    """Hyperparameter distributions of the SCM prior."""
    mlp: MLPSpace = field(default_factory=MLPSpace)
    """Hyperparameter distributions of the MLP prior."""
    trees: TreesSpace = field(default_factory=TreesSpace)
    """Hyperparameter distributions of the tree-ensemble prior."""

    def __post_init__(self) -> None:
        if self.name not in PRIOR_NAMES:
            raise ValueError(f"prior.name={self.name!r} is unknown; use one of {PRIOR_NAMES}")
        unknown = set(self.weights) - set(FAMILIES)
        if unknown:
            raise ValueError(f"prior.weights has unknown families {sorted(unknown)}; valid keys are {FAMILIES}")
        if any(w < 0 for w in self.weights.values()) or sum(self.weights.values()) <= 0:
            raise ValueError(f"prior.weights must be >= 0 with a positive sum, got {self.weights}")


class MixPrior:
    """Draws each table from one family, chosen with fixed weights."""

    name = "mix"

    def __init__(self, priors: dict[str, Prior], weights: dict[str, float]) -> None:
        self.names = [n for n in FAMILIES if weights.get(n, 0.0) > 0]
        self.priors = [priors[n] for n in self.names]
        p = np.array([weights[n] for n in self.names], dtype=float)
        self.p = p / p.sum()

    def sample(self, rng: np.random.Generator, n_rows: int, n_features: int, n_targets: int) -> PriorSample:
        k = int(rng.choice(len(self.priors), p=self.p))
        return self.priors[k].sample(rng, n_rows, n_features, n_targets)


def make_prior(cfg: PriorConfig) -> Prior:
    """The prior `cfg.name` names, with the hyperparameter spaces of `cfg`."""
    families: dict[str, Prior] = {"scm": SCMPrior(cfg.scm), "mlp": MLPPrior(cfg.mlp), "trees": TreesPrior(cfg.trees)}
    if cfg.name == "mix":
        return MixPrior(families, cfg.weights)
    return families[cfg.name]
