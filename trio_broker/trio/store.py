"""The queue store: PostgreSQL through psycopg's sync API, in worker threads.

Theory of operation
===================

psycopg has no trio support, so :class:`Store` runs psycopg's synchronous API in
``trio.to_thread.run_sync``: every call borrows one connection of a
``psycopg_pool.ConnectionPool`` for the length of one short statement (or one
short transaction), behind a ``trio.CapacityLimiter`` as large as the pool, so
no thread ever waits for a connection. Connections are in autocommit mode; a
call that needs several statements opens a transaction explicitly.

Schema. :meth:`Store.migrate` applies the library's numbered migrations and an
application's own (:mod:`trio_broker.trio.schema`), once, whoever starts first.

The queue (``broker_queue``; every statement on it is in
:mod:`trio_broker.trio.queue_sql`). A row is ``new`` (claimable once
``start_after`` has passed), ``claimed`` by one backend, or ``failed``; a
finished item's row is deleted, so "finished" is "its row is gone"
(:meth:`Store.item` returns ``None``) and the table holds only work still to do
and failures to look at.

- **Claim** is one statement: ``UPDATE … WHERE id IN (SELECT … ORDER BY priority
  DESC, id LIMIT n FOR UPDATE SKIP LOCKED) RETURNING …``. Concurrent claimers
  skip each other's locked rows instead of waiting, so every row goes to exactly
  one of them. :meth:`Store.claim_batch` claims several kinds (exec-bound,
  odd-only, local-bound) in that one statement, each a materialised CTE that
  excludes the rows of the ones before it. A claim increments ``attempts``. The
  order is :data:`~trio_broker.trio.queue_sql.CLAIM_ORDER`, the one definition
  :meth:`Store.positions` counts with too.
- **Outcomes are fenced.** :meth:`Store.finish` (and ``complete``/``fail``/
  ``requeue`` given a :class:`QueueItem`) touches a row only while it is still
  ``claimed`` by the same backend with the same ``attempts``: an outcome that
  arrives after the row was requeued (a stale heartbeat, a lost reply) and
  claimed again, by anyone, changes nothing. Retrying an outcome is therefore
  always safe.
- **Backends** heartbeat in ``broker_backends``. :meth:`Store.requeue_stale`
  deletes the backends whose heartbeat is older than a threshold and returns
  their rows to ``new`` in one statement; concurrent sweeps requeue each row
  once. :meth:`Store.return_claimed` returns a live backend's rows (shutdown; or
  the rows of a claim whose reply was lost, via ``keep``);
  :meth:`Store.live_backends` names the backends alive now.

The application's transaction. An application keeps its own tables beside the
queue (the reference fylr's ``files``) and must never write the queue's tables
itself. Where its own change and a queue change must commit together (a file
moves on *and* its next step is queued; a failed step is retried *and* its file
goes back to where the step starts), it runs both in one function given to
:meth:`Store.call`, inside ``conn.transaction()``, with the ``*_in`` functions
of this module, which take that connection: :func:`enqueue_in`,
:func:`requeue_failed_in`, :func:`delete_unclaimed_in`, :func:`failed_in`. Each
has an async method on the store that borrows a pooled connection for it instead
(the name without ``_in``; :meth:`Store.enqueue_many` for :func:`enqueue_in`).

Attempts. Every outcome that does not complete its row (a requeue, a failure)
keeps the claim's end in ``broker_attempts`` in the same statement
(:class:`Attempt`: backend, execserver instance, start, end, outcome, reason,
decisive line); a requeue's reason becomes the row's ``waits_because`` until its
next claim. :meth:`Store.attempts` reads them; a row that completes takes its
attempts with it.

Operators. :meth:`Store.items` pages rows by id with filters (state,
priority, action, age, file); :func:`cancel_in` (:meth:`Store.cancel`) fails a
new or claimed row with a note (the holder's re-check cancels its handler);
:func:`delete_items_in` deletes a file's rows and attempts; :func:`failed_ids_in`
names a file's failed rows for :func:`requeue_failed_in`.

Inspection. :meth:`Store.counts` counts the rows by state;
:meth:`Store.figures` adds the same per priority, the oldest ready row's age and
the soonest delayed row's start; :meth:`Store.positions`
ranks rows among the ready rows a claim would take before them;
:meth:`Store.failed` lists the failed rows with their reasons.

Values. The rows the store returns and the requests it takes (:class:`QueueItem`,
:class:`NewItem`, :class:`Outcome` …) are frozen values of
:mod:`trio_broker.trio.store_values`, imported from here.

Failures. A broken connection, an unreachable server or a server that has
become read-only (a standby after a fail-over: SQLSTATE 25006) makes the call
raise :class:`StoreUnavailable` (the pool replaces broken connections, and
closes one that met a read-only server, so that the next one is dialled
afresh: with a libpq multi-host DSN and ``target_session_attrs=read-write`` it
finds the new primary; the call may or may not have taken effect). Callers
retry after a short back-off; fencing and ``return_claimed(keep=…)`` make every
retry safe, so nothing is lost or done twice across a database restart.

Reconnecting. The pool replaces a broken connection in the background with
psycopg_pool's back-off, which starts at 1 s and doubles without a bound of its
own: after an outage of T seconds the next try could come up to about T seconds
after the server is back (a 15 s outage: the first call succeeded 12 s after the
restart). The store bounds each replacement's tries to ``reconnect_timeout``
(default :data:`RECONNECT_WINDOW` × ``connect_timeout``): then the pool gives
that one up and the next call that finds no connection dials anew, from 1 s
(``benchmarks/reconnect.py``).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any, Final, Literal, TypeVar

import psycopg
import trio
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import TupleRow
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool

from trio_broker.core.errors import StoreUnavailable
from trio_broker.trio import queue_sql, tracing
from trio_broker.trio.inspection import Histogram
from trio_broker.trio.schema import Migration, apply_migrations, load_migrations
from trio_broker.trio.store_values import (
    Attempt,
    CancelledItem,
    ClaimRequest,
    FailedItem,
    ItemPosition,
    NewItem,
    Outcome,
    QueueCounts,
    QueueFigures,
    QueueItem,
    StoreStatistics,
)

__all__ = [
    "RECONNECT_WINDOW",
    "TRACEPARENT",
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
    "Store",
    "StoreStatistics",
    "StoreUnavailable",
    "cancel_in",
    "claimed_in",
    "delete_items_in",
    "delete_unclaimed_in",
    "describe_dsn",
    "enqueue_in",
    "failed_ids_in",
    "failed_in",
    "open_store",
    "requeue_failed_in",
]

log = logging.getLogger("trio_broker.trio.store")

T = TypeVar("T")
Connection = psycopg.Connection[TupleRow]

PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1
ERROR_CHECK_INTERVAL = 1.0
RECONNECT_WINDOW = 2.0
"""The default ``reconnect_timeout`` of a :class:`Store`, in multiples of its
``connect_timeout`` (see *Reconnecting* in the module docstring)."""
"""After a connection error the idle pooled connections are checked, at most this often."""


# -- rows ------------------------------------------------------------------------------------


def _item(row: Sequence[Any]) -> QueueItem:
    return QueueItem(
        id=row[0],
        file_ref=row[1],
        action=row[2],
        priority=row[3],
        payload=row[4] if row[4] is not None else {},
        attempts=row[5],
        status=row[6],
        claimed_by=row[7],
        last_error=row[8],
        waits_because=row[9],
        start_after=row[10],
        created_at=row[11],
        claimed_at=row[12],
    )


def _attempt(row: Sequence[Any]) -> Attempt:
    return Attempt(
        item_id=row[0],
        attempt=row[1],
        backend_id=row[2],
        instance_id=row[3],
        started_at=row[4],
        ended_at=row[5],
        outcome=row[6],
        reason=row[7],
        decisive_line=row[8],
    )


def _failed(row: Sequence[Any]) -> FailedItem:
    return FailedItem(
        id=row[0],
        file_ref=row[1],
        action=row[2],
        priority=row[3],
        payload=row[4] if row[4] is not None else {},
        attempts=row[5],
        reason=row[6],
        created_at=row[7],
    )


def _counts(row: Sequence[int]) -> QueueCounts:
    return QueueCounts(ready=row[0], delayed=row[1], claimed=row[2], failed=row[3])


def _check_priority(priority: int) -> None:
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise ValueError(f"priority must be a 32-bit signed integer, got {priority}")


# -- on the caller's connection ------------------------------------------------------------


TRACEPARENT: Final = "traceparent"
"""The payload member in which :func:`enqueue_in` records the trace an item was
queued in (a W3C ``traceparent``), for the dispatcher's step span to continue."""


