"""The fylr's HTTP API: upload, get a file, sync again, download, health.

Theory of operation
===================

:func:`build_app` makes the starlette application the fylr's one listener
serves; its handlers (:class:`FileApi`) work on the process's
:class:`~trio_broker_daemons.fylr.state.FylrState`.

**Adding a route.** Every route declares who may use it: build it with
:func:`~trio_broker_daemons.fylr.guard.route` (or ``websocket_route``) and its
:class:`~trio_broker_daemons.fylr.access.Role`, one line::

    route("/eas/put", api.upload, role=Role.UPLOAD, methods=("PUT",))

``Role.UPLOAD`` puts content in, ``Role.READ`` reads documents and downloads,
``Role.OPERATOR`` runs the installation (sync, requeue, cancel, delete,
inspection, metrics), ``Role.PUBLIC`` needs nothing (probes), ``Role.PIPE``
is what the execservers call back (pipes, ``/whoami``). A state-changing
route takes ``POST``, ``PUT`` or ``DELETE`` (never ``GET``) with a JSON or
binary body. :func:`build_app`
refuses a route without a role, and the matrix test
(``tests/daemons/test_fylr_access.py``) tries every route of the real
application with no, a wrong, and each role's token: a new route is covered
the moment it is added. The rules are :mod:`trio_broker_daemons.fylr.access`'s.

Routes (role in brackets):

``PUT /eas/put?filename=NAME&priority=N`` [upload]
    the body is streamed into storage (hashed on the way), then the original's
    row is inserted with its first step queued, in one transaction; 201 with the
    file's document, 400 for a bad query, 413 over ``max_upload_size``, 503
    while stopping, or when the storage folder or the database fails. An upload
    whose sender goes away keeps nothing.
``GET /api/v1/eas/<id>[?wait=S[&until=ended]]`` [read]
    the file's document (:func:`file_document`); 404 for an unknown id. With
    ``wait``, it answers at once when the file has ended, otherwise when this
    process next changes it (or after ``S`` seconds, at most :data:`MAX_WAIT`):
    clients and tests follow a file's progress without polling. With
    ``until=ended`` it answers only once the file has ended (or after ``S``):
    a client that shows no progress asks once per ``S``, not once per change.
``PUT /eas/rput?url=URL&priority=N[&leave_on_remote=1][&filename=NAME]`` [upload]
    register a file at a remote URL, copied in or left there
    (:mod:`~trio_broker_daemons.fylr.remote_api`); 201 with its document, 400
    for a bad query or a URL the blocklist refuses.
``POST /api/v1/eas/<id>/sync`` [operator]
    sync an original again (202); 409 while it waits for its metadata step.
``GET /api/v1/eas/download/<id>/<version>`` [read, or a signed link]
    the stored original (``original``) or a ``done`` version; 404 otherwise.
    It answers one ``Range`` (206, 416 beyond the end) and ``If-None-Match``
    against its ``ETag``, the quoted SHA-256 (304):
    :mod:`~trio_broker_daemons.fylr.ranges`.
``GET /api/v1/eas/download/<id>/custom?preset=NAME`` [read, or a signed link]
    an on-demand rendition of the original, made now and streamed, never
    stored; also ``?service=NAME&PARAM=VALUE…`` within the class's
    ``custom_versions`` (:mod:`~trio_broker_daemons.fylr.renditions`: 400 for a
    request no preset or class allows, 503, 502 and the broken transfer).
``GET /api/v1/eas/export/<id>`` [read]
    the original and its document as a tar stream
    (:mod:`~trio_broker_daemons.fylr.export`); 409 with the file's ``state``
    before its metadata is known or after it failed.
``GET /healthz`` [public]
    200 ``{"status": "serving"}``, 503 ``{"status": "stopping"}``.
``PUT /eas/put?original=ID&version=NAME``, ``POST /eas/produce?source=ID&…`` [upload]
    a manual version; a modified original
    (:mod:`~trio_broker_daemons.fylr.entry_api`).
``POST /inspect/system/fylr/checksum|copy_move|sync_check[?file=ID]`` [operator]
    queue a local action for one file or all
    (:mod:`~trio_broker_daemons.fylr.entry_api`).
``GET /livez``, ``GET /readyz`` [public]
    the probes (:mod:`trio_broker_daemons.fylr.probes`).

The application also carries the inspection routes [operator]
(:func:`trio_broker_daemons.fylr.metrics.routes`, the work an operator acts on:
:func:`trio_broker_daemons.fylr.work.routes`,
:func:`trio_broker_daemons.fylr.topology.routes`) and the broker client's
one-time pipes and ``/whoami`` [pipe].

**Signed download links.** The ``url`` of a file document (and of each
version) is a link that works without a token until it expires (``link_ttl``
after the document was made): ``…/download/<id>/<version>?expires=<unix
seconds>&signature=<s>``. The signature covers the path and ``expires`` only.
A client keeps both parameters as they are and may add what the signature
does not cover: a ``Range`` header for a part of the file, further query
parameters after them for a route that reads them (``…&signature=<s>&page=2``).
Changing the path (another id or version) or ``expires`` breaks the link
(403); a link past its expiry is 403 too: fetch the document again for a
fresh one. A request with a ``read`` token needs no link.

While the database is unavailable every route that needs it answers 503 with
``Retry-After: RETRY_AFTER`` (:data:`RETRY_AFTER`), GET included: the request
may be repeated as it is. So do uploads whose storage write failed, and
requests while the process is stopping.
"""

