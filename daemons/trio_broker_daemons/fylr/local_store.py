"""What the local actions (``checksum``, ``copy_move``, ``sync_check``) write, and queue.

Each method is one transaction through the store. A result is written only
while the row still holds the stored bytes it was found with (its
``storage_key``): a file moved, made again or removed meanwhile is left as it
is now. The queue's rows are reached through the store's functions only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal, TypeAlias, cast

import attrs
import psycopg
from psycopg.rows import TupleRow

from trio_broker.trio.store import (
    NewItem,
    Store,
    claimed_in,
    delete_unclaimed_in,
    enqueue_in,
)
from trio_broker_daemons.fylr.files import ACTION_PRODUCE, queue_steps, source_failed

__all__ = [
    "ACTION_CHECKSUM",
    "ACTION_COPY_MOVE",
    "ACTION_SYNC_CHECK",
    "LOCAL_ACTIONS",
    "LocalAction",
    "LocalStore",
    "Queued",
    "SyncCheckResult",
]

Connection = psycopg.Connection[TupleRow]
LocalAction: TypeAlias = Literal["checksum", "copy_move", "sync_check"]

ACTION_CHECKSUM: Final = "checksum"
ACTION_COPY_MOVE: Final = "copy_move"
ACTION_SYNC_CHECK: Final = "sync_check"
LOCAL_ACTIONS: Final[tuple[LocalAction, ...]] = ("checksum", "copy_move", "sync_check")
_BATCH: Final = 1000


@attrs.frozen(kw_only=True)
class Queued:
    """What a request for a local action queued.

    Attributes:
        action: the action.
        queued: the file ids whose item is queued now (a waiting one replaced).
        running: the file ids whose item of this action runs already (left alone).
    """

    action: str
    queued: tuple[int, ...]
    running: tuple[int, ...]


@attrs.frozen(kw_only=True)
class SyncCheckResult:
    """What one ``sync_check`` changed.

    Attributes:
        requeued: the produced versions made again (their produce queued, or
            queued by their source's end).
        marked: the manual versions whose bytes are gone (marked ``damage``:
            only a new upload brings them back).
        skipped: why nothing was changed (the original is not ``done`` or
            ``produce``: its versions are the pipeline's business now), or ``None``.
    """

    requeued: tuple[str, ...] = ()
    marked: tuple[str, ...] = ()
    skipped: str | None = None


def _targets(conn: Connection, action: LocalAction, file_id: int) -> list[int]:
    """The files one request names: an original's stored rows (checksum, copy_move)
    or the original itself (sync_check); a version alone, or its original."""
    if action == ACTION_SYNC_CHECK:
        row = conn.execute(
            "SELECT coalesce(parent_id, id) FROM files WHERE id = %s", (file_id,)
        ).fetchone()
        return [] if row is None else [row[0]]
    rows = conn.execute(
        "SELECT id FROM files WHERE (id = %s OR parent_id = %s) AND storage_key IS NOT NULL"
        " ORDER BY id",
        (file_id, file_id),
    ).fetchall()
    return [row[0] for row in rows]


def _all_targets(conn: Connection, action: LocalAction, after: int) -> list[int]:
    """The next batch of every file (by id, past ``after``) an action applies to."""
    kind = "kind = 'original'" if action == ACTION_SYNC_CHECK else "storage_key IS NOT NULL"
    rows = conn.execute(
        f"SELECT id FROM files WHERE {kind} AND id > %s ORDER BY id LIMIT %s",
        (after, _BATCH),
    ).fetchall()
    return [row[0] for row in rows]


def _queue(
    conn: Connection,
    action: LocalAction,
    ids: Sequence[int],
    payload: Mapping[str, Any],
    priority: int,
) -> tuple[list[int], list[int]]:
    """Queue one item per file, replacing a waiting one, leaving a running one."""
    # the files' rows locked, in order: two requests at once queue each file once
    conn.execute(
        "SELECT id FROM files WHERE id = ANY(%s::bigint[]) ORDER BY id FOR UPDATE", (list(ids),)
    )
    refs = [str(i) for i in ids]
    running = claimed_in(conn, action, refs)
    delete_unclaimed_in(conn, action, refs)
    fresh = [i for i in ids if str(i) not in running]
    enqueue_in(
        conn,
        [
            NewItem(file_ref=str(i), action=action, priority=priority, payload=payload)
            for i in fresh
        ],
    )
    return fresh, [i for i in ids if str(i) in running]


class LocalStore:
    """The local actions' writes (see the module docstring).

    Every method may raise :class:`~trio_broker.trio.store.StoreUnavailable`.
    """

    def __init__(self, store: Store) -> None:
        self.store = store

    async def queue(
        self,
        action: LocalAction,
        file_id: int | None,
        *,
        payload: Mapping[str, Any] | None = None,
        priority: int = -2,
    ) -> Queued:
        """Queue an action for one file (an original with its versions) or for all.

        Args:
            action: ``checksum``, ``copy_move`` or ``sync_check``.
            file_id: the file; ``None`` for every file (in transactions of
                :data:`_BATCH` files each).
            payload: the items' payload (``copy_move``: ``{"location": …}``).
            priority: the items' priority (background by default).

        Returns:
            What was queued, and what was left running.
        """
        items = dict(payload or {})

        def one(conn: Connection) -> Queued:
            with conn.transaction():
                queued, running = _queue(
                    conn, action, _targets(conn, action, file_id or 0), items, priority
                )
            return Queued(action=action, queued=tuple(queued), running=tuple(running))

        def every(conn: Connection) -> Queued:
            queued: list[int] = []
            running: list[int] = []
            after = 0
            while True:
                with conn.transaction():
                    ids = _all_targets(conn, action, after)
                    if not ids:
                        break
                    done, busy = _queue(conn, action, ids, items, priority)
                queued += done
                running += busy
                after = ids[-1]
            return Queued(action=action, queued=tuple(queued), running=tuple(running))

        return await self.store.call(one if file_id is not None else every, kind="local_queue")

    async def record_check(self, file_id: int, key: str, damage: str | None) -> bool:
        """Record a checksum run of the bytes at ``key``: ``checked_at`` now and its
        ``damage`` (``None``: they are fine); whether the row still had that key."""

        def run(conn: Connection) -> bool:
            cur = conn.execute(
                "UPDATE files SET checked_at = now(), damage = %s"
                " WHERE id = %s AND storage_key = %s",
                (damage, file_id, key),
            )
            return cur.rowcount == 1

        return await self.store.call(run, kind="local_check")

    async def switch_key(self, file_id: int, old: str, new: str) -> bool:
        """Point a row at its moved bytes (``old`` → ``new``); whether it still named ``old``."""

        def run(conn: Connection) -> bool:
            cur = conn.execute(
                "UPDATE files SET storage_key = %s, updated_at = now()"
                " WHERE id = %s AND storage_key = %s",
                (new, file_id, old),
            )
            return cur.rowcount == 1

        return await self.store.call(run, kind="local_move")

    async def sync_check(
        self, original_id: int, found: Mapping[int, tuple[str, str]]
    ) -> SyncCheckResult:
        """Make again the versions whose stored bytes are missing or damaged.

        In one transaction, under the original's row lock, only while the
        original is ``done`` or ``produce`` and each version still holds the
        bytes it was found with: a produced version goes back to ``new`` (its
        stored key forgotten) and its produce is queued (a version made from one
        that is made again waits for that one's end, which queues it); a manual
        version is marked with the reason; the original goes to ``produce``.

        Args:
            original_id: the original.
            found: version id → (its storage key, why its bytes cannot be used).
        """

        def run(conn: Connection) -> SyncCheckResult:
            with conn.transaction():
                original = conn.execute(
                    "SELECT status, priority FROM files WHERE id = %s AND kind = 'original'"
                    " FOR UPDATE",
                    (original_id,),
                ).fetchone()
                if original is None:
                    return SyncCheckResult(skipped="the original is gone")
                status, priority = original
                if status not in ("done", "produce"):
                    return SyncCheckResult(skipped=f"the original is in state {status}")
                return _remake(conn, original_id, found, priority)

        return await self.store.call(run, kind="local_sync_check")


def _remake(
    conn: Connection, original_id: int, found: Mapping[int, tuple[str, str]], priority: int
) -> SyncCheckResult:
    rows = conn.execute(
        "SELECT id, version, source, manual, storage_key, status FROM files"
        " WHERE parent_id = %s ORDER BY id FOR UPDATE",
        (original_id,),
    ).fetchall()
    by_id = {row[0]: row for row in rows}
    remade: dict[str, int] = {}
    marked: list[str] = []
    for version_id, (key, reason) in found.items():
        row = by_id.get(version_id)
        if row is None or row[4] != key or row[5] != "done":
            continue  # changed meanwhile
        if row[3]:
            conn.execute(
                "UPDATE files SET damage = %s, checked_at = now() WHERE id = %s",
                (reason, version_id),
            )
            marked.append(row[1])
            continue
        conn.execute(
            "UPDATE files SET status = 'new', storage_key = NULL, size = NULL, sha256 = NULL,"
            " damage = NULL, checked_at = NULL, error = NULL, updated_at = now() WHERE id = %s",
            (version_id,),
        )
        remade[row[1]] = version_id
    if remade:
        states = {row[1]: "new" if row[0] in remade.values() else row[5] for row in rows}
        sources = {row[1]: row[2] for row in rows}
        ready, failed = [], []
        for name, version_id in remade.items():
            source = sources[name]
            state = "done" if source is None else states.get(source)
            if state == "done":
                ready.append((version_id, ACTION_PRODUCE, priority))
            elif state is None or state == "error":
                failed.append(version_id)
            # else its source is being made: that one's end queues it
        for version_id in failed:
            name = by_id[version_id][1]
            conn.execute(
                "UPDATE files SET status = 'error', error = %s WHERE id = %s",
                (source_failed(cast(str, sources[name])), version_id),
            )
        queue_steps(conn, ready)
        conn.execute(
            "UPDATE files SET status = CASE WHEN EXISTS (SELECT 1 FROM files WHERE parent_id"
            " = %s AND status NOT IN ('done', 'error')) THEN 'produce' ELSE 'done' END,"
            " updated_at = now() WHERE id = %s",
            (original_id, original_id),
        )
    return SyncCheckResult(requeued=tuple(remade), marked=tuple(marked))
