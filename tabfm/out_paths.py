"""Where a command may write, checked before it does any work: a chart's .png name, a folder that a file above it
would block, the name of a run's checkpoints folder, and where the benchmark scripts write when given no path.
Standard library only, so a launching process checks these without importing torch, and every command says the
same thing about the same mistake."""

from __future__ import annotations

import secrets
from pathlib import Path

BENCHMARK_RUNS = Path("runs") / "benchmarks"
"""Where the benchmark scripts (benchmarks/*.py) write their text, csv and png when given no output path: a folder
under runs/, which git ignores, made when the first file is written. benchmarks/results/ holds the curated results
that README quotes; a script writes there only when given the path (e.g. --txt benchmarks/results/inference.txt),
so a short trial run never replaces a full run's log."""


def benchmark_output(name: str) -> Path:
    """The default path of a benchmark's output file `name`: BENCHMARK_RUNS / name (relative to the working folder,
    as the paths given on the command line are)."""
    return BENCHMARK_RUNS / name


CHECKPOINTS = "checkpoints"
"""The folder of a run's out_dir that holds its step_<digits> checkpoints and the `latest` pointer."""


def checkpoints_of(out_dir: str | Path) -> Path:
    """The checkpoints folder of the run in `out_dir`."""
    return Path(out_dir) / CHECKPOINTS


def file_in_the_way(path: str | Path) -> Path | None:
    """The nearest existing path above `path` when it is not a folder (so `path` can never be made), else None."""
    above = next((p for p in Path(path).parents if p.exists()), None)
    return above if above is not None and not above.is_dir() else None


def check_png(path: str | Path, flag: str) -> Path:
    """`path` as a chart can be written there: a file name ending in .png (matplotlib would otherwise add .png,
    or pick another format from the suffix), not a folder, with no file where a folder above it must be.
    `flag` names the option in the message, e.g. "--png"."""
    p = Path(path)
    if p.is_dir() or p.suffix.lower() != ".png":
        raise ValueError(f"{flag} {path}: give a file name ending in .png")
    blocker = file_in_the_way(p)
    if blocker is not None:
        raise ValueError(f"{flag} {path}: {blocker} is a file, not a folder")
    return p


def check_text_output(path: str | Path, flag: str, what: str) -> Path:
    """`path` as a file can be written there: not a folder, with no file where a folder above it must be. `flag`
    and `what` name the option and the file in the message, e.g. "--txt" and "the results text"."""
    p = Path(path)
    blocker = p if p.is_dir() else file_in_the_way(p)
    if blocker is not None:
        raise ValueError(f"{flag} {path}: {blocker} is {'a folder' if blocker == p else 'a file, not a folder'}; "
                         f"give a file name for {what}")
    return p


def private_name(path: Path, kind: str) -> Path:
    """A name beside `path` that no file of the user's has (hidden, with a random part): where a command writes
    before renaming into place, or puts an output it replaces until then."""
    return path.with_name(f".{path.name}.{kind}-{secrets.token_hex(4)}")

