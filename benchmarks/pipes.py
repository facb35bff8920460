"""Bulk throughput through a pipe pair, against a plain ``cat`` of the same bytes.

Run: ``.venv/bin/python benchmarks/pipes.py`` (``--mib`` sets the size, 1024 by default).

In one run, on one machine:

1. **floor**: the bytes go through a plain ``cat`` started by this process, fed
   and drained through OS pipes in 64 KiB chunks: the cost of moving them into a
   command and back out with no HTTP and no broker. What comes out is checked as
   in the pipe pair (SHA-256), so both pay the same for the check.
2. **pipe pair**: the same bytes as a body-mode job through the real execserver
   daemon in its own process (``trio-broker execserver``, service ``cat``). This
   process is the client: it serves a :class:`~trio_broker.trio.pipes.PipeRegistry` on
   127.0.0.1, places the job over the broker websocket (``WANT``, ``OFFER``, ``JOB``
   with ``stdin_url`` and ``stdout_url``) and waits for ``DONE``. The execserver
   streams the in-pipe into ``cat`` (``GET``) and ``cat``'s output into the
   out-pipe (``PUT``), whose sink checks every byte (SHA-256 against the digest
   of the source, computed before the clock starts).
Both run in alternating rounds (``--repeat``; medians).

It prints MiB/s of both, and the resident-memory growth of both sides (this
process; the execserver daemon without its ``cat``), sampled every 16 MiB as the
bytes flow and at the end, against their values before the job.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import time
from collections.abc import AsyncIterator

import bench_checkout  # noqa: F401  (tests.support is this checkout's)
import psutil
import trio
from trio_websocket import WebSocketConnection, open_websocket_url

from tests.support.processes import open_execserver_process
from trio_broker.core import protocol as p
from trio_broker.trio.pipes import PipeRegistry, serve_pipes

MiB = 1 << 20
CHUNK = 64 * 1024
SAMPLE_EVERY = 16 * MiB

CONFIG = """\
listen: 127.0.0.1:0
slots: 1
fast_reserve: 0
unknown_share: 1.0
services:
  cat: {argv: [cat]}
"""


def block() -> bytes:
    """One chunk of bytes that are not all alike."""
    return hashlib.sha256(b"pipes benchmark").digest() * (CHUNK // 32)


def digest_of(size: int) -> bytes:
    """The SHA-256 of the ``size`` bytes both runs send."""
    data = block()
    digest = hashlib.sha256()
    for start in range(0, size, CHUNK):
        digest.update(data[: min(CHUNK, size - start)])
    return digest.digest()


async def floor(size: int, expected: bytes) -> float:
    """MiB/s of ``size`` bytes through a plain ``cat``, fed and drained by this process."""
    data = block()
    digest = hashlib.sha256()
    process = await trio.lowlevel.open_process(
        ["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert process.stdin is not None
    assert process.stdout is not None
    stdin, stdout = process.stdin, process.stdout
    received = 0
    began = time.perf_counter()
    async with trio.open_nursery() as nursery:

        async def feed() -> None:
            sent = 0
            while sent < size:
                piece = data[: min(CHUNK, size - sent)]
                await stdin.send_all(piece)
                sent += len(piece)
            await stdin.aclose()

        nursery.start_soon(feed)
        while chunk := await stdout.receive_some(CHUNK):
            digest.update(chunk)
            received += len(chunk)
    elapsed = time.perf_counter() - began
    await stdout.aclose()
    await process.wait()
    assert received == size
    assert digest.digest() == expected, "the bytes changed on the way"
    return size / MiB / elapsed


class Memory:
    """Peak RSS growth of a process, sampled when asked."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.baseline = self.process.memory_info().rss
        self.peak = 0

    def sample(self) -> None:
        self.peak = max(self.peak, self.process.memory_info().rss - self.baseline)


async def answer_pings(ws: WebSocketConnection, done: list[p.Done]) -> None:
    """Read frames until ``DONE``, answering every ``PING`` of the execserver on the way."""
    while True:
        message = p.decode(await ws.get_message(), accept=p.EXEC_TO_CLIENT)
        if isinstance(message, p.Ping):
            await ws.send_message(p.encode(p.Pong(nonce=message.nonce)))
        elif isinstance(message, p.Done):
            done.append(message)
            return
        elif not isinstance(message, p.Hello):
            raise RuntimeError(f"unexpected frame {message!r}")


