"""Throughput and slot-reuse gap of one execserver, against a bare websocket floor.

Run: ``.venv/bin/python benchmarks/execserver.py`` (``--seconds`` per phase).

In one run, with the server always in its own process (the real
``trio-broker execserver`` daemon, or a bare echo server for the floor) and the
load generator in this process:

1. **floor**: the round trip of one small text frame through a bare
   trio-websocket echo server on 127.0.0.1 (p50 and p99 of sequential trips);
2. **stack ceiling**: messages per second (in and out) through a bare hypercorn
   websocket echo server, the same server stack as the execserver's, pipelined;
3. **no-op jobs per second** through one execserver (16 slots, ``builtin: noop``)
   from 1 and from 4 client connections keeping 16 wants outstanding in all, so
   every job is WANT, OFFER, JOB, DONE; and once with a backlog of 64 wants on one
   connection, so every job is also answered QUEUED first (median of
   ``--repeat`` rounds; with ``--compare CHECKOUT`` the daemon of another
   checkout of this repository runs beside it, in alternating rounds). The load
   generator answers like a client's driver: a reader that decides, a writer that
   sends everything waiting in one write (``WebsocketConnection``). One more line
   runs the generator of the earlier figures (trio-websocket, one write per frame)
   against the daemon, to show what that generator itself allowed;
4. **slot-reuse gap** with a backlog: one slot, 60 queued wants, in rounds that
   alternate with floor round trips; the gap is a job's end to the next job's
   start, both read from the receipts the execserver wrote (``started_at`` +
   ``duration_s``), so it covers the grant, the OFFER, the client's JOB and the
   start of the next run. Its p50 is compared to the floor's p50 of the same rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import bench_checkout  # noqa: F401  (tests.support is this checkout's)
import psutil
import trio
from trio_websocket import WebSocketConnection, open_websocket_url

from tests.support.processes import DaemonProcess, open_execserver_process
from trio_broker.core import protocol as p
from trio_broker.trio.websocket import WebsocketConnection, connect

SLOTS = 16

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
async def execserver(slots: int, *, checkout: str | None = None) -> AsyncIterator[DaemonProcess]:
    """The reference daemon with ``slots`` slots and a no-op service.

    ``checkout``: run the daemon of another checkout of this repository (its
    ``trio_broker`` and ``daemons`` first on ``PYTHONPATH``), to compare with.
    """
    config = (
        "listen: 127.0.0.1:0\n"
        f"slots: {slots}\n"
        "fast_reserve: 0\n"
        "unknown_share: 1.0\n"
        "services:\n"
        "  noop: {builtin: noop}\n"
    )
    prefix = [] if checkout is None else ["env", f"PYTHONPATH={checkout}:{checkout}/daemons"]
    async with open_execserver_process(config, prefix=prefix) as daemon:
        yield daemon


HYPERCORN_ECHO = """
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            kind = message["type"].rsplit(".", 1)[1]
            await send({"type": f"lifespan.{kind}.complete"})
            if kind == "shutdown":
                return
    if scope["type"] != "websocket":
        return
    await receive()
    await send({"type": "websocket.accept"})
    while True:
        message = await receive()
        if message["type"] != "websocket.receive":
            return
        await send({"type": "websocket.send", "text": message["text"]})

async def main():
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = None
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(lambda task_status: serve(app, config, task_status=task_status))
        print(binds[0].rsplit(":", 1)[1], flush=True)

