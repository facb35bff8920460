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

The queue (``file_queue``). A row is ``new`` (claimable once ``start_after``
has passed), ``claimed`` by one backend, or ``failed``; a finished item's row is
deleted, so "finished" is "its row is gone" (:meth:`Store.item` returns
``None``) and the table holds only work still to do and failures to look at.

- **Claim** is one statement: ``UPDATE … WHERE id IN (SELECT … ORDER BY priority
  DESC, id LIMIT n FOR UPDATE SKIP LOCKED) RETURNING …``. Concurrent claimers
  skip each other's locked rows instead of waiting, so every row goes to exactly
  one of them. :meth:`Store.claim_batch` claims several kinds (exec-bound,
  odd-only, local-bound) in that one statement, each a materialised CTE that
  excludes the rows of the ones before it. A claim increments ``attempts``.
- **Outcomes are fenced.** :meth:`Store.finish` (and ``complete``/``fail``/
  ``requeue`` given a :class:`QueueItem`) touches a row only while it is still
  ``claimed`` by the same backend with the same ``attempts``: an outcome that
  arrives after the row was requeued (a stale heartbeat, a lost reply) and
  claimed again, by anyone, changes nothing. Retrying an outcome is therefore
  always safe.
- **Backends** heartbeat in ``backends``. :meth:`Store.requeue_stale` deletes the
  backends whose heartbeat is older than a threshold and returns their rows to
  ``new`` in one statement; concurrent sweeps requeue each row once.
  :meth:`Store.return_claimed` returns a live backend's rows (shutdown; or the
  rows of a claim whose reply was lost, via ``keep``).

Failures. A broken connection or an unreachable server makes the call raise
:class:`StoreUnavailable` (the pool replaces broken connections; the call may or
may not have taken effect). Callers retry after a short back-off; fencing and
``return_claimed(keep=…)`` make every retry safe, so nothing is lost or done
twice across a database restart.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, TypeVar

import attrs
import psycopg
import trio
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import TupleRow
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool

from trio_broker.core.errors import StoreUnavailable
from trio_broker.trio.schema import Migration, apply_migrations, load_migrations

__all__ = [
    "ClaimRequest",
    "NewItem",
    "Outcome",
    "QueueCounts",
    "QueueItem",
    "Store",
    "StoreStatistics",
    "StoreUnavailable",
    "describe_dsn",
    "open_store",
]

log = logging.getLogger("trio_broker.trio.store")

T = TypeVar("T")
Connection = psycopg.Connection[TupleRow]

PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1
ERROR_CHECK_INTERVAL = 1.0
"""After a connection error the idle pooled connections are checked, at most this often."""


# -- values --------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class QueueItem:
    """One row of ``file_queue``.

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


@attrs.frozen(kw_only=True)
class NewItem:
    """An item to enqueue (:meth:`Store.enqueue_many`)."""

    file_ref: str
    action: str
    priority: int = 0
    payload: Mapping[str, Any] = attrs.field(factory=dict)
    start_after: datetime.datetime | None = None


@attrs.frozen(kw_only=True)
class ClaimRequest:
    """One kind of item a claim asks for (:meth:`Store.claim_batch`).

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
    """How one claimed item ended (:meth:`Store.finish`).

    Attributes:
        item_id, attempts: the claim this outcome belongs to (the fence).
        kind: ``complete`` (the row is deleted), ``requeue`` (new again after
            ``delay`` seconds) or ``fail`` (status ``failed``).
        delay: seconds before a requeued item may be claimed again.
        error: stored in ``last_error`` (``fail``; ``requeue`` when given).
    """

    item_id: int
    attempts: int
    kind: Literal["complete", "requeue", "fail"]
    delay: float = 0.0
    error: str | None = None


