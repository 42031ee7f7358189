"""How well pretraining uses one GPU: model step time, FLOPs and MFU per precision, loader throughput, and the
share of a real run spent waiting for batches.

Three sections, each printed as a markdown table row by row (flushed as it goes; a measurement that fails prints
its row with the reason and the script carries on, so a GPU lease never ends with nothing):

    model    for each model preset x feature count x precision (fp32, tf32, bf16, bf16+compile): one fixed batch
             of B tables x R rows x F features on the device, no loader; a full training step (forward and loss
             under the precision's autocast, backward, global-norm clipping, AdamW: tabfm.pretrain.train_step),
             `--warmup` untimed steps, then the median of `--steps` timed ones. cells/s = B*R*F / step time.
             FLOPs per step: forward + backward counted once per shape with torch.utils.flop_counter
             .FlopCounterMode (matmuls and attention; the optimizer's elementwise work is not counted). MFU =
             achieved FLOP/s / the device's dense peak for that precision's math (PEAK_TFLOPS; n/a off those GPUs).
             Peak memory: torch.cuda.max_memory_allocated on CUDA; on CPU the process's peak RSS so far (it only
             grows). bf16+compile: model.compile() (its first steps compile; compile errors print their reason),
             and torch._dynamo.explain once reports the graph breaks of the forward.
    loader   tables/s of data.loader.make_loader at the same table shape with W workers: the first batch (worker
             start-up) is timed apart, then the steady rate over the next batches
    e2e      a short real run, loader and model together: the fraction of step time blocked in next(loader);
             on CUDA in bf16 three times: with tabfm's attention kernels (flash / memory-efficient), with cuDNN's
             allowed (it plans each new shape, and a real run's batches all have new ones), and compiled as
             train.compile does (its recompiles for new shapes counted in the mean step, not the median)

    python benchmarks/gpu_pretrain.py                       # on a GPU: tiny/small/base, 16 x 1024 x {32, 64}
    python benchmarks/gpu_pretrain.py --cpu-smoke           # on CPU (the default there): tiny shapes, seconds
    python benchmarks/gpu_pretrain.py --presets small --features 64 --precisions bf16 bf16+compile --sections model
    python benchmarks/gpu_pretrain.py --presets small small_wide small_inducing --rows 4096 --features 32 \
        --precisions bf16 --sections model          # column-stage presets (issue 12.3): full vs inducing, heads 8 vs 16

The machine (device name, torch version, CPU count, load average) is printed first.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # dense (no structured sparsity) per-GPU peaks from NVIDIA's datasheets; the first name found in the device's
    # name wins, so the more specific names come first
    "H200 NVL": {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H200": {"bf16": 989.5, "tf32": 494.7, "fp32": 66.9},
    "H100 NVL": {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H100 PCIe": {"bf16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "H100": {"bf16": 989.5, "tf32": 494.7, "fp32": 66.9},
    "A100": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
}


@dataclass(frozen=True)
class Variant:
    """One column of the precision sweep: the run's train.precision, the math its peak is read for, compile."""

    name: str
    precision: str
    math: str
    compile: bool = False


VARIANTS = {v.name: v for v in (Variant("fp32", "fp32", "fp32"), Variant("tf32", "tf32", "tf32"),
                                Variant("bf16", "bf16", "bf16"), Variant("bf16+compile", "bf16", "bf16", True))}
GPU_DEFAULTS = {"presets": ["tiny", "small", "base"], "batch": 16, "rows": 1024, "features": [32, 64],
                "steps": 10, "warmup": 3, "loader_workers": [1, 8, 15], "e2e_steps": 20}
CPU_DEFAULTS = {"presets": ["tiny"], "batch": 2, "rows": 32, "features": [4], "steps": 2, "warmup": 1,
                "loader_workers": [0, 1, 2], "e2e_steps": 3}


def peak_tflops(device_name: str | None, math: str) -> float | None:
    """The dense peak TFLOP/s of `device_name` for `math` (fp32, tf32, bf16); None for unknown devices and CPUs."""
    if device_name is None:
        return None
    for key, peaks in PEAK_TFLOPS.items():
        if key in device_name:
            return peaks[math]
    return None


def say(line: str) -> None:
    print(line, flush=True)


def reason(e: BaseException) -> str:
    """One line: the exception's type and the last line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1][:160] if text else ''}"


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_mib(device: torch.device) -> float:
    """Peak device memory since reset_peak (CUDA), or the process's peak RSS so far (CPU), in MiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def fmt(x: float | None, spec: str = ".3g") -> str:
    return "n/a" if x is None else format(x, spec)


