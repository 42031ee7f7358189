"""The `tabfm` command: subcommands exist and bad layouts are refused before any process starts."""

from __future__ import annotations

import pytest

from tabfm import _cli_demo, cli
from tabfm.parallel.mesh import LayoutError


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "demo" in out and "gen" in out


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


def test_demo_runs_on_one_process(capsys):
    assert _cli_demo.main(["--layout", "1x1", "--steps", "3", "--hidden", "16", "--heads", "2"]) == 0
    assert "largest relative difference: 0.00e+00" in capsys.readouterr().out
