"""The dispatcher against a real PostgreSQL, real execservers and real processes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import psycopg
import pytest
import trio
from trio_broker_daemons.fylr.pgcluster import PgCluster

from tests.support.pg import own_cluster
from tests.support.wire import WAIT, start_execserver
from trio_broker.core import protocol as p
from trio_broker.core.admission import AdmissionConfig, InstanceLoad
from trio_broker.core.client import ClientConfig
from trio_broker.core.dispatch import Decision
from trio_broker.core.errors import (
    ClientClosed,
    JobLost,
    JobStopped,
    NoExecserver,
    NoSlot,
    StoreUnavailable,
    UnknownService,
)
from trio_broker.trio.client import BrokerClient, open_broker_client
from trio_broker.trio.dispatcher import (
    Action,
    Dispatcher,
    DispatcherConfig,
    DispatcherStatistics,
    OnDemandFailed,
    RetryLater,
    run_on_demand,
)
from trio_broker.trio.execserver import ExecserverHandle
from trio_broker.trio.store import NewItem, QueueItem, Store, open_store

ROOT = Path(__file__).resolve().parents[2]


@attrs.define
class StaticExec:
    """A fixed exec side, for tests where the admission input is not the subject."""

    loads: list[InstanceLoad] = attrs.field(factory=list)
    waiting_jobs: int = 0

    def instance_loads(self) -> Sequence[InstanceLoad]:
        return list(self.loads)

    def waiting(self) -> int:
        return self.waiting_jobs

    async def wait_capacity_changed(self) -> None:
        await trio.sleep_forever()  # fixed: it never changes


def one_instance(processes: int, clients: int = 1) -> StaticExec:
    return StaticExec([InstanceLoad(instance_id="x", processes=processes, clients=clients, idle=0)])


def dconfig(backend_id: str = "d1", **overrides: Any) -> DispatcherConfig:
    data: dict[str, Any] = {
        "backend_id": backend_id,
        "name": backend_id,
        "tick_interval": 0.2,
        "heartbeat_interval": 5.0,
        "stale_after": 60.0,
        "local_workers": 4,
        # the CPU count in the base, fixed so the limits do not follow the machine
        "admission": AdmissionConfig(cpus=2),
    }
    data.update(overrides)
    return DispatcherConfig(**data)


@asynccontextmanager
async def running(
    store: Store,
    actions: Sequence[Action],
    config: DispatcherConfig,
    exec_client: Any = None,
) -> AsyncIterator[Dispatcher]:
    """A dispatcher served in a nursery until the block ends (then shut down)."""
    async with trio.open_nursery() as nursery:
        dispatcher = Dispatcher(store, actions, config, exec_client=exec_client)
        await nursery.start(dispatcher.serve)
        yield dispatcher
        nursery.cancel_scope.cancel()


async def until(dispatcher: Dispatcher, predicate: Callable[[DispatcherStatistics], bool]) -> None:
    with trio.fail_after(WAIT):
        await dispatcher.wait_until(predicate)


def rows(store_dsn: str) -> dict[int, tuple[str, int, str | None, bool]]:
    """Every queue row: id -> (status, attempts, last_error, due now)."""
    with psycopg.connect(store_dsn) as conn:
        return {
            r[0]: (r[1], r[2], r[3], r[4])
            for r in conn.execute(
                "SELECT id, status, attempts, last_error, start_after <= now() FROM broker_queue"
            )
        }


# -- outcomes, priorities, shutdown (a fixed exec side) -------------------------------------


async def test_handler_outcomes_map_to_rows(pg_dsn: str) -> None:
    """Every row of the outcome table reaches the database: return completes; NoSlot,
    JobStopped, UnknownService and RetryLater requeue later; NoExecserver, JobLost,
    ClientClosed and StoreUnavailable at once; other errors fail, in a group too."""
    seen: Counter[str] = Counter()
    at_once = {
        "noexec": NoExecserver("nothing reachable"),
        "lost": JobLost("the connection closed"),
        "closed": ClientClosed("the client closed"),
        "store": StoreUnavailable("the database went away"),
    }

    async def handler(item: QueueItem) -> None:
        seen[item.file_ref] += 1
        kind = item.file_ref
        if kind == "noslot":
            raise NoSlot("no slot within 60 s")
        if kind in at_once and item.attempts == 1:
            raise at_once[kind]
        if kind == "stopped":
            raise RetryLater(30, "stopped: the execserver drained")
        if kind == "jobstopped":
            raise JobStopped("the job was stopped: draining")
        if kind == "unknown":
            raise UnknownService("nobody offers it")
        if kind == "boom":
            raise ValueError("boom")
        if kind == "group":
            raise ExceptionGroup("inner", [NoSlot("in a group")])
        if kind == "mixed":
            raise ExceptionGroup("inner", [NoSlot("busy"), KeyError("a bug")])

    kinds = ["ok", "noslot", "noexec", "stopped", "boom", "group", *at_once]
    kinds += ["jobstopped", "unknown", "mixed"]
    kinds = list(dict.fromkeys(kinds))
    async with open_store(pg_dsn, pool_size=4) as store:
        ids = dict(
            zip(
                kinds,
                await store.enqueue_many(
                    NewItem(file_ref=k, action="work", priority=1) for k in kinds
                ),
                strict=True,
            )
        )
        actions = [Action("work", True, handler)]
        async with running(store, actions, dconfig(), one_instance(8)) as dispatcher:
            await until(dispatcher, lambda s: s.completed == 5 and s.failed == 2)
            await until(dispatcher, lambda s: s.requeued == 9)
        state = rows(pg_dsn)
    assert ids["ok"] not in state
    assert ids["noexec"] not in state  # requeued at once, then done at the second attempt
    assert seen["noexec"] == 2
    assert state[ids["noslot"]][0:2] == ("new", 1)
    assert state[ids["noslot"]][3] is False  # due in a minute
    assert "NoSlot: no slot within 60 s" in (state[ids["noslot"]][2] or "")
    assert state[ids["stopped"]] == ("new", 1, "stopped: the execserver drained", False)
    assert state[ids["boom"]][0:3] == ("failed", 1, "ValueError: boom")
    assert state[ids["group"]][0:2] == ("new", 1)
    assert "in a group" in (state[ids["group"]][2] or "")
    for kind in at_once:
        assert ids[kind] not in state  # requeued at once, then done at the second attempt
        assert seen[kind] == 2
    assert state[ids["jobstopped"]] == (
        "new",
        1,
        "JobStopped: the job was stopped: draining",
        False,
    )
    assert state[ids["unknown"]] == ("new", 1, "UnknownService: nobody offers it", False)
    assert state[ids["mixed"]][0:3] == ("failed", 1, "KeyError: 'a bug'")


async def test_each_decision_is_settled_once_before_it_is_written(pg_dsn: str) -> None:
    """The action's settle hook gets each item's one decision (an UnknownService beyond the
    action's bound already a failure) while the row is still claimed; a hook that raises
    StoreUnavailable is called again; the rows then hold exactly the decisions."""
    settled: list[tuple[str, str, str, str | None]] = []
    calls: Counter[str] = Counter()

    async def handler(item: QueueItem) -> None:
        kind = item.file_ref
        if kind == "lost" and item.attempts == 1:
            raise JobLost("the connection closed")
        if kind == "bad":
            raise ExceptionGroup("steps", [ValueError("bad input")])
        if kind == "unknown":
            raise UnknownService("nobody offers 'x'")

    async def settle(item: QueueItem, decision: Decision) -> None:
        calls[item.file_ref] += 1
        if item.file_ref == "lost" and calls["lost"] == 1:
            raise StoreUnavailable("the database went away while settling")
        (row,) = [r for i, r in rows(pg_dsn).items() if i == item.id]
        cause = decision.verdict.cause
        settled.append(
            (item.file_ref, decision.verdict.outcome, row[0], None if cause is None else str(cause))
        )

    async with open_store(pg_dsn, pool_size=4) as store:
        kinds = ["ok", "lost", "bad", "unknown"]
        ids = dict(
            zip(
                kinds,
                await store.enqueue_many(NewItem(file_ref=k, action="work") for k in kinds),
                strict=True,
            )
        )
        action = Action("work", True, handler, settle=settle, unknown_service_attempts=1)
        config = dconfig(retry_min=0.01, retry_max=0.05)
        async with running(store, [action], config, one_instance(8)) as dispatcher:
            await until(dispatcher, lambda s: s.completed == 2 and s.failed == 2)
            stats = dispatcher.statistics()
        state = rows(pg_dsn)
    assert sorted(settled, key=str) == sorted(
        [
            ("bad", "failed", "claimed", "bad input"),
            ("lost", "lost", "claimed", "the connection closed"),  # the second settling
            ("lost", "ok", "claimed", None),  # requeued at once, then done
            ("ok", "ok", "claimed", None),
            ("unknown", "service_not_offered", "claimed", "nobody offers 'x', after 1 attempts"),
        ],
        key=str,
    )
    assert dict(calls) == {"ok": 1, "lost": 3, "bad": 1, "unknown": 1}
    assert stats.store_errors == 1
    assert ids["ok"] not in state
    assert ids["lost"] not in state
    assert state[ids["bad"]][0:3] == ("failed", 1, "ValueError: bad input")
    assert state[ids["unknown"]][0:3] == (
        "failed",
        1,
        "ServiceNotOffered: nobody offers 'x', after 1 attempts",
    )


async def test_a_settling_cancelled_at_shutdown_leaves_no_outcome(pg_dsn: str) -> None:
    """Shutdown while the application settles a decision: the decision is never written and
    the row goes back to the queue, due now."""
    settling = trio.Event()

    async def handler(item: QueueItem) -> None:
        raise ValueError("bad input")

    async def settle(item: QueueItem, decision: Decision) -> None:
        settling.set()
        await trio.sleep_forever()

    async with open_store(pg_dsn, pool_size=4) as store:
        item_id = await store.enqueue("x", "work")
        action = Action("work", False, handler, settle=settle)
        async with running(store, [action], dconfig()) as dispatcher:
            with trio.fail_after(WAIT):
                await settling.wait()
        stats = dispatcher.statistics()
    assert rows(pg_dsn)[item_id] == ("new", 1, None, True)
    assert (stats.failed, stats.returned, stats.pending_outcomes) == (0, 1, 0)


async def test_claims_follow_finishes_not_only_ticks(pg_dsn: str) -> None:
    """With an hour-long tick every item still runs: a finishing item triggers the next claim."""
    done: list[int] = []

    async def handler(item: QueueItem) -> None:
        done.append(item.id)

    async with open_store(pg_dsn, pool_size=4) as store:
        ids = await store.enqueue_many(NewItem(file_ref=str(i), action="sync") for i in range(40))
        config = dconfig(tick_interval=3600.0, local_workers=2)
        async with running(store, [Action("sync", False, handler)], config) as dispatcher:
            await until(dispatcher, lambda s: s.completed == 40)
            stats = dispatcher.statistics()
    assert sorted(done) == ids
    assert stats.claims > 40 // 2  # at most two per claim: many claims, one tick


async def test_odd_priority_claimed_at_next_tick_behind_a_full_queue(pg_dsn: str) -> None:
    """A priority-3 item behind 10,000 priority-0 items is claimed by the next claim, through
    the odd reserve, while an even priority-2 item stays queued."""
    release, urgent_started = trio.Event(), trio.Event()
    claimed_at: dict[int, int] = {}
    dispatcher: Dispatcher | None = None

    async def handler(item: QueueItem) -> None:
        assert dispatcher is not None
        claimed_at[item.priority] = dispatcher.statistics().claims
        if item.priority == 3:
            urgent_started.set()
        await release.wait()

    async with open_store(pg_dsn, pool_size=8) as store:
        await store.enqueue_many(NewItem(file_ref=str(i), action="exec") for i in range(10_000))
        # 8 slots, one client: limit 10 (a pool of 8 caps at 16) for even items, and a
        # reserve of 2 more that only odd items may take
        async with running(
            store, [Action("exec", True, handler)], dconfig(), one_instance(8)
        ) as dispatcher:
            await until(dispatcher, lambda s: s.exec_in_flight == 10)
            assert dispatcher.statistics().exec_limit == 10
            even = await store.enqueue("even", "exec", priority=2)
            urgent = await store.enqueue("urgent", "exec", priority=3)
            after_enqueue = dispatcher.statistics().claims
            with trio.fail_after(WAIT):
                await urgent_started.wait()
            assert claimed_at[3] <= after_enqueue + 1
            assert dispatcher.statistics().exec_in_flight == 11
            stuck = await store.item(even)
            assert stuck is not None
            assert stuck.status == "new"
            done = await store.item(urgent)
            assert done is None or done.status == "claimed"
            release.set()


async def test_odd_local_item_runs_while_even_ones_hold_every_local_slot(pg_dsn: str) -> None:
    """With both local slots held by even-priority items (a large background run), an
    odd-priority local item (an interactive sync) is still claimed and run to its end."""
    release = trio.Event()
    started: list[int] = []
    dispatcher: Dispatcher | None = None

    async def handler(item: QueueItem) -> None:
        started.append(item.priority)
        if item.priority % 2 == 0:
            await release.wait()

    async with open_store(pg_dsn, pool_size=4) as store:
        await store.enqueue_many(
            NewItem(file_ref=str(i), action="sync", priority=-2) for i in range(50)
        )
        config = dconfig(local_workers=2)
        async with running(store, [Action("sync", False, handler)], config) as dispatcher:
            await until(dispatcher, lambda s: s.local_in_flight == 2)
            stats = dispatcher.statistics()
            assert (stats.local_limit, stats.local_reserve) == (2, 1)
            urgent = await store.enqueue("urgent", "sync", priority=3)
            dispatcher.wake()
            await until(dispatcher, lambda s: s.completed == 1)
            assert await store.item(urgent) is None  # ran and completed
            stats = dispatcher.statistics()
            assert (stats.local_in_flight, stats.local_odd_in_flight) == (2, 0)
            assert started.count(-2) == 2  # no third background item took the reserve
            release.set()


async def test_shutdown_returns_in_flight_items_at_once(pg_dsn: str) -> None:
    """Cancelling the dispatcher puts every item it holds back in the queue, due now."""
    started = 0

    async def handler(item: QueueItem) -> None:
        nonlocal started
        started += 1
        await trio.sleep_forever()

    async with open_store(pg_dsn, pool_size=4) as store:
        await store.enqueue_many(NewItem(file_ref=str(i), action="copy_move") for i in range(10))
        config = dconfig(local_workers=3)
        async with running(store, [Action("copy_move", False, handler)], config) as dispatcher:
            await until(dispatcher, lambda s: s.local_in_flight == 3)
            assert (await store.counts()).claimed == 3
        stats = dispatcher.statistics()
        counts = await store.counts()
        assert (counts.ready, counts.claimed) == (10, 0)
        assert stats.returned == 3
        assert await store.heartbeat("d1") is False  # it unregistered itself


async def test_a_handler_cancelled_at_shutdown_has_no_outcome_even_inside_a_group(
    pg_dsn: str,
) -> None:
    """A handler whose nursery raises NoSlot while shutdown cancels it gets no outcome: its
    row goes back to the queue, due now, and the dispatcher stops cleanly."""
    started = trio.Event()

    async def raise_when_cancelled() -> None:
        try:
            await trio.sleep_forever()
        finally:
            raise NoSlot("raised while being cancelled")

    async def handler(item: QueueItem) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(raise_when_cancelled)
            started.set()
            await trio.sleep_forever()

    async with open_store(pg_dsn, pool_size=4) as store:
        item_id = await store.enqueue("x", "exec", priority=0)
        async with running(
            store, [Action("exec", True, handler)], dconfig(), one_instance(2)
        ) as dispatcher:
            with trio.fail_after(WAIT):
                await started.wait()
        stats = dispatcher.statistics()
    assert rows(pg_dsn)[item_id] == ("new", 1, None, True)
    assert (stats.returned, stats.requeued, stats.failed, stats.pending_outcomes) == (1, 0, 0, 0)


async def test_rows_of_an_earlier_life_are_returned_at_start(pg_dsn: str) -> None:
    """Rows still claimed under the dispatcher's backend id (a crash) go back when it starts."""
    async with open_store(pg_dsn, pool_size=4) as store:
        await store.enqueue_many(NewItem(file_ref=str(i), action="sync") for i in range(5))
        await store.claim("d1", 5)
        handled: list[int] = []

        async def handler(item: QueueItem) -> None:
            handled.append(item.attempts)

        async with running(store, [Action("sync", False, handler)], dconfig()) as dispatcher:
            await until(dispatcher, lambda s: s.completed == 5)
        assert dispatcher.statistics().returned == 5
        assert handled == [2] * 5


async def test_database_restart_loses_and_duplicates_nothing(
    pg_cluster: PgCluster, pg_dsn: str
) -> None:
    """Two dispatchers keep draining across a PostgreSQL restart; each item runs exactly once."""
    handled: Counter[int] = Counter()
    total = 3000

    async def handler(item: QueueItem) -> None:
        handled[item.id] += 1

    async with (
        open_store(pg_dsn, pool_size=4) as one,
        open_store(pg_dsn, pool_size=4, migrate=False) as two,
    ):
        ids = await one.enqueue_many(NewItem(file_ref=str(i), action="sync") for i in range(total))
        actions = [Action("sync", False, handler)]
        async with (
            running(one, actions, dconfig("d1", retry_max=0.5)) as d1,
            running(two, actions, dconfig("d2", retry_max=0.5)) as d2,
        ):
            await until(d1, lambda s: s.completed >= 100)
            await trio.to_thread.run_sync(pg_cluster.restart)
            with trio.fail_after(WAIT):
                # (an outcome whose first write committed unseen is "fenced" on its retry)
                while (
                    sum(d.completed + d.fenced for d in (d1.statistics(), d2.statistics())) < total
                ):
                    await _either(d1, d2)
        errors = d1.statistics().store_errors + d2.statistics().store_errors
        counts = await one.counts()
    assert errors > 0  # the restart was felt
    assert counts.total == 0
    assert sorted(handled) == ids
    assert set(handled.values()) == {1}


async def _either(*dispatchers: Dispatcher) -> None:
    """Return after the next change of any of the dispatchers."""
    async with trio.open_nursery() as nursery:
        for dispatcher in dispatchers:
            before = dispatcher.statistics()

            async def watch(d: Dispatcher = dispatcher, s: DispatcherStatistics = before) -> None:
                await d.wait_until(lambda now: now != s)
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)


