"""The ``files`` rows of modified and produce-first originals and of manual versions.

Each method is one transaction through the store, like
:class:`~trio_broker_daemons.fylr.files.FileStore`'s: a change that hands a
file on queues its next step in the same transaction, and every write is
fenced by the state it expects, so a replay changes nothing (the decisions are
:mod:`~trio_broker_daemons.fylr.derived`'s).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import attrs
import psycopg
from psycopg.rows import TupleRow
from psycopg.types.json import Jsonb

from trio_broker.trio.store import Store
from trio_broker_daemons.fylr.config import DELIVERED_VERSION
from trio_broker_daemons.fylr.derived import Modification, OwnProduce, ProduceRefused
from trio_broker_daemons.fylr.files import (
    ACTION_METADATA,
    ACTION_PRODUCE,
    ACTION_SYNC,
    FILE_COLUMNS,
    FileRow,
    file_row,
    queue_steps,
)
from trio_broker_daemons.fylr.storage import StoredFile

__all__ = ["DerivedStore", "ManualStored", "NameOf"]

Connection = psycopg.Connection[TupleRow]

NameOf = Callable[[FileRow], tuple[str, str | None, str | None]]
"""A modified original's name, class and first MIME type guess, from its source's row
(called inside the transaction: keep it pure)."""
ManualCheck = Callable[[FileRow, bool], ProduceRefused | None]
"""Whether a manual version may be stored on this original (converted or not)."""

_LOCKED_ORIGINAL: Final = f"SELECT {FILE_COLUMNS} FROM files WHERE id = %s FOR UPDATE"


@attrs.frozen(kw_only=True)
class ManualStored:
    """What storing a manual version did.

    Attributes:
        version: its row.
        replaced_key: the stored bytes of the manual version it replaced (to delete).
    """

    version: FileRow
    replaced_key: str | None


def _not_an_original(row: FileRow | None, file_id: int, what: str) -> ProduceRefused | None:
    if row is None:
        return ProduceRefused(f"{what}: no file {file_id}", status=404)
    if row.kind != "original":
        return ProduceRefused(
            f"{what}: file {file_id} is a version (of original {row.parent_id}), not an original"
        )
    return None


class DerivedStore:
    """The writes of the originals the fylr produces, and of manual versions.

    Every method may raise :class:`~trio_broker.trio.store.StoreUnavailable`.
    """

    def __init__(self, store: Store) -> None:
        self.store = store

    async def create_modified(
        self, source_id: int, modification: Modification, *, priority: int | None, name_of: NameOf
    ) -> FileRow:
        """Record a modified original of ``source_id`` and queue its produce step.

        Args:
            source_id: the original it is made from.
            modification: what it is asked to be.
            priority: of its steps; ``None``: the source's.
            name_of: its name, class and MIME type guess from the source's row.

        Returns:
            The new original (``pending_produce``).

        Raises:
            ProduceRefused: 404 no such file; 400 a version; 409 a source whose
                bytes are not stored (yet).
        """

        def run(conn: Connection) -> FileRow:
            with conn.transaction():
                source = file_row(
                    conn, f"SELECT {FILE_COLUMNS} FROM files WHERE id = %s FOR SHARE", (source_id,)
                )
                refused = _not_an_original(source, source_id, "source")
                if refused is not None:
                    raise refused
                assert source is not None
                if source.status == "pending_produce" or source.storage_key is None:
                    raise ProduceRefused(
                        f"source: original {source_id} has no stored bytes yet (state"
                        f" {source.status}): make it once it is processing or done",
                        status=409,
                    )
                filename, class_name, mimetype = name_of(source)
                steps_priority = source.priority if priority is None else priority
                row = file_row(
                    conn,
                    "INSERT INTO files (kind, filename, class, status, priority, mimetype,"
                    " derived_from, derivation) VALUES ('original', %s, %s, 'pending_produce',"
                    f" %s, %s, %s, %s) RETURNING {FILE_COLUMNS}",
                    (
                        filename,
                        class_name,
                        steps_priority,
                        mimetype,
                        source_id,
                        Jsonb(modification.document()),
                    ),
                )
                assert row is not None
                queue_steps(conn, [(row.id, ACTION_PRODUCE, steps_priority)])
                return row

        return await self.store.call(run, kind="files_create")

    async def end_own_produce(
        self, file_id: int, stored: StoredFile, step: OwnProduce
    ) -> FileRow | None:
        """An original's own produce step stored its bytes: on to metadata (or sync).

        In one transaction, only while the original is still ``pending_produce``:
        a produce-first original's upload becomes its manual version
        ``delivered``; the produced bytes become the original, under its new
        name and class; its metadata step (state ``new``) or its sync is queued.

        Returns:
            The original as it is now; ``None`` when it was not waiting for this
            end (a replay): the caller deletes ``stored``.
        """

        def run(conn: Connection) -> FileRow | None:
            with conn.transaction():
                row = file_row(
                    conn,
                    f"SELECT {FILE_COLUMNS} FROM files WHERE id = %s AND kind = 'original'"
                    " AND status = 'pending_produce' FOR UPDATE",
                    (file_id,),
                )
                if row is None:
                    return None
                if step.delivered and row.storage_key is not None:
                    conn.execute(
                        "INSERT INTO files (kind, parent_id, version, filename, class, status,"
                        " priority, storage_key, size, sha256, mimetype, manual) VALUES"
                        " ('version', %s, %s, %s, %s, 'done', %s, %s, %s, %s, %s, true)",
                        (
                            file_id,
                            DELIVERED_VERSION,
                            row.filename,
                            row.file_class,
                            row.priority,
                            row.storage_key,
                            row.size,
                            row.sha256,
                            row.mimetype,
                        ),
                    )
                status, action = (
                    ("new", ACTION_METADATA) if step.metadata_step else ("sync", ACTION_SYNC)
                )
                ended = file_row(
                    conn,
                    "UPDATE files SET status = %s, filename = %s, class = %s, storage_key = %s,"
                    " size = %s, sha256 = %s, mimetype = coalesce(%s, mimetype), error = NULL,"
                    f" updated_at = now() WHERE id = %s RETURNING {FILE_COLUMNS}",
                    (
                        status,
                        step.filename,
                        step.file_class,
                        stored.key,
                        stored.size,
                        stored.sha256,
                        step.mimetype,
                        file_id,
                    ),
                )
                queue_steps(conn, [(file_id, action, row.priority)])
                return ended

        return await self.store.call(run, kind="files_produce")

    async def store_manual(
        self,
        original_id: int,
        name: str,
        stored: StoredFile,
        *,
        mimetype: str | None,
        check: ManualCheck,
    ) -> ManualStored:
        """Record a manual version of an original (replacing a manual one of that name).

        Args:
            original_id: the original.
            name: the version's name.
            stored: its stored bytes.
            mimetype: what they are labelled with.
            check: whether the original takes it (under the original's row lock).

        Raises:
            ProduceRefused: 404 no such original, 400 a version's id, what
                ``check`` refuses, and 409 for a produced version of that name
                (the configuration no longer makes it: sync the original first).
        """

        def run(conn: Connection) -> ManualStored:
            with conn.transaction():
                original = file_row(conn, _LOCKED_ORIGINAL, (original_id,))
                refused = _not_an_original(original, original_id, "original")
                if refused is not None:
                    raise refused
                assert original is not None
                existing = file_row(
                    conn,
                    f"SELECT {FILE_COLUMNS} FROM files WHERE parent_id = %s AND version = %s",
                    (original_id, name),
                )
                converted = conn.execute(
                    "SELECT 1 FROM files WHERE parent_id = %s AND version = %s AND manual",
                    (original_id, DELIVERED_VERSION),
                ).fetchone()
                refused = check(original, converted is not None)
                if refused is None and existing is not None and not existing.manual:
                    refused = ProduceRefused(
                        f"version {name!r} of original {original_id} was produced by a recipe"
                        " the configuration no longer has: sync the original first",
                        status=409,
                    )
                if refused is not None:
                    raise refused
                values = (stored.key, stored.size, stored.sha256, mimetype)
                if existing is None:
                    row = file_row(
                        conn,
                        "INSERT INTO files (kind, parent_id, version, filename, class, status,"
                        " priority, storage_key, size, sha256, mimetype, manual) VALUES"
                        " ('version', %s, %s, %s, %s, 'done', %s, %s, %s, %s, %s, true)"
                        f" RETURNING {FILE_COLUMNS}",
                        (original_id, name, original.filename, original.file_class,
                         original.priority, *values),
                    )  # fmt: skip
                else:
                    row = file_row(
                        conn,
                        "UPDATE files SET storage_key = %s, size = %s, sha256 = %s, mimetype = %s,"
                        " status = 'done', error = NULL, damage = NULL, checked_at = NULL,"
                        f" updated_at = now() WHERE id = %s RETURNING {FILE_COLUMNS}",
                        (*values, existing.id),
                    )
                assert row is not None
                replaced = None if existing is None else existing.storage_key
                return ManualStored(version=row, replaced_key=replaced)

        return await self.store.call(run, kind="files_manual")

    async def retry_own_produce(self, file_id: int, notice: str | None) -> None:
        """A requeued own produce step: its original stays ``pending_produce``, with
        ``notice`` (why it waits) in its ``error`` meanwhile."""

        def run(conn: Connection) -> None:
            conn.execute(
                "UPDATE files SET error = %s, updated_at = now()"
                " WHERE id = %s AND status = 'pending_produce'",
                (notice, file_id),
            )

        await self.store.call(run, kind="files_move")
