"""``trio-broker upload``: send files to a fylr and follow them until they have ended.

:func:`upload` streams one file to ``PUT /eas/put`` (read in chunks, never
whole); :func:`follow` waits for one file with ``GET /api/v1/eas/<id>?wait=S``,
which the fylr answers when the file changes (or after ``S`` seconds), so
following a file costs one request per change, not a poll loop;
:func:`upload_files` does both for many files at once and shows their progress
with rich. The command line (:func:`main`) prints one line per file:

.. code-block:: text

    sunset.jpg: id 12 pending http://127.0.0.1:7400/api/v1/eas/12

and with ``--wait``, once every file has ended, its status and versions:

.. code-block:: text

    sunset.jpg: id 12 done (preview done, preview_small done, sha256 done, thumbnail done)

Exit status: 0 when every file was uploaded (and, with ``--wait``, ended
``done``); 1 otherwise; 2 for bad arguments.
"""

from __future__ import annotations

import math
import os
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Final

import attrs
import httpx
import trio
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from trio_broker_daemons.position import queue_text, waiting_steps

__all__ = [
    "FINISHED",
    "FileOutcome",
    "UploadError",
    "follow",
    "summary",
    "upload",
    "upload_files",
]

FINISHED: Final = frozenset({"done", "failed"})
"""The API statuses of a file that has ended."""
CHUNK: Final = 1 << 16
WAIT: Final = 20.0
"""Seconds one follow request may wait at the fylr for a change."""
REQUEST_TIMEOUT: Final = 60.0
QUEUED_WAIT: Final = 2.0
"""Seconds one follow request waits while a step waits in the queue (its position moves)."""


class UploadError(Exception):
    """The fylr refused the upload or could not be reached."""


@attrs.frozen(kw_only=True)
class FileOutcome:
    """What became of one file.

    Attributes:
        path: the local file.
        priority: the priority it was uploaded with.
        document: the fylr's last document of it (``None`` when it was not uploaded).
        error: why it was not uploaded (or could not be followed), else ``None``.
    """

    path: Path
    priority: int
    document: Mapping[str, Any] | None = None
    error: str | None = None

    @property
    def status(self) -> str:
        """The file's API status, or ``"not uploaded"``."""
        if self.document is None:
            return "not uploaded"
        return str(self.document.get("status"))


