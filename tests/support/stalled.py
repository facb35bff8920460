"""Peers that stop reading: real websockets that fill the other side's outbox.

Either side answers every ``PING`` with a ``PONG`` carrying the same nonce. A peer
whose socket receive buffer is small and whose websocket reader never hands a
message on (``message_queue_size=0``, nothing calls ``get_message``) stops taking
bytes after the first few ``PONG`` frames. :func:`flood_pings` first sends
``PING`` frames with big nonces, whose answers fill the socket buffers between the
two sides, then small ones, whose answers can only wait in the answering side's
outbox: more of them than :data:`~trio_broker.trio.driver.OUTBOX_FRAMES`.
"""

from __future__ import annotations

import socket

import trio
from trio_websocket import WebSocketConnection

from trio_broker.core import protocol as p
from trio_broker.trio.driver import OUTBOX_FRAMES

RECEIVE_BUFFER = 65536
"""SO_RCVBUF of a stalled peer's socket (the kernel doubles it)."""

BIG_NONCE_CHARS = 900_000
"""Under the default max_frame_bytes (1 MiB), so the frames are accepted."""

BIG_PINGS = 12
"""About 11 MB of answers: more than a socket send buffer (at most 4 MB here)
and the stalled peer's receive buffer together."""


def small_receive_buffer(sock: trio.socket.SocketType) -> None:
    """Shrink a socket's receive buffer; on a listener, its accepted sockets inherit it."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)


async def stalled_stream(host: str, port: int) -> trio.SocketStream:
    """A TCP connection whose small receive buffer is set before it connects."""
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
    small_receive_buffer(sock)
    await sock.connect((host, port))
    return trio.SocketStream(sock)


async def flood_pings(ws: WebSocketConnection, *, small: int = OUTBOX_FRAMES + 200) -> None:
    """Send big PINGs, then ``small`` small ones, without reading any answer."""
    for i in range(BIG_PINGS):
        await ws.send_message(p.encode(p.Ping(nonce=f"big-{i}-" + "x" * BIG_NONCE_CHARS)))
    for i in range(small):
        await ws.send_message(p.encode(p.Ping(nonce=f"small-{i}")))