# ---------------------------------------------------------------------------------------------------------
# Batches, models, FLOPs
# ---------------------------------------------------------------------------------------------------------

def data_config(batch: int, rows: int, features: int, workers: int = 0):
    """A DataConfig whose every table has exactly `rows` x `features` cells."""
    from tabfm.config import load_config

    return load_config(None, [f"data.batch_size={batch}", f"data.table.min_rows={rows}",
                              f"data.table.max_rows={rows}", f"data.table.min_features={features}",
                              f"data.table.max_features={features}", "data.curriculum.ramp_steps=0",
                              f"data.num_workers={workers}"]).data


def fixed_batch(batch: int, rows: int, features: int, device: torch.device):
    """One batch of the prior at that exact shape, on the device."""
    from tabfm.data.loader import PriorSource, batch_at

    b = batch_at(PriorSource(data_config(batch, rows, features)), 0)
    if tuple(b.values.shape) != (batch, rows, features):
        raise RuntimeError(f"the prior drew a batch of {tuple(b.values.shape)}, not {(batch, rows, features)}")
    return b.to(device)


def build(preset: str, device: torch.device):
    """(model, optimizer, mesh, optim config) of a preset on one device, as tabfm.pretrain builds them."""
    from tabfm.config import OptimConfig
    from tabfm.model import build_model
    from tabfm.parallel_model import parallelize_model
    from tabfm.parallel.mesh import TPMesh
    from tabfm.precision import make_optimizer

    mesh = TPMesh.single()
    model = parallelize_model(build_model(preset, seed=0).to(device), mesh)
    ocfg = OptimConfig()
    return model, make_optimizer(model, ocfg), mesh, ocfg


def _flop_formulas() -> dict:
    """FlopCounterMode counts CUDA's fused attention but not the CPU one: the same formulas for the CPU ops."""
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten

    def fwd(query, key, value, *args, out_shape=None, **kwargs):
        return fc.sdpa_flop_count(query, key, value)

    def bwd(grad_out, query, key, value, *args, out_shape=None, **kwargs):
        return fc.sdpa_backward_flop_count(grad_out, query, key, value)

    out = {}
    for name, f in (("_scaled_dot_product_flash_attention_for_cpu", fwd),
                    ("_scaled_dot_product_flash_attention_for_cpu_backward", bwd)):
        if hasattr(aten, name):
            out[getattr(aten, name)] = f
    return out


def count_flops(preset: str, batch, device: torch.device) -> int:
    """FLOPs of one forward + backward of `preset` on `batch` (float32 eager; the count is the same under autocast)."""
    from torch.utils.flop_counter import FlopCounterMode

    model, _, _, _ = build(preset, device)
    with FlopCounterMode(display=False, custom_mapping=_flop_formulas()) as counter:
        model.loss(batch).backward()
    del model
    return counter.get_total_flops()


def graph_breaks(preset: str, batch, device: torch.device) -> str:
    """torch._dynamo.explain of the forward under bf16 autocast: graphs, breaks and their distinct reasons."""
    import torch._dynamo

    from tabfm.precision import autocast

    model, _, _, _ = build(preset, device)
    torch._dynamo.reset()
    with autocast("bf16", device):
        out = torch._dynamo.explain(model)(batch)
    torch._dynamo.reset()
    reasons = []
    for br in out.break_reasons:
        frame = br.user_stack[-1] if br.user_stack else None
        where = f" at {os.path.basename(frame.filename)}:{frame.lineno}" if frame else ""
        text = f"{br.reason.strip().splitlines()[0][:110]}{where}"
        if text not in reasons:
            reasons.append(text)
    return f"{out.graph_count} graphs, {out.graph_break_count} breaks: " + ("; ".join(reasons) or "none")


# ---------------------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------------------

def time_steps(preset: str, batch, device: torch.device, variant: Variant, steps: int, warmup: int,
               compile_backend: str) -> dict[str, float]:
    """Median seconds of a full training step (warmup steps untimed) and the peak memory."""
    import torch._dynamo

    from tabfm.precision import matmul_precision
    from tabfm.pretrain import train_step

    free(device)
    reset_peak(device)
    model, optimizer, mesh, ocfg = build(preset, device)
    if variant.compile:
        torch._dynamo.reset()
        model.compile(backend=compile_backend)
    times = []
    with matmul_precision(variant.precision, device):
        for i in range(warmup + steps):
            tic = time.perf_counter()
            train_step(model, optimizer, batch, mesh, ocfg.lr * 0.1, ocfg, variant.precision)
            sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - tic)
    result = {"seconds": statistics.median(times), "peak_mib": peak_mib(device)}
    del model, optimizer
    free(device)
    return result


