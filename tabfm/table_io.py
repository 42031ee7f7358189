"""The tables of the `tabfm` command: CSV, TSV and Parquet read and written with polars.

Reading turns the usual missing-value tokens (NA_VALUES, as pandas and R read them) into missing cells, so a numeric
column with a few "NA" cells stays numeric instead of silently becoming a categorical one. Text cells are stripped
of surrounding blanks, and a text column whose every remaining cell is a number becomes numeric, one whose
every cell is an ISO-8601 date or date-time (2024-01-31, 2024-01-31T13:45:00, with an offset or Z) a date or
datetime column (the same for CSV and Parquet; other spellings such as 01/02/2024 stay text: their day and month
order would be a guess). Anything that cannot be read raises TableError: one line that names the file and says
what to do. Writing is tabfm.table_write's.

polars is imported inside the functions: the `tabfm` command imports this module to build its help.
"""

from __future__ import annotations

import contextlib
import csv
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
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

SEPARATOR_NAMES = {",": "comma", ";": "semicolon", "\t": "tab", "|": "pipe"}
"""Field separators a one-column header is checked for (a file read with the wrong one has a one-column header)."""

_PARQUET_MAGIC = b"PAR1"
ISO_DATE_START = re.compile(r"\d{4}-\d{1,2}-\d{1,2}")
_DATE_FORMAT = "%Y-%m-%d"
_DATETIME_FORMATS = tuple(f"%Y-%m-%d{t}%H:%M{s}" for t in ("T", " ") for s in (":%S%.f", ""))
"""ISO-8601 date-times a text cell may hold (seconds and their fraction optional; %z is added for an offset)."""


class TableError(ValueError):
    """A table that cannot be read or written; the message is one line naming the file and what to do."""


def na_tokens(extra: str | Iterable[str] = "", defaults: bool = True) -> list[str]:
    """The missing-value tokens: NA_VALUES (unless `defaults` is False) plus `extra`, a comma-separated string
    (as --na-values takes it) or a list."""
    items = extra.split(",") if isinstance(extra, str) else list(extra)
    tokens = list(NA_VALUES) if defaults else [""]
    return list(dict.fromkeys(tokens + [t.strip() for t in items if t.strip()]))


def read_table(path: str | Path, na_values: Sequence[str] = NA_VALUES, separator: str | None = None,
               decimal_comma: bool = False) -> pl.DataFrame:
    """A DataFrame from a .csv/.txt, .tsv or .parquet file with at least one row; `na_values` cells are missing.
    A text file's fields are split at `separator` (None: by extension); `decimal_comma` reads text cells such as
    1,5 as numbers.

    Raises TableError (one line, naming the file) for a missing, empty, ragged, non-UTF-8 or mislabelled file.
    """
    return read_table_and_text(path, None, na_values, separator, decimal_comma)[0]


def read_table_and_text(path: str | Path, column: str | None, na_values: Sequence[str] = NA_VALUES,
                        separator: str | None = None,
                        decimal_comma: bool = False) -> tuple[pl.DataFrame, pl.Series | None]:
    """read_table's DataFrame, and its `column` as the text its cells hold (stripped; the NA tokens and empty cells
    missing) before any reading as numbers or booleans: what a classifier's labels must be written as when '01'
    would otherwise read as 1, '007' and '7' as one class, or TRUE as true. From one read of the file (reading the
    column again as text was one more pass over it). The text is None for a Parquet file, whose columns are typed
    by whoever wrote it, or where there is no such column."""
    import polars as pl

    p, head = _checked_file(path)
    separator = _separator(p, separator)
    text = None
    if separator is None:
        df = _read_parquet(p, head)
    else:
        df = _read_text(p, head, separator, na_values, column)
    _check_header(p, df.columns)
    if df.height == 0:
        raise TableError(f"{path}: has a header ({len(df.columns)} columns) but no rows")
    if separator is not None and column in df.columns:
        text = df.get_column(column)
        try:
            typed = _typed_as_polars(text)
        except pl.exceptions.PolarsError:  # polars fails on its own inference (an integer past 128 bits): the
            typed = _read_text(p, head, separator, na_values).get_column(column)  # file read whole raises it
        df = df.with_columns(typed)
    return _tidy_text(df, na_values, decimal_comma), None if text is None else _text_cells(text, na_values)


