"""The reference fylr daemon: files in over HTTP, metadata and versions made on execservers.

Theory of operation
===================

:func:`serve_fylr` runs, in one process and one trio nursery:

- **the store**: PostgreSQL, either the configured ``database`` or a private
  cluster in ``state_dir/pg`` (:mod:`trio_broker_daemons.pgcluster`); migrations are
  applied at start. ``files`` (:mod:`trio_broker_daemons.fylr.files`) sits beside
  ``file_queue``;
- **the storage**: stored files in ``state_dir/files`` (:mod:`trio_broker_daemons.fylr.storage`);
  leftovers of writes a killed process could not clean up are swept at start;
- **one HTTP listener** (hypercorn, trio worker) with a small starlette app: the
  file API, the one-time pipes and ``/whoami`` of the broker client, health,
  inspection and metrics (the routes are listed in :func:`serve_fylr`);
- **a broker client** (:mod:`trio_broker.trio.client`) to every configured execserver;
  the pipe URLs it puts into jobs point back at this listener;
- **a dispatcher** (:mod:`trio_broker.trio.dispatcher`) that drains ``file_queue``
  into three actions.

The file worker. An upload is stored (hashed on the way) and its row inserted
with its first step queued; then each step is a queue item, and each step's
handler decides with :mod:`trio_broker_daemons.fylr.produce` and writes with one transaction
of :class:`~trio_broker_daemons.fylr.files.FileStore`, which also queues the next step:

``metadata`` (exec-bound)
    the class's metadata service reads the original through an in-pipe; its
    stdout (through an out-pipe, kept up to :data:`METADATA_OUTPUT_LIMIT`) becomes
    the technical metadata. A command that fails leaves the metadata empty and
    the reason in the original's ``error``; the file goes on to sync.
``sync`` (local-bound)
    creates the missing version rows, removes the unwanted ones (and their
    stored files), queues a produce for each version whose source exists.
    Idempotent: a second sync of an unchanged file changes nothing.
``produce`` (exec-bound, body mode)
    the version's service reads its source (the original, or a ``done`` source
    version) through an in-pipe and writes the rendition through an out-pipe
    straight into storage. A receipt ``ok`` stores it (``done``); any failure
    ends the version ``error`` with the receipt's ``stderr_line``. The original
    is ``done`` when every version has ended.

Retries. No slot within ``connect_timeout`` (:class:`~trio_broker.core.errors.NoSlot`),
a job the execserver ``stopped`` (draining), a service no connected execserver
offers and a lost connection requeue the item after ``retry_delay`` (at once for
a lost connection; while no execserver is reachable, exec-bound items are not
claimed at all), and the file goes back to the state the step started from. Any
other exception fails the step: the version (or, for a metadata step, the
original) ends ``error`` with the exception's text, and the queue row ``failed``.
Every write of a step is fenced by the state it expects, so a step that runs
twice (its process was killed after the work but before its outcome was
written) changes nothing the second time.

Waiting for a file. ``GET /api/v1/eas/<id>?wait=S`` answers at once when the
file has ended, otherwise when this process next changes it (or after ``S``
seconds, at most :data:`MAX_WAIT`): clients and tests follow a file's progress
without polling.

Shutdown (:meth:`FylrHandle.stop`, SIGTERM through the daemon): the dispatcher
stops and returns its claimed items to the queue at once (running jobs are
cancelled at the execservers), the broker connections close, the listener stops,
then the database pool and the private cluster.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import mimetypes
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any, Final, cast

import attrs
import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from trio_broker._version import __version__
from trio_broker.core import protocol as p
from trio_broker.core.admission import AdmissionConfig
from trio_broker.core.client import ClientConfig
from trio_broker.core.errors import ClientClosed, JobLost, NoExecserver, NoSlot, UnknownService
from trio_broker.trio.client import BrokerClient, ClientStatistics, open_broker_client
from trio_broker.trio.dispatcher import (
    Action,
    Dispatcher,
    DispatcherConfig,
    DispatcherStatistics,
    RetryLater,
    serve_dispatcher,
)
from trio_broker.trio.listener import listener_config, serve_app
from trio_broker.trio.pipes import OutPipe, PipeRegistry, PipeStatistics, Sink
from trio_broker.trio.store import (
    QueueCounts,
    QueueItem,
    Store,
    StoreUnavailable,
    describe_dsn,
    open_store,
)
from trio_broker_daemons.fylr.config import FileClass, FylrConfig, VersionConfig, new_backend_id
from trio_broker_daemons.fylr.files import (
    ACTION_METADATA,
    ACTION_PRODUCE,
    ACTION_SYNC,
    FileRow,
    FileStore,
    ProduceStart,
    WantedVersion,
    fylr_migrations,
    source_failed,
)
from trio_broker_daemons.fylr.produce import (
    FileState,
    api_status,
    class_of,
    parse_metadata_output,
    version_metadata,
    wanted_versions,
)
from trio_broker_daemons.fylr.storage import FileReader, FileTooLarge, Storage, StoredFile
from trio_broker_daemons.logfmt import fields
from trio_broker_daemons.pgcluster import open_pg_cluster

__all__ = [
    "EMBEDDED_DATABASE",
    "MAX_WAIT",
    "METADATA_OUTPUT_LIMIT",
    "FylrHandle",
    "FylrStatistics",
    "file_document",
    "serve_fylr",
]

log = logging.getLogger("trio_broker_daemons.fylr.app")

EMBEDDED_DATABASE: Final = "fylr"
"""The database the fylr uses in its private cluster."""
MAX_WAIT: Final = 60.0
"""The longest ``?wait=`` a file request may ask for, in seconds."""
METADATA_OUTPUT_LIMIT: Final = 1 << 20
"""Bytes of a metadata service's stdout that are kept (the rest is dropped)."""
OCTET_STREAM: Final = "application/octet-stream"
MAX_FILENAME_CHARS: Final = 1000
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1
_SHUTDOWN_TIMEOUT: Final = 10.0
_CLEANUP_TIMEOUT: Final = 10.0


