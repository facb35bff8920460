"""One-time pipes: the client's HTTP endpoints for a body-mode job's stdin and stdout.

Bulk bytes never ride the broker socket. The client that places a job serves
them on its own HTTP listener, and the execserver running the job calls back:

``GET /pipe/<id>``
    the execserver reads the job's stdin from an :class:`InPipe`: the body is
    the pipe's source, streamed chunk by chunk (chunked transfer encoding).
``PUT /pipe/<id>``
    the execserver streams the job's stdout into an :class:`OutPipe`: each
    chunk of the (chunked) request body is handed to the pipe's sink.
``GET /whoami``
    ``{"backend_id": …}``: the execserver's callback check (``PROTOCOL.md``).

Theory of operation:

* **The id is the credential.** Each pipe gets ``secrets.token_urlsafe(16)``
  (128 random bits, 22 characters). An unknown id, a used one, a closed one
  and one of the other direction (a ``PUT`` to an in-pipe) all get the same
  404 with the same body, so an answer reveals nothing about which it was.
* **Exactly once.** A request claims its pipe before its first ``await``: the
  pipe leaves the registry at once, so a second request, even a concurrent
  one, finds nothing (404). ``HEAD`` never claims.
* **Back-pressure end to end.** ``GET`` pulls the next chunk from the source
  only once the previous one went to the socket; ``PUT`` reads the next chunk of
  the request body only once the sink has taken the previous one, and the HTTP
  server stops reading the socket while its small per-request queue is full.
  Memory per pipe is a few chunks, whatever the size of the stream.
* **Incomplete is never silent.** Both directions are chunked: a body is
  complete only with its final empty chunk. A ``PUT`` whose sender went away
  before it (the execserver aborted the stream: the command failed, was killed,
  or the execserver stopped) ends the out-pipe :class:`PipeAborted`; the sink
  has then seen a prefix of the stream and nothing tells it the stream ended,
  so the owner learns the outcome from :meth:`Pipe.wait`. A ``GET`` whose source
  fails is cut off without its final chunk, so the execserver sees an
  incomplete body too.
* **Pipes expire with their job.** The owner calls :meth:`Pipe.close` when the
  job ends (a pipe is also a context manager); a closed pipe answers 404, and
  closing a pipe in the middle of a transfer cuts the transfer off. There is no
  time-based expiry here: the owner knows when its job ended.

The registry knows nothing about broker connections; a client builds a pipe's
URL from its own address on the broker connection to the execserver running
the job (``http://<local ip>:<listener port>`` + :attr:`Pipe.path`).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Final, Self, TypeAlias, cast

import attrs
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from trio_broker.core.endings import PipeState
from trio_broker.trio.listener import listener_config, serve_app

__all__ = [
    "InPipe",
    "OutPipe",
    "Pipe",
    "PipeAborted",
    "PipeClosed",
    "PipeError",
    "PipeRegistry",
    "PipeState",
    "PipeStatistics",
    "Sink",
    "serve_pipes",
]

log = logging.getLogger(__name__)

PIPE_ID_BYTES: Final = 16
"""Random bytes in a pipe id (128 bits; 22 URL-safe characters)."""

NOT_FOUND_BODY: Final = "not found\n"
"""The body of every 404 of the pipe endpoints, whatever the reason."""

_CLEANUP_TIMEOUT = 5.0  # closing a source after a transfer (shielded)

Sink: TypeAlias = Callable[[bytes], Awaitable[object]]
"""Where an out-pipe's bytes go: awaited once per chunk, in order.