# -- separate processes ---------------------------------------------------------------------


@attrs.define
class Worker:
    """A ``tests.support.dispatch_worker`` process and what it reported."""

    process: trio.Process
    name: str
    ready: trio.Event = attrs.field(factory=trio.Event)
    handled: list[tuple[int, int]] = attrs.field(factory=list)
    holding: list[tuple[int, int]] = attrs.field(factory=list)


@attrs.define
class Workers:
    """Every worker of a test, and an event for "something was reported"."""

    all: list[Worker] = attrs.field(factory=list)
    changed: trio.Event = attrs.field(factory=trio.Event)

    async def wait(self, predicate: Callable[[], bool]) -> None:
        with trio.fail_after(WAIT * 2):
            while not predicate():
                await self.changed.wait()

    def handled(self) -> list[tuple[int, int]]:
        return [h for w in self.all for h in w.handled]


async def _read_lines(worker: Worker, workers: Workers) -> None:
    assert worker.process.stdout is not None
    buffer = b""
    async for chunk in worker.process.stdout:
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            word, *rest = line.decode().split()
            if word == "ready":
                worker.ready.set()
            elif word == "handled":
                worker.handled.append((int(rest[0]), int(rest[1])))
            elif word == "holding":
                worker.holding.append((int(rest[0]), int(rest[1])))
        workers.changed.set()
        workers.changed = trio.Event()


