"""Pretraining throughput of the small config on 1 process and on every tensor-parallel layout of 2 and 4 ranks.

One table in one run: per layout, steps/s and cells/s (batch * rows * features per second) of full training steps
(forward, backward, replica averaging, global-norm clipping, AdamW: tabfm.pretrain.train_step), median-free
wall time of `--steps` timed steps after `--warmup` untimed ones, on the same pre-drawn batches of fixed size
(default 8 tables of 256 rows x 16 features, so layouts are comparable), and the peak resident memory (RSS,
getrusage ru_maxrss) of every rank. Each layout runs in fresh processes (gloo on CPU), so peaks don't carry over.
Sequence parallelism is measured on 4 ranks wherever d0 > 1 (with d0 = 1 it is the same layout).

If tabfm.parallel.planner can rank layouts of the TabFM model, its predicted ranking is printed beside the
measured one; otherwise the table says why not.

    python benchmarks/pretrain.py [--config configs/pretrain/small.yaml --rows 256 --features 16 --batch 8
                                   --steps 15 --warmup 3 --nproc 1 2 4]

Batch generation is not timed (the batches are drawn once, before any layout runs). On a machine shared with
other jobs the absolute numbers move with the load; the machine's load average is printed with the table.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def layouts(nproc: int) -> list[tuple[int, int, bool]]:
    """(d0, d1, sequence_parallel) of every layout measured for `nproc` ranks."""
    from tabfm.parallel.mesh import factorizations

    out = []
    for d0, d1 in factorizations(nproc):
        out.append((d0, d1, False))
        if nproc == 4 and d0 > 1:
            out.append((d0, d1, True))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, args: dict, d0: int, d1: int, sp: bool, result_path: str) -> None:
    threads = args["threads"]
    torch.set_num_threads(threads)
    import torch.distributed as dist

    from tabfm.config import load_config
    from tabfm.model import build_model
    from tabfm.parallel.mesh import ParallelDims
    from tabfm.parallel_model import parallelize_model
    from tabfm.pretrain import DTYPES, lr_at, train_step

    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        cfg = load_config(args["config"], [f"parallel.d0={d0}", f"parallel.d1={d1}",
                                           f"parallel.sequence_parallel={sp}"])
        mesh = ParallelDims(d0, d1, 1).build("cpu")
        model = build_model(cfg.model, seed=cfg.train.seed).to(dtype=DTYPES[cfg.train.dtype])
        model = parallelize_model(model, mesh, sequence_parallel=sp)
        o = cfg.optim
        optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                      weight_decay=o.weight_decay)
        batches = torch.load(args["batches"], weights_only=False)
        model.train()
        losses, tic = [], 0.0
        for step, batch in enumerate(batches):
            if step == args["warmup"]:
                if world > 1:
                    dist.barrier()
                tic = time.perf_counter()
            loss, _ = train_step(model, optimizer, batch, mesh, lr_at(step, o, cfg.train.steps), o)
            losses.append(float(loss.detach()))
        if world > 1:
            dist.barrier()
        seconds = time.perf_counter() - tic
        rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.float64)
        if world > 1:
            every = [torch.zeros_like(rss) for _ in range(world)]
            dist.all_gather(every, rss)
            rss_all = [int(t.item()) for t in every]
        else:
            rss_all = [int(rss.item())]
        if rank == 0:
            Path(result_path).write_text(repr({"seconds": seconds, "rss": rss_all, "threads": threads,
                                               "losses": losses}))
    finally:
        if world > 1:
            dist.destroy_process_group()


def measure(args: argparse.Namespace, batches_path: str, d0: int, d1: int, sp: bool, tmp: Path,
            threads: int) -> dict:
    """Run one layout in fresh processes and return its timing and memory (or the error)."""
    import torch.multiprocessing as mp

    world = d0 * d1
    result = tmp / f"{d0}x{d1}{'sp' if sp else ''}_{threads}.txt"
    worker_args = {"config": args.config, "batches": batches_path, "warmup": args.warmup, "threads": threads}
    try:  # join=True kills the other ranks when one fails
        mp.start_processes(_worker, args=(world, _free_port(), worker_args, d0, d1, sp, str(result)),
                           nprocs=world, join=True, start_method="spawn")
    except Exception as e:  # noqa: BLE001 - a layout that fails is reported in its row
        return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:120]}"}
    return eval(result.read_text())  # noqa: S307 - our own repr of plain numbers


def _overrides(args: argparse.Namespace) -> list[str]:
    """The config's data section set to the fixed batch size of the flags."""
    return [f"data.batch_size={args.batch}", f"data.table.min_rows={args.rows}", f"data.table.max_rows={args.rows}",
            f"data.table.min_features={args.features}", f"data.table.max_features={args.features}",
            "data.curriculum.ramp_steps=0"]


