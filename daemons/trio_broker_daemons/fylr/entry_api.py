"""The routes of the fylr's further ways in, and of its local actions.

Routes (role in brackets; the decisions are
:mod:`~trio_broker_daemons.fylr.derived`'s and
:mod:`~trio_broker_daemons.fylr.local_actions`'s):

``POST /eas/produce?source=ID[&rotate=R][&crop=x,y,w,h][&format=EXT][&priority=N]`` [upload]
    ``R`` is 90, 180 or 270 (degrees clockwise). Records a modified original of
    ``source`` and queues its produce step; 201 with its document (``status``
    ``processing``, ``derived_from``); 400 for a bad parameter (named) or a
    version's id, 404 for an unknown source, 409 for a source whose bytes are
    not stored yet, 501 when no ``modify`` service is configured, 503 while
    stopping.
``PUT /eas/put?original=ID&version=NAME`` [upload]
    stores the body as the manual version ``NAME`` of original ``ID`` (replacing
    a manual one of that name); 201 with the version's document; 400 for a bad
    name, 404 for an unknown original, 409 while the original's class makes that
    version itself (or the original is not produced yet); 413 and 503 as an
    upload. Without ``original`` the route is the upload
    (:meth:`FileApi.upload <trio_broker_daemons.fylr.api.FileApi.upload>`). The
    version is labelled with the request's ``Content-Type``.
``POST /inspect/system/fylr/checksum[?file=ID][&priority=N]`` [operator]
``POST /inspect/system/fylr/copy_move[?file=ID][&location=NAME][&priority=N]`` [operator]
``POST /inspect/system/fylr/sync_check[?file=ID][&priority=N]`` [operator]
    queue the local action for one file (an original with its versions) or,
    without ``file``, for every file; 202 ``{"action", "queued": n, "running":
    n, "files": [...]}`` (``files``: the ids queued, for one file); 400 for a bad
    parameter or a location this fylr does not configure, 404 for an unknown file.
    Priority: background (-2) unless given.
"""

from __future__ import annotations

import contextlib
import logging
import mimetypes
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, Final

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from trio_broker_daemons.fylr.access import Role
from trio_broker_daemons.fylr.config import DELIVERED_VERSION
from trio_broker_daemons.fylr.derived import (
    Modification,
    ProduceRefused,
    manual_refusal,
    parse_modification,
    priority_of,
    renamed,
)
from trio_broker_daemons.fylr.derived_store import DerivedStore
from trio_broker_daemons.fylr.files import FileRow
from trio_broker_daemons.fylr.guard import GuardedRoute, route
from trio_broker_daemons.fylr.local_store import LOCAL_ACTIONS, LocalAction, LocalStore
from trio_broker_daemons.fylr.produce import class_of
from trio_broker_daemons.fylr.state import FylrState
from trio_broker_daemons.fylr.storage import StoredFile
from trio_broker_daemons.runtime.logfmt import fields

__all__ = ["LOCAL_PRIORITY", "EntryApi"]

log = logging.getLogger("trio_broker_daemons.fylr.entry_api")

LOCAL_PRIORITY: Final = -2
"""The priority of the local actions an operator queues, unless the request gives one."""
_SHOWN_FILES: Final = 1000
"""The most file ids an answer lists."""

Endpoint = Callable[[Request], Coroutine[Any, Any, Response]]
StoreBody = Callable[..., Awaitable[StoredFile | Response]]
"""``(request, kind, *, what)``: the body into storage, or the answer why not
(:meth:`FileApi.store_body <trio_broker_daemons.fylr.api.FileApi.store_body>`)."""


def _file_id(text: str | None, what: str) -> int:
    if text is None or not text.isascii() or not text.isdigit() or len(text) > 18:
        raise ProduceRefused(f"{what}: expected a file id, got {text!r}")
    return int(text)


def _refused(exc: ProduceRefused) -> Response:
    return JSONResponse({"error": str(exc)}, status_code=exc.status)


