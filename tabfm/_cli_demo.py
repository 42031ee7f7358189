"""`tabfm demo`: train a small ATP block stack on N ranks and check it against one process.

It launches itself under torchrun (`tabfm demo --nproc 4 --layout 2x2`); each rank trains the same model on
its (d0, d1) mesh, rank 0 also trains the one-process reference and prints both loss curves, their largest
relative difference, and the collectives each axis ran per step. Until pretraining exists this is the
project's main job; it shows the layers working end to end with nothing but CPUs.
"""

from __future__ import annotations

import argparse
import copy
import sys
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch


class Layout(NamedTuple):
    """A tensor-parallel mesh d0 x d1 given on the command line; str() is its command-line form, so the launcher
    can hand it on to the ranks (tabfm.launch.worker_argv)."""

    d0: int
    d1: int

    def __str__(self) -> str:
        return f"{self.d0}x{self.d1}"


def parse_layout(text: str) -> Layout:
    """'2x2' -> Layout(2, 2), equal to the tuple (2, 2)."""
    try:
        d0, d1 = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"layout must look like 2x2 (d0 x d1), got {text!r}") from None
    if d0 < 1 or d1 < 1:
        raise argparse.ArgumentTypeError(f"layout degrees must be positive, got {text!r}")
    return Layout(d0, d1)


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layout", type=parse_layout, default=Layout(2, 2),
                        help="tensor-parallel mesh d0xd1: d0 ranks on axis 0 times d1 on axis 1 (default: 2x2)")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="shard the tokens over axis 0 too (default: tokens whole on every rank)")
    parser.add_argument("--steps", type=int, default=30, help="AdamW steps to train (default: 30)")
    parser.add_argument("--depth", type=int, default=2, help="transformer blocks in the stack (default: 2)")
    parser.add_argument("--hidden", type=int, default=64,
                        help="hidden width; must divide by d1 for the sharded norms (default: 64)")
    parser.add_argument("--heads", type=int, default=8,
                        help="attention heads; must divide by d0*d1 (default: 8)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per sequence, 8 sequences a step (default: 32)")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="train a small ATP block stack on N CPU ranks vs one process")
    parser.add_argument("--nproc", type=int, default=None, help="processes to launch (default: d0*d1)")
    _arguments(parser)
    parser.set_defaults(run=launch)


def worker_parser() -> argparse.ArgumentParser:
    """The parser each rank reads its arguments with (the demo's options less --nproc)."""
    parser = argparse.ArgumentParser(prog="python -m tabfm._cli_demo")
    _arguments(parser)
    return parser


def check_arguments(args: argparse.Namespace) -> torch.nn.Sequential:
    """The plain block stack the options describe, once they are checked; ValueError (LayoutError for a layout
    that does not fit it), one line, for what every rank would otherwise fail on with a traceback, or train on
    without a word (--tokens 0 gave NaN losses)."""
    import torch

    from tabfm.parallel import dense
    from tabfm.parallel.parallelize import block_plan, check_layout

    for flag in ("steps", "depth", "hidden", "heads", "tokens"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    d0, d1 = args.layout
    if args.sequence_parallel and args.tokens % d0:
        raise ValueError(f"--sequence-parallel splits the --tokens {args.tokens} over d0={d0}: give a multiple of "
                         f"{d0}")
    if args.hidden % args.heads:
        raise ValueError(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    torch.manual_seed(0)
    plain = torch.nn.Sequential(dense.BlockStack(args.depth, args.hidden, args.heads))
    check_layout(plain, block_plan("0"), d0, d1)
    return plain


def launch(args: argparse.Namespace) -> int:
    """Check the options here, then run this module under torchrun with the same arguments: a mistake is one line,
    not a traceback from every rank."""
    from tabfm.launch import run_torchrun, worker_argv

    d0, d1 = args.layout
    nproc = d0 * d1 if args.nproc is None else args.nproc
    if nproc != d0 * d1:
        print(f"error: layout {d0}x{d1} needs {d0 * d1} processes, not --nproc {nproc}", file=sys.stderr)
        return 2
    try:
        check_arguments(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run_torchrun(__name__, worker_argv(worker_parser(), args), nproc)


def _train(model, mesh, sp: bool, steps: int, tokens: int, hidden: int) -> list[float]:
    import torch

    from tabfm.parallel.layers import gather_activation, shard_activation

    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    data = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, tokens, hidden, generator=data)
        target = torch.sin(x.cumsum(-2) / tokens)  # a target that needs attention across tokens
        y = gather_activation(model(shard_activation(x, mesh, sp)), mesh, sp)
        loss = torch.nn.functional.mse_loss(y, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _report(losses: list[float], reference: list[float], mesh, args: argparse.Namespace) -> None:
    """Both loss curves at three steps, their largest relative difference, and each axis's collectives."""
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    print(f"layout {mesh}, sequence parallel {args.sequence_parallel}, {args.steps} AdamW steps")
    print(f"{'step':>5} {'loss (ATP)':>12} {'loss (1 proc)':>14}")
    for step in sorted({0, args.steps // 2, args.steps - 1}):
        print(f"{step:>5} {losses[step]:>12.6f} {reference[step]:>14.6f}")
    print(f"largest relative difference: {worst:.2e}")
    for name in ("tp0", "tp1"):
        tally = mesh.axis(name).tally
        calls = {k: v // args.steps for k, v in tally.calls.items()}
        mb = float(tally.total_traffic) / args.steps / 2**20
        print(f"axis {name}: per step {calls or 'no collectives'}, ring traffic {mb:.3f} MiB per device")


def main(argv: list[str] | None = None) -> int:
    """Entry point of each rank (and of one process): train on the mesh; rank 0 compares with one process."""
    import torch.distributed as dist

    from tabfm.parallel.mesh import ParallelDims, TPMesh
    from tabfm.parallel.parallelize import block_plan, parallelize
    from tabfm.parallel.process_group import process_group, world_size_from_env

    args = worker_parser().parse_args(argv)
    d0, d1 = args.layout
    plain = check_arguments(args)  # before any process group starts
    world = world_size_from_env()
    ParallelDims(d0, d1).check_world_size(world)
    with process_group("cpu"):
        mesh = ParallelDims(d0, d1).build("cpu") if world > 1 else TPMesh.single()
        model = parallelize(copy.deepcopy(plain), mesh, block_plan("0"), sequence_parallel=args.sequence_parallel)
        losses = _train(model[0], mesh, args.sequence_parallel, args.steps, args.tokens, args.hidden)
        if world == 1 or dist.get_rank() == 0:
            reference = _train(plain[0], TPMesh.single(), False, args.steps, args.tokens, args.hidden)
            _report(losses, reference, mesh, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