def _traced(payload: Mapping[str, Any], traceparent: str | None) -> dict[str, Any]:
    """The payload with the current trace context, unless it has one or there is none."""
    body = dict(payload)
    if traceparent is not None and TRACEPARENT not in body:
        body[TRACEPARENT] = traceparent
    return body


def enqueue_in(conn: Connection, items: Iterable[NewItem]) -> list[int]:
    """Add items on ``conn``, inside the caller's transaction; returns their ids in order.

    For an application whose own change must commit with the items it queues
    (the module docstring's *The application's transaction*)::

        def hand_on(conn):
            with conn.transaction():
                conn.execute("UPDATE files SET status = 'sync' WHERE id = %s", (file_id,))
                enqueue_in(conn, [NewItem(file_ref=str(file_id), action="sync")])

        await store.call(hand_on)

    The items become claimable when the transaction commits, and vanish with it
    when it rolls back. With OpenTelemetry (the ``otel`` extra) and a span
    current, each item's payload records it as :data:`TRACEPARENT` (unless the
    payload has that member already): the dispatcher's span for the item's
    step joins that trace (:mod:`trio_broker.trio.tracing`).

    Args:
        conn: a connection borrowed through :meth:`Store.call` (in a transaction,
            or in autocommit mode: then the insert commits at once).
        items: what to add (one statement for all of them).

    Raises:
        ValueError: a priority is out of range (nothing was added).
    """
    items = list(items)
    for item in items:
        _check_priority(item.priority)
    if not items:
        return []
    traceparent = tracing.current_traceparent()
    params = {
        "refs": [i.file_ref for i in items],
        "actions": [i.action for i in items],
        "priorities": [i.priority for i in items],
        "payloads": [Jsonb(_traced(i.payload, traceparent)) for i in items],
        "starts": [i.start_after for i in items],
    }
    return [row[0] for row in conn.execute(queue_sql.ENQUEUE, params).fetchall()]


