"""Execserver figures over real broker connections: SUBSCRIBE while watched, silence after."""

from __future__ import annotations

import trio

from tests.support.frames import FrameCount, serve_counting_relay
from tests.support.wire import WAIT, start_execserver
from tests.trio.test_client import client_config
from trio_broker.trio.client import BrokerClient, open_broker_client

LIVENESS = {"ping_interval": 0.3, "ping_timeout": 10.0}


def running(client: BrokerClient) -> list[int | None]:
    return [None if link.stats is None else link.stats.running for link in client.links()]


async def test_figures_come_while_watched_and_the_wire_is_quiet_after() -> None:
    """A watching client sees a job another client started; once nobody watches, the
    connection carries nothing but PING and PONG, counted on the wire."""
    frames = FrameCount()
    async with trio.open_nursery() as nursery:
        handle = await start_execserver(nursery, slots=2, ping_interval="0.3s")
        port = await nursery.start(serve_counting_relay, handle.host, handle.port, frames)
        watcher_config = client_config(f"127.0.0.1:{port}", backend_id="watcher", **LIVENESS)
        async with (
            open_broker_client(watcher_config) as watcher,
            open_broker_client(client_config(handle, backend_id="worker")) as worker,
        ):
            assert running(watcher) == [None]
            with trio.fail_after(WAIT), watcher.watching():
                await watcher.wait_until(lambda: running(watcher) == [0])
                (link,) = watcher.links()
                assert link.stats is not None
                assert (link.stats.slots, link.stats.name) == (2, "test-exec")
                assert link.hello.instance_id == link.stats.instance_id
                async with trio.open_nursery() as jobs:
                    jobs.start_soon(worker.run, "hold", {"params": {"seconds": 600}})
                    await watcher.wait_until(lambda: running(watcher) == [1])
                    jobs.cancel_scope.cancel()
                await watcher.wait_until(lambda: running(watcher) == [0])
            assert running(watcher) == [None]
            with trio.fail_after(WAIT):
                await frames.wait_for("to exec", "UNSUBSCRIBE")
                # settled: the freed slot shows in the idle figure, and the watcher was
                # told so (no HELLO is pending any more)
                await handle.wait_until(lambda: handle.broker.idle() == 2)
                await watcher.wait_until(lambda: [x.idle for x in watcher.instance_loads()] == [2])
            before = frames.counts.copy()
            with trio.fail_after(WAIT):
                await frames.wait_for("to exec", "PING", before["to exec", "PING"] + 5)
                await frames.wait_for("to client", "PING", before["to client", "PING"] + 5)
            window = frames.counts - before
        nursery.cancel_scope.cancel()
    assert {kind for _, kind in window} <= {"PING", "PONG"}, window
    assert before["to exec", "SUBSCRIBE"] == 1
    assert before["to client", "STATS"] >= 3  # the first, running 1, running 0


async def test_nested_watchers_share_one_subscription() -> None:
    """Two overlapping viewers make one SUBSCRIBE and, when the last leaves, one UNSUBSCRIBE."""
    frames = FrameCount()
    async with trio.open_nursery() as nursery:
        handle = await start_execserver(nursery, slots=1)
        port = await nursery.start(serve_counting_relay, handle.host, handle.port, frames)
        async with open_broker_client(client_config(f"127.0.0.1:{port}")) as client:
            with trio.fail_after(WAIT):
                with client.watching():
                    with client.watching():
                        await client.wait_until(lambda: running(client) == [0])
                    assert running(client) == [0]  # still watched by the outer block
                await frames.wait_for("to exec", "UNSUBSCRIBE")
        nursery.cancel_scope.cancel()
    assert (frames.counts["to exec", "SUBSCRIBE"], frames.counts["to exec", "UNSUBSCRIBE"]) == (
        1,
        1,
    )
