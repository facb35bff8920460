"""BrokerClient throughput, surplus offers, and how fast a burst spreads behind a balancer.

Run: ``.venv/bin/python benchmarks/client.py`` (``--seconds`` per throughput phase).

In one run, with every execserver in its own process (the real daemon):

1. **floor**: no-op jobs/s of one raw protocol connection keeping 16 wants
   outstanding on one execserver (what the wire and the server allow without any
   client logic: the same driver as ``benchmarks/execserver.py``);
2. **one client, three execservers**: no-op jobs/s of a :class:`BrokerClient`
   with 16 and 48 concurrent ``run()`` callers against three execservers of
   16 slots each, and the surplus offers per job (every want is parked on all
   three, so the losers' offers are declined);
3. **burst behind HAProxy**: three replicas of 4 slots behind one HAProxy port,
   a fresh client with one connection, 100 jobs of 0.2 s submitted at once. It
   reports when every replica was reached, the makespan, and the same burst with
   the three replicas configured as literal addresses (no growth needed), next to
   the ideal makespan ``ceil(100 / 12) x 0.2 s``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import bench_checkout  # noqa: F401  (tests.support is this checkout's)
import trio
from execserver import throughput

from tests.support.haproxy import open_haproxy
from tests.support.processes import DaemonProcess, open_execserver_process
from trio_broker.core.client import ClientConfig
from trio_broker.trio.client import BrokerClient, open_broker_client


def replica_config(slots: int) -> str:
    return (
        "listen: 127.0.0.1:0\n"
        f"slots: {slots}\n"
        "fast_reserve: 0\n"
        "unknown_share: 1.0\n"
        "services:\n"
        "  noop: {builtin: noop}\n"
        "  hold: {builtin: sleep}\n"
    )


@asynccontextmanager
async def replicas(count: int, slots: int) -> AsyncIterator[list[DaemonProcess]]:
    async with AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(open_execserver_process(replica_config(slots)))
            for _ in range(count)
        ]


def client(*addresses: str, **overrides: float) -> ClientConfig:
    return ClientConfig(
        backend_id="bench",
        name="bench",
        version="1",
        addresses=addresses,
        connect_timeout=120,
        retry_tick=overrides.pop("retry_tick", 0.2),
        pool_grow_interval=overrides.pop("pool_grow_interval", 0.2),
    )


async def client_rate(broker: BrokerClient, callers: int, seconds: float) -> tuple[float, float]:
    """No-op jobs/s with ``callers`` concurrent run() loops, and surplus offers per job."""
    done = [0]
    before = broker.statistics().surplus_offers
    stop_at = time.perf_counter() + seconds

    async def loop() -> None:
        while time.perf_counter() < stop_at:
            await broker.run("noop", {})
            done[0] += 1

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(callers):
            nursery.start_soon(loop)
    elapsed = time.perf_counter() - start
    surplus = broker.statistics().surplus_offers - before
    return done[0] / elapsed, surplus / max(done[0], 1)


async def burst(config: ClientConfig, jobs: int, seconds: float) -> tuple[float, float]:
    """(seconds until every replica was reached, makespan) for a burst from a fresh client."""
    async with open_broker_client(config) as broker:
        start = time.perf_counter()
        spread = [math.nan]

        async def watch() -> None:
            await broker.wait_until(
                lambda: sum(len(a.instances) for a in broker.statistics().addresses) >= 3
            )
            spread[0] = time.perf_counter() - start

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            async with trio.open_nursery() as work:
                for _ in range(jobs):
                    work.start_soon(broker.run, "hold", {"params": {"seconds": seconds}})
            makespan = time.perf_counter() - start
            nursery.cancel_scope.cancel()
        return spread[0], makespan


async def main(seconds: float) -> None:
    async with replicas(3, 16) as fleet:
        addresses = [f"{d.host}:{d.port}" for d in fleet]
        await throughput(fleet[0].url, 1, 16, 0.5)  # warm up
        floor = await throughput(fleet[0].url, 1, 16, seconds)
        print(f"floor: raw protocol, 1 connection x 16 wants, one execserver: {floor:,.0f} jobs/s")
        async with open_broker_client(client(*addresses)) as broker:
            await client_rate(broker, 16, 0.5)  # warm up
            for callers in (16, 48):
                rate, surplus = await client_rate(broker, callers, seconds)
                print(
                    f"BrokerClient, {callers} callers, 3 execservers x 16 slots: "
                    f"{rate:,.0f} jobs/s "
                    f"({rate / floor:.0%} of the floor), {surplus:.2f} surplus offers per job"
                )
    jobs, hold, slots = 100, 0.2, 4
    ideal = math.ceil(jobs / (3 * slots)) * hold
    async with replicas(3, slots) as fleet:
        addresses = [f"{d.host}:{d.port}" for d in fleet]
        _, literal = await burst(client(*addresses), jobs, hold)
        async with open_haproxy([(d.host, d.port) for d in fleet]) as proxy:
            spread, balanced = await burst(client(proxy.address), jobs, hold)
    print(
        f"burst of {jobs} x {hold}s jobs on 3 replicas x {slots} slots: behind HAProxy "
        f"all replicas reached after {spread:.2f}s, makespan {balanced:.2f}s; "
        f"literal addresses makespan {literal:.2f}s; ideal {ideal:.2f}s"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per throughput phase")
    args = parser.parse_args()
    trio.run(main, args.seconds)
