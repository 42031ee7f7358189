"""The synthetic prior: deterministic, varied (every column type, missingness and task), learnable but not trivial,
and loud about bad config."""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import fields

import numpy as np
import polars as pl
import pytest
from scipy.stats import rankdata
from sklearn.linear_model import LogisticRegression

from tabfm.data import columns as col
from tabfm.data.config import CurriculumConfig, DataConfig, TableConfig
from tabfm.data.loader import PriorSource
from tabfm.data.priors.hparams import IntUniform, Uniform, sample_space
from tabfm.data.priors.mix import PriorConfig, make_prior
from tabfm.data.priors.mlp import MLPPrior, MLPSpace
from tabfm.data.priors.scm import SCMPrior, SCMSpace
from tabfm.data.priors.trees import TreesPrior, TreesSpace
from tabfm.data.tables import TARGET, sample_table

FAMILIES = [SCMPrior, MLPPrior, TreesPrior]


def _tables(cfg: DataConfig, n_steps: int, dp_rank: int = 0) -> list:
    src = PriorSource(cfg)
    return [t for s in range(n_steps) for t in src.tables(s, dp_rank)]


@pytest.mark.parametrize("family", FAMILIES)
def test_prior_families_are_deterministic_and_ignore_global_rng(family):
    np.random.seed(1)
    a = family().sample(np.random.default_rng(7), 50, 6, 3)
    np.random.seed(2)  # a prior must not read numpy's global RNG
    b = family().sample(np.random.default_rng(7), 50, 6, 3)
    c = family().sample(np.random.default_rng(8), 50, 6, 3)
    assert a.x.shape == (50, 6) and a.y.shape == (50, 3)
    assert np.isfinite(a.x).all() and np.isfinite(a.y).all()
    assert np.array_equal(a.x, b.x) and np.array_equal(a.y, b.y) and a.hparams == b.hparams
    assert not np.array_equal(a.x, c.x)


@pytest.mark.parametrize("space", [SCMSpace(), MLPSpace(), TreesSpace()])
def test_hyperparameter_spaces_are_data(space):
    """Every field is a distribution; a draw has one value per field, inside its declared range."""
    hp = sample_space(space, np.random.default_rng(0))
    assert list(hp) == [f.name for f in fields(space)]
    for f in fields(space):
        dist = getattr(space, f.name)
        if hasattr(dist, "low"):
            assert dist.low <= hp[f.name] <= dist.high


def test_mix_draws_every_family_with_its_weights():
    prior = make_prior(PriorConfig(name="mix", weights={"scm": 1.0, "mlp": 1.0, "trees": 2.0}))
    rng = np.random.default_rng(0)
    counts = Counter(prior.sample(rng, 20, 3, 1).prior for _ in range(400))
    assert set(counts) == {"scm", "mlp", "trees"}
    assert counts["trees"] > counts["scm"] and counts["trees"] > counts["mlp"]


def test_same_seed_same_tables_and_different_otherwise():
    cfg = DataConfig.tiny(seed=3)
    a, b = PriorSource(cfg).tables(5, 1), PriorSource(cfg).tables(5, 1)
    assert all(x.df.equals(y.df) and x.meta == y.meta for x, y in zip(a, b))
    src, other_seed = PriorSource(cfg), PriorSource(DataConfig.tiny(seed=4))
    for other in (src.tables(6, 1), src.tables(5, 0), other_seed.tables(5, 1)):
        assert not any(x.df.equals(y.df) for x, y in zip(a, other))


def test_table_layout_matches_metadata():
    for t in _tables(DataConfig.tiny(seed=1), 6):
        df, meta = t.df, t.meta
        assert df.columns == [c.name for c in meta.columns] + [TARGET]
        assert 0 < meta.n_train < df.height
        for c in meta.columns:
            s = df[c.name]
            expected = {"categorical": pl.String, "integer": pl.Int64}.get(c.kind, pl.Float64)
            assert s.dtype == expected, c
            if c.missing == "none":
                assert s.null_count() == 0, c
            if c.role == "constant":
                assert s.n_unique() == 1
            if c.role == "duplicate":
                assert any(df[o.name].equals(s) for o in meta.columns if o.name != c.name and o.role != "duplicate")
            if c.kind == "categorical" and c.role != "constant":
                assert 1 <= s.drop_nulls().n_unique() <= 50
        y = df[TARGET]
        if meta.task == "classification":
            assert y.dtype == pl.Int64 and 2 <= meta.n_classes <= 10
            assert sorted(y.unique().to_list()) == list(range(meta.n_classes))
            assert y[: meta.n_train].n_unique() == meta.n_classes, "every class needs a train row"
        else:
            assert y.dtype == pl.Float64 and meta.n_classes == 0


