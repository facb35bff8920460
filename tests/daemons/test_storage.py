"""Local file storage: streamed writes with hashes, all-or-nothing, reads, deletes and keys."""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import pytest
import trio
from trio_broker_daemons.fylr.storage import (
    WRITE_BATCH,
    FileTooLarge,
    Leftover,
    Storage,
    StoredFile,
    abandoned,
    writer_tag,
)

TIMEOUT = 30


def files_under(root: Path) -> list[Path]:
    """Every regular file below ``root`` (temporary ones included)."""
    return sorted(path for path in root.rglob("*") if path.is_file())


class Chunks:
    """An async iterator over given chunks that can fail or hang after them (no generator)."""

    def __init__(self, chunks: Iterable[bytes | bytearray | memoryview], *, then: str = "end"):
        self._chunks = list(chunks)
        self._then = then
        self.exhausted = trio.Event()

    def __aiter__(self) -> Chunks:
        return self

    async def __anext__(self) -> bytes:
        await trio.lowlevel.checkpoint()
        if self._chunks:
            return bytes(self._chunks.pop(0))
        self.exhausted.set()
        if self._then == "fail":
            raise ConnectionResetError("the client hung up")
        if self._then == "hang":
            await trio.sleep_forever()
        raise StopAsyncIteration


async def read_all(storage: Storage, key: str, chunk_size: int = 65536) -> bytes:
    """The whole content of a stored file, through open_read."""
    reader = await storage.open_read(key, chunk_size=chunk_size)
    parts = [chunk async for chunk in reader]
    assert reader.closed
    return b"".join(parts)


async def test_write_then_read(tmp_path: Path) -> None:
    """A stream of mixed chunks is stored whole, with the size and SHA-256 of its bytes."""
    storage = Storage(tmp_path / "store")
    chunks: list[bytes | bytearray | memoryview] = [b"a" * 10, b"", bytearray(b"b" * 70000)]
    chunks += [memoryview(bytes(range(256)) * 300), b"z"]
    content = b"".join(bytes(chunk) for chunk in chunks)
    with trio.fail_after(TIMEOUT):
        stored = await storage.write_stream("original", Chunks(chunks))
        assert stored == StoredFile(
            key=stored.key, size=len(content), sha256=hashlib.sha256(content).hexdigest()
        )
        assert storage.path(stored.key).read_bytes() == content
        assert await read_all(storage, stored.key) == content
        assert await read_all(storage, stored.key, chunk_size=1000) == content
        reader = await storage.open_read(stored.key)
        assert reader.size == len(content)
        await reader.aclose()


async def test_many_small_chunks_are_batched(tmp_path: Path) -> None:
    """Thousands of tiny chunks arrive whole and in order (gathered before each write)."""
    storage = Storage(tmp_path)
    chunks = [bytes([i % 251]) * (i % 50) for i in range(5000)]
    content = b"".join(chunks)
    assert len(content) > WRITE_BATCH
    with trio.fail_after(TIMEOUT):
        stored = await storage.write_stream("version", Chunks(chunks))
        assert await read_all(storage, stored.key) == content
    assert stored.sha256 == hashlib.sha256(content).hexdigest()


async def test_empty_stream(tmp_path: Path) -> None:
    """An empty upload is a stored file of size 0 with the SHA-256 of nothing."""
    storage = Storage(tmp_path)
    with trio.fail_after(TIMEOUT):
        stored = await storage.write_stream("original", Chunks([]))
        assert await read_all(storage, stored.key) == b""
    assert (stored.size, stored.sha256) == (0, hashlib.sha256(b"").hexdigest())


async def test_originals_and_versions_live_apart(tmp_path: Path) -> None:
    """Originals and versions go to their own folders and every key is fresh and random."""
    storage = Storage(tmp_path)
    with trio.fail_after(TIMEOUT):
        originals = [await storage.write_stream("original", Chunks([b"same"])) for _ in range(3)]
        version = await storage.write_stream("version", Chunks([b"same"]))
    keys = [stored.key for stored in originals]
    assert len(set(keys)) == 3
    for key in keys:
        assert re.fullmatch(r"originals/([0-9a-f]{2})/\1[0-9a-f]{30}", key)
        assert storage.path(key).is_relative_to(tmp_path / "originals")
        assert Storage.kind_of(key) == "original"
    assert re.fullmatch(r"versions/([0-9a-f]{2})/\1[0-9a-f]{30}", version.key)
    assert storage.path(version.key).is_relative_to(tmp_path / "versions")
    assert Storage.kind_of(version.key) == "version"
    assert {stored.sha256 for stored in [*originals, version]} == {
        hashlib.sha256(b"same").hexdigest()
    }


