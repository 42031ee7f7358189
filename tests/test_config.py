"""The one typed config loader (tabfm.config_io) behind run configs, model presets, plan configs and topology presets:
every shipped file loads with it, `--set` overrides refine presets, and every error is one line that names the key
and the file (or the --set) its value came from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tabfm.config import ConfigError, RunConfig, dump_config, from_dict, load_config, load_topology, to_dict
from tabfm.config_io import preset_names, read_yaml
from tabfm.data.priors.hparams import Choice, LogUniform
from tabfm.model import ModelConfig
from tabfm.parallel.plan_trace import TransformerSpec
from tabfm.parallel.topology import HierarchicalTopology
from tabfm.plan_config import PlanConfig, load_plan

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "pretrain" / "tiny.yaml"


def _error(call, *args) -> str:
    """The message of the ConfigError `call(*args)` raises, checked to be one line."""
    with pytest.raises(ConfigError) as err:
        call(*args)
    message = str(err.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------------------------------------------------
# Every shipped config, through its loader
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "pretrain").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_run_configs_load_as_runs_and_as_plans(path):
    run = load_config(path)
    plan = load_plan(path)
    assert isinstance(plan.model, ModelConfig) and plan.model == run.model and plan.data == run.data
    assert plan.options().dtype == run.train.compute_dtype   # a TabFM run is counted in its compute dtype


def test_shipped_presets_and_plan_configs_load():
    assert preset_names("model") == ["base", "large", "small", "small_inducing", "small_wide", "tiny"]
    sizes = [ModelConfig.load(name).embed_dim for name in ("tiny", "small", "base")]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
    for path in sorted((ROOT / "configs" / "plan").glob("*.yaml")):
        cfg = load_plan(path)
        assert isinstance(cfg.model, TransformerSpec) and cfg.options() == cfg.plan, path
    assert load_plan(ROOT / "configs/plan/transformer_small.yaml").plan.dtype == "float32"
    assert load_plan(ROOT / "configs/plan/transformer_large.yaml").model.hidden == 8192
    for name in preset_names("topology"):
        topo = load_topology(name)
        assert isinstance(topo, HierarchicalTopology) and topo.name == name and topo.levels[-1].span == topo.devices


def test_a_topology_preset_reads_its_units(tmp_path):
    path = tmp_path / "two.yaml"
    path.write_text("devices: 4\nmemory_gb: 2\ncompute: {peak_tflops: 10, memory_bandwidth_gbs: 100, "
                    "matmul_efficiency: 0.5}\nlevels:\n  - {name: pair, span: 2, alpha_us: 3, bandwidth_gbs: 50, "
                    "efficiency: 0.8, uplink_gbs: 10}\n  - {name: net, span: 4, alpha_us: 20, bandwidth_gbs: 5}\n")
    topo = load_topology(path)
    assert topo.name == "two" and topo.memory_bytes == 2e9 and topo.dtype == "bfloat16" and topo.overlap
    assert topo.compute.matmul_flops == 10 * 1e12 * 0.5 and topo.compute.op_overhead == 5.0 * 1e-6
    pair, net = topo.levels
    assert (pair.alpha, pair.bandwidth, pair.uplink) == (3e-6, 50 * 1e9 * 0.8, 10 * 1e9 * 0.8)  # uplink: level's eff
    assert (net.span, net.bandwidth, net.uplink) == (4, 5e9, None)


# ---------------------------------------------------------------------------------------------------------
# Presets and --set overrides
# ---------------------------------------------------------------------------------------------------------

def test_set_refines_a_named_preset_or_replaces_it():
    tiny = ModelConfig.load("tiny")
    cfg = load_config(TINY, ["model.embed_dim=32"])                      # the file says `model: tiny`
    assert cfg.model == ModelConfig(**{**tiny.to_dict(), "embed_dim": 32})
    assert load_config(TINY, ["model.preset=base"]).model == ModelConfig.load("base")
    assert load_config(TINY, ["model=base"]).model == ModelConfig.load("base")
    assert load_config(TINY, ["model={preset: base, icl_num_blocks: 1}"]).model.icl_num_blocks == 1
    assert ModelConfig.from_dict({"preset": "tiny", "num_bins": 8}) == ModelConfig(**{**tiny.to_dict(), "num_bins": 8})


def test_overrides_parse_as_yaml_and_a_single_value_is_a_one_item_list(tmp_path):
    cfg = load_config(TINY, ["optim.lr=3e-4", "train.eval_tables=[skl_iris, skl_wine]"])
    assert cfg.optim.lr == 3e-4 and cfg.train.eval_tables == ("skl_iris", "skl_wine")
    assert load_config(TINY, ["train.eval_tables=skl_iris"]).train.eval_tables == ("skl_iris",)
    plan = load_plan(ROOT / "configs/plan/transformer_small.yaml", ["plan.chunks=4", "model.depth=3"])
    assert plan.plan.chunks == (4,) and plan.model.depth == 3


def test_dumped_configs_load_back_equal_with_their_tags(tmp_path):
    cfg = load_config(TINY, ["data.prior.scm.gain={type: LogUniform, low: 0.5, high: 4}",
                             "data.prior.mlp.activation={options: [tanh, relu]}"])   # the one class with `options`
    assert cfg.data.prior.scm.gain == LogUniform(0.5, 4.0) and cfg.data.prior.mlp.activation == Choice(("tanh", "relu"))
    raw = to_dict(cfg)
    assert raw["data"]["prior"]["mlp"]["activation"] == {"type": "Choice", "options": ["tanh", "relu"], "weights": None}
    assert from_dict(RunConfig, json.loads(json.dumps(raw))) == cfg
    (tmp_path / "run.yaml").write_text(dump_config(cfg))
    assert load_config(tmp_path / "run.yaml") == cfg
    plan = load_plan(ROOT / "configs/plan/transformer_small.yaml")
    assert to_dict(plan)["model"]["kind"] == "transformer" and from_dict(PlanConfig, to_dict(plan)) == plan


# ---------------------------------------------------------------------------------------------------------
# Errors: one line, naming the key and where its value came from
# ---------------------------------------------------------------------------------------------------------

def test_errors_name_the_key_and_the_file(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("model: tiny\ndata:\n  table: {max_rowz: 10}\n")
    assert _error(load_config, run) == (
        "unknown config key data.table.max_rowz; valid keys of data.table: " + ", ".join(
            f for f in to_dict(RunConfig().data.table)) + f" (in {run})")
    run.write_text("train:\n  steps: ten\n")
    assert _error(load_config, run) == f"train.steps must be an integer, got 'ten' (in {run})"
    assert _error(load_config, run, ["train.steps=many"]) == \
        "train.steps must be an integer, got 'many' (from --set train.steps=many)"
    run.write_text("optim: {lr: 0.1\n")
    assert _error(load_config, run).startswith(f"{run} is not valid YAML: ")
    assert "line 2" in _error(load_config, run)
    for empty in ("", "# only a comment\n", "\n\n"):  # once trained the defaults without a word
        run.write_text(empty)
        assert _error(load_config, run) == f"{run} is empty: write its keys in it, or leave the file out to use " \
                                           "the defaults"
    run.write_text("- a list\n")
    assert _error(load_config, run) == f"{run} must hold a mapping of keys to values, got a list"
    assert _error(load_config, tmp_path / "nope.yaml") == f"config file {tmp_path / 'nope.yaml'} does not exist"


def test_an_empty_section_is_refused_with_or_without_set(tmp_path):
    """Found by an audit: `train:` with its keys commented out was refused alone, but a --set train.X turned it
    into the defaults (a 1000-step run into runs/default)."""
    run = tmp_path / "run.yaml"
    run.write_text("model: tiny\ntrain:\n  # steps: 3\n")
    assert "train must be a mapping of TrainConfig fields, got None" in _error(load_config, run)
    assert _error(load_config, run, ["train.steps=3"]) == ("train is empty in the config file (null, every key "
                                                           "commented out?): give it keys, or remove the line to "
                                                           "take its defaults")


def test_a_section_check_blames_the_key_it_names():
    """A dataclass's own check (__post_init__) names the value; the origin is that key's, not its section's."""
    assert _error(load_config, TINY, ["model.embed_dim=10"]) == \
        "model.embed_dim=10 is not divisible by axial_heads=4 (from --set model.embed_dim=10)"
    assert _error(load_config, TINY, ["train.dtype=bfloat16"]).endswith("(from --set train.dtype=bfloat16)")
    # the parallel options are checked by the layers' own checks (ParallelOptions), named as config keys
    assert _error(load_config, TINY, ["parallel.overlap_chunks=0"]) == ("parallel.overlap_chunks must be a positive "
                                                                        "integer (1 = no overlap), got 0 (from --set "
                                                                        "parallel.overlap_chunks=0)")
    assert _error(load_config, TINY, ["parallel.kernels=cuda"]) == \
        "parallel.kernels must be one of auto, triton, torch; got 'cuda' (from --set parallel.kernels=cuda)"


