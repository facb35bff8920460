"""The execserver's end of a job's pipes: stdin from ``stdin_url``, stdout to ``stdout_url``.

A job object may carry ``stdin_url`` and ``stdout_url`` (``PROTOCOL.md``, *Pipes*),
one-time endpoints served by the client that placed the job (the client's end is
:mod:`trio_broker.trio.pipes`). The command runner (:mod:`trio_broker.trio.command`)
opens them here before it starts the command and pumps the bytes through them
while it runs. Every byte moves with back-pressure, so memory stays bounded
whatever the size:

* ``stdin_url``: its ``GET`` is sent before the command starts. An in-pipe that
  cannot be reached (connection refused or reset, a name that does not resolve,
  a failed TLS handshake, no answer within the connect timeout) or answers
  anything but 200 is :class:`PipeUnreachable`: nothing runs and the job ends
  ``stopped`` with a sentence naming the listener and the cause (``the in-pipe
  at http://h:p could not be reached (connection refused): …``). The callback
  base or the network to it failed, not the input, so the client runs it again
  later (``PROTOCOL.md``, Decision S36). Then each chunk of the body
  is written to the command's stdin, and its end closes stdin. A command that
  stops reading its stdin is not a failure (the rest is not read). A body that
  breaks off in mid-stream (an incomplete chunked body, a reset) is a
  :class:`PipeFault`: the command must not take a truncated input for a whole one,
  so stdin is left open and the job is ended ``stopped``.
* ``stdout_url``: stdout is held back until it outgrows
  :data:`~trio_broker.core.job.STDOUT_PREFIX_BYTES`; only then is a chunked ``PUT``
  opened, fed from the command's stdout as fast as the client takes it. The body
  gets its final chunk only once the command has ended ``ok``
  (:meth:`OutPipe.finish`); any other end (a non-zero exit, a signal, a verdict,
  an abort, stdout left open by a stray process) makes the body raise, so the
  connection drops without the final chunk and the client sees an incomplete
  body, never a silent truncation; the receipt's error then adds ``the output
  stream was aborted after N bytes``. Output that never outgrew the buffer is
  ``PUT`` in one piece after an ``ok`` end, and never sent after any other end
  (the receipt carries it in ``stdout_prefix``). A ``PUT`` that is refused or
  breaks while the command runs is a :class:`PipeFault` (the job ends
  ``stopped``); one that fails after an ``ok`` end turns the receipt ``stopped``
  too, since the output did not arrive. A client that takes nothing more is
  covered by the stall timeout while the command runs, and by the same timeout
  (:data:`PIPE_FINISH_TIMEOUT` when the service has none) for the last bytes once
  it has ended.
* **A silent pipe is not a stall of the command.** Each pipe records since when
  it waits on the network (:attr:`InPipe.network_since`: the next bytes of the
  in-pipe's body; :attr:`OutPipe.network_since`: a chunk handed to the ``PUT``
  not yet taken). When the stall watchdog rules that the job made no progress,
  the runner reports these waits (:func:`pipe_waits`) with the verdict, and the
  supervision core decides (:func:`trio_broker.core.supervision.verdict_ending`):
  a pipe that has waited on the network for the whole stall window is the
  reason (the network to the client, or the client, went silent; the command
  waited for it), and the job ends ``stopped`` with a sentence naming that
  stream and for how long it moved nothing, like any other broken stream,
  instead of ``stalled``.

Without an out-pipe stdout is still read to its end here (:class:`StdoutReader`):
it is counted, and its start kept for the receipt.

Errors name a pipe by its listener (``http://host:port``), never by its id: the
id is the pipe's credential.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
from collections.abc import AsyncIterator
from typing import Final

import attrs
import httpx
import trio

from trio_broker.core.job import STDOUT_PREFIX_BYTES, JobSpec, JobSpecError, stdout_prefix
from trio_broker.core.supervision import PipeWait

__all__ = [
    "PIPE_FINISH_TIMEOUT",
    "InPipe",
    "MissingInput",
    "OutPipe",
    "PipeConnector",
    "PipeFault",
    "PipeUnreachable",
    "PipeUrls",
    "StdoutReader",
    "open_pipes",
    "pipe_waits",
    "pump_stdout",
    "wait_stdout_end",
]

PIPE_FINISH_TIMEOUT: Final = 600.0
"""Seconds for the out-pipe's last bytes once the command has ended, for a
service without a stall timeout."""

_STDOUT_READ: Final = 256 * 1024
"""Largest stdout read: a quarter of the widened pipe, so a reader that keeps up
moves big blocks while each one in flight stays small."""
_PIPE_TIMEOUT: Final = httpx.Timeout(connect=10.0, read=None, write=None, pool=10.0)
"""Pipe transfers have no read or write timeout: a slow client is back-pressure,
and a client that takes nothing is the stall watchdog's business."""
_PIPE_MAX_BYTES: Final = 1 << 20
"""The most an OS pipe holds (Linux's default ``pipe-max-size``): more stdout
read after the process group died was written by a process outside it."""
_OUTPUT_DRAIN_TIMEOUT = 2.0
"""Seconds for stdout to reach its end once the group is dead, when nothing is
being sent (a stray process outside the group may hold it open)."""


