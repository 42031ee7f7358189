"""The `tabfm` command: one subcommand per job, each defined in the module that owns the job."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    """The full parser; subcommands register themselves through their `add_parser(subparsers)`."""
    from tabfm import _cli_demo, _cli_gen, _cli_plan, _cli_predict, _cli_train

    parser = argparse.ArgumentParser(prog="tabfm", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (_cli_train, _cli_predict, _cli_plan, _cli_demo, _cli_gen):
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `tabfm` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
