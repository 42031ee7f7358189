"""tabfm.table_write: output paths checked before any work (extension, folder, not an input, not an earlier run's
output unless asked), tables written batch by batch with the same bytes whatever the batches, atomically."""

from __future__ import annotations

import os

import polars as pl
import pytest

from tabfm import table_write
from tabfm.table_io import TableError
from tabfm.table_write import TableWriter, check_output, write_table


def _write(path, data: bytes | str):
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def test_check_output_refuses_before_any_work(tmp_path):
    train = _write(tmp_path / "train.csv", "a\n1\n")
    assert check_output(None) is None and check_output("-") is None
    assert check_output(str(tmp_path / "p.TSV")) == tmp_path / "p.TSV"
    cases = [
        (tmp_path / "p.xlsx", "cannot write a table with extension '.xlsx'; name it .csv, .tsv or .parquet"),
        (tmp_path / "preds", "cannot write a table with no extension"),
        (tmp_path / "no" / "p.csv", f"folder {tmp_path / 'no'} does not exist; create it first"),
        (tmp_path / "train.csv" / "p.csv", f"{tmp_path / 'train.csv'} is a file, not a folder"),  # a fuzzer's
        (tmp_path / "dir.csv", "is a folder"),
        (tmp_path / "outdir", f"is a folder; give a file name such as {tmp_path / 'outdir' / 'predictions.csv'}"),
        (tmp_path / "sub" / ".." / "train.csv", "is the input table"),
        (tmp_path / "link.csv", "is the input table"),
        (tmp_path / "old.csv", "old.csv: already exists; choose another output file, or replace it with --overwrite"),
        (tmp_path / "dangling.csv", "dangling.csv: already exists"),  # a link to nothing was replaced unasked
    ]
    _write(tmp_path / "old.csv", "an earlier run\n")
    (tmp_path / "dir.csv").mkdir()
    (tmp_path / "outdir").mkdir()  # a folder without an extension was told to get one
    (tmp_path / "sub").mkdir()
    os.symlink(train, tmp_path / "link.csv")
    os.symlink(tmp_path / "nowhere" / "p.csv", tmp_path / "dangling.csv")
    for path, message in cases:
        with pytest.raises(TableError) as err:
            check_output(str(path), [train])
        assert message in str(err.value), path
    assert train.read_text() == "a\n1\n" and (tmp_path / "old.csv").read_text() == "an earlier run\n"
    assert (tmp_path / "dangling.csv").is_symlink()
    assert check_output(str(tmp_path / "old.csv"), [train], overwrite=True) == tmp_path / "old.csv"
    with pytest.raises(TableError, match="is the input table"):  # --overwrite never covers an input table
        check_output(str(train), [train], overwrite=True)


def test_write_csv_tsv_parquet_with_significant_digits(tmp_path, capsys):
    df = pl.DataFrame({"label": ["a", "b"], "p": [1 / 3, 1.23456789e-7]})
    write_table(df, tmp_path / "p.csv", float_digits=6)
    assert (tmp_path / "p.csv").read_text() == "label,p\na,0.333333\nb,1.23457e-7\n"
    write_table(df, tmp_path / "p.tsv", float_digits=6)
    assert (tmp_path / "p.tsv").read_text().splitlines()[1] == "a\t0.333333"
    write_table(df, tmp_path / "p.parquet", float_digits=6)
    assert pl.read_parquet(tmp_path / "p.parquet").equals(df)  # binary: kept whole
    write_table(df, None)
    assert capsys.readouterr().out.startswith("label,p\na,0.3333333333333333\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.csv", "p.parquet", "p.tsv"]
    assert oct((tmp_path / "p.csv").stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    out = _write(tmp_path / "p.csv", "old\n")
    with pytest.raises(TableError, match="cannot write it"):
        write_table(pl.DataFrame({"nested": [[1, 2]]}), out)  # CSV cannot hold a list column
    assert out.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["p.csv"]


def test_parquet_bytes_do_not_depend_on_the_batches_written(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    monkeypatch.setattr(table_write, "PARQUET_ROW_GROUP_ROWS", 5)
    df = pl.DataFrame({"label": [f"c{i % 3}" for i in range(23)], "p": [i / 7 for i in range(23)]})
    files = []
    for k, sizes in enumerate(([23], [7, 7, 7, 2], [1] * 23, [4, 0, 19])):
        path = tmp_path / f"p{k}.parquet"
        with TableWriter(path) as out:
            start = 0
            for n in sizes:
                out.write(df.slice(start, n))
                start += n
        files.append(path.read_bytes())
    assert all(f == files[0] for f in files)
    assert pl.read_parquet(tmp_path / "p0.parquet").equals(df)
    assert pq.ParquetFile(tmp_path / "p0.parquet").metadata.num_row_groups == 5


def test_an_error_while_writing_in_batches_leaves_the_old_file(tmp_path):
    out = _write(tmp_path / "p.csv", "old\n")
    with pytest.raises(RuntimeError, match="half-way"):
        with TableWriter(out) as writer:
            writer.write(pl.DataFrame({"x": [1, 2]}))
            raise RuntimeError("half-way")
    assert out.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["p.csv"]
    with TableWriter(out) as writer:
        for x in ([1, 2], [], [3]):
            writer.write(pl.DataFrame({"x": x}, schema={"x": pl.Int64}))
    assert out.read_text() == "x\n1\n2\n3\n" and writer.rows == 3