def test_a_range_check_blames_the_override_that_broke_it_not_the_file(tmp_path):
    """Every range is checked field by field, so the error names one key and that key's origin: the --set that
    gave it, or the file when the file gave it (a valid override beside a bad file value is not blamed)."""
    for override, message in [("optim.lr=-1", "optim.lr must be a finite number > 0, got -1.0"),
                              ("optim.lr=nan", "optim.lr must be a finite number > 0, got nan"),
                              ("optim.beta2=1", "optim.beta2 must be within [0, 1), got 1.0"),
                              ("train.steps=0", "train.steps must be >= 1, got 0"),
                              ("train.eval_max_train_rows=0", "train.eval_max_train_rows must be >= 1, got 0")]:
        assert _error(load_config, TINY, [override]) == f"{message} (from --set {override})"
    # a relation between two keys, named by their section-relative path: the override is blamed
    assert _error(load_config, TINY, ["data.table.max_rows=1"]).endswith("(from --set data.table.max_rows=1)")
    run = tmp_path / "run.yaml"
    run.write_text("optim: {lr: -1}\n")
    assert _error(load_config, run, ["optim.warmup_steps=5", "optim.min_lr_ratio=0.5"]) == \
        f"optim.lr must be a finite number > 0, got -1.0 (in {run})"


