"""The broker websocket on a trio stream, framed by wsproto: both sides' transport.

Theory of operation
===================

Every frame of the protocol passes through here, so this module is as short a
path as wsproto (the framing library) allows: no task of its own, no queue.
The connection's reader (the driver's read loop) calls :meth:`WebsocketConnection.receive`,
which reads the stream and lets wsproto parse it; its writer calls
:meth:`WebsocketConnection.send_texts` with every frame that is waiting, and
they leave in **one** ``send_all``: the frames one core input produced (a
``DONE`` and the ``OFFER`` of the freed slot, a ``JOB`` and a ``DECLINE``) cost
one system call and one wake-up of the peer instead of one each.

The reader answers a websocket ``Ping`` and a peer's ``Close`` itself, through
the same send lock as the writer, so the two never interleave their bytes.

Handshakes: :func:`connect` upgrades a client stream (``GET`` with
``Upgrade: websocket``; any other answer is :class:`HandshakeRefused` with its
status). :func:`accept` finishes a server's upgrade on a stream whose request
head was already read by the listener (:mod:`trio_broker.trio.listener` routes
``GET /broker`` upgrades here and everything else to hypercorn); :func:`refuse`
answers such a request with a plain HTTP response instead.

No extension is offered or accepted (no compression): the frames are small
and the CPU is the limit.
"""

from __future__ import annotations

import codecs
import contextlib
from collections.abc import Sequence
from typing import Final

import h11
import trio
import wsproto
from wsproto.connection import Connection, ConnectionState, ConnectionType
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    RejectConnection,
    Request,
    TextMessage,
)
from wsproto.frame_protocol import Frame, MessageDecoder, Opcode
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

from trio_broker.trio.driver import FrameTooBig

__all__ = [
    "RECEIVE_BYTES",
    "HandshakeRefused",
    "WebsocketConnection",
    "accept",
    "connect",
    "refuse",
]

RECEIVE_BYTES: Final = 65536
"""The largest single read from the stream."""

_Stream = trio.abc.Stream


class HandshakeRefused(Exception):
    """The server answered the upgrade with something else than 101.

    Attributes:
        status: the HTTP status of the answer (0 when it was no HTTP at all).
    """

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class _TextKeepsBadBytes(MessageDecoder):
    """wsproto's message decoder, except that a text message's bytes that are not
    UTF-8 become lone surrogates (``surrogateescape``) instead of failing the whole
    websocket: the protocol answers such a frame with ``bad_frame`` (a lone surrogate
    is never UTF-8, docs/PROTOCOL.md) and the connection stays open."""

    def process_frame(self, frame: Frame) -> Frame:
        if frame.opcode is Opcode.TEXT and self.opcode is None:
            # open the message with a decoder of our own; the base class then treats
            # this first part like the continuation parts that follow it
            self.opcode = Opcode.TEXT
            self.decoder = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
            frame = Frame(
                Opcode.CONTINUATION, frame.payload, frame.frame_finished, frame.message_finished
            )
        return super().process_frame(frame)


