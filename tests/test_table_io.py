"""tabfm.table_io: NA tokens read as missing, clear one-line errors for files that cannot be read, tables read in
batches with another table's column types (every batch alike). Writing is tests/test_table_write.py's."""

from __future__ import annotations

from datetime import date, datetime

import polars as pl
import pytest

from tabfm import table_io
from tabfm.table_io import NA_VALUES, TableError, TableScan, na_tokens, read_table, read_table_and_text
from tabfm.text_columns import decimal_comma_text, mostly_numeric_text, mostly_temporal_text, thousands_text


def _write(path, data: bytes | str):
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def test_na_tokens_are_missing_and_numeric_columns_stay_numeric(tmp_path):
    f = _write(tmp_path / "t.csv",
               "x,colour,y\n1.5,red,1\nNA,NA,2\n?,blue,3\n, N/A ,4\n-,.,5\n 2 ,None,6\nnull,green,7\n")
    df = read_table(f)
    assert df.schema == pl.Schema({"x": pl.Float64, "colour": pl.String, "y": pl.Int64})
    assert df["x"].to_list() == [1.5, None, None, None, None, 2.0, None]
    assert df["colour"].to_list() == ["red", None, "blue", None, None, None, "green"]
    assert mostly_numeric_text(df) == []


def test_na_values_extend_or_replace_the_defaults(tmp_path):
    f = _write(tmp_path / "t.csv", "x,grade\n1,NA\nmissing,B\n3,-\n")
    df = read_table(f, na_tokens("missing"))
    assert df["x"].to_list() == [1, None, 3] and df["grade"].to_list() == [None, "B", None]
    df = read_table(f, na_tokens("missing", defaults=False))  # 'NA' and '-' are categories here
    assert df["grade"].to_list() == ["NA", "B", "-"]
    assert na_tokens(" a, b ,,a") == [*NA_VALUES, "a", "b"]


def test_a_column_that_is_mostly_numbers_is_reported(tmp_path):
    f = _write(tmp_path / "t.csv", "x,colour\n1,red\nn.a.,blue\n3,red\n4,green\nunknown,red\n6,blue\n")
    df = read_table(f)
    assert df["x"].dtype == pl.String  # read as categories: the caller warns
    assert mostly_numeric_text(df) == [("x", 4, 6, ["n.a.", "unknown"])]
    assert read_table(f, na_tokens("n.a.,unknown"))["x"].to_list() == [1, None, 3, 4, None, 6]


def test_nan_and_inf_text_are_not_counted_as_numbers():
    """polars reads "nan" and "inf" as floats; a column of them (what astype(str) makes of missing cells) is not
    mostly numbers, and the warning's advice to convert it would have emptied it."""
    df = pl.DataFrame({"s": ["nan", "b", "nan", "inf", "nan"], "t": ["1", "2", "nan", "3", "-inf"]})
    assert mostly_numeric_text(df) == [("t", 3, 5, ["nan", "-inf"])]


def test_types_come_from_every_row(tmp_path):
    rows = "\n".join(str(i) for i in range(20_000))
    df = read_table(_write(tmp_path / "t.csv", f"x\n{rows}\n0.5\n"))
    assert df["x"].dtype == pl.Float64 and df.height == 20_001


def test_parquet_and_tsv_read_the_same_tokens(tmp_path):
    frame = pl.DataFrame({"x": ["1", "NA", " 3 "], "c": ["a", "?", "b"]})
    frame.write_parquet(tmp_path / "t.parquet")
    expected = pl.DataFrame({"x": [1, None, 3], "c": ["a", None, "b"]})
    assert read_table(tmp_path / "t.parquet").equals(expected)
    _write(tmp_path / "t.tsv", "x\tc\n1\ta\nNA\t?\n 3 \tb\n")
    assert read_table(tmp_path / "t.tsv").equals(expected)


