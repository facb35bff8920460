"""The ``files`` table of the reference fylr daemon: every state change in one transaction.

Theory of operation
===================

The fylr's file worker (:mod:`trio_broker_daemons.fylr.worker`) decides with the pure functions
of :mod:`trio_broker_daemons.fylr.produce`; this module reads and writes what they decide,
through :meth:`Store.call <trio_broker.trio.store.Store.call>` (one pooled connection in
a worker thread per call). Migration ``002_files.sql`` holds the schema.

**A step and the next one commit together.** Each state change that hands the
file on to the next step queues that step in the same transaction (the upload
queues metadata or sync; metadata queues sync; sync queues one produce per
version; a finished version queues the versions made from it), through the
store's :func:`~trio_broker.trio.store.enqueue_in` on this transaction's
connection: the queue's tables are the store's alone. A crash therefore never
leaves a file whose next step is not queued, nor a step queued twice by one
change.

**Steps are replay-safe.** The dispatcher may run a step again (its process was
killed after the work but before the outcome was written; a stale heartbeat
requeued a step that was still running). Every write is conditional on the
state the step started from (``WHERE status IN (…)``, and for a version its
``produce_hash``), so a replay, or a second run racing the first, changes
nothing: the loser learns it from the return value (``applied`` false) and
deletes the file it stored, if any.

**The original's end is decided under its row lock.** Sync and every version's
end lock the original's row (``SELECT … FOR UPDATE``) before they look at the
versions, so two versions ending at once cannot both miss that they were the
last: the second sees the first's commit.

Versions made from another version (``source``) are queued only once their
source is ``done``: by sync when the source is already done, otherwise by the
source's end. A source that ends ``error`` takes every version made from it,
directly or down a chain, to ``error`` too.
"""

from __future__ import annotations

import datetime
import importlib.resources
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Literal, TypeAlias, cast

import attrs
import psycopg
from psycopg.rows import TupleRow
from psycopg.types.json import Jsonb

from trio_broker.trio.schema import Migration, load_migrations
from trio_broker.trio.store import (
    CancelledItem,
    NewItem,
    Store,
    delete_items_in,
    delete_unclaimed_in,
    enqueue_in,
)
from trio_broker_daemons.fylr.produce import (
    FINISHED_STATES,
    FileKind,
    FileState,
    original_done,
    plan_sync,
)
from trio_broker_daemons.fylr.storage import StoredFile

__all__ = [
    "FILE_COLUMNS",
    "FYLR_SCOPE",
    "FileRow",
    "FileStore",
    "FilesDeleted",
    "ProduceStart",
    "SyncResult",
    "VersionEnd",
    "WantedVersion",
    "file_row",
    "fylr_migrations",
    "queue_steps",
]

Connection: TypeAlias = psycopg.Connection[TupleRow]

ACTION_METADATA: Final = "metadata"
ACTION_SYNC: Final = "sync"
ACTION_PRODUCE: Final = "produce"

_COLUMNS: Final = (
    "id, kind, parent_id, version, source, filename, class, status, priority, storage_key,"
    " size, sha256, mimetype, metadata, produce_hash, error, created_at, updated_at,"
    " manual, derived_from, derivation, checked_at, damage"
)


