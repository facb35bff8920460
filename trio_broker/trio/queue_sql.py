"""The queue's SQL: its two tables and every statement on them, in one place.

Theory of operation
===================

The library's queue lives in three tables of the database
(:mod:`trio_broker.trio.schema`, migrations ``001_queue.sql`` to
``004_attempts.sql``):

``broker_queue``
    one row per item of work: ``new`` (claimable once ``start_after`` has
    passed), ``claimed`` by one backend (``claimed_by``; ``attempts`` counts the
    claims and fences late outcomes), or ``failed`` (``last_error`` says why). A
    finished item's row is deleted.
``broker_backends``
    one row per backend (a client process draining the queue) with its heartbeat,
    and the view of the installation it published (:mod:`trio_broker.trio.views`).
``broker_attempts``
    one row per claim of a queue row that ended other than complete (migration
    ``004_attempts.sql``): the backend, the execserver instance whose receipt
    came back, when the claim began and ended, the outcome's name, the reason
    and the receipt's decisive line; written by the same statement as the
    outcome (:data:`FINISH`) or the operator's cancel (:data:`CANCEL`), deleted
    with the row. ``broker_queue.waits_because`` is the reason of a row's last
    requeue until its next claim.

This module only *writes* SQL; :mod:`trio_broker.trio.store` runs it (and
:mod:`trio_broker.trio.views` the views' two statements). No other module names
the tables: an application reaches them through the store's methods, or through
the store's ``*_in`` functions that run on its own connection, inside its own
transaction. The application's own tables are its business.

The claim order. :data:`CLAIM_ORDER` is the one definition of which ready row a
claim takes first: the highest priority, then the oldest (lowest id). The claim
statement's ``ORDER BY`` (:func:`order_by`), the position query's "who is ahead"
(:func:`ahead_of`) and the store's sort of a claim's rows (:func:`claim_key`)
are all derived from it, so a position never disagrees with what the
dispatchers will claim. The partial indexes of ``001_queue.sql`` serve that
order.
"""

from __future__ import annotations

from typing import Any, Final

from psycopg import sql

__all__ = [
    "ATTEMPTS_OF",
    "ATTEMPTS_TABLE",
    "ATTEMPT_COLUMNS",
    "BACKENDS_TABLE",
    "CANCEL",
    "CLAIMED_REFS",
    "CLAIM_ORDER",
    "COMPLETE_ID",
    "COUNTS",
    "COUNTS_BY_PRIORITY",
    "DELETE_OF_REFS",
    "DELETE_UNCLAIMED",
    "ENQUEUE",
    "FAILED",
    "FAILED_OF_REFS",
    "FAIL_ID",
    "FINISH",
    "HEARTBEAT",
    "HELD",
    "ITEM_BY_ID",
    "ITEM_COLUMNS",
    "ITEM_STATES",
    "LIVE_BACKENDS",
    "PUBLISH_VIEW",
    "QUEUE_TABLE",
    "READY",
    "READY_AGES",
    "READ_VIEWS",
    "REGISTER_BACKEND",
    "REQUEUE_ID",
    "REQUEUE_STALE",
    "RETURN_CLAIMED",
    "ROWS_OF",
    "TABLES",
    "UNREGISTER_BACKEND",
    "ClaimShape",
    "ahead_of",
    "claim_key",
    "claim_query",
    "list_items_query",
    "order_by",
    "positions_query",
    "ready",
    "requeue_failed_query",
]

QUEUE_TABLE: Final = "broker_queue"
"""The queue's items (migration ``003_broker_names.sql`` renamed it from ``file_queue``)."""
BACKENDS_TABLE: Final = "broker_backends"
"""The backends and their heartbeats (renamed from ``backends`` by the same migration)."""
ATTEMPTS_TABLE: Final = "broker_attempts"
"""Each claim's end (migration ``004_attempts.sql``)."""
TABLES: Final = (QUEUE_TABLE, BACKENDS_TABLE, ATTEMPTS_TABLE)
"""Every table of the library's queue."""

