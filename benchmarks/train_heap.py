"""CPU pretraining steps with large blocks kept in malloc's heap (tabfm.train_heap, what `tabfm pretrain` does on
a CPU) against glibc's default thresholds, side by side.

Each side runs in a fresh process (the thresholds are process-wide) the same full training steps
(tabfm.pretrain.train_step: forward, backward, clipping, AdamW) on the same pre-drawn batches of fixed size, and
reports the wall time per timed step, the CPU seconds spent in the kernel per step (getrusage: page faults of
freshly mapped blocks land there) and the peak resident memory. The sides alternate `--repeats` times so that a
machine's drift hits both; the best of each is printed.

    python benchmarks/train_heap.py [--config configs/pretrain/small_wide_cpu.yaml --batch 8 --rows 512 1024
                                     --features 64 --steps 4 --warmup 2 --repeats 2 --txt FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_side(args: argparse.Namespace) -> None:
    """One side in this process: --side kept or default; prints one JSON line."""
    import torch

    from tabfm import train_heap
    from tabfm.config import load_config
    from tabfm.model import build_model
    from tabfm.parallel.mesh import ParallelDims
    from tabfm.pretrain import lr_at, train_step

    applied = train_heap.keep_large_blocks_in_heap() if args.side == "kept" else False
    cfg = load_config(args.config)
    mesh = ParallelDims(1, 1, 1).build("cpu")
    model = build_model(cfg.model, seed=0)
    o = cfg.optim
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                  weight_decay=o.weight_decay)
    batches = torch.load(args.batches, weights_only=False)
    model.train()
    losses = []
    for step, batch in enumerate(batches):
        if step == args.warmup:
            tic, kernel = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_stime
        loss, _ = train_step(model, optimizer, batch, mesh, lr_at(step, o, 1000), o)
        losses.append(float(loss.detach()))
    timed = len(batches) - args.warmup
    print(json.dumps({"applied": applied, "step_s": (time.perf_counter() - tic) / timed,
                      "kernel_s": (resource.getrusage(resource.RUSAGE_SELF).ru_stime - kernel) / timed,
                      "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "losses": losses}))


def draw_batches(args: argparse.Namespace, rows: int, path: Path) -> None:
    """`warmup + steps` batches of exactly batch x rows x features, drawn once for both sides."""
    import torch

    from tabfm.config import load_config
    from tabfm.data.loader import PriorSource, batch_at

    cfg = load_config(args.config, [f"data.batch_size={args.batch}", f"data.table.min_rows={rows}",
                                    f"data.table.max_rows={rows}", f"data.table.min_features={args.features}",
                                    f"data.table.max_features={args.features}", "data.curriculum.ramp_steps=0",
                                    "data.table.regression_prob=0.0"])
    source = PriorSource(cfg.data)
    torch.save([batch_at(source, step) for step in range(args.warmup + args.steps)], path)


def measure(args: argparse.Namespace, side: str, batches: Path) -> dict:
    """One side in a fresh process, without any malloc setting of the caller's environment."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
    out = subprocess.run([sys.executable, __file__, "--side", side, "--batches", str(batches), "--config",
                          args.config, "--warmup", str(args.warmup)], env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "pretrain" / "small_wide_cpu.yaml"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--txt", help="also write the table to this file")
    parser.add_argument("--side", choices=("kept", "default"), help=argparse.SUPPRESS)
    parser.add_argument("--batches", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        return run_side(args)
    import torch

    lines = [f"# large blocks kept in the heap (tabfm.train_heap) vs glibc's default thresholds; "
             f"{Path(args.config).name}, batch {args.batch} x rows x {args.features} features; torch "
             f"{torch.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, load average "
             f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; best of {args.repeats}",
             f"{'rows':>5} | {'default s/step':>14} {'kernel s':>8} {'peak GiB':>8} | {'kept s/step':>11} "
             f"{'kernel s':>8} {'peak GiB':>8} | speed-up  same losses"]
    print("\n".join(lines), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for rows in args.rows:
            batches = Path(tmp) / f"batches_{rows}.pt"
            draw_batches(args, rows, batches)
            runs = {"default": [], "kept": []}
            for _ in range(args.repeats):
                for side in runs:
                    runs[side].append(measure(args, side, batches))
            best = {side: min(r, key=lambda x: x["step_s"]) for side, r in runs.items()}
            d, k = best["default"], best["kept"]
            assert k["applied"], "the thresholds were not set (not glibc?)"
            line = (f"{rows:>5} | {d['step_s']:>14.2f} {d['kernel_s']:>8.2f} {d['peak_gib']:>8.2f} | "
                    f"{k['step_s']:>11.2f} {k['kernel_s']:>8.2f} {k['peak_gib']:>8.2f} | "
                    f"{d['step_s'] / k['step_s']:>7.2f}x  {d['losses'] == k['losses']}")
            print(line, flush=True)
            lines.append(line)
    lines.append("kernel s: CPU seconds in the kernel per timed step (page faults of freshly mapped blocks); "
                 "peak: the process's resident set")
    if args.txt:
        Path(args.txt).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
