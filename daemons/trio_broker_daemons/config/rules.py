"""The field rules both daemons' configuration classes are written with.

A field's type is ``Annotated[T, Rule(check)]``: the converter
(:mod:`trio_broker_daemons.config.structure`) hands the raw value to ``check``,
which returns the value to store or raises
:class:`~trio_broker_daemons.config.values.ConfigError` with a key path relative
to the field. The rules here are the ones the execserver's and the fylr's
configurations share (strings, paths, integers, durations, sizes, listen
addresses); each daemon's own rules live beside its classes.

While a document read from a file is structured (:func:`reading_from`), a
relative path is taken relative to that file's folder (:func:`config_path`) and
:func:`config_folder` answers the folder.
"""

import contextlib
import contextvars
import ipaddress
import math
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import attrs

from trio_broker_daemons.config.values import ConfigError, parse_duration, parse_size, show

__all__ = [
    "MAX_SERVICE_NAME_CHARS",
    "Rule",
    "config_folder",
    "config_path",
    "integer",
    "listen_address",
    "loopback_host",
    "nonempty_string",
    "not_a_string",
    "number",
    "optional_size",
    "optional_token",
    "parse_listen",
    "positive_duration",
    "reading_from",
    "string",
]

MAX_SERVICE_NAME_CHARS: Final = 200
"""Longest service name (an execserver's services, a fylr recipe's ``service``)."""

_config_dir: Final = contextvars.ContextVar[Path | None]("config_dir", default=None)
"""The configuration file's folder while a document of a file is structured."""


def config_folder() -> Path | None:
    """The folder of the configuration file being structured, or ``None`` (no file)."""
    return _config_dir.get()


@contextlib.contextmanager
def reading_from(folder: Path | None) -> Iterator[None]:
    """Within the block, the document being structured comes from a file in ``folder``.

    Relative paths (:func:`config_path`) are taken relative to it and
    :func:`config_folder` answers it; ``None`` means a document not read from a file.
    """
    token = _config_dir.set(folder)
    try:
        yield
    finally:
        _config_dir.reset(token)


@attrs.frozen
class Rule:
    """``Annotated`` metadata: the function that checks and converts a raw value.

    The function raises :class:`ConfigError` with a key path relative to the field.
    """

    check: Callable[[Any], Any]


# -- listen addresses ------------------------------------------------------------------

_HOST: Final = re.compile(r"[A-Za-z0-9._-]+")


def parse_listen(value: object) -> tuple[str, int]:
    """Split ``host:port`` (``[v6]:port`` for IPv6) into host and port."""
    problem = f'expected host:port (e.g. "127.0.0.1:7000" or "[::1]:7000"), got {show(value)}'
    if not isinstance(value, str):
        raise ConfigError(problem)
    host, sep, port = value.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit():
        raise ConfigError(problem)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(problem) from None
    elif ":" in host:
        raise ConfigError(f"{problem} (write an IPv6 address in brackets)")
    elif not _HOST.fullmatch(host):
        raise ConfigError(problem)
    if int(port) > 65535:
        raise ConfigError(f"expected a port from 0 to 65535, got {show(value)}")
    return host, int(port)


def loopback_host(host: str) -> bool:
    """Whether a listen host reaches this machine only: ``localhost`` or a loopback address."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen_address(value: object) -> str:
    """A ``listen`` value: ``host:port``, checked by :func:`parse_listen` and kept as written."""
    parse_listen(value)
    assert isinstance(value, str)
    return value


# -- strings and paths -----------------------------------------------------------------


def not_a_string(value: object) -> ConfigError:
    """The refusal of a non-string, with a hint when YAML read a scalar as non-text."""
    quote = " (quote it)" if value is not None and not isinstance(value, Mapping | list) else ""
    return ConfigError(f"expected a string, got {show(value)}{quote}")


def string(value: object) -> str:
    """A YAML string (a number or ``yes`` is refused: quote it)."""
    if type(value) is not str:
        raise not_a_string(value)
    return value


def nonempty_string(value: object) -> str:
    """A YAML string that is not empty."""
    if not string(value):
        raise ConfigError("expected a non-empty string, got ''")
    return str(value)


def optional_token(value: object) -> str | None:
    """A secret such as ``broker_token``: ``null`` or a non-empty string."""
    return None if value is None else nonempty_string(value)


def config_path(value: object) -> Path:
    """A path; a relative one is taken relative to the configuration file's folder."""
    path = Path(nonempty_string(value))
    folder = _config_dir.get()
    return path if folder is None or path.is_absolute() else folder / path


# -- numbers, durations, sizes ---------------------------------------------------------


def integer(minimum: int) -> Callable[[object], int]:
    """The rule of a YAML integer at least ``minimum`` (``"2"``, ``true``, ``2.5`` refused)."""

    def check(value: object) -> int:
        if type(value) is not int:
            raise ConfigError(f"expected an integer, got {show(value)}")
        if value < minimum:
            raise ConfigError(f"expected an integer >= {minimum}, got {value}")
        return value

    return check


def number(value: object) -> float:
    """A finite YAML number (not a boolean), as a float."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"expected a number, got {show(value)}")
    return float(value)


def positive_duration(value: object) -> float:
    """A duration greater than zero, in seconds."""
    seconds = parse_duration(value)
    if seconds == 0:
        raise ConfigError(f"expected a duration greater than 0, got {show(value)}")
    return seconds


def optional_size(value: object) -> int | None:
    """``null`` or a size, in bytes."""
    return None if value is None else parse_size(value)
