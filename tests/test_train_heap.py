"""tabfm.train_heap: a pretraining process serves large blocks from malloc's heap and keeps them for reuse, unless
the user set malloc's thresholds; pretrain.main applies it on a CPU."""

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tabfm import heap_release, pretrain, train_heap

ROOT = Path(__file__).resolve().parent.parent
glibc = pytest.mark.skipif(heap_release.glibc() is None, reason="needs glibc")

# In a fresh process (the thresholds are process-wide): allocate and free a 64 MiB block, reporting how much of it
# malloc mapped separately (mallinfo2's hblkhd) and how much free memory the heap kept afterwards (fordblks).
PROBE = """
import json, sys
from tabfm import heap_release, train_heap
applied = train_heap.keep_large_blocks_in_heap() if sys.argv[1] == "apply" else None
libc = heap_release.glibc()
block = bytearray(64 << 20)
mapped = libc.mallinfo2().hblkhd
del block
print(json.dumps({"applied": applied, "mapped": mapped, "kept_free": libc.mallinfo2().fordblks}))
"""


def _probe(mode: str, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", *train_heap._USER_SETTINGS)}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env=environ | env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout)


@glibc
def test_large_blocks_come_from_the_heap_and_stay_for_the_next_step():
    default = _probe("none")
    assert default["mapped"] >= 64 << 20 and default["kept_free"] < 32 << 20  # mapped alone, unmapped on free
    kept = _probe("apply")
    assert kept["applied"] is True
    assert kept["mapped"] < 1 << 20 and kept["kept_free"] >= 64 << 20


@glibc
def test_the_users_own_thresholds_win():
    out = _probe("apply", GLIBC_TUNABLES="glibc.malloc.mmap_threshold=1048576")
    assert out["applied"] is False and out["mapped"] >= 64 << 20  # the user's 1 MiB threshold still maps it


@pytest.mark.parametrize("environ, want", [
    ({}, False),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, False),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.trim_threshold=0"}, True),
    ({"MALLOC_MMAP_THRESHOLD_": "65536"}, True),
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, True),
])
def test_user_set_thresholds(environ, want):
    assert train_heap.user_set_thresholds(environ) is want


@pytest.mark.parametrize("device, applied", [("cpu", True), ("cuda", False)])
def test_pretrain_main_keeps_large_blocks_only_on_a_cpu(device, applied, monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(pretrain, "keep_large_blocks_in_heap", lambda: calls.append(1))
    monkeypatch.setattr(pretrain, "resolve_device", lambda cfg: __import__("torch").device(device))
    monkeypatch.setattr(pretrain, "process_group", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(pretrain, "train", lambda cfg, **kw: [])
    assert pretrain.main(["--config", str(ROOT / "configs/pretrain/tiny.yaml"), "--set", f"train.out_dir={tmp_path / 'run'}"]) == 0
    assert calls == ([1] if applied else [])

