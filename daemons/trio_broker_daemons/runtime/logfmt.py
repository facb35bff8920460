"""The daemons' log lines: one ``key=value`` line per event ("logfmt"), or one JSON object.

Both daemons log the same way (:func:`configure_logging`, ``--log-format``). A
record renders as ``ts=… level=… logger=… msg="…"`` followed by its fields::

    ts=2026-01-02T03:04:05.678Z level=info logger=fylr msg="file stored" file=12

Fields come from either of two places, so that the library can attach them
without knowing this module:

- ``extra=fields(file=12, action="produce")`` (this module's helper), or
- plain ``extra={"service": "thumbnail", "job_id": "j1"}``: every attribute of a
  record that a standard :class:`logging.LogRecord` does not have is a field
  (the library's execserver logs one line per job this way).

Values that contain spaces, quotes, ``=`` or nothing at all are double-quoted with
JSON escapes; ``None`` renders as ``null``. Lines are one per record (a traceback
goes into one quoted ``exc`` field), so they can be grepped and parsed. With
``--log-format json`` the same members form one JSON object per line.

``ts`` is ISO 8601 in UTC with its zone (``Z``), milliseconds included: the one
time format of the daemons' logs and documents.

Logs never carry a pipe id: a pipe's URL is its credential.
:func:`configure_logging` keeps the HTTP client's per-request lines (which name
the URL) out of every log, whatever the level.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
import sys
from collections.abc import Mapping
from typing import Any, Final, Literal

__all__ = [
    "JsonFormatter",
    "LogfmtFormatter",
    "configure_logging",
    "fields",
    "format_value",
    "iso_time",
    "record_fields",
]

_BARE: Final = re.compile(r"[^\s\"=\\]+")
_FIELDS: Final = "fields"
_STANDARD: Final = frozenset(
    logging.LogRecord("", 0, "", 0, "", (), None).__dict__.keys()
    | {"message", "asctime", "taskName", _FIELDS}
)
QUIET_LOGGERS: Final = {
    # one line per HTTP request, naming its URL: a pipe URL is a credential
    "httpx": logging.WARNING,
    "httpcore": logging.WARNING,
    # one warning per failed connection attempt; the store reports an outage itself
    "psycopg.pool": logging.ERROR,
}
"""Loggers held at a level of their own by :func:`configure_logging`."""


def fields(**values: Any) -> dict[str, Any]:
    """The ``extra=`` of a log call that attaches these key/value pairs to its line."""
    return {_FIELDS: values}


def iso_time(seconds: float) -> str:
    """A UNIX time as ISO 8601 in UTC with milliseconds: ``2026-01-02T03:04:05.678Z``."""
    stamp = datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)
    return stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp.microsecond // 1000:03d}Z"


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


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The fields of a record: ``ts``, ``level``, ``logger``, ``msg``, its extras, ``exc``."""
    pairs: dict[str, Any] = {
        "ts": iso_time(record.created),
        "level": record.levelname.lower(),
        "logger": record.name,
        "msg": record.getMessage(),
    }
    extra = getattr(record, _FIELDS, None)
    if isinstance(extra, Mapping):
        for key, value in extra.items():
            pairs.setdefault(str(key), value)
    for key, value in record.__dict__.items():
        if key not in _STANDARD and not key.startswith("_"):
            pairs.setdefault(key, value)
    return pairs


class LogfmtFormatter(logging.Formatter):
    """Formats records as one ``key=value`` line each (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        pairs = record_fields(record)
        if record.exc_info:
            pairs["exc"] = self.formatException(record.exc_info)
        return " ".join(f"{key}={format_value(value)}" for key, value in pairs.items())


class JsonFormatter(logging.Formatter):
    """Formats records as one JSON object per line, with the members logfmt shows."""

    def format(self, record: logging.LogRecord) -> str:
        pairs = record_fields(record)
        if record.exc_info:
            pairs["exc"] = self.formatException(record.exc_info)
        return json.dumps(pairs, ensure_ascii=False, default=str)


def configure_logging(
    level: str = "info", log_format: Literal["logfmt", "json"] | str = "logfmt"
) -> logging.Handler:
    """Send every log record to stderr in one of the two formats.

    Args:
        level: ``debug``, ``info``, ``warning`` or ``error``.
        log_format: ``logfmt`` or ``json``.

    Returns:
        The handler installed on the root logger (it replaces any other).

    Raises:
        ValueError: an unknown format.
    """
    if log_format not in ("logfmt", "json"):
        raise ValueError(f"log format must be logfmt or json, got {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else LogfmtFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    for name, quiet in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(quiet)
    return handler
