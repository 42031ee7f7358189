"""Run configs (YAML, --set overrides, unknown keys, layouts refused before any process group) and the pretraining
loop: schedule, a resumed run equal to an uninterrupted one (evaluation on), 2x2 tensor-parallel training equal to
one process (float64), data-parallel replicas in step, the torchrun entry point, and `torchrun --max-restarts`
recovering from a killed rank with the losses of an uninterrupted run.

Every subprocess runs with a timeout and is killed on the way out with all its descendants: torchrun starts its
workers in sessions of their own, so they are found by an environment token they inherit, not by process group."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_harness import get_mesh
from safetensors.torch import load_file

from tabfm import checkpoint as ckpt
from tabfm.config import OptimConfig, RunConfig, dump_config, from_dict, load_config
from tabfm.model import ModelConfig
from tabfm.parallel.mesh import LayoutError
from tabfm import train_loop
from tabfm.pretrain import NonFiniteLossError, latest_checkpoint, lr_at, main, train

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "pretrain" / "tiny.yaml"


def tiny_cfg(out_dir: Path, *extra: str) -> RunConfig:
    return load_config(TINY, [f"train.out_dir={out_dir}", "train.progress=false", "data.batch_size=2",
                              "data.table.max_rows=40", *extra])


# ---------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------

def test_file_then_overrides_then_defaults(tmp_path):
    cfg = load_config(TINY, ["optim.lr=3e-4", "model.embed_dim=32", "data.table.max_rows=48"])
    assert cfg.optim.lr == 3e-4 and cfg.optim.warmup_steps == 5       # --set, then the file
    assert cfg.optim.beta2 == OptimConfig().beta2                       # default
    assert cfg.model.embed_dim == 32 and cfg.model.icl_num_blocks == ModelConfig.load("tiny").icl_num_blocks
    assert cfg.data.table.max_rows == 48 and cfg.data.table.min_features == 2
    assert load_config(None, ["model.preset=base"]).model == ModelConfig.load("base")
    assert load_config(None, []).model == ModelConfig.load("small")


def test_unknown_keys_and_bad_values_are_refused():
    with pytest.raises(ValueError, match="unknown config key optim.lrr; valid keys of optim: lr, min_lr_ratio"):
        load_config(TINY, ["optim.lrr=1"])
    with pytest.raises(ValueError, match="unknown config key trian; valid keys: model, data, optim, parallel, train"):
        load_config(None, ["trian.steps=3"])
    with pytest.raises(ValueError, match="unknown config key model.width; valid keys of model: embed_dim"):
        load_config(None, ["model.width=3"])
    with pytest.raises(ValueError, match="train.steps must be an integer, got 'many'"):
        load_config(None, ["train.steps=many"])
    with pytest.raises(ValueError, match="section.key=value"):
        load_config(None, ["optim.lr"])


def test_dumped_config_loads_back_equal(tmp_path):
    cfg = load_config(TINY, ["data.prior.scm.edge_prob={type: Uniform, low: 0.2, high: 0.4}"])
    path = tmp_path / "run.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg
    assert from_dict(RunConfig, json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_schedule_warms_up_then_decays_to_the_floor():
    o = OptimConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1)
    assert [lr_at(s, o, 20) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(19, o, 20) == pytest.approx(0.1)
    lrs = [lr_at(s, o, 20) for s in range(3, 20)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


# ---------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------

def read_metrics(out_dir: Path) -> tuple[list[dict], list[dict]]:
    """(training lines, evaluation lines) of <out_dir>/metrics.jsonl."""
    lines = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "loss" in r], [r for r in lines if "eval" in r]


EVAL = ("train.eval_every=2", "train.eval_tables=[skl_iris,mass_crabs_species]")


def test_resumed_run_equals_uninterrupted_run(tmp_path):
    """With evaluation on (every 2 steps): it changes neither the batches nor the RNG streams."""
    a = tiny_cfg(tmp_path / "a", "train.steps=4", "train.checkpoint_every=2", "train.keep_checkpoints=0", *EVAL)
    full = train(a)
    assert [r["step"] for r in full] == [1, 2, 3, 4]
    lines, evals = read_metrics(tmp_path / "a")
    assert [r["loss"] for r in lines] == [r["loss"] for r in full]
    assert all(0 <= r["data_seconds"] <= r["seconds"] for r in lines)  # the loader's share of each step
    assert [e["step"] for e in evals] == [2, 4]
    for e in evals:
        assert set(e["eval"]["tables"]) == {"skl_iris", "mass_crabs_species"}
        assert 0 <= e["eval"]["mean_roc_auc"] <= 1 and 0 <= e["eval"]["mean_accuracy"] <= 1
        assert 0 < e["eval"]["mean_log_loss"] < 50
    assert full[3]["eval"] == evals[1]["eval"]
    # Another run starts from a's step-2 checkpoint, as if a had crashed there.
    b_ckpts = tmp_path / "b" / "checkpoints"
    b_ckpts.mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step_0000002", b_ckpts / "step_0000002")
    resumed = train(tiny_cfg(tmp_path / "b", "train.steps=4", "train.checkpoint_every=2", *EVAL), resume="auto")
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[2:]]
    assert read_metrics(tmp_path / "b")[1] == evals[1:]  # the same weights evaluate the same
    ma = load_file(ckpt.merge(tmp_path / "a" / "checkpoints" / "step_0000004", tmp_path / "a.safetensors"))
    mb = load_file(ckpt.merge(latest_checkpoint(tmp_path / "b"), tmp_path / "b.safetensors"))
    assert all(torch.equal(ma[k], mb[k]) for k in ma)


def test_resume_before_the_first_checkpoint_starts_afresh_with_an_empty_log(tmp_path):
    """A run that crashed before its first checkpoint left metric lines: --resume auto starts at step 0 and the
    log holds each step once, with the losses of an uninterrupted run."""
    full = train(tiny_cfg(tmp_path / "a", "train.steps=3"))
    shutil.rmtree(tmp_path / "a" / "checkpoints")  # as if killed before step 3's (first) save
    assert [r["step"] for r in read_metrics(tmp_path / "a")[0]] == [1, 2, 3]
    resumed = train(tiny_cfg(tmp_path / "a", "train.steps=3"), resume="auto")
    lines, _ = read_metrics(tmp_path / "a")
    assert [r["step"] for r in lines] == [1, 2, 3] and [r["loss"] for r in lines] == [r["loss"] for r in full]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full]


def _crashed_at_step_3(tmp_path: Path, tail: str) -> tuple[Path, list[dict]]:
    """Run a (4 steps, checkpoint every 2); b holds a's step-2 checkpoint and a's log up to step 3 plus `tail`."""
    full = train(tiny_cfg(tmp_path / "a", "train.steps=4", "train.checkpoint_every=2", "train.keep_checkpoints=0"))
    b = tmp_path / "b"
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step_0000002", b / "checkpoints" / "step_0000002")
    lines = (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
    (b / "metrics.jsonl").write_text("\n".join(lines[:3]) + "\n" + tail)
    return b, full


def test_resume_drops_a_torn_last_metrics_line(tmp_path, capsys):
    """A full disk or a power cut mid-write leaves half a line (or NUL bytes): dropped with a warning."""
    b, full = _crashed_at_step_3(tmp_path, '{"step": 4, "loss": 0.6\x00\x00')
    resumed = train(tiny_cfg(b, "train.steps=4", "train.checkpoint_every=2"), resume="auto")
    assert "metrics.jsonl line 4 is torn" in capsys.readouterr().err
    lines, _ = read_metrics(b)
    assert [r["step"] for r in lines] == [1, 2, 3, 4] and [r["loss"] for r in lines] == [r["loss"] for r in full]
    assert [r["step"] for r in resumed] == [3, 4]


def test_the_log_is_on_disk_before_each_checkpoint_that_ends_it(tmp_path, monkeypatch):
    """A machine crash keeps what was fsynced: the checkpoint's files are, so the log's lines up to its step must
    be too, else a resume from it finds the step's line torn or missing and never writes it again."""
    import os

    synced = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        steps = [r["step"] for r in read_metrics(path.parent)[0]] if path.name == "metrics.jsonl" else None
        synced.append((path.name, steps))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    train(tiny_cfg(tmp_path / "a", "train.steps=4", "train.checkpoint_every=2", "train.log_every=1"))
    logs = [i for i, (name, _) in enumerate(synced) if name == "metrics.jsonl"]
    assert [synced[i][1] for i in logs] == [[1, 2], [1, 2, 3, 4]]
    assert all(synced[i + 1][0].endswith(".safetensors") for i in logs)  # each checkpoint's first file follows


