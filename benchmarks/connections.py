"""One execserver under many open connections: ``/livez`` and a newcomer's first job.

Run: ``.venv/bin/python benchmarks/connections.py`` (``--compare CHECKOUT`` runs the
daemon of another checkout of this repository too, in alternating rounds).

The execserver is the real ``trio-broker execserver`` daemon in its own process
(4 slots, a ``builtin: noop`` service). The load comes from a second process (so
that the probes below do not wait for the load generator's own event loop): it
opens the connections, registers each, answers the execserver's ``PING`` with
``PONG`` and sends its own after sending nothing for 5 s (as any client does), and
on half of them ping-pongs without pause (a ``PING``, then the next
one as soon as its ``PONG`` came back: one frame in flight per connection).

With the load running, this process measures, sequentially:

* ``/livez``: the latency of ``GET /livez`` (a new TCP connection per probe, as a
  probe of an orchestrator makes), ``--probes`` of them, p50 and p99;
* the first job of a newcomer: a new connection dials ``/broker``, sends
  ``REGISTER`` and ``WANT`` for a no-op job and answers the ``OFFER`` with ``JOB``;
  the time from the dial to the ``DONE`` (``--jobs`` of them, p50 and max).

Each load (``--connections``, default 1,000 with 500 ping-ponging) is measured
beside a baseline of 10 connections (5 ping-ponging) in the same run. The file
descriptor limit of both processes is raised to fit the connections.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import bench_checkout  # noqa: F401  (tests.support is this checkout's)
import trio

from tests.support.processes import DaemonProcess, open_execserver_process
from trio_broker.core import protocol as p
from trio_broker.trio.websocket import WebsocketConnection, connect

SLOTS = 4
DIALS = 32
"""Connections the load generator dials at once."""
PING_INTERVAL = 5.0
"""A load connection that sent nothing this long sends a PING (the protocol's rule)."""


def raise_fd_limit(wanted: int) -> None:
    """Raise this process's open-file limit to ``wanted`` (within the hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        limit = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))


@asynccontextmanager
async def execserver(
    *, checkout: str | None = None, log_level: str = "warning"
) -> AsyncIterator[DaemonProcess]:
    """The reference daemon with a no-op service (of ``checkout`` when given)."""
    config = (
        "listen: 127.0.0.1:0\n"
        f"slots: {SLOTS}\n"
        "fast_reserve: 0\n"
        "unknown_share: 1.0\n"
        "services:\n"
        "  noop: {builtin: noop}\n"
    )
    prefix = [] if checkout is None else ["env", f"PYTHONPATH={checkout}:{checkout}/daemons"]
    # the daemon inherits this process's raised descriptor limit
    async with open_execserver_process(config, prefix=prefix, log_level=log_level) as daemon:
        yield daemon


async def dial(host: str, port: int) -> WebsocketConnection:
    stream = await trio.open_tcp_stream(host, port)
    return await connect(stream, f"{host}:{port}", "/broker", max_message_bytes=1 << 20)


# -- the load generator (its own process) ------------------------------------------------


async def _hold(
    host: str,
    port: int,
    number: int,
    pinging: bool,
    dialling: trio.CapacityLimiter,
    opened: trio.Semaphore,
    all_open: trio.Event,
    started: trio.Semaphore,
    closed: list[int],
) -> None:
    """One connection: REGISTER, answer PINGs, and ping-pong without pause if asked.

    A connection the execserver closes is counted in ``closed`` and not redialled.
    """
    async with dialling:  # a few dials at a time: the listen backlog is finite
        ws = await dial(host, port)
        name = f"load-{number}"
        await ws.send_text(p.encode(p.Register(backend_id=name, name=name, version="bench")))
        while not isinstance(p.decode(await ws.receive() or "", accept=None), p.Hello):
            pass
    opened.release()
    nonces = iter(range(10**12))
    ponging = False
    sent = trio.current_time()
    while True:
        if pinging and all_open.is_set():
            # the ping-pong starts once every connection is open
            await ws.send_text(p.encode(p.Ping(nonce=str(next(nonces)))))
            sent = trio.current_time()
            started.release()
            pinging = False  # from now on, every PONG is answered by the next PING
            ponging = True
        text: str | bytes | None = ""
        # like any client, PING after sending nothing for ping_interval (and look
        # at least once a second whether the ping-pong should start)
        with trio.move_on_at(min(sent + PING_INTERVAL, trio.current_time() + 1.0)):
            try:
                text = await ws.receive()
            except trio.BrokenResourceError:
                text = None
        if text == "":
            if trio.current_time() >= sent + PING_INTERVAL:
                await ws.send_text(p.encode(p.Ping(nonce=str(next(nonces)))))
                sent = trio.current_time()
            continue
        if text is None:
            closed.append(number)
            return
        message = p.decode(text, accept=p.EXEC_TO_CLIENT)
        if isinstance(message, p.Ping):
            await ws.send_text(p.encode(p.Pong(nonce=message.nonce)))
            sent = trio.current_time()
        elif isinstance(message, p.Pong) and ponging:
            await ws.send_text(p.encode(p.Ping(nonce=str(next(nonces)))))
            sent = trio.current_time()


async def generate(host: str, port: int, connections: int, pinging: int) -> None:
    """Open the connections, say ``ready`` on stdout, hold them until stdin closes;
    then say how many the execserver closed meanwhile."""
    opened = trio.Semaphore(0, max_value=connections)
    dialling = trio.CapacityLimiter(DIALS)
    all_open = trio.Event()
    started = trio.Semaphore(0, max_value=max(1, pinging))
    closed: list[int] = []
    async with trio.open_nursery() as nursery:
        for number in range(connections):
            pings = number < pinging
            args = (number, pings, dialling, opened, all_open, started, closed)
            nursery.start_soon(_hold, host, port, *args)
        for _ in range(connections):
            await opened.acquire()
        all_open.set()
        for _ in range(pinging):
            await started.acquire()
        print("ready", flush=True)
        await trio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)
        nursery.cancel_scope.cancel()
    print(len(closed), flush=True)


@asynccontextmanager
async def load(daemon: DaemonProcess, connections: int, pinging: int) -> AsyncIterator[list[int]]:
    """The load generator process, from all connections open until the block ends.

    Yields a list that holds, after the block, how many connections the execserver
    closed during the run (it closes a connection it thinks silent).
    """
    argv = [sys.executable, __file__, "--generate", daemon.host, str(daemon.port)]
    argv += [str(connections), str(pinging)]
    proc = await trio.lowlevel.open_process(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None
    assert proc.stdout is not None
    try:
        with trio.fail_after(900):  # a loaded machine dials slowly
            line = b""
            while not line.endswith(b"\n"):
                chunk = await proc.stdout.receive_some(64)
                if not chunk:
                    raise RuntimeError("the load generator exited before it was ready")
                line += chunk
        closed: list[int] = []
        yield closed
    finally:
        with trio.CancelScope(shield=True):
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await proc.stdin.aclose()
            rest = b""
            with trio.move_on_after(30):
                while chunk := await proc.stdout.receive_some(64):
                    rest += chunk
                await proc.wait()
            if rest.strip().isdigit():
                closed.append(int(rest.strip()))
            if proc.returncode is None:
                proc.kill()
            await proc.wait()


# -- the probes -------------------------------------------------------------------------------


async def livez(daemon: DaemonProcess) -> float:
    """Seconds from a new TCP connection to the end of ``/livez``'s answer."""
    start = time.perf_counter()
    stream = await trio.open_tcp_stream(daemon.host, daemon.port)
    async with stream:
        request = f"GET /livez HTTP/1.1\r\nHost: {daemon.host}\r\nConnection: close\r\n\r\n"
        await stream.send_all(request.encode())
        answer = b""
        while chunk := await stream.receive_some(4096):
            answer += chunk
    elapsed = time.perf_counter() - start
    if not answer.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"/livez answered {answer[:40]!r}")
    return elapsed


