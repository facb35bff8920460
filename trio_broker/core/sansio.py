"""What the two sans-IO cores share: outputs, timers, time and liveness.

:class:`~trio_broker.core.broker.Broker` (the execserver side) and
:class:`~trio_broker.core.client.ClientCore` (the client side) are driven the
same way: inputs carry ``now``, which never goes backwards; frames and effects
pile up while an input is handled and are drained afterwards; timers sit in a
heap whose earliest live entry is :meth:`SansIOCore.next_deadline`, and ``tick``
fires the due ones. A side may cancel a timer whose reason went away
(:meth:`SansIOCore._cancel_timer` with the handle :meth:`SansIOCore._push_timer`
returned): it is never reported as a deadline, so the code that sleeps until the
next deadline wakes only for live timers. Cancelled entries leave the heap when
they reach its top, or all at once when they outnumber the live ones, so the
heap never holds more than about twice the live timers. A timer that is not
cancelled and whose reason went away does nothing when it fires.

Both sides also follow the same liveness rule (:class:`~trio_broker.core.liveness.Liveness`)
per connection; :meth:`SansIOCore._liveness_timer` applies it at the ``"ping"``
and ``"dead"`` timers and leaves only the closing to the side.

Stalls. A peer is judged by what it sent, not by when this process got round to
reading it. The code that sleeps until :meth:`SansIOCore.next_deadline` passes
that deadline to :meth:`SansIOCore.tick` as ``due``; a tick that comes
:data:`STALL_AFTER` or more after it shows that nothing of this process ran from
``due`` to ``now`` (it was stopped, SIGSTOP, or starved), so nothing that peers
sent meanwhile was read either. That span is a *stall*, and the ``"dead"`` rule
does not count stalled time as a peer's silence: after a stop the readers get to
what waits in the sockets before anyone is closed for silence. Ticks without
``due`` (tests that jump the clock) record no stall.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from typing import Any, ClassVar, Final, Generic, Literal, Protocol, TypeVar, cast

from trio_broker.core import protocol as p
from trio_broker.core.liveness import Liveness

__all__ = ["STALL_AFTER", "Peer", "SansIOCore"]

STALL_AFTER: Final = 1.0
"""A tick this many seconds or more after its ``due`` deadline reveals a stall."""

E = TypeVar("E")
K = TypeVar("K", bound=str)


class Peer(Protocol):
    """What the shared plumbing needs of a core's connection record."""

    id: int
    last_sent: float
    last_recv: float