def test_a_bad_key_of_a_preset_file_names_that_file(tmp_path):
    model = tmp_path / "mine.yaml"
    model.write_text("embed_dim: 16\naxial_heads: 3\n")
    run = tmp_path / "run.yaml"
    run.write_text(f"model: {{preset: {model}}}\n")
    assert _error(load_config, run) == f"model.embed_dim=16 is not divisible by axial_heads=3 (in {model})"
    assert _error(load_config, TINY, ["model=huge"]) == \
        "unknown model preset 'huge'; presets: base, large, small, small_inducing, small_wide, tiny, or a path to a .yaml file (from --set model=huge)"
    assert _error(ModelConfig.load, tmp_path / "gone.yaml").startswith(f"model config file {tmp_path / 'gone.yaml'} "
                                                                        "does not exist; presets: base")


def test_a_key_given_twice_and_a_folder_for_a_file_are_refused(tmp_path):
    """Found by a hunt: `steps: 2` then `steps: 3` trained 3 steps without a word; a folder was "does not exist"."""
    path = tmp_path / "twice.yaml"
    path.write_text("train:\n  steps: 2\n  steps: 3\n")
    assert _error(load_config, path) == f"{path}: key 'steps' appears twice (line 3); give each key once"
    assert _error(load_config, tmp_path) == f"config file {tmp_path} is a folder; give a .yaml file in it"
    path.write_text("train:\n  steps: 2\noptim:\n  lr: 0.001\n")  # the same key in two sections is fine
    assert load_config(path).train.steps == 2


def test_merge_keys_work_and_a_config_nested_too_deep_is_one_line(tmp_path):
    """Found by an audit: `<<: *anchor` (which yaml.safe_load reads) was "not valid YAML", and a config nested 1,500
    deep a RecursionError of 3,000 lines."""
    path = tmp_path / "merge.yaml"
    path.write_text("optim: &base\n  lr: 0.001\n  warmup_steps: 3\ntrain:\n  steps: 2\nlevels:\n  - <<: *base\n"
                    "    lr: 0.5\n")
    assert read_yaml(path)["levels"] == [{"lr": 0.5, "warmup_steps": 3}]  # the mapping's own key overrides
    deep = tmp_path / "deep.yaml"
    deep.write_text("train: " + "[" * 1500 + "]" * 1500 + "\n")
    assert _error(load_config, deep) == f"{deep} is nested too deeply to be a config"


def test_a_folder_for_a_preset_file_is_named_a_folder(tmp_path):
    """Found by a hunt: `tabfm plan --topology configs/topology` said the folder does not exist."""
    assert _error(load_topology, tmp_path) == f"topology config file {tmp_path} is a folder; give a .yaml file in it"
    assert _error(load_config, TINY, [f"model={tmp_path}"]) == \
        f"model config file {tmp_path} is a folder; give a .yaml file in it (from --set model={tmp_path})"