@attrs.frozen(kw_only=True)
class FileRow:
    """One row of ``files`` (see ``002_files.sql``).

    Attributes:
        id: the file's id (what the API calls it; ``file_ref`` of its queue rows).
        kind: ``original`` or ``version``.
        parent_id: a version's original; ``None`` for an original.
        version: a version's name; ``None`` for an original.
        source: the version it is made from; ``None`` = from the original.
        filename: the uploaded file's name (a version keeps its original's).
        file_class: the class it was classified into, or ``None``.
        status: the internal state (:data:`trio_broker_daemons.fylr.produce.STATES`).
        priority: the queue priority of its steps.
        storage_key: where its content is stored, once stored.
        size, sha256: of the stored content.
        mimetype: what the content is labelled with.
        metadata: technical metadata (an original's metadata step; a version's
            recipe and produce receipt).
        produce_hash: a version's recipe and input identity.
        error: why it failed (or, for an original whose metadata step failed,
            why there is no metadata).
        created_at, updated_at: timestamps.
        manual: a version uploaded by hand (or a produce-first upload as delivered):
            no produce hash, never touched by a sync.
        derived_from: a modified original's source original.
        derivation: what a modified original was asked to be (rotate, crop, format).
        checked_at: when the checksum action last read its stored bytes.
        damage: why its stored bytes cannot be trusted, or ``None``.
    """

    id: int
    kind: FileKind
    parent_id: int | None
    version: str | None
    source: str | None
    filename: str
    file_class: str | None
    status: FileState
    priority: int
    storage_key: str | None
    size: int | None
    sha256: str | None
    mimetype: str | None
    metadata: Mapping[str, Any]
    produce_hash: str | None
    error: str | None
    created_at: datetime.datetime
    updated_at: datetime.datetime
    manual: bool = False
    derived_from: int | None = None
    derivation: Mapping[str, Any] | None = None
    checked_at: datetime.datetime | None = None
    damage: str | None = None

    @property
    def finished(self) -> bool:
        """Whether the row is ``done`` or ``error``."""
        return self.status in FINISHED_STATES


@attrs.frozen(kw_only=True)
class FilesDeleted:
    """What :meth:`FileStore.delete_original` removed.

    Attributes:
        rows: the original and its versions, as they were.
        queue: the queue rows of those files that were deleted with them
            (claimed ones included: their backends cancel their jobs).
    """

    rows: tuple[FileRow, ...]
    queue: tuple[CancelledItem, ...]

    @property
    def storage_keys(self) -> list[str]:
        """The stored files the rows referenced."""
        return [row.storage_key for row in self.rows if row.storage_key is not None]


@attrs.frozen(kw_only=True)
class WantedVersion:
    """A version an original should have (what sync compares the rows with).

    Attributes:
        produce_hash: its recipe and input identity.
        source: the version it is made from, ``None`` for the original.
        mimetype: the configured MIME type, if any.
    """

    produce_hash: str
    source: str | None
    mimetype: str | None = None


Decide: TypeAlias = Callable[[FileRow], tuple[str | None, Mapping[str, WantedVersion]]]
"""Sync's view of the configuration: an original → its class and wanted versions,
in production order (sources first). Called inside the transaction: keep it pure."""


@attrs.frozen(kw_only=True)
class SyncResult:
    """What one sync did to an original.

    Attributes:
        created, kept, removed: version names, as
            :class:`~trio_broker_daemons.fylr.produce.SyncPlan`.
        queued: the created versions whose produce was queued now.
        removed_keys: storage keys of the removed rows' content, to delete.
        status: the original's state afterwards (``produce`` or ``done``).
    """

    created: tuple[str, ...]
    kept: tuple[str, ...]
    removed: tuple[str, ...]
    queued: tuple[str, ...]
    removed_keys: tuple[str, ...]
    status: FileState


@attrs.frozen(kw_only=True)
class ProduceStart:
    """A version's produce step, as :meth:`FileStore.begin_produce` found it.

    Attributes:
        version: the version row (now ``produce``).
        original: its original.
        source_key: the storage key of the content to produce it from; ``None``
            for a version made from an original left on its remote (its URL is
            read instead).
    """

    version: FileRow
    original: FileRow
    source_key: str | None


@attrs.frozen(kw_only=True)
class VersionEnd:
    """What :meth:`FileStore.end_version` changed.

    Attributes:
        applied: whether the version was still waiting for this end (``False``:
            a replay, a removed version, or another recipe meanwhile).
        original_id: the version's original (``None`` when the row is gone).
        original_done: whether the original is ``done`` now.
        queued: versions made from this one whose produce was queued now.
        failed: versions made from this one (down the chain) that failed with it.
    """

    applied: bool
    original_id: int | None
    original_done: bool = False
    queued: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()


