"""Latent targets -> a task's labels (imbalanced classes or a regression target), and the train/test split."""

from __future__ import annotations

import numpy as np

from tabfm.data.config import TableConfig

TASKS = ("classification", "regression")


def draw_task(rng: np.random.Generator, cfg: TableConfig) -> str:
    """Classification or regression, with `cfg.regression_prob`."""
    return "regression" if rng.random() < cfg.regression_prob else "classification"


def draw_label_plan(rng: np.random.Generator, cfg: TableConfig, task: str) -> tuple[int, str, int]:
    """(classes wanted, label mode, latent targets the prior must draw) for one table."""
    if task == "regression":
        return 0, "skewed" if rng.random() < 0.25 else "linear", 1
    if task != "classification":
        raise ValueError(f"unknown task {task!r}; use one of {TASKS}")
    if cfg.min_classes == 2 and (cfg.max_classes == 2 or rng.random() < cfg.binary_prob):
        k = 2
    else:
        k = int(rng.integers(max(cfg.min_classes, 3), cfg.max_classes + 1))
    if k > 2 and rng.random() < cfg.argmax_class_prob:
        return k, "argmax", k
    return k, "threshold", 1


def make_labels(
    rng: np.random.Generator, y: np.ndarray, n_classes: int, mode: str, cfg: TableConfig
) -> tuple[np.ndarray, int]:
    """(labels [n_rows], realised n_classes) from latent targets y [n_rows, n_targets].

    Class labels are int64 in 0..n_classes-1 with random, often imbalanced proportions; regression labels are
    float64 on a random scale. Argmax classes that end up empty are dropped, so n_classes can shrink (never below 2).
    """
    if mode in ("linear", "skewed"):
        t = np.exp(0.7 * np.clip(y[:, 0], -8, 8)) if mode == "skewed" else y[:, 0]
        return 10.0 ** rng.uniform(-1.0, 3.0) * t + rng.normal(0.0, 10.0), 0
    n = y.shape[0]
    alpha = np.exp(rng.uniform(np.log(cfg.min_imbalance_alpha), np.log(cfg.max_imbalance_alpha)))
    share = rng.dirichlet(np.full(n_classes, alpha))
    share = np.maximum(share, 2.0 / n)  # at least about two rows per class
    share /= share.sum()
    if mode == "argmax":  # class scores shifted by log-shares: nominal classes, imbalanced by the shift
        raw = np.argmax(y + np.log(share), axis=1)
        present = np.unique(raw)
        if present.size >= 2:
            relabel = np.full(n_classes, -1)
            relabel[present] = rng.permutation(present.size)
            return relabel[raw].astype(np.int64), int(present.size)
    cuts = np.quantile(y[:, 0], np.cumsum(share)[:-1])
    ordered = np.searchsorted(cuts, y[:, 0], side="right")
    present = np.unique(ordered)
    if present.size < 2:  # a latent with a few atoms can swallow thresholds: fall back to a median split
        ordered = (y[:, 0] > np.median(y[:, 0])).astype(np.int64)
        if np.unique(ordered).size < 2:
            ordered = (np.arange(n) % 2).astype(np.int64)  # a constant latent: an unlearnable coin
        present = np.unique(ordered)
    relabel = np.full(n_classes, -1)
    relabel[present] = rng.permutation(present.size)  # thresholds are ordered, class ids are not
    return relabel[ordered].astype(np.int64), int(present.size)


def split_order(
    rng: np.random.Generator, labels: np.ndarray, n_classes: int, cfg: TableConfig
) -> tuple[np.ndarray, int]:
    """(row order with train rows first, n_train); every class has at least one train row."""
    n = labels.shape[0]
    frac = rng.uniform(cfg.min_train_fraction, cfg.max_train_fraction)
    n_train = int(np.clip(round(frac * n), max(n_classes, 1), n - 1))
    order = rng.permutation(n)
    if n_classes == 0:
        return order, n_train
    for c in range(n_classes):
        in_train = labels[order[:n_train]]
        if (in_train == c).any():
            continue
        test_pos = n_train + int(np.flatnonzero(labels[order[n_train:]] == c)[0])
        counts = np.bincount(in_train, minlength=n_classes)
        train_pos = int(np.flatnonzero(in_train == np.argmax(counts))[0])
        order[train_pos], order[test_pos] = order[test_pos], order[train_pos]
    return order, n_train
