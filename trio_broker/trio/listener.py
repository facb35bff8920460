"""One HTTP listener per process: an ASGI app on hypercorn's trio worker.

The execserver, the fylr and a library client's pipe endpoints all serve this
way; :func:`listener_config` holds the settings they share and :func:`serve_app`
runs the app and reports the address it bound.

Websocket routes
================

The broker websocket carries every frame of the protocol, and ASGI costs it
dearly: hypercorn hands each frame from its reading task to the application's
task and back through channels, and ASGI has no way to write several frames at
once. So :func:`serve_app` can take ``websockets``, a map from a path to a
handler that gets the **raw** stream of a websocket upgrade to that path.

Each accepted connection (TLS handshake done) is read up to the end of its first
request head, parsed by h11. A ``GET`` with ``Upgrade: websocket`` to a routed
path goes to its handler with the bytes read so far (the handler finishes the
upgrade with :func:`trio_broker.trio.websocket.accept`); every other connection
goes to hypercorn's own per-connection server, which is handed the same bytes
first, so it serves pages, keep-alive, HTTP/2 over TLS and the other websocket
paths exactly as without the routes. A connection that sends no complete
request head within ``keep_alive_timeout`` is closed, as hypercorn closes an
idle one.

This uses hypercorn's per-connection server (``hypercorn.trio.tcp_server``),
which is not part of its documented API; the tests of both paths pin the
behaviour. No ASGI lifespan runs on a routed listener: the apps that use routes
have no start-up or shut-down handlers.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, TypeAlias, cast

import attrs
import h11
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

__all__ = ["ListenerSettings", "WebsocketHandler", "listener_config", "serve_app"]

log = logging.getLogger("trio_broker.trio.listener")

WebsocketHandler: TypeAlias = Callable[[trio.abc.Stream, bytes, h11.Request], Awaitable[None]]
"""Serves one websocket upgrade: the stream, every byte read from it so far (the
request head and whatever followed it), and the parsed head. It owns the
stream: it answers the upgrade (or refuses it) and closes the stream."""

_HEAD_BYTES: Final = 16384
"""The largest request head a routed listener reads before it hands over."""


@attrs.frozen(kw_only=True)
class ListenerSettings:
    """Where a service listens, and with which TLS files.

    Attributes:
        listen: ``host:port`` (``[::1]:7000`` for IPv6; port 0 picks a free one).
        certfile, keyfile: PEM files; when set the listener serves https/wss.
    """

    listen: str = "127.0.0.1:0"
    certfile: str | None = None
    keyfile: str | None = None

    def __attrs_post_init__(self) -> None:
        if (self.certfile is None) != (self.keyfile is None):
            raise ValueError("certfile and keyfile go together: give both or neither")


def listener_config(listen: str, *, logger: str = "trio_broker.http") -> HypercornConfig:
    """Hypercorn settings for one listener on ``listen`` (``host:port``, port 0: any).

    No access log; hypercorn's own messages go to ``logger`` (our handlers, our
    level); a short graceful stop; idle keep-alive connections kept 75 s.
    """
    hyper = HypercornConfig()
    hyper.bind = [listen]
    hyper.accesslog = None
    hyper.errorlog = logging.getLogger(logger)
    hyper.graceful_timeout = 1.0
    hyper.keep_alive_timeout = 75.0
    return hyper


async def serve_app(
    app: object,
    hyper: HypercornConfig,
    *,
    shutdown_trigger: Callable[[], Awaitable[Any]] | None = None,
    websockets: Mapping[str, WebsocketHandler] | None = None,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` until cancelled or until ``shutdown_trigger`` returns.

    Binds first, then reports ``(host, port)`` through ``task_status.started()``
    (an IPv6 host without brackets).

    Args:
        app: the ASGI application.
        hyper: the hypercorn settings (:func:`listener_config`).
        shutdown_trigger: a graceful stop once it returns: no new connections,
            ``graceful_timeout`` for the open ones.
        websockets: upgrades to these paths go to their handler on the raw
            stream instead of to ``app`` (see the module's docstring).
    """
    if websockets:
        serve: Callable[..., Awaitable[Any]] = functools.partial(
            _serve_routed, app, hyper, websockets, shutdown_trigger
        )
    else:
        serve = functools.partial(
            hypercorn_serve, cast(Any, app), hyper, shutdown_trigger=shutdown_trigger
        )
    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(serve)
        host, _, port = binds[0].split("://", 1)[1].rpartition(":")
        task_status.started((host.strip("[]"), int(port)))