trio.run(main)
"""


@asynccontextmanager
async def _line_server(code: str) -> AsyncIterator[int]:
    """Run ``code`` in a new process; it prints its port on the first line."""
    proc = await trio.lowlevel.open_process([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = b""
        while not line.endswith(b"\n"):
            line += await proc.stdout.receive_some()
        yield int(line)
    finally:
        proc.terminate()
        await proc.wait()


async def stack_ceiling(seconds: float, window: int = 32) -> float:
    """Messages per second (in + out) a bare hypercorn websocket echo handles."""
    async with (
        _line_server(HYPERCORN_ECHO) as port,
        open_websocket_url(f"ws://127.0.0.1:{port}/") as ws,
    ):
        frame = p.encode(p.Want(job_id="job-000001", service="noop", priority=0))
        for _ in range(window):
            await ws.send_message(frame)
        count = 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            await ws.get_message()
            count += 1
            await ws.send_message(frame)
        return 2 * count / (time.perf_counter() - start)


async def round_trips(ws: WebSocketConnection, count: int) -> list[float]:
    """``count`` sequential round trips of one small frame, in seconds."""
    frame = p.encode(p.Want(job_id="job-000001", service="noop", priority=0))
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        await ws.send_message(frame)
        await ws.get_message()
        samples.append(time.perf_counter() - start)
    return samples


async def dial(url: str) -> WebsocketConnection:
    """A broker websocket to ``ws://host:port/broker`` on the library's transport."""
    host, port = url.removeprefix("ws://").split("/", 1)[0].rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    return await connect(stream, f"{host}:{port}", "/broker", max_message_bytes=1 << 20)


async def _driver(url: str, name: str, window: int, stop_at: float, counts: list[int]) -> None:
    """Keep ``window`` wants outstanding on one connection until ``stop_at``.

    A reader decides each answer as a frame comes; a writer sends whatever is
    waiting in one write, as the library's connection driver does.
    """
    ws = await dial(url)
    numbers = iter(range(10**9))
    outbox = [p.encode(p.Register(backend_id=name, name=name, version="bench"))]
    outbox += [
        p.encode(p.Want(job_id=f"{name}-{next(numbers)}", service="noop", priority=0))
        for _ in range(window)
    ]
    wake = trio.Event()
    finished = False

    async def writer() -> None:
        nonlocal wake, outbox
        while outbox or not finished:
            if not outbox:
                wake = trio.Event()
                await wake.wait()
                continue
            batch, outbox = outbox, []
            await ws.send_texts(batch)

    def send(message: p.Message) -> None:
        outbox.append(p.encode(message))
        wake.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer)
        stopping = False
        outstanding = window
        while outstanding:
            text = await ws.receive()
            assert text is not None, "the execserver closed the connection"
            message = p.decode(text, accept=p.EXEC_TO_CLIENT)
            if isinstance(message, p.Offer):
                send(p.Job(job_id=message.job_id, token=message.token, service="noop", job={}))
            elif isinstance(message, p.Done):
                counts[0] += 1
                if not stopping and time.perf_counter() >= stop_at:
                    stopping = True
                if stopping:
                    outstanding -= 1
                else:
                    send(p.Want(job_id=f"{name}-{next(numbers)}", service="noop", priority=0))
            elif isinstance(message, p.Ping):
                send(p.Pong(nonce=message.nonce))
        finished = True
        wake.set()
    with trio.move_on_after(2):
        await ws.close(p.CLOSE_NORMAL, "done")


async def _driver_one_write_per_frame(
    url: str, name: str, window: int, stop_at: float, counts: list[int]
) -> None:
    """The earlier generator: trio-websocket, one write per frame, nothing waits for the reader."""
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


async def throughput(
    url: str,
    connections: int,
    window: int,
    seconds: float,
    *,
    one_write_per_frame: bool = False,
    phases: list[float] | None = None,
) -> float:
    """No-op jobs per second over ``connections`` connections, ``window`` wants each.

    ``phases`` gets the jobs counted, after the warm-up phase that is not.
    """
    driver = _driver_one_write_per_frame if one_write_per_frame else _driver
    warm = [0]
    async with trio.open_nursery() as nursery:
        for i in range(connections):
            nursery.start_soon(driver, url, f"warm{i}", window, time.perf_counter() + 0.5, warm)
    if phases is not None:
        phases.append(warm[0])
    counts = [0]
    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(connections):
            nursery.start_soon(driver, url, f"c{i}", window, start + seconds, counts)
    if phases is not None:
        phases.append(counts[0])
    return counts[0] / (time.perf_counter() - start)


async def measured(
    daemon: DaemonProcess, connections: int, window: int, seconds: float
) -> tuple[float, float]:
    """No-op jobs/s (see :func:`throughput`) and the execserver's CPU seconds per job."""
    process = psutil.Process(daemon.process.pid)
    before = process.cpu_times()
    jobs: list[float] = []
    rate = await throughput(daemon.url, connections, window, seconds, phases=jobs)
    after = process.cpu_times()
    used = (after.user + after.system) - (before.user + before.system)
    # throughput() warms up first: that phase's CPU and jobs are both counted
    return rate, used / (jobs[0] + jobs[1])


