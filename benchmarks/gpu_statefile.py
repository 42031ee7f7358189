"""The GPU recipe's state file and history (benchmarks/gpu_state.py's first layer): a checkpoint folder packed
into one safetensors file and back, bit-exactly, and state.json, the recipe's history that names that file by
its sha256. Kept apart from the leg driver (benchmarks/gpu_leg.py) and the command line (benchmarks/gpu_state.py),
which both build on it."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file, save_file

STATE_FORMAT = "tabfm-gpu-state-v1"
HISTORY_FORMAT = "tabfm-gpu-recipe-v1"
STATE_FILE, HISTORY_FILE = "state.safetensors", "state.json"
FILE_PREFIX = "file/"
_FILE_NAME = re.compile(r"manifest\.json|rank[0-9]{3}\.safetensors")
"""The only files a packed checkpoint folder may hold (no separators: unpacking never leaves the folder)."""
MAX_STATE_BYTES = 1 << 30


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_atomic(path: Path, write: Any) -> None:
    """Write through `write(tmp_path)` beside `path`, then rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    tmp.replace(path)


# ---------------------------------------------------------------------------------------------------------
# pack / unpack: a checkpoint folder <-> one file
# ---------------------------------------------------------------------------------------------------------

def _folder_files(ckpt_dir: Path) -> tuple[dict, list[str]]:
    """The manifest of a checkpoint folder and the files to pack (manifest first), each rank file's checksum
    checked against the manifest, so a torn or edited folder is never packed."""
    manifest_path = ckpt_dir / "manifest.json"
    if not manifest_path.is_file():
        raise ValueError(f"{ckpt_dir} is not a checkpoint folder (no manifest.json); give a run's step_N folder")
    manifest = json.loads(manifest_path.read_text())
    names = sorted(manifest.get("files", {}))
    for name in names:
        if not _FILE_NAME.fullmatch(name):
            raise ValueError(f"{ckpt_dir}: its manifest lists {name!r}, not a rank file")
        if sha256(ckpt_dir / name) != manifest["files"][name]["sha256"]:
            raise ValueError(f"{ckpt_dir}/{name} does not match its manifest's checksum: the folder is damaged")
    return manifest, ["manifest.json", *names]


def pack(ckpt_dir: str | Path, out: str | Path) -> dict[str, Any]:
    """Pack checkpoint folder `ckpt_dir` into the single file `out` (replaced atomically); returns its step,
    data position, size and sha256."""
    ckpt_dir, out = Path(ckpt_dir), Path(out)
    manifest, names = _folder_files(ckpt_dir)
    tensors = {FILE_PREFIX + n: np.frombuffer((ckpt_dir / n).read_bytes(), dtype=np.uint8) for n in names}
    meta = {"format": STATE_FORMAT, "step": str(manifest["step"]), "source": ckpt_dir.name}
    _write_atomic(out, lambda tmp: save_file(tensors, str(tmp), meta))
    return {"step": int(manifest["step"]), "data_position": manifest.get("data_position", {}),
            "bytes": out.stat().st_size, "sha256": sha256(out)}


def read_state(path: str | Path) -> tuple[int, dict[str, bytes]]:
    """(step, {file name: bytes}) of a state file, checked: our format, only manifest and rank files, and the
    rank files' checksums against the manifest. Nothing is written."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such state file")
    if path.stat().st_size > MAX_STATE_BYTES:
        raise ValueError(f"{path} is larger than any state ({MAX_STATE_BYTES} bytes); it is not one")
    try:
        with safe_open(str(path), "np") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path} cannot be read as a state file ({e})") from None
    if meta.get("format") != STATE_FORMAT:
        raise ValueError(f"{path} is not a {STATE_FORMAT} file (format {meta.get('format')!r})")
    files = {}
    for key, t in tensors.items():
        name = key[len(FILE_PREFIX):]
        if not key.startswith(FILE_PREFIX) or not _FILE_NAME.fullmatch(name) or t.dtype != np.uint8:
            raise ValueError(f"{path} holds {key!r}, not a checkpoint file")
        files[name] = t.tobytes()
    try:
        manifest = json.loads(files["manifest.json"])
        step, listed = manifest["step"], {n: i["sha256"] for n, i in manifest["files"].items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ValueError(f"{path}: its manifest.json is missing or damaged (no step or file checksums)") from None
    if not isinstance(step, int) or step < 0 or set(listed) != set(files) - {"manifest.json"}:
        raise ValueError(f"{path}: its manifest's step or file list does not match the files it holds")
    for name, digest in listed.items():
        if hashlib.sha256(files[name]).hexdigest() != digest:
            raise ValueError(f"{path}: {name} does not match the manifest's checksum")
    return step, files


def unpack(state: str | Path, run_dir: str | Path) -> Path:
    """Write the checkpoint of `state` into <run_dir>/checkpoints/step_N with `latest` naming it, so that
    `tabfm pretrain ... --set train.out_dir=RUN_DIR --resume auto` continues it. Refused when run_dir holds a
    run already. Returns the checkpoint folder."""
    from tabfm import checkpoint as ckpt

    run_dir = Path(run_dir)
    step, files = read_state(state)
    if (run_dir / "metrics.jsonl").exists() or any((run_dir / "checkpoints").glob("*")):
        raise ValueError(f"{run_dir} already holds a run; unpack into a new folder")
    root = run_dir / "checkpoints"
    folder = root / f"step_{step:07d}"
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True)
    try:
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        ckpt.verify_checkpoint(tmp)  # every check a resume runs, against this code's model
    except ValueError:
        shutil.rmtree(tmp)
        raise
    tmp.rename(folder)
    ckpt.mark_latest(root, folder.name)
    return folder


# ---------------------------------------------------------------------------------------------------------
# state.json: the recipe's history
# ---------------------------------------------------------------------------------------------------------

def read_history(path: str | Path) -> dict[str, Any]:
    """A state.json, checked for its format and the fields the leg and adopt read."""
    path = Path(path)
    try:
        history = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read as the recipe's state.json ({e})") from None
    if not isinstance(history, dict) or history.get("format") != HISTORY_FORMAT:
        raise ValueError(f"{path} is not a {HISTORY_FORMAT} state.json")
    for key, kind in (("step", int), ("legs", list), ("state_file", dict), ("tables_seen", int)):
        if not isinstance(history.get(key), kind):
            raise ValueError(f"{path}: field {key!r} is missing or not a {kind.__name__}")
    return history


def write_history(path: Path, history: dict[str, Any]) -> None:
    """Write state.json atomically: a lease cut mid-write leaves the previous one whole."""
    _write_atomic(path, lambda tmp: tmp.write_text(json.dumps(history, indent=1) + "\n"))


def committed(state_dir: Path) -> tuple[dict[str, Any] | None, Path | None]:
    """The committed (history, state file), both None before the first leg; refused when they disagree."""
    hist_path, state_path = state_dir / HISTORY_FILE, state_dir / STATE_FILE
    if not hist_path.exists() and not state_path.exists():
        return None, None
    if not (hist_path.is_file() and state_path.is_file()):
        raise ValueError(f"{state_dir} needs both {STATE_FILE} and {HISTORY_FILE} (or neither, before the first "
                         "leg); restore the missing one from git")
    history = read_history(hist_path)
    if sha256(state_path) != history["state_file"].get("sha256"):
        raise ValueError(f"{state_path} is not the state {hist_path} describes (sha256 differs); restore both "
                         "from the same commit")
    return history, state_path
