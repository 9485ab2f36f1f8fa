"""CSV as RFC 4180, strictly: the records of a file's bytes, each with its line.

How this works: the bytes are decoded as UTF-8 with ``surrogateescape``, so a
byte that is not UTF-8 survives as a lone surrogate instead of becoming U+FFFD;
:mod:`csv` then splits the text (double-quote escaping, quoted newlines, CRLF or
LF line ends) in ``strict`` mode.  The separators of CSV are ASCII and UTF-8
never uses an ASCII byte inside a multi-byte character, so the split is the
same as on the bytes.  Each record is then judged whole:

- a record whose field count differs from the header's is rejected;
- a field holding a byte that is not UTF-8 (a surrogate after decoding) is
  rejected, naming its column;
- a quoting error (a quote inside an unquoted field, text after a closing
  quote, a quote never closed) is rejected with :mod:`csv`'s words.

A rejected record keeps its original text (:attr:`CsvRecord.text`, bytes that
are not UTF-8 shown as ``\\xNN``); an accepted one has its fields exactly as
written.  Completely empty lines are not records (as in Spark's reader).
Why not Spark's CSV reader: it escapes with backslashes, reads one line per
row, fills or drops fields in permissive mode, decodes with replacement and
cannot say which line a row came from (docs/pipeline.md, "Input").

Pure: no Spark, no I/O; :func:`clone.pipeline.sources.read_table` runs it on
each file's bytes in the executors.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from dataclasses import dataclass

from clone.wire.protocol import MAX_VALUE_BYTES

__all__ = ["CsvRecord", "CsvHeaderError", "parse_header", "parse_records", "reason_not_utf8"]

# A field may be a whole value, and a value with every byte quoted twice.
csv.field_size_limit(max(csv.field_size_limit(), 4 * MAX_VALUE_BYTES))


class CsvHeaderError(ValueError):
    """The file's first record cannot be a header."""


@dataclass(frozen=True, slots=True)
class CsvRecord:
    """One record: its first line (1-based), its fields or why it is rejected."""

    line: int
    fields: tuple[str, ...] | None
    reason: str | None
    text: str


def reason_not_utf8(column: str) -> str:
    return f"column {column!r} is not valid UTF-8"


def _lines(text: str) -> Iterator[str]:
    """Physical lines, split at LF only (a CR alone is data), ends kept."""
    start = 0
    while True:
        end = text.find("\n", start)
        if end < 0:
            if start < len(text):
                yield text[start:]
            return
        yield text[start : end + 1]
        start = end + 1


def _shown(raw: str) -> str:
    """A record's text with bytes that are not UTF-8 as ``\\xNN``."""
    return raw.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _valid(field: str) -> bool:
    if field.isascii():
        return True
    try:
        field.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: a byte that was not UTF-8
        return False
    return True


def _records(data: bytes) -> Iterator[tuple[int, list[str] | None, str | None, str]]:
    """(first line, fields or None, csv's error or None, raw text) per record."""
    text = data.decode("utf-8", "surrogateescape")
    if text.startswith("\ufeff"):
        text = text[1:]  # a byte order mark is not part of the first column's name
    consumed: list[str] = []

    def feed() -> Iterator[str]:
        for line in _lines(text):
            consumed.append(line)
            yield line

    reader = csv.reader(feed(), dialect="excel", strict=True)
    line = 1
    while True:
        try:
            fields: list[str] | None = next(reader)
            error = None
        except StopIteration:
            return
        except csv.Error as exc:
            fields, error = None, str(exc)
        raw = "".join(consumed)
        consumed.clear()
        first, line = line, reader.line_num + 1
        if fields == [] and error is None:
            continue  # an empty line
        yield first, fields, error, raw


def parse_header(data: bytes) -> tuple[str, ...]:
    """The column names in the first record of ``data``."""
    for _, fields, error, raw in _records(data):
        if error is not None or fields is None:
            raise CsvHeaderError(f"header line cannot be read as CSV: {error}")
        names = tuple(fields)
        bad = [n for n in names if not _valid(n)]
        if bad:
            raise CsvHeaderError(f"header is not valid UTF-8: {_shown(raw).strip()!r}")
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise CsvHeaderError(f"header names column(s) {', '.join(map(repr, dupes))} twice")
        if any(n == "" for n in names):
            raise CsvHeaderError("header has an empty column name")
        return names
    raise CsvHeaderError("no header line (empty file)")


def parse_records(data: bytes, header: tuple[str, ...]) -> Iterator[CsvRecord]:
    """The records after the header of ``data``, which must be ``header``."""
    records = _records(data)
    for _, fields, error, raw in records:
        if error is not None or tuple(fields or ()) != header:
            got = _shown(raw).strip()
            raise CsvHeaderError(f"header {got!r} differs from {','.join(header)!r}")
        break
    width = len(header)
    for line, fields, error, raw in records:
        if fields is None:
            yield CsvRecord(line, None, f"not RFC 4180 CSV: {error}", _shown(raw))
        elif len(fields) != width:
            more = "many" if len(fields) > width else "few"
            reason = f"too {more} fields: {len(fields)}, the header has {width}"
            yield CsvRecord(line, None, reason, _shown(raw))
        else:
            bad = next((i for i, f in enumerate(fields) if not _valid(f)), None)
            if bad is not None:
                yield CsvRecord(line, None, reason_not_utf8(header[bad]), _shown(raw))
            else:
                yield CsvRecord(line, tuple(fields), None, raw)
