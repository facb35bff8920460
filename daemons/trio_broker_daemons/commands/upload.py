"""``trio-broker upload``: send files to a fylr and follow them until they have ended.

:func:`upload` streams one file to ``PUT /eas/put`` (read in chunks, never
whole); :func:`follow` waits for one file with ``GET /api/v1/eas/<id>?wait=S``,
which the fylr answers when the file changes (or after ``S`` seconds), so
following a file costs one request per change, not a poll loop;
:func:`upload_files` does both for many files at once and shows their progress
with rich. The command line (:func:`main`) prints one line per file:

.. code-block:: text

    sunset.jpg: id 12 processing http://127.0.0.1:7400/api/v1/eas/12

and with ``--wait``, once every file has ended, its status and versions, then
one indented line for the file's and each failed version's reason:

.. code-block:: text

    sunset.jpg: id 12 done (preview done, preview_small done, sha256 done, thumbnail done)
    broken.png: id 13 done (preview failed, sha256 done, thumbnail failed)
      preview failed: convert_image: cannot read image: broken PNG data: image file is truncated
      thumbnail failed: convert_image: cannot read image: broken PNG data: image file is truncated

A fylr answers 503 while its database is unavailable (or it is stopping, or
its storage failed); :func:`upload` and :func:`follow` then try again, at most
:data:`RETRIES` times per request, after the answer's ``Retry-After`` (at most
:data:`RETRY_AFTER_MAX` seconds) or else an exponential back-off
(:func:`retry_delay`). An upload is sent again whole.

``--server`` is ``host:port`` (``http://`` is assumed) or a URL with its scheme
(:func:`server_url`); ``--priority`` a band name or a number
(:func:`parse_priority`). A fylr with tokens needs the ``upload`` token (which
also reads the documents), given with ``--token-file`` (or ``--token``, or
``$TRIO_BROKER_FYLR_TOKEN``).

Exit status: 0 when every file was uploaded (and, with ``--wait``, it and every
version ended ``done``); 1 when a file was not uploaded, a file or a version
failed, or ``--timeout`` ran out first; 2 for bad arguments.
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

from trio_broker_daemons.commands.credentials import auth_headers, refusal_hint
from trio_broker_daemons.commands.position import queue_text, waiting_steps

__all__ = [
    "FINISHED",
    "POSITION_FOLLOWERS",
    "PRIORITY_BANDS",
    "RETRIES",
    "RETRY_AFTER_MAX",
    "FileOutcome",
    "PositionFollowers",
    "UploadError",
    "ended_done",
    "failures",
    "follow",
    "parse_priority",
    "retry_delay",
    "server_url",
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
PRIORITY_BANDS: Final = {"background": -2, "normal": 0, "interactive": 2, "synchronous": 4}
"""The priority bands of the queue; ``band + 1`` is the band's "high" variant."""
RETRIES: Final = 8
"""How often one request is repeated after a 503 answer."""
RETRY_AFTER_MAX: Final = 60.0
"""The longest wait before a repeat, whatever ``Retry-After`` asks."""
BACKOFF_FIRST: Final = 0.5
"""The first back-off without ``Retry-After``, doubled for every further attempt."""
RETRY_STATUSES: Final = frozenset({503})


def retry_delay(attempt: int, retry_after: str | None) -> float:
    """Seconds to wait before repeating a request that was answered 503.

    Args:
        attempt: how many repeats were made before this one (0 for the first).
        retry_after: the answer's ``Retry-After`` header, if any (seconds; an
            HTTP date or anything else unreadable is ignored).

    Returns:
        ``Retry-After`` when given, else ``BACKOFF_FIRST × 2^attempt``; never
        more than :data:`RETRY_AFTER_MAX`.
    """
    if retry_after is not None and retry_after.strip().isdigit():
        return min(float(retry_after.strip()), RETRY_AFTER_MAX)
    return min(BACKOFF_FIRST * 2.0 ** max(0, attempt), RETRY_AFTER_MAX)


