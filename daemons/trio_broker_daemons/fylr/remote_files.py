"""Remote sources in the database and on the wire: ``remote_sources`` and reading a URL.

Theory of operation
===================

An original registered with ``PUT /eas/rput`` has a row in ``remote_sources``
(migration ``002_remote_sources.sql``) beside its ``files`` row:
:class:`RemoteFiles` reads and writes both, each state change with the next
step queued in the same transaction (through the store's
:func:`~trio_broker.trio.store.enqueue_in`, as :mod:`~trio_broker_daemons.fylr.files`
does). :class:`RemoteSources` is what the steps call to read a remote:

- :meth:`RemoteSources.fetch_into` streams a URL into storage (the ``copy``
  step, :mod:`~trio_broker_daemons.fylr.remote_steps`);
- :meth:`RemoteSources.pipe_source` is an in-pipe's source that reads the URL
  of an original left on its remote, opened only when the execserver asks
  (the ``metadata`` and ``produce`` steps), and :meth:`RemoteSources.after_pipe`
  raises what it ran into once the job has ended;
- :meth:`RemoteSources.check_reference` is the ``sync`` step's check that the
  URL of an original left on its remote still answers (and, when its versions
  are made, the one read that identifies its bytes: size and SHA-256).

Each turns what the remote did into the step's end by the rules of
:mod:`~trio_broker_daemons.fylr.remote`: a temporary failure raises
:class:`~trio_broker.core.errors.RetryLater` with the delay the answer asked
for (the dispatcher decides once, and requeues after it), unless the remote
has been failing for ``rput.give_up_after``; anything else raises
:class:`~trio_broker_daemons.fylr.remote.RemoteSourceFailed` (the step fails
for good with that line). The give-up clock (``retry_since``) and the current
time both come from the database, so every fylr on it agrees.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Final, Literal

import attrs
import httpx
import psycopg
from psycopg.rows import TupleRow

from trio_broker.core.errors import RetryLater, describe
from trio_broker.trio.store import NewItem, Store, enqueue_in
from trio_broker_daemons.fylr.config import FylrConfig
from trio_broker_daemons.fylr.fetch import RemoteFetcher, Unresolvable
from trio_broker_daemons.fylr.files import ACTION_METADATA, ACTION_SYNC, FileRow, FileStore
from trio_broker_daemons.fylr.remote import (
    Failure,
    RemoteRefused,
    RemoteSourceFailed,
    Temporary,
    give_up,
    judge_failure,
    judge_status,
)
from trio_broker_daemons.fylr.storage import FileTooLarge, Storage, StoredFile

__all__ = [
    "ACTION_COPY",
    "FirstStep",
    "RemoteOriginal",
    "RemotePipeSource",
    "RemoteProblem",
    "RemoteSource",
    "RemoteSources",
    "restart_give_up_in",
]

Connection = psycopg.Connection[TupleRow]

ACTION_COPY: Final = "copy"
"""The step that fetches a remote original into storage (local-bound)."""

FirstStep = Literal["copy", "metadata", "sync"]
"""The step an original registered by URL starts with."""

_FIRST_STATE: Final = {"copy": "copy", "metadata": "new", "sync": "sync"}


@attrs.frozen(kw_only=True)
class RemoteSource:
    """One row of ``remote_sources``.

    Attributes:
        file_id: the original.
        url: where its bytes are (or came from).
        leave_on_remote: whether its bytes stay there (no copy in storage).
        retry_since: when the give-up clock started (``None``: it is not running).
        checked_at: when the URL last answered a check, if ever.
    """

    file_id: int
    url: str
    leave_on_remote: bool
    retry_since: datetime.datetime | None = None
    checked_at: datetime.datetime | None = None

    def document(self) -> dict[str, Any]:
        """The ``remote`` member of the file's document."""
        return {
            "url": self.url,
            "leave_on_remote": self.leave_on_remote,
            "checked_at": None if self.checked_at is None else self.checked_at.isoformat(),
        }