CLAIM_ORDER: Final[tuple[tuple[str, bool], ...]] = (("priority", True), ("id", False))
"""The claim order as ``(column, descending)`` pairs: priority descending, then id."""

# -- the order and the ready rows ----------------------------------------------------------


def _column(alias: str | None, name: str) -> sql.Identifier:
    return sql.Identifier(name) if alias is None else sql.Identifier(alias, name)


def order_by(alias: str | None = None) -> sql.Composed:
    """The claim order as an ``ORDER BY`` list (``priority DESC, id``), columns of ``alias``."""
    return sql.SQL(", ").join(
        sql.SQL("{} DESC").format(_column(alias, name)) if descending else _column(alias, name)
        for name, descending in CLAIM_ORDER
    )


def ahead_of(row: str, of: str) -> sql.Composed:
    """The condition "row ``row`` comes before row ``of`` in the claim order".

    Lexicographic over :data:`CLAIM_ORDER`: for ``priority DESC, id`` it reads
    ``(r.priority > q.priority OR (r.priority = q.priority AND r.id < q.id))``.
    """
    branches: list[sql.Composable] = []
    for i, (name, descending) in enumerate(CLAIM_ORDER):
        terms: list[sql.Composable] = [
            sql.SQL("{} = {}").format(_column(row, equal), _column(of, equal))
            for equal, _ in CLAIM_ORDER[:i]
        ]
        comparison = sql.SQL(" > " if descending else " < ")
        terms.append(comparison.join([_column(row, name), _column(of, name)]))
        branches.append(sql.SQL("({})").format(sql.SQL(" AND ").join(terms)))
    return sql.SQL("({})").format(sql.SQL(" OR ").join(branches))


def claim_key(row: Any) -> tuple[int, ...]:
    """A sort key that puts rows (with the order's attributes: ``priority``, ``id``) in
    claim order."""
    return tuple(
        -getattr(row, name) if descending else getattr(row, name)
        for name, descending in CLAIM_ORDER
    )


def ready(alias: str | None = None) -> sql.Composed:
    """The condition "claimable now" (:data:`READY`) for rows of ``alias``."""
    return sql.SQL("{} = 'new' AND {} <= now()").format(
        _column(alias, "status"), _column(alias, "start_after")
    )


READY: Final = ready()
"""The condition "claimable now": new, and ``start_after`` has passed."""

# -- items ---------------------------------------------------------------------------------

ITEM_COLUMNS: Final = sql.SQL(
    "id, file_ref, action, priority, payload, attempts, status, claimed_by, last_error,"
    " waits_because, start_after, created_at, claimed_at"
)
"""The columns a :class:`~trio_broker.trio.store.QueueItem` is read from, in its order."""
_ITEM_OF_Q = sql.SQL(
    "q.id, q.file_ref, q.action, q.priority, q.payload, q.attempts, q.status,"
    " q.claimed_by, q.last_error, q.waits_because, q.start_after, q.created_at, q.claimed_at"
)

ENQUEUE: Final = sql.SQL(
    "INSERT INTO broker_queue (file_ref, action, priority, payload, start_after)"
    " SELECT r, a, p, j, coalesce(s, now())"
    " FROM unnest(%(refs)s::text[], %(actions)s::text[], %(priorities)s::integer[],"
    " %(payloads)s::jsonb[], %(starts)s::timestamptz[]) WITH ORDINALITY"
    " AS n(r, a, p, j, s, ord) ORDER BY ord"
    " RETURNING id"
)
"""Insert items from parallel arrays, in their order; returns their ids."""

ClaimShape = tuple[tuple[bool, bool], ...]
"""A claim's branches, each ``(has_actions, odd_only)``."""


