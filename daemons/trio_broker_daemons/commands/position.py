"""``trio-broker position``: where a file's waiting steps stand, in words.

The fylr puts a ``queue`` member on every exec-bound step of a file that waits
for a slot (``GET /api/v1/eas/<id>``; see
:mod:`trio_broker_daemons.fylr.position`). This module turns it into the line
users read, shared by ``trio-broker position`` and the progress display of
``trio-broker upload --wait``:

.. code-block:: text

    sunset.jpg #12 metadata: 3 running, 7 waiting, you are number 11, roughly 4 minutes

The position is the hard number; the time is only ever written as "roughly",
since it is the execserver's mean runtime times the rounds ahead. Exit status of
the command: 0 when the file was found, 1 when it is unknown, the fylr could
not be reached or refused the token (a fylr with tokens needs the ``read``
token, or the ``upload`` or ``operator`` one: ``--token-file``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import httpx
import trio

from trio_broker_daemons.commands.credentials import auth_headers, refusal_hint

__all__ = ["eta_text", "main", "queue_text", "waiting_steps"]

REQUEST_TIMEOUT: Final = 30.0


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


def queue_text(queue: Mapping[str, Any]) -> str:
    """One step's ``queue`` member in words: running, waiting, the number, the estimate."""
    parts = [f"{queue['running']} running"]
    if queue.get("waiting") is not None:
        parts.append(f"{queue['waiting']} waiting")
    parts.append(f"you are number {queue['position']}")
    eta = eta_text(queue.get("eta_s"))
    if eta is not None:
        parts.append(eta)
    return ", ".join(parts)


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
        return await http.get(f"{server.rstrip('/')}/api/v1/eas/{file_id}")


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
