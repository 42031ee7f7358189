"""The `tabfm` command: subcommands exist, its help imports no torch, --version, bad layouts are refused before
any process starts, and `gen` does not mix two runs' tables in one folder."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib.metadata import version

import pytest

from tabfm import _cli_demo, cli
from tabfm.parallel.mesh import LayoutError


SUBCOMMANDS = ["pretrain", "ckpt", "plot-run", "predict", "plan", "demo", "gen"]


def test_help_lists_every_subcommand_with_its_summary(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    listed = re.findall(r"^    (\S+)  +\S", out, re.M)  # "    name   summary" lines under COMMAND
    assert listed == SUBCOMMANDS
    for name in SUBCOMMANDS:  # and each one answers its own --help
        with pytest.raises(SystemExit) as exit_:
            cli.main([name, "--help"])
        assert exit_.value.code == 0 and capsys.readouterr().out.startswith(f"usage: tabfm {name} ")


def test_demo_refuses_a_layout_that_does_not_divide_the_heads():
    with pytest.raises(LayoutError) as err:
        _cli_demo.main(["--layout", "1x3", "--heads", "8"])
    msg = str(err.value)
    assert "8 attention heads are not divisible by d0*d1=3 (0.blocks.0.attn and 1 more)" in msg
    assert "norm width 64 is not divisible by d1=3 (0.blocks.0.norm1 and 3 more)" in msg
    assert msg.endswith("that fit: none: change the number of processes")



def test_demo_refuses_a_process_count_that_does_not_match(capsys):
    assert cli.main(["demo", "--nproc", "3", "--layout", "2x2"]) == 2
    assert "needs 4 processes" in capsys.readouterr().err
    with pytest.raises(LayoutError, match="needs 4 processes but 1 were started"):
        _cli_demo.main(["--layout", "2x2"])


def test_demo_refuses_bad_options_in_one_line_before_torchrun_starts(capsys, monkeypatch):
    """Found by a hunt: --layout 1x3 (heads 8), --heads 6 (hidden 64) and --steps 0 started torchrun, whose every
    rank failed with a traceback; --tokens 0 trained NaN losses without a word."""
    from tabfm import launch

    monkeypatch.setattr(launch, "run_torchrun", lambda *a, **k: pytest.fail("torchrun started"))
    for argv, message in (
        (["--layout", "1x3"], "layout 1x3 does not fit the model: norm width 64 is not divisible by d1=3 "
         "(0.blocks.0.norm1 and 3 more); hidden size 64 is not divisible by d1=3 (0.blocks.0.attn and 3 more); 8 "
         "attention heads are not divisible by d0*d1=3 (0.blocks.0.attn and 1 more). Layouts with 3 tensor-parallel "
         "ranks that fit: none: change the number of processes"),
        (["--heads", "6"], "--hidden 64 is not divisible by --heads 6"),
        (["--steps", "0"], "--steps must be at least 1, got 0"),
        (["--tokens", "0"], "--tokens must be at least 1, got 0"),
        (["--sequence-parallel", "--tokens", "31"],
         "--sequence-parallel splits the --tokens 31 over d0=2: give a multiple of 2"),
        (["--nproc", "0"], "layout 2x2 needs 4 processes, not --nproc 0"),
    ):
        assert cli.main(["demo", *argv]) == 2
        assert capsys.readouterr().err == f"error: {message}\n"


def test_demo_runs_on_one_process(capsys):
    assert _cli_demo.main(["--layout", "1x1", "--steps", "3", "--hidden", "16", "--heads", "2"]) == 0
    out = capsys.readouterr().out
    assert "largest relative difference: 0.00e+00" in out and "3 AdamW steps" in out
    steps = [int(line.split()[0]) for line in out.splitlines() if re.match(r"\s+\d+ ", line)]
    assert steps == [0, 1, 2]  # --steps 3: the first, middle and last step of both curves


def test_help_and_the_parser_import_no_torch():
    # A fresh interpreter: this one has torch loaded already. `tabfm --help` took 4-16 s when it imported torch.
    code = ("import sys; from tabfm.cli import build_parser, main\n"
            "build_parser()\n"
            "for argv in (['--help'], ['predict', '--help'], ['gen', '--help'], ['plan', '--help']):\n"
            "    try:\n"
            "        main(argv)\n"
            "    except SystemExit:\n"
            "        pass\n"
            "print('torch' in sys.modules, 'tabfm.estimator' in sys.modules, file=sys.stderr)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stderr.strip().splitlines()[-1] == "False False"
    assert "--na-values" in run.stdout and "--overwrite" in run.stdout and "flat64" in run.stdout


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"tabfm {version('tabfm')}"


def test_demo_options_reach_the_model_and_all_have_help():
    # --depth 3 and --hidden 40 on a 1x3 layout: three blocks' attentions and six norms of width 40 are refused.
    with pytest.raises(LayoutError) as err:
        _cli_demo.main(["--layout", "1x3", "--heads", "8", "--depth", "3", "--hidden", "40"])
    assert "8 attention heads are not divisible by d0*d1=3 (0.blocks.0.attn and 2 more)" in str(err.value)
    assert "norm width 40 is not divisible by d1=3 (0.blocks.0.norm1 and 5 more)" in str(err.value)
    parser = cli.build_parser()
    demo = parser._subparsers._group_actions[0].choices["demo"]
    assert all(a.help for a in demo._actions), [a.dest for a in demo._actions if not a.help]


def _gen(out, n: int, *extra: str) -> int:
    return cli.main(["gen", "--prior", "trees", "--n-tables", str(n), "--out", str(out), "--max-rows", "64",
                     "--max-features", "4", *extra])


def test_gen_refuses_a_non_empty_folder_unless_overwrite(tmp_path, capsys):
    out = tmp_path / "tables"
    assert _gen(out, 3) == 0
    capsys.readouterr()
    (out / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert _gen(out, 2, "--seed", "1") == 2
    err = capsys.readouterr().err.strip()
    assert err == f"tabfm gen: error: --out {out} is not empty; choose an empty or new folder, or pass --overwrite " \
        "to replace an earlier run's tables there"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert _gen(out, 2, "--seed", "1", "--overwrite") == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["manifest.json", "notes.txt", "table_000000.json", "table_000000.parquet", "table_000001.json",
                     "table_000001.parquet"]
    assert json.loads((out / "manifest.json").read_text())["seed"] == 1
    assert (out / "notes.txt").read_text() == "mine"


def test_gen_shows_progress_unless_quiet(tmp_path, capsys):
    assert _gen(tmp_path / "a", 2) == 0
    assert "gen trees" in capsys.readouterr().err  # tqdm's bar, on stderr
    assert _gen(tmp_path / "b", 2, "--quiet") == 0
    assert capsys.readouterr().err == "" and len(list((tmp_path / "b").glob("table_*.parquet"))) == 2


def test_gen_refuses_tables_larger_than_memory_before_writing(tmp_path, capsys):
    """Found by an audit: a MemoryError traceback at the first table, and an empty --out left behind."""
    out = tmp_path / "tables"
    assert _gen(out, 2, "--min-rows", "100000000000", "--max-rows", "100000000000") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "GiB for their raw cells alone" in err[0] and "lower the rows" in err[0]
    assert not out.exists()
    assert _gen(out, 10**13, "--workers", "2") == 2  # once a list of every range, then a MemoryError
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "10,000,000,000,000 tables need at least" in err[0] and "write fewer tables" in err[0]
    assert not out.exists()


def test_gen_names_its_own_flags_in_a_bad_table_shape(tmp_path, capsys):
    """Found by a hunt: `--max-rows 32` was told `table.min_rows=64 > table.max_rows=32; make min_rows <=
    max_rows`, keys of a config file that gen has none of."""
    out = tmp_path / "tables"
    for extra, message in ((["--max-rows", "32"], "--min-rows=64 > --max-rows=32; make --min-rows <= --max-rows"),
                           (["--max-rows", "64", "--min-rows", "8", "--max-classes", "10"],
                            "--min-rows=8 is too few for 10 classes; raise --min-rows to >= 20 or lower --max-classes"),
                           (["--seed", "-1"], "--seed=-1 must be >= 0 (it seeds numpy's SeedSequence)")):
        assert cli.main(["gen", "--n-tables", "1", "--out", str(out), "--quiet", *extra]) == 2
        assert capsys.readouterr().err == f"tabfm gen: error: {message}\n"
    assert not out.exists()


def test_gen_refuses_a_file_as_out(tmp_path, capsys):
    f = tmp_path / "x.parquet"
    f.write_text("keep")
    assert _gen(f, 1) == 2
    assert capsys.readouterr().err.strip() == f"tabfm gen: error: --out {f} is a file, not a folder"
    assert f.read_text() == "keep"
    assert _gen(f / "tables", 1) == 2  # a folder under a file: refused before the first table, not by mkdir's errno
    assert capsys.readouterr().err.strip() == f"tabfm gen: error: --out {f / 'tables'}: {f} is a file, not a folder"
    assert f.read_text() == "keep"
