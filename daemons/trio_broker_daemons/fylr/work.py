"""Work an operator can act on: list files and steps, see a step's attempts, cancel,
retry, delete; and the admission with its parts.

Theory of operation
===================

Every route here needs the ``operator`` role (the inspection token,
:mod:`~trio_broker_daemons.fylr.access`) and answers JSON. A bad filter is 400
with one line naming the parameter, what was expected and what came; an
unknown id is 404. The queue's rows and their attempts are read and changed
only through the store (:mod:`trio_broker.trio.store`); the ``files`` table
through :class:`~trio_broker_daemons.fylr.files.FileStore`.

``GET /inspect/system/fylr/files``
    files, newest first. Filters (each repeatable, any value matches):
    ``kind`` (``original``, ``version``), ``state`` (the internal states:
    ``new``, ``metadata``, ``sync``, ``produce``, ``done``, ``error`` …),
    ``priority`` (an integer), ``class``; ``older_than`` (seconds since the
    upload, at least). Paged: ``limit`` (1 to :data:`MAX_LIMIT`, default
    :data:`DEFAULT_LIMIT`) and ``cursor`` (the ``next_cursor`` of the page
    before; ``null`` on the last page).
``GET /inspect/system/fylr/steps``
    queue rows (steps), oldest first. Filters: ``state`` (``ready``,
    ``delayed``, ``claimed``, ``failed``), ``priority``, ``action``,
    ``service`` (the execserver service the step runs: a ``metadata`` or
    ``produce`` step's, by the file's class), ``file`` (an original with its
    versions), ``older_than``; ``limit`` and ``cursor`` as above. A page
    filtered by service looks at :data:`SERVICE_SCAN` pages of rows at most and
    may come back short with a ``next_cursor``: ask again from there.
``GET /inspect/system/fylr/steps/<id>``
    one step and its attempts: per ended claim its number, the fylr backend
    that held it, the execserver instance whose receipt came back, when it
    started, how long it took, the outcome (``no_slot``, ``stopped``,
    ``unknown_service``, ``failed``, ``cancelled`` …), the reason and the
    receipt's decisive line; a claim running now is ``current``. A step that
    finished is gone (its row and attempts are deleted): 404.
``POST /inspect/system/fylr/steps/<id>/cancel``
    a queued step (ready or delayed) or a running one: its row becomes
    ``failed`` (``cancelled by an operator``) and its file ends as a failed
    step would (a version or an original ``error``). A running step's job is
    cancelled through the broker's ``CANCEL``: at once when this fylr holds
    it, at the holder's next heartbeat otherwise. 409 for a failed step.
``POST /inspect/system/fylr/steps/<id>/retry``
    put one failed step back (:func:`~trio_broker_daemons.fylr.failed.retry_failed`);
    409 when it has not failed.
``POST /inspect/system/fylr/files/<id>/retry``
    put back every failed step of a file (an original with its versions, or
    one version), each file back to where its step starts.
``DELETE /inspect/system/fylr/files/<id>``
    delete an original with its versions, their queue rows (running steps are
    cancelled as above) and their stored bytes. 409 for a version (it goes
    with its original).
``GET /inspect/system/queues``
    the admission and its parts: the base (this fylr's share of the
    execservers' slots plus its CPUs), the rise the idle slots earned, the odd
    reserve, the cap, what is in flight and what waits at the execservers, the
    local workers, each execserver's announced load, and the queue per
    priority band (ready, delayed, claimed, failed, the oldest ready row's age).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from trio_broker.trio.host import cpu_count
from trio_broker.trio.queue_sql import ITEM_STATES
from trio_broker.trio.store import (
    Attempt,
    QueueItem,
    StoreUnavailable,
    failed_ids_in,
)
from trio_broker_daemons.fylr.access import Role
from trio_broker_daemons.fylr.derived import priority_of
from trio_broker_daemons.fylr.failed import retry_failed
from trio_broker_daemons.fylr.files import (
    ACTION_METADATA,
    ACTION_PRODUCE,
    FileRow,
    FilesDeleted,
)
from trio_broker_daemons.fylr.guard import GuardedRoute, route
from trio_broker_daemons.fylr.position import service_of
from trio_broker_daemons.fylr.produce import STATES, api_status
from trio_broker_daemons.fylr.remote_files import ACTION_COPY
from trio_broker_daemons.fylr.state import FylrState
from trio_broker_daemons.runtime.logfmt import fields

__all__ = [
    "CANCEL_NOTE",
    "DEFAULT_LIMIT",
    "MAX_LIMIT",
    "SERVICE_SCAN",
    "band_name",
    "queues_document",
    "routes",
]

log = logging.getLogger("trio_broker_daemons.fylr.work")

DEFAULT_LIMIT: Final = 100
"""Rows a page holds unless ``limit`` says otherwise."""
MAX_LIMIT: Final = 1000
"""The largest ``limit`` a page may ask for."""
SERVICE_SCAN: Final = 10
"""Pages of rows a listing filtered by service looks at, at most, per request."""
CANCEL_NOTE: Final = "cancelled by an operator"
"""The reason a cancelled step's row (and its file) carries."""
EXEC_ACTIONS: Final = (ACTION_METADATA, ACTION_PRODUCE)
_BANDS: Final = {-2: "background", 0: "normal", 2: "interactive", 4: "synchronous"}


