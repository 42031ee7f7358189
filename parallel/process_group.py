"""How a rank joins the process group: the one place every job (pretrain, predict, demo, topology measurement)
creates and leaves it.

    with process_group("cuda"):      # under torchrun: WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR/PORT set by it
        ...                          # one process (WORLD_SIZE unset or 1): no process group, the body just runs
    with process_group("cpu", rank=r, world_size=n, init_method="tcp://127.0.0.1:PORT"):   # self-spawned ranks
        ...

The backend follows the device (NCCL for CUDA, each rank on its LOCAL_RANK's GPU; gloo otherwise). Under
torchrun's agent store each restart attempt (`--max-restarts`) rendezvous under keys of its own: the agent keeps
one store across attempts, and a restarted rank could otherwise read the address a dead worker of the previous
attempt published (and fail to connect to it).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

STORE_TIMEOUT = timedelta(minutes=10)
"""How long a rank waits for the agent's store when the caller gives no timeout."""


def backend_for(device: str | torch.device) -> str:
    """NCCL for a CUDA device (or "auto" with a GPU visible), gloo for everything else."""
    if str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return "nccl" if torch.device(device).type == "cuda" and torch.cuda.is_available() else "gloo"


def world_size_from_env() -> int:
    """The process count torchrun launched (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_process_group(device: str | torch.device = "cpu", *, timeout: timedelta | None = None,
                       rank: int | None = None, world_size: int | None = None,
                       init_method: str | None = None) -> str:
    """Join the process group with the backend of `device` and return the backend. The rendezvous is
    `init_method` (e.g. tcp://HOST:PORT, for ranks started by torch.multiprocessing) or else the environment
    (MASTER_ADDR/PORT, as torchrun sets them); rank and world size are the arguments, or else RANK / WORLD_SIZE.
    timeout: of the collectives and the rendezvous (None: torch's default)."""
    backend = backend_for(device)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank or 0)))
    extra = {} if timeout is None else {"timeout": timeout}
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if init_method is None and attempt is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timeout or STORE_TIMEOUT)
        dist.init_process_group(backend, store=dist.PrefixStore(f"tabfm/attempt_{attempt}", store),
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), **extra)
        return backend
    if rank is not None and world_size is not None:
        extra.update(rank=rank, world_size=world_size)
    dist.init_process_group(backend, init_method=init_method, **extra)
    return backend


@contextlib.contextmanager
def process_group(device: str | torch.device = "cpu", *, timeout: timedelta | None = None,
                  rank: int | None = None, world_size: int | None = None,
                  init_method: str | None = None) -> Iterator[bool]:
    """Join the process group for the body and leave it after, even on an error. Yields whether this call
    started it: not on one process (world size 1) nor when a process group exists already (a caller's)."""
    size = world_size if world_size is not None else world_size_from_env()
    started = size > 1 and not dist.is_initialized()
    if started:
        init_process_group(device, timeout=timeout, rank=rank, world_size=world_size, init_method=init_method)
    try:
        yield started
    finally:
        if started and dist.is_initialized():
            dist.destroy_process_group()