async def test_concurrent_writes(tmp_path: Path) -> None:
    """Writers running at once each get their own complete file."""
    storage = Storage(tmp_path)
    results: dict[int, StoredFile] = {}

    async def write(number: int) -> None:
        chunks = [bytes([number]) * 50000 for _ in range(4)]
        results[number] = await storage.write_stream("original", Chunks(chunks))

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            for number in range(8):
                nursery.start_soon(write, number)
        for number, stored in results.items():
            assert await read_all(storage, stored.key) == bytes([number]) * 200000
    assert len(files_under(tmp_path)) == 8


async def test_a_failing_stream_leaves_nothing(tmp_path: Path) -> None:
    """When the chunk source raises mid-stream, the error propagates and no file is left."""
    storage = Storage(tmp_path)
    source = Chunks([b"x" * 100000, b"y" * 100000], then="fail")
    with trio.fail_after(TIMEOUT), pytest.raises(ConnectionResetError, match="hung up"):
        await storage.write_stream("original", source)
    assert source.exhausted.is_set()
    assert files_under(tmp_path) == []


async def test_a_cancelled_upload_leaves_nothing(tmp_path: Path) -> None:
    """Cancelling a write while it waits for more bytes deletes its temporary file."""
    storage = Storage(tmp_path)
    source = Chunks([b"x" * 200000], then="hang")
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:

            async def upload() -> None:
                await storage.write_stream("original", source)
                raise AssertionError("the upload finished")  # pragma: no cover

            nursery.start_soon(upload)
            await source.exhausted.wait()
            temporaries = files_under(tmp_path)
            assert len(temporaries) == 1
            assert temporaries[0].name.startswith(".tmp-")
            nursery.cancel_scope.cancel()
    assert files_under(tmp_path) == []


async def test_size_limit(tmp_path: Path) -> None:
    """A stream passing max_size is refused and removed; one of exactly max_size is kept."""
    storage = Storage(tmp_path)
    with trio.fail_after(TIMEOUT):
        with pytest.raises(FileTooLarge, match="larger than 100 bytes") as info:
            await storage.write_stream("original", Chunks([b"a" * 60, b"b" * 41]), max_size=100)
        assert info.value.limit == 100
        assert files_under(tmp_path) == []
        stored = await storage.write_stream(
            "original", Chunks([b"a" * 60, b"b" * 40]), max_size=100
        )
    assert stored.size == 100
    assert files_under(tmp_path) == [storage.path(stored.key)]


async def test_delete(tmp_path: Path) -> None:
    """Deleting removes the file once; the key then reads as missing."""
    storage = Storage(tmp_path)
    with trio.fail_after(TIMEOUT):
        stored = await storage.write_stream("version", Chunks([b"gone soon"]))
        assert await storage.exists(stored.key)
        assert await storage.delete(stored.key) is True
        assert await storage.delete(stored.key) is False
        assert not await storage.exists(stored.key)
        with pytest.raises(FileNotFoundError):
            await storage.open_read(stored.key)
    assert files_under(tmp_path) == []


async def test_never_written_key_is_missing(tmp_path: Path) -> None:
    """A well-formed key that was never written fails before any byte is read."""
    storage = Storage(tmp_path)
    with trio.fail_after(TIMEOUT), pytest.raises(FileNotFoundError):
        await storage.open_read(storage.new_key("original"))


async def test_reader_closes_early(tmp_path: Path) -> None:
    """Leaving ``async with`` after one chunk closes the file; iterating on ends at once."""
    storage = Storage(tmp_path)
    with trio.fail_after(TIMEOUT):
        stored = await storage.write_stream("original", Chunks([b"q" * 10000]))
        reader = await storage.open_read(stored.key, chunk_size=100)
        async with reader:
            first = await reader.__anext__()
        assert first == b"q" * 100
        assert reader.closed
        assert [chunk async for chunk in reader] == []
        await reader.aclose()  # again: nothing happens
        with pytest.raises(ValueError, match="chunk_size must be >= 1"):
            await storage.open_read(stored.key, chunk_size=0)


@pytest.mark.parametrize(
    "key",
    [
        "",
        "../etc/passwd",
        "/etc/passwd",
        "originals/ab/../../../etc/passwd",
        "originals/ab/cd00000000000000000000000000000000",
        "originals/ab/ab0000000000000000000000000000000",
        "originals/AB/AB000000000000000000000000000000",
        "others/ab/ab000000000000000000000000000000",
        "originals/ab/ab000000000000000000000000000000/x",
        "photo.jpg",
    ],
)
async def test_malformed_keys_are_refused(tmp_path: Path, key: str) -> None:
    """Anything but a key of the storage's own form is refused, so no path escapes the root."""
    storage = Storage(tmp_path)
    with pytest.raises(ValueError, match="not a storage key"):
        storage.path(key)
    with pytest.raises(ValueError, match="not a storage key"):
        await storage.delete(key)
    with pytest.raises(ValueError, match="not a storage key"):
        await storage.open_read(key)
    with pytest.raises(ValueError, match="not a storage key"):
        Storage.kind_of(key)


