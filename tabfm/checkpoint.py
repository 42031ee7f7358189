"""Sharded checkpoints (DESIGN 6): save / load on any layout, merge into one file, reshard for another layout.

This module gathers the public names of five modules, each with one job, so `from tabfm import checkpoint` (or
`from tabfm.checkpoint import load_model`) is all a caller needs:

    checkpoint_format    the folder's format: manifest.json + one rank<t>.safetensors per tensor-parallel rank,
                         names, the dtype whitelist, shard specs as JSON, atomic file and folder writes
    checkpoint_inspect   a checkpoint is untrusted input: read_manifest / inspect_checkpoint check structure,
                         types, shapes, specs and file headers before any tensor is read; verify_checkpoint adds
                         checksums and finite weights
    checkpoint_io        save_checkpoint (collective, atomic) / load_checkpoint (any layout, optimizer and RNG)
    checkpoint_run       a run's step_<digits> folders: latest_checkpoint, mark_latest, prune_checkpoints
    checkpoint_convert   merge (one safetensors file), reshard (another layout), load_merged / load_model /
                         init_weights

    merge(ckpt_dir, out)              one safetensors file: the plain model's state dict, config in its metadata
    reshard(ckpt_dir, d0, d1, out)    the same checkpoint cut for another layout (optimizer state included)
    load_merged / load_model          a merged file (or a checkpoint folder) into a model on any layout
    verify_checkpoint(ckpt_dir)       every check loading runs, plus every file's checksum and finite weights
    latest_checkpoint(out_dir)        the checkpoint a run resumes from; mark_latest / prune_checkpoints after a save

The training loop's view of a run's checkpoints (save every N steps, prune, resume) is
tabfm.train_checkpoints.CheckpointManager.
"""

from __future__ import annotations

from tabfm.checkpoint_convert import check_init_from, init_weights, load_merged, load_model, merge, reshard
from tabfm.checkpoint_format import DTYPES, FORMAT, MANIFEST, MERGED_FORMAT, MODEL, OPTIM, RNG, model_specs, rank_file
from tabfm.checkpoint_inspect import MAX_MANIFEST_BYTES, inspect_checkpoint, read_manifest, verify_checkpoint
from tabfm.checkpoint_io import CheckpointState, load_checkpoint, save_checkpoint
from tabfm.checkpoint_run import (LATEST, STEP_DIR, latest_checkpoint, mark_latest, prune_checkpoints, read_latest,
                                  step_checkpoints)

__all__ = ["DTYPES", "FORMAT", "LATEST", "MANIFEST", "MAX_MANIFEST_BYTES", "MERGED_FORMAT", "MODEL", "OPTIM", "RNG",
           "STEP_DIR", "CheckpointState", "check_init_from", "init_weights", "inspect_checkpoint", "latest_checkpoint", "load_checkpoint",
           "load_merged", "load_model", "mark_latest", "merge", "model_specs", "prune_checkpoints", "rank_file",
           "read_latest", "read_manifest", "reshard", "save_checkpoint", "step_checkpoints", "verify_checkpoint"]
