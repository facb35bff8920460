"""Stored files in a local folder: streamed in with their hash, streamed out by key.

Theory of operation
===================

:class:`Storage` owns one folder with two subfolders, ``originals/`` (uploads)
and ``versions/`` (renditions). A file's **key** is chosen here, never taken from
a user's file name: ``<kind folder>/<2 hex>/<32 hex>``, 64 random bits and the
writer's tag (below), fanned out by the random part over 256 subfolders so that
no folder grows huge. :meth:`Storage.path` accepts
only keys of exactly that form, so a key from a database row can never point
outside the folder.

Writing is all or nothing. :meth:`Storage.write_stream` writes the chunks to a
temporary file ``.tmp-<writer tag>-<random>`` in the destination's own folder,
hashing (SHA-256) and counting as it goes; on success it flushes, ``fsync``\\ s,
renames the temporary file to its key and ``fsync``\\ s the folder, so a
returned key names a complete file that survives a crash. On any failure or
cancellation (the client hung up, a chunk source raised, the size limit was
passed, the disk is full) the temporary file is closed and deleted in a
shielded, bounded cleanup: an interrupted upload leaves nothing.

Several processes on one folder
-------------------------------

Several fylrs may share the folder (and the database). Each :class:`Storage` is
made for one **writer**, the backend id of its process, and marks what it writes
with the writer's **tag** (:func:`writer_tag`, 64 bits of the id's SHA-256):
temporary files carry it in their name, and a key's 32 hex digits are 64 random
bits followed by the tag. A process killed outright cannot clean up after
itself; its leftovers are of two sorts: temporary files of writes it never
finished, and stored files it wrote but never recorded in a row (killed between
the two). Nothing here decides alone what another process still uses:
:meth:`Storage.scan` lists both sorts with their writer and age, :func:`abandoned`
judges one (pure, the time passed in), :meth:`Storage.remove` deletes. The rule
(:mod:`~trio_broker_daemons.fylr.sweep` applies it with the database's view of
the live backends and of the referenced keys) is that a leftover is removed only
when its writer is not a live backend *and* it has not been written to for a
grace period; a stored file moreover only when no row references it. A write in
progress in a live process is therefore never touched, whoever sweeps. Within
one process the same holds without the heartbeat: a key stays in
:attr:`Storage.recording` from before its file exists until the caller has
written (or failed to write) its row (:meth:`Storage.settled`), and the sweep
spares those; so a live fylr also removes what it stored itself and then could
not record (the database failed at that moment).

Storage locations
-----------------

The folder is the ``default`` location; further locations are other folders by
name (``FylrConfig.storage_locations``), and new files go to the *current* one.
A key outside ``default`` starts with its location: ``archive:originals/ab/…``.
A file keeps its name (the part after the location) wherever it is stored, so
a file moved to another location (:meth:`Storage.copy_to`, the ``copy_move``
action) is found by a reader that still holds its old key: :meth:`Storage.open_read`
and :meth:`Storage.exists` look for the same name in the other locations when
the key's own file is missing (:meth:`Storage.find`). A move therefore never
has a moment where neither copy exists, nor one where a reader that read the
row a moment earlier finds nothing.

Blocking file I/O runs in worker threads (:func:`trio.to_thread.run_sync`); small
chunks are gathered to :data:`WRITE_BATCH` bytes before each hop, and hashing
happens in the thread along with the write.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
from collections.abc import AsyncIterable, Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Final, Literal, TypeAlias

import attrs
import trio

__all__ = [
    "CHUNK_SIZE",
    "DEFAULT_LOCATION",
    "KIND_FOLDERS",
    "WRITE_BATCH",
    "FileReader",
    "FileTooLarge",
    "Leftover",
    "Storage",
    "StoredFile",
    "StoredKind",
    "abandoned",
    "writer_tag",
]

StoredKind: TypeAlias = Literal["original", "version"]
"""What a stored file is: an upload or a rendition."""

KIND_FOLDERS: Final[dict[StoredKind, str]] = {"original": "originals", "version": "versions"}
CHUNK_SIZE: Final = 65536
"""The chunk size :meth:`Storage.open_read` reads by default."""
WRITE_BATCH: Final = 65536
"""Bytes gathered from the incoming chunks before one write in a worker thread."""

DEFAULT_LOCATION: Final = "default"
"""The location of keys without a prefix: the folder given as ``root``."""

_TEMP_PREFIX: Final = ".tmp-"
_KEY: Final = re.compile(
    r"(?:([a-z0-9][a-z0-9_-]{0,62}):)?((originals|versions)/([0-9a-f]{2})/(\4[0-9a-f]{30}))"
)
_TEMP_NAME: Final = re.compile(r"\.tmp-([0-9a-f]{16})-[0-9a-f]{16}")
_NAME: Final = re.compile(r"[0-9a-f]{32}")
_TAG_HEX: Final = 16
_CLEANUP_TIMEOUT: Final = 10.0


class FileTooLarge(ValueError):
    """The stream passed the size limit of :meth:`Storage.write_stream`; nothing was kept."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the file is larger than {limit} bytes")
        self.limit = limit


