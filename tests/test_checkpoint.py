"""Sharded checkpoints: a 2x2 run saved by 4 gloo ranks merges, reshards and loads back bit-exactly on any
layout (model and optimizer state); the trainer's CheckpointManager saves, prunes and resumes. Checkpoints that must
not load are test_checkpoint_safety.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dist_harness import get_mesh
from safetensors.torch import load_file
from builders import adamw_steps, make_batch, tiny_model

from tabfm import checkpoint as ckpt
from tabfm.model import ModelConfig
from tabfm.parallel.mesh import TPMesh
from tabfm.parallel.sharding import ShardSpec, gather_state_dict, shard_tensor
from tabfm.parallel_model import model_mesh, parallelize_model
from tabfm.train_checkpoints import CheckpointManager
from tabfm.train_log import MetricsLog

STEPS = 2


def _model(**overrides):
    return tiny_model(seed=3, **overrides)


def _optim_by_name(model, opt) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {f"{names[id(p)]}/{k}": v.clone() for p, st in opt.state.items() for k, v in st.items()}


def _train_and_save(path: str, d0: int, d1: int, **overrides) -> dict:
    mesh = get_mesh(d0, d1)
    model = parallelize_model(_model(**overrides), mesh)
    opt = adamw_steps(model, STEPS)
    ckpt.save_checkpoint(path, model, opt, mesh=mesh, step=STEPS, data_position={"next_step": STEPS},
                         run_config={"note": "test"})
    with torch.no_grad():
        logits = model(make_batch(seed=7))
    return {"coord": (mesh.i, mesh.j), "state": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": _optim_by_name(model, opt), "specs": ckpt.model_specs(model), "logits": logits}


def _load_on(path: str, d0: int, d1: int) -> dict:
    mesh = get_mesh(d0, d1)
    model = parallelize_model(_model(), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = ckpt.load_checkpoint(path, model, opt)
    return {"coord": (mesh.i, mesh.j), "state": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": _optim_by_name(model, opt), "step": state.step, "data": state.data_position}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2x2 checkpoint written by 4 ranks, and what each rank held."""
    from conftest import _pool

    path = tmp_path_factory.mktemp("ckpt") / "step2"
    results = _pool(4).run(_train_and_save, str(path), 2, 2)
    specs = results[0]["specs"]
    full = gather_state_dict({r["coord"]: r["state"] for r in results}, specs, 2, 2)
    optim_specs = {k: specs.get(k.rpartition("/")[0]) if v.dim() else None
                   for k, v in results[0]["optim"].items()}
    optim_full = gather_state_dict({r["coord"]: r["optim"] for r in results},
                                   {k: s for k, s in optim_specs.items() if s is not None}, 2, 2)
    return {"path": path, "results": results, "full": full, "optim_full": optim_full, "specs": specs}


def test_manifest_describes_the_run(saved):
    manifest = ckpt.verify_checkpoint(saved["path"])
    assert manifest["layout"] == {"d0": 2, "d1": 2, "dp": 1}
    assert manifest["step"] == STEPS and manifest["data_position"] == {"next_step": STEPS}
    assert manifest["model_config"] == ModelConfig.load("tiny").to_dict()
    assert sorted(manifest["files"]) == [f"rank00{t}.safetensors" for t in range(4)]
    qkv = manifest["tensors"]["model/icl.blocks.blocks.0.attn.qkv.weight"]
    assert qkv["shape"] == [96, 32] and qkv["spec"] == {"dims": ["tp0", "tp1"], "qkv_heads": 4}
    assert manifest["tensors"]["optim/icl.blocks.blocks.0.attn.qkv.weight/exp_avg"]["spec"] == qkv["spec"]
    assert manifest["optimizer"]["class"] == "AdamW"
    assert not Path(str(saved["path"]) + ".tmp").exists()


def test_merge_is_the_gathered_state_dict(saved, tmp_path):
    out = ckpt.merge(saved["path"], tmp_path / "merged.safetensors")
    merged = load_file(out)
    assert merged.keys() == saved["full"].keys()
    for k, v in saved["full"].items():
        assert torch.equal(merged[k], v), k
    # The merged file is a plain model: it predicts what the 2x2 model predicted.
    model = ckpt.load_model(out)
    assert model_mesh(model) is None and next(model.parameters()).dtype == torch.float64
    with torch.no_grad():
        logits = model(make_batch(seed=7))
    assert (logits - saved["results"][0]["logits"]).abs().max() <= 1e-10


