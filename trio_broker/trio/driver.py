"""The connection driver: one sans-IO core, its connections and its timer, on trio.

Theory of operation
===================

Both sides of the protocol are a sans-IO core, the
:class:`~trio_broker.core.broker.Broker` on the execserver and the
:class:`~trio_broker.core.client.ClientCore` on the client, and both are driven by
the same glue, a :class:`CoreDriver`. It owns no policy: every decision is the
core's; the driver only moves frames, sleeps and wakes.

Inputs, then a flush
    Whatever feeds the core an input (a frame, a timer tick, a job's end, a dial's
    outcome, a caller's request) calls :meth:`CoreDriver.flush` right after it. The
    flush drains the core's frames into the outboxes of their connections, in the
    order the core decided them; then hands each effect to the side's ``apply``
    function; then wakes the timer task if the core's next deadline moved earlier;
    then wakes whoever waits in :meth:`CoreDriver.wait_until`. The flush never
    blocks: it runs inside other inputs.

One reader and one writer per connection
    :meth:`CoreDriver.serve` carries one connection: the reader feeds every frame
    the transport delivers into the core (a frame of more than ``max_frame_bytes``
    UTF-8 bytes closes the connection with 1009 instead), the writer sends what the
    outbox holds, in order: everything that is waiting when it wakes goes to
    :meth:`Transport.send_texts` at once, so the frames of one core input (a
    ``DONE`` and the ``OFFER`` of the freed slot) leave in one write where the
    transport can (:class:`~trio_broker.trio.websocket.WebsocketConnection`).
    When either of them ends, the connection ends: the core is told at once
    (the side's ``closed`` input, so its wants, offers and jobs are settled
    without waiting for the network), then the writer is stopped and the
    transport is closed with the code the core asked for (:meth:`CoreDriver.close`;
    1009 or 1008 when the driver ended it; the side's default otherwise), shielded
    and bounded by :data:`CLOSE_TIMEOUT`. Until that close is done the
    connection still counts in :attr:`CoreDriver.connections`, so "every connection
    closed" means every close went out.

A bounded outbox
    Each connection's outbox holds :data:`OUTBOX_FRAMES` frames. A peer that does not
    read fills it, and the frame that finds it full closes that connection with 1008
    instead of letting memory grow without end. Frames of the side's ``own_frames``
    types do not count: they come from the side's own callers, at most a few per job
    (the client's ``WANT``, ``UNWANT``, ``CANCEL`` and ``QUERY``), so a peer cannot make
    them pile up, while ten thousand callers may well queue ten thousand ``WANT``
    frames before the writer's turn.

One timer task
    :meth:`CoreDriver.run_timers` sleeps until the core's ``next_deadline()`` and then
    calls ``tick(now=trio.current_time())``, so a ``MockClock`` drives every timeout.
    An input that moves the deadline earlier wakes it to re-arm; any other input
    leaves it asleep, so an idle core costs nothing between its timers. Each tick
    carries the deadline it was due at: a tick that comes long after it tells the
    core that this process could not run (it was stopped), so that the peers'
    frames that wait unread in the sockets are not taken for silence.

The transport is anything with ``send_texts``, ``receive`` and ``close``
(:class:`Transport`): both sides' broker websockets are a
:class:`~trio_broker.trio.websocket.WebsocketConnection`; the execserver also
wraps an ASGI websocket (an upgrade that reached its app).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection, Sequence
from typing import Final, Generic, NoReturn, Protocol, TypeVar

import trio

from trio_broker.core import protocol as p

__all__ = [
    "CLOSE_TIMEOUT",
    "MAX_FRAME_BYTES",
    "OUTBOX_FRAMES",
    "ConnectionInput",
    "CoreDriver",
    "DrivenCore",
    "FrameTooBig",
    "Transport",
]

log = logging.getLogger("trio_broker.trio.driver")

E = TypeVar("E")

MAX_FRAME_BYTES: Final = 1_048_576
"""The protocol's default ``max_frame_bytes``."""

OUTBOX_FRAMES: Final = 4096
"""Frames queued for one connection before its peer counts as not reading (1008)."""

CLOSE_TIMEOUT: Final = 2.0
"""Seconds the close of one connection (its closing handshake) may take."""


class FrameTooBig(Exception):
    """What :meth:`Transport.receive` may raise for a frame announced (by its header)
    larger than the limit, before its payload came: the driver closes with 1009.

    Attributes:
        size: the announced size in bytes.
    """

    def __init__(self, size: int) -> None:
        super().__init__(f"a frame of {size} bytes was announced")
        self.size = size


