"""The tables of the `tabfm` command: CSV, TSV and Parquet read and written with polars.

Reading turns the usual missing-value tokens (NA_VALUES, as pandas and R read them) into missing cells, so a numeric
column with a few "NA" cells stays numeric instead of silently becoming a categorical one. Text cells are stripped
of surrounding blanks, and a text column whose every remaining cell is a number becomes numeric (the same for CSV
and Parquet). Anything that cannot be read or written raises TableError: one line that names the file and says
what to do. Writing checks the extension first, refuses to overwrite an input table, and is atomic (a temporary
file renamed into place), so a failure leaves nothing behind.

polars is imported inside the functions: the `tabfm` command imports this module to build its help.
"""

from __future__ import annotations

import csv
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import polars as pl

NA_VALUES: tuple[str, ...] = (
    "", "NA", "N/A", "n/a", "#N/A", "#N/A N/A", "#NA", "<NA>", "NaN", "nan", "-NaN", "-nan", "NAN",
    "null", "NULL", "None", "?", "-", ".", "-1.#IND", "1.#IND", "-1.#QNAN", "1.#QNAN",
)
"""Cells read as missing by default: pandas' default list, R's NA, and "?", "-", "." (common in hand-made and
UCI tables). Matched exactly (case-sensitive) after stripping blanks; empty cells are always missing."""

READ_FORMATS = {".csv": ",", ".txt": ",", ".tsv": "\t", ".parquet": None}
"""Readable extensions and their field separator (None: Parquet)."""

WRITE_FORMATS = (".csv", ".tsv", ".parquet")
STDOUT = "-"
_PARQUET_MAGIC = b"PAR1"


class TableError(ValueError):
    """A table that cannot be read or written; the message is one line naming the file and what to do."""


def na_tokens(extra: str | Iterable[str] = "", defaults: bool = True) -> list[str]:
    """The missing-value tokens: NA_VALUES (unless `defaults` is False) plus `extra`, a comma-separated string
    (as --na-values takes it) or a list."""
    items = extra.split(",") if isinstance(extra, str) else list(extra)
    tokens = list(NA_VALUES) if defaults else [""]
    return list(dict.fromkeys(tokens + [t.strip() for t in items if t.strip()]))


def read_table(path: str | Path, na_values: Sequence[str] = NA_VALUES) -> pl.DataFrame:
    """A DataFrame from a .csv/.txt, .tsv or .parquet file with at least one row; `na_values` cells are missing.

    Raises TableError (one line, naming the file) for a missing, empty, ragged, non-UTF-8 or mislabelled file.
    """
    p = Path(path)
    if p.is_dir():
        raise TableError(f"{path}: is a folder, not a table file")
    if not p.is_file():
        raise TableError(f"{path}: no such file")
    suffix = p.suffix.lower()
    if suffix not in READ_FORMATS:
        raise TableError(f"{path}: unknown table format {p.suffix!r}; use .csv, .tsv or .parquet")
    try:
        with p.open("rb") as f:
            head = f.read(64)
    except OSError as e:
        raise TableError(f"{path}: cannot read it: {e.strerror}") from None
    if not head.strip():
        raise TableError(f"{path}: the file is empty; it needs a header line and at least one row")
    if READ_FORMATS[suffix] is None:
        df = _read_parquet(p, head)
    else:
        df = _read_text(p, head, READ_FORMATS[suffix], na_values)
    _check_header(p, df)
    if df.height == 0:
        raise TableError(f"{path}: has a header ({len(df.columns)} columns) but no rows")
    return _tidy_text(df, na_values)


def _read_parquet(p: Path, head: bytes) -> pl.DataFrame:
    import polars as pl

    if not head.startswith(_PARQUET_MAGIC):
        start = head[:20].decode("utf-8", "replace").splitlines()[0] if head else ""
        raise TableError(f"{p}: not a Parquet file (it starts with {start!r}); if it is CSV text, name it .csv")
    try:
        return pl.read_parquet(p)
    except (pl.exceptions.PolarsError, OSError) as e:
        raise TableError(f"{p}: cannot read it as Parquet ({_first_line(e)}); is the file complete?") from None


def _read_text(p: Path, head: bytes, separator: str, na_values: Sequence[str]) -> pl.DataFrame:
    import polars as pl

    if head.startswith(_PARQUET_MAGIC):
        raise TableError(f"{p}: this is a Parquet file, not {p.suffix} text; name it .parquet")
    try:  # every row decides the column types: a float on row 20,000 of an integer column must not fail
        return pl.read_csv(p, separator=separator, null_values=list(na_values), infer_schema_length=None)
    except pl.exceptions.NoDataError:
        raise TableError(f"{p}: the file is empty; it needs a header line and at least one row") from None
    except pl.exceptions.PolarsError as e:
        message = str(e)
        if "utf-8" in message.lower() or "utf8" in message.lower():
            raise TableError(_not_utf8(p)) from None
        if "more fields" in message:
            raise TableError(_ragged(p, separator)) from None
        raise TableError(f"{p}: cannot read it as {p.suffix} text ({_first_line(e)})") from None
    except OSError as e:
        raise TableError(f"{p}: cannot read it: {e.strerror}") from None