def parse_priority(text: str) -> int:
    """A priority from the command line.

    Args:
        text: a band name (``background`` -2, ``normal`` 0, ``interactive`` 2,
            ``synchronous`` 4), its high variant as ``NAME+1`` or ``high-NAME``
            (one more: ``interactive+1`` is 3), or an integer (``-2``, ``3``).
            Names are case-insensitive.

    Returns:
        The priority.

    Raises:
        ValueError: anything else, naming what is accepted.
    """
    word = text.strip().lower()
    try:
        return int(word)
    except ValueError:
        pass
    high = 0
    if word.endswith("+1"):
        word, high = word[:-2], 1
    elif word.startswith("high-"):
        word, high = word[len("high-") :], 1
    if word in PRIORITY_BANDS:
        return PRIORITY_BANDS[word] + high
    names = ", ".join(PRIORITY_BANDS)
    raise ValueError(
        f"expected a band ({names}), NAME+1 or high-NAME for its high variant,"
        f" or an integer, got {text!r}"
    )


def server_url(text: str) -> str:
    """The fylr's base URL from ``host:port`` or ``http(s)://host:port``.

    Args:
        text: ``127.0.0.1:7400``, ``fylr:7400``, ``[::1]:7400`` (``http://`` is
            assumed) or a URL with its scheme; a trailing ``/`` is dropped.

    Returns:
        ``scheme://host:port`` (the port as given; a URL without one keeps none).

    Raises:
        ValueError: no host, a bad port, another scheme, or a path, query or fragment.
    """
    given = text.strip()
    url = given if "://" in given else f"http://{given}"
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        raise ValueError(f"expected host:port or http(s)://host:port, got {text!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected host:port or http(s)://host:port, got {text!r}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"expected no path, query or fragment after host:port, got {text!r}")
    if port is None and "://" not in given:
        raise ValueError(f"expected host:port (a port is needed without a scheme), got {text!r}")
    return f"{parts.scheme}://{parts.netloc}"


QUEUED_WAIT: Final = 2.0
"""Seconds one follow request waits while a step waits in the queue (its position moves)."""
REFRESH_PER_SECOND: Final = 4
"""How often :func:`upload_files` redraws its progress bars."""
POSITION_FOLLOWERS: Final = 8
"""Files :func:`upload_files` follows at the pace of their queue position at once."""


class PositionFollowers:
    """At most ``limit`` files at a time are followed at the pace of their queue position.

    A waiting step's position moves without its file changing, so following it
    means asking every :data:`QUEUED_WAIT` seconds; for hundreds of queued files
    that is hundreds of requests a second, each a database read and a question
    to the execservers. The first ``limit`` files whose steps wait (the ones
    nearest the front) are followed that way; the others wait for their next
    change (their step begins) and take a free place then.

    Args:
        limit: files followed at the position's pace at once (0: none).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.holders: set[int] = set()

    def wants(self, file_id: int, waiting: bool) -> bool:
        """Whether ``file_id``, whose steps wait (or not), is asked for at the position's pace."""
        if not waiting:
            self.holders.discard(file_id)
            return False
        if file_id in self.holders:
            return True
        if len(self.holders) < self.limit:
            self.holders.add(file_id)
            return True
        return False

    def ended(self, file_id: int) -> None:
        """``file_id`` is no longer followed."""
        self.holders.discard(file_id)


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
    retries: int = RETRIES,
) -> dict[str, Any]:
    """Stream one file to ``PUT /eas/put``, again after a 503 answer.

    Args:
        http: the HTTP client.
        server: the fylr's base URL (``http://host:port``).
        path: the file to send.
        priority: the priority of its steps.
        filename: the name to send (default: the file's own name).
        retries: how often to send it again after a 503 answer (see
            :func:`retry_delay` for the waits).

    Returns:
        The fylr's document of the new file (``id``, ``status`` …).

    Raises:
        UploadError: the file could not be read, the fylr refused it (or still
            answered 503 after ``retries`` repeats), or it could not be reached.
    """
    name = filename if filename is not None else path.name
    query = urllib.parse.urlencode({"filename": name, "priority": str(priority)})
    attempt = 0
    while True:
        response = await _put_once(http, f"{_base(server)}/eas/put?{query}", path, server)
        if response.status_code not in RETRY_STATUSES or attempt >= retries:
            break
        await trio.sleep(retry_delay(attempt, response.headers.get("retry-after")))
        attempt += 1
    if response.status_code != 201:
        raise UploadError(
            f"the fylr answered {response.status_code}: {_error_of(response)}"
            + refusal_hint(response.status_code, "upload")
        )
    document: dict[str, Any] = response.json()
    return document


