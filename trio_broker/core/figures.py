"""Execserver figures: what a ``STATS`` frame counts, when it is sent, and queue positions.

Rules
=====

This module holds the bookkeeping behind the ``SUBSCRIBE``/``STATS`` extension
of the protocol (PROTOCOL.md, section 21) and the arithmetic a client uses to
tell a user where a job stands. Like the rest of the core it has no clock of its
own: every method that depends on time takes ``now``.

Job figures (:class:`JobFigures`, on the execserver)
    Every job end is counted once: ``finished`` when its receipt says ``ok``,
    ``failed`` otherwise (every other status: the two never overlap). The bytes
    moved are the receipts' ``stdin_bytes`` (``bytes_in``) and ``stdout_bytes``
    (``bytes_out``). The throughput ``per_minute`` is the number of jobs that
    ended during the last 60 seconds, counted per whole second of the caller's
    clock: a job that ended at ``t`` counts while ``floor(now) < floor(t) + 60``.
    So the figure changes only at whole seconds (and the once-a-second look of a
    subscription notices when it falls).

Subscriptions (:class:`Subscriptions`, on the execserver)
    A connection that sent ``SUBSCRIBE`` gets one ``STATS`` frame at once, then is
    looked at once every :data:`STATS_INTERVAL` seconds (one timer per subscribed
    connection) and sent a new frame only when what it would be told differs from
    what it was told last. So a subscriber gets at most one frame a second, a
    change is reported within a second, figures that stand still cost no frame,
    and a connection that never subscribed costs nothing at all: the idle traffic
    of the protocol stays ``PING``/``PONG``. ``UNSUBSCRIBE`` and a closed
    connection end the subscription; a timer left from an earlier subscription
    of the same connection is recognised by its generation and does nothing.

Queue positions (:func:`queue_position`, on the client)
    A job's position merges two books: the execservers' (the wants parked
    there, from every client) and the queue's (the rows a dispatcher holds or
    would claim first: priority descending, then id). Ahead of the job are
    the wants ahead of it at the execserver with the fewest (a job parked at
    execservers takes their ``POSITION`` answers, ``ahead`` by the grant rule;
    a job not parked anywhere yet takes, from each execserver's ``STATS``,
    every want waiting there at its priority or above), or, when more, the
    claimed rows ahead of it that hold no slot (claimed rows ahead less the busy
    slots: a dispatcher may hold claimed rows it has not offered yet, which no
    execserver sees); and on top the unclaimed rows ahead of it. ``position``
    is 1 + everything ahead: the hard number. ``waiting`` counts the same way
    over everything waiting (so it is never below ``position``), ``running``
    and ``capacity`` add up over the execservers that answered. ``eta_s`` is
    only a hint: the slot releases the job waits for (everything ahead and
    itself, less the free slots) at ``capacity`` slots of the service's mean
    runtime each, then one run: ``mean × (max(0, ahead + 1 - free) / capacity
    + 1)`` (null while the mean was never measured).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Final

import attrs

from trio_broker.core import protocol as p

__all__ = [
    "STATS_INTERVAL",
    "THROUGHPUT_WINDOW",
    "Answer",
    "JobFigures",
    "QueuePosition",
    "Subscriptions",
    "answer_from_position",
    "answer_from_stats",
    "queue_position",
    "service_figures",
]

STATS_INTERVAL: Final = 1.0
"""A subscribed connection is told of changed figures at most this often (seconds)."""

THROUGHPUT_WINDOW: Final = 60
"""The throughput counts the jobs that ended within this many whole seconds."""


class JobFigures:
    """Counts of ended jobs, the bytes they moved, and the throughput of the last minute."""

    __slots__ = ("_seconds", "bytes_in", "bytes_out", "failed", "finished")

    def __init__(self) -> None:
        self.finished = 0
        self.failed = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self._seconds: deque[list[int]] = deque()  # [second, ends], oldest first

    def __repr__(self) -> str:
        return (
            f"JobFigures(finished={self.finished!r}, failed={self.failed!r}, "
            f"bytes_in={self.bytes_in!r}, bytes_out={self.bytes_out!r})"
        )

    def record(self, receipt: p.Receipt, *, now: float) -> None:
        """Count one job's end at ``now``."""
        if receipt.status == "ok":
            self.finished += 1
        else:
            self.failed += 1
        self.bytes_in += receipt.stdin_bytes
        self.bytes_out += receipt.stdout_bytes
        second = math.floor(now)
        seconds = self._seconds
        if seconds and seconds[-1][0] == second:
            seconds[-1][1] += 1
        else:
            seconds.append([second, 1])
        self._expire(second)

    def per_minute(self, *, now: float) -> int:
        """Jobs that ended within the last :data:`THROUGHPUT_WINDOW` whole seconds."""
        self._expire(math.floor(now))
        return sum(ends for _, ends in self._seconds)

    def _expire(self, second: int) -> None:
        seconds = self._seconds
        while seconds and seconds[0][0] <= second - THROUGHPUT_WINDOW:
            seconds.popleft()


