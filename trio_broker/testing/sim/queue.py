"""The queue's database, modelled: the store's claim semantics on plain rows.

:class:`QueueModel` does to its rows what the statements of
:class:`~trio_broker.trio.store.Store` do to ``file_queue`` and ``backends``:

- **claim** (``claim_batch``): for each request in order (any priority, then
  odd priorities only), the ``new`` rows whose ``start_after`` has passed, best
  first (``priority`` descending, then ``id``), up to the request's limit,
  skipping the rows an earlier request of the same statement took; they become
  ``claimed`` by the backend, ``attempts`` one higher. A statement runs whole at
  one instant of the simulation, so two claims never take one row (what
  ``FOR UPDATE SKIP LOCKED`` guarantees the real store);
- **finish**: each outcome applies only while its row is still claimed by that
  backend with that ``attempts`` (fenced): complete deletes the row (here: marks
  it done), requeue makes it ``new`` after its delay, fail marks it ``failed``;
- **heartbeat**, **requeue_stale** (the rows of backends silent for longer
  than the threshold, and of unregistered ones, go back at once) and
  **return_claimed** (a backend's rows but ``keep``).

Everything here is pure; the simulator adds the database's latency and faults.
Each row also keeps its history (claims, outcomes, sweeps) for the checks.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from typing import Literal

import attrs

from trio_broker.core.admission import ClaimPlan, is_odd

__all__ = ["Outcome", "QueueModel", "Row"]

RowStatus = Literal["new", "claimed", "failed", "done"]


@attrs.frozen(kw_only=True)
class Outcome:
    """One outcome to write (what :class:`~trio_broker.trio.store.Outcome` carries)."""

    item_id: int
    attempts: int
    kind: Literal["complete", "requeue", "fail"]
    delay: float = 0.0
    error: str | None = None


@attrs.define(kw_only=True, eq=False)
class Row:
    """One queue row and its history.

    The claim protocol's view (:class:`~trio_broker.core.dispatch.ClaimedItem`):
    ``id``, ``attempts``, ``action`` (the service) and ``priority``.
    """

    id: int
    action: str
    priority: int
    job: int
    """The index of its :class:`~trio_broker.testing.sim.trace.JobInput`."""
    enqueued_at: float
    attempts: int = 0
    status: RowStatus = "new"
    claimed_by: str | None = None
    start_after: float = 0.0
    last_error: str | None = None
    ended_at: float | None = None
    swept: int = 0
    """Claims of this row that went back to the queue without an outcome."""


@attrs.frozen
class ClaimedRow:
    """A row as a claim returns it (a snapshot: the claim's ``attempts``)."""

    id: int
    attempts: int
    action: str
    priority: int


class QueueModel:
    """The queue table and the backends table (see the module docstring)."""

    def __init__(self) -> None:
        self.rows: dict[int, Row] = {}
        self.backends: dict[str, float] = {}
        self._ready: list[tuple[int, int]] = []  # (-priority, id) of new rows, lazily
        self._ready_odd: list[tuple[int, int]] = []
        self._delayed: list[tuple[float, int]] = []  # (start_after, id)
        self._queued: set[int] = set()  # ids whose ready entries are live
        self._by_backend: dict[str, set[int]] = {}  # backend -> ids of its claimed rows
        self.open_rows = 0
        """Rows neither done nor failed."""

    # -- rows --------------------------------------------------------------------------

    def enqueue(self, action: str, priority: int, job: int, *, now: float) -> Row:
        row_id = len(self.rows) + 1
        row = Row(id=row_id, action=action, priority=priority, job=job, enqueued_at=now)
        self.rows[row_id] = row
        self.open_rows += 1
        self._make_ready(row)
        return row

    def _make_ready(self, row: Row) -> None:
        self._queued.add(row.id)
        heapq.heappush(self._ready, (-row.priority, row.id))
        if is_odd(row.priority):
            heapq.heappush(self._ready_odd, (-row.priority, row.id))

    def _unclaim(self, row: Row) -> None:
        assert row.claimed_by is not None
        self._by_backend[row.claimed_by].discard(row.id)
        row.claimed_by = None

    def _release(self, row: Row, *, delay: float, now: float, error: str | None) -> None:
        self._unclaim(row)
        row.status = "new"
        row.start_after = now + delay
        if error is not None:
            row.last_error = error
        if delay > 0:
            heapq.heappush(self._delayed, (row.start_after, row.id))
        else:
            self._make_ready(row)

    def _promote(self, now: float) -> None:
        delayed = self._delayed
        while delayed and delayed[0][0] <= now:
            _, row_id = heapq.heappop(delayed)
            row = self.rows[row_id]
            if row.status == "new" and row.start_after <= now and row_id not in self._queued:
                self._make_ready(row)

    def _take(self, heap: list[tuple[int, int]], limit: int, taken: set[int]) -> list[Row]:
        rows: list[Row] = []
        skipped: list[tuple[int, int]] = []
        while heap and len(rows) < limit:
            entry = heapq.heappop(heap)
            row = self.rows[entry[1]]
            if row.status != "new" or row.id not in self._queued:
                continue  # a stale entry
            if row.id in taken:
                skipped.append(entry)
                continue
            rows.append(row)
            taken.add(row.id)
        for entry in skipped:
            heapq.heappush(heap, entry)
        return rows

    # -- statements --------------------------------------------------------------------

    def claim(self, backend: str, plan: ClaimPlan, *, now: float) -> list[ClaimedRow]:
        """One claim statement: the general share, then the odd-only share."""
        self._promote(now)
        taken: set[int] = set()
        rows = self._take(self._ready, plan.general, taken)
        rows += self._take(self._ready_odd, plan.odd_only, taken)
        claimed = []
        for row in rows:
            self._queued.discard(row.id)
            row.status = "claimed"
            row.claimed_by = backend
            self._by_backend.setdefault(backend, set()).add(row.id)
            row.attempts += 1
            claimed.append(ClaimedRow(row.id, row.attempts, row.action, row.priority))
        return claimed

    def finish(self, backend: str, outcomes: Sequence[Outcome], *, now: float) -> set[int]:
        """Write outcomes, each fenced to its claim; returns the ids that took effect."""
        applied: set[int] = set()
        for outcome in outcomes:
            row = self.rows.get(outcome.item_id)
            if (
                row is None
                or row.status != "claimed"
                or row.claimed_by != backend
                or row.attempts != outcome.attempts
            ):
                continue
            applied.add(row.id)
            if outcome.kind == "requeue":
                self._release(row, delay=outcome.delay, now=now, error=outcome.error)
                continue
            self._unclaim(row)
            row.status = "done" if outcome.kind == "complete" else "failed"
            row.ended_at = now
            row.last_error = outcome.error if outcome.error is not None else row.last_error
            self.open_rows -= 1
        return applied

    def heartbeat(self, backend: str, *, now: float) -> bool:
        """Mark the backend alive; False when it had been swept (registered again)."""
        existed = backend in self.backends
        self.backends[backend] = now
        return existed

    def register(self, backend: str, *, now: float) -> None:
        self.backends[backend] = now

    def unregister(self, backend: str) -> None:
        self.backends.pop(backend, None)

    def requeue_stale(self, threshold: float, *, now: float) -> int:
        """Requeue the rows of backends silent for longer than ``threshold``, and of
        backends not registered at all; the stale backends are forgotten."""
        for backend, beat in list(self.backends.items()):
            if beat < now - threshold:
                del self.backends[backend]
        count = 0
        for backend in [b for b in self._by_backend if b not in self.backends]:
            for row_id in sorted(self._by_backend[backend]):
                row = self.rows[row_id]
                row.swept += 1
                error = f"requeued: backend {backend} stopped heartbeating"
                self._release(row, delay=0.0, now=now, error=error)
                count += 1
            del self._by_backend[backend]
        return count

    def return_claimed(self, backend: str, keep: Iterable[int] = (), *, now: float) -> int:
        kept = set(keep)
        count = 0
        for row_id in sorted(self._by_backend.get(backend, set()) - kept):
            row = self.rows[row_id]
            row.swept += 1
            self._release(row, delay=0.0, now=now, error=None)
            count += 1
        return count

    # -- questions ---------------------------------------------------------------------

    def depth(self) -> int:
        """Rows still to do (new or claimed)."""
        return self.open_rows

    def check_invariants(self) -> None:
        """Raise AssertionError when the rows disagree with the indexes."""
        open_rows = 0
        for row in self.rows.values():
            assert (row.status == "claimed") == (row.claimed_by is not None), row
            if row.status in ("new", "claimed"):
                open_rows += 1
            if row.id in self._queued:
                assert row.status == "new", row
            if row.claimed_by is not None:
                assert row.id in self._by_backend[row.claimed_by], row
        claimed = sum(len(ids) for ids in self._by_backend.values())
        assert claimed == sum(1 for row in self.rows.values() if row.status == "claimed")
        assert open_rows == self.open_rows