async def _put_once(http: httpx.AsyncClient, url: str, path: Path, server: str) -> httpx.Response:
    try:
        stream = await trio.to_thread.run_sync(open, path, "rb")
    except OSError as exc:
        raise UploadError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        size = os.fstat(stream.fileno()).st_size
        return await http.put(
            url,
            content=_FileChunks(stream),
            headers={"content-length": str(size), "content-type": "application/octet-stream"},
            timeout=REQUEST_TIMEOUT,
        )
    except httpx.HTTPError as exc:
        raise UploadError(f"cannot reach {server}: {type(exc).__name__}: {exc}") from None
    finally:
        stream.close()


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
    positions: PositionFollowers | None = None,
    until_ended: bool = False,
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
        positions: shared by files followed together: whether this one is
            asked for every :data:`QUEUED_WAIT` seconds while a step waits
            (``None``: it is).
        until_ended: ask the fylr to answer only once the file has ended (or
            after ``wait``), for a caller that shows no progress: one request
            per ``wait`` seconds instead of one per change.

    Raises:
        UploadError: the file is unknown, the fylr could not be reached, or it
            answered 503 more than :data:`RETRIES` times in a row.
    """
    url = f"{_base(server)}/api/v1/eas/{file_id}"
    last: Mapping[str, Any] | None = None
    unavailable = 0
    try:
        while True:
            # while a step waits for a slot its position moves without the file changing
            waiting = last is None or bool(waiting_steps(last))
            if positions is not None:
                waiting = positions.wants(file_id, waiting)
            step_wait = min(wait, QUEUED_WAIT) if waiting else wait
            params = {"wait": f"{step_wait:g}"}
            if until_ended:
                params["until"] = "ended"
            try:
                response = await http.get(url, params=params, timeout=wait + 30.0)
            except httpx.HTTPError as exc:
                raise UploadError(f"cannot reach {server}: {type(exc).__name__}: {exc}") from None
            if response.status_code in RETRY_STATUSES and unavailable < RETRIES:
                await trio.sleep(retry_delay(unavailable, response.headers.get("retry-after")))
                unavailable += 1
                continue
            if response.status_code != 200:
                raise UploadError(
                    f"file {file_id}: the fylr answered {response.status_code}: "
                    f"{_error_of(response)}{refusal_hint(response.status_code, 'upload or read')}"
                )
            unavailable = 0
            document: dict[str, Any] = response.json()
            if document != last and on_change is not None:
                on_change(document)
            last = document
            if document.get("status") in FINISHED:
                return document
    finally:
        if positions is not None:
            positions.ended(file_id)


def failures(outcome: FileOutcome) -> list[tuple[str, str]]:
    """``(what, why)`` for a failed file and each failed version, in version order.

    ``what`` is ``"file"`` or the version's name; ``why`` the document's ``error``.
    """
    document = outcome.document or {}
    found: list[tuple[str, str]] = []
    if document.get("status") == "failed":
        found.append(("file", str(document.get("error") or "no reason given")))
    versions: Mapping[str, Any] = document.get("versions") or {}
    for name in sorted(versions):
        version = versions[name]
        if version.get("status") == "failed":
            found.append((name, str(version.get("error") or "no reason given")))
    return found


def ended_done(outcome: FileOutcome) -> bool:
    """Whether the file and every version of it ended ``done``."""
    return outcome.error is None and outcome.status == "done" and not failures(outcome)


def summary(outcome: FileOutcome) -> str:
    """Name, id, status and each version's status; then one line per failure's reason."""
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
    for what, why in failures(outcome):
        line += f"\n  {what} failed: {' '.join(why.split())}"
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
    report_timeout: bool = False,
    token: str | None = None,
) -> list[FileOutcome]:
    """Upload files and, with ``wait``, follow each until it has ended, with progress bars.

    Args:
        server: the fylr's base URL.
        files: ``(path, priority)`` pairs, uploaded in this order (``concurrency``
            at a time).
        wait: follow every uploaded file until it is ``done`` or ``failed``.
        console: where the progress is shown (default: stderr).
        timeout: seconds for everything; on expiry :class:`trio.TooSlowError`,
            or with ``report_timeout`` the outcomes so far, each file that had not
            ended with an ``error`` saying so (and its last document).
        concurrency: uploads in flight at once.
        report_timeout: see ``timeout``.
        token: the fylr's ``upload`` token, sent with every request.

    Returns:
        One outcome per file, in the order given.
    """
    console = console or Console(stderr=True)
    outcomes: list[FileOutcome] = [FileOutcome(path=path, priority=prio) for path, prio in files]
    limiter = trio.CapacityLimiter(max(1, concurrency))
    # nothing shown, no position to ask for; else the files nearest the front
    positions = PositionFollowers(0 if console.quiet else POSITION_FOLLOWERS)
    columns = (
        TextColumn("{task.description}", justify="left"),
        BarColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
    )
    done: set[int] = set()
    async with httpx.AsyncClient(headers=auth_headers(token)) as http:
        with (
            trio.move_on_after(math.inf if timeout is None else timeout) as scope,
            # the bars are drawn 4 times a second, not at all on a quiet console: each
            # refresh renders every file's row (hundreds of files are a CPU's share)
            Progress(
                *columns,
                console=console,
                transient=False,
                refresh_per_second=REFRESH_PER_SECOND,
                disable=console.quiet,
            ) as progress,
        ):
            overall = progress.add_task("all files", total=len(files), status="uploading")
            finished = 0

            def ended(index: int) -> None:
                nonlocal finished
                done.add(index)
                finished += 1
                progress.update(overall, completed=finished, status=f"{finished}/{len(files)}")

            async def one(index: int, path: Path, priority: int) -> None:
                task: TaskID = progress.add_task(
                    f"{path.name} (priority {priority})", total=None, status="uploading"
                )

                said: list[str] = []

                def show(document: Mapping[str, Any]) -> None:
                    outcomes[index] = attrs.evolve(outcomes[index], document=document)
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
                        document = await follow(
                            http,
                            server,
                            int(document["id"]),
                            on_change=show,
                            positions=positions,
                            until_ended=console.quiet,  # no progress to show
                        )
                        outcomes[index] = attrs.evolve(outcomes[index], document=document)
                except UploadError as exc:
                    outcomes[index] = attrs.evolve(outcomes[index], error=str(exc))
                    progress.update(task, total=1, completed=0, status=f"error: {exc}")
                ended(index)

            async with trio.open_nursery() as nursery:
                for index, (path, priority) in enumerate(files):
                    nursery.start_soon(one, index, path, priority)
    if scope.cancelled_caught:
        if not report_timeout:
            raise trio.TooSlowError
        what = "ended" if wait else "uploaded"
        for index, outcome in enumerate(outcomes):
            if index not in done:
                reason = f"not {what} within {timeout:g}s"
                outcomes[index] = attrs.evolve(outcome, error=reason)
    return outcomes


def main(
    server: str,
    paths: Sequence[str],
    *,
    priority: int,
    wait: bool,
    timeout: float | None = None,
    token: str | None = None,
) -> int:
    """The ``trio-broker upload`` command; returns the exit status.

    Args:
        server: ``host:port`` or a URL (see :func:`server_url`).
        paths: the files.
        priority: their priority.
        wait: follow each until it has ended, and print how.
        timeout: seconds for everything; files not ended by then count as failed.
        token: the fylr's ``upload`` token.
    """
    try:
        base = server_url(server)
    except ValueError as exc:
        Console(stderr=True, highlight=False).print(f"trio-broker upload: --server: {exc}")
        return 2
    outcomes = trio.run(
        lambda: upload_files(
            base,
            [(Path(p), priority) for p in paths],
            wait=wait,
            timeout=timeout,
            report_timeout=True,
            token=token,
        )
    )
    out = Console(highlight=False, soft_wrap=True)
    status = 0
    for outcome in outcomes:
        if outcome.document is None or outcome.error or (wait and not ended_done(outcome)):
            status = 1
        if wait or outcome.document is None or outcome.error:
            out.print(summary(outcome), markup=False)
        else:
            document = outcome.document
            out.print(
                f"{outcome.path.name}: id {document['id']} {document['status']}"
                f" {base}/api/v1/eas/{document['id']}",
                markup=False,
            )
    return status
