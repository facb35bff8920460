"""A remote file server for the fylr's remote sources: real HTTP/1.1 on a real socket.

:func:`serve_remote` answers each ``GET`` from a script (:class:`RemoteServer`):
per path, a list of :class:`Reply` values taken one per request (the last one
repeats), each an answer (a status, headers, a body), a redirect, or a fault:
``drop`` closes the connection before answering, ``cut`` sends the head and
half the body and closes, ``hang`` reads the request and never answers. Every
request is recorded (path, time, the ``Host`` header) so a test can say when
the fylr asked and how often. HTTP is :mod:`h11`'s (the library's dependency);
one request per connection (``Connection: close``), like a server that keeps
nothing alive.

The listener is the caller's (:func:`open_listener` on ``127.0.0.1`` or any
address; a network namespace's own listener works the same), so the tests can
put servers where the blocklist does or does not allow them.
"""

from __future__ import annotations

import email.utils
from collections.abc import Callable, Mapping, Sequence
from typing import Final, Literal

import attrs
import h11
import trio

__all__ = [
    "RemoteServer",
    "Reply",
    "RequestSeen",
    "answer",
    "http_date",
    "open_listener",
    "requests_of",
    "serve_remote",
]

MAX_HEAD: Final = 65536


@attrs.frozen(kw_only=True)
class Reply:
    """One scripted answer.

    Attributes:
        status: the status code (ignored for the faults).
        headers: extra headers.
        body: the body (``Content-Length`` is set).
        fault: ``drop``, ``cut`` or ``hang`` (see the module docstring), or ``None``.
    """

    status: int = 200
    headers: Mapping[str, str] = attrs.field(factory=dict)
    body: bytes = b""
    fault: Literal["drop", "cut", "hang"] | None = None


def answer(body: bytes, status: int = 200, **headers: str) -> Reply:
    """A plain answer; header names are written with ``_`` for ``-`` (``retry_after``)."""
    return Reply(
        status=status, body=body, headers={k.replace("_", "-"): v for k, v in headers.items()}
    )


def http_date(unix_time: float) -> str:
    """An HTTP date (what ``Retry-After`` may carry instead of seconds)."""
    return email.utils.formatdate(unix_time, usegmt=True)


@attrs.frozen
class RequestSeen:
    """One request the server read.

    Attributes:
        path: its target.
        at: ``trio.current_time()`` when its head was read.
        host: its ``Host`` header.
    """

    path: str
    at: float
    host: str


@attrs.define
class RemoteServer:
    """The script and what the server saw.

    Attributes:
        routes: path → replies, taken one per request (the last one repeats);
            a path with none answers 404.
        chooser: when set, picks the reply of every request instead (chaos: a
            seeded mix of faults and answers), given the path.
        requests: every request read, in order.
        connections: every connection accepted.
    """

    routes: dict[str, list[Reply]] = attrs.field(factory=dict)
    chooser: Callable[[str], Reply | None] | None = None
    requests: list[RequestSeen] = attrs.field(factory=list)
    connections: int = 0
    _seen: trio.Event = attrs.field(factory=trio.Event)

    def script(self, path: str, *replies: Reply) -> None:
        """Answer ``path`` with these replies, in turn (the last one repeats)."""
        self.routes[path] = list(replies)

    def seen(self, path: str) -> list[RequestSeen]:
        """The requests of one path."""
        return [r for r in self.requests if r.path == path]

    async def wait_requests(self, path: str, count: int) -> list[RequestSeen]:
        """Until ``path`` has been asked ``count`` times (bound it with ``fail_after``)."""
        while len(self.seen(path)) < count:
            await self._seen.wait()
        return self.seen(path)

    def _next(self, path: str) -> Reply:
        if self.chooser is not None:
            chosen = self.chooser(path)
            if chosen is not None:
                return chosen
        replies = self.routes.get(path)
        if not replies:
            return answer(b"not here\n", 404)
        return replies.pop(0) if len(replies) > 1 else replies[0]

    def _record(self, seen: RequestSeen) -> None:
        self.requests.append(seen)
        self._seen.set()
        self._seen = trio.Event()


async def open_listener(host: str = "127.0.0.1", port: int = 0) -> trio.SocketListener:
    """A TCP listener on ``host`` (any address of this machine: ``127.0.0.2`` is loopback too)."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    return listeners[0]


def _port(listener: trio.SocketListener) -> int:
    return int(listener.socket.getsockname()[1])


async def _read_request(stream: trio.SocketStream, conn: h11.Connection) -> h11.Request | None:
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await stream.receive_some(MAX_HEAD)
            conn.receive_data(data)
            if not data:
                return None
            continue
        if isinstance(event, h11.Request):
            return event
        if isinstance(event, h11.ConnectionClosed):
            return None


async def _send(stream: trio.SocketStream, conn: h11.Connection, reply: Reply) -> None:
    headers = [
        ("content-length", str(len(reply.body))),
        ("connection", "close"),
        *reply.headers.items(),
    ]
    head = conn.send(h11.Response(status_code=reply.status, headers=headers))
    assert head is not None
    if reply.fault == "cut":
        await stream.send_all(head + reply.body[: len(reply.body) // 2])
        return
    body = conn.send(h11.Data(data=reply.body)) if reply.body else b""
    end = conn.send(h11.EndOfMessage())
    await stream.send_all(head + (body or b"") + (end or b""))


async def _serve_one(stream: trio.SocketStream, server: RemoteServer) -> None:
    async with stream:
        conn = h11.Connection(h11.SERVER)
        try:
            request = await _read_request(stream, conn)
        except (h11.RemoteProtocolError, trio.BrokenResourceError):
            return
        if request is None:
            return
        path = request.target.decode("ascii", "replace")
        host = dict(request.headers).get(b"host", b"").decode("ascii", "replace")
        server._record(RequestSeen(path, trio.current_time(), host))
        reply = server._next(path)
        if reply.fault == "drop":
            return
        if reply.fault == "hang":
            await trio.sleep_forever()
        try:
            await _send(stream, conn, reply)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return


async def serve_remote(
    listener: trio.SocketListener,
    server: RemoteServer,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``server``'s script on ``listener`` until cancelled; started with the port."""
    async with listener, trio.open_nursery() as nursery:
        task_status.started(_port(listener))
        while True:
            stream = await listener.accept()
            server.connections += 1
            nursery.start_soon(_serve_one, stream, server)


def requests_of(server: RemoteServer, paths: Sequence[str]) -> int:
    """How many requests asked for any of ``paths``."""
    wanted = set(paths)
    return sum(1 for r in server.requests if r.path in wanted)