@attrs.frozen(kw_only=True)
class StoredFile:
    """A completely written file.

    Attributes:
        key: where it is (:meth:`Storage.path`); store this in the database.
        size: its length in bytes.
        sha256: the SHA-256 of its content, 64 lowercase hex digits.
    """

    key: str
    size: int
    sha256: str


def writer_tag(writer: str) -> str:
    """The tag a writer marks its files with: 16 hex digits of the SHA-256 of its id.

    Args:
        writer: a backend id (any string; ``""`` for an anonymous writer).
    """
    return hashlib.sha256(writer.encode()).hexdigest()[:_TAG_HEX]


@attrs.frozen(kw_only=True)
class Leftover:
    """A file a sweep may remove: a temporary file, or a stored file (maybe unreferenced).

    Attributes:
        path: the file.
        kind: ``temporary`` (an unfinished write) or ``stored`` (a complete file).
        key: a stored file's key (``None`` for a temporary file).
        writer: the writer's tag from the name (``None``: a name of no known writer).
        age: seconds since it was last written to, when it was scanned.
    """

    path: Path
    kind: Literal["temporary", "stored"]
    key: str | None
    writer: str | None
    age: float


def abandoned(leftover: Leftover, *, live: Collection[str], grace: float) -> bool:
    """Whether nobody can still be writing or recording a file.

    Args:
        leftover: what :meth:`Storage.scan` found.
        live: the tags (:func:`writer_tag`) of the backends that are alive.
        grace: seconds a file must have gone unwritten.

    Returns:
        ``True`` when its writer is not among ``live`` (or unknown) and it is at
        least ``grace`` seconds old. A stored file must further be unreferenced,
        which only the database can say.
    """
    return leftover.age >= grace and (leftover.writer is None or leftover.writer not in live)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_dirs(path: Path, root: Path) -> None:
    """Create ``root`` and the folders from it down to ``path``; fsync each new one's parent."""
    root.mkdir(parents=True, exist_ok=True)
    missing = []
    here = path
    while here != root and not here.is_dir():
        missing.append(here)
        here = here.parent
    for folder in reversed(missing):
        try:
            folder.mkdir()
        except FileExistsError:
            continue  # another writer made it
        _fsync_dir(folder.parent)


def _open_temporary(folder: Path, tag: str) -> tuple[Path, IO[bytes]]:
    while True:
        temp = folder / f"{_TEMP_PREFIX}{tag}-{secrets.token_hex(8)}"
        try:
            return temp, open(temp, "xb")
        except FileExistsError:  # pragma: no cover - 64 random bits per writer
            continue


def _open_new(folder: Path, root: Path, tag: str) -> tuple[Path, IO[bytes]]:
    """The folders down to ``folder`` (:func:`_make_dirs`), then a temporary file in it."""
    _make_dirs(folder, root)
    return _open_temporary(folder, tag)


def _write_batch(stream: IO[bytes], digest: hashlib._Hash, data: bytes) -> None:
    stream.write(data)
    digest.update(data)


