"""The fleet simulator: how fast it runs, and how close it comes to real daemons.

Run: ``.venv/bin/python benchmarks/sim.py`` (``--quick``: shorter runs;
``--no-real``: skip the real daemons; ``--no-big``: skip the 1,000-execserver run).

1. **Speed, 100 execservers and 20 fylrs** (``fleet-100x20``, 10 minutes of
   arrivals): virtual seconds per CPU second (one core), over the whole run and
   while the work arrives.
2. **Speed, 1,000 execservers and 100 fylrs** (``fleet-100x1000``: ten
   balancers of a hundred pods): CPU time for an hour of arrivals, one core
   (``--quick``: ten minutes).
3. **Faithfulness**: the two small scenarios (``one-execserver``: one
   execserver of four slots, three callers at 5, 2.5 and 1.25 calls/s;
   ``two-pods``: HAProxy in front of two execservers of four slots, two
   callers at 12.5 and 5 calls/s), seed 0 of each: the same jobs (arrival
   times, durations, priorities, callers) run on real daemons (execserver
   processes, their builtin ``sleep`` service; a real HAProxy; one
   ``BrokerClient`` per caller in this process; ``--repeats`` times, for the
   machine's own spread) and once in the simulator (deterministic). Compared:
   throughput, wait p50/p99 per priority, each caller's share of the jobs and
   p50 wait. A wait is from the call to the start of its job (the receipt's
   ``started_at`` against the caller's clock, one machine).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from typing import Any

import attrs
import bench_checkout  # noqa: F401  (tests.support is this checkout's)
import trio

from tests.support.haproxy import open_haproxy
from tests.support.processes import open_execserver_process
from trio_broker.core.client import ClientConfig
from trio_broker.testing.sim.library import SCENARIOS
from trio_broker.testing.sim.report import percentile
from trio_broker.testing.sim.scenario import Scenario
from trio_broker.testing.sim.trace import JobInput, Trace, plan
from trio_broker.testing.sim.world import World
from trio_broker.trio.client import BrokerClient, open_broker_client

EXECSERVER = """\
listen: 127.0.0.1:0
slots: {slots}
fast_reserve: 0
unknown_share: 1.0
services:
  hold: {{builtin: sleep}}