from __future__ import annotations

import logging
import math
import mimetypes
import time
import urllib.parse
from collections.abc import AsyncIterable, Callable, Mapping, Sequence
from typing import Any, Final, cast

import trio
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from trio_broker.trio import tracing
from trio_broker.trio.store import StoreUnavailable
from trio_broker_daemons.fylr import metrics, probes, renditions, topology, work
from trio_broker_daemons.fylr.access import Access, Role
from trio_broker_daemons.fylr.config import FileClass, is_version_name
from trio_broker_daemons.fylr.derived import priority_of
from trio_broker_daemons.fylr.entry_api import EntryApi
from trio_broker_daemons.fylr.export import export_refusal, tar_stream
from trio_broker_daemons.fylr.files import FileRow
from trio_broker_daemons.fylr.guard import FylrGate, access_of, guarded, route, undeclared
from trio_broker_daemons.fylr.local_actions import integrity_members
from trio_broker_daemons.fylr.position import add_queue_positions
from trio_broker_daemons.fylr.produce import api_status, class_of
from trio_broker_daemons.fylr.ranges import plan_download
from trio_broker_daemons.fylr.remote_api import RemoteApi, add_remote
from trio_broker_daemons.fylr.state import FylrState
from trio_broker_daemons.fylr.storage import FileReader, FileTooLarge, StoredFile, StoredKind
from trio_broker_daemons.fylr.worker import OCTET_STREAM
from trio_broker_daemons.runtime.logfmt import fields

__all__ = [
    "MAX_FILENAME_CHARS",
    "MAX_WAIT",
    "RETRY_AFTER",
    "FileApi",
    "build_app",
    "file_document",
    "unavailable",
]

log = logging.getLogger("trio_broker_daemons.fylr.api")

MAX_WAIT: Final = 60.0
"""The longest ``?wait=`` a file request may ask for, in seconds."""
MAX_FILENAME_CHARS: Final = 1000
"""The longest file name an upload may carry."""
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1
RETRY_AFTER: Final = 2
"""Seconds a 503 answer asks the client to wait (its ``Retry-After``)."""


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


class _Download(StreamingResponse):
    """A stored file streamed out; the file is closed however the response ends."""

    def __init__(
        self,
        reader: FileReader,
        headers: Mapping[str, str],
        media_type: str,
        body: AsyncIterable[bytes] | None = None,
    ) -> None:
        super().__init__(
            reader if body is None else body, headers=dict(headers), media_type=media_type
        )
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


def _guess_mimetype(filename: str) -> str | None:
    guess, _ = mimetypes.guess_type(filename, strict=False)
    return guess


def _not_found() -> Response:
    return JSONResponse({"error": "not found"}, status_code=404)


def unavailable(error: str) -> Response:
    """A 503 answer with ``Retry-After``: the request may be repeated as it is."""
    return JSONResponse(
        {"error": error}, status_code=503, headers={"retry-after": str(RETRY_AFTER)}
    )


def _early(response: Response) -> Response:
    """An answer before the request's body was read: the connection closes after it.

    The sender may still be writing a body nobody reads; left open, its write would
    block until a timeout and it would never see the answer. Closed, its write
    fails and it reads the answer (as HTTP clients do after a failed write).
    """
    response.headers["connection"] = "close"
    return response


async def _store_unavailable(request: Request, exc: Exception) -> Response:
    log.info("database unavailable", extra=fields(path=request.url.path, error=str(exc)))
    return unavailable(f"the database is unavailable: {exc}")