def test_unknown_kind_is_refused(tmp_path: Path) -> None:
    """A kind other than original or version is a caller's bug."""
    with pytest.raises(ValueError, match="kind must be 'original' or 'version'"):
        Storage(tmp_path).new_key("thumbnail")  # type: ignore[arg-type]


async def test_files_carry_their_writer_tag(tmp_path: Path) -> None:
    """Keys end in the writer's tag, temporary files are named after it; writers differ."""
    one, other = Storage(tmp_path, writer="fylr-a-1"), Storage(tmp_path, writer="fylr-b-2")
    assert one.tag == writer_tag("fylr-a-1") != other.tag
    assert re.fullmatch(r"[0-9a-f]{16}", one.tag)
    for _ in range(20):
        key = one.new_key("version")
        assert key.endswith(one.tag)
        assert one.path(key) == tmp_path / key  # still a well-formed key
    source = Chunks([b"half"], then="hang")
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one.write_stream, "original", source)
            await source.exhausted.wait()
            (temp,) = files_under(tmp_path)
            assert re.fullmatch(rf"\.tmp-{one.tag}-[0-9a-f]{{16}}", temp.name)
            nursery.cancel_scope.cancel()
    assert files_under(tmp_path) == []


async def test_scan_lists_leftovers_with_writer_and_age(tmp_path: Path) -> None:
    """scan finds temporary and stored files with their writer and age, and nothing foreign."""
    storage = Storage(tmp_path, writer="w")
    with trio.fail_after(TIMEOUT):
        stored = await storage.write_stream("original", Chunks([b"kept"]))
    folder = storage.path(stored.key).parent
    temp = folder / f".tmp-{storage.tag}-0123456789abcdef"
    old_temp = tmp_path / "versions" / "ff" / ".tmp-0123"  # an older release's name
    foreign = folder / "notes.txt"
    for path in (temp, old_temp, foreign):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"half an upload")
    now = time.time()
    os.utime(temp, (now - 100, now - 100))
    found = {f.path: f for f in await storage.scan(now)}
    assert set(found) == {storage.path(stored.key), temp, old_temp}
    assert found[temp].kind == "temporary"
    assert found[temp].writer == storage.tag
    assert 99 <= found[temp].age <= 101
    assert found[old_temp].writer is None
    assert found[storage.path(stored.key)].key == stored.key
    assert found[storage.path(stored.key)].writer == storage.tag
    assert await storage.remove([found[temp], found[old_temp], found[temp]]) == 2
    assert files_under(tmp_path) == sorted([storage.path(stored.key), foreign])
    assert await Storage(tmp_path / "missing").scan(now) == []


def test_abandoned_needs_a_dead_writer_and_age() -> None:
    """A leftover is abandoned only when its writer is not live and it is older than the grace."""

    def leftover(writer: str | None, age: float) -> Leftover:
        return Leftover(path=Path("x"), kind="temporary", key=None, writer=writer, age=age)

    live = {"a" * 16}
    assert not abandoned(leftover("a" * 16, 1e9), live=live, grace=10)  # a live writer: never
    assert not abandoned(leftover("b" * 16, 9.9), live=live, grace=10)  # too recent
    assert abandoned(leftover("b" * 16, 10), live=live, grace=10)
    assert abandoned(leftover(None, 10), live=live, grace=10)  # no writer known
    assert not abandoned(leftover(None, 1), live=live, grace=10)


async def test_a_stream_of_an_async_generator(tmp_path: Path) -> None:
    """An async generator that runs to its end is a fine chunk source."""

    async def produce() -> AsyncIterator[bytes]:
        for index in range(3):
            await trio.lowlevel.checkpoint()
            yield str(index).encode() * 10

    storage = Storage(tmp_path)
    with trio.fail_after(TIMEOUT):
        stored = await storage.write_stream("version", produce())
        assert await read_all(storage, stored.key) == b"0" * 10 + b"1" * 10 + b"2" * 10


# -- storage locations --------------------------------------------------------------------


def two_locations(tmp_path: Path, current: str | None = None) -> Storage:
    return Storage(
        tmp_path / "files",
        writer="w",
        locations={"archive": tmp_path / "archive"},
        current=current,
    )