def _finish(stream: IO[bytes], temp: Path, final: Path, digest: hashlib._Hash, data: bytes) -> None:
    """Write the last ``data``, make the file durable and rename it to its key."""
    if data:
        _write_batch(stream, digest, data)
    stream.flush()
    os.fsync(stream.fileno())
    stream.close()
    if final.exists():  # pragma: no cover - 64 random bits per writer
        raise FileExistsError(errno.EEXIST, "key already in use", str(final))
    os.rename(temp, final)
    try:
        _fsync_dir(final.parent)
    except BaseException:
        final.unlink(missing_ok=True)
        raise


def _discard(stream: IO[bytes], temp: Path) -> None:
    try:
        stream.close()
    finally:
        temp.unlink(missing_ok=True)


class Storage:
    """Originals and versions in one local folder, by random keys.

    Args:
        root: the folder of the ``default`` location; it and its subfolders are
            created on first write.
        writer: the backend id of the process that writes through this object
            (its files carry :func:`writer_tag` of it).
        locations: further locations by name (folders).
        current: where new files go (``None``: ``default``).

    Raises:
        ValueError: ``current`` names no location.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        writer: str = "",
        locations: Mapping[str, str | os.PathLike[str]] | None = None,
        current: str | None = None,
    ) -> None:
        self.root = Path(root)
        self.roots: dict[str, Path] = {
            DEFAULT_LOCATION: self.root,
            **{name: Path(folder) for name, folder in (locations or {}).items()},
        }
        self.current = current or DEFAULT_LOCATION
        if self.current not in self.roots:
            raise ValueError(f"current: no location named {self.current!r}")
        self.writer = writer
        self.tag = writer_tag(writer)
        self.recording: set[str] = set()
        """Keys this object wrote whose row is not settled yet (:meth:`settled`)."""

    def __repr__(self) -> str:
        return f"Storage({str(self.root)!r})"

    def path(self, key: str) -> Path:
        """The file of a key.

        Args:
            key: a key :meth:`write_stream` returned.

        Returns:
            Its path under :attr:`root` (the file may no longer exist).

        Raises:
            ValueError: not a well-formed key (so never a path outside the folder).
        """
        location, name = self._split(key)
        return self.roots[location] / name

    def _split(self, key: str) -> tuple[str, str]:
        """A key's location and name (the part every location stores it under)."""
        match = _KEY.fullmatch(key) if isinstance(key, str) else None
        if match is None:
            raise ValueError(f"not a storage key: {key!r}")
        location = match.group(1) or DEFAULT_LOCATION
        if location not in self.roots or match.group(1) == DEFAULT_LOCATION:
            raise ValueError(f"not a storage key of a configured location: {key!r}")
        return location, match.group(2)

    def location_of(self, key: str) -> str:
        """The location a key names (``default`` for a key without a prefix).

        Raises:
            ValueError: not a well-formed key, or its location is not configured.
        """
        return self._split(key)[0]

    def relocated(self, key: str, location: str) -> str:
        """The key of the same file in another location.

        Raises:
            ValueError: not a well-formed key, or a location that is not configured.
        """
        _, name = self._split(key)
        if location not in self.roots:
            raise ValueError(f"no storage location named {location!r}")
        return name if location == DEFAULT_LOCATION else f"{location}:{name}"

    @staticmethod
    def kind_of(key: str) -> StoredKind:
        """Whether a key names an original or a version.

        Raises:
            ValueError: not a well-formed key.
        """
        match = _KEY.fullmatch(key) if isinstance(key, str) else None
        if match is None:
            raise ValueError(f"not a storage key: {key!r}")
        return "original" if match.group(3) == "originals" else "version"

    def new_key(self, kind: StoredKind) -> str:
        """A fresh key of this kind: 64 random bits and this writer's tag (nothing is created).

        Raises:
            ValueError: an unknown kind.
        """
        if kind not in KIND_FOLDERS:
            raise ValueError(f"kind must be 'original' or 'version', got {kind!r}")
        name = secrets.token_hex(8) + self.tag
        key = f"{KIND_FOLDERS[kind]}/{name[:2]}/{name}"
        return key if self.current == DEFAULT_LOCATION else f"{self.current}:{key}"

    async def write_stream(
        self, kind: StoredKind, chunks: AsyncIterable[bytes], *, max_size: int | None = None
    ) -> StoredFile:
        """Store a stream of bytes under a new key, hashing it on the way.

        Args:
            kind: ``original`` or ``version`` (the subfolder).
            chunks: the content; each item ``bytes`` (or a bytes-like object).
            max_size: refuse the stream once it passes this many bytes; ``None``
                for no limit.

        Returns:
            The key, size and SHA-256 of the complete, durable file. The key is
            in :attr:`recording` until the caller calls :meth:`settled`.

        Raises:
            FileTooLarge: the stream passed ``max_size``.
            OSError: the file could not be written (disk full, permissions, the
                folder went away, the temporary file vanished).
            Exception: whatever iterating ``chunks`` raised.

            On any of these and on cancellation nothing is left behind.
        """
        key = self.new_key(kind)
        final = self.path(key)
        root = self.roots[self.current]
        # one worker-thread hop to open, one per WRITE_BATCH, one to finish
        temp, stream = await trio.to_thread.run_sync(_open_new, final.parent, root, self.tag)
        digest = hashlib.sha256()
        size = 0
        pending: list[bytes] = []
        pending_size = 0
        try:
            async for chunk in chunks:
                if not chunk:
                    continue
                size += len(chunk)
                if max_size is not None and size > max_size:
                    raise FileTooLarge(max_size)
                pending.append(bytes(chunk))
                pending_size += len(chunk)
                if pending_size >= WRITE_BATCH:
                    data = b"".join(pending)
                    pending.clear()
                    pending_size = 0
                    await trio.to_thread.run_sync(_write_batch, stream, digest, data)
            last = b"".join(pending)
            pending.clear()
            self.recording.add(key)  # before it exists under its key: a sweep keeps it
            await trio.to_thread.run_sync(_finish, stream, temp, final, digest, last)
        except BaseException:
            self.recording.discard(key)
            with trio.CancelScope(shield=True), trio.move_on_after(_CLEANUP_TIMEOUT):
                await trio.to_thread.run_sync(_discard, stream, temp)
            raise
        return StoredFile(key=key, size=size, sha256=digest.hexdigest())

    def settled(self, key: str) -> None:
        """The writer is done recording ``key`` (the row was written, or writing it failed).

        Until then a sweep in this process never removes the file; afterwards it
        may, once the file is old and no row references it. Not calling it only
        keeps the file.
        """
        self.recording.discard(key)

    async def open_read(self, key: str, *, chunk_size: int = CHUNK_SIZE) -> FileReader:
        """Open a stored file for streaming out.

        The file is opened here, so a missing key fails before any byte is sent.

        Args:
            key: the file's key.
            chunk_size: the most bytes per chunk, >= 1.

        Returns:
            A reader: ``async for chunk in reader`` yields the content and closes
            the file at the end; use ``async with reader`` (or :meth:`FileReader.aclose`)
            when the loop may stop early.

        Raises:
            ValueError: a malformed key or ``chunk_size`` below 1.
            FileNotFoundError: no file has this key (never written, or deleted).
        """
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        paths = self._candidates(key)
        file, size = await trio.to_thread.run_sync(_open_first, paths)
        return FileReader(file, size=size, chunk_size=chunk_size)

    def _candidates(self, key: str) -> list[Path]:
        """Where a key's file may be: its own location first, then the others."""
        location, name = self._split(key)
        others = [root / name for where, root in self.roots.items() if where != location]
        return [self.roots[location] / name, *others]

    async def find(self, key: str) -> Path | None:
        """The file of a key: its own, or the same name in another location (a moved
        file read through its old key); ``None`` when none exists.

        Raises:
            ValueError: a malformed key.
        """
        paths = self._candidates(key)
        return await trio.to_thread.run_sync(_first_file, paths)

    async def delete(self, key: str) -> bool:
        """Delete a stored file.

        Args:
            key: the file's key.

        Returns:
            ``True`` when it existed, ``False`` when there was nothing to delete.

        Raises:
            ValueError: a malformed key.
        """
        path = self.path(key)
        try:
            await trio.to_thread.run_sync(path.unlink)
        except FileNotFoundError:
            return False
        return True

    async def exists(self, key: str) -> bool:
        """Whether a file is stored under this key (in its location, or moved to another).

        Raises:
            ValueError: a malformed key.
        """
        return await self.find(key) is not None

    async def digest(self, key: str) -> tuple[int, str]:
        """Read a stored file through and hash it: its size and SHA-256 (hex).

        Raises:
            ValueError: a malformed key.
            FileNotFoundError: no location holds it.
            OSError: it could not be read.
        """
        paths = self._candidates(key)
        return await trio.to_thread.run_sync(_digest_first, paths)

    async def copy_to(self, key: str, location: str) -> StoredFile:
        """Copy a stored file to another location under the same name.

        The copy is written to a temporary file there, hashed on the way, made
        durable and renamed over any earlier copy of that name (an interrupted
        move's), so the returned key names a complete file; the source stays.
        The new key is in :attr:`recording` until :meth:`settled`.

        Args:
            key: the file's key (its own location, or where it was moved).
            location: the target location.

        Returns:
            The new key (``location``'s), the size and the SHA-256 of what was copied.

        Raises:
            ValueError: a malformed key, an unknown location, or the key's own.
            FileNotFoundError: no location holds the file.
            OSError: reading or writing failed (nothing is left behind).
        """
        target = self.relocated(key, location)
        if target == key:
            raise ValueError(f"{key!r} is already in location {location!r}")
        sources = self._candidates(key)
        final = self.path(target)
        self.recording.add(target)
        try:
            size, sha256 = await trio.to_thread.run_sync(
                _copy, sources, final, self.roots[location], self.tag
            )
        except BaseException:
            self.recording.discard(target)
            raise
        return StoredFile(key=target, size=size, sha256=sha256)

    async def remove_copies(self, key: str) -> int:
        """Delete the copies of a key's file in the locations other than its own.

        What an interrupted move leaves: the old copy after its row changed, or
        a new one before. Only the same name is touched, which no other file has.

        Returns:
            How many copies were deleted.

        Raises:
            ValueError: a malformed key.
        """
        return await trio.to_thread.run_sync(_remove, self._candidates(key)[1:])

    async def scan(self, now: float) -> list[Leftover]:
        """Every temporary and stored file of every location, with its writer and age.

        Args:
            now: the current time (``time.time()``), to age the files by their mtime.

        Returns:
            The files found (a file that vanishes while scanning is left out); a
            stored file's key names its location.
        """
        found: list[Leftover] = []
        for location, root in self.roots.items():
            prefix = "" if location == DEFAULT_LOCATION else f"{location}:"
            found += await trio.to_thread.run_sync(_scan, root, now, prefix)
        return found

    async def remove(self, leftovers: Iterable[Leftover]) -> int:
        """Delete files :meth:`scan` found (those already gone count as not deleted).

        Returns:
            How many files were deleted.
        """
        paths = [leftover.path for leftover in leftovers]
        return await trio.to_thread.run_sync(_remove, paths)

    async def available(self) -> bool:
        """Whether every location's folder can be reached (a missing file then is really
        missing)."""
        roots = list(self.roots.values())
        return await trio.to_thread.run_sync(lambda: all(map(_folder_available, roots)))


