"""Checkpoints that must not load: corrupt, truncated, mismatched, hostile (non-finite weights, malformed
manifests, sizes that would allocate too much, pointers out of the run folder) each get one clear ValueError or one
CLI error line and write nothing; a save killed at any point, or crashing mid-write, leaves the last good
checkpoint loadable exactly."""

from __future__ import annotations

import copy
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from builders import adamw_steps, tiny_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tabfm import checkpoint as ckpt
from tabfm import checkpoint_convert, checkpoint_format, checkpoint_io
from tabfm import cli
from tabfm.model import ModelConfig, build_model


def _model(**overrides):
    return tiny_model(seed=3, **overrides)


# ---------------------------------------------------------------------------------------------------------
# Bad checkpoints
# ---------------------------------------------------------------------------------------------------------

@pytest.fixture
def plain(tmp_path):
    model = _model()
    opt = adamw_steps(model, 1)
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
    _rewrite_rank(path, lambda t: {**t, "model/bin_head.bias": torch.zeros(17, dtype=torch.float64)})
    with pytest.raises(ValueError, match=r"bin_head.bias has shape \(17,\), expected \(16,\)"):
        ckpt.verify_checkpoint(path)


def test_reshard_to_a_layout_the_model_does_not_fit(plain, tmp_path):
    path, _ = plain
    with pytest.raises(ValueError, match="cannot reshard .* to 3x1: .*not divisible"):
        ckpt.reshard(path, 3, 1, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_merge_and_reshard_leave_folders_and_files_of_the_users_names_alone(plain, tmp_path):
    """Found by an audit: both wrote beside the output under fixed names, OUT.tmp and OUT.old, deleting a folder
    of the user's of that name, the source checkpoint itself when it was called OUT.tmp, or overwriting a file."""
    import shutil

    path, model = plain
    source = Path(shutil.copytree(path, tmp_path / "resharded.tmp"))  # the source, named as the old temporary
    mine = tmp_path / "resharded.old"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    (tmp_path / "model.safetensors.tmp").write_text("mine")
    before = _snapshot(tmp_path)
    ckpt.reshard(source, 1, 1, tmp_path / "resharded")
    ckpt.reshard(source, 1, 1, tmp_path / "resharded", overwrite=True)
    ckpt.merge(source, tmp_path / "model.safetensors")
    after = _snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before  # the source and the user's files as they were
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["plain", "resharded.tmp", "resharded.old", "model.safetensors.tmp", "resharded", "model.safetensors"])
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError, match="lies under .*a_file, which is a file"):
        ckpt.merge(source, tmp_path / "a_file" / "m.safetensors")


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

    monkeypatch.setattr(checkpoint_io, "finish_folder", crash)
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.class_head.bias.add_(1)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(path, changed, step=99)
    assert {f.name: f.read_bytes() for f in path.iterdir()} == before
    assert ckpt.load_checkpoint(path, _model()).step == 1


# ---------------------------------------------------------------------------------------------------------
# Hostile checkpoints (issue 16): each gets one clear ValueError (or one CLI error line) and writes nothing
# ---------------------------------------------------------------------------------------------------------

def _edit_manifest(path: Path, edit) -> None:
    """Apply `edit` to the manifest in place; a non-None result replaces the whole manifest."""
    manifest = json.loads((path / "manifest.json").read_text())
    new = edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest if new is None else new))


def _rewrite_rank(path: Path, change, name: str = "rank000.safetensors") -> None:
    """Rewrite a rank file with changed tensors and record its new size and checksum in the manifest: a
    self-consistent checkpoint, as a hostile one would be."""
    f = path / name
    save_file(change(load_file(f)), f)
    _edit_manifest(path, lambda m: m["files"][name].update(bytes=f.stat().st_size, sha256=checkpoint_format.sha256(f)))