class Transport(Protocol):
    """One websocket, as the driver needs it."""

    async def send_texts(self, texts: Sequence[str]) -> None:
        """Send text frames, in order (in one write where the transport can).

        Raises:
            trio.BrokenResourceError: the peer is gone.
        """
        ...

    async def receive(self) -> str | bytes | None:
        """The next frame, text or binary; ``None`` once the connection is closed.

        Raises:
            FrameTooBig: a frame's header announced more bytes than the limit.
        """
        ...

    async def close(self, code: int, reason: str) -> None:
        """Close with this code; nothing once closed. Never raises for a gone peer."""
        ...


class DrivenCore(Protocol[E]):
    """What the driver needs of a core (both sides' cores have it)."""

    def frames_to_send(self) -> list[tuple[int, p.Message]]: ...

    def effects(self) -> list[E]: ...

    def next_deadline(self) -> float | None: ...

    def tick(self, *, now: float, due: float | None = None) -> None: ...

    def receive_text(self, conn_id: int, text: str | bytes, *, now: float) -> None: ...


class ConnectionInput(Protocol):
    """A core input about one connection: ``Broker.close_connection`` and the like."""

    def __call__(self, conn_id: int, *, now: float) -> None: ...


class _Link:
    """One served connection: its outbox, how it ends, and the scope of its reader.

    The outbox is a plain list the writer takes whole; ``wake`` is set when a
    frame is queued (or the outbox closed) while the writer sleeps.
    """

    __slots__ = ("close_with", "closed", "counted", "outbox", "scope", "wake")

    def __init__(self) -> None:
        self.outbox: list[str] = []
        self.closed = False  # nothing more is queued; the writer ends once it is empty
        self.wake: trio.Event | None = None  # the writer sleeps on it
        self.scope = trio.CancelScope()
        self.close_with: tuple[int, str] | None = None
        self.counted = 0  # frames in the outbox that count against OUTBOX_FRAMES

    def put(self, text: str, *, counted: bool = True) -> bool:
        """Queue one frame; False when the outbox is full (of counted frames)."""
        if self.closed:
            return True  # closing: nothing more goes out
        if counted:
            if self.counted >= OUTBOX_FRAMES:
                return False
            self.counted += 1
        self.outbox.append(text)
        wake = self.wake
        if wake is not None:
            self.wake = None
            wake.set()
        return True

    def close(self) -> None:
        """The writer sends what is queued, then ends."""
        self.closed = True
        wake = self.wake
        if wake is not None:
            self.wake = None
            wake.set()