def test_iso_dates_read_as_dates_and_other_text_stays_text(tmp_path):
    f = _write(tmp_path / "t.csv", "d,t,z,us,free,mixed,n\n"
               "2024-01-31,2024-01-31T13:45:00,2024-01-31T13:45:00Z,03/12/2020,hello,2024-01-31,20240131\n"
               " 2024-02-29 ,2024-02-01 08:00,2024-01-31T13:45:00.5+01:00,04/11/2020,2024-01-31 x,soon,20240201\n"
               "NA,?,,-,NA,NA,NA\n")
    df = read_table(f)
    assert df.schema == pl.Schema({"d": pl.Date, "t": pl.Datetime("us"), "z": pl.Datetime("us", "UTC"),
                                   "us": pl.String, "free": pl.String, "mixed": pl.String, "n": pl.Int64})
    assert df["d"].to_list() == [date(2024, 1, 31), date(2024, 2, 29), None]
    assert df["t"].to_list() == [datetime(2024, 1, 31, 13, 45), datetime(2024, 2, 1, 8, 0), None]
    assert [v.replace(tzinfo=None) for v in df["z"].drop_nulls()] == [datetime(2024, 1, 31, 13, 45),
                                                                      datetime(2024, 1, 31, 12, 45, 0, 500_000)]
    assert df["us"].to_list() == ["03/12/2020", "04/11/2020", None]  # day or month first: not guessed
    assert df["free"].to_list() == ["hello", "2024-01-31 x", None] and df["mixed"][1] == "soon"
    # in batches of one row, given the whole table's types, every cell reads as it did in the whole table
    assert pl.concat(TableScan(f).batches(df.schema, 1)).equals(df.with_columns(pl.col("n").cast(pl.Float64)))
    pl.DataFrame({"d": ["2024-01-31", None]}).write_parquet(tmp_path / "t.parquet")  # the same for Parquet text
    assert read_table(tmp_path / "t.parquet")["d"].to_list() == [date(2024, 1, 31), None]


def test_a_cell_that_is_not_a_date_in_a_date_column_is_named(tmp_path):
    f = _write(tmp_path / "t.csv", "d,t\n2024-01-31,2024-01-31T13:45:00\n31/01/2024,2024-01-31\n")
    with pytest.raises(TableError, match=r"t.csv: column 'd' holds '31/01/2024' \(row 2\) where the train table "
                       r"has dates \(such as 2024-01-31\); fix that cell"):
        list(TableScan(f).batches({"d": pl.Date}, 10))
    with pytest.raises(TableError, match=r"column 't' holds '2024-01-31' \(row 2\) where the train table has "
                       r"date-times with an offset \(such as 2024-01-31T13:45:00\+01:00\)"):  # no zone in a date
        list(TableScan(_write(tmp_path / "z.csv", "t\n2024-01-31T13:45:00Z\n2024-01-31\n")).batches(
            {"t": pl.Datetime("ns", "UTC")}, 10))
    with pytest.raises(TableError, match="column 'd' is Time in the train table, which text cells are not read as; "
                       "give this table as Parquet"):
        list(TableScan(f).batches({"d": pl.Time}, 10))


def test_a_date_alone_in_a_date_time_column_is_its_midnight(tmp_path):
    """ISO 8601 (and pandas) read a date alone as its midnight: a column written with times only where they are not
    midnight was left out as an id column, and a test cell 2021-12-01 was refused where the train table had
    date-times."""
    f = _write(tmp_path / "t.csv", "t\n2024-01-31\n2024-01-31T13:45:00\n2024-02-01 08:00\n")
    df = read_table(f)
    assert df["t"].to_list() == [datetime(2024, 1, 31), datetime(2024, 1, 31, 13, 45), datetime(2024, 2, 1, 8)]
    assert pl.concat(TableScan(f).batches({"t": pl.Datetime("us")}, 1)).equals(df)


def test_a_date_column_with_an_impossible_date_is_reported(tmp_path):
    """One impossible date (2020-02-30) made a column of dates categories without a word."""
    days = [f"2020-01-{d:02d}" for d in range(1, 29)]
    f = _write(tmp_path / "t.csv", "d,t,free\n" + "\n".join(
        f"{d},{d}T0{i % 10}:00:00,{'2020-01-01 x' if i else 'word'}" for i, d in enumerate(days[:-1]))
               + "\n2020-02-30,2020-01-01T25:00:00,2020-01-02\n")
    df = read_table(f)
    assert df.schema == pl.Schema({"d": pl.String, "t": pl.String, "free": pl.String})
    assert mostly_temporal_text(df) == [("d", 27, 28, ["2020-02-30"]), ("t", 27, 28, ["2020-01-01T25:00:00"])]
    assert mostly_temporal_text(read_table(_write(tmp_path / "ok.csv", "d\n2020-01-01\n2020-01-02\n"))) == []