async def first_job(daemon: DaemonProcess, number: int) -> float:
    """Seconds from a newcomer's dial to the DONE of its first (no-op) job."""
    start = time.perf_counter()
    ws = await dial(daemon.host, daemon.port)
    name = f"newcomer-{number}"
    job_id = f"{name}-job"
    await ws.send_texts(
        [
            p.encode(p.Register(backend_id=name, name=name, version="bench")),
            p.encode(p.Want(job_id=job_id, service="noop", priority=0)),
        ]
    )
    while True:
        text = await ws.receive()
        if text is None:
            raise RuntimeError("the execserver closed the newcomer's connection")
        message = p.decode(text, accept=p.EXEC_TO_CLIENT)
        if isinstance(message, p.Offer):
            job = p.Job(job_id=job_id, token=message.token, service="noop", job={})
            await ws.send_text(p.encode(job))
        elif isinstance(message, p.Done):
            elapsed = time.perf_counter() - start
            break
    with trio.move_on_after(5):
        await ws.close(p.CLOSE_NORMAL, "done")
    return elapsed


async def measure(daemon: DaemonProcess, probes: int, jobs: int) -> tuple[list[float], list[float]]:
    lives = [await livez(daemon) for _ in range(probes)]
    firsts = [await first_job(daemon, number) for number in range(jobs)]
    return lives, firsts