# -- values ------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class FylrStatistics:
    """A snapshot of one fylr process (:meth:`FylrHandle.statistics`).

    Attributes:
        backend_id: this process's backend id.
        uploads: uploads stored and recorded.
        uploads_refused: uploads refused before storing (bad request, too large).
        uploads_aborted: uploads whose sender went away before the end (nothing kept).
        bytes_uploaded: bytes of the recorded uploads.
        downloads: downloads started.
        steps: step ends by ``"<action>.<outcome>"`` (``produce.done``,
            ``produce.error``, ``metadata.ok``, ``metadata.failed``, ``sync.done``,
            ``<action>.requeued``, ``<action>.replayed``, ``<action>.error``).
        dispatcher: the dispatcher's snapshot (``None`` before it started).
        client: the broker client's snapshot (``None`` without execservers).
        pipes: the one-time pipes' counts and bytes.
    """

    backend_id: str
    uploads: int
    uploads_refused: int
    uploads_aborted: int
    bytes_uploaded: int
    downloads: int
    steps: Mapping[str, int]
    dispatcher: DispatcherStatistics | None
    client: ClientStatistics | None
    pipes: PipeStatistics


class _UploadInterrupted(Exception):
    """The uploading client went away before the end of the body."""


class _RequestBody:
    """An upload's body as an async iterator of chunks, read from ASGI messages.

    Not an async generator: :meth:`Storage.write_stream` may stop iterating
    anywhere (a size limit), and an abandoned generator would be finalized late.
    """

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._ended = False

    def __aiter__(self) -> _RequestBody:
        return self

    async def __anext__(self) -> bytes:
        if self._ended:
            raise StopAsyncIteration
        message = await self._receive()
        if message["type"] == "http.disconnect":
            self._ended = True
            raise _UploadInterrupted("the client went away before the end of the body")
        if not message.get("more_body", False):
            self._ended = True
        return cast(bytes, message.get("body", b""))


class _StoredSource:
    """An in-pipe's source: a stored file, opened only when the execserver asks for it."""

    def __init__(self, storage: Storage, key: str) -> None:
        self._storage = storage
        self._key = key
        self._reader: FileReader | None = None
        self._closed = False

    def __aiter__(self) -> _StoredSource:
        return self

    async def __anext__(self) -> bytes:
        if self._closed:
            raise StopAsyncIteration
        if self._reader is None:
            self._reader = await self._storage.open_read(self._key)
        return await self._reader.__anext__()

    async def aclose(self) -> None:
        self._closed = True
        if self._reader is not None:
            await self._reader.aclose()


class _Download(StreamingResponse):
    """A stored file streamed out; the file is closed however the response ends."""

    def __init__(self, reader: FileReader, headers: Mapping[str, str], media_type: str) -> None:
        super().__init__(reader, headers=dict(headers), media_type=media_type)
        self.reader = reader

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.reader.aclose()


def _file_id(text: str) -> int | None:
    if not text.isascii() or not text.isdigit() or len(text) > 18:
        return None
    return int(text)


def _receipt_reason(receipt: p.Receipt) -> str:
    """A failed job's reason: the decisive stderr line, else the receipt's error."""
    return receipt.stderr_line or receipt.error or f"status {receipt.status}"


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _guess_mimetype(filename: str) -> str | None:
    guess, _ = mimetypes.guess_type(filename, strict=False)
    return guess


# -- documents ---------------------------------------------------------------------------


def _row_document(row: FileRow, base: str) -> dict[str, Any]:
    name = "original" if row.kind == "original" else row.version
    owner = row.id if row.kind == "original" else row.parent_id
    stored = row.storage_key is not None and (row.kind == "original" or row.status == "done")
    return {
        "id": row.id,
        "kind": row.kind,
        "status": api_status(row.status),
        "state": row.status,
        "filename": row.filename,
        "class": row.file_class,
        "filesize": row.size,
        "hash": {"sha256": row.sha256} if row.sha256 else None,
        "mimetype": row.mimetype,
        "metadata": dict(row.metadata),
        "error": row.error,
        "priority": row.priority,
        "created_at": row.created_at.isoformat(),
        "updated_at": row.updated_at.isoformat(),
        "url": f"{base}/api/v1/eas/download/{owner}/{name}" if stored else None,
    }


def file_document(row: FileRow, versions: Sequence[FileRow], *, base: str = "") -> dict[str, Any]:
    """The JSON document ``GET /api/v1/eas/<id>`` answers.

    Args:
        row: the file (an original or a version).
        versions: an original's versions (empty for a version).
        base: prefixed to the download URLs (``http://host:port``; ``""``: paths).

    Returns:
        ``id``, ``kind``, ``status`` (the API status), ``state`` (the internal
        one), ``filename``, ``class``, ``filesize``, ``hash`` (``{"sha256": …}``),
        ``mimetype``, ``metadata``, ``error``, ``priority``, timestamps, ``url``
        (its download, once stored); an original has ``versions`` (name → the
        same members), a version ``version``, ``source`` and ``original``.
    """
    document = _row_document(row, base)
    if row.kind == "original":
        document["versions"] = {
            cast(str, version.version): {
                **_row_document(version, base),
                "source": version.source,
                "produce_hash": version.produce_hash,
            }
            for version in versions
        }
    else:
        document["version"] = row.version
        document["source"] = row.source
        document["original"] = row.parent_id
        document["produce_hash"] = row.produce_hash
    return document