class _Subscriber:
    __slots__ = ("generation", "told")

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.told: p.Stats | None = None


class Subscriptions:
    """Which connections subscribed, what each was told, and their timers' generations.

    The owner (the broker) sends the frames and pushes the timers; this class
    only remembers. Connections are any hashable ids.
    """

    __slots__ = ("_generations", "_subscribers")

    def __init__(self) -> None:
        self._subscribers: dict[int, _Subscriber] = {}
        self._generations = 0

    def __bool__(self) -> bool:
        return bool(self._subscribers)

    def __len__(self) -> int:
        return len(self._subscribers)

    def __iter__(self) -> Iterator[int]:
        return iter(self._subscribers)

    def __contains__(self, conn: object) -> bool:
        return conn in self._subscribers

    def add(self, conn: int) -> int | None:
        """Subscribe ``conn``; returns its timer generation, None when it already was."""
        if conn in self._subscribers:
            return None
        self._generations += 1
        self._subscribers[conn] = _Subscriber(self._generations)
        return self._generations

    def discard(self, conn: int) -> None:
        """End ``conn``'s subscription (unknown connections are ignored)."""
        self._subscribers.pop(conn, None)

    def current(self, conn: int, generation: int) -> bool:
        """Whether a timer of this generation belongs to ``conn``'s live subscription."""
        subscriber = self._subscribers.get(conn)
        return subscriber is not None and subscriber.generation == generation

    def changed(self, conn: int, stats: p.Stats) -> bool:
        """Whether ``stats`` differs from what ``conn`` was told; if so it counts as told."""
        subscriber = self._subscribers[conn]
        if subscriber.told == stats:
            return False
        subscriber.told = stats
        return True


# -- queue positions -------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Answer:
    """What one execserver says about a job (one ``POSITION``, or figures from ``STATS``).

    Attributes:
        instance_id: the execserver.
        running: its busy slots.
        waiting: wants parked there (null when unknown: no ``STATS`` came).
        ahead: wants that would be served before the job.
        capacity: the slots the job's service could hold there.
        mean_s: the service's mean runtime there (null: never measured).
    """

    instance_id: str
    running: int
    waiting: int | None
    ahead: int
    capacity: int
    mean_s: float | None


@attrs.frozen(kw_only=True)
class QueuePosition:
    """Where a job stands (``3 running, 7 waiting, you are number 5, roughly 4 minutes``).

    Attributes:
        running: busy slots at the execservers that answered.
        waiting: everything waiting for a slot: the wants the execservers know
            (or the claimed rows that hold no slot, when more) and the unclaimed
            rows; never below ``position``.
        position: 1 + the wants and rows ahead of the job (the hard number).
        capacity: the slots the job's service can hold at the execservers that
            answered.
        eta_s: a rough hint of the time until the job ends, in seconds; null
            when it cannot be told.
        instance_id: the execserver of the best answer.
        rows_ahead: unclaimed queue rows counted in ``position``.
        held_ahead: claimed rows ahead of the job that hold no slot; counted in
            ``position`` when more than the execserver's wants ahead.
    """

    running: int
    waiting: int | None
    position: int
    capacity: int
    eta_s: float | None
    instance_id: str
    rows_ahead: int
    held_ahead: int = 0