class SansIOCore(ABC, Generic[E, K]):
    """Output queues, the timer heap, the clock check and liveness timers.

    Type parameters: ``E`` is the side's effect type, ``K`` its timer kinds (which
    include ``"ping"`` and ``"dead"``).
    """

    usage_error: ClassVar[type[Exception]] = RuntimeError
    """Raised when the driving code misuses the core (time going backwards)."""

    def __init__(self, *, now: float, liveness: Liveness) -> None:
        self._now = now
        self._liveness = liveness
        self._nonces = itertools.count(1)
        self._frames: list[tuple[int, p.Message]] = []
        self._effects: list[E] = []
        self._timers: list[tuple[float, int, K, Any]] = []
        self._timer_seq = itertools.count()
        self._cancelled: set[int] = set()  # handles of cancelled timers still in the heap
        # (start, end) of the stalls that may still matter to a liveness decision
        self._stalls: deque[tuple[float, float]] = deque()

    # -- outputs ---------------------------------------------------------------------

    def frames_to_send(self) -> list[tuple[int, p.Message]]:
        """Drain the frames to send, in order, as (connection, message) pairs."""
        frames, self._frames = self._frames, []
        return frames

    def effects(self) -> list[E]:
        """Drain the effects for the code around the core, in order."""
        effects, self._effects = self._effects, []
        return effects

    def next_deadline(self) -> float | None:
        """When :meth:`tick` is due next; None when no live timer is pending."""
        self._drop_cancelled()
        return self._timers[0][0] if self._timers else None

    # -- the timer input -----------------------------------------------------------------

    def tick(self, *, now: float, due: float | None = None) -> None:
        """Run every timer due at ``now``. Drain frames and effects afterwards.

        Args:
            now: the current time.
            due: the deadline the caller slept until (the :meth:`next_deadline` it
                was woken for), if it knows it. ``now`` at least :data:`STALL_AFTER`
                past it is a stall: time no peer's silence is counted for (see
                *Stalls* in the module docstring).
        """
        self._enter(now)
        if due is not None and now - due >= STALL_AFTER:
            self._stalled(due, now)
        while (timer := self._pop_due(now)) is not None:
            self._fire(*timer, now)
        self._leave()

    def _enter(self, now: float) -> None:
        """Before an input: take the time (sides add their own bookkeeping)."""
        self._advance(now)

    def _leave(self) -> None:
        """After an input: the side's follow-up work (grants, growth...)."""

    @abstractmethod
    def _fire(self, kind: K, key: Any, now: float) -> None:
        """Act on one due timer."""

    # -- plumbing for the sides ----------------------------------------------------------

    def _advance(self, now: float) -> None:
        """Take ``now`` as the current time; it must not go backwards."""
        if now < self._now:
            raise self.usage_error(f"time went backwards: {now} < {self._now}")
        self._now = now

    def _send(self, conn: Peer, message: p.Message) -> None:
        conn.last_sent = self._now
        self._frames.append((conn.id, message))

    def _push_timer(self, when: float, kind: K, key: Any) -> int:
        """Arm a timer; returns its handle for :meth:`_cancel_timer`. O(log timers)."""
        handle = next(self._timer_seq)
        heapq.heappush(self._timers, (when, handle, kind, key))
        return handle

    def _cancel_timer(self, handle: int) -> None:
        """Disarm a timer that has not fired yet (a fired or unknown handle: no-op).

        Amortised O(log timers): the entry stays in the heap until it reaches the
        top or the cancelled entries outnumber the live ones (then one rebuild).
        """
        cancelled = self._cancelled
        cancelled.add(handle)
        if len(cancelled) > 64 and 2 * len(cancelled) > len(self._timers):
            self._timers = [t for t in self._timers if t[1] not in cancelled]
            heapq.heapify(self._timers)
            cancelled.clear()

    def _drop_cancelled(self) -> None:
        timers, cancelled = self._timers, self._cancelled
        while timers and cancelled and timers[0][1] in cancelled:
            cancelled.discard(heapq.heappop(timers)[1])

    def _pop_due(self, now: float) -> tuple[K, Any] | None:
        """The earliest live timer due at ``now`` (removed), or None."""
        self._drop_cancelled()
        timers = self._timers
        if timers and timers[0][0] <= now:
            _, _, kind, key = heapq.heappop(timers)
            return kind, key
        return None

    def _stalled(self, start: float, end: float) -> None:
        """Record a stall, and forget those no live peer's silence can reach back to."""
        stalls = self._stalls
        stalls.append((start, end))
        # A peer still alive was heard within ping_timeout of listening time, so
        # within ping_timeout plus the stalled time kept of the current time.
        reach = self._liveness.ping_timeout + sum(e - s for s, e in stalls)
        while stalls and stalls[0][1] <= end - reach:
            stalls.popleft()

    def _stalled_since(self, since: float, now: float) -> float:
        """How much of ``[since, now]`` was stalled."""
        total = 0.0
        for start, end in self._stalls:
            overlap = min(end, now) - max(start, since)
            if overlap > 0:
                total += overlap
        return total

    def _watch(self, conn: Peer) -> None:
        """Start the liveness timers of a connection that just opened."""
        self._push_timer(self._now + self._liveness.ping_interval, cast(K, "ping"), conn.id)
        self._push_timer(self._now + self._liveness.ping_timeout, cast(K, "dead"), conn.id)

    def _liveness_timer(self, kind: Literal["ping", "dead"], conn: Peer, now: float) -> bool:
        """Apply the liveness rule at a timer; True when the peer is dead now.

        Sends the ``PING`` that is due and re-arms the timer; closing a dead
        connection is the caller's business.
        """
        if kind == "ping":
            send, due = self._liveness.ping(conn.last_sent, now)
            if send:
                self._send(conn, p.Ping(nonce=str(next(self._nonces))))
            self._push_timer(due, cast(K, "ping"), conn.id)
            return False
        heard = conn.last_recv
        if self._stalls:  # stalled time is not the peer's silence
            heard += self._stalled_since(heard, now)
        later = self._liveness.dead(heard, now)
        if later is None:
            return True
        self._push_timer(later, cast(K, "dead"), conn.id)
        return False
