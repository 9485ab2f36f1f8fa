"""The strict RFC 4180 reader: every case of docs/pipeline.md's reject table, no Spark."""

from __future__ import annotations

import pytest

from clone.pipeline.csvinput import CsvHeaderError, CsvRecord, parse_header, parse_records

HEADER = ("key", "value")


def _records(body: bytes) -> list[CsvRecord]:
    return list(parse_records(b"key,value\r\n" + body, HEADER))


# (input after the header, the line the record starts on, fields or reason)
CASES: list[tuple[str, bytes, int, tuple[str, ...] | str]] = [
    ("plain", b"/a,1\r\n", 2, ("/a", "1")),
    ("doubled quotes", b'/a,"he said ""hi"", then left"\n', 2, ("/a", 'he said "hi", then left')),
    ("quoted newline", b'/a,"two\nlines"\n', 2, ("/a", "two\nlines")),
    ("quoted CRLF kept", b'/a,"two\r\nlines"\r\n', 2, ("/a", "two\r\nlines")),
    ("quoted comma", b'/a,"x,y"\n', 2, ("/a", "x,y")),
    ("UTF-8 kept", "/é,ü€\n".encode(), 2, ("/é", "ü€")),
    ("no final newline", b"/a,1", 2, ("/a", "1")),
    ("too many fields", b"/a,1,2\n", 2, "too many fields: 3, the header has 2"),
    ("too few fields", b"/a\n", 2, "too few fields: 1, the header has 2"),
    ("not UTF-8 in the value", b"/a,\xff\xfe\n", 2, "column 'value' is not valid UTF-8"),
    ("not UTF-8 in the key", b"/\xc3(,1\n", 2, "column 'key' is not valid UTF-8"),
    ("text after a closing quote", b'/a,"ab"c\n', 2, "not RFC 4180 CSV: ',' expected after '\"'"),
    ("quote never closed", b'/a,"open\n/b,2\n', 2, "not RFC 4180 CSV: unexpected end of data"),
]


@pytest.mark.parametrize(("name", "body", "line", "expected"), CASES, ids=[c[0] for c in CASES])
def test_each_case(name: str, body: bytes, line: int, expected: tuple[str, ...] | str) -> None:
    (rec,) = _records(body)
    assert rec.line == line
    if isinstance(expected, tuple):
        assert (rec.fields, rec.reason) == (expected, None)
        assert rec.text.encode("utf-8") == body  # the record's bytes, whole
    else:
        assert (rec.fields, rec.reason) == (None, expected)


def test_line_numbers_count_physical_lines_and_skip_empty_ones() -> None:
    recs = _records(b'/a,"x\ny\nz"\n\n/b,1,2\r\n/c,\xff\n/d,4\n')
    assert [(r.line, r.fields, r.reason) for r in recs] == [
        (2, ("/a", "x\ny\nz"), None),
        (6, None, "too many fields: 3, the header has 2"),
        (7, None, "column 'value' is not valid UTF-8"),
        (8, ("/d", "4"), None),
    ]
    # A rejected record keeps its text, bytes that are not UTF-8 as \xNN.
    assert [r.text for r in recs[1:3]] == ["/b,1,2\r\n", "/c,\\xff\n"]


def test_a_bad_record_does_not_swallow_the_next() -> None:
    recs = _records(b'/a,"ab"c\n/b,2\n')
    assert [(r.line, r.fields) for r in recs] == [(2, None), (3, ("/b", "2"))]


def test_header() -> None:
    assert parse_header(b"\xef\xbb\xbfkey,value\n/a,1\n") == HEADER  # byte order mark dropped
    assert parse_header(b'"k,1",v\n') == ("k,1", "v")
    for bad, words in [
        (b"", "empty file"),
        (b"key,key\n", "twice"),
        (b"key,\n", "empty column name"),
        (b"k\xff,v\n", "not valid UTF-8"),
    ]:
        with pytest.raises(CsvHeaderError, match=words):
            parse_header(bad)


def test_a_file_with_another_header_is_refused() -> None:
    with pytest.raises(CsvHeaderError, match="differs"):
        list(parse_records(b"name,value\n/a,1\n", HEADER))
