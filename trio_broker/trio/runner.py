"""Runners: what an execserver calls to run a granted job, and the supervised reference.

The execserver grants a slot, creates a :class:`JobControl` for the job and awaits
``runner.run(request, control)``; the runner returns a
:class:`~trio_broker.core.protocol.Receipt`, whatever happened to the job. A
:class:`CommandRunner` runs each service as a configured argv template (never a
shell) in its own process group and work directory, samples the group every
``sample_interval`` for :mod:`trio_broker.core.supervision`, and kills the whole group at
the end. Linux only: it reads ``/proc`` (:mod:`trio_broker.trio.procgroup`).

Ending a job:

* The leader exits on its own: the rest of the group gets ``SIGKILL`` (no stray
  helper survives), the leader is reaped, the receipt tells its exit status.
* A verdict (timeout, stall, memory) or :meth:`JobControl.abort`: ``SIGTERM`` to
  the group, up to ``kill_grace`` seconds for the leader to exit, then ``SIGKILL``
  to the group; the receipt keeps the leader's real exit status.
* The task running :meth:`CommandRunner.run` is cancelled (daemon shutdown):
  ``SIGKILL`` to the group at once, reap, clean up (shielded, bounded), and the
  cancellation propagates.

The leader is waited for through a pidfd, which becomes readable when it exits
but does not reap it: the group is signalled while the exited leader is still a
zombie holding its pid, so the group id cannot have been reused by then.

Pipes (``PROTOCOL.md``, *Pipes*): a job object may carry ``stdin_url`` and
``stdout_url``, one-time endpoints served by the client (:mod:`trio_broker.trio.pipes`).
Every byte moves with back-pressure, so memory stays bounded whatever the size:

* ``stdin_url``: the runner sends its ``GET`` before it starts the command. A refusal
  (404, connection refused, any answer but 200) ends the job ``error``
  (``missing input: …``) and runs nothing. Then each chunk of the body is written
  to the command's stdin, and its end closes stdin. A command that stops reading
  its stdin is not a failure (the rest is not read). A body that breaks off in
  mid-stream (an incomplete chunked body, a reset) ends the job ``stopped``: the
  command must not take a truncated input for a whole one.
* ``stdout_url``: stdout is held back until it outgrows
  :data:`STDOUT_PREFIX_BYTES`; only then is a chunked ``PUT`` opened, fed from the
  command's stdout as fast as the client takes it. The body gets its final chunk
  only once the command has ended ``ok``; any other end (a non-zero exit, a
  signal, a verdict, an abort, stdout left open by a stray process) makes the
  body generator raise, so the connection drops without the final chunk and the
  client sees an incomplete body, never a silent truncation. The receipt's error
  then says why and adds ``the output stream was aborted after N bytes``. Output
  that never outgrew the buffer is ``PUT`` in one piece after an ``ok`` end, and
  never sent after any other end (the receipt carries it in ``stdout_prefix``).
  A ``PUT`` that is refused or breaks while the command runs ends the job
  ``stopped``; one that fails after an ``ok`` end turns the receipt ``stopped``
  too, since the output did not arrive. A client that takes nothing more is
  covered by the stall timeout while the command runs, and by the same timeout
  (:data:`_PIPE_FINISH_TIMEOUT` when the service has none) for the last bytes
  once it has ended.

Builtin services ignore pipes. Errors name a pipe by its listener
(``http://host:port``), never by its id: the id is the pipe's credential.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import logging
import math
import os
import re
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Mapping
from functools import partial
from typing import Any, Final, Literal, Protocol, TypeAlias

import attrs
import httpx
import trio

from trio_broker.core.protocol import Receipt, Status
from trio_broker.core.supervision import MemoryBudget, Verdict, Watchdog, budget_verdict
from trio_broker.trio import procgroup

__all__ = [
    "AbortStatus",
    "CommandRunner",
    "CommandSpec",
    "JobControl",
    "JobRequest",
    "ParameterError",
    "Runner",
    "RunnerStatistics",
    "RunningJob",
    "fill_argv",
]

logger = logging.getLogger(__name__)

AbortStatus: TypeAlias = Literal["cancelled", "stopped"]
"""The receipt statuses of an aborted job: ``CANCEL`` from the client, or an
operational interruption (shutdown, broken stream)."""

STDOUT_PREFIX_BYTES: Final = 4000
"""How much of stdout a receipt carries."""
STDERR_LINE_CHARS: Final = 1000
"""The longest ``stderr_line`` a receipt carries (its last characters)."""
SUPERVISED_ENV: Final = ("FYLR_EXEC_SUPERVISED", "FYLR_CONVERT_THREADS")
"""Variables the runner always sets itself."""

_READ_CHUNK = 65536

_BULK_PIPE_BYTES = 1 << 20
"""Kernel buffer asked for the stdin/stdout pipes of a body-mode job (Linux: at
most ``/proc/sys/fs/pipe-max-size``, 1 MiB by default): fewer, larger reads and
writes per megabyte streamed."""

_STDOUT_READ = 256 * 1024
"""Largest stdout read: a quarter of the widened pipe, so a reader that keeps up
moves big blocks while each one in flight stays small."""
_STDERR_TAIL_BYTES = 4 * STDERR_LINE_CHARS + 4  # enough bytes for 1000 characters
_CLEANUP_TIMEOUT = 5.0  # shielded cleanup after a cancellation
_GROUP_GONE_TIMEOUT = 3.0  # for SIGKILLed members to die
_GROUP_GONE_POLL = 0.02
_OUTPUT_DRAIN_TIMEOUT = 2.0  # for the pipes to reach EOF once the group is dead
_PIPE_TIMEOUT = httpx.Timeout(connect=10.0, read=None, write=None, pool=10.0)
"""Pipe transfers have no read or write timeout: a slow client is back-pressure,
and a client that takes nothing is the stall watchdog's business."""
_PIPE_FINISH_TIMEOUT = 600.0
"""Seconds for the out-pipe's last bytes once the command has ended, for a
service without a stall timeout."""
_PIPE_MAX_BYTES = 1 << 20
"""The most an OS pipe holds (Linux's default ``pipe-max-size``): more stdout
read after the process group died was written by a process outside it."""


