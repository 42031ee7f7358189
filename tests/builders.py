"""Builders of test inputs shared by several test modules (a test module never imports another one).

    make_batch, tiny_model   the axial model's ragged float64 batch and its tiny preset (test_model, test_inference,
                             test_checkpoint)
    Holder, layer_case       one ATP layer kind under its plan, and its dense reference (test_parallel_layers,
                             test_overlap); shapes B, S, H, HEADS below
    mixed_frame              a mixed-type DataFrame for the estimators (test_estimator, test_cli_predict)
    benchmark_module         benchmarks/<name>.py as a module (the tests of the benchmarks' CPU paths)
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pandas as pd
import torch
from torch import nn

from tabfm.data.encode import IGNORE_LABEL, Batch
from tabfm.model import ModelConfig, TabFM, build_model
from tabfm.parallel import dense
from tabfm.parallel.parallelize import block_plan

B, S, H, HEADS = 2, 12, 16, 4
"""The layer cases' sequences, tokens per sequence, hidden width and heads."""


def make_batch(task: str = "classification", seed: int = 0) -> Batch:
    """Two ragged tables: 9 rows (5 train), 4 columns; 10 rows (6 train), 5 columns (one categorical each)."""
    g = torch.Generator().manual_seed(seed)
    B, R, C = 2, 10, 5
    rows, n_train, cols = [9, 10], [5, 6], [4, 5]
    values = torch.randn(B, R, C, generator=g, dtype=torch.float64) * 3 + 1
    missing = torch.rand(B, R, C, generator=g) < 0.15
    is_cat = torch.tensor([[False, True, False, False, False], [False, False, False, True, False]])
    cat_codes = torch.randint(0, 4, (B, R, C), generator=g)
    row_pad = torch.arange(R)[None, :] >= torch.tensor(rows)[:, None]
    col_pad = torch.arange(C)[None, :] >= torch.tensor(cols)[:, None]
    dead = row_pad[:, :, None] | col_pad[:, None, :]
    missing &= ~dead
    cat_codes = torch.where(is_cat[:, None, :] & ~missing & ~dead, cat_codes, -1)
    values = torch.where(is_cat[:, None, :] | missing | dead, 0.0, values)
    n_classes = torch.tensor([3, 4])
    if task == "classification":
        labels = (torch.rand(B, R, generator=g) * n_classes[:, None]).long()
        labels = labels.masked_fill(row_pad, IGNORE_LABEL)
    else:
        labels = (torch.randn(B, R, generator=g, dtype=torch.float64) * 5 + 2).masked_fill(row_pad, 0.0)
        n_classes = torch.zeros(B, dtype=torch.long)
    return Batch(values=values, missing=missing, cat_codes=cat_codes, is_cat=is_cat,
                 n_cats=torch.where(is_cat, 4, 0), labels=labels, n_train=torch.tensor(n_train),
                 n_classes=n_classes, row_pad=row_pad, col_pad=col_pad, task=task)


def tiny_model(seed: int = 1, **overrides) -> TabFM:
    cfg = ModelConfig(**{**ModelConfig.load("tiny").to_dict(), **overrides})
    return build_model(cfg, seed=seed).double()


