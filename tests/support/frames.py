"""A TCP relay that decodes the websocket frames it carries and counts them by type.

Tests that must show what travels on a broker connection (the idle traffic is
``PING``/``PONG`` alone, a subscription sends ``STATS`` only while it lasts)
put this relay between a real client and a real execserver: every byte is
forwarded unchanged, and a copy is parsed as RFC 6455 frames after the HTTP
upgrade (masked client frames included).
"""

from __future__ import annotations

import json
from collections import Counter

import attrs
import trio


@attrs.define
class FrameCount:
    """Websocket frames seen by the relay, by direction (``to exec``, ``to client``) and type."""

    counts: Counter[tuple[str, str]] = attrs.field(factory=Counter)
    changed: trio.Event = attrs.field(factory=trio.Event)

    def feed(self, direction: str, buffer: bytearray, upgraded: list[bool]) -> None:
        """Count every whole frame in ``buffer`` (consumed), after the HTTP upgrade."""
        if not upgraded[0]:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            del buffer[: end + 4]
            upgraded[0] = True
        while len(buffer) >= 2:
            opcode, masked, length, pos = buffer[0] & 0x0F, buffer[1] & 0x80, buffer[1] & 0x7F, 2
            if length == 126:
                if len(buffer) < 4:
                    return
                length, pos = int.from_bytes(buffer[2:4], "big"), 4
            elif length == 127:
                if len(buffer) < 10:
                    return
                length, pos = int.from_bytes(buffer[2:10], "big"), 10
            mask = b""
            if masked:
                mask, pos = bytes(buffer[pos : pos + 4]), pos + 4
            if len(buffer) < pos + length:
                return
            payload = bytes(buffer[pos : pos + length])
            del buffer[: pos + length]
            if mask:
                payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
            kind = json.loads(payload)["type"] if opcode == 1 else f"opcode {opcode}"
            self.counts[direction, kind] += 1
            self.changed.set()
            self.changed = trio.Event()

    def kinds(self) -> set[str]:
        """Every message type seen so far, in either direction."""
        return {kind for _, kind in self.counts}

    async def wait_for(self, direction: str, kind: str, count: int = 1) -> None:
        """Return once ``count`` frames of ``kind`` went ``direction`` (bound it yourself)."""
        while self.counts[direction, kind] < count:
            await self.changed.wait()


async def serve_counting_relay(
    host: str, port: int, count: FrameCount, *, task_status: trio.TaskStatus[int]
) -> None:
    """Relay 127.0.0.1:<free port> to ``host:port``, counting frames; started with the port."""

    async def pump(
        src: trio.SocketStream, dst: trio.SocketStream, direction: str, done: trio.CancelScope
    ) -> None:
        buffer, upgraded = bytearray(), [False]
        try:
            async for chunk in src:
                await dst.send_all(chunk)
                buffer += chunk
                count.feed(direction, buffer, upgraded)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        done.cancel()

    async def handle(downstream: trio.SocketStream) -> None:
        upstream = await trio.open_tcp_stream(host, port)
        async with downstream, upstream, trio.open_nursery() as nursery:
            nursery.start_soon(pump, downstream, upstream, "to exec", nursery.cancel_scope)
            nursery.start_soon(pump, upstream, downstream, "to client", nursery.cancel_scope)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handle, listeners)