def claim_query(shape: ClaimShape) -> sql.Composed:
    """The claim statement for branches of shape ``(has_actions, odd_only)``.

    Each branch is a materialised CTE taking the best ready rows (in
    :data:`CLAIM_ORDER`) that the branches before it did not take, locked with
    ``FOR UPDATE SKIP LOCKED``; one ``UPDATE`` claims them all and returns them
    as :data:`ITEM_COLUMNS`.

    Parameters, in order: per branch its actions (when it has them) and its
    limit; then the backend id.
    """
    ctes: list[sql.Composable] = []
    for i, (has_actions, odd_only) in enumerate(shape):
        conditions: list[sql.Composable] = [READY]
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
                "{} AS MATERIALIZED (SELECT id FROM broker_queue WHERE {}"
                " ORDER BY {} LIMIT %s FOR UPDATE SKIP LOCKED)"
            ).format(sql.Identifier(f"c{i}"), sql.SQL(" AND ").join(conditions), order_by())
        )
    picked = sql.SQL(" UNION ALL ").join(
        sql.SQL("SELECT id FROM {}").format(sql.Identifier(f"c{i}")) for i in range(len(shape))
    )
    return sql.SQL(
        "WITH {ctes} UPDATE broker_queue q"
        " SET status = 'claimed', claimed_by = %s, claimed_at = now(), attempts = q.attempts + 1,"
        " waits_because = NULL"
        " WHERE q.id IN ({picked})"
        " RETURNING {columns}"
    ).format(ctes=sql.SQL(", ").join(ctes), picked=picked, columns=_ITEM_OF_Q)


FINISH: Final = sql.SQL("""
WITH old AS (
    SELECT q.id, q.attempts, q.file_ref, q.action, q.claimed_at
      FROM broker_queue q
     WHERE q.id = ANY(%(o_ids)s::bigint[])
       AND q.status = 'claimed' AND q.claimed_by = %(backend)s
), done AS (
    DELETE FROM broker_queue q
     USING unnest(%(c_ids)s::bigint[], %(c_attempts)s::integer[]) AS d(id, attempts)
     WHERE q.id = d.id AND q.attempts = d.attempts
       AND q.status = 'claimed' AND q.claimed_by = %(backend)s
    RETURNING q.id
), back AS (
    UPDATE broker_queue q
       SET status = d.status,
           claimed_by = NULL,
           claimed_at = NULL,
           start_after = now() + d.delay * interval '1 second',
           last_error = coalesce(d.error, q.last_error),
           waits_because = CASE WHEN d.status = 'new' THEN d.error END
      FROM unnest(%(o_ids)s::bigint[], %(o_attempts)s::integer[], %(o_status)s::text[],
                  %(o_delay)s::float8[], %(o_error)s::text[])
           AS d(id, attempts, status, delay, error)
     WHERE q.id = d.id AND q.attempts = d.attempts
       AND q.status = 'claimed' AND q.claimed_by = %(backend)s
    RETURNING q.id
), forgotten AS (
    DELETE FROM broker_attempts a USING done WHERE a.item_id = done.id
), noted AS (
    INSERT INTO broker_attempts (item_id, attempt, file_ref, action, backend_id, instance_id,
                                 started_at, ended_at, outcome, reason, decisive_line)
    SELECT old.id, old.attempts, old.file_ref, old.action, %(backend)s, n.instance,
           coalesce(old.claimed_at, now()), now(), n.outcome, n.error, n.line
      FROM back
      JOIN old ON old.id = back.id
      JOIN unnest(%(o_ids)s::bigint[], %(o_outcome)s::text[], %(o_instance)s::text[],
                  %(o_line)s::text[], %(o_error)s::text[]) AS n(id, outcome, instance, line, error)
        ON n.id = back.id
    ON CONFLICT (item_id, attempt) DO NOTHING
)
SELECT id FROM done UNION ALL SELECT id FROM back
""")
"""Record outcomes of one backend's claims, fenced by ``(id, attempts)``: completes
(``c_*``: deleted, with their attempts) and the others (``o_*``: new again or failed,
each claim's end kept in ``broker_attempts``; a requeued row's error becomes its
``waits_because``). Returns the ids that took effect. Parameters: ``backend``,
``c_ids``, ``c_attempts``, ``o_ids``, ``o_attempts``, ``o_status``, ``o_delay``,
``o_error``, ``o_outcome``, ``o_instance``, ``o_line``."""