def _poison(key: str, value: float):
    def change(tensors):
        t = tensors[key].clone()
        t.view(-1)[0] = value
        return {**tensors, key: t}
    return change


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_non_finite_weights_are_refused_by_every_reader(plain, tmp_path):
    path, _ = plain
    good = ckpt.merge(path, tmp_path / "good.safetensors")
    _rewrite_rank(path, _poison("model/class_head.weight", float("nan")))
    readers = {"load": lambda: ckpt.load_checkpoint(path, _model()), "verify": lambda: ckpt.verify_checkpoint(path),
               "load_model": lambda: ckpt.load_model(path), "merge": lambda: ckpt.merge(path, tmp_path / "m"),
               "reshard": lambda: ckpt.reshard(path, 1, 1, tmp_path / "r")}
    for name, read in readers.items():
        with pytest.raises(ValueError, match=r"rank000.safetensors: model/class_head.weight holds 1 non-finite "
                                             r"value\(s\) \(NaN or inf\) of 320"):
            read()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.safetensors", "plain"]

    with safe_open(str(good), "pt") as f:
        metadata = f.metadata()
    bad = tmp_path / "bad.safetensors"
    save_file(_poison("cells.value_proj.weight", float("inf"))(load_file(good)), bad, metadata)
    with pytest.raises(ValueError, match="bad.safetensors: cells.value_proj.weight holds 1 non-finite"):
        ckpt.load_model(bad)
    # Finite in float64, infinite once cast to float32: refused in float32, fine in the saved dtype.
    save_file(_poison("cells.value_proj.weight", 1e300)(load_file(good)), bad, metadata)
    assert next(ckpt.load_model(bad).parameters()).dtype == torch.float64
    with pytest.raises(ValueError, match="cells.value_proj.weight holds 1 non-finite.*overflow torch.float32"):
        ckpt.load_model(bad, dtype=torch.float32)


def _pop(part, key: str):
    """An edit removing `key` from the part of the manifest `part` selects."""
    def edit(m):
        del part(m)[key]
    return edit


def _set(part, **values):
    """An edit setting `values` in the part of the manifest `part` selects."""
    return lambda m: part(m).update(values)


RANK0 = "rank000.safetensors"
BIAS = "model/bin_head.bias"
BAD_MANIFESTS = {
    "manifest a list": (lambda m: [m], r"the manifest must be a JSON object, got list"),
    "wrong format": (lambda m: m.update(format="tabfm-checkpoint-v0"), r"format 'tabfm-checkpoint-v0', expected"),
    "file entry without coord": (_pop(lambda m: m["files"][RANK0], "coord"),
                                 r"field files\['rank000.safetensors'\].coord is missing"),
    "layout without d1": (_pop(lambda m: m["layout"], "d1"), r"field layout.d1 is missing"),
    "coordinates as a string": (_set(lambda m: m["files"][RANK0], coord="0,0"),
                                r"coord must be a list \[i, j\] of two integers, got '0,0'"),
    "coordinate out of range": (_set(lambda m: m["files"][RANK0], coord=[1, 0]),
                                r"coord \[1, 0\] is outside the 1x1 layout"),
    "files as a list": (lambda m: m.update(files=[{"name": RANK0, **m["files"][RANK0]}]),
                        r"field files must be a JSON object of rank files, got \["),
    "model config a list": (lambda m: m.update(model_config=[16]), r"field model_config must be a JSON object"),
    "model config of the wrong type": (_set(lambda m: m["model_config"], embed_dim="16"),
                                       r"model_config: embed_dim must be an integer, got '16'"),
    "model config with an unknown key": (_set(lambda m: m["model_config"], depth=3),
                                         r"model_config: unknown config key depth; valid keys: embed_dim"),
    "NaN in the JSON": (_set(lambda m: m["model_config"], bin_range=float("nan")), r"holds the non-number NaN"),
    "model config naming a preset file": (_set(lambda m: m["model_config"], preset="/etc/passwd"),
                                          r"model_config names a preset \('/etc/passwd'\)"),  # a fuzzer's: it was read
    "step a string": (lambda m: m.update(step="1"), r"field step must be a non-negative integer, got '1'"),
    "next step negative": (lambda m: m.update(data_position={"next_step": -1}),
                           r"field data_position.next_step must be a non-negative integer, got -1"),
    "layout of floats": (_set(lambda m: m["layout"], d0=1.0), r"field layout.d0 must be a positive integer, got 1.0"),
    "shape a string": (_set(lambda m: m["tensors"][BIAS], shape="16"),
                       r"field tensors\['model/bin_head.bias'\].shape must be a list of non-negative integers"),
    "dtype not whitelisted": (_set(lambda m: m["tensors"][BIAS], dtype="torch.complex128"),
                              r"tensors\['model/bin_head.bias'\].dtype must be one of torch.float32, "),
    "dtype an attribute of torch": (_set(lambda m: m["tensors"][BIAS], dtype="torch.load"), r"dtype must be one of"),
    "spec dims of the wrong length": (_set(lambda m: m["tensors"][BIAS]["spec"], dims=[None, None]),
                                      r"spec.dims must be a list of 1 placements"),
    "unknown placement": (_set(lambda m: m["tensors"][BIAS]["spec"], dims=["tp9"]), r"spec.dims must be a list"),
    "tensor outside model/ and optim/": (lambda m: m["tensors"].update({"rng/x": m["tensors"][BIAS]}),
                                         r"tensor 'rng/x' is neither model/... nor optim/..."),
    "optimizer naming no parameter": (lambda m: m["optimizer"]["param_groups"][0]["params"].append("nope"),
                                      r"optimizer.param_groups\[0\].params must be a list of the model's parameter"),
    "optimizer setting a dict": (lambda m: m["optimizer"]["param_groups"][0].update(lr={"a": 1}),
                                 r"optimizer.param_groups\[0\].lr must be a number"),
}


