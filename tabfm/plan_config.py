"""What `tabfm plan --config` reads: a pretraining run config or a plan config with a plain transformer
(configs/plan/), and the planner's search settings, loaded by the one typed loader (tabfm.config_io). Apart from
tabfm.config because it imports the planner, which loading a run config does not need."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from tabfm.config import RunConfig
from tabfm.config_io import load
from tabfm.model import ModelConfig
from tabfm.parallel.plan_trace import TransformerSpec
from tabfm.parallel.planner import PlanOptions


@dataclass(frozen=True)
class PlanConfig(RunConfig):
    """What `tabfm plan` reads: a pretraining run config (the planner counts the TabFM it trains, on the largest
    tables its data section draws, in train.precision's compute dtype) or a plain transformer (`model: {kind:
    transformer, depth, hidden, ...}`, configs/plan/), and the search settings."""

    model: TransformerSpec | ModelConfig = field(default_factory=lambda: ModelConfig.load("small"))
    """The model: a ModelConfig (a preset name, `{preset: ..., ...}` or its fields; `kind: tabfm`) or a
    TransformerSpec (`kind: transformer`; its fields alone also tell it apart)."""
    plan: PlanOptions = field(default_factory=PlanOptions)
    """The search settings (dtype, sequence parallelism and chunk counts to try, optimizer, memory fraction)."""

    def options(self) -> PlanOptions:
        """The search settings; a TabFM run is counted in its compute dtype unless plan.dtype says otherwise."""
        if isinstance(self.model, ModelConfig) and self.plan.dtype is None:
            return replace(self.plan, dtype=self.train.compute_dtype)
        return self.plan


def load_plan(path: str | Path, overrides: Sequence[str] | None = None) -> PlanConfig:
    """`tabfm plan --config`: a run config or a plan config (configs/plan/), with the `a.b=c` overrides."""
    return load(PlanConfig, path, overrides or ())
