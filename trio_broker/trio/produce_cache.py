"""The execserver's produce cache: a service's output kept for the next job that asks the same.

A service may declare a cache (:class:`CacheSpec`: the params its key is made of,
and a size bound). :class:`CachingRunner` wraps the reference runner: for a job of
such a service it makes the job's key from the service, the named params and
the job object's ``input_hash`` (the client sends the hash of the input it will
pipe in; a job without one is run as it is, uncached), and then:

* **Hit**: the cached file is streamed to the job's ``stdout_url`` as a command's
  stdout would be (the same framing and back-pressure,
  :mod:`trio_broker.trio.pipe_io`), and the receipt is ``ok`` with
  ``exit_code`` null: no command runs, nothing is read from the in-pipe. The
  job still holds its slot while it streams.
* **Miss**: the command runs as usual, and a copy of its stdout goes to a
  temporary sibling of the entry (``JobRequest.stdout_tap``). Only when the job
  ends ``ok`` with its whole output copied is the temporary file renamed into
  place; any other end (a failure, a kill, a cancel, the daemon stopping)
  deletes it. A producer killed with the whole daemon leaves a temporary file,
  which the next start deletes: a partial entry is never served.
* **One producer per key.** Jobs of one key are serialised by a lock per key in
  this process and a file lock (``flock``) on ``<entry>.lock``, which also holds
  between processes sharing the folder: the first runs the command, the others
  wait (an abort still ends a waiting job at once) and then find the entry.
* **Bounded.** After each new entry, entries are deleted least recently used
  first (a hit makes an entry the most recent) until the cache's files fit in
  ``max_size``; an output larger than ``max_size`` is not kept at all. Deleting
  an entry that a hit is streaming does not disturb it (the open file stays
  readable).

Each service's cache is one folder, ``<temp_dir>/produce-cache/<service>``; its
figures (entries, bytes, hits, misses) are in the runner's statistics and on
``/inspect/system/execserver``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from functools import partial
from pathlib import Path
from typing import IO, Any, Final

import attrs
import trio

from trio_broker.core.job import JobSpec, JobSpecError, ended_receipt
from trio_broker.core.protocol import Receipt
from trio_broker.trio.pipe_io import (
    PIPE_FINISH_TIMEOUT,
    PipeConnector,
    PipeFault,
    PipeUrls,
    StdoutReader,
    open_pipes,
    pump_stdout,
)
from trio_broker.trio.runner import JobControl, JobRequest, ReportingRunner, RunnerStatistics

__all__ = ["CacheSpec", "CachingRunner", "ProduceCache"]

log = logging.getLogger(__name__)

_TEMP_SUFFIX: Final = ".tmp"
_LOCK_SUFFIX: Final = ".lock"
_READ_CHUNK: Final = 256 * 1024
_KEY_FORMAT: Final = 1


@attrs.frozen(kw_only=True)
class CacheSpec:
    """A service's produce cache.

    Attributes:
        key: the job params the key is made of (besides the service and the input hash).
        max_size: the most bytes the cache's entries take together (> 0).
    """

    key: tuple[str, ...]
    max_size: int

    def __attrs_post_init__(self) -> None:
        if self.max_size <= 0:
            raise ValueError(f"max_size must be positive, got {self.max_size!r}")


class _FileLock:
    """An exclusive ``flock`` on one file, taken in a thread, given up safely on cancellation."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._fd: int | None = None
        self._mutex = threading.Lock()
        self._abandoned = False

    def _take(self) -> None:
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        with self._mutex:
            if self._abandoned:  # the waiting task was cancelled meanwhile
                os.close(fd)
            else:
                self._fd = fd

    async def __aenter__(self) -> None:
        try:
            await trio.to_thread.run_sync(self._take, abandon_on_cancel=True)
        except BaseException:
            with self._mutex:
                self._abandoned = True
                self._release()
            raise

    def _release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None

    async def __aexit__(self, *exc_info: object) -> None:
        self._release()


