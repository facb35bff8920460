"""The job object and the receipt: what ``JOB`` carries in, what ``DONE`` carries out.

``JOB.job`` is a JSON object the execserver's runner interprets. For the reference
runner it is a :class:`JobSpec`:

``params`` (object, default ``{}``)
    Fills the service's argv template (:mod:`trio_broker.core.argv`); the builtin
    ``sleep`` reads ``params.seconds``.
``stdin_url``, ``stdout_url`` (string, or null or absent for none)
    One-time pipe endpoints served by the client (``PROTOCOL.md``, *Pipes*): an
    ``http`` or ``https`` URL with a host and a valid port, without spaces or
    control characters.
``timeout``, ``stall_timeout`` (duration string, or null or absent for the service's)
    This job's own wall-clock ceiling and stall window, which take precedence
    over the service's: ``<number><unit>`` parts (``ms``, ``s``, ``m``, ``h``,
    ``d``, e.g. ``"30m"``, ``"1h30m"``, ``"1.5s"``), or ``"0"``, which disables
    that supervision for the job (:func:`parse_job_duration`).

Other members are ignored, so new ones can be added without breaking older
execservers (an older execserver ignores ``timeout`` and ``stall_timeout``).
:meth:`JobSpec.from_wire` checks a received object and raises
:class:`JobSpecError`, whose text is the receipt's error: a bad job object ends
with status ``error``, never an ``ERROR`` frame. :meth:`JobSpec.to_wire` writes
the object a client sends.

Receipts are built here too, so that the rules of ``PROTOCOL.md`` (*Receipt*)
hold for every ending: every member present, ``error`` null exactly when the
status is ``ok``, ``stdout_prefix`` the first :data:`STDOUT_PREFIX_BYTES` of
stdout cut at a character boundary (or ``<N bytes of binary output>`` when
that is not UTF-8 text), ``stderr_line`` the last non-empty line of stderr.
:func:`ended_receipt` builds any receipt, :func:`error_receipt` the one of a
job that could not start.

The module is pure: no I/O, no trio, no clock (times are arguments).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final
from urllib.parse import urlsplit

import attrs

from trio_broker.core.protocol import Receipt, Status

__all__ = [
    "STDERR_LINE_CHARS",
    "STDOUT_PREFIX_BYTES",
    "JobSpec",
    "JobSpecError",
    "LastLine",
    "binary_output",
    "ended_receipt",
    "error_receipt",
    "format_job_duration",
    "parse_job_duration",
    "stdout_prefix",
    "with_pipe_urls",
]

STDOUT_PREFIX_BYTES: Final = 4000
"""How much of stdout a receipt carries; also how much stdout is held back before
an out-pipe is opened."""
STDERR_LINE_CHARS: Final = 1000
"""The longest ``stderr_line`` a receipt carries (its last characters)."""
_STDERR_TAIL_BYTES: Final = 4 * STDERR_LINE_CHARS + 4  # enough bytes for 1000 characters

# -- the job object -----------------------------------------------------------------


class JobSpecError(ValueError):
    """A job object the runner cannot use; the text is the receipt's error."""


def _is_http_url(text: str) -> bool:
    if any(char <= " " or char == "\x7f" for char in text):
        return False
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 -- raises ValueError for a port that is not 0..65535
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def _check_params(spec: JobSpec, _: attrs.Attribute[Any], params: Mapping[str, Any]) -> None:
    if not isinstance(params, Mapping) or not all(isinstance(key, str) for key in params):
        raise JobSpecError("params must be an object")


def _check_url(spec: JobSpec, attribute: attrs.Attribute[Any], url: object) -> None:
    if url is not None and not (isinstance(url, str) and _is_http_url(url)):
        raise JobSpecError(f"{attribute.name} must be an http or https URL")


_DURATION_UNITS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_PART: Final = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_DURATION: Final = re.compile(r"(?:\d+(?:\.\d+)?(?:ms|s|m|h|d))+")


def parse_job_duration(name: str, value: object) -> float | None:
    """Read a job's ``timeout`` or ``stall_timeout`` member.

    Args:
        name: the member, for the error.
        value: a duration string (``"30m"``, ``"1h30m"``, ``"1.5s"``), ``"0"``,
            or ``None`` (absent).

    Returns:
        ``None`` for absent (the service's limit applies), ``0.0`` for ``"0"``
        (no limit for this job), else the seconds (> 0).

    Raises:
        JobSpecError: anything else, naming the member and the value.
    """
    if value is None:
        return None
    if value == "0":
        return 0.0
    if isinstance(value, str) and _DURATION.fullmatch(value):
        # milliseconds are divided, not multiplied by 0.001, so "43ms" is 0.043 exactly
        seconds = sum(
            float(number) / 1000 if unit == "ms" else float(number) * _DURATION_UNITS[unit]
            for number, unit in _DURATION_PART.findall(value)
        )
        if seconds > 0:
            return seconds
    raise JobSpecError(
        f'{name} must be a duration such as "30m", "1h30m" or "1.5s", '
        f'or "0" for none; got {value!r}'
    )


