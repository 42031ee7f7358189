"""A run's checkpoint folders: <out_dir>/checkpoints/step_<digits>/ and a `latest` file naming the newest.

A `latest` file must name a step_<digits> folder beside it; only complete step_<digits> folders (their manifest
written, which a save does last) count as checkpoints, never step_N.tmp. After each save, `mark_latest` points
`latest` at it and `prune_checkpoints` keeps the newest few and removes what interrupted saves left.
"""

from __future__ import annotations

import re
import reprlib
import shutil
from pathlib import Path

from tabfm.checkpoint_format import MANIFEST
from tabfm.out_paths import checkpoints_of

LATEST = "latest"
STEP_DIR = re.compile(r"step_[0-9]+")
"""The name of a complete checkpoint of a run. An interrupted save leaves step_N.tmp (and replacing a folder
briefly leaves step_N.old): they never count as checkpoints, and pruning removes them."""
_LEFTOVER = re.compile(r"step_[0-9]+(\.tmp|\.old)?")


def _complete(path: Path) -> bool:
    """A real folder (not a link leading elsewhere) whose manifest was written: saves write it last."""
    return path.is_dir() and not path.is_symlink() and (path / MANIFEST).is_file()


def step_checkpoints(ckpt_root: str | Path) -> list[Path]:
    """A run's complete checkpoints (step_<digits> folders holding a manifest), oldest first by step number."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.fullmatch(p.name) and _complete(p)]
    return sorted(found, key=lambda p: int(p.name[len("step_"):]))


def _pointer_name(pointer: Path) -> str:
    """The folder name a `latest` file holds, accepted only as step_<digits>: no separator, no '..', so an
    edited or hostile file cannot lead a resume outside the run's checkpoints folder."""
    try:
        with open(pointer, "rb") as f:
            name = f.read(256).decode().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{pointer} cannot be read as a checkpoint name ({e})") from None
    if not STEP_DIR.fullmatch(name):
        raise ValueError(f"{pointer} names {reprlib.repr(name)}, not a step_<digits> folder beside it; delete the "
                         "file (resuming then takes the newest complete step_* folder) or write such a name into it")
    return name


def read_latest(pointer: str | Path) -> Path:
    """The checkpoint folder a `latest` file names: a step_<digits> folder beside it that exists."""
    pointer = Path(pointer)
    path = pointer.parent / _pointer_name(pointer)
    if not path.is_dir() or path.is_symlink():
        raise ValueError(f"{pointer} names {path.name}, which is not a folder beside it")
    return path


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The checkpoint a run resumes from: the one <out_dir>/checkpoints/latest names when it is complete, else
    the newest complete step_<digits> folder; None when there is none. A `latest` file naming anything but a
    step_<digits> folder is refused (ValueError)."""
    root = checkpoints_of(out_dir)
    if root.is_symlink():
        raise ValueError(f"{root} is a link (to {root.resolve()}); a run reads checkpoints of its own folder only: "
                         "copy them in, or point train.out_dir (or the command) at the run that holds them")
    pointer = root / LATEST
    if pointer.is_file():
        named = root / _pointer_name(pointer)
        if _complete(named):
            return named
    found = step_checkpoints(root)
    return found[-1] if found else None


def mark_latest(ckpt_root: str | Path, name: str, keep: int = 0) -> list[Path]:
    """After the save of `name` completed: point `latest` at it (write, then rename), then prune_checkpoints."""
    if not STEP_DIR.fullmatch(name):
        raise ValueError(f"checkpoint name {name!r} is not step_<digits>")
    root = Path(ckpt_root)
    tmp = root / (LATEST + ".tmp")
    tmp.write_text(name + "\n")
    tmp.replace(root / LATEST)
    return prune_checkpoints(root, keep, protect=name)


def prune_checkpoints(ckpt_root: str | Path, keep: int, protect: str | None = None) -> list[Path]:
    """Keep the newest `keep` complete checkpoints (all when 0) and `protect`; remove the older ones and what
    interrupted saves left behind (step_N.tmp, step_N.old, a step_N without manifest). Call it only between
    saves. Each removal first deletes the manifest, so a prune killed midway leaves no folder that looks
    complete. Returns the removed folders."""
    root = Path(ckpt_root)
    done = step_checkpoints(root)
    doomed = [p for p in (done[:-keep] if keep else []) if p.name != protect]
    doomed += [p for p in root.iterdir() if _LEFTOVER.fullmatch(p.name) and p.is_dir() and not p.is_symlink()
               and p not in done]
    for p in doomed:
        (p / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(p, ignore_errors=True)
    return doomed

