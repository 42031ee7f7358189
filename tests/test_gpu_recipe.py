"""The GPU recipe across short leases (benchmarks/gpu_recipe.sh, benchmarks/gpu_state.py), on CPU with the tiny
model: the state file packs a checkpoint folder bit-exactly and a run resumed from it continues exactly; the
script's dry run writes the expected files and its next invocation resumes the state it left, across the stage
boundary; a new default is adopted only when it scores better."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch
from builders import benchmark_module
from safetensors.torch import load_file

from tabfm import checkpoint as ckpt
from tabfm.config import load_config, to_dict
from tabfm.model import build_model
from tabfm.pretrain import train

ROOT = Path(__file__).resolve().parent.parent
gpu_state = benchmark_module("gpu_state")

TINY = ["data.batch_size=2", "data.num_workers=0", "data.table.min_rows=24", "data.table.max_rows=40",
        "data.table.max_features=5", "train.eval_every=0", "train.precision=fp32", "train.progress=false",
        "train.log_every=1", "optim.warmup_steps=2"]
"""Overrides that make any recipe config a few-millisecond-per-step CPU run."""


@pytest.fixture(autouse=True)
def one_thread():
    """The shared 2-core machine: more threads only contend (a tiny step takes 0.1 s instead of 1-3 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tiny_run(out_dir: Path, steps: int, every: int):
    """The tiny recipe's config: `steps` steps, a checkpoint every `every`, all kept."""
    return load_config(ROOT / "configs/pretrain/tiny.yaml",
                       [*TINY, f"train.steps={steps}", f"train.checkpoint_every={every}", "train.keep_checkpoints=0",
                        f"train.out_dir={out_dir}"])


WHEELS_BYTES = 45_314_209
"""polars 1.36.1 and polars-runtime-32 1.36.1 (manylinux x86_64): what a GPU lease carries beside the tree."""


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the git checkout's list of tracked files")
def test_tracked_files_leave_the_gpu_lease_room_for_the_polars_wheels():
    """The device tool sends the working tree and the carried wheels, at most 64 MiB in all: a repository grown
    past 64 MiB - WHEELS_BYTES could not run benchmarks/gpu_recipe.sh on its next lease."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    tracked = sum((ROOT / name).stat().st_size for name in listed.decode().split("\0")
                  if name and (ROOT / name).is_file())
    assert tracked + WHEELS_BYTES < 64 * 2**20, f"tracked files {tracked / 1e6:.1f} MB + wheels overflow 64 MiB"


def test_stage_configs_differ_only_in_rows_and_share_one_schedule():
    one, two = (load_config(ROOT / f"configs/pretrain/{n}.yaml") for n in ("gpu", "gpu_stage2"))
    a, b = to_dict(one), to_dict(two)
    assert a["data"]["table"].pop("max_rows") == 1024 and b["data"]["table"].pop("max_rows") == 2048
    assert a == b
    assert one.model == load_config(ROOT / "configs/pretrain/small.yaml").model  # continues the shipped model
    t = one.data.table
    assert (t.max_features, 0 < t.regression_prob < 1, one.data.batch_size, one.train.precision) == (100, True, 16,
                                                                                                      "bf16")
    stages = gpu_state.parse_stages(["configs/pretrain/gpu.yaml:0", "configs/pretrain/gpu_stage2.yaml:1500"])
    cfgs = gpu_state.stage_configs(stages, [], ROOT)  # each stage's own config, in order
    assert [c.data.table.max_rows for c in cfgs] == [1024, 2048]
    # one schedule, and a checkpoint lands on the stage boundary
    assert cfgs[0].train.steps == cfgs[1].train.steps and 1500 % cfgs[1].train.checkpoint_every == 0
    assert gpu_state.stage_at(stages, 1499) == (stages[0], 1500) and gpu_state.stage_at(stages, 1500) == (stages[1],
                                                                                                           None)
    with pytest.raises(ValueError, match="multiple of train.checkpoint_every"):
        gpu_state.stage_configs([stages[0], gpu_state.Stage(stages[1].config, 1510)], [], ROOT)
    with pytest.raises(ValueError, match="share one schedule"):
        gpu_state.stage_configs([stages[0], gpu_state.Stage("configs/pretrain/small.yaml", 1500)], [], ROOT)
    for key in gpu_state.LEG_SETS:  # a leg sets these on each process's command line, where a repeat is refused
        with pytest.raises(ValueError, match=f"--set {key}: a leg sets it itself"):
            gpu_state.stage_configs(stages, ["train.steps=4000", f" {key} =x"], ROOT)


def test_pack_unpack_is_bit_exact_and_resumes_like_an_uninterrupted_run(tmp_path):
    full = train(_tiny_run(tmp_path / "full", 6, 3))
    step3 = tmp_path / "full/checkpoints/step_0000003"
    state = tmp_path / "state.safetensors"
    info = gpu_state.pack(step3, state)
    assert info["step"] == 3 and info["data_position"]["next_step"] == 3

    folder = gpu_state.unpack(state, tmp_path / "resumed")
    assert folder.name == "step_0000003" and ckpt.latest_checkpoint(tmp_path / "resumed") == folder
    for f in step3.iterdir():
        assert (folder / f.name).read_bytes() == f.read_bytes()  # bit-exact: the manifest's checksums hold

    resumed = train(_tiny_run(tmp_path / "resumed", 6, 3), resume="auto")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[3:]]
    a = load_file(tmp_path / "full/checkpoints/step_0000006/rank000.safetensors")
    b = load_file(tmp_path / "resumed/checkpoints/step_0000006/rank000.safetensors")
    assert a.keys() == b.keys() and any(k.startswith("optim/") for k in a)
    # Weights and AdamW state alike. Not rng/torch_cpu: a resumed run makes its DataLoader after restoring the
    # RNG and the DataLoader draws a base seed from it (nothing in a step draws from it: the losses agree).
    assert all(torch.equal(a[k], b[k]) for k in a if not k.startswith("rng/"))


def test_damaged_state_and_occupied_run_folder_are_refused(tmp_path):
    train(_tiny_run(tmp_path / "run", 2, 2))
    state = tmp_path / "state.safetensors"
    gpu_state.pack(tmp_path / "run/checkpoints/step_0000002", state)
    with pytest.raises(ValueError, match="already holds a run"):
        gpu_state.unpack(state, tmp_path / "run")
    data = bytearray(state.read_bytes())
    data[-100] ^= 0xFF  # a bit of the rank file's bytes, near the end
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        gpu_state.unpack(bad, tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists()  # nothing written
    assert gpu_state.main(["unpack", str(bad), str(tmp_path / "fresh")]) == 2


def _accuracy_csv(path: Path, roc: float, logloss: float, r2: float) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["dataset", "task", "model", "n_folds", "roc_auc_mean", "log_loss_mean", "r2_mean", "failed_folds",
                    "error"])
        w.writerow(["a", "binary", "tabfm", 1, roc, logloss, "", 0, ""])
        w.writerow(["a", "binary", "logreg", 1, 0.99, 0.1, "", 0, ""])  # baselines do not count
        w.writerow(["b", "regression", "tabfm", 1, "", "", r2, 0, ""])
    return path


def test_decide_needs_no_metric_worse_and_one_better(tmp_path):
    base = _accuracy_csv(tmp_path / "base.csv", 0.90, 0.30, 0.50)
    assert gpu_state.decide(_accuracy_csv(tmp_path / "c1.csv", 0.91, 0.30, 0.50), base)[0]
    assert not gpu_state.decide(_accuracy_csv(tmp_path / "c2.csv", 0.91, 0.31, 0.50), base)[0]  # log-loss worse
    assert not gpu_state.decide(_accuracy_csv(tmp_path / "c3.csv", 0.90, 0.30, 0.50), base)[0]  # nothing better
    assert not gpu_state.decide(_accuracy_csv(tmp_path / "c4.csv", 0.95, 0.20, 0.49), base)[0]  # R^2 worse
    other = tmp_path / "other.csv"
    other.write_text(base.read_text().replace("b,regression", "c,regression"))
    with pytest.raises(ValueError, match="different tables"):
        gpu_state.decide(other, base)


STAGES = "configs/pretrain/gpu.yaml:0 configs/pretrain/gpu_stage2.yaml:4"
DRY_SET = ["model=tiny", *(s for s in TINY if not s.startswith("train.progress=")), "train.steps=20",
           "train.checkpoint_every=2"]  # a leg turns progress off itself (gpu_leg.LEG_SETS)
"""The dry run: the tiny model, a schedule of 20 steps, stage 2 from step 4, 4 steps per leg."""


def _expect_out(out: Path) -> dict:
    assert {"state.safetensors", "state.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    return json.loads((out / "state.json").read_text())


def _run_script(tmp_path: Path, out: Path, init: Path) -> dict:
    """benchmarks/gpu_recipe.sh in its CPU dry mode: no throughput table, no accuracy check."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OUT": str(out), "WORK": str(tmp_path / "work"),
           "STATE_DIR": str(tmp_path / "state"), "DEVICE": "cpu", "BUDGET_S": "300", "THROUGHPUT_S": "0",
           "EVAL_S": "0", "FINISH_S": "0", "MIN_SEGMENT_S": "0", "SAVE_EVERY_S": "60", "LEG_STEPS": "4",
           "INIT_FROM": str(init), "STAGES": STAGES, "SET": " ".join(DRY_SET)}
    proc = subprocess.run(["bash", "benchmarks/gpu_recipe.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == {"state.safetensors", "state.json", "model.safetensors",
                                               "logs.tar.gz"}
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert {"./session.log", "./train.log", "./metrics.jsonl"} <= set(tar.getnames())
    return _expect_out(out)


def _run_leg(tmp_path: Path, out: Path, init: Path, monkeypatch) -> dict:
    """The script's leg step with the same settings, in this process (one torch import fewer: the test's time)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    shutil.rmtree(tmp_path / "work/run")
    args = ["leg", "--state-dir", str(tmp_path / "state"), "--run", str(tmp_path / "work/run"), "--out", str(out),
            "--deadline", str(time.time() + 240), "--device", "cpu", "--init-from", str(init), "--leg-steps", "4",
            "--min-segment-s", "0", "--save-every-s", "60", *(a for st in STAGES.split() for a in ("--stage", st)),
            "--set", *DRY_SET]
    assert gpu_state.main(args) == 0
    return _expect_out(out)


@pytest.mark.slow
def test_recipe_script_dry_run_leaves_a_state_that_the_next_lease_resumes(tmp_path, monkeypatch):
    init = tmp_path / "init.safetensors"  # stands in for the shipped weights: the recipe's step 0
    model = build_model(load_config(ROOT / "configs/pretrain/tiny.yaml").model, seed=7)
    ckpt.merge(ckpt.save_checkpoint(tmp_path / "init_ckpt", model), init)
    weights = tmp_path / "default.safetensors"
    shutil.copy(init, weights)

    first = _run_script(tmp_path, tmp_path / "out1", init)
    assert first["step"] == 4 and first["data_position"]["next_step"] == 4 and first["tables_seen"] == 8
    (leg,) = first["legs"]
    assert (leg["from_step"], leg["to_step"], leg["stopped"]) == (0, 4, "leg_steps")
    assert [(s["config"], s["from"], s["to"]) for s in leg["segments"]] == [("configs/pretrain/gpu.yaml", 0, 4)]
    assert ckpt.load_merged(tmp_path / "out1/model.safetensors")[1].keys() == load_file(init).keys()
    timing = leg["step_timing"]  # from the logged steps 1-4: the step time and the loader's share of it
    assert timing["logged_steps"] == 4 and timing["median_step_s"] > 0 and 0 <= timing["loader_wait_share"] <= 1

    better = _accuracy_csv(tmp_path / "better.csv", 0.95, 0.2, 0.6)
    worse = _accuracy_csv(tmp_path / "worse.csv", 0.90, 0.3, 0.5)
    adopt = ["adopt", str(tmp_path / "out1"), "--state-dir", str(tmp_path / "state"), "--weights", str(weights)]
    assert gpu_state.main([*adopt, "--candidate-csv", str(worse), "--default-csv", str(better), "--apply"]) == 0
    assert weights.read_bytes() == init.read_bytes()  # not better: the default stays
    kept = json.loads((tmp_path / "state/state.json").read_text())
    assert kept["legs"][0]["default_replaced"] is False and kept["legs"][0]["accuracy"]["candidate"]["tables"] == 2
    assert gpu_state.main([*adopt, "--candidate-csv", str(better), "--default-csv", str(worse), "--apply"]) == 2
    # ^ the same lease again is refused: it does not continue the state now committed

    second = _run_leg(tmp_path, tmp_path / "out2", init, monkeypatch)
    assert second["legs"][0] == kept["legs"][0]  # the committed history, carried on
    leg2 = second["legs"][1]
    assert (second["step"], second["tables_seen"], leg2["from_step"], leg2["to_step"]) == (8, 16, 4, 8)
    assert leg2["step_timing"]["logged_steps"] == 4  # its own steps 5-8, not the first leg's
    assert [(s["config"], s["from"], s["to"]) for s in leg2["segments"]] == [("configs/pretrain/gpu_stage2.yaml", 4,
                                                                              8)]
    adopt[1] = str(tmp_path / "out2")
    assert gpu_state.main([*adopt, "--candidate-csv", str(better), "--default-csv", str(worse), "--apply"]) == 0
    assert weights.read_bytes() == (tmp_path / "out2/model.safetensors").read_bytes()  # better: replaced
    assert gpu_state.committed(tmp_path / "state")[0]["step"] == 8

    # Two calls in one lease (README): the first call's files copied over the state, unadopted, a second call
    # resumes them, and adopting the second call's files keeps both legs.
    third = _run_leg(tmp_path, tmp_path / "out3", init, monkeypatch)
    for name in ("state.safetensors", "state.json"):
        shutil.copy(tmp_path / "out3" / name, tmp_path / "state" / name)
    fourth = _run_leg(tmp_path, tmp_path / "out4", init, monkeypatch)
    assert fourth["legs"][:3] == third["legs"] and (fourth["step"], len(fourth["legs"])) == (16, 4)
    adopt[1] = str(tmp_path / "out4")
    assert gpu_state.main([*adopt, "--candidate-csv", str(worse), "--default-csv", str(better), "--apply"]) == 0
    assert gpu_state.committed(tmp_path / "state")[0]["step"] == 16


def _alive(pid: int) -> bool:
    """Whether a process runs (a zombie nobody reaped counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _ends_within(pid: int, seconds: float) -> bool:
    """Whether the process has ended or ends within `seconds`: SIGKILL is delivered asynchronously, so a
    process killed a moment ago may still be exiting (seen on a loaded 2-core machine)."""
    deadline = time.time() + seconds
    while _alive(pid):
        if time.time() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_leg_stops_its_trainer_and_workers_at_the_deadline(tmp_path, monkeypatch):
    # A stand-in trainer that ignores SIGINT and starts a "loader worker": both must end by the deadline + grace.
    fake = ("import signal, subprocess, sys, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
            "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(tmp_path / 'pids')!r}, 'w').write(f'{{w.pid}}'); time.sleep(60)")
    leg_driver = sys.modules["gpu_leg"]  # benchmarks/gpu_leg.py, imported by gpu_state: its names are replaced
    monkeypatch.setattr(leg_driver, "segment_command", lambda leg, stage, step: [sys.executable, "-c", fake])
    stop = leg_driver.stop_process
    monkeypatch.setattr(leg_driver, "stop_process", lambda proc: stop(proc, grace_s=0.5))
    stage = gpu_state.Stage("configs/pretrain/gpu.yaml", 0)
    leg = gpu_state.Leg(repo=ROOT, run_dir=tmp_path / "run", out=tmp_path, deadline=time.time() + 3.0, stages=[stage],
                        overrides=[], device="cpu", init_from="", leg_steps=0, min_segment_s=0, save_every_s=60,
                        started=time.time(), history=gpu_state.new_history(""))
    tic = time.time()
    assert gpu_state.run_segment(leg, stage, 100, tmp_path / "train.log") == "deadline"
    assert time.time() - tic < 15
    assert leg.segments == [{"config": stage.config, "from": 0, "to": 0, "seconds": leg.segments[0]["seconds"],
                             "stopped": "deadline"}]
    assert _ends_within(int((tmp_path / "pids").read_text()), 2.0)
    assert "stopped by the leg driver" in (tmp_path / "train.log").read_text()