@asynccontextmanager
async def worker_processes(
    dsn: str, specs: Sequence[tuple[str, Sequence[str]]]
) -> AsyncIterator[Workers]:
    """Start one worker per ``(name, extra args)``; wait until each is ready; stop them after."""
    workers = Workers()
    async with trio.open_nursery() as nursery:
        try:
            for name, extra in specs:
                process = await trio.lowlevel.open_process(
                    [sys.executable, "-m", "tests.support.dispatch_worker", "--dsn", dsn,
                     "--backend-id", name, *extra],
                    stdout=subprocess.PIPE,
                    cwd=ROOT,
                )  # fmt: skip
                worker = Worker(process=process, name=name)
                workers.all.append(worker)
                nursery.start_soon(_read_lines, worker, workers)
            with trio.fail_after(WAIT):
                for worker in workers.all:
                    await worker.ready.wait()
            yield workers
        finally:
            with trio.CancelScope(shield=True):
                for worker in workers.all:
                    if worker.process.returncode is None:
                        worker.process.send_signal(signal.SIGTERM)
                with trio.move_on_after(WAIT):
                    for worker in workers.all:
                        await worker.process.wait()
                for worker in workers.all:
                    if worker.process.returncode is None:
                        worker.process.kill()
                    await worker.process.wait()
                    assert worker.process.stdout is not None
                    await worker.process.stdout.aclose()