# -- the service -------------------------------------------------------------------------


class _Fylr:
    """The state of one fylr process: what the handlers and the HTTP app share."""

    def __init__(
        self,
        config: FylrConfig,
        *,
        backend_id: str,
        store: Store,
        storage: Storage,
        database: str,
    ) -> None:
        self.config = config
        self.backend_id = backend_id
        self.store = store
        self.files = FileStore(store)
        self.storage = storage
        self.database = database
        self.pipes = PipeRegistry(backend_id)
        self.client: BrokerClient | None = None
        self.dispatcher: Dispatcher | None = None
        self.base_url = ""
        self.stopping = False
        self.stop_requested = trio.Event()
        self.closed = trio.Event()
        self.counters: dict[str, int] = dict.fromkeys(
            ("uploads", "uploads_refused", "uploads_aborted", "bytes_uploaded", "downloads"), 0
        )
        self.steps: dict[str, int] = {}
        self._watchers: dict[int, trio.Event] = {}
        self._watching: dict[int, int] = {}
        self._changed = trio.Event()

    # -- notifications ---------------------------------------------------------------------

    def changed(self, *file_ids: int | None) -> None:
        """Wake whoever waits for these originals, and every statistics waiter."""
        for file_id in file_ids:
            if file_id is not None:
                event = self._watchers.pop(file_id, None)
                if event is not None:
                    event.set()
        self._changed.set()
        self._changed = trio.Event()

    @contextlib.contextmanager
    def watch(self, file_id: int) -> Iterator[trio.Event]:
        """An event set at this process's next change of the original ``file_id``."""
        event = self._watchers.get(file_id)
        if event is None:
            event = self._watchers[file_id] = trio.Event()
        self._watching[file_id] = self._watching.get(file_id, 0) + 1
        try:
            yield event
        finally:
            left = self._watching.pop(file_id) - 1
            if left:
                self._watching[file_id] = left
            elif self._watchers.get(file_id) is event:
                del self._watchers[file_id]

    async def wait_changed(self) -> None:
        await self._changed.wait()

    def count(self, counter: str, amount: int = 1) -> None:
        self.counters[counter] += amount
        self.changed()

    def step(self, action: str, outcome: str) -> None:
        key = f"{action}.{outcome}"
        self.steps[key] = self.steps.get(key, 0) + 1
        self.changed()

    def statistics(self) -> FylrStatistics:
        c = self.counters
        return FylrStatistics(
            backend_id=self.backend_id,
            uploads=c["uploads"],
            uploads_refused=c["uploads_refused"],
            uploads_aborted=c["uploads_aborted"],
            bytes_uploaded=c["bytes_uploaded"],
            downloads=c["downloads"],
            steps=dict(self.steps),
            dispatcher=self.dispatcher.statistics() if self.dispatcher else None,
            client=self.client.statistics() if self.client else None,
            pipes=self.pipes.statistics(),
        )

    # -- configuration lookups -------------------------------------------------------------

    def file_class(self, name: str | None) -> FileClass | None:
        return None if name is None else self.config.classes.get(name)

    def decide(self, original: FileRow) -> tuple[str | None, dict[str, WantedVersion]]:
        """Sync's view of the configuration (pure: it runs inside a transaction)."""
        class_name = class_of(original.filename, self.config)
        file_class = self.file_class(class_name)
        assert original.sha256 is not None
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
        file_class = self.file_class(start.version.file_class)
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
        source_key: str,
        sink: Sink,
        priority: int,
        subject: str,
    ) -> tuple[p.Receipt, OutPipe]:
        """Run a body-mode job: ``source_key`` on its stdin, its stdout into ``sink``.

        Raises:
            FileNotFoundError: the stored input is gone (a hard failure, not a retry).
            NoExecserver, NoSlot, JobLost, ClientClosed: see :meth:`BrokerClient.run`.
        """
        client = self.client
        if client is None:
            raise NoExecserver("no execserver is configured")
        if not await self.storage.exists(source_key):
            raise FileNotFoundError(f"the stored input {source_key} is missing")
        source = _StoredSource(self.storage, source_key)
        try:
            stdin = client.pipe_in(source)
            stdout = client.pipe_out(sink)
            receipt = await client.run(
                service,
                {"params": dict(params)},
                priority=priority,
                subject=subject,
                stdin=stdin,
                stdout=stdout,
            )
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(_CLEANUP_TIMEOUT):
                await source.aclose()
        return receipt, stdout

    async def requeue(
        self, action: str, file_id: int, old: FileState, new: FileState, exc: BaseException
    ) -> None:
        """A step will run again: move its file back (best effort) and count it."""
        with contextlib.suppress(StoreUnavailable):
            await self.files.move(file_id, old, new)
        self.step(action, "requeued")
        log.info(
            "step requeued",
            extra=fields(action=action, file=file_id, reason=_describe(exc)),
        )

    # -- the actions -----------------------------------------------------------------------

    async def metadata(self, item: QueueItem) -> None:
        """The ``metadata`` action: the class's metadata service on the original."""
        file_id = int(item.file_ref)
        row = await self.files.begin_metadata(file_id)
        if row is None:
            self.step(ACTION_METADATA, "replayed")
            return
        self.changed(file_id)
        file_class = self.file_class(row.file_class)
        step = file_class.metadata if file_class is not None else None
        metadata: dict[str, Any] = {}
        mimetype: str | None = None
        error: str | None = None
        if step is not None:
            assert row.storage_key is not None
            output = bytearray()

            async def keep(chunk: bytes) -> None:
                room = METADATA_OUTPUT_LIMIT - len(output)
                if room > 0:
                    output.extend(chunk[:room])

            try:
                receipt, stdout = await self.run_piped(
                    step.service,
                    step.params,
                    source_key=row.storage_key,
                    sink=keep,
                    priority=row.priority,
                    subject=f"{row.filename} #{file_id} metadata",
                )
            except Exception as raised:
                exc = _sole(raised)
                if isinstance(exc, _TEMPORARY):
                    await self.requeue(ACTION_METADATA, file_id, "metadata", "new", exc)
                    raise _retry(exc, self.config.retry_delay) from None
                await self.files.fail_original(file_id, f"metadata: {_describe(exc)}")
                self.step(ACTION_METADATA, "error")
                self.changed(file_id)
                raise exc from None
            if receipt.status in ("stopped", "cancelled"):
                await self.requeue(
                    ACTION_METADATA, file_id, "metadata", "new", Exception(_receipt_reason(receipt))
                )
                raise RetryLater(self.config.retry_delay, f"metadata job {receipt.status}")
            if receipt.status == "ok":
                text = bytes(output) if stdout.state == "done" else receipt.stdout_prefix.encode()
                metadata = parse_metadata_output(text.decode("utf-8", "replace"))
                found = metadata.get("mimetype")
                mimetype = found if isinstance(found, str) and found else None
            else:
                error = f"metadata: {_receipt_reason(receipt)}"
            self.step(ACTION_METADATA, "ok" if error is None else "failed")
        applied = await self.files.end_metadata(
            file_id, metadata=metadata, mimetype=mimetype, error=error
        )
        self.changed(file_id)
        log.info(
            "metadata stored" if error is None else "metadata step failed",
            extra=fields(file=file_id, mimetype=mimetype, error=error, applied=applied),
        )

    async def sync(self, item: QueueItem) -> None:
        """The ``sync`` action: version rows in line with the configuration."""
        file_id = int(item.file_ref)
        result = await self.files.sync(file_id, self.decide)
        if result is None:
            self.step(ACTION_SYNC, "replayed")
            return
        for key in result.removed_keys:
            with contextlib.suppress(OSError, ValueError):
                await self.storage.delete(key)
        self.step(ACTION_SYNC, "done")
        self.changed(file_id)
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
        version_id = int(item.file_ref)
        start = await self.files.begin_produce(version_id)
        if start == "gone" or start == "waiting":
            self.step(ACTION_PRODUCE, "replayed")
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
                self.changed(end.original_id)
            self.step(ACTION_PRODUCE, "error")
            return
        version, original = start.version, start.original
        assert version.produce_hash is not None
        self.changed(original.id, version_id)
        recipe = self.recipe(start)
        if recipe is None:
            # the configuration changed since the sync: sync again (it replaces this row)
            await self.files.request_sync(original.id)
            self.step(ACTION_PRODUCE, "resync")
            self.changed(original.id)
            return
        name = cast(str, version.version)
        try:
            receipt, stored = await self._produce(start, recipe)
        except Exception as raised:
            exc = _sole(raised)
            if isinstance(exc, _TEMPORARY):
                await self.requeue(ACTION_PRODUCE, version_id, "produce", "new", exc)
                raise _retry(exc, self.config.retry_delay) from None
            await self.files.end_version(
                version_id, version.produce_hash, stored=None, error=_describe(exc)
            )
            self.step(ACTION_PRODUCE, "error")
            self.changed(original.id)
            raise exc from None
        metadata = version_metadata(name, recipe, receipt)
        if stored is not None:
            # A database error here may or may not have committed: the file is kept
            # either way (an unreferenced file is the safe loss).
            end = await self.files.end_version(
                version_id,
                version.produce_hash,
                stored=stored,
                mimetype=recipe.mimetype or OCTET_STREAM,
                metadata=metadata,
            )
            if not end.applied:  # a replay, or a removed version: keep nothing
                await self.storage.delete(stored.key)
        else:
            end = await self.files.end_version(
                version_id,
                version.produce_hash,
                stored=None,
                metadata=metadata,
                error=_receipt_reason(receipt),
            )
        outcome = ("done" if stored is not None else "error") if end.applied else "replayed"
        self.step(ACTION_PRODUCE, outcome)
        self.changed(original.id, version_id)
        log.info(
            "version produced" if stored is not None else "version failed",
            extra=fields(
                file=original.id,
                version=name,
                status=receipt.status,
                size=stored.size if stored else None,
                duration_s=receipt.duration_s,
                error=None if stored is not None else _receipt_reason(receipt),
                original_done=end.original_done,
            ),
        )

    async def _produce(
        self, start: ProduceStart, recipe: VersionConfig
    ) -> tuple[p.Receipt, StoredFile | None]:
        """Run a version's job with its rendition streamed into storage.

        Returns:
            The receipt, and the stored rendition when the job ended ``ok`` with
            its whole output received.

        Raises:
            RetryLater: the execserver stopped the job, or the output did not
                arrive whole.
        """
        version, original = start.version, start.original
        send, receive = trio.open_memory_channel[bytes](0)
        stored: list[StoredFile] = []

        async def write() -> None:
            async with receive:
                stored.append(await self.storage.write_stream("version", receive))

        async def sink(chunk: bytes) -> None:
            await send.send(chunk)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(write)
            try:
                receipt, stdout = await self.run_piped(
                    recipe.service,
                    recipe.params,
                    source_key=start.source_key,
                    sink=sink,
                    priority=original.priority,
                    subject=f"{original.filename} #{original.id} {version.version}",
                )
            except BaseException:
                nursery.cancel_scope.cancel()
                raise
            complete = stdout.state == "done" or (
                stdout.state == "closed" and receipt.stdout_bytes == 0
            )
            if receipt.status == "ok" and complete:
                await send.aclose()  # the writer finishes the file
            else:
                nursery.cancel_scope.cancel()  # the writer deletes what it has
        if receipt.status in ("stopped", "cancelled"):
            raise RetryLater(
                self.config.retry_delay, f"the job was {receipt.status}: {_receipt_reason(receipt)}"
            )
        if receipt.status == "ok":
            if not stored:
                raise RetryLater(
                    self.config.retry_delay,
                    f"the output did not arrive whole (out-pipe {stdout.state})",
                )
            return receipt, stored[0]
        return receipt, None

    # -- HTTP ------------------------------------------------------------------------------

    async def upload(self, request: Request) -> Response:
        """``PUT /eas/put?filename=…&priority=…``: store the body, record the file."""
        filename = request.query_params.get("filename", "")
        raw_priority = request.query_params.get("priority", "0")
        problem = None
        if not filename or len(filename) > MAX_FILENAME_CHARS or "\x00" in filename:
            problem = f"filename: expected 1 to {MAX_FILENAME_CHARS} characters"
        try:
            priority = int(raw_priority)
        except ValueError:
            priority = 0
            problem = problem or f"priority: expected an integer, got {raw_priority!r}"
        if problem is None and not PRIORITY_MIN <= priority <= PRIORITY_MAX:
            problem = f"priority: expected a 32-bit signed integer, got {priority}"
        if self.stopping:
            return JSONResponse({"error": "the server is shutting down"}, status_code=503)
        if problem is not None:
            self.count("uploads_refused")
            return JSONResponse({"error": problem}, status_code=400)
        limit = self.config.max_upload_size
        declared = request.headers.get("content-length", "")
        if limit is not None and declared.isdigit() and int(declared) > limit:
            self.count("uploads_refused")
            return JSONResponse({"error": f"the file is larger than {limit} bytes"}, 413)
        try:
            stored = await self.storage.write_stream(
                "original", _RequestBody(request.receive), max_size=limit
            )
        except FileTooLarge as exc:
            self.count("uploads_refused")
            return JSONResponse({"error": str(exc)}, status_code=413)
        except _UploadInterrupted:
            self.count("uploads_aborted")
            log.info("upload interrupted", extra=fields(filename=filename))
            return Response(status_code=400)  # nobody reads it
        class_name = class_of(filename, self.config)
        file_class = self.file_class(class_name)
        try:
            with trio.CancelScope(shield=True):
                row = await self.files.create_original(
                    filename=filename,
                    file_class=class_name,
                    priority=priority,
                    stored=stored,
                    mimetype=_guess_mimetype(filename),
                    metadata_step=file_class is not None and file_class.metadata is not None,
                )
        except StoreUnavailable as exc:
            # it may or may not have committed: the stored bytes stay (never a row
            # without its file; at worst a file without a row)
            return JSONResponse({"error": f"the database is unavailable: {exc}"}, 503)
        self.count("uploads")
        self.count("bytes_uploaded", stored.size)
        if self.dispatcher is not None:
            self.dispatcher.wake()
        self.changed(row.id)
        log.info(
            "file stored",
            extra=fields(
                file=row.id,
                filename=filename,
                size=stored.size,
                sha256=stored.sha256,
                file_class=class_name,
                priority=priority,
            ),
        )
        return JSONResponse(file_document(row, [], base=self.base_url), status_code=201)

    async def get_file(self, request: Request) -> Response:
        """``GET /api/v1/eas/<id>[?wait=S]``: the file and its versions."""
        file_id = _file_id(request.path_params["file_id"])
        if file_id is None:
            return _not_found()
        try:
            wait = float(request.query_params.get("wait", "0"))
        except ValueError:
            return JSONResponse({"error": "wait: expected seconds"}, status_code=400)
        if not math.isfinite(wait) or wait < 0:
            return JSONResponse({"error": "wait: expected seconds"}, status_code=400)
        with self.watch(file_id) as event:  # before reading: no change is missed
            found = await self.files.with_versions(file_id)
            if found is not None and wait > 0 and not found[0].finished:
                with trio.move_on_after(min(wait, MAX_WAIT)):
                    await event.wait()
                found = await self.files.with_versions(file_id)
        if found is None:
            return _not_found()
        row, versions = found
        return JSONResponse(file_document(row, versions, base=self.base_url))

    async def resync(self, request: Request) -> Response:
        """``POST /api/v1/eas/<id>/sync``: sync an original again (after a configuration change)."""
        file_id = _file_id(request.path_params["file_id"])
        if file_id is None:
            return _not_found()
        row, queued = await self.files.request_sync(file_id)
        if row is None:
            return _not_found()
        if not queued:
            return JSONResponse(
                {"error": "the file waits for its metadata step; it is synced after it"},
                status_code=409,
            )
        if self.dispatcher is not None:
            self.dispatcher.wake()
        self.changed(file_id)
        return JSONResponse(file_document(row, [], base=self.base_url), status_code=202)

    async def download(self, request: Request) -> Response:
        """``GET /api/v1/eas/download/<id>/<version>``: a stored original or version."""
        file_id = _file_id(request.path_params["file_id"])
        name = request.path_params["version"]
        if file_id is None:
            return _not_found()
        if name == "original":
            row = await self.files.get(file_id)
            if row is None or row.kind != "original":
                return _not_found()
        else:
            row = await self.files.version_of(file_id, name)
            if row is None or row.status != "done":
                return _not_found()
        if row.storage_key is None:
            return _not_found()
        try:
            reader = await self.storage.open_read(row.storage_key)
        except (FileNotFoundError, ValueError):
            return _not_found()
        self.count("downloads")
        download_name = row.filename if name == "original" else f"{row.filename}.{name}"
        headers = {
            "content-length": str(reader.size),
            "content-disposition": f"attachment; filename*=UTF-8''{_quote(download_name)}",
            "cache-control": "no-store",
        }
        if row.sha256:
            headers["x-content-sha256"] = row.sha256
        return _Download(reader, headers, row.mimetype or OCTET_STREAM)

    async def healthz(self, request: Request) -> Response:
        if self.stopping:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return JSONResponse({"status": "serving"})

    async def inspect(self) -> dict[str, Any]:
        """The document of ``/inspect/system/fylr``."""
        queue = await self.store.counts()
        counts = await self.files.counts()
        stats = self.statistics()
        files: dict[str, dict[str, int]] = {"original": {}, "version": {}}
        for (kind, status), count in sorted(counts.items()):
            files.setdefault(kind, {})[status] = count
        return {
            "backend_id": self.backend_id,
            "name": self.config.name,
            "version": __version__,
            "url": self.base_url,
            "database": self.database,
            "state_dir": str(self.config.state_dir),
            "stopping": self.stopping,
            "queue": attrs.asdict(queue),
            "files": files,
            "http": dict(self.counters),
            "steps": dict(stats.steps),
            "dispatcher": attrs.asdict(stats.dispatcher) if stats.dispatcher else None,
            "client": _client_document(stats.client, self.config.execservers),
            "pipes": attrs.asdict(stats.pipes),
        }

    async def inspect_page(self, request: Request) -> Response:
        return JSONResponse(await self.inspect())

    async def metrics(self, request: Request) -> Response:
        queue = await self.store.counts()
        counts = await self.files.counts()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self.statistics(), queue, counts))
        return Response(
            generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/eas/put", self.upload, methods=["PUT"]),
                Route("/api/v1/eas/download/{file_id}/{version}", self.download, methods=["GET"]),
                Route("/api/v1/eas/{file_id}/sync", self.resync, methods=["POST"]),
                Route("/api/v1/eas/{file_id}", self.get_file, methods=["GET"]),
                Route("/healthz", self.healthz, methods=["GET"]),
                Route("/inspect/system/fylr", self.inspect_page, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
                *self.pipes.routes(),
            ]
        )


