"""The local actions on stored files: ``checksum``, ``copy_move`` and ``sync_check``.

Theory of operation
===================

Each is a queue action the dispatcher runs *locally* (no execserver): on its
local semaphore, sized from the CPU count (``local_workers``) with a part kept
for odd (high) priorities, as sync is. One item names one file; an operator
queues them for one file or for all (:mod:`~trio_broker_daemons.fylr.entry_api`,
``trio-broker storage``), at background priority unless told otherwise. A
request replaces an item of the same action still waiting for that file, and
leaves one that runs (:meth:`LocalStore.queue
<trio_broker_daemons.fylr.local_store.LocalStore.queue>`), so one file never has
two of them running. None of them changes a file's state, except that
``sync_check`` hands versions back to the pipeline.

``checksum``
    reads the stored bytes through and hashes them; a size or SHA-256 other than
    the recorded one, or bytes that are gone, marks the row's ``damage`` with
    the reason (:func:`checksum_damage`) and logs a warning; bytes that match
    clear it. ``checked_at`` says when.
``copy_move``
    moves a file's stored bytes to another storage location (the item's
    ``location``, else ``storage_location``), in three steps, each safe to be
    killed after: (1) copy them there under the same name, to a temporary file
    renamed into place once complete and durable, hashing them on the way (a
    copy whose hash is not the recorded one is deleted, the file marked
    damaged, and the step fails); (2) point the row at the copy, only if it still
    names the old key; (3) delete the other copies. Until (2) the row names the
    old copy, which is there; after it, the new one; a reader holding the old
    key finds the file in the other location by its name
    (:meth:`Storage.open_read <trio_broker_daemons.fylr.storage.Storage.open_read>`).
    A kill between the steps leaves a copy too many, never none: the step runs
    again (a killed fylr's items go back to the queue) and, finding the row
    already in the target location, deletes the other copies; a copy the row
    never named is removed by the storage sweep once its grace has passed.
``sync_check``
    looks at every ``done`` version of an original: one whose stored bytes are
    missing, or that ``checksum`` marked damaged, is made again (a produced
    version: back to ``new`` with its produce queued, the original to
    ``produce``); a manual version cannot be, and is marked. The original's
    own bytes missing mark the original.

A failed item (a location not configured, a mismatching copy, a missing file to
move) stays ``failed`` with its reason, for an operator to read and requeue; a
storage error (an unreachable folder, an I/O error) is temporary and the item
runs again after ``retry_delay``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Final

from trio_broker.core.dispatch import Decision
from trio_broker.trio.dispatcher import Action
from trio_broker.trio.store import QueueItem
from trio_broker_daemons.fylr.files import FileRow
from trio_broker_daemons.fylr.local_store import (
    ACTION_CHECKSUM,
    ACTION_COPY_MOVE,
    ACTION_SYNC_CHECK,
    LocalStore,
)
from trio_broker_daemons.fylr.storage import DEFAULT_LOCATION
from trio_broker_daemons.fylr.worker import FileWorker
from trio_broker_daemons.runtime.logfmt import fields

__all__ = [
    "BYTES_MISSING",
    "DamagedBytes",
    "LocalActions",
    "UnknownLocation",
    "checksum_damage",
    "integrity_members",
    "location_of_key",
]

log = logging.getLogger("trio_broker_daemons.fylr.local_actions")

BYTES_MISSING: Final = "its stored bytes are missing"
"""The ``damage`` of a row whose stored bytes are gone."""


class UnknownLocation(ValueError):
    """``copy_move`` was asked for a location this fylr does not configure (a failed item)."""


class DamagedBytes(ValueError):
    """``copy_move`` read bytes that are not the recorded ones (a failed item; the file is
    marked damaged)."""


def checksum_damage(
    recorded_size: int | None, recorded_sha256: str | None, size: int, sha256: str
) -> str | None:
    """What is wrong with stored bytes, from what was recorded and what was read.

    Args:
        recorded_size, recorded_sha256: the row's (``None``: nothing recorded).
        size, sha256: what reading the bytes through gave.

    Returns:
        ``None`` when they match (or nothing was recorded to compare with);
        otherwise one line naming both hashes (and sizes, when they differ).
    """
    if recorded_sha256 is None or recorded_sha256 == sha256:
        return None
    sizes = ""
    if recorded_size is not None and recorded_size != size:
        sizes = f" ({size} bytes, recorded {recorded_size})"
    return (
        f"checksum mismatch: the stored bytes hash to sha256 {sha256}, recorded"
        f" {recorded_sha256}{sizes}"
    )


def location_of_key(key: str | None) -> str | None:
    """The storage location a key names (``default`` without a prefix; ``None``: no key)."""
    if key is None:
        return None
    location, colon, _ = key.partition(":")
    return location if colon else DEFAULT_LOCATION


def integrity_members(row: FileRow) -> dict[str, Any]:
    """A file document's members about its stored bytes and where it came from.

    Returns:
        ``location`` (where its bytes are; ``None`` before they exist),
        ``checked`` (the last checksum run: ``{"at": ISO 8601}``, or ``None``),
        ``damage`` (why its bytes cannot be trusted, else ``None``), ``manual``
        (a version uploaded by hand), and for an original ``derived_from``: its
        source's ``id`` with what was asked (``rotate``, ``crop``, ``format``),
        or ``None``.
    """
    members: dict[str, Any] = {
        "location": location_of_key(row.storage_key),
        "checked": None if row.checked_at is None else {"at": row.checked_at.isoformat()},
        "damage": row.damage,
        "manual": row.manual,
    }
    if row.kind == "original":
        derived = None
        if row.derivation is not None:
            derived = {"id": row.derived_from, **row.derivation}
        members["derived_from"] = derived
    return members


class LocalActions:
    """The three local actions of a fylr process (see the module docstring).

    Args:
        worker: the fylr's file worker (its state, and what a storage error means).
    """

    def __init__(self, worker: FileWorker) -> None:
        self.worker = worker
        self.state = worker.state
        self.storage = worker.storage
        self.store = LocalStore(worker.state.store)

    def actions(self) -> list[Action]:
        """``checksum``, ``copy_move`` and ``sync_check``, local-bound, settled here."""
        return [
            Action(name, exec_bound=False, handler=handler, settle=self.settle)
            for name, handler in (
                (ACTION_CHECKSUM, self.checksum),
                (ACTION_COPY_MOVE, self.copy_move),
                (ACTION_SYNC_CHECK, self.sync_check),
            )
        ]

    async def _missing(self, exc: FileNotFoundError) -> None:
        """A missing file is the storage's fault (temporary: raised here) while a folder
        is unreachable; otherwise it really is missing (the caller decides)."""
        if not await self.storage.available():
            raise self.worker.storage_failed(exc) from exc

    def _changed(self, row: FileRow) -> None:
        self.state.changed(row.parent_id if row.parent_id is not None else row.id)

    # -- checksum ------------------------------------------------------------------------

    async def checksum(self, item: QueueItem) -> None:
        """Hash a file's stored bytes and record whether they are the recorded ones."""
        row = await self.state.files.get(int(item.file_ref))
        if row is None or row.storage_key is None:
            self.state.step(ACTION_CHECKSUM, "replayed")
            return
        key = row.storage_key
        try:
            size, sha256 = await self.storage.digest(key)
            damage = checksum_damage(row.size, row.sha256, size, sha256)
        except FileNotFoundError as exc:
            await self._missing(exc)
            damage = BYTES_MISSING
        except OSError as exc:
            raise self.worker.storage_failed(exc) from exc
        applied = await self.store.record_check(row.id, key, damage)
        self.state.step(ACTION_CHECKSUM, "ok" if applied else "replayed")
        self._changed(row)
        log.log(
            logging.WARNING if damage else logging.INFO,
            "stored bytes damaged" if damage else "checksum matches",
            extra=fields(file=row.id, key=key, damage=damage, applied=applied),
        )

    # -- copy_move -----------------------------------------------------------------------

    def _target(self, item: QueueItem) -> str:
        wanted = item.payload.get("location") or self.state.config.storage_location
        target = str(wanted or DEFAULT_LOCATION)
        if target not in self.storage.roots:
            known = ", ".join(sorted(self.storage.roots))
            raise UnknownLocation(f"copy_move: no storage location {target!r} (here: {known})")
        return target

    async def copy_move(self, item: QueueItem) -> None:
        """Move a file's stored bytes to another location (see the module docstring)."""
        target = self._target(item)
        row = await self.state.files.get(int(item.file_ref))
        if row is None or row.storage_key is None:
            self.state.step(ACTION_COPY_MOVE, "replayed")
            return
        key = row.storage_key
        if self.storage.location_of(key) == target:  # moved already: an interrupted move's copies
            removed = await self.storage.remove_copies(key)
            self.state.step(ACTION_COPY_MOVE, "ok" if removed else "replayed")
            log.info("file in place", extra=fields(file=row.id, key=key, removed=removed))
            return
        try:
            copied = await self.storage.copy_to(key, target)
        except FileNotFoundError as exc:
            await self._missing(exc)
            raise
        except OSError as exc:
            raise self.worker.storage_failed(exc) from exc
        try:
            damage = checksum_damage(row.size, row.sha256, copied.size, copied.sha256)
            if damage is not None:
                with contextlib.suppress(OSError):
                    await self.storage.delete(copied.key)
                await self.store.record_check(row.id, key, damage)
                self._changed(row)
                raise DamagedBytes(f"not moved: {damage}")
            switched = await self.store.switch_key(row.id, key, copied.key)
        finally:
            self.storage.settled(copied.key)
        await self._after_switch(row, copied.key, switched)

    async def _after_switch(self, row: FileRow, new: str, switched: bool) -> None:
        """Delete the copies the row does not name (the old one; or the new one, when the
        row changed meanwhile)."""
        if switched:
            removed = await self.storage.remove_copies(new)
        else:
            now = await self.state.files.get(row.id)
            removed = 0
            if now is None or now.storage_key != new:
                with contextlib.suppress(OSError):
                    removed = int(await self.storage.delete(new))
        self.state.step(ACTION_COPY_MOVE, "ok" if switched else "replayed")
        self._changed(row)
        log.info(
            "file moved" if switched else "file changed while moving: the copy removed",
            extra=fields(file=row.id, old=row.storage_key, new=new, removed=removed),
        )

    # -- sync_check ----------------------------------------------------------------------

    async def sync_check(self, item: QueueItem) -> None:
        """Make again the versions of an original whose stored bytes are missing or damaged."""
        found = await self.state.files.with_versions(int(item.file_ref))
        if found is None:
            self.state.step(ACTION_SYNC_CHECK, "replayed")
            return
        original, versions = found
        missing: dict[int, tuple[str, str]] = {}
        for version in versions:
            if version.status != "done" or version.storage_key is None:
                continue
            if version.damage is not None:
                missing[version.id] = (version.storage_key, version.damage)
            elif not await self._present(version.storage_key):
                missing[version.id] = (version.storage_key, BYTES_MISSING)
        if original.storage_key is not None and not await self._present(original.storage_key):
            await self.store.record_check(original.id, original.storage_key, BYTES_MISSING)
        result = await self.store.sync_check(original.id, missing)
        if result.requeued:
            self.state.wake_dispatcher()
        self.state.step(ACTION_SYNC_CHECK, "ok")
        self.state.changed(original.id)
        log.log(
            logging.WARNING if missing else logging.INFO,
            "versions made again" if result.requeued else "versions checked",
            extra=fields(
                file=original.id,
                checked=len(versions),
                requeued=",".join(result.requeued) or None,
                marked=",".join(result.marked) or None,
                skipped=result.skipped,
            ),
        )

    async def _present(self, key: str) -> bool:
        """Whether a key's bytes are stored (a missing file while a folder is unreachable
        is the storage's fault: temporary)."""
        try:
            if await self.storage.exists(key):
                return True
        except OSError as exc:
            raise self.worker.storage_failed(exc) from exc
        await self._missing(FileNotFoundError(f"the stored file {key} is missing"))
        return False

    # -- settling ------------------------------------------------------------------------

    async def settle(self, item: QueueItem, decision: Decision) -> None:
        """Count the dispatcher's decision on a local action (no file state to move)."""
        verdict = decision.verdict
        if verdict.kind == "complete":
            return
        outcome = "requeued" if verdict.kind == "requeue" else "error"
        self.state.step(item.action, outcome)
        log.log(
            logging.INFO if verdict.kind == "requeue" else logging.WARNING,
            f"{item.action} {'requeued' if verdict.kind == 'requeue' else 'failed'}",
            extra=fields(file=item.file_ref, reason=verdict.error, delay=verdict.delay),
        )