class _Replayed(trio.abc.Stream):
    """A stream whose first bytes are the ones already read from it (for hypercorn)."""

    def __init__(self, stream: trio.abc.Stream, head: bytes) -> None:
        self._stream = stream
        self._head = head

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        head = self._head
        if head:
            self._head = b""
            await trio.lowlevel.checkpoint()
            return head
        return await self._stream.receive_some(max_bytes)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await cast(Any, self._stream).send_eof()

    async def aclose(self) -> None:
        await self._stream.aclose()

    def __getattr__(self, name: str) -> Any:
        # socket, transport_stream, do_handshake, selected_alpn_protocol: what
        # hypercorn asks of a plain or a TLS stream (AttributeError tells them apart)
        return getattr(self._stream, name)


async def _read_head(stream: trio.abc.Stream) -> tuple[bytes, h11.Request | None]:
    """Read up to the end of the first request head; the bytes, and the head if parsed.

    ``None`` for a head that h11 cannot parse (HTTP/2, garbage), that is too
    long, or a stream that ends first: hypercorn answers those as it would.
    """
    parser = h11.Connection(h11.SERVER, max_incomplete_event_size=_HEAD_BYTES)
    read = bytearray()
    while True:
        try:
            event = parser.next_event()
        except h11.RemoteProtocolError:
            return bytes(read), None
        if isinstance(event, h11.Request):
            return bytes(read), event
        if event is not h11.NEED_DATA:
            return bytes(read), None
        try:
            data = await stream.receive_some(_HEAD_BYTES)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        if not data:
            return bytes(read), None
        read += data
        parser.receive_data(bytes(data))


def _websocket_target(request: h11.Request, websockets: Mapping[str, WebsocketHandler]) -> str:
    """The routed path a websocket upgrade asks for, or ``""``."""
    if request.method != b"GET":
        return ""
    path = request.target.split(b"?", 1)[0].decode("latin-1")
    if path not in websockets:
        return ""
    for name, value in request.headers:
        if name == b"upgrade" and value.lower() == b"websocket":
            return path
    return ""


async def _serve_routed(
    app: object,
    hyper: HypercornConfig,
    websockets: Mapping[str, WebsocketHandler],
    shutdown_trigger: Callable[[], Awaitable[Any]] | None,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """hypercorn's trio worker, with the websocket routes taken off before it."""
    from hypercorn.trio.tcp_server import TCPServer
    from hypercorn.trio.worker_context import WorkerContext
    from hypercorn.typing import ConnectionState
    from hypercorn.utils import repr_socket_addr, wrap_app

    wrapped = wrap_app(cast(Any, app), hyper.wsgi_max_body_size, "asgi")
    context = WorkerContext(None)
    sockets = hyper.create_sockets()
    ssl_context = hyper.create_ssl_context()
    listeners: list[trio.abc.Listener[Any]] = []
    binds: list[str] = []
    for sock in [*sockets.secure_sockets, *sockets.insecure_sockets]:
        sock.listen(hyper.backlog)
        listener: trio.abc.Listener[Any] = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
        secure = sock in sockets.secure_sockets
        if secure:
            assert ssl_context is not None
            listener = trio.SSLListener(listener, ssl_context, https_compatible=True)
        listeners.append(listener)
        bind = repr_socket_addr(sock.family, sock.getsockname())
        binds.append(f"{'https' if secure else 'http'}://{bind}")

    async def connection(stream: trio.abc.Stream) -> None:
        if isinstance(stream, trio.SSLStream):
            try:
                with trio.fail_after(hyper.ssl_handshake_timeout):
                    await stream.do_handshake()
            except (trio.BrokenResourceError, trio.TooSlowError):
                await trio.aclose_forcefully(stream)
                return
            if stream.selected_alpn_protocol() == "h2":
                await TCPServer(wrapped, hyper, context, ConnectionState({}), stream)
                return
        with trio.move_on_after(hyper.keep_alive_timeout) as waited:
            head, request = await _read_head(stream)
        if waited.cancelled_caught:
            await trio.aclose_forcefully(stream)
            return
        path = "" if request is None else _websocket_target(request, websockets)
        if path:
            assert request is not None
            await websockets[path](stream, head, request)
        else:
            replayed = cast(Any, _Replayed(stream, head))
            await TCPServer(wrapped, hyper, context, ConnectionState({}), replayed)

    async with trio.open_nursery() as handlers:
        task_status.started(binds)
        try:
            async with trio.open_nursery() as serving:
                serving.start_soon(
                    functools.partial(
                        trio.serve_listeners, connection, listeners, handler_nursery=handlers
                    )
                )
                if shutdown_trigger is None:
                    await trio.sleep_forever()
                await shutdown_trigger()
                serving.cancel_scope.cancel()  # no new connections
        finally:
            await context.terminated.set()  # hypercorn's servers close idle connections
            handlers.cancel_scope.deadline = trio.current_time() + hyper.graceful_timeout
