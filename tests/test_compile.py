"""torch.compile traces the model's training forward whole: no graph break, and the same numbers as eager.

The forward reads no tensor into Python: the batch carries n_train's range and the most classes as Python ints
(Batch.train_bounds / most_classes, read when it is built). The one break left is in `loss`, outside the forward
(`model.compile()` compiles the forward only): `logits[test]` keeps a data-dependent number of rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch._dynamo
from builders import make_batch, tiny_model

from tabfm.data.encode import Batch

ROOT = Path(__file__).resolve().parent.parent


def explain(fn, batch: Batch):
    """torch._dynamo.explain of fn(batch), from a clean dynamo cache."""
    torch._dynamo.reset()
    try:
        return torch._dynamo.explain(fn)(batch)
    finally:
        torch._dynamo.reset()


def test_the_forward_has_no_graph_break():
    out = explain(tiny_model(), make_batch("classification"))
    assert (out.graph_count, out.graph_break_count) == (1, 0), [b.reason for b in out.break_reasons]


def test_the_loss_breaks_once_at_its_test_row_selection():
    out = explain(tiny_model().loss, make_batch("regression"))
    assert out.graph_break_count == 1
    assert "dynamic shape" in out.break_reasons[0].reason.lower()


@pytest.mark.parametrize("task", ["classification", "regression"])
def test_fullgraph_compile_matches_eager_exactly(task):
    """backend="eager" runs dynamo's captured graph with the same kernels: outputs, loss and every gradient equal
    the uncompiled model's bit for bit (fullgraph=True raises on any graph break)."""
    batch = make_batch(task)
    eager, traced = tiny_model(), tiny_model()
    torch._dynamo.reset()
    compiled = torch.compile(traced, backend="eager", fullgraph=True)
    try:
        losses = [eager.loss(batch, eager(batch)), traced.loss(batch, compiled(batch))]
    finally:
        torch._dynamo.reset()
    for loss in losses:
        loss.backward()
    assert torch.equal(losses[0], losses[1])
    for (name, a), b in zip(eager.named_parameters(), traced.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None) and (a.grad is None or torch.equal(a.grad, b.grad)), name


def test_the_batch_carries_its_counts_as_python_ints():
    batch = make_batch("classification")
    assert (batch.train_bounds, batch.most_classes) == ((5, 6), 4)
    rebuilt = Batch(**{**batch.__dict__, "n_train": torch.tensor([3, 7]), "n_classes": torch.tensor([2, 9])})
    assert (rebuilt.train_bounds, rebuilt.most_classes) == ((3, 7), 9)  # re-read, never carried over stale
    assert batch.to("meta").train_bounds == (5, 6)  # moved: the ints travel with it (no read on a device)
    meta = Batch(**{k: v.to("meta") for k, v in batch.tensors().items()}, task=batch.task)
    assert (meta.train_bounds, meta.most_classes) == (None, None)  # built on meta: nothing to read
    model = tiny_model().to("meta")
    assert model(meta, max_train=6).shape == (2, 10, 10)  # the planner's path: max_train given
    with pytest.raises(ValueError, match="max_train"):
        model(meta)


# ---------------------------------------------------------------------------------------------------------
# train.compile: the pretraining loop with a compiled forward
# ---------------------------------------------------------------------------------------------------------

def _run(out_dir, *extra):
    from tabfm.config import load_config
    from tabfm.pretrain import train

    cfg = load_config(ROOT / "configs" / "pretrain" / "tiny.yaml",
                      [f"train.out_dir={out_dir}", "train.progress=false", "data.batch_size=2",
                       "data.table.max_rows=40", "train.steps=3", "train.dtype=float64", *extra])
    return train(cfg)


def test_train_compile_gives_the_eager_losses_and_the_same_checkpoint_names(tmp_path):
    """aot_eager traces forward and backward (AOTAutograd) without generating code: in float64 the three steps'
    losses match eager's to 1e-10, over batches of different shapes (recompiles, then dynamic sizes), and the
    checkpoint's parameter names are the plain model's (model.compile() works in place)."""
    from safetensors.torch import load_file

    from tabfm import checkpoint as ckpt

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    try:
        compiled = _run(tmp_path / "c", "train.compile=aot_eager")
        graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    assert graphs >= 1  # dynamo did trace the forward
    eager = _run(tmp_path / "e")
    assert len({tuple(r["batch_shape"]) for r in eager}) > 1  # the shapes change from step to step
    assert [r["loss"] for r in compiled] == pytest.approx([r["loss"] for r in eager], rel=1e-10, abs=0)
    names = [set(load_file(ckpt.merge(ckpt.latest_checkpoint(tmp_path / d), tmp_path / f"{d}.safetensors")))
             for d in ("c", "e")]
    assert names[0] == names[1]


@pytest.mark.parametrize("extra, says", [
    (["train.compile=inductr"], "is not a torch.compile backend"),
    (["train.compile=inductor", "parallel.d1=2"], "needs parallel.d0 = d1 = 1"),
    (["train.compile=inductor", "parallel.layout=auto"], "needs parallel.d0 = d1 = 1"),
])
def test_train_compile_is_refused_where_it_cannot_run(extra, says):
    from tabfm.config import load_config

    with pytest.raises(ValueError, match=says):
        load_config(ROOT / "configs" / "pretrain" / "tiny.yaml", extra)
