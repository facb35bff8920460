"""BrokerClient pools behind a real HAProxy in front of several execserver replicas."""

from __future__ import annotations

from collections import Counter
from contextlib import AsyncExitStack
from typing import Any

import pytest
import trio

from tests.support.haproxy import open_haproxy
from tests.support.processes import open_execserver_process
from tests.support.wire import WAIT, start_execserver
from tests.trio.test_client import client_for
from trio_broker.core.errors import JobLost, ServiceNotOffered, UnknownService
from trio_broker.trio.client import BrokerClient
from trio_broker.trio.execserver import ExecserverHandle


def reached(client: BrokerClient) -> set[str]:
    (address,) = client.statistics().addresses
    return set(address.instances)


def backlog(client: BrokerClient, nursery: trio.Nursery, count: int, seconds: float) -> None:
    for _ in range(count):
        nursery.start_soon(client.run, "hold", {"params": {"seconds": seconds}})


GROWTH: dict[str, Any] = {"retry_tick": 0.1, "pool_grow_interval": 0.1}


async def test_a_single_want_leaves_the_pool_at_one_connection() -> None:
    """A job that gets a slot at once never makes the pool grow, even behind a balancer."""
    async with trio.open_nursery() as nursery:
        replicas = [await start_execserver(nursery, slots=2) for _ in range(3)]
        async with (
            open_haproxy([(r.host, r.port) for r in replicas]) as proxy,
            client_for(proxy.address, **GROWTH) as client,
        ):
            for _ in range(5):
                assert (await client.run("noop", {})).status == "ok"
            (address,) = client.statistics().addresses
            assert address.connections == 1
            assert address.balanced  # HELLO.addr names the replica, not the balancer
        nursery.cancel_scope.cancel()


async def test_a_backlog_grows_the_pool_to_every_replica_then_stops() -> None:
    """A sustained backlog opens connections until all three replicas are reached; the next
    one lands on a known replica, is closed as a duplicate and marks the address covered."""
    async with trio.open_nursery() as nursery:
        replicas = [await start_execserver(nursery, slots=1) for _ in range(3)]
        ids = {r.broker.config.instance_id for r in replicas}
        async with (
            open_haproxy([(r.host, r.port) for r in replicas]) as proxy,
            client_for(proxy.address, pool_reprobe_interval=3600, **GROWTH) as client,
            trio.open_nursery() as jobs,
        ):
            backlog(client, jobs, 6, 60)
            await client.wait_until(lambda: reached(client) == ids, timeout=WAIT)
            await client.wait_until(lambda: client.statistics().addresses[0].covered, timeout=WAIT)
            assert client.statistics().addresses[0].connections == 3
            # Every replica runs one job and parks the rest: the backlog is spread.
            for replica in replicas:
                await replica.wait_until(lambda r=replica: _running(r) == 1)  # type: ignore[misc]
            jobs.cancel_scope.cancel()
        nursery.cancel_scope.cancel()


async def test_a_replica_added_later_is_found_after_a_reprobe() -> None:
    """With the pool covered, a fourth replica added to the balancer is reached once the
    re-probe clears the covered mark and the backlog is still there."""
    async with trio.open_nursery() as nursery:
        replicas = [await start_execserver(nursery, slots=1) for _ in range(3)]
        async with (
            open_haproxy([(r.host, r.port) for r in replicas]) as proxy,
            client_for(proxy.address, pool_reprobe_interval=0.5, **GROWTH) as client,
            trio.open_nursery() as jobs,
        ):
            backlog(client, jobs, 8, 60)
            ids = {r.broker.config.instance_id for r in replicas}
            await client.wait_until(lambda: reached(client) == ids, timeout=WAIT)
            fourth = await start_execserver(nursery, slots=1)
            await proxy.add_backend(fourth.host, fourth.port)
            ids.add(fourth.broker.config.instance_id)
            await client.wait_until(lambda: reached(client) == ids, timeout=WAIT)
            await fourth.wait_until(lambda: _running(fourth) == 1)
            jobs.cancel_scope.cancel()
        nursery.cancel_scope.cancel()


REPLICA = (
    "listen: 127.0.0.1:0\nslots: 2\nfast_reserve: 0\nunknown_share: 1.0\n"
    "services:\n  hold: {builtin: sleep}\n  noop: {builtin: noop}\n"
)