def format_job_duration(seconds: float) -> str:
    """A duration string :func:`parse_job_duration` reads back (to the millisecond).

    ``0`` gives ``"0"``; a positive duration below a millisecond gives ``"1ms"``.

    Raises:
        ValueError: ``seconds`` is negative or not finite.
    """
    if not (seconds >= 0 and seconds != float("inf")):
        raise ValueError(f"expected a finite duration >= 0, got {seconds!r}")
    if seconds == 0:
        return "0"
    millis = max(1, round(seconds * 1000))
    if millis % 1000 == 0:
        return f"{millis // 1000}s"
    return f"{millis}ms"


def _check_duration(spec: JobSpec, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (value >= 0 and value != float("inf"))
    ):
        raise JobSpecError(f"{attribute.name} must be a number of seconds >= 0 or None")


def _copy_params(params: Mapping[str, Any]) -> Mapping[str, Any]:
    return dict(params) if isinstance(params, Mapping) else params


@attrs.frozen(kw_only=True)
class JobSpec:
    """The reference runner's job object (see the module docstring).

    Attributes:
        params: the job's parameters (a copy is kept).
        stdin_url: where the job's stdin is read from, ``None`` for none.
        stdout_url: where the job's stdout is streamed to, ``None`` for none.
        timeout: this job's wall-clock ceiling in seconds, over the service's;
            ``0`` for none, ``None`` for the service's.
        stall_timeout: this job's stall window in seconds, over the service's;
            ``0`` for no stall supervision, ``None`` for the service's.

    Raises:
        JobSpecError: ``params`` is not a mapping with string keys, a URL is
            not an http or https URL with a host, or a limit is negative.
    """

    params: Mapping[str, Any] = attrs.field(
        factory=dict, converter=_copy_params, validator=_check_params
    )
    stdin_url: str | None = attrs.field(default=None, validator=_check_url)
    stdout_url: str | None = attrs.field(default=None, validator=_check_url)
    timeout: float | None = attrs.field(default=None, validator=_check_duration)
    stall_timeout: float | None = attrs.field(default=None, validator=_check_duration)

    @staticmethod
    def _override(own: float | None, service: float | None) -> float | None:
        if own is None:
            return service
        return own or None

    def effective_timeout(self, service: float | None) -> float | None:
        """The wall-clock ceiling that applies: this job's, else the service's (``None``: none)."""
        return self._override(self.timeout, service)

    def effective_stall_timeout(self, service: float | None) -> float | None:
        """The stall window that applies: this job's, else the service's (``None``: none)."""
        return self._override(self.stall_timeout, service)

    @classmethod
    def from_wire(cls, job: Mapping[str, Any]) -> JobSpec:
        """Read a received job object (``JOB.job``).

        Args:
            job: the decoded object; members not listed are ignored.

        Returns:
            The job object, checked.

        Raises:
            JobSpecError: ``params`` is not an object, a pipe URL is not an
                http or https URL (absent and null mean no pipe), or ``timeout`` or
                ``stall_timeout`` is not a duration string. The first problem in
                the order ``params``, ``stdin_url``, ``stdout_url``, ``timeout``,
                ``stall_timeout`` is named.
        """
        return cls(
            params=job.get("params", {}),
            stdin_url=job.get("stdin_url"),
            stdout_url=job.get("stdout_url"),
            timeout=parse_job_duration("timeout", job.get("timeout")),
            stall_timeout=parse_job_duration("stall_timeout", job.get("stall_timeout")),
        )

    def to_wire(self) -> dict[str, Any]:
        """The job object to send in ``JOB.job``; pipes without a URL and limits left
        to the service are left out."""
        wire: dict[str, Any] = {"params": dict(self.params)}
        if self.stdin_url is not None:
            wire["stdin_url"] = self.stdin_url
        if self.stdout_url is not None:
            wire["stdout_url"] = self.stdout_url
        if self.timeout is not None:
            wire["timeout"] = format_job_duration(self.timeout)
        if self.stall_timeout is not None:
            wire["stall_timeout"] = format_job_duration(self.stall_timeout)
        return wire


def with_pipe_urls(job: Mapping[str, Any], base: str, paths: Mapping[str, str]) -> dict[str, Any]:
    """A job object whose pipe members are completed with a callback base.

    A client knows its pipes' paths when it submits a job, but their URLs only
    once an offer has won: they are built on the callback base of that connection.

    Args:
        job: the job object as submitted.
        base: the winning connection's callback base (``http://host:port``).
        paths: member name → path on the client's listener (``/pipe/<id>``).

    Returns:
        A new job object with each member set to ``base`` + its path.
    """
    root = base.rstrip("/")
    return {**job, **{member: root + path for member, path in paths.items()}}


# -- receipts -----------------------------------------------------------------------


