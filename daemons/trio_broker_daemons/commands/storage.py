"""``trio-broker storage checksum|copy-move|sync-check``: an operator's local actions.

Each subcommand asks a fylr to queue one local action
(:mod:`~trio_broker_daemons.fylr.local_actions`) for some files or for all, with
``POST /inspect/system/fylr/<action>`` (the operator token), and prints what was
queued:

.. code-block:: text

    $ trio-broker storage checksum --all --server 127.0.0.1:7400 --token-file op.token
    checksum of every file: 1284 files queued, 0 running

``--file ID`` (repeatable) names files (an original with its versions);
``--all`` every file; one of the two is required, so a mistyped command never
starts a run over the whole installation. ``copy-move`` takes ``--location
NAME`` (default: the fylr's ``storage_location``). The actions run in the
background (priority ``background`` unless ``--priority`` says otherwise); their
results are in each file's document (``damage``, ``checked``, ``location``) and,
for what failed, under ``failed`` in ``/inspect/system/fylr``.

Exit status: 0 when every request was queued; 1 when the fylr could not be
reached or refused one (an unknown file, a location it does not have, a token
it does not take); 2 for bad arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import httpx
import trio

from trio_broker_daemons.commands.credentials import auth_headers, refusal_hint

__all__ = ["ACTIONS", "main"]

ACTIONS: Final = {"checksum": "checksum", "copy-move": "copy_move", "sync-check": "sync_check"}
"""The subcommands and the actions they queue."""
REQUEST_TIMEOUT: Final = 300.0
"""Seconds a request may take (queueing every file of a large installation takes a while)."""


def _files(count: int) -> str:
    return f"{count} file" if count == 1 else f"{count} files"


async def _queue(
    server: str,
    action: str,
    files: Sequence[int | None],
    params: dict[str, str],
    token: str | None,
) -> int:
    status = 0
    url = f"{server.rstrip('/')}/inspect/system/fylr/{action}"
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT, headers=auth_headers(token)) as http:
        for file_id in files:
            query = dict(params) if file_id is None else {**params, "file": str(file_id)}
            what = "every file" if file_id is None else f"file {file_id}"
            try:
                response = await http.post(url, params=query)
            except httpx.HTTPError as exc:
                print(f"trio-broker storage: cannot reach {server}: {type(exc).__name__}: {exc}")
                return 1
            if response.status_code != 202:
                print(
                    f"{action} of {what}: the fylr answered {response.status_code}:"
                    f" {response.text.strip()}" + refusal_hint(response.status_code, "operator")
                )
                status = 1
                continue
            answer = response.json()
            queued, running = _files(answer["queued"]), answer["running"]
            print(f"{action} of {what}: {queued} queued, {running} running")
    return status


def main(
    server: str,
    command: str,
    *,
    files: Sequence[int] | None,
    location: str | None = None,
    priority: int | None = None,
    token: str | None = None,
) -> int:
    """The ``trio-broker storage`` command; returns the exit status.

    Args:
        server: the fylr's base URL.
        command: ``checksum``, ``copy-move`` or ``sync-check``.
        files: the files to queue it for; ``None`` for every file.
        location: ``copy-move``'s target location (``None``: the fylr's own choice).
        priority: the items' priority (``None``: background).
        token: the fylr's operator token, if it has tokens.
    """
    params: dict[str, str] = {}
    if location is not None:
        params["location"] = location
    if priority is not None:
        params["priority"] = str(priority)
    targets: Sequence[int | None] = [None] if files is None else files
    return trio.run(_queue, server, ACTIONS[command], targets, params, token)
