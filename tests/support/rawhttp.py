"""Requests written by hand on one real connection: repeated headers, upgrades, keep-alive.

HTTP clients fold or refuse what these tests must send (two ``Authorization``
headers, a websocket upgrade as the second request of a kept-alive connection),
so :func:`exchange` writes each request head with h11 on one TCP connection
and returns each answer's status and body, in order.
"""

from __future__ import annotations

from collections.abc import Sequence

import h11
import trio

__all__ = ["UPGRADE", "exchange"]

UPGRADE: tuple[tuple[str, str], ...] = (
    ("connection", "Upgrade"),
    ("upgrade", "websocket"),
    ("sec-websocket-version", "13"),
    ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
)
"""The headers of a websocket upgrade request."""


async def exchange(
    host: str,
    port: int,
    requests: Sequence[tuple[str, str, Sequence[tuple[str, str]]]],
    *,
    within: float = 30.0,
) -> list[tuple[int, bytes]]:
    """Send ``(method, target, headers)`` requests one after the other on one connection.

    ``Host`` is added unless given. A request after an answer that closed the
    connection (or switched protocols) is not sent.

    Returns:
        ``(status, body)`` of each answer.
    """
    answers: list[tuple[int, bytes]] = []
    with trio.fail_after(within):
        stream = await trio.open_tcp_stream(host, port)
        async with stream:
            http = h11.Connection(h11.CLIENT)
            for method, target, headers in requests:
                if http.our_state is not h11.IDLE:
                    break
                given = [(name.lower(), value) for name, value in headers]
                if not any(name == "host" for name, _ in given):
                    given.insert(0, ("host", f"{host}:{port}"))
                await stream.send_all(
                    http.send(h11.Request(method=method, target=target, headers=given)) or b""
                )
                await stream.send_all(http.send(h11.EndOfMessage()) or b"")
                answers.append(await _answer(stream, http))
                if http.states != {h11.CLIENT: h11.DONE, h11.SERVER: h11.DONE}:
                    break
                http.start_next_cycle()
    return answers


async def _answer(stream: trio.SocketStream, http: h11.Connection) -> tuple[int, bytes]:
    status = 0
    body = b""
    while True:
        event = http.next_event()
        if event is h11.NEED_DATA:
            http.receive_data(await stream.receive_some(65536))
            continue
        if isinstance(event, h11.InformationalResponse):
            return event.status_code, b""  # 101: the websocket was accepted
        if isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            body += bytes(event.data)
        elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            return status, body
