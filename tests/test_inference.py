"""Cached in-context inference: the train rows encoded once, then test rows alone, equal one forward of the whole
table; and the same on 2 and 4 gloo ranks (tensor and sequence parallel) as in one process (float64)."""

from __future__ import annotations

import copy

import pytest
import torch
from builders import tiny_model
from dist_harness import get_mesh

from tabfm.chunked import is_plain
from tabfm.data.encode import Batch
from tabfm.inference import encode_context, predict_logits
from tabfm.parallel_model import parallelize_model

TOL = 1e-10
ROWS, TRAIN, COLS = 13, 8, 5


def full_table(task: str, seed: int = 0) -> Batch:
    """Two tables of 13 rows (8 train), 5 columns (one categorical), some missing cells."""
    g = torch.Generator().manual_seed(seed)
    B = 2
    values = torch.randn(B, ROWS, COLS, generator=g, dtype=torch.float64) * 2 + 1
    missing = torch.rand(B, ROWS, COLS, generator=g) < 0.1
    is_cat = torch.tensor([False, False, True, False, False]).expand(B, COLS)
    cat_codes = torch.where(is_cat[:, None, :] & ~missing, torch.randint(0, 3, (B, ROWS, COLS), generator=g), -1)
    values = torch.where(is_cat[:, None, :] | missing, 0.0, values)
    if task == "classification":
        labels, n_classes = torch.randint(0, 3, (B, ROWS), generator=g), torch.tensor([3, 2])
        labels[1] %= 2
    else:
        labels, n_classes = torch.randn(B, ROWS, generator=g, dtype=torch.float64) * 4, torch.zeros(B, dtype=torch.long)
    return Batch(values=values, missing=missing, cat_codes=cat_codes, is_cat=is_cat, n_cats=torch.where(is_cat, 3, 0),
                 labels=labels, n_train=torch.full((B,), TRAIN), n_classes=n_classes,
                 row_pad=torch.zeros(B, ROWS, dtype=torch.bool), col_pad=torch.zeros(B, COLS, dtype=torch.bool),
                 task=task)


def rows_of(batch: Batch, rows: slice, n_train: int) -> Batch:
    per_row = ("values", "missing", "cat_codes", "labels", "row_pad")
    parts = {k: (v[:, rows] if k in per_row else v) for k, v in batch.tensors().items()}
    parts["n_train"] = torch.full_like(batch.n_train, n_train)
    return Batch(**parts, task=batch.task)


def cached_logits(model, batch: Batch, test_chunks: int = 2, row_chunk: int | None = None) -> torch.Tensor:
    """Encode the train rows (`row_chunk` rows at a time), then predict the test rows in `test_chunks` batches."""
    context = encode_context(model, rows_of(batch, slice(0, TRAIN), TRAIN), row_chunk)
    bounds = torch.linspace(TRAIN, ROWS, test_chunks + 1).long().tolist()
    return torch.cat([predict_logits(model, context, rows_of(batch, slice(a, b), 0))
                      for a, b in zip(bounds[:-1], bounds[1:], strict=True)], dim=1)


@pytest.mark.parametrize("task", ["classification", "regression"])
def test_cached_context_equals_full_forward(task):
    model, batch = tiny_model().eval(), full_table(task)
    with torch.no_grad():
        full = model(batch)[:, TRAIN:]
    for chunks in (1, 2, 5):
        assert (cached_logits(model, batch, chunks) - full).abs().max() <= TOL
    # The cache holds keys and values of the train rows only, at every attention over rows.
    context = encode_context(model, rows_of(batch, slice(0, TRAIN), TRAIN))
    assert all(c.k.shape[-2] == TRAIN for c in context.caches)
    assert len(context.caches) == model.config.axial_num_blocks + model.config.icl_num_blocks