@pytest.mark.parametrize("edit,message", BAD_MANIFESTS.values(), ids=BAD_MANIFESTS.keys())
def test_malformed_manifest_is_one_clear_error(plain, edit, message):
    path, _ = plain
    _edit_manifest(path, edit)
    for read in (ckpt.verify_checkpoint, lambda p: ckpt.load_checkpoint(p, _model(), torch.optim.AdamW(
            _model().parameters())), ckpt.load_model):
        with pytest.raises(ValueError, match=message) as e:
            read(path)
        assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_declared_sizes_are_checked_before_anything_is_allocated(plain, tmp_path, monkeypatch):
    path, _ = plain
    merged = ckpt.merge(path, tmp_path / "m.safetensors")
    original = (path / "manifest.json").read_text()
    _edit_manifest(path, _set(lambda m: m["layout"], d0=100_000, d1=100_000))
    tic = time.perf_counter()
    with pytest.raises(ValueError, match="layout 100000x100000 needs 10000000000 rank files, the manifest lists 1"):
        ckpt.verify_checkpoint(path)
    assert time.perf_counter() - tic < 1

    def no_real_model(*args, **kwargs):
        raise AssertionError("a real model was built before the checkpoint's sizes were checked")

    monkeypatch.setattr(checkpoint_convert, "build_model", no_real_model)
    (path / "manifest.json").write_text(original)
    _edit_manifest(path, _set(lambda m: m["model_config"], embed_dim=65536))  # 51 GB if it were built
    for read in (ckpt.verify_checkpoint, ckpt.load_model, lambda p: ckpt.merge(p, tmp_path / "m2")):
        with pytest.raises(ValueError, match=r"shape mismatch \(saved vs model\): .*\(16,\), \(65536,\)"):
            read(path)
    _edit_manifest(path, _set(lambda m: m["model_config"], embed_dim=16, icl_num_blocks=10**9))
    with pytest.raises(ValueError, match="declares 1000000001 blocks but the weights hold only 76 tensors"):
        ckpt.load_model(path)
    # A merged file whose metadata declares a huge model: refused from its header.
    with safe_open(str(merged), "pt") as f:
        metadata = f.metadata()
    config = {**json.loads(metadata["model_config"]), "embed_dim": 65536}
    save_file(load_file(merged), merged, {**metadata, "model_config": json.dumps(config)})
    with pytest.raises(ValueError, match=r"m.safetensors: shape mismatch \(file vs model\)"):
        ckpt.load_model(merged)


