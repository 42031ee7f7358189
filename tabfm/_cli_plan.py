"""`tabfm plan`: rank every ATP layout of N ranks for a model on a topology (tabfm.parallel.planner)."""

from __future__ import annotations

import argparse
import sys


def _preset_names() -> list[str]:
    """The topology presets, listed without importing tabfm.parallel.topology (it imports torch, which would make
    `tabfm --help` take seconds): the same folder as topology.preset_dir(), found from where that module lives."""
    import importlib.util
    import os
    from pathlib import Path

    spec = importlib.util.find_spec("tabfm.parallel.topology")
    repo_configs = Path(spec.origin).resolve().parents[1] / "configs" / "topology" if spec and spec.origin else None
    folder = os.environ.get("TABFM_TOPOLOGY_DIR") or repo_configs
    return sorted(p.stem for p in Path(folder).glob("*.yaml")) if folder and Path(folder).is_dir() else []


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `plan` on the `tabfm` command."""
    presets = _preset_names()
    p = subparsers.add_parser(
        "plan",
        help="rank the tensor-parallel layouts of N ranks for a model (ATP planner)",
        description="Count each layout's collectives from the model's own layers (a dry run on the meta device), "
        "price them on a topology (a preset machine, or this one measured), and print every layout d0 x d1 x "
        "sequence parallelism x overlap chunks ranked by predicted step time, with the rejected ones and why.",
    )
    p.add_argument("--config", required=True, help="YAML with a `model:` section (and optionally `plan:`), "
                   "e.g. configs/plan/transformer_small.yaml")
    p.add_argument("--nproc", type=int, required=True, help="tensor-parallel ranks N = d0 * d1")
    p.add_argument("--topology", default="measure",
                   help=f"a preset ({', '.join(presets) or 'none found'}), a path to a preset YAML, or 'measure' "
                   "(this machine: collective microbenchmarks on N local ranks, cached after the first run; "
                   "default)")
    p.add_argument("--png", default=None, help="write a bar chart of the ranking here")
    p.add_argument("--top", type=int, default=None, help="print only the best TOP candidates (rejected ones "
                   "are always listed)")
    p.set_defaults(run=run)


def _source(path: str):
    """A plan config (`model: {kind: transformer, ...}`) or a pretraining run config (the TabFM it trains, on its
    largest tables): the planner's model source and search options."""
    from pathlib import Path

    import yaml

    from tabfm.parallel import planner

    raw = yaml.safe_load(Path(path).read_text()) if Path(path).is_file() else None
    model = raw.get("model") if isinstance(raw, dict) else None
    if isinstance(model, dict) and model.get("kind", "transformer") == "transformer" and "embed_dim" not in model:
        return planner.load_config(path)
    from tabfm.config import load_config
    from tabfm.layout import source_for

    cfg = load_config(path)
    return source_for(cfg), planner.PlanOptions(dtype=cfg.train.compute_dtype)


def run(args: argparse.Namespace) -> int:
    """Print the ranked table (and draw it); 0 on success, 2 on bad input (with what to change)."""
    from tabfm.parallel import planner
    from tabfm.parallel.topology import load_or_measure, load_preset

    try:
        spec, options = _source(args.config)
        if args.nproc < 1:
            raise ValueError(f"--nproc must be a positive integer, got {args.nproc}")
        if args.topology == "measure":
            topology = load_or_measure(args.nproc)
        else:
            topology = load_preset(args.topology)
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