def test_context_checks_its_inputs():
    model, batch = tiny_model().eval(), full_table("classification")
    with pytest.raises(ValueError, match="train rows only"):
        encode_context(model, batch)
    context = encode_context(model, rows_of(batch, slice(0, TRAIN), TRAIN))
    narrow = rows_of(batch, slice(TRAIN, ROWS), 0)
    narrow = Batch(**{**narrow.tensors(), "values": narrow.values[..., :3], "missing": narrow.missing[..., :3],
                      "cat_codes": narrow.cat_codes[..., :3], "is_cat": narrow.is_cat[:, :3],
                      "n_cats": narrow.n_cats[:, :3], "col_pad": narrow.col_pad[:, :3]}, task="classification")
    with pytest.raises(ValueError, match="columns"):
        predict_logits(model, context, narrow)
    with pytest.raises(ValueError, match="cannot be predicted from a classification context"):
        predict_logits(model, context, rows_of(full_table("regression"), slice(TRAIN, ROWS), 0))


def test_the_cache_is_an_argument_not_state_on_the_layers():
    """Encoding a context leaves the model as it was: no layer holds a cache, a plain forward is unchanged, and two
    contexts of different tables predict independently of the order they were encoded in."""
    model = tiny_model().eval()
    a, b = full_table("classification", seed=0), full_table("classification", seed=1)
    with torch.no_grad():
        before = model(a)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ctx_a = encode_context(model, rows_of(a, slice(0, TRAIN), TRAIN))
    ctx_b = encode_context(model, rows_of(b, slice(0, TRAIN), TRAIN))
    assert not any(hasattr(m, "kv_cache") or hasattr(m, "cache") for m in model.modules())
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(model(a), before)
    pred_a = predict_logits(model, ctx_a, rows_of(a, slice(TRAIN, ROWS), 0))
    pred_b = predict_logits(model, ctx_b, rows_of(b, slice(TRAIN, ROWS), 0))
    assert torch.equal(pred_a, cached_logits(model, a, test_chunks=1))
    assert torch.equal(pred_b, cached_logits(model, b, test_chunks=1))
    assert not torch.allclose(pred_a, pred_b)
    # The same pair on the model itself: encode_context, then forward(batch, context=...).
    with torch.no_grad():
        assert torch.equal(model(rows_of(a, slice(TRAIN, ROWS), 0), context=model.encode_context(
            rows_of(a, slice(0, TRAIN), TRAIN))), pred_a)


def _sharded(d0: int, d1: int, sp: bool, **overrides) -> dict[str, float]:
    mesh = get_mesh(d0, d1)
    errors = {}
    for task in ("classification", "regression"):
        model, batch = tiny_model(**overrides).eval(), full_table(task)
        with torch.no_grad():
            full = model(batch)[:, TRAIN:]
        par = parallelize_model(copy.deepcopy(model), mesh, sequence_parallel=sp)
        assert is_plain(model) and not is_plain(par)  # a sharded model encodes its context in one pass
        errors[task] = float((cached_logits(par, batch, row_chunk=3) - full).abs().max())
    return errors


@pytest.mark.parametrize("world,d0,d1", [(2, 2, 1), (2, 1, 2), (4, 2, 2), (4, 4, 1)])
@pytest.mark.parametrize("sp", [False, True])
def test_sharded_cached_inference_equals_one_process(ranks, world, d0, d1, sp):
    for rank_errors in ranks(world).run(_sharded, d0, d1, sp):
        assert max(rank_errors.values()) <= TOL, rank_errors


@pytest.mark.parametrize("task", ["classification", "regression"])
def test_context_encoded_in_row_chunks_equals_one_pass(task):
    """Chunks of 3 rows (the last one shorter) give the one-pass context: statistics and every cached key/value
    (float64, 1e-10), and the test rows' logits from it equal a forward of the whole table."""
    model, batch = tiny_model().eval(), full_table(task)
    train = rows_of(batch, slice(0, TRAIN), TRAIN)
    whole, chunked = model.encode_context(train), encode_context(model, train, row_chunk=3)
    assert len(chunked.caches) == len(whole.caches)
    for a, b in zip(whole.caches, chunked.caches, strict=True):
        assert a.k.shape == b.k.shape and not b.recording
        assert max((a.k - b.k).abs().max(), (a.v - b.v).abs().max()) <= TOL
    assert all(torch.equal(a, b) for a, b in zip(whole.cell_stats, chunked.cell_stats, strict=True))
    with torch.no_grad():
        full = model(batch)[:, TRAIN:]
    assert (predict_logits(model, chunked, rows_of(batch, slice(TRAIN, ROWS), 0)) - full).abs().max() <= TOL
    with pytest.raises(ValueError, match="train rows only"):
        encode_context(model, batch, row_chunk=3)
    with pytest.raises(ValueError, match="positive number of rows"):
        encode_context(model, train, row_chunk=0)