def test_reshard_round_trip_is_bit_exact(saved, tmp_path):
    a = ckpt.reshard(saved["path"], 4, 1, tmp_path / "a")
    b = ckpt.reshard(a, 1, 1, tmp_path / "b")
    c = ckpt.reshard(b, 2, 2, tmp_path / "c")
    assert ckpt.verify_checkpoint(b)["layout"] == {"d0": 1, "d1": 1, "dp": 1}
    merged = {name: load_file(ckpt.merge(d, tmp_path / f"{name}.safetensors")) for name, d in
              [("orig", saved["path"]), ("a", a), ("b", b), ("c", c)]}
    for name in "abc":
        for k, v in merged["orig"].items():
            assert torch.equal(merged[name][k], v), (name, k)
    # c is cut exactly like the original: every rank file holds the same tensors.
    for t in range(4):
        orig = load_file(saved["path"] / f"rank00{t}.safetensors")
        again = load_file(c / f"rank00{t}.safetensors")
        for k, v in orig.items():
            if not k.startswith("rng/"):
                assert torch.equal(again[k], v), (t, k)
    # 1x1 loads into a plain model with its optimizer state, bit-exactly.
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = ckpt.load_checkpoint(b, model, opt)
    assert state.step == STEPS and state.run_config == {"note": "test"}
    for k, v in saved["full"].items():
        assert torch.equal(model.state_dict()[k], v), k
    for k, v in _optim_by_name(model, opt).items():
        assert torch.equal(v, saved["optim_full"][k]), k


@pytest.mark.parametrize("d0,d1", [(2, 2), (4, 1), (1, 4)], ids=["same-2x2", "4x1", "1x4"])
def test_load_on_any_layout(saved, ranks, d0, d1):
    for r in ranks(4).run(_load_on, str(saved["path"]), d0, d1):
        i, j = r["coord"]
        assert r["step"] == STEPS and r["data"] == {"next_step": STEPS}
        for k, v in r["state"].items():
            spec = saved["specs"].get(k, ShardSpec((None,) * v.dim()))
            assert torch.equal(v, shard_tensor(saved["full"][k], spec, d0, d1, i, j)), k
        for k, v in r["optim"].items():
            spec = saved["specs"].get(k.rpartition("/")[0]) if v.dim() else None
            want = saved["optim_full"][k]
            assert torch.equal(v, want if spec is None else shard_tensor(want, spec, d0, d1, i, j)), k


def _load_merged_on(path: str, d0: int, d1: int) -> dict:
    mesh = get_mesh(d0, d1)
    model = ckpt.load_model(path, mesh)
    with torch.no_grad():
        return {"logits": model(make_batch(seed=7))}


def test_merged_file_loads_on_a_mesh(saved, ranks, tmp_path):
    out = ckpt.merge(saved["path"], tmp_path / "merged.safetensors")
    for r in ranks(4).run(_load_merged_on, str(out), 4, 1):
        assert (r["logits"] - saved["results"][0]["logits"]).abs().max() <= 1e-10


def test_inducing_column_stage_shards_merges_and_loads_on_any_layout(ranks, tmp_path):
    """The inducing column stage's parameters (tokens, summarise and read blocks) are cut, merged and loaded like the
    others: a 2x2 checkpoint merges to the gathered state dict, which a plain model and a 4x1 mesh load to the 2x2
    model's logits (float64, 1e-10)."""
    path = tmp_path / "step2"
    results = ranks(4).run(_train_and_save, str(path), 2, 2, column_attention="inducing", num_inducing=6)
    specs = results[0]["specs"]
    assert "axial.0.column.summarise.attn.qkv.weight" in specs and "axial.0.column.read.mlp.fc1.weight" in specs
    assert "axial.0.column.inducing" not in specs  # replicated, like the CLS tokens
    full = gather_state_dict({r["coord"]: r["state"] for r in results}, specs, 2, 2)
    merged = load_file(ckpt.merge(path, tmp_path / "merged.safetensors"))
    assert merged.keys() == full.keys() and all(torch.equal(merged[k], v) for k, v in full.items())
    model = ckpt.load_model(tmp_path / "merged.safetensors")
    assert model.config.column_attention == "inducing" and model.config.num_inducing == 6
    with torch.no_grad():
        assert (model(make_batch(seed=7)) - results[0]["logits"]).abs().max() <= 1e-10
    for r in ranks(4).run(_load_merged_on, str(tmp_path / "merged.safetensors"), 4, 1):
        assert (r["logits"] - results[0]["logits"]).abs().max() <= 1e-10


