"""The fylr's queue worker: the ``metadata``, ``sync`` and ``produce`` steps, and their files.

Theory of operation
===================

An upload is stored (hashed on the way) and its row inserted with its first step
queued (:mod:`~trio_broker_daemons.fylr.api`); then each step is a queue item
that the dispatcher (:mod:`trio_broker.trio.dispatcher`) hands to one handler of
:class:`FileWorker`. Each handler decides with :mod:`trio_broker_daemons.fylr.produce`
and writes with one transaction of :class:`~trio_broker_daemons.fylr.files.FileStore`,
which also queues the next step:

``metadata`` (exec-bound)
    the class's metadata service reads the original through an in-pipe; its
    stdout (through an out-pipe, kept up to :data:`METADATA_OUTPUT_LIMIT`) becomes
    the technical metadata. A command that fails is no failed step: the metadata
    stays empty, the reason (its receipt's decisive line) goes to the original's
    ``error``, and the file goes on to sync.
``sync`` (local-bound)
    creates the missing version rows, removes the unwanted ones (and their
    stored files; a manual version stays), queues a produce for each version
    whose source exists.
    Idempotent: a second sync of an unchanged file changes nothing.
``produce`` (exec-bound, body mode)
    the version's service reads its source (the original, or a ``done`` source
    version) through an in-pipe and writes the rendition through an out-pipe
    straight into storage. A receipt ``ok`` whose output arrived whole stores it
    (``done``). The original is ``done`` when every version has ended.

An original left on its remote (``PUT /eas/rput?…&leave_on_remote=1``) has no
stored bytes: its ``metadata`` step and the ``produce`` steps of versions made
from it read its URL through the fylr (:meth:`RemoteSources.pipe_source
<trio_broker_daemons.fylr.remote_files.RemoteSources.pipe_source>` as the
in-pipe's source; the execserver never sees the URL), and its ``sync`` first
checks that the URL still answers (:meth:`RemoteSources.check_reference
<trio_broker_daemons.fylr.remote_files.RemoteSources.check_reference>`). What
the remote did ends the step as :mod:`~trio_broker_daemons.fylr.remote` says: a
``RetryLater`` with the delay its answer asked for, or a
:class:`~trio_broker_daemons.fylr.remote.RemoteSourceFailed`, after which a
failed ``sync`` ends its original ``error`` (``the remote no longer answers:
…``). The ``copy`` step of a file copied in is
:mod:`~trio_broker_daemons.fylr.remote_steps`'.

One verdict per step. A handler does its step's work and raises when the work
cannot end well; it never judges what it raised. What a receipt means is the
library's (:func:`trio_broker.core.endings.receipt_failure`): a job the execserver
stopped, or whose output did not arrive whole, raises
:class:`~trio_broker.core.errors.JobStopped`; a job that ran and failed
(``failed``, ``timed_out``, ``stalled``, ``out_of_memory``, ``error``) raises
:class:`~trio_broker.core.endings.JobFailed`. Besides those a step raises the
broker client's ``NoSlot``, ``NoExecserver``, ``UnknownService`` and
``ServiceNotOffered`` (described with the closest offered name,
:func:`service_notice`), ``JobLost`` (a killed
execserver) or ``ClientClosed``, the store's ``StoreUnavailable``, a
``FileNotFoundError`` for a stored input that is missing while the storage folder
is there, and a :class:`~trio_broker.core.errors.RetryLater` after the queue's
``retry_delay`` for a storage error (:meth:`FileWorker.storage_failed`: a
temporary file that vanished under its writer, an I/O error of a shared folder,
a full disk, an input that could not be read, an unreachable folder).

The dispatcher decides once, by the outcome table of
:mod:`trio_broker.core.dispatch` (``UnknownService`` is requeued; the broker
client's ``ServiceNotOffered``, once its pool looked for the service a whole
``pool_reprobe_interval``, fails the step), and hands its decision to
:meth:`FileWorker.settle`, which moves the step's file by it and never changes it:

- **requeued** (the reason is temporary): the file goes back to the state the
  step started from (the original or the version to ``new``), a service nobody
  offers with its notice in the file's ``error`` (one warning, then debug);
- **failed** (the input or the recipe is at fault: the job failed, the stored
  input is missing, the broker client looked for the service a whole
  ``pool_reprobe_interval`` and no execserver offers it, or a bug): the version
  ends ``error`` with
  the reason (for a failed job its receipt's decisive line, and the receipt in
  its metadata), and so do the versions made from it; for a metadata step the
  original ends ``error`` (``metadata: <reason>``); a failed ``sync`` leaves its
  original in ``sync``, unless the URL of an original left on its remote failed
  (then the original ends ``error`` with the reason). The queue row stays
  ``failed`` with its reason, its attempts and, for a failed job, the
  receipt's status and decisive line in
  ``last_error`` (:mod:`~trio_broker_daemons.fylr.failed`): once the input or
  the recipe is fixed, ``trio-broker fylr requeue --failed`` (or ``POST
  /inspect/system/fylr/requeue``) puts the row back and its file back where the
  step starts, and the version is made again.

Every write of a step is fenced by the state it expects, so a step (or a
settling) that runs twice (its process was killed after the work but before its
outcome was written) changes nothing the second time. A failure is settled
before its row is written (two transactions): a step run again whose file
already ended ``error`` by its own failure (a version whose error is not
``source version '…' failed``, an original whose error is ``metadata: …``)
raises :class:`FailedEarlier` with the reason the file recorded, so the row is
written ``failed`` as the first run would have, and ``requeue --failed`` can
retry it (the dispatcher's rule, *Settled but not written*).

A finished job's result is recorded until the database takes it. Once a
metadata or produce job has ended and its output is kept (a version's in
storage), the step's last write (``end_metadata``, ``end_version``) is tried
again after a back-off while it raises ``StoreUnavailable`` (a database restart,
a fail-over to a standby), counted as ``results_retried``, instead of requeuing
the step: a requeue would run the finished job a second time. The wait ends
when the write commits, or when the dispatcher cancels the step (its row is no
longer held by this fylr, or the fylr stops). A write whose connection broke may
still have committed: a retry that finds the version already ended keeps the
stored file when the row references it.

Test-only hook: with the environment variable named by
:data:`TEST_EXIT_AFTER_FAILURE_SETTLED` set (to anything non-empty), the process
exits at once (``os._exit``, status :data:`TEST_EXIT_STATUS`) right after it
settled a failure and before the dispatcher writes the row: the tests kill a
real fylr between the two writes with it. Never set it in a deployment.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any, Final, TypeVar, cast

import trio

from trio_broker.core import protocol as p
from trio_broker.core.dispatch import Backoff, Decision, Verdict
from trio_broker.core.endings import JobFailed, receipt_failure
from trio_broker.core.errors import (
    JobStopped,
    NoExecserver,
    RetryLater,
    ServiceNotOffered,
    StoreUnavailable,
    UnknownService,
    describe,
)
from trio_broker.trio.dispatcher import Action
from trio_broker.trio.pipes import OutPipe, Sink
from trio_broker.trio.store import QueueItem
from trio_broker_daemons.fylr.config import VersionConfig, job_limits
from trio_broker_daemons.fylr.files import (
    ACTION_METADATA,
    ACTION_PRODUCE,
    ACTION_SYNC,
    FileRow,
    ProduceStart,
    WantedVersion,
    source_failed,
)
from trio_broker_daemons.fylr.position import step_job_id
from trio_broker_daemons.fylr.produce import (
    FileState,
    class_of,
    parse_metadata_output,
    version_metadata,
    wanted_versions,
)
from trio_broker_daemons.fylr.remote import RemoteSourceFailed
from trio_broker_daemons.fylr.remote_files import RemotePipeSource
from trio_broker_daemons.fylr.state import FylrState
from trio_broker_daemons.fylr.storage import FileReader, Storage, StoredFile, StoredKind
from trio_broker_daemons.fylr.timing import step_service
from trio_broker_daemons.runtime.logfmt import fields

__all__ = [
    "METADATA_OUTPUT_LIMIT",
    "OCTET_STREAM",
    "TEST_EXIT_AFTER_FAILURE_SETTLED",
    "TEST_EXIT_STATUS",
    "FailedEarlier",
    "FileWorker",
    "service_notice",
]

log = logging.getLogger("trio_broker_daemons.fylr.worker")

METADATA_OUTPUT_LIMIT: Final = 1 << 20
"""Bytes of a metadata service's stdout that are kept (the rest is dropped)."""
OCTET_STREAM: Final = "application/octet-stream"
"""The mimetype of a stored file whose recipe names none."""
_CLEANUP_TIMEOUT: Final = 10.0
_STARTED: Final[Mapping[str, FileState]] = {ACTION_METADATA: "metadata", ACTION_PRODUCE: "produce"}
"""The state a requeued step's file goes back from (to ``new``), by action."""
_METADATA_FAILED: Final = "metadata: "
"""How an original's ``error`` begins when its metadata step failed for good."""