def test_a_time_zone_of_the_train_table_is_kept(tmp_path):
    stamps = pl.Series("t", ["2024-01-31T13:45:00"]).str.to_datetime(time_unit="ns", time_zone="Europe/Paris")
    pl.DataFrame([stamps]).write_csv(tmp_path / "t.csv")  # polars writes 2024-01-31T13:45:00.000000000+0100
    read = pl.concat(TableScan(tmp_path / "t.csv").batches({"t": stamps.dtype}, 10))
    assert read["t"].dtype == stamps.dtype and read["t"].equals(stamps)


PARQUET = b"PAR1" + bytes(range(40))


UNREADABLE = [
    ("empty.csv", b"", "the file is empty"),
    ("blank.csv", b"\n\n", "the file is empty"),
    ("header.csv", b"a,b\n", "has a header (2 columns) but no rows"),
    ("ragged.csv", b"a,b\n1,2\n3,4,5\n", "line 3 has 3 fields but the header has 2"),
    ("ragged.tsv", b"a\tb\n1\t2\n\"x\ny\"\t2\n3\t4\t5\n", "line 5 has 3 fields but the header has 2"),
    ("latin1.csv", "a,b\n1,2\n3,café\n".encode("latin-1"), "not UTF-8 text (byte 0xe9 on line 3)"),
    ("latin1_header.csv", "a,café\n1,2\n".encode("latin-1"), "not UTF-8 text (byte 0xe9 on line 1)"),
    ("utf16.csv", "a,b,y\n1,2,p\n".encode("utf-16"), "UTF-16 or UTF-32 text (it has a byte-order mark or NUL "
     "bytes); save it as UTF-8"),
    ("utf16_no_bom.tsv", "a\tb\n1\t2\n".encode("utf-16-le"), "UTF-16 or UTF-32 text"),
    ("csv.parquet", b"a,b\n1,2\n", "not a Parquet file (it starts with 'a,b'); if it is CSV text, name it .csv"),
    ("cut.parquet", PARQUET, "cannot read it as Parquet"),
    ("parquet.csv", PARQUET, "this is a Parquet file, not .csv text; name it .parquet"),
    ("dup.csv", b"a,b,a\n1,2,3\n", "column name 'a' appears more than once"),
    ("index.csv", b",a,y\n0,1.5,p\n1,2.5,n\n", "column 1 has no name in the header (the row index that pandas' "
     "to_csv writes?): drop it (to_csv(..., index=False)) or give it a name"),
    ("trailing.csv", b"x,y,\n1,a,\n2,b,\n", "the last column (3) has no name in the header: do the lines end in a "
     "separator (such as a trailing ',')? Remove it, or give the column a name"),  # was called a row index
    ("mac.csv", b"x,c,y\r1,u,a\r2,v,b\r", "its lines end in a carriage return alone (classic Mac line endings); "
     "convert them to newlines"),  # was "column name 'u' appears more than once in the header"
    ("book.xlsx", b"PK\x03\x04", "unknown table format '.xlsx'"),
    ("semi.csv", b"a;c;y\n1,5;x,y;1\n", "the header 'a;c;y' is one column holding ';': the file looks "
     "semicolon-separated; pass --separator ';' (and --decimal-comma if its numbers are written 1,5), or save it"),
    ("semi_plain.csv", b"a;c;y\n1;x;1\n", "looks semicolon-separated; pass --separator ';'"),
    ("tabs.csv", b"a\tc\n1\t2\n", "looks tab-separated; pass --separator tab, or save it as comma-separated CSV"),
    ("commas.tsv", b"a,c\n1,2\n", "looks comma-separated; pass --separator ','"),
]


@pytest.mark.parametrize("read", [read_table, TableScan], ids=["whole", "in batches"])
@pytest.mark.parametrize("name, data, message", UNREADABLE)
def test_unreadable_files_give_one_line_naming_the_file(tmp_path, read, name, data, message):
    f = _write(tmp_path / name, data)
    with pytest.raises(TableError) as err:
        read(f)
    text = str(err.value)
    assert text.startswith(f"{f}: ") and message in text and "\n" not in text


