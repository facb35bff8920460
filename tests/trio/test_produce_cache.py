"""The produce cache's folder: keys, what a start finds, and the size bound (no daemons;
the cache at work on real daemons is ``tests/daemons/test_produce_cache.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trio_broker.trio.produce_cache import CacheSpec, ProduceCache

SPEC = CacheSpec(key=("size",), max_size=100)


def names(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


def test_a_start_deletes_temporary_files_and_keeps_entries_by_age(tmp_path: Path) -> None:
    """A killed producer's temporary file is deleted at start; entries are indexed, the
    oldest first (the first to go)."""
    (tmp_path / ".abc.1234.tmp").write_bytes(b"partial")
    (tmp_path / "old").write_bytes(b"x" * 10)
    (tmp_path / "new").write_bytes(b"y" * 20)
    (tmp_path / "new.lock").write_bytes(b"")
    os.utime(tmp_path / "old", (1000, 1000))
    cache = ProduceCache(tmp_path, SPEC)
    assert not (tmp_path / ".abc.1234.tmp").exists()
    assert cache.figures() == {"entries": 2, "bytes": 30, "max_size": 100, "hits": 0, "misses": 0}
    assert list(cache._entries) == ["old", "new"]


def test_keys() -> None:
    """The key covers the service, the named params and the input hash, nothing else;
    a job without an input hash or a key param is not cached."""
    cache = ProduceCache.__new__(ProduceCache)
    cache.spec = SPEC
    one = cache.key_of("s", {"params": {"size": 1, "out": "a"}, "input_hash": "h"})
    assert one == cache.key_of("s", {"params": {"size": 1, "out": "b"}, "input_hash": "h"})
    assert one != cache.key_of("t", {"params": {"size": 1}, "input_hash": "h"})
    assert one != cache.key_of("s", {"params": {"size": 2}, "input_hash": "h"})
    assert one != cache.key_of("s", {"params": {"size": 1}, "input_hash": "g"})
    assert cache.key_of("s", {"params": {"size": 1}}) is None
    assert cache.key_of("s", {"params": {}, "input_hash": "h"}) is None


@pytest.mark.parametrize("ended", [True, False])
async def test_a_copy_is_kept_only_whole_and_ok(tmp_path: Path, ended: bool) -> None:
    """A copy becomes an entry only after an ok end with stdout at its end; else nothing
    is left, not even the temporary file."""
    cache = ProduceCache(tmp_path, SPEC)
    for ok in (False, True):
        copy = cache.copy("k")
        await copy.write(b"abc")
        if ended:
            await copy.write(b"")
        await cache.keep("k", copy, ok)
        assert names(tmp_path) == (["k"] if ok and ended else [])
    assert cache.lookup("k") == (tmp_path / "k" if ended else None)


async def test_the_least_recently_used_go_first(tmp_path: Path) -> None:
    """Over max_size, the least recently used entries go; a hit makes one the most recent;
    an output larger than the cache is not kept."""
    cache = ProduceCache(tmp_path, SPEC)

    async def put(key: str, size: int) -> None:
        copy = cache.copy(key)
        await copy.write(b"x" * size)
        await copy.write(b"")
        await cache.keep(key, copy, True)

    await put("a", 40)
    await put("b", 40)
    assert cache.lookup("a") is not None  # a is now the most recent
    await put("c", 40)
    assert names(tmp_path) == ["a", "c"]
    await put("big", 101)
    assert names(tmp_path) == ["a", "c"]