COMPLETE_ID: Final = sql.SQL(
    "WITH done AS (DELETE FROM broker_queue WHERE id = %(id)s RETURNING id),"
    " forgotten AS (DELETE FROM broker_attempts WHERE item_id IN (SELECT id FROM done))"
    " SELECT id FROM done"
)
FAIL_ID: Final = sql.SQL(
    "UPDATE broker_queue SET status = 'failed', claimed_by = NULL, claimed_at = NULL,"
    " last_error = %s WHERE id = %s"
)
REQUEUE_ID: Final = sql.SQL(
    "UPDATE broker_queue SET status = 'new', claimed_by = NULL, claimed_at = NULL,"
    " start_after = now() + %(delay)s * interval '1 second',"
    " last_error = coalesce(%(error)s, last_error), waits_because = %(error)s"
    " WHERE id = %(id)s"
)
RETURN_CLAIMED: Final = sql.SQL(
    "UPDATE broker_queue SET status = 'new', claimed_by = NULL, claimed_at = NULL,"
    " start_after = now()"
    " WHERE status = 'claimed' AND claimed_by = %s AND NOT (id = ANY(%s::bigint[]))"
)
DELETE_UNCLAIMED: Final = sql.SQL(
    "DELETE FROM broker_queue WHERE action = %s AND status <> 'claimed'"
    " AND file_ref = ANY(%s::text[])"
)
"""Delete the new and failed rows of one action for some files; claimed rows stay."""
CLAIMED_REFS: Final = sql.SQL(
    "SELECT DISTINCT file_ref FROM broker_queue WHERE action = %s AND status = 'claimed'"
    " AND file_ref = ANY(%s::text[])"
)
"""The files (of some) that have a claimed row of one action."""

# -- failed rows ---------------------------------------------------------------------------

_FAILED_COLUMNS = sql.SQL(
    "id, file_ref, action, priority, payload, attempts, last_error, created_at"
)

FAILED: Final = sql.SQL(
    "SELECT {} FROM broker_queue WHERE status = 'failed' ORDER BY id LIMIT %s"
).format(_FAILED_COLUMNS)
"""The failed rows, oldest first, at most ``%s`` of them."""


def requeue_failed_query(with_ids: bool) -> sql.Composed:
    """Put failed rows back to ``new`` (all, or those of ``%(ids)s``), locked in id order.

    ``last_error`` becomes ``%(note)s; it had failed: <reason>``. Returns each
    row as it was (``id, file_ref, action, priority, payload, attempts,
    last_error, created_at``).
    """
    which = sql.SQL(" AND id = ANY(%(ids)s::bigint[])") if with_ids else sql.SQL("")
    return sql.SQL(
        "WITH old AS (SELECT id, last_error FROM broker_queue"
        " WHERE status = 'failed'{which} ORDER BY id FOR UPDATE)"
        " UPDATE broker_queue q SET status = 'new', start_after = now(), claimed_by = NULL,"
        " claimed_at = NULL, waits_because = NULL,"
        " last_error = %(note)s || '; it had failed: ' || coalesce(old.last_error, 'no reason')"
        " FROM old WHERE q.id = old.id"
        " RETURNING q.id, q.file_ref, q.action, q.priority, q.payload, q.attempts,"
        " old.last_error, q.created_at"
    ).format(which=which)


# -- inspection ----------------------------------------------------------------------------

_STATE_COUNTS = sql.SQL(
    "count(*) FILTER (WHERE {ready}),"
    " count(*) FILTER (WHERE status = 'new' AND start_after > now()),"
    " count(*) FILTER (WHERE status = 'claimed'),"
    " count(*) FILTER (WHERE status = 'failed')"
).format(ready=READY)

