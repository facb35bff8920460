"""``PUT /eas/rput``: a file registered by its URL, copied in or left on its remote.

Theory of operation
===================

``PUT /eas/rput?url=URL&priority=P[&leave_on_remote=1][&filename=NAME]``
registers an original whose bytes are at ``URL`` and answers its document
(201), as ``/eas/put`` does; the request has no body. Before anything is
recorded the URL is checked (:func:`~trio_broker_daemons.fylr.fetch.parse_remote_url`:
``http``/``https``, a host, no credentials) and its host resolved and judged
by the blocklist (:meth:`RemoteFetcher.check
<trio_broker_daemons.fylr.fetch.RemoteFetcher.check>`): a blocked name, a
name with a blocked address, a blocked address, or a name that does not
resolve is a 400 with one line naming it. Nothing is fetched here.

- Without ``leave_on_remote`` the original is ``copy`` and a ``copy`` step is
  queued (:mod:`~trio_broker_daemons.fylr.remote_steps`): its bytes are fetched
  into storage, then it goes on as an upload.
- With ``leave_on_remote=1`` only the reference is kept: the original has no
  stored bytes (no download), and ``rput.reference_steps`` says what is made
  of it from the remote bytes: nothing (``none``: it goes to ``sync``), its
  metadata (``metadata``) or its metadata and versions (``all``). Its sync
  checks that the URL still answers, and it ends ``error`` when it does not.

``filename`` defaults to the last part of the URL's path; it decides the class
as an upload's name does. ``priority`` is the priority of all its steps.

Every original's document carries ``remote``: ``null``, or ``{"url",
"leave_on_remote", "checked_at"}`` for one registered by URL
(:func:`add_remote`).
"""

from __future__ import annotations

import logging
import mimetypes
from collections.abc import Callable, MutableMapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from trio_broker.core.protocol import INT32_MAX, INT32_MIN
from trio_broker_daemons.fylr.fetch import (
    BadRemoteUrl,
    Unresolvable,
    filename_of,
    parse_remote_url,
)
from trio_broker_daemons.fylr.files import FileRow
from trio_broker_daemons.fylr.produce import class_of
from trio_broker_daemons.fylr.remote import RemoteRefused
from trio_broker_daemons.fylr.remote_files import FirstStep
from trio_broker_daemons.fylr.state import FylrState
from trio_broker_daemons.runtime.logfmt import fields

__all__ = ["MAX_FILENAME_CHARS", "RemoteApi", "add_remote"]

log = logging.getLogger("trio_broker_daemons.fylr.remote_api")

MAX_FILENAME_CHARS = 1000
"""The longest file name a registration may carry (as an upload's)."""
_FLAGS = {"1": True, "true": True, "0": False, "false": False, "": False}


def _bad(problem: str) -> Response:
    return JSONResponse({"error": problem}, status_code=400)


def _query(request: Request) -> tuple[str, int, bool, str | None] | str:
    """``url``, ``priority``, ``leave_on_remote``, ``filename``; or the first problem."""
    query = request.query_params
    raw_priority = query.get("priority", "0")
    try:
        priority = int(raw_priority)
    except ValueError:
        return f"priority: expected an integer, got {raw_priority!r}"
    if not INT32_MIN <= priority <= INT32_MAX:
        return f"priority: expected a 32-bit signed integer, got {priority}"
    leave = _FLAGS.get(query.get("leave_on_remote", "").lower())
    if leave is None:
        return f"leave_on_remote: expected 1 or 0, got {query.get('leave_on_remote')!r}"
    filename = query.get("filename")
    if filename is not None and (
        not filename or len(filename) > MAX_FILENAME_CHARS or "\x00" in filename
    ):
        return f"filename: expected 1 to {MAX_FILENAME_CHARS} characters"
    return query.get("url", ""), priority, leave, filename


class RemoteApi:
    """The handler of ``PUT /eas/rput`` (see the module docstring).

    Args:
        state: the process's shared state.
        document: a new original's document (the API's ``file_document``).
        unavailable: the API's 503 answer for a request to repeat.
    """

    def __init__(
        self,
        state: FylrState,
        *,
        document: Callable[[FileRow], dict[str, Any]],
        unavailable: Callable[[str], Response],
    ) -> None:
        self.state = state
        self.document = document
        self.unavailable = unavailable

    async def rput(self, request: Request) -> Response:
        """``PUT /eas/rput?url=…&priority=…[&leave_on_remote=1][&filename=…]``."""
        state = self.state
        if state.stopping:
            return self.unavailable("the server is shutting down")
        parsed = _query(request)
        if isinstance(parsed, str):
            return _bad(parsed)
        text, priority, leave, filename = parsed
        try:
            url = parse_remote_url(text)
        except BadRemoteUrl as exc:
            return _bad(str(exc))
        try:
            await state.remote.fetcher.check(url)
        except (RemoteRefused, Unresolvable) as exc:
            log.info("remote file refused", extra=fields(host=url.host, reason=str(exc)))
            return _bad(f"url: {exc}")
        name = filename if filename is not None else filename_of(url)[:MAX_FILENAME_CHARS]
        class_name = class_of(name, state.config)
        file_class = state.file_class(class_name)
        first: FirstStep = "copy"
        if leave:
            wanted = state.config.rput.reference_steps != "none"
            has_step = file_class is not None and file_class.metadata is not None
            first = "metadata" if wanted and has_step else "sync"
        guess, _ = mimetypes.guess_type(name, strict=False)
        row = await state.remote.files.register(
            url=str(url),
            leave_on_remote=leave,
            filename=name,
            file_class=class_name,
            priority=priority,
            mimetype=guess,
            first=first,
        )
        state.wake_dispatcher()
        state.changed(row.id)
        log.info(
            "remote file registered",
            extra=fields(
                file=row.id, filename=name, file_class=class_name, first=first, priority=priority
            ),
        )
        document = self.document(row)
        source = await state.remote.files.get(row.id)
        document["remote"] = None if source is None else source.document()
        return JSONResponse(document, status_code=201)


async def add_remote(state: FylrState, document: MutableMapping[str, Any], row: FileRow) -> None:
    """Give an original's document its ``remote`` member (``null`` for an upload)."""
    if row.kind != "original":
        return
    source = await state.remote.files.get(row.id)
    document["remote"] = None if source is None else source.document()
