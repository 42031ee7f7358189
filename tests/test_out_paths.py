"""tabfm.out_paths: the checks every command makes on where it writes, before any work."""

from __future__ import annotations

import pytest

from tabfm.out_paths import CHECKPOINTS, check_png, checkpoints_of, file_in_the_way


def test_a_file_above_a_path_is_found_and_folders_or_new_paths_are_not(tmp_path):
    (tmp_path / "f").write_text("x")
    assert file_in_the_way(tmp_path / "f" / "a" / "b") == tmp_path / "f"
    assert file_in_the_way(tmp_path / "new" / "deeper") is None  # can be made
    assert file_in_the_way(tmp_path / "f") is None  # the path itself is not above itself
    assert checkpoints_of(tmp_path) == tmp_path / CHECKPOINTS


def test_png_names_are_checked_without_writing(tmp_path):
    assert check_png(tmp_path / "new" / "Chart.PNG", "--png") == tmp_path / "new" / "Chart.PNG"
    (tmp_path / "f").write_text("x")
    (tmp_path / "dir.png").mkdir()
    for bad, message in ((tmp_path / "chart.svg", "give a file name ending in .png"),
                         (tmp_path / "chart", "give a file name ending in .png"),
                         (tmp_path / "dir.png", "give a file name ending in .png"),
                         (tmp_path / "f" / "chart.png", f"{tmp_path / 'f'} is a file, not a folder")):
        with pytest.raises(ValueError, match="^-o ") as e:
            check_png(bad, "-o")
        assert message in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.png", "f"]