def _open_for_reading(path: Path) -> tuple[IO[bytes], int]:
    file = open(path, "rb")  # noqa: SIM115 - closed by FileReader
    try:
        return file, os.fstat(file.fileno()).st_size
    except BaseException:
        file.close()
        raise


def _open_first(paths: Sequence[Path]) -> tuple[IO[bytes], int]:
    """The first of ``paths`` that opens; the first one's ``FileNotFoundError`` if none does."""
    missing: FileNotFoundError | None = None
    for path in paths:
        try:
            return _open_for_reading(path)
        except FileNotFoundError as exc:
            missing = missing or exc
    assert missing is not None
    raise missing


def _first_file(paths: Sequence[Path]) -> Path | None:
    return next((path for path in paths if path.is_file()), None)


def _read_through(
    stream: IO[bytes], sink: Callable[[bytes], object] | None = None
) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    while chunk := stream.read(CHUNK_SIZE * 16):
        digest.update(chunk)
        size += len(chunk)
        if sink is not None:
            sink(chunk)
    return size, digest.hexdigest()


def _digest_first(paths: Sequence[Path]) -> tuple[int, str]:
    stream, _ = _open_first(paths)
    with stream:
        return _read_through(stream)


def _copy(sources: Sequence[Path], final: Path, root: Path, tag: str) -> tuple[int, str]:
    """Copy the first readable of ``sources`` to ``final`` through a temporary file."""
    source, _ = _open_first(sources)
    with source:
        temp, stream = _open_new(final.parent, root, tag)
        try:
            size, sha256 = _read_through(source, stream.write)
            stream.flush()
            os.fsync(stream.fileno())
            stream.close()
            os.replace(temp, final)  # over an interrupted move's copy of this name
        except BaseException:
            _discard(stream, temp)
            raise
    _fsync_dir(final.parent)
    return size, sha256