class PipeUnreachable(Exception):
    """The in-pipe could not be opened; the text is the ``stopped`` receipt's error."""


MissingInput = PipeUnreachable
"""The former name of :class:`PipeUnreachable`."""

_CAUSES: Final[tuple[tuple[type[BaseException], str], ...]] = (
    (ssl.SSLError, "TLS failure"),
    (socket.gaierror, "DNS failure"),
    (ConnectionRefusedError, "connection refused"),
    (ConnectionResetError, "connection reset"),
    (httpx.TimeoutException, "timed out"),
    (TimeoutError, "timed out"),
)
"""What an in-pipe's connection failure is called, the first match of its chain."""


def _exceptions(exc: BaseException) -> list[BaseException]:
    """An exception, its causes and contexts, and the members of the groups among them."""
    found: list[BaseException] = []
    todo = [exc]
    while todo:
        current = todo.pop(0)
        if any(current is seen for seen in found):
            continue
        found.append(current)
        if isinstance(current, BaseExceptionGroup):
            todo.extend(current.exceptions)
        todo.extend(e for e in (current.__cause__, current.__context__) if e is not None)
    return found


def unreachable_cause(exc: BaseException) -> str:
    """The cause of a failed connection, as a receipt names it (``connection refused``…)."""
    chain = _exceptions(exc)
    for kind, cause in _CAUSES:
        if any(isinstance(e, kind) for e in chain):
            return cause
    return "no answer"


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _refusal(where: str, status: int) -> str:
    why = ": it is not the pipe's owner, or the owner gave the job up" if status == 404 else ""
    return f"the in-pipe at {where} answered {status}{why}"


def _listener(url: httpx.URL) -> str:
    """``scheme://host:port`` of a pipe URL: where it is, without its credential."""
    return f"{url.scheme}://{url.netloc.decode('ascii')}"


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


class PipeFault:
    """The first pipe failure of a job: it ends the job, or spoils an ``ok`` receipt.

    A job ended by a pipe failure is ``stopped`` (an operational interruption);
    :attr:`error` is the receipt's sentence.
    """

    def __init__(self) -> None:
        self.error: str | None = None
        """The first failure reported, ``None`` while there was none."""
        self._event = trio.Event()

    def report(self, error: str) -> None:
        """Record a failure; only the first one counts."""
        if self.error is None:
            self.error = error
            self._event.set()

    async def wait(self) -> str:
        """Return the first failure once one is reported."""
        await self._event.wait()
        assert self.error is not None
        return self.error


@attrs.frozen(kw_only=True)
class PipeUrls:
    """A job's pipe URLs as the HTTP client will use them."""

    stdin: httpx.URL | None
    stdout: httpx.URL | None

    @classmethod
    def of(cls, spec: JobSpec) -> PipeUrls:
        """The pipe URLs of a job object.

        Raises:
            JobSpecError: the HTTP client cannot use one (the same sentence as for
                a URL the job object refused).
        """
        return cls(
            stdin=_transport_url("stdin_url", spec.stdin_url),
            stdout=_transport_url("stdout_url", spec.stdout_url),
        )

    @property
    def any(self) -> bool:
        """Whether the job has a pipe at all."""
        return self.stdin is not None or self.stdout is not None


