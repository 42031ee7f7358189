"""`tabfm pretrain`, `tabfm ckpt merge | reshard | verify` and `tabfm plot-run`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tabfm._cli_demo import parse_layout
from tabfm.out_paths import check_png, checkpoints_of


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("pretrain", help="pretrain on the synthetic prior (launches torchrun for --nproc > 1)")
    p.add_argument("--nproc", type=int, default=1, help="processes on this machine (dp * d0 * d1)")
    p.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts after a failed rank")
    p.add_argument("--config", help="YAML run config (required): configs/pretrain/{tiny,small,large}.yaml or yours")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="A.B=C", help="override config fields")
    add_run_dir_arguments(p)
    p.set_defaults(run=_pretrain)

    ckpt = subparsers.add_parser("ckpt", help="merge, re-split or verify a sharded checkpoint")
    sub = ckpt.add_subparsers(dest="ckpt_command", required=True, metavar="ACTION")
    m = sub.add_parser("merge", help="all rank shards -> one safetensors file of the plain model")
    m.add_argument("checkpoint", help="a checkpoint folder (runs/small/checkpoints/step_0000250), or a run's "
                   "out_dir for its latest checkpoint")
    m.add_argument("-o", "--output", required=True, help="the .safetensors file to write")
    m.add_argument("--overwrite", action="store_true", help="replace the output file if it exists")
    m.set_defaults(run=_merge)
    r = sub.add_parser("reshard", help="re-split a checkpoint for another layout")
    r.add_argument("checkpoint")
    r.add_argument("--layout", type=parse_layout, required=True, help="the new tensor-parallel mesh d0xd1")
    r.add_argument("-o", "--output", required=True, help="the checkpoint folder to write")
    r.add_argument("--overwrite", action="store_true", help="replace the output folder if it is a checkpoint")
    r.set_defaults(run=_reshard)
    v = sub.add_parser("verify", help="run every check loading runs, plus checksums and finite weights")
    v.add_argument("checkpoint")
    v.set_defaults(run=_verify)

    plot = subparsers.add_parser("plot-run", help="draw a run's loss and evaluation curves to PNG")
    plot.add_argument("run_dir", help="the run's out_dir (holds metrics.jsonl)")
    plot.add_argument("-o", "--output", help="PNG path (default RUN_DIR/curves.png)")
    plot.set_defaults(run=_plot_run)


def add_run_dir_arguments(parser: argparse.ArgumentParser) -> None:
    """--resume and --overwrite: what to do with a train.out_dir that already holds a run; --quiet: whether it
    shows a progress bar (also the arguments of `python -m tabfm.pretrain`)."""
    parser.add_argument("--resume", nargs="?", const="auto", default=None, metavar="auto|DIR",
                        help="continue a run: auto (the value of a bare --resume) from the latest checkpoint in "
                        "train.out_dir, from step 0 when it has none; DIR from that checkpoint folder "
                        "(e.g. runs/tiny/checkpoints/step_0000010). Metric lines after the resumed step are "
                        "dropped. Without --resume or --overwrite an out_dir that holds a run is refused")
    parser.add_argument("--overwrite", action="store_true",
                        help="start afresh in an out_dir that holds a run: first deletes its metrics.jsonl, "
                        "curves.png, config.yaml, layout.json and what a run wrote in checkpoints/")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bar (as --set train.progress=false; metrics.jsonl and errors still come)")


def run_overrides(args: argparse.Namespace) -> list[str]:
    """The config overrides of a pretrain command line: its --set fields, and train.progress=false for --quiet
    (ValueError, one line, where --set gives train.progress too)."""
    if not args.quiet:
        return list(args.set)
    given = [item for item in args.set if item.split("=", 1)[0].strip() == "train.progress"]
    if given:
        raise ValueError(f"--quiet and --set {given[0]} both set the progress bar; give one of them")
    return [*args.set, "train.progress=false"]


def _pretrain(args: argparse.Namespace) -> int:
    """Check the whole run in this process (config, layout for --nproc, out_dir), then train here or under
    torchrun: a mistake is one line in a few seconds, not a traceback per rank after the workers start."""
    from tabfm import pretrain
    from tabfm.launch import run_torchrun, worker_argv

    if args.nproc < 1 or args.max_restarts < 0:
        return _fail("--nproc must be at least 1 and --max-restarts at least 0")
    try:
        cfg = pretrain.load_run_config(args.config, run_overrides(args))
        pretrain.check_run(cfg, args.nproc, args.resume, args.overwrite, args.config)
    except ValueError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    worker = pretrain.build_parser()
    if args.nproc == 1 and args.max_restarts == 0:
        return pretrain.main(worker_argv(worker, args))
    if args.overwrite and (note := pretrain.clear_run(Path(cfg.train.out_dir))):
        print(note, file=sys.stderr)  # here, once: the ranks (and restarted ones) must not clear it again
    # A restarted rank must continue from the last checkpoint.
    resume = args.resume if args.resume is not None or not args.max_restarts else "auto"
    ranks = argparse.Namespace(**{**vars(args), "overwrite": False, "resume": resume})
    return run_torchrun("tabfm.pretrain", worker_argv(worker, ranks), args.nproc, args.max_restarts)


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, a run's out_dir (its latest checkpoint) or a `checkpoints/latest` pointer file (which
    must name a step_<digits> folder beside it)."""
    from tabfm.checkpoint import latest_checkpoint, read_latest

    path = Path(path)
    if path.is_file() and path.name == "latest":
        return read_latest(path)
    if checkpoints_of(path).is_dir():
        latest = latest_checkpoint(path)
        if latest is None:
            raise ValueError(f"run {path} has no complete checkpoint yet")
        return latest
    return path