async def reuse_gaps(url: str, backlog: int) -> list[float]:
    """Job end -> next job start on one slot, in seconds, from the receipts."""
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
    return [
        later.started_at - (earlier.started_at + earlier.duration_s)
        for earlier, later in itertools.pairwise(receipts[5:])
    ]


def _percentile(samples: list[float], q: int) -> float:
    return (
        statistics.quantiles(samples, n=100, method="inclusive")[q - 1] if q < 100 else max(samples)
    )


async def main(seconds: float, rounds: int, repeat: int, compare: str | None) -> None:
    async with (
        _line_server(ECHO_SERVER) as port,
        open_websocket_url(f"ws://127.0.0.1:{port}/") as echo,
    ):
        await round_trips(echo, 200)  # warm up
        floor = await round_trips(echo, 1000)
        print(f"floor: bare trio-websocket round trip p50 {_us(floor, 50)}, p99 {_us(floor, 99)}")
        ceiling = await stack_ceiling(seconds)
        print(f"stack ceiling: bare hypercorn websocket echo, {ceiling:,.0f} messages/s in+out")
        async with contextlib.AsyncExitStack() as stack:
            daemons = {"this checkout": await stack.enter_async_context(execserver(SLOTS))}
            if compare is not None:
                daemons[compare] = await stack.enter_async_context(
                    execserver(SLOTS, checkout=compare)
                )
            for connections, window, frames in ((1, SLOTS, 4), (4, SLOTS // 4, 4), (1, 64, 5)):
                runs: dict[str, list[tuple[float, float]]] = {name: [] for name in daemons}
                for _ in range(repeat):  # alternating, so all see the same machine
                    for name, daemon in daemons.items():
                        runs[name].append(await measured(daemon, connections, window, seconds))
                for name, results in runs.items():
                    rate = statistics.median(r for r, _ in results)
                    cpu = statistics.median(c for _, c in results) * 1e6
                    print(
                        f"no-op jobs/s, {connections} connection(s) x {window} wants, "
                        f"{SLOTS} slots, {name}: {rate:,.0f} ({cpu:.0f} µs execserver CPU/job; "
                        f"median of {repeat}; {frames} frames/job: "
                        f"{rate * frames / ceiling:.0%} of the stack ceiling)"
                    )
            url = daemons["this checkout"].url
            rate = await throughput(url, 1, SLOTS, seconds, one_write_per_frame=True)
            print(
                f"no-op jobs/s, 1 connection x {SLOTS} wants, this checkout, the earlier load "
                f"generator (trio-websocket, one write per frame): {rate:,.0f}"
            )
        # The gap and its floor are sampled in alternating rounds, so both see the
        # same machine: these 2-core virtual machines change speed from minute to minute.
        gaps: list[float] = []
        floor = []
        async with execserver(1) as one:
            url = one.url
            await reuse_gaps(url, 20)  # warm up
            for _ in range(rounds):
                floor += await round_trips(echo, 100)
                gaps += await reuse_gaps(url, 60)
        ratio = _percentile(gaps, 50) / _percentile(floor, 50)
        print(
            f"slot-reuse gap (1 slot, backlog 60, {rounds} rounds): p50 {_us(gaps, 50)}, "
            f"p99 {_us(gaps, 99)}; floor of the same rounds p50 {_us(floor, 50)}; "
            f"gap/floor p50 {ratio:.2f}x"
        )


def _us(samples: list[float], q: int) -> str:
    return f"{_percentile(samples, q) * 1e6:.0f} µs"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each phase")
    parser.add_argument("--rounds", type=int, default=10, help="rounds of the gap measurement")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of each throughput phase")
    parser.add_argument(
        "--compare",
        metavar="CHECKOUT",
        help="also run the daemon of this other checkout, in alternating rounds",
    )
    args = parser.parse_args()
    trio.run(main, args.seconds, args.rounds, args.repeat, args.compare)