class CoreDriver(Generic[E]):
    """Feeds one core and carries its frames over any number of connections.

    Args:
        core: the sans-IO core.
        apply: carries out one effect of the core (start a job, dial, close a
            connection with :meth:`close`...). It must not feed the core.
        closed: the core's input for a connection that ended
            (``Broker.close_connection``, ``ClientCore.connection_closed``).
        max_frame_bytes: a larger incoming frame closes its connection (1009).
        own_frames: frame types that do not count against :data:`OUTBOX_FRAMES`
            (the side's callers bound them; see the module docstring).
        default_close: the close code and reason of a connection that ends
            without one asked for (its task was cancelled, or the peer is gone);
            None leaves such a transport to its server.
    """

    def __init__(
        self,
        core: DrivenCore[E],
        apply: Callable[[E], None],
        *,
        closed: ConnectionInput,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        own_frames: Collection[str] = (),
        default_close: tuple[int, str] | None = None,
    ) -> None:
        self.core = core
        self._apply = apply
        self._closed = closed
        self._max_frame_bytes = max_frame_bytes
        self._default_close = default_close
        self._own_frames = frozenset(own_frames)
        self._links: dict[int, _Link] = {}
        self._wake = trio.Event()
        self._armed = math.inf  # the deadline the timer task sleeps until
        self._changed: trio.Event | None = None  # made by a waiter, set by flush

    # -- after every input ---------------------------------------------------------------

    def flush(self) -> None:
        """Carry out what the core decided: frames, then effects, then the timer."""
        core = self.core
        links = self._links
        encode = p.encode
        own = self._own_frames
        last: p.Message | None = None
        text = ""
        for conn_id, message in core.frames_to_send():
            link = links.get(conn_id)
            if link is None:
                continue  # the connection already ended
            if message is not last:  # one value sent to many (a HELLO round): encoded once
                last, text = message, encode(message)
            if not link.put(text, counted=message.TYPE not in own):
                self._overflowed(conn_id, link)
        apply = self._apply
        for effect in core.effects():
            apply(effect)
        deadline = core.next_deadline()
        if deadline is not None and deadline < self._armed:
            self._wake.set()
        if self._changed is not None:  # only when someone waits: flush is the hot path
            self._notify()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def close(self, conn_id: int, code: int, reason: str) -> None:
        """Close a connection after the frames already queued for it.

        Unknown (already ended) connections are ignored. Frames queued for it
        after this are dropped.
        """
        link = self._links.get(conn_id)
        if link is not None:
            if link.close_with is None:
                link.close_with = (code, reason)
            link.close()  # the writer sends what is queued, then ends

    def _overflowed(self, conn_id: int, link: _Link) -> None:
        log.warning(
            "connection %d does not read its frames (%d queued): closing it",
            conn_id,
            OUTBOX_FRAMES,
        )
        link.close_with = (p.CLOSE_POLICY, "frames are not being read")
        link.close()
        link.scope.cancel()

    # -- waiting -----------------------------------------------------------------------------

    @property
    def connections(self) -> list[int]:
        """The connections being served, those still closing included."""
        return list(self._links)

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` holds.

        It is re-checked after every flush and whenever a connection has closed.
        """
        while not predicate():
            if self._changed is None:
                self._changed = trio.Event()
            await self._changed.wait()

    # -- tasks -------------------------------------------------------------------------------

    async def run_timers(self) -> NoReturn:
        """Tick the core at each of its deadlines; run it in the side's nursery."""
        while True:
            deadline = self.core.next_deadline()
            self._armed = math.inf if deadline is None else deadline
            with trio.move_on_at(self._armed):
                await self._wake.wait()
            self._wake = trio.Event()
            now = trio.current_time()
            if now >= self._armed:
                # _armed keeps the deadline just served while tick() and flush()
                # run: were it reset first, the flush would wake this task again
                # at once, and an idle core would spin.
                # due: a tick long after it shows this process could not run
                # (stopped or starved): the core does not count that as silence
                self.core.tick(now=now, due=self._armed)
                self.flush()
            # else: woken by an earlier deadline; sleep again until that one

    async def serve(self, conn_id: int, transport: Transport) -> None:
        """Carry one connection until it ends, then tell the core and close it.

        Call it right after the core input that opened ``conn_id``
        (``Broker.open_connection``, ``ClientCore.connected``) with no checkpoint
        in between: it attaches the connection's outbox, then flushes the frames
        that input queued (a flush finds no outbox for them before).

        Args:
            conn_id: the core's id of the connection.
            transport: the connection's websocket.
        """
        link = _Link()
        self._links[conn_id] = link
        try:
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._write, transport, link)
                    try:
                        self.flush()
                        with link.scope:
                            await self._read(conn_id, transport, link)
                    finally:
                        # The connection has ended. The core hears of it now, not
                        # once the writer is done: a transport may refuse to abandon
                        # a frame it has begun to send (hypercorn shields its socket
                        # writes), and a peer that reads nothing never lets it finish.
                        link.close()  # what the core still decides for it is dropped
                        self._closed(conn_id, now=trio.current_time())
                        self.flush()
                        nursery.cancel_scope.cancel()
            finally:
                close_with = link.close_with or self._default_close
                if close_with is not None:
                    with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT):
                        await transport.close(*close_with)
        finally:
            del self._links[conn_id]
            self._notify()

    async def _read(self, conn_id: int, transport: Transport, link: _Link) -> None:
        limit = self._max_frame_bytes
        while True:
            try:
                data = await transport.receive()
            except FrameTooBig as exc:
                data, size = None, exc.size
            else:
                if data is None:
                    return
                size = len(data) if isinstance(data, bytes) else _utf8_size(data, limit)
            if size > limit:
                log.info("connection %d sent a %d-byte frame: closing it", conn_id, size)
                if link.close_with is None:
                    link.close_with = (p.CLOSE_TOO_BIG, "frame too big")
                return
            assert data is not None
            # self.core is looked up on every frame, as on every tick: tests may
            # wrap the core's methods to count what it is fed.
            self.core.receive_text(conn_id, data, now=trio.current_time())
            self.flush()

    async def _write(self, transport: Transport, link: _Link) -> None:
        try:
            while True:
                batch = link.outbox
                if not batch:
                    if link.closed:
                        break
                    wake = link.wake = trio.Event()
                    await wake.wait()
                    continue
                link.outbox = []
                link.counted = 0
                await transport.send_texts(batch)
        except trio.BrokenResourceError:
            pass  # the peer is gone
        link.scope.cancel()  # closed (close() or overflow) or broken: the connection ends


def _utf8_size(text: str, limit: int) -> int:
    """The UTF-8 size of text, computed only when the character count can't decide."""
    if len(text) * 4 <= limit:
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))