RESULT_RETRY_MIN: Final = 0.1
RESULT_RETRY_MAX: Final = 5.0
"""The back-off range of a finished job's result while the database is unavailable
(seconds; the dispatcher's own for its writes)."""

T = TypeVar("T")
TEST_EXIT_AFTER_FAILURE_SETTLED: Final = "TRIO_BROKER_FYLR_TEST_EXIT_AFTER_FAILURE_SETTLED"
"""TEST-ONLY: the environment variable that makes the process exit right after it
settled a failure, before its row is written (see the module docstring)."""
TEST_EXIT_STATUS: Final = 75
"""TEST-ONLY: the exit status of :data:`TEST_EXIT_AFTER_FAILURE_SETTLED`'s exit."""


class FailedEarlier(Exception):
    """A step run again found its file already ended ``error`` by its own failure:
    an earlier run settled the failure and was killed before its row was written.

    Raised (never judged here) so the dispatcher fails the row again, its text the
    reason the file recorded.
    """


class _StoredSource:
    """An in-pipe's source: a stored file, opened only when the execserver asks for it.

    A read that fails is remembered in :attr:`error`: the job then saw a cut-off
    input, and its result is not to be trusted whatever it says.
    """

    def __init__(self, storage: Storage, key: str) -> None:
        self._storage = storage
        self._key = key
        self._reader: FileReader | None = None
        self._closed = False
        self.error: OSError | None = None

    def __aiter__(self) -> _StoredSource:
        return self

    async def __anext__(self) -> bytes:
        if self._closed:
            raise StopAsyncIteration
        try:
            if self._reader is None:
                self._reader = await self._storage.open_read(self._key)
            return await self._reader.__anext__()
        except OSError as exc:
            self.error = exc
            raise

    async def aclose(self) -> None:
        self._closed = True
        if self._reader is not None:
            await self._reader.aclose()


