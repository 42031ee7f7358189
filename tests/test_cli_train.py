"""`tabfm pretrain`, `tabfm ckpt merge | reshard | verify` and `tabfm plot-run` from the command line."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from tabfm import cli
from tabfm.checkpoint import load_merged

TINY = Path(__file__).resolve().parent.parent / "configs" / "pretrain" / "tiny.yaml"


def test_pretrain_then_verify_merge_reshard_and_plot(tmp_path, capsys):
    run = tmp_path / "run"
    assert cli.main(["pretrain", "--config", str(TINY), "--set", f"train.out_dir={run}", "train.steps=2",
                     "train.checkpoint_every=2"]) == 0
    (ckpt,) = sorted((run / "checkpoints").glob("step_*"))
    assert cli.main(["ckpt", "verify", str(ckpt)]) == 0
    assert "ok (step 2" in capsys.readouterr().out

    merged = tmp_path / "model.safetensors"
    assert cli.main(["ckpt", "merge", str(run), "-o", str(merged)]) == 0  # a run folder: its latest checkpoint
    config, state = load_merged(merged)
    assert state.keys() == load_file(merged).keys() and config is not None

    resharded = tmp_path / "resharded"
    assert cli.main(["ckpt", "reshard", str(ckpt), "--layout", "2x1", "-o", str(resharded)]) == 0
    merged_again = tmp_path / "again.safetensors"
    assert cli.main(["ckpt", "merge", str(resharded), "-o", str(merged_again)]) == 0
    again = load_file(merged_again)
    assert all(torch.equal(again[k], v) for k, v in state.items())

    assert cli.main(["plot-run", str(run)]) == 0
    png = run / "curves.png"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_bad_checkpoint_and_run_paths_say_what_is_wrong(tmp_path, capsys):
    assert cli.main(["ckpt", "merge", str(tmp_path / "nope"), "-o", str(tmp_path / "m.safetensors")]) == 2
    assert "error:" in capsys.readouterr().err
    assert cli.main(["plot-run", str(tmp_path)]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err