@attrs.frozen(kw_only=True)
class RemoteOriginal:
    """An original registered by URL, as a step needs it (:meth:`RemoteFiles.waiting`).

    Attributes:
        source: its remote.
        file_class: its class, or ``None``.
        mimetype: what it is labelled with so far.
        sha256: of its bytes, once known.
    """

    source: RemoteSource
    file_class: str | None
    mimetype: str | None
    sha256: str | None


_SOURCE_COLUMNS: Final = "file_id, url, leave_on_remote, retry_since, checked_at"
_R_COLUMNS: Final = "r.file_id, r.url, r.leave_on_remote, r.retry_since, r.checked_at"


def _source(values: Sequence[Any] | None) -> RemoteSource | None:
    if values is None:
        return None
    file_id, url, leave, since, checked = values
    return RemoteSource(
        file_id=file_id, url=url, leave_on_remote=leave, retry_since=since, checked_at=checked
    )


def _queue(conn: Connection, file_id: int, action: str, priority: int) -> None:
    """Queue one step of a file in the caller's transaction (through the store)."""
    enqueue_in(conn, [NewItem(file_ref=str(file_id), action=action, priority=priority)])


def restart_give_up_in(conn: Connection, file_id: int) -> None:
    """Start the give-up clock of a file's remote again, in the caller's transaction.

    For an operator's requeue of a failed step: a copy's clock restarts now, a
    reference's stops until its next failure. ``file_id`` may name a version
    (its original's remote is meant) or a file with no remote (nothing happens).
    """
    conn.execute(
        "UPDATE remote_sources SET retry_since = CASE WHEN leave_on_remote THEN NULL"
        " ELSE now() END"
        " WHERE file_id = (SELECT coalesce(parent_id, id) FROM files WHERE id = %s)",
        (file_id,),
    )


