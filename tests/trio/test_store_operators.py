"""The queue's operator side on a real PostgreSQL: each claim's end kept as an attempt,
why a waiting row waits, pages of rows with filters, cancelling and deleting rows."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from trio_broker.trio.store import (
    NewItem,
    Outcome,
    Store,
    cancel_in,
    delete_items_in,
    failed_ids_in,
    open_store,
)


@pytest.fixture
async def store(pg_dsn: str) -> AsyncIterator[Store]:
    async with open_store(pg_dsn, pool_size=4) as store:
        yield store


async def test_each_claims_end_is_an_attempt_and_a_requeue_says_why_until_claimed(
    store: Store,
) -> None:
    """A requeue and a failure each leave an attempt (backend, instance, outcome, reason,
    decisive line, its claim's start); the requeued row waits because of its reason until
    it is claimed again; a fenced (late) outcome leaves none; completing the row deletes its
    attempts."""
    first = await store.enqueue("f1", "a")
    second = await store.enqueue("f2", "a")
    a, b = await store.claim("b1", 2)
    requeue = Outcome(item_id=a.id, attempts=1, kind="requeue", delay=3600, error="NoSlot: busy",
                      outcome="no_slot")  # fmt: skip
    fail = Outcome(item_id=b.id, attempts=1, kind="fail", error="JobFailed: failed: bad",
                   outcome="failed", instance_id="exec-1", line="bad")  # fmt: skip
    assert await store.finish("b1", [requeue, fail]) == {first, second}
    waiting = await store.item(first)
    assert waiting is not None
    assert (waiting.status, waiting.waits_because) == ("new", "NoSlot: busy")
    failed = await store.item(second)
    assert failed is not None
    assert failed.waits_because is None
    [attempt] = await store.attempts(first)
    assert (attempt.item_id, attempt.attempt, attempt.backend_id, attempt.instance_id) == (
        first, 1, "b1", None
    )  # fmt: skip
    assert (attempt.outcome, attempt.reason, attempt.decisive_line) == (
        "no_slot", "NoSlot: busy", None
    )  # fmt: skip
    assert attempt.started_at == a.claimed_at
    assert attempt.duration_s >= 0
    [attempt] = await store.attempts(second)
    assert (attempt.outcome, attempt.instance_id, attempt.decisive_line) == (
        "failed",
        "exec-1",
        "bad",
    )
    # a late outcome of a claim that is no longer held leaves no attempt
    assert await store.finish("b1", [requeue]) == set()
    assert len(await store.attempts(first)) == 1
    # claimed again: no longer waiting for that reason; completed: its attempts go
    await store.requeue(first, 0, "operator says go")
    [again] = await store.claim("b1", 1)
    assert (again.id, again.attempts, again.waits_because) == (first, 2, None)
    assert await store.finish("b1", [Outcome(item_id=first, attempts=2, kind="complete")]) == {
        first
    }
    assert await store.attempts(first) == []


async def test_pages_of_rows_by_state_priority_action_age_and_file(store: Store) -> None:
    """Rows are paged by id after a cursor and filtered by state (ready, delayed, claimed,
    failed), priority, action, age and file; an unknown state or a limit below 1 raises."""
    ids = await store.enqueue_many(
        [NewItem(file_ref=f"f{i}", action="a" if i % 2 else "b", priority=i % 3) for i in range(6)]
    )
    [claimed] = await store.claim("b1", 1)  # priority 2, lowest id: f2
    assert claimed.file_ref == "f2"
    assert await store.requeue(ids[5], 3600, "later")
    assert await store.fail(ids[4], "bad")

    async def page(**filters: object) -> list[str]:
        rows, _ = await store.items(**filters)  # type: ignore[arg-type]
        return [row.file_ref for row in rows]

    assert await page() == [f"f{i}" for i in range(6)]
    assert await page(states=["ready"]) == ["f0", "f1", "f3"]
    assert await page(states=["delayed", "failed"]) == ["f4", "f5"]
    assert await page(states=["claimed"]) == ["f2"]
    assert await page(priorities=[0]) == ["f0", "f3"]
    assert await page(actions=["a"]) == ["f1", "f3", "f5"]
    assert await page(file_refs=["f1", "f4"]) == ["f1", "f4"]
    assert await page(older_than_s=3600) == []
    assert await page(limit=2) == ["f0", "f1"]
    assert await page(after=ids[1], limit=2) == ["f2", "f3"]
    rows, now = await store.items(limit=1)
    assert now is not None
    assert rows[0].created_at is not None
    assert rows[0].created_at <= now
    with pytest.raises(ValueError, match="unknown state 'bogus'"):
        await store.items(states=["bogus"])
    with pytest.raises(ValueError, match="limit must be at least 1"):
        await store.items(limit=0)


async def test_cancel_and_delete_take_rows_from_their_backend(store: Store) -> None:
    """A cancelled claimed row is failed with the note and its claim kept as a cancelled
    attempt; the backend no longer holds it (its re-check cancels the handler); a failed
    row is not cancelled again. Deleting a file's rows takes claimed ones and attempts."""
    ids = await store.enqueue_many([NewItem(file_ref=r, action="a") for r in ("f1", "f2", "f3")])
    running, _, _ = await store.claim("b1", 3)
    cancelled = await store.call(lambda conn: cancel_in(conn, running.id, note="stop it"))
    assert cancelled is not None
    assert (cancelled.status, cancelled.claimed_by, cancelled.file_ref) == ("claimed", "b1", "f1")
    row = await store.item(running.id)
    assert row is not None
    assert (row.status, row.last_error, row.claimed_by) == ("failed", "stop it", None)
    [attempt] = await store.attempts(running.id)
    assert (attempt.outcome, attempt.backend_id, attempt.reason) == ("cancelled", "b1", "stop it")
    _, held = await store.recheck_claims("b1", keep=ids)
    assert running.id not in {item_id for item_id, _ in held}
    assert await store.cancel(running.id) is None  # failed already
    assert await store.call(lambda conn: failed_ids_in(conn, ["f1", "f2"])) == [running.id]
    # the late outcome of the cancelled claim changes nothing
    late = Outcome(item_id=running.id, attempts=1, kind="complete")
    assert await store.finish("b1", [late]) == set()
    deleted = await store.call(lambda conn: delete_items_in(conn, ["f1", "f2"]))
    assert [(d.file_ref, d.status) for d in deleted] == [("f1", "failed"), ("f2", "claimed")]
    assert await store.attempts(running.id) == []
    assert [row.file_ref for row in (await store.items())[0]] == ["f3"]


async def test_a_stale_backends_claims_end_as_stale_attempts(store: Store) -> None:
    """The sweep that requeues a silent backend's rows keeps each claim's end as a
    ``stale`` attempt naming that backend, and the rows wait for nothing."""
    ids = await store.enqueue_many([NewItem(file_ref=r, action="a") for r in ("f1", "f2")])
    await store.register_backend("gone", "G")
    claimed = await store.claim("gone", 2)
    assert await store.requeue_stale(0.0) == 2
    for item in claimed:
        [attempt] = await store.attempts(item.id)
        assert (attempt.attempt, attempt.backend_id, attempt.outcome) == (1, "gone", "stale")
        assert attempt.reason == "requeued: backend gone stopped heartbeating"
        assert attempt.started_at == item.claimed_at
        row = await store.item(item.id)
        assert row is not None
        assert (row.status, row.waits_because) == ("new", None)
    assert sorted(item.id for item in claimed) == ids