async def test_three_processes_drain_each_item_exactly_once(pg_dsn: str) -> None:
    """Three dispatchers in separate processes drain 3,000 items, each exactly once."""
    total = 3000
    async with open_store(pg_dsn, pool_size=2) as store:
        specs = [(f"w{i}", ()) for i in range(3)]
        async with worker_processes(pg_dsn, specs) as workers:
            ids = await store.enqueue_many(
                NewItem(file_ref=str(i), action="noop") for i in range(total)
            )
            await workers.wait(lambda: len(workers.handled()) >= total)
            for worker in workers.all:
                worker.process.send_signal(signal.SIGTERM)
            with trio.fail_after(WAIT):
                for worker in workers.all:
                    assert await worker.process.wait() == 0
        counts = await store.counts()
    handled = Counter(item_id for item_id, _ in workers.handled())
    assert sorted(handled) == ids
    assert set(handled.values()) == {1}
    assert all(worker.handled for worker in workers.all)  # all three took part
    assert counts.total == 0


async def test_killed_dispatchers_rows_come_back(pg_dsn: str) -> None:
    """After kill -9 of a dispatcher holding rows, the survivors requeue them once its heartbeat
    is stale, and every item completes exactly once."""
    total = 600
    fast = ["--heartbeat", "0.25", "--stale-after", "1.5"]
    async with open_store(pg_dsn, pool_size=2) as store:
        ids = await store.enqueue_many(
            NewItem(file_ref=str(i), action="noop") for i in range(total)
        )
        victim_spec = [("victim", ["--mode", "stall", "--local-workers", "8", *fast])]
        async with worker_processes(pg_dsn, victim_spec) as doomed:
            victim = doomed.all[0]
            await doomed.wait(lambda: len(victim.holding) == 8)
            victim.process.kill()
            assert await victim.process.wait() == -signal.SIGKILL
        assert (await store.counts()).claimed == 8  # nobody has returned them
        survivors = [(f"survivor{i}", fast) for i in range(2)]
        async with worker_processes(pg_dsn, survivors) as workers:
            await workers.wait(lambda: len(workers.handled()) >= total)
        counts = await store.counts()
    handled = dict(Counter(item_id for item_id, _ in workers.handled()))
    assert sorted(handled) == ids
    assert set(handled.values()) == {1}
    attempts = dict(workers.handled())
    for item_id, first_attempt in victim.holding:
        assert attempts[item_id] == first_attempt + 1  # claimed again after the sweep
    assert counts.total == 0