class WebsocketConnection:
    """One open websocket: a driver :class:`~trio_broker.trio.driver.Transport`.

    Args:
        stream: the byte stream (TCP, or TLS over TCP).
        connection: wsproto's connection, past its handshake.
        max_message_bytes: a message that grows beyond this many bytes (text:
            characters) is returned as soon as it has, unfinished, so that the
            driver closes the connection (1009) without buffering the rest; a
            frame whose header announces more raises
            :class:`~trio_broker.trio.driver.FrameTooBig` before its payload came.

    A text frame that is not UTF-8 arrives with its bad bytes as lone surrogates
    (the protocol's ``bad_frame``) instead of closing the websocket.
    """

    __slots__ = ("_conn", "_limit", "_send_lock", "_stream")

    def __init__(self, stream: _Stream, connection: Connection, *, max_message_bytes: int) -> None:
        self._stream = stream
        self._conn = connection
        self._limit = max_message_bytes
        self._send_lock = trio.StrictFIFOLock()
        connection._proto._message_decoder = _TextKeepsBadBytes()

    @property
    def stream(self) -> _Stream:
        """The underlying byte stream."""
        return self._stream

    async def send_text(self, text: str) -> None:
        """Send one text message.

        Raises:
            trio.BrokenResourceError: the peer is gone or the websocket is closing.
        """
        await self.send_texts((text,))

    async def send_texts(self, texts: Sequence[str]) -> None:
        """Send text messages in order, in one write to the stream.

        Raises:
            trio.BrokenResourceError: the peer is gone or the websocket is closing.
        """
        conn = self._conn
        try:
            if len(texts) == 1:
                data = conn.send(TextMessage(data=texts[0]))
            else:
                data = b"".join([conn.send(TextMessage(data=text)) for text in texts])
        except LocalProtocolError as exc:  # a close was sent or received
            raise trio.BrokenResourceError("the websocket is closing") from exc
        await self._send(data)

    async def _send(self, data: bytes) -> None:
        try:
            async with self._send_lock:
                await self._stream.send_all(data)
        except (OSError, trio.ClosedResourceError) as exc:
            raise trio.BrokenResourceError("the peer is gone") from exc

    async def receive(self) -> str | bytes | None:
        """The next message, text or binary; ``None`` once the websocket is closed.

        A peer's ``Close`` is answered before ``None`` is returned; a websocket
        ``Ping`` is answered with its ``Pong`` on the way.
        """
        conn = self._conn
        parts: list[str] = []
        blobs: list[bytes] = []
        size = 0
        while True:
            for event in conn.events():
                if isinstance(event, TextMessage):
                    if event.message_finished and not parts:
                        return event.data
                    parts.append(event.data)
                    size += len(event.data)
                    if event.message_finished or size > self._limit:
                        return "".join(parts)
                elif isinstance(event, BytesMessage):
                    if event.message_finished and not blobs:
                        return bytes(event.data)
                    blobs.append(bytes(event.data))
                    size += len(event.data)
                    if event.message_finished or size > self._limit:
                        return b"".join(blobs)
                elif isinstance(event, Ping):
                    with contextlib.suppress(LocalProtocolError, trio.BrokenResourceError):
                        await self._send(conn.send(event.response()))
                elif isinstance(event, CloseConnection):
                    await self._answer_close(event)
                    return None
            self._check_announced()
            if not await self._feed():
                return None

    def _check_announced(self) -> None:
        """Raise FrameTooBig when the frame being read announces more than the limit."""
        header = self._conn._proto._frame_decoder.header
        if header is not None and header.payload_len > self._limit:
            raise FrameTooBig(header.payload_len)

    async def _feed(self) -> bool:
        """Read the stream once into wsproto; False at its end (or when it broke)."""
        try:
            data = await self._stream.receive_some(RECEIVE_BYTES)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        if not data:
            if self._conn.state is not ConnectionState.CLOSED:
                self._conn.receive_data(None)
            return False
        try:
            self._conn.receive_data(bytes(data))
        except LocalProtocolError:  # data after the close: ignored
            return False
        return True

    async def _answer_close(self, event: CloseConnection) -> None:
        if self._conn.state is ConnectionState.REMOTE_CLOSING:
            with contextlib.suppress(LocalProtocolError, trio.BrokenResourceError):
                await self._send(self._conn.send(event.response()))
        with contextlib.suppress(OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            await self._stream.aclose()

    def _closing(self) -> bool:
        return self._conn.state is ConnectionState.LOCAL_CLOSING

    async def close(self, code: int, reason: str) -> None:
        """Close with this code (the closing handshake), then the stream.

        Waits for the peer's answering ``Close`` (or the end of the stream);
        bound it with a cancel scope. Nothing happens once closed; a gone peer
        raises nothing.
        """
        conn = self._conn
        try:
            if conn.state is ConnectionState.OPEN:
                with contextlib.suppress(LocalProtocolError, trio.BrokenResourceError):
                    await self._send(conn.send(CloseConnection(code=code, reason=reason)))
                while self._closing():
                    if any(isinstance(e, CloseConnection) for e in conn.events()):
                        break
                    if not await self._feed():
                        break
            elif conn.state is ConnectionState.REMOTE_CLOSING:
                with contextlib.suppress(LocalProtocolError, trio.BrokenResourceError):
                    await self._send(conn.send(CloseConnection(code=code, reason=reason)))
        finally:
            with contextlib.suppress(OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                await self._stream.aclose()


# -- handshakes -----------------------------------------------------------------------------


async def connect(
    stream: _Stream,
    host: str,
    path: str,
    *,
    headers: Sequence[tuple[bytes, bytes]] = (),
    max_message_bytes: int,
) -> WebsocketConnection:
    """Upgrade a client stream to a websocket at ``path``.

    Args:
        stream: a connected stream (TLS already wrapped around it, if any).
        host: the ``Host`` header (``host`` or ``host:port``).
        path: the request target.
        headers: more request headers (``authorization``).
        max_message_bytes: see :class:`WebsocketConnection`.

    Raises:
        HandshakeRefused: the server answered anything but the upgrade (the
            stream is closed).
        OSError, trio.BrokenResourceError: the stream broke on the way.
    """
    try:
        return await _upgrade(stream, host, path, headers, max_message_bytes)
    except HandshakeRefused:
        await trio.aclose_forcefully(stream)
        raise


async def _upgrade(
    stream: _Stream,
    host: str,
    path: str,
    headers: Sequence[tuple[bytes, bytes]],
    max_message_bytes: int,
) -> WebsocketConnection:
    ws = wsproto.WSConnection(ConnectionType.CLIENT)
    await stream.send_all(ws.send(Request(host=host, target=path, extra_headers=list(headers))))
    while True:
        data = await stream.receive_some(RECEIVE_BYTES)
        if not data:
            raise HandshakeRefused("the server closed the connection during the upgrade", 0)
        try:
            ws.receive_data(bytes(data))
        except RemoteProtocolError as exc:
            raise HandshakeRefused(f"the server's answer is not HTTP: {exc}", 0) from None
        for event in ws.events():
            if isinstance(event, AcceptConnection):
                assert ws.connection is not None
                return WebsocketConnection(
                    stream, ws.connection, max_message_bytes=max_message_bytes
                )
            if isinstance(event, RejectConnection):
                raise HandshakeRefused(
                    f"the server refused the upgrade with {event.status_code}", event.status_code
                )


def _handshake(head: bytes) -> tuple[wsproto.WSConnection, Request]:
    ws = wsproto.WSConnection(ConnectionType.SERVER)
    ws.receive_data(head)
    for event in ws.events():
        if isinstance(event, Request):
            return ws, event
    raise RemoteProtocolError("no complete upgrade request", event_hint=RejectConnection())


async def accept(
    stream: _Stream, head: bytes, *, max_message_bytes: int
) -> WebsocketConnection | None:
    """Accept the upgrade request whose bytes (head and any later bytes) were read.

    Returns:
        The open websocket, or ``None`` when ``head`` is no valid upgrade
        request (it has then been answered 400 and the stream closed).
    """
    try:
        ws, _ = _handshake(head)
    except RemoteProtocolError:
        await refuse(stream, head, 400, b"not a websocket upgrade\n")
        return None
    try:
        await stream.send_all(ws.send(AcceptConnection()))
    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
        await trio.aclose_forcefully(stream)
        return None
    assert ws.connection is not None
    return WebsocketConnection(stream, ws.connection, max_message_bytes=max_message_bytes)


async def refuse(
    stream: _Stream,
    head: bytes,
    status: int,
    body: bytes,
    headers: Sequence[tuple[bytes, bytes]] = (),
) -> None:
    """Answer the request whose head was read with a plain-text response; close the stream."""
    http = h11.Connection(h11.SERVER)
    http.receive_data(head)
    try:
        http.next_event()  # the request: h11 answers only a request it has seen
        answer = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            *headers,
        ]
        data = http.send(h11.Response(status_code=status, headers=answer)) or b""
        data += http.send(h11.Data(data=body)) or b""
        data += http.send(h11.EndOfMessage()) or b""
        await stream.send_all(data)
    except (h11.ProtocolError, OSError, trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        await trio.aclose_forcefully(stream)
