"""`parallel.layout: auto`: the planner picks the layout of a pretraining run from the real TabFM layers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tabfm.config import load_config, load_topology
from tabfm.layout import TabFMSource, resolve_layout, source_for
from tabfm.parallel import planner
from tabfm.pretrain import check_run_layout, train

TINY = Path(__file__).resolve().parent.parent / "configs" / "pretrain" / "tiny.yaml"
PAIRS = """
name: test-pairs
description: 4 devices, fast pairs joined by a 20x slower link (a test fixture)
devices: 4
memory_gb: 16
dtype: float32
compute: {peak_tflops: 1.0, memory_bandwidth_gbs: 50}
levels:
  - {name: pair, span: 2, alpha_us: 5, bandwidth_gbs: 100}
  - {name: network, span: 4, alpha_us: 100, bandwidth_gbs: 5}
"""


def _auto_cfg(tmp_path: Path, *extra: str, write_preset: bool = True):
    """The tiny run with layout: auto on the pairs preset, written into tmp_path (ranks sharing a folder pass
    write_preset=False: the test writes it once, as one rank rewriting it could truncate it under another's read)."""
    preset = tmp_path / "pairs.yaml"
    if write_preset:
        preset.write_text(PAIRS)
    sets = {"train.out_dir": tmp_path / "run", "train.steps": 1, "train.checkpoint_every": 0,
            "parallel.layout": "auto", "parallel.topology": preset}
    sets.update(item.split("=", 1) for item in extra)  # an extra's key replaces the default's: --set takes it once
    return load_config(TINY, [f"{key}={value}" for key, value in sets.items()])


@pytest.fixture(scope="module")
def pairs_plan(tmp_path_factory) -> tuple:
    """The planner's ranking of the tiny run's layouts on 4 ranks of the pairs preset, that topology, and the
    planner's traces of the layouts (traced once for the module: the ranking does not depend on the run folder)."""
    tmp = tmp_path_factory.mktemp("pairs")
    cfg = _auto_cfg(tmp)
    topology = load_topology(str(tmp / "pairs.yaml"))
    traces: dict = {}
    return planner.plan(source_for(cfg), topology, 4, dtype=cfg.train.dtype, traces=traces), topology, traces


def _train_auto(tmp: str) -> tuple:
    cfg = _auto_cfg(Path(tmp), write_preset=False)
    train(cfg)
    return json.loads((Path(tmp) / "run" / "layout.json").read_text()) if (Path(tmp) / "run" / "layout.json").exists() else None


@pytest.mark.slow
def test_auto_on_four_ranks_uses_the_planner_winner_on_every_rank(ranks, tmp_path, request):
    (tmp_path / "pairs.yaml").write_text(PAIRS)
    # rank 0 plans while this process plans the module's
    (best, _), results = ranks(4).submit(_train_auto, str(tmp_path)).beside(
        lambda: planner.choose_layout_from(*request.getfixturevalue("pairs_plan")[:2]))
    chosen = results[0]
    assert (chosen["d0"], chosen["d1"], chosen["sequence_parallel"], chosen["overlap_chunks"]) == \
        (best.d0, best.d1, best.sequence_parallel, best.chunks)
    assert chosen["reason"].startswith(f"{best.layout} (d0={best.d0}, d1={best.d1})") and "predicted" in \
        chosen["reason"]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics and metrics[-1]["step"] == 1


def test_tabfm_source_counts_the_real_model(tmp_path, pairs_plan):
    cfg = _auto_cfg(tmp_path)
    source = source_for(cfg)
    assert isinstance(source, TabFMSource) and source.model == cfg.model
    assert (source.batch, source.rows, source.features) == (cfg.data.batch_size, cfg.data.table.max_rows,
                                                            cfg.data.table.max_features)
    valid = [c for c in pairs_plan[0] if c.valid and c.chunks == 1]
    assert {(c.d0, c.d1) for c in valid} == {(4, 1), (2, 2), (1, 4)}
    volume = {(c.d0, c.d1, c.sequence_parallel): c.volume for c in valid}
    # DESIGN 3.3: axis 0 carries (d0-1)/d0 * 4/d1 of each block's tokens, so 4x1 moves 3x what 2x2 does; an axis of
    # size 1 moves nothing.
    assert volume[(4, 1, False)]["tp0"] == 3 * volume[(2, 2, False)]["tp0"] > 0
    assert volume[(4, 1, False)]["tp1"] == volume[(1, 4, False)]["tp0"] == 0


@pytest.mark.slow
def test_auto_on_one_process_is_the_single_device_layout(tmp_path):
    cfg = _auto_cfg(tmp_path, "parallel.topology=measure")
    check_run_layout(cfg, 1)
    resolved, reason = resolve_layout(cfg, 1, tmp_path)
    assert (resolved.parallel.d0, resolved.parallel.d1, resolved.parallel.layout) == (1, 1, "manual")
    assert "1x1" in reason and json.loads((tmp_path / "layout.json").read_text())["d0"] == 1


def test_auto_with_data_parallel_needs_a_preset(tmp_path):
    cfg = _auto_cfg(tmp_path, "parallel.topology=measure", "parallel.dp=2")
    with pytest.raises(ValueError, match="needs a topology preset"):
        resolve_layout(cfg, 4)


def test_tabfm_plan_takes_a_pretraining_config(tmp_path, capsys, monkeypatch, pairs_plan):
    """`tabfm plan` of the pretraining config ranks the same layouts as the module's plan: the planner runs whole
    (pricing, ranking, the table), reading the module's traces of the same model, layouts and dtype (plan()'s
    `traces`, which do not depend on the topology) instead of tracing each layout again."""
    from tabfm import cli

    real_plan, calls = planner.plan, []

    def plan(source, topology, nproc, **options):
        shared = source == source_for(_auto_cfg(tmp_path)) and options.get("trace_device", "meta") == "meta"
        calls.append(shared)
        return real_plan(source, topology, nproc, **options, **({"traces": pairs_plan[2]} if shared else {}))

    monkeypatch.setattr(planner, "plan", plan)
    preset = tmp_path / "pairs.yaml"
    preset.write_text(PAIRS)
    assert cli.main(["plan", "--config", str(TINY), "--nproc", "4", "--topology", str(preset), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "model: TabFM" in out and "best: " in out
    assert calls == [True]
    best, reason = planner.choose_layout_from(*pairs_plan[:2])
    assert f"best: {reason}" in out


def _inducing_source() -> TabFMSource:
    """The tiny model with the inducing-point column stage (issue 12), on 2 tables x 16 rows x 4 features."""
    import dataclasses

    from tabfm.model import ModelConfig

    cfg = dataclasses.replace(ModelConfig.load("tiny"), column_attention="inducing", num_inducing=6)
    return TabFMSource(cfg, batch=2, rows=16, features=4)


def _real_step_tallies(d0: int, d1: int, sp: bool) -> dict:
    """On each rank: the collectives one forward and one backward of the inducing model send on a real mesh."""
    import torch
    from dist_harness import get_mesh

    from tabfm.parallel.topology import AXES

    torch.manual_seed(0)
    model, parallelize_model, inputs = _inducing_source()()
    mesh = get_mesh(d0, d1)
    par = parallelize_model(model, mesh, sp, 1)
    batch = inputs(mesh, sp, torch.device("cpu"), torch.float32)
    mesh.reset_tallies()
    out = par(*batch)
    out = out[0] if isinstance(out, tuple) else out
    forward = {a: mesh.axis(a).tally.snapshot() for a in AXES}
    mesh.reset_tallies()
    out.backward(torch.ones_like(out))
    return {"forward": forward, "backward": {a: mesh.axis(a).tally.snapshot() for a in AXES}}


@pytest.mark.parametrize("d0, d1, sp", [(2, 2, True), (4, 1, False)])
def test_planner_counts_the_inducing_column_stage_as_the_ranks_run_it(ranks, d0, d1, sp):
    """The planner's trace of the inducing model (the summarising block's extra key pass included) holds, per
    axis and phase, exactly the collectives, bytes and traffic the 4 ranks send."""
    from tabfm.parallel.plan_trace import trace

    traced, results = ranks(4).submit(_real_step_tallies, d0, d1, sp).beside(
        lambda: trace(_inducing_source(), d0, d1, sp, 1))
    for real in results:
        for phase in ("forward", "backward"):
            assert real[phase] == traced.tallies[phase], phase
            assert sum(real[phase]["tp0"]["calls"].values()) + sum(real[phase]["tp1"]["calls"].values()) > 0
