"""`python tests/fault_worker.py --kill-before STEP --kill-rank R --marker FILE <python -m tabfm.pretrain args>`:
tabfm.pretrain's main with a step hook that makes rank R SIGKILL itself just before step STEP (0-based), once per
marker file (the file records that it fired, so the workers torchrun restarts run through). Run under torchrun by
tests/test_pretrain.py; the training loop itself carries no fault injection."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from tabfm import pretrain


def kill_once(at: int, rank: int, marker: Path) -> Callable[[int], None]:
    """A step hook: on rank `rank`, before step `at`, create `marker` (only if it does not exist yet) and die."""

    def hook(step: int) -> None:
        me = dist.get_rank() if dist.is_initialized() else 0
        if step != at or me != rank:
            return
        marker.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # fire once, even across restarts
        except FileExistsError:
            return
        os.write(fd, f"rank {me} killed itself before step {step}\n".encode())
        os.fsync(fd)
        os.close(fd)
        print(f"fault_worker: rank {me} kills itself before step {step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    return hook


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tests/fault_worker.py")
    parser.add_argument("--kill-before", type=int, required=True)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--marker", type=Path, required=True)
    args, rest = parser.parse_known_args(argv)
    return pretrain.main(rest, hooks=[kill_once(args.kill_before, args.kill_rank, args.marker)])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
