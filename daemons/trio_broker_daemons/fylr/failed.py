"""Failed queue rows: shown with their reason, and retried on an operator's word.

Theory of operation
===================

A step fails for good only when its input or its recipe is at fault (the
dispatcher decides once, from the dispatch core's outcome table, and the
worker's ``settle`` carries the decision out:
:mod:`~trio_broker_daemons.fylr.worker`); its queue row then stays ``failed``
with the reason and the receipt's decisive line, and its file ends ``error``.
:func:`failed_items` lists those rows (the store's
:func:`~trio_broker.trio.store.failed_in`) with the file they belong to (read
from ``files`` on the same connection; the inspection document carries them),
and :func:`retry_failed` runs them again once the cause is fixed
(``trio-broker fylr requeue --failed``:
:mod:`trio_broker_daemons.commands.requeue`, or
``POST /inspect/system/fylr/requeue``). A retry, in one transaction per call,
puts each row back to ``new`` (the store's
:func:`~trio_broker.trio.store.requeue_failed_in`) and its file back to the
state its step starts from:

``metadata``
    the original goes back to ``new`` (its error is cleared);
``produce``
    the version goes back to ``new``, and so do the versions that failed only
    because it had (``source version '…' failed``), down the chain; an original
    that had ended ``done`` goes back to ``produce``; an original whose own
    produce step (a conversion, a modification) had failed goes back to
    ``pending_produce``;
``copy``
    the original goes back to ``copy`` (its error is cleared);
``sync``
    an original left on its remote whose URL had failed goes back to ``sync``
    (any other stayed in ``sync``: only the row is requeued);
any other action
    only the row is requeued.

A file registered by URL also gets its remote's give-up clock started again
(:func:`~trio_broker_daemons.fylr.remote_files.restart_give_up_in`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs
from psycopg import Connection

from trio_broker.trio.store import FailedItem, Store, failed_in, requeue_failed_in
from trio_broker_daemons.fylr.files import (
    ACTION_METADATA,
    ACTION_PRODUCE,
    ACTION_SYNC,
    source_failed,
)
from trio_broker_daemons.fylr.remote_files import ACTION_COPY, restart_give_up_in

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
    """The ``files`` id a queue row's ``file_ref`` names (``None``: not one of ours)."""
    usable = file_ref.isascii() and file_ref.isdigit() and len(file_ref) <= 18
    return int(file_ref) if usable else None


def _files(conn: Connection, ids: Sequence[int]) -> dict[int, tuple[Any, ...]]:
    """``kind, filename, version, status, parent_id`` of the rows of ``files`` by id."""
    rows = conn.execute(
        "SELECT id, kind, filename, version, status, parent_id FROM files"
        " WHERE id = ANY(%s::bigint[])",
        (list(ids),),
    ).fetchall()
    return {row[0]: tuple(row[1:]) for row in rows}


def _document(item: FailedItem, files: Mapping[int, tuple[Any, ...]]) -> dict[str, Any]:
    file_id = _file_id(item.file_ref)
    found = None if file_id is None else files.get(file_id)
    file = None
    if found is not None:
        kind, filename, version, status, parent_id = found
        file = {
            "kind": kind,
            "filename": filename,
            "version": version,
            "state": status,
            "original": parent_id if kind == "version" else file_id,
        }
    return {
        "id": item.id,
        "action": item.action,
        "file_ref": item.file_ref,
        "attempts": item.attempts,
        "reason": item.reason,
        "queued_at": item.created_at.isoformat(),
        "file": file,
    }


def _failed_rows(conn: Connection, limit: int) -> list[dict[str, Any]]:
    items = failed_in(conn, limit=limit)
    ids = [_file_id(item.file_ref) for item in items]
    files = _files(conn, [i for i in ids if i is not None])
    return [_document(item, files) for item in items]


async def failed_items(store: Store, *, limit: int = FAILED_SHOWN) -> list[dict[str, Any]]:
    """The failed queue rows (oldest first), each with its reason and file.

    Returns:
        Per row: ``id``, ``action``, ``file_ref``, ``attempts``, ``reason`` (the
        row's last error), ``queued_at``, and ``file`` (``kind``,
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


def _reset_original(conn: Connection, file_id: int, state: str) -> None:
    """A failed original back to the state its step starts from (copy, sync)."""
    conn.execute(
        "UPDATE files SET status = %s, error = NULL, updated_at = now()"
        " WHERE id = %s AND kind = 'original' AND status = 'error'",
        (state, file_id),
    )


def _reset_produce(conn: Connection, version_id: int) -> None:
    conn.execute(  # an original's own produce step
        "UPDATE files SET status = 'pending_produce', error = NULL, updated_at = now()"
        " WHERE id = %s AND kind = 'original' AND status = 'error'",
        (version_id,),
    )
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
        retried = []
        for item in requeue_failed_in(conn, ids=ids):
            file_id = _file_id(item.file_ref)
            if file_id is not None and item.action == ACTION_METADATA:
                _reset_metadata(conn, file_id)
            elif file_id is not None and item.action == ACTION_PRODUCE:
                _reset_produce(conn, file_id)
            elif file_id is not None and item.action in (ACTION_COPY, ACTION_SYNC):
                _reset_original(conn, file_id, item.action)
            if file_id is not None:
                restart_give_up_in(conn, file_id)
            retried.append(
                RetriedItem(
                    id=item.id, action=item.action, file_ref=item.file_ref, error=item.reason
                )
            )
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
