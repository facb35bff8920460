"""The broker websocket on wsproto, and the listener that hands its upgrades over.

The connection tests run two real wsproto connections over trio's in-memory
stream pair (one end wrapped to count its writes); the listener tests run a real
listener on 127.0.0.1 with real HTTP and websocket clients.
"""

from __future__ import annotations

import functools

import h11
import httpx
import pytest
import trio
import trio.testing
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from trio_websocket import ConnectionClosed, WebSocketConnection
from wsproto.connection import Connection, ConnectionType
from wsproto.events import Ping, Pong, TextMessage

from tests.support import wire
from tests.support.wire import WAIT
from trio_broker.core import protocol as p
from trio_broker.core.broker import Broker, BrokerConfig, Effect
from trio_broker.core.pool import PoolConfig
from trio_broker.trio.driver import CoreDriver
from trio_broker.trio.listener import WebsocketHandler, listener_config, serve_app
from trio_broker.trio.websocket import (
    HandshakeRefused,
    WebsocketConnection,
    accept,
    connect,
    refuse,
)

LIMIT = 1000


class CountingStream(trio.abc.Stream):
    """A stream that records each ``send_all`` it passes on (to see what left together)."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.writes: list[bytes] = []

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))
        await self.stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.stream.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.stream.aclose()


def pair() -> tuple[WebsocketConnection, WebsocketConnection, CountingStream]:
    """A server and a client connection past their handshake; the server's writes counted."""
    server_stream, client_stream = trio.testing.memory_stream_pair()
    counted = CountingStream(server_stream)
    server = WebsocketConnection(
        counted, Connection(ConnectionType.SERVER), max_message_bytes=LIMIT
    )
    client = WebsocketConnection(
        client_stream, Connection(ConnectionType.CLIENT), max_message_bytes=LIMIT
    )
    return server, client, counted


async def test_several_texts_leave_in_one_write_and_arrive_in_order() -> None:
    """send_texts frames every message and writes them with one send_all."""
    server, client, counted = pair()
    await server.send_texts(["one", "two", "three"])
    assert len(counted.writes) == 1
    with trio.fail_after(WAIT):
        assert [await client.receive() for _ in range(3)] == ["one", "two", "three"]


async def test_the_frames_of_one_read_leave_together_through_the_driver(
    nursery: trio.Nursery,
) -> None:
    """Three WANTs that arrive in one read get their OFFER and two QUEUEDs in one write: the
    driver's writer takes the whole outbox while the reader was busy."""
    config = BrokerConfig(
        instance_id="inst",
        name="exec",
        pool=PoolConfig(size=1, max_slots={"s": 0}, unknown_share=1.0),
    )
    core = Broker(config, now=trio.current_time())
    driver = CoreDriver[Effect](core, lambda effect: None, closed=core.close_connection)
    server, client, counted = pair()
    conn_id = core.open_connection("127.0.0.1:1", now=trio.current_time())
    nursery.start_soon(driver.serve, conn_id, server)
    with trio.fail_after(WAIT):
        assert isinstance(p.decode(await client.receive() or ""), p.Hello)
        counted.writes.clear()
        frames = [p.encode(p.Register(backend_id="b", name="b", version="1"))]
        frames += [p.encode(p.Want(job_id=f"j{n}", service="s", priority=0)) for n in range(3)]
        await client.send_texts(frames)
        answers = [p.decode(await client.receive() or "") for _ in range(3)]
    assert [type(m) for m in answers] == [p.Offer, p.Queued, p.Queued]
    assert len(counted.writes) == 1


async def test_a_ping_is_answered_and_fragments_are_joined() -> None:
    """A websocket Ping gets its Pong from the reader; a message sent in fragments comes out
    whole."""
    server_stream, client_stream = trio.testing.memory_stream_pair()
    server = WebsocketConnection(
        server_stream, Connection(ConnectionType.SERVER), max_message_bytes=LIMIT
    )
    raw = Connection(ConnectionType.CLIENT)
    data = raw.send(Ping(payload=b"are you there"))
    data += raw.send(TextMessage(data="hel", message_finished=False))
    data += raw.send(TextMessage(data="lo", message_finished=True))
    await client_stream.send_all(data)
    with trio.fail_after(WAIT):
        assert await server.receive() == "hello"
        raw.receive_data(bytes(await client_stream.receive_some()))
    assert list(raw.events()) == [Pong(payload=b"are you there")]


async def test_a_message_growing_past_the_limit_comes_out_early() -> None:
    """Fragments beyond max_message_bytes are not buffered on: the message comes out as soon
    as it is too big, so the driver closes the connection (1009)."""
    server_stream, client_stream = trio.testing.memory_stream_pair()
    server = WebsocketConnection(
        server_stream, Connection(ConnectionType.SERVER), max_message_bytes=LIMIT
    )
    raw = Connection(ConnectionType.CLIENT)
    for _ in range(3):
        await client_stream.send_all(raw.send(TextMessage(data="x" * 600, message_finished=False)))
    with trio.fail_after(WAIT):
        message = await server.receive()
    assert message == "x" * 1200


async def test_the_closing_handshake_both_ways() -> None:
    """close() sends the code and waits for the answer; the peer's receive() answers it and
    ends with None."""
    server, client, _ = pair()
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.close, 1001, "going away")
            assert await client.receive() is None
    with pytest.raises(trio.BrokenResourceError):
        await client.send_texts(["too late"])