def delete_unclaimed_in(conn: Connection, action: str, file_refs: Sequence[str]) -> int:
    """Delete the rows of ``action`` for ``file_refs`` that no backend holds, on ``conn``.

    New and failed rows go; claimed ones stay (their handler runs, and must find
    out by itself that its work is no longer wanted). For an application that
    removes what the items were about, in the same transaction.

    Returns:
        How many rows were deleted.
    """
    return conn.execute(queue_sql.DELETE_UNCLAIMED, (action, list(file_refs))).rowcount


def claimed_in(conn: Connection, action: str, file_refs: Sequence[str]) -> set[str]:
    """Which of ``file_refs`` have a row of ``action`` that a backend holds, on ``conn``.

    For an application that queues an item per file at most once at a time: with
    :func:`delete_unclaimed_in` and :func:`enqueue_in` in one transaction, it
    replaces the waiting rows and leaves the files whose item runs.
    """
    rows = conn.execute(queue_sql.CLAIMED_REFS, (action, list(file_refs))).fetchall()
    return {row[0] for row in rows}


def failed_in(conn: Connection, *, limit: int) -> list[FailedItem]:
    """The failed rows, oldest first, at most ``limit`` of them, read on ``conn``.

    For an application that shows them beside its own rows (read in the same
    borrowed connection).
    """
    return [_failed(row) for row in conn.execute(queue_sql.FAILED, (limit,)).fetchall()]


def requeue_failed_in(
    conn: Connection,
    *,
    ids: Sequence[int] | None = None,
    note: str = "requeued by an operator",
) -> list[FailedItem]:
    """Put failed rows back to ``new``, claimable now, on ``conn`` (the caller's transaction).

    Each row's ``last_error`` becomes ``"<note>; it had failed: <reason>"``; its
    ``attempts`` keep counting. The rows are locked in id order until the
    transaction ends, so the caller resets its own state for them (a file back to
    where its step starts) before any backend can claim them.

    Args:
        conn: a connection borrowed through :meth:`Store.call`.
        ids: only these rows (``None``: every failed row); rows that are not
            failed are left alone.
        note: what put them back.

    Returns:
        The rows put back, by id, as they were (``reason``: why they had failed).
    """
    query = queue_sql.requeue_failed_query(with_ids=ids is not None)
    params = {"ids": None if ids is None else list(ids), "note": note}
    rows = [_failed(row) for row in conn.execute(query, params).fetchall()]
    return sorted(rows, key=lambda row: row.id)


def cancel_in(
    conn: Connection, item_id: int, *, note: str = "cancelled by an operator"
) -> CancelledItem | None:
    """Cancel one new or claimed row on ``conn`` (the caller's transaction).

    The row becomes ``failed`` with ``note`` as its reason, so that it stays
    for someone to read and can be put back like any failed row
    (:func:`requeue_failed_in`). A claimed row's claim ends as a ``cancelled``
    attempt; the backend that held it no longer finds it among its claims at
    its next re-check (:meth:`Dispatcher.recheck
    <trio_broker.trio.dispatcher.Dispatcher.recheck>`), cancels its handler (a
    running job gets the broker's ``CANCEL``) and writes no outcome for it.

    Returns:
        The row as it was, or ``None`` when it was neither new nor claimed
        (failed already, finished, or unknown).
    """
    row = conn.execute(queue_sql.CANCEL, {"id": item_id, "note": note}).fetchone()
    if row is None:
        return None
    return CancelledItem(
        id=row[0], file_ref=row[1], action=row[2], status=row[3], claimed_by=row[4]
    )


def failed_ids_in(conn: Connection, file_refs: Sequence[str]) -> list[int]:
    """The ids of the failed rows of ``file_refs`` (by id), read on ``conn``."""
    rows = conn.execute(queue_sql.FAILED_OF_REFS, (list(file_refs),)).fetchall()
    return [row[0] for row in rows]


def delete_items_in(conn: Connection, file_refs: Sequence[str]) -> list[CancelledItem]:
    """Delete every row of ``file_refs`` and their attempts, on ``conn``.

    For an application that deletes what the rows were about, in the same
    transaction. Claimed rows go too: their backends find them no longer held at
    their next re-check and cancel their handlers (a running job gets the
    broker's ``CANCEL``).

    Returns:
        The rows deleted, as they were.
    """
    rows = conn.execute(queue_sql.DELETE_OF_REFS, {"refs": list(file_refs)}).fetchall()
    return [
        CancelledItem(id=row[0], file_ref=row[1], action=row[2], status=row[3], claimed_by=row[4])
        for row in rows
    ]