# -- the real exec side ---------------------------------------------------------------------


def exec_action(client: BrokerClient, service: str, params: dict[str, Any]) -> Action:
    """An exec-bound action that runs ``service`` through the broker client."""

    async def handler(item: QueueItem) -> None:
        receipt = await client.run(
            service, {"params": params}, priority=item.priority, subject=item.file_ref
        )
        if receipt.status == "stopped":
            raise RetryLater(60, f"stopped: {receipt.error}")
        if receipt.status != "ok":
            raise RuntimeError(receipt.error)

    return Action(service, True, handler)


def client_config(address: str, backend_id: str, **overrides: Any) -> ClientConfig:
    data: dict[str, Any] = {
        "backend_id": backend_id,
        "name": backend_id,
        "version": "1",
        "addresses": (address,),
        "reconnect_min": 0.05,
        "reconnect_max": 0.5,
    }
    data.update(overrides)
    return ClientConfig(**data)


async def execserver_in_own_scope(
    *, task_status: trio.TaskStatus[tuple[ExecserverHandle, trio.CancelScope]]
) -> None:
    """An execserver that stops (as if killed) when the reported scope is cancelled."""
    async with trio.open_nursery() as nursery:
        handle = await start_execserver(nursery, slots=2)
        task_status.started((handle, nursery.cancel_scope))


def sees_clients(client: BrokerClient, n: int) -> bool:
    """Whether the client's one execserver announced ``n`` connected clients."""
    return [load.clients for load in client.instance_loads()] == [n]


def address(handle: ExecserverHandle) -> str:
    return f"{handle.host}:{handle.port}"


