"""Failed queue rows: shown with their reason, and retried on an operator's word.

Theory of operation
===================

A step fails for good only when its input or its recipe is at fault (the worker
classifies: :mod:`~trio_broker_daemons.fylr.worker`); its ``file_queue`` row then
stays ``failed`` with the reason in ``last_error``, and its file ends ``error``.
:func:`failed_items` lists those rows with the file they belong to (the
inspection document carries them), and :func:`retry_failed` runs them again once
the cause is fixed (``trio-broker fylr requeue --failed``:
:mod:`trio_broker_daemons.commands.requeue`, or
``POST /inspect/system/fylr/requeue``). A retry, in one transaction per call,
puts each row back to ``new`` and its file back to the state its step starts
from:

``metadata``
    the original goes back to ``new`` (its error is cleared);
``produce``
    the version goes back to ``new``, and so do the versions that failed only
    because it had (``source version '…' failed``), down the chain; an original
    that had ended ``done`` goes back to ``produce``;
``sync`` and any other action
    only the row is requeued.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, Final

import attrs
from psycopg import Connection

from trio_broker.trio.store import Store
from trio_broker_daemons.fylr.files import ACTION_METADATA, ACTION_PRODUCE, source_failed

__all__ = ["FAILED_SHOWN", "RetriedItem", "failed_items", "retry_failed"]

FAILED_SHOWN: Final = 100
"""The most failed rows the inspection document lists (the oldest first)."""


@attrs.frozen(kw_only=True)
class RetriedItem:
    """A failed queue row that was put back.

    Attributes:
        id: the queue row.
        action: its action.
        file_ref: the file it works on.
        error: why it had failed.
    """

    id: int
    action: str
    file_ref: str
    error: str | None


def _file_id(file_ref: str) -> int | None:
    return int(file_ref) if file_ref.isascii() and file_ref.isdigit() else None


def _failed_rows(conn: Connection, limit: int) -> list[dict[str, Any]]:
    rows = conn.execute(
        "SELECT q.id, q.action, q.file_ref, q.attempts, q.last_error, q.created_at,"
        " f.kind, f.filename, f.version, f.status, f.parent_id"
        " FROM file_queue q LEFT JOIN files f"
        " ON f.id = CASE WHEN q.file_ref ~ '^[0-9]{1,18}$' THEN q.file_ref::bigint END"
        " WHERE q.status = 'failed' ORDER BY q.id LIMIT %s",
        (limit,),
    ).fetchall()
    items = []
    for row in rows:
        created: datetime = row[5]
        items.append(
            {
                "id": row[0],
                "action": row[1],
                "file_ref": row[2],
                "attempts": row[3],
                "reason": row[4],
                "queued_at": created.isoformat(),
                "file": None
                if row[6] is None
                else {
                    "kind": row[6],
                    "filename": row[7],
                    "version": row[8],
                    "state": row[9],
                    "original": row[10] if row[6] == "version" else _file_id(row[2]),
                },
            }
        )
    return items


async def failed_items(store: Store, *, limit: int = FAILED_SHOWN) -> list[dict[str, Any]]:
    """The failed rows of ``file_queue`` (oldest first), each with its reason and file.

    Returns:
        Per row: ``id``, ``action``, ``file_ref``, ``attempts``, ``reason`` (the
        row's ``last_error``), ``queued_at``, and ``file`` (``kind``,
        ``filename``, ``version``, ``state``, ``original``; ``None`` when the file
        is gone).

    Raises:
        StoreUnavailable: the database could not be read.
    """
    return await store.call(lambda conn: _failed_rows(conn, limit), kind="failed_items")


def _reset_metadata(conn: Connection, file_id: int) -> None:
    conn.execute(
        "UPDATE files SET status = 'new', error = NULL, updated_at = now()"
        " WHERE id = %s AND kind = 'original' AND status IN ('error', 'metadata')",
        (file_id,),
    )


def _reset_produce(conn: Connection, version_id: int) -> None:
    found = conn.execute(
        "SELECT parent_id, version FROM files WHERE id = %s AND kind = 'version'", (version_id,)
    ).fetchone()
    if found is None:
        return
    parent_id, name = found
    original = conn.execute(
        "SELECT status FROM files WHERE id = %s FOR UPDATE", (parent_id,)
    ).fetchone()
    conn.execute(
        "UPDATE files SET status = 'new', error = NULL, updated_at = now()"
        " WHERE id = %s AND status IN ('error', 'produce')",
        (version_id,),
    )
    sources = [name]
    while sources:
        source = sources.pop()
        cur = conn.execute(
            "UPDATE files SET status = 'new', error = NULL, updated_at = now()"
            " WHERE parent_id = %s AND source = %s AND status = 'error' AND error = %s"
            " RETURNING version",
            (parent_id, source, source_failed(source)),
        )
        sources.extend(row[0] for row in cur.fetchall())
    if original is not None and original[0] == "done":
        conn.execute(
            "UPDATE files SET status = 'produce', updated_at = now() WHERE id = %s", (parent_id,)
        )


def _retry(conn: Connection, ids: Sequence[int] | None) -> list[RetriedItem]:
    with conn.transaction():
        query = (
            "SELECT id, action, file_ref, last_error FROM file_queue WHERE status = 'failed'"
            + ("" if ids is None else " AND id = ANY(%s::bigint[])")
            + " ORDER BY id FOR UPDATE"
        )
        rows = conn.execute(query, () if ids is None else (list(ids),)).fetchall()
        retried = []
        for item_id, action, file_ref, error in rows:
            file_id = _file_id(file_ref)
            if file_id is not None and action == ACTION_METADATA:
                _reset_metadata(conn, file_id)
            elif file_id is not None and action == ACTION_PRODUCE:
                _reset_produce(conn, file_id)
            conn.execute(
                "UPDATE file_queue SET status = 'new', start_after = now(), claimed_by = NULL,"
                " claimed_at = NULL, last_error = %s WHERE id = %s",
                (f"requeued by an operator; it had failed: {error}", item_id),
            )
            retried.append(RetriedItem(id=item_id, action=action, file_ref=file_ref, error=error))
        return retried


async def retry_failed(store: Store, *, ids: Sequence[int] | None = None) -> list[RetriedItem]:
    """Put failed rows back into the queue, their files back to where their step starts.

    Args:
        store: the queue database.
        ids: only these rows (``None``: every failed row).

    Returns:
        The rows put back (rows that were not failed are left alone).

    Raises:
        StoreUnavailable: the database could not be reached (then nothing changed,
            or everything did: it is one transaction).
    """
    return await store.call(lambda conn: _retry(conn, ids), kind="retry_failed")
