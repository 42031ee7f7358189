"""`tabfm plan`: rank every ATP layout of N ranks for a model on a topology (tabfm.parallel.planner)."""

from __future__ import annotations

import argparse
import sys

from tabfm.out_paths import check_png


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `plan` on the `tabfm` command."""
    from tabfm.config_io import preset_names  # imports no torch: `tabfm --help` stays fast

    presets = preset_names("topology")
    p = subparsers.add_parser(
        "plan",
        help="rank the tensor-parallel layouts of N ranks for a model (ATP planner)",
        description="Count each layout's collectives from the model's own layers (a dry run on the meta device), "
        "price them on a topology (a preset machine, or this one measured), and print every layout d0 x d1 x "
        "sequence parallelism x overlap chunks ranked by predicted step time, with the rejected ones and why.",
    )
    p.add_argument("--config", required=True, help="a pretraining run config (plans the TabFM it trains, e.g. "
                   "configs/pretrain/large.yaml) or a plan config with a plain transformer (model: {kind: "
                   "transformer, ...}, e.g. configs/plan/transformer_small.yaml); either may hold a `plan:` section")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="A.B=C",
                   help="override config fields, e.g. model.depth=4 plan.chunks=[1,2]")
    p.add_argument("--nproc", type=int, required=True, help="tensor-parallel ranks N = d0 * d1")
    p.add_argument("--topology", default="measure",
                   help=f"a preset ({', '.join(presets) or 'none found'}), a path to a preset YAML, or 'measure' "
                   "(this machine: collective microbenchmarks on N local ranks, cached after the first run; "
                   "default)")
    p.add_argument("--png", default=None, help="write a bar chart of the ranking here")
    p.add_argument("--top", type=int, default=None, help="print only the best TOP candidates (rejected ones "
                   "are always listed)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print the ranked table (and draw it); 0 on success, 2 on bad input (with what to change)."""
    from tabfm.config import load_topology
    from tabfm.layout import source_for
    from tabfm.parallel import planner
    from tabfm.parallel.plan_trace import TransformerSpec
    from tabfm.parallel.topology import load_or_measure
    from tabfm.plan_config import load_plan

    try:
        cfg = load_plan(args.config, args.set)
        spec = cfg.model if isinstance(cfg.model, TransformerSpec) else source_for(cfg)
        options = cfg.options()
        if args.nproc < 1:
            raise ValueError(f"--nproc must be a positive integer, got {args.nproc}")
        if args.top is not None and args.top < 1:
            raise ValueError(f"--top must be a positive integer, got {args.top}")
        if args.png:  # checked before the planning, not after it
            check_png(args.png, "--png")
        if args.topology == "measure":
            planner.check_shapes_fit(spec, args.nproc)  # before timing that many local ranks
            topology = load_or_measure(args.nproc)
        else:
            topology = load_topology(args.topology, args.nproc)
        ranked = planner.plan(spec, topology, args.nproc, **options.kwargs())
        best, reason = planner.choose_layout_from(ranked, topology)
    except ValueError as e:
        print(f"tabfm plan: {e}", file=sys.stderr)
        return 2
    print(f"model: {spec.describe()}")
    print(f"topology: {topology.name}: {topology.description}")
    print(f"dtype: {planner.dtype_name(options.dtype or topology.dtype)}; optimizer: {options.optimizer}; "
          f"{args.nproc} ranks")
    print(planner.table(ranked, top=args.top))
    print(f"best: {reason}")
    if args.png:
        path = planner.draw(ranked, args.png, title=f"{spec.describe()}\n{args.nproc} ranks on {topology.name}")
        print(f"wrote {path}")
    return 0