# -- the interface ----------------------------------------------------------------


class ParameterError(ValueError):
    """A job's parameters cannot fill an argv template; the text is the receipt's error."""


_TEMPLATE_TOKEN = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")


def _parse_template(element: str) -> tuple[str | tuple[str], ...]:
    """Split an argv element into literal strings and ``(name,)`` placeholders.

    Raises:
        ValueError: a single ``{`` or ``}``, or an empty ``{}``.
    """
    parts: list[str | tuple[str]] = []
    position = 0
    for match in _TEMPLATE_TOKEN.finditer(element):
        parts.append(element[position : match.start()])
        token = match.group()
        if token in ("{{", "}}"):
            parts.append(token[0])
        elif match.group(1):
            parts.append((match.group(1),))
        elif token == "{}":
            raise ValueError(f"argv element {element!r} has an empty placeholder '{{}}'")
        else:
            raise ValueError(
                f"argv element {element!r} has a single {token!r}; write {token * 2!r} "
                "for a literal brace"
            )
        position = match.end()
    parts.append(element[position:])
    return tuple(part for part in parts if part != "")


def _format_parameter(name: str, value: object) -> str:
    if isinstance(value, str):
        text = value
    elif value is True or value is False:
        text = "true" if value else "false"
    elif isinstance(value, int | float) and math.isfinite(value):
        text = json.dumps(value)
    else:
        raise ParameterError(f"parameter {name!r} must be a string, number or boolean")
    if "\0" in text:
        raise ParameterError(f"parameter {name!r} must not contain a NUL character")
    return text


def fill_argv(argv: tuple[str, ...], params: Mapping[str, Any]) -> tuple[str, ...]:
    """Fill the ``{name}`` placeholders of an argv template from a job's parameters.

    Strings go in as they are, numbers as JSON prints them, booleans as ``true``
    or ``false``; ``{{`` and ``}}`` are literal braces. Each element stays one
    argument whatever the values hold: there is no shell.

    Raises:
        ParameterError: a placeholder's parameter is missing or not a scalar.
        ValueError: the template itself is malformed (a caller's mistake).
    """
    filled = []
    for element in argv:
        pieces = []
        for part in _parse_template(element):
            if isinstance(part, str):
                pieces.append(part)
                continue
            (name,) = part
            if name not in params:
                raise ParameterError(f"missing parameter {name!r}")
            pieces.append(_format_parameter(name, params[name]))
        filled.append("".join(pieces))
    return tuple(filled)


def _check_argv(spec: CommandSpec, _: attrs.Attribute[Any], argv: tuple[str, ...] | None) -> None:
    if argv is None:
        return
    if not isinstance(argv, tuple) or not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"argv must be a non-empty tuple of strings, got {argv!r}")
    if any("\0" in element for element in argv):
        raise ValueError("argv must not contain NUL characters")
    for element in argv:
        _parse_template(element)


def _positive_or_none(spec: CommandSpec, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name} must be positive or None, got {value!r}")


@attrs.frozen(kw_only=True)
class CommandSpec:
    """How one service runs.

    Attributes:
        argv: the command as an argv template: elements may hold ``{name}``
            placeholders filled from the job's ``params``; ``{{``/``}}`` are
            literal braces.
        builtin: instead of a command, ``"noop"`` (ends at once) or ``"sleep"``
            (holds the slot for ``params.seconds``). Exactly one of ``argv`` and
            ``builtin`` is set.
        threads: the resolved thread count, given to the command as
            ``FYLR_CONVERT_THREADS``.
        timeout: the wall-clock ceiling in seconds, ``None`` for none.
        stall_timeout: seconds without progress before the job is stalled,
            ``None`` for no stall supervision.
        memory_limit: this job's own RSS ceiling in bytes, ``None`` for none.
        env: extra environment variables for the command.

    Raises:
        ValueError: both or neither of ``argv``/``builtin``; a malformed
            template; a non-positive limit or thread count.
    """

    argv: tuple[str, ...] | None = attrs.field(default=None, validator=_check_argv)
    builtin: Literal["noop", "sleep"] | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.in_(("noop", "sleep")))
    )
    threads: int = attrs.field(default=1)
    timeout: float | None = attrs.field(default=None, validator=_positive_or_none)
    stall_timeout: float | None = attrs.field(default=600.0, validator=_positive_or_none)
    memory_limit: int | None = attrs.field(default=None, validator=_positive_or_none)
    env: Mapping[str, str] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        if (self.argv is None) == (self.builtin is None):
            raise ValueError("a CommandSpec needs exactly one of argv and builtin")
        if type(self.threads) is not int or self.threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {self.threads!r}")


@attrs.frozen(kw_only=True)
class JobRequest:
    """A job to run: the redeemed ``JOB`` message.

    Attributes:
        job_id: the client's job id.
        service: the service to run it with.
        subject: what the job is about (for logs), if the client said.
        job: the ``JOB`` message's object; parameters are in ``job["params"]``.
    """

    job_id: str
    service: str
    subject: str | None = None
    job: Mapping[str, Any] = attrs.field(factory=dict)


