"""Writing the tables of the `tabfm` command (CSV, TSV, Parquet, or stdout): the output checked before any work, rows
written as they come, atomically.

Writing checks the extension first, refuses to overwrite an input table (or an earlier run's output unless asked),
and is atomic (a temporary file renamed into place), so a failure leaves nothing behind. Errors are
tabfm.table_io.TableError: one line that names the file and says what to do.

polars is imported inside the functions: the `tabfm` command imports this module to build its help.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from tabfm.out_paths import file_in_the_way
from tabfm.table_io import TableError, _first_line

if TYPE_CHECKING:
    import polars as pl

WRITE_FORMATS = (".csv", ".tsv", ".parquet")
STDOUT = "-"


def check_output(path: str | None, inputs: Iterable[str | Path] = (), overwrite: bool = False) -> Path | None:
    """The output path (None: stdout), checked before any work: a known extension, an existing folder, not one
    of the `inputs` (which it would overwrite), and not an existing file unless `overwrite` (an earlier run's
    predictions are not replaced silently)."""
    if path is None or path == STDOUT:
        return None
    p = Path(path)
    if p.is_dir():  # first: an existing folder named without an extension was told to get one
        raise TableError(f"{path}: is a folder; give a file name such as {p / 'predictions.csv'}")
    if p.suffix.lower() not in WRITE_FORMATS:
        what = f"extension {p.suffix!r}" if p.suffix else "no extension"
        raise TableError(f"{path}: cannot write a table with {what}; name it .csv, .tsv or .parquet "
                         "(or leave -o out for stdout)")
    folder = p.parent
    blocker = file_in_the_way(p)
    if blocker is not None:
        raise TableError(f"{path}: {blocker} is a file, not a folder; choose an output path in a folder")
    if not folder.is_dir():
        raise TableError(f"{path}: folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK):
        raise TableError(f"{path}: cannot write into folder {folder} (permission denied)")
    for source in inputs:
        if _same_file(p, Path(source)):
            raise TableError(f"{path}: is the input table {source}; writing there would overwrite it, choose "
                             "another output file")
    if (p.exists() or p.is_symlink()) and not overwrite:  # a link to nothing is still someone's path
        raise TableError(f"{path}: already exists; choose another output file, or replace it with --overwrite")
    return p


def _same_file(a: Path, b: Path) -> bool:
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()


STDOUT_SPOOL_BYTES = 64 << 20
"""Text for stdout kept in memory up to this size, then in a temporary file, until the output is complete."""

PARQUET_ROW_GROUP_ROWS = 65_536
"""Rows per Parquet row group written by TableWriter, whatever the batches written: the file's bytes do not
depend on how the rows arrived."""


def write_table(df: pl.DataFrame, path: str | Path | None, float_digits: int | None = None) -> None:
    """Write `df` as CSV to stdout (path None) or by extension to .csv, .tsv or .parquet, atomically.

    `float_digits` rounds float columns to that many significant digits in text output (Parquet keeps them whole).
    """
    with TableWriter(path, float_digits) as out:
        out.write(df)


class TableWriter:
    """Writes a table batch by batch (`with TableWriter(path) as out: out.write(batch)`), memory bounded by a
    batch: CSV to stdout (path None), or by extension to .csv, .tsv or .parquet through a temporary file in the
    same folder, renamed into place when the `with` block ends without an error and removed when it fails, so a
    failure leaves nothing half-written. Stdout gets the same guarantee: the text is spooled (in memory up to
    STDOUT_SPOOL_BYTES, then in a temporary file) and copied out only when the block succeeds, since what a pipe
    or a redirected file has received cannot be taken back. `float_digits` rounds float columns to that many significant digits in
    text output (Parquet keeps them whole). The bytes written do not depend on how the rows are split into batches.
    """

    def __init__(self, path: str | Path | None, float_digits: int | None = None):
        # a file there is replaced only when the `with` block succeeds; callers refuse one first (check_output)
        self.path = check_output(None if path is None else str(path), overwrite=True)
        self.float_digits = float_digits
        self.rows = 0
        self._suffix = "" if self.path is None else self.path.suffix.lower()
        self._tmp: str | None = None
        self._file = None
        self._parquet = None
        self._pending: list = []  # Parquet: arrow tables not yet written as a row group
        self._header = False  # text: the header line is written

    def __enter__(self) -> TableWriter:
        if self.path is None:
            self._file = tempfile.SpooledTemporaryFile(max_size=STDOUT_SPOOL_BYTES, mode="w+b")
        else:
            fd, self._tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
            self._file = os.fdopen(fd, "wb")
        return self

    def write(self, df: pl.DataFrame) -> None:
        """Append the rows of `df` (the same columns and types in every batch)."""
        import polars as pl

        try:
            if self._suffix == ".parquet":
                self._write_parquet(df.to_arrow())
            else:
                if self.float_digits is not None:
                    df = df.with_columns(pl.col(pl.Float32, pl.Float64).round_sig_figs(self.float_digits))
                text = df.write_csv(separator="\t" if self._suffix == ".tsv" else ",", include_header=not self._header)
                self._header = True
                self._file.write(text.encode())
        except (OSError, ValueError, pl.exceptions.PolarsError) as e:
            raise TableError(f"{self.path}: cannot write it ({_first_line(e)})") from None
        self.rows += df.height

    def _write_parquet(self, table) -> None:
        """Buffer the rows; write every full PARQUET_ROW_GROUP_ROWS of them as one row group."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        if self._parquet is None:
            self._parquet = pq.ParquetWriter(self._file, table.schema, compression="zstd")
        self._pending.append(table)
        buffered = sum(t.num_rows for t in self._pending)
        if buffered < PARQUET_ROW_GROUP_ROWS:
            return
        rows = pa.concat_tables(self._pending)
        full = buffered - buffered % PARQUET_ROW_GROUP_ROWS
        for start in range(0, full, PARQUET_ROW_GROUP_ROWS):
            self._parquet.write_table(rows.slice(start, PARQUET_ROW_GROUP_ROWS).combine_chunks())
        self._pending = [rows.slice(full)] if full < buffered else []

    def __exit__(self, kind, error, traceback) -> None:
        if self._file is None:
            return
        done = False
        try:
            if kind is None:
                self._finish()
                done = True
        except (OSError, ValueError) as e:
            raise TableError(f"{self.path}: cannot write it ({_first_line(e)})") from None
        finally:
            if not done:
                self._abandon()

    def _abandon(self) -> None:
        """Close and remove the temporary file (after an error)."""
        with contextlib.suppress(Exception):
            if self._parquet is not None:
                self._parquet.close()
        self._file.close()
        if self._tmp is not None:
            Path(self._tmp).unlink(missing_ok=True)

    def _finish(self) -> None:
        """Write what is buffered, close and rename into place (stdout: copy the spooled text out)."""
        import codecs

        import pyarrow as pa

        if self.path is None:
            self._file.seek(0)
            decoder = codecs.getincrementaldecoder("utf-8")()
            while chunk := self._file.read(1 << 20):
                _write_stdout(decoder.decode(chunk))
            self._file.close()
            return

        if self._parquet is not None:
            if self._pending:
                self._parquet.write_table(pa.concat_tables(self._pending).combine_chunks())
            self._parquet.close()
        self._file.close()
        os.chmod(self._tmp, 0o666 & ~_umask())
        os.replace(self._tmp, self.path)


def _write_stdout(text: str) -> None:
    """Print, and leave quietly when the reader has gone (`tabfm predict ... | head`)."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python exits


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