class _Copy:
    """A miss's copy of stdout into the entry's temporary sibling (a :class:`StdoutTap`)."""

    def __init__(self, path: Path, limit: int) -> None:
        self.path = path
        self.limit = limit
        self.bytes = 0
        self.ended = False
        self.failed: str | None = None
        self._file: IO[bytes] | None = None

    async def write(self, chunk: bytes) -> None:
        if not chunk:
            self.ended = True  # stdout reached its end: the copy is whole
            return
        if self.failed is not None:
            return
        if self.bytes + len(chunk) > self.limit:
            self.failed = f"the output is larger than the cache ({self.limit} bytes)"
            return
        try:
            await trio.to_thread.run_sync(self._write, chunk)
        except OSError as exc:
            self.failed = f"cannot write the cache entry: {exc}"
            log.warning("produce cache: %s", self.failed)
        else:
            self.bytes += len(chunk)

    def _write(self, chunk: bytes) -> None:
        if self._file is None:
            self._file = open(self.path, "xb")  # noqa: SIM115 - closed by _finish
        self._file.write(chunk)

    def finish(self, keep_as: Path | None) -> bool:
        """Close the copy; rename it to ``keep_as`` (None: delete it). Whether it was kept."""
        try:
            if self._file is None:
                if keep_as is None or self.failed is not None or not self.ended:
                    return False
                self._file = open(self.path, "xb")  # noqa: SIM115 - an empty output
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            if keep_as is not None and self.failed is None and self.ended:
                os.replace(self.path, keep_as)
                return True
        except OSError as exc:
            log.warning("produce cache: cannot keep %s: %s", keep_as, exc)
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        return False