async def test_five_dispatchers_share_forty_slots(pg_dsn: str) -> None:
    """Five dispatchers on a 40-slot execserver hold at most ten items each; when one leaves,
    each of the others grows to twelve."""
    members = 5
    admission = AdmissionConfig(cpus=2, use_idle=False)  # the base alone (idle has its own test)
    async with trio.open_nursery() as nursery, open_store(pg_dsn, pool_size=2) as store:
        handle = await start_execserver(nursery, slots=40)
        await store.enqueue_many(
            NewItem(file_ref=str(i), action="hold", priority=0) for i in range(150)
        )
        clients: list[BrokerClient] = []
        dispatchers: dict[int, Dispatcher] = {}
        scopes: list[trio.CancelScope] = []
        go, all_serving = trio.Event(), trio.Event()

        async def member(i: int, *, task_status: trio.TaskStatus[None]) -> None:
            with trio.CancelScope() as scope:
                scopes.append(scope)
                async with (
                    open_store(pg_dsn, pool_size=8, migrate=False) as own,
                    open_broker_client(client_config(address(handle), f"m{i}")) as client,
                ):
                    clients.append(client)
                    task_status.started()
                    await go.wait()
                    action = exec_action(client, "hold", {"seconds": 120})
                    config = dconfig(f"m{i}", admission=admission)
                    async with trio.open_nursery() as inner:
                        dispatcher = Dispatcher(own, [action], config, exec_client=client)
                        await inner.start(dispatcher.serve)
                        dispatchers[i] = dispatcher
                        if len(dispatchers) == members:
                            all_serving.set()

        for i in range(members):
            await nursery.start(member, i)
        for client in clients:
            await client.wait_until(partial(sees_clients, client, members), timeout=WAIT)
        go.set()
        with trio.fail_after(WAIT):
            await all_serving.wait()
        for d in dispatchers.values():
            await until(d, lambda s: s.exec_in_flight == 10)
        # 50 jobs for 40 slots: jobs wait, which lowers each limit below 10 again
        peaks = [d.statistics().peak_exec_in_flight for d in dispatchers.values()]
        assert peaks == [10] * members

        scopes[0].cancel()  # the first member leaves: its client closes
        rest = [d for i, d in sorted(dispatchers.items()) if i != 0]
        for d in rest:
            await until(d, lambda s: s.peak_exec_in_flight == 12)
        assert max(d.statistics().peak_exec_in_flight for d in rest) == 12
        nursery.cancel_scope.cancel()


async def test_idle_slots_raise_admission(pg_dsn: str) -> None:
    """A dispatcher sharing an execserver with an idle client takes the slots it leaves idle.

    (The pool of 8 makes the automatic cap 16: room for the rise beside the odd reserve.)"""
    async with trio.open_nursery() as nursery, open_store(pg_dsn, pool_size=8) as store:
        handle = await start_execserver(nursery, slots=8)
        await store.enqueue_many(
            NewItem(file_ref=str(i), action="hold", priority=0) for i in range(30)
        )
        async with (
            open_broker_client(client_config(address(handle), "idle")),
            open_broker_client(client_config(address(handle), "busy")) as client,
        ):
            await client.wait_until(partial(sees_clients, client, 2), timeout=WAIT)
            action = exec_action(client, "hold", {"seconds": 120})
            async with running(store, [action], dconfig(), client) as dispatcher:
                await until(dispatcher, lambda s: s.exec_in_flight == s.exec_base)  # 8 / 2 + CPUs
                await until(dispatcher, lambda s: s.peak_exec_in_flight >= 7)
        nursery.cancel_scope.cancel()


async def test_a_change_of_capacity_claims_at_once(pg_dsn: str) -> None:
    """The dispatcher watches its broker client: with an hour between ticks, work queued
    unannounced is claimed as soon as the execserver's capacity changes (a second client
    arrives), with no wake-up from the application."""
    async with trio.open_nursery() as nursery, open_store(pg_dsn, pool_size=4) as store:
        handle = await start_execserver(nursery, slots=4)
        async with open_broker_client(client_config(address(handle), "watcher")) as client:
            await client.wait_until(partial(sees_clients, client, 1), timeout=WAIT)
            config = dconfig(tick_interval=3600.0, heartbeat_interval=30.0)
            async with running(store, [exec_action(client, "noop", {})], config, client) as d:
                await until(d, lambda s: s.ticks == 1)  # the first tick found nothing
                await store.enqueue_many(NewItem(file_ref=str(i), action="noop") for i in range(3))
                assert d.statistics().ticks == 1
                async with open_broker_client(client_config(address(handle), "other")):
                    # claimed at the change (then after each finish), long before the tick
                    await until(d, lambda s: s.completed == 3)
        nursery.cancel_scope.cancel()


async def test_no_execserver_no_exec_claims_local_work_goes_on(pg_dsn: str) -> None:
    """With every execserver down nothing exec-bound is claimed, and local work still runs."""
    local_done: list[int] = []

    async def local(item: QueueItem) -> None:
        local_done.append(item.id)

    async with trio.open_nursery() as nursery, open_store(pg_dsn, pool_size=4) as store:
        handle, exec_scope = await nursery.start(execserver_in_own_scope)
        async with open_broker_client(client_config(address(handle), "c")) as client:
            actions = [exec_action(client, "noop", {}), Action("checksum", False, local)]
            async with running(store, actions, dconfig(), client) as dispatcher:
                ok = await store.enqueue("first", "noop")
                await until(dispatcher, lambda s: s.completed == 1)  # it works while up
                assert await store.item(ok) is None
                exec_scope.cancel()
                await client.wait_until(lambda: not client.instance_loads(), timeout=WAIT)
                exec_ids = await store.enqueue_many(
                    NewItem(file_ref=str(i), action="noop", priority=4) for i in range(5)
                )
                local_ids = await store.enqueue_many(
                    NewItem(file_ref=str(i), action="checksum") for i in range(5)
                )
                await until(dispatcher, lambda s: s.completed == 6)
                stats = dispatcher.statistics()
                state = rows(pg_dsn)
        nursery.cancel_scope.cancel()
    assert sorted(local_done) == local_ids
    assert stats.exec_limit == 0
    assert [state[i][0:2] for i in exec_ids] == [("new", 0)] * 5  # never claimed


# -- idle cost ------------------------------------------------------------------------------


