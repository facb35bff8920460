"""The queue store against a real PostgreSQL (a fresh database per test)."""

from __future__ import annotations

import datetime
import re
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import psycopg
import pytest
import trio
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from trio_broker_daemons.fylr.pgcluster import PgCluster

from trio_broker.trio.dispatcher import Action, Dispatcher, DispatcherConfig
from trio_broker.trio.schema import Migration, apply_migrations, load_migrations
from trio_broker.trio.store import (
    ClaimRequest,
    FailedItem,
    NewItem,
    Outcome,
    QueueItem,
    Store,
    StoreUnavailable,
    delete_unclaimed_in,
    enqueue_in,
    failed_in,
    open_store,
    requeue_failed_in,
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


# -- the library's table names ---------------------------------------------------------------


async def test_an_old_schema_keeps_every_row_under_the_new_names(pg_dsn: str) -> None:
    """A database at the old names (file_queue, backends) with an application's own
    migration and new, claimed and failed rows migrates to broker_queue and broker_backends
    keeping every row as it was; ids go on from where they were, and a dispatcher claims the
    rows (the one it held before a restart included) while the failed one stays failed."""
    old = [m for m in load_migrations() if m.version < 3]
    app = Migration(
        scope="app", version=1, name="001_app.sql", sql="CREATE TABLE app_files (id bigint);"
    )
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert apply_migrations(conn, [*old, app]) == [("queue", 1), ("queue", 2), ("app", 1)]
        conn.execute(
            "INSERT INTO file_queue (file_ref, action, priority, payload) VALUES"
            " ('r1', 'work', 0, '{\"k\": 1}'), ('r2', 'work', 3, '{}'), ('r3', 'work', -2, '{}')"
        )
        conn.execute(
            "INSERT INTO file_queue (file_ref, action, status, claimed_by, claimed_at, attempts)"
            " VALUES ('r4', 'work', 'claimed', 'd1', now(), 1)"
        )
        conn.execute(
            "INSERT INTO file_queue (file_ref, action, status, attempts, last_error)"
            " VALUES ('r5', 'work', 'failed', 2, 'ValueError: bad input')"
        )
        conn.execute(
            "INSERT INTO backends (backend_id, name, view, view_at)"
            " VALUES ('old', 'O', '{\"n\": 1}', now())"
        )
        queue_before = conn.execute("SELECT * FROM file_queue ORDER BY id").fetchall()
        backends_before = conn.execute("SELECT * FROM backends").fetchall()

    def read(conn: psycopg.Connection[tuple[Any, ...]]) -> tuple[list[Any], list[Any], list[Any]]:
        queue = conn.execute("SELECT * FROM broker_queue ORDER BY id").fetchall()
        backends = conn.execute("SELECT * FROM broker_backends").fetchall()
        gone = conn.execute("SELECT to_regclass('file_queue'), to_regclass('backends')")
        return queue, backends, gone.fetchall()

    async with open_store(pg_dsn, pool_size=4, migrations=[app]) as store:
        assert await store.migrate([app]) == []  # open_store applied 003 already
        queue_after, backends_after, gone = await store.call(read)
        # 004 added waits_because (null for every row that was there)
        width = len(queue_before[0])
        assert [row[:width] for row in queue_after] == queue_before
        assert {row[width:] for row in queue_after} == {(None,)}
        assert backends_after == backends_before
        assert gone == [(None, None)]
        assert await store.enqueue("r6", "work") > max(row[0] for row in queue_before)
        seen: list[str] = []

        async def handler(item: QueueItem) -> None:
            seen.append(item.file_ref)

        config = DispatcherConfig(backend_id="d1", name="d1", tick_interval=0.2)
        async with trio.open_nursery() as nursery:
            dispatcher = Dispatcher(store, [Action("work", False, handler)], config)
            await nursery.start(dispatcher.serve)
            with trio.fail_after(WAIT):
                await dispatcher.wait_until(lambda s: s.completed == 5)
            nursery.cancel_scope.cancel()
        assert sorted(seen) == ["r1", "r2", "r3", "r4", "r6"]
        assert [(f.file_ref, f.reason) for f in await store.failed()] == [
            ("r5", "ValueError: bad input")
        ]


# -- what an application needs -----------------------------------------------------------------


async def test_enqueue_in_commits_and_rolls_back_with_the_callers_transaction(
    store: Store,
) -> None:
    """Items queued with enqueue_in inside an application's transaction appear with its own
    change when it commits, and vanish with it when it rolls back; a bad priority adds
    nothing."""

    def create(conn: psycopg.Connection[tuple[Any, ...]]) -> None:
        conn.execute("CREATE TABLE app_files (id bigint PRIMARY KEY, state text)")

    await store.call(create)

    def hand_on(conn: psycopg.Connection[tuple[Any, ...]], file_id: int, fail: bool) -> list[int]:
        with conn.transaction():
            conn.execute("INSERT INTO app_files VALUES (%s, 'sync')", (file_id,))
            ids = enqueue_in(
                conn,
                [
                    NewItem(file_ref=str(file_id), action="sync", priority=2),
                    NewItem(file_ref=str(file_id), action="note", payload={"n": 1}),
                ],
            )
            if fail:
                raise RuntimeError("the application changed its mind")
            return ids

    with pytest.raises(RuntimeError, match="changed its mind"):
        await store.call(partial(hand_on, file_id=1, fail=True))
    assert (await store.counts()).total == 0
    sync, note = await store.call(partial(hand_on, file_id=2, fail=False))
    claimed = await store.claim("b1", 5)
    assert [(c.id, c.file_ref, c.action) for c in claimed] == [
        (sync, "2", "sync"),
        (note, "2", "note"),
    ]
    assert claimed[1].payload == {"n": 1}

    def states(conn: psycopg.Connection[tuple[Any, ...]]) -> list[Any]:
        return conn.execute("SELECT id, state FROM app_files").fetchall()

    assert await store.call(states) == [(2, "sync")]
    with pytest.raises(ValueError, match="32-bit"):
        await store.call(
            lambda conn: enqueue_in(
                conn, [NewItem(file_ref="x", action="a", priority=-(2**31) - 1)]
            )
        )
    assert await store.call(lambda conn: enqueue_in(conn, [])) == []
    assert (await store.counts()).total == 2


async def test_positions_count_the_rows_a_claim_takes_first(store: Store) -> None:
    """A row's position is the number of ready rows of the same actions the claim order
    puts before it: claiming exactly that many leaves it, and the next claim takes it;
    rows not ready yet, of other actions, of other files, failed or gone do not count.
    The claimed rows ahead of it (held by dispatchers) and the ready and claimed rows
    in all come with it."""
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)
    ids = await store.enqueue_many(
        [
            NewItem(file_ref="f1", action="exec", priority=0),
            NewItem(file_ref="f2", action="exec", priority=2),
            NewItem(file_ref="f3", action="exec", priority=0),
            NewItem(file_ref="f4", action="exec", priority=3),
            NewItem(file_ref="f5", action="exec", priority=2),
            NewItem(file_ref="f6", action="exec", priority=9, start_after=later),
            NewItem(file_ref="f7", action="local", priority=9),
            NewItem(file_ref="f8", action="exec", priority=-1),
        ]
    )
    refs = [f"f{i}" for i in range(1, 9)]
    positions = await store.positions(refs, actions=["exec"])
    ahead = {p.item.file_ref: p.ahead for p in positions}
    # f4 (3), f2 and f5 (2, by id), f1 and f3 (0, by id), f8 (-1); f6 is not ready yet
    assert ahead == {"f4": 0, "f2": 1, "f5": 2, "f1": 3, "f3": 4, "f8": 5, "f6": 0}
    assert [p.item.id for p in positions] == sorted(p.item.id for p in positions)
    assert all(p.item.status == "new" for p in positions)
    assert {(p.claimed_ahead, p.ready, p.claimed) for p in positions} == {(0, 6, 0)}
    everything = await store.positions(refs)
    assert {p.item.file_ref: p.ahead for p in everything}["f2"] == 2  # f7 counts too
    # the claim order agrees, row by row
    for ref, count in sorted(ahead.items(), key=lambda pair: pair[1]):
        if ref == "f6":
            continue
        (taken,) = await store.claim("b1", 1, actions=["exec"])
        assert taken.file_ref == ref, (ref, count)
        now = {p.item.file_ref: p for p in await store.positions([ref], actions=["exec"])}
        assert now[ref].item.status == "claimed"
        # every row ahead of it was claimed before it; it is claimed itself
        assert (now[ref].ahead, now[ref].claimed_ahead) == (0, count)
        assert (now[ref].ready, now[ref].claimed) == (6 - count - 1, count + 1)
    assert await store.positions(["nothing"]) == []
    await store.fail((await store.claim("b1", 1, actions=["local"]))[0], "boom")
    assert [p.item.file_ref for p in await store.positions(["f7"])] == []
    assert len(ids) == 8