class _FileChunks:
    """A local file as an async iterator of chunks, read in a worker thread."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream

    def __aiter__(self) -> _FileChunks:
        return self

    async def __anext__(self) -> bytes:
        chunk = await trio.to_thread.run_sync(self._stream.read, CHUNK)
        if not chunk:
            raise StopAsyncIteration
        return chunk


def _base(server: str) -> str:
    return server.rstrip("/")


async def upload(
    http: httpx.AsyncClient,
    server: str,
    path: Path,
    *,
    priority: int = 0,
    filename: str | None = None,
) -> dict[str, Any]:
    """Stream one file to ``PUT /eas/put``.

    Args:
        http: the HTTP client.
        server: the fylr's base URL (``http://host:port``).
        path: the file to send.
        priority: the priority of its steps.
        filename: the name to send (default: the file's own name).

    Returns:
        The fylr's document of the new file (``id``, ``status`` …).

    Raises:
        UploadError: the file could not be read, the fylr refused it, or it
            could not be reached.
    """
    name = filename if filename is not None else path.name
    query = urllib.parse.urlencode({"filename": name, "priority": str(priority)})
    try:
        stream = await trio.to_thread.run_sync(open, path, "rb")
    except OSError as exc:
        raise UploadError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        size = os.fstat(stream.fileno()).st_size
        response = await http.put(
            f"{_base(server)}/eas/put?{query}",
            content=_FileChunks(stream),
            headers={"content-length": str(size), "content-type": "application/octet-stream"},
            timeout=REQUEST_TIMEOUT,
        )
    except httpx.HTTPError as exc:
        raise UploadError(f"cannot reach {server}: {type(exc).__name__}: {exc}") from None
    finally:
        stream.close()
    if response.status_code != 201:
        raise UploadError(f"the fylr answered {response.status_code}: {_error_of(response)}")
    document: dict[str, Any] = response.json()
    return document


def _error_of(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip() or response.reason_phrase
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return str(body["error"])
    return response.text.strip()


async def follow(
    http: httpx.AsyncClient,
    server: str,
    file_id: int,
    *,
    on_change: Callable[[Mapping[str, Any]], None] | None = None,
    wait: float = WAIT,
) -> dict[str, Any]:
    """Wait until a file has ended (``done`` or ``failed``); returns its last document.

    Each request waits at the fylr for the file's next change (``?wait=``), so
    this loop sends one request per change, or per ``wait`` seconds when nothing
    changes. Bound it with a cancel scope.

    Args:
        http: the HTTP client.
        server: the fylr's base URL.
        file_id: the file.
        on_change: called with every document that differs from the one before.
        wait: seconds one request may wait for a change.

    Raises:
        UploadError: the file is unknown, or the fylr could not be reached.
    """
    url = f"{_base(server)}/api/v1/eas/{file_id}"
    last: Mapping[str, Any] | None = None
    while True:
        # while a step waits for a slot its position moves without the file changing
        step_wait = wait if last is not None and not waiting_steps(last) else min(wait, QUEUED_WAIT)
        try:
            response = await http.get(url, params={"wait": f"{step_wait:g}"}, timeout=wait + 30.0)
        except httpx.HTTPError as exc:
            raise UploadError(f"cannot reach {server}: {type(exc).__name__}: {exc}") from None
        if response.status_code != 200:
            raise UploadError(f"file {file_id}: the fylr answered {response.status_code}")
        document: dict[str, Any] = response.json()
        if document != last and on_change is not None:
            on_change(document)
        last = document
        if document.get("status") in FINISHED:
            return document


def summary(outcome: FileOutcome) -> str:
    """One line: name, id, status and each version's status (or why it failed)."""
    name = outcome.path.name
    if outcome.document is None:
        return f"{name}: not uploaded: {outcome.error}"
    document = outcome.document
    line = f"{name}: id {document.get('id')} {document.get('status')}"
    versions = document.get("versions") or {}
    if versions:
        line += " (" + ", ".join(f"{v} {versions[v]['status']}" for v in sorted(versions)) + ")"
    if outcome.error:
        line += f": {outcome.error}"
    return line


def _progress_of(document: Mapping[str, Any]) -> tuple[int, int | None, str]:
    """(steps ended, steps in all or None while unknown, status text) of a document."""
    versions: Mapping[str, Any] = document.get("versions") or {}
    status = str(document.get("status"))
    if status in FINISHED:
        total = len(versions) + 1
        return total, total, status
    if document.get("state") in ("new", "metadata", "sync"):
        return 0, None, status
    ended = sum(1 for v in versions.values() if v.get("status") in FINISHED)
    return ended, len(versions) + 1, f"{status} ({ended}/{len(versions)} versions)"


async def upload_files(
    server: str,
    files: Sequence[tuple[Path, int]],
    *,
    wait: bool = False,
    console: Console | None = None,
    timeout: float | None = None,  # noqa: ASYNC109 (a bound on the whole run, for callers)
    concurrency: int = 4,
) -> list[FileOutcome]:
    """Upload files and, with ``wait``, follow each until it has ended, with progress bars.

    Args:
        server: the fylr's base URL.
        files: ``(path, priority)`` pairs, uploaded in this order (``concurrency``
            at a time).
        wait: follow every uploaded file until it is ``done`` or ``failed``.
        console: where the progress is shown (default: stderr).
        timeout: seconds for everything; on expiry :class:`trio.TooSlowError`.
        concurrency: uploads in flight at once.

    Returns:
        One outcome per file, in the order given.
    """
    console = console or Console(stderr=True)
    outcomes: list[FileOutcome] = [FileOutcome(path=path, priority=prio) for path, prio in files]
    limiter = trio.CapacityLimiter(max(1, concurrency))
    columns = (
        TextColumn("{task.description}", justify="left"),
        BarColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
    )
    async with httpx.AsyncClient() as http:
        with (
            trio.fail_after(math.inf if timeout is None else timeout),
            Progress(*columns, console=console, transient=False) as progress,
        ):
            overall = progress.add_task("all files", total=len(files), status="uploading")
            finished = 0

            def ended() -> None:
                nonlocal finished
                finished += 1
                progress.update(overall, completed=finished, status=f"{finished}/{len(files)}")

            async def one(index: int, path: Path, priority: int) -> None:
                task: TaskID = progress.add_task(
                    f"{path.name} (priority {priority})", total=None, status="uploading"
                )

                said: list[str] = []

                def show(document: Mapping[str, Any]) -> None:
                    completed, total, status = _progress_of(document)
                    queued = "; ".join(queue_text(q) for _, q in waiting_steps(document))
                    if queued:
                        status = f"{status}: {queued}"
                        if not console.is_terminal and said[-1:] != [queued]:
                            progress.console.print(f"{path.name}: {queued}", markup=False)
                            said.append(queued)
                    progress.update(task, completed=completed, total=total, status=status)

                try:
                    async with limiter:
                        document = await upload(http, server, path, priority=priority)
                    outcomes[index] = attrs.evolve(outcomes[index], document=document)
                    show(document)
                    if wait:
                        document = await follow(http, server, int(document["id"]), on_change=show)
                        outcomes[index] = attrs.evolve(outcomes[index], document=document)
                except UploadError as exc:
                    outcomes[index] = attrs.evolve(outcomes[index], error=str(exc))
                    progress.update(task, total=1, completed=0, status=f"error: {exc}")
                ended()

            async with trio.open_nursery() as nursery:
                for index, (path, priority) in enumerate(files):
                    nursery.start_soon(one, index, path, priority)
    return outcomes


def main(server: str, paths: Sequence[str], *, priority: int, wait: bool) -> int:
    """The ``trio-broker upload`` command; returns the exit status."""
    outcomes = trio.run(
        lambda: upload_files(server, [(Path(p), priority) for p in paths], wait=wait)
    )
    out = Console(highlight=False, soft_wrap=True)
    base = _base(server)
    status = 0
    for outcome in outcomes:
        if outcome.document is None or (wait and outcome.status != "done"):
            status = 1
        if wait or outcome.document is None:
            out.print(summary(outcome), markup=False)
        else:
            document = outcome.document
            out.print(
                f"{outcome.path.name}: id {document['id']} {document['status']}"
                f" {base}/api/v1/eas/{document['id']}",
                markup=False,
            )
    return status