def test_resume_refuses_a_log_corrupt_in_the_middle(tmp_path, capsys):
    b, _ = _crashed_at_step_3(tmp_path, "")
    lines = (b / "metrics.jsonl").read_text().splitlines()
    (b / "metrics.jsonl").write_text("\n".join([lines[0], "garbage", *lines[1:]]) + "\n")
    before = (b / "metrics.jsonl").read_bytes()
    assert main(["--config", str(TINY), "--set", f"train.out_dir={b}", "train.steps=4", "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "metrics.jsonl line 2 is not a metrics record ('garbage')" in err[0]
    assert (b / "metrics.jsonl").read_bytes() == before and not (b / "config.yaml").exists()


def test_a_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    """Step 3's loss is NaN: nothing after step 2's checkpoint is logged or saved, and main says which step."""
    real_step, calls = train_loop.train_step, []

    def nan_at_step_3(*args, **kwargs):
        loss, norm = real_step(*args, **kwargs)
        calls.append(1)
        return (loss * float("nan"), norm) if len(calls) == 3 else (loss, norm)

    monkeypatch.setattr(train_loop, "train_step", nan_at_step_3)
    out = tmp_path / "run"
    argv = ["--config", str(TINY), "--set", f"train.out_dir={out}", "train.steps=4", "train.checkpoint_every=2",
            "train.keep_checkpoints=0", "train.progress=false", "data.batch_size=2", "data.table.max_rows=40"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: step 3 (")
    assert "loss nan" in err[0] and f"the last good checkpoint is {out / 'checkpoints' / 'step_0000002'}" in err[0]
    assert latest_checkpoint(out).name == "step_0000002"
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_")) == ["step_0000002"]
    assert [r["step"] for r in read_metrics(out)[0]] == [1, 2]
    calls[:] = [1, 1]  # resumed from step 2: its next step (3) is NaN again, and stops it again
    with pytest.raises(NonFiniteLossError, match=r"step 3 \((classification|regression) batch\)"):
        train(tiny_cfg(out, "train.steps=4", "train.checkpoint_every=2"), resume="auto")


class InjectedFault(Exception):
    pass


def test_step_hooks_run_before_each_step_and_a_fault_leaves_a_resumable_run(tmp_path):
    """Hooks see every step's index before it runs; one that fails before step 3 (index 2) stops the run there,
    as a killed rank would, with step 2's checkpoint and log lines kept; a resume runs steps 3 and 4 with the
    losses of an uninterrupted run."""
    extra = ("train.steps=4", "train.checkpoint_every=2", "train.keep_checkpoints=0")
    seen: list[int] = []
    full = train(tiny_cfg(tmp_path / "ref", *extra), hooks=[seen.append])
    assert seen == [0, 1, 2, 3]

    def fault_before_index_2(step: int) -> None:
        if step == 2:
            raise InjectedFault(step)

    seen.clear()
    with pytest.raises(InjectedFault):
        train(tiny_cfg(tmp_path / "run", *extra), hooks=[seen.append, fault_before_index_2])
    assert seen == [0, 1, 2]  # every hook runs, in order, before the step
    assert latest_checkpoint(tmp_path / "run").name == "step_0000002"
    assert [r["step"] for r in read_metrics(tmp_path / "run")[0]] == [1, 2]
    seen.clear()
    resumed = train(tiny_cfg(tmp_path / "run", *extra), resume="auto", hooks=[seen.append])
    assert seen == [2, 3]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[2:]]
    assert [r["loss"] for r in read_metrics(tmp_path / "run")[0]] == [r["loss"] for r in full]


def test_init_from_weights_starts_a_fresh_run_from_them(tmp_path):
    """A run from a's merged weights (or its checkpoint folder) starts at step 0 with a's weights and a new
    optimizer: its first loss is not a fresh model's; a wrong model config is refused; a resume wins."""
    a = train(tiny_cfg(tmp_path / "a", "train.steps=2"))
    weights = ckpt.merge(latest_checkpoint(tmp_path / "a"), tmp_path / "a.safetensors")
    fresh = train(tiny_cfg(tmp_path / "fresh", "train.steps=1"))
    b = train(tiny_cfg(tmp_path / "b", "train.steps=1", f"train.init_from={weights}", "optim.lr=1e-12"))
    assert b[0]["loss"] != fresh[0]["loss"]
    # a step of lr 1e-12 moves no weight by more than ~1e-12: b's weights are a's
    mb = load_file(ckpt.merge(latest_checkpoint(tmp_path / "b"), tmp_path / "b.safetensors"))
    ma = load_file(weights)
    assert max((ma[k].double() - mb[k].double()).abs().max().item() for k in ma) < 1e-9
    # from a checkpoint folder too, same result
    c = train(tiny_cfg(tmp_path / "c", "train.steps=1", f"train.init_from={latest_checkpoint(tmp_path / 'a')}",
                       "optim.lr=1e-12"))
    assert c[0]["loss"] == b[0]["loss"]
    with pytest.raises(ValueError, match=r"holds a different model than this run builds .*embed_dim"):
        train(tiny_cfg(tmp_path / "d", "train.steps=1", f"train.init_from={weights}", "model.embed_dim=32"))
    # head counts change no parameter's shape: the same weights regrouped into 2 and 1 heads, another function
    wide = train(tiny_cfg(tmp_path / "e", "train.steps=1", f"train.init_from={weights}", "optim.lr=1e-12",
                          "model.axial_heads=2", "model.icl_heads=1"))
    assert wide[0]["loss"] != b[0]["loss"]
    me = load_file(ckpt.merge(latest_checkpoint(tmp_path / "e"), tmp_path / "e.safetensors"))
    assert max((ma[k].double() - me[k].double()).abs().max().item() for k in ma) < 1e-9
    assert ckpt.load_model(tmp_path / "e.safetensors").config.axial_heads == 2
    # a checkpoint in out_dir takes precedence: the restarted run continues a and never reads init_from (a file
    # that does not exist would raise if it did)
    resumed = train(tiny_cfg(tmp_path / "a", "train.steps=3", f"train.init_from={tmp_path / 'missing.safetensors'}"),
                    resume="auto")
    assert [r["step"] for r in resumed] == [3]
    assert len(a) == 2


def test_layout_that_needs_more_processes_is_refused(tmp_path):
    with pytest.raises(LayoutError, match="needs 4 processes but 1 were started"):
        train(tiny_cfg(tmp_path, "parallel.d0=2", "parallel.d1=2"))


def test_main_reports_config_errors(capsys):
    assert main(["--config", str(TINY), "--set", "optim.lrr=1"]) == 2
    assert "valid keys of optim" in capsys.readouterr().err


def test_main_refuses_a_layout_that_does_not_match_the_world_size(monkeypatch, capsys, tmp_path):
    """Before any process group: WORLD_SIZE=4 but the layout has 2 ranks."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(["--config", str(TINY), "--set", f"train.out_dir={tmp_path}", "parallel.d0=2"]) == 2
    err = capsys.readouterr().err
    assert "config error: layout dp=1 x 2x1 needs 2 processes but 4 were started" in err
    assert "Layouts of 4 processes that fit this model: dp=1 x 1x4, dp=1 x 2x2, dp=1 x 4x1, dp=2 x 1x2" in err
    assert not dist.is_initialized() and not (tmp_path / "metrics.jsonl").exists()


def test_main_refuses_a_layout_that_does_not_divide_the_model(monkeypatch, capsys, tmp_path):
    """3 ranks can't split the tiny model's 4 heads and 16-wide cells: only 3 data-parallel replicas fit."""
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert main(["--config", str(TINY), "--set", f"train.out_dir={tmp_path}", "parallel.d1=3"]) == 2
    err = capsys.readouterr().err
    assert "config error: layout 1x3 does not fit the model: " in err
    assert "4 attention heads are not divisible by d0*d1=3" in err
    assert "Layouts of 3 processes that fit this model: dp=3 x 1x1" in err
    assert not dist.is_initialized()


def _run_on_mesh(out_dir: str, d0: int, d1: int, dp: int, sp: bool, steps: int = 2, dtype: str = "float64") -> dict:
    cfg = tiny_cfg(Path(out_dir), f"train.steps={steps}", "train.checkpoint_every=0", f"train.dtype={dtype}",
                   "optim.grad_clip=0.1", "train.log_every=1", f"parallel.d0={d0}", f"parallel.d1={d1}", f"parallel.dp={dp}", f"parallel.sequence_parallel={sp}")
    records = train(cfg, mesh=get_mesh(d0, d1, dp))
    return {"losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records]}


def test_tensor_parallel_training_equals_one_process(ranks, tmp_path):
    """2x2 with sequence parallelism, float64, clipping active every step (the global norm spans the shards)."""
    ref = _run_on_mesh(str(tmp_path / "ref"), 1, 1, 1, False)
    assert min(ref["norms"]) > 0.1
    for r in ranks(4).run(_run_on_mesh, str(tmp_path / "tp"), 2, 2, 1, True):
        for key in ("losses", "norms"):
            err = max(abs(a - b) / abs(b) for a, b in zip(r[key], ref[key], strict=True))
            assert err <= 1e-9, (key, r[key], ref[key])
    manifest = ckpt.verify_checkpoint(tmp_path / "tp" / "checkpoints" / "step_0000002")
    assert manifest["layout"] == {"d0": 2, "d1": 2, "dp": 1}


@pytest.mark.slow
def test_twenty_float32_steps_on_2x2_give_the_one_process_losses(ranks, tmp_path):
    ref = _run_on_mesh(str(tmp_path / "ref"), 1, 1, 1, False, 20, "float32")
    assert len(ref["losses"]) == 20
    for r in ranks(4).run(_run_on_mesh, str(tmp_path / "tp"), 2, 2, 1, False, 20, "float32"):
        err = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"], strict=True))
        assert err <= 1e-4, (r["losses"], ref["losses"])


def _replica_params(out_dir: str) -> dict:
    cfg = tiny_cfg(Path(out_dir), "train.steps=2", "train.checkpoint_every=0", "parallel.d1=2", "parallel.dp=2")
    records = train(cfg, mesh=get_mesh(1, 2, 2))
    return {"losses": [r["loss"] for r in records]}


def test_data_parallel_replicas_stay_in_step(ranks, tmp_path):
    results = ranks(4).run(_replica_params, str(tmp_path / "dp"))
    assert all(r["losses"] == results[0]["losses"] for r in results)  # the loss is averaged over replicas
    # Replica 1 never wrote; replica 0's two files load as a 1x2 checkpoint.
    manifest = ckpt.verify_checkpoint(tmp_path / "dp" / "checkpoints" / "step_0000002")
    assert manifest["layout"] == {"d0": 1, "d1": 2, "dp": 2} and len(manifest["files"]) == 2


def _replicas_of_mixed_tasks(out_dir: str) -> dict:
    """4 data-parallel replicas of the plain model, half the tables regression: the task differs between
    replicas in some step, so a head has a gradient on some replicas and none on the others."""
    cfg = tiny_cfg(Path(out_dir), "train.steps=2", "train.checkpoint_every=0", "parallel.dp=4",
                   "data.table.regression_prob=0.5", "train.dtype=float64")
    records = train(cfg, mesh=get_mesh(1, 1, 4))
    return {key: [r[key] for r in records] for key in ("task", "loss", "grad_norm")}


def test_replicas_that_see_different_tasks_average_their_gradients(ranks, tmp_path):
    """Replica averaging when the replicas' batches are of different tasks in a step (this used to fail in the
    all-reduce with mismatched sizes): every replica steps with the same averaged gradient (its norm, taken
    after averaging, is the same on every replica), so the replicas stay in step."""
    results = ranks(4).run(_replicas_of_mixed_tasks, str(tmp_path / "dp"))
    steps = list(zip(*(r["task"] for r in results)))
    assert any(len(set(tasks)) > 1 for tasks in steps), steps  # the case this test is for happened
    for key in ("loss", "grad_norm"):
        assert all(r[key] == results[0][key] for r in results), key
    assert all(math.isfinite(x) and x > 0 for x in results[0]["grad_norm"])


# ---------------------------------------------------------------------------------------------------------
# torchrun, in subprocesses that never outlive the test
# ---------------------------------------------------------------------------------------------------------

TOKEN_VAR = "TABFM_TEST_PROCESS_TOKEN"


def _tagged_pids(token: str) -> list[int]:
    """Processes whose environment carries TOKEN_VAR=token (the launched process and all its descendants, even
    those in sessions of their own or already reparented)."""
    tag, pids = f"{TOKEN_VAR}={token}".encode(), []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if tag in (d / "environ").read_bytes().split(b"\0"):
                    pids.append(int(d.name))
            except OSError:
                continue
    return pids


def _kill_tagged(token: str) -> list[int]:
    killed = []
    for _ in range(3):  # a dying agent may still be starting a worker
        pids = _tagged_pids(token)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        if not pids:
            break
        time.sleep(0.2)
    return killed


def run_process_tree(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run cmd from the repository root; on timeout (or any error) kill it and every descendant, and fail.
    Stragglers are killed on success too."""
    token = uuid.uuid4().hex
    env = {**os.environ, "OMP_NUM_THREADS": "1", TOKEN_VAR: token}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tagged(token)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd[:6])} ... ran past {timeout}s and was killed with its workers:\n{err[-3000:]}")
    finally:
        _kill_tagged(token)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def torchrun(out_dir: Path, *extra: str, restarts: int = 0, worker: tuple[str, ...] = ("-m", "tabfm.pretrain")
             ) -> list[str]:
    """torchrun of 2 workers on the tiny config; `worker`: what each runs (a module, or a script and its flags)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", str(restarts), *worker, "--config", str(TINY),
            "--set", f"train.out_dir={out_dir}", "parallel.d1=2", "train.progress=false", "data.batch_size=2",
            "data.table.max_rows=40", *extra]


def _uninterrupted_1x2(out_dir: str, *extra: str) -> list[dict]:
    """The torchrun runs' config (torchrun() below) trained on the 2-rank pool: the uninterrupted reference."""
    cfg = tiny_cfg(Path(out_dir), "parallel.d1=2", *extra)
    return [{k: r[k] for k in ("step", "loss", "grad_norm")} for r in train(cfg, mesh=get_mesh(1, 2))]