def _not_utf8(p: Path) -> str:
    """Where the first byte that is not UTF-8 is (the file is read again only on this error path)."""
    data = p.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        return (f"{p}: not UTF-8 text (byte 0x{data[e.start]:02x} on line {line}); "
                "save it as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)")
    return f"{p}: not valid UTF-8 text; save it as UTF-8"


def _ragged(p: Path, separator: str) -> str:
    """The first row with more fields than the header (read again only on this error path)."""
    with p.open(newline="", encoding="utf-8") as f:
        reader = csv.reader(f, delimiter=separator)
        width = len(next(reader))
        for row in reader:
            if len(row) > width:
                return (f"{p}: line {reader.line_num} has {len(row)} fields but the header has {width}; "
                        "fix that row (a separator inside a value needs quotes)")
    return f"{p}: a row has more fields than the header; fix that row (a separator inside a value needs quotes)"


def _check_header(p: Path, df: pl.DataFrame) -> None:
    """polars renames a repeated column name to NAME_duplicated_0 without a word; refuse it instead."""
    names = set(df.columns)
    for c in df.columns:
        m = re.fullmatch(r"(.*)_duplicated_\d+", c)
        if m and m.group(1) in names:
            raise TableError(f"{p}: column name {m.group(1)!r} appears more than once in the header; rename one")


def _tidy_text(df: pl.DataFrame, na_values: Sequence[str]) -> pl.DataFrame:
    """Text columns stripped of blanks, NA tokens made missing, and turned numeric when every cell left is a number
    (so ' 3', ' NA' and an all-missing column read as numbers, as they would in a clean file)."""
    import polars as pl

    tidy = []
    for name, dtype in df.schema.items():
        if dtype != pl.String:
            continue
        s = df.get_column(name).str.strip_chars()
        s = pl.select(pl.when(s.is_in(list(na_values))).then(None).otherwise(s).alias(name)).to_series()
        for numeric in (pl.Int64, pl.Float64):
            cast = s.cast(numeric, strict=False)
            if cast.null_count() == s.null_count():
                s = cast
                break
        tidy.append(s)
    return df.with_columns(tidy) if tidy else df


def mostly_numeric_text(df: pl.DataFrame) -> list[tuple[str, int, int, list[str]]]:
    """Text columns where most cells are numbers: (column, numbers, non-missing cells, up to 3 of the other values).

    Such a column is read as categories, which is rarely what was meant: the other values are usually a missing
    token that is not in the NA list, or a typo.
    """
    import polars as pl

    found = []
    for name, dtype in df.schema.items():
        if dtype != pl.String:
            continue
        s = df.get_column(name).drop_nulls()
        numbers = s.cast(pl.Float64, strict=False)
        n = s.len()
        k = n - numbers.null_count()
        if n and 2 * k > n:
            others = s.filter(numbers.is_null()).unique(maintain_order=True).head(3).to_list()
            found.append((name, k, n, others))
    return found


def check_output(path: str | None, inputs: Iterable[str | Path] = ()) -> Path | None:
    """The output path (None: stdout), checked before any work: a known extension, an existing folder, and not
    one of the `inputs` (which it would overwrite)."""
    if path is None or path == STDOUT:
        return None
    p = Path(path)
    if p.suffix.lower() not in WRITE_FORMATS:
        what = f"extension {p.suffix!r}" if p.suffix else "no extension"
        raise TableError(f"{path}: cannot write a table with {what}; name it .csv, .tsv or .parquet "
                         "(or leave -o out for stdout)")
    if p.is_dir():
        raise TableError(f"{path}: is a folder; give a file name such as {p / 'predictions.csv'}")
    folder = p.parent
    if not folder.is_dir():
        raise TableError(f"{path}: folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK):
        raise TableError(f"{path}: cannot write into folder {folder} (permission denied)")
    for source in inputs:
        if _same_file(p, Path(source)):
            raise TableError(f"{path}: is the input table {source}; writing there would overwrite it, choose "
                             "another output file")
    return p


def _same_file(a: Path, b: Path) -> bool:
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()


def write_table(df: pl.DataFrame, path: str | Path | None, float_digits: int | None = None) -> None:
    """Write `df` as CSV to stdout (path None) or by extension to .csv, .tsv or .parquet, atomically.

    `float_digits` rounds float columns to that many significant digits in text output (Parquet keeps them whole).
    """
    import polars as pl

    p = check_output(None if path is None else str(path))
    if float_digits is not None and (p is None or p.suffix.lower() != ".parquet"):
        df = df.with_columns(pl.col(pl.Float32, pl.Float64).round_sig_figs(float_digits))
    if p is None:
        _write_stdout(df.write_csv())
        return
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    os.close(fd)
    try:
        suffix = p.suffix.lower()
        if suffix == ".parquet":
            df.write_parquet(tmp)
        else:
            df.write_csv(tmp, separator="\t" if suffix == ".tsv" else ",")
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, p)
    except (OSError, pl.exceptions.PolarsError) as e:
        Path(tmp).unlink(missing_ok=True)
        raise TableError(f"{path}: cannot write it ({_first_line(e)})") from None


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


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