_WIDTH: Final = len(_COLUMNS.split(","))
_VERSION_COLUMNS: Final = ", ".join(f"v.{c.strip()}" for c in _COLUMNS.split(","))
_ORIGINAL_COLUMNS: Final = ", ".join(f"o.{c.strip()}" for c in _COLUMNS.split(","))


def _row(values: Sequence[Any]) -> FileRow:
    return FileRow(
        id=values[0],
        kind=values[1],
        parent_id=values[2],
        version=values[3],
        source=values[4],
        filename=values[5],
        file_class=values[6],
        status=values[7],
        priority=values[8],
        storage_key=values[9],
        size=values[10],
        sha256=values[11],
        mimetype=values[12],
        metadata=values[13] if values[13] is not None else {},
        produce_hash=values[14],
        error=values[15],
        created_at=values[16],
        updated_at=values[17],
        manual=values[18],
        derived_from=values[19],
        derivation=values[20],
        checked_at=values[21],
        damage=values[22],
    )


def _one(conn: Connection, query: str, params: Sequence[Any] | Mapping[str, Any]) -> FileRow | None:
    row = conn.execute(cast(Any, query), params).fetchone()
    return None if row is None else _row(row)


def _enqueue(conn: Connection, items: Sequence[tuple[int, str, int]]) -> None:
    """Queue steps in the caller's transaction: ``(file id, action, priority)`` each."""
    enqueue_in(conn, [NewItem(file_ref=str(i), action=a, priority=p) for i, a, p in items])


FILE_COLUMNS: Final = _COLUMNS
"""The columns :func:`file_row` reads, for the modules that write ``files`` beside this one."""


def file_row(
    conn: Connection, query: str, params: Sequence[Any] | Mapping[str, Any]
) -> FileRow | None:
    """The one row a statement selecting :data:`FILE_COLUMNS` returns, or ``None``."""
    return _one(conn, query, params)


def queue_steps(conn: Connection, items: Sequence[tuple[int, str, int]]) -> None:
    """Queue steps in the caller's transaction: ``(file id, action, priority)`` each."""
    _enqueue(conn, items)


FYLR_SCOPE: Final = "fylr"
"""The migration scope of the fylr's own tables (``files``)."""


def fylr_migrations() -> list[Migration]:
    """The fylr's schema migrations, applied after the queue's (``open_store(migrations=)``)."""
    folder = importlib.resources.files("trio_broker_daemons.fylr").joinpath("migrations")
    return load_migrations(folder, scope=FYLR_SCOPE)


def source_failed(source: str) -> str:
    """The error of a version whose source version failed."""
    return f"source version {source!r} failed"