def _quote(text: str) -> str:
    return urllib.parse.quote(text, safe="")


# -- documents ---------------------------------------------------------------------------


Sign = Callable[[str], str]
"""Makes a path a signed link (its query): :meth:`Access.sign` at the current time."""


def _row_document(row: FileRow, base: str, sign: Sign | None) -> dict[str, Any]:
    name = "original" if row.kind == "original" else row.version
    owner = row.id if row.kind == "original" else row.parent_id
    stored = row.storage_key is not None and (row.kind == "original" or row.status == "done")
    url = None
    if stored:
        path = f"/api/v1/eas/download/{owner}/{name}"
        url = f"{base}{path}?{sign(path)}" if sign is not None else f"{base}{path}"
    return {
        "id": row.id,
        "kind": row.kind,
        "status": api_status(row.status, row.kind),
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
        "url": url,
        **integrity_members(row),
    }


def file_document(
    row: FileRow, versions: Sequence[FileRow], *, base: str = "", sign: Sign | None = None
) -> dict[str, Any]:
    """The JSON document ``GET /api/v1/eas/<id>`` answers.

    Args:
        row: the file (an original or a version).
        versions: an original's versions (empty for a version).
        base: prefixed to the download URLs (``http://host:port``; ``""``: paths).
        sign: makes each download URL a signed link (the module docstring);
            ``None``: plain paths.

    Returns:
        ``id``, ``kind``, ``status`` (the API status), ``state`` (the internal
        one), ``filename``, ``class``, ``filesize``, ``hash`` (``{"sha256": …}``),
        ``mimetype``, ``metadata``, ``error``, ``priority``, timestamps, ``url``
        (its download, once stored); an original has ``versions`` (name → the
        same members), a version ``version``, ``source`` and ``original``. An
        original's ``remote`` is ``None`` here (:func:`add_remote` fills it).
    """
    document = _row_document(row, base, sign)
    if row.kind == "original":
        document["remote"] = None
        document["versions"] = {
            cast(str, version.version): {
                **_row_document(version, base, sign),
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


# -- the handlers ------------------------------------------------------------------------


class FileApi:
    """The request handlers of the file API (routes in the module docstring).

    Args:
        state: the process's shared state.
        access: signs the download links of the documents.
    """

    def __init__(self, state: FylrState, access: Access) -> None:
        self.state = state
        self.files = state.files
        self.storage = state.storage
        self.access = access

    def document(self, row: FileRow, versions: Sequence[FileRow]) -> dict[str, Any]:
        """The file's document, its download URLs signed links valid from now."""
        now = time.time()

        def sign(path: str) -> str:
            return self.access.sign(path, now=now)

        return file_document(row, versions, base=self.state.base_url, sign=sign)

    async def upload(self, request: Request) -> Response:
        """``PUT /eas/put?filename=…&priority=…``: store the body, record the file.

        Traced (the ``otel`` extra): one ``fylr.upload`` span, child of the
        request's ``traceparent`` header when it has one; the steps the upload
        queues join its trace.
        """
        with tracing.span(
            "fylr.upload",
            traceparent=request.headers.get("traceparent"),
            remote=True,
            kind="server",
            attributes={"fylr.filename": request.query_params.get("filename")},
        ) as opened:
            response = await self._upload(request, opened)
            tracing.set_attributes(opened, {"http.response.status_code": response.status_code})
            if response.status_code >= 400:
                tracing.set_error(opened, f"answered {response.status_code}")
            return response

    async def _upload(self, request: Request, opened: tracing.Span) -> Response:
        state = self.state
        filename = request.query_params.get("filename", "")
        problem = None
        if not filename or len(filename) > MAX_FILENAME_CHARS or "\x00" in filename:
            problem = f"filename: expected 1 to {MAX_FILENAME_CHARS} characters"
        priority, bad_priority = priority_of(request.query_params.get("priority", "0"))
        problem = problem or bad_priority
        if state.stopping:
            return _early(unavailable("the server is shutting down"))
        if problem is not None:
            state.count("uploads_refused")
            return _early(JSONResponse({"error": problem}, status_code=400))
        stored = await self.store_body(request, "original", what=filename)
        if isinstance(stored, Response):
            return stored
        class_name = class_of(filename, state.config)
        file_class = state.file_class(class_name)
        try:
            with trio.CancelScope(shield=True):
                row = await self._record(stored, filename, class_name, priority, file_class)
        except StoreUnavailable as exc:
            # it may or may not have committed: the stored bytes stay (never a row
            # without its file; at worst a file without a row, which the storage
            # sweep removes once it is unreferenced and old)
            state.count("uploads_failed")
            return unavailable(f"the database is unavailable: {exc}")
        state.count("uploads")
        state.count("bytes_uploaded", stored.size)
        tracing.set_attributes(opened, {"fylr.file": row.id, "fylr.size": stored.size})
        state.wake_dispatcher()
        state.changed(row.id)
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
        return JSONResponse(self.document(row, []), status_code=201)

    async def store_body(
        self, request: Request, kind: StoredKind, *, what: str
    ) -> StoredFile | Response:
        """Stream a request's body into storage (hashed on the way), or the answer why not.

        Returns:
            The stored file (the caller settles its key), or 413 over
            ``max_upload_size``, 400 for a sender that went away, 503 when the
            storage folder failed; each counted.
        """
        state = self.state
        limit = state.config.max_upload_size
        declared = request.headers.get("content-length", "")
        if limit is not None and declared.isdigit() and int(declared) > limit:
            state.count("uploads_refused")
            return _early(JSONResponse({"error": f"the file is larger than {limit} bytes"}, 413))
        try:
            return await self.storage.write_stream(
                kind, _RequestBody(request.receive), max_size=limit
            )
        except FileTooLarge as exc:
            state.count("uploads_refused")
            return _early(JSONResponse({"error": str(exc)}, status_code=413))
        except _UploadInterrupted:
            state.count("uploads_aborted")
            log.info("upload interrupted", extra=fields(filename=what))
            return Response(status_code=400)  # nobody reads it
        except OSError as exc:  # the folder failed (a vanished temporary file, an I/O error)
            state.count("uploads_failed")
            log.warning("upload not stored", extra=fields(filename=what, error=repr(exc)))
            return unavailable(f"the file could not be stored: {exc}")

    async def _record(
        self,
        stored: StoredFile,
        filename: str,
        class_name: str | None,
        priority: int,
        file_class: FileClass | None,
    ) -> FileRow:
        """Insert the uploaded original's row; the stored file is settled either way."""
        try:
            return await self.files.create_original(
                filename=filename,
                file_class=class_name,
                priority=priority,
                stored=stored,
                mimetype=_guess_mimetype(filename),
                metadata_step=file_class is not None and file_class.metadata is not None,
                produce_first=file_class is not None and file_class.convert is not None,
            )
        finally:
            self.storage.settled(stored.key)

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
        until = request.query_params.get("until", "changed")
        if until not in ("changed", "ended"):
            return JSONResponse({"error": "until: expected changed or ended"}, status_code=400)
        found = await self._wait_for(file_id, wait, until == "ended")
        if found is None:
            return _not_found()
        row, versions = found
        document = self.document(row, versions)
        await add_remote(self.state, document, row)
        await add_queue_positions(self.state, document, row, versions)
        return JSONResponse(document)

    async def _wait_for(
        self, file_id: int, wait: float, ended: bool
    ) -> tuple[FileRow, list[FileRow]] | None:
        """The file and its versions once it changed (``ended``: once it ended), or ``wait`` s."""
        with trio.move_on_after(min(wait, MAX_WAIT)):
            while True:
                with self.state.watch(file_id) as event:  # before reading: no change is missed
                    found = await self.files.with_versions(file_id)
                    if found is None or wait <= 0 or found[0].finished:
                        return found
                    await event.wait()
                if not ended:
                    break
        return await self.files.with_versions(file_id)

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
        self.state.wake_dispatcher()
        self.state.changed(file_id)
        return JSONResponse(self.document(row, []), status_code=202)

    async def download(self, request: Request) -> Response:
        """``GET /api/v1/eas/download/<id>/<version>``: a stored original or version."""
        file_id = _file_id(request.path_params["file_id"])
        name = request.path_params["version"]
        if file_id is None or not (name == "original" or is_version_name(name)):
            return _not_found()  # a NUL, a space, …: no version has such a name
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
        plan = plan_download(reader.size, row.sha256, request.headers)
        download_name = row.filename if name == "original" else f"{row.filename}.{name}"
        headers = {
            **plan.headers,
            "content-disposition": f"attachment; filename*=UTF-8''{_quote(download_name)}",
            "cache-control": "private, no-cache",
        }
        if row.sha256:
            headers["x-content-sha256"] = row.sha256
        if plan.status in (304, 416):
            await reader.aclose()
            return Response(status_code=plan.status, headers=headers)
        self.state.count("downloads")
        await reader.limit(plan.start, plan.length)
        download = _Download(reader, headers, row.mimetype or OCTET_STREAM)
        download.status_code = plan.status
        return download

    async def export(self, request: Request) -> Response:
        """``GET /api/v1/eas/export/<id>``: the original and its document, as a tar stream."""
        file_id = _file_id(request.path_params["file_id"])
        found = None if file_id is None else await self.files.with_versions(file_id)
        if found is None or found[0].kind != "original" or found[0].storage_key is None:
            return _not_found()
        row, versions = found
        refusal = export_refusal(row)
        if refusal is not None:
            return JSONResponse(refusal, status_code=409)
        try:
            reader = await self.storage.open_read(cast(str, row.storage_key))
        except (FileNotFoundError, ValueError):
            return _not_found()
        self.state.count("downloads")
        headers = {
            "content-disposition": f"attachment; filename*=UTF-8''{row.id}.tar",
            "cache-control": "no-store",
        }
        body = tar_stream(row, self.document(row, versions), reader)
        return _Download(reader, headers, "application/x-tar", body)

    async def custom_download(self, request: Request) -> Response | renditions.RenditionResponse:
        """``GET /api/v1/eas/download/<id>/custom?…``: an on-demand rendition of the original."""
        file_id = _file_id(request.path_params["file_id"])
        row = None if file_id is None else await self.files.get(file_id)
        if row is None or row.kind != "original" or row.storage_key is None:
            return _not_found()
        if self.state.stopping:
            return unavailable("the server is shutting down")
        try:
            rendition = renditions.resolve(
                self.state.config, row, request.query_params.multi_items()
            )
        except renditions.RenditionRefused as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        self.state.count("downloads")
        return renditions.RenditionResponse(
            rendition, renditions.job_runner(self.state, row, rendition), retry_after=RETRY_AFTER
        )

    async def healthz(self, request: Request) -> Response:
        """``GET /healthz``: serving, or stopping (503)."""
        if self.state.stopping:
            return JSONResponse(
                {"status": "stopping"},
                status_code=503,
                headers={"retry-after": str(RETRY_AFTER)},
            )
        return JSONResponse({"status": "serving"})


def build_app(state: FylrState, access: Access | None = None) -> Starlette:
    """The starlette application of one fylr process (every route of the listener).

    Args:
        state: the process's shared state; its pipes are served here too.
        access: who may do what (:func:`~trio_broker_daemons.fylr.guard.access_of`
            of the configuration by default); ``app.state.access`` holds it.

    Returns:
        The file API, health, inspection and metrics, the pipes and ``/whoami``,
        every route guarded by its role, the whole behind
        :class:`~trio_broker_daemons.fylr.guard.FylrGate`.

    Raises:
        RuntimeError: a route declares no role.
    """
    access = access or access_of(state.config)
    api = FileApi(state, access)
    entry = EntryApi(
        state,
        document=lambda row: api.document(row, []),
        upload=api.upload,
        store_body=api.store_body,
        unavailable=unavailable,
    )
    remote = RemoteApi(state, document=lambda row: api.document(row, []), unavailable=unavailable)
    routes = [
        *entry.routes(),  # /eas/put (uploads, manual versions), /eas/produce, local actions
        route("/eas/rput", remote.rput, role=Role.UPLOAD, methods=("PUT",)),
        route(
            "/api/v1/eas/download/{file_id}/custom",
            api.custom_download,
            role=Role.READ,
            links=True,
        ),
        route("/api/v1/eas/download/{file_id}/{version}", api.download, role=Role.READ, links=True),
        route("/api/v1/eas/export/{file_id}", api.export, role=Role.READ),
        route("/api/v1/eas/{file_id}/sync", api.resync, role=Role.OPERATOR, methods=("POST",)),
        route("/api/v1/eas/{file_id}", api.get_file, role=Role.READ),
        route("/healthz", api.healthz, role=Role.PUBLIC),
        *probes.routes(state),
        *metrics.routes(state),
        *work.routes(state),
        *topology.routes(state, access),
        *guarded(state.pipes.routes(), role=Role.PIPE),
    ]
    missing = undeclared(routes)
    if missing:
        raise RuntimeError(
            f"routes without a role: {', '.join(missing)} (build them with"
            " trio_broker_daemons.fylr.guard.route and a Role)"
        )
    app = Starlette(
        routes=routes,
        middleware=[Middleware(FylrGate, access=access)],
        exception_handlers={StoreUnavailable: _store_unavailable},
    )
    app.state.access = access
    return app
