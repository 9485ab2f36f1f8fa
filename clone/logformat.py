"""Log formats for entry points: ``text`` (the default) or ``json``, one object a line.

How this works: :class:`JsonFormatter` turns each record into one JSON object
on one line (``time`` in ISO 8601 with the UTC offset, ``level``, ``logger``,
``message`` with its %-arguments applied, and ``exc_info``/``stack_info`` text
when there is any), so a log shipper needs no parsing rules.  Entry points
choose it with :func:`formatter`; library code only logs.
"""

from __future__ import annotations

import datetime
import json
import logging

__all__ = ["LOG_FORMATS", "JsonFormatter", "formatter"]

#: The ``--log-format`` choices.
LOG_FORMATS = ("text", "json")

_TEXT_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)-7s %(name)s: %(message)s"
_TEXT_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "time": datetime.datetime.fromtimestamp(record.created)
            .astimezone()
            .isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc_info"] = record.exc_text
        if record.stack_info:
            out["stack_info"] = self.formatStack(record.stack_info)
        # json.dumps escapes newlines: a traceback stays on its record's line.
        return json.dumps(out, ensure_ascii=False, default=str)


def formatter(name: str) -> logging.Formatter:
    """The formatter for a ``--log-format`` choice."""
    if name == "json":
        return JsonFormatter()
    if name == "text":
        return logging.Formatter(_TEXT_FORMAT, _TEXT_DATE_FORMAT)
    raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {name!r}")