def _separator(p: Path, separator: str | None) -> str | None:
    """The field separator of `p` (None: Parquet): `separator` for a text file when given, else its extension's,
    checked against its header (see _check_separator)."""
    default = READ_FORMATS[p.suffix.lower()]
    if default is None:
        return None
    separator = separator or default
    _check_separator(p, separator)
    return separator


def _check_separator(p: Path, separator: str) -> None:
    """A header that splits into one column holding another separator (a semicolon export read as CSV) would
    otherwise fail later as a ragged row or a missing column; say what the file looks like instead."""
    try:
        with p.open(newline="", encoding="utf-8", errors="replace") as f:
            header = next(csv.reader(f, delimiter=separator), [])
    except csv.Error:  # a field beyond csv's size limit: polars reads it, or reports it
        return
    if len(header) != 1:
        return
    for other, name in SEPARATOR_NAMES.items():
        if other != separator and other in header[0]:
            comma = " (and --decimal-comma if its numbers are written 1,5)" if other == ";" else ""
            raise TableError(f"{p}: the header {header[0][:60]!r} is one column holding {other!r}: the file looks "
                             f"{name}-separated; pass --separator {_shell_word(other)}{comma}, or save it as "
                             "comma-separated CSV")


def _shell_word(separator: str) -> str:
    """A separator as --separator takes it on a command line."""
    return "tab" if separator == "\t" else f"'{separator}'"


def _checked_file(path: str | Path) -> tuple[Path, bytes]:
    """(path, its first 64 bytes) of an existing, non-empty file with a readable extension; TableError if not."""
    p = Path(path)
    if p.is_dir():
        raise TableError(f"{path}: is a folder, not a table file")
    if not p.is_file():
        raise TableError(f"{path}: no such file")
    if p.suffix.lower() not in READ_FORMATS:
        raise TableError(f"{path}: unknown table format {p.suffix!r}; use .csv, .tsv or .parquet")
    try:
        with p.open("rb") as f:
            head = f.read(64)
    except OSError as e:
        raise TableError(f"{path}: cannot read it: {e.strerror}") from None
    if not head.strip():
        raise TableError(f"{path}: the file is empty; it needs a header line and at least one row")
    _check_magic(p, head)
    if READ_FORMATS[p.suffix.lower()] is not None:
        _check_text_encoding(p, head)
    return p, head


def _check_text_encoding(p: Path, head: bytes) -> None:
    """A UTF-16/32 file (a byte-order mark, or NUL bytes: Excel's "Unicode text") and a header line that is not
    UTF-8 are refused: polars decodes a header leniently, so the columns would get names such as 'caf\ufffd'
    (the rows' bad bytes are caught when they are read)."""
    if head.startswith((b"\xff\xfe", b"\xfe\xff")) or b"\x00" in head:
        raise TableError(f"{p}: UTF-16 or UTF-32 text (it has a byte-order mark or NUL bytes); save it as UTF-8 "
                         "(e.g. `iconv -f utf-16 -t utf-8`, or Excel's \"CSV UTF-8\")")
    with p.open("rb") as f:
        header = f.readline(1 << 20)
    if b"\r" in header.rstrip(b"\r\n") and b"\n" not in header:  # polars reads such a file as one line
        raise TableError(f"{p}: its lines end in a carriage return alone (classic Mac line endings); convert them to "
                         f"newlines (e.g. `tr '\\r' '\\n' < {p.name} > fixed{p.suffix}`, or save as \"CSV UTF-8\")")
    try:
        header.decode("utf-8")
    except UnicodeDecodeError as e:
        cut = len(header) == 1 << 20 and e.start >= len(header) - 3  # a character cut by the 1 MiB limit
        if not cut:
            raise TableError(_not_utf8(p)) from None