def _scan(root: Path, now: float, prefix: str = "") -> list[Leftover]:
    found: list[Leftover] = []
    for folder in KIND_FOLDERS.values():
        try:
            fans = sorted(os.scandir(root / folder), key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for fan in fans:
            if not fan.is_dir(follow_symlinks=False):
                continue
            try:
                entries = list(os.scandir(fan.path))
            except FileNotFoundError:  # pragma: no cover - removed meanwhile
                continue
            for entry in entries:
                leftover = _leftover(entry, f"{folder}/{fan.name}", now, prefix)
                if leftover is not None:
                    found.append(leftover)
    return found


def _leftover(
    entry: os.DirEntry[str], folder: str, now: float, prefix: str = ""
) -> Leftover | None:
    name = entry.name
    try:
        if not entry.is_file(follow_symlinks=False):
            return None
        age = now - entry.stat(follow_symlinks=False).st_mtime
    except FileNotFoundError:
        return None
    if name.startswith(_TEMP_PREFIX):
        match = _TEMP_NAME.fullmatch(name)
        writer = match.group(1) if match else None
        return Leftover(path=Path(entry.path), kind="temporary", key=None, writer=writer, age=age)
    key = f"{prefix}{folder}/{name}"
    if not _NAME.fullmatch(name) or not _KEY.fullmatch(key):
        return None  # not ours: never touched
    return Leftover(path=Path(entry.path), kind="stored", key=key, writer=name[-_TAG_HEX:], age=age)


def _remove(paths: Iterable[Path]) -> int:
    count = 0
    for path in paths:
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        count += 1
    return count


def _folder_available(root: Path) -> bool:
    try:
        return root.is_dir() and os.access(root, os.R_OK | os.X_OK)
    except OSError:  # pragma: no cover - an unreachable mount
        return False


class FileReader:
    """A stored file being read: an async iterator of chunks and an async context manager.

    Made by :meth:`Storage.open_read`. Iterating to the end closes the file;
    :meth:`aclose` (or leaving ``async with``) closes it early. Not for use by
    two tasks at once.

    Attributes:
        size: the file's length when it was opened, in bytes (for ``Content-Length``).
    """

    def __init__(self, file: IO[bytes], *, size: int, chunk_size: int) -> None:
        self._file = file
        self._chunk_size = chunk_size
        self._closed = False
        self._read_bytes = 0
        self.size = size

    @property
    def closed(self) -> bool:
        """Whether the file has been closed."""
        return self._closed

    def __aiter__(self) -> FileReader:
        return self

    async def __anext__(self) -> bytes:
        if self._closed:
            raise StopAsyncIteration
        try:
            chunk, ended = await trio.to_thread.run_sync(self._read)
        except BaseException:
            await self.aclose()
            raise
        if ended:
            self._closed = True  # closed by the read that reached the end (one hop)
        if not chunk:
            await self.aclose()
            raise StopAsyncIteration
        return chunk

    def _read(self) -> tuple[bytes, bool]:
        """A chunk, and whether it reached the size seen at opening (the file is closed then)."""
        chunk = self._file.read(self._chunk_size)
        self._read_bytes += len(chunk)
        if not chunk or self._read_bytes >= self.size:
            self._file.close()
            return chunk, True
        return chunk, False

    async def aclose(self) -> None:
        """Close the file; calling it again does nothing."""
        if not self._closed:
            self._closed = True
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self._file.close)

    async def __aenter__(self) -> FileReader:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()
