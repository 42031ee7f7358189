"""Heap-sized CPU forwards (tabfm.forward_sizes): `forward_bytes` bounds every tensor a forward allocates, the forward
counts keep each forward within its limits and the threads balanced, and forwards cut smaller give the estimators'
predictions of forwards bounded by the cell budget alone."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from builders import estimator_outputs, estimator_table, side_by_side_rows, speed_up_matches
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import tabfm.estimator as estimator_module
import tabfm.forward_sizes as forward_sizes
from tabfm.data.encode import Batch
from tabfm.estimator import TabFMClassifier, TabFMRegressor
from tabfm.forward_sizes import forward_bytes, forward_count
from tabfm.inference import encode_context, predict_logits
from tabfm.model import ModelConfig, TabFM


class LargestStorage(TorchDispatchMode):
    """The largest storage (bytes) an op allocates for its output while the mode is on (views of its inputs, e.g.
    a weight's transpose, allocate nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def _batch(tables: int, rows: int, columns: int, task: str, train: bool, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(tables, rows, columns, generator=g, dtype=torch.float64)
    if task == "classification":
        labels = torch.randint(0, 3, (tables, rows), generator=g) if train else torch.full((tables, rows), -100)
    else:
        labels = torch.randn(tables, rows, generator=g, dtype=torch.float64) if train else torch.zeros(
            tables, rows, dtype=torch.float64)
    is_cat = torch.zeros(tables, columns, dtype=torch.bool)
    is_cat[:, 0] = columns > 1  # one categorical column where there are several
    cat_codes = torch.where(is_cat[:, None, :], torch.randint(0, 4, values.shape, generator=g), -1)
    values = torch.where(is_cat[:, None, :], 0.0, values)
    return Batch(values=values, missing=torch.zeros_like(values, dtype=torch.bool), cat_codes=cat_codes,
                 is_cat=is_cat, n_cats=torch.where(is_cat, 4, 0), labels=labels,
                 n_train=torch.full((tables,), rows if train else 0), n_classes=torch.full((tables,), 3),
                 row_pad=torch.zeros(tables, rows, dtype=torch.bool),
                 col_pad=torch.zeros(tables, columns, dtype=torch.bool), task=task)


CONFIGS = {
    "small": ModelConfig.load("small"),
    "wide-mlp": ModelConfig(embed_dim=16, axial_heads=2, axial_mlp_ratio=5, row_num_cls=2, icl_heads=2,
                            icl_mlp_ratio=6, icl_num_blocks=1, axial_num_blocks=1),
    "inducing": ModelConfig.load("small_inducing"),
}


@pytest.mark.parametrize("task", ["classification", "regression"])
@pytest.mark.parametrize("columns", [1, 3, 20])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_bytes_bounds_every_tensor_of_a_forward(name, columns, task):
    """Encoding train rows and predicting test rows against them: no op writes a tensor larger than
    forward_bytes, and the bound is met by some tensor (it is the widest activation, not a loose cap)."""
    cfg = CONFIGS[name]
    model = TabFM(cfg).double().eval()
    tables, rows, test_rows = 3, 40, 17
    with torch.no_grad():
        with LargestStorage() as enc:
            context = encode_context(model, _batch(tables, rows, columns, task, train=True))
        with LargestStorage() as pred:
            predict_logits(model, context, _batch(tables, test_rows, columns, task, train=False, seed=1))
    assert enc.largest == forward_bytes(cfg, tables, rows, columns, 8, encoding=True)
    assert pred.largest <= forward_bytes(cfg, tables, test_rows, columns, 8, encoding=False)
    assert pred.largest >= forward_bytes(cfg, tables, test_rows, columns, 8, encoding=False) / 2


@pytest.mark.parametrize("columns", [1, 3, 20])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_context_cache_bytes_is_what_an_encoded_context_holds(name, columns):
    """context_cache_bytes per table is exactly the bytes of the keys and values an encoded context caches
    (tabfm.cache_memory refuses a fit by it), for full and inducing column attention, float64 and float32."""
    cfg = CONFIGS[name]
    for dtype, size in ((torch.float64, 8), (torch.float32, 4)):
        model = TabFM(cfg).to(dtype).eval()
        batch = _batch(3, 40, columns, "classification", train=True)
        batch = dataclasses.replace(batch, values=batch.values.to(dtype))
        with torch.no_grad():
            context = encode_context(model, batch)
        assert context.nbytes() == 3 * forward_sizes.context_cache_bytes(cfg, 40, columns, size)


@pytest.mark.parametrize("tables", [1, 2, 7, 40, 333])
@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("byte_limit", [None, 5000, 10])
def test_forward_count_keeps_each_forward_within_the_heap_and_the_threads_even(tables, workers, byte_limit):
    table_bytes = 700
    count = forward_count(tables, table_bytes, workers, byte_limit)
    sizes = [len(p) for p in np.array_split(np.arange(tables), count)]
    assert sum(sizes) == tables and min(sizes) >= 1
    assert byte_limit is None or all(size * table_bytes <= byte_limit for size in sizes if size > 1)
    assert count == tables or count % workers == 0
    per = tables if byte_limit is None else max(1, byte_limit // table_bytes)
    assert count < -(-tables // per) + workers  # no more forwards than the limit and the rounding need
    assert forward_count(0, table_bytes, workers, byte_limit) == 0


def _recorded_forwards(monkeypatch) -> list[tuple[str, int, int, int]]:
    """(function, tables, rows, columns) of every forward the estimator runs (function: encode_context or
    predict_logits)."""
    shapes: list[tuple[str, int, int, int]] = []
    for name in ("encode_context", "predict_logits"):
        real = getattr(estimator_module, name)

        def recorded(model, *args, _real=real, _name=name, **kwargs):
            batch = args[-1]
            shapes.append((_name, *batch.values.shape))
            return _real(model, *args, **kwargs)

        monkeypatch.setattr(estimator_module, name, recorded)
    return shapes


@pytest.mark.parametrize("local_context_rows", [48, None])
@pytest.mark.parametrize("Estimator", [TabFMClassifier, TabFMRegressor])
def test_heap_sized_forwards_give_the_cell_budget_forwards_predictions(Estimator, local_context_rows, monkeypatch):
    """float64, with a heap of 2 MiB so that every fit and predict is cut into many forwards: each forward within
    it (unless one table alone is larger), and the outputs those of forwards bounded by the cell budget alone, to
    1e-12, through calibration."""
    X, y = estimator_table(Estimator)
    X_test = X.iloc[:90]
    params = dict(n_estimators=3, dtype="float64", n_jobs=2, local_context_rows=local_context_rows, random_state=0)

    def fit_predict():
        est = Estimator(**params).fit(X, y)
        return est, estimator_outputs(est, X_test)

    shapes = _recorded_forwards(monkeypatch)
    monkeypatch.setattr(forward_sizes, "HEAP_BLOCK_BYTES", None)
    want, want_out = fit_predict()
    base, shapes[:] = shapes[:], []
    monkeypatch.setattr(forward_sizes, "HEAP_BLOCK_BYTES", 2 << 20)
    got, got_out = fit_predict()
    np.testing.assert_allclose(got_out, want_out, rtol=0, atol=1e-12)
    if Estimator is TabFMClassifier:
        assert got.temperature_ == pytest.approx(want.temperature_, abs=1e-9)
    config = got.model_.config
    assert len(shapes) > len(base)
    for _, tables, rows, columns in shapes:
        assert tables == 1 or forward_bytes(config, tables, rows, columns, 8, encoding=True) <= 2 << 20

    def encoded(forwards):  # the same train rows, cut finer (test rows are padded per forward: their sums differ)
        return sum(t * r for name, t, r, _ in forwards if name == "encode_context")

    assert encoded(shapes) == encoded(base) > 0


def test_selected_tables_are_those_tables_of_the_context():
    """Context.select of some tables (in any order, and of a selection again) holds exactly those tables' caches
    and statistics, and no longer records."""
    model = TabFM(ModelConfig.load("tiny")).double().eval()
    with torch.no_grad():
        context = encode_context(model, _batch(5, 30, 4, "regression", train=True))
    order = torch.tensor([4, 2, 0])
    picked = context.select(torch.tensor([3, 4])).select(torch.tensor([1]))
    want = context.select(torch.tensor([4]))
    for got, one in [(context.select(order), order), (picked, torch.tensor([4])), (want, torch.tensor([4]))]:
        assert got.num_tables == len(one) and got.target_stats is not None
        for a, b in zip(got.caches, context.caches, strict=True):
            assert torch.equal(a.k, b.k[one]) and torch.equal(a.v, b.v[one]) and not a.recording
        for a, b in [(got.cell_stats, context.cell_stats), (got.target_stats, context.target_stats)]:
            assert torch.equal(a[0], b[0][one]) and torch.equal(a[1], b[1][one])
        assert torch.equal(got.n_classes, context.n_classes[one])


def test_benchmark_prints_both_sides_and_their_ratio(tmp_path):
    rows = side_by_side_rows("forward_sizes", ["--sizes", "300x40", "--repeats", "1", "--n-jobs", "1", "--settings",
                                               "classifier-1-member"], tmp_path / "t.txt")
    assert [r[0] for r in rows] == ["classifier-1-member"]
    _, ref, new, speed_up, diff = rows[0]
    assert speed_up_matches(ref, new, speed_up)
    assert diff < 1e-4
    assert forward_sizes.HEAP_BLOCK_BYTES == 8 << 20  # the reference side restored it


def test_context_groups_hold_one_width_each_within_the_cell_budget(monkeypatch):
    monkeypatch.setattr(forward_sizes, "CONTEXT_CELL_BUDGET", 10_000)
    widths = np.array([5, 7, 5, 5, 7, 5, 5, 5, 5, 5, 5])
    groups = forward_sizes.context_groups(widths, rows=300)
    assert sorted(u for units, _ in groups for u in units) == list(range(len(widths)))
    for units, width in groups:
        assert set(widths[units]) == {width}
        assert len(units) * 300 * width <= 10_000 or len(units) == 1
    assert [len(units) for units, w in groups if w == 5] == [5, 4]  # as few groups as the budget allows, even
