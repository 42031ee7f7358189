"""Random MLP prior: targets are a randomly initialised network of some of the inputs.

Smooth, dense interactions of many features (the opposite of the tree prior). Some feature columns are read off
hidden units instead of inputs, as in TabPFN's MLP prior, so features are not always independent causes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tabfm.data.priors.base import ACTIVATIONS, INPUT_DISTS, PriorSample, sample_inputs, standardize
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
class MLPSpace:
    """Distributions of the MLP prior's hyperparameters; each table draws one value from each."""

    n_layers: Dist = IntUniform(1, 3)
    """Hidden layers between the inputs and the targets."""
    width: Dist = IntLogUniform(8, 64)
    """Units per hidden layer."""
    activation: Dist = Choice(("tanh", "relu", "sin", "sigmoid", "leaky_relu", "abs", "softplus", "step"))
    """The network's nonlinearity (one per table)."""
    weight_density: Dist = Uniform(0.3, 1.0)
    """Fraction of weights kept, the rest zeroed: sparse networks have local structure."""
    gain: Dist = LogUniform(0.5, 2.5)
    """Scale of each layer's standardized pre-activation: larger gains bend the function more."""
    input_dist: Dist = Choice(INPUT_DISTS)
    """Distribution of the input features."""
    relevant_frac: Dist = Uniform(0.3, 1.0)
    """Fraction of the inputs the network reads; the others are plausible-looking but unrelated."""
    hidden_feature_frac: Dist = Uniform(0.0, 0.5)
    """Fraction of feature columns read off hidden units (effects of the inputs, not causes)."""
    noise_std: Dist = LogUniform(0.05, 0.8)
    """Std of the noise on the targets and on hidden-unit features, relative to their unit signal."""


class MLPPrior:
    """Inputs -> random MLP -> targets, evaluated for all rows at once."""

    name = "mlp"

    def __init__(self, space: MLPSpace | None = None) -> None:
        self.space = space or MLPSpace()
        check_space(self.space)

    def sample(self, rng: np.random.Generator, n_rows: int, n_features: int, n_targets: int) -> PriorSample:
        hp = sample_space(self.space, rng)
        act = ACTIVATIONS[hp["activation"]]
        n_hidden_feats = min(int(round(hp["hidden_feature_frac"] * n_features)), n_features - 1)
        n_inputs = n_features - n_hidden_feats
        inputs = sample_inputs(rng, n_rows, n_inputs, hp["input_dist"])
        n_relevant = max(1, int(round(hp["relevant_frac"] * n_inputs)))
        h = inputs[:, rng.choice(n_inputs, size=n_relevant, replace=False)]

        hidden = []
        for _ in range(hp["n_layers"]):
            shape = (h.shape[1], hp["width"])
            w = rng.standard_normal(shape) * (rng.random(shape) < hp["weight_density"])
            h = standardize(act(standardize(h @ w) * hp["gain"] + rng.uniform(-1.0, 1.0, hp["width"])))
            hidden.append(h)
        y = standardize(h @ rng.standard_normal((h.shape[1], n_targets)))
        y = standardize(y + hp["noise_std"] * rng.standard_normal(y.shape))

        units = np.concatenate(hidden, axis=1)
        picked = units[:, rng.choice(units.shape[1], size=n_hidden_feats, replace=units.shape[1] < n_hidden_feats)]
        picked = standardize(picked + hp["noise_std"] * rng.standard_normal(picked.shape))
        x = np.concatenate([inputs, picked], axis=1)[:, rng.permutation(n_features)]
        return PriorSample(x=x, y=y, prior=self.name, hparams=hp)
