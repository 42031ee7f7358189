"""Text columns that were likely meant as numbers or dates: the warnings `tabfm predict` (and, for numbers, the
estimators: tabfm.preprocess) give about a column read as text, naming its odd cells.

Why apart from tabfm.table_io: reading a table decides each column's type cell by cell and never guesses; these
look at a column that ended up text and say what would have made it numbers or dates (a missing-value token, a
thousands separator, a decimal comma, an impossible date), which the user then decides.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tabfm.table_io import ISO_DATE_START, decimal_point_text, temporal_types, text_to_temporal

if TYPE_CHECKING:
    import polars as pl


THOUSANDS = r"^[+-]?[1-9]\d{0,2}(,\d{3})+(\.\d+)?$"
"""A number written with thousands separators (1,000 or 12,345,678.5, never 0,125); a decimal comma writes 1,000
too."""


def thousands_text(df: pl.DataFrame) -> list[tuple[str, str]]:
    """Text columns where most cells are numbers once cells such as 1,000 count as numbers, and every cell with a
    comma reads so: (column, an example cell). Whether 1,000 is a thousand (a separator) or 1.0 (a decimal comma)
    the file cannot say, so neither reading is taken for the user; without this a column of half 850 and half
    1,000 was read as categories without a word."""
    import polars as pl

    found = []
    for name, dtype in df.schema.items():
        if dtype != pl.String:
            continue
        s = df.get_column(name).drop_nulls().str.strip_chars()
        grouped = s.str.contains(THOUSANDS)
        comma = s.str.contains(",", literal=True)
        plain = s.cast(pl.Float64, strict=False).is_not_null()
        if grouped.any() and (grouped == comma).all() and 2 * (grouped | plain).sum() > s.len():
            found.append((name, s.filter(grouped)[0]))
    return found


def decimal_comma_text(df: pl.DataFrame) -> list[tuple[str, str]]:
    """Text columns most of whose cells are numbers written with a decimal comma: (column, an example cell).

    Such a column (a semicolon export read without --decimal-comma) is read as categories, which is not what was
    meant. Columns whose commas all group thousands (thousands_text) are left to that warning."""
    import polars as pl

    found = []
    grouped = {name for name, _ in thousands_text(df)}
    for name, dtype in df.schema.items():
        if dtype != pl.String or name in grouped:
            continue
        s = df.get_column(name).drop_nulls()
        number = decimal_point_text(s).cast(pl.Float64, strict=False).is_not_null()
        comma = s.str.contains(",", literal=True) & number
        if s.len() and 2 * comma.sum() > s.len():
            found.append((name, s.filter(comma)[0]))
    return found


def mostly_numeric_text(df: pl.DataFrame, decimal_comma: bool = False) -> list[tuple[str, int, int, list[str]]]:
    """Text columns where most cells are numbers (written with a decimal comma, with `decimal_comma`): (column,
    numbers, non-missing cells, up to 3 of the other values).

    Such a column is read as categories, which is rarely what was meant: the other values are usually a missing
    token that is not in the NA list, or a typo. Only finite numbers count: "nan" and "inf", which polars reads as
    floats, are what `astype(str)` makes of missing cells, and converting such a column as advised would empty it.
    """
    import polars as pl

    found = []
    for name, dtype in df.schema.items():
        if dtype != pl.String:
            continue
        s = df.get_column(name).drop_nulls()
        text = decimal_point_text(s) if decimal_comma else s
        finite = text.cast(pl.Float64, strict=False).is_finite().fill_null(False)
        n = s.len()
        k = int(finite.sum())
        if n and 2 * k > n:
            others = s.filter(~finite).unique(maintain_order=True).head(3).to_list()
            found.append((name, k, n, others))
    return found


def mostly_temporal_text(df: pl.DataFrame) -> list[tuple[str, int, int, list[str]]]:
    """Text columns where most cells are ISO dates or date-times but some are not (2020-02-30, a typo): (column,
    dates, non-missing cells, up to 3 of the other values). Such a column is read as categories, every later date
    a category the train rows never saw, which was done without a word."""
    import polars as pl

    found = []
    for name, dtype in df.schema.items():
        if dtype != pl.String:
            continue
        s = df.get_column(name).drop_nulls().str.strip_chars()
        n = s.len()
        if not n or 2 * int(s.str.contains(ISO_DATE_START.pattern).sum()) <= n:
            continue
        read = max((text_to_temporal(s, t).is_not_null() for t in temporal_types()), key=lambda ok: int(ok.sum()))
        k = int(read.sum())
        if k < n and 2 * k > n:
            found.append((name, k, n, s.filter(~read).unique(maintain_order=True).head(3).to_list()))
    return found