def _check_magic(p: Path, head: bytes) -> None:
    """A .parquet file must start as Parquet, a text file must not."""
    is_parquet = head.startswith(_PARQUET_MAGIC)
    if READ_FORMATS[p.suffix.lower()] is None and not is_parquet:
        start = head[:20].decode("utf-8", "replace").splitlines()[0] if head else ""
        raise TableError(f"{p}: not a Parquet file (it starts with {start!r}); if it is CSV text, name it .csv")
    if READ_FORMATS[p.suffix.lower()] is not None and is_parquet:
        raise TableError(f"{p}: this is a Parquet file, not {p.suffix} text; name it .parquet")


def _read_parquet(p: Path, head: bytes) -> pl.DataFrame:
    import polars as pl

    try:
        return pl.read_parquet(p)
    except (pl.exceptions.PolarsError, OSError) as e:
        raise _read_error(p, None, e) from None


def _read_text(p: Path, head: bytes, separator: str, na_values: Sequence[str], as_text: str | None = None
               ) -> pl.DataFrame:
    """The text file `p` as polars types it, but its column `as_text` (if any) read as text."""
    import polars as pl

    try:  # every row decides the column types: a float on row 20,000 of an integer column must not fail
        return pl.read_csv(p, separator=separator, null_values=list(na_values), infer_schema_length=None,
                           schema_overrides=None if as_text is None else {as_text: pl.String})
    except (pl.exceptions.PolarsError, OSError) as e:
        raise _read_error(p, separator, e) from None


def _typed_as_polars(text: pl.Series) -> pl.Series:
    """A text column (as read_csv read it with the file's null values) with the type read_csv gives it when it
    infers it: the column alone, written as a CSV (quoted where needed, a missing cell empty) and read back, so
    each rule of polars' inference (integers, Int128 past 64 bits, floats, true/false any case) is polars' own."""
    import io

    import polars as pl

    buffer = io.BytesIO()
    pl.DataFrame([text]).write_csv(buffer)
    buffer.seek(0)
    return pl.read_csv(buffer, infer_schema_length=None).to_series(0).alias(text.name)


def _read_error(p: Path, separator: str | None, e: Exception) -> TableError:
    """The one-line TableError for a polars or OS error met while reading `p` (separator None: Parquet)."""
    import polars as pl

    if isinstance(e, OSError):
        return TableError(f"{p}: cannot read it: {e.strerror}")
    if separator is None:
        return TableError(f"{p}: cannot read it as Parquet ({_first_line(e)}); is the file complete?")
    if isinstance(e, pl.exceptions.NoDataError):
        return TableError(f"{p}: the file is empty; it needs a header line and at least one row")
    message = str(e)
    if "utf-8" in message.lower() or "utf8" in message.lower():
        return TableError(_not_utf8(p))
    if "more fields" in message:
        return TableError(_ragged(p, separator))
    return TableError(f"{p}: cannot read it as {p.suffix} text ({_first_line(e)})")