async def next_frame(ws: WebSocketConnection) -> p.Message:
    while True:
        message = p.decode(await ws.get_message(), accept=p.EXEC_TO_CLIENT)
        if not isinstance(message, p.Hello | p.Ping):
            return message


async def pipe_pair(size: int, expected: bytes) -> tuple[float, int, int]:
    """MiB/s through in-pipe -> execserver -> cat -> out-pipe; RSS growth here and there."""
    data = block()
    registry = PipeRegistry("benchmark")
    received_digest = hashlib.sha256()
    received = 0

    async def source() -> AsyncIterator[bytes]:
        sent = 0
        while sent < size:
            piece = data[: min(CHUNK, size - sent)]
            yield piece
            sent += len(piece)

    async def sink(chunk: bytes) -> None:
        nonlocal received
        received_digest.update(chunk)
        received += len(chunk)
        if received % SAMPLE_EVERY < len(chunk):
            here.sample()
            there.sample()

    async with open_execserver_process(CONFIG) as daemon, trio.open_nursery() as nursery:
        port = await nursery.start(serve_pipes, registry, "127.0.0.1", 0)
        base = f"http://127.0.0.1:{port}"
        async with open_websocket_url(daemon.url) as ws:
            await ws.send_message(
                p.encode(
                    p.Register(
                        backend_id="benchmark", name="benchmark", version="1", callback_url=None
                    )
                )
            )
            await ws.send_message(p.encode(p.Want(job_id="bulk", service="cat", priority=0)))
            offer = await next_frame(ws)
            assert isinstance(offer, p.Offer), offer
            in_pipe = registry.pipe_in(source())
            out_pipe = registry.pipe_out(sink)
            job = {"stdin_url": in_pipe.url(base), "stdout_url": out_pipe.url(base)}
            here = Memory(psutil.Process().pid)
            there = Memory(daemon.process.pid)
            began = time.perf_counter()
            await ws.send_message(
                p.encode(
                    p.Job(job_id="bulk", token=offer.token, service="cat", subject=None, job=job)
                )
            )
            done: list[p.Done] = []
            await answer_pings(ws, done)
            moved = await out_pipe.wait()
            elapsed = time.perf_counter() - began
            here.sample()
            there.sample()
            in_pipe.close()
            out_pipe.close()
        nursery.cancel_scope.cancel()
    receipt = done[0].receipt
    assert receipt.status == "ok", receipt
    assert receipt.stdin_bytes == receipt.stdout_bytes == moved == size, receipt
    assert received_digest.digest() == expected, "the bytes changed on the way"
    return size / MiB / elapsed, here.peak, there.peak


async def main(mib: int, repeat: int) -> None:
    size = mib * MiB
    expected = digest_of(size)
    floors, rates = [], []
    here = there = 0
    for _ in range(repeat):  # alternating, so both see the same machine
        floors.append(await floor(size, expected))
        rate, grown_here, grown_there = await pipe_pair(size, expected)
        rates.append(rate)
        here, there = max(here, grown_here), max(there, grown_there)
    floor_rate = statistics.median(floors)
    rate = statistics.median(rates)
    print(
        f"floor: plain cat of {mib} MiB, fed and drained (and checked) by this process: "
        f"{floor_rate:.0f} MiB/s (median of {repeat})"
    )
    print(
        f"pipe pair: {mib} MiB in-pipe -> execserver -> cat -> out-pipe: {rate:.0f} MiB/s "
        f"({rate / floor_rate:.0%} of the floor, median of {repeat})"
    )
    print(
        f"resident memory growth: client {here / MiB:.1f} MiB, "
        f"execserver {there / MiB:.1f} MiB (peak of the pipe-pair runs, "
        f"sampled every {SAMPLE_EVERY // MiB} MiB)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="MiB to stream (default 1024)")
    parser.add_argument("--repeat", type=int, default=3, help="alternating rounds")
    args = parser.parse_args()
    trio.run(main, args.mib, args.repeat)
