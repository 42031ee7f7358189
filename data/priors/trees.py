"""Random tree-ensemble prior: targets are sums of random axis-aligned decision trees.

Piecewise-constant targets with sharp thresholds and feature interactions: the tables gradient-boosted trees
are good at and smooth models are not. Split thresholds come from the rows that reach a node, so splits cut
where the data is (as a fitted tree's would), not in empty space.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tabfm.data.priors.base import INPUT_DISTS, PriorSample, sample_inputs, standardize
from tabfm.data.priors.hparams import (
    Choice,
    Dist,
    IntLogUniform,
    IntUniform,
    LogUniform,
    Uniform,
    check_space,
    sample_space,
)


@dataclass(frozen=True)
class TreesSpace:
    """Distributions of the tree prior's hyperparameters; each table draws one value from each."""

    n_trees: Dist = IntLogUniform(1, 32)
    """Trees in the ensemble: one tree gives a few flat regions, many give a finer staircase."""
    depth: Dist = IntUniform(1, 5)
    """Depth of every tree: a leaf is an interaction of up to `depth` features."""
    input_dist: Dist = Choice(INPUT_DISTS)
    """Distribution of the input features."""
    relevant_frac: Dist = Uniform(0.3, 1.0)
    """Fraction of features that any tree splits on; the others are unrelated."""
    feature_concentration: Dist = LogUniform(0.2, 5.0)
    """Dirichlet concentration of split-feature frequencies: small values let a few features dominate."""
    tree_decay: Dist = Uniform(0.5, 1.0)
    """Leaf values of tree t are scaled by decay**t, like boosting's shrinking corrections."""
    noise_std: Dist = LogUniform(0.05, 0.8)
    """Std of the noise added to the targets, relative to their unit signal."""


class TreesPrior:
    """Random axis-aligned trees over sampled inputs; leaves hold one value per target."""

    name = "trees"

    def __init__(self, space: TreesSpace | None = None) -> None:
        self.space = space or TreesSpace()
        check_space(self.space)

    def sample(self, rng: np.random.Generator, n_rows: int, n_features: int, n_targets: int) -> PriorSample:
        hp = sample_space(self.space, rng)
        x = sample_inputs(rng, n_rows, n_features, hp["input_dist"])
        n_relevant = max(1, int(round(hp["relevant_frac"] * n_features)))
        relevant = rng.choice(n_features, size=n_relevant, replace=False)
        feature_p = rng.dirichlet(np.full(n_relevant, hp["feature_concentration"]))

        y = np.zeros((n_rows, n_targets))
        for t in range(hp["n_trees"]):
            leaf = _grow_tree(rng, x, hp["depth"], relevant, feature_p)
            y += hp["tree_decay"] ** t * rng.standard_normal((2 ** hp["depth"], n_targets))[leaf]
        y = standardize(standardize(y) + hp["noise_std"] * rng.standard_normal(y.shape))
        return PriorSample(x=x, y=y, prior=self.name, hparams=hp)


def _grow_tree(
    rng: np.random.Generator, x: np.ndarray, depth: int, features: np.ndarray, feature_p: np.ndarray
) -> np.ndarray:
    """Leaf index [n_rows] of each row in one random tree, grown level by level for all rows at once.

    Each node splits a random feature at the median of three random rows reaching it (a random interior
    quantile); nodes no row reaches split anywhere, it does not matter.
    """
    n_rows = x.shape[0]
    rows = np.arange(n_rows)
    node = np.zeros(n_rows, dtype=np.int64)
    for level in range(depth):
        n_nodes = 2**level
        feat = rng.choice(features, size=n_nodes, p=feature_p)
        picks = np.zeros((3, n_nodes))
        for k in range(3):
            perm = rng.permutation(n_rows)
            present, first = np.unique(node[perm], return_index=True)
            picks[k, present] = x[perm[first], feat[present]]
        threshold = np.median(picks, axis=0)
        node = 2 * node + (x[rows, feat[node]] > threshold[node])
    return node