def test_encoding_in_chunks_records_the_last_in_context_blocks_keys_without_running_it():
    """The last in-context block's outputs for the train rows feed nothing a test row reads (only its keys/values
    do), so encoding in chunks records its cache and stops there: the context is the one-pass context and the
    test rows' logits are a forward's. In one chunk the model's own encoding runs (tabfm.chunked: cheaper there)."""
    model, batch = tiny_model().eval(), full_table("classification")
    train = rows_of(batch, slice(0, TRAIN), TRAIN)
    runs = []
    *_, last = model.icl.blocks.blocks
    for block in (last, model.icl.blocks.blocks[0]):
        block.register_forward_hook(lambda module, args, out, block=block: runs.append(block is last))
    whole = model.encode_context(train)
    assert runs.count(True) == 1  # the model's own encoding runs it
    with torch.no_grad():
        full = model(batch)[:, TRAIN:]
    for row_chunk in (None, 3):
        runs.clear()
        context = encode_context(model, train, row_chunk)
        assert runs.count(True) == (row_chunk is None) and runs.count(False) == (1 if row_chunk is None else 3)
        for a, b in zip(whole.caches, context.caches, strict=True):
            assert max((a.k - b.k).abs().max(), (a.v - b.v).abs().max()) <= TOL
        assert (predict_logits(model, context, rows_of(batch, slice(TRAIN, ROWS), 0)) - full).abs().max() <= TOL


# ---------------------------------------------------------------------------------------------------------
# Inducing column attention (tabfm.column_stage): the column stage's cache holds the M summaries' keys/values
# ---------------------------------------------------------------------------------------------------------

INDUCING = {"column_attention": "inducing", "num_inducing": 6}


@pytest.mark.parametrize("task", ["classification", "regression"])
def test_inducing_context_equals_full_forward(task):
    """Test rows predicted against a context (one pass, or encoded 3 rows at a time) equal a forward of the whole
    table; each axial block's cache holds the keys/values of its M summaries, not of the train rows, so a test row
    costs O(M) there."""
    model, batch = tiny_model(**INDUCING).eval(), full_table(task)
    with torch.no_grad():
        full = model(batch)[:, TRAIN:]
    for chunks in (1, 5):
        assert (cached_logits(model, batch, chunks) - full).abs().max() <= TOL
        assert (cached_logits(model, batch, chunks, row_chunk=3) - full).abs().max() <= TOL
    train = rows_of(batch, slice(0, TRAIN), TRAIN)
    whole, chunked = model.encode_context(train), encode_context(model, train, row_chunk=3)
    A = model.config.axial_num_blocks
    assert len(whole.caches) == A + model.config.icl_num_blocks
    assert [c.k.shape[-2] for c in whole.caches] == [6] * A + [TRAIN] * model.config.icl_num_blocks
    for a, b in zip(whole.caches, chunked.caches, strict=True):
        assert a.k.shape == b.k.shape and not b.recording
        assert max((a.k - b.k).abs().max(), (a.v - b.v).abs().max()) <= TOL


@pytest.mark.parametrize("world,d0,d1,sp", [(2, 1, 2, False), (4, 2, 2, True), (4, 4, 1, True)])
def test_sharded_inducing_inference_equals_one_process(ranks, world, d0, d1, sp):
    for rank_errors in ranks(world).run(_sharded, d0, d1, sp, **INDUCING):
        assert max(rank_errors.values()) <= TOL, rank_errors
