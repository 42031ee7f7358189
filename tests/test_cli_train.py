"""`tabfm pretrain`, `tabfm ckpt merge | reshard | verify` and `tabfm plot-run` from the command line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tabfm import cli, launch, pretrain
from tabfm._cli_train import read_metrics
from tabfm.checkpoint import load_merged

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "pretrain" / "tiny.yaml"


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

    for inside in (run / "checkpoints" / "step_0000009", run / "checkpoints" / "mine"):  # found by a hunt
        for flags in ([], ["--overwrite"]):  # a resume would take step_0000009 for the run's own step 9
            assert cli.main(["ckpt", "reshard", str(ckpt), "--layout", "2x1", "-o", str(inside), *flags]) == 2
            err = capsys.readouterr().err
            assert "inside a run's checkpoints folder" in err and f"{run / 'resharded_2x1'}" in err, err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", ckpt.name]

    for bad in (tmp_path, tmp_path / "curves.txt"):  # found by a hunt: a folder wrote folder.png, reported folder
        assert cli.main(["plot-run", str(run), "-o", str(bad)]) == 2
        assert "give a file name ending in .png" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("keep")
    assert cli.main(["plot-run", str(run), "-o", str(tmp_path / "a_file" / "curves.png")]) == 2
    assert f"{tmp_path / 'a_file'} is a file, not a folder" in capsys.readouterr().err
    assert cli.main(["plot-run", str(run)]) == 0
    png = run / "curves.png"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_pretrain_quiet_hides_the_progress_bar_and_reaches_the_ranks(tmp_path, capsys):
    steps = ["train.steps=2", "data.batch_size=2", "data.table.max_rows=40"]
    assert cli.main(["pretrain", "--config", str(TINY), "--set", f"train.out_dir={tmp_path / 'a'}", *steps]) == 0
    assert "pretrain: 100%" in capsys.readouterr().err  # tqdm's bar, on stderr
    assert cli.main(["pretrain", "--config", str(TINY), "--quiet", "--set", f"train.out_dir={tmp_path / 'b'}",
                     *steps, "train.progress=true"]) == 2
    assert capsys.readouterr().err == ("config error: --quiet and --set train.progress=true both set the progress "
                                       "bar; give one of them\n")
    assert not (tmp_path / "b").exists()
    assert cli.main(["pretrain", "--config", str(TINY), "--quiet", "--set", f"train.out_dir={tmp_path / 'b'}",
                     *steps]) == 0
    assert "pretrain:" not in capsys.readouterr().err
    assert [r["step"] for r in read_metrics(tmp_path / "b")[0]] == [1, 2]  # the metrics log still comes
    args = pretrain.build_parser().parse_args(["--config", str(TINY), "--quiet"])
    assert "--quiet" in launch.worker_argv(pretrain.build_parser(), args)  # what torchrun's ranks are given
    assert pretrain.main(["--config", str(TINY), "--quiet", "--print-config"]) == 0
    assert "progress: false" in capsys.readouterr().out


def test_checkpoint_tools_never_write_into_or_read_through_links_out_of_the_checkpoint(tmp_path, capsys):
    """merge --overwrite wrote over the checkpoint's own rank file; verify and merge read a rank file, a manifest and
    a run's checkpoints/ that were links to elsewhere."""
    run = tmp_path / "run"
    assert cli.main(["pretrain", "--config", str(TINY), "--set", f"train.out_dir={run}", "train.steps=2",
                     "train.checkpoint_every=2", "train.progress=false"]) == 0
    (ckpt,) = sorted((run / "checkpoints").glob("step_*"))
    shard = next(ckpt.glob("rank*.safetensors"))
    before = shard.read_bytes()
    capsys.readouterr()
    assert cli.main(["ckpt", "merge", str(run), "-o", str(shard), "--overwrite"]) == 2
    assert "is the checkpoint being read, or a file in its folder" in capsys.readouterr().err
    assert shard.read_bytes() == before

    copy = tmp_path / "copy"
    copy.mkdir()
    for f in ckpt.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    (copy / shard.name).unlink()
    (copy / shard.name).symlink_to(shard)
    assert cli.main(["ckpt", "verify", str(copy)]) == 2
    assert f"{copy / shard.name} is a link" in capsys.readouterr().err
    linked_run = tmp_path / "linked_run"
    linked_run.mkdir()
    (linked_run / "checkpoints").symlink_to(run / "checkpoints")
    assert cli.main(["ckpt", "verify", str(linked_run)]) == 2
    assert "checkpoints is a link" in capsys.readouterr().err


