"""The axial in-context model: one process against 2 and 4 gloo ranks in float64, leakage, losses, configs.

Parallel: forward + backward on meshes 2x2, 4x1 and 1x2 (dp=2 on the 4-rank pool), with and without sequence
parallelism, for both tasks: outputs, input gradients and every parameter gradient (cut by its shard spec) equal
the plain model's to 1e-10. The batch has ragged tables (different rows, train rows and columns), so row and
column padding, the per-table train-row masks and the sequence padding to a multiple of d0 are all exercised.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from builders import make_batch, tiny_model
from dist_harness import get_mesh

from tabfm.data.encode import Batch
from tabfm.model import ModelConfig, TabFM, build_model
from tabfm.parallel.mesh import LayoutError
from tabfm.parallel.parallelize import check_layout, shard_specs
from tabfm.parallel.sharding import ShardSpec, shard_tensor
from tabfm.parallel_model import parallelize_model, tp_plan

TOL = 1e-10


def _objective(model: TabFM, batch: Batch, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits with unused classes zeroed, a scalar mixing the loss and every row's logits)."""
    logits = model(batch)
    valid = logits > torch.finfo(logits.dtype).min
    out = torch.where(valid, logits, 0.0)
    return out, model.loss(batch, logits) + 0.01 * (out * g[..., : out.shape[-1]]).sum()


COLUMN_STAGES = {"full": {}, "inducing": {"column_attention": "inducing", "num_inducing": 6}}
"""The tiny model's column stages under test. 6 inducing tokens: sequence parallelism on d0=4 pads them; and an
odd M would shift the rows' place in the `read` block's matmuls, so permuted rows would agree to 1e-15, not bit
for bit (test_permuting_test_rows_permutes_their_predictions)."""


def _parallel_errors(d0: int, d1: int, dp: int, sp: bool, column: str = "full") -> dict[str, float]:
    """Run on every rank: the plain model and its parallelized copy on the same batch, for both tasks."""
    mesh = get_mesh(d0, d1, dp)
    errors: dict[str, float] = {}
    for task in ("classification", "regression"):
        model = tiny_model(**COLUMN_STAGES[column])
        batch = make_batch(task)
        g = torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

        values = batch.values.clone().requires_grad_()
        ref_out, ref_obj = _objective(model, Batch(**{**batch.__dict__, "values": values}), g)
        ref_obj.backward()
        full_grads = {n: p.grad for n, p in model.named_parameters()}

        par = parallelize_model(copy.deepcopy(model), mesh, sequence_parallel=sp)
        par.zero_grad()
        par_values = batch.values.clone().requires_grad_()
        out, obj = _objective(par, Batch(**{**batch.__dict__, "values": par_values}), g)
        obj.backward()

        specs = shard_specs(par)
        assert specs, "nothing was sharded"
        errors[f"{task} out"] = (out - ref_out).abs().max().item()
        errors[f"{task} loss"] = abs(obj.item() - ref_obj.item())
        errors[f"{task} dvalues"] = (par_values.grad - values.grad).abs().max().item()
        for name, p in par.named_parameters():
            if full_grads[name] is None:  # the head of the other task
                assert p.grad is None, name
                continue
            spec = specs.get(name, ShardSpec((None,) * p.dim()))
            want = shard_tensor(full_grads[name], spec, d0, d1, mesh.i, mesh.j)
            errors[f"{task} grad {name}"] = (p.grad - want).abs().max().item()
    return errors


@pytest.mark.parametrize("column", COLUMN_STAGES)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("d0,d1,dp", [(2, 2, 1), (4, 1, 1), (1, 2, 2)], ids=["2x2", "4x1", "1x2-dp2"])
def test_parallel_model_equals_one_process(ranks, d0, d1, dp, sp, column):
    names = {n for n, _ in tiny_model(**COLUMN_STAGES[column]).named_parameters()}
    for rank, errors in enumerate(ranks(4).run(_parallel_errors, d0, d1, dp, sp, column)):
        # every parameter's gradient was compared (each head in its own task), and every task's output and loss
        assert {k.split(" grad ", 1)[1] for k in errors if " grad " in k} == names
        assert {k for k in errors if " grad " not in k} == {f"{t} {w}" for t in ("classification", "regression")
                                                             for w in ("out", "loss", "dvalues")}
        bad = {k: v for k, v in errors.items() if not v <= TOL}
        assert not bad, f"rank {rank}: {bad}"


