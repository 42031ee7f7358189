"""Sharded checkpoints: a 2x2 run saved by 4 gloo ranks merges, reshards and loads back bit-exactly on any
layout (model and optimizer state); corrupt, truncated and mismatched checkpoints get a clear ValueError; a crash
mid-write leaves the last good checkpoint as it was."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from dist_harness import get_mesh
from safetensors.torch import load_file
from test_model import make_batch

from tabfm import checkpoint as ckpt
from tabfm.model import ModelConfig, build_model, parallelize_model
from tabfm.parallel.sharding import ShardSpec, gather_state_dict, shard_tensor

STEPS = 2


def _model():
    return build_model("tiny", seed=3).double()


def _train(model, steps: int = STEPS):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        loss = model.loss(make_batch(seed=step))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return opt


def _optim_by_name(model, opt) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {f"{names[id(p)]}/{k}": v.clone() for p, st in opt.state.items() for k, v in st.items()}


def _train_and_save(path: str, d0: int, d1: int) -> dict:
    mesh = get_mesh(d0, d1)
    model = parallelize_model(_model(), mesh)
    opt = _train(model)
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
    assert model.region.mesh is None and next(model.parameters()).dtype == torch.float64
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


# ---------------------------------------------------------------------------------------------------------
# Bad checkpoints
# ---------------------------------------------------------------------------------------------------------

@pytest.fixture
def plain(tmp_path):
    model = _model()
    opt = _train(model, 1)
    path = ckpt.save_checkpoint(tmp_path / "plain", model, opt, step=1)
    return path, model


def test_plain_save_load_restores_rng(plain):
    path, model = plain
    expected = torch.rand(3)  # drawn right after the save
    torch.rand(5)
    fresh = _model()
    ckpt.load_checkpoint(path, fresh)
    assert torch.equal(torch.rand(3), expected)
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v)


def test_corrupt_file_is_refused(plain):
    path, _ = plain
    f = path / "rank000.safetensors"
    data = bytearray(f.read_bytes())
    data[-10] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="rank000.safetensors is corrupt: its sha256"):
        ckpt.load_checkpoint(path, _model())
    with pytest.raises(ValueError, match="corrupt"):
        ckpt.merge(path, path.parent / "m.safetensors")


def test_truncated_file_is_refused(plain):
    path, _ = plain
    f = path / "rank000.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"rank000.safetensors is truncated or altered: 1000 bytes"):
        ckpt.load_checkpoint(path, _model())


def test_missing_or_broken_manifest_is_refused(plain, tmp_path):
    path, _ = plain
    with pytest.raises(ValueError, match="no manifest.json"):
        ckpt.load_checkpoint(tmp_path, _model())
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ckpt.load_checkpoint(path, _model())


def test_mismatched_model_is_refused(plain):
    path, _ = plain
    other = build_model(ModelConfig(**{**ModelConfig.load("tiny").to_dict(), "embed_dim": 32})).double()
    with pytest.raises(ValueError, match="different model config.*embed_dim: saved 16 vs model 32"):
        ckpt.load_checkpoint(path, other)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["tensors"]["model/class_head.weight"]["shape"] = [11, 32]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="shape mismatch.*class_head.weight"):
        ckpt.load_checkpoint(path, _model())


def test_file_shape_disagreeing_with_manifest_is_refused(plain):
    path, _ = plain
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["layout"] = {"d0": 1, "d1": 1, "dp": 1}
    manifest["tensors"]["model/bin_head.bias"]["shape"] = [17]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"bin_head.bias has shape \(16,\), expected \(17,\)"):
        ckpt.verify_checkpoint(path)


def test_reshard_to_a_layout_the_model_does_not_fit(plain, tmp_path):
    path, _ = plain
    with pytest.raises(ValueError, match="cannot reshard .* to 3x1: .*not divisible"):
        ckpt.reshard(path, 3, 1, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_optimizer_missing_from_checkpoint(tmp_path):
    model = _model()
    path = ckpt.save_checkpoint(tmp_path / "noopt", model)
    with pytest.raises(ValueError, match="holds no optimizer state"):
        ckpt.load_checkpoint(path, _model(), torch.optim.AdamW(model.parameters()))


def test_crash_mid_write_keeps_the_last_good_checkpoint(plain, monkeypatch):
    path, model = plain
    before = {f.name: f.read_bytes() for f in path.iterdir()}

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(ckpt, "_finish", crash)
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.class_head.bias.add_(1)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(path, changed, step=99)
    assert {f.name: f.read_bytes() for f in path.iterdir()} == before
    assert ckpt.load_checkpoint(path, _model()).step == 1