class BadRequest(Exception):
    """A request's parameter is refused: its text is the one line of the 400 answer."""


def band_name(priority: int) -> str:
    """``normal``, ``high-interactive`` …; the number itself outside the bands."""
    base = priority - (priority % 2)
    name = _BANDS.get(base)
    if name is None:
        return str(priority)
    return name if priority % 2 == 0 else f"high-{name}"


# -- parameters ----------------------------------------------------------------------------


def _id_of(text: str) -> int | None:
    if not text.isascii() or not text.isdigit() or len(text) > 18:
        return None
    return int(text)


def _choices(request: Request, name: str, allowed: Sequence[str]) -> list[str] | None:
    values = request.query_params.getlist(name)
    for value in values:
        if value not in allowed:
            raise BadRequest(f"{name}: expected one of {', '.join(allowed)}; got {value!r}")
    return values or None


def _texts(request: Request, name: str) -> list[str] | None:
    values = request.query_params.getlist(name)
    for value in values:
        if not value or len(value) > 200:
            raise BadRequest(f"{name}: expected 1 to 200 characters; got {value!r}")
    return values or None


def _priorities(request: Request) -> list[int] | None:
    found = []
    for value in request.query_params.getlist("priority"):
        priority, problem = priority_of(value)
        if problem is not None:
            raise BadRequest(problem)
        found.append(priority)
    return found or None


def _seconds(request: Request, name: str) -> float | None:
    text = request.query_params.get(name)
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise BadRequest(f"{name}: expected seconds (a number >= 0); got {text!r}")
    return value


def _limit(request: Request) -> int:
    text = request.query_params.get("limit", str(DEFAULT_LIMIT))
    value = _id_of(text)
    if value is None or not 1 <= value <= MAX_LIMIT:
        raise BadRequest(f"limit: expected 1 to {MAX_LIMIT}; got {text!r}")
    return value


def _cursor(request: Request) -> int | None:
    text = request.query_params.get("cursor")
    if text is None:
        return None
    value = _id_of(text)
    if value is None:
        raise BadRequest(f"cursor: expected the next_cursor of a page; got {text!r}")
    return value


def _known(request: Request, allowed: Sequence[str]) -> None:
    for name in request.query_params:
        if name not in allowed:
            raise BadRequest(f"{name}: unknown parameter (expected {', '.join(allowed)})")


def _bad(exc: BadRequest) -> Response:
    return JSONResponse({"error": str(exc)}, status_code=400)


def _not_found(what: str) -> Response:
    return JSONResponse({"error": what}, status_code=404)


def _no_step(text: str) -> Response:
    return _not_found(f"no step {text} (finished, or never queued)")


# -- documents -----------------------------------------------------------------------------


def _file_document(row: FileRow, now: Any) -> dict[str, Any]:
    return {
        "id": row.id,
        "kind": row.kind,
        "original": row.parent_id if row.kind == "version" else row.id,
        "version": row.version,
        "filename": row.filename,
        "class": row.file_class,
        "state": row.status,
        "status": api_status(row.status, row.kind),
        "priority": row.priority,
        "size": row.size,
        "error": row.error,
        "created_at": row.created_at.isoformat(),
        "updated_at": row.updated_at.isoformat(),
        "age_s": None if now is None else (now - row.created_at).total_seconds(),
    }


