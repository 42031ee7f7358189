"""How an estimator gets its model: the shipped weights or a checkpoint, one shared plain copy per (weights,
device, dtype), or a tensor-parallel copy on a mesh of this run's processes (one mesh per layout)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from tabfm.model import TabFM

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent / "weights" / "tabfm-small.safetensors"


def _mesh(d0: int, d1: int, device: torch.device):
    """The d0 x d1 mesh over this run's processes (every rank asks for it at the same point of fit)."""
    import torch.distributed as dist

    from tabfm.parallel.mesh import LayoutError

    world = dist.get_world_size() if dist.is_initialized() else 1
    if d0 * d1 != world:
        raise LayoutError(f"tensor_parallel=({d0}, {d1}) needs {d0 * d1} processes, this run has {world}: launch "
                          f"with `torchrun --nproc-per-node {d0 * d1}` (or `tabfm predict --nproc {d0 * d1}`)")
    return _layout_mesh(d0, d1, device.type, dist.group.WORLD)


@functools.lru_cache(maxsize=8)
def _layout_mesh(d0: int, d1: int, device_type: str, world: object):
    """One mesh per layout for the life of the default process group `world` (the key holds the group itself, so a
    re-initialised group gets new meshes): a mesh's process groups are never destroyed, and building one per fit
    would leak a pair of them on every fit of a cross-validation."""
    from tabfm.parallel.mesh import ParallelDims

    return ParallelDims(d0=d0, d1=d1).build(device_type)


@functools.lru_cache(maxsize=4)
def shared_plain_model(path: str, mtime_ns: int, device: str, dtype: torch.dtype) -> TabFM:
    """The plain (one-device) model of a checkpoint, in eval mode, shared read-only by every estimator that fits
    with the same weights, device and dtype: cross-validation and grid search fit many clones, which then hold
    one copy of the weights instead of one each and skip re-reading the file. Estimators never write to the
    weights (inference runs under no_grad). Bounded: the 4 most recently used (path, file time, device, dtype);
    mtime_ns makes a rewritten file a new entry. `shared_plain_model.cache_clear()` frees them."""
    from tabfm.checkpoint import load_model

    return load_model(path, dtype=dtype).to(device).eval()


def weights_digest(checkpoint: str | Path | None) -> str:
    """SHA-256 that names the weights at `checkpoint` (default: the shipped weights): of a merged file's bytes, or of
    a checkpoint folder's manifest (which holds every rank file's SHA-256, checked when the folder is loaded). An
    estimator records it at fit, since its encoded train rows belong to those weights: a file replaced or re-merged
    since, another working folder's file of the same relative name, or other shipped weights are told apart when
    a saved or pickled estimator reloads its model."""
    from tabfm.checkpoint_format import MANIFEST

    path = (Path(checkpoint) if checkpoint is not None else DEFAULT_CHECKPOINT).resolve()
    file = path / MANIFEST if path.is_dir() else path
    stat = file.stat()
    return _file_digest(str(file), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=16)
def _file_digest(path: str, mtime_ns: int, size: int) -> str:
    """A file's SHA-256, once per (path, file time, size): every fit of a grid search asks for it."""
    from tabfm.checkpoint_format import sha256

    return sha256(Path(path))


def load_estimator_model(checkpoint: str | Path | None, device: torch.device, dtype: torch.dtype,
                         tensor_parallel: tuple[int, int] | None = None, sequence_parallel: bool = True) -> TabFM:
    """The model of a merged file or checkpoint folder (default: the shipped weights), in eval mode: the shared
    plain model (shared_plain_model), or with tensor_parallel a model parallelized on a new mesh, which it holds
    (tabfm.parallel_model.model_mesh reads it back). Estimators call it once per fit and keep it as `model_`."""
    from tabfm.checkpoint import load_model
    from tabfm.parallel_model import ParallelOptions

    path = Path(checkpoint) if checkpoint is not None else DEFAULT_CHECKPOINT
    what_to_pass = ("pass a merged .safetensors file or a checkpoint folder (`tabfm ckpt merge RUN_DIR -o "
                    "model.safetensors`), or checkpoint=None for the shipped model")
    if checkpoint is not None and not str(checkpoint).strip():  # Path("") is the working folder
        raise ValueError(f"checkpoint is an empty string; {what_to_pass}")
    if not path.exists():
        raise ValueError(f"checkpoint {str(path)!r} does not exist; {what_to_pass}")
    try:
        if tensor_parallel is None or tuple(tensor_parallel) == (1, 1):
            return shared_plain_model(str(path.resolve()), path.stat().st_mtime_ns, str(device), dtype)
        d0, d1 = (int(d) for d in tensor_parallel)
        options = ParallelOptions(sequence_parallel=sequence_parallel)
        return load_model(path, _mesh(d0, d1, device), options, dtype=dtype).to(device).eval()
    except ValueError as e:  # the checkpoint's own checks, which name the file but not the parameter
        if checkpoint is None:
            raise
        raise ValueError(f"checkpoint={str(checkpoint)!r} cannot be used: {e}; {what_to_pass}") from None