The next chunk is read from the network only once the call returned, so a slow
sink slows the sender down. A trio ``SendStream``'s bound ``send_all`` is a sink.
If it raises, the transfer stops: the pipe ends :class:`PipeAborted` (with the
exception as its cause) and the sender gets a 500.
"""


class PipeError(Exception):
    """A pipe did not move its whole stream."""


class PipeAborted(PipeError):
    """The transfer started but did not complete (the other side went away, the
    source or the sink failed, or the pipe was closed in mid-transfer)."""


class PipeClosed(PipeError):
    """The pipe was closed before any request used it."""


class Pipe:
    """One one-time endpoint; made by :meth:`PipeRegistry.pipe_in` or :meth:`PipeRegistry.pipe_out`.

    Use it from the trio thread only.

    Attributes:
        id: the random id, the pipe's only credential.
        path: ``/pipe/<id>``, to append to the listener's base URL.
    """

    method: str = ""
    """The HTTP method that uses this pipe."""

    def __init__(self, registry: PipeRegistry, pipe_id: str) -> None:
        self.id = pipe_id
        self.path = f"/pipe/{pipe_id}"
        self._registry = registry
        self._state: PipeState = "open"
        self._bytes = 0
        self._reason: str | None = None
        self._cause: BaseException | None = None
        self._ended = trio.Event()
        self._scope: trio.CancelScope | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._state} {self._bytes} bytes>"  # never the id

    @property
    def state(self) -> PipeState:
        """Where the pipe stands (see :data:`PipeState`)."""
        return self._state

    @property
    def bytes(self) -> int:
        """Bytes moved so far (for an out-pipe: handed to the sink)."""
        return self._bytes

    def url(self, base: str) -> str:
        """The pipe's URL under a listener's base URL (``http://host:port``)."""
        return base.rstrip("/") + self.path

    def close(self) -> None:
        """End the pipe: later requests get 404; a transfer in progress is cut off.

        Idempotent. A pipe that already ended keeps its outcome.
        """
        self._registry._forget(self)
        if self._state == "open":
            self._end("closed", "the pipe was closed before it was used")
        elif self._state == "active":
            assert self._scope is not None
            self._scope.cancel()  # the handler ends the pipe "aborted"

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def wait(self) -> int:
        """Wait until the pipe has ended and tell how.

        Returns:
            The bytes moved, when the whole stream went through.

        Raises:
            PipeAborted: the transfer started but did not complete.
            PipeClosed: the pipe was closed before any request used it.
        """
        await self._ended.wait()
        return self.outcome()

    def outcome(self) -> int:
        """What :meth:`wait` returns or raises, for a pipe that has ended.

        Raises:
            RuntimeError: the pipe has not ended yet.
        """
        if self._state == "done":
            return self._bytes
        if self._state == "aborted":
            raise PipeAborted(self._reason) from self._cause
        if self._state == "closed":
            raise PipeClosed(self._reason)
        raise RuntimeError(f"the pipe is still {self._state}")

    # -- used by the handlers

    def _claim(self, scope: trio.CancelScope) -> None:
        self._state = "active"
        self._scope = scope

    def _end(
        self, state: PipeState, reason: str | None = None, cause: BaseException | None = None
    ) -> None:
        if self._ended.is_set():
            return
        self._state = state
        self._reason = reason
        self._cause = cause
        self._scope = None
        self._ended.set()
        self._registry._ended(self)


class InPipe(Pipe):
    """A job's stdin: ``GET`` streams the source (see :meth:`PipeRegistry.pipe_in`)."""

    method = "GET"

    def __init__(self, registry: PipeRegistry, pipe_id: str, source: AsyncIterable[bytes]) -> None:
        super().__init__(registry, pipe_id)
        self._source = source


class OutPipe(Pipe):
    """A job's stdout: ``PUT`` feeds the sink (see :meth:`PipeRegistry.pipe_out`)."""

    method = "PUT"

    def __init__(self, registry: PipeRegistry, pipe_id: str, sink: Sink) -> None:
        super().__init__(registry, pipe_id)
        self._sink = sink


@attrs.frozen(kw_only=True)
class PipeStatistics:
    """A snapshot of a :class:`PipeRegistry`."""

    open: int
    """Pipes waiting for their request."""
    active: int
    """Pipes being served now."""
    done: int
    """Pipes that moved their whole stream, since the registry was made."""
    aborted: int
    """Pipes whose transfer started but did not complete."""
    bytes_served: int
    """Bytes sent by in-pipes (jobs' stdin), finished transfers included."""
    bytes_received: int
    """Bytes handed to out-pipes' sinks (jobs' stdout), finished transfers included."""


class PipeRegistry:
    """The one-time pipes of one client process, and the HTTP routes that serve them.

    Args:
        backend_id: what ``GET /whoami`` answers (the client's ``REGISTER.backend_id``).
    """

    def __init__(self, backend_id: str) -> None:
        self.backend_id = backend_id
        self._pipes: dict[str, Pipe] = {}
        self._active: set[Pipe] = set()
        self._done = 0
        self._aborted = 0
        self._bytes_served = 0
        self._bytes_received = 0

    # -- making pipes

    def pipe_in(self, source: AsyncIterable[bytes]) -> InPipe:
        """A one-time ``GET`` endpoint whose body is ``source`` (a job's stdin).

        The source is iterated only when the execserver asks, one chunk per send,
        and closed (``aclose()``, when it has one) once the transfer ends. If it
        raises, the response is cut off without its final chunk (the job sees
        a broken input) and the pipe ends :class:`PipeAborted`.

        Args:
            source: the bytes, as an async iterable of chunks.

        Returns:
            The pipe; :meth:`Pipe.close` it when the job has ended.
        """
        pipe = InPipe(self, self._new_id(), source)
        self._pipes[pipe.id] = pipe
        return pipe

    def pipe_out(self, sink: Sink) -> OutPipe:
        """A one-time ``PUT`` endpoint whose body goes to ``sink`` (a job's stdout).

        Args:
            sink: awaited once per received chunk (see :data:`Sink`); e.g. a
                trio ``SendStream``'s ``send_all``.

        Returns:
            The pipe; :meth:`Pipe.close` it when the job has ended. Its
            :meth:`Pipe.wait` tells whether the sink saw the whole stream.
        """
        pipe = OutPipe(self, self._new_id(), sink)
        self._pipes[pipe.id] = pipe
        return pipe

    def _new_id(self) -> str:
        while True:
            pipe_id = secrets.token_urlsafe(PIPE_ID_BYTES)
            if pipe_id not in self._pipes:
                return pipe_id

    def close(self) -> None:
        """Close every pipe (the client is shutting down)."""
        for pipe in [*self._pipes.values(), *self._active]:
            pipe.close()

    def __len__(self) -> int:
        """The pipes that can still be requested or are being served."""
        return len(self._pipes) + len(self._active)

    def statistics(self) -> PipeStatistics:
        """Counts and bytes moved, as a snapshot."""
        active_in = sum(pipe.bytes for pipe in self._active if isinstance(pipe, InPipe))
        active_out = sum(pipe.bytes for pipe in self._active if isinstance(pipe, OutPipe))
        return PipeStatistics(
            open=len(self._pipes),
            active=len(self._active),
            done=self._done,
            aborted=self._aborted,
            bytes_served=self._bytes_served + active_in,
            bytes_received=self._bytes_received + active_out,
        )

    # -- bookkeeping (called by the pipes)

    def _claim(self, pipe_id: str, method: str, scope: trio.CancelScope) -> Pipe | None:
        pipe = self._pipes.get(pipe_id)
        if pipe is None or pipe.method != method:
            return None
        del self._pipes[pipe_id]
        self._active.add(pipe)
        pipe._claim(scope)
        return pipe

    def _forget(self, pipe: Pipe) -> None:
        if self._pipes.get(pipe.id) is pipe:
            del self._pipes[pipe.id]

    def _ended(self, pipe: Pipe) -> None:
        self._active.discard(pipe)
        if pipe.state == "done":
            self._done += 1
        elif pipe.state == "aborted":
            self._aborted += 1
        if isinstance(pipe, InPipe):
            self._bytes_served += pipe.bytes
        else:
            self._bytes_received += pipe.bytes

    # -- HTTP

    def routes(self) -> list[BaseRoute]:
        """The starlette routes: ``/pipe/{id}`` (``GET``, ``PUT``) and ``/whoami``.

        Mount them into any starlette app; :meth:`app` is an app with just these.
        """
        return [
            Route("/pipe/{pipe_id}", self._pipe_endpoint, methods=["GET", "PUT"]),
            Route("/whoami", self._whoami, methods=["GET"]),
        ]

    def app(self) -> Starlette:
        """A starlette app serving :meth:`routes` and nothing else."""
        return Starlette(routes=self.routes())

    async def _whoami(self, request: Request) -> Response:
        return JSONResponse({"backend_id": self.backend_id})

    async def _pipe_endpoint(self, request: Request) -> Response:
        method = request.method
        if method not in ("GET", "PUT"):  # HEAD: never claims a pipe
            return _not_found()
        scope = trio.CancelScope()
        pipe = self._claim(request.path_params["pipe_id"], method, scope)
        if pipe is None:
            return _not_found()
        if isinstance(pipe, InPipe):
            return _InPipeResponse(pipe, scope)
        assert isinstance(pipe, OutPipe)
        return await _receive_out_pipe(pipe, scope, request)


def _not_found() -> Response:
    return PlainTextResponse(NOT_FOUND_BODY, status_code=404)


class _InPipeResponse(StreamingResponse):
    """The body of an in-pipe: its source, chunk by chunk, cut off when anything fails.

    It watches for the execserver's disconnect while it streams (the server
    would otherwise take sends after a disconnect silently, and the source would
    be read to its end for nothing), and it returns without the final chunk when
    the transfer cannot complete, so that the server drops the connection.
    """

    def __init__(self, pipe: InPipe, scope: trio.CancelScope) -> None:
        super().__init__(
            pipe._source,
            media_type="application/octet-stream",
            headers={"cache-control": "no-store"},
        )
        self.pipe = pipe
        self.scope = scope

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pipe = self.pipe
        chunks = cast(AsyncIterator[bytes], aiter(self.body_iterator))
        outcome: list[tuple[PipeState, str | None, BaseException | None]] = []

        async def watch_disconnect(cancel: trio.CancelScope) -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not outcome:
                outcome.append(("aborted", f"the reader went away after {pipe.bytes} bytes", None))
            cancel.cancel()

        async def stream(cancel: trio.CancelScope) -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            try:
                async for chunk in chunks:
                    if chunk:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                        pipe._bytes += len(chunk)
            except Exception as exc:  # the source failed: cut the response off
                log.info("in-pipe source failed after %d bytes: %r", pipe.bytes, exc)
                outcome.append(
                    ("aborted", f"the source failed after {pipe.bytes} bytes: {exc!r}", exc)
                )
            else:
                # Every byte went out: what is left is the final chunk, whose send
                # itself reports the end of the request as a disconnect.
                outcome.append(("done", None, None))
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            cancel.cancel()

        try:
            with self.scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watch_disconnect, nursery.cancel_scope)
                    nursery.start_soon(stream, nursery.cancel_scope)
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(_CLEANUP_TIMEOUT):
                    await aclose()
            if not outcome:  # close() cut the transfer off, or the server is stopping
                outcome.append(("aborted", f"the pipe was closed after {pipe.bytes} bytes", None))
            pipe._end(*outcome[0])