def _transport_url(name: str, url: str | None) -> httpx.URL | None:
    if url is None:
        return None
    try:
        return httpx.URL(url)
    except httpx.InvalidURL:
        raise JobSpecError(f"{name} must be an http or https URL") from None


class PipeConnector:
    """Makes the HTTP clients of the jobs' pipes; the TLS setup is made once, off-thread."""

    def __init__(self) -> None:
        self._ssl_context: ssl.SSLContext | None = None

    async def client(self) -> httpx.AsyncClient:
        """A fresh HTTP client for one job's pipes.

        It ignores proxy settings of the environment: a pipe is a direct call back
        to the client that placed the job, and a proxy might buffer whole bodies.
        """
        if self._ssl_context is None:
            self._ssl_context = await trio.to_thread.run_sync(httpx.create_ssl_context)
        return httpx.AsyncClient(verify=self._ssl_context, timeout=_PIPE_TIMEOUT, trust_env=False)


async def open_pipes(
    stack: contextlib.AsyncExitStack[bool | None], connector: PipeConnector, urls: PipeUrls
) -> tuple[InPipe | None, OutPipe | None]:
    """Open a job's pipes before its command starts: the in-pipe's ``GET`` is sent.

    Args:
        stack: closes the HTTP client and the in-pipe's response when the job is over.
        connector: makes the HTTP client.
        urls: the job's pipes.

    Returns:
        The in-pipe with its body on the way, and the out-pipe (opened later,
        once stdout outgrows the buffer); ``None`` for a pipe the job has not.

    Raises:
        PipeUnreachable: the in-pipe could not be reached, or refused.
    """
    if not urls.any:
        return None, None
    http = await stack.enter_async_context(await connector.client())
    in_pipe = None
    if urls.stdin is not None:
        where = _listener(urls.stdin)
        try:
            body = await stack.enter_async_context(
                http.stream("GET", urls.stdin, timeout=_PIPE_TIMEOUT)
            )
        except httpx.HTTPError as exc:
            raise PipeUnreachable(
                f"the in-pipe at {where} could not be reached ({unreachable_cause(exc)}):"
                f" {_describe(exc)}"
            ) from None
        if body.status_code != 200:
            raise PipeUnreachable(_refusal(where, body.status_code))
        in_pipe = InPipe(body, where)
    out_pipe = None if urls.stdout is None else OutPipe(http, urls.stdout)
    return in_pipe, out_pipe


# -- stdin ----------------------------------------------------------------------------


class InPipe:
    """The execserver's end of a job's ``stdin_url``: a response whose body is the input."""

    def __init__(self, body: httpx.Response, where: str) -> None:
        self._body = body
        self.where = where
        """The pipe's listener (``http://host:port``), for error sentences."""
        self.bytes = 0
        """Bytes written to the command's stdin."""
        self.network_since: float | None = None
        """Since when the pump waits for the body's next bytes; ``None`` while it does not."""

    async def pump(self, stdin: trio.abc.SendStream, fault: PipeFault) -> None:
        """Feed the body to the command's stdin; close stdin at its end (EOF).

        A body that breaks off leaves stdin open: an end of file would pass a
        truncated input for a whole one. The failure goes to ``fault`` instead.
        """
        chunks = self._body.aiter_bytes()
        try:
            while True:
                self.network_since = trio.current_time()
                try:
                    chunk = await anext(chunks)
                except StopAsyncIteration:
                    break
                except httpx.HTTPError as exc:
                    fault.report(
                        f"the input stream broke after {self.bytes} bytes: {_describe(exc)}"
                    )
                    return
                finally:
                    self.network_since = None
                try:
                    await stdin.send_all(chunk)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return  # the command stopped reading its stdin: not a failure
                self.bytes += len(chunk)
        finally:
            await _abandon(chunks)
        await stdin.aclose()


# -- stdout ---------------------------------------------------------------------------


