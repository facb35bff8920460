"""The ``copy`` step: a remote original fetched into storage, then on as an upload.

Theory of operation
===================

``PUT /eas/rput`` without ``leave_on_remote`` records the original in state
``copy`` with a ``copy`` step queued (:mod:`~trio_broker_daemons.fylr.remote_api`).
:class:`CopyStep` is that step's action on the dispatcher:

- **local-bound**: fetching is network and disk I/O in this process, no
  execserver job, so the step never holds an execserver slot; it holds one of
  the dispatcher's local slots (``local_workers``, the CPU count, with the
  odd-priority reserve), for at most ``rput.timeout`` between two reads of the
  remote;
- the URL is read through the blocklist
  (:meth:`~trio_broker_daemons.fylr.remote_files.RemoteSources.fetch_into`),
  streamed into storage and hashed on the way, ``max_upload_size`` applied;
  then, in one transaction, the original gets its stored bytes and its next
  step is queued (``metadata``, or ``sync`` when its class has no metadata
  step), exactly as an upload's;
- a remote that answers with a temporary failure raises
  :class:`~trio_broker.core.errors.RetryLater` with the delay its answer asked
  for (``Retry-After``), until it has been failing for ``rput.give_up_after``
  since the copy was queued; anything else, and the give-up, raises
  :class:`~trio_broker_daemons.fylr.remote.RemoteSourceFailed`; a storage error is
  temporary (``retry_delay``).

The dispatcher decides once (the outcome table of
:mod:`trio_broker.core.dispatch`) and :meth:`CopyStep.settle` carries the
decision out: requeued, the file stays ``copy`` with why it waits in its
``error`` (``the remote answered 503 Service Unavailable; asked again in 2 s``);
failed, it ends ``error`` with ``copy: <reason>`` and the queue row stays
``failed`` for an operator to requeue (which restarts the give-up clock).
Every write is fenced by the state ``copy``, so a copy that runs twice keeps
one stored file: the loser deletes its own.
"""

from __future__ import annotations

import contextlib
import logging

import trio

from trio_broker.core.dispatch import Decision
from trio_broker.core.errors import RetryLater, StoreUnavailable, describe
from trio_broker.trio.dispatcher import Action
from trio_broker.trio.store import QueueItem
from trio_broker_daemons.fylr.remote import RemoteSourceFailed
from trio_broker_daemons.fylr.remote_files import ACTION_COPY, RemoteProblem
from trio_broker_daemons.fylr.state import FylrState
from trio_broker_daemons.runtime.logfmt import fields

__all__ = ["CopyStep"]

log = logging.getLogger("trio_broker_daemons.fylr.remote_steps")


class CopyStep:
    """The ``copy`` action of one fylr process.

    Args:
        state: the process's shared state (its ``remote`` reads the URLs).
    """

    def __init__(self, state: FylrState) -> None:
        self.state = state
        self.remote = state.remote

    def actions(self) -> list[Action]:
        """The dispatcher's ``copy`` action: local-bound, settled by :meth:`settle`."""
        return [Action(ACTION_COPY, exec_bound=False, handler=self.copy, settle=self.settle)]

    async def copy(self, item: QueueItem) -> None:
        """Fetch a remote original into storage and queue its next step.

        Raises:
            RetryLater: the remote failed for now (after the delay it asked for),
                or the storage folder failed (after ``retry_delay``).
            RemoteSourceFailed: the remote failed for good, or was given up on.
        """
        state = self.state
        file_id = int(item.file_ref)
        found = await self.remote.files.waiting(file_id, "copy")
        if found is None:  # copied already (a replay), or removed
            state.step(ACTION_COPY, "replayed")
            return
        try:
            stored, content_type = await self.remote.fetch_into(found.source.url)
        except RemoteProblem as exc:
            raise await self.remote.end_of(file_id, exc.problem) from exc
        except OSError as exc:  # the storage's fault, not the remote's
            raise RetryLater(None, f"storage: {describe(exc)}") from exc
        file_class = state.file_class(found.file_class)
        try:
            with trio.CancelScope(shield=True):
                applied = await self.remote.files.copied(
                    file_id,
                    stored,
                    mimetype=content_type if found.mimetype is None else None,
                    metadata_step=file_class is not None and file_class.metadata is not None,
                )
        finally:
            state.storage.settled(stored.key)
        if not applied:
            with contextlib.suppress(OSError):  # else the storage sweep removes it
                await state.storage.delete(stored.key)
        state.step(ACTION_COPY, "ok" if applied else "replayed")
        state.changed(file_id)
        log.info(
            "remote file copied",
            extra=fields(file=file_id, size=stored.size, sha256=stored.sha256, applied=applied),
        )

    async def settle(self, item: QueueItem, decision: Decision) -> None:
        """The dispatcher's one decision on a copy: the file waits (with why) or fails.

        Raises:
            StoreUnavailable: a failure could not be recorded (settled again later).
        """
        verdict = decision.verdict
        file_id = int(item.file_ref)
        if verdict.kind == "complete":
            return
        if verdict.kind == "requeue":
            notice = f"{verdict.error}; asked again in {verdict.delay:g} s"
            with contextlib.suppress(StoreUnavailable):
                await self.state.files.move(file_id, "copy", "copy", notice=notice)
            self.state.step(ACTION_COPY, "requeued")
            self.state.changed(file_id)
            log.info("copy requeued", extra=fields(file=file_id, reason=notice))
            return
        cause = verdict.cause
        reason = str(cause) if isinstance(cause, RemoteSourceFailed) else verdict.error
        await self.state.files.fail_original(file_id, f"copy: {reason}")
        self.state.step(ACTION_COPY, "error")
        self.state.changed(file_id)
        log.warning("copy failed", extra=fields(file=file_id, error=reason))