class JobControl:
    """The execserver's handle on one running job: it can ask the runner to end it.

    Created by the execserver per job and passed to :meth:`Runner.run`. Use it
    from the trio thread only.
    """

    def __init__(self) -> None:
        self._event = trio.Event()
        self._status: AbortStatus | None = None
        self._reason: str | None = None

    def abort(self, status: AbortStatus, reason: str) -> None:
        """Ask the runner to end the job now; the first call wins, later ones are ignored.

        Args:
            status: the receipt status, ``"cancelled"`` (the client's ``CANCEL``)
                or ``"stopped"`` (shutdown, broken stream).
            reason: the receipt's error sentence.

        Raises:
            ValueError: ``status`` is neither of the two.
        """
        if status not in ("cancelled", "stopped"):
            raise ValueError(f"an abort status is 'cancelled' or 'stopped', not {status!r}")
        if self._status is None:
            self._status = status
            self._reason = reason
            self._event.set()

    @property
    def aborted(self) -> bool:
        """Whether :meth:`abort` was called."""
        return self._status is not None

    @property
    def status(self) -> AbortStatus | None:
        """The first abort's status, ``None`` before any."""
        return self._status

    @property
    def reason(self) -> str | None:
        """The first abort's reason, ``None`` before any."""
        return self._reason

    async def wait_aborted(self) -> None:
        """Return once :meth:`abort` has been called."""
        await self._event.wait()


class Runner(Protocol):
    """Runs granted jobs for an execserver."""

    async def run(self, request: JobRequest, control: JobControl) -> Receipt:
        """Run one job to its end and describe how it ended.

        Never raises for job-level problems (unknown service, bad parameters,
        a command that fails or cannot start): those are receipts. If the calling
        task is cancelled, the job is killed and the cancellation propagates.
        """
        ...


@attrs.frozen(kw_only=True)
class RunningJob:
    """One running job in :meth:`CommandRunner.statistics`."""

    job_id: str
    service: str
    started_at: float
    pid: int | None
    """The leader's pid; ``None`` for builtins."""
    pgid: int | None
    """The process group (equal to ``pid``); ``None`` for builtins."""
    rss: int | None
    """The latest sampled RSS of the group."""
    peak_memory: int | None


@attrs.frozen(kw_only=True)
class RunnerStatistics:
    """A snapshot of a :class:`CommandRunner`."""

    running: tuple[RunningJob, ...]
    memory_used: int
    """The latest sampled RSS of every running job, summed."""
    memory_budget: int | None


# -- the reference runner -----------------------------------------------------------


@attrs.frozen(kw_only=True)
class _Ending:
    """Why the runner ended a job (a verdict or an abort)."""

    status: Status
    error: str


@attrs.frozen(kw_only=True)
class _Start:
    """When a job started, and the receipts that tell how it ended."""

    started: float
    """On the trio clock (monotonic)."""
    started_at: float
    """On the wall clock."""
    instance_id: str

    def receipt(
        self,
        status: Status,
        error: str | None = None,
        *,
        exit_code: int | None = None,
        stderr_line: str | None = None,
        stdout_prefix: str = "",
        stdout_bytes: int = 0,
        stdin_bytes: int = 0,
        peak_memory: int | None = None,
    ) -> Receipt:
        return Receipt(
            status=status,
            exit_code=exit_code,
            error=error,
            stderr_line=stderr_line,
            stdout_prefix=stdout_prefix,
            stdout_bytes=stdout_bytes,
            stdin_bytes=stdin_bytes,
            started_at=self.started_at,
            duration_s=trio.current_time() - self.started,
            peak_memory=peak_memory,
            instance_id=self.instance_id,
        )


def _only_cancelled(group: BaseExceptionGroup[BaseException]) -> trio.Cancelled | None:
    """The first Cancelled of a group that holds nothing else, else ``None``."""
    cancelled, rest = group.split(trio.Cancelled)
    if cancelled is None or rest is not None:
        return None
    leaf: BaseException = cancelled
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    assert isinstance(leaf, trio.Cancelled)
    return leaf


def _cut_utf8(data: bytes, limit: int) -> bytes:
    """The first ``limit`` bytes at most, without a character cut in two."""
    if len(data) <= limit:
        return data
    cut = limit
    while cut > limit - 3 and cut > 0 and data[cut] & 0xC0 == 0x80:
        cut -= 1
    return data[:cut] if data[cut] & 0xC0 != 0x80 else data[:limit]


class _LastLine:
    """Keeps the last non-empty line of a byte stream (``\\n`` or ``\\r`` ends a line)."""

    _BREAK = re.compile(rb"[\r\n]")

    def __init__(self) -> None:
        self._last: bytes | None = None
        self._partial = b""

    def feed(self, chunk: bytes | bytearray) -> None:
        *lines, partial = self._BREAK.split(self._partial + chunk)
        for line in reversed(lines):
            if line.strip():
                self._last = line[-_STDERR_TAIL_BYTES:]
                break
        self._partial = partial[-_STDERR_TAIL_BYTES:]

    def result(self) -> str | None:
        line = self._partial if self._partial.strip() else self._last
        if line is None:
            return None
        if len(line) == _STDERR_TAIL_BYTES:  # possibly cut inside a character
            line = line.lstrip(bytes(range(0x80, 0xC0)))
        return line.decode("utf-8", "replace").strip()[-STDERR_LINE_CHARS:]


