"""Refusing a fit whose cached keys and values cannot fit in memory, before anything is encoded.

Why: an estimator keeps the keys and values of every context's train rows (tabfm.model.Context), about 28 KiB per
train row per member at 20 columns on a CPU in float32, so the default's 4 members hold about 11 GiB at 100,000 train
rows and 110 GiB at a million. Past the machine's memory the operating system kills the process (a notebook's
kernel dies, a script ends without a traceback) after minutes of preprocessing and encoding. The contexts are
drawn before any is encoded, so their caches' bytes are known exactly (tabfm.forward_sizes.context_cache_bytes)
and a fit that cannot hold them is refused there, with what would fit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tabfm.forward_sizes import context_cache_bytes
from tabfm.model import ModelConfig

GIB = 1 << 30
MEMINFO = "/proc/meminfo"
PROC_CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"
UNLIMITED = 1 << 60
"""A cgroup v1 limit at or above this is no limit (the kernel writes 9223372036854771712 for none)."""


def _size(n: int) -> str:
    """Bytes as GiB, or as MiB under one GiB."""
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


def available_bytes(device: torch.device) -> int | None:
    """Memory a fit may still take on `device`: on a CPU, Linux's MemAvailable (free memory plus what the kernel can
    reclaim without swapping) or the room under the process's cgroup limit, whichever is smaller; on CUDA the free
    device memory plus what PyTorch's caching allocator holds unused; None where it is not known (another OS,
    another accelerator): nothing is checked there."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type != "cpu":
        return None
    known = [room for room in (_meminfo_available(), _cgroup_room()) if room is not None]
    return min(known) if known else None


def _read(path: Path) -> str:
    return path.read_text().strip()


def _meminfo_available() -> int | None:
    """Linux's MemAvailable: the machine's (a container sees its host's)."""
    try:
        for line in _read(Path(MEMINFO)).splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room() -> int | None:
    """Room under this process's cgroup memory limits (a container's, a Kubernetes pod's, a systemd unit's): the
    smallest over its cgroup and the ancestors that have a limit (a child without one lives within its parent's)
    of the limit less what that cgroup uses, its inactive file cache not counted (the kernel reclaims it first, as
    `docker stats` reckons); None without a limit or where cgroups cannot be read. cgroup v1's memory controller or
    v2's unified hierarchy, at the path /proc/self/cgroup names, else at the mount's root (a container's own view)."""
    try:
        lines = _read(Path(PROC_CGROUP)).splitlines()
    except OSError:
        return None
    v1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    v2 = ("memory.max", "memory.current", "inactive_file")
    places = []
    for line in lines:
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if "memory" in controllers.split(","):
            root = Path(CGROUP_ROOT) / "memory"
            places += [(root / path.lstrip("/"), root, v1), (root, root, v1)]
        elif number == "0":
            root = Path(CGROUP_ROOT)
            places += [(root / path.lstrip("/"), root, v2), (root, root, v2)]
    for folder, root, files in places:
        try:
            rooms = [_room(folder, *files)]
        except (OSError, ValueError):
            continue  # not this place: the next one
        for parent in folder.parents if folder != root else []:
            if parent != root and root not in parent.parents:
                break
            try:
                rooms.append(_room(parent, *files))
            except (OSError, ValueError):
                break  # above the part of the hierarchy this process can read
        limited = [room for room in rooms if room is not None]
        return min(limited) if limited else None
    return None


def _room(folder: Path, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    """One cgroup's limit less its usage without inactive file cache; None when it has no limit. Raises OSError
    or ValueError where its files cannot be read."""
    limit = _read(folder / limit_file)
    if limit == "max" or int(limit) >= UNLIMITED:
        return None
    stat = dict(line.split() for line in _read(folder / "memory.stat").splitlines() if line.count(" ") == 1)
    return max(0, int(limit) - (int(_read(folder / usage_file)) - int(stat.get(inactive_key, 0))))


def check_cache_fits(member_bytes: list[int], train_rows: int, device: torch.device,
                     available: int | None = None) -> None:
    """Raise MemoryError, saying what would fit, when the members' caches (member_bytes: each member's, in bytes)
    need more than the memory `available` on `device` (default: available_bytes(device))."""
    available = available_bytes(device) if available is None else available
    need = sum(member_bytes)
    if available is None or need <= available:
        return
    largest = max(member_bytes)
    fitting = available // largest if largest else 0
    rows = train_rows * available // need  # the caches grow in proportion to the rows
    members = f", pass n_estimators={fitting} or fewer (each member holds up to {_size(largest)})" if fitting else ""
    raise MemoryError(f"these {train_rows:,} train rows would hold {_size(need)} of cached keys and values "
                      f"({len(member_bytes)} members), more than the {_size(available)} of memory available on "
                      f"{device}: fit on a sample of at most about {rows:,} rows{members}, or pass a smaller "
                      "max_features")


def check_contexts(config: ModelConfig, rows: int, counts: list[int] | np.ndarray, widths: np.ndarray,
                   element_size: int, train_rows: int, device: torch.device) -> None:
    """check_cache_fits for an estimator's drawn contexts, each of `rows` train rows: counts [M] how many each
    member has, widths [M] the columns each member shows. Skipped under torch.distributed: the ranks of one
    machine share its memory and read it at different moments, so one might refuse while the others go on into
    collectives that would then wait for it forever."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    member_bytes = [int(count) * context_cache_bytes(config, rows, int(width), element_size)
                    for count, width in zip(counts, widths, strict=True)]
    check_cache_fits(member_bytes, train_rows, device)