def _item_state(item: QueueItem, now: Any) -> str:
    if item.status != "new":
        return item.status
    if item.start_after is not None and now is not None and item.start_after > now:
        return "delayed"
    return "ready"


def _file_id(item: QueueItem) -> int | None:
    return _id_of(item.file_ref)


def _step_document(
    item: QueueItem, now: Any, service: str | None, file_row: FileRow | None
) -> dict[str, Any]:
    def iso(value: Any) -> str | None:
        return None if value is None else value.isoformat()

    return {
        "id": item.id,
        "action": item.action,
        "file": _file_id(item),
        "file_ref": item.file_ref,
        "version": None if file_row is None else file_row.version,
        "filename": None if file_row is None else file_row.filename,
        "service": service,
        "priority": item.priority,
        "band": band_name(item.priority),
        "state": _item_state(item, now),
        "attempts": item.attempts,
        "claimed_by": item.claimed_by,
        "waits_because": item.waits_because,
        "last_error": item.last_error,
        "start_after": iso(item.start_after),
        "created_at": iso(item.created_at),
        "claimed_at": iso(item.claimed_at),
        "age_s": (
            None if now is None or item.created_at is None
            else (now - item.created_at).total_seconds()
        ),
    }  # fmt: skip


def _attempt_document(attempt: Attempt) -> dict[str, Any]:
    return {
        "attempt": attempt.attempt,
        "backend": attempt.backend_id,
        "instance": attempt.instance_id,
        "started_at": attempt.started_at.isoformat(),
        "ended_at": attempt.ended_at.isoformat(),
        "duration_s": attempt.duration_s,
        "outcome": attempt.outcome,
        "reason": attempt.reason,
        "decisive_line": attempt.decisive_line,
    }


# -- the handlers --------------------------------------------------------------------------


