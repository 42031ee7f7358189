"""Building a model for its shapes skips initialisation, and so never imports torch._dynamo.

`SkipInit` (tabfm/skip_init.py) turns the random initialisers into no-ops; the model's constructors must do no other
arithmetic on parameters, or the meta device reaches PyTorch's Python kernels, whose first call imports
torch._dynamo (a second of every process's first fit). The import is checked in a fresh interpreter, since the
suite's own process has long imported it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from tabfm.checkpoint_inspect import meta_model
from tabfm.layout import shape_model
from tabfm.model import ModelConfig, build_model
from tabfm.skip_init import SkipInit


def _fresh(code: str) -> str:
    """stdout of `code` run in a new interpreter."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          check=True, timeout=300).stdout


def test_shape_models_match_the_real_model():
    """Same names, shapes and dtypes as the initialised model, on meta and on the CPU."""
    cfg = ModelConfig()
    real = {k: (v.shape, v.dtype) for k, v in build_model(cfg).state_dict().items()}
    meta = meta_model(cfg, len(real), "test")
    assert {k: (v.shape, v.dtype) for k, v in meta.state_dict().items()} == real
    assert all(v.is_meta for v in meta.state_dict().values())
    assert {k: (v.shape, v.dtype) for k, v in shape_model(cfg).state_dict().items()} == real


def test_initialisers_are_skipped_only_inside():
    """Inside, randn is an empty tensor and init.normal_ leaves the values as they were; outside, both draw."""
    t = torch.zeros(64)
    with SkipInit():
        torch.nn.init.normal_(t)
        t.uniform_()
        drawn = torch.randn(3, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert torch.equal(t, torch.zeros(64)) and drawn.shape == (3, 5) and drawn.dtype == torch.float64
    torch.nn.init.normal_(t)
    assert t.std() > 0.5


def test_fit_and_checkpoint_read_do_not_import_dynamo():
    """A first fit + predict and a checkpoint's meta check in a fresh process leave torch._dynamo unimported."""
    out = _fresh("""
        import sys
        import numpy as np
        from tabfm import TabFMClassifier
        from tabfm.checkpoint_inspect import meta_model
        from tabfm.model import ModelConfig
        meta_model(ModelConfig(), 10_000, "test")
        X = np.random.default_rng(0).normal(size=(60, 3))
        TabFMClassifier(n_estimators=1, n_jobs=1).fit(X, X[:, 0] > 0).predict_proba(X)
        print("torch._dynamo" in sys.modules)
    """)
    assert out.strip() == "False"