class ProduceCache:
    """One service's cache folder: its entries, by recency, and its figures.

    Args:
        folder: the cache's folder (made if missing). Temporary files left there
            by a producer that was killed are deleted now.
        spec: the key's params and the size bound.
    """

    def __init__(self, folder: Path, spec: CacheSpec) -> None:
        self.folder = folder
        self.spec = spec
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[str, int] = OrderedDict()
        self._locks: dict[str, tuple[trio.Lock, int]] = {}
        folder.mkdir(parents=True, exist_ok=True)
        found = []
        for path in folder.iterdir():
            if path.name.endswith(_TEMP_SUFFIX):
                path.unlink(missing_ok=True)
            elif not path.name.endswith(_LOCK_SUFFIX) and path.is_file():
                stat = path.stat()
                found.append((stat.st_mtime, path.name, stat.st_size))
        for _, name, size in sorted(found):
            self._entries[name] = size

    def figures(self) -> dict[str, int]:
        """``entries``, ``bytes``, ``max_size``, ``hits``, ``misses``."""
        return {
            "entries": len(self._entries),
            "bytes": sum(self._entries.values()),
            "max_size": self.spec.max_size,
            "hits": self.hits,
            "misses": self.misses,
        }

    def key_of(self, service: str, job: Mapping[str, Any]) -> str | None:
        """The entry name of a job: a hash of the service, the key params and the input
        hash; ``None`` for a job that cannot be cached (no ``input_hash``, a key param
        missing)."""
        input_hash = job.get("input_hash")
        params = job.get("params")
        if not isinstance(input_hash, str) or not input_hash or not isinstance(params, Mapping):
            return None
        if any(name not in params for name in self.spec.key):
            return None
        document = {
            "format": _KEY_FORMAT,
            "service": service,
            "params": {name: params[name] for name in self.spec.key},
            "input_hash": input_hash,
        }
        text = json.dumps(document, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    @contextlib.asynccontextmanager
    async def producing(self, key: str) -> AsyncIterator[None]:
        """Hold the key: one job at a time produces or reads it (this process, then flock)."""
        lock, users = self._locks.get(key, (trio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock, _FileLock(self.folder / f"{key}{_LOCK_SUFFIX}"):
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)

    def lookup(self, key: str) -> Path | None:
        """The entry's file if it is cached (it becomes the most recent), else ``None``."""
        path = self.folder / key
        if key not in self._entries:
            if not path.is_file():  # another process may have made it
                return None
            self._entries[key] = path.stat().st_size
        self._entries.move_to_end(key)
        with contextlib.suppress(OSError):
            os.utime(path)  # the recency survives a restart
        return path

    def copy(self, key: str) -> _Copy:
        """A copy of a miss's output into a temporary sibling of the entry."""
        name = f".{key}.{secrets.token_hex(4)}{_TEMP_SUFFIX}"
        return _Copy(self.folder / name, self.spec.max_size)

    async def keep(self, key: str, copy: _Copy, ok: bool) -> None:
        """End a miss: rename its copy into place when ``ok``, else delete it; then evict."""
        path = self.folder / key
        kept = await trio.to_thread.run_sync(copy.finish, path if ok else None)
        if not kept:
            return
        self._entries[key] = copy.bytes
        self._entries.move_to_end(key)
        victims = []
        total = sum(self._entries.values())
        while total > self.spec.max_size:
            victim, size = self._entries.popitem(last=False)
            victims.append(self.folder / victim)
            total -= size
        for victim_path in victims:
            await trio.to_thread.run_sync(partial(victim_path.unlink, missing_ok=True))


class _FileStream(trio.abc.ReceiveStream):
    """A cached entry as a receive stream, for the stdout reader of a hit."""

    def __init__(self, file: Any) -> None:
        self._file = file  # a trio async file

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        data: bytes = await self._file.read(max_bytes or _READ_CHUNK)
        return data

    async def aclose(self) -> None:
        await self._file.aclose()


class CachingRunner:
    """A runner with a produce cache for some services (the module docstring).

    Args:
        inner: the runner that runs the commands (the reference runner, which
            honours ``JobRequest.stdout_tap``).
        caches: the cache of each cached service; other services go to ``inner``.
        instance_id: copied into the receipts of hits.
    """

    def __init__(
        self,
        inner: ReportingRunner,
        caches: Mapping[str, ProduceCache],
        *,
        instance_id: str = "",
    ) -> None:
        self._inner = inner
        self._caches = dict(caches)
        self._instance_id = instance_id
        self._connector = PipeConnector()

    def statistics(self) -> RunnerStatistics:
        """The inner runner's statistics with each cache's figures."""
        figures = {name: cache.figures() for name, cache in self._caches.items()}
        return attrs.evolve(self._inner.statistics(), caches=figures)

    async def run(self, request: JobRequest, control: JobControl) -> Receipt:
        """Run a job: from the cache, or through the inner runner (copied into the cache)."""
        cache = self._caches.get(request.service)
        key = None if cache is None else cache.key_of(request.service, request.job)
        if cache is None or key is None:
            return await self._inner.run(request, control)
        started, started_at = trio.current_time(), time.time()
        async with contextlib.AsyncExitStack() as stack:
            if not await _hold(stack, cache, key, control):
                assert control.status is not None
                assert control.reason is not None
                return ended_receipt(
                    control.status,
                    control.reason,
                    started_at=started_at,
                    duration_s=trio.current_time() - started,
                    instance_id=self._instance_id,
                )
            path = cache.lookup(key)
            if path is not None:
                cache.hits += 1
                return await self._serve(path, request, control, started_at)
            cache.misses += 1
            copy = cache.copy(key)
            ok = False
            try:
                receipt = await self._inner.run(attrs.evolve(request, stdout_tap=copy), control)
                ok = receipt.status == "ok"
            finally:
                with trio.CancelScope(shield=True):
                    await cache.keep(key, copy, ok)
            return receipt

    async def _serve(
        self, path: Path, request: JobRequest, control: JobControl, started_at: float
    ) -> Receipt:
        """Stream a cached entry to the job's out-pipe; no command runs."""
        started = trio.current_time()

        def receipt(status: Any, error: str | None, reader: StdoutReader | None) -> Receipt:
            return ended_receipt(
                status,
                error,
                started_at=started_at,
                duration_s=trio.current_time() - started,
                instance_id=self._instance_id,
                stdout_prefix="" if reader is None else reader.prefix(),
                stdout_bytes=0 if reader is None else reader.bytes,
            )

        try:
            urls = PipeUrls.of(JobSpec.from_wire(request.job))
        except JobSpecError as exc:
            return receipt("error", str(exc), None)
        fault = PipeFault()
        async with contextlib.AsyncExitStack() as stack:
            _, out_pipe = await open_pipes(
                stack, self._connector, PipeUrls(stdin=None, stdout=urls.stdout)
            )
            file = await trio.open_file(path, "rb")
            reader = StdoutReader(_FileStream(file))
            stack.push_async_callback(file.aclose)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_cancel_on_abort, control, nursery.cancel_scope)
                nursery.start_soon(_cancel_on_fault, fault, nursery.cancel_scope)
                nursery.start_soon(pump_stdout, reader, out_pipe, fault)
                await reader.eof.wait()
                if out_pipe is not None:
                    await out_pipe.finish(reader, fault, True, PIPE_FINISH_TIMEOUT)
                nursery.cancel_scope.cancel()
        if control.status is not None:
            return receipt(control.status, control.reason, reader)
        if fault.error is not None:
            return receipt("stopped", fault.error, reader)
        return receipt("ok", None, reader)


async def _hold(
    stack: contextlib.AsyncExitStack[bool | None],
    cache: ProduceCache,
    key: str,
    control: JobControl,
) -> bool:
    """Take the key's lock onto ``stack``; ``False`` when the job was aborted while waiting."""
    held = False
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_cancel_on_abort, control, nursery.cancel_scope)
        await stack.enter_async_context(cache.producing(key))
        held = True
        nursery.cancel_scope.cancel()
    return held and control.status is None


async def _cancel_on_abort(control: JobControl, scope: trio.CancelScope) -> None:
    await control.wait_aborted()
    scope.cancel()


async def _cancel_on_fault(fault: PipeFault, scope: trio.CancelScope) -> None:
    await fault.wait()
    scope.cancel()