class WorkApi:
    """The operator's routes on the work (see the module docstring).

    Args:
        state: the process's shared state.
    """

    def __init__(self, state: FylrState) -> None:
        self.state = state
        self.store = state.store
        self.files = state.files

    def routes(self) -> list[GuardedRoute]:
        """Every route of the module, each needing the ``operator`` role."""
        operator = Role.OPERATOR
        return [
            route("/inspect/system/fylr/files", self.list_files, role=operator),
            route(
                "/inspect/system/fylr/files/{file_id}",
                self.delete_file,
                role=operator,
                methods=("DELETE",),
            ),
            route(
                "/inspect/system/fylr/files/{file_id}/retry",
                self.retry_file,
                role=operator,
                methods=("POST",),
            ),
            route("/inspect/system/fylr/steps", self.list_steps, role=operator),
            route("/inspect/system/fylr/steps/{item_id}", self.show_step, role=operator),
            route(
                "/inspect/system/fylr/steps/{item_id}/cancel",
                self.cancel_step,
                role=operator,
                methods=("POST",),
            ),
            route(
                "/inspect/system/fylr/steps/{item_id}/retry",
                self.retry_step,
                role=operator,
                methods=("POST",),
            ),
            route("/inspect/system/queues", self.queues, role=operator),
        ]

    # -- listing -------------------------------------------------------------------------

    async def list_files(self, request: Request) -> Response:
        """``GET /inspect/system/fylr/files``: a page of files, newest first."""
        try:
            _known(request, ("kind", "state", "priority", "class", "older_than", "limit", "cursor"))
            kinds = _choices(request, "kind", ("original", "version"))
            states = _choices(request, "state", STATES)
            priorities = _priorities(request)
            classes = _texts(request, "class")
            older_than = _seconds(request, "older_than")
            limit = _limit(request)
            cursor = _cursor(request)
        except BadRequest as exc:
            return _bad(exc)
        rows = await self.files.page(
            before=cursor,
            limit=limit,
            kinds=kinds,
            states=states,
            priorities=priorities,
            classes=classes,
            older_than_s=older_than,
        )
        now = datetime.datetime.now(datetime.UTC)
        return JSONResponse(
            {
                "files": [_file_document(row, now) for row in rows],
                "next_cursor": str(rows[-1].id) if len(rows) == limit else None,
            }
        )

    async def list_steps(self, request: Request) -> Response:
        """``GET /inspect/system/fylr/steps``: a page of steps, oldest first."""
        try:
            _known(
                request,
                (
                    "state", "priority", "action", "service", "file", "older_than", "limit",
                    "cursor",
                ),
            )  # fmt: skip
            states = _choices(request, "state", ITEM_STATES)
            priorities = _priorities(request)
            actions = _texts(request, "action")
            services = _texts(request, "service")
            file_text = request.query_params.get("file")
            file_id = None if file_text is None else _id_of(file_text)
            if file_text is not None and file_id is None:
                raise BadRequest(f"file: expected a file id; got {file_text!r}")
            older_than = _seconds(request, "older_than")
            limit = _limit(request)
            cursor = _cursor(request) or 0
        except BadRequest as exc:
            return _bad(exc)
        refs = None
        if file_id is not None:
            found = await self.files.with_versions(file_id)
            if found is None:
                return _not_found(f"no file {file_id}")
            refs = [str(row.id) for row in (found[0], *found[1])]
        if services is not None:  # only exec-bound steps run a service
            actions = [a for a in (actions or EXEC_ACTIONS) if a in EXEC_ACTIONS]
            if not actions:
                return JSONResponse({"steps": [], "next_cursor": None})
        documents: list[dict[str, Any]] = []
        after = cursor
        next_cursor: int | None = None
        for _ in range(SERVICE_SCAN if services is not None else 1):
            items, now = await self.store.items(
                after=after,
                limit=limit,
                states=states,
                priorities=priorities,
                actions=actions,
                older_than_s=older_than,
                file_refs=refs,
            )
            rows = await self._file_rows(items)
            for item in items:
                after = item.id
                file_row = rows.get(_file_id(item) or -1)
                service = None if file_row is None else self._service(item, file_row)
                if services is None or service in services:
                    documents.append(_step_document(item, now, service, file_row))
                    if len(documents) == limit:
                        break
            # more may follow the last row looked at: a full page, or a full answer
            more = len(items) == limit or len(documents) == limit
            next_cursor = after if more else None
            if not more or len(documents) == limit:
                break
        return JSONResponse(
            {
                "steps": documents,
                "next_cursor": None if next_cursor is None else str(next_cursor),
            }
        )

    # -- one step ------------------------------------------------------------------------

    async def show_step(self, request: Request) -> Response:
        """``GET /inspect/system/fylr/steps/<id>``: the step and its attempts."""
        item_id = _id_of(request.path_params["item_id"])
        item = None if item_id is None else await self.store.item(item_id)
        if item is None or item_id is None:
            return _no_step(request.path_params["item_id"])
        attempts = await self.store.attempts(item_id)
        rows = await self._file_rows([item])
        file_row = rows.get(_file_id(item) or -1)
        service = None if file_row is None else self._service(item, file_row)
        now = datetime.datetime.now(datetime.UTC)
        document = _step_document(item, now, service, file_row)
        document["attempts_ended"] = [_attempt_document(a) for a in attempts]
        document["current"] = (
            None
            if item.status != "claimed"
            else {
                "attempt": item.attempts,
                "backend": item.claimed_by,
                "started_at": None if item.claimed_at is None else item.claimed_at.isoformat(),
                "running_s": (
                    None if now is None or item.claimed_at is None
                    else (now - item.claimed_at).total_seconds()
                ),
            }
        )  # fmt: skip
        return JSONResponse(document)

    async def cancel_step(self, request: Request) -> Response:
        """``POST /inspect/system/fylr/steps/<id>/cancel``: a queued or running step."""
        item_id = _id_of(request.path_params["item_id"])
        if item_id is None:
            return _no_step(request.path_params["item_id"])
        cancelled = await self.store.cancel(item_id, note=CANCEL_NOTE)
        if cancelled is None:
            item = await self.store.item(item_id)
            if item is None:
                return _no_step(str(item_id))
            return JSONResponse(
                {"error": f"step {item_id} has failed already: retry it, or leave it"},
                status_code=409,
            )
        if cancelled.claimed_by == self.state.backend_id:
            await self._recheck()  # its job gets the broker's CANCEL now
        file_id = _id_of(cancelled.file_ref)
        if file_id is not None:
            await self._settle_cancelled(cancelled.action, file_id)
        log.info(
            "step cancelled",
            extra=fields(
                item=item_id,
                action=cancelled.action,
                file=cancelled.file_ref,
                was=cancelled.status,
                claimed_by=cancelled.claimed_by,
            ),
        )
        return JSONResponse(
            {
                "cancelled": {
                    "id": cancelled.id,
                    "action": cancelled.action,
                    "file": file_id,
                    "was": cancelled.status,
                    "claimed_by": cancelled.claimed_by,
                }
            }
        )

    async def retry_step(self, request: Request) -> Response:
        """``POST /inspect/system/fylr/steps/<id>/retry``: one failed step back."""
        item_id = _id_of(request.path_params["item_id"])
        item = None if item_id is None else await self.store.item(item_id)
        if item is None or item_id is None:
            return _no_step(request.path_params["item_id"])
        retried = await retry_failed(self.store, ids=[item_id])
        if not retried:
            return JSONResponse(
                {"error": f"step {item_id} has not failed ({item.status}): nothing to retry"},
                status_code=409,
            )
        self._woken(retried[0].file_ref)
        return JSONResponse({"requeued": [attrs.asdict(r) for r in retried]})

    # -- one file ------------------------------------------------------------------------

    async def retry_file(self, request: Request) -> Response:
        """``POST /inspect/system/fylr/files/<id>/retry``: every failed step of a file."""
        file_id = _id_of(request.path_params["file_id"])
        found = None if file_id is None else await self.files.with_versions(file_id)
        if found is None:
            return _not_found(f"no file {request.path_params['file_id']}")
        refs = [str(row.id) for row in (found[0], *found[1])]
        ids = await self.store.call(lambda conn: failed_ids_in(conn, refs), kind="failed_ids")
        retried = await retry_failed(self.store, ids=ids) if ids else []
        for item in retried:
            self._woken(item.file_ref)
        log.info("failed steps of a file requeued", extra=fields(file=file_id, items=len(retried)))
        return JSONResponse({"requeued": [attrs.asdict(r) for r in retried]})

    async def delete_file(self, request: Request) -> Response:
        """``DELETE /inspect/system/fylr/files/<id>``: an original, its versions, their bytes."""
        file_id = _id_of(request.path_params["file_id"])
        deleted = None if file_id is None else await self.files.delete_original(file_id)
        if deleted is None:
            return _not_found(f"no file {request.path_params['file_id']}")
        if not isinstance(deleted, FilesDeleted):
            return JSONResponse(
                {
                    "error": f"file {file_id} is a version of {deleted.parent_id}: a version"
                    " goes with its original"
                },
                status_code=409,
            )
        if any(row.claimed_by == self.state.backend_id for row in deleted.queue):
            await self._recheck()  # its running jobs get the broker's CANCEL now
        removed = 0
        for key in deleted.storage_keys:
            with contextlib.suppress(OSError, ValueError):  # the sweep removes what is left
                removed += bool(await self.state.storage.delete(key))
        ids = [row.id for row in deleted.rows]
        self.state.changed(*ids)
        log.info(
            "file deleted",
            extra=fields(file=file_id, versions=len(ids) - 1, steps=len(deleted.queue)),
        )
        return JSONResponse(
            {
                "deleted": {
                    "file": file_id,
                    "versions": [row.version for row in deleted.rows if row.kind == "version"],
                    "steps": [item.id for item in deleted.queue],
                    "stored_files": removed,
                }
            }
        )

    # -- the admission -------------------------------------------------------------------

    async def queues(self, request: Request) -> Response:
        """``GET /inspect/system/queues``: the admission and its parts, the queue by band."""
        return JSONResponse(await queues_document(self.state))

    # -- helpers -------------------------------------------------------------------------

    async def _file_rows(self, items: Sequence[QueueItem]) -> Mapping[int, FileRow]:
        ids = sorted({i for i in map(_file_id, items) if i is not None})
        return await self.files.get_many(ids) if ids else {}

    def _service(self, item: QueueItem, row: FileRow) -> str | None:
        if item.action not in EXEC_ACTIONS:
            return None
        return service_of(self.state, row)

    async def _recheck(self) -> None:
        dispatcher = self.state.dispatcher
        if dispatcher is None:
            return
        try:
            await dispatcher.recheck()
        except StoreUnavailable as exc:  # the next heartbeat re-checks
            log.info("re-check after an operator's change failed", extra=fields(error=str(exc)))

    async def _settle_cancelled(self, action: str, file_id: int) -> None:
        """The cancelled step's file ends as a failed step's would (retry puts it back)."""
        files = self.files
        row = await files.get(file_id)
        if row is None:
            return
        if action == ACTION_PRODUCE and row.kind == "version" and row.produce_hash is not None:
            end = await files.end_version(file_id, row.produce_hash, stored=None, error=CANCEL_NOTE)
            self.state.changed(end.original_id, file_id)
        elif action == ACTION_METADATA:
            await files.fail_original(file_id, f"metadata: {CANCEL_NOTE}")
        elif action in (ACTION_PRODUCE, ACTION_COPY) and row.kind == "original":
            await files.fail_original(file_id, CANCEL_NOTE)
        self.state.changed(file_id)

    def _woken(self, file_ref: str) -> None:
        self.state.wake_dispatcher()
        self.state.changed(_id_of(file_ref))