_TEMPORARY: Final = (
    NoSlot,
    NoExecserver,
    UnknownService,
    JobLost,
    ClientClosed,
    StoreUnavailable,
    RetryLater,
)
"""What makes a step run again later rather than fail its file.

``UnknownService`` too: the execservers that offer it may be restarting; a service
that nobody offers shows as a step requeued again and again with that error."""


def _sole(exc: BaseException) -> BaseException:
    """The one exception inside nested single-exception groups, else ``exc``."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _retry(exc: BaseException, delay: float) -> BaseException:
    """The exception that makes the dispatcher requeue a step the way ``exc`` calls for.

    A lost connection or a closing client runs the step again at once, an unknown
    service after ``delay``; the others are what the dispatcher already requeues
    (``NoSlot`` after ``retry_delay``, ``NoExecserver`` at once).
    """
    if isinstance(exc, JobLost | ClientClosed):
        return RetryLater(0.0, _describe(exc))
    if isinstance(exc, UnknownService):
        return RetryLater(delay, _describe(exc))
    return exc


def _not_found() -> Response:
    return JSONResponse({"error": "not found"}, status_code=404)


def _quote(text: str) -> str:
    import urllib.parse

    return urllib.parse.quote(text, safe="")


def _client_document(
    stats: ClientStatistics | None, addresses: Sequence[str]
) -> dict[str, Any] | None:
    if stats is None:
        return None
    return {
        "waiting": stats.waiting,
        "running": stats.running,
        "finished": stats.finished,
        "failed": stats.failed,
        "surplus_offers": stats.surplus_offers,
        "addresses": [
            {
                "address": a.address,
                "connections": a.connections,
                "instances": list(a.instances),
                "names": dict(a.names),
                "covered": a.covered,
                "balanced": a.balanced,
            }
            for a in stats.addresses
        ],
    }


class _Collector:
    """Prometheus metrics from one snapshot, taken when ``/metrics`` is scraped."""

    def __init__(
        self,
        stats: FylrStatistics,
        queue: QueueCounts,
        files: Mapping[tuple[str, str], int],
    ) -> None:
        self.stats = stats
        self.queue = queue
        self.files = files

    def collect(self) -> list[Metric]:
        stats = self.stats
        metrics: list[Metric] = []
        files = GaugeMetricFamily(
            "trio_broker_fylr_files", "Files by kind and internal state.", labels=["kind", "state"]
        )
        for (kind, state), count in sorted(self.files.items()):
            files.add_metric([kind, state], count)
        metrics.append(files)
        queue = GaugeMetricFamily(
            "trio_broker_fylr_queue_items", "Rows of file_queue by state.", labels=["state"]
        )
        for state, count in attrs.asdict(self.queue).items():
            queue.add_metric([state], count)
        metrics.append(queue)
        http = [
            ("uploads", "Uploads stored and recorded.", stats.uploads),
            ("uploads_refused", "Uploads refused before storing.", stats.uploads_refused),
            ("uploads_aborted", "Uploads whose sender went away.", stats.uploads_aborted),
            ("uploaded_bytes", "Bytes of recorded uploads.", stats.bytes_uploaded),
            ("downloads", "Downloads started.", stats.downloads),
        ]
        for name, text, value in http:
            metrics.append(CounterMetricFamily(f"trio_broker_fylr_{name}", text, value=value))
        steps = CounterMetricFamily(
            "trio_broker_fylr_steps",
            "Step ends by action and outcome.",
            labels=["action", "outcome"],
        )
        for key, value in sorted(stats.steps.items()):
            action, _, outcome = key.partition(".")
            steps.add_metric([action, outcome], value)
        metrics.append(steps)
        if stats.dispatcher is not None:
            d = stats.dispatcher
            for name, value in (
                ("exec_limit", d.exec_limit),
                ("exec_in_flight", d.exec_in_flight),
                ("local_in_flight", d.local_in_flight),
                ("pending_outcomes", d.pending_outcomes),
            ):
                metrics.append(
                    GaugeMetricFamily(
                        f"trio_broker_fylr_dispatcher_{name}", f"Dispatcher {name}.", value=value
                    )
                )
            for name, value in (
                ("claims", d.claims),
                ("claimed", d.claimed),
                ("completed", d.completed),
                ("requeued", d.requeued),
                ("failed", d.failed),
                ("stale_requeued", d.stale_requeued),
                ("store_errors", d.store_errors),
            ):
                metrics.append(
                    CounterMetricFamily(
                        f"trio_broker_fylr_dispatcher_{name}", f"Dispatcher {name}.", value=value
                    )
                )
        if stats.client is not None:
            c = stats.client
            metrics.append(
                GaugeMetricFamily(
                    "trio_broker_fylr_jobs_waiting", "Jobs waiting for a slot.", value=c.waiting
                )
            )
            metrics.append(
                GaugeMetricFamily(
                    "trio_broker_fylr_jobs_running", "Jobs holding a slot.", value=c.running
                )
            )
            metrics.append(
                CounterMetricFamily(
                    "trio_broker_fylr_jobs_finished", "Jobs ended with a receipt.", value=c.finished
                )
            )
            connections = GaugeMetricFamily(
                "trio_broker_fylr_broker_connections",
                "Open broker connections per configured address.",
                labels=["address"],
            )
            for a in c.addresses:
                connections.add_metric([a.address], a.connections)
            metrics.append(connections)
        pipes = stats.pipes
        for name, text, value in (
            ("pipe_bytes_served", "Bytes sent through in-pipes.", pipes.bytes_served),
            ("pipe_bytes_received", "Bytes received through out-pipes.", pipes.bytes_received),
            ("pipes_aborted", "Pipes whose transfer did not complete.", pipes.aborted),
        ):
            metrics.append(CounterMetricFamily(f"trio_broker_fylr_{name}", text, value=value))
        return metrics


# -- the handle and the service ----------------------------------------------------------


class FylrHandle:
    """What :func:`serve_fylr` hands to ``task_status.started()``.

    Attributes:
        host, port: where the listener is bound (the real port when 0 was asked).
        url: ``http://host:port``.
        backend_id: this process's backend id.
        files: the ``files`` table (tests and tools read it).
        storage: the stored files.
        store: the queue database.
    """

    def __init__(self, service: _Fylr, host: str, port: int) -> None:
        self._service = service
        self.host = host
        self.port = port
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{port}"
        self.backend_id = service.backend_id
        self.files = service.files
        self.storage = service.storage
        self.store = service.store

    @property
    def dispatcher(self) -> Dispatcher | None:
        """The dispatcher (``None`` until it has started); its ``wait_until`` is exact."""
        return self._service.dispatcher

    def statistics(self) -> FylrStatistics:
        """A frozen snapshot of this process's counters, dispatcher, client and pipes."""
        return self._service.statistics()

    async def inspect(self) -> dict[str, Any]:
        """The document of ``/inspect/system/fylr`` (reads the database)."""
        return await self._service.inspect()

    def stop(self) -> None:
        """Stop gracefully (what SIGTERM does): :func:`serve_fylr` returns when done."""
        self._service.stop_requested.set()

    async def wait_until(self, predicate: Callable[[FylrStatistics], bool]) -> None:
        """Wait until ``predicate(self.statistics())`` holds.

        It is re-checked after every change this process makes to a file or to its
        own counters, and at least once a second for the figures of the dispatcher
        and the broker client, which change without telling. Bound it with a
        cancel scope.
        """
        while not predicate(self.statistics()):
            with trio.move_on_after(1.0):  # dispatcher and client counters change silently
                await self._service.wait_changed()

    async def wait_closed(self) -> None:
        """Wait until :func:`serve_fylr` has stopped everything."""
        await self._service.closed.wait()