class RemoteFiles:
    """``remote_sources`` and the ``files`` rows of remote originals (one call each)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._files = FileStore(store)

    async def register(
        self,
        *,
        url: str,
        leave_on_remote: bool,
        filename: str,
        file_class: str | None,
        priority: int,
        mimetype: str | None,
        first: FirstStep,
    ) -> FileRow:
        """Insert an original registered by URL, its remote and its first step, in one transaction.

        Args:
            url: the remote URL.
            leave_on_remote: keep only the reference (no copy).
            filename: its name.
            file_class: its class, or ``None``.
            priority: the priority of all its steps.
            mimetype: a first guess.
            first: ``copy`` (state ``copy``), or for a reference ``metadata``
                (state ``new``) or ``sync`` (state ``sync``).
        """

        def run(conn: Connection) -> int:
            with conn.transaction():
                created = conn.execute(
                    "INSERT INTO files (kind, filename, class, status, priority, mimetype)"
                    " VALUES ('original', %s, %s, %s, %s, %s) RETURNING id",
                    (filename, file_class, _FIRST_STATE[first], priority, mimetype),
                ).fetchone()
                assert created is not None
                file_id = int(created[0])
                conn.execute(
                    "INSERT INTO remote_sources (file_id, url, leave_on_remote, retry_since)"
                    " VALUES (%s, %s, %s, CASE WHEN %s THEN NULL ELSE now() END)",
                    (file_id, url, leave_on_remote, leave_on_remote),
                )
                _queue(conn, file_id, first, priority)
                return file_id

        file_id = await self.store.call(run, kind="remote_register")
        row = await self._files.get(file_id)
        if row is None:  # removed at once by someone else
            raise LookupError(f"the file {file_id} is gone right after its registration")
        return row

    async def get(self, file_id: int) -> RemoteSource | None:
        """The remote of an original, or ``None``."""

        def run(conn: Connection) -> RemoteSource | None:
            found = conn.execute(
                f"SELECT {_SOURCE_COLUMNS} FROM remote_sources WHERE file_id = %s", (file_id,)
            ).fetchone()
            return _source(found)

        return await self.store.call(run, kind="remote_get")

    async def waiting(self, file_id: int, state: str) -> RemoteOriginal | None:
        """An original registered by URL that is in ``state`` (``None``: it is not)."""

        def run(conn: Connection) -> RemoteOriginal | None:
            found = conn.execute(
                f"SELECT {_R_COLUMNS}, f.class, f.mimetype, f.sha256"
                " FROM remote_sources r JOIN files f ON f.id = r.file_id"
                " WHERE r.file_id = %s AND f.status = %s",
                (file_id, state),
            ).fetchone()
            if found is None:
                return None
            source = _source(found[:5])
            assert source is not None
            return RemoteOriginal(
                source=source, file_class=found[5], mimetype=found[6], sha256=found[7]
            )

        return await self.store.call(run, kind="remote_get")

    async def copied(
        self, file_id: int, stored: StoredFile, *, mimetype: str | None, metadata_step: bool
    ) -> bool:
        """A copy ended: the original's bytes are stored; queue its next step.

        Args:
            file_id: the original (in state ``copy``).
            stored: the fetched bytes.
            mimetype: replaces the guess when not ``None``.
            metadata_step: queue ``metadata`` (state ``new``); otherwise ``sync``.

        Returns:
            Whether it applied (``False``: the file was no longer waiting for its
            copy; the caller deletes the stored file).
        """
        status, action = ("new", ACTION_METADATA) if metadata_step else ("sync", ACTION_SYNC)

        def run(conn: Connection) -> bool:
            with conn.transaction():
                found = conn.execute(
                    "UPDATE files SET status = %s, storage_key = %s, size = %s, sha256 = %s,"
                    " mimetype = coalesce(%s, mimetype), error = NULL, updated_at = now()"
                    " WHERE id = %s AND kind = 'original' AND status = 'copy' RETURNING priority",
                    (status, stored.key, stored.size, stored.sha256, mimetype, file_id),
                ).fetchone()
                if found is None:
                    return False
                conn.execute(
                    "UPDATE remote_sources SET retry_since = NULL, checked_at = now()"
                    " WHERE file_id = %s",
                    (file_id,),
                )
                _queue(conn, file_id, action, found[0])
                return True

        return await self.store.call(run, kind="remote_copied")

    async def failing(self, file_id: int) -> tuple[float, float]:
        """The give-up clock of a remote that failed now: ``(since, now)``, UNIX times.

        Starts the clock when it is not running; both times are the database's.
        """

        def run(conn: Connection) -> tuple[float, float]:
            found = conn.execute(
                "UPDATE remote_sources SET retry_since = coalesce(retry_since, now())"
                " WHERE file_id = %s"
                " RETURNING extract(epoch FROM retry_since)::float8,"
                " extract(epoch FROM now())::float8",
                (file_id,),
            ).fetchone()
            if found is None:  # the file is gone: the clock starts now
                now = conn.execute("SELECT extract(epoch FROM now())::float8").fetchone()
                assert now is not None
                return float(now[0]), float(now[0])
            return float(found[0]), float(found[1])

        return await self.store.call(run, kind="remote_failing")

    async def answered(
        self, file_id: int, *, size: int | None = None, sha256: str | None = None
    ) -> None:
        """The remote of a reference answered: its clock stops; its bytes' identity is kept.

        Args:
            file_id: the original.
            size, sha256: of the bytes read whole, recorded when the original
                has none yet (they identify its versions' input).
        """

        def run(conn: Connection) -> None:
            with conn.transaction():
                conn.execute(
                    "UPDATE remote_sources SET retry_since = NULL, checked_at = now()"
                    " WHERE file_id = %s",
                    (file_id,),
                )
                if sha256 is not None:
                    conn.execute(
                        "UPDATE files SET size = %s, sha256 = %s, updated_at = now()"
                        " WHERE id = %s AND sha256 IS NULL",
                        (size, sha256, file_id),
                    )

        await self.store.call(run, kind="remote_answered")


class RemotePipeSource:
    """An in-pipe's source that reads a remote URL, opened when the execserver asks.

    What went wrong is kept in :attr:`problem` (the execserver then saw a cut
    input, whatever its job says); :meth:`RemoteSources.after_pipe` turns it
    into the step's end.
    """

    def __init__(self, sources: RemoteSources, url: str) -> None:
        self._sources = sources
        self._url = url
        self._stack: contextlib.AsyncExitStack | None = None
        self._chunks: AsyncIterator[bytes] | None = None
        self._closed = False
        self.problem: Temporary | Failure | None = None
        self.complete = False

    def __aiter__(self) -> RemotePipeSource:
        return self

    async def __anext__(self) -> bytes:
        if self._closed:
            raise StopAsyncIteration
        try:
            if self._chunks is None:
                self._chunks = await self._open()
            return await self._chunks.__anext__()
        except StopAsyncIteration:
            self.complete = True
            await self.aclose()
            raise
        except Exception as exc:
            if self.problem is None:
                self.problem = self._sources.judge_exception(exc)
            await self.aclose()
            raise

    async def _open(self) -> AsyncIterator[bytes]:
        stack = self._stack = contextlib.AsyncExitStack()
        response = await stack.enter_async_context(self._sources.fetcher.get(httpx.URL(self._url)))
        judged = self._sources.judge_response(response)
        if judged is not None:
            self.problem = judged
            raise RemoteSourceFailed(judged.reason)
        return response.aiter_raw()

    async def aclose(self) -> None:
        """Close the remote's connection (safe to call twice)."""
        self._closed = True
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()


class RemoteSources:
    """Reading remote originals for the steps (see the module docstring).

    Args:
        config: the fylr configuration (its ``rput``, ``retry_delay`` and
            ``max_upload_size``).
        store: the database.
        storage: where copies are written.
        fetcher: how URLs are read (by default one on ``rput``'s blocklist).
    """

    def __init__(
        self,
        config: FylrConfig,
        store: Store,
        storage: Storage,
        fetcher: RemoteFetcher | None = None,
    ) -> None:
        self.config = config
        self.files = RemoteFiles(store)
        self.storage = storage
        self.fetcher = fetcher or RemoteFetcher(config.rput.policy(), timeout=config.rput.timeout)

    # -- judging ---------------------------------------------------------------------------

    def judge_response(self, response: httpx.Response) -> Temporary | Failure | None:
        """What a final answer means (:func:`~trio_broker_daemons.fylr.remote.judge_status`)."""
        status = response.status_code
        return judge_status(
            status,
            response.reason_phrase or httpx.codes.get_reason_phrase(status),
            response.headers.get("retry-after"),
            now=time.time(),
            retry_delay=self.config.retry_delay,
        )

    def judge_exception(self, exc: BaseException) -> Temporary | Failure:
        """What a failed read means: refused or failed for good, else temporary."""
        if isinstance(exc, RemoteRefused):
            return Failure(exc.line)
        if isinstance(exc, RemoteSourceFailed | Unresolvable):
            return Failure(str(exc))
        if isinstance(exc, FileTooLarge):
            return Failure(f"the remote file is larger than {exc.limit} bytes")
        if isinstance(exc, httpx.TimeoutException):
            return judge_failure(
                f"the remote did not answer within {self.config.rput.timeout:g} s"
                f" ({type(exc).__name__})",
                retry_delay=self.config.retry_delay,
            )
        return judge_failure(
            f"the remote could not be read: {describe(exc)}", retry_delay=self.config.retry_delay
        )

    async def end_of(self, file_id: int, problem: Temporary | Failure) -> Exception:
        """The exception a step raises for a remote's problem (given up on, or not yet)."""
        if isinstance(problem, Temporary):
            since, now = await self.files.failing(file_id)
            decided = give_up(
                problem, since=since, now=now, give_up_after=self.config.rput.give_up_after
            )
            if isinstance(decided, Temporary):
                return RetryLater(decided.delay, decided.reason)
            problem = decided
        return RemoteSourceFailed(problem.reason)

    # -- the copy step ---------------------------------------------------------------------

    async def fetch_into(self, url: str) -> tuple[StoredFile, str | None]:
        """Read ``url`` into storage (hashed on the way, ``max_upload_size`` applies).

        Returns:
            The stored file and the answer's ``Content-Type`` (without parameters).

        Raises:
            RemoteProblem: what the remote did (see :meth:`judge_exception`).
            OSError: the storage folder failed (the caller's temporary reason).
        """
        limit = self.config.max_upload_size
        async with self._answer(url, passing=(OSError,)) as response:
            declared = response.headers.get("content-length", "")
            if limit is not None and declared.isdigit() and int(declared) > limit:
                raise RemoteProblem(Failure(f"the remote file is larger than {limit} bytes"))
            stored = await self.storage.write_stream(
                "original", response.aiter_raw(), max_size=limit
            )
            kind = response.headers.get("content-type", "").split(";", 1)[0].strip()
            return stored, kind or None

    @contextlib.asynccontextmanager
    async def _answer(
        self, url: str, *, passing: tuple[type[Exception], ...] = ()
    ) -> AsyncIterator[httpx.Response]:
        """The 2xx answer of ``url``; what else the remote did, as a :class:`RemoteProblem`.

        A :class:`RemoteProblem` and exceptions of the ``passing`` types (raised
        by the fetch or by the caller's body) go through as they are; any other
        becomes the :class:`RemoteProblem` :meth:`judge_exception` says.
        """
        try:
            async with self.fetcher.get(httpx.URL(url)) as response:
                judged = self.judge_response(response)
                if judged is not None:
                    raise RemoteProblem(judged)
                yield response
        except Exception as exc:
            if isinstance(exc, (RemoteProblem, *passing)):
                raise
            raise RemoteProblem(self.judge_exception(exc)) from exc

    # -- references: in-pipes and the check at sync -------------------------------------------

    async def pipe_source(self, file_id: int) -> RemotePipeSource:
        """An in-pipe source reading the URL of an original left on its remote.

        Raises:
            FileNotFoundError: the original has no remote (its stored bytes are
                missing: a hard failure).
        """
        found = await self.files.get(file_id)
        if found is None or not found.leave_on_remote:
            raise FileNotFoundError(f"the original {file_id} has neither stored bytes nor a URL")
        return RemotePipeSource(self, found.url)

    async def after_pipe(self, file_id: int, source: RemotePipeSource) -> None:
        """After the job that read ``source``: raise what the remote did, or note it answered.

        Raises:
            RetryLater: a temporary failure (the job's result is dropped).
            RemoteSourceFailed: a failure for good, or one given up on.
        """
        if source.problem is not None:
            raise await self.end_of(file_id, source.problem)
        if source.complete:
            await self.files.answered(file_id)

    async def check_reference(self, file_id: int) -> None:
        """The sync step's check of an original left on its remote (nothing for others).

        The URL must answer 2xx; when the original's versions are made from it
        (``rput.reference_steps: all``) and its bytes are not identified yet,
        they are read once, whole, for their size and SHA-256.

        Raises:
            RetryLater: a temporary failure.
            RemoteSourceFailed: the URL does not answer (the original ends ``error``).
        """
        found = await self.files.waiting(file_id, "sync")
        if found is None or not found.source.leave_on_remote:
            return
        identify = self.config.rput.reference_steps == "all" and found.sha256 is None
        try:
            size, digest = await self._probe(found.source.url, identify=identify)
        except RemoteProblem as exc:
            raise await self.end_of(file_id, exc.problem) from None
        await self.files.answered(file_id, size=size, sha256=digest)

    async def _probe(self, url: str, *, identify: bool) -> tuple[int | None, str | None]:
        limit = self.config.max_upload_size
        async with self._answer(url) as response:
            if not identify:
                return None, None
            digest = hashlib.sha256()
            size = 0
            async for chunk in response.aiter_raw():
                size += len(chunk)
                if limit is not None and size > limit:
                    raise FileTooLarge(limit)
                digest.update(chunk)
            return size, digest.hexdigest()


class RemoteProblem(Exception):
    """What a remote did, on its way to the step's end (:meth:`RemoteSources.end_of`).

    Attributes:
        problem: the failure, temporary or for good.
    """

    def __init__(self, problem: Temporary | Failure) -> None:
        super().__init__(problem.reason)
        self.problem = problem