def test_topology_errors_name_the_key_the_file_and_the_choices(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("devices: 2\nmemory_gb: 1\ncompute: {peak_tflops: 1, memory_bandwidth_gbs: 1}\n"
                    "levels: [{name: net, span: 2, alpha_us: 1, bandwith_gbs: 1}]\n")
    assert _error(load_topology, path).startswith(
        "unknown config key levels[0].bandwith_gbs; valid keys of levels[0]: name, span, alpha_us, bandwidth_gbs")
    path.write_text("devices: 2\nmemory_gb: 1\nlevels: []\n")
    assert _error(load_topology, path) == f"missing config key compute (in {path})"
    assert _error(load_topology, "nvswitch8", 16).startswith(
        "topology 'nvswitch8' describes 8 devices, but --nproc is 16; use --nproc 8, or a topology for 16 devices "
        "(presets for 16 devices: nvswitch8x2-ib) (devices in ")
    assert "presets: flat64, " in _error(load_topology, "dgx") and "measure (this machine)" in _error(load_topology, "dgx")
    # found by a hunt: a negative memory rejected every layout for "more than 90% of -5000000000B", and an
    # efficiency of 7 was priced
    good = ("devices: 2\nmemory_gb: {m}\ncompute: {{peak_tflops: 1, memory_bandwidth_gbs: 1}}\n"
            "levels: [{{name: net, span: 2, alpha_us: 1, bandwidth_gbs: 1, efficiency: {e}}}]\n")
    path.write_text(good.format(m=1, e=0.5))
    assert load_topology(path).devices == 2
    path.write_text(good.format(m=-5, e=0.5))
    assert "memory_gb=-5.0 must be a finite number > 0 (in " in _error(load_topology, path)
    path.write_text(good.format(m=1, e=7))
    assert "efficiency=7.0 is a share of the vendor's peak; set it within (0, 1]" in _error(load_topology, path)


def test_unions_want_a_tag_when_the_keys_do_not_tell():
    assert _error(load_config, TINY, ["data.prior.scm.gain={low: 1, high: 2}"]) == (
        "data.prior.scm.gain: give type as one of Uniform, LogUniform, IntUniform, IntLogUniform, got "
        "{'low': 1, 'high': 2} (from --set data.prior.scm.gain={low: 1, high: 2})")
    assert _error(load_config, TINY, ["data.prior.scm.gain={type: Gamma, k: 1}"]).startswith(
        "data.prior.scm.gain.type='Gamma'; use one of Fixed, Uniform, LogUniform")
    plan = ROOT / "configs/plan/transformer_small.yaml"
    assert _error(load_plan, plan, ["model.kind=mlp"]).startswith("model.kind='mlp'; use one of transformer, tabfm")
    assert _error(load_plan, plan, ["model={}"]) == \
        "model: give kind as one of transformer, tabfm, got {} (from --set model={})"


def test_override_mistakes_are_one_line():
    assert _error(load_config, TINY, ["optim.lr"]) == \
        "--set 'optim.lr': write it as section.key=value, e.g. optim.lr=3e-4"
    assert _error(load_config, TINY, ["train..steps=5"]) == \
        "--set 'train..steps=5': write it as section.key=value, e.g. optim.lr=3e-4"  # a fuzzer's: blamed the file
    assert _error(load_config, TINY, ["train.device.kind=cpu"]) == \
        "--set 'train.device.kind=cpu': train.device is a value, not a section"
    assert _error(load_config, TINY, ["optim.lr=[1, 2"]).startswith("--set 'optim.lr=[1, 2': the value is not valid YAML")
    assert _error(load_config, TINY, ["optim.lrr=1"]).endswith("(from --set optim.lrr=1)")


def test_a_key_set_twice_is_refused():
    """A key given twice in a YAML file is refused; two --set of one key trained the later's value without a word."""
    assert _error(load_config, TINY, ["train.steps=5", "optim.lr=1e-3", " train.steps =6"]) == \
        "--set train.steps is given twice ('train.steps=5', then ' train.steps =6'); give it once"
    assert _error(load_config, TINY, ["train.steps=5", "train.steps=5"]).startswith("--set train.steps is given twice")
    assert _error(load_plan, ROOT / "configs/plan/transformer_small.yaml", ["plan.chunks=4", "plan.chunks=2"]) == \
        "--set plan.chunks is given twice ('plan.chunks=4', then 'plan.chunks=2'); give it once"
    cfg = load_config(TINY, ["model=tiny", "model.embed_dim=64", "train.steps=5"])  # a section, then its key: two keys
    assert (cfg.model.embed_dim, cfg.train.steps) == (64, 5)


def test_a_run_folder_and_weights_under_the_home_folder_are_expanded():
    """Found by an audit: train.out_dir: ~/runs/x wrote into a folder named ~ in the working folder."""
    import os

    from tabfm.config import TrainConfig

    cfg = TrainConfig(out_dir="~/runs/x", init_from="~/w.safetensors")
    assert cfg.out_dir == os.path.expanduser("~/runs/x") and not cfg.out_dir.startswith("~")
    assert cfg.init_from == os.path.expanduser("~/w.safetensors")
    assert TrainConfig(out_dir="runs/~x").out_dir == "runs/~x"
