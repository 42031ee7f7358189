"""The loader: batches depend only on (seed, step, dp rank), workers and resume change nothing, tensors match the
tables, and a Parquet round trip encodes to the very same tensors."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace

import numpy as np
import polars as pl
import pytest
import torch

from tabfm import _cli_gen
from tabfm.data.config import CurriculumConfig, DataConfig, TableConfig
from tabfm.data.dump import ParquetTables, read_table, table_at, write_table, write_tables
from tabfm.data.encode import IGNORE_LABEL, Batch, encode_tables
from tabfm.data.loader import FixedSource, PriorSource, batch_at, make_loader
from tabfm.data.priors.scm import SCMPrior
from tabfm.data.tables import sample_table


def assert_same(a: Batch, b: Batch) -> None:
    assert a.task == b.task and a.step == b.step
    for name, t in a.tensors().items():
        u = b.tensors()[name]
        assert t.dtype == u.dtype and t.shape == u.shape and torch.equal(t, u), name


def differs(a: Batch, b: Batch) -> bool:
    return a.values.shape != b.values.shape or not torch.equal(a.values, b.values)


def test_tiny_batch_shapes_and_dtypes():
    """(How fast a worker makes batches is benchmarks/prior.py's to measure.)"""
    b = batch_at(PriorSource(DataConfig.tiny()), 1)
    assert b.values.shape == b.missing.shape == b.cat_codes.shape == (8, 64, 8)
    assert b.values.dtype == torch.float32 and b.missing.dtype == torch.bool and b.cat_codes.dtype == torch.int64
    assert b.is_cat.shape == b.n_cats.shape == b.col_pad.shape == (8, 8)
    assert b.labels.shape == b.row_pad.shape == (8, 64)
    assert b.labels.dtype == (torch.int64 if b.task == "classification" else torch.float32)
    assert b.n_train.shape == b.n_classes.shape == (8,) and b.step == 1


def test_batch_depends_only_on_seed_step_and_dp_rank():
    cfg = DataConfig.tiny(seed=5)
    ref = batch_at(PriorSource(cfg), 3, dp_rank=1)
    assert_same(ref, batch_at(PriorSource(cfg), 3, dp_rank=1))  # e.g. another tensor-parallel rank of the mesh
    assert differs(ref, batch_at(PriorSource(cfg), 3, dp_rank=0))  # another data-parallel replica
    assert differs(ref, batch_at(PriorSource(cfg), 4, dp_rank=1))  # another step
    assert differs(ref, batch_at(PriorSource(DataConfig.tiny(seed=6)), 3, dp_rank=1))  # another seed


def test_resume_from_step_k_gives_the_same_batches():
    cfg = DataConfig.tiny(seed=2)
    full = list(make_loader(cfg, num_steps=6))
    resumed = list(make_loader(cfg, start_step=4, num_steps=2))
    assert [b.step for b in full] == list(range(6))
    for a, b in zip(full[4:], resumed):
        assert_same(a, b)


def test_two_workers_give_the_same_batches_in_order_as_none():
    cfg = DataConfig.tiny(seed=9)
    inline = list(make_loader(cfg, dp_rank=1, start_step=3, num_steps=5))
    workers = list(make_loader(replace(cfg, num_workers=2), dp_rank=1, start_step=3, num_steps=5))
    assert [b.step for b in workers] == [3, 4, 5, 6, 7]
    for a, b in zip(inline, workers, strict=True):
        assert_same(a, b)


class ThreadProbe(PriorSource):
    """The prior, noting each worker process's BLAS and polars thread counts in a folder as it draws a step."""

    def __init__(self, cfg: DataConfig, folder: str) -> None:
        super().__init__(cfg)
        self.folder = folder

    def tables(self, step: int, dp_rank: int) -> list:
        import threadpoolctl  # scikit-learn's dependency; only this test reads thread pools

        tables = super().tables(step, dp_rank)  # polars and numpy have both run by now
        blas = {i["internal_api"]: i["num_threads"] for i in threadpoolctl.threadpool_info()}
        with open(f"{self.folder}/{os.getpid()}.json", "w") as f:
            json.dump({"polars": pl.thread_pool_size(), "blas": blas}, f)
        return tables


def test_workers_run_one_blas_and_one_polars_thread_each(tmp_path):
    cfg = replace(DataConfig.tiny(seed=4), num_workers=2)
    batches = list(make_loader(cfg, source=ThreadProbe(cfg, str(tmp_path)), num_steps=4))
    assert [b.step for b in batches] == [0, 1, 2, 3]
    notes = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert len(notes) == 2  # one per worker process
    for note in notes:
        assert note["polars"] == 1
        assert note["blas"] and set(note["blas"].values()) == {1}, note


def test_tensors_match_the_tables():
    table = TableConfig(min_rows=20, max_rows=64, min_features=2, max_features=8, missing_table_prob=1.0)
    cfg = DataConfig.tiny(seed=1, table=table)
    tables = PriorSource(cfg).tables(0, 0)
    b = encode_tables(tables)
    for i, t in enumerate(tables):
        n, c = t.df.height, len(t.meta.columns)
        assert not b.row_pad[i, :n].any() and b.row_pad[i, n:].all()
        assert not b.col_pad[i, :c].any() and b.col_pad[i, c:].all()
        assert int(b.n_train[i]) == t.meta.n_train and int(b.n_classes[i]) == t.meta.n_classes
        assert (b.values[i, n:] == 0).all() and (b.cat_codes[i, n:] == -1).all() and not b.missing[i, n:].any()
        for j, info in enumerate(t.meta.columns):
            s = t.df[info.name]
            assert np.array_equal(b.missing[i, :n, j].numpy(), s.is_null().to_numpy())
            codes = b.cat_codes[i, :n, j]
            if info.kind == "categorical":
                assert b.is_cat[i, j] and int(b.n_cats[i, j]) == s.drop_nulls().n_unique()
                assert ((codes >= 0) == ~b.missing[i, :n, j]).all() and (codes < b.n_cats[i, j]).all()
                cats = sorted(s.drop_nulls().unique().to_list())
                assert [cats[k] if k >= 0 else None for k in codes.tolist()] == s.to_list()
                assert (b.values[i, :n, j] == 0).all()
            else:
                assert not b.is_cat[i, j] and (codes == -1).all()
                expected = s.cast(pl.Float64).fill_null(0.0).to_numpy().astype(np.float32)
                assert np.array_equal(b.values[i, :n, j].numpy(), expected)
        labels = b.labels[i]
        if b.task == "classification":
            assert labels[:n].tolist() == t.df["target"].to_list() and (labels[n:] == IGNORE_LABEL).all()


def test_a_batch_holds_one_task():
    rng = np.random.default_rng(0)
    cls = sample_table(rng, SCMPrior(), TableConfig(), 30, 3, "classification")
    reg = sample_table(rng, SCMPrior(), TableConfig(), 30, 3, "regression")
    assert encode_tables([reg]).labels.dtype == torch.float32
    with pytest.raises(ValueError, match="one task"):
        encode_tables([cls, reg])


def test_curriculum_grows_table_sizes_with_the_step():
    table = TableConfig(min_rows=32, max_rows=1024, min_features=2, max_features=64)
    cur = CurriculumConfig(start_max_rows=64, start_max_features=4, ramp_steps=100)
    limits = [cur.limits(s, table) for s in (0, 25, 50, 99, 100, 5000)]
    assert limits[0] == (64, 4) and limits[-2] == limits[-1] == (1024, 64)
    assert all(a <= b for a, b in zip(limits, limits[1:]))
    src = PriorSource(DataConfig(seed=0, batch_size=4, table=table, curriculum=cur))
    early = batch_at(src, 0)
    assert early.values.shape[1] <= 64 and early.values.shape[2] <= 4


def test_parquet_round_trip_encodes_to_the_same_tensors(tmp_path):
    table = TableConfig(min_rows=30, max_rows=64, min_features=2, max_features=8, missing_table_prob=1.0)
    cfg = DataConfig.tiny(seed=4, table=table)
    tables = PriorSource(cfg).tables(7, 0)
    for i, t in enumerate(tables):
        write_table(t, tmp_path, i)
    back = [read_table(tmp_path, i) for i in range(len(tables))]
    assert all(a.meta == b.meta and a.df.equals(b.df) for a, b in zip(tables, back))
    assert_same(encode_tables(tables, step=7), encode_tables(back, step=7))


def test_dump_read_back_as_a_fixed_dataset(tmp_path):
    cfg = DataConfig.tiny(seed=8, table=TableConfig(min_rows=24, max_rows=48, min_features=2, max_features=6))
    write_tables(cfg, tmp_path, 12)
    stored = ParquetTables(tmp_path)
    in_memory = [table_at(cfg, i) for i in range(12)]
    assert len(stored) == 12 and json.loads((tmp_path / "manifest.json").read_text())["n_tables"] == 12
    sidecar = json.loads((tmp_path / "table_000003.json").read_text())
    assert {"prior", "hparams", "task", "n_classes", "columns", "n_train"} <= set(sidecar)
    a, b = FixedSource(stored, batch_size=4, seed=1), FixedSource(in_memory, batch_size=4, seed=1)
    for step in range(5):
        ba, bb = batch_at(a, step, dp_rank=1), batch_at(b, step, dp_rank=1)
        assert_same(ba, bb)
    assert differs(batch_at(a, 0, 0), batch_at(a, 0, 1))
    assert_same(next(iter(make_loader(cfg, source=a, dp_rank=1, start_step=2, num_steps=1))), batch_at(b, 2, 1))


def test_dump_is_the_same_with_worker_processes(tmp_path):
    cfg = DataConfig.tiny(seed=8, table=TableConfig(min_rows=24, max_rows=48, min_features=2, max_features=6))
    write_tables(cfg, tmp_path / "a", 20)
    write_tables(cfg, tmp_path / "b", 20, workers=2)
    for x, y in zip(ParquetTables(tmp_path / "a"), ParquetTables(tmp_path / "b"), strict=True):
        assert x.df.equals(y.df) and x.meta == y.meta


def _gen_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tabfm")
    _cli_gen.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def test_cli_gen_writes_tables(tmp_path):
    argv = ["gen", "--prior", "trees", "--n-tables", "5", "--out", str(tmp_path), "--seed", "3"]
    args = _gen_parser().parse_args([*argv, "--max-rows", "100", "--task", "regression"])
    assert args.run(args) == 0
    stored = ParquetTables(tmp_path)
    assert len(stored) == 5 and {m.prior for m in stored.metas()} == {"trees"}
    assert {m.task for m in stored.metas()} == {"regression"} and max(t.df.height for t in stored) <= 100


def test_cli_gen_bad_option_says_what_to_change(tmp_path, capsys):
    args = _gen_parser().parse_args(["gen", "--out", str(tmp_path), "--min-rows", "500", "--max-rows", "100"])
    assert args.run(args) == 2
    assert capsys.readouterr().err == ("tabfm gen: error: --min-rows=500 > --max-rows=100; make --min-rows <= "
                                       "--max-rows\n")