def test_every_column_type_missingness_and_task_appears():
    table = TableConfig(min_rows=64, max_rows=64, min_features=8, max_features=8, regression_prob=0.3)
    cfg = DataConfig.tiny(seed=0, table=table)
    tables = _tables(cfg, 40)
    infos = [c for t in tables for c in t.meta.columns]
    assert {c.kind for c in infos} == set(col.KINDS)
    assert {c.role for c in infos} == set(col.ROLES)
    assert {c.missing for c in infos} == set(col.MISSING)
    assert {t.meta.task_kind for t in tables} == {"binary", "multiclass", "regression"}
    assert {t.meta.prior for t in tables} == {"scm", "mlp", "trees"}
    assert {t.meta.label_mode for t in tables} >= {"threshold", "argmax"}
    assert {t.meta.n_classes for t in tables} >= {2, 3, 10}
    counts = [np.bincount(t.df[TARGET].to_numpy()) for t in tables if t.meta.task == "classification"]
    assert max(c.max() / c.min() for c in counts) >= 4, "some tables should be clearly imbalanced"
    categorical = [t.df[c.name] for t in tables for c in t.meta.columns if c.kind == "categorical"]
    cardinality = {s.drop_nulls().n_unique() for s in categorical}
    assert cardinality >= {2, 20}


def test_value_dependent_missingness_follows_the_value():
    rng = np.random.default_rng(0)
    z = np.sort(rng.standard_normal(20000))
    for how in ("mcar", "value"):
        m = col.missing_mask(np.random.default_rng(1), z, how, 0.4)
        low, high = m[:2000].mean(), m[-2000:].mean()
        if how == "mcar":
            assert abs(low - high) < 0.05
        else:
            assert abs(low - high) > 0.5


def _design(t) -> np.ndarray:
    """Train-statistics imputation and scaling for numeric columns, mode imputation + one-hot for categoricals."""
    n, cols = t.meta.n_train, []
    for c in t.meta.columns:
        s = t.df[c.name]
        if c.kind == "categorical":
            mode = s[:n].drop_nulls().mode().sort()
            v = s.fill_null(mode[0] if len(mode) else "").to_numpy()
            cols += [(v == k).astype(float) for k in np.unique(v[:n])]
        else:
            v = s.cast(pl.Float64).to_numpy()
            train = v[:n][~np.isnan(v[:n])]
            mu, sd = (train.mean(), train.std()) if train.size else (0.0, 1.0)
            cols.append((np.where(np.isnan(v), mu, v) - mu) / (sd if sd > 0 else 1.0))
    return np.column_stack(cols)