# -- the listener ----------------------------------------------------------------------------


async def echo_route(stream: trio.abc.Stream, head: bytes, request: h11.Request) -> None:
    """A routed websocket: echoes text, and says which path it was upgraded on."""
    if request.target == b"/refused":
        await refuse(stream, head, 403, b"not here\n")
        return
    ws = await accept(stream, head, max_message_bytes=LIMIT)
    assert ws is not None
    await ws.send_texts([f"routed {request.target.decode()}"])
    while isinstance(text := await ws.receive(), str):
        await ws.send_texts([text])
    await ws.close(1000, "bye")


def pages() -> Starlette:
    async def hello(request: Request) -> Response:
        return PlainTextResponse("hello from the app")

    return Starlette(routes=[Route("/hello", hello)])


async def start_listener(nursery: trio.Nursery) -> str:
    routes: dict[str, WebsocketHandler] = {"/ws": echo_route, "/refused": echo_route}
    host, port = await nursery.start(
        functools.partial(serve_app, pages(), listener_config("127.0.0.1:0"), websockets=routes)
    )
    return f"{host}:{port}"


async def test_one_port_serves_pages_and_routed_upgrades(nursery: trio.Nursery) -> None:
    """Pages (on a kept-alive connection) go to the app; an upgrade to a routed path goes to
    its handler on the raw stream, with the bytes that came with the head."""
    address = await start_listener(nursery)
    async with httpx.AsyncClient(timeout=WAIT) as http:
        for _ in range(2):  # the second request rides the same connection
            answer = await http.get(f"http://{address}/hello")
            assert answer.text == "hello from the app"
        assert (await http.get(f"http://{address}/missing")).status_code == 404
    with trio.fail_after(WAIT):
        host, port = address.split(":")
        ws = await connect(
            await trio.open_tcp_stream(host, int(port)), address, "/ws?x=1", max_message_bytes=LIMIT
        )
        assert await ws.receive() == "routed /ws?x=1"
        await ws.send_texts(["ping"])
        assert await ws.receive() == "ping"
        await ws.close(1000, "done")


async def test_an_upgrade_to_another_path_goes_to_the_app(nursery: trio.Nursery) -> None:
    """A websocket to a path without a route reaches the ASGI app, which has none: 403 from
    the app's server, not the route."""
    address = await start_listener(nursery)
    host, port = address.split(":")
    with trio.fail_after(WAIT), pytest.raises(HandshakeRefused) as refused:
        await connect(
            await trio.open_tcp_stream(host, int(port)), address, "/other", max_message_bytes=LIMIT
        )
    assert refused.value.status == 403


async def test_a_route_may_refuse_with_an_http_answer(nursery: trio.Nursery) -> None:
    """refuse() answers the upgrade with a plain HTTP response the client sees as a status."""
    address = await start_listener(nursery)
    host, port = address.split(":")
    with trio.fail_after(WAIT), pytest.raises(HandshakeRefused) as refused:
        await connect(
            await trio.open_tcp_stream(host, int(port)),
            address,
            "/refused",
            max_message_bytes=LIMIT,
        )
    assert refused.value.status == 403


# -- raw frames from a real socket -----------------------------------------------------------


def masked_text_header(length: int) -> bytes:
    """A client's text-frame header (FIN, masked, a zero mask key) announcing ``length``."""
    if length <= 125:
        size = bytes([0x80 | length])
    elif length < 2**16:
        size = bytes([0x80 | 126]) + length.to_bytes(2, "big")
    else:
        size = bytes([0x80 | 127]) + length.to_bytes(8, "big")
    return bytes([0x81]) + size + b"\0\0\0\0"  # a zero mask key leaves the payload as it is


async def test_invalid_utf8_in_a_text_frame_is_bad_frame_and_the_connection_stays(
    nursery: trio.Nursery,
) -> None:
    """A text frame whose payload is not UTF-8 is answered ``ERROR bad_frame``, like
    any malformed frame, and the connection goes on (docs/PROTOCOL.md, section 2)."""
    handle = await wire.start_execserver(nursery)
    async with wire.connect(handle) as peer:
        payload = b'{"type": "PONG", "nonce": "\xff\xfe"}'
        await peer.ws._stream.send_all(masked_text_header(len(payload)) + payload)
        await peer.expect_error("bad_frame")
        await peer.send(p.Want(job_id="j1", service="noop", priority=0))
        assert isinstance(await peer.recv(), p.Offer | p.Queued)


async def test_a_header_announcing_an_oversize_frame_closes_with_1009(
    nursery: trio.Nursery,
) -> None:
    """A frame header announcing more than ``max_frame_bytes`` closes the connection with
    1009 at once, before any of its payload came."""
    handle = await wire.start_execserver(nursery)
    async with wire.connect(handle) as peer:
        await peer.ws._stream.send_all(masked_text_header(2**40))
        with trio.fail_after(WAIT):
            closed = await closed_by_server(peer.ws)
        assert closed.reason is not None
        assert closed.reason.code == 1009


async def closed_by_server(ws: WebSocketConnection) -> ConnectionClosed:
    """Read until the server closes; its close."""
    try:
        while True:
            await ws.get_message()
    except ConnectionClosed as exc:
        return exc