REMOTE_GONE: Final = "the remote no longer answers"
"""How the error of an original left on its remote starts when its URL failed at sync."""


def _reason(verdict: Verdict) -> str:
    """A failed step's reason for its file: a remote's own line, else the row's text."""
    if isinstance(verdict.cause, RemoteSourceFailed):
        return str(verdict.cause)
    return cast(str, verdict.error)


def service_notice(service: str, offered: Collection[str]) -> str:
    """Why a step waits: no execserver offers ``service``, with the closest offered name.

    Args:
        service: the service the recipe names.
        offered: the services the connected execservers announce.

    Returns:
        ``no connected execserver offers service 'thumbnial' (did you mean
        'thumbnail'?)``, or with the offered names when none is close.
    """
    text = f"no connected execserver offers service {service!r}"
    close = difflib.get_close_matches(service, list(offered), n=1)
    if close:
        return f"{text} (did you mean {close[0]!r}?)"
    if offered:
        return f"{text} (offered: {', '.join(sorted(offered))})"
    return text


class FileWorker:
    """The step handlers of one fylr process, registered with its dispatcher.

    Args:
        state: the process's shared state (store, storage, client, counters).
    """

    def __init__(self, state: FylrState) -> None:
        self.state = state
        self.files = state.files
        self.storage = state.storage
        self._noticed: dict[int, set[str]] = {}

    def actions(self) -> list[Action]:
        """The dispatcher's actions: ``metadata`` and ``produce`` exec-bound, ``sync``
        local; each settled by :meth:`settle`. No action counts ``UnknownService``:
        the broker client's verdict (``ServiceNotOffered``) decides."""
        return [
            Action(ACTION_METADATA, exec_bound=True, handler=self.metadata, settle=self.settle),
            Action(ACTION_SYNC, exec_bound=False, handler=self.sync, settle=self.settle),
            Action(ACTION_PRODUCE, exec_bound=True, handler=self.produce, settle=self.settle),
        ]

    # -- configuration lookups -------------------------------------------------------------

    def decide(self, original: FileRow) -> tuple[str | None, dict[str, WantedVersion]]:
        """Sync's view of the configuration (pure: it runs inside a transaction)."""
        config = self.state.config
        class_name = class_of(original.filename, config)
        file_class = self.state.file_class(class_name)
        if original.sha256 is None or (
            original.storage_key is None and config.rput.reference_steps != "all"
        ):  # left on its remote, and no versions are made of such files
            return class_name, {}
        hashes = wanted_versions(file_class, original.sha256)
        wanted: dict[str, WantedVersion] = {}
        for name, produce_hash in hashes.items():
            assert file_class is not None
            version = file_class.versions[name]
            wanted[name] = WantedVersion(
                produce_hash=produce_hash, source=version.source, mimetype=version.mimetype
            )
        return class_name, wanted

    def recipe(self, start: ProduceStart) -> VersionConfig | None:
        """The configured recipe of a version, if it still is the one it was synced for."""
        file_class = self.state.file_class(start.version.file_class)
        if file_class is None or start.version.version not in file_class.versions:
            return None
        assert start.original.sha256 is not None
        wanted = wanted_versions(file_class, start.original.sha256)
        if wanted.get(cast(str, start.version.version)) != start.version.produce_hash:
            return None
        return file_class.versions[cast(str, start.version.version)]

    # -- running jobs ----------------------------------------------------------------------

    async def run_piped(
        self,
        service: str,
        params: Mapping[str, Any],
        *,
        source_key: str | None,
        sink: Sink,
        priority: int,
        subject: str,
        original_id: int | None = None,
        job_id: str | None = None,
        limits: Mapping[str, str] | None = None,
    ) -> tuple[p.Receipt, OutPipe]:
        """Run a body-mode job: ``source_key`` on its stdin, its stdout into ``sink``;
        ``limits`` are more job object members: the recipe's own ``timeout``/``stall_timeout``
        (:func:`job_limits`), an ``input_hash``. ``source_key`` ``None`` reads the URL
        of the original ``original_id``, which is left on its remote
        (:meth:`RemoteSources.pipe_source
        <trio_broker_daemons.fylr.remote_files.RemoteSources.pipe_source>`).

        Raises:
            FileNotFoundError: the stored input is gone while the storage folder is
                there (a hard failure, not a retry).
            RetryLater: the storage folder could not be reached, or reading the
                input failed during the job (the job's result is dropped); or
                the remote answered with a temporary failure.
            RemoteSourceFailed: the remote input failed for good.
            UnknownService: no connected execserver offers ``service`` yet; its
                text is :func:`service_notice` (the closest offered name).
            ServiceNotOffered: the broker client looked for ``service`` a whole
                ``pool_reprobe_interval`` without finding it (the same text).
            NoExecserver, NoSlot, JobLost, ClientClosed: see :meth:`BrokerClient.run`.
        """
        step_service(service)
        client = self.state.client
        if client is None:
            raise NoExecserver("no execserver is configured")
        source: _StoredSource | RemotePipeSource
        if source_key is None:
            source = await self.state.remote.pipe_source(cast(int, original_id))
        else:
            source = await self._stored_source(source_key)
        try:
            stdin = client.pipe_in(source)
            stdout = client.pipe_out(sink)
            receipt = await client.run(
                service,
                {"params": dict(params), **(limits or {})},
                priority=priority,
                subject=subject,
                stdin=stdin,
                stdout=stdout,
                job_id=job_id,
            )
        except UnknownService as exc:
            raise UnknownService(service_notice(service, self.offered_services())) from exc
        except ServiceNotOffered as exc:
            notice = service_notice(service, self.offered_services())
            raise ServiceNotOffered(f"{notice}, after a whole re-probe of looking") from exc
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(_CLEANUP_TIMEOUT):
                await source.aclose()
        if isinstance(source, RemotePipeSource):
            await self.state.remote.after_pipe(cast(int, original_id), source)
        elif source.error is not None:
            raise self.storage_failed(source.error) from source.error
        return receipt, stdout

    async def _stored_source(self, key: str) -> _StoredSource:
        """An in-pipe source of a stored file, once it is known to be there."""
        try:
            present = await self.storage.exists(key)
        except OSError as exc:
            raise self.storage_failed(exc) from exc
        if not present:
            if not await self.storage.available():
                raise self.storage_failed(
                    FileNotFoundError(f"the storage folder {self.storage.root} is unreachable")
                )
            raise FileNotFoundError(f"the stored input {key} is missing")
        return _StoredSource(self.storage, key)

    def storage_failed(self, exc: BaseException) -> RetryLater:
        """The outcome of a storage error: temporary, the step runs again after the
        queue's ``retry_delay``.

        A vanished temporary file (another process's sweep, a remount), an I/O
        error of a shared folder, a full disk: none is the input's fault.
        """
        return RetryLater(None, f"storage: {describe(exc)}")

    def offered_services(self) -> set[str]:
        """The services the connected, non-draining execservers announce."""
        client = self.state.client
        if client is None:
            return set()
        links = [link for link in client.links() if not link.hello.draining]
        return {name for link in links for name in link.hello.services}

    # -- the actions -----------------------------------------------------------------------

    async def metadata(self, item: QueueItem) -> None:
        """The ``metadata`` action: the class's metadata service on the original."""
        state = self.state
        file_id = int(item.file_ref)
        row = await self.files.begin_metadata(file_id)
        if row is None:
            ended = await self.files.get(file_id)
            recorded = "" if ended is None or ended.status != "error" else ended.error or ""
            if recorded.startswith(_METADATA_FAILED):  # its own failure, settled
                raise FailedEarlier(recorded.removeprefix(_METADATA_FAILED))
            state.step(ACTION_METADATA, "replayed")
            return
        state.changed(file_id)
        file_class = state.file_class(row.file_class)
        step = file_class.metadata if file_class is not None else None
        metadata: dict[str, Any] = {}
        mimetype: str | None = None
        error: str | None = None
        if step is not None:
            output = bytearray()

            async def keep(chunk: bytes) -> None:
                room = METADATA_OUTPUT_LIMIT - len(output)
                if room > 0:
                    output.extend(chunk[:room])

            receipt, stdout = await self.run_piped(
                step.service,
                step.params,
                limits=job_limits(step),
                source_key=row.storage_key,
                original_id=file_id,
                sink=keep,
                priority=row.priority,
                subject=f"{row.filename} #{file_id} metadata",
                job_id=step_job_id(item),
            )
            failure = receipt_failure(receipt, what="the metadata job")
            if isinstance(failure, JobStopped):
                raise failure
            if failure is None:
                text = bytes(output) if stdout.state == "done" else receipt.stdout_prefix.encode()
                metadata = parse_metadata_output(text.decode("utf-8", "replace"))
                found = metadata.get("mimetype")
                mimetype = found if isinstance(found, str) and found else None
            else:  # the command failed: no metadata, and the file goes on
                error = f"metadata: {failure.line}"
            state.step(ACTION_METADATA, receipt.status)
        applied = await self._record(
            lambda: self.files.end_metadata(
                file_id, metadata=metadata, mimetype=mimetype, error=error
            )
        )
        state.changed(file_id)
        log.info(
            "metadata stored" if error is None else "metadata step failed",
            extra=fields(file=file_id, mimetype=mimetype, error=error, applied=applied),
        )

    async def sync(self, item: QueueItem) -> None:
        """The ``sync`` action: version rows in line with the configuration."""
        state = self.state
        file_id = int(item.file_ref)
        await state.remote.check_reference(file_id)  # a file left on its remote: still there?
        result = await self.files.sync(file_id, self.decide)
        if result is None:
            state.step(ACTION_SYNC, "replayed")
            return
        for key in result.removed_keys:
            with contextlib.suppress(OSError, ValueError):
                await self.storage.delete(key)
        state.step(ACTION_SYNC, "ok")
        state.changed(file_id)
        log.info(
            "synced",
            extra=fields(
                file=file_id,
                created=",".join(result.created),
                kept=",".join(result.kept),
                removed=",".join(result.removed),
                status=result.status,
            ),
        )

    async def produce(self, item: QueueItem) -> None:
        """The ``produce`` action: one version, from its source, into storage."""
        state = self.state
        version_id = int(item.file_ref)
        start = await self.files.begin_produce(version_id)
        if start == "gone":
            await self._failed_earlier(version_id)
        if start == "gone" or start == "waiting":
            state.step(ACTION_PRODUCE, "replayed")
            return
        if start == "source_failed":
            row = await self.files.get(version_id)
            if row is not None and row.produce_hash is not None:
                end = await self.files.end_version(
                    version_id,
                    row.produce_hash,
                    stored=None,
                    error=source_failed(cast(str, row.source)),
                )
                state.changed(end.original_id)
            state.step(ACTION_PRODUCE, "error")
            return
        version, original = start.version, start.original
        assert version.produce_hash is not None
        state.changed(original.id, version_id)
        recipe = self.recipe(start)
        if recipe is None:
            # the configuration changed since the sync: sync again (it replaces this row)
            await self.files.request_sync(original.id)
            state.step(ACTION_PRODUCE, "resync")
            state.changed(original.id)
            return
        name = cast(str, version.version)
        receipt, stored = await self._produce(start, recipe, job_id=step_job_id(item))
        # The job is done: its result waits for the database rather than the step being
        # requeued (_record). A try whose connection broke may have committed: a later
        # try then finds the version ended, by this very file (_references).
        produce_hash = version.produce_hash
        try:
            end = await self._record(
                lambda: self.files.end_version(
                    version_id,
                    produce_hash,
                    stored=stored,
                    mimetype=recipe.mimetype or OCTET_STREAM,
                    metadata=version_metadata(name, recipe, receipt),
                )
            )
            applied = end.applied or await self._references(version_id, stored.key)
        finally:
            self.storage.settled(stored.key)
        if not applied:  # a replay, or a removed version: keep nothing
            with contextlib.suppress(OSError):  # else the storage sweep removes it
                await self.storage.delete(stored.key)
        state.step(ACTION_PRODUCE, receipt.status if applied else "replayed")
        state.changed(original.id, version_id)
        log.info(
            "version produced",
            extra=fields(
                file=original.id,
                version=name,
                status=receipt.status,
                size=stored.size,
                duration_s=receipt.duration_s,
                original_done=end.original_done,
            ),
        )

    async def _produce(
        self, start: ProduceStart, recipe: VersionConfig, *, job_id: str | None = None
    ) -> tuple[p.Receipt, StoredFile]:
        """Run a version's job with its rendition streamed into storage
        (:meth:`produce_into_storage`)."""
        version, original = start.version, start.original
        return await self.produce_into_storage(
            "version",
            recipe.service,
            recipe.params,
            limits=job_limits(recipe),
            source_key=start.source_key,
            original_id=original.id,
            priority=original.priority,
            subject=f"{original.filename} #{original.id} {version.version}",
            job_id=job_id,
        )

    async def _record(self, write: Callable[[], Awaitable[T]]) -> T:
        """``await write()``, tried again after a back-off while the database is unavailable
        (a finished job's result: see *A finished job's result* in the module docstring)."""
        backoff = Backoff(RESULT_RETRY_MIN, RESULT_RETRY_MAX)
        while True:
            try:
                return await write()
            except StoreUnavailable as exc:
                delay = backoff.failed()
                self.state.count("results_retried")
                log.log(
                    logging.WARNING if delay == RESULT_RETRY_MIN else logging.DEBUG,
                    "a finished job's result waits for the database",
                    extra=fields(reason=str(exc), delay=delay),
                )
            await trio.sleep(delay)

    async def _references(self, version_id: int, key: str) -> bool:
        """Whether the version's row holds ``key`` (an earlier try of its end committed)."""
        row = await self._record(lambda: self.files.get(version_id))
        return row is not None and row.storage_key == key

    async def _failed_earlier(self, version_id: int) -> None:
        """Raise :class:`FailedEarlier` when the version ended ``error`` by its own
        step's failure (a version failed with its source ended by that source's step)."""
        row = await self.files.get(version_id)
        if row is None or row.kind != "version" or row.status != "error":
            return
        if row.source is not None and row.error == source_failed(row.source):
            return
        raise FailedEarlier(row.error or "failed")

    async def produce_into_storage(
        self,
        kind: StoredKind,
        service: str,
        params: Mapping[str, Any],
        *,
        limits: Mapping[str, str],
        source_key: str | None,
        priority: int,
        subject: str,
        original_id: int | None = None,
        job_id: str | None = None,
    ) -> tuple[p.Receipt, StoredFile]:
        """Run a body-mode job on a stored file with its output streamed into storage.

        Args:
            kind: what the output is stored as (a version; an original the fylr
                produces itself).
            service, params, limits: the job (:meth:`run_piped`).
            source_key: the stored input (``None``: the remote of ``original_id``,
                an original left on its remote).
            priority, subject, job_id: of the job.

        Returns:
            The receipt (``ok``, its whole output received) and the stored output;
            the caller settles its key (:meth:`Storage.settled`).

        Raises:
            JobStopped: the execserver stopped the job, or the output did not
                arrive whole.
            JobFailed: the job ran and failed (its receipt says why).
            RetryLater: the output could not be written to storage, or the
                input could not be read (:meth:`storage_failed`).
        """
        send, receive = trio.open_memory_channel[bytes](0)
        stored: list[StoredFile] = []
        failed: list[OSError] = []

        async def write() -> None:
            async with receive:
                try:
                    stored.append(await self.storage.write_stream(kind, receive))
                except OSError as exc:  # the storage's fault, not the job's: stop the job
                    failed.append(exc)
                    nursery.cancel_scope.cancel()

        async def sink(chunk: bytes) -> None:
            await send.send(chunk)

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(write)
                try:
                    receipt, stdout = await self.run_piped(
                        service,
                        params,
                        limits=limits,
                        source_key=source_key,
                        original_id=original_id,
                        sink=sink,
                        priority=priority,
                        subject=subject,
                        job_id=job_id,
                    )
                except BaseException:
                    nursery.cancel_scope.cancel()
                    raise
                failure = receipt_failure(receipt, stdout=stdout.state)
                if failure is None:
                    await send.aclose()  # the writer finishes the file
                else:
                    nursery.cancel_scope.cancel()  # the writer deletes what it has
        except Exception as exc:
            if failed:  # what broke the job was the storage
                raise self.storage_failed(failed[0]) from exc
            raise
        if failed:
            raise self.storage_failed(failed[0]) from failed[0]
        if failure is not None:
            raise failure
        assert stored, "the output arrived whole and the writer ended without an error"
        return receipt, stored[0]

    # -- settling the dispatcher's decision --------------------------------------------------

    async def settle(self, item: QueueItem, decision: Decision) -> None:
        """The dispatcher's one decision on a step: move the step's file by it.

        Requeued, the file goes back to where the step started; failed, the
        version (or the original, for a metadata step) ends ``error`` with the
        reason. The decision itself is never changed here; its cause only
        describes it (a failed job's receipt, a service notice). Safe to repeat.

        Raises:
            StoreUnavailable: a failure could not be recorded (the dispatcher
                settles again after a back-off).
        """
        verdict = decision.verdict
        file_id = int(item.file_ref)
        if verdict.outcome != "unknown_service":
            self._noticed.pop(file_id, None)
        if verdict.kind == "complete":
            return
        if verdict.kind == "requeue":
            await self._requeued(item, file_id, verdict)
        elif item.action == ACTION_PRODUCE:
            await self._version_failed(file_id, verdict)
        elif item.action == ACTION_METADATA:
            await self.files.fail_original(file_id, f"metadata: {_reason(verdict)}")
            self.state.step(ACTION_METADATA, "error")
            self.state.changed(file_id)
        elif isinstance(verdict.cause, RemoteSourceFailed):  # the URL of a reference is gone
            await self.files.fail_original(file_id, f"{REMOTE_GONE}: {verdict.cause}")
            self.state.step(item.action, "error")
            self.state.changed(file_id)
        else:  # a sync: its original stays in sync, for the row's requeue to run it again
            self.state.step(item.action, "error")
        if verdict.kind == "fail" and os.environ.get(TEST_EXIT_AFTER_FAILURE_SETTLED):
            os._exit(TEST_EXIT_STATUS)  # TEST-ONLY: killed between the two writes

    async def _requeued(self, item: QueueItem, file_id: int, verdict: Verdict) -> None:
        """A step runs again: its file back where the step started (best effort), counted.

        A service nobody offers leaves its notice in the file's ``error`` while it
        waits; the step's first requeue for it logs a warning, the next ones log at
        debug level.
        """
        notice = str(verdict.cause) if verdict.outcome == "unknown_service" else None
        started = _STARTED.get(item.action)
        original: int | None = file_id
        if started is not None:
            with contextlib.suppress(StoreUnavailable):
                await self.files.move(file_id, started, "new", notice=notice)
                if item.action == ACTION_PRODUCE:
                    row = await self.files.get(file_id)
                    original = None if row is None else row.parent_id
        self.state.step(item.action, "requeued")
        self.state.changed(original)
        if notice is None:
            log.info(
                "step requeued",
                extra=fields(
                    action=item.action, file=file_id, reason=verdict.error, delay=verdict.delay
                ),
            )
            return
        log.log(
            logging.DEBUG if notice in self._noticed.get(file_id, ()) else logging.WARNING,
            "step waits for a service",
            extra=fields(action=item.action, file=file_id, reason=notice, delay=verdict.delay),
        )
        self._noticed.setdefault(file_id, set()).add(notice)

    async def _version_failed(self, version_id: int, verdict: Verdict) -> None:
        """A version's step failed for good: the version ends ``error`` with the reason
        (a failed job's decisive line, its receipt in the metadata), its dependents too."""
        cause = verdict.cause
        job = cause if isinstance(cause, JobFailed) else None
        error = job.line if job is not None else _reason(verdict)
        row = await self.files.get(version_id)
        if row is None or row.produce_hash is None:  # removed by a sync meanwhile
            self.state.step(ACTION_PRODUCE, "replayed")
            return
        name = cast(str, row.version)
        file_class = self.state.file_class(row.file_class)
        recipe = None if file_class is None else file_class.versions.get(name)
        metadata = None
        if job is not None and recipe is not None:
            metadata = version_metadata(name, recipe, job.receipt)
        end = await self.files.end_version(
            version_id, row.produce_hash, stored=None, metadata=metadata, error=error
        )
        outcome = job.receipt.status if job is not None else "error"
        self.state.step(ACTION_PRODUCE, outcome if end.applied else "replayed")
        self.state.changed(end.original_id, version_id)
        log.log(
            logging.WARNING if isinstance(cause, ServiceNotOffered) else logging.INFO,
            "version failed",
            extra=fields(
                file=end.original_id,
                version=name,
                status=outcome,
                duration_s=None if job is None else job.receipt.duration_s,
                error=error,
                original_done=end.original_done,
            ),
        )
