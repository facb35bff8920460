"""What the two sans-IO cores share: their output queues and their timer heap."""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Generic, TypeVar

from trio_broker import protocol as p

__all__ = ["Outputs"]

E = TypeVar("E")
K = TypeVar("K", bound=str)


class Outputs(Generic[E, K]):
    """Frames and effects waiting to be drained, and timers waiting to fire.

    A core appends to ``_frames`` and ``_effects`` while it handles an input and
    pushes ``(when, kind, key)`` timers; its driver drains the first two after
    every input and calls ``tick(now)`` at :meth:`next_deadline`. Timers are lazy:
    a timer whose reason went away stays in the heap and does nothing when it
    fires, so pushing is the only bookkeeping.
    """

    def __init__(self) -> None:
        self._frames: list[tuple[int, p.Message]] = []
        self._effects: list[E] = []
        self._timers: list[tuple[float, int, K, Any]] = []
        self._timer_seq = itertools.count()

    def frames_to_send(self) -> list[tuple[int, p.Message]]:
        """Drain the frames to send, in order, as (connection, message) pairs."""
        frames, self._frames = self._frames, []
        return frames

    def effects(self) -> list[E]:
        """Drain the effects for the code around the core, in order."""
        effects, self._effects = self._effects, []
        return effects

    def next_deadline(self) -> float | None:
        """When ``tick`` is due next; None when no timer is pending."""
        return self._timers[0][0] if self._timers else None

    def _push_timer(self, when: float, kind: K, key: Any) -> None:
        heapq.heappush(self._timers, (when, next(self._timer_seq), kind, key))

    def _pop_due(self, now: float) -> tuple[K, Any] | None:
        """The earliest timer due at ``now`` (removed), or None."""
        timers = self._timers
        if timers and timers[0][0] <= now:
            _, _, kind, key = heapq.heappop(timers)
            return kind, key
        return None