@pytest.mark.slow  # two generations of torchrun workers: ~10-15 s on the shared 2-core machine
def test_torchrun_entry_point_and_restart_after_a_rank_dies(ranks, tmp_path):
    """A 1x2 run under torchrun (tabfm.pretrain's main in each worker) where rank 1 SIGKILLs itself before step 3
    (checkpoint at step 2): torchrun restarts both workers once, they resume from the step-2 checkpoint, and the
    losses and gradient norms are exactly those of the uninterrupted run. That reference is the same config
    trained on the 2-rank pool's process group (gloo, one thread per rank, as torchrun's workers), not a third
    generation of torchrun workers; `python -m tabfm.pretrain` itself runs in tests/test_gpu_recipe.py."""
    extra = ("train.steps=6", "train.checkpoint_every=2")
    reference = ranks(2).run(_uninterrupted_1x2, str(tmp_path / "ref"), *extra)[0]
    assert [r["step"] for r in reference] == [1, 2, 3, 4, 5, 6]
    assert ckpt.verify_checkpoint(latest_checkpoint(tmp_path / "ref"))["layout"]["d1"] == 2

    marker = tmp_path / "run" / "fault_fired"  # tests/fault_worker.py's hook: rank 1 dies before step 3, once
    fault = (str(ROOT / "tests" / "fault_worker.py"), "--kill-before", "3", "--kill-rank", "1", "--marker", str(marker))
    out = run_process_tree([*torchrun(tmp_path / "run", *extra, restarts=1, worker=fault), "--resume", "auto"],
                           timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "rank 1 killed itself before step 3" in marker.read_text()
    lines, _ = read_metrics(tmp_path / "run")
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6]  # the failed attempt's step-3 line was trimmed
    assert [r["loss"] for r in lines] == [r["loss"] for r in reference]
    assert [r["grad_norm"] for r in lines] == [r["grad_norm"] for r in reference]
    assert ckpt.verify_checkpoint(latest_checkpoint(tmp_path / "run"))["layout"]["d1"] == 2