def _auc(positive: np.ndarray, score: np.ndarray) -> float:
    """ROC-AUC as the Mann-Whitney statistic (ties count half)."""
    r = rankdata(score)
    n_pos = positive.sum()
    return float((r[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * (len(score) - n_pos)))


def _logistic_auc(t) -> float | None:
    """Held-out ROC-AUC of a logistic regression (macro one-vs-rest over classes present in the test rows)."""
    x, y, n = _design(t), t.df[TARGET].to_numpy(), t.meta.n_train
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = LogisticRegression(max_iter=200).fit(x[:n], y[:n])
    p, y_test = model.predict_proba(x[n:]), y[n:]
    if len(model.classes_) == 2:
        return _auc(y_test == model.classes_[1], p[:, 1]) if 0 < y_test.sum() < len(y_test) else None
    aucs = [_auc(y_test == c, p[:, k]) for k, c in enumerate(model.classes_) if 0 < (y_test == c).sum() < len(y_test)]
    return float(np.mean(aucs)) if aucs else None


@pytest.mark.slow
def test_labels_are_learnable_but_not_trivial():
    table = TableConfig(min_rows=100, max_rows=200, min_features=2, max_features=10, regression_prob=0.0)
    src = PriorSource(DataConfig(seed=11, batch_size=1, table=table))
    aucs = np.array([a for s in range(200) if (a := _logistic_auc(src.tables(s, 0)[0])) is not None])
    assert len(aucs) >= 180
    assert 0.6 < aucs.mean() < 0.95, aucs.mean()
    assert (aucs <= 0.99).any()


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: TableConfig(min_rows=500, max_rows=100), "min_rows"),
        (lambda: TableConfig(max_classes=11), "max_classes"),
        (lambda: TableConfig(min_classes=1), "min_classes"),
        (lambda: TableConfig(min_classes=5, max_classes=3), "min_classes"),
        (lambda: TableConfig(min_features=0), "min_features"),
        (lambda: TableConfig(max_train_fraction=1.0), "train_fraction"),
        (lambda: TableConfig(categorical_prob=1.5), "categorical_prob"),
        (lambda: TableConfig(min_rows=10, max_rows=100), "min_rows"),
        (lambda: PriorConfig(name="gan"), "prior.name"),
        (lambda: PriorConfig(weights={"scm": 1.0, "bayes": 1.0}), "bayes"),
        (lambda: PriorConfig(weights={"scm": 0.0}), "positive sum"),
        (lambda: DataConfig(batch_size=0), "batch_size"),
        (lambda: DataConfig(seed=-1), "seed"),
        (lambda: CurriculumConfig(ramp_steps=-5), "ramp_steps"),
        (lambda: SCMPrior(SCMSpace(gain=Uniform(3.0, 1.0))), "SCMSpace.gain"),
        (lambda: TreesPrior(TreesSpace(depth=IntUniform(4, 2))), "TreesSpace.depth"),
    ],
)
def test_bad_config_raises_value_error_that_says_what_to_change(make, words):
    with pytest.raises(ValueError, match=words):
        make()


def test_sample_table_has_the_exact_size_asked_for():
    rng = np.random.default_rng(0)
    t = sample_table(rng, SCMPrior(), TableConfig(), n_rows=37, n_features=5, task="regression")
    assert t.df.shape == (37, 6) and len(t.meta.columns) == 5


@pytest.mark.parametrize("flags,message", [
    (["--priors", "mix,foo"], "--priors foo: no such prior; choose from scm,mlp,trees,mix"),
    (["--sizes", "64x8,64"], "--sizes 64: give ROWSxCOLS sizes such as 64x8,256x16"),
    (["--sizes", "64x0"], "--sizes 64x0: the prior makes no table of 64 rows x 0 columns (table.min_features=0 must "
     "be >= 1); give larger sizes such as 64x8"),
    (["--batch-size", "0"], "--batch-size 0: give 1 or more tables per step"),
    (["--png", "{tmp}/afile/grid.png"], "--png {tmp}/afile/grid.png: {tmp}/afile is a file, not a folder"),
    (["--png", "{tmp}/grid.svg"], "--png {tmp}/grid.svg: give a file name ending in .png"),
])
def test_prior_benchmark_refuses_a_bad_flag_before_timing(monkeypatch, tmp_path, capsys, flags, message):
    """benchmarks/prior.py had met these after timing (the --png after every measurement) in a traceback that named
    the prior's config keys (prior.name, data.batch_size), or wrote an .svg under --png; now one line naming the
    flag, nothing timed or drawn."""
    import sys

    from builders import benchmark_module

    bench = benchmark_module("prior")
    (tmp_path / "afile").write_text("x")
    monkeypatch.setattr(bench, "measure", lambda *a: pytest.fail("timed before the flags were checked"))
    monkeypatch.setattr(bench, "draw_grid", lambda *a: pytest.fail("drew before the flags were checked"))
    argv = ["--png", str(tmp_path / "grid.png"), *(f.format(tmp=tmp_path) for f in flags)]
    monkeypatch.setattr(sys, "argv", ["prior.py", *argv])
    with pytest.raises(SystemExit):
        bench.main()
    assert capsys.readouterr().err.splitlines()[-1] == f"prior.py: error: {message.format(tmp=tmp_path)}"
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]