async def test_figures_count_by_state_and_priority(store: Store) -> None:
    """figures() counts every state per priority (highest first) and in all, as counts()
    does, with the age of each priority's oldest ready row and the soonest start of a
    delayed one; an empty queue has no priorities, zero counts and no ages."""
    empty = await store.figures()
    assert (empty.counts, dict(empty.by_priority)) == (await store.counts(), {})
    assert (dict(empty.oldest_ready), empty.oldest_ready_s, empty.next_start_after) == (
        {},
        None,
        None,
    )
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)
    await store.enqueue_many(
        [
            NewItem(file_ref="a", action="x", priority=4),
            NewItem(file_ref="b", action="x", priority=4),
            NewItem(file_ref="c", action="x", priority=0),
            NewItem(file_ref="d", action="x", priority=0, start_after=later),
            NewItem(file_ref="e", action="x", priority=-2),
        ]
    )
    first, second = await store.claim("b1", 2)  # both priority 4
    await store.fail(second, "boom")
    figures = await store.figures()
    assert list(figures.by_priority) == [4, 0, -2]
    as_tuples = {
        p: (c.ready, c.delayed, c.claimed, c.failed) for p, c in figures.by_priority.items()
    }
    assert as_tuples == {4: (0, 0, 1, 1), 0: (1, 1, 0, 0), -2: (1, 0, 0, 0)}
    assert figures.counts == await store.counts()
    assert figures.counts.total == 5
    assert first.priority == 4
    assert figures.next_start_after == later
    assert set(figures.oldest_ready) == {0, -2}  # priority 4 has no ready row
    await store.call(
        lambda conn: conn.execute(
            "UPDATE broker_queue SET created_at = now() - interval '90 seconds'"
            " WHERE file_ref = 'c'"
        )
    )
    aged = await store.figures()
    assert 90 <= aged.oldest_ready[0] < 150
    assert 0 <= aged.oldest_ready[-2] < 60
    assert aged.oldest_ready_s == aged.oldest_ready[0]