def _merge(args: argparse.Namespace) -> int:
    from tabfm import checkpoint

    try:
        out = checkpoint.merge(resolve_checkpoint(args.checkpoint), args.output, overwrite=args.overwrite)
    except (ValueError, FileNotFoundError) as e:
        return _fail(str(e))
    print(f"merged {args.checkpoint} -> {out}")
    return 0


def _reshard(args: argparse.Namespace) -> int:
    from tabfm import checkpoint

    d0, d1 = args.layout
    try:
        out = checkpoint.reshard(resolve_checkpoint(args.checkpoint), d0, d1, args.output, overwrite=args.overwrite)
    except (ValueError, FileNotFoundError) as e:
        return _fail(str(e))
    print(f"resharded {args.checkpoint} to {d0}x{d1} -> {out}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from tabfm import checkpoint

    try:
        manifest = checkpoint.verify_checkpoint(resolve_checkpoint(args.checkpoint))
    except (ValueError, FileNotFoundError) as e:
        return _fail(str(e))
    print(f"{args.checkpoint}: ok (step {manifest.get('step')}, layout {manifest.get('layout')})")
    return 0


def read_metrics_file(path: Path, warn: bool = True) -> list[dict]:
    """The records of a metrics.jsonl. A torn last line (a crash, a full disk mid-write) is dropped with a warning;
    an unparsable line before it is corruption, not a crash artefact: ValueError naming the line."""
    lines = path.read_text(errors="replace").splitlines()
    last = max((i for i, ln in enumerate(lines) if ln.strip()), default=-1)
    records = []
    for i, ln in enumerate(lines):
        if not ln.strip():
            continue
        try:
            record = json.loads(ln)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not a metrics record")
        except ValueError:
            if i < last:
                raise ValueError(f"{path} line {i + 1} is not a metrics record ({ln[:60]!r}); fix or delete "
                                 "that line") from None
            if warn:
                print(f"warning: {path} line {i + 1} is torn ({ln[:60]!r}); dropping it", file=sys.stderr)
            continue
        records.append(record)
    return records


def read_metrics(run_dir: str | Path) -> tuple[list[dict], list[dict]]:
    """A run's training lines and evaluation lines from metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a pretraining run's out_dir?")
    train, evals = [], []
    for record in read_metrics_file(path):
        (evals if "eval" in record else train).append(record)
    return train, evals


def plot_run(run_dir: str | Path, output: str | Path | None = None) -> Path:
    """Loss per task (smoothed), learning rate, and evaluation metrics against the step, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    if Path(run_dir).is_file():  # e.g. its metrics.jsonl: checked before -o, whose default lies inside RUN_DIR
        raise ValueError(f"{run_dir} is a file; give the run's out_dir, the folder that holds metrics.jsonl")
    out = check_png(output if output else Path(run_dir) / "curves.png", "-o")
    train, evals = read_metrics(run_dir)
    train = [r for r in train if all(isinstance(r.get(k), int | float) for k in ("loss", "lr"))  # else no curve
             and isinstance(r.get("task", "all"), str)]  # a hand-edited null or list was a TypeError
    evals = [r for r in evals if isinstance(r.get("eval"), dict)]
    if not train:
        raise ValueError(f"{run_dir}/metrics.jsonl has no training lines (with a loss and a learning rate) yet")
    fig, axes = plt.subplots(1, 3 if evals else 2, figsize=(15 if evals else 10, 4))
    for task in sorted({r.get("task", "all") for r in train}):
        rows = [r for r in train if r.get("task", "all") == task]
        steps, loss = np.array([r["step"] for r in rows]), np.array([r["loss"] for r in rows])
        axes[0].plot(steps, loss, alpha=0.25)
        window = max(1, len(loss) // 20)
        smooth = np.convolve(loss, np.ones(window) / window, mode="valid")
        axes[0].plot(steps[window - 1:], smooth, label=f"{task} (moving mean of {window})")
    axes[0].set(xlabel="step", ylabel="training loss", title="loss")
    axes[0].legend()
    axes[1].plot([r["step"] for r in train], [r["lr"] for r in train])
    axes[1].set(xlabel="step", ylabel="learning rate", title="schedule")
    if evals:
        steps = [r["step"] for r in evals]
        for key in ("mean_roc_auc", "mean_accuracy", "mean_log_loss"):
            held = [(step, r["eval"][key]) for step, r in zip(steps, evals, strict=True) if key in r["eval"]]
            if held:  # evaluations need not all carry the same keys (a run resumed with other eval settings)
                axes[2].plot(*zip(*held, strict=True), marker="o", label=key)
        axes[2].set(xlabel="step", title="evaluation on real tables")
        axes[2].legend()
    fig.suptitle(f"tabfm run {run_dir}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)  # as `tabfm plan --png` does
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _plot_run(args: argparse.Namespace) -> int:
    try:
        out = plot_run(args.run_dir, args.output)
    except (ValueError, OSError) as e:  # OSError: an -o it may not write (PermissionError) or a full disk
        return _fail(str(e))
    print(f"wrote {out}")
    return 0