@attrs.frozen(kw_only=True)
class QueueCounts:
    """How many rows of ``file_queue`` are in each state.

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


# -- SQL -----------------------------------------------------------------------------------

_ITEM_COLUMNS = sql.SQL(
    "id, file_ref, action, priority, payload, attempts, status, claimed_by, last_error"
)
_RETURNING_ITEM = sql.SQL(
    "q.id, q.file_ref, q.action, q.priority, q.payload, q.attempts, q.status,"
    " q.claimed_by, q.last_error"
)

_FINISH = sql.SQL("""
WITH done AS (
    DELETE FROM file_queue q
     USING unnest(%(c_ids)s::bigint[], %(c_attempts)s::integer[]) AS d(id, attempts)
     WHERE q.id = d.id AND q.attempts = d.attempts
       AND q.status = 'claimed' AND q.claimed_by = %(backend)s
    RETURNING q.id
), back AS (
    UPDATE file_queue q
       SET status = d.status,
           claimed_by = NULL,
           claimed_at = NULL,
           start_after = now() + d.delay * interval '1 second',
           last_error = coalesce(d.error, q.last_error)
      FROM unnest(%(o_ids)s::bigint[], %(o_attempts)s::integer[], %(o_status)s::text[],
                  %(o_delay)s::float8[], %(o_error)s::text[])
           AS d(id, attempts, status, delay, error)
     WHERE q.id = d.id AND q.attempts = d.attempts
       AND q.status = 'claimed' AND q.claimed_by = %(backend)s
    RETURNING q.id
)
SELECT id FROM done UNION ALL SELECT id FROM back
""")

_REQUEUE_STALE = sql.SQL("""
WITH stale AS (
    DELETE FROM backends
     WHERE heartbeat < now() - %(threshold)s * interval '1 second'
    RETURNING backend_id
)
UPDATE file_queue q
   SET status = 'new',
       claimed_by = NULL,
       claimed_at = NULL,
       start_after = now(),
       last_error = 'requeued: backend ' || q.claimed_by || ' stopped heartbeating'
 WHERE q.status = 'claimed'
   AND (q.claimed_by IN (SELECT backend_id FROM stale)
        OR NOT EXISTS (SELECT 1 FROM backends b WHERE b.backend_id = q.claimed_by))