async def test_failed_rows_are_listed_with_reason_attempts_and_time(store: Store) -> None:
    """failed() lists the failed rows oldest first, at most ``limit``, each with its reason,
    attempts and creation time; failed_in reads the same on the caller's connection."""
    before = datetime.datetime.now(datetime.UTC)
    await store.enqueue_many(items(4))
    a, b, c, d = await store.claim("b1", 4)
    await store.fail(c, "KeyError: gone")
    await store.fail(a, "ValueError: bad")
    await store.requeue(b, 0, "NoSlot")
    (b_again,) = await store.claim("b1", 1)
    await store.fail(b_again, "RuntimeError: twice")
    listed = await store.failed()
    assert [(f.id, f.file_ref, f.reason, f.attempts) for f in listed] == [
        (a.id, "f0", "ValueError: bad", 1),
        (b.id, "f1", "RuntimeError: twice", 2),
        (c.id, "f2", "KeyError: gone", 1),
    ]
    assert all(f.created_at >= before - datetime.timedelta(seconds=5) for f in listed)
    assert listed[0].payload == {"i": 0}
    assert [f.id for f in await store.failed(limit=2)] == [a.id, b.id]
    assert await store.call(lambda conn: failed_in(conn, limit=100)) == listed
    assert d.status == "claimed"


async def test_requeue_failed_in_the_callers_transaction(store: Store) -> None:
    """requeue_failed_in puts failed rows (all, or some ids) back to new inside the caller's
    transaction: a rollback leaves them failed; a commit makes them claimable, with what had
    failed noted; rows that are not failed are left alone."""
    await store.enqueue_many(items(4))
    a, b, c, d = await store.claim("b1", 4)
    for item in (a, b, c):
        await store.fail(item, f"E{item.file_ref}")

    def retry(
        conn: psycopg.Connection[tuple[Any, ...]], ids: list[int] | None, fail: bool
    ) -> list[FailedItem]:
        with conn.transaction():
            put_back = requeue_failed_in(conn, ids=ids)
            if fail:
                raise RuntimeError("the application could not reset its state")
            return put_back

    with pytest.raises(RuntimeError, match="could not reset"):
        await store.call(partial(retry, ids=None, fail=True))
    assert [f.id for f in await store.failed()] == [a.id, b.id, c.id]
    put_back = await store.call(partial(retry, ids=[c.id, a.id, d.id, 10**9], fail=False))
    assert [(f.id, f.reason, f.attempts) for f in put_back] == [(a.id, "Ef0", 1), (c.id, "Ef2", 1)]
    again = await store.item(a.id)
    assert again is not None
    assert (again.status, again.last_error) == (
        "new",
        "requeued by an operator; it had failed: Ef0",
    )
    assert (await store.item(d.id)) == d  # claimed: untouched
    assert [f.id for f in await store.failed()] == [b.id]
    assert [i.id for i in await store.claim("b2", 5)] == [a.id, c.id]
    # the store's own form: every failed row, with a note of the caller's
    (rest,) = await store.requeue_failed(note="retried by the nightly job")
    assert rest.id == b.id
    b_now = await store.item(b.id)
    assert b_now is not None
    assert b_now.last_error == "retried by the nightly job; it had failed: Ef1"
    assert await store.requeue_failed() == []