def answer_from_position(
    instance_id: str, answer: p.Position, stats: p.Stats | None, service: str
) -> Answer:
    """An :class:`Answer` from a ``POSITION`` and, when one came, the latest ``STATS``.

    The service's mean runtime is taken from ``STATS``; without it, it is worked
    back from ``eta_s`` (which the execserver computed from it).
    """
    figures = None if stats is None else stats.services.get(service)
    mean = None if figures is None else figures.mean_s
    if mean is None and answer.eta_s and answer.capacity:
        mean = answer.eta_s / (answer.ahead // answer.capacity + 1)
    return Answer(
        instance_id=instance_id,
        running=answer.running,
        waiting=None if stats is None else stats.waiting,
        ahead=answer.ahead,
        capacity=answer.capacity,
        mean_s=mean,
    )


def answer_from_stats(stats: p.Stats, service: str, priority: int) -> Answer | None:
    """An :class:`Answer` for a want not parked yet: everything at its priority or above.

    Returns None when the execserver does not offer ``service`` (or drains).
    """
    figures = stats.services.get(service)
    if figures is None or stats.draining:
        return None
    ahead = sum(c.waiting for c in stats.waiting_by_priority if c.priority >= priority)
    return Answer(
        instance_id=stats.instance_id,
        running=stats.running + stats.offered,
        waiting=stats.waiting,
        ahead=ahead,
        capacity=figures.capacity,
        mean_s=figures.mean_s,
    )


def queue_position(
    answers: Iterable[Answer],
    *,
    rows_ahead: int = 0,
    claimed_ahead: int = 0,
    ready_rows: int = 0,
    claimed_rows: int = 0,
) -> QueuePosition | None:
    """The execservers' ``answers`` merged with the queue's rows (see the module docstring).

    Args:
        answers: one per execserver that can run the job.
        rows_ahead: unclaimed queue rows a dispatcher would claim before the job.
        claimed_ahead: claimed queue rows before the job in the claim order.
        ready_rows: unclaimed queue rows in all (the job's own one included when it
            is unclaimed).
        claimed_rows: claimed queue rows in all (the job's own one included when
            it is claimed).

    Returns:
        The position, or None when there is no answer at all.

    Raises:
        ValueError: a count is negative.
    """
    counts = {
        "rows_ahead": rows_ahead,
        "claimed_ahead": claimed_ahead,
        "ready_rows": ready_rows,
        "claimed_rows": claimed_rows,
    }
    for name, value in counts.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    found = sorted(answers, key=lambda a: (a.ahead, -a.capacity))
    if not found:
        return None
    best = found[0]
    running = sum(a.running for a in found)
    capacity = sum(a.capacity for a in found)
    held_ahead = max(0, claimed_ahead - running)
    ahead = max(best.ahead, held_ahead) + rows_ahead
    known = max((a.waiting for a in found if a.waiting is not None), default=0)
    waiting = max(known, claimed_rows - running, 0) + ready_rows
    mean = next((a.mean_s for a in found if a.mean_s is not None), None)
    eta: float | None = None
    if mean is not None and capacity > 0:
        releases = max(0, ahead + 1 - max(0, capacity - running))
        eta = mean * (releases / capacity + 1)
    return QueuePosition(
        running=running,
        waiting=max(waiting, ahead + 1),
        position=ahead + 1,
        capacity=capacity,
        eta_s=eta,
        instance_id=best.instance_id,
        rows_ahead=rows_ahead,
        held_ahead=held_ahead,
    )


def service_figures(
    kinds: Mapping[str, p.Kind],
    capacity: Mapping[str, int],
    mean: Mapping[str, float | None],
    running: Mapping[str, int],
    waiting: Mapping[str, int],
) -> dict[str, p.ServiceFigures]:
    """``STATS.services`` from per-service lookups (services of ``kinds``, in that order)."""
    return {
        name: p.ServiceFigures(
            kind=kind,
            capacity=capacity[name],
            mean_s=mean.get(name),
            running=running.get(name, 0),
            waiting=waiting.get(name, 0),
        )
        for name, kind in kinds.items()
    }