def model_section(args: argparse.Namespace, device: torch.device, device_name: str | None) -> None:
    say("\n## model step (fixed batch on the device, no loader)\n")
    say("| preset | tables x rows x features | precision | step ms | cells/s | GFLOP/step | TFLOP/s | MFU | "
        "peak MiB | note |")
    say("|---|---|---|---|---|---|---|---|---|---|")
    explained = not args.explain
    for preset in args.presets:
        for features in args.features:
            shape = f"{args.batch} x {args.rows} x {features}"
            try:
                batch = fixed_batch(args.batch, args.rows, features, device)
            except Exception as e:  # noqa: BLE001 - one line, then the next shape
                say(f"| {preset} | {shape} | all | | | | | | | batch failed: {reason(e)} |")
                continue
            try:
                flops = count_flops(preset, batch, device)
            except Exception as e:  # noqa: BLE001
                flops = None
                say(f"| {preset} | {shape} | - | | | | | | | FLOP count failed: {reason(e)} |")
            free(device)
            for name in args.precisions:
                variant = VARIANTS[name]
                note = ""
                if variant.compile and not explained:
                    explained = True
                    try:
                        note = "dynamo: " + graph_breaks(preset, batch, device)
                    except Exception as e:  # noqa: BLE001
                        note = f"dynamo.explain failed: {reason(e)}"
                try:
                    r = time_steps(preset, batch, device, variant, args.steps, args.warmup, args.compile_backend)
                except Exception as e:  # noqa: BLE001 - compile errors and OOMs land here
                    free(device)
                    say(f"| {preset} | {shape} | {name} | | | | | | | failed: {reason(e)} {note} |")
                    continue
                s = r["seconds"]
                achieved = None if flops is None else flops / s / 1e12
                peak = peak_tflops(device_name, variant.math)
                mfu = None if achieved is None or peak is None else f"{100 * achieved / peak:.1f}%"
                say(f"| {preset} | {shape} | {name} | {1e3 * s:.1f} | {args.batch * args.rows * features / s:.3g} | "
                    f"{fmt(None if flops is None else flops / 1e9)} | {fmt(achieved)} | {mfu or 'n/a'} | "
                    f"{r['peak_mib']:.0f} | {note} |")
            del batch
            free(device)


def loader_rate(args: argparse.Namespace, features: int, workers: int) -> dict[str, float]:
    """Seconds to the first batch, then tables/s over the following ones (at most --loader-seconds)."""
    from tabfm.data.loader import make_loader

    n = args.loader_steps or max(4, 2 * workers + 1)
    loader = make_loader(data_config(args.batch, args.rows, features, workers), num_steps=n)
    it = iter(loader)
    tic = time.perf_counter()
    next(it)
    first = time.perf_counter() - tic
    tic, got = time.perf_counter(), 0
    for _ in it:
        got += 1
        if time.perf_counter() - tic > args.loader_seconds:
            break
    seconds = time.perf_counter() - tic
    del it, loader
    return {"first_s": first, "tables_per_s": got * args.batch / seconds if got else float("nan"), "steps": got}


def loader_section(args: argparse.Namespace) -> None:
    say("\n## loader (tables/s after the first batch)\n")
    say("| tables x rows x features | workers | first batch s | tables/s | batches timed |")
    say("|---|---|---|---|---|")
    for features in args.features:
        for workers in args.loader_workers:
            shape = f"{args.batch} x {args.rows} x {features}"
            try:
                r = loader_rate(args, features, workers)
            except Exception as e:  # noqa: BLE001
                say(f"| {shape} | {workers} | failed: {reason(e)} | | |")
                continue
            say(f"| {shape} | {workers} | {r['first_s']:.2f} | {r['tables_per_s']:.3g} | {r['steps']} |")