def draw_batches(args: argparse.Namespace) -> list:
    from tabfm.config import load_config
    from tabfm.data.loader import PriorSource, batch_at

    cfg = load_config(args.config, _overrides(args))
    source = PriorSource(cfg.data)
    batches = [batch_at(source, step) for step in range(args.warmup + args.steps)]
    for b in batches:
        assert tuple(b.values.shape) == (args.batch, args.rows, args.features), b.values.shape
    return batches


def tabfm_planner_source(model_cfg, batch: int, rows: int, features: int, n_train: int | None = None):
    """A planner ModelSource for TabFM on fixed-size classification batches (B x rows x features)."""
    from tabfm.data.encode import Batch
    from tabfm.model import TabFM
    from tabfm.parallel_model import tp_plan

    n_train = n_train or rows // 2

    def inputs(mesh, sequence_parallel, device, dtype):
        shape = (batch, rows, features)
        b = Batch(values=torch.empty(shape, device=device, dtype=torch.float32),
                  missing=torch.empty(shape, device=device, dtype=torch.bool),
                  cat_codes=torch.empty(shape, device=device, dtype=torch.int64),
                  is_cat=torch.empty(batch, features, device=device, dtype=torch.bool),
                  n_cats=torch.empty(batch, features, device=device, dtype=torch.int64),
                  labels=torch.empty(batch, rows, device=device, dtype=torch.int64),
                  n_train=torch.empty(batch, device=device, dtype=torch.int64),
                  n_classes=torch.empty(batch, device=device, dtype=torch.int64),
                  row_pad=torch.empty(batch, rows, device=device, dtype=torch.bool),
                  col_pad=torch.empty(batch, features, device=device, dtype=torch.bool), task="classification")
        return b, n_train  # TabFM.forward(batch, max_train): meta tensors hold no n_train to read

    def source():
        model = TabFM(model_cfg)
        return model, tp_plan(model), inputs

    return source


def planner_ranking(args: argparse.Namespace, nproc: int) -> tuple[list[str] | None, str]:
    """(layout labels in the planner's predicted order, note), or (None, why not)."""
    try:
        from tabfm.parallel import planner
    except ImportError as e:
        return None, f"tabfm.parallel.planner is not available ({e})"
    if not hasattr(planner, "plan"):
        return None, "tabfm.parallel.planner has no plan() ranking function"
    try:  # API as of this writing: plan(source, topology, nproc, sequence_parallel=..., chunks=..., dtype=...)
        from tabfm.config import load_config
        from tabfm.parallel.topology import load_or_measure

        cfg = load_config(args.config)
        src = tabfm_planner_source(cfg.model, args.batch, args.rows, args.features)
        topology = load_or_measure(nproc)
        ranked = planner.plan(src, topology, nproc, sequence_parallel=(False, True), chunks=(1,),
                              dtype=cfg.train.dtype)
    except Exception as e:  # noqa: BLE001 - the planner is work in progress: report, don't fail the benchmark
        return None, f"planner failed: {type(e).__name__}: {str(e).splitlines()[0][:150]}"
    labels = [f"{c.d0}x{c.d1}{' sp' if c.sequence_parallel else ''}" for c in ranked if c.valid]
    times = ", ".join(f"{c.d0}x{c.d1}{' sp' if c.sequence_parallel else ''} {c.step_seconds:.3f}s"
                      for c in ranked if c.valid)
    return labels, f"planner.plan() on {topology.name}, predicted s/step: {times}"


