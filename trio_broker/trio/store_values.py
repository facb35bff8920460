"""The queue store's values: the rows it returns and the requests it takes.

Frozen attrs values, importable from :mod:`trio_broker.trio.store` (their home
for users) without the store's machinery: a :class:`QueueItem` is a row of
``broker_queue`` as a claim returned it, a :class:`NewItem` one to enqueue, an
:class:`Outcome` how a claimed item ended, and the inspection figures
(:class:`QueueCounts`, :class:`QueueFigures`, :class:`ItemPosition`,
:class:`FailedItem`, :class:`StoreStatistics`).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any, Literal

import attrs

__all__ = [
    "Attempt",
    "CancelledItem",
    "ClaimRequest",
    "FailedItem",
    "ItemPosition",
    "NewItem",
    "Outcome",
    "QueueCounts",
    "QueueFigures",
    "QueueItem",
    "StoreStatistics",
]


# -- the values --------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class QueueItem:
    """One row of ``broker_queue``.

    Attributes:
        id: the row's id.
        file_ref: the file the work is about.
        action: what to do (the dispatcher's action name).
        priority: higher first; odd is the "high" variant of a band.
        payload: free JSON object for the action.
        attempts: how many times the row was claimed (this claim included).
        status: ``new``, ``claimed`` or ``failed``.
        claimed_by: the backend holding the claim, or ``None``.
        last_error: why it was last requeued or failed, or ``None``.
        waits_because: why a new row waits now (the reason of its last requeue:
            no slot in time, a service nobody offers, an execserver draining);
            ``None`` once claimed again, failed, or never requeued.
        start_after: when it may be claimed (``None`` where not read).
        created_at: when it was enqueued (``None`` where not read).
        claimed_at: when its claim began (``None`` unless claimed).
    """

    id: int
    file_ref: str
    action: str
    priority: int
    payload: Mapping[str, Any] = attrs.field(factory=dict)
    attempts: int = 0
    status: str = "new"
    claimed_by: str | None = None
    last_error: str | None = None
    waits_because: str | None = None
    start_after: datetime.datetime | None = None
    created_at: datetime.datetime | None = None
    claimed_at: datetime.datetime | None = None


@attrs.frozen(kw_only=True)
class NewItem:
    """An item to enqueue (:meth:`~trio_broker.trio.store.Store.enqueue_many`,
    :func:`~trio_broker.trio.store.enqueue_in`)."""

    file_ref: str
    action: str
    priority: int = 0
    payload: Mapping[str, Any] = attrs.field(factory=dict)
    start_after: datetime.datetime | None = None


@attrs.frozen(kw_only=True)
class ClaimRequest:
    """One kind of item a claim asks for
    (:meth:`~trio_broker.trio.store.Store.claim_batch`).

    Attributes:
        limit: at most this many rows (0 asks for none).
        actions: only these actions; ``None`` means any.
        odd_only: only odd priorities.
    """

    limit: int
    actions: tuple[str, ...] | None = None
    odd_only: bool = False


@attrs.frozen(kw_only=True)
class Outcome:
    """How one claimed item ended (:meth:`~trio_broker.trio.store.Store.finish`).

    Attributes:
        item_id, attempts: the claim this outcome belongs to (the fence).
        kind: ``complete`` (the row is deleted), ``requeue`` (new again after
            ``delay`` seconds) or ``fail`` (status ``failed``).
        delay: seconds before a requeued item may be claimed again.
        error: stored in ``last_error`` (``fail``; ``requeue`` when given), and
            for ``requeue`` in ``waits_because``.
        outcome: the outcome's name kept with the attempt (the dispatch core's:
            ``no_slot``, ``failed`` ...; ``None``: the ``kind``).
        instance_id: the execserver instance that ran the job, when known.
        line: the receipt's decisive line, when a job ended badly.
    """

    item_id: int
    attempts: int
    kind: Literal["complete", "requeue", "fail"]
    delay: float = 0.0
    error: str | None = None
    outcome: str | None = None
    instance_id: str | None = None
    line: str | None = None


@attrs.frozen(kw_only=True)
class QueueCounts:
    """How many rows of ``broker_queue`` are in each state.

    Attributes:
        ready: new and claimable now.
        delayed: new, but ``start_after`` is still ahead.
        claimed: claimed by some backend.
        failed: failed.
    """

    ready: int
    delayed: int
    claimed: int
    failed: int

    @property
    def total(self) -> int:
        return self.ready + self.delayed + self.claimed + self.failed


@attrs.frozen(kw_only=True)
class QueueFigures:
    """The queue's figures at one moment
    (:meth:`~trio_broker.trio.store.Store.figures`).

    A value that grows with what callers need to know about the queue; read its
    attributes by name.

    Attributes:
        counts: the rows by state, over every priority.
        by_priority: the rows by state per priority, highest priority first
            (only priorities that have rows).
        oldest_ready: per priority that has ready rows, the age in seconds of
            its oldest one (since it was enqueued, on the database's clock).
        next_start_after: the soonest ``start_after`` of a delayed row (``None``
            without one).
    """

    counts: QueueCounts
    by_priority: Mapping[int, QueueCounts] = attrs.field(factory=dict)
    oldest_ready: Mapping[int, float] = attrs.field(factory=dict)
    next_start_after: datetime.datetime | None = None

    @property
    def oldest_ready_s(self) -> float | None:
        """The age of the oldest ready row of any priority (``None`` without one)."""
        return max(self.oldest_ready.values(), default=None)


@attrs.frozen(kw_only=True)
class ItemPosition:
    """A new or claimed row and its competitors in the queue
    (:meth:`~trio_broker.trio.store.Store.positions`), among the actions asked about.

    Attributes:
        item: the row (``payload`` and ``last_error`` included).
        ahead: ready rows that come before it in the claim order
            (:data:`~trio_broker.trio.queue_sql.CLAIM_ORDER`). For a claimed row
            it is the rows that would now be claimed before a row like it.
        claimed_ahead: claimed rows (other than it) that come before it in the
            claim order: held by a dispatcher, each running or waiting for a slot.
        ready: the ready rows, in all.
        claimed: the claimed rows, in all (it included when it is claimed).
    """

    item: QueueItem
    ahead: int
    claimed_ahead: int = 0
    ready: int = 0
    claimed: int = 0


@attrs.frozen(kw_only=True)
class FailedItem:
    """A failed row of ``broker_queue`` (:meth:`~trio_broker.trio.store.Store.failed`), or
    one put back (:meth:`~trio_broker.trio.store.Store.requeue_failed`: as it was before).

    Attributes:
        id, file_ref, action, priority, payload: the item.
        attempts: how many times it was claimed.
        reason: why it failed (its ``last_error``), or ``None``.
        created_at: when it was enqueued.
    """

    id: int
    file_ref: str
    action: str
    priority: int
    payload: Mapping[str, Any]
    attempts: int
    reason: str | None
    created_at: datetime.datetime


@attrs.frozen(kw_only=True)
class StoreStatistics:
    """A snapshot of what a :class:`Store` has done.

    Attributes:
        pool_size: connections in the pool (and threads at most).
        calls: calls made, by operation (``claim``, ``finish``, ``heartbeat``…).
        unavailable: calls that raised :class:`StoreUnavailable`.
    """

    pool_size: int
    calls: Mapping[str, int]
    unavailable: int


@attrs.frozen(kw_only=True)
class Attempt:
    """One ended claim of a queue row (:meth:`~trio_broker.trio.store.Store.attempts`).

    Attributes:
        item_id: the row.
        attempt: the claim's number (the row's ``attempts`` at that claim).
        backend_id: the backend that held the claim.
        instance_id: the execserver instance whose receipt came back, if any.
        started_at: when the claim began.
        ended_at: when its end was written.
        outcome: ``no_slot``, ``stopped``, ``unknown_service``, ``failed``,
            ``cancelled`` … (the dispatch core's outcome names).
        reason: why (the requeue's or the failure's text).
        decisive_line: the receipt's decisive line, for a job that ended badly.
    """

    item_id: int
    attempt: int
    backend_id: str
    instance_id: str | None
    started_at: datetime.datetime
    ended_at: datetime.datetime
    outcome: str
    reason: str | None
    decisive_line: str | None

    @property
    def duration_s(self) -> float:
        """Seconds from the claim to its end."""
        return (self.ended_at - self.started_at).total_seconds()


@attrs.frozen(kw_only=True)
class CancelledItem:
    """A row an operator cancelled (:func:`~trio_broker.trio.store.cancel_in`), as it was.

    Attributes:
        id, file_ref, action: the row.
        status: ``new`` or ``claimed`` before the cancel.
        claimed_by: the backend that held it (a running job to cancel there).
    """

    id: int
    file_ref: str
    action: str
    status: str
    claimed_by: str | None
