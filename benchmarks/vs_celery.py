"""trio_broker against Celery on Redis: the same jobs, the same four slots, in one run.

Run: ``make bench-celery``, or ``.venv/bin/pip install -e '.[bench-celery]'``,
``scripts/system-packages redis`` and ``.venv/bin/python benchmarks/vs_celery.py``
(``--quick``: small sizes, one round, for development).

The systems, each started afresh in its turn and stopped after it:

- **trio_broker**: a real ``trio-broker execserver`` daemon with 4 slots (and
  one with 1 slot for the gap), jobs through :meth:`BrokerClient.run` from this
  process; no-op jobs are ``builtin: noop``, 20 ms jobs ``builtin: sleep``.
- **Celery threads / prefork**: one worker with concurrency 4 (and one with 1
  for the gap), ``-P threads`` or ``-P prefork``, tuned: prefetch multiplier 1
  and late acks (``benchmarks/_celery_tasks.py``); no gossip, mingle or event
  heartbeat. Broker and result backend are one ``redis-server`` on a loopback
  port, started in a temporary folder by this script and stopped at its end.
  Jobs go as ``send_task(...)`` and come back through ``AsyncResult.get()``
  (16 callers: one thread each) or ``ResultSet.get()`` (many at once).

The systems take turns, three rounds (the order rotates each round), and every
figure is printed as the median and the range over the rounds. Job timings are
read inside the job in both systems with ``time.time()`` (the execserver's
receipt ``started_at`` and its duration; the Celery task's own two readings),
submit times in this process with the same clock.

Figures:

1. no-op jobs/s from 16 callers (each runs one job after another), and with all
   jobs submitted at once;
2. the slot-reuse gap on 1 slot (a job's end to the next job's start) with a
   backlog of 20 ms jobs, p50, against the floor of the same rounds: a bare
   websocket round trip after 20 ms of idleness (the library's listener and
   connection on both ends, as ``benchmarks/handover.py``), and for Redis a
   ``PING`` after the same idleness;
3. priority: a backlog of 500 low 20 ms jobs, then 5 high ones (probes) submitted
   while it lasts. Ideal: a probe starts at the first slot end after its submit.
   Worst excess over that, and inversions: low jobs that took a slot freed after
   a probe's submit and before the probe started. Which slot a job took is
   rebuilt from the timings (each start takes the slot freed earliest);
4. fairness: producer A submits a flood of 2,000 20 ms jobs at once, producer B
   runs one job at a time until A's flood is done. B's share of the slot time
   while the flood lasts (ideal 0.25: one slot of 4) and B's mean wait beyond
   the first slot end after its submit, and the slot time used by anyone (ideal 1).
   trio_broker: A and B are two BrokerClients; Celery: one queue, and a queue
   per producer (the worker consumes both);
5. idle: messages/s and bytes/s between the parts, a fresh pair left alone for
   ``--idle`` seconds after 2 s of settling: the client and the execserver; the
   Celery worker (4) and Redis. Counted by the kernel on every TCP connection
   between them (``ss -ti``: data-carrying segments both ways, and payload bytes),
   so nothing sits between the parts;
6. CPU per job in the 16-caller phase: the execserver, or the worker (its
   children too) and Redis; and this process, the client.

The machine's other load shows in every figure; compare figures of one run.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import heapq
import importlib.util
import itertools
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import attrs
import bench_checkout  # noqa: F401  (tests.support is this checkout's)
import psutil
import trio

from tests.support.processes import DaemonProcess, open_execserver_process
from trio_broker.core.client import ClientConfig
from trio_broker.trio.client import BrokerClient, open_broker_client

HERE = Path(__file__).resolve().parent
T = TypeVar("T")
SLOTS = 4
JOB = 0.020
"""The length of the jobs that hold a slot (gap, priority, fairness), and the floor's idle time."""
SETTLE = 2.0
"""Seconds a fresh pair is left alone before its idle traffic is counted."""
PROBES = 5
CALLERS = 16
WAIT = 300.0
"""Seconds a job may take from its submit to its result before the run fails."""