def _parser() -> argparse.ArgumentParser:
    """The command line (its own function to keep main short)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "pretrain" / "small.yaml"))
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=15, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per rank (0: cores // ranks, at least 1; one process also with 1)")
    parser.add_argument("--no-planner", action="store_true")
    return parser


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The flags checked before any work: a missing --config or a size the prior cannot make had been a ConfigError
    traceback, --steps 0 a ZeroDivisionError after every layout had run."""
    from tabfm.config import load_config

    for flag, value, least in (("--steps", args.steps, 1), ("--warmup", args.warmup, 0),
                               ("--threads", args.threads, 0), ("--nproc", min(args.nproc), 1)):
        if value < least:
            parser.error(f"{flag} {value}: give {least} or more")
    try:
        load_config(args.config, _overrides(args))
    except ValueError as e:
        said = str(e).splitlines()[0].split(" (from --set ")[0]  # the flags set those keys, not a --set of the user's
        parser.error(f"--config {args.config} --batch {args.batch} --rows {args.rows} --features {args.features}: "
                     f"{said}")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _check(parser, args)

    cells = args.batch * args.rows * args.features
    print(f"# benchmarks/pretrain.py: {Path(args.config).name}, batch {args.batch} x {args.rows} rows x "
          f"{args.features} features = {cells} cells/step, {args.warmup} warmup + {args.steps} timed steps, gloo on "
          f"CPU\n# {platform.node()}: {os.cpu_count()} cores, torch {torch.__version__}, load average at start "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} (shared machine: absolute numbers move with the load)",
          flush=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        batches_path = str(tmp / "batches.pt")
        torch.save(draw_batches(args), batches_path)
        rows: list[tuple[int, str, dict]] = []
        cores = os.cpu_count() or 1
        for nproc in args.nproc:
            for d0, d1, sp in layouts(nproc):
                label = f"{d0}x{d1}{' sp' if sp else ''}"
                # One process: with 1 thread (the per-rank budget of 2+ ranks here) and with every core.
                variants = [args.threads] if args.threads else sorted({1, max(1, cores // nproc)})
                for threads in variants:
                    r = measure(args, batches_path, d0, d1, sp, tmp, threads)
                    rows.append((nproc, label if len(variants) == 1 else f"{label} t{threads}", r))
                    status = r.get("error") or f"{args.steps / r['seconds']:.3f} steps/s"
                    print(f"#   {nproc} x {rows[-1][1]}: {status}", file=sys.stderr, flush=True)

    print()
    print(f"{'ranks':>5}  {'layout':<8} {'thr':>3}  {'steps/s':>8}  {'cells/s':>9}  {'s/step':>7}  "
          f"{'peak RSS/rank (MB)':<24} {'final loss':>10}  {'measured':>8}  {'planner':>7}")
    for nproc in args.nproc:
        group = [(label, r) for n, label, r in rows if n == nproc]
        ok = sorted((r["seconds"], label) for label, r in group if "error" not in r)
        measured_rank = {label: i + 1 for i, (_, label) in enumerate(ok)}
        predicted, note = (None, "skipped (--no-planner)") if args.no_planner or nproc == 1 else \
            planner_ranking(args, nproc)
        predicted_rank = {label: i + 1 for i, label in enumerate(predicted or [])}
        for label, r in group:
            if "error" in r:
                print(f"{nproc:>5}  {label:<8} {'':>3}  failed: {r['error']}")
                continue
            sps = args.steps / r["seconds"]
            rss = "/".join(f"{b / 2**20:.0f}" for b in r["rss"])
            pred = str(predicted_rank.get(label, "-")) if predicted else "n/a"
            print(f"{nproc:>5}  {label:<8} {r['threads']:>3}  {sps:>8.3f}  {sps * cells:>9.0f}  {1 / sps:>7.3f}  "
                  f"{rss:<24} {r['losses'][-1]:>10.5f}  {measured_rank[label]:>8}  {pred:>7}")
        if nproc > 1:
            print(f"{'':>5}  planner for {nproc} ranks: {note}" + (f"; predicted order {' > '.join(predicted)}"
                                                                   if predicted else ""))
    print(f"\n# total wall time {time.perf_counter() - t0:.0f} s; load average at end "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
