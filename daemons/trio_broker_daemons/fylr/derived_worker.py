"""The ``produce`` step of an original the fylr makes itself (a conversion, a modification).

A ``produce`` queue row names a version (its rendition) or an original in
``pending_produce`` (:mod:`~trio_broker_daemons.fylr.derived`): :class:`OwnProduceStep`
takes the action from :class:`~trio_broker_daemons.fylr.worker.FileWorker`,
runs the original's own step, and hands every version's step on to it.

The original's step reads its input (the upload as delivered, or the source
original of a modification) through an in-pipe and writes the original through
an out-pipe into storage, as a version's produce does
(:meth:`FileWorker.produce_into_storage
<trio_broker_daemons.fylr.worker.FileWorker.produce_into_storage>`); its end
(:meth:`DerivedStore.end_own_produce
<trio_broker_daemons.fylr.derived_store.DerivedStore.end_own_produce>`) hands
the original on to its metadata step or its sync. The dispatcher's one decision
about it is settled here too: requeued, the original stays ``pending_produce``
(a service nobody offers with its notice in ``error``); failed, it ends
``error`` with ``produce: <reason>`` (a failed job's decisive line), and
``trio-broker fylr requeue --failed`` puts it back.
"""

from __future__ import annotations

import contextlib
import logging

from trio_broker.core.dispatch import Decision
from trio_broker.core.endings import JobFailed
from trio_broker.trio.dispatcher import Action
from trio_broker.trio.store import QueueItem
from trio_broker_daemons.fylr.derived import OwnProduce, own_produce
from trio_broker_daemons.fylr.derived_store import DerivedStore
from trio_broker_daemons.fylr.files import ACTION_PRODUCE, FileRow
from trio_broker_daemons.fylr.position import step_job_id
from trio_broker_daemons.fylr.worker import FileWorker
from trio_broker_daemons.runtime.logfmt import fields

__all__ = ["ConfigurationChanged", "OwnProduceStep"]

log = logging.getLogger("trio_broker_daemons.fylr.derived_worker")


class ConfigurationChanged(ValueError):
    """An original's own produce step is configured no more (the step fails with the reason)."""


class OwnProduceStep:
    """The ``produce`` action of a fylr: originals' own steps here, versions' by the worker.

    Args:
        worker: the fylr's file worker (versions' steps, jobs into storage).
    """

    def __init__(self, worker: FileWorker) -> None:
        self.worker = worker
        self.state = worker.state
        self.store = DerivedStore(worker.state.store)

    def wrap(self, actions: list[Action]) -> list[Action]:
        """The worker's actions with ``produce`` handled and settled here first."""
        return [
            Action(
                action.name,
                exec_bound=action.exec_bound,
                handler=self.produce,
                settle=self.settle,
                unknown_service_attempts=action.unknown_service_attempts,
            )
            if action.name == ACTION_PRODUCE
            else action
            for action in actions
        ]

    async def produce(self, item: QueueItem) -> None:
        """A produce step: an original's own, or a version's (the worker's)."""
        row = await self.state.files.get(int(item.file_ref))
        if row is None or row.kind != "original":
            await self.worker.produce(item)
            return
        if row.status != "pending_produce":
            self.state.step(ACTION_PRODUCE, "replayed")
            return
        step = own_produce(self.state.config, filename=row.filename, derivation=row.derivation)
        if isinstance(step, str):
            raise ConfigurationChanged(step)
        await self._produce(item, row, step)

    async def _input_key(self, row: FileRow) -> str:
        """The stored input: the upload as delivered, or a modification's source original."""
        if row.derivation is None:
            if row.storage_key is None:
                raise FileNotFoundError(f"original {row.id} has no stored upload")
            return row.storage_key
        source = None if row.derived_from is None else await self.state.files.get(row.derived_from)
        if source is None or source.storage_key is None:
            raise FileNotFoundError(
                f"the source original {row.derived_from} of this modified original is gone"
            )
        return source.storage_key

    async def _produce(self, item: QueueItem, row: FileRow, step: OwnProduce) -> None:
        state = self.state
        state.changed(row.id)
        receipt, stored = await self.worker.produce_into_storage(
            "original",
            step.service,
            step.params,
            limits=step.limits,
            source_key=await self._input_key(row),
            priority=row.priority,
            subject=f"{row.filename} #{row.id} produce",
            job_id=step_job_id(item),
        )
        try:
            ended = await self.store.end_own_produce(row.id, stored, step)
        finally:
            state.storage.settled(stored.key)
        if ended is None:  # a replay: keep nothing (else the storage sweep removes it)
            with contextlib.suppress(OSError):
                await state.storage.delete(stored.key)
        state.step(ACTION_PRODUCE, receipt.status if ended is not None else "replayed")
        state.changed(row.id)
        state.wake_dispatcher()
        log.info(
            "original produced",
            extra=fields(
                file=row.id,
                filename=step.filename,
                file_class=step.file_class,
                service=step.service,
                size=stored.size,
                duration_s=receipt.duration_s,
                applied=ended is not None,
            ),
        )

    async def settle(self, item: QueueItem, decision: Decision) -> None:
        """The dispatcher's decision on a produce step: an original's here, a version's
        by the worker. Safe to repeat."""
        verdict = decision.verdict
        if verdict.kind != "complete":
            row = await self.state.files.get(int(item.file_ref))
            if row is not None and row.kind == "original":
                await self._settle_original(row, decision)
                return
        await self.worker.settle(item, decision)

    async def _settle_original(self, row: FileRow, decision: Decision) -> None:
        verdict = decision.verdict
        state = self.state
        if verdict.kind == "requeue":
            notice = str(verdict.cause) if verdict.outcome == "unknown_service" else None
            await self.store.retry_own_produce(row.id, notice)
            state.step(ACTION_PRODUCE, "requeued")
            log.info(
                "original's produce requeued",
                extra=fields(file=row.id, reason=verdict.error, delay=verdict.delay),
            )
        else:
            job = verdict.cause if isinstance(verdict.cause, JobFailed) else None
            reason = job.line if job is not None else verdict.error
            await state.files.fail_original(row.id, f"produce: {reason}")
            state.step(ACTION_PRODUCE, job.receipt.status if job is not None else "error")
            log.warning("original's produce failed", extra=fields(file=row.id, error=reason))
        state.changed(row.id)