def e2e_run(args: argparse.Namespace, device: torch.device, features: int, compile: bool = False) -> dict[str, float]:
    """Steps fed by the loader: time blocked in next(loader) and whole-step time, after one untimed step. With
    `compile`, the forward is compiled (--compile-backend) as train.compile does: the timed steps then include
    the recompiles that new batch shapes bring (the median step leaves them out)."""
    from tabfm.data.loader import make_loader
    from tabfm.precision import matmul_precision
    from tabfm.pretrain import train_step

    model, optimizer, mesh, ocfg = build(args.e2e_preset, device)
    if compile:
        import torch._dynamo

        torch._dynamo.reset()
        model.compile(backend=args.compile_backend)
    steps = args.e2e_steps + 1
    loader = make_loader(data_config(args.batch, args.rows, features, args.e2e_workers), num_steps=steps,
                         pin_memory=device.type == "cuda")
    it = iter(loader)
    wait, times = 0.0, []
    with matmul_precision(args.e2e_precision, device):
        for i in range(steps):
            tic = time.perf_counter()
            batch = next(it).to(device, non_blocking=True)
            got = time.perf_counter()
            train_step(model, optimizer, batch, mesh, ocfg.lr * 0.1, ocfg, args.e2e_precision)
            sync(device)
            if i:  # the first step waits for the workers to start (and compiles the first graph)
                wait += got - tic
                times.append(time.perf_counter() - tic)
    del it, loader, model, optimizer
    if compile:
        torch._dynamo.reset()
    free(device)
    total = sum(times)
    return {"wait": wait, "total": total, "step_ms": 1e3 * total / args.e2e_steps,
            "median_ms": 1e3 * statistics.median(times)}


@contextlib.contextmanager
def cudnn_attention_allowed() -> Iterator[None]:
    """bf16 autocast with PyTorch's own choice of attention kernel, cuDNN's included (which tabfm leaves out:
    tabfm.precision.BF16_ATTENTION_BACKENDS): the comparison row of the end-to-end section."""
    from torch.nn.attention import SDPBackend

    import tabfm.precision as precision

    kept = precision.BF16_ATTENTION_BACKENDS
    precision.BF16_ATTENTION_BACKENDS = [SDPBackend.CUDNN_ATTENTION, *kept]
    try:
        yield
    finally:
        precision.BF16_ATTENTION_BACKENDS = kept


E2E_ROWS = ("eager", "compile", "cudnn")
"""The end-to-end section's rows on CUDA in bf16: tabfm's attention kernels eager, the same compiled (as
train.compile does), PyTorch's own choice with cuDNN's attention (measured: 4.6x slower on an H200, README)."""


def e2e_settings(device_type: str, precision: str, rows: tuple[str, ...] | list[str],
                 backend: str) -> list[tuple[str, Callable[[], Any], bool]]:
    """(label, context manager factory, compile) of each end-to-end row asked for in `rows` (E2E_ROWS), in
    E2E_ROWS' order: compiled before cuDNN, so a check cut short keeps the open question. Off CUDA or bf16, the
    one eager row."""
    if device_type != "cuda":
        return [("CPU kernels", contextlib.nullcontext, False)]
    known = {"eager": ("flash / efficient (tabfm)", contextlib.nullcontext, False),
             "compile": (f"flash / efficient + compile ({backend})", contextlib.nullcontext, True),
             "cudnn": ("cuDNN allowed (PyTorch's choice)", cudnn_attention_allowed, False)}
    if precision != "bf16":  # cuDNN's attention and its planning arise under bf16 autocast only
        rows = [r for r in rows if r != "cudnn"]
    return [known[r] for r in E2E_ROWS if r in rows]


def e2e_section(args: argparse.Namespace, device: torch.device) -> None:
    say(f"\n## end to end ({args.e2e_preset}, {args.e2e_precision}, {args.e2e_workers} loader workers, "
        f"{args.e2e_steps} steps after one untimed)\n")
    say("| tables x rows x features | attention kernels | step ms | median step ms | waiting for batches "
        "| tables/s |")
    say("|---|---|---|---|---|---|")
    settings = e2e_settings(device.type, args.e2e_precision, args.e2e_rows, args.compile_backend)
    for features in args.features:
        shape = f"{args.batch} x {args.rows} x {features}"
        for label, context, compile in settings:
            try:
                with context():
                    r = e2e_run(args, device, features, compile)
            except Exception as e:  # noqa: BLE001
                free(device)
                say(f"| {shape} | {label} | failed: {reason(e)} | | | |")
                continue
            say(f"| {shape} | {label} | {r['step_ms']:.1f} | {r['median_ms']:.1f} | "
                f"{100 * r['wait'] / r['total']:.1f}% | {args.batch * args.e2e_steps / r['total']:.3g} |")


