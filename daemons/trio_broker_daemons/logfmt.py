"""Structured log lines (``key=value`` pairs, "logfmt") for the reference daemons.

A record renders as ``ts=… level=… logger=… msg="…"`` followed by the fields a
caller attached with ``extra=fields(file=12, action="produce")``::

    ts=2026-01-02T03:04:05.678Z level=info logger=fylr msg="file stored" file=12

Values that contain spaces, quotes, ``=`` or nothing at all are double-quoted with
JSON escapes; ``None`` renders as ``null``. Lines are one per record (a traceback
goes into one quoted ``exc`` field), so they can be grepped and parsed.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
from collections.abc import Mapping
from typing import Any, Final

__all__ = ["LogfmtFormatter", "fields", "format_value"]

_BARE: Final = re.compile(r"[^\s\"=\\]+")
_FIELDS: Final = "fields"


def fields(**values: Any) -> dict[str, Any]:
    """The ``extra=`` of a log call that attaches these key/value pairs to its line."""
    return {_FIELDS: values}


def format_value(value: Any) -> str:
    """One value as logfmt: bare when it can be, else a JSON string."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.6g}"
    text = value if isinstance(value, str) else str(value)
    if _BARE.fullmatch(text):
        return text
    return json.dumps(text, ensure_ascii=False)


class LogfmtFormatter(logging.Formatter):
    """Formats records as one ``key=value`` line each (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC)
        pairs: dict[str, Any] = {
            "ts": stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp.microsecond // 1000:03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        extra = getattr(record, _FIELDS, None)
        if isinstance(extra, Mapping):
            for key, value in extra.items():
                pairs.setdefault(str(key), value)
        if record.exc_info:
            pairs["exc"] = self.formatException(record.exc_info)
        return " ".join(f"{key}={format_value(value)}" for key, value in pairs.items())