COUNTS: Final = sql.SQL("SELECT {} FROM broker_queue").format(_STATE_COUNTS)
"""Rows by state: ready, delayed, claimed, failed (one row)."""
COUNTS_BY_PRIORITY: Final = sql.SQL(
    "SELECT priority, {counts},"
    " extract(epoch FROM now() - min(created_at) FILTER (WHERE {ready}))::float8,"
    " min(start_after) FILTER (WHERE status = 'new' AND start_after > now())"
    " FROM broker_queue GROUP BY priority ORDER BY priority DESC"
).format(counts=_STATE_COUNTS, ready=READY)
"""Rows by state per priority (ready, delayed, claimed, failed after the priority), then
the age in seconds of the oldest ready row (since it was enqueued; null without one)
and the soonest ``start_after`` of a delayed row (null without one)."""

READY_AGES: Final = sql.SQL(
    "SELECT priority, bucket, count(*), sum(age) FROM ("
    " SELECT priority, age,"
    " (SELECT count(*) FROM unnest(%(bounds)s::float8[]) AS b(le) WHERE b.le < age)::int"
    " AS bucket"
    " FROM (SELECT priority,"
    " greatest(0, extract(epoch FROM now() - created_at))::float8 AS age"
    " FROM broker_queue WHERE {ready}) AS ready_rows"
    ") AS aged GROUP BY priority, bucket ORDER BY priority DESC, bucket"
).format(ready=READY)
"""The ready rows' ages (seconds since enqueued) per priority, counted into the
buckets of ``%(bounds)s`` (ascending upper bounds; a row goes into the first bound
at or above its age, index ``len(bounds)`` past the last): priority, bucket index,
rows, the sum of their ages."""

ITEM_BY_ID: Final = sql.SQL("SELECT {} FROM broker_queue WHERE id = %s").format(ITEM_COLUMNS)
ROWS_OF: Final = sql.SQL(
    "SELECT {} FROM broker_queue WHERE status = 'claimed' AND claimed_by = %s ORDER BY id"
).format(ITEM_COLUMNS)
"""The rows one backend holds."""
HELD: Final = sql.SQL(
    "SELECT id, attempts FROM broker_queue WHERE status = 'claimed' AND claimed_by = %s"
)
"""The claims one backend holds, as ``(id, attempts)``."""


def positions_query(with_actions: bool) -> sql.Composed:
    """The new and claimed rows of some files (``%(refs)s``), each with its competitors:
    the ready rows ahead of it in :data:`CLAIM_ORDER`, the claimed rows ahead of it
    (held by a dispatcher: running, or waiting for a slot), and, in all, the ready
    rows and the claimed rows.

    With ``with_actions``, only rows of ``%(actions)s`` count, both as the files'
    rows and as their competitors. Returns :data:`ITEM_COLUMNS` and the four counts.
    """

    def actions_of(alias: str) -> sql.Composable:
        if not with_actions:
            return sql.SQL("")
        return sql.SQL(" AND {} = ANY(%(actions)s::text[])").format(_column(alias, "action"))

    return sql.SQL(
        "SELECT {columns},"
        " count(*) FILTER (WHERE {ready} AND {ahead}),"
        " count(*) FILTER (WHERE r.status = 'claimed' AND r.id <> q.id AND {ahead}),"
        " count(*) FILTER (WHERE {ready}),"
        " count(*) FILTER (WHERE r.status = 'claimed')"
        " FROM broker_queue q"
        " LEFT JOIN broker_queue r ON (r.status = 'claimed' OR {ready}){r_actions}"
        " WHERE q.file_ref = ANY(%(refs)s::text[]){q_actions} AND q.status IN ('new', 'claimed')"
        " GROUP BY q.id ORDER BY q.id"
    ).format(
        columns=_ITEM_OF_Q,
        ready=ready("r"),
        r_actions=actions_of("r"),
        ahead=ahead_of("r", "q"),
        q_actions=actions_of("q"),
    )


# -- operators: listing, attempts, cancelling, deleting ------------------------------------