async def _receive_out_pipe(pipe: OutPipe, scope: trio.CancelScope, request: Request) -> Response:
    """Hand each chunk of a ``PUT`` body to the pipe's sink; the pipe's outcome follows.

    It reads the ASGI messages itself rather than through ``request.stream()``:
    an async generator left suspended when the sink fails or the pipe is closed
    would be finalized late, with a warning from trio.
    """
    sink = pipe._sink
    try:
        with scope:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    pipe._end("aborted", f"the body ended incomplete after {pipe.bytes} bytes")
                    return Response(status_code=400)  # nobody reads it
                chunk = message.get("body", b"")
                if chunk:
                    try:
                        await sink(chunk)
                    except Exception as exc:
                        log.info("out-pipe sink failed after %d bytes: %r", pipe.bytes, exc)
                        reason = f"the sink failed after {pipe.bytes} bytes: {exc!r}"
                        pipe._end("aborted", reason, exc)
                        return PlainTextResponse("the receiver failed\n", status_code=500)
                    pipe._bytes += len(chunk)
                if not message.get("more_body", False):
                    pipe._end("done")
                    return Response(status_code=204)
        return _not_found()  # close() cut the transfer off
    finally:
        # the transfer was cut off: by close(), or the server is stopping
        pipe._end("aborted", f"the pipe was closed after {pipe.bytes} bytes")


async def serve_pipes(
    registry: PipeRegistry,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve a registry's pipes and ``/whoami`` on one HTTP listener until cancelled.

    Binds first, then reports the bound port through ``task_status.started()``
    (start it with ``port = await nursery.start(serve_pipes, registry)``). A daemon
    with its own starlette app mounts :meth:`PipeRegistry.routes` instead.

    Args:
        registry: the pipes to serve.
        host: the address to listen on (``"0.0.0.0"`` or ``"::"`` for every one).
        port: the port; 0 picks a free one.
    """
    shown = f"[{host}]" if ":" in host else host
    hyper = listener_config(f"{shown}:{port}", logger="trio_broker.trio.pipes.http")
    async with trio.open_nursery() as nursery:
        _, bound = await nursery.start(serve_app, registry.app(), hyper)
        task_status.started(bound)