def test_verify_runs_every_check_that_load_runs(plain):
    path, _ = plain
    original = {f.name: f.read_bytes() for f in path.iterdir()}

    def restore():
        for name, data in original.items():
            (path / name).write_bytes(data)

    cases = [
        # A file whose tensors disagree in dtype with the manifest.
        (lambda: _rewrite_rank(path, lambda t: {**t, BIAS: t[BIAS].float()}),
         r"model/bin_head.bias is torch.float32, the manifest says torch.float64"),
        # A file holding a tensor the manifest does not list.
        (lambda: _rewrite_rank(path, lambda t: {**t, "model/extra": torch.zeros(2)}),
         r"holds tensors the manifest does not list: \['model/extra'\]"),
        # A shard spec that is not the model's (it would reassemble the tensor wrongly on another layout).
        (lambda: _edit_manifest(path, _set(lambda m: m["tensors"]["model/icl.blocks.blocks.0.attn.qkv.weight"][
            "spec"], qkv_heads=2)), r"qkv.weight is cut as .* but the model cuts it as"),
        # Optimizer state shaped unlike its parameter.
        (lambda: _edit_manifest(path, _set(lambda m: m["tensors"]["optim/class_head.bias/exp_avg"], shape=[8])),
         r"optimizer state optim/class_head.bias/exp_avg has shape \(8,\), its parameter \(10,\)"),
    ]
    for corrupt, message in cases:
        corrupt()
        for read in (ckpt.verify_checkpoint, lambda p: ckpt.load_checkpoint(p, _model())):
            with pytest.raises(ValueError, match=message):
                read(path)
        restore()
    assert ckpt.verify_checkpoint(path)["step"] == 1


def test_latest_pointer_must_name_a_step_folder_beside_it(plain, tmp_path, capsys):
    path, _ = plain
    run = tmp_path / "run"
    root = run / "checkpoints"
    shutil.copytree(path, root / "step_0000001")
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(path, elsewhere)  # a valid checkpoint outside the run
    for hostile in ("../../elsewhere", str(elsewhere), "step_0000001/../../../elsewhere", ".."):
        (root / "latest").write_text(hostile + "\n")
        with pytest.raises(ValueError, match=r"latest names .*, not a step_<digits> folder beside it"):
            ckpt.latest_checkpoint(run)
        for target in (run, root / "latest"):
            assert cli.main(["ckpt", "verify", str(target)]) == 2
            err = capsys.readouterr().err
            assert err.startswith("error:") and err.count("\n") == 1 and "step_<digits>" in err
    # A step folder that is a link to elsewhere is no checkpoint of the run.
    (root / "step_0000002").symlink_to(elsewhere, target_is_directory=True)
    (root / "latest").write_text("step_0000002\n")
    assert ckpt.latest_checkpoint(run) == root / "step_0000001"
    with pytest.raises(ValueError, match="names step_0000002, which is not a folder beside it"):
        ckpt.read_latest(root / "latest")
    (root / "latest").write_text("step_0000001\n")
    assert cli.main(["ckpt", "verify", str(root / "latest")]) == 0


def test_interrupted_saves_never_count_and_are_pruned(plain, tmp_path):
    path, _ = plain
    root = tmp_path / "run" / "checkpoints"
    for step in (9, 10):
        shutil.copytree(path, root / f"step_{step}")  # unpadded: the newest is found by number, not by name
    shutil.copytree(path, root / "step_11.tmp")  # an interrupted save, even one whose manifest was written
    shutil.copytree(path, root / "step_8.old")
    (root / "step_12").mkdir()  # an interrupted prune: no manifest
    assert ckpt.step_checkpoints(root) == [root / "step_9", root / "step_10"]
    assert ckpt.latest_checkpoint(tmp_path / "run") == root / "step_10"
    removed = ckpt.mark_latest(root, "step_10", keep=1)
    assert sorted(p.name for p in removed) == ["step_11.tmp", "step_12", "step_8.old", "step_9"]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_10"]
    assert ckpt.latest_checkpoint(tmp_path / "run") == root / "step_10"
    # keep=0 keeps every checkpoint but still clears leftovers; the folder just saved is never pruned.
    shutil.copytree(path, root / "step_13.tmp")
    shutil.copytree(path, root / "step_20")
    assert [p.name for p in ckpt.mark_latest(root, "step_10", keep=0)] == ["step_13.tmp"]
    assert ckpt.mark_latest(root, "step_10", keep=1) == []  # step_20 is newer, step_10 is `latest`