def test_one_by_one_mesh_is_the_plain_model():
    from tabfm.parallel.mesh import TPMesh

    model = tiny_model()
    batch = make_batch()
    plain = model(batch)
    assert torch.equal(parallelize_model(model, TPMesh.single())(batch), plain)


def test_the_plan_is_applied_from_outside():
    """tp_plan makes each stage's blocks a region and its blocks ATP layers; the plain model is left untouched by
    anything but the swap: same parameter names, the mesh kept only in the layers, output the plain one's."""
    from tabfm.parallel.layers import ParallelBlock
    from tabfm.parallel.mesh import TPMesh
    from tabfm.parallel.parallelize import parallelize
    from tabfm.parallel_model import model_mesh

    model, batch = tiny_model(), make_batch()
    mesh = TPMesh.single()
    par = parallelize(copy.deepcopy(model), mesh, tp_plan(model))
    assert model_mesh(model) is None and model_mesh(par) is mesh
    assert [n for n, _ in par.named_parameters()] == [n for n, _ in model.named_parameters()]
    blocks = [m for m in par.modules() if isinstance(m, ParallelBlock)]
    assert len(blocks) == 2 * model.config.axial_num_blocks + 1 + model.config.icl_num_blocks
    regions = [n for n, m in par.named_modules() if m._forward_pre_hooks]
    axial = [f"axial.{i}.{stage}.block" for i in range(model.config.axial_num_blocks) for stage in ("column", "row")]
    assert regions == [*axial, "compress.block", "icl.blocks"]
    with torch.no_grad():
        assert torch.allclose(par(batch), model(batch), rtol=0, atol=TOL)
    with pytest.raises(ValueError, match="matches both 'icl' and its child 'icl.blocks'"):
        parallelize(copy.deepcopy(model), mesh, {"icl": "region", "icl.blocks": "region"})


