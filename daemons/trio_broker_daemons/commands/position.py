"""``trio-broker position``: where a file's waiting steps stand, in words.

The fylr puts a ``queue`` member on every exec-bound step of a file that waits
for a slot (``GET /api/v1/eas/<id>``; see
:mod:`trio_broker_daemons.fylr.position`). This module turns it into the line
users read, shared by ``trio-broker position`` and the progress display of
``trio-broker upload --wait``:

.. code-block:: text

    sunset.jpg #12 metadata: 3 running, 7 waiting, you are number 11, roughly 4 minutes

A step requeued for a reason says it first, from the moment it was requeued:

.. code-block:: text

    sunset.jpg #12 small: waits: no connected execserver offers service 'thumbnial'
    (did you mean 'thumbnail'?) (tried again in roughly 55 seconds), 0 running, ...

The position is the hard number; the time is only ever written as "roughly",
since it is the execserver's mean runtime times the rounds ahead. A fylr that
cannot be reached (it restarts) or answers 503 is asked again with a back-off,
:data:`RETRIES` times (:mod:`trio_broker_daemons.commands.retry`). Exit status
of the command: 0 when the file was found, 1 when it is unknown, the fylr could
still not be reached after the repeats, or it refused the token (a fylr with
tokens needs the ``read`` token, or the ``upload`` or ``operator`` one:
``--token-file``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import httpx
import trio

from trio_broker_daemons.commands.credentials import auth_headers, refusal_hint
from trio_broker_daemons.commands.retry import get_retrying

__all__ = ["eta_text", "main", "queue_text", "retry_text", "waiting_steps"]

REQUEST_TIMEOUT: Final = 30.0
RETRIES: Final = 6
"""Repeats of a request the fylr did not answer (or answered 503): about 30 s of
back-off, a restart's length, before the command gives up."""


def eta_text(seconds: float | None) -> str | None:
    """``roughly 4 minutes`` (None when there is no estimate)."""
    if seconds is None:
        return None
    if seconds < 90:
        count, unit = max(1, round(seconds)), "second"
    elif seconds < 90 * 60:
        count, unit = round(seconds / 60), "minute"
    else:
        count, unit = round(seconds / 3600), "hour"
    return f"roughly {count} {unit}{'' if count == 1 else 's'}"


def retry_text(seconds: float | None) -> str | None:
    """``tried again in roughly 40 seconds`` (None when not known)."""
    if seconds is None:
        return None
    if seconds < 1:
        return "tried again now"
    return f"tried again in {eta_text(seconds)}"


def queue_text(queue: Mapping[str, Any]) -> str:
    """One step's ``queue`` member in words: why it waits (a requeued step), then running,
    waiting, the number and the estimate."""
    parts = []
    if queue.get("waits_because"):
        reason = " ".join(str(queue["waits_because"]).split())
        retry = retry_text(queue.get("retry_in_s"))
        parts.append(f"waits: {reason}" + (f" ({retry})" if retry else ""))
    if queue.get("position") is not None:
        if queue.get("running") is not None:
            parts.append(f"{queue['running']} running")
        if queue.get("waiting") is not None:
            parts.append(f"{queue['waiting']} waiting")
        parts.append(f"you are number {queue['position']}")
        eta = eta_text(queue.get("eta_s"))
        if eta is not None:
            parts.append(eta)
    return ", ".join(parts) or "waiting"


def waiting_steps(document: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """``(label, queue)`` of every step of a file's document that waits for a slot."""
    name = f"{document.get('filename')} #{document.get('id')}"
    found: list[tuple[str, Mapping[str, Any]]] = []
    own = document.get("queue")
    if own:
        found.append((f"{name} {own['action']}", own))
    for version, entry in sorted((document.get("versions") or {}).items()):
        queue = entry.get("queue")
        if queue:
            found.append((f"{name} {version}", queue))
    return found


async def _fetch(server: str, file_id: int, token: str | None) -> httpx.Response:
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT, headers=auth_headers(token)) as http:
        url = f"{server.rstrip('/')}/api/v1/eas/{file_id}"
        return await get_retrying(http, url, timeout=REQUEST_TIMEOUT, retries=RETRIES)


def main(server: str, file_id: int, *, token: str | None = None) -> int:
    """The ``trio-broker position`` command; returns the exit status.

    Args:
        server: the fylr's base URL.
        file_id: the file.
        token: the fylr's ``read`` token (or a wider one), if it has tokens.
    """
    try:
        response = trio.run(_fetch, server, file_id, token)
    except httpx.HTTPError as exc:
        print(f"trio-broker position: cannot reach {server}: {type(exc).__name__}: {exc}")
        return 1
    status = response.status_code
    if status != 200:
        print(
            f"file {file_id}: the fylr answered {status}: {response.text.strip()}"
            + refusal_hint(status, "read")
        )
        return 1
    try:
        document = response.json()
    except ValueError as exc:
        print(f"trio-broker position: {server} answered no JSON: {exc}")
        return 1
    steps = waiting_steps(document)
    if not steps:
        print(f"{document.get('filename')} #{file_id}: {document.get('status')}, nothing waits")
    for label, queue in steps:
        print(f"{label}: {queue_text(queue)}")
    return 0