# -- pipes --------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class _PipeUrls:
    """The job object's pipe endpoints, checked."""

    stdin_url: str | None = None
    stdout_url: str | None = None

    @classmethod
    def from_job(cls, job: Mapping[str, Any]) -> _PipeUrls:
        """Read ``stdin_url`` and ``stdout_url`` (absent or null: no pipe).

        Raises:
            ParameterError: one is not an http or https URL with a host.
        """
        return cls(stdin_url=_pipe_url(job, "stdin_url"), stdout_url=_pipe_url(job, "stdout_url"))


def _pipe_url(job: Mapping[str, Any], name: str) -> str | None:
    value = job.get(name)
    if value is None:
        return None
    problem = ParameterError(f"{name} must be an http or https URL")
    if not isinstance(value, str):
        raise problem
    try:
        url = httpx.URL(value)
    except httpx.InvalidURL:
        raise problem from None
    if url.scheme not in ("http", "https") or not url.host:
        raise problem
    return value


def _listener(url: str) -> str:
    """``scheme://host:port`` of a pipe URL: where it is, without its credential."""
    parsed = httpx.URL(url)
    return f"{parsed.scheme}://{parsed.netloc.decode('ascii')}"


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class _AbortStream(Exception):
    """Raised inside an out-pipe's body so that the ``PUT`` drops without its final chunk."""


async def _abandon(chunks: AsyncIterator[bytes]) -> None:
    """Finish a half-read httpx response iterator now.

    It is a chain of async generators; left suspended, each would be finalized
    at garbage collection, with a warning from trio. Resumed under a cancelled
    scope, the chain unwinds at its next checkpoint (the network read), each
    generator ending as the cancellation passes through it.
    """
    with trio.CancelScope() as scope:
        scope.cancel()
        while True:
            try:
                await anext(chunks)
            except (StopAsyncIteration, httpx.HTTPError):
                return


class _OutPipe:
    """The runner's end of a job's ``stdout_url``."""

    def __init__(self, http: httpx.AsyncClient, url: str) -> None:
        self.http = http
        self.url = url
        self.opened = False
        """Whether the streaming ``PUT`` was opened (stdout outgrew the buffer)."""
        self.aborted = False
        """Whether the runner cut the streaming ``PUT`` off."""
        self.sent = 0
        """Bytes of the body handed to the connection."""
        self._settled = trio.Event()
        self._ok = False

    def settle(self, ok: bool) -> None:
        """Say how the command ended: ``ok`` completes the body, anything else aborts it."""
        if not self._settled.is_set():
            self._ok = ok
            self._settled.set()

    async def wait_settled(self) -> bool:
        await self._settled.wait()
        return self._ok


class _StdoutBody(httpx.AsyncByteStream):
    """An out-pipe's ``PUT`` body: the held bytes, then (streaming) the rest of stdout.

    A streaming body is complete only when the command ended ok; otherwise its
    last step raises :class:`_AbortStream`, so the connection drops without the
    final chunk. A plain async iterator rather than an async generator: the HTTP
    client may stop iterating anywhere (a refused ``PUT``, a cancellation), and an
    abandoned generator would be finalized late, with a warning from trio.
    """

    def __init__(self, job: _CommandJob, pipe: _OutPipe, held: bytes, *, streaming: bool) -> None:
        self._job = job
        self._pipe = pipe
        self._held: bytes | None = held
        self._streaming = streaming

    def headers(self) -> dict[str, str]:
        framing = (
            {"transfer-encoding": "chunked"}
            if self._streaming
            else {"content-length": str(len(self._held or b""))}
        )
        return {"content-type": "application/octet-stream", **framing}

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        chunk = self._held
        if chunk is not None:
            self._held = None
            if chunk:
                self._pipe.sent += len(chunk)
                return chunk
        if self._streaming:
            chunk = await self._job._read_stdout()
            if chunk:
                self._pipe.sent += len(chunk)
                return chunk
            if not await self._pipe.wait_settled():
                raise _AbortStream
        raise StopAsyncIteration


