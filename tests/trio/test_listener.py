"""The HTTP listener keeps serving whatever one connection does.

Each test runs a real listener (:func:`serve_app`) on 127.0.0.1, with and
without websocket routes, and real clients over TCP.
"""

from __future__ import annotations

import functools
import logging

import h11
import httpx
import pytest
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from tests.support.wire import WAIT
from trio_broker.trio.listener import WebsocketHandler, listener_config, serve_app

# Known defect (issue 23's chaos seed 1): hypercorn's reading task writes its 400 while the
# app's task closes the connection; trio refuses the concurrent write (BusyResourceError),
# hypercorn does not catch it there, and the listener stops. A fix that serialises a
# connection's writes and EOF and contains one connection's errors exists but was not
# merged yet (it unsettled the renditions' client-going-away test).
pytestmark = pytest.mark.xfail(
    strict=True, reason="a connection's error answer racing its close stops the listener"
)

ATTEMPTS = 200
"""Connections the race test opens: without the serialised stream the listener fell within
the first ten on this machine, every time."""

CLOSE_THEN_BYTES = (
    b"GET /hello HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n"
    b"bytes after a request that asked to close\r\n\r\n"
)
"""A complete request that asks to close, and bytes after it: hypercorn answers the request
from the app's task and answers the bytes with a 400 from its reading task, while one of the
two closes the connection (an EOF, then a close)."""


async def hello(request: Request) -> Response:
    return PlainTextResponse("hello")


async def broken_route(stream: trio.abc.Stream, head: bytes, request: h11.Request) -> None:
    raise RuntimeError("a handler's own failure")


async def start(nursery: trio.Nursery, *, routed: bool) -> tuple[str, int]:
    routes: dict[str, WebsocketHandler] | None = {"/broken": broken_route} if routed else None
    app = Starlette(routes=[Route("/hello", hello)])
    started: tuple[str, int] = await nursery.start(
        functools.partial(serve_app, app, listener_config("127.0.0.1:0"), websockets=routes)
    )
    return started


async def read_to_the_end(stream: trio.abc.Stream) -> bytes:
    answer = bytearray()
    try:
        while data := await stream.receive_some(65536):
            answer += data
    except trio.BrokenResourceError:
        pass  # reset after the 400: the server closed with our bytes unread
    return bytes(answer)


@pytest.mark.parametrize("routed", [False, True], ids=["plain", "routed"])
async def test_listener_error_answer_and_close_race(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture, routed: bool
) -> None:
    """Bytes after a ``Connection: close`` request make hypercorn write an error answer while
    the connection is being closed: the listener closes each such connection without an
    error and keeps serving (it used to stop on ``BusyResourceError``)."""
    host, port = await start(nursery, routed=routed)
    async with httpx.AsyncClient(timeout=WAIT) as http:
        with caplog.at_level(logging.WARNING), trio.fail_after(WAIT * 4):
            for _ in range(ATTEMPTS):
                stream = await trio.open_tcp_stream(host, port)
                await stream.send_all(CLOSE_THEN_BYTES)
                await stream.send_eof()
                await read_to_the_end(stream)  # whatever came before the close
                await stream.aclose()
        # the same listener still answers
        assert (await http.get(f"http://{host}:{port}/hello")).text == "hello"
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_a_failing_route_ends_its_connection_only(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """A websocket route whose handler raises ends that connection, logged with the peer's
    address; the listener keeps serving pages and other connections."""
    host, port = await start(nursery, routed=True)
    upgrade = (
        b"GET /broken HTTP/1.1\r\nHost: test\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    with caplog.at_level(logging.WARNING, logger="trio_broker.trio.listener"):
        with trio.fail_after(WAIT):
            stream = await trio.open_tcp_stream(host, port)
            local = stream.socket.getsockname()
            await stream.send_all(upgrade)
            assert await read_to_the_end(stream) == b""  # closed, unanswered
            await stream.aclose()
        async with httpx.AsyncClient(timeout=WAIT) as http:
            assert (await http.get(f"http://{host}:{port}/hello")).text == "hello"
    lines = [r.getMessage() for r in caplog.records if r.name == "trio_broker.trio.listener"]
    assert lines == [
        f"a connection from {local[0]}:{local[1]} ended with an error:"
        " RuntimeError: a handler's own failure"
    ]
