"""An execserver process that was stopped (SIGSTOP) judges its clients by what they sent."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import trio
from trio_websocket import ConnectionClosed

from tests.support.processes import open_execserver_process
from tests.support.wire import WAIT, connect
from trio_broker.core import protocol as p

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="SIGSTOP, FIFOs")

PING_INTERVAL = 0.5
PING_TIMEOUT = 2.0
STOPS = 3
"""Stop and continue this often: each time, the order in which the woken process
first runs its timer or its readers is the scheduler's choice."""
STOPPED_FOR = 2 * PING_TIMEOUT
"""Each stop lasts this long: twice the execserver's ping_timeout."""
PING_EVERY = 0.25


async def test_a_stopped_execserver_reads_what_waits_before_it_closes_anyone(
    tmp_path: Path,
) -> None:
    """SIGSTOP for twice ping_timeout while the client keeps sending PINGs and the job
    it runs ends: after SIGCONT the execserver reads the waiting PINGs and closes
    nobody, and the receipt of the job that ended while it was stopped arrives.
    Three stops, each a fresh chance for the woken process to look at its timers
    before its sockets."""
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    config = (
        "listen: 127.0.0.1:0\nslots: 1\nunknown_share: 1.0\nfast_reserve: 0\n"
        f"ping_interval: {PING_INTERVAL}s\nping_timeout: {PING_TIMEOUT}s\n"
        'services:\n  gated: {argv: [head, -c, "1", "{gate}"]}\n'
    )
    async with (
        open_execserver_process(config, ready_within=WAIT) as daemon,
        connect(daemon.url) as peer,
    ):
        offer = await peer.want("j", "gated")
        assert isinstance(offer, p.Offer)
        await peer.run(offer, "gated", {"gate": str(gate)})
        # opening the FIFO for writing returns once the job opened it: it runs
        with trio.fail_after(WAIT):
            writer = await trio.to_thread.run_sync(os.open, gate, os.O_WRONLY)
        frames: list[p.Message] = []
        closed: list[BaseException] = []
        done = trio.Event()
        pong = [trio.Event()]  # set by the next PONG

        async def read() -> None:
            try:
                while True:
                    message = await peer.recv(within=WAIT * 4)
                    frames.append(message)
                    if isinstance(message, p.Done):
                        done.set()
                    elif isinstance(message, p.Pong):
                        pong[0].set()
            except ConnectionClosed as exc:
                closed.append(exc)
                done.set()
                pong[0].set()

        async def keep_pinging() -> None:
            for n in range(10**6):
                await peer.send(p.Ping(nonce=f"test-{n}"))
                await trio.sleep(PING_EVERY)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            nursery.start_soon(keep_pinging)
            for stop in range(STOPS):
                daemon.process.send_signal(signal.SIGSTOP)
                if stop == 0:
                    os.write(writer, b"x")  # the job ends while its execserver is stopped
                    os.close(writer)
                await trio.sleep(STOPPED_FOR)  # the stop itself: the PINGs keep coming
                pong[0] = trio.Event()  # a stopped execserver answers nothing
                daemon.process.send_signal(signal.SIGCONT)
                with trio.fail_after(WAIT):  # it runs again: the waiting PINGs get PONGs
                    await pong[0].wait()
                assert not closed, f"closed after stop {stop + 1}: {closed[0]!r}"
            with trio.fail_after(WAIT):
                await done.wait()
            nursery.cancel_scope.cancel()
        assert not closed, f"the execserver closed the connection: {closed[0]!r}"
        (receipt,) = [m.receipt for m in frames if isinstance(m, p.Done)]
        assert receipt.status == "ok", receipt
