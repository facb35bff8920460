"""The slot hand-over through a BrokerClient, against the round trip it cannot beat.

Run: ``.venv/bin/python benchmarks/handover.py`` (``--rounds``, ``--jobs`` per round).

In one run, with the execserver (the real ``trio-broker execserver`` daemon, one
slot) and a bare echo server each in its own process and the
:class:`~trio_broker.trio.client.BrokerClient` in this process:

1. **the gap**: ``--jobs`` jobs kept waiting on the one slot by as many
   concurrent ``run()`` calls (a backlog), of 0 ms (``builtin: noop``) and of
   20 ms (``builtin: sleep``). The gap is one job's end to the next job's start
   on the slot, both read from the receipts (``started_at`` + ``duration_s``):
   the runner's end, the broker core, the ``DONE`` and the ``OFFER`` to the
   client, its decision and its ``JOB``, the start of the next run.
2. **the floor, like for like**: round trips of one small text frame through a
   bare echo server on the same stack (the library's listener and its wsproto
   connection on both ends), back to back, and after the same idle time as the
   job (20 ms): an idle machine lets its CPUs sleep, and the first round trip
   after that is slower. The gap of 0 ms jobs is held against the back-to-back
   round trip, the gap of 20 ms jobs against the round trip after 20 ms.

Gap rounds alternate with floor rounds, so both see the same machine; the
figures are the p50 and p90 over all rounds.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import bench_checkout  # noqa: F401  (tests.support is this checkout's)
import trio

from tests.support.processes import open_execserver_process
from trio_broker.core import protocol as p
from trio_broker.core.client import ClientConfig
from trio_broker.trio.client import BrokerClient, open_broker_client
from trio_broker.trio.websocket import WebsocketConnection, connect

IDLE = 0.020
"""The job length of the second case, and the idle time before its floor's round trips."""

CONFIG = """\
listen: 127.0.0.1:0
slots: 1
fast_reserve: 0
unknown_share: 1.0
services:
  noop: {builtin: noop}
  hold: {builtin: sleep}
"""

ECHO_SERVER = """
import trio
from trio_broker.trio.listener import listener_config, serve_app
from trio_broker.trio.websocket import accept

async def echo(stream, head, request):
    ws = await accept(stream, head, max_message_bytes=1 << 20)
    if ws is None:
        return
    while (text := await ws.receive()) is not None:
        await ws.send_texts([text])
    await ws.close(1000, "bye")

async def app(scope, receive, send):
    pass

async def main():
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(
            lambda task_status: serve_app(
                app, listener_config("127.0.0.1:0"), websockets={"/echo": echo},
                task_status=task_status,
            )
        )
        print(port, flush=True)

trio.run(main)
"""


@asynccontextmanager
async def echo_server() -> AsyncIterator[WebsocketConnection]:
    """A bare echo server in its own process, and a connection to it."""
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-c", ECHO_SERVER], stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        line = b""
        while not line.endswith(b"\n"):
            line += await proc.stdout.receive_some()
        port = int(line)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        ws = await connect(stream, f"127.0.0.1:{port}", "/echo", max_message_bytes=1 << 20)
        try:
            yield ws
        finally:
            with trio.move_on_after(2):
                await ws.close(p.CLOSE_NORMAL, "done")
    finally:
        proc.terminate()
        await proc.wait()


async def round_trips(ws: WebsocketConnection, count: int, idle: float) -> list[float]:
    """``count`` round trips of one small frame, each after ``idle`` seconds of nothing."""
    frame = p.encode(p.Want(job_id="job-000001", service="noop", priority=0))
    samples = []
    for _ in range(count):
        if idle:
            await trio.sleep(idle)
        start = time.perf_counter()
        await ws.send_texts([frame])
        await ws.receive()
        samples.append(time.perf_counter() - start)
    return samples


async def gaps(client: BrokerClient, service: str, seconds: float, jobs: int) -> list[float]:
    """Job end -> next job start on the one slot, from the receipts of ``jobs`` jobs."""
    job = {"params": {"seconds": seconds}} if seconds else {}
    receipts: list[p.Receipt] = []

    async def one() -> None:
        receipts.append(await client.run(service, job))

    async with trio.open_nursery() as nursery:
        for _ in range(jobs):
            nursery.start_soon(one)
    receipts.sort(key=lambda r: r.started_at)
    return [
        later.started_at - (earlier.started_at + earlier.duration_s)
        for earlier, later in itertools.pairwise(receipts[2:])  # the first ones wait to start
    ]


def _percentile(samples: list[float], q: int) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[q - 1]


def _us(samples: list[float], q: int) -> str:
    return f"{_percentile(samples, q) * 1e6:.0f} µs"


async def main(rounds: int, jobs: int) -> None:
    async with (
        echo_server() as echo,
        open_execserver_process(CONFIG) as daemon,
        open_broker_client(
            ClientConfig(
                backend_id="handover",
                name="handover",
                version="1",
                addresses=(f"{daemon.host}:{daemon.port}",),
                connect_timeout=60,
            )
        ) as client,
    ):
        await round_trips(echo, 100, 0.0)  # warm up
        await gaps(client, "noop", 0.0, jobs)
        for label, service, seconds in (
            ("0 ms", "noop", 0.0),
            (f"{IDLE * 1e3:.0f} ms", "hold", IDLE),
        ):
            gap: list[float] = []
            floor: list[float] = []
            for _ in range(rounds):
                floor += await round_trips(echo, 50 if seconds else 200, seconds)
                gap += await gaps(client, service, seconds, jobs)
            ratio = _percentile(gap, 50) / _percentile(floor, 50)
            after = f"after {seconds * 1e3:.0f} ms idle" if seconds else "back to back"
            print(
                f"{label} jobs, 1 slot, backlog of {jobs}: "
                f"gap p50 {_us(gap, 50)}, p90 {_us(gap, 90)}; "
                f"echo round trip {after} p50 {_us(floor, 50)}, p90 {_us(floor, 90)}; "
                f"gap/round trip p50 {ratio:.2f}x ({len(gap)} gaps, {len(floor)} round trips)"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="alternating gap/floor rounds")
    parser.add_argument("--jobs", type=int, default=40, help="jobs per gap round")
    args = parser.parse_args()
    trio.run(main, args.rounds, args.jobs)