RETURNING q.id
""")

_ClaimShape = tuple[tuple[bool, bool], ...]


def _claim_query(shape: _ClaimShape) -> sql.Composed:
    """The claim statement for branches of shape ``(has_actions, odd_only)``.

    Parameters, in order: per branch its actions (when it has them) and its
    limit; then the backend id.
    """
    ctes: list[sql.Composable] = []
    for i, (has_actions, odd_only) in enumerate(shape):
        conditions: list[sql.Composable] = [sql.SQL("status = 'new' AND start_after <= now()")]
        if has_actions:
            conditions.append(sql.SQL("action = ANY(%s::text[])"))
        if odd_only:
            conditions.append(sql.SQL("priority %% 2 <> 0"))
        for j in range(i):
            conditions.append(
                sql.SQL("id NOT IN (SELECT id FROM {})").format(sql.Identifier(f"c{j}"))
            )
        ctes.append(
            sql.SQL(
                "{} AS MATERIALIZED (SELECT id FROM file_queue WHERE {}"
                " ORDER BY priority DESC, id LIMIT %s FOR UPDATE SKIP LOCKED)"
            ).format(sql.Identifier(f"c{i}"), sql.SQL(" AND ").join(conditions))
        )
    picked = sql.SQL(" UNION ALL ").join(
        sql.SQL("SELECT id FROM {}").format(sql.Identifier(f"c{i}")) for i in range(len(shape))
    )
    return sql.SQL(
        "WITH {ctes} UPDATE file_queue q"
        " SET status = 'claimed', claimed_by = %s, claimed_at = now(), attempts = q.attempts + 1"
        " WHERE q.id IN ({picked})"
        " RETURNING {columns}"
    ).format(ctes=sql.SQL(", ").join(ctes), picked=picked, columns=_RETURNING_ITEM)


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
    )


def _check_priority(priority: int) -> None:
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise ValueError(f"priority must be a 32-bit signed integer, got {priority}")


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

    def __init__(self, dsn: str, *, pool_size: int = 10, connect_timeout: float = 5.0) -> None:
        """Create the store; :meth:`open` connects.

        Args:
            dsn: a libpq connection string or URL.
            pool_size: connections (and worker threads) at most.
            connect_timeout: seconds a call waits for a pooled connection (and a
                new connection for the server) before it raises
                :class:`StoreUnavailable`.
        """
        if pool_size < 1:
            raise ValueError(f"pool_size must be at least 1, got {pool_size}")
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
            reconnect_timeout=24 * 3600.0,
        )
        self._limiter = trio.CapacityLimiter(pool_size)
        self._calls: Counter[str] = Counter()
        self._unavailable = 0
        self._check_lock = threading.Lock()
        self._last_check = 0.0
        self._claim_queries: dict[_ClaimShape, sql.Composed] = {}

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

    async def call(self, fn: Callable[[Connection], T], *, kind: str = "call") -> T:
        """Run ``fn(connection)`` in a worker thread with a pooled connection.

        For tables beside the queue (the connection is in autocommit mode; open
        ``conn.transaction()`` for several statements). ``fn`` must be short: it
        holds a connection and a thread.

        Raises:
            StoreUnavailable: the server is unreachable or the connection broke.
        """
        self._calls[kind] += 1
        return await trio.to_thread.run_sync(self._call_sync, fn, limiter=self._limiter)

    def _call_sync(self, fn: Callable[[Connection], T]) -> T:
        try:
            with self._pool.connection() as conn:
                return fn(conn)
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
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
        """Add many items in one statement; returns their ids in order."""
        items = list(items)
        for item in items:
            _check_priority(item.priority)
        if not items:
            return []
        params = {
            "refs": [i.file_ref for i in items],
            "actions": [i.action for i in items],
            "priorities": [i.priority for i in items],
            "payloads": [Jsonb(dict(i.payload)) for i in items],
            "starts": [i.start_after for i in items],
        }

        def run(conn: Connection) -> list[int]:
            cur = conn.execute(
                "INSERT INTO file_queue (file_ref, action, priority, payload, start_after)"
                " SELECT r, a, p, j, coalesce(s, now())"
                " FROM unnest(%(refs)s::text[], %(actions)s::text[], %(priorities)s::integer[],"
                " %(payloads)s::jsonb[], %(starts)s::timestamptz[]) WITH ORDINALITY"
                " AS n(r, a, p, j, s, ord) ORDER BY ord"
                " RETURNING id",
                params,
            )
            return [row[0] for row in cur.fetchall()]

        return await self.call(run, kind="enqueue")

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
        shape: _ClaimShape = tuple((r.actions is not None, r.odd_only) for r in requests)
        query = self._claim_queries.get(shape)
        if query is None:
            query = self._claim_queries[shape] = _claim_query(shape)
        params: list[Any] = []
        for r in requests:
            if r.actions is not None:
                params.append(list(r.actions))
            params.append(r.limit)
        params.append(backend_id)

        def run(conn: Connection) -> list[QueueItem]:
            items = [_item(row) for row in conn.execute(query, params).fetchall()]
            items.sort(key=lambda item: (-item.priority, item.id))
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
        }

        def run(conn: Connection) -> set[int]:
            return {row[0] for row in conn.execute(_FINISH, params).fetchall()}

        return await self.call(run, kind="finish")

    async def complete(self, item: QueueItem | int) -> bool:
        """The item is done: its row is deleted. Returns whether it was."""
        if isinstance(item, QueueItem):
            return await self._fenced(item, "complete")

        def run(conn: Connection) -> bool:
            return conn.execute("DELETE FROM file_queue WHERE id = %s", (item,)).rowcount == 1

        return await self.call(run, kind="complete")

    async def fail(self, item: QueueItem | int, error: str) -> bool:
        """The item failed for good: status ``failed``, ``last_error`` = ``error``."""
        if isinstance(item, QueueItem):
            return await self._fenced(item, "fail", error=error)

        def run(conn: Connection) -> bool:
            cur = conn.execute(
                "UPDATE file_queue SET status = 'failed', claimed_by = NULL, claimed_at = NULL,"
                " last_error = %s WHERE id = %s",
                (error, item),
            )
            return cur.rowcount == 1

        return await self.call(run, kind="fail")

    async def requeue(
        self, item: QueueItem | int, delay_s: float, error: str | None = None
    ) -> bool:
        """Make the item claimable again after ``delay_s`` seconds (a failed one too)."""
        if isinstance(item, QueueItem):
            return await self._fenced(item, "requeue", delay=delay_s, error=error)

        def run(conn: Connection) -> bool:
            cur = conn.execute(
                "UPDATE file_queue SET status = 'new', claimed_by = NULL, claimed_at = NULL,"
                " start_after = now() + %s * interval '1 second',"
                " last_error = coalesce(%s, last_error) WHERE id = %s",
                (float(delay_s), error, item),
            )
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
            cur = conn.execute(
                "UPDATE file_queue SET status = 'new', claimed_by = NULL, claimed_at = NULL,"
                " start_after = now()"
                " WHERE status = 'claimed' AND claimed_by = %s AND NOT (id = ANY(%s::bigint[]))",
                (backend_id, keep_ids),
            )
            return cur.rowcount

        return await self.call(run, kind="return_claimed")

    # -- backends --------------------------------------------------------------------------

    async def register_backend(self, backend_id: str, name: str) -> None:
        """Record a backend as started now (again, if it was known)."""

        def run(conn: Connection) -> None:
            conn.execute(
                "INSERT INTO backends (backend_id, name, started, heartbeat)"
                " VALUES (%s, %s, now(), now())"
                " ON CONFLICT (backend_id) DO UPDATE"
                " SET name = EXCLUDED.name, started = now(), heartbeat = now()",
                (backend_id, name),
            )

        await self.call(run, kind="register")

    async def heartbeat(self, backend_id: str, name: str = "") -> bool:
        """Mark the backend alive now.

        A backend that was swept as stale meanwhile is registered again.

        Returns:
            Whether it was still registered (``False``: its rows were requeued
            by a sweep, and its outcomes for them no longer count).
        """

        def run(conn: Connection) -> bool:
            cur = conn.execute(
                "INSERT INTO backends (backend_id, name, started, heartbeat)"
                " VALUES (%s, %s, now(), now())"
                " ON CONFLICT (backend_id) DO UPDATE SET heartbeat = now()"
                " RETURNING (xmax <> 0) AS existed",
                (backend_id, name),
            )
            row = cur.fetchone()
            return bool(row and row[0])

        return await self.call(run, kind="heartbeat")

    async def unregister_backend(self, backend_id: str) -> None:
        """Forget a backend (at shutdown, after :meth:`return_claimed`)."""

        def run(conn: Connection) -> None:
            conn.execute("DELETE FROM backends WHERE backend_id = %s", (backend_id,))

        await self.call(run, kind="unregister")

    async def requeue_stale(self, threshold_s: float) -> int:
        """Requeue the rows of backends silent for more than ``threshold_s`` seconds.

        The stale backends are deleted; rows claimed by a backend that is not
        registered at all are requeued too. Returns how many rows were requeued.
        """

        def run(conn: Connection) -> int:
            return conn.execute(_REQUEUE_STALE, {"threshold": float(threshold_s)}).rowcount

        return await self.call(run, kind="requeue_stale")

    # -- inspection ------------------------------------------------------------------------

    async def counts(self) -> QueueCounts:
        """How many rows are in each state (a full scan: for inspection)."""

        def run(conn: Connection) -> QueueCounts:
            row = conn.execute(
                "SELECT count(*) FILTER (WHERE status = 'new' AND start_after <= now()),"
                " count(*) FILTER (WHERE status = 'new' AND start_after > now()),"
                " count(*) FILTER (WHERE status = 'claimed'),"
                " count(*) FILTER (WHERE status = 'failed')"
                " FROM file_queue"
            ).fetchone()
            assert row is not None
            return QueueCounts(ready=row[0], delayed=row[1], claimed=row[2], failed=row[3])

        return await self.call(run, kind="counts")

    async def item(self, item_id: int) -> QueueItem | None:
        """The row of ``item_id``, or ``None`` once it finished (or never existed)."""

        def run(conn: Connection) -> QueueItem | None:
            row = conn.execute(
                sql.SQL("SELECT {} FROM file_queue WHERE id = %s").format(_ITEM_COLUMNS),
                (item_id,),
            ).fetchone()
            return None if row is None else _item(row)

        return await self.call(run, kind="item")

    async def claimed_by(self, backend_id: str) -> list[QueueItem]:
        """The rows ``backend_id`` holds, by id."""

        def run(conn: Connection) -> list[QueueItem]:
            cur = conn.execute(
                sql.SQL(
                    "SELECT {} FROM file_queue WHERE status = 'claimed' AND claimed_by = %s"
                    " ORDER BY id"
                ).format(_ITEM_COLUMNS),
                (backend_id,),
            )
            return [_item(row) for row in cur.fetchall()]

        return await self.call(run, kind="claimed_by")


@contextlib.asynccontextmanager
async def open_store(
    dsn: str,
    *,
    pool_size: int = 10,
    connect_timeout: float = 5.0,
    migrate: bool = True,
    migrations: Sequence[Migration] = (),
    wait: float | None = None,
) -> AsyncIterator[Store]:
    """Open a :class:`Store`, apply pending migrations, close it at the end.

    Args:
        dsn: a libpq connection string or URL.
        pool_size: connections (and worker threads) at most.
        connect_timeout: seconds a call waits for a connection.
        migrate: apply the library's pending migrations (and ``migrations``) first.
        migrations: an application's own migrations, applied after the library's.
        wait: seconds to wait for the server at start (default: ``connect_timeout``).

    Raises:
        StoreUnavailable: the server could not be reached.
    """
    store = Store(dsn, pool_size=pool_size, connect_timeout=connect_timeout)
    await store.open(wait=wait)
    try:
        if migrate:
            applied = await store.migrate(migrations)
            if applied:
                log.info("applied migrations %s", applied)
        yield store
    finally:
        await store.aclose()