async def _wake_on_capacity(client: BrokerClient, dispatcher: Dispatcher) -> None:
    """Claim at once when the execservers' capacity changes (a first HELLO, say)."""

    def capacity() -> tuple[tuple[str, int, int], ...]:
        return tuple(
            sorted((i.instance_id, i.processes, i.clients) for i in client.instance_loads())
        )

    seen = capacity()
    dispatcher.wake()

    def moved() -> bool:
        return capacity() != seen

    while True:
        await client.wait_until(moved)
        seen = capacity()
        dispatcher.wake()


def client_config(config: FylrConfig, *, backend_id: str, callback_port: int) -> ClientConfig:
    """The broker client's configuration for a fylr configuration (with execservers)."""
    return ClientConfig(
        backend_id=backend_id,
        name=config.name,
        version=__version__,
        callback_url=config.callback_own_url,
        callback_port=callback_port,
        addresses=tuple(config.execservers),
        connect_timeout=config.connect_timeout,
        pool_grow_interval=config.pool_grow_interval,
        pool_max=config.pool_max,
        pool_reprobe_interval=config.pool_reprobe_interval,
        ping_interval=config.ping_interval,
        ping_timeout=config.ping_timeout,
    )


def dispatcher_config(config: FylrConfig, *, backend_id: str) -> DispatcherConfig:
    """The dispatcher's configuration for a fylr configuration."""
    return DispatcherConfig(
        backend_id=backend_id,
        name=config.name,
        tick_interval=config.claim_interval,
        heartbeat_interval=config.heartbeat_interval,
        stale_after=config.stale_after,
        local_workers=config.resolved_local_workers(),
        admission=AdmissionConfig(max_in_flight=config.max_in_flight),
        no_slot_delay=config.retry_delay,
        shutdown_timeout=_SHUTDOWN_TIMEOUT,
    )