# ---------------------------------------------------------------------------------------------------------
# CheckpointManager: a training run's saves, pruning and resume
# ---------------------------------------------------------------------------------------------------------

def _metrics(lines: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in lines)


def test_manager_saves_when_due_and_keeps_the_newest(tmp_path):
    """Every 2 steps and after the last (5); keep=2 prunes older saves and an interrupted save's leftover; each
    manifest records where the data continues and the run's config."""
    mesh = TPMesh.single()
    manager = CheckpointManager(tmp_path, mesh, every=2, keep=2, run_config={"note": "run"}, data_seed=7)
    assert [s for s in range(1, 6) if manager.due(s, 5)] == [2, 4, 5]
    assert [s for s in range(1, 6) if CheckpointManager(tmp_path / "x", mesh).due(s, 5)] == [5]  # every=0: the end
    assert manager.latest() is None
    (tmp_path / "checkpoints" / "step_0000009.tmp").mkdir(parents=True)
    model = _model()
    opt = adamw_steps(model, 1)
    for step in (2, 4, 5):
        assert manager.save(model, opt, step) == tmp_path / "checkpoints" / f"step_{step:07d}"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_0000004", "step_0000005"]
    assert manager.latest().name == "step_0000005"
    manifest = ckpt.read_manifest(manager.latest())
    assert manifest["step"] == 5 and manifest["data_position"] == {"next_step": 5, "seed": 7}
    assert manifest["run_config"] == {"note": "run"}


def test_manager_resumes_from_the_latest_and_trims_the_log(tmp_path, capsys):
    """resume="auto" finds the newest checkpoint before any model exists, restores model and optimizer and
    continues at its step; the log keeps the lines up to that step. Without a checkpoint it starts at 0 with an
    empty log; without resume it reads nothing and trims nothing; only rank 0 trims."""
    mesh = TPMesh.single()
    model = _model()
    opt = adamw_steps(model, STEPS)
    CheckpointManager(tmp_path, mesh, every=2).save(model, opt, 2)
    log = MetricsLog(tmp_path / "metrics.jsonl")
    lines = [{"step": s, "loss": 1.0 / s} for s in (1, 2)] + [{"step": 2, "eval": {}}, {"step": 3, "loss": 0.3}]
    (tmp_path / "metrics.jsonl").write_text(_metrics(lines))

    not_rank0 = CheckpointManager(tmp_path, mesh, resume="auto", metrics=log, rank0=False)
    fresh = _model()
    assert not_rank0.restore(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2)) == 2
    assert (tmp_path / "metrics.jsonl").read_text() == _metrics(lines)

    manager = CheckpointManager(tmp_path, mesh, resume="auto", metrics=log)
    assert manager.resume_from == tmp_path / "checkpoints" / "step_0000002"
    fresh = _model()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert manager.restore(fresh, fresh_opt) == 2
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
    want = _optim_by_name(model, opt)
    assert all(torch.equal(v, want[k]) for k, v in _optim_by_name(fresh, fresh_opt).items())
    assert (tmp_path / "metrics.jsonl").read_text() == _metrics(lines[:3])

    folder = CheckpointManager(tmp_path, mesh, resume=str(manager.resume_from))
    assert folder.resume_from == manager.resume_from
    untouched = _model()
    no_resume = CheckpointManager(tmp_path, mesh, metrics=log)
    assert no_resume.restore(untouched, torch.optim.AdamW(untouched.parameters())) == 0
    assert torch.equal(untouched.class_head.bias, _model().class_head.bias)
    assert (tmp_path / "metrics.jsonl").read_text() == _metrics(lines[:3])

    empty = CheckpointManager(tmp_path / "new", mesh, resume="auto", metrics=log)
    assert "--resume auto: no checkpoint under" in capsys.readouterr().err
    assert empty.resume_from is None and empty.restore(untouched, torch.optim.AdamW(untouched.parameters())) == 0
    assert (tmp_path / "metrics.jsonl").read_text() == ""