def adamw_steps(model: nn.Module, steps: int) -> torch.optim.AdamW:
    """A few AdamW steps on make_batch(seed=step): weights and optimizer state worth saving."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        loss = model.loss(make_batch(seed=step))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return opt


class Holder(nn.Module):
    """Gives the module under test a parent, so the plan can swap it."""

    def __init__(self, m: nn.Module):
        super().__init__()
        self.m = m


def layer_case(kind: str) -> tuple[nn.Module, dict[str, str], dict]:
    """The module under test (in a Holder), its plan and its forward keywords, seeded by the caller."""
    if kind == "mlp":
        return Holder(dense.Mlp(H, 4 * H)), {"m": "mlp"}, {}
    if kind == "attention":
        return Holder(dense.Attention(H, HEADS)), {"m": "attention"}, {}
    if kind == "attention_ctx":
        # Query-to-context: every token attends to the first 8 (the "train" rows), some of which are padding.
        mask = torch.ones(B, S, 8, dtype=torch.bool)
        mask[1, :, 6:] = False
        return Holder(dense.Attention(H, HEADS)), {"m": "attention"}, {"num_kv": 8, "attn_mask": mask}
    if kind == "norm":
        norm = nn.LayerNorm(H)
        with torch.no_grad():  # non-trivial affine parameters
            norm.weight.normal_()
            norm.bias.normal_()
        return Holder(norm), {"m": "norm"}, {}
    if kind == "stack":
        return Holder(dense.BlockStack(2, H, HEADS)), block_plan("m"), {"num_kv": 8}
    raise ValueError(kind)


def mixed_frame(n: int, seed: int = 0) -> tuple[pd.DataFrame, np.ndarray]:
    """Numeric, string-categorical, boolean, constant and partly missing columns; the class depends on x and colour."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=n)
    colour = rng.choice(["red", "green", "blue"], size=n)
    df = pd.DataFrame({
        "x": x,
        "noise": rng.normal(size=n) * 100 + 5,
        "colour": colour,
        "flag": rng.random(n) < 0.5,
        "const": np.full(n, 3.0),
        "gappy": np.where(rng.random(n) < 0.3, np.nan, rng.normal(size=n)),
    })
    y = np.where(x + (colour == "red") * 1.5 > 0.5, "yes", "no")
    return df, y


def estimator_table(Estimator: type, n: int = 240, seed: int = 3) -> tuple:
    """(X, y) of mixed_frame for a classifier (its labels) or a regressor (a target from two of its columns)."""
    X, y = mixed_frame(n=n, seed=seed)
    if Estimator._task == "regression":
        y = X["x"].to_numpy() * 2 + (X["colour"] == "red") + np.random.default_rng(seed).normal(size=len(X)) * 0.1
    return X, y


def estimator_outputs(est, X) -> np.ndarray:
    """A classifier's probabilities or a regressor's predictions."""
    return est.predict_proba(X) if est._task == "classification" else est.predict(X)


BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def benchmark_module(name: str) -> ModuleType:
    """benchmarks/<name>.py as a module, loaded once per process. benchmarks/ is no package, so the file is
    loaded by path and registered as sys.modules[name], where the dataclasses it defines look their module up
    (and where a benchmark's `import <sibling>` finds a sibling already loaded)."""
    path = BENCHMARKS / f"{name}.py"
    module = sys.modules.get(name)
    if module is not None:
        if Path(getattr(module, "__file__", "") or "").resolve() != path:
            raise RuntimeError(f"sys.modules[{name!r}] is {module!r}, not {path}")
        return module
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def side_by_side_rows(benchmark: str, argv: list[str], txt: Path) -> list[tuple[str, float, float, float, float]]:
    """Run benchmarks/<benchmark>.py (a side-by-side benchmark of benchmarks/table_threads.py's kind) with argv,
    writing its table to txt: (setting, reference total, our total, printed speed-up, max |d|) of each row."""
    bench = benchmark_module(benchmark)
    bench.main([*argv, "--txt", str(txt)])
    rows = []
    for line in txt.read_text().splitlines():
        fields = line.split("|")
        if len(fields) == 4 and not line.startswith("setting"):
            speed_up, diff = fields[3].split()
            rows.append((fields[0].split()[0], float(fields[1].split()[-1]), float(fields[2].split()[-1]),
                         float(speed_up.rstrip("x")), float(diff)))
    return rows


def speed_up_matches(reference: float, ours: float, speed_up: float) -> bool:
    """Whether a printed speed-up (2 decimals) is reference / ours, the printed totals being rounded to 0.01 s (the
    ratio is taken before rounding: at totals of 0.1 s that rounding alone moves it by 10%)."""
    low, high = (reference - 0.005) / (ours + 0.005), (reference + 0.005) / max(ours - 0.005, 1e-9)
    return low - 0.005 <= speed_up <= high + 0.005