class StdoutReader:
    """Reads a command's stdout: counts it, keeps its start for the receipt."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self.bytes = 0
        """Bytes read so far."""
        self._head = bytearray()
        self.eof = trio.Event()
        """Set when stdout reached its end."""
        self.waiting_since: float | None = None
        """Since when the reader waits on the pipe; ``None`` while it does not."""
        self.done = trio.Event()
        """Set when :func:`pump_stdout` is done (with an out-pipe: its ``PUT`` too)."""

    async def read(self) -> bytes:
        """The next chunk of stdout, counted and kept for the prefix; ``b""`` at its end."""
        self.waiting_since = trio.current_time()
        try:
            chunk = await self._stream.receive_some(_STDOUT_READ)
        finally:
            self.waiting_since = None
        if not chunk:
            self.eof.set()
            return b""
        self.bytes += len(chunk)
        room = STDOUT_PREFIX_BYTES + 1 - len(self._head)  # +1: see stdout_prefix
        if room > 0:
            self._head += chunk[:room]
        return chunk if isinstance(chunk, bytes) else bytes(chunk)

    def prefix(self) -> str:
        """The receipt's ``stdout_prefix``."""
        return stdout_prefix(bytes(self._head), total=self.bytes)


async def pump_stdout(reader: StdoutReader, out_pipe: OutPipe | None, fault: PipeFault) -> None:
    """Read stdout to its end, through the out-pipe when there is one.

    All of stdout is read and counted, even what a failed ``PUT`` left.
    """
    try:
        if out_pipe is not None:
            await out_pipe.pump(reader, fault)
        while await reader.read():
            pass
    finally:
        reader.done.set()


async def wait_stdout_end(reader: StdoutReader, out_pipe: OutPipe | None, within: float) -> None:
    """Wait (bounded) for stdout to reach its end once the process group is dead.

    A process outside the group (one that made its own session) may hold it
    open, so it gets :data:`_OUTPUT_DRAIN_TIMEOUT`. With an out-pipe, though, the
    last of stdout may still be on its way to a slow client: it is waited for, up
    to ``within``, while the reader is busy sending. It is given up on once the
    reader has waited that long on a silent pipe, or has read more than a pipe
    can hold since the group died (a stray process writes).

    Args:
        reader: the command's stdout.
        out_pipe: the job's out-pipe, if any.
        within: the bound on the wait for a slow client, in seconds.
    """
    if out_pipe is None:
        with trio.move_on_after(_OUTPUT_DRAIN_TIMEOUT):
            await reader.eof.wait()
        return
    limit = reader.bytes + _PIPE_MAX_BYTES
    with trio.move_on_after(within):
        while not reader.eof.is_set() and reader.bytes <= limit:
            now = trio.current_time()
            since = reader.waiting_since
            if since is not None and now - since >= _OUTPUT_DRAIN_TIMEOUT:
                return
            with trio.move_on_at((now if since is None else since) + _OUTPUT_DRAIN_TIMEOUT):
                await reader.eof.wait()


class _AbortStream(Exception):
    """Raised inside an out-pipe's body so that the ``PUT`` drops without its final chunk."""