def ended_receipt(
    status: Status,
    error: str | None = None,
    *,
    started_at: float,
    duration_s: float,
    instance_id: str,
    exit_code: int | None = None,
    stderr_line: str | None = None,
    stdout_prefix: str = "",
    stdout_bytes: int = 0,
    stdin_bytes: int = 0,
    peak_memory: int | None = None,
) -> Receipt:
    """The receipt of a job that ended; what no process produced keeps its default.

    Args:
        status: how it ended.
        error: ``None`` for ``ok``, the sentence that says why otherwise.
        started_at: when it started (wall clock, UNIX seconds).
        duration_s: how long it ran.
        instance_id: the execserver instance that ran it.
        exit_code: the exit status, minus the signal number for a signal;
            ``None`` when no process ran.
        stderr_line: the decisive stderr line (see :class:`LastLine`).
        stdout_prefix: the start of stdout (see :func:`stdout_prefix`).
        stdout_bytes: all of stdout, in bytes.
        stdin_bytes: the stdin fed to the command, in bytes.
        peak_memory: the group's highest sampled RSS; ``None`` when no process ran.

    Raises:
        ValueError: ``error`` is set for ``ok`` or missing for another status.
    """
    if (status == "ok") != (error is None):
        raise ValueError(f"a receipt has an error exactly when it is not ok: {status}, {error!r}")
    return Receipt(
        status=status,
        exit_code=exit_code,
        error=error,
        stderr_line=stderr_line,
        stdout_prefix=stdout_prefix,
        stdout_bytes=stdout_bytes,
        stdin_bytes=stdin_bytes,
        started_at=started_at,
        duration_s=duration_s,
        peak_memory=peak_memory,
        instance_id=instance_id,
    )


def error_receipt(
    reason: str, *, started_at: float, duration_s: float, instance_id: str
) -> Receipt:
    """The receipt of a job that could not start (status ``error``, no process ran).

    Args:
        reason: the sentence that says why (``missing parameter 'text'``).
        started_at: when the attempt began (wall clock, UNIX seconds).
        duration_s: how long the attempt took.
        instance_id: the execserver instance that tried.
    """
    return ended_receipt(
        "error", reason, started_at=started_at, duration_s=duration_s, instance_id=instance_id
    )


def _cut_utf8(data: bytes, limit: int) -> bytes:
    """The first ``limit`` bytes at most, without a character cut in two."""
    if len(data) <= limit:
        return data
    cut = limit
    while cut > limit - 3 and cut > 0 and data[cut] & 0xC0 == 0x80:
        cut -= 1
    return data[:cut] if data[cut] & 0xC0 != 0x80 else data[:limit]


def binary_output(size: int) -> str:
    """The ``stdout_prefix`` of output that is no text: ``<N bytes of binary output>``."""
    return f"<{size} bytes of binary output>"


def stdout_prefix(head: bytes, *, total: int | None = None) -> str:
    """A receipt's ``stdout_prefix`` from the start of stdout.

    The rule: the first :data:`STDOUT_PREFIX_BYTES` bytes, cut so that no
    character is cut in two, when they are UTF-8 text; output whose start is
    not valid UTF-8 or holds a NUL is binary (an image, an archive) and is
    shown as its size, :func:`binary_output` (``<52341 bytes of binary
    output>``), not as replacement characters.

    Args:
        head: the first bytes of stdout; one byte more than
            :data:`STDOUT_PREFIX_BYTES` tells whether a character straddles the cut.
        total: all of stdout in bytes (the receipt's ``stdout_bytes``), for the
            size of binary output; by default ``len(head)``.

    Returns:
        The text, or the binary marker.
    """
    cut = _cut_utf8(head, STDOUT_PREFIX_BYTES)
    try:
        text = cut.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or "\x00" in text:
        return binary_output(len(head) if total is None else total)
    return text


class LastLine:
    """Keeps the last non-empty line of a byte stream (``\\n`` or ``\\r`` ends a line).

    Feed it stderr chunk by chunk; it holds at most a few kilobytes whatever
    the stream's size.
    """

    _BREAK = re.compile(rb"[\r\n]")

    def __init__(self) -> None:
        self._last: bytes | None = None
        self._partial = b""

    def feed(self, chunk: bytes | bytearray) -> None:
        """Take the next chunk of the stream."""
        *lines, partial = self._BREAK.split(self._partial + chunk)
        for line in reversed(lines):
            if line.strip():
                self._last = line[-_STDERR_TAIL_BYTES:]
                break
        self._partial = partial[-_STDERR_TAIL_BYTES:]

    def result(self) -> str | None:
        """The receipt's ``stderr_line``: the last non-empty line, stripped, at most
        :data:`STDERR_LINE_CHARS` characters (its end); ``None`` when there was none."""
        line = self._partial if self._partial.strip() else self._last
        if line is None:
            return None
        if len(line) == _STDERR_TAIL_BYTES:  # possibly cut inside a character
            line = line.lstrip(bytes(range(0x80, 0xC0)))
        return line.decode("utf-8", "replace").strip()[-STDERR_LINE_CHARS:]