@contextlib.asynccontextmanager
async def _open_database(config: FylrConfig) -> AsyncIterator[tuple[str, str]]:
    """The DSN to use and how to describe it: the configured one, or the private cluster's."""
    if config.database is not None:
        yield config.database, describe_dsn(config.database)
        return
    async with open_pg_cluster(config.pg_dir) as cluster:
        dsn = await trio.to_thread.run_sync(cluster.ensure_database, EMBEDDED_DATABASE)
        log.info(
            "private PostgreSQL cluster started",
            extra=fields(folder=str(config.pg_dir), port=cluster.port),
        )
        yield dsn, f"embedded cluster in {config.pg_dir} (port {cluster.port})"


@contextlib.asynccontextmanager
async def _maybe_client(
    config: FylrConfig, service: _Fylr, port: int
) -> AsyncIterator[BrokerClient | None]:
    if not config.execservers:
        yield None
        return
    async with open_broker_client(
        client_config(config, backend_id=service.backend_id, callback_port=port),
        broker_token=config.broker_token,
        pipes=service.pipes,
        max_frame_bytes=config.max_frame_bytes,
        wait_connected=None,
    ) as client:
        yield client


async def serve_fylr(
    config: FylrConfig,
    *,
    task_status: trio.TaskStatus[FylrHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a fylr until :meth:`FylrHandle.stop` (or until cancelled).

    Starts (or connects to) the database, sweeps the storage, binds the listener
    of ``config.listen`` (port 0 picks a free port), dials the execservers and
    starts the dispatcher; then calls ``task_status.started()`` with a
    :class:`FylrHandle`. Routes of the listener:

    ``PUT /eas/put?filename=NAME&priority=N``
        the body is the file; 201 with the file's document (``id`` …), 400 for
        a bad query, 413 over ``max_upload_size``.
    ``GET /api/v1/eas/<id>[?wait=S]``
        the file's document (:func:`file_document`); 404 for an unknown id.
    ``POST /api/v1/eas/<id>/sync``
        sync an original again (202); 409 while it waits for its metadata step.
    ``GET /api/v1/eas/download/<id>/<version>``
        the stored original (``original``) or a ``done`` version; 404 otherwise.
    ``GET /healthz``, ``GET /inspect/system/fylr``, ``GET /metrics``
        health, the inspection document (JSON), Prometheus text.
    ``GET|PUT /pipe/<id>``, ``GET /whoami``
        the broker client's one-time pipes and callback check.

    Args:
        config: the fylr configuration (:class:`~trio_broker_daemons.fylr.config.FylrConfig`).

    Raises:
        PostgresNotFound, PgClusterError: the private cluster could not start.
        StoreUnavailable: the database could not be reached.
    """
    backend_id = config.backend_id or new_backend_id(config.name)
    storage = Storage(config.storage_dir)
    swept = await storage.sweep_temporary()
    if swept:
        log.info("removed leftovers of interrupted writes", extra=fields(files=swept))
    service: _Fylr | None = None
    try:
        async with (
            _open_database(config) as (dsn, database),
            open_store(
                dsn, pool_size=config.database_pool, migrations=fylr_migrations(), wait=30.0
            ) as store,
        ):
            service = _Fylr(
                config, backend_id=backend_id, store=store, storage=storage, database=database
            )
            http_stopped = trio.Event()
            async with trio.open_nursery() as http_nursery:
                host, port = await http_nursery.start(
                    functools.partial(
                        serve_app,
                        service.app(),
                        listener_config(config.listen),
                        shutdown_trigger=http_stopped.wait,
                    )
                )
                handle = FylrHandle(service, host, port)
                service.base_url = handle.url
                try:
                    async with _maybe_client(config, service, port) as client:
                        service.client = client
                        actions = [
                            Action(ACTION_METADATA, exec_bound=True, handler=service.metadata),
                            Action(ACTION_SYNC, exec_bound=False, handler=service.sync),
                            Action(ACTION_PRODUCE, exec_bound=True, handler=service.produce),
                        ]
                        async with trio.open_nursery() as work:
                            dispatcher: Dispatcher = await work.start(
                                _dispatcher_task(store, actions, config, backend_id, client)
                            )
                            service.dispatcher = dispatcher
                            if client is not None:
                                work.start_soon(_wake_on_capacity, client, dispatcher)
                            log.info(
                                "fylr serving",
                                extra=fields(
                                    url=handle.url,
                                    backend_id=backend_id,
                                    database=database,
                                    execservers=",".join(config.execservers) or None,
                                ),
                            )
                            task_status.started(handle)
                            await service.stop_requested.wait()
                            log.info("stopping: returning claimed items to the queue")
                            service.stopping = True
                            work.cancel_scope.cancel()
                finally:
                    service.stopping = True
                    http_stopped.set()
    finally:
        if service is not None:
            service.closed.set()
            log.info("fylr stopped", extra=fields(backend_id=backend_id))


def _dispatcher_task(
    store: Store,
    actions: Sequence[Action],
    config: FylrConfig,
    backend_id: str,
    client: BrokerClient | None,
) -> Callable[..., Any]:
    """``serve_dispatcher`` bound to a fylr's store, actions and configuration."""

    async def run(task_status: trio.TaskStatus[Dispatcher]) -> None:
        await serve_dispatcher(
            store,
            actions,
            dispatcher_config(config, backend_id=backend_id),
            exec_client=client,
            task_status=task_status,
        )

    return run