async def test_new_files_go_to_the_current_location_and_keys_name_it(tmp_path: Path) -> None:
    """A key outside ``default`` starts with its location; its path is in that folder."""
    storage = two_locations(tmp_path, current="archive")
    with trio.fail_after(TIMEOUT):
        stored = await storage.write_stream("original", Chunks([b"archived"]))
    assert re.fullmatch(r"archive:originals/([0-9a-f]{2})/\1[0-9a-f]{30}", stored.key)
    assert storage.path(stored.key) == tmp_path / "archive" / stored.key.split(":", 1)[1]
    assert storage.location_of(stored.key) == "archive"
    assert Storage.kind_of(stored.key) == "original"
    assert await read_all(storage, stored.key) == b"archived"
    plain = storage.relocated(stored.key, "default")
    assert storage.location_of(plain) == "default"
    assert storage.relocated(plain, "archive") == stored.key
    assert files_under(tmp_path / "files") == []


@pytest.mark.parametrize(
    "key",
    [
        "attic:originals/ab/ab0123456789abcdef0123456789abcd",  # not configured
        "default:originals/ab/ab0123456789abcdef0123456789abcd",  # default has no prefix
        "Archive:originals/ab/ab0123456789abcdef0123456789abcd",
        ":originals/ab/ab0123456789abcdef0123456789abcd",
    ],
)
def test_keys_of_unknown_locations_are_refused(tmp_path: Path, key: str) -> None:
    """A prefix names a configured location, spelled as configured; nothing else is a key."""
    with pytest.raises(ValueError, match="not a storage key"):
        two_locations(tmp_path).path(key)


def test_an_unknown_current_location_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="current: no location named 'attic'"):
        Storage(tmp_path, current="attic")
    with pytest.raises(ValueError, match="no storage location named 'attic'"):
        two_locations(tmp_path).relocated("originals/ab/ab0123456789abcdef0123456789abcd", "attic")


async def test_copy_to_makes_a_durable_copy_under_the_same_name(tmp_path: Path) -> None:
    """copy_to writes the same bytes under the same name elsewhere, hashed; the source stays;
    a copy left by an interrupted move is replaced, not kept beside."""
    storage = two_locations(tmp_path)
    content = os.urandom(3 * WRITE_BATCH + 5)
    with trio.fail_after(TIMEOUT):
        stored = await storage.write_stream("version", Chunks([content]))
        target = storage.path(storage.relocated(stored.key, "archive"))
        target.parent.mkdir(parents=True)
        target.write_bytes(b"a half copy of an interrupted move")
        copied = await storage.copy_to(stored.key, "archive")
    assert copied == StoredFile(
        key=f"archive:{stored.key}", size=len(content), sha256=hashlib.sha256(content).hexdigest()
    )
    assert copied.key in storage.recording
    assert storage.path(copied.key).read_bytes() == content
    assert storage.path(stored.key).read_bytes() == content
    assert [p.name for p in files_under(tmp_path / "archive")] == [target.name]
    with pytest.raises(ValueError, match="already in location 'archive'"):
        await storage.copy_to(copied.key, "archive")


async def test_a_reader_with_the_old_key_finds_a_moved_file(tmp_path: Path) -> None:
    """Once the old copy is gone, open_read, exists and digest of the old key find the new one;
    remove_copies deletes every copy but the key's own."""
    storage = two_locations(tmp_path)
    with trio.fail_after(TIMEOUT):
        stored = await storage.write_stream("original", Chunks([b"moving"]))
        copied = await storage.copy_to(stored.key, "archive")
        assert await storage.remove_copies(copied.key) == 1
        assert not storage.path(stored.key).exists()
        assert await read_all(storage, stored.key) == b"moving"
        assert await storage.exists(stored.key)
        assert await storage.find(stored.key) == storage.path(copied.key)
        assert await storage.digest(stored.key) == (6, hashlib.sha256(b"moving").hexdigest())
        assert await storage.remove_copies(copied.key) == 0
        await storage.delete(copied.key)
        assert not await storage.exists(stored.key)
        with pytest.raises(FileNotFoundError):
            await storage.open_read(stored.key)
        with pytest.raises(FileNotFoundError):
            await storage.digest(copied.key)
        with pytest.raises(FileNotFoundError):
            await storage.copy_to(stored.key, "archive")
    assert files_under(tmp_path) == []


async def test_scan_covers_every_location_with_prefixed_keys(tmp_path: Path) -> None:
    """A sweep sees the files of every location, each stored one under its full key."""
    storage = two_locations(tmp_path)
    with trio.fail_after(TIMEOUT):
        here = await storage.write_stream("original", Chunks([b"here"]))
        moved = await storage.copy_to(here.key, "archive")
    keys = {leftover.key for leftover in await storage.scan(time.time())}
    assert keys == {here.key, moved.key}