class _CommandJob:
    """The state of one command while it runs (one per :meth:`CommandRunner.run`)."""

    def __init__(
        self,
        runner: CommandRunner,
        entry: _Entry,
        spec: CommandSpec,
        process: trio.Process,
        workdir: str,
        start: _Start,
        out_pipe: _OutPipe | None = None,
    ) -> None:
        self.runner = runner
        self.request = entry.request
        self.process = process
        self.pgid = process.pid
        self.workdir = workdir
        self.key = entry.key
        self.watchdog = Watchdog(
            started=start.started,
            timeout=spec.timeout,
            stall_timeout=spec.stall_timeout,
            memory_limit=spec.memory_limit,
        )
        self.pidfd = procgroup.open_pidfd(process.pid)
        self.reaped = False
        self.rss: int | None = None
        self.stdout_head = bytearray()
        self.stdout_bytes = 0
        self.stderr_bytes = 0
        self.stdin_bytes = 0
        self.stderr_line = _LastLine()
        self.out_pipe = out_pipe
        self.stdout_eof = trio.Event()
        """Set when the command's stdout reached its end."""
        self.stdout_waiting_since: float | None = None
        """Since when the stdout reader waits on the pipe; ``None`` while it does not."""
        self.stdout_done = trio.Event()
        """Set when the stdout pump is done (with an out-pipe: its ``PUT`` too)."""
        self.stderr_done = trio.Event()
        self.failure: _Ending | None = None
        """The first pipe failure: it ends the job (see :meth:`fail`)."""
        self.failed = trio.Event()

    def fail(self, ending: _Ending) -> None:
        """A pipe failed: end the job (once it runs) or spoil an ``ok`` receipt (after)."""
        if self.failure is None:
            self.failure = ending
            self.failed.set()

    # -- input

    async def pump_stdin(self, body: httpx.Response) -> None:
        """Feed the in-pipe's body to the command's stdin; close stdin at its end (EOF).

        A body that breaks off leaves stdin open: an end of file would pass a
        truncated input for a whole one. The job is ended instead.
        """
        stdin = self.process.stdin
        assert stdin is not None
        chunks = body.aiter_bytes()
        try:
            while True:
                try:
                    chunk = await anext(chunks)
                except StopAsyncIteration:
                    break
                except httpx.HTTPError as exc:
                    self.fail(
                        _Ending(
                            status="stopped",
                            error=f"the input stream broke after {self.stdin_bytes} bytes: "
                            f"{_describe(exc)}",
                        )
                    )
                    return
                try:
                    await stdin.send_all(chunk)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return  # the command stopped reading its stdin: not a failure
                self.stdin_bytes += len(chunk)
        finally:
            await _abandon(chunks)
        await stdin.aclose()

    # -- output

    async def _read_stdout(self) -> bytes:
        """The next chunk of stdout, counted and kept for the prefix; ``b""`` at its end."""
        assert self.process.stdout is not None
        self.stdout_waiting_since = trio.current_time()
        try:
            chunk = await self.process.stdout.receive_some(_STDOUT_READ)
        finally:
            self.stdout_waiting_since = None
        if not chunk:
            self.stdout_eof.set()
            return b""
        self.stdout_bytes += len(chunk)
        room = STDOUT_PREFIX_BYTES + 1 - len(self.stdout_head)  # +1: see _cut_utf8
        if room > 0:
            self.stdout_head += chunk[:room]
        return chunk if isinstance(chunk, bytes) else bytes(chunk)

    async def pump_stdout(self) -> None:
        try:
            if self.out_pipe is not None:
                await self._pump_stdout_to(self.out_pipe)
            # to the end: all of stdout is counted, even what a failed PUT left
            while await self._read_stdout():
                pass
        finally:
            self.stdout_done.set()

    async def _pump_stdout_to(self, pipe: _OutPipe) -> None:
        """Hold stdout back until it outgrows the prefix, then stream it in a ``PUT``."""
        held = bytearray()
        while len(held) <= STDOUT_PREFIX_BYTES:
            chunk = await self._read_stdout()
            if not chunk:  # the whole output fits: send it only after an ok end
                if await pipe.wait_settled():
                    await self._put(pipe, _StdoutBody(self, pipe, bytes(held), streaming=False))
                return
            held += chunk
        pipe.opened = True
        try:
            await self._put(pipe, _StdoutBody(self, pipe, bytes(held), streaming=True))
        except _AbortStream:
            pipe.aborted = True

    async def _put(self, pipe: _OutPipe, body: _StdoutBody) -> None:
        where = _listener(pipe.url)
        request = pipe.http.build_request(
            "PUT", pipe.url, headers=body.headers(), timeout=_PIPE_TIMEOUT
        )
        request.stream = body
        try:
            response = await pipe.http.send(request)
        except httpx.HTTPError as exc:
            problem = f"cannot write to the out-pipe at {where}: {_describe(exc)}"
        else:
            if response.is_success:
                return
            problem = f"the out-pipe at {where} answered {response.status_code}"
        self.fail(_Ending(status="stopped", error=f"the output stream broke: {problem}"))

    async def wait_output_end(self, within: float) -> None:
        """Wait (bounded) for stdout and stderr to reach their ends once the group is dead.

        A process outside the group (one that made its own session) may hold them
        open, so each gets :data:`_OUTPUT_DRAIN_TIMEOUT`. With an out-pipe, though,
        the last of stdout may still be on its way to a slow client: it is waited
        for, up to ``within``, while the reader is busy sending. It is given up on
        once the reader has waited that long on a silent pipe, or has read more
        than a pipe can hold since the group died (a stray process writes).

        Args:
            within: the bound on the wait for a slow client, in seconds.
        """
        with trio.move_on_after(_OUTPUT_DRAIN_TIMEOUT):
            await self.stderr_done.wait()
        if self.out_pipe is None:
            with trio.move_on_after(_OUTPUT_DRAIN_TIMEOUT):
                await self.stdout_eof.wait()
            return
        limit = self.stdout_bytes + _PIPE_MAX_BYTES
        with trio.move_on_after(within):
            while not self.stdout_eof.is_set() and self.stdout_bytes <= limit:
                now = trio.current_time()
                since = self.stdout_waiting_since
                if since is not None and now - since >= _OUTPUT_DRAIN_TIMEOUT:
                    return
                with trio.move_on_at((now if since is None else since) + _OUTPUT_DRAIN_TIMEOUT):
                    await self.stdout_eof.wait()

    async def finish_stdout(self, ok: bool, within: float) -> None:
        """Tell the out-pipe how the command ended; wait (bounded) for its last bytes.

        Args:
            ok: whether the command ended ok (the body gets its final chunk).
            within: seconds for the client to take what is still in flight.
        """
        pipe = self.out_pipe
        assert pipe is not None
        eof = self.stdout_eof.is_set()
        pipe.settle(ok and eof)
        if not eof:  # a stray process holds stdout open: the pump is cancelled
            if ok:
                self.fail(
                    _Ending(
                        status="stopped",
                        error="stdout stayed open after the command ended; "
                        "the output stream was aborted",
                    )
                )
            return
        with trio.move_on_after(within) as scope:
            await self.stdout_done.wait()
        if scope.cancelled_caught:
            self.fail(
                _Ending(
                    status="stopped",
                    error=f"the output stream did not finish within {within:g}s "
                    "after the command ended",
                )
            )

    async def pump_stderr(self) -> None:
        assert self.process.stderr is not None
        try:
            while chunk := await self.process.stderr.receive_some(_READ_CHUNK):
                self.stderr_bytes += len(chunk)
                self.stderr_line.feed(chunk)
        finally:
            self.stderr_done.set()

    # -- supervision

    async def sample(self) -> Verdict | None:
        """Sample the group and its work dir once; the verdict if the job must end."""
        reading, dir_bytes = await trio.to_thread.run_sync(self._read, abandon_on_cancel=True)
        verdict = self.watchdog.sample(
            trio.current_time(),
            rss=reading.rss,
            cpu_seconds=reading.cpu_seconds,
            io_bytes=self.stdin_bytes + self.stdout_bytes + self.stderr_bytes,
            dir_bytes=dir_bytes,
        )
        self.rss = reading.rss
        budget = self.runner._budget
        if budget is not None:
            budget.report(self.key, reading.rss)
            if verdict is None and budget.over_budget() == self.key:
                verdict = budget_verdict(rss=reading.rss, used=budget.used(), total=budget.total)
        return verdict

    def _read(self) -> tuple[procgroup.GroupSample, int]:
        return procgroup.sample_group(self.pgid), procgroup.directory_bytes(self.workdir)

    async def supervise(self, control: JobControl) -> _Ending | None:
        """Wait for the first of: the leader exits (``None``), a verdict, an abort."""
        verdict = await self.sample()  # at least one sample: peak_memory is known
        if verdict is not None:
            return _Ending(status=verdict.status, error=verdict.error)
        endings: list[_Ending | None] = []

        def decide(ending: _Ending | None) -> None:
            if not endings:
                endings.append(ending)
                nursery.cancel_scope.cancel()

        async def leader_exited() -> None:
            await self.wait_leader_exited()
            decide(None)

        async def aborted() -> None:
            await control.wait_aborted()
            assert control.status is not None
            assert control.reason is not None
            decide(_Ending(status=control.status, error=control.reason))

        async def pipe_failed() -> None:
            await self.failed.wait()
            decide(self.failure)

        async def sampler() -> None:
            interval = self.runner._sample_interval
            while True:
                deadline = trio.current_time() + interval
                limit = self.watchdog.next_deadline()
                await trio.sleep_until(deadline if limit is None else min(deadline, limit))
                verdict = await self.sample()
                if verdict is not None:
                    decide(_Ending(status=verdict.status, error=verdict.error))
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(leader_exited)
            nursery.start_soon(aborted)
            nursery.start_soon(pipe_failed)
            nursery.start_soon(sampler)
        return endings[0]

    # -- ending

    async def wait_leader_exited(self) -> None:
        """Return once the leader has exited; reaps it only if no pidfd is available."""
        if self.reaped:
            return
        if self.pidfd is not None:
            await trio.lowlevel.wait_readable(self.pidfd)
        else:
            await self.process.wait()
            self.reaped = True

    def kill(self, sig: signal.Signals) -> None:
        procgroup.signal_group(self.pgid, sig)

    async def terminate(self, grace: float) -> None:
        """SIGTERM to the group, then up to ``grace`` seconds for the leader to exit."""
        self.kill(signal.SIGTERM)
        with trio.move_on_after(grace):
            await self.wait_leader_exited()

    async def kill_and_reap(self) -> None:
        """SIGKILL to the group, reap the leader, wait (bounded) for the members to die."""
        self.kill(signal.SIGKILL)
        await self.process.wait()
        self.reaped = True
        with trio.move_on_after(_GROUP_GONE_TIMEOUT) as scope:
            await self._wait_group_gone()
        if scope.cancelled_caught:
            logger.warning(
                "job %s: process group %d survived SIGKILL for %ss",
                self.request.job_id,
                self.pgid,
                _GROUP_GONE_TIMEOUT,
            )

    async def _wait_group_gone(self) -> None:
        """Return once no member of the group is alive (zombies do not count).

        Event-driven: a pidfd becomes readable when its process exits, even for
        a process that is not our child.
        """
        while True:
            reading = await trio.to_thread.run_sync(procgroup.sample_group, self.pgid)
            if not reading.live_pids:
                return
            pidfds = [procgroup.open_pidfd(pid) for pid in reading.live_pids]
            opened = [fd for fd in pidfds if fd is not None]
            try:
                async with trio.open_nursery() as nursery:
                    for fd in opened:
                        nursery.start_soon(trio.lowlevel.wait_readable, fd)
            finally:
                for fd in opened:
                    trio.lowlevel.notify_closing(fd)
                    os.close(fd)
            if len(opened) < len(pidfds):  # gone already, or no pidfds here: look again soon
                await trio.sleep(_GROUP_GONE_POLL)

    async def close(self) -> None:
        """Release everything; after a cancellation, first kill the group (shielded)."""
        with trio.CancelScope(shield=True), trio.move_on_after(_CLEANUP_TIMEOUT):
            if not self.reaped:
                await self.kill_and_reap()
        if not self.reaped:
            logger.warning("job %s: leader %d not reaped", self.request.job_id, self.pgid)
        if self.pidfd is not None:
            trio.lowlevel.notify_closing(self.pidfd)
            os.close(self.pidfd)
            self.pidfd = None
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            if stream is not None:
                with trio.CancelScope(shield=True):
                    await stream.aclose()

    # -- the receipt

    def stdout_prefix(self) -> str:
        return _cut_utf8(bytes(self.stdout_head), STDOUT_PREFIX_BYTES).decode("utf-8", "replace")