@attrs.define
class FrameCount:
    """Websocket frames seen by the relay, by direction and message type."""

    counts: Counter[tuple[str, str]] = attrs.field(factory=Counter)

    def feed(self, direction: str, buffer: bytearray, upgraded: list[bool]) -> None:
        if not upgraded[0]:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            del buffer[: end + 4]
            upgraded[0] = True
        while len(buffer) >= 2:
            opcode, masked, length, pos = buffer[0] & 0x0F, buffer[1] & 0x80, buffer[1] & 0x7F, 2
            if length == 126:
                if len(buffer) < 4:
                    return
                length, pos = int.from_bytes(buffer[2:4], "big"), 4
            elif length == 127:
                if len(buffer) < 10:
                    return
                length, pos = int.from_bytes(buffer[2:10], "big"), 10
            mask = b""
            if masked:
                mask, pos = bytes(buffer[pos : pos + 4]), pos + 4
            if len(buffer) < pos + length:
                return
            payload = bytes(buffer[pos : pos + length])
            del buffer[: pos + length]
            if mask:
                payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
            kind = json.loads(payload)["type"] if opcode == 1 else f"opcode {opcode}"
            self.counts[direction, kind] += 1


async def serve_counting_relay(
    target: ExecserverHandle, count: FrameCount, *, task_status: trio.TaskStatus[int]
) -> None:
    """A TCP relay on 127.0.0.1 to the execserver that counts the websocket frames it carries."""

    async def pump(
        src: trio.SocketStream, dst: trio.SocketStream, direction: str, done: trio.CancelScope
    ) -> None:
        buffer, upgraded = bytearray(), [False]
        try:
            async for chunk in src:
                await dst.send_all(chunk)
                buffer += chunk
                count.feed(direction, buffer, upgraded)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        done.cancel()

    async def handle(downstream: trio.SocketStream) -> None:
        upstream = await trio.open_tcp_stream(target.host, target.port)
        async with downstream, upstream, trio.open_nursery() as nursery:
            nursery.start_soon(pump, downstream, upstream, "to exec", nursery.cancel_scope)
            nursery.start_soon(pump, upstream, downstream, "to client", nursery.cancel_scope)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handle, listeners)


def claim_statements(dsn: str) -> int:
    """Claim statements this database has executed, as PostgreSQL itself counted them."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(s.calls), 0) FROM pg_stat_statements s"
            " JOIN pg_database d ON d.oid = s.dbid"
            " WHERE d.datname = current_database() AND s.query LIKE '%SKIP LOCKED%'"
        ).fetchone()
        assert row is not None
        return int(row[0])


async def test_idle_cost(pg_dsn: str) -> None:
    """With an empty queue a dispatcher sends one claim per tick (as PostgreSQL counts them) and
    its broker connection carries nothing but PING and PONG."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    frames = FrameCount()
    tick = 0.2
    liveness = {"ping_interval": 0.3, "ping_timeout": 10.0}
    async with trio.open_nursery() as nursery, open_store(pg_dsn, pool_size=4) as store:
        handle = await start_execserver(nursery, slots=2, ping_interval="0.3s")
        port = await nursery.start(serve_counting_relay, handle, frames)
        via_relay = client_config(f"127.0.0.1:{port}", "idle", **liveness)
        async with open_broker_client(via_relay) as client:
            # settled: the execserver announced its idle slots (it changes no more)
            await client.wait_until(
                lambda: [x.idle for x in client.instance_loads()] == [2], timeout=WAIT
            )
            actions = [exec_action(client, "noop", {}), Action("sync", False, _never)]
            # (no heartbeat inside the window: it would wake the waits below mid-claim)
            config = dconfig(tick_interval=tick, heartbeat_interval=30.0)
            async with running(store, actions, config, client) as dispatcher:
                await until(dispatcher, lambda s: s.claims >= 2)
                before = dispatcher.statistics()
                sent_before = claim_statements(pg_dsn)
                frames_before = frames.counts.copy()
                start = trio.current_time()
                await until(dispatcher, lambda s: s.claims >= before.claims + 10)
                elapsed = trio.current_time() - start
                after = dispatcher.statistics()
                sent = claim_statements(pg_dsn) - sent_before
                window = frames.counts - frames_before
        nursery.cancel_scope.cancel()
    claims = after.claims - before.claims
    assert sent == claims == 10
    assert abs((after.ticks - before.ticks) - claims) <= 1  # one claim per tick
    assert claims <= elapsed / tick + 1  # and the ticks were not early
    kinds = {kind for _, kind in window}
    assert kinds <= {"PING", "PONG"}, window
    assert window["to exec", "PING"] > 0  # counted: the liveness traffic is all there is
    assert window["to client", "PING"] > 0


async def _never(item: QueueItem) -> None:  # pragma: no cover - the queue stays empty
    raise AssertionError(f"nothing should run, got {item}")


# -- waiting callers ------------------------------------------------------------------------


async def test_a_waiting_caller_gets_503_not_a_requeue() -> None:
    """Work a caller waits for, run with run_on_demand on a real broker client: with the
    only execserver full, the job finds no slot within connect_timeout and the caller gets
    503 with the reason at once (a queued step would have been requeued)."""
    async with trio.open_nursery() as nursery:
        handle = await start_execserver(nursery, slots=1)
        config = client_config(address(handle), "caller", connect_timeout=0.5)
        async with open_broker_client(config) as client:
            holding = trio.Event()

            async def hold() -> None:
                holding.set()
                await client.run("hold", {"params": {"seconds": 120}}, subject="busy")

            nursery.start_soon(hold)
            await holding.wait()
            await client.wait_until(lambda: client.statistics().running == 1, timeout=WAIT)

            async def render() -> p.Receipt:
                return await client.run("noop", {}, subject="on demand")

            with trio.fail_after(WAIT), pytest.raises(OnDemandFailed) as failed:
                await run_on_demand(render)
            assert failed.value.answer.status == 503
            assert failed.value.answer.outcome == "no_slot"
            assert isinstance(failed.value.__cause__, NoSlot)
            nursery.cancel_scope.cancel()