class EntryApi:
    """Modified originals, manual versions and the local actions' routes.

    Args:
        state: the process's shared state.
        document: a file's document (download links signed).
        upload: the upload endpoint (``/eas/put`` without ``original``).
        store_body: streams a body into storage (:data:`StoreBody`).
        unavailable: a 503 answer with ``Retry-After``.
    """

    def __init__(
        self,
        state: FylrState,
        *,
        document: Callable[[FileRow], Mapping[str, Any]],
        upload: Endpoint,
        store_body: StoreBody,
        unavailable: Callable[[str], Response],
    ) -> None:
        self.state = state
        self.document = document
        self.upload = upload
        self.store_body = store_body
        self.unavailable = unavailable
        self.derived = DerivedStore(state.store)
        self.local = LocalStore(state.store)

    def routes(self) -> list[GuardedRoute]:
        """``/eas/put`` (uploads and manual versions), ``/eas/produce`` and the three
        local actions' routes, each with its role."""
        return [
            route("/eas/put", self.put, role=Role.UPLOAD, methods=("PUT",)),
            route("/eas/produce", self.produce, role=Role.UPLOAD, methods=("POST",)),
            *[
                route(
                    f"/inspect/system/fylr/{action}",
                    self._local(action),
                    role=Role.OPERATOR,
                    methods=("POST",),
                )
                for action in LOCAL_ACTIONS
            ],
        ]

    # -- modified originals --------------------------------------------------------------

    async def produce(self, request: Request) -> Response:
        """``POST /eas/produce``: a modified original of another one."""
        state = self.state
        query = request.query_params
        try:
            source_id = _file_id(query.get("source"), "source")
            modification = parse_modification(query)
            priority = None
            if "priority" in query:
                priority, bad = priority_of(query["priority"])
                if bad is not None:
                    raise ProduceRefused(bad)
        except ProduceRefused as exc:
            return _refused(exc)
        if state.config.modify is None:
            return JSONResponse(
                {"error": "this fylr makes no modified originals (no modify service configured)"},
                status_code=501,
            )
        if state.stopping:
            return self.unavailable("the server is shutting down")

        def name_of(source: FileRow) -> tuple[str, str | None, str | None]:
            filename = renamed(source.filename, modification.format)
            guess, _ = mimetypes.guess_type(filename, strict=False)
            return filename, class_of(filename, state.config), guess

        try:
            row = await self.derived.create_modified(
                source_id, modification, priority=priority, name_of=name_of
            )
        except ProduceRefused as exc:
            return _refused(exc)
        state.wake_dispatcher()
        state.changed(row.id, source_id)
        log.info(
            "modified original recorded",
            extra=fields(file=row.id, source=source_id, **_shown(modification)),
        )
        return JSONResponse(self.document(row), status_code=201)

    # -- manual versions -----------------------------------------------------------------

    async def put(self, request: Request) -> Response:
        """``PUT /eas/put``: a manual version with ``original``, else an upload."""
        if "original" not in request.query_params:
            return await self.upload(request)
        return await self.put_version(request)

    def _manual_check(self, name: str) -> Callable[[FileRow, bool], ProduceRefused | None]:
        def check(original: FileRow, converted: bool) -> ProduceRefused | None:
            return manual_refusal(
                self.state.config,
                name=name,
                original_filename=original.filename,
                original_status=original.status,
                converted=converted,
            )

        return check

    async def put_version(self, request: Request) -> Response:
        """``PUT /eas/put?original=ID&version=NAME``: store a manual version."""
        state = self.state
        query = request.query_params
        name = query.get("version", "")
        try:
            original_id = _file_id(query.get("original"), "original")
            # before the body is stored: most refusals cost no upload
            found = await state.files.with_versions(original_id)
            if found is None:
                raise ProduceRefused(f"original: no file {original_id}", status=404)
            original, versions = found
            if original.kind != "original":
                raise ProduceRefused(f"original: file {original_id} is a version, not an original")
            converted = any(v.manual and v.version == DELIVERED_VERSION for v in versions)
            refused = self._manual_check(name)(original, converted)
            if refused is not None:
                raise refused
        except ProduceRefused as exc:
            state.count("uploads_refused")
            return _refused(exc)
        if state.stopping:
            return self.unavailable("the server is shutting down")
        stored = await self.store_body(request, "version", what=f"{original.filename} {name}")
        if isinstance(stored, Response):
            return stored
        mimetype = request.headers.get("content-type", "").split(";")[0].strip() or None
        try:
            with trio.CancelScope(shield=True):
                result = await self.derived.store_manual(
                    original_id, name, stored, mimetype=mimetype, check=self._manual_check(name)
                )
        except ProduceRefused as exc:  # the original changed while the body came
            with contextlib.suppress(OSError):
                await state.storage.delete(stored.key)
            return _refused(exc)
        finally:
            state.storage.settled(stored.key)
        if result.replaced_key is not None:
            with contextlib.suppress(OSError, ValueError):
                await state.storage.delete(result.replaced_key)
        state.count("uploads")
        state.count("bytes_uploaded", stored.size)
        state.changed(original_id)
        log.info(
            "manual version stored",
            extra=fields(file=original_id, version=name, size=stored.size, sha256=stored.sha256),
        )
        return JSONResponse(self.document(result.version), status_code=201)

    # -- local actions -------------------------------------------------------------------

    def _local(self, action: LocalAction) -> Endpoint:
        async def endpoint(request: Request) -> Response:
            return await self.queue_local(action, request)

        return endpoint

    async def queue_local(self, action: LocalAction, request: Request) -> Response:
        """``POST /inspect/system/fylr/<action>``: queue a local action."""
        query = request.query_params
        try:
            file_id = None if "file" not in query else _file_id(query["file"], "file")
            priority, bad = priority_of(query.get("priority", str(LOCAL_PRIORITY)))
            if bad is not None:
                raise ProduceRefused(bad)
            payload = {}
            if action == "copy_move" and "location" in query:
                location = query["location"]
                if location not in self.state.config.locations:
                    known = ", ".join(sorted(self.state.config.locations))
                    raise ProduceRefused(
                        f"location: expected a storage location of this fylr ({known}),"
                        f" got {location!r}"
                    )
                payload["location"] = location
            if file_id is not None and await self.state.files.get(file_id) is None:
                raise ProduceRefused(f"file: no file {file_id}", status=404)
        except ProduceRefused as exc:
            return _refused(exc)
        queued = await self.local.queue(action, file_id, payload=payload, priority=priority)
        if queued.queued:
            self.state.wake_dispatcher()
        log.info(
            f"{action} queued",
            extra=fields(file=file_id, queued=len(queued.queued), running=len(queued.running)),
        )
        document: dict[str, Any] = {
            "action": action,
            "queued": len(queued.queued),
            "running": len(queued.running),
        }
        if len(queued.queued) <= _SHOWN_FILES:
            document["files"] = list(queued.queued)
        return JSONResponse(document, status_code=202)


def _shown(modification: Modification) -> dict[str, Any]:
    crop = modification.crop
    return {
        "rotate": modification.rotate,
        "crop": None if crop is None else ",".join(map(str, crop)),
        "format": modification.format,
    }