@attrs.define(kw_only=True, eq=False)
class _Entry:
    """A job in :meth:`CommandRunner.statistics`, from the start of ``run`` to its end."""

    request: JobRequest
    key: int
    started_at: float
    job: _CommandJob | None = None
    """Set once the command's process exists."""

    def snapshot(self) -> RunningJob:
        job = self.job
        return RunningJob(
            job_id=self.request.job_id,
            service=self.request.service,
            started_at=self.started_at,
            pid=None if job is None else job.pgid,
            pgid=None if job is None else job.pgid,
            rss=None if job is None else job.rss,
            peak_memory=None if job is None else job.watchdog.peak_memory,
        )


class CommandRunner:
    """The reference runner: each service is a supervised command (or a builtin).

    Args:
        services: how each service runs, by name.
        env: environment variables for every command (under each service's own).
        temp_dir: where the per-job work directories are made (default: the
            system's temporary directory).
        memory_budget: bytes that all running jobs together may use; when they
            exceed it, the job with the largest RSS ends ``out_of_memory``.
        instance_id: copied into every receipt.
        sample_interval: seconds between samples of a running job.
        kill_grace: seconds between SIGTERM and SIGKILL when the runner ends a job.
    """

    def __init__(
        self,
        services: Mapping[str, CommandSpec],
        *,
        env: Mapping[str, str] = {},
        temp_dir: str | None = None,
        memory_budget: int | None = None,
        instance_id: str = "",
        sample_interval: float = 1.0,
        kill_grace: float = 2.0,
    ) -> None:
        if not (math.isfinite(sample_interval) and sample_interval > 0):
            raise ValueError(f"sample_interval must be positive, got {sample_interval!r}")
        if not (math.isfinite(kill_grace) and kill_grace >= 0):
            raise ValueError(f"kill_grace must be non-negative, got {kill_grace!r}")
        self._services = dict(services)
        self._env = dict(env)
        self._temp_dir = temp_dir
        self._budget: MemoryBudget[int] | None = (
            None if memory_budget is None else MemoryBudget(memory_budget)
        )
        self._instance_id = instance_id
        self._sample_interval = sample_interval
        self._kill_grace = kill_grace
        self._keys = itertools.count()
        self._running: dict[int, _Entry] = {}
        self._ssl_context: ssl.SSLContext | None = None
        for where, mapping in [("runner env", self._env)] + [
            (f"service {name!r} env", spec.env) for name, spec in self._services.items()
        ]:
            overridden = sorted(set(mapping) & set(SUPERVISED_ENV))
            if overridden:
                logger.warning(
                    "%s sets %s, which the runner always sets itself; ignored",
                    where,
                    ", ".join(overridden),
                )

    def statistics(self) -> RunnerStatistics:
        """A snapshot of the running jobs and the memory they use."""
        running = tuple(entry.snapshot() for entry in self._running.values())
        budget = self._budget
        return RunnerStatistics(
            running=running,
            memory_used=sum(job.rss or 0 for job in running),
            memory_budget=None if budget is None else budget.total,
        )

    async def run(self, request: JobRequest, control: JobControl) -> Receipt:
        """Run one job to its end and describe how it ended (see :class:`Runner`)."""
        start = _Start(
            started=trio.current_time(), started_at=time.time(), instance_id=self._instance_id
        )
        spec = self._services.get(request.service)
        if spec is None:
            return start.receipt("error", f"unknown service {request.service!r}")
        entry = _Entry(request=request, key=next(self._keys), started_at=start.started_at)
        self._running[entry.key] = entry
        try:
            return await self._run_job(entry, spec, control, start)
        finally:
            del self._running[entry.key]

    async def _run_job(
        self, entry: _Entry, spec: CommandSpec, control: JobControl, start: _Start
    ) -> Receipt:
        request = entry.request
        receipt = start.receipt
        if control.aborted:
            assert control.status is not None
            return receipt(control.status, control.reason)
        params = request.job.get("params", {})
        if not isinstance(params, Mapping):
            return receipt("error", "params must be an object")
        if spec.builtin is not None:
            return await self._run_builtin(spec.builtin, params, control, start)
        assert spec.argv is not None
        try:
            argv = fill_argv(spec.argv, params)
            pipes = _PipeUrls.from_job(request.job)
        except ParameterError as exc:
            return receipt("error", str(exc))
        try:
            workdir = tempfile.mkdtemp(prefix="trio-broker-job-", dir=self._temp_dir)
        except OSError as exc:
            return receipt("error", f"cannot create a work directory: {exc}")
        try:
            return await self._run_command(entry, spec, argv, workdir, control, start, pipes)
        except BaseExceptionGroup as group:
            # Our nurseries wrap the cancellation of the calling task in groups of
            # Cancelled; callers expect the plain Cancelled that trio.run_process raises.
            cancelled = _only_cancelled(group)
            if cancelled is None:
                raise
            raise cancelled from None
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(_CLEANUP_TIMEOUT):
                await trio.to_thread.run_sync(
                    partial(shutil.rmtree, workdir, ignore_errors=True), abandon_on_cancel=True
                )

    async def _run_builtin(
        self,
        builtin: Literal["noop", "sleep"],
        params: Mapping[str, Any],
        control: JobControl,
        start: _Start,
    ) -> Receipt:
        receipt = start.receipt
        if builtin == "noop":
            return receipt("ok")
        if "seconds" not in params:
            return receipt("error", "missing parameter 'seconds'")
        seconds = params["seconds"]
        if (
            not isinstance(seconds, int | float)
            or isinstance(seconds, bool)
            or not math.isfinite(seconds)
            or seconds < 0
        ):
            return receipt("error", "parameter 'seconds' must be a non-negative number")
        with trio.move_on_after(seconds):
            await control.wait_aborted()
        if control.status is not None:
            return receipt(control.status, control.reason)
        return receipt("ok")

    def _environment(self, spec: CommandSpec) -> dict[str, str]:
        env = {**os.environ, **self._env, **spec.env}
        env["FYLR_EXEC_SUPERVISED"] = "1"
        env["FYLR_CONVERT_THREADS"] = str(spec.threads)
        return env

    async def _pipe_client(self) -> httpx.AsyncClient:
        """A fresh HTTP client for one job's pipes (the TLS setup is made once, off-thread).

        It ignores proxy settings of the environment: a pipe is a direct call back
        to the client that placed the job, and a proxy might buffer whole bodies.
        """
        if self._ssl_context is None:
            self._ssl_context = await trio.to_thread.run_sync(httpx.create_ssl_context)
        return httpx.AsyncClient(verify=self._ssl_context, timeout=_PIPE_TIMEOUT, trust_env=False)

    async def _run_command(
        self,
        entry: _Entry,
        spec: CommandSpec,
        argv: tuple[str, ...],
        workdir: str,
        control: JobControl,
        start: _Start,
        pipes: _PipeUrls,
    ) -> Receipt:
        receipt = start.receipt
        async with contextlib.AsyncExitStack() as stack:
            http: httpx.AsyncClient | None = None
            if pipes.stdin_url is not None or pipes.stdout_url is not None:
                http = await stack.enter_async_context(await self._pipe_client())
            stdin_body: httpx.Response | None = None
            if pipes.stdin_url is not None:
                assert http is not None
                where = _listener(pipes.stdin_url)
                try:
                    stdin_body = await stack.enter_async_context(
                        http.stream("GET", pipes.stdin_url, timeout=_PIPE_TIMEOUT)
                    )
                except httpx.HTTPError as exc:
                    return receipt(
                        "error",
                        f"missing input: cannot read the in-pipe at {where}: {_describe(exc)}",
                    )
                if stdin_body.status_code != 200:
                    return receipt(
                        "error",
                        f"missing input: the in-pipe at {where} answered {stdin_body.status_code}",
                    )
            try:
                process = await trio.lowlevel.open_process(
                    argv,
                    start_new_session=True,
                    cwd=workdir,
                    env=self._environment(spec),
                    stdin=subprocess.DEVNULL if stdin_body is None else subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                )
            except OSError as exc:
                reason = exc.strerror or str(exc)
                return receipt("error", f"cannot run {argv[0]!r}: {reason}")
            except ValueError as exc:  # e.g. a NUL in the configured env
                return receipt("error", f"cannot run {argv[0]!r}: {exc}")
            if stdin_body is not None or pipes.stdout_url is not None:
                _widen_pipes(process)
            out_pipe = None
            if pipes.stdout_url is not None:
                assert http is not None
                out_pipe = _OutPipe(http, pipes.stdout_url)
            job = entry.job = _CommandJob(self, entry, spec, process, workdir, start, out_pipe)
            try:
                async with trio.open_nursery() as nursery:
                    if stdin_body is not None:
                        nursery.start_soon(job.pump_stdin, stdin_body)
                    nursery.start_soon(job.pump_stdout)
                    nursery.start_soon(job.pump_stderr)
                    ending = await job.supervise(control)
                    if ending is not None:
                        await job.terminate(self._kill_grace)
                    await job.kill_and_reap()
                    finish = spec.stall_timeout or _PIPE_FINISH_TIMEOUT
                    await job.wait_output_end(finish)
                    exit_code = process.returncode
                    assert exit_code is not None
                    status, error = _command_end(ending, exit_code)
                    if out_pipe is not None:
                        await job.finish_stdout(status == "ok", finish)
                    nursery.cancel_scope.cancel()
            finally:
                await job.close()
                if self._budget is not None:
                    self._budget.forget(job.key)
        if out_pipe is not None and out_pipe.aborted:
            error = f"{error}; the output stream was aborted after {out_pipe.sent} bytes"
        if status == "ok" and job.failure is not None:
            status, error = job.failure.status, job.failure.error
        return receipt(
            status,
            error,
            exit_code=exit_code,
            stderr_line=job.stderr_line.result(),
            stdout_prefix=job.stdout_prefix(),
            stdout_bytes=job.stdout_bytes,
            stdin_bytes=job.stdin_bytes,
            peak_memory=job.watchdog.peak_memory,
        )


def _command_end(ending: _Ending | None, exit_code: int) -> tuple[Status, str | None]:
    """A command's status and error from the runner's ending (if any) and its exit status."""
    if ending is not None:
        return ending.status, ending.error
    if exit_code == 0:
        return "ok", None
    if exit_code > 0:
        return "failed", f"exit status {exit_code}"
    return "failed", f"killed by signal {-exit_code}"


def _widen_pipes(process: trio.Process) -> None:
    """Ask for larger kernel buffers on a bulk job's pipes; keep the default if refused."""
    set_size = getattr(fcntl, "F_SETPIPE_SZ", None)
    if set_size is None:  # not Linux
        return
    for stream in (process.stdin, process.stdout):
        fileno = getattr(stream, "fileno", None)
        if fileno is not None:
            with contextlib.suppress(OSError):
                fcntl.fcntl(fileno(), set_size, _BULK_PIPE_BYTES)