# -- claims re-checked every heartbeat -------------------------------------------------------


async def _drain_with_a_stuck_first_dispatcher(
    store: Store, dsn: str, total: int, take: Callable[[], Any]
) -> tuple[Counter[int], DispatcherStatistics]:
    """``d1`` claims every item and holds it (its first handler of each waits); ``take()``
    makes the rows leave it; ``d2`` joins and the two drain them. Returns the
    completions per item and d1's statistics once every item completed and d1's held
    handlers ended."""
    completed: Counter[int] = Counter()
    all_done = trio.Event()
    gate = trio.Event()
    held: set[int] = set()

    def complete(item: QueueItem) -> None:
        completed[item.id] += 1
        if len(completed) == total:
            all_done.set()

    async def first_holds(item: QueueItem) -> None:
        if item.id not in held:
            held.add(item.id)
            await gate.wait()
        complete(item)

    async def quick(item: QueueItem) -> None:
        complete(item)

    config = dconfig("d1", local_workers=total, heartbeat_interval=0.3)
    async with running(store, [Action("sync", False, first_holds)], config) as d1:
        await until(d1, lambda s: s.local_in_flight == total)
        await trio.to_thread.run_sync(take)
        async with (
            open_store(dsn, pool_size=2, migrate=False) as other,
            running(other, [Action("sync", False, quick)], dconfig("d2")),
        ):
            with trio.fail_after(WAIT):
                await all_done.wait()
            await until(d1, lambda s: s.lost == total)
        gate.set()  # had d1 kept its first handlers, they would complete now: a second time
        await until(d1, lambda s: s.local_in_flight == 0)
        stats = d1.statistics()
    return completed, stats


async def test_a_row_taken_from_under_a_dispatcher_is_not_completed_twice(pg_dsn: str) -> None:
    """Rows requeued by SQL, as another node's stale sweep would, are let go by their
    first holder at its next heartbeat: its handlers are cancelled, its outcomes never
    written over the new holder's, and each item completes exactly once."""
    total = 4

    def sweep() -> None:
        with psycopg.connect(pg_dsn) as conn:
            conn.execute(
                "UPDATE broker_queue SET status = 'new', claimed_by = NULL, claimed_at = NULL,"
                " start_after = now(), last_error = 'requeued: backend d1 stopped heartbeating'"
            )

    async with open_store(pg_dsn, pool_size=3) as store:
        ids = await store.enqueue_many(
            NewItem(file_ref=str(i), action="sync") for i in range(total)
        )
        completed, stats = await _drain_with_a_stuck_first_dispatcher(store, pg_dsn, total, sweep)
        counts = await store.counts()
    assert sorted(completed) == ids
    assert set(completed.values()) == {1}
    assert stats.lost == total
    assert stats.fenced == 0  # nothing of d1 was written over d2
    assert counts.total == 0


async def test_rows_held_but_unknown_go_back_at_the_next_heartbeat(pg_dsn: str) -> None:
    """A row claimed under a dispatcher's id that it does not know (an outcome or claim
    a database restart lost) is returned by its next heartbeat, though it lives."""
    async with open_store(pg_dsn, pool_size=3) as store:
        (item_id,) = await store.enqueue_many([NewItem(file_ref="a", action="other")])
        async with running(
            store, [Action("sync", False, _never)], dconfig(heartbeat_interval=0.3)
        ) as d1:
            with psycopg.connect(pg_dsn) as conn:
                conn.execute(
                    "UPDATE broker_queue SET status = 'claimed', claimed_by = 'd1', attempts = 1"
                )
            await until(d1, lambda s: s.returned == 1)
        assert rows(pg_dsn)[item_id][0] == "new"


def checkpoint(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CHECKPOINT")


async def test_claims_an_immediate_restart_lost_are_let_go_not_completed_twice() -> None:
    """``pg_ctl restart -m immediate`` while a dispatcher holds claims that were not yet
    durable (asynchronous commit, a WAL writer that waits): the rows come back new, a
    second dispatcher claims them, and the first one's re-check lets its items go. Each
    item completes exactly once; nothing stays claimed."""
    total = 4
    # commits wait in the WAL buffers for up to 10 s: the restart loses the claims
    with own_cluster(wal_writer_delay="10s") as cluster:
        dsn = cluster.ensure_database("restart")
        async with open_store(dsn, pool_size=3) as store:
            ids = await store.enqueue_many(
                NewItem(file_ref=str(i), action="sync") for i in range(total)
            )
            await trio.to_thread.run_sync(checkpoint, dsn)  # the rows themselves are durable

            def restart() -> None:
                cluster.restart(mode="immediate")

            completed, stats = await _drain_with_a_stuck_first_dispatcher(
                store, dsn, total, restart
            )
            counts = await store.counts()
    assert sorted(completed) == ids
    assert set(completed.values()) == {1}
    assert stats.lost == total
    assert counts.total == 0