async def test_killing_a_replica_redials_onto_a_live_one_and_loses_nothing() -> None:
    """kill -9 of one of three replica processes mid-run: its running jobs raise JobLost
    (never a silent loss), every other job completes, and the pool re-dials onto live ones."""
    async with AsyncExitStack() as stack:
        daemons = [await stack.enter_async_context(open_execserver_process(REPLICA)) for _ in "abc"]
        proxy = await stack.enter_async_context(open_haproxy([(d.host, d.port) for d in daemons]))
        client = await stack.enter_async_context(
            client_for(proxy.address, connect_timeout=WAIT, pool_reprobe_interval=0.5, **GROWTH)
        )
        outcomes: Counter[str] = Counter()

        async def one(i: int) -> None:
            try:
                receipt = await client.run("hold", {"params": {"seconds": 0.05}}, job_id=f"j{i}")
                outcomes[receipt.status] += 1
            except JobLost:
                outcomes["lost"] += 1

        with trio.fail_after(120):
            async with trio.open_nursery() as jobs:
                for i in range(60):
                    jobs.start_soon(one, i)
                await client.wait_until(lambda: len(reached(client)) == 3)
                await client.wait_until(lambda: sum(outcomes.values()) >= 10)
                daemons[0].process.kill()
                for i in range(60, 120):
                    jobs.start_soon(one, i)
        assert sum(outcomes.values()) == 120
        assert outcomes["lost"] <= 2  # at most the killed replica's two slots
        assert outcomes["ok"] == 120 - outcomes["lost"]
        # After the kill the pool holds only live replicas, and new jobs still run.
        with trio.fail_after(WAIT):
            await client.wait_until(lambda: client.statistics().addresses[0].connections >= 1)
        assert (await client.run("noop", {})).status == "ok"


METADATA_ONLY = {"metadata": {"builtin": "noop"}}
EVERYTHING = {**METADATA_ONLY, "noop": {"builtin": "noop"}, "hold": {"builtin": "sleep"}}


async def test_a_mixed_fleet_behind_one_balancer_needs_no_configuration() -> None:
    """The first replica in rotation offers only metadata, the second everything. A client
    that knows only the balancer gets jobs of every service done: a job its first
    connection cannot serve waits while the pool grows to the second replica. A service
    nobody offers waits while the pool keeps looking, then raises ServiceNotOffered once
    it looked a whole pool_reprobe_interval; the pool holds one connection per replica."""
    async with trio.open_nursery() as nursery:
        meta = await start_execserver(nursery, services=METADATA_ONLY)
        full = await start_execserver(nursery, services=EVERYTHING)
        async with (
            open_haproxy([(meta.host, meta.port), (full.host, full.port)]) as proxy,
            client_for(
                proxy.address, pool_reprobe_interval=1.0, connect_timeout=1.0, **GROWTH
            ) as client,
        ):
            # the first connection landed on the metadata-only replica
            assert reached(client) == {meta.broker.config.instance_id}
            assert client.statistics().addresses[0].balanced
            noop = await client.run("noop", {})
            assert noop.instance_id == full.broker.config.instance_id
            async with trio.open_nursery() as jobs:
                for _ in range(6):
                    jobs.start_soon(client.run, "metadata", {})
                    jobs.start_soon(client.run, "noop", {})
            assert client.statistics().finished == 13
            with trio.fail_after(WAIT), pytest.raises(ServiceNotOffered):
                await client.run("nothing", {})
            (address,) = client.statistics().addresses
            assert address.connections == 2
            assert (await client.run("metadata", {})).status == "ok"
            assert client.statistics().addresses[0].connections == 2
        nursery.cancel_scope.cancel()


async def test_a_host_name_in_front_of_one_execserver_is_no_balancer() -> None:
    """``localhost:port`` reaches the execserver directly: its HELLO.addr is the socket's
    peer address, so the address is not balanced and an unknown service fails at once."""
    async with trio.open_nursery() as nursery:
        handle = await start_execserver(nursery)
        async with client_for(f"localhost:{handle.port}", **GROWTH) as client:
            (address,) = client.statistics().addresses
            assert address.instances == (handle.broker.config.instance_id,)
            assert not address.balanced
            with pytest.raises(UnknownService):
                await client.run("nothing", {})
            assert client.statistics().addresses[0].connections == 1
        nursery.cancel_scope.cancel()


async def test_one_execserver_under_two_addresses_counts_the_client_once() -> None:
    """The same execserver configured as ``127.0.0.1:port`` and ``localhost:port``: the
    second connection is closed as a duplicate, so the execserver counts one client."""
    async with trio.open_nursery() as nursery:
        handle = await start_execserver(nursery)
        async with client_for(
            f"127.0.0.1:{handle.port}", f"localhost:{handle.port}", **GROWTH
        ) as client:
            await client.wait_until(
                lambda: sum(a.connections for a in client.statistics().addresses) == 1,
                timeout=WAIT,
            )
            await handle.wait_until(lambda: len(handle.broker.statistics().connections) == 1)
            assert (await client.run("noop", {})).status == "ok"
            (link,) = client.links()
            await client.wait_until(lambda: client.links()[0].hello.clients == 1, timeout=WAIT)
            assert link.hello.instance_id == handle.broker.config.instance_id
        nursery.cancel_scope.cancel()


def _running(handle: ExecserverHandle) -> int:
    return sum(s.running for s in handle.broker.statistics().services)