def test_cli_writes_over_existing_output_only_with_overwrite(plain, tmp_path, capsys):
    path, _ = plain
    out = tmp_path / "m.safetensors"
    out.write_bytes(b"precious")
    assert cli.main(["ckpt", "merge", str(path), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "m.safetensors already exists" in err and "--overwrite" in err and err.count("\n") == 1
    assert out.read_bytes() == b"precious"
    assert cli.main(["ckpt", "merge", str(path), "-o", str(out), "--overwrite"]) == 2  # replaces only a merged file
    assert "is not a merged checkpoint" in capsys.readouterr().err and out.read_bytes() == b"precious"
    out.unlink()
    assert cli.main(["ckpt", "merge", str(path), "-o", str(out)]) == 0
    assert cli.main(["ckpt", "merge", str(path), "-o", str(out), "--overwrite"]) == 0
    assert ckpt.load_merged(out)[1].keys() == _model().state_dict().keys()

    folder = tmp_path / "r"
    assert cli.main(["ckpt", "reshard", str(path), "--layout", "2x1", "-o", str(folder)]) == 0
    before = _snapshot(folder)
    assert cli.main(["ckpt", "reshard", str(path), "--layout", "1x2", "-o", str(folder)]) == 2
    assert "r already exists" in capsys.readouterr().err and _snapshot(folder) == before
    assert cli.main(["ckpt", "reshard", str(path), "--layout", "1x2", "-o", str(folder), "--overwrite"]) == 0
    assert ckpt.verify_checkpoint(folder)["layout"] == {"d0": 1, "d1": 2, "dp": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors", "plain", "r"]

    docs = tmp_path / "docs"  # not a checkpoint: never replaced, even with --overwrite
    docs.mkdir()
    (docs / "notes.txt").write_text("keep me")
    source = _snapshot(path)
    for target in (docs, path):
        assert cli.main(["ckpt", "reshard", str(path), "--layout", "1x1", "-o", str(target), "--overwrite"]) == 2
        assert capsys.readouterr().err.count("\n") == 1
    assert (docs / "notes.txt").read_text() == "keep me" and _snapshot(path) == source


def _save_and_kill_at(run: Path, model, opt, kill_at: int) -> int:
    """In a forked child, save step 2 and mark it latest (keep 1), SIGKILLing the child at its `kill_at`-th
    filesystem operation (a safetensors write is left half-written). Returns the child's wait status."""
    import signal

    pid = os.fork()
    if pid:
        for _ in range(3000):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        pytest.fail(f"the save killed at operation {kill_at} hung")
    try:
        calls = [0]

        def counted(fn, half_written=False):
            def wrapper(*args, **kwargs):
                calls[0] += 1
                if calls[0] == kill_at and not half_written:
                    os.kill(os.getpid(), signal.SIGKILL)
                out = fn(*args, **kwargs)
                if calls[0] == kill_at:
                    path = Path(args[1])
                    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
                    os.kill(os.getpid(), signal.SIGKILL)
                return out
            return wrapper

        for owner, name in [(os, "fsync"), (Path, "rename"), (Path, "replace"), (Path, "write_text"),
                            (Path, "mkdir"), (Path, "unlink"), (shutil, "rmtree")]:
            setattr(owner, name, counted(getattr(owner, name)))
        checkpoint_format.save_file = counted(checkpoint_format.save_file, half_written=True)
        ckpt.save_checkpoint(run / "checkpoints" / "step_2", model, opt, step=2)
        ckpt.mark_latest(run / "checkpoints", "step_2", keep=1)
    finally:
        os._exit(0)


def test_a_save_killed_at_any_point_leaves_a_checkpoint_that_loads_exactly(plain, tmp_path):
    path, old_model = plain
    old = {k: v.clone() for k, v in old_model.state_dict().items()}
    new_model = copy.deepcopy(old_model)
    opt = adamw_steps(new_model, 1)
    new = new_model.state_dict()
    for kill_at in range(1, 100):
        run = tmp_path / f"run{kill_at}"
        shutil.copytree(path, run / "checkpoints" / "step_1")
        ckpt.mark_latest(run / "checkpoints", "step_1")
        status = _save_and_kill_at(run, new_model, opt, kill_at)
        latest = ckpt.latest_checkpoint(run)
        fresh = _model()
        state = ckpt.load_checkpoint(latest, fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2))
        want = {1: old, 2: new}[state.step]
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in want.items()), kill_at
        # The next completed save prunes whatever the killed one left behind.
        ckpt.save_checkpoint(run / "checkpoints" / "step_3", fresh, step=3)
        ckpt.mark_latest(run / "checkpoints", "step_3", keep=1)
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_3"], kill_at
        shutil.rmtree(run)
        if os.WIFEXITED(status):  # the save ran to its end: every operation has had its kill
            assert state.step == 2 and kill_at > 5
            break
    else:
        pytest.fail("the save never completed")


def test_an_integer_of_more_digits_than_python_converts_is_one_clear_error(plain):
    """A fuzzer's finding: json's own ValueError (an integer of 5,000 digits) named neither file nor field."""
    path, _ = plain
    text = (path / "manifest.json").read_text()
    (path / "manifest.json").write_text(text.replace('"step": 1', '"step": ' + "9" * 5000, 1))
    with pytest.raises(ValueError, match=r"manifest.json is not valid JSON \(.*digits.*\): the manifest is corrupt"):
        ckpt.verify_checkpoint(path)


def test_merge_overwrites_only_a_merged_file_and_never_writes_into_a_checkpoint(plain, tmp_path):
    """A fuzzer's finding: `merge -o <a checkpoint's shard> --overwrite` (or a run's config.yaml) replaced it,
    where reshard refuses such outputs."""
    path, _ = plain
    other = Path(shutil.copytree(path, tmp_path / "other"))  # another checkpoint, e.g. an earlier step's
    shard = other / "rank000.safetensors"
    before = shard.read_bytes()
    with pytest.raises(ValueError, match="is inside the checkpoint folder"):
        ckpt.merge(path, shard, overwrite=True)
    with pytest.raises(ValueError, match="is inside the checkpoint folder"):
        ckpt.merge(path, other / "merged.safetensors")
    assert shard.read_bytes() == before and not (other / "merged.safetensors").exists()
    config = tmp_path / "config.yaml"
    config.write_text("model: tiny\n")
    with pytest.raises(ValueError, match="exists and is not a merged checkpoint"):
        ckpt.merge(path, config, overwrite=True)
    assert config.read_text() == "model: tiny\n"
    merged = ckpt.merge(path, tmp_path / "m.safetensors")
    assert ckpt.merge(path, merged, overwrite=True) == merged  # an earlier merged file is replaced


def test_a_save_over_a_linked_step_folder_unlinks_it_and_leaves_its_target(tmp_path):
    from tabfm.checkpoint_format import MANIFEST, finish_folder

    elsewhere = tmp_path / "elsewhere" / "step_5"
    elsewhere.mkdir(parents=True)
    (elsewhere / "weights").write_text("not ours to delete")
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    (root / "step_5").symlink_to(elsewhere, target_is_directory=True)
    tmp = root / "step_5.tmp"
    tmp.mkdir()
    finish_folder(tmp, root / "step_5", {"step": 5})
    assert sorted(p.name for p in root.iterdir()) == ["step_5"]  # no step_5.old left behind
    assert not (root / "step_5").is_symlink() and (root / "step_5" / MANIFEST).is_file()
    assert (elsewhere / "weights").read_text() == "not ours to delete"