def describe_dsn(dsn: str) -> str:
    """The connection string without its password (for messages and logs)."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "(unparsable connection string)"
    return " ".join(f"{k}={v}" for k, v in params.items() if k != "password")


# -- the store -----------------------------------------------------------------------------


class Store:
    """The queue database (see the module docstring). Use :func:`open_store`.

    Every ``async`` method runs one short database call in a worker thread and
    may raise :class:`StoreUnavailable`. Methods that act on a claimed item
    accept either its :class:`QueueItem` (the outcome is then fenced to that
    claim) or a bare id (acting on the row whatever its state: for operators and
    tests).
    """

    def __init__(
        self,
        dsn: str,
        *,
        pool_size: int = 10,
        connect_timeout: float = 5.0,
        reconnect_timeout: float | None = None,
    ) -> None:
        """Create the store; :meth:`open` connects.

        Args:
            dsn: a libpq connection string or URL.
            pool_size: connections (and worker threads) at most.
            connect_timeout: seconds a call waits for a pooled connection (and a
                new connection for the server) before it raises
                :class:`StoreUnavailable`.
            reconnect_timeout: seconds the pool keeps trying to replace one broken
                connection with its doubling back-off before it gives that one up
                (the next call that needs a connection dials anew); default
                :data:`RECONNECT_WINDOW` × ``connect_timeout``. See
                *Reconnecting* in the module docstring.
        """
        if pool_size < 1:
            raise ValueError(f"pool_size must be at least 1, got {pool_size}")
        if reconnect_timeout is None:
            reconnect_timeout = RECONNECT_WINDOW * connect_timeout
        if reconnect_timeout <= 0:
            raise ValueError(f"reconnect_timeout must be above 0, got {reconnect_timeout}")
        self.dsn = dsn
        self.pool_size = pool_size
        self._timeout = connect_timeout
        self._pool: ConnectionPool[Connection] = ConnectionPool(
            dsn,
            min_size=pool_size,
            max_size=pool_size,
            open=False,
            timeout=connect_timeout,
            kwargs={
                "autocommit": True,
                "connect_timeout": max(1, round(connect_timeout)),
                "application_name": "trio_broker",
            },
            name="trio_broker",
            reconnect_timeout=reconnect_timeout,
        )
        self._limiter = trio.CapacityLimiter(pool_size)
        self._calls: Counter[str] = Counter()
        self._unavailable = 0
        self._check_lock = threading.Lock()
        self._last_check = 0.0
        self._claim_queries: dict[queue_sql.ClaimShape, sql.Composed] = {}

    # -- lifecycle -----------------------------------------------------------------------

    async def open(self, *, wait: float | None = None) -> None:
        """Open the pool and wait until its first connection works.

        Args:
            wait: seconds to wait for the server (default: the store's timeout).

        Raises:
            StoreUnavailable: no connection within ``wait`` seconds.
        """
        timeout = self._timeout if wait is None else wait

        def open_pool() -> None:
            try:
                self._pool.open(wait=True, timeout=timeout)
            except psycopg.OperationalError as exc:
                self._pool.close()
                raise StoreUnavailable(
                    f"cannot connect to the queue database ({describe_dsn(self.dsn)}) "
                    f"within {timeout:g} s: {exc}"
                ) from exc

        await trio.to_thread.run_sync(open_pool)

    async def aclose(self) -> None:
        """Close every connection (waits for the calls in progress)."""
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(self._pool.close)

    async def migrate(self, extra: Sequence[Migration] = ()) -> list[tuple[str, int]]:
        """Apply the library's pending migrations, then ``extra`` (an application's).

        Returns:
            ``(scope, version)`` of each migration applied now.
        """
        migrations = [*load_migrations(), *extra]
        return await self.call(lambda conn: apply_migrations(conn, migrations), kind="migrate")

    # -- plumbing ------------------------------------------------------------------------

    async def call(
        self, fn: Callable[[Connection], T], *, kind: str = "call", abandon_on_cancel: bool = False
    ) -> T:
        """Run ``fn(connection)`` in a worker thread with a pooled connection.

        For tables beside the queue (the connection is in autocommit mode; open
        ``conn.transaction()`` for several statements). ``fn`` must be short: it
        holds a connection and a thread.

        Args:
            fn: what to run.
            kind: its name in :meth:`statistics`.
            abandon_on_cancel: a cancelled call returns at once, leaving the
                thread to finish ``fn`` and give its connection back (for a
                read-only check that must answer in time, a probe); otherwise a
                cancellation waits for ``fn``.

        Raises:
            StoreUnavailable: the server is unreachable or the connection broke.
        """
        self._calls[kind] += 1
        return await trio.to_thread.run_sync(
            self._call_sync, fn, limiter=self._limiter, abandon_on_cancel=abandon_on_cancel
        )

    def _call_sync(self, fn: Callable[[Connection], T]) -> T:
        try:
            with self._pool.connection() as conn:
                try:
                    return fn(conn)
                except psycopg.errors.ReadOnlySqlTransaction:
                    conn.close()  # a standby now (fail-over): the pool dials afresh
                    raise
        except (
            psycopg.OperationalError,
            psycopg.InterfaceError,
            psycopg.errors.ReadOnlySqlTransaction,
        ) as exc:
            with self._check_lock:
                self._unavailable += 1
            self._check_pool()
            raise StoreUnavailable(f"queue database unavailable: {exc}") from exc

    def _check_pool(self) -> None:
        """After a connection error, replace the other broken connections too."""
        now = time.monotonic()
        with self._check_lock:
            if now - self._last_check < ERROR_CHECK_INTERVAL:
                return
            self._last_check = now
        with contextlib.suppress(psycopg.Error):
            self._pool.check()

    def statistics(self) -> StoreStatistics:
        """A snapshot of the calls made so far."""
        return StoreStatistics(
            pool_size=self.pool_size, calls=dict(self._calls), unavailable=self._unavailable
        )

    # -- enqueue ---------------------------------------------------------------------------

    async def enqueue(
        self,
        file_ref: str,
        action: str,
        priority: int = 0,
        payload: Mapping[str, Any] | None = None,
        start_after: datetime.datetime | None = None,
    ) -> int:
        """Add one item; returns its id.

        Args:
            file_ref: the file the work is about.
            action: the action name a dispatcher runs it with.
            priority: 32-bit signed; higher first.
            payload: a JSON object for the action.
            start_after: not claimable before this instant (timezone-aware);
                ``None`` means now.

        Raises:
            ValueError: the priority is out of range.
        """
        ids = await self.enqueue_many(
            [
                NewItem(
                    file_ref=file_ref,
                    action=action,
                    priority=priority,
                    payload=payload or {},
                    start_after=start_after,
                )
            ]
        )
        return ids[0]

    async def enqueue_many(self, items: Iterable[NewItem]) -> list[int]:
        """Add many items in one statement; returns their ids in order.

        To add them in a transaction of the application's own, use
        :func:`enqueue_in`.

        Raises:
            ValueError: a priority is out of range (nothing was added).
        """
        items = list(items)
        for item in items:
            _check_priority(item.priority)
        if not items:
            return []
        return await self.call(lambda conn: enqueue_in(conn, items), kind="enqueue")

    # -- claim -----------------------------------------------------------------------------

    async def claim(
        self,
        backend_id: str,
        limit: int,
        odd_only: bool = False,
        actions: Sequence[str] | None = None,
    ) -> list[QueueItem]:
        """Claim up to ``limit`` ready items, highest priority first, then oldest.

        Args:
            backend_id: who claims (recorded in ``claimed_by``).
            limit: at most this many.
            odd_only: only odd priorities.
            actions: only these actions (``None``: any).

        Returns:
            The claimed items in claim order (``attempts`` already counts this claim).
        """
        request = ClaimRequest(
            limit=limit, odd_only=odd_only, actions=None if actions is None else tuple(actions)
        )
        return await self.claim_batch(backend_id, [request])

    async def claim_batch(
        self, backend_id: str, requests: Sequence[ClaimRequest]
    ) -> list[QueueItem]:
        """Claim for several requests in one statement; no row is claimed twice.

        Requests are served in order: each gets the best rows the ones before it
        did not take. Requests with a limit of 0 are left out; when none is left,
        nothing is sent to the database.
        """
        requests = [r for r in requests if r.limit > 0]
        if not requests:
            return []
        shape: queue_sql.ClaimShape = tuple((r.actions is not None, r.odd_only) for r in requests)
        query = self._claim_queries.get(shape)
        if query is None:
            query = self._claim_queries[shape] = queue_sql.claim_query(shape)
        params: list[Any] = []
        for r in requests:
            if r.actions is not None:
                params.append(list(r.actions))
            params.append(r.limit)
        params.append(backend_id)

        def run(conn: Connection) -> list[QueueItem]:
            items = [_item(row) for row in conn.execute(query, params).fetchall()]
            items.sort(key=queue_sql.claim_key)
            return items

        return await self.call(run, kind="claim")

    # -- outcomes --------------------------------------------------------------------------

    async def finish(self, backend_id: str, outcomes: Sequence[Outcome]) -> set[int]:
        """Record many outcomes of ``backend_id``'s claims in one statement.

        Returns:
            The ids whose outcome took effect; the others were no longer held by
            that claim (requeued meanwhile), and nothing changed for them.
        """
        if not outcomes:
            return set()
        completes = [o for o in outcomes if o.kind == "complete"]
        others = [o for o in outcomes if o.kind != "complete"]
        params = {
            "backend": backend_id,
            "c_ids": [o.item_id for o in completes],
            "c_attempts": [o.attempts for o in completes],
            "o_ids": [o.item_id for o in others],
            "o_attempts": [o.attempts for o in others],
            "o_status": ["failed" if o.kind == "fail" else "new" for o in others],
            "o_delay": [float(o.delay) for o in others],
            "o_error": [o.error for o in others],
            "o_outcome": [o.outcome or o.kind for o in others],
            "o_instance": [o.instance_id for o in others],
            "o_line": [o.line for o in others],
        }

        def run(conn: Connection) -> set[int]:
            return {row[0] for row in conn.execute(queue_sql.FINISH, params).fetchall()}

        return await self.call(run, kind="finish")

    async def complete(self, item: QueueItem | int) -> bool:
        """The item is done: its row is deleted. Returns whether it was."""
        if isinstance(item, QueueItem):
            return await self._fenced(item, "complete")

        def run(conn: Connection) -> bool:
            return conn.execute(queue_sql.COMPLETE_ID, {"id": item}).rowcount == 1

        return await self.call(run, kind="complete")

    async def fail(self, item: QueueItem | int, error: str) -> bool:
        """The item failed for good: status ``failed``, ``last_error`` = ``error``."""
        if isinstance(item, QueueItem):
            return await self._fenced(item, "fail", error=error)

        def run(conn: Connection) -> bool:
            return conn.execute(queue_sql.FAIL_ID, (error, item)).rowcount == 1

        return await self.call(run, kind="fail")

    async def requeue(
        self, item: QueueItem | int, delay_s: float, error: str | None = None
    ) -> bool:
        """Make the item claimable again after ``delay_s`` seconds (a failed one too)."""
        if isinstance(item, QueueItem):
            return await self._fenced(item, "requeue", delay=delay_s, error=error)

        def run(conn: Connection) -> bool:
            params = {"delay": float(delay_s), "error": error, "id": item}
            cur = conn.execute(queue_sql.REQUEUE_ID, params)
            return cur.rowcount == 1

        return await self.call(run, kind="requeue")

    async def _fenced(
        self,
        item: QueueItem,
        kind: Literal["complete", "requeue", "fail"],
        *,
        delay: float = 0.0,
        error: str | None = None,
    ) -> bool:
        if item.claimed_by is None:
            raise ValueError(f"item {item.id} is not a claimed item (claimed_by is None)")
        outcome = Outcome(
            item_id=item.id, attempts=item.attempts, kind=kind, delay=delay, error=error
        )
        return item.id in await self.finish(item.claimed_by, [outcome])

    async def return_claimed(self, backend_id: str, *, keep: Iterable[int] = ()) -> int:
        """Make every row ``backend_id`` holds claimable again at once.

        Args:
            backend_id: whose rows.
            keep: ids to leave claimed (the items the backend knows it runs).

        Returns:
            How many rows were returned.
        """
        keep_ids = list(keep)

        def run(conn: Connection) -> int:
            return conn.execute(queue_sql.RETURN_CLAIMED, (backend_id, keep_ids)).rowcount

        return await self.call(run, kind="return_claimed")

    async def recheck_claims(
        self, backend_id: str, *, keep: Iterable[int] = ()
    ) -> tuple[int, set[tuple[int, int]]]:
        """Return the rows ``backend_id`` holds but does not know; read the claims it holds.

        In one transaction: every row ``backend_id`` holds except ``keep`` is made
        claimable again at once (a claim or an outcome whose commit was lost left
        it there), then the claims still held are read.

        Args:
            backend_id: whose rows.
            keep: ids of the items the backend knows it runs.

        Returns:
            How many rows were returned, and the ``(id, attempts)`` of every row
            ``backend_id`` still holds.
        """
        keep_ids = list(keep)

        def run(conn: Connection) -> tuple[int, set[tuple[int, int]]]:
            with conn.transaction():
                returned = conn.execute(queue_sql.RETURN_CLAIMED, (backend_id, keep_ids)).rowcount
                held = {(row[0], row[1]) for row in conn.execute(queue_sql.HELD, (backend_id,))}
            return returned, held

        return await self.call(run, kind="recheck_claims")

    # -- backends --------------------------------------------------------------------------

    async def register_backend(self, backend_id: str, name: str) -> None:
        """Record a backend as started now (again, if it was known)."""

        def run(conn: Connection) -> None:
            conn.execute(queue_sql.REGISTER_BACKEND, (backend_id, name))

        await self.call(run, kind="register")

    async def heartbeat(self, backend_id: str, name: str = "") -> bool:
        """Mark the backend alive now.

        A backend that was swept as stale meanwhile is registered again.

        Returns:
            Whether it was still registered (``False``: its rows were requeued
            by a sweep, and its outcomes for them no longer count).
        """

        def run(conn: Connection) -> bool:
            row = conn.execute(queue_sql.HEARTBEAT, (backend_id, name)).fetchone()
            return bool(row and row[0])

        return await self.call(run, kind="heartbeat")

    async def unregister_backend(self, backend_id: str) -> None:
        """Forget a backend (at shutdown, after :meth:`return_claimed`)."""

        def run(conn: Connection) -> None:
            conn.execute(queue_sql.UNREGISTER_BACKEND, (backend_id,))

        await self.call(run, kind="unregister")

    async def requeue_stale(self, threshold_s: float) -> int:
        """Requeue the rows of backends silent for more than ``threshold_s`` seconds.

        The stale backends are deleted; rows claimed by a backend that is not
        registered at all are requeued too. Returns how many rows were requeued.
        """

        def run(conn: Connection) -> int:
            return conn.execute(queue_sql.REQUEUE_STALE, {"threshold": float(threshold_s)}).rowcount

        return await self.call(run, kind="requeue_stale")

    async def live_backends(self, stale_after: float) -> list[str]:
        """The ids of the backends whose heartbeat is younger than ``stale_after`` seconds.

        Measured on the database's clock, by id. A backend registers before it
        claims (or writes anything of its own), so whatever it made after that is
        covered by this answer while it lives.
        """

        def run(conn: Connection) -> list[str]:
            rows = conn.execute(queue_sql.LIVE_BACKENDS, (float(stale_after),)).fetchall()
            return [row[0] for row in rows]

        return await self.call(run, kind="live_backends")

    # -- inspection ------------------------------------------------------------------------

    async def counts(self) -> QueueCounts:
        """How many rows are in each state (a full scan: for inspection)."""

        def run(conn: Connection) -> QueueCounts:
            row = conn.execute(queue_sql.COUNTS).fetchone()
            assert row is not None
            return _counts(row)

        return await self.call(run, kind="counts")

    async def ready_ages(self, bounds: Sequence[float]) -> dict[int, Histogram]:
        """The ages of the ready rows (seconds since each was enqueued) per priority, as
        histograms over ``bounds`` (ascending upper bounds; ``+Inf`` follows): how long
        the claimable work has been waiting, now (one statement: for metrics)."""
        bounds = tuple(float(b) for b in bounds)
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"bounds must be ascending and distinct, got {bounds}")

        def run(conn: Connection) -> dict[int, Histogram]:
            rows = conn.execute(queue_sql.READY_AGES, {"bounds": list(bounds)}).fetchall()
            counts: dict[int, list[int]] = {}
            totals: dict[int, float] = {}
            for priority, bucket, count, total in rows:
                counts.setdefault(priority, [0] * (len(bounds) + 1))[bucket] = count
                totals[priority] = totals.get(priority, 0.0) + total
            return {
                priority: Histogram(
                    bounds=bounds,
                    counts=tuple(c),
                    total=totals[priority],
                    count=sum(c),
                )
                for priority, c in counts.items()
            }

        return await self.call(run, kind="ready_ages")

    async def figures(self) -> QueueFigures:
        """The rows by state, in all and per priority, with the oldest ready row's age and
        the soonest delayed row's start (one statement, one full scan: for inspection)."""

        def run(conn: Connection) -> QueueFigures:
            rows = conn.execute(queue_sql.COUNTS_BY_PRIORITY).fetchall()
            by_priority = {row[0]: _counts(row[1:5]) for row in rows}
            totals = [sum(column) for column in zip(*(row[1:5] for row in rows), strict=True)]
            starts = [row[6] for row in rows if row[6] is not None]
            return QueueFigures(
                counts=_counts(totals or (0, 0, 0, 0)),
                by_priority=by_priority,
                oldest_ready={row[0]: row[5] for row in rows if row[5] is not None},
                next_start_after=min(starts, default=None),
            )

        return await self.call(run, kind="figures")

    async def positions(
        self, file_refs: Sequence[str], *, actions: Sequence[str] | None = None
    ) -> list[ItemPosition]:
        """The new and claimed rows of ``file_refs``, each with its competitors.

        "Ahead" is the claim order itself
        (:data:`~trio_broker.trio.queue_sql.CLAIM_ORDER`: priority descending,
        then id): the ready rows ahead (those a claim could take now) and the
        claimed rows ahead (held by dispatchers), with the ready and claimed rows
        in all (:class:`ItemPosition`). One statement.

        Args:
            file_refs: the files whose rows to rank.
            actions: only rows of these actions count, both as the files' rows
                and as the rows ahead (``None``: every action).

        Returns:
            The rows, by id. A new row whose ``start_after`` is still ahead is
            ranked all the same, among the rows that are ready now.
        """
        query = queue_sql.positions_query(with_actions=actions is not None)
        params = {"refs": list(file_refs), "actions": None if actions is None else list(actions)}

        def run(conn: Connection) -> list[ItemPosition]:
            return [
                ItemPosition(
                    item=_item(row),
                    ahead=row[-4],
                    claimed_ahead=row[-3],
                    ready=row[-2],
                    claimed=row[-1],
                )
                for row in conn.execute(query, params).fetchall()
            ]

        return await self.call(run, kind="positions")

    async def failed(self, *, limit: int = 100) -> list[FailedItem]:
        """The failed rows, oldest first, at most ``limit`` (:func:`failed_in`)."""
        return await self.call(lambda conn: failed_in(conn, limit=limit), kind="failed")

    async def requeue_failed(
        self, *, ids: Sequence[int] | None = None, note: str = "requeued by an operator"
    ) -> list[FailedItem]:
        """Put failed rows back into the queue (:func:`requeue_failed_in`, on its own).

        Use :func:`requeue_failed_in` when the application must reset its own
        state for them in the same transaction.
        """
        return await self.call(
            lambda conn: requeue_failed_in(conn, ids=ids, note=note), kind="requeue_failed"
        )

    async def delete_unclaimed(self, action: str, file_refs: Sequence[str]) -> int:
        """Delete the rows of ``action`` for ``file_refs`` no backend holds
        (:func:`delete_unclaimed_in`, on its own). Returns how many."""
        return await self.call(
            lambda conn: delete_unclaimed_in(conn, action, file_refs), kind="delete_unclaimed"
        )

    async def items(
        self,
        *,
        after: int = 0,
        limit: int = 100,
        states: Sequence[str] | None = None,
        priorities: Sequence[int] | None = None,
        actions: Sequence[str] | None = None,
        older_than_s: float | None = None,
        file_refs: Sequence[str] | None = None,
    ) -> tuple[list[QueueItem], datetime.datetime | None]:
        """A page of rows by id, for operators: the ones after ``after`` that match.

        Args:
            after: the cursor: only rows with a larger id (0: from the start).
            limit: at most this many rows.
            states: only rows in one of these states
                (:data:`~trio_broker.trio.queue_sql.ITEM_STATES`).
            priorities: only rows of these priorities.
            actions: only rows of these actions.
            older_than_s: only rows enqueued at least this many seconds ago.
            file_refs: only rows of these files.

        Returns:
            The rows, and the database's now (``None`` for an empty page).

        Raises:
            ValueError: an unknown state, or a limit below 1.
        """
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        unknown = sorted(set(states or ()) - set(queue_sql.ITEM_STATES))
        if unknown:
            raise ValueError(
                f"unknown state {unknown[0]!r} (expected {', '.join(queue_sql.ITEM_STATES)})"
            )
        query = queue_sql.list_items_query(
            states=states is not None,
            priorities=priorities is not None,
            actions=actions is not None,
            older_than=older_than_s is not None,
            refs=file_refs is not None,
        )
        params = {
            "after": after,
            "limit": limit,
            "states": None if states is None else list(states),
            "priorities": None if priorities is None else list(priorities),
            "actions": None if actions is None else list(actions),
            "older_than": None if older_than_s is None else float(older_than_s),
            "refs": None if file_refs is None else list(file_refs),
        }

        def run(conn: Connection) -> tuple[list[QueueItem], datetime.datetime | None]:
            rows = conn.execute(query, params).fetchall()
            return [_item(row) for row in rows], (rows[0][-1] if rows else None)

        return await self.call(run, kind="items")

    async def attempts(self, item_id: int) -> list[Attempt]:
        """The ended claims of row ``item_id``, first first (empty once it completed)."""

        def run(conn: Connection) -> list[Attempt]:
            return [_attempt(row) for row in conn.execute(queue_sql.ATTEMPTS_OF, (item_id,))]

        return await self.call(run, kind="attempts")

    async def cancel(
        self, item_id: int, *, note: str = "cancelled by an operator"
    ) -> CancelledItem | None:
        """Cancel one new or claimed row (:func:`cancel_in`, on its own)."""
        return await self.call(lambda conn: cancel_in(conn, item_id, note=note), kind="cancel")

    async def item(self, item_id: int) -> QueueItem | None:
        """The row of ``item_id``, or ``None`` once it finished (or never existed)."""

        def run(conn: Connection) -> QueueItem | None:
            row = conn.execute(queue_sql.ITEM_BY_ID, (item_id,)).fetchone()
            return None if row is None else _item(row)

        return await self.call(run, kind="item")

    async def claimed_by(self, backend_id: str) -> list[QueueItem]:
        """The rows ``backend_id`` holds, by id."""

        def run(conn: Connection) -> list[QueueItem]:
            return [_item(row) for row in conn.execute(queue_sql.ROWS_OF, (backend_id,))]

        return await self.call(run, kind="claimed_by")


@contextlib.asynccontextmanager
async def open_store(
    dsn: str,
    *,
    pool_size: int = 10,
    connect_timeout: float = 5.0,
    reconnect_timeout: float | None = None,
    migrate: bool = True,
    migrations: Sequence[Migration] = (),
    wait: float | None = None,
) -> AsyncIterator[Store]:
    """Open a :class:`Store`, apply pending migrations, close it at the end.

    Args:
        dsn: a libpq connection string or URL.
        pool_size: connections (and worker threads) at most.
        connect_timeout: seconds a call waits for a connection.
        reconnect_timeout: as for :class:`Store`.
        migrate: apply the library's pending migrations (and ``migrations``) first.
        migrations: an application's own migrations, applied after the library's.
        wait: seconds to wait for the server at start (default: ``connect_timeout``).

    Raises:
        StoreUnavailable: the server could not be reached.
    """
    store = Store(
        dsn,
        pool_size=pool_size,
        connect_timeout=connect_timeout,
        reconnect_timeout=reconnect_timeout,
    )
    await store.open(wait=wait)
    try:
        if migrate:
            applied = await store.migrate(migrations)
            if applied:
                log.info("applied migrations %s", applied)
        yield store
    finally:
        await store.aclose()
