"""The queue store against a real PostgreSQL (a fresh database per test)."""

from __future__ import annotations

import datetime
from collections.abc import AsyncIterator
from pathlib import Path

import attrs
import psycopg
import pytest
import trio
from trio_broker_daemons.fylr.pgcluster import PgCluster

from trio_broker.trio.schema import Migration, apply_migrations, load_migrations
from trio_broker.trio.store import (
    ClaimRequest,
    NewItem,
    Outcome,
    Store,
    StoreUnavailable,
    open_store,
)

WAIT = 30.0


@pytest.fixture
async def store(pg_dsn: str) -> AsyncIterator[Store]:
    async with open_store(pg_dsn, pool_size=4) as store:
        yield store


def items(n: int, *, action: str = "a", priority: int = 0, prefix: str = "f") -> list[NewItem]:
    return [
        NewItem(file_ref=f"{prefix}{i}", action=action, priority=priority, payload={"i": i})
        for i in range(n)
    ]


async def test_migrations_apply_once(pg_dsn: str) -> None:
    """A fresh database gets every migration once; opening it again applies nothing."""
    versions = [(m.scope, m.version) for m in load_migrations()]
    assert versions[0] == ("queue", 1)
    assert versions == sorted(versions)
    app = Migration(scope="app", version=1, name="001_app.sql", sql="CREATE TABLE app (x int);")
    async with open_store(pg_dsn, pool_size=1, migrate=False) as store:
        assert await store.migrate([app]) == [*versions, ("app", 1)]
        assert await store.migrate([app]) == []

        def recorded(conn: psycopg.Connection[tuple[str, int]]) -> list[tuple[str, int]]:
            query = "SELECT scope, version FROM schema_migrations ORDER BY 2, 1"
            return [(r[0], r[1]) for r in conn.execute(query)]

        assert await store.call(recorded) == [("app", 1), *versions]