class FileStore:
    """The ``files`` table, through a :class:`~trio_broker.trio.store.Store`.

    Every method is one database call (one transaction at most) and may raise
    :class:`~trio_broker.trio.store.StoreUnavailable`.
    """

    def __init__(self, store: Store) -> None:
        self.store = store

    # -- reading -----------------------------------------------------------------------

    async def get(self, file_id: int) -> FileRow | None:
        """The row of ``file_id``, or ``None``."""

        def run(conn: Connection) -> FileRow | None:
            return _one(conn, f"SELECT {_COLUMNS} FROM files WHERE id = %s", (file_id,))

        return await self.store.call(run, kind="files_get")

    async def get_many(self, file_ids: Sequence[int]) -> dict[int, FileRow]:
        """The rows of ``file_ids`` that exist, by id (one statement)."""

        def run(conn: Connection) -> dict[int, FileRow]:
            found = conn.execute(
                f"SELECT {_COLUMNS} FROM files WHERE id = ANY(%s::bigint[])", (list(file_ids),)
            ).fetchall()
            return {row.id: row for row in map(_row, found)}

        return await self.store.call(run, kind="files_get_many")

    async def with_versions(self, file_id: int) -> tuple[FileRow, list[FileRow]] | None:
        """A row and, for an original, its versions by id; ``None`` for an unknown id."""

        def run(conn: Connection) -> tuple[FileRow, list[FileRow]] | None:
            # one statement, one snapshot: the row and (an original's) versions; a
            # version's parent_id names its original, never another version
            cur = conn.execute(
                f"SELECT {_COLUMNS} FROM files WHERE id = %s OR parent_id = %s ORDER BY id",
                (file_id, file_id),
            )
            found = [_row(r) for r in cur.fetchall()]
            if not found or found[0].id != file_id:
                return None
            return found[0], found[1:]

        return await self.store.call(run, kind="files_get")

    async def version_of(self, original_id: int, name: str) -> FileRow | None:
        """The version ``name`` of an original, or ``None``."""

        def run(conn: Connection) -> FileRow | None:
            return _one(
                conn,
                f"SELECT {_COLUMNS} FROM files WHERE parent_id = %s AND version = %s",
                (original_id, name),
            )

        return await self.store.call(run, kind="files_get")

    async def page(
        self,
        *,
        before: int | None = None,
        limit: int = 100,
        kinds: Sequence[str] | None = None,
        states: Sequence[str] | None = None,
        priorities: Sequence[int] | None = None,
        classes: Sequence[str] | None = None,
        older_than_s: float | None = None,
    ) -> list[FileRow]:
        """A page of rows, newest first: the ones below the cursor ``before`` that match.

        Args:
            before: only rows with a smaller id (``None``: from the newest).
            limit: at most this many.
            kinds: only ``original`` or ``version`` rows.
            states: only rows in these internal states.
            priorities: only rows of these priorities.
            classes: only rows of these classes.
            older_than_s: only rows created at least this many seconds ago.
        """
        conditions = ["true"]
        params: dict[str, Any] = {"limit": limit}
        filters: list[tuple[str, str, Any]] = [
            ("before", "id < %(before)s", before),
            ("kinds", "kind = ANY(%(kinds)s::text[])", kinds),
            ("states", "status = ANY(%(states)s::text[])", states),
            ("priorities", "priority = ANY(%(priorities)s::integer[])", priorities),
            ("classes", "class = ANY(%(classes)s::text[])", classes),
            (
                "older_than",
                "created_at <= now() - %(older_than)s::float8 * interval '1 second'",
                older_than_s,
            ),
        ]
        for name, condition, value in filters:
            if value is not None:
                conditions.append(condition)
                params[name] = list(value) if isinstance(value, (list, tuple)) else value
        query = (
            f"SELECT {_COLUMNS} FROM files WHERE {' AND '.join(conditions)}"
            " ORDER BY id DESC LIMIT %(limit)s"
        )

        def run(conn: Connection) -> list[FileRow]:
            return [_row(row) for row in conn.execute(query.encode(), params).fetchall()]

        return await self.store.call(run, kind="files_page")

    async def counts(self) -> dict[tuple[str, str], int]:
        """How many rows there are per ``(kind, status)``."""

        def run(conn: Connection) -> dict[tuple[str, str], int]:
            cur = conn.execute("SELECT kind, status, count(*) FROM files GROUP BY kind, status")
            return {(kind, status): count for kind, status, count in cur.fetchall()}

        return await self.store.call(run, kind="files_counts")

    # -- upload ------------------------------------------------------------------------

    async def create_original(
        self,
        *,
        filename: str,
        file_class: str | None,
        priority: int,
        stored: StoredFile,
        mimetype: str | None,
        metadata_step: bool,
        produce_first: bool = False,
    ) -> FileRow:
        """Insert an uploaded original and queue its first step, in one transaction.

        Args:
            filename: the name the client sent.
            file_class: its class, or ``None``.
            priority: the priority of all its steps.
            stored: where its content is.
            mimetype: a first guess (the metadata step may correct it).
            metadata_step: queue ``metadata`` (state ``new``); otherwise ``sync``
                (state ``sync``).
            produce_first: its class converts it first: queue its ``produce``
                (state ``pending_produce``) before either.
        """
        status: FileState = "new" if metadata_step else "sync"
        action = ACTION_METADATA if metadata_step else ACTION_SYNC
        if produce_first:
            status, action = "pending_produce", ACTION_PRODUCE

        def run(conn: Connection) -> FileRow:
            with conn.transaction():
                row = _one(
                    conn,
                    "INSERT INTO files (kind, filename, class, status, priority, storage_key,"
                    " size, sha256, mimetype) VALUES ('original', %s, %s, %s, %s, %s, %s, %s, %s)"
                    f" RETURNING {_COLUMNS}",
                    (
                        filename,
                        file_class,
                        status,
                        priority,
                        stored.key,
                        stored.size,
                        stored.sha256,
                        mimetype,
                    ),
                )
                assert row is not None
                _enqueue(conn, [(row.id, action, priority)])
                return row

        return await self.store.call(run, kind="files_create")

    # -- metadata ----------------------------------------------------------------------

    async def begin_metadata(self, file_id: int) -> FileRow | None:
        """Move an original to ``metadata``; ``None`` when it is past that step."""

        def run(conn: Connection) -> FileRow | None:
            return _one(
                conn,
                "UPDATE files SET status = 'metadata', updated_at = now()"
                " WHERE id = %s AND kind = 'original' AND status IN ('new', 'metadata')"
                f" RETURNING {_COLUMNS}",
                (file_id,),
            )

        return await self.store.call(run, kind="files_metadata")

    async def end_metadata(
        self,
        file_id: int,
        *,
        metadata: Mapping[str, Any],
        mimetype: str | None,
        error: str | None,
    ) -> bool:
        """Store an original's metadata, move it to ``sync`` and queue its sync.

        Args:
            file_id: the original.
            metadata: the technical metadata (``{}`` when the step failed).
            mimetype: replaces the guess when not ``None``.
            error: why the metadata step failed, or ``None``.

        Returns:
            Whether it applied (``False``: the original was past the step).
        """

        def run(conn: Connection) -> bool:
            with conn.transaction():
                row = conn.execute(
                    "UPDATE files SET status = 'sync', metadata = %s,"
                    " mimetype = coalesce(%s, mimetype), error = %s, updated_at = now()"
                    " WHERE id = %s AND kind = 'original' AND status IN ('new', 'metadata')"
                    " RETURNING priority",
                    (Jsonb(dict(metadata)), mimetype, error, file_id),
                ).fetchone()
                if row is None:
                    return False
                _enqueue(conn, [(file_id, ACTION_SYNC, row[0])])
                return True

        return await self.store.call(run, kind="files_metadata")

    # -- generic transitions -------------------------------------------------------------

    async def move(
        self, file_id: int, old: FileState, new: FileState, *, notice: str | None = None
    ) -> bool:
        """Move a row from ``old`` to ``new`` (a requeued step goes back); whether it did.

        ``notice`` (why it waits) is stored in its ``error`` meanwhile; the step's
        end replaces it.
        """

        def run(conn: Connection) -> bool:
            if notice is None:
                cur = conn.execute(
                    "UPDATE files SET status = %s, updated_at = now()"
                    " WHERE id = %s AND status = %s",
                    (new, file_id, old),
                )
            else:
                cur = conn.execute(
                    "UPDATE files SET status = %s, error = %s, updated_at = now()"
                    " WHERE id = %s AND status = %s",
                    (new, notice, file_id, old),
                )
            return cur.rowcount == 1

        return await self.store.call(run, kind="files_move")

    async def fail_original(self, file_id: int, error: str) -> bool:
        """An original's step failed for good: ``error`` unless it already ended."""

        def run(conn: Connection) -> bool:
            cur = conn.execute(
                "UPDATE files SET status = 'error', error = %s, updated_at = now()"
                " WHERE id = %s AND kind = 'original' AND status NOT IN ('done', 'error')",
                (error, file_id),
            )
            return cur.rowcount == 1

        return await self.store.call(run, kind="files_fail")

    async def delete_original(self, file_id: int) -> FilesDeleted | FileRow | None:
        """Delete an original, its versions and their queue rows, in one transaction.

        The stored bytes are the caller's to delete afterwards
        (:attr:`FilesDeleted.storage_keys`; the storage sweep removes whatever is
        left once unreferenced). Claimed queue rows go too: their backends cancel
        the jobs at their next re-check. A modified original made from it keeps
        its own row (``derived_from`` becomes null).

        Returns:
            What was deleted; the row itself when ``file_id`` is a version (nothing
            is deleted: a version goes with its original); ``None`` for an unknown id.
        """

        def run(conn: Connection) -> FilesDeleted | FileRow | None:
            with conn.transaction():
                found = conn.execute(
                    f"SELECT {_COLUMNS} FROM files WHERE id = %s OR parent_id = %s"
                    " ORDER BY id FOR UPDATE",
                    (file_id, file_id),
                ).fetchall()
                rows = [_row(row) for row in found]
                if not rows or rows[0].id != file_id:
                    return None
                if rows[0].kind != "original":
                    return rows[0]
                queue = delete_items_in(conn, [str(row.id) for row in rows])
                conn.execute("DELETE FROM files WHERE id = %s", (file_id,))  # versions cascade
                return FilesDeleted(rows=tuple(rows), queue=tuple(queue))

        return await self.store.call(run, kind="files_delete")

    async def request_sync(self, file_id: int) -> tuple[FileRow | None, bool]:
        """Queue a sync of an original that has passed its metadata step.

        Returns:
            The row as it is now (``None`` for an unknown or non-original id) and
            whether a sync is queued (``True`` also when one already was;
            ``False`` while the original still waits for its metadata step).
        """

        def run(conn: Connection) -> tuple[FileRow | None, bool]:
            with conn.transaction():
                row = _one(
                    conn,
                    f"SELECT {_COLUMNS} FROM files WHERE id = %s AND kind = 'original' FOR UPDATE",
                    (file_id,),
                )
                if row is None:
                    return None, False
                if row.status == "sync":
                    return row, True
                if row.status in ("new", "metadata"):
                    return row, False
                row = _one(
                    conn,
                    "UPDATE files SET status = 'sync', updated_at = now() WHERE id = %s"
                    f" RETURNING {_COLUMNS}",
                    (file_id,),
                )
                assert row is not None
                _enqueue(conn, [(file_id, ACTION_SYNC, row.priority)])
                return row, True

        return await self.store.call(run, kind="files_sync")

    # -- sync --------------------------------------------------------------------------

    async def sync(self, file_id: int, decide: Decide) -> SyncResult | None:
        """Bring an original's version rows in line with what it should have.

        Removes the rows of versions no longer wanted or wanted with another
        produce hash (their unclaimed produce steps too), creates the missing
        ones and queues the produce of those that can start, keeps the rest
        untouched; a manual version is kept, and no version of its name is
        made; the original goes to ``produce``, or ``done`` when every
        version has finished (or there is none). The caller deletes
        ``removed_keys`` from storage afterwards.

        Args:
            file_id: the original (it must be in state ``sync``).
            decide: the original's class and wanted versions.

        Returns:
            What changed; ``None`` when the original is not waiting for a sync.
        """

        def run(conn: Connection) -> SyncResult | None:
            with conn.transaction():
                original = _one(
                    conn,
                    f"SELECT {_COLUMNS} FROM files WHERE id = %s AND kind = 'original' FOR UPDATE",
                    (file_id,),
                )
                if original is None or original.status != "sync":
                    return None
                class_name, wanted = decide(original)
                rows = [
                    _row(r)
                    for r in conn.execute(
                        f"SELECT {_COLUMNS} FROM files WHERE parent_id = %s ORDER BY id FOR UPDATE",
                        (file_id,),
                    ).fetchall()
                ]
                manual = {row.version: row.status for row in rows if row.manual}
                by_name = {row.version: row for row in rows if row.version and not row.manual}
                wanted = {name: w for name, w in wanted.items() if name not in manual}
                plan = plan_sync(
                    {name: row.produce_hash or "" for name, row in by_name.items()},
                    {name: w.produce_hash for name, w in wanted.items()},
                )
                removed = [by_name[name] for name in plan.remove]
                if removed:
                    ids = [row.id for row in removed]
                    conn.execute("DELETE FROM files WHERE id = ANY(%s::bigint[])", (ids,))
                    delete_unclaimed_in(conn, ACTION_PRODUCE, [str(i) for i in ids])
                states: dict[str, FileState] = {
                    **{name: by_name[name].status for name in plan.keep},
                    **{cast(str, name): status for name, status in manual.items()},
                }
                queued: list[str] = []
                to_queue: list[tuple[int, str, int]] = []
                for name in plan.create:
                    want = wanted[name]
                    source_state = "done" if want.source is None else states.get(want.source)
                    failed = source_state is None or source_state == "error"
                    status: FileState = "error" if failed else "new"
                    created = conn.execute(
                        "INSERT INTO files (kind, parent_id, version, source, filename, class,"
                        " status, priority, mimetype, produce_hash, error)"
                        " VALUES ('version', %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) RETURNING id",
                        (
                            file_id,
                            name,
                            want.source,
                            original.filename,
                            class_name,
                            status,
                            original.priority,
                            want.mimetype,
                            want.produce_hash,
                            source_failed(cast(str, want.source)) if failed else None,
                        ),
                    ).fetchone()
                    assert created is not None
                    states[name] = status
                    if source_state == "done":
                        queued.append(name)
                        to_queue.append((created[0], ACTION_PRODUCE, original.priority))
                _enqueue(conn, to_queue)
                final: FileState = "done" if original_done(states.values()) else "produce"
                conn.execute(
                    "UPDATE files SET status = %s, class = %s, updated_at = now() WHERE id = %s",
                    (final, class_name, file_id),
                )
                return SyncResult(
                    created=plan.create,
                    kept=plan.keep,
                    removed=plan.remove,
                    queued=tuple(queued),
                    removed_keys=tuple(row.storage_key for row in removed if row.storage_key),
                    status=final,
                )

        return await self.store.call(run, kind="files_sync")

    # -- produce -----------------------------------------------------------------------

    async def begin_produce(
        self, version_id: int
    ) -> ProduceStart | Literal["gone", "waiting", "source_failed"]:
        """Move a version to ``produce`` and find the content to make it from.

        Returns:
            The start, or why there is nothing to run: ``gone`` (no such version,
            or it already ended), ``waiting`` (its source is not done yet; the
            source's end queues it), ``source_failed`` (its source failed or is
            missing: end it with :func:`source_failed`).
        """

        def run(conn: Connection) -> ProduceStart | Literal["gone", "waiting", "source_failed"]:
            with conn.transaction():
                # the version (locked) and its original, in one statement
                both = conn.execute(
                    f"SELECT {_VERSION_COLUMNS}, {_ORIGINAL_COLUMNS}"
                    " FROM files v JOIN files o ON o.id = v.parent_id"
                    " WHERE v.id = %s AND v.kind = 'version' FOR UPDATE OF v",
                    (version_id,),
                ).fetchone()
                if both is None:
                    return "gone"
                version, original = _row(both[:_WIDTH]), _row(both[_WIDTH:])
                if version.status not in ("new", "produce"):
                    return "gone"
                if version.source is None:
                    key = original.storage_key
                else:
                    source = _one(
                        conn,
                        f"SELECT {_COLUMNS} FROM files WHERE parent_id = %s AND version = %s",
                        (version.parent_id, version.source),
                    )
                    if source is None or source.status == "error":
                        return "source_failed"
                    if source.status != "done":
                        return "waiting"
                    key = source.storage_key
                    assert key is not None
                started = _one(
                    conn,
                    "UPDATE files SET status = 'produce', updated_at = now() WHERE id = %s"
                    f" RETURNING {_COLUMNS}",
                    (version_id,),
                )
                assert started is not None
                return ProduceStart(version=started, original=original, source_key=key)

        return await self.store.call(run, kind="files_produce")

    async def end_version(
        self,
        version_id: int,
        produce_hash: str,
        *,
        stored: StoredFile | None,
        mimetype: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        error: str | None = None,
    ) -> VersionEnd:
        """A version ended: ``done`` with its stored content, or ``error``.

        In one transaction, under the original's row lock: the version's row
        (only while it still waits for an end with this ``produce_hash``), the
        versions made from it (queued when it is done; failed, down the chain,
        when it failed), and the original (``done`` once every version ended).

        Args:
            version_id: the version.
            produce_hash: the recipe it was produced for (a fence).
            stored: the rendition (``None``: the version failed).
            mimetype: the rendition's MIME type (done only).
            metadata: stored as the version's metadata.
            error: why it failed (failed only).
        """

        def run(conn: Connection) -> VersionEnd:
            with conn.transaction():
                # the version's name and its original, locked (one statement)
                found = conn.execute(
                    "SELECT v.parent_id, v.version, o.status, o.priority"
                    " FROM files v JOIN files o ON o.id = v.parent_id"
                    " WHERE v.id = %s AND v.kind = 'version' FOR UPDATE OF o",
                    (version_id,),
                ).fetchone()
                if found is None:
                    return VersionEnd(applied=False, original_id=None)
                parent_id, name, original_status, priority = found
                params = {
                    "id": version_id,
                    "hash": produce_hash,
                    "status": "done" if stored is not None else "error",
                    "key": stored.key if stored else None,
                    "size": stored.size if stored else None,
                    "sha256": stored.sha256 if stored else None,
                    "mimetype": mimetype,
                    "metadata": Jsonb(dict(metadata or {})),
                    "error": error,
                }
                ended = conn.execute(
                    "UPDATE files SET status = %(status)s, storage_key = %(key)s, size = %(size)s,"
                    " sha256 = %(sha256)s, mimetype = coalesce(%(mimetype)s, mimetype),"
                    " metadata = %(metadata)s, error = %(error)s, updated_at = now()"
                    " WHERE id = %(id)s AND status IN ('new', 'produce')"
                    " AND produce_hash = %(hash)s",
                    params,
                ).rowcount
                if ended != 1:
                    return VersionEnd(applied=False, original_id=parent_id)
                queued: list[str] = []
                failed: list[str] = []
                if stored is not None:
                    dependents = conn.execute(
                        "SELECT id, version FROM files"
                        " WHERE parent_id = %s AND source = %s AND status = 'new' ORDER BY id",
                        (parent_id, name),
                    ).fetchall()
                    _enqueue(conn, [(row[0], ACTION_PRODUCE, priority) for row in dependents])
                    queued = [row[1] for row in dependents]
                else:
                    sources = [name]
                    while sources:
                        source = sources.pop()
                        cur = conn.execute(
                            "UPDATE files SET status = 'error', error = %s, updated_at = now()"
                            " WHERE parent_id = %s AND source = %s AND status IN ('new', 'produce')"
                            " RETURNING version",
                            (source_failed(source), parent_id, source),
                        )
                        names = [row[0] for row in cur.fetchall()]
                        failed.extend(names)
                        sources.extend(names)
                done = False
                if original_status == "produce":
                    # done once no version is left unfinished (original_done, in SQL);
                    # an original left on its remote goes back to sync, which checks
                    # that its URL still answers before it is done
                    final = conn.execute(
                        "UPDATE files SET status = CASE WHEN EXISTS (SELECT 1 FROM"
                        " remote_sources r WHERE r.file_id = files.id AND r.leave_on_remote)"
                        " THEN 'sync' ELSE 'done' END, updated_at = now()"
                        " WHERE id = %s AND NOT EXISTS (SELECT 1 FROM files"
                        " WHERE parent_id = %s AND status NOT IN ('done', 'error'))"
                        " RETURNING status",
                        (parent_id, parent_id),
                    ).fetchone()
                    done = final is not None and final[0] == "done"
                    if final is not None and final[0] == "sync":
                        _enqueue(conn, [(parent_id, ACTION_SYNC, priority)])
                return VersionEnd(
                    applied=True,
                    original_id=parent_id,
                    original_done=done,
                    queued=tuple(queued),
                    failed=tuple(failed),
                )

        return await self.store.call(run, kind="files_version")