async def test_delete_unclaimed_leaves_claimed_rows_and_other_actions(store: Store) -> None:
    """delete_unclaimed removes the new and failed rows of one action for some files, in the
    caller's transaction or on its own; a claimed row, other actions and other files stay."""
    ids = await store.enqueue_many(
        [
            NewItem(file_ref="1", action="produce"),
            NewItem(file_ref="2", action="produce"),
            NewItem(file_ref="3", action="produce"),
            NewItem(file_ref="1", action="sync"),
            NewItem(file_ref="4", action="produce"),
        ]
    )
    (claimed,) = await store.claim("b1", 1)  # file 1's produce (the lowest id)
    (failed,) = await store.claim("b1", 1)
    await store.fail(failed, "boom")  # file 2's produce

    def remove(conn: psycopg.Connection[tuple[Any, ...]]) -> int:
        with conn.transaction():
            return delete_unclaimed_in(conn, "produce", ["1", "2", "3"])

    assert await store.call(remove) == 2
    left = [await store.item(i) for i in ids]
    assert [i.id for i in left if i is not None] == [claimed.id, ids[3], ids[4]]
    assert await store.delete_unclaimed("produce", ["4"]) == 1
    assert await store.delete_unclaimed("produce", []) == 0
    assert (await store.counts()).total == 2


async def test_live_backends_are_those_with_a_recent_heartbeat(store: Store) -> None:
    """live_backends names, by id, the backends whose heartbeat is younger than the
    threshold (on the database's clock); an unregistered one is not alive."""
    assert await store.live_backends(60) == []
    for backend in ("b2", "b1", "old"):
        await store.register_backend(backend, backend.upper())

    def age(conn: psycopg.Connection[tuple[Any, ...]]) -> None:
        conn.execute(
            "UPDATE broker_backends SET heartbeat = now() - interval '2 minutes'"
            " WHERE backend_id = 'old'"
        )

    await store.call(age)
    assert await store.live_backends(60) == ["b1", "b2"]
    assert await store.live_backends(3600) == ["b1", "b2", "old"]
    await store.unregister_backend("b1")
    assert await store.live_backends(60) == ["b2"]


# -- fail-over ---------------------------------------------------------------------------------


def _database_setting(dsn: str, value: str) -> None:
    """Make the test's database read-only for new sessions (``on``) or writable again, and
    end its current sessions (as a fail-over does)."""
    name = conninfo_to_dict(dsn)["dbname"]
    admin = make_conninfo(dsn, dbname="postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(
            sql.SQL("ALTER DATABASE {} SET default_transaction_read_only = {}").format(
                sql.Identifier(str(name)), sql.SQL(value)
            )
        )
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = %s AND pid <> pg_backend_pid()",
            (name,),
        )


async def test_a_read_only_server_is_unavailable_and_its_connections_are_replaced(
    pg_dsn: str,
) -> None:
    """A server that became read-only (a standby after a fail-over) is StoreUnavailable, not
    an internal error; once a writable server is back, the next calls succeed: the
    connections that met the read-only one were closed, not kept in the pool."""
    async with open_store(pg_dsn, pool_size=2) as store:
        await store.enqueue_many(items(1))
        await trio.to_thread.run_sync(_database_setting, pg_dsn, "on")
        read_only = 0
        with trio.fail_after(WAIT):
            while read_only < 3:  # the broken connections first, then read-only ones
                with pytest.raises(StoreUnavailable) as caught:
                    await store.enqueue_many(items(1, prefix="g"))
                if "read-only" in str(caught.value):
                    read_only += 1
        await trio.to_thread.run_sync(_database_setting, pg_dsn, "off")
        with trio.fail_after(WAIT):
            while True:
                try:
                    await store.enqueue_many(items(1, prefix="h"))
                    break
                except StoreUnavailable:
                    await trio.lowlevel.checkpoint()  # the terminated sessions, once each
        assert (await store.counts()).ready == 2


async def test_a_multi_host_dsn_finds_the_writable_server(pg_dsn: str) -> None:
    """``host=a,b port=p,q target_session_attrs=read-write``: the first host is down, the
    store connects to the second."""
    params = conninfo_to_dict(pg_dsn)
    host = str(params.get("host") or "127.0.0.1")
    port = str(params.get("port") or 5432)
    dsn = make_conninfo(
        pg_dsn,
        host=f"127.0.0.1,{host}",
        port=f"{_closed_port()},{port}",
        target_session_attrs="read-write",
    )
    async with open_store(dsn, pool_size=1) as store:
        await store.enqueue_many(items(2))
        assert (await store.counts()).ready == 2


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"pool_size": 0}, "pool_size must be at least 1, got 0"),
        ({"reconnect_timeout": 0.0}, "reconnect_timeout must be above 0, got 0.0"),
        ({"reconnect_timeout": -1.0}, "reconnect_timeout must be above 0, got -1.0"),
    ],
)
def test_bad_pool_settings_are_refused(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Store("dbname=unused", **arguments)