class OutPipe:
    """The execserver's end of a job's ``stdout_url``."""

    def __init__(self, http: httpx.AsyncClient, url: httpx.URL) -> None:
        self._http = http
        self._url = url
        self.where = _listener(url)
        """The pipe's listener (``http://host:port``), for error sentences."""
        self.opened = False
        """Whether the streaming ``PUT`` was opened (stdout outgrew the buffer)."""
        self.aborted = False
        """Whether the streaming ``PUT`` was cut off."""
        self.sent = 0
        """Bytes of the body handed to the connection."""
        self.network_since: float | None = None
        """Since when a chunk handed to the ``PUT`` waits to be taken; ``None`` while none does."""
        self._settled = trio.Event()
        self._ok = False

    def settle(self, ok: bool) -> None:
        """Say how the command ended: ``ok`` completes the body, anything else aborts it."""
        if not self._settled.is_set():
            self._ok = ok
            self._settled.set()

    async def wait_settled(self) -> bool:
        """Return how the command ended (see :meth:`settle`), once it has."""
        await self._settled.wait()
        return self._ok

    async def pump(self, reader: StdoutReader, fault: PipeFault) -> None:
        """Hold stdout back until it outgrows the prefix, then stream it in a ``PUT``."""
        held = bytearray()
        while len(held) <= STDOUT_PREFIX_BYTES:
            chunk = await reader.read()
            if not chunk:  # the whole output fits: send it only after an ok end
                if await self.wait_settled():
                    await self._put(_StdoutBody(reader, self, bytes(held), streaming=False), fault)
                return
            held += chunk
        self.opened = True
        try:
            await self._put(_StdoutBody(reader, self, bytes(held), streaming=True), fault)
        except _AbortStream:
            self.aborted = True

    async def _put(self, body: _StdoutBody, fault: PipeFault) -> None:
        where = _listener(self._url)
        request = self._http.build_request(
            "PUT", self._url, headers=body.headers(), timeout=_PIPE_TIMEOUT
        )
        request.stream = body
        try:
            response = await self._http.send(request)
        except httpx.HTTPError as exc:
            problem = f"cannot write to the out-pipe at {where}: {_describe(exc)}"
        else:
            if response.is_success:
                return
            problem = f"the out-pipe at {where} answered {response.status_code}"
        finally:
            self.network_since = None
        fault.report(f"the output stream broke: {problem}")

    async def finish(self, reader: StdoutReader, fault: PipeFault, ok: bool, within: float) -> None:
        """Tell the out-pipe how the command ended; wait (bounded) for its last bytes.

        Args:
            reader: the command's stdout.
            fault: where a failure to deliver the output goes.
            ok: whether the command ended ok (the body gets its final chunk).
            within: seconds for the client to take what is still in flight.
        """
        eof = reader.eof.is_set()
        self.settle(ok and eof)
        if not eof:  # a stray process holds stdout open: the pump is cancelled
            if ok:
                fault.report(
                    "stdout stayed open after the command ended; the output stream was aborted"
                )
            return
        with trio.move_on_after(within) as scope:
            await reader.done.wait()
        if scope.cancelled_caught:
            fault.report(
                f"the output stream did not finish within {within:g}s after the command ended"
            )


class _StdoutBody(httpx.AsyncByteStream):
    """An out-pipe's ``PUT`` body: the held bytes, then (streaming) the rest of stdout.

    A streaming body is complete only when the command ended ok; otherwise its
    last step raises :class:`_AbortStream`, so the connection drops without the
    final chunk. A plain async iterator rather than an async generator: the HTTP
    client may stop iterating anywhere (a refused ``PUT``, a cancellation), and an
    abandoned generator would be finalized late, with a warning from trio.
    """

    def __init__(
        self, reader: StdoutReader, pipe: OutPipe, held: bytes, *, streaming: bool
    ) -> None:
        self._reader = reader
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
        pipe = self._pipe
        pipe.network_since = None  # the connection took the previous chunk
        chunk = self._held
        if chunk is not None:
            self._held = None
            if chunk:
                return self._handed(chunk)
        if self._streaming:
            chunk = await self._reader.read()
            if chunk:
                return self._handed(chunk)
            if not await self._pipe.wait_settled():
                raise _AbortStream
        raise StopAsyncIteration

    def _handed(self, chunk: bytes) -> bytes:
        pipe = self._pipe
        pipe.sent += len(chunk)
        pipe.network_since = trio.current_time()
        return chunk


def pipe_waits(in_pipe: InPipe | None, out_pipe: OutPipe | None) -> list[PipeWait]:
    """The job's pipes that wait on the network now, the input first (an observation).

    The in-pipe waits for the body's next bytes, the out-pipe for a chunk handed
    to its ``PUT`` to be taken; the supervision core decides whether a wait
    explains a stall (:func:`trio_broker.core.supervision.verdict_ending`).
    """
    waits = []
    if in_pipe is not None and in_pipe.network_since is not None:
        waits.append(
            PipeWait(
                stream="input",
                where=in_pipe.where,
                since=in_pipe.network_since,
                moved=in_pipe.bytes,
            )
        )
    if out_pipe is not None and out_pipe.network_since is not None:
        waits.append(
            PipeWait(
                stream="output",
                where=out_pipe.where,
                since=out_pipe.network_since,
                moved=out_pipe.sent,
            )
        )
    return waits