async def queues_document(state: FylrState) -> dict[str, Any]:
    """The document of ``GET /inspect/system/queues`` (reads the database).

    Returns:
        ``admission`` (``base`` = ``share`` + ``cpus``, ``rise``, ``exec_limit``,
        ``odd_reserve``, ``max_in_flight``, ``in_flight``, ``odd_in_flight``,
        ``peak_in_flight``, ``waiting_at_execservers``, ``queue_deep``; ``null``
        on an API-only node), ``local`` (``limit``, ``reserve``, ``in_flight``,
        ``odd_in_flight``), ``execservers`` (each instance's ``processes``,
        ``clients`` and ``idle`` as its last ``HELLO`` said), and ``queue``:
        the rows by state, and per priority ``bands`` with the oldest ready
        row's age and the soonest delayed start.

    Raises:
        StoreUnavailable: the database could not be read.
    """
    figures = await state.store.figures()
    dispatcher = state.dispatcher
    stats = None if dispatcher is None else dispatcher.statistics()
    client = state.client
    cpus = cpu_count()
    admission = local = None
    if stats is not None:
        admission = {
            "base": stats.exec_base,
            "share": max(0, stats.exec_base - cpus),
            "cpus": cpus,
            "rise": stats.admission_rise,
            "exec_limit": stats.exec_limit,
            "odd_reserve": stats.odd_reserve,
            "max_in_flight": stats.max_in_flight,
            "in_flight": stats.exec_in_flight,
            "odd_in_flight": stats.odd_in_flight,
            "peak_in_flight": stats.peak_exec_in_flight,
            "waiting_at_execservers": None if client is None else client.waiting(),
            "queue_deep": stats.queue_deep,
        }
        local = {
            "limit": stats.local_limit,
            "reserve": stats.local_reserve,
            "in_flight": stats.local_in_flight,
            "odd_in_flight": stats.local_odd_in_flight,
        }
    loads = [] if client is None else client.instance_loads()
    counts = figures.counts
    return {
        "backend_id": state.backend_id,
        "admission": admission,
        "local": local,
        "execservers": [
            {
                "instance_id": load.instance_id,
                "processes": load.processes,
                "clients": load.clients,
                "idle": load.idle,
            }
            for load in loads
        ],
        "queue": {
            "ready": counts.ready,
            "delayed": counts.delayed,
            "claimed": counts.claimed,
            "failed": counts.failed,
            "oldest_ready_s": figures.oldest_ready_s,
            "next_start_after": (
                None if figures.next_start_after is None else figures.next_start_after.isoformat()
            ),
            "bands": [
                {
                    "priority": priority,
                    "band": band_name(priority),
                    "ready": band.ready,
                    "delayed": band.delayed,
                    "claimed": band.claimed,
                    "failed": band.failed,
                    "oldest_ready_s": figures.oldest_ready.get(priority),
                }
                for priority, band in figures.by_priority.items()
            ],
        },
    }


def routes(state: FylrState) -> list[GuardedRoute]:
    """The operator's work routes on ``state`` (:class:`WorkApi`)."""
    return WorkApi(state).routes()
