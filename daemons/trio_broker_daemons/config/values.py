"""The configuration's value conventions: the one error type, durations, sizes, threads.

Both daemons' configuration modules (:mod:`trio_broker_daemons.execserver.config`,
:mod:`trio_broker_daemons.fylr.config`) report every problem as a
:class:`ConfigError`, one line that starts with the dotted key path, and read
durations, sizes and thread counts with the parsers here. The conventions for an
operator are stated in :mod:`trio_broker_daemons.config`.
"""

import math
import re
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Final, TypeAlias

__all__ = [
    "SIZE_HINT",
    "ConfigError",
    "Key",
    "ThreadsSpec",
    "check_threads",
    "parse_duration",
    "parse_size",
    "resolve_threads",
    "show",
]

ThreadsSpec: TypeAlias = int | str
"""A ``threads`` value: an int (0, N, -N) or a percentage string (``"N%"``, ``"-N%"``)."""

Key: TypeAlias = str | int
"""One step of a key path: a mapping key or a list position."""
_DURATION_HINT: Final = '(use e.g. "10s", "30m", "12h" or a number of seconds)'
SIZE_HINT: Final = 'an integer or a string like "512M", "2G", "1.5GiB"'
"""What a size is, for error messages."""


class ConfigError(ValueError):
    """The configuration is unusable; ``str()`` is one line naming where and why.

    Attributes:
        keys: the key path to the offending value (strings for mapping keys,
            integers for list positions); empty for problems of the whole file.
        reason: what was expected and what came.
        file: the configuration file, for problems of the file itself (missing,
            unreadable, not YAML, not a mapping); otherwise ``None``.
    """

    def __init__(self, reason: str, *, keys: Sequence[Key] = (), file: str | None = None) -> None:
        super().__init__(reason, tuple(keys), file)
        self.reason = reason
        self.keys: tuple[Key, ...] = tuple(keys)
        self.file = file

    @property
    def path(self) -> str:
        """The dotted key path, e.g. ``services.ffmpeg.argv[0]``; ``""`` for none."""
        text = ""
        for key in self.keys:
            if isinstance(key, int):
                text += f"[{key}]"
            elif _PLAIN_KEY.fullmatch(key):
                text += f".{key}" if text else key
            else:
                text += f"[{key!r}]"
        return text

    def __str__(self) -> str:
        where = self.path or self.file
        return f"{where}: {self.reason}" if where else self.reason


_PLAIN_KEY: Final = re.compile(r"[A-Za-z0-9_-]+")


def show(value: object) -> str:
    """A short YAML-ish rendering of an offending value for error messages."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, str):
        return repr(value if len(value) <= 40 else value[:37] + "...")
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return repr(value)


# -- durations, sizes, threads ----------------------------------------------------

_DURATION_UNITS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_PART: Final = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_DURATION: Final = re.compile(r"(?:\d+(?:\.\d+)?(?:ms|s|m|h|d))+")


def parse_duration(value: object) -> float:
    """Parse a duration into seconds.

    Args:
        value: a string of ``<number><unit>`` parts (units ``ms``, ``s``, ``m``,
            ``h``, ``d``, any order, e.g. ``"1h30m"``, ``"1.5s"``), the string
            ``"0"``, or a non-negative int or float of seconds (not a bool).

    Returns:
        The duration in seconds, finite and >= 0. Zero is returned as ``0.0``; what
        zero means ("none", "at once") is up to the key.

    Raises:
        ConfigError: with an empty key path, naming the value.
    """
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"expected a duration, got {show(value)}")
    if isinstance(value, str):
        if value == "0":
            return 0.0
        if not _DURATION.fullmatch(value):
            raise ConfigError(f"invalid duration {show(value)} {_DURATION_HINT}")
        seconds = sum(
            float(number) * _DURATION_UNITS[unit] for number, unit in _DURATION_PART.findall(value)
        )
    else:
        seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigError(f"invalid duration {show(value)} {_DURATION_HINT}")
    return seconds


_SIZE: Final = re.compile(r"(\d+(?:\.\d+)?) ?(?:([kmgtp])(i?b)?|b)?", re.IGNORECASE)
_SIZE_POWERS: Final = {"k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(value: object) -> int:
    """Parse a size into bytes.

    Args:
        value: a positive int of bytes, or a string ``<number>[unit]``: ``K`` …
            ``P`` and ``KiB`` … ``PiB`` are powers of 1024, ``KB`` … ``PB`` powers
            of 1000, ``B`` or nothing is bytes; case-insensitive, one optional space
            (``"512M"``, ``"1.5GiB"``, ``"100 kB"``). Fractions of a byte are dropped.

    Returns:
        The size in bytes, > 0.

    Raises:
        ConfigError: with an empty key path, naming the value.
    """
    if type(value) is int:
        size = value
    elif isinstance(value, str):
        match = _SIZE.fullmatch(value)
        if match is None:
            raise ConfigError(f"expected a size ({SIZE_HINT}), got {show(value)}")
        number, prefix, suffix = match.groups()
        factor = 1
        if prefix is not None:
            base = 1000 if suffix is not None and suffix.lower() == "b" else 1024
            factor = base ** _SIZE_POWERS[prefix.lower()]
        size = int(Decimal(number) * factor)
    else:
        raise ConfigError(f"expected a size ({SIZE_HINT}), got {show(value)}")
    if size <= 0:
        raise ConfigError(f"expected a size greater than 0, got {show(value)}")
    return size


_THREADS: Final = re.compile(r"(-?)(\d+)(%?)")


def check_threads(value: object) -> ThreadsSpec:
    """Validate a ``threads`` value; ``"N"`` and ``"-N"`` become ints."""
    if type(value) is int:
        return value
    if isinstance(value, str) and (match := _THREADS.fullmatch(value)):
        sign, digits, percent = match.groups()
        if not percent:
            return int(sign + digits)
        if not 1 <= int(digits) <= 100:
            raise ConfigError(f"expected a percentage from 1 to 100, got {show(value)}")
        return value
    raise ConfigError(
        f'expected an integer, or a string "N", "-N", "N%" or "-N%", got {show(value)}'
    )


def resolve_threads(spec: ThreadsSpec, cpu_count: int) -> int:
    """Turn a service's ``threads`` into a thread count.

    Args:
        spec: ``0`` all CPUs, ``N`` exactly N, ``-N`` all but N, ``"N%"`` that share
            of the CPUs (rounded down), ``"-N%"`` all but that share (the share
            rounded up); ``"N"`` and ``"-N"`` strings are read as ints.
        cpu_count: the CPUs available, >= 1 (usually ``HostResources.cpus``).

    Returns:
        The thread count, always at least 1.

    Raises:
        ValueError: for a spec the loader would have refused, or ``cpu_count < 1``.
    """
    if cpu_count < 1:
        raise ValueError(f"cpu_count must be at least 1, got {cpu_count}")
    try:
        checked = check_threads(spec)
    except ConfigError as exc:
        raise ValueError(f"invalid threads spec: {exc.reason}") from None
    if isinstance(checked, int):
        if checked == 0:
            count = cpu_count
        elif checked > 0:
            count = checked
        else:
            count = cpu_count + checked
    else:
        share = int(checked.strip("-%"))
        if checked.startswith("-"):
            count = cpu_count * (100 - share) // 100
        else:
            count = cpu_count * share // 100
    return max(1, count)
