"""The storage sweep against a real PostgreSQL: only dead writers' old, unreferenced files go.

And the failed queue rows: listed with their reasons, retried by id or all.

Each test plays several fylrs on one folder and one database: storages with
distinct backend ids, registered (alive) or not (dead) in ``broker_backends``. File
ages are set with ``os.utime`` rather than waited for.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
import trio
from trio_broker_daemons.commands.requeue import requeue_main
from trio_broker_daemons.fylr.failed import failed_items, retry_failed
from trio_broker_daemons.fylr.files import fylr_migrations
from trio_broker_daemons.fylr.storage import Storage, StoredFile
from trio_broker_daemons.fylr.sweep import GRACE_STALE, StorageSweeper

from trio_broker.trio.schema import apply_migrations, load_migrations
from trio_broker.trio.store import Store, open_store

STALE_AFTER = 30.0
OLD = GRACE_STALE * STALE_AFTER + 60  # seconds: past the grace
TIMEOUT = 30


@asynccontextmanager
async def fylr_store(dsn: str) -> AsyncIterator[Store]:
    async with open_store(dsn, pool_size=2, migrations=fylr_migrations()) as store:
        yield store


async def chunks(data: bytes) -> AsyncIterator[bytes]:
    yield data


def age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def record(dsn: str, stored: StoredFile) -> None:
    """A row that references the stored file, as an upload writes it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO files (kind, filename, storage_key, size, sha256)"
            " VALUES ('original', 'a.txt', %s, %s, %s)",
            (stored.key, stored.size, stored.sha256),
        )


def temporary(storage: Storage, folder: str = "originals/00") -> Path:
    """A temporary file as the writer of ``storage`` leaves it when killed in mid-write."""
    path = storage.root / folder / f".tmp-{storage.tag}-{os.urandom(8).hex()}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"half a file")
    return path


async def test_only_dead_writers_old_leftovers_are_removed(pg_dsn: str, tmp_path: Path) -> None:
    """Temporary files and unreferenced stored files go only when their writer is dead and
    they are old; a live writer's, a recent one, and a referenced one stay."""
    root = tmp_path / "files"
    live, dead = Storage(root, writer="fylr-live"), Storage(root, writer="fylr-dead")
    sweeping = Storage(root, writer="fylr-sweeping")
    with trio.fail_after(TIMEOUT):
        async with fylr_store(pg_dsn) as store:
            await store.register_backend("fylr-live", "live")
            await store.register_backend("fylr-sweeping", "sweeping")
            live_orphan = await live.write_stream("version", chunks(b"live, not yet recorded"))
            dead_orphan = await dead.write_stream("version", chunks(b"dead, never recorded"))
            dead_recent = await dead.write_stream("version", chunks(b"dead, just written"))
            dead_kept = await dead.write_stream("original", chunks(b"dead, recorded"))
            record(pg_dsn, dead_kept)
            live_temp, dead_temp, dead_recent_temp = (
                temporary(live),
                temporary(dead),
                temporary(dead, "versions/ab"),
            )
            for path in (live_temp, dead_temp):
                age(path, OLD)
            for stored in (live_orphan, dead_orphan, dead_kept):
                age(root / stored.key, OLD)
            sweeper = StorageSweeper(sweeping, store, stale_after=STALE_AFTER)
            result = await sweeper.sweep()
            assert (result.temporary, result.orphans) == (1, 1)
            assert not dead_temp.exists()
            assert not (root / dead_orphan.key).exists()
            for path in (live_temp, dead_recent_temp):
                assert path.exists()
            for stored in (live_orphan, dead_recent, dead_kept):
                assert (root / stored.key).exists()
            # the live writer's heartbeat goes stale: now its old leftovers go too
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute(
                    "UPDATE broker_backends SET heartbeat = now() - interval '1 hour'"
                    " WHERE backend_id = 'fylr-live'"
                )
            result = await sweeper.sweep()
            assert (result.temporary, result.orphans) == (1, 1)
            assert not live_temp.exists()
            assert not (root / live_orphan.key).exists()
            assert (root / dead_kept.key).exists()
            assert sweeper.document()["temporary_removed"] == 2
            assert sweeper.document()["orphans_removed"] == 2