def _ms(samples: list[float], q: int) -> str:
    ordered = sorted(samples)
    value = ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]
    return f"{value * 1e3:,.1f} ms"


async def main(
    connections: int, probes: int, jobs: int, compare: str | None, log_level: str
) -> None:
    loads = ((10, 5), (connections, connections // 2))
    async with contextlib.AsyncExitStack() as stack:
        here = execserver(log_level=log_level)
        daemons = {"this checkout": await stack.enter_async_context(here)}
        if compare is not None:
            there = execserver(checkout=compare, log_level=log_level)
            daemons[compare] = await stack.enter_async_context(there)
        for count, pinging in loads:
            for name, daemon in daemons.items():
                async with load(daemon, count, pinging) as closed:
                    began = time.perf_counter()
                    lives, firsts = await measure(daemon, probes, jobs)
                    took = time.perf_counter() - began
                print(
                    f"{count:>5} connections ({pinging} ping-ponging), {name}: "
                    f"/livez p50 {_ms(lives, 50)}, p99 {_ms(lives, 99)} ({probes} probes); "
                    f"first job p50 {_ms(firsts, 50)}, max {_ms(firsts, 100)} ({jobs} newcomers; "
                    f"{took:.1f} s); closed by the execserver: "
                    f"{closed[0] if closed else '?'}",
                    flush=True,
                )
    print(f"({os.cpu_count()} CPUs, shared with other work: figures are noisy)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=1000, help="the loaded run")
    parser.add_argument("--probes", type=int, default=100, help="/livez probes per run")
    parser.add_argument("--jobs", type=int, default=10, help="newcomers' first jobs per run")
    parser.add_argument(
        "--compare",
        metavar="CHECKOUT",
        help="also run the daemon of this other checkout (e.g. one at main)",
    )
    parser.add_argument("--log-level", default="warning", help="the execservers' log level")
    parser.add_argument("--generate", nargs=4, metavar=("HOST", "PORT", "N", "PINGING"))
    args = parser.parse_args()
    if args.generate:
        host, port, count, pinging = args.generate
        raise_fd_limit(int(count) + 256)
        trio.run(generate, host, int(port), int(count), int(pinging))
    else:
        raise_fd_limit(2 * args.connections + 256)
        trio.run(main, args.connections, args.probes, args.jobs, args.compare, args.log_level)