def test_thousands_separators_are_reported_as_ambiguous_never_as_decimal_commas():
    """A column of 1,000-style prices was advised --decimal-comma (which reads 1,010 as 1.01), and one of half 850
    and half 1,000 was read as categories without a word."""
    prices = pl.DataFrame({"p": [f"{v:,}" for v in range(850, 1150, 10)], "q": ["1,000", "x", "y"] * 10})
    assert thousands_text(prices) == [("p", "1,000")] and decimal_comma_text(prices) == []
    decimals = pl.DataFrame({"a": ["0,125", "1,250", "2,5"] * 4, "b": ["1,000", "1,5", "2"] * 4})
    assert thousands_text(decimals) == [] and decimal_comma_text(decimals) == [("a", "0,125"), ("b", "1,000")]
    assert thousands_text(pl.DataFrame({"big": ["12,345,678.5", "-1,000", "3"]})) == [("big", "12,345,678.5")]


def test_a_separator_and_decimal_commas(tmp_path):
    f = _write(tmp_path / "semi.csv", "a;c;y\n1,5;x,y;1\n-2,25;z;0\n3;NA;1\n")
    df = read_table(f, separator=";", decimal_comma=True)
    assert df.schema == pl.Schema({"a": pl.Float64, "c": pl.String, "y": pl.Int64})
    assert df["a"].to_list() == [1.5, -2.25, 3.0] and df["c"].to_list() == ["x,y", "z", None]
    plain = read_table(f, separator=";")  # without decimal_comma: text, and reported
    assert plain["a"].to_list() == ["1,5", "-2,25", "3"] and decimal_comma_text(plain) == [("a", "1,5")]
    assert decimal_comma_text(df) == []
    assert decimal_comma_text(read_table(_write(tmp_path / "t.csv", 'c\n"x,y"\n"1,5"\n"a,b"\n'))) == []
    scan = TableScan(f, separator=";", decimal_comma=True)
    assert pl.concat(scan.batches(df.schema, 1)).equals(df.with_columns(pl.col("y").cast(pl.Float64)))
    with pytest.raises(TableError, match=r"column 'a' holds '1,5' \(row 1\) where the train table has numbers"):
        list(TableScan(f, separator=";").batches({"a": pl.Float64}, 10))


def test_decimal_commas_with_points_grouping_thousands(tmp_path):
    """A decimal-comma export writes thousands as 2.981,74: read as 2.981.74 that was no number, and the column
    was left out as an id column without a word of why."""
    f = _write(tmp_path / "de.csv", "price;y\n2.981,74;1\n12,50;0\n4.500;1\n-1.234.567,5;0\n0,125;1\n")
    df = read_table(f, separator=";", decimal_comma=True)
    assert df["price"].to_list() == [2981.74, 12.5, 4500.0, -1234567.5, 0.125]
    scan = TableScan(f, separator=";", decimal_comma=True)
    assert pl.concat(scan.batches(df.schema, 2))["price"].to_list() == df["price"].to_list()
    text = pl.DataFrame({"p": ["1,5", "2.000,5", "3", "n/a"]})  # mostly numbers with a decimal comma
    assert mostly_numeric_text(text, decimal_comma=True) == [("p", 3, 4, ["n/a"])]
    assert mostly_numeric_text(text) == []  # without it, "1,5" is no number: the decimal-comma warning's case


@pytest.mark.parametrize("cells, dtype, text", [
    (["01", "2", "NA"], pl.Int64, ["01", "2", None]), (["7", "007", ""], pl.Int64, ["7", "007", None]),
    (["1.0", "2.50", "1e3"], pl.Float64, ["1.0", "2.50", "1e3"]),
    (["TRUE", "false", "True"], pl.Boolean, ["TRUE", "false", "True"]),
    (["99999999999999999999", "1", "?"], pl.Int128, ["99999999999999999999", "1", None]),
    ([" 3", "4 ", '" 5"'], pl.Int64, ["3", "4", "5"]),  # read as text by polars, numbers once stripped
    (['"1,5"', "x", '"a ""b"""'], pl.String, ["1,5", "x", 'a "b"']),
    (["+1", "-0", "NaN"], pl.Int64, ["+1", "-0", None]),  # NaN: a missing-value token
])
def test_a_column_read_once_is_typed_as_read_table_types_it_and_kept_as_written(tmp_path, cells, dtype, text):
    """read_table_and_text gives read_table's frame and the column's text from one read of the file (the text was
    read in a second pass); its column is typed as polars' own inference types it."""
    rows = [f"{i},{c},z" for i, c in enumerate(cells)]
    f = _write(tmp_path / "t.csv", "\r\n".join(["a,y,b", *rows, "", ""]))
    df, as_written = read_table_and_text(f, "y")
    assert df.equals(read_table(f)) and df.schema == read_table(f).schema and df.schema["y"] == dtype
    assert as_written.to_list() == [*text, None]  # polars reads the blank line as a row
    assert read_table_and_text(f, "nothing")[1] is None
    pl.read_csv(f).write_parquet(tmp_path / "t.parquet")
    assert read_table_and_text(tmp_path / "t.parquet", "y")[1] is None  # Parquet's columns come typed