ITEM_STATES: Final = ("ready", "delayed", "claimed", "failed")
"""The states a listing filters by: ``ready`` (new, claimable now), ``delayed`` (new,
``start_after`` ahead), ``claimed``, ``failed``."""

_STATE_CONDITIONS: Final = {
    "ready": READY,
    "delayed": sql.SQL("status = 'new' AND start_after > now()"),
    "claimed": sql.SQL("status = 'claimed'"),
    "failed": sql.SQL("status = 'failed'"),
}


def list_items_query(
    *, states: bool, priorities: bool, actions: bool, older_than: bool, refs: bool
) -> sql.Composed:
    """Rows (:data:`ITEM_COLUMNS`, then the database's now) after the cursor
    ``%(after)s`` by id, at most ``%(limit)s``, with the filters asked for:
    ``%(states)s`` (names of :data:`ITEM_STATES`, any of them), ``%(priorities)s``,
    ``%(actions)s``, ``%(older_than)s`` (seconds since the row was enqueued, at
    least), ``%(refs)s`` (file refs)."""
    conditions: list[sql.Composable] = [sql.SQL("id > %(after)s")]
    if states:
        conditions.append(
            sql.SQL("({})").format(
                sql.SQL(" OR ").join(
                    sql.SQL("({} = ANY(%(states)s::text[]) AND {})").format(
                        sql.Literal(name), condition
                    )
                    for name, condition in _STATE_CONDITIONS.items()
                )
            )
        )
    if priorities:
        conditions.append(sql.SQL("priority = ANY(%(priorities)s::integer[])"))
    if actions:
        conditions.append(sql.SQL("action = ANY(%(actions)s::text[])"))
    if older_than:
        conditions.append(
            sql.SQL("created_at <= now() - %(older_than)s::float8 * interval '1 second'")
        )
    if refs:
        conditions.append(sql.SQL("file_ref = ANY(%(refs)s::text[])"))
    return sql.SQL(
        "SELECT {columns}, now() FROM broker_queue WHERE {conditions} ORDER BY id LIMIT %(limit)s"
    ).format(columns=ITEM_COLUMNS, conditions=sql.SQL(" AND ").join(conditions))


ATTEMPT_COLUMNS: Final = sql.SQL(
    "item_id, attempt, backend_id, instance_id, started_at, ended_at, outcome, reason,"
    " decisive_line"
)
"""The columns an :class:`~trio_broker.trio.store.Attempt` is read from, in its order."""
ATTEMPTS_OF: Final = sql.SQL(
    "SELECT {} FROM broker_attempts WHERE item_id = %s ORDER BY attempt"
).format(ATTEMPT_COLUMNS)
"""The ended claims of one row, first first."""

CANCEL: Final = sql.SQL("""
WITH old AS (
    SELECT id, attempts, file_ref, action, status, claimed_by, claimed_at
      FROM broker_queue
     WHERE id = %(id)s AND status IN ('new', 'claimed')
       FOR UPDATE
), cancelled AS (
    UPDATE broker_queue q
       SET status = 'failed', claimed_by = NULL, claimed_at = NULL, waits_because = NULL,
           last_error = %(note)s
      FROM old WHERE q.id = old.id
), noted AS (
    INSERT INTO broker_attempts (item_id, attempt, file_ref, action, backend_id,
                                 started_at, ended_at, outcome, reason)
    SELECT old.id, old.attempts, old.file_ref, old.action, old.claimed_by,
           coalesce(old.claimed_at, now()), now(), 'cancelled', %(note)s
      FROM old WHERE old.status = 'claimed'
    ON CONFLICT (item_id, attempt) DO NOTHING
)
SELECT id, file_ref, action, status, claimed_by FROM old
""")
"""Cancel one new or claimed row (``%(id)s``): it becomes ``failed`` with ``%(note)s``
(a claimed one's claim ends as a ``cancelled`` attempt; its backend finds the row no
longer held and cancels the job). Returns ``id, file_ref, action, status, claimed_by``
as the row was, or nothing when it was neither new nor claimed."""