async def test_a_restart_with_the_same_backend_id_sweeps_its_own_leftovers(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A fixed backend id restarted: at start-up the earlier run's leftovers count as dead,
    in a later sweep (this run may be writing) they do not."""
    root = tmp_path / "files"
    storage = Storage(root, writer="fylr-fixed")
    with trio.fail_after(TIMEOUT):
        async with fylr_store(pg_dsn) as store:
            await store.register_backend("fylr-fixed", "fixed")
            temp = temporary(storage)
            orphan = await storage.write_stream("version", chunks(b"never recorded"))
            age(temp, OLD)
            age(root / orphan.key, OLD)
            sweeper = StorageSweeper(storage, store, stale_after=STALE_AFTER)
            assert (await sweeper.sweep()).temporary == 0
            assert temp.exists()
            result = await sweeper.sweep(startup=True)
            assert (result.temporary, result.orphans) == (1, 1)
            assert not temp.exists()
            assert not (root / orphan.key).exists()


async def test_a_live_fylr_removes_what_it_stored_and_could_not_record(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Its own stored file is spared while its row is being recorded; once settled and old,
    unreferenced, it goes (the database failed at the moment of recording); a temporary file
    of its own (a write in progress) always stays."""
    root = tmp_path / "files"
    storage = Storage(root, writer="fylr-self")
    with trio.fail_after(TIMEOUT):
        async with fylr_store(pg_dsn) as store:
            await store.register_backend("fylr-self", "self")
            unrecorded = await storage.write_stream("version", chunks(b"row never written"))
            recorded = await storage.write_stream("version", chunks(b"row written"))
            record(pg_dsn, recorded)
            assert storage.recording == {unrecorded.key, recorded.key}
            temp = temporary(storage)
            for path in (root / unrecorded.key, root / recorded.key, temp):
                age(path, OLD)
            sweeper = StorageSweeper(storage, store, stale_after=STALE_AFTER)
            assert (await sweeper.sweep()).orphans == 0  # both are still being recorded
            storage.settled(unrecorded.key)
            storage.settled(recorded.key)
            result = await sweeper.sweep()
            assert (result.temporary, result.orphans) == (0, 1)
            assert not (root / unrecorded.key).exists()
            assert (root / recorded.key).exists()
            assert temp.exists()


async def test_failed_rows_of_any_file_ref_are_listed_and_retried(pg_dsn: str) -> None:
    """Failed rows are listed oldest first with their reason, also one whose file_ref names
    no file; a retry puts back only the rows asked for."""
    with trio.fail_after(TIMEOUT):
        async with fylr_store(pg_dsn) as store:
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute(
                    "INSERT INTO broker_queue (file_ref, action, status, last_error) VALUES"
                    " ('not-a-number', 'other', 'failed', 'ValueError: bad'),"
                    " ('12345', 'produce', 'failed', 'KeyError: gone'),"
                    " ('7', 'sync', 'new', NULL)"
                )
            listed = await failed_items(store)
            assert [(i["file_ref"], i["reason"], i["file"]) for i in listed] == [
                ("not-a-number", "ValueError: bad", None),
                ("12345", "KeyError: gone", None),
            ]
            retried = await retry_failed(store, ids=[listed[1]["id"]])
            assert [(r.file_ref, r.error) for r in retried] == [("12345", "KeyError: gone")]
            assert [i["file_ref"] for i in await failed_items(store)] == ["not-a-number"]
            with psycopg.connect(pg_dsn) as conn:
                row = conn.execute(
                    "SELECT status, last_error FROM broker_queue WHERE file_ref = '12345'"
                ).fetchone()
            assert row == ("new", "requeued by an operator; it had failed: KeyError: gone")
            assert len(await retry_failed(store)) == 1
            assert await failed_items(store) == []


def new_id(conn: psycopg.Connection[Any], query: str, params: tuple[Any, ...]) -> int:
    row = conn.execute(query.encode(), params).fetchone()
    assert row is not None
    return int(row[0])


async def test_retrying_a_failed_produce_resets_the_version_its_chain_and_the_original(
    pg_dsn: str,
) -> None:
    """A failed produce row put back: its version and the versions that failed only because
    of it go back to new, the done original back to produce; other versions are untouched."""
    with trio.fail_after(TIMEOUT):
        async with fylr_store(pg_dsn) as store:
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                original = new_id(
                    conn,
                    "INSERT INTO files (kind, filename, status, storage_key)"
                    " VALUES ('original', 'a.txt', 'done', 'originals/00/00') RETURNING id",
                    (),
                )
                ids = {}
                for name, source, status, error in (
                    ("a", None, "error", "KeyError: 'x'"),
                    ("b", "a", "error", "source version 'a' failed"),
                    ("c", "b", "error", "source version 'b' failed"),
                    ("d", None, "error", "its own converter failed"),
                    ("e", None, "done", None),
                ):
                    ids[name] = new_id(
                        conn,
                        "INSERT INTO files (kind, parent_id, version, source, filename,"
                        " status, produce_hash, error)"
                        " VALUES ('version', %s, %s, %s, 'a.txt', %s, 'h', %s) RETURNING id",
                        (original, name, source, status, error),
                    )
                conn.execute(
                    "INSERT INTO broker_queue (file_ref, action, status, last_error)"
                    " VALUES (%s, 'produce', 'failed', 'KeyError: x')",
                    (str(ids["a"]),),
                )
            (retried,) = await retry_failed(store)
            assert retried.file_ref == str(ids["a"])
            with psycopg.connect(pg_dsn) as conn:
                states: dict[str, str] = dict(
                    conn.execute(
                        "SELECT coalesce(version, 'original'), status || ':' || coalesce(error, '')"
                        " FROM files"
                    ).fetchall()
                )
                queued = conn.execute("SELECT status FROM broker_queue").fetchall()
    assert states == {
        "original": "produce:",
        "a": "new:",
        "b": "new:",
        "c": "new:",
        "d": "error:its own converter failed",
        "e": "done:",
    }
    assert queued == [("new",)]


def test_requeue_on_a_database_not_yet_migrated_says_so_and_changes_nothing(
    pg_dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``fylr requeue --failed`` on a database still at the old queue names (no fylr of this
    version started on it) is one line saying so, exit 1, the failed row untouched; once a
    start has migrated it, the same command puts the row back."""
    old = [m for m in load_migrations() if m.version < 3]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        apply_migrations(conn, [*old, *fylr_migrations()])
        conn.execute(
            "INSERT INTO file_queue (file_ref, action, status, last_error)"
            " VALUES ('x', 'other', 'failed', 'ValueError: bad')"
        )
    config = tmp_path / "fylr.yml"
    config.write_text(
        f"database: {json.dumps(pg_dsn)}\nstate_dir: {json.dumps(str(tmp_path / 'state'))}\n"
        'execservers: ["127.0.0.1:7000"]\n'
    )
    assert requeue_main(str(config), environ={}) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert "no queue of this version" in line
    assert "broker_queue" in line
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT status FROM file_queue").fetchall() == [("failed",)]

    async def start() -> None:
        async with fylr_store(pg_dsn):
            pass

    trio.run(start)
    assert requeue_main(str(config), environ={}) == 0
    out = capsys.readouterr().out
    assert "it had failed: ValueError: bad" in out
    assert "1 failed item(s) requeued" in out