async def test_an_unscoped_migrations_table_gets_its_scopes(pg_dsn: str) -> None:
    """A database migrated before scopes existed keeps its history: the queue's rows
    become scope ``queue`` and the fylr's old version 2 becomes ``fylr`` version 1."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE schema_migrations (version integer PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        first, *later = load_migrations()  # releases before scopes had only the first
        conn.execute(first.sql.encode())
        conn.execute(
            "INSERT INTO schema_migrations (version, name) VALUES (%s, %s)",
            (first.version, first.name),
        )
        conn.execute("INSERT INTO schema_migrations (version, name) VALUES (2, '002_files.sql')")
        assert apply_migrations(conn) == [(m.scope, m.version) for m in later]
        rows = conn.execute("SELECT scope, version FROM schema_migrations ORDER BY 1, 2").fetchall()
    assert rows == [("fylr", 1), *((m.scope, m.version) for m in [first, *later])]


def test_migration_files_are_found_by_number(tmp_path: Path) -> None:
    """Numbered .sql files are loaded in version order; other files are ignored; a repeated
    version is refused."""
    (tmp_path / "010_later.sql").write_text("SELECT 10;")
    (tmp_path / "002_files.sql").write_text("SELECT 2;")
    (tmp_path / "notes.txt").write_text("not a migration")
    found = load_migrations(tmp_path)
    assert [(m.version, m.name, m.sql) for m in found] == [
        (2, "002_files.sql", "SELECT 2;"),
        (10, "010_later.sql", "SELECT 10;"),
    ]
    (tmp_path / "2_again.sql").write_text("SELECT 2;")
    with pytest.raises(ValueError, match="share version 2"):
        load_migrations(tmp_path)


async def test_concurrent_migrations_apply_each_once(pg_dsn: str) -> None:
    """Several servers migrating one database at once apply each migration exactly once."""
    extra = Migration(
        scope="queue", version=901, name="901_extra.sql", sql="CREATE TABLE extra (x int);"
    )
    migrations = [*load_migrations(), extra]
    results: list[list[tuple[str, int]]] = []

    def migrate() -> None:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            results.append(apply_migrations(conn, migrations))

    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(trio.to_thread.run_sync, migrate)
    assert sorted(results, key=len) == [[], [], [], [(m.scope, m.version) for m in migrations]]


async def test_enqueue_and_claim_order(store: Store) -> None:
    """Claims take the highest priority first, then the oldest, and skip items not yet due."""
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)
    low = await store.enqueue("low", "a", priority=-2)
    first = await store.enqueue("first", "a", priority=2, payload={"k": [1, 2]})
    second = await store.enqueue("second", "a", priority=2)
    await store.enqueue("future", "a", priority=9, start_after=later)
    top = await store.enqueue("top", "a", priority=5)
    claimed = await store.claim("b1", 3)
    assert [c.id for c in claimed] == [top, first, second]
    assert claimed[1].payload == {"k": [1, 2]}
    assert all(c.status == "claimed" and c.claimed_by == "b1" and c.attempts == 1 for c in claimed)
    assert [c.id for c in await store.claim("b1", 10)] == [low]
    assert await store.claim("b1", 10) == []
    counts = await store.counts()
    assert (counts.ready, counts.delayed, counts.claimed, counts.failed) == (0, 1, 4, 0)
    with pytest.raises(ValueError, match="32-bit"):
        await store.enqueue("x", "a", priority=2**31)


async def test_claim_filters_and_batches(store: Store) -> None:
    """Claims filter by action and odd priority, and a batch never claims one row twice."""
    ids = await store.enqueue_many(
        [
            NewItem(file_ref="e4", action="exec", priority=4),
            NewItem(file_ref="e3", action="exec", priority=3),
            NewItem(file_ref="e1", action="exec", priority=1),
            NewItem(file_ref="e0", action="exec", priority=0),
            NewItem(file_ref="l0", action="local", priority=0),
        ]
    )
    e4, e3, e1, e0, l0 = ids
    batch = await store.claim_batch(
        "b1",
        [
            ClaimRequest(limit=2, actions=("exec",)),
            ClaimRequest(limit=5, actions=("exec",), odd_only=True),
            ClaimRequest(limit=5, actions=("local",)),
            ClaimRequest(limit=0),
        ],
    )
    # general takes e4, e3; the odd request may not take e3 again and finds e1 only
    assert sorted(c.id for c in batch) == sorted([e4, e3, e1, l0])
    assert [c.id for c in await store.claim("b1", 5, actions=["local"])] == []
    assert [c.id for c in await store.claim("b1", 5, odd_only=True)] == []
    assert [c.id for c in await store.claim("b1", 5)] == [e0]
    assert await store.claim_batch("b1", [ClaimRequest(limit=0)]) == []


async def test_concurrent_claimers_never_share_a_row(pg_dsn: str) -> None:
    """Two stores claiming in parallel get disjoint rows that together are all of them."""
    async with open_store(pg_dsn, pool_size=3) as one, open_store(pg_dsn, pool_size=3) as two:
        ids = await one.enqueue_many(items(600))
        got: dict[str, list[int]] = {"one": [], "two": []}

        async def drain(store: Store, name: str) -> None:
            while batch := await store.claim(name, 7):
                got[name].extend(c.id for c in batch)

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(drain, one, "one")
                nursery.start_soon(drain, two, "two")
    assert not set(got["one"]) & set(got["two"])
    assert sorted(got["one"] + got["two"]) == sorted(ids)
    assert got["one"]
    assert got["two"]


async def test_outcomes_and_fencing(store: Store) -> None:
    """Outcomes change a row only while the same claim holds it; the others are ignored."""
    await store.enqueue_many(items(4))
    a, b, c, d = await store.claim("b1", 4)
    assert await store.complete(a)
    assert await store.item(a.id) is None
    assert not await store.complete(a)  # already gone
    assert await store.fail(b, "ValueError: boom")
    failed = await store.item(b.id)
    assert failed is not None
    assert (failed.status, failed.last_error, failed.claimed_by) == (
        "failed",
        "ValueError: boom",
        None,
    )
    assert await store.requeue(c, 0, "NoExecserver")
    # c is claimed again (attempts 2): the late outcome of the first claim changes nothing
    (again,) = await store.claim("b1", 1)
    assert (again.id, again.attempts) == (c.id, 2)
    assert not await store.complete(c)
    assert not await store.complete(attrs.evolve(again, claimed_by="other"))
    assert await store.finish("b1", [Outcome(item_id=again.id, attempts=2, kind="complete")]) == {
        c.id
    }
    assert await store.requeue(d, 3600, "NoSlot")
    counts = await store.counts()
    assert (counts.ready, counts.delayed, counts.claimed, counts.failed) == (0, 1, 0, 1)
    # by id, an operator retries the failed item
    assert await store.requeue(b.id, 0)
    retried = await store.item(b.id)
    assert retried is not None
    assert (retried.status, retried.last_error) == ("new", "ValueError: boom")
    with pytest.raises(ValueError, match="not a claimed item"):
        await store.complete(retried)


async def test_return_claimed_keeps_what_it_is_told(store: Store) -> None:
    """return_claimed requeues a backend's rows except the kept ones, and no one else's."""
    await store.enqueue_many(items(5))
    mine = await store.claim("b1", 3)
    theirs = await store.claim("b2", 2)
    assert await store.return_claimed("b1", keep=[mine[0].id]) == 2
    assert [c.id for c in await store.claimed_by("b1")] == [mine[0].id]
    assert [c.id for c in await store.claimed_by("b2")] == [t.id for t in theirs]
    assert (await store.counts()).ready == 2


async def test_stale_backends_are_swept_once(store: Store, pg_dsn: str) -> None:
    """Rows of a backend whose heartbeat is stale (or that never registered) are requeued once."""
    await store.enqueue_many(items(6))
    await store.register_backend("alive", "A")
    await store.register_backend("dead", "D")
    await store.claim("alive", 2)
    dead_rows = await store.claim("dead", 3)
    await store.claim("ghost", 1)  # never registered
    assert await store.requeue_stale(3600) == 1  # only the ghost's row

    def age(conn: psycopg.Connection[tuple[object, ...]]) -> None:
        conn.execute(
            "UPDATE broker_backends SET heartbeat = now() - interval '2 hours'"
            " WHERE backend_id = 'dead'"
        )

    await store.call(age)
    results: list[int] = []

    async def sweep() -> None:
        results.append(await store.requeue_stale(3600))

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(sweep)
    assert sorted(results) == [0, 0, len(dead_rows)]
    assert await store.claimed_by("dead") == []
    assert len(await store.claimed_by("alive")) == 2
    assert await store.heartbeat("alive", "A") is True
    # the swept backend finds out at its next heartbeat (and is registered again)
    assert await store.heartbeat("dead", "D") is False
    assert await store.heartbeat("dead", "D") is True
    await store.unregister_backend("dead")
    assert await store.heartbeat("dead", "D") is False


async def test_unreachable_database_is_a_clear_error(pg_cluster: PgCluster) -> None:
    """Opening a store on a server that is not there fails with StoreUnavailable naming it."""
    dsn = f"host=127.0.0.1 port={_closed_port()} user=nobody password=secret dbname=x"
    with pytest.raises(StoreUnavailable, match="port=") as caught:
        async with open_store(dsn, connect_timeout=1.0, wait=1.0):
            pass  # pragma: no cover
    assert "secret" not in str(caught.value)


def _closed_port() -> int:
    from trio_broker_daemons.fylr.pgcluster import free_port

    return free_port()


async def test_store_survives_a_database_restart(pg_cluster: PgCluster, pg_dsn: str) -> None:
    """After a restart a call fails with StoreUnavailable, and retries succeed on new ones."""
    async with open_store(pg_dsn, pool_size=2) as store:
        await store.enqueue_many(items(3))
        await trio.to_thread.run_sync(pg_cluster.restart)
        errors = 0
        with trio.fail_after(WAIT):
            while True:
                try:
                    counts = await store.counts()
                    break
                except StoreUnavailable:
                    errors += 1
                    # The server is back when restart() returns: retry at once.
                    await trio.lowlevel.checkpoint()
        assert errors >= 1  # the pooled connections broke with the restart
        assert counts.ready == 3
        assert store.statistics().unavailable == errors