@pytest.mark.parametrize("flags,message", [
    (["--config", "{tmp}/nope.yaml"], "--config {tmp}/nope.yaml --batch 8 --rows 256 --features 16: config file "
     "{tmp}/nope.yaml does not exist"),
    (["--rows", "8"], "--config {small} --batch 8 --rows 8 --features 16: table.min_rows=8 is too few for 10 classes; "
     "raise min_rows to >= 20 or lower max_classes"),
    (["--steps", "0"], "--steps 0: give 1 or more"),
    (["--nproc", "1", "0"], "--nproc 0: give 1 or more"),
])
def test_pretrain_benchmark_refuses_a_bad_flag_before_any_work(monkeypatch, tmp_path, capsys, flags, message):
    """A missing --config or a size the prior cannot make had been a ConfigError traceback (naming a --set never
    given), and --steps 0 a ZeroDivisionError after every layout ran: now one line naming the flags, first."""
    from builders import benchmark_module

    bench = benchmark_module("pretrain")
    small = bench.ROOT / "configs" / "pretrain" / "small.yaml"
    monkeypatch.setattr(sys, "argv", ["pretrain.py"])  # argparse's program name
    monkeypatch.setattr(bench, "draw_batches", lambda *a: pytest.fail("drew batches before the flags were checked"))
    with pytest.raises(SystemExit):
        bench.main([f.format(tmp=tmp_path) for f in flags])
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"pretrain.py: error: {message.format(tmp=tmp_path, small=small)}")
