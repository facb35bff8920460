"""Throughput and slot-reuse gap of one execserver, against a bare websocket floor.

Run: ``.venv/bin/python benchmarks/execserver.py`` (``--seconds`` per phase).

In one run, with the server always in its own process (the real
``trio-broker execserver`` daemon, or a bare trio-websocket echo server for the
floor) and the load generator in this process:

1. **floor**: the round trip of one small text frame through a bare
   trio-websocket echo server on 127.0.0.1 (p50 and p99 of sequential trips);
2. **no-op jobs per second** through one execserver (8 slots, ``builtin: noop``)
   from 1 and from 4 client connections, each keeping 32 wants outstanding: every
   job is WANT, OFFER, JOB, DONE;
3. **slot-reuse gap** with a backlog: one slot, 200 queued wants; the gap is a
   job's end to the next job's start, both read from the receipts the execserver
   wrote (``started_at`` + ``duration_s``), so it covers the grant, the OFFER, the
   client's JOB and the start of the next run.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio
from trio_websocket import open_websocket_url

from trio_broker import protocol as p

ECHO_SERVER = """
import sys, trio
from trio_websocket import serve_websocket

async def echo(request):
    ws = await request.accept()
    while True:
        try:
            await ws.send_message(await ws.get_message())
        except Exception:
            return

async def main():
    async with trio.open_nursery() as nursery:
        servers = await nursery.start(serve_websocket, echo, "127.0.0.1", 0, None)
        print(servers.port, flush=True)

trio.run(main)
"""


@asynccontextmanager
async def echo_server() -> AsyncIterator[int]:
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-c", ECHO_SERVER], stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        line = b""
        while not line.endswith(b"\n"):
            line += await proc.stdout.receive_some()
        yield int(line)
    finally:
        proc.terminate()
        await proc.wait()


@asynccontextmanager
async def execserver(slots: int) -> AsyncIterator[str]:
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "exec.yml"
        config.write_text(
            "listen: 127.0.0.1:0\n"
            f"slots: {slots}\n"
            "fast_reserve: 0\n"
            "unknown_share: 1.0\n"
            "services:\n"
            "  noop: {builtin: noop}\n"
        )
        ready = Path(tmp) / "ready"
        os.mkfifo(ready)
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "trio_broker", "--log-level", "warning", "execserver",
             "--config", str(config), "--ready-file", str(ready)],
        )  # fmt: skip
        try:
            host, port = (await trio.to_thread.run_sync(ready.read_text)).split()
            yield f"ws://{host}:{port}/broker"
        finally:
            proc.terminate()
            await proc.wait()


async def floor(seconds: float) -> tuple[float, float]:
    """p50 and p99 round trip of a bare trio-websocket echo, in microseconds."""
    async with echo_server() as port, open_websocket_url(f"ws://127.0.0.1:{port}/") as ws:
        frame = p.encode(p.Want(job_id="job-000001", service="noop", priority=0))
        for _ in range(200):
            await ws.send_message(frame)
            await ws.get_message()
        samples = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            start = time.perf_counter()
            await ws.send_message(frame)
            await ws.get_message()
            samples.append(time.perf_counter() - start)
    return _percentile(samples, 50) * 1e6, _percentile(samples, 99) * 1e6


async def _driver(url: str, name: str, window: int, stop_at: float, counts: list[int]) -> None:
    """Keep ``window`` wants outstanding on one connection until ``stop_at``."""
    async with open_websocket_url(url) as ws:
        await ws.get_message()  # HELLO
        await ws.send_message(p.encode(p.Register(backend_id=name, name=name, version="bench")))
        numbers = iter(range(10**9))
        for _ in range(window):
            await ws.send_message(p.encode(p.Want(job_id=f"{name}-{next(numbers)}",
                                                  service="noop", priority=0)))  # fmt: skip
        stopping = False
        outstanding = window
        while outstanding:
            message = p.decode(await ws.get_message(), accept=p.EXEC_TO_CLIENT)
            if isinstance(message, p.Offer):
                await ws.send_message(p.encode(p.Job(job_id=message.job_id, token=message.token,
                                                     service="noop", job={})))  # fmt: skip
            elif isinstance(message, p.Done):
                counts[0] += 1
                if not stopping and time.perf_counter() >= stop_at:
                    stopping = True
                if stopping:
                    outstanding -= 1
                else:
                    await ws.send_message(p.encode(p.Want(job_id=f"{name}-{next(numbers)}",
                                                          service="noop", priority=0)))  # fmt: skip
            elif isinstance(message, p.Ping):
                await ws.send_message(p.encode(p.Pong(nonce=message.nonce)))


async def throughput(url: str, connections: int, seconds: float) -> float:
    """No-op jobs per second over ``connections`` connections."""
    warm = [0]
    async with trio.open_nursery() as nursery:
        for i in range(connections):
            nursery.start_soon(_driver, url, f"warm{i}", 32, time.perf_counter() + 0.5, warm)
    counts = [0]
    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(connections):
            nursery.start_soon(_driver, url, f"c{i}", 32, start + seconds, counts)
    return counts[0] / (time.perf_counter() - start)


async def reuse_gap(url: str, backlog: int) -> tuple[float, float]:
    """p50 and p99 of job end -> next job start on one slot, in microseconds."""
    receipts: list[p.Receipt] = []
    async with open_websocket_url(url) as ws:
        await ws.get_message()
        await ws.send_message(p.encode(p.Register(backend_id="gap", name="gap", version="b")))
        for n in range(backlog):
            await ws.send_message(p.encode(p.Want(job_id=f"g{n}", service="noop", priority=0)))
        while len(receipts) < backlog:
            message = p.decode(await ws.get_message(), accept=p.EXEC_TO_CLIENT)
            if isinstance(message, p.Offer):
                await ws.send_message(p.encode(p.Job(job_id=message.job_id, token=message.token,
                                                     service="noop", job={})))  # fmt: skip
            elif isinstance(message, p.Done):
                receipts.append(message.receipt)
            elif isinstance(message, p.Ping):
                await ws.send_message(p.encode(p.Pong(nonce=message.nonce)))
    receipts.sort(key=lambda r: r.started_at)
    gaps = [
        later.started_at - (earlier.started_at + earlier.duration_s)
        for earlier, later in itertools.pairwise(receipts[10:])
    ]
    return _percentile(gaps, 50) * 1e6, _percentile(gaps, 99) * 1e6


def _percentile(samples: list[float], q: int) -> float:
    return (
        statistics.quantiles(samples, n=100, method="inclusive")[q - 1] if q < 100 else max(samples)
    )


async def main(seconds: float) -> None:
    floor50, floor99 = await floor(seconds)
    print(f"floor: bare trio-websocket round trip p50 {floor50:.0f} µs, p99 {floor99:.0f} µs")
    async with execserver(slots=8) as url:
        for connections in (1, 4):
            rate = await throughput(url, connections, seconds)
            print(f"no-op jobs/s, {connections} connection(s), 8 slots: {rate:,.0f}")
    async with execserver(slots=1) as url:
        await reuse_gap(url, 20)  # warm up
        gap50, gap99 = await reuse_gap(url, 200)
    print(
        f"slot-reuse gap (1 slot, 200 backlog): p50 {gap50:.0f} µs ({gap50 / floor50:.2f}x floor), "
        f"p99 {gap99:.0f} µs ({gap99 / floor50:.2f}x floor p50)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each phase")
    trio.run(main, parser.parse_args().seconds)