"""


# -- speed --------------------------------------------------------------------------------


def speed(name: str, duration: float) -> dict[str, float]:
    """One seed of a size scenario: its speed overall, and while the work arrives.

    Speeds are virtual seconds per CPU second of this process (one core: other
    work on a shared machine does not count), beside the wall time.
    """
    scenario = attrs.evolve(SCENARIOS[name](), duration=duration)
    world = World(plan(scenario, 0), record=False, log_size=0)
    wall, cpu = time.perf_counter(), time.process_time()
    world.run()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    loaded = [c for v, c in world.cpu if v <= duration]
    return {
        "arrivals": duration,
        "virtual": world.now,
        "wall": wall,
        "cpu": cpu,
        "speed": world.now / cpu,
        "loaded": duration / (loaded[-1] - loaded[0]) if len(loaded) > 1 else math.nan,
        "events": world.events,
        "events_per_s": world.events / cpu,
        "jobs": sum(1 for item in world.items if item.ended == "done"),
        "violations": len(world.violations),
    }


def print_speed(name: str, row: dict[str, float]) -> None:
    print(
        f"  {name}: {row['arrivals']:.0f} s of arrivals, {row['virtual']:.0f} s virtual in "
        f"{row['cpu']:.1f} CPU s ({row['wall']:.1f} s wall) = {row['speed']:.0f}x real time "
        f"({row['loaded']:.0f}x while the work arrives); {row['jobs']:.0f} jobs, "
        f"{row['events']:.0f} events ({row['events_per_s']:.0f}/CPU s), "
        f"{row['violations']:.0f} violations",
        flush=True,
    )


# -- faithfulness -------------------------------------------------------------------------


Outcome = tuple[JobInput, float, float]
"""A job, its wait, and when its run ended (seconds from the first arrival)."""


async def real_run(scenario: Scenario, jobs: Sequence[JobInput]) -> list[Outcome]:
    """The jobs on real daemons: execserver processes, HAProxy when the scenario has a balancer."""
    async with AsyncExitStack() as stack:
        pods = [
            await stack.enter_async_context(
                open_execserver_process(EXECSERVER.format(slots=spec.slots))
            )
            for spec in scenario.pods
            for _ in range(spec.count)
        ]
        if scenario.balancers:
            proxy = await stack.enter_async_context(
                open_haproxy([(pod.host, pod.port) for pod in pods])
            )
            address = proxy.address
        else:
            address = f"{pods[0].host}:{pods[0].port}"
        clients: dict[str, BrokerClient] = {}
        for spec in scenario.clients:
            config = ClientConfig(
                backend_id=spec.name,
                name=spec.name,
                version="bench",
                addresses=(address,),
                connect_timeout=120,
                retry_tick=spec.retry_tick,
                pool_grow_interval=spec.pool_grow_interval,
            )
            clients[spec.name] = await stack.enter_async_context(open_broker_client(config))
        outcomes: list[Outcome] = []
        start = trio.current_time() + 0.5
        wall_start = time.time() + (start - trio.current_time())

        async def call(job: JobInput) -> None:
            await trio.sleep_until(start + job.at)
            called = time.time()
            receipt = await clients[job.target].run(
                "hold", {"params": {"seconds": job.duration}}, priority=job.priority
            )
            outcomes.append((job, receipt.started_at - called, time.time() - wall_start))

        async with trio.open_nursery() as nursery:
            for job in jobs:
                nursery.start_soon(call, job)
        return outcomes


def simulated_run(trace: Trace) -> list[Outcome]:
    """The same jobs in the simulator (its latencies drawn from the trace's seed)."""
    world = World(trace, record=False, log_size=0)
    world.run()
    if world.violations:
        print(f"  (the simulated run broke a check: {world.violations[0]})")
    return [
        (
            item.job,
            math.nan if item.start_of_done is None else item.start_of_done - item.job.at,
            math.nan if item.ended_at is None else item.ended_at,
        )
        for item in world.items
    ]


def figures(outcomes: Sequence[Outcome]) -> dict[str, float]:
    """Throughput, wait p50/p99 per priority, and each caller's share and p50 wait."""
    first = min(job.at for job, _, _ in outcomes)
    last = max(end for _, _, end in outcomes)
    row: dict[str, float] = {"throughput": len(outcomes) / (last - first)}
    for priority in sorted({job.priority for job, _, _ in outcomes}, reverse=True):
        waits = [w for job, w, _ in outcomes if job.priority == priority]
        row[f"p{priority} wait p50"] = percentile(waits, 50)
        row[f"p{priority} wait p99"] = percentile(waits, 99)
    for client in sorted({job.target for job, _, _ in outcomes}):
        mine = [w for job, w, _ in outcomes if job.target == client]
        row[f"{client} share"] = len(mine) / len(outcomes)
        row[f"{client} wait p50"] = percentile(mine, 50)
    return row


def faithfulness(name: str, duration: float, repeats: int) -> None:
    """Seed 0's jobs on real daemons ``repeats`` times and once in the simulator."""
    scenario = attrs.evolve(SCENARIOS[name](), duration=duration)
    trace = plan(scenario, 0)
    print(f"\n{name}: {scenario.description}; {len(trace.jobs)} calls in {duration:.0f} s")
    reals = [figures(trio.run(real_run, scenario, trace.jobs)) for _ in range(repeats)]
    sim = figures(simulated_run(trace))
    print(
        f"  {'figure':<20} {'real (mean)':>12} {'real range':>17} {'simulated':>10} {'vs mean':>8}"
    )
    for key in reals[0]:
        values = [real[key] for real in reals]
        mean = sum(values) / len(values)
        other = sim.get(key, math.nan)
        diff = (other - mean) / mean if mean else math.nan
        unit = "/s" if key == "throughput" else ("" if "share" in key else " s")
        inside = "" if min(values) <= other <= max(values) else " (outside the real range)"
        print(
            f"  {key:<20} {mean:>10.3f}{unit:<2} {min(values):>7.3f}..{max(values):<7.3f} "
            f"{other:>8.3f}{unit:<2} {diff:>+8.1%}{inside}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--quick", action="store_true", help="shorter runs")
    parser.add_argument("--no-real", action="store_true", help="skip the real daemons")
    parser.add_argument("--no-big", action="store_true", help="skip the 1,000-execserver run")
    parser.add_argument(
        "--repeats", type=int, default=3, help="real runs of each small scenario (default 3)"
    )
    args: Any = parser.parse_args(argv)
    print("speed (one core, light checks: the simulator's own)")
    print_speed("fleet-100x20", speed("fleet-100x20", 120.0 if args.quick else 600.0))
    if not args.no_big:
        print_speed("fleet-100x1000", speed("fleet-100x1000", 600.0 if args.quick else 3600.0))
    if not args.no_real:
        for name in ("one-execserver", "two-pods"):
            faithfulness(name, 20.0 if args.quick else 60.0, 1 if args.quick else args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
