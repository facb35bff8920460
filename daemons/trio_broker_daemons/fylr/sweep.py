"""The storage sweep: leftovers of killed writers removed, never a live writer's file.

Theory of operation
===================

Several fylrs may share one storage folder and one database. A fylr killed
outright leaves temporary files of unfinished writes, and sometimes a stored file
it wrote but never recorded in a row. :class:`StorageSweeper` removes them, at
start-up and then every :data:`SWEEP_EVERY` × ``stale_after``; each sweep:

1. lists the folder (:meth:`Storage.scan <trio_broker_daemons.fylr.storage.Storage.scan>`);
2. *then* asks the queue's store which backends are alive
   (:meth:`Store.live_backends <trio_broker.trio.store.Store.live_backends>`:
   those whose heartbeat is younger than ``stale_after``). A file seen in step 1 was created
   after its writer registered (a fylr registers before its first write), so a
   live writer of it is in this answer;
3. keeps every file of a live writer, and every file written to less than
   ``grace`` (:data:`GRACE_STALE` × ``stale_after``) ago
   (:func:`~trio_broker_daemons.fylr.storage.abandoned`); of its own files it
   keeps the temporary ones (writes in progress) and the stored ones whose row
   it is still recording (:attr:`Storage.recording
   <trio_broker_daemons.fylr.storage.Storage.recording>`);
4. removes the remaining temporary files, and those remaining stored files whose
   key no row of ``files`` holds.

At start-up, before this process wrote anything, files carrying its own tag
count as abandoned too (a restart with a fixed ``backend_id``: they are an
earlier run's). A sweep that meets an unavailable database removes nothing.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from typing import Final

import attrs
import trio
from psycopg import Connection

from trio_broker.core.errors import StoreUnavailable
from trio_broker.trio.inspection import iso_time
from trio_broker.trio.store import Store
from trio_broker_daemons.fylr.storage import Leftover, Storage, abandoned, writer_tag
from trio_broker_daemons.runtime.logfmt import fields

__all__ = ["GRACE_STALE", "SWEEP_EVERY", "StorageSweeper", "SweepResult"]

log = logging.getLogger("trio_broker_daemons.fylr.sweep")

GRACE_STALE: Final = 2.0
"""A leftover must have gone unwritten for this many ``stale_after``\\ s."""
SWEEP_EVERY: Final = 10.0
"""Sweeps run every this many ``stale_after``\\ s (and at start-up)."""
_KEY_BATCH: Final = 1000


@attrs.frozen(kw_only=True)
class SweepResult:
    """What one sweep did.

    Attributes:
        temporary: temporary files removed.
        orphans: unreferenced stored files removed.
        kept: files seen and left in place (a live writer's, too recent, or
            referenced by a row).
        at: when it ran (``time.time()``).
    """

    temporary: int
    orphans: int
    kept: int
    at: float


def _referenced(conn: Connection, keys: Sequence[str]) -> set[str]:
    rows = conn.execute(
        "SELECT storage_key FROM files WHERE storage_key = ANY(%s::text[])", (list(keys),)
    ).fetchall()
    return {row[0] for row in rows}


class StorageSweeper:
    """Sweeps one storage folder shared with other fylrs (see the module docstring).

    Args:
        storage: the folder, made for this process's backend id.
        store: the shared database.
        stale_after: the backends' stale threshold, in seconds.
    """

    def __init__(self, storage: Storage, store: Store, *, stale_after: float) -> None:
        self.storage = storage
        self.store = store
        self.stale_after = stale_after
        self.grace = GRACE_STALE * stale_after
        self.interval = SWEEP_EVERY * stale_after
        self.last: SweepResult | None = None
        self.temporary_removed = 0
        self.orphans_removed = 0
        self.sweeps = 0
        self._lock = trio.Lock()

    async def sweep(self, *, startup: bool = False) -> SweepResult:
        """Sweep once.

        Args:
            startup: this process has written nothing yet: its own tag's files
                are an earlier run's.

        Raises:
            StoreUnavailable: the database could not be asked (nothing was removed).
        """
        async with self._lock:
            found = await self.storage.scan(time.time())
            live = {writer_tag(b) for b in await self.store.live_backends(self.stale_after)}
            if startup:
                live.discard(self.storage.tag)
            candidates = [f for f in found if self._removable(f, live, startup=startup)]
            temporary = [f for f in candidates if f.kind == "temporary"]
            stored = [f for f in candidates if f.kind == "stored"]
            orphans = await self._unreferenced(stored)
            removed_temporary = await self.storage.remove(temporary)
            removed_orphans = await self.storage.remove(orphans)
            result = SweepResult(
                temporary=removed_temporary,
                orphans=removed_orphans,
                kept=len(found) - removed_temporary - removed_orphans,
                at=time.time(),
            )
            self.last = result
            self.sweeps += 1
            self.temporary_removed += removed_temporary
            self.orphans_removed += removed_orphans
        if removed_temporary or removed_orphans:
            log.info(
                "removed leftovers of killed writers",
                extra=fields(temporary=removed_temporary, orphans=removed_orphans),
            )
        return result

    def _removable(self, leftover: Leftover, live: set[str], *, startup: bool) -> bool:
        own = self.storage
        if leftover.writer != own.tag or startup:
            return abandoned(leftover, live=live, grace=self.grace)
        # this process's own file: a temporary one is a write in progress; a stored
        # one is spared while its row is being recorded
        return (
            leftover.kind == "stored"
            and leftover.age >= self.grace
            and leftover.key not in own.recording
        )

    async def _unreferenced(self, stored: Sequence[Leftover]) -> list[Leftover]:
        orphans: list[Leftover] = []
        for start in range(0, len(stored), _KEY_BATCH):
            batch = stored[start : start + _KEY_BATCH]
            keys = [f.key for f in batch if f.key is not None]
            held = await self.store.call(
                functools.partial(_referenced, keys=keys), kind="sweep_referenced"
            )
            orphans.extend(f for f in batch if f.key not in held)
        return orphans

    async def serve(self) -> None:
        """Sweep every :attr:`interval` seconds until cancelled (errors are logged)."""
        while True:
            await trio.sleep(self.interval)
            try:
                await self.sweep()
            except StoreUnavailable as exc:
                log.info("storage sweep skipped", extra=fields(error=str(exc)))
            except OSError as exc:
                log.warning("storage sweep failed", extra=fields(error=repr(exc)))

    def document(self) -> dict[str, object]:
        """The sweep's part of the inspection document."""
        last = self.last
        return {
            "sweeps": self.sweeps,
            "temporary_removed": self.temporary_removed,
            "orphans_removed": self.orphans_removed,
            "grace_s": self.grace,
            "interval_s": self.interval,
            "last": result_document(last) if last is not None else None,
        }


def result_document(result: SweepResult) -> dict[str, object]:
    """A sweep's result as JSON: its counts, and ``at`` in ISO 8601 (UTC)."""
    return {**attrs.asdict(result), "at": iso_time(result.at)}