@attrs.frozen
class Sizes:
    """How much of everything one run does."""

    rounds: int
    warm: int  # no-op jobs before the throughput phases, not counted
    callers_jobs: int  # no-op jobs from 16 callers
    at_once: int  # no-op jobs submitted at once
    gap_backlog: int  # 20 ms jobs on 1 slot
    backlog: int  # low jobs before the priority probes
    flood: int  # producer A's jobs
    idle: float  # seconds of idleness counted


FULL = Sizes(rounds=3, warm=200, callers_jobs=3000, at_once=5000, gap_backlog=40,
             backlog=500, flood=2000, idle=20.0)  # fmt: skip
QUICK = Sizes(rounds=1, warm=50, callers_jobs=300, at_once=500, gap_backlog=15,
              backlog=100, flood=200, idle=4.0)  # fmt: skip


# -- the figures, from job timings (pure) --------------------------------------------------


@attrs.frozen
class Run:
    """One job: submitted (in this process), started and ended (inside the job): ``time.time()``."""

    submit: float
    start: float
    end: float
    tag: str = ""


def reuse_gaps(runs: Sequence[Run]) -> list[float]:
    """A job's end to the next job's start, on one slot (the first two jobs left out)."""
    ordered = sorted(runs, key=lambda r: r.start)[2:]
    return [b.start - a.end for a, b in itertools.pairwise(ordered)]


def freed_at(runs: Sequence[Run], slots: int) -> dict[int, float]:
    """For each job (by index), when the slot it took was freed (``-inf``: free from the start).

    Rebuilt from the timings alone: in start order, each job takes the slot freed
    earliest (a freed slot is taken by the next start).
    """
    free = [-float("inf")] * slots
    heapq.heapify(free)
    taken: dict[int, float] = {}
    for index in sorted(range(len(runs)), key=lambda i: runs[i].start):
        taken[index] = heapq.heappop(free)
        heapq.heappush(free, runs[index].end)
    return taken


def next_end(ends: Sequence[float], after: float) -> float:
    """The first of the sorted ``ends`` after ``after`` (``after`` itself when there is none)."""
    at = bisect.bisect_right(ends, after)
    return ends[at] if at < len(ends) else after


def priority_figures(runs: Sequence[Run], slots: int) -> tuple[float, int]:
    """Worst excess of a ``high`` job's start over the first slot end after its submit,
    and the inversions: ``low`` jobs that took a slot freed after a ``high`` job's
    submit and started before it."""
    ends = sorted(r.end for r in runs)
    taken = freed_at(runs, slots)
    worst = -float("inf")
    inversions = 0
    for high in (r for r in runs if r.tag == "high"):
        worst = max(worst, high.start - next_end(ends, high.submit))
        inversions += sum(
            1
            for i, r in enumerate(runs)
            if r.tag == "low" and taken[i] > high.submit and r.start < high.start
        )
    return worst, inversions


def slot_share(runs: Sequence[Run], slots: int, begin: float, end: float) -> float:
    """The share of the slot time between ``begin`` and ``end`` that ``runs`` held."""
    held = sum(max(0.0, min(r.end, end) - max(r.start, begin)) for r in runs)
    return held / (slots * (end - begin))


def fairness_figures(
    runs: Sequence[Run], slots: int, begin: float, end: float
) -> tuple[float, float]:
    """B's share of the slot time between ``begin`` and ``end``, and B's mean wait
    beyond the first slot end after each of its submits."""
    ends = sorted(r.end for r in runs)
    mine = [r for r in runs if r.tag == "b"]
    waits = [r.start - next_end(ends, r.submit) for r in mine]
    return slot_share(mine, slots, begin, end), statistics.mean(waits) if waits else float("nan")


def flood_figures(runs: Sequence[Run], slots: int, begin: float) -> dict[str, float]:
    """B's share and wait (:func:`fairness_figures`) and the share of slot time used by
    anyone, from ``begin`` to the end of A's last job."""
    end = max(r.end for r in runs if r.tag == "a")
    share, wait = fairness_figures(runs, slots, begin, end)
    return {"share": share, "wait": wait, "busy": slot_share(runs, slots, begin, end)}


# -- traffic on the wire, counted by the kernel ------------------------------------------


@attrs.frozen
class Traffic:
    """Data-carrying TCP segments and payload bytes, both directions, summed over connections."""

    segments: int
    payload: int
    connections: int