def test_plot_run_that_cannot_write_its_png_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    """An -o it may not write (as root here, faked) had escaped as a PermissionError traceback."""
    import matplotlib.figure

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "task": "classification", "loss": 1.0, "lr": 1e-3})
                                       + "\n")

    def refuse(self, path, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", refuse)
    assert cli.main(["plot-run", str(run), "-o", str(tmp_path / "c.png")]) == 2
    assert capsys.readouterr().err == f"error: [Errno 13] Permission denied: '{tmp_path / 'c.png'}'\n"


def test_bad_checkpoint_and_run_paths_say_what_is_wrong(tmp_path, capsys):
    assert cli.main(["ckpt", "merge", str(tmp_path / "nope"), "-o", str(tmp_path / "m.safetensors")]) == 2
    assert "error:" in capsys.readouterr().err
    # README's merge before its run exists had been told that its output lay in the checkpoint being read
    run = tmp_path / "runs" / "tiny"
    for command in (["merge", str(run), "-o", str(run / "model.safetensors")],
                    ["reshard", str(run), "--layout", "2x1", "-o", str(run / "resharded")]):
        assert cli.main(["ckpt", *command]) == 2
        assert capsys.readouterr().err == f"error: {run} is not a checkpoint folder (no such directory)\n"
    assert not (tmp_path / "runs").exists()
    assert cli.main(["plot-run", str(tmp_path)]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err


def test_plot_run_names_a_file_given_for_the_run_and_makes_the_output_folder(tmp_path, capsys):
    """Found by a hunt: `plot-run RUN/metrics.jsonl` blamed an -o never given (`-o RUN/metrics.jsonl/curves.png:
    ... is a file`), and `-o new/curves.png` failed after drawing with `[Errno 2] No such file or directory`."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1 / s, "lr": 1e-3}) + "\n"
                                               for s in (1, 2, 3)))
    assert cli.main(["plot-run", str(run / "metrics.jsonl")]) == 2
    assert capsys.readouterr().err == (f"error: {run / 'metrics.jsonl'} is a file; give the run's out_dir, the "
                                       "folder that holds metrics.jsonl\n")
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]
    assert cli.main(["plot-run", str(run), "-o", str(tmp_path / "new" / "curves.png")]) == 0
    assert (tmp_path / "new" / "curves.png").read_bytes()[:4] == b"\x89PNG"


# ---------------------------------------------------------------------------------------------------------
# `tabfm pretrain`: a run folder is resumed, overwritten or refused; mistakes fail in the launcher, in one line
# ---------------------------------------------------------------------------------------------------------

SMALL = ("train.progress=false", "data.batch_size=2", "data.table.max_rows=40", "train.checkpoint_every=2")


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _steps(run: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run)[0]]


def test_a_second_run_into_the_same_folder_is_refused_resumed_or_overwritten(tmp_path, capsys):
    run = tmp_path / "run"
    args = ["pretrain", "--config", str(TINY), "--set", f"train.out_dir={run}", *SMALL]
    assert cli.main([*args, "train.steps=2"]) == 0
    before = _snapshot(run)
    capsys.readouterr()

    assert cli.main([*args, "train.steps=2"]) == 2  # README's main job run twice
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds a run" in err[0]
    assert "--resume auto" in err[0] and "train.out_dir=NEW_DIR" in err[0] and "--overwrite" in err[0]
    assert _snapshot(run) == before  # nothing written, nothing lost
    for bad in (["--resume", "--overwrite"], ["--resume", str(tmp_path / "nope")]):
        assert cli.main([*args, "train.steps=2", *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("config error: --resume")
        assert _snapshot(run) == before

    assert cli.main([*args, "train.steps=3", "--resume"]) == 0
    assert f"resuming from {run / 'checkpoints' / 'step_0000002'} (step 2)" in capsys.readouterr().err
    assert _steps(run) == [1, 2, 3]
    config = (run / "config.yaml").read_text()
    assert cli.main([*args, "train.steps=9", "model.embed_dim=32", "--resume"]) == 2  # found by a hunt: a traceback
    err = capsys.readouterr().err
    assert "was saved for another model than this run's (saved vs now: {'embed_dim': (16, 32)})" in err
    assert len(err.strip().splitlines()) == 1
    assert cli.main([*args, "train.steps=1", "--resume"]) == 0  # found by a hunt: silent, and config.yaml rewritten
    assert "already at step 3, train.steps=1: nothing to train" in capsys.readouterr().err
    assert (run / "config.yaml").read_text() == config and _steps(run) == [1, 2, 3]
    losses = [r["loss"] for r in read_metrics(run)[0]]

    capsys.readouterr()
    assert cli.main([*args, "train.steps=2", "--overwrite"]) == 0
    assert (f"--overwrite removed {run / 'metrics.jsonl'}, {run / 'config.yaml'}, {run / 'checkpoints'}/ "
            "(2 checkpoints)") in capsys.readouterr().err
    assert _steps(run) == [1, 2] and [r["loss"] for r in read_metrics(run)[0]] == losses[:2]
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_0000002"]


def test_overwrite_checks_everything_first_and_deletes_only_what_a_run_wrote(tmp_path, capsys):
    """--overwrite deleted the old run and then failed on weights that did not exist (both runs lost); it deleted a
    user's file kept in checkpoints/; config.yaml was written through a link out of the folder."""
    run = tmp_path / "run"
    args = ["pretrain", "--config", str(TINY), "--set", f"train.out_dir={run}", *SMALL]
    assert cli.main([*args, "train.steps=2"]) == 0
    before = _snapshot(run)
    capsys.readouterr()
    assert cli.main([*args, "train.steps=2", f"train.init_from={tmp_path / 'nope.safetensors'}", "--overwrite"]) == 2
    assert "no such merged checkpoint file" in capsys.readouterr().err and _snapshot(run) == before
    (run / "checkpoints" / "my_model.pt").write_bytes(b"mine")
    assert cli.main([*args, "train.steps=2", "--overwrite"]) == 0
    assert "(1 checkpoint; other files in it kept)" in capsys.readouterr().err
    assert (run / "checkpoints" / "my_model.pt").read_bytes() == b"mine"
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_0000002"]

    elsewhere = tmp_path / "elsewhere.yaml"
    elsewhere.write_text("mine: 1\n")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "config.yaml").symlink_to(elsewhere)
    (tmp_path / "a_file").write_text("x")
    for out_dir, message in ((linked, "config.yaml is a link"), (tmp_path / "a_file", "is a file; give a folder"),
                             (tmp_path / "a_file" / "run", "which is a file; give a folder")):
        assert cli.main(["pretrain", "--config", str(TINY), "--set", f"train.out_dir={out_dir}", *SMALL,
                         "train.steps=1"]) == 2
        assert message in capsys.readouterr().err
    assert elsewhere.read_text() == "mine: 1\n" and (tmp_path / "a_file").read_text() == "x"


def test_overwrite_never_deletes_what_the_new_run_starts_from_or_another_runs_checkpoints(tmp_path, capsys):
    """Found by an audit: --overwrite with train.init_from inside the run deleted the weights and then failed (both
    lost); a run inside another run's checkpoint was merged as that checkpoint and pruned with it; an empty
    out_dir trained into the working folder; a fresh run replaced a config.yaml of the user's."""
    run = tmp_path / "run"
    args = ["pretrain", "--config", str(TINY), "--set", *SMALL, "train.steps=2"]
    assert cli.main([*args, f"train.out_dir={run}"]) == 0
    before = _snapshot(run)
    capsys.readouterr()
    step = run / "checkpoints" / "step_0000002"
    assert cli.main([*args, f"train.out_dir={run}", f"train.init_from={step}", "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"lies in {run / 'checkpoints'}, which --overwrite deletes" in err[0]
    assert _snapshot(run) == before
    for inside in (step / "nested", run / "checkpoints" / "other"):
        assert cli.main([*args, f"train.out_dir={inside}"]) == 2
        assert "another run's checkpoints" in capsys.readouterr().err and not inside.exists()
    assert cli.main([*args, "train.out_dir="]) == 2
    assert "train.out_dir is empty" in capsys.readouterr().err
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text(f"# my notes\n{TINY.read_text()}")  # the --config kept in the out_dir
    own = ["--config", str(mine / "config.yaml"), "--set", *SMALL, "train.steps=2", f"train.out_dir={mine}"]
    for argv in (["pretrain", *own], ["pretrain", *own, "--overwrite"],
                 ["pretrain", "--nproc", "2", *own, "parallel.d0=2", "--overwrite"]):
        assert cli.main(argv) == 2
        assert "is train.out_dir's config.yaml, which a new run replaces" in capsys.readouterr().err, argv
        assert (mine / "config.yaml").read_text().startswith("# my notes\n")
    assert _snapshot(run) == before
    project = tmp_path / "project"  # a project's own manifest.json above a run is not a checkpoint
    project.mkdir()
    (project / "manifest.json").write_text('{"name": "my web app"}')
    assert cli.main([*args, f"train.out_dir={project / 'runs' / 'tiny'}"]) == 0
    capsys.readouterr()
    (project / "runs" / "tiny" / "metrics.jsonl").unlink()  # as a start-up crash leaves it: config.yaml, no run
    shutil.rmtree(project / "runs" / "tiny" / "checkpoints")
    assert cli.main([*args, f"train.out_dir={project / 'runs' / 'tiny'}"]) == 0  # the same command runs again


def test_overwrite_on_two_ranks_keeps_a_users_file_and_trains(tmp_path, capsys):
    """The launcher cleared the run, keeping a user's file in checkpoints/, and every rank then refused the folder
    as a run (a torchrun traceback, the old run deleted and nothing trained)."""
    run = tmp_path / "run"
    args = ["pretrain", "--config", str(TINY), "--set", f"train.out_dir={run}", *SMALL, "train.steps=2"]
    assert cli.main(args) == 0
    (run / "checkpoints" / "NOTES.txt").write_text("mine")
    assert cli.main(["pretrain", "--nproc", "2", "--config", str(TINY), "--set", f"train.out_dir={run}", *SMALL,
                     "train.steps=2", "parallel.d0=2", "--overwrite"]) == 0
    assert (run / "checkpoints" / "NOTES.txt").read_text() == "mine" and _steps(run) == [1, 2]
    assert len(list((run / "checkpoints" / "step_0000002").glob("rank*.safetensors"))) == 2


def test_pretrain_without_a_config_is_refused_naming_the_shipped_ones(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["pretrain"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--config is required" in err[0]
    assert all(f"configs/pretrain/{name}.yaml" in err[0] for name in ("tiny", "small", "large"))
    assert not (tmp_path / "runs").exists()


BAD_CONFIGS = {
    "a misspelled key": (["--set", "parallel.d0=2", "parallel.d1=2", "train.stepz=3"], "unknown config key"),
    "a wrong file name": (["--config", "configs/pretrain/tiniy.yaml"], "tiniy.yaml does not exist"),
    "a layout of 4 on 3 processes": (["--nproc", "3", "--set", "parallel.d0=2", "parallel.d1=2"],
                                     "needs 4 processes but 3 were started"),
    "a key set twice": (["--set", "parallel.d0=2", "parallel.d1=2", "train.steps=5", "train.steps=6"],
                        "--set train.steps is given twice ('train.steps=5', then 'train.steps=6'); give it once"),
    "a key set twice over two --set options": (["--set", "parallel.d0=2", "parallel.d1=2", "train.steps=5", "--set",
                                                 "train.steps=6"], "--set train.steps is given twice"),
    "a word for a number": (["--set", "parallel.d0=2", "parallel.d1=2", "train.steps=ten"],
                            "train.steps must be an integer"),
    "a misspelled topology preset": (["--set", "parallel.layout=auto", "parallel.topology=nvswitch9"],
                                     "unknown topology preset 'nvswitch9'"),
    "a GPU run without a GPU": (["--set", "parallel.d0=2", "parallel.d1=2", "train.device=cuda"],
                                "train.device=cuda but no GPU is visible"),
    # found by a hunt over the CLI: each of these failed in the ranks, one traceback per rank
    "a topology of another device count": (["--set", "parallel.layout=auto", "parallel.topology=nvswitch8"],
                                           "describes 8 devices"),
    "weights that do not exist": (["--set", "parallel.d0=2", "parallel.d1=2", "train.init_from=nowhere.safetensors"],
                                  "nowhere.safetensors: no such merged checkpoint file or checkpoint folder"),
    "tables wider than the model": (["--set", "parallel.d0=2", "parallel.d1=2", "data.table.max_features=100"],
                                    "data.table.max_features=100 is more than the model takes"),
    "an infinite learning rate": (["--set", "parallel.d0=2", "parallel.d1=2", "optim.lr=inf"],
                                  "optim.lr must be a finite number > 0, got inf (from --set optim.lr=inf)"),
    # found by an audit: these failed on every rank once torchrun had started
    "a seed past 64 bits": (["--set", "parallel.d0=2", "parallel.d1=2", "train.seed=99999999999999999999999"],
                            "train.seed must be within [0, 2**63)"),
    "Triton kernels on a CPU mesh": (["--set", "parallel.d0=2", "parallel.d1=2", "parallel.kernels=triton"],
                                     "parallel.kernels=triton runs on CUDA tensors, and this run's device is cpu"),
    "tables larger than memory": (["--set", "parallel.d0=2", "parallel.d1=2", "data.table.max_rows=100000000000"],
                                  "need at least 53,644 GiB for their raw cells alone"),
    "a model larger than memory": (["--set", "parallel.d0=2", "parallel.d1=2", "model.embed_dim=65536"],
                                   "the model's weights alone take 1,408 GiB"),  # an allocator's traceback
}


def _pretrain_argv(extra: list[str], run: Path) -> list[str]:
    """`tabfm pretrain --nproc 4 --config tiny ...` with `extra` taking the place of --nproc/--config/--set."""
    nproc = extra[extra.index("--nproc") + 1] if "--nproc" in extra else "4"
    config = extra[extra.index("--config") + 1] if "--config" in extra else str(TINY)
    sets = extra[extra.index("--set") + 1:] if "--set" in extra else []
    return ["pretrain", "--nproc", nproc, "--config", config, "--set", f"train.out_dir={run}", *sets]


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_config_errors_under_nproc_stop_before_torchrun(case, tmp_path, capsys, monkeypatch):
    def no_torchrun(*args, **kwargs):
        raise AssertionError(f"torchrun was started: {args}")

    if case == "a GPU run without a GPU" and torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    monkeypatch.setattr(launch, "run_command", no_torchrun)
    extra, message = BAD_CONFIGS[case]
    assert cli.main(_pretrain_argv(extra, tmp_path / "run")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: ") and message in err[0]
    assert not (tmp_path / "run").exists()


def test_a_config_error_under_nproc_is_one_line(tmp_path):
    """The real command, in a subprocess: no torchrun, no traceback per rank (it was ~55 lines after 18-38 s).
    That no worker starts is checked in-process above (test_config_errors_under_nproc_stop_before_torchrun)."""
    argv = _pretrain_argv(BAD_CONFIGS["a word for a number"][0], tmp_path / "run")
    out = subprocess.run([sys.executable, "-m", "tabfm.cli", *argv], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["config error: train.steps must be an integer, got 'ten' "
                                               "(from --set train.steps=ten)"]
    assert "Traceback" not in out.stderr and "ChildFailedError" not in out.stderr
    assert not (tmp_path / "run").exists()


def test_plot_run_drops_a_torn_last_line_and_names_a_corrupt_one(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    good = [json.dumps({"step": s, "loss": 1.0 / s, "lr": 1e-3, "task": "classification"}) for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("\n".join(good) + '\n{"step": 4, "lo')  # a write cut short
    train, _ = read_metrics(run)
    assert [r["step"] for r in train] == [1, 2, 3]
    assert "line 4 is torn" in capsys.readouterr().err
    (run / "metrics.jsonl").write_text("\n".join([good[0], "{oops", *good[1:]]) + "\n")
    assert cli.main(["plot-run", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "metrics.jsonl line 2 is not a metrics record" in err[0]
    assert not (run / "curves.png").exists()


def test_plot_run_draws_a_log_whose_lines_differ_in_their_fields(tmp_path, capsys):
    """Found by an audit: a line without a loss, or evaluations whose keys differ from the first's, were a KeyError
    traceback; such lines are left out of the curve they lack."""
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": 1, "loss": 1.0, "lr": 1e-3}, {"step": 2, "lr": 1e-3}, {"step": 3, "loss": 0.5, "lr": 1e-3},
             {"step": 2, "eval": {"mean_accuracy": 0.7}}, {"step": 3, "eval": {"mean_roc_auc": 0.8}},
             {"step": 4, "loss": 0.4, "lr": 1e-3, "task": None},  # hand-edited tasks: a TypeError, then these
             {"step": 5, "loss": 0.4, "lr": 1e-3, "task": ["a"]}, {"step": 6, "loss": 0.3, "lr": 1e-3, "task": "x"}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert cli.main(["plot-run", str(run)]) == 0
    assert (run / "curves.png").stat().st_size > 0


def test_under_nproc_the_launcher_refuses_or_clears_the_old_run_once(tmp_path, capsys, monkeypatch):
    """The README main job (--nproc 4, 2x2) rerun: refused before torchrun; with --overwrite the launcher clears the
    folder itself and the ranks (restarted ones included) are told to resume, never to clear it again."""
    started = []
    monkeypatch.setattr(launch, "run_command", lambda cmd, env: started.append(cmd) or 0)
    run = tmp_path / "run"
    (run / "checkpoints" / "step_0000010").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    argv = ["pretrain", "--nproc", "4", "--config", str(TINY), "--set", f"train.out_dir={run}", "parallel.d0=2",
            "parallel.d1=2"]
    assert cli.main(argv) == 2 and not started
    assert "already holds a run" in capsys.readouterr().err
    assert cli.main([*argv, "--overwrite", "--max-restarts", "1"]) == 0
    assert "--overwrite removed" in capsys.readouterr().err and not any(run.iterdir())
    (cmd,) = started
    ranks = pretrain.build_parser().parse_args(cmd[cmd.index("tabfm.pretrain") + 1:])
    assert cmd[cmd.index("--nproc-per-node") + 1] == "4" and cmd[cmd.index("--max-restarts") + 1] == "1"
    assert not ranks.overwrite and ranks.resume == "auto"
    assert ranks.config == str(TINY) and ranks.set == [f"train.out_dir={run}", "parallel.d0=2", "parallel.d1=2"]


def test_resume_with_a_hostile_latest_pointer_is_one_line_before_any_work(tmp_path):
    """`latest` naming a folder outside the run: refused by the launcher's checks, nothing opened or written."""
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("../../elsewhere\n")
    with pytest.raises(ValueError, match="latest"):
        pretrain.check_out_dir(out, "auto", overwrite=False)
    assert sorted(p.name for p in out.rglob("*")) == ["checkpoints", "latest"]


def test_resume_from_a_shard_with_a_flipped_byte_is_one_line_before_any_work(tmp_path, capsys):
    """A fuzzer's finding: the launcher read the resume checkpoint's headers only, and a flipped byte in a shard
    ended in a traceback from the restore once training had started; now every file's checksum is checked first."""
    run = tmp_path / "run"
    args = ["pretrain", "--config", str(TINY), "--set", f"train.out_dir={run}", *SMALL]
    assert cli.main([*args, "train.steps=2"]) == 0
    shard = run / "checkpoints" / "step_0000002" / "rank000.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) - 100] ^= 0xFF
    shard.write_bytes(bytes(data))
    before = _snapshot(run)
    capsys.readouterr()
    assert cli.main([*args, "train.steps=3", "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: ") and "rank000.safetensors is corrupt" in err[0]
    assert _snapshot(run) == before


def test_a_run_is_not_started_in_the_filesystem_root_the_home_folder_or_a_project_root(tmp_path, capsys):
    """A fuzzer's finding: train.out_dir=/ and =<the repository> wrote checkpoints/, config.yaml and metrics.jsonl
    there without a word (and --overwrite would then delete them among the project's files)."""
    for folder in (Path("/"), Path.home()):
        with pytest.raises(ValueError, match="give a folder of the run's own"):
            pretrain.check_out_dir(folder, None, overwrite=False)
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text("[project]\n")
    before = _snapshot(project)
    assert cli.main(["pretrain", "--config", str(TINY), "--set", f"train.out_dir={project}", *SMALL,
                     "train.steps=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a project's root (it holds pyproject.toml)" in err[0]
    assert _snapshot(project) == before


@pytest.mark.parametrize("make, message", [
    (lambda run: (run / "checkpoints").touch(), "checkpoints is a file, where a run writes its checkpoints folder"),
    (lambda run: (run / "metrics.jsonl").mkdir(), "metrics.jsonl is a folder, where a run writes its file"),
])
def test_a_run_file_of_the_wrong_kind_is_refused_before_training(tmp_path, capsys, monkeypatch, make, message):
    """Found by an audit: a file named checkpoints let the run train to its first save and fail there (200 steps
    lost at checkpoint_every 200); a folder named metrics.jsonl was a traceback."""
    monkeypatch.setattr(launch, "run_command", lambda *a, **k: (_ for _ in ()).throw(AssertionError("started")))
    run = tmp_path / "run"
    run.mkdir()
    make(run)
    assert cli.main(_pretrain_argv(["--nproc", "2", "--set", "parallel.d0=2"], run)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: ") and message in err[0], err


def test_resume_without_a_checkpoint_checks_init_from_before_torchrun(tmp_path, capsys, monkeypatch):
    """Found by an audit: --resume skipped the check of train.init_from, which a resume that finds no checkpoint
    starts from (README's restart idiom), and every rank failed on it."""
    monkeypatch.setattr(launch, "run_command", lambda *a, **k: (_ for _ in ()).throw(AssertionError("started")))
    argv = _pretrain_argv(["--nproc", "2", "--set", "parallel.d0=2", "train.init_from=nowhere.safetensors"],
                          tmp_path / "fresh")
    assert cli.main([*argv, "--resume", "auto"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nowhere.safetensors: no such merged checkpoint file" in err[0], err


def test_a_write_the_file_system_refuses_is_one_line(tmp_path, capsys, monkeypatch):
    """Found by an audit: a full disk or a read-only folder under `tabfm ckpt merge` was a 24-line traceback from
    safetensors (its own error type), and a read-only train.out_dir one from every rank."""
    from safetensors import SafetensorError

    from tabfm import checkpoint_format

    run = tmp_path / "run"
    assert cli.main(["pretrain", "--config", str(TINY), "--set", f"train.out_dir={run}", *SMALL,
                     "train.steps=2"]) == 0
    capsys.readouterr()

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    monkeypatch.setattr(checkpoint_format, "save_file", full)
    out = tmp_path / "m.safetensors"
    assert cli.main(["ckpt", "merge", str(run / "checkpoints" / "step_0000002"), "-o", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tabfm ckpt: error: cannot write") and "StorageFull" in err[0], err
    assert not out.exists()
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path)  # as a read-only mount says
    assert cli.main(_pretrain_argv(["--nproc", "2", "--set", "parallel.d0=2"], tmp_path / "new")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot write in {tmp_path} (read-only or not yours)" in err[0], err