def test_a_column_past_128_bits_is_the_error_read_table_gives(tmp_path):
    f = _write(tmp_path / "t.csv", "a,y\n1,1\n2,999999999999999999999999999999999999999999\n")
    with pytest.raises(TableError) as err:
        read_table(f)
    with pytest.raises(TableError) as again:
        read_table_and_text(f, "y")
    assert str(again.value) == str(err.value) and "column 'y'" in str(err.value)


def test_missing_file_and_folder(tmp_path):
    with pytest.raises(TableError, match="no such file"):
        read_table(tmp_path / "nope.csv")
    with pytest.raises(TableError, match="is a folder, not a table file"):
        read_table(tmp_path)


def test_batches_take_the_schema_types_cell_by_cell(tmp_path):
    # read alone, the first 3 rows' 'n' would be all missing, 'code' all integers and 'flag' all booleans
    f = _write(tmp_path / "t.csv", "n,code,flag,extra\nNA,01,TRUE,a\n,2,false,b\n?,007,True,c\n"
                                   " 4 ,x7,maybe,d\n5,NA,,e\n6.5,3,FALSE,f\n7,1, true ,g\n")
    schema = {"flag": pl.Boolean, "n": pl.Int64, "code": pl.String}
    scan = TableScan(f)
    assert scan.columns == ["n", "code", "flag", "extra"] and scan.n_rows == 7
    batches = list(scan.batches(schema, 3))
    assert [b.height for b in batches] == [3, 3, 1]
    for b in batches:
        assert b.schema == pl.Schema({"flag": pl.String, "n": pl.Float64, "code": pl.String})
    read = pl.concat(batches)
    assert read.equals(pl.concat(scan.batches(schema, 100)))
    assert read["n"].to_list() == [None, None, None, 4.0, 5.0, 6.5, 7.0]
    assert read["code"].to_list() == ["01", "2", "007", "x7", None, "3", "1"]
    assert read["flag"].to_list() == ["True", "False", "True", "maybe", None, "False", "True"]


def test_a_cell_that_is_not_a_number_in_a_numeric_column_is_named(tmp_path):
    f = _write(tmp_path / "t.csv", "n,c\n1,a\n2,b\n3,c\n4,d\nn.a.,e\n")
    batches = TableScan(f).batches({"n": pl.Float64}, 2)
    assert next(batches)["n"].to_list() == [1.0, 2.0]
    next(batches)
    with pytest.raises(TableError, match=r"t.csv: column 'n' holds 'n.a.' \(row 5\) where the train table has numbers"):
        next(batches)
    assert TableScan(f, na_tokens("n.a.")).n_rows == 5


def test_short_rows_are_counted_with_the_first_line(tmp_path):
    """Rows with fewer fields than the header (polars reads their absent cells as missing): counted, the first
    named by its line; a quoted newline, a blank line or a row of empty cells is no short row."""
    path = tmp_path / "t.csv"
    path.write_text('a,b,c\n1,"x\ny",3\n\n4,5\n,,\n6\n7,8,9\n')
    assert table_io.short_rows(path) == (2, 5)
    assert table_io.short_rows(path, last_column_missing=0) is None  # the caller's count says there are none
    semi = tmp_path / "t.txt"
    semi.write_text("a;b\n1;2\n3\n")
    assert table_io.short_rows(semi, ";") == (1, 3)
    full = tmp_path / "full.csv"
    full.write_text("a,b\n1,\n2,3\n")  # an empty last cell is a missing value, not a short row
    assert table_io.short_rows(full) is None
    pl.DataFrame({"a": [1, None]}).write_parquet(tmp_path / "t.parquet")
    assert table_io.short_rows(tmp_path / "t.parquet") is None
    scan = TableScan(path, NA_VALUES)
    assert scan.short_rows() == (2, 5)
    assert TableScan(full, NA_VALUES).short_rows() is None