FAILED_OF_REFS: Final = sql.SQL(
    "SELECT id FROM broker_queue WHERE status = 'failed' AND file_ref = ANY(%s::text[]) ORDER BY id"
)
"""The ids of the failed rows of some files."""

DELETE_OF_REFS: Final = sql.SQL("""
WITH gone AS (
    DELETE FROM broker_queue WHERE file_ref = ANY(%(refs)s::text[])
    RETURNING id, file_ref, action, status, claimed_by
), forgotten AS (
    DELETE FROM broker_attempts WHERE file_ref = ANY(%(refs)s::text[])
)
SELECT id, file_ref, action, status, claimed_by FROM gone ORDER BY id
""")
"""Delete every row of some files, claimed ones too, and their attempts; returns
``id, file_ref, action, status, claimed_by`` of the rows deleted (a claimed row's
backend finds it no longer held and cancels its job)."""

# -- backends ------------------------------------------------------------------------------

REGISTER_BACKEND: Final = sql.SQL(
    "INSERT INTO broker_backends (backend_id, name, started, heartbeat)"
    " VALUES (%s, %s, now(), now())"
    " ON CONFLICT (backend_id) DO UPDATE"
    " SET name = EXCLUDED.name, started = now(), heartbeat = now()"
)
HEARTBEAT: Final = sql.SQL(
    "INSERT INTO broker_backends (backend_id, name, started, heartbeat)"
    " VALUES (%s, %s, now(), now())"
    " ON CONFLICT (backend_id) DO UPDATE SET heartbeat = now()"
    " RETURNING (xmax <> 0) AS existed"
)
"""Mark a backend alive (registering it again if it was swept); returns whether it existed."""
UNREGISTER_BACKEND: Final = sql.SQL("DELETE FROM broker_backends WHERE backend_id = %s")
LIVE_BACKENDS: Final = sql.SQL(
    "SELECT backend_id FROM broker_backends"
    " WHERE heartbeat >= now() - %s * interval '1 second' ORDER BY backend_id"
)
"""The ids of the backends whose heartbeat is younger than ``%s`` seconds."""

REQUEUE_STALE: Final = sql.SQL("""
WITH stale AS (
    DELETE FROM broker_backends
     WHERE heartbeat < now() - %(threshold)s * interval '1 second'
    RETURNING backend_id
), back AS (
    UPDATE broker_queue q
       SET status = 'new',
           claimed_by = NULL,
           claimed_at = NULL,
           start_after = now(),
           waits_because = NULL,
           last_error = 'requeued: backend ' || q.claimed_by || ' stopped heartbeating'
     WHERE q.status = 'claimed'
       AND (q.claimed_by IN (SELECT backend_id FROM stale)
            OR NOT EXISTS (SELECT 1 FROM broker_backends b WHERE b.backend_id = q.claimed_by))
    RETURNING q.id, q.last_error
), noted AS (
    INSERT INTO broker_attempts (item_id, attempt, file_ref, action, backend_id,
                                 started_at, ended_at, outcome, reason)
    SELECT old.id, old.attempts, old.file_ref, old.action, old.claimed_by,
           coalesce(old.claimed_at, now()), now(), 'stale', back.last_error
      FROM back JOIN broker_queue old ON old.id = back.id
     WHERE old.claimed_by IS NOT NULL
    ON CONFLICT (item_id, attempt) DO NOTHING
)
SELECT id FROM back
""")
"""Delete the backends silent for ``%(threshold)s`` seconds and requeue their rows (and
the rows of backends not registered at all), each claim's end kept as a ``stale``
attempt; returns the ids requeued."""

READ_VIEWS: Final = sql.SQL(
    "SELECT backend_id, name, started, heartbeat, view, view_at, now()"
    " FROM broker_backends ORDER BY started, backend_id"
)
"""Every backend with its published view, oldest registration first, and the database's now."""
PUBLISH_VIEW: Final = sql.SQL(
    "UPDATE broker_backends SET view = %s, view_at = now() WHERE backend_id = %s"
)
