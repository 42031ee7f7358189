"""The wheel carries what an installed tabfm needs away from a source checkout: the size presets, the topology
presets and the default weights, so presets load and the estimator predicts from the installed copy alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import sys, tabfm
from pathlib import Path
assert Path(tabfm.__file__).resolve().is_relative_to(Path(sys.argv[1]).resolve()), tabfm.__file__
from tabfm.model import ModelConfig
from tabfm.config import load_topology
print(ModelConfig.load("small").embed_dim, ModelConfig.load("base").embed_dim, load_topology("nvswitch8").name)
import numpy as np
from tabfm import TabFMClassifier
rng = np.random.default_rng(0)
X = rng.normal(size=(60, 3)); y = (X[:, 0] > 0).astype(int)
print(TabFMClassifier(n_estimators=1).fit(X[:40], y[:40]).score(X[40:], y[40:]))
"""


@pytest.mark.slow
def test_installed_wheel_finds_presets_and_weights(tmp_path):
    pytest.importorskip("setuptools", minversion="77")
    src, wheels = tmp_path / "src", tmp_path / "wheels"  # a copy: the build writes build/ and egg-info in its tree
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".*", "build", "dist", "runs", "out", "*.egg-info",
                                                              "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(wheels), str(src)], check=True, cwd=tmp_path)
    (wheel,) = wheels.glob("tabfm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "tabfm/configs/model/small.yaml" in names and "tabfm/configs/topology/nvswitch8.yaml" in names
    assert "tabfm/weights/tabfm-small.safetensors" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)  # a pure-Python wheel's install is its unpacked files
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", PROBE, str(site)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    sizes, score = out.stdout.split("\n")[:2]
    assert sizes == "32 64 nvswitch8"
    assert float(score) > 0.8


def test_triton_is_an_extra_and_the_model_runs_without_it():
    """A CPU install needs no triton (about 1 GB): it is the `gpu` extra, and with it unimportable the layers run
    the torch references."""
    import tomllib

    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("triton") for d in meta["dependencies"])
    assert any(d.startswith("triton") for d in meta["optional-dependencies"]["gpu"])
    probe = ("import sys; sys.modules['triton'] = None\n"  # `import triton` now raises ImportError
             "import torch\nfrom tabfm.parallel.kernels import ops\n"
             "assert not ops.triton_available()\n"
             "x = torch.randn(4, 8)\nassert ops.backend('auto', x) == 'torch'\n"
             "from tabfm.model import build_model\nfrom tabfm.parallel_model import parallelize_model\n"
             "m = parallelize_model(build_model('tiny'), None)\nprint('ok')\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