# ---------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python benchmarks/gpu_pretrain.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes on CPU (the default on a machine without a GPU): seconds, for tests")
    p.add_argument("--presets", nargs="+", help="model presets (configs/model); GPU default tiny small base")
    p.add_argument("--batch", type=int, help="tables per batch (GPU default 16)")
    p.add_argument("--rows", type=int, help="rows per table (GPU default 1024)")
    p.add_argument("--features", type=int, nargs="+", help="features per table (GPU default 32 64)")
    p.add_argument("--precisions", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--steps", type=int, help="timed steps per measurement (GPU default 10)")
    p.add_argument("--warmup", type=int, help="untimed steps first (GPU default 3; compile happens here)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default inductor)")
    p.add_argument("--no-explain", dest="explain", action="store_false",
                   help="skip torch._dynamo.explain's graph-break report")
    p.add_argument("--loader-workers", type=int, nargs="+", help="worker counts (GPU default 1 8 15)")
    p.add_argument("--loader-steps", type=int, help="batches per loader measurement (default max(4, 2W+1))")
    p.add_argument("--loader-seconds", type=float, default=60.0, help="cap on one loader measurement")
    p.add_argument("--e2e-preset", help="model of the end-to-end run (default: the last of --presets)")
    p.add_argument("--e2e-precision", choices=["fp32", "tf32", "bf16"],
                   help="precision of the end-to-end run (default bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--e2e-workers", type=int, help="loader workers of the end-to-end run (default the most of "
                                                   "--loader-workers)")
    p.add_argument("--e2e-steps", type=int, help="timed steps of the end-to-end run (GPU default 20)")
    p.add_argument("--e2e-rows", nargs="+", choices=list(E2E_ROWS), default=list(E2E_ROWS),
                   help="end-to-end rows on CUDA: tabfm's eager bf16, compiled, with cuDNN's attention allowed "
                        "(default all; a CPU runs the eager row alone)")
    p.add_argument("--sections", nargs="+", choices=["model", "loader", "e2e"], default=["model", "loader", "e2e"])
    return p


def resolve(args: argparse.Namespace) -> torch.device:
    """The device, and every shape flag not given filled from the GPU or the CPU (smoke) defaults."""
    from tabfm.model import ModelConfig

    if args.cpu_smoke:
        args.device = "cpu"
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU is visible; use --device cpu or --cpu-smoke")
    defaults = GPU_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    counts = [("--batch", [args.batch], 1), ("--rows", [args.rows], 1), ("--features", args.features, 1),
              ("--steps", [args.steps], 1), ("--warmup", [args.warmup], 0),
              ("--loader-workers", args.loader_workers, 0), ("--e2e-steps", [args.e2e_steps], 1),
              ("--e2e-workers", [args.e2e_workers or 0], 0)]
    for flag, values, least in counts:  # else every row 'failed' (no median of 0 steps) and the run exits 0
        if min(values) < least:
            raise SystemExit(f"{flag} {min(values)}: give {least} or more")
    args.e2e_preset = args.e2e_preset or args.presets[-1]
    for name in {*args.presets, args.e2e_preset}:  # a typo fails here, not after minutes of a lease
        try:
            ModelConfig.load(name)  # a preset of configs/model (tiny ... small_wide, small_inducing) or a YAML file
        except ValueError as e:
            raise SystemExit(f"--presets / --e2e-preset: {e}") from None
    args.e2e_precision = args.e2e_precision or ("bf16" if args.device == "cuda" else "fp32")
    args.e2e_workers = max(args.loader_workers) if args.e2e_workers is None else args.e2e_workers
    return torch.device(args.device)


def header(device: torch.device) -> str | None:
    """Print the machine; return the GPU's name (None on CPU)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    load = os.getloadavg() if hasattr(os, "getloadavg") else ()
    say(f"# tabfm pretraining on one device: {name or 'CPU (' + platform.processor() + ')'}")
    say(f"torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs, load average "
        f"{' '.join(f'{x:.1f}' for x in load)}; peak TFLOP/s bf16/tf32/fp32: "
        f"{', '.join(fmt(peak_tflops(name, m)) for m in ('bf16', 'tf32', 'fp32'))}")
    return name


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = resolve(args)
    name = header(device)
    sections: dict[str, Callable[[], Any]] = {
        "model": lambda: model_section(args, device, name),
        "loader": lambda: loader_section(args),
        "e2e": lambda: e2e_section(args, device),
    }
    for section in args.sections:
        try:
            sections[section]()
        except Exception as e:  # noqa: BLE001 - never lose the sections after a failing one
            say(f"section {section} failed: {reason(e)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