def _not_utf8(p: Path) -> str:
    """Where the first byte that is not UTF-8 is (the file is read again, 1 MiB at a time, only on this error
    path)."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    line = 1
    with p.open("rb") as f:
        while chunk := f.read(1 << 20):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                pending = len(e.object) - len(chunk)  # bytes of a character cut by the previous chunk
                at = max(e.start - pending, 0)
                line += chunk.count(b"\n", 0, at)
                return (f"{p}: not UTF-8 text (byte 0x{chunk[at]:02x} on line {line}); "
                        "save it as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)")
            line += chunk.count(b"\n")
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


def short_rows(path: str | Path, separator: str | None = None, last_column_missing: int = 1) -> tuple[int, int] | None:
    """(rows with fewer fields than the header, the line of the first) of a CSV/TSV file, or None where there are
    none. polars (like pandas) reads a short row's absent last cells as missing without a word; a cut-off file or
    a lost separator looks just like that, so the CLI says so. Such a row leaves the last column missing, so
    callers pass how many cells of it are (0: no short row, and the file is not read again); Parquet has no rows
    to be short."""
    p = Path(path)
    separator = _separator(p, separator)
    if separator is None or not last_column_missing:
        return None
    count, first = 0, 0
    with p.open(newline="", encoding="utf-8") as f:
        reader = csv.reader(f, delimiter=separator)
        width = len(next(reader, []))
        for row in reader:
            if 0 < len(row) < width and row != [""]:  # a blank line is no short row (polars: every cell missing)
                count += 1
                first = first or reader.line_num
    return (count, first) if count else None


def _check_header(p: Path, columns: Sequence[str]) -> None:
    """polars renames a repeated column name to NAME_duplicated_0 without a word; refuse it instead. A column with
    no name is refused too: it is nearly always the row index pandas' to_csv writes, which the model would take
    for a feature (and which nothing could name in --target or --categorical)."""
    if "" in columns and list(columns).index("") == len(columns) - 1 > 0:
        raise TableError(f"{p}: the last column ({len(columns)}) has no name in the header: do the lines end in a "
                         "separator (such as a trailing ',')? Remove it, or give the column a name")
    if "" in columns:
        raise TableError(f"{p}: column {list(columns).index('') + 1} has no name in the header (the row index that "
                         "pandas' to_csv writes?): drop it (to_csv(..., index=False)) or give it a name")
    names = set(columns)
    for c in columns:
        m = re.fullmatch(r"(.*)_duplicated_\d+", c)
        if m and m.group(1) in names:
            raise TableError(f"{p}: column name {m.group(1)!r} appears more than once in the header; rename one")


def _tidy_text(df: pl.DataFrame, na_values: Sequence[str], decimal_comma: bool = False) -> pl.DataFrame:
    """Text columns stripped of blanks, NA tokens made missing, and turned numeric when every cell left is a number
    (so ' 3', ' NA' and an all-missing column read as numbers, as they would in a clean file; with `decimal_comma`,
    '1,5' too)."""
    import polars as pl

    tidy = []
    for name, dtype in df.schema.items():
        if dtype != pl.String:
            continue
        s = _text_cells(df.get_column(name), na_values)
        number_text = decimal_point_text(s) if decimal_comma else s
        for numeric in (pl.Int64, pl.Float64):
            cast = number_text.cast(numeric, strict=False)
            if cast.null_count() == s.null_count():
                s = cast
                break
        else:
            s = _as_temporal(s)
        tidy.append(s)
    return df.with_columns(tidy) if tidy else df


def _as_temporal(s: pl.Series) -> pl.Series:
    """Text `s` (stripped, NA tokens missing) as dates, naive date-times or UTC date-times when every cell reads as
    one of them (so the model sees seconds, not a category per day); `s` unchanged otherwise."""
    first = s.drop_nulls().head(1).to_list()
    if not first or not ISO_DATE_START.match(first[0]):  # one cell looked at: text columns cost nothing more
        return s
    for dtype in temporal_types():
        parsed = text_to_temporal(s, dtype)
        if parsed.null_count() == s.null_count():
            return parsed
    return s


def temporal_types() -> tuple[pl.DataType, ...]:
    """What a text column of ISO cells may read as, in the order tried: dates, naive date-times, UTC date-times."""
    import polars as pl

    return pl.Date, pl.Datetime("us"), pl.Datetime("us", "UTC")


def text_to_temporal(s: pl.Series, dtype: pl.DataType) -> pl.Series:
    """Text cells as `dtype` (Date, or Datetime: with an offset or Z when it has a time zone, naive otherwise),
    each cell read alone in ISO 8601 (so a batch reads as the whole table would); a cell that is not one is
    missing. A naive date-time may be a date alone, its midnight (a column of dates whose times are written only
    where they are not midnight; a date was refused where the train table had date-times); one with a time zone
    needs its offset, which a date alone does not give."""
    import polars as pl

    if dtype == pl.Date:
        return s.str.to_date(_DATE_FORMAT, strict=False)
    aware = dtype.time_zone is not None
    text = s.str.replace(r"Z$", "+00:00") if aware else s
    formats = [f + "%z" for f in _DATETIME_FORMATS] if aware else [*_DATETIME_FORMATS, _DATE_FORMAT]
    parsed = [text.str.to_datetime(f, strict=False, time_unit=dtype.time_unit) for f in formats]
    out = pl.select(pl.coalesce(parsed)).to_series().alias(s.name)
    return out.dt.convert_time_zone(dtype.time_zone) if aware else out


POINT_THOUSANDS = r"^[+-]?[1-9]\d{0,2}(\.\d{3})+(,\d+)?$"
"""A number written with a decimal comma and points grouping its thousands (2.981,74 or 4.500), as the exports
that write a decimal comma write them."""


def decimal_point_text(s: pl.Series) -> pl.Series:
    """Text cells with a decimal comma written with a point (1,5 -> 1.5), for reading them as numbers; points that
    group thousands before it are dropped (2.981,74 -> 2981.74: read as 2.981.74 they were no number, and the
    column became text)."""
    import polars as pl

    grouped = s.str.contains(POINT_THOUSANDS)
    whole = pl.select(pl.when(grouped).then(s.str.replace_all(".", "", literal=True)).otherwise(s)).to_series()
    return whole.str.replace(",", ".", literal=True).alias(s.name)


def _text_cells(s: pl.Series, na_values: Sequence[str]) -> pl.Series:
    """Text cells stripped of surrounding blanks, the NA tokens among them missing."""
    import polars as pl

    s = s.str.strip_chars()
    return pl.select(pl.when(s.is_in(list(na_values))).then(None).otherwise(s).alias(s.name)).to_series()


class TableScan:
    """A table file read in batches of rows, for tables larger than memory (`tabfm predict --test`).

    Opening it checks what read_table checks up front (the file, its header, at least one row: counted in one
    streaming pass) and reads the first `check_rows` rows, so a file that is bad from the start is refused before
    any work; a bad row further on raises the same TableError from batches(). batches() reads the cells as text and
    gives each column the type it has in another table (the train table's schema), cell by cell, so a batch whose
    column happens to be all missing or all integers is read exactly as in any other batch, whatever the batch size.
    """

    def __init__(self, path: str | Path, na_values: Sequence[str] = NA_VALUES, check_rows: int = 1000,
                 separator: str | None = None, decimal_comma: bool = False):
        import polars as pl

        self.path, _ = _checked_file(path)
        self.na_values = list(na_values)
        self.decimal_comma = decimal_comma
        self._separator = _separator(self.path, separator)
        with self._reading():
            if self._separator is None:
                self._frame = pl.scan_parquet(self.path)
            else:
                self._frame = pl.scan_csv(self.path, separator=self._separator, null_values=self.na_values,
                                          infer_schema=False)
            self.columns: list[str] = self._frame.collect_schema().names()
            _check_header(self.path, self.columns)
            counts = self._frame.select(pl.len(), pl.col(self.columns[-1]).is_null().sum()).collect().row(0)
            self.n_rows: int = counts[0]
            self._last_missing: int = counts[1]  # a short row leaves the last column missing (short_rows)
            self._frame.head(check_rows).collect()
        if self.n_rows == 0:
            raise TableError(f"{self.path}: has a header ({len(self.columns)} columns) but no rows")

    @contextlib.contextmanager
    def _reading(self):
        """polars and OS errors while reading become read_table's one-line TableErrors."""
        import polars as pl

        try:
            yield
        except (pl.exceptions.PolarsError, OSError) as e:
            raise _read_error(self.path, self._separator, e) from None

    def short_rows(self) -> tuple[int, int] | None:
        """table_io.short_rows of this file (its last column's missing cells were counted with its rows)."""
        return short_rows(self.path, self._separator, self._last_missing)

    def batches(self, schema: Mapping[str, pl.DataType], rows: int) -> Iterator[pl.DataFrame]:
        """The columns named in `schema`, `rows` rows at a time (about: polars decides the exact sizes), each
        column conformed to its schema type (see conform)."""
        offset = 0
        with self._reading():
            for batch in self._frame.select(list(schema)).collect_batches(chunk_size=rows, lazy=True):
                yield conform(batch, schema, self.na_values, f"{self.path}", offset, self.decimal_comma)
                offset += batch.height


def conform(df: pl.DataFrame, schema: Mapping[str, pl.DataType], na_values: Sequence[str] = NA_VALUES,
            where: str = "table", offset: int = 0, decimal_comma: bool = False) -> pl.DataFrame:
    """`df`'s text columns read as `schema` says, cell by cell (never from what the other cells hold): stripped,
    NA tokens missing, then numbers where the schema has a number, dates or date-times where it has one (ISO 8601,
    see text_to_temporal; a cell that is neither is a TableError naming it and its row, counted from `offset`),
    True/False for a boolean column's true/false in any case (the categories a boolean column has), text otherwise.
    Columns that are not text are kept as they are. `decimal_comma`: a number may be written 1,5."""
    import polars as pl

    out = []
    for name, dtype in schema.items():
        s = df.get_column(name)
        if s.dtype != pl.String:
            out.append(s)
            continue
        s = _text_cells(s, na_values)
        if dtype.is_numeric():
            number_text = decimal_point_text(s) if decimal_comma else s
            s = _read_cells(s, number_text.cast(pl.Float64, strict=False), "numbers", where, offset)
        elif dtype in (pl.Date, pl.Datetime):
            s = _read_cells(s, text_to_temporal(s, dtype), _temporal_words(dtype), where, offset)
        elif dtype.is_temporal():
            raise TableError(f"{where}: column {name!r} is {dtype} in the train table, which text cells are not read "
                             "as; give this table as Parquet")
        elif dtype == pl.Boolean:
            low = s.str.to_lowercase()
            s = pl.select(pl.when(low == "true").then(pl.lit("True")).when(low == "false").then(pl.lit("False"))
                          .otherwise(s).alias(name)).to_series()
        out.append(s)
    frame = pl.DataFrame(out)
    check_finite(frame, where, offset)
    return frame


def check_finite(df: pl.DataFrame, where: str = "table", offset: int = 0) -> None:
    """A TableError naming the first infinite cell of `df`'s float columns and its row (counted from `offset`):
    'inf' and 1e400 read as floats, and the estimators take no infinity (NaN, a missing cell, is fine)."""
    for s in df.iter_columns():
        if s.dtype.is_float():
            bad = s.is_infinite().fill_null(False).arg_true()
            if len(bad):
                raise TableError(f"{where}: column {s.name!r} holds {s[bad[0]]} (row {offset + bad[0] + 1}); the "
                                 "model takes finite numbers: replace it, or leave the cell empty (missing)")


def _temporal_words(dtype: pl.DataType) -> str:
    """What conform's error says the train table has, with the spelling a cell needs."""
    import polars as pl

    if dtype == pl.Date:
        return "dates (such as 2024-01-31)"
    if dtype.time_zone is None:
        return "date-times (such as 2024-01-31T13:45:00)"
    return "date-times with an offset (such as 2024-01-31T13:45:00+01:00)"


def _read_cells(s: pl.Series, read: pl.Series, what: str, where: str, offset: int) -> pl.Series:
    """`read` (the text cells `s` read as `what`), or a TableError naming the first cell that did not read."""
    bad = (read.is_null() & s.is_not_null()).arg_true()
    if len(bad):
        raise TableError(f"{where}: column {s.name!r} holds {s[bad[0]]!r} (row {offset + bad[0] + 1}) where the "
                         f"train table has {what}; fix that cell, or add it to the missing-value tokens "
                         "(--na-values) if it means missing")
    return read


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
