"""The `tabfm` command: one subcommand per job, each defined in the module that owns the job.

Building the parser imports no torch (the subcommand modules import it inside the functions that run the job), so
`tabfm --help` and `tabfm predict --help` answer at once; tests/test_cli.py checks it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def version() -> str:
    """The installed distribution's version, or the source tree's when tabfm is not installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("tabfm")
    except PackageNotFoundError:
        from tabfm import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    """The full parser; subcommands register themselves through their `add_parser(subparsers)`."""
    from tabfm import _cli_demo, _cli_gen, _cli_plan, _cli_predict, _cli_train

    parser = argparse.ArgumentParser(prog="tabfm", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"tabfm {version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (_cli_train, _cli_predict, _cli_plan, _cli_demo, _cli_gen):
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `tabfm` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print(f"tabfm {args.command}: interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # a full disk, a read-only folder: what the file system said, not a traceback
        print(f"tabfm {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