def test_inducing_column_blocks_are_regions_of_the_plan():
    """With inducing column attention each axial block's column stage is two regions (summarise, read) whose
    attention, MLP and norms are ATP layers; the inducing tokens stay replicated like the CLS tokens."""
    from tabfm.parallel.layers import ParallelBlock
    from tabfm.parallel.mesh import TPMesh
    from tabfm.parallel.parallelize import parallelize

    model, batch = tiny_model(**COLUMN_STAGES["inducing"]), make_batch()
    par = parallelize(copy.deepcopy(model), TPMesh.single(), tp_plan(model))
    assert [n for n, _ in par.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert "axial.0.column.inducing" in dict(par.named_parameters())
    regions = [n for n, m in par.named_modules() if m._forward_pre_hooks]
    assert regions == ["axial.0.column.summarise", "axial.0.column.read", "axial.0.row.block", "compress.block",
                       "icl.blocks"]
    assert all(isinstance(par.get_submodule(n), ParallelBlock) for n in regions[:-1])
    with torch.no_grad():
        assert torch.allclose(par(batch), model(batch), rtol=0, atol=TOL)


def test_layout_that_does_not_divide_heads_is_refused():
    model = tiny_model(axial_heads=2)
    with pytest.raises(LayoutError, match="heads are not divisible"):
        check_layout(model, tp_plan(model), 2, 2)


# ---------------------------------------------------------------------------------------------------------
# Leakage: test rows never influence other rows, normalisation comes from train rows only
# ---------------------------------------------------------------------------------------------------------

def _perturb_row(batch: Batch, b: int, r: int, seed: int = 9) -> Batch:
    g = torch.Generator().manual_seed(seed)
    values, codes, missing = batch.values.clone(), batch.cat_codes.clone(), batch.missing.clone()
    num = ~batch.is_cat[b] & ~batch.col_pad[b]
    values[b, r, num] = torch.randn(int(num.sum()), generator=g, dtype=values.dtype) * 1e3
    missing[b, r, num] = False
    cat = batch.is_cat[b] & ~batch.col_pad[b]
    codes[b, r, cat] = (codes[b, r, cat] + 1) % 4
    labels = batch.labels.clone()
    labels[b, r] = labels[b, r] + 1 if batch.task == "regression" else (labels[b, r] + 1) % 3
    return Batch(**{**batch.__dict__, "values": values, "cat_codes": codes, "missing": missing, "labels": labels})


@pytest.mark.parametrize("column", COLUMN_STAGES)
@pytest.mark.parametrize("task", ["classification", "regression"])
def test_changing_a_test_row_moves_no_other_row(task, column):
    model, batch = tiny_model(**COLUMN_STAGES[column]), make_batch(task)
    with torch.no_grad():
        before = model(batch)
        for b, r in [(0, 5), (0, 8), (1, 7)]:  # test rows (table 0 has 5 train rows, table 1 has 6)
            after = model(_perturb_row(batch, b, r))
            others = torch.ones(2, 10, dtype=torch.bool)
            others[b, r] = False
            assert torch.equal(after[others], before[others]), (b, r)
            assert not torch.equal(after[b, r], before[b, r])  # the changed row itself did move
        # Sanity: changing a train row does move the test rows.
        after = model(_perturb_row(batch, 1, 2))
        assert not torch.allclose(after[1, 6:], before[1, 6:])


@pytest.mark.parametrize("column", COLUMN_STAGES)
def test_permuting_test_rows_permutes_their_predictions(column):
    model, batch = tiny_model(**COLUMN_STAGES[column]), make_batch()
    perm = torch.tensor([0, 1, 2, 3, 4, 5, 9, 7, 6, 8])  # table 1: train rows 0..5 stay, test rows shuffled
    fields = {}
    for name, t in batch.tensors().items():
        fields[name] = t.clone()
        if t.dim() >= 2 and t.shape[1] == 10:
            fields[name][1] = t[1][perm]
    shuffled = Batch(**{**batch.__dict__, **fields})
    with torch.no_grad():
        before, after = model(batch), model(shuffled)
    assert torch.equal(after[1], before[1][perm])
    assert torch.equal(after[0], before[0])


def test_normalisation_uses_train_rows_only():
    model, batch = tiny_model(), make_batch()
    cells = model.cells
    args = lambda bt: (bt.values, bt.missing, bt.cat_codes, bt.is_cat,  # noqa: E731
                       cells.stats(bt.values, bt.missing, bt.n_train))
    with torch.no_grad():
        x = cells(*args(batch))
        x2 = cells(*args(_perturb_row(batch, 1, 9)))
        # Only row 9 of table 1 changes.
        mask = torch.ones(2, 10, dtype=torch.bool)
        mask[1, 9] = False
        assert torch.equal(x[mask], x2[mask])
        # A shift and scale of a whole column leaves a numeric column's cells unchanged (up to rounding).
        v = batch.values.clone()
        v[:, :, 0] = v[:, :, 0] * 7 + 100
        x3 = cells(*args(Batch(**{**batch.__dict__, "values": v})))
        assert torch.allclose(x3, x, atol=1e-9)


# ---------------------------------------------------------------------------------------------------------
# Losses, heads, a real prior batch, configs
# ---------------------------------------------------------------------------------------------------------

def test_classification_loss_is_cross_entropy_over_test_rows():
    model, batch = tiny_model(), make_batch()
    logits = model(batch)
    test = model.test_mask(batch)
    assert test.sum() == (9 - 5) + (10 - 6)
    manual = torch.stack([torch.nn.functional.cross_entropy(logits[b, r][None], batch.labels[b, r][None])
                          for b, r in test.nonzero().tolist()]).mean()
    assert torch.allclose(model.loss(batch, logits), manual)
    # Unused classes get no probability.
    probs = logits.softmax(-1)
    assert probs[0, :, 3:].max() == 0 and probs[1, :, 4:].max() == 0


def test_regression_loss_and_mean():
    model, batch = tiny_model(), make_batch("regression")
    logits = model(batch)
    # The loss is the cross-entropy of each test row's bin: its target standardised with the train rows' mean and
    # deviation, clipped to +-bin_range, and cut into num_bins equal bins.
    train = [batch.labels[b, :n] for b, n in enumerate(batch.n_train.tolist())]
    mu = torch.stack([t.mean() for t in train])[:, None]
    sd = torch.stack([t.std(correction=0) for t in train])[:, None]
    span = 2 * model.config.bin_range / model.config.num_bins
    test = model.test_mask(batch)
    z = ((batch.labels - mu) / sd).clamp(-model.config.bin_range, model.config.bin_range)
    bins = ((z + model.config.bin_range) / span).floor().long().clamp(max=model.config.num_bins - 1)
    manual = torch.nn.functional.cross_entropy(logits[test], bins[test])
    assert torch.allclose(model.loss(batch, logits), manual, rtol=0, atol=1e-12)
    mean = model.predict(batch)
    assert mean.shape == (2, 10) and torch.isfinite(mean).all()
    assert torch.allclose(torch.cat(model.target_stats(batch), 1), torch.cat([mu, sd], 1), rtol=0, atol=1e-9)
    # The predicted mean lies within the bin range of each table's train targets.
    assert ((mean - mu).abs() <= model.config.bin_range * sd + 1e-9).all()
    # Quantiles are ordered, and the median of a distribution symmetric about 0 is the train mean.
    qs = model.regression_quantiles(batch, logits, torch.tensor([0.1, 0.5, 0.9]))
    assert qs.shape == (2, 10, 3) and (qs[..., 0] <= qs[..., 1]).all() and (qs[..., 1] <= qs[..., 2]).all()
    flat = torch.zeros_like(logits)
    assert torch.allclose(model.regression_quantiles(batch, flat, torch.tensor([0.5]))[..., 0], mu.expand(2, 10))
    assert torch.allclose(model.regression_mean(batch, flat), mu.expand(2, 10))


@pytest.mark.parametrize("task", ["classification", "regression"])
def test_a_few_steps_fit_a_fixed_batch(task):
    torch.manual_seed(0)
    model, batch = build_model("tiny", seed=0), make_batch(task)
    batch = Batch(**{**batch.__dict__, "values": batch.values.float(), "labels": batch.labels if task ==
                     "classification" else batch.labels.float()})
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(10):  # both tasks fall below 0.4x the first loss by step 10 (0.24x, 0.37x)
        loss = model.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_runs_on_a_prior_batch():
    from tabfm.data.config import DataConfig
    from tabfm.data.loader import PriorSource, batch_at

    src = PriorSource(DataConfig.tiny(batch_size=2))
    for step in range(3):
        batch = batch_at(src, step)
        model = build_model("tiny")
        loss = model.loss(batch)
        assert torch.isfinite(loss), (step, batch.task)
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_presets_load_and_bad_configs_are_refused():
    sizes = {name: sum(p.numel() for p in build_model(name).parameters()) for name in ("tiny", "small", "base")}
    assert sizes["tiny"] < sizes["small"] < sizes["base"]
    assert ModelConfig.load("large").icl_dim == 512
    with pytest.raises(ValueError, match="valid keys: embed_dim"):
        ModelConfig.from_dict({"embed_dimension": 8})
    with pytest.raises(ValueError, match="not divisible by axial_heads"):
        ModelConfig(embed_dim=10, axial_heads=4)
    with pytest.raises(ValueError, match="presets: base, large, small, small_inducing, small_wide, tiny"):
        ModelConfig.load("huge")
    with pytest.raises(ValueError, match="max_columns"):
        tiny_model(max_columns=3)(make_batch())
    with pytest.raises(ValueError, match="column_attention must be one of full, inducing, got 'linear'"):
        ModelConfig(column_attention="linear")
    with pytest.raises(ValueError, match="num_inducing must be a positive number"):
        ModelConfig(column_attention="inducing", num_inducing=0)


def test_wide_and_inducing_presets_and_the_meshes_they_fit():
    """small_wide: small's widths with 2 axial heads of 16 (meshes of 1 or 2 ranks); small_inducing: small with 32
    inducing tokens per column (every mesh of up to 4 ranks, as small). A full-attention config's dict, and so its
    checkpoints, carries no column-stage settings (as before the option); an inducing one's does, and round-trips."""
    from tabfm.layout import fitting_layouts

    small, wide, inducing = (ModelConfig.load(n) for n in ("small", "small_wide", "small_inducing"))
    assert (wide.embed_dim, wide.axial_heads, wide.icl_dim // wide.icl_heads) == (32, 2, 32)
    assert inducing == dataclasses.replace(small, column_attention="inducing", num_inducing=32)
    meshes = lambda cfg, n: {(p.d0, p.d1) for p in fitting_layouts(cfg, n) if p.dp == 1}  # noqa: E731
    assert meshes(wide, 2) == {(1, 2), (2, 1)} and meshes(wide, 4) == set()
    assert meshes(inducing, 4) == meshes(small, 4) == {(1, 4), (2, 2), (4, 1)}
    assert "column_attention" not in small.to_dict() and ModelConfig.from_dict(small.to_dict()) == small
    assert ModelConfig.from_dict(inducing.to_dict()) == inducing
