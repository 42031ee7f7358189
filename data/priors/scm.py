"""Structural causal model prior: a random DAG whose nodes are noisy nonlinear functions of their parents.

Features and targets are chosen nodes, so a feature can be a cause of the target, an effect of it, a sibling
through a hidden confounder, or unrelated: the dependence structures real tables have and a plain regression
misses. Node order is the topological order; edges only go from earlier to later nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tabfm.data.priors.base import ACTIVATIONS, INPUT_DISTS, PriorSample, sample_inputs, standardize
from tabfm.data.priors.hparams import Choice, Dist, Fixed, IntUniform, LogUniform, Uniform, check_space, sample_space


@dataclass(frozen=True)
class SCMSpace:
    """Distributions of the SCM prior's hyperparameters; each table draws one value from each."""

    hidden_nodes: Dist = IntUniform(0, 10)
    """Unobserved nodes besides features and targets: confounders and mediators the table never shows."""
    edge_prob: Dist = Uniform(0.3, 0.9)
    """Chance that an earlier node is a parent of a later one (before the max_parents cap)."""
    max_parents: Dist = IntUniform(1, 4)
    """Most parents a node keeps: few parents make sparse, local mechanisms."""
    root_dist: Dist = Choice(INPUT_DISTS)
    """Distribution of the root (parentless) nodes."""
    activation_pool: Dist = Fixed(
        ("tanh", "relu", "sin", "step", "square", "cube", "abs", "sigmoid", "gauss", "leaky_relu", "identity")
    )
    """The nonlinearities a table may use; `n_activations` of them are picked per table."""
    n_activations: Dist = IntUniform(1, 4)
    """How many distinct nonlinearities one table's nodes draw from (1: every node uses the same one)."""
    gain: Dist = LogUniform(0.5, 2.5)
    """Scale of a node's standardized input before its nonlinearity: larger gains bend it more."""
    noise_std: Dist = LogUniform(0.05, 0.8)
    """Std of each node's additive noise, relative to its (unit) signal."""
    mult_noise_frac: Dist = Uniform(0.0, 0.5)
    """Fraction of nodes whose output is also multiplied by log-normal noise (heteroscedastic nodes)."""
    mult_noise_std: Dist = LogUniform(0.05, 0.5)
    """Std of the log of the multiplicative noise."""
    target_depth: Dist = Uniform(0.4, 1.0)
    """Where the targets sit in topological order (1: last): deeper targets have more causes."""


class SCMPrior:
    """Random DAG, evaluated node by node in topological order, all rows at once."""

    name = "scm"

    def __init__(self, space: SCMSpace | None = None) -> None:
        self.space = space or SCMSpace()
        check_space(self.space)

    def sample(self, rng: np.random.Generator, n_rows: int, n_features: int, n_targets: int) -> PriorSample:
        hp = sample_space(self.space, rng)
        n_nodes = n_features + n_targets + hp["hidden_nodes"]
        pool = list(hp["activation_pool"])
        n_act = min(hp["n_activations"], len(pool))
        acts = [str(a) for a in rng.choice(pool, size=n_act, replace=False)]
        hp["activations"] = acts
        targets = _pick_targets(rng, n_nodes, n_targets, hp["target_depth"])
        is_target = np.zeros(n_nodes, dtype=bool)
        is_target[targets] = True

        values = np.empty((n_rows, n_nodes))
        for j in range(n_nodes):
            parents = _pick_parents(rng, j, hp["edge_prob"], hp["max_parents"], force=bool(is_target[j]))
            if parents.size == 0:
                values[:, j] = sample_inputs(rng, n_rows, 1, hp["root_dist"])[:, 0]
                continue
            pre = standardize(values[:, parents] @ rng.standard_normal(parents.size))
            v = standardize(ACTIVATIONS[acts[int(rng.integers(n_act))]](pre * hp["gain"] + rng.uniform(-1.0, 1.0)))
            if rng.random() < hp["mult_noise_frac"]:
                v = v * np.exp(hp["mult_noise_std"] * rng.standard_normal(n_rows))
            values[:, j] = standardize(v + hp["noise_std"] * rng.standard_normal(n_rows))

        others = np.flatnonzero(~is_target)
        features = rng.choice(others, size=n_features, replace=False)
        return PriorSample(x=values[:, features], y=values[:, targets], prior=self.name, hparams=hp)


def _pick_targets(rng: np.random.Generator, n_nodes: int, n_targets: int, depth: float) -> np.ndarray:
    """Target nodes near relative position `depth`, never node 0 (which can have no parents)."""
    pos = np.arange(1, n_nodes)
    weight = np.exp(-6.0 * np.abs(pos / max(n_nodes - 1, 1) - depth))
    return np.sort(rng.choice(pos, size=n_targets, replace=False, p=weight / weight.sum()))


def _pick_parents(rng: np.random.Generator, j: int, edge_prob: float, max_parents: int, force: bool) -> np.ndarray:
    """Parents of node j among nodes 0..j-1; `force` guarantees at least one (targets must have causes)."""
    if j == 0:
        return np.empty(0, dtype=np.int64)
    parents = np.flatnonzero(rng.random(j) < edge_prob)
    if parents.size == 0 and force:
        parents = np.array([int(rng.integers(j))])
    if parents.size > max_parents:
        parents = np.sort(rng.choice(parents, size=max_parents, replace=False))
    return parents