def tcp_traffic(remote_port: int, local_ports: set[int] | None = None) -> Traffic:
    """What the kernel counted on the established connections to ``127.0.0.1:remote_port``
    (only those from ``local_ports``, when given), read from ``ss -ti``."""
    out = subprocess.run(
        ["ss", "-tinH", "state", "established", "(", "dport", "=", f":{remote_port}", ")"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    segments = payload = connections = 0
    counted = False
    for line in out.splitlines():
        if not line[:1].isspace():
            local = line.split()[2]
            counted = local_ports is None or int(local.rsplit(":", 1)[1]) in local_ports
            connections += counted
            continue
        if not counted:
            continue
        fields = dict(f.split(":", 1) for f in line.split() if ":" in f and "(" not in f)
        segments += int(fields.get("data_segs_out", 0)) + int(fields.get("data_segs_in", 0))
        payload += int(fields.get("bytes_sent", 0)) + int(fields.get("bytes_received", 0))
    return Traffic(segments=segments, payload=payload, connections=connections)


async def idle_rates(count: Callable[[], Traffic], seconds: float) -> dict[str, float]:
    """Messages/s and bytes/s counted by ``count`` over ``seconds`` of idleness."""
    await trio.sleep(SETTLE)
    before, started = count(), time.monotonic()
    await trio.sleep(seconds)
    after, took = count(), time.monotonic() - started
    return {
        "idle_msgs": (after.segments - before.segments) / took,
        "idle_bytes": (after.payload - before.payload) / took,
        "idle_conns": after.connections,
    }


def cpu_seconds(processes: Sequence[psutil.Process]) -> float:
    """User and system CPU seconds the processes used so far."""
    return sum(t.user + t.system for t in (proc.cpu_times() for proc in processes))


async def cpu_per_job(
    parts: Sequence[psutil.Process], phase: Callable[[], Any]
) -> tuple[float, dict[str, float]]:
    """Run ``phase`` (it returns jobs/s and ran ``jobs`` jobs), and the CPU per job it cost
    the parts and this process (the client)."""
    me = [psutil.Process()]
    parts_before, client_before = cpu_seconds(parts), cpu_seconds(me)
    rate, jobs = await phase()
    return rate, {
        "cpu_parts": (cpu_seconds(parts) - parts_before) / jobs,
        "cpu_client": (cpu_seconds(me) - client_before) / jobs,
    }


# -- trio_broker --------------------------------------------------------------------------


def _execserver_config(slots: int) -> str:
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
async def _client(daemon: DaemonProcess, name: str) -> AsyncIterator[BrokerClient]:
    config = ClientConfig(
        backend_id=name,
        name=name,
        version="1",
        addresses=(f"{daemon.host}:{daemon.port}",),
        connect_timeout=WAIT,
    )
    async with open_broker_client(config) as client:
        yield client


async def _trio_run(client: BrokerClient, service: str, tag: str = "", priority: int = 0) -> Run:
    job = {"params": {"seconds": JOB}} if service == "hold" else {}
    submit = time.time()
    receipt = await client.run(service, job, priority=priority)
    if receipt.status != "ok":
        raise RuntimeError(f"a {service} job ended {receipt.status}: {receipt.error}")
    return Run(submit, receipt.started_at, receipt.started_at + receipt.duration_s, tag)


async def _trio_many(
    client: BrokerClient, count: int, service: str, tag: str = "", priority: int = 0
) -> list[Run]:
    runs: list[Run] = []

    async def one() -> None:
        runs.append(await _trio_run(client, service, tag, priority))

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(one)
    return runs


async def _trio_callers(client: BrokerClient, jobs: int) -> float:
    numbers = itertools.count()

    async def caller() -> None:
        while next(numbers) < jobs:
            await _trio_run(client, "noop")

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(CALLERS):
            nursery.start_soon(caller)
    return jobs / (time.perf_counter() - start)


async def _trio_priority(client: BrokerClient, backlog: int) -> list[Run]:
    runs: list[Run] = []

    async def one(tag: str, priority: int) -> None:
        runs.append(await _trio_run(client, "hold", tag, priority))

    async with trio.open_nursery() as nursery:
        for _ in range(backlog):
            nursery.start_soon(one, "low", 0)
        for delay in _probe_delays(backlog):
            await trio.sleep(delay)
            nursery.start_soon(one, "high", 1)
    return runs


async def _trio_fairness(daemon: DaemonProcess, flood: int) -> dict[str, float]:
    async with _client(daemon, "producer-a") as a, _client(daemon, "producer-b") as b:
        runs: list[Run] = []
        done = trio.Event()

        async def producer_a() -> None:
            runs.extend(await _trio_many(a, flood, "hold", "a"))
            done.set()

        async def producer_b() -> None:
            while not done.is_set():
                runs.append(await _trio_run(b, "hold", "b"))

        begin = time.time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(producer_a)
            nursery.start_soon(producer_b)
    return flood_figures(runs, SLOTS, begin)


async def trio_turn(sizes: Sizes) -> dict[str, float]:
    """Every figure of one round, for trio_broker."""
    figures: dict[str, float] = {}
    async with (
        open_execserver_process(_execserver_config(SLOTS)) as four,
        open_execserver_process(_execserver_config(1)) as one,
    ):
        async with _client(four, "idle"):
            figures |= await idle_rates(lambda: tcp_traffic(four.port), sizes.idle)
        async with _client(four, "bench") as client:
            await _trio_callers(client, sizes.warm)

            async def callers() -> tuple[float, int]:
                return await _trio_callers(client, sizes.callers_jobs), sizes.callers_jobs

            parts = [psutil.Process(four.process.pid)]
            figures["jobs16"], cpu = await cpu_per_job(parts, callers)
            figures |= cpu
            start = time.perf_counter()
            await _trio_many(client, sizes.at_once, "noop")
            figures["jobs_all"] = sizes.at_once / (time.perf_counter() - start)
            runs = await _trio_priority(client, sizes.backlog)
            figures["excess"], figures["inversions"] = priority_figures(runs, SLOTS)
        async with _client(one, "gap") as client:
            gaps = reuse_gaps(await _trio_many(client, sizes.gap_backlog, "hold"))
            figures["gap"] = statistics.median(gaps)
        figures |= await _trio_fairness(four, sizes.flood)
    return figures


def _probe_delays(backlog: int) -> list[float]:
    """The pause before each probe: an eighth of the backlog's length (so 5/8 in all)."""
    lasts = backlog * JOB / SLOTS
    return [lasts / 8] * PROBES


# -- Celery -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@attrs.frozen
class RedisServer:
    """A running ``redis-server``: its port and its process."""

    port: int
    process: psutil.Process


@asynccontextmanager
async def redis_server(folder: Path) -> AsyncIterator[RedisServer]:
    """A ``redis-server`` on a free loopback port, in ``folder``, without persistence."""
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server not found: run scripts/system-packages redis (or make bench-celery)")
    port = _free_port()
    log = (folder / "redis.log").open("wb")
    proc = await trio.lowlevel.open_process(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder),
         "--save", "", "--appendonly", "no", "--daemonize", "no"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        with trio.fail_after(30):
            while True:  # a benchmark may poll: wait until it listens
                try:
                    stream = await trio.open_tcp_stream("127.0.0.1", port)
                except OSError:
                    await trio.sleep(0.05)
                    continue
                await stream.aclose()
                break
        yield RedisServer(port, psutil.Process(proc.pid))
    finally:
        with trio.CancelScope(shield=True):
            proc.terminate()
            await proc.wait()
            log.close()


@asynccontextmanager
async def celery_worker(
    url: str, pool: str, concurrency: int, queues: Sequence[str], folder: Path
) -> AsyncIterator[trio.Process]:
    """``celery worker`` of ``benchmarks/_celery_tasks.py``, until it said it consumes."""
    name = f"{pool}{concurrency}-{'-'.join(queues)}"
    env = dict(os.environ, BENCH_REDIS_URL=url)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    log_path = folder / f"{name}.log"
    log = log_path.open("wb")
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "celery", "--quiet", "-A", "_celery_tasks", "worker",
         "-P", pool, "-c", str(concurrency), "-Q", ",".join(queues), "-n", f"{name}@bench",
         "--without-gossip", "--without-mingle", "--without-heartbeat", "--loglevel", "WARNING"],
        stdout=subprocess.PIPE, stderr=log, env=env, cwd=folder,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        seen = b""
        with trio.fail_after(120):
            while b"ready\n" not in seen:
                chunk = await proc.stdout.receive_some()
                if not chunk:
                    raise RuntimeError(f"the Celery worker {name} exited; see {log_path}")
                seen += chunk
        yield proc
    finally:
        with trio.CancelScope(shield=True):
            proc.send_signal(signal.SIGTERM)
            with trio.move_on_after(30):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            log.close()


def _worker_ports(proc: trio.Process, redis_port: int) -> set[int]:
    """The local ports of a worker's connections (its children's too) to Redis."""
    parent = psutil.Process(proc.pid)
    ports: set[int] = set()
    for process in [parent, *parent.children(recursive=True)]:
        for conn in process.net_connections(kind="tcp"):
            if conn.raddr and conn.raddr.port == redis_port:
                ports.add(conn.laddr.port)
    return ports


async def _in_thread(call: Callable[[], T]) -> T:
    """Run a blocking call in a thread; Ctrl-C abandons it (the run then stops the parts)."""
    return await trio.to_thread.run_sync(call, abandon_on_cancel=True)


class CeleryClient:
    """The producer side, blocking calls for threads: ``send_task`` and ``get``."""

    def __init__(self, url: str) -> None:
        from _celery_tasks import make_app

        self.app = make_app(url)

    def send(self, name: str, queue: str, priority: int | None = None) -> tuple[float, Any]:
        args = [JOB] if name == "bench.hold" else []
        submit = time.time()
        return submit, self.app.send_task(name, args=args, queue=queue, priority=priority)

    def run(self, name: str, queue: str, tag: str = "", priority: int | None = None) -> Run:
        submit, result = self.send(name, queue, priority)
        start, end = result.get(timeout=WAIT)
        return Run(submit, start, end, tag)

    def wait(self, sent: Sequence[tuple[float, Any]], tags: Sequence[str]) -> list[Run]:
        from celery.result import ResultSet

        values = ResultSet([result for _, result in sent], app=self.app).get(timeout=WAIT)
        return [Run(s, b, e, t) for (s, _), (b, e), t in zip(sent, values, tags, strict=True)]

    def many(self, count: int, name: str, queue: str, tag: str = "") -> list[Run]:
        sent = [self.send(name, queue) for _ in range(count)]
        return self.wait(sent, [tag] * count)

    def callers(self, jobs: int, queue: str) -> float:
        numbers = itertools.count()

        def caller() -> None:
            while next(numbers) < jobs:
                self.run("bench.noop", queue)

        start = time.perf_counter()
        with ThreadPoolExecutor(CALLERS) as pool:
            for future in [pool.submit(caller) for _ in range(CALLERS)]:
                future.result()
        return jobs / (time.perf_counter() - start)

    def at_once(self, jobs: int, queue: str) -> float:
        start = time.perf_counter()
        self.many(jobs, "bench.noop", queue)
        return jobs / (time.perf_counter() - start)

    def priority(self, backlog: int, queue: str) -> list[Run]:
        # Redis priorities in Celery: 0 is served first, 9 last.
        sent = [self.send("bench.hold", queue, 9) for _ in range(backlog)]
        for delay in _probe_delays(backlog):
            time.sleep(delay)
            sent.append(self.send("bench.hold", queue, 0))
        return self.wait(sent, ["low"] * backlog + ["high"] * PROBES)

    def fairness(self, flood: int, queue_a: str, queue_b: str) -> dict[str, float]:
        done = threading.Event()
        runs: list[Run] = []

        def producer_b() -> None:
            while not done.is_set():
                runs.append(self.run("bench.hold", queue_b, "b"))

        begin = time.time()
        with ThreadPoolExecutor(1) as pool:
            b = pool.submit(producer_b)
            try:
                runs.extend(self.many(flood, "bench.hold", queue_a, "a"))
            finally:
                done.set()
            b.result()
        return flood_figures(runs, SLOTS, begin)


async def celery_turn(
    redis: RedisServer, pool: str, sizes: Sizes, folder: Path
) -> dict[str, float]:
    """Every figure of one round, for Celery with this worker pool."""
    port = redis.port
    url = f"redis://127.0.0.1:{port}/0"
    client = CeleryClient(url)
    await _in_thread(client.app.backend.client.flushdb)
    figures: dict[str, float] = {}
    async with contextlib.AsyncExitStack() as stack:
        workers: dict[str, trio.Process] = {}

        async def start(key: str, concurrency: int, queues: list[str]) -> None:
            worker = celery_worker(url, pool, concurrency, queues, folder)
            workers[key] = await stack.enter_async_context(worker)

        async with trio.open_nursery() as nursery:  # the three start side by side
            nursery.start_soon(start, "main", SLOTS, ["bench"])
            nursery.start_soon(start, "one", 1, ["gap"])
            nursery.start_soon(start, "split", SLOTS, ["bench-a", "bench-b"])
        ports = _worker_ports(workers["main"], port)
        figures |= await idle_rates(lambda: tcp_traffic(port, ports), sizes.idle)
        await _in_thread(partial(client.callers, sizes.warm, "bench"))

        def callers() -> tuple[float, int]:
            return client.callers(sizes.callers_jobs, "bench"), sizes.callers_jobs

        worker = psutil.Process(workers["main"].pid)
        parts = [redis.process, worker, *worker.children(recursive=True)]
        figures["jobs16"], cpu = await cpu_per_job(parts, partial(_in_thread, callers))
        figures |= cpu

        def measure() -> None:
            figures["jobs_all"] = client.at_once(sizes.at_once, "bench")
            runs = client.priority(sizes.backlog, "bench")
            figures["excess"], figures["inversions"] = priority_figures(runs, SLOTS)
            figures["gap"] = statistics.median(
                reuse_gaps(client.many(sizes.gap_backlog, "bench.hold", "gap"))
            )
            figures.update(client.fairness(sizes.flood, "bench", "bench"))
            split = client.fairness(sizes.flood, "bench-a", "bench-b")
            figures.update({f"{key}_split": value for key, value in split.items()})

        await _in_thread(measure)
    return figures


# -- the floor ----------------------------------------------------------------------------


async def floor_turn(redis: RedisServer) -> dict[str, float]:
    """Round trips after ``JOB`` seconds of idleness: a bare websocket, and Redis ``PING``."""
    from handover import echo_server, round_trips

    async with echo_server() as echo:
        await round_trips(echo, 20, 0.0)
        websocket = await round_trips(echo, 50, JOB)

    def pings() -> list[float]:
        from redis import Redis

        samples = []
        with Redis(port=redis.port) as r:
            r.ping()
            for _ in range(50):
                time.sleep(JOB)
                start = time.perf_counter()
                r.ping()
                samples.append(time.perf_counter() - start)
        return samples

    return {
        "floor_ws": statistics.median(websocket),
        "floor_redis": statistics.median(await _in_thread(pings)),
    }


# -- the run ------------------------------------------------------------------------------

SYSTEMS = ("trio_broker", "Celery threads", "Celery prefork")


@attrs.frozen
class Row:
    """One line of the table: a figure, how to show it, and its floor or ideal."""

    key: str
    label: str
    unit: str  # "jobs/s", "ms", "count", "share", "msg/s", "B/s"
    floor: str = ""


ROWS = (
    Row("jobs16", "no-op jobs/s, 16 callers", "jobs/s"),
    Row("jobs_all", "no-op jobs/s, all submitted at once", "jobs/s"),
    Row("gap", "slot-reuse gap p50, 1 slot, 20 ms jobs", "ms", "floor_ws"),
    Row("excess", "high job behind a backlog: worst excess over ideal", "ms", "0"),
    Row("inversions", "low jobs that took a slot freed after the high submit", "count", "0"),
    Row("share", "producer B's share of slot time", "share", "0.25"),
    Row("share_split", "  the same, a queue per producer", "share", "0.25"),
    Row("wait", "B's mean wait beyond the next slot end", "ms", "0"),
    Row("wait_split", "  the same, a queue per producer", "ms", "0"),
    Row("busy", "slot time used during the flood (A and B)", "share", "1"),
    Row("busy_split", "  the same, a queue per producer", "share", "1"),
    Row("cpu_parts", "CPU per job, 16 callers: execserver | worker + Redis", "ms"),
    Row("cpu_client", "CPU per job, 16 callers: the client (this process)", "ms"),
    Row("idle_msgs", "idle: messages/s between the parts", "msg/s"),
    Row("idle_bytes", "idle: bytes/s between the parts", "B/s"),
    Row("idle_conns", "idle: connections between the parts", "count"),
)


def _show(value: float, unit: str) -> str:
    if unit == "ms":
        return f"{value * 1e3:.2f}"
    if unit == "share":
        return f"{value:.3f}"
    if unit in ("count", "jobs/s", "B/s"):
        return f"{value:,.0f}" if unit != "B/s" or value >= 100 else f"{value:.1f}"
    return f"{value:.2f}"


def _cell(values: list[float], unit: str) -> str:
    """Median, and the range when there is more than one round."""
    if not values:
        return "-"
    middle = _show(statistics.median(values), unit)
    if len(values) == 1:
        return middle
    return f"{middle} ({_show(min(values), unit)}–{_show(max(values), unit)})"


def report(results: dict[str, list[dict[str, float]]], sizes: Sizes) -> Iterator[str]:
    """The table: median (min–max) over the rounds, floors, and the ratios of the medians."""
    floors = results["floor"]
    yield (
        f"{sizes.rounds} round(s); {CALLERS} callers x {sizes.callers_jobs} jobs, "
        f"{sizes.at_once} at once, gap backlog {sizes.gap_backlog}, priority backlog "
        f"{sizes.backlog} + {PROBES} probes, flood {sizes.flood}, idle {sizes.idle:.0f} s; "
        f"{SLOTS} slots; median (min–max) over the rounds"
    )
    head = ["figure", "unit", *SYSTEMS, "floor/ideal", "÷ threads", "÷ prefork"]
    lines = [head]
    for row in ROWS:
        cells = [row.label, row.unit]
        medians = []
        for system in SYSTEMS:
            values = [r[row.key] for r in results[system] if row.key in r]
            cells.append(_cell(values, row.unit))
            medians.append(statistics.median(values) if values else None)
        if row.floor.startswith("floor"):
            cells.append(_cell([f[row.floor] for f in floors], row.unit))
        else:
            cells.append(row.floor)
        for other in medians[1:]:
            ours = medians[0]
            cells.append(f"{ours / other:.2f}x" if ours is not None and other else "-")
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for line in lines:
        yield "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                        enumerate(zip(line, widths, strict=True)))  # fmt: skip
    redis_floor = _cell([f["floor_redis"] for f in floors], "ms")
    yield f"floor of the Celery gap: Redis PING after {JOB * 1e3:.0f} ms idle p50 {redis_floor} ms"


async def main(sizes: Sizes) -> None:
    if not all(importlib.util.find_spec(name) for name in ("celery", "redis")):
        sys.exit("Celery is missing: .venv/bin/pip install -e '.[bench-celery]'")
    results: dict[str, list[dict[str, float]]] = {name: [] for name in (*SYSTEMS, "floor")}
    with tempfile.TemporaryDirectory(prefix="vs-celery-") as tmp:
        folder = Path(tmp)
        async with redis_server(folder) as redis:
            turns: dict[str, Callable[[], Any]] = {
                "trio_broker": lambda: trio_turn(sizes),
                "Celery threads": lambda: celery_turn(redis, "threads", sizes, folder),
                "Celery prefork": lambda: celery_turn(redis, "prefork", sizes, folder),
                "floor": lambda: floor_turn(redis),
            }
            names = list(turns)
            for round_ in range(sizes.rounds):
                order = names[round_ % len(names) :] + names[: round_ % len(names)]
                for name in order:
                    started = time.perf_counter()
                    figures = await turns[name]()
                    results[name].append(figures)
                    took = time.perf_counter() - started
                    shown = ", ".join(f"{k} {v:.4g}" for k, v in figures.items())
                    print(f"round {round_ + 1}, {name} ({took:.0f} s): {shown}", flush=True)
    load = os.getloadavg()
    print()
    for line in report(results, sizes):
        print(line)
    print(f"load average at the end: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and one round")
    parser.add_argument("--rounds", type=int, help="rounds (default 3, 1 with --quick)")
    parser.add_argument("--idle", type=float, help="seconds of idleness counted")
    args = parser.parse_args()
    chosen = QUICK if args.quick else FULL
    if args.rounds is not None:
        chosen = attrs.evolve(chosen, rounds=args.rounds)
    if args.idle is not None:
        chosen = attrs.evolve(chosen, idle=args.idle)
    trio.run(main, chosen)
