"""The HAProxy test helper in front of real execservers on 127.0.0.1."""

from __future__ import annotations

import os
import signal
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Literal

import attrs
import httpx
import psutil
import pytest
import trio
from trio_broker_daemons.execserver.app import serve_from_config
from trio_websocket import ConnectionClosed

from tests.support.haproxy import HAProxy, HAProxyError, HAProxyNotFound, open_haproxy
from tests.support.wire import WAIT, connect, execserver_config
from trio_broker.core import protocol as p
from trio_broker.trio.execserver import ExecserverHandle


@attrs.frozen(kw_only=True)
class Replica:
    """One in-process execserver that a test can kill (its listener closes)."""

    instance_id: str
    handle: ExecserverHandle
    scope: trio.CancelScope

    @property
    def backend(self) -> tuple[str, int]:
        return (self.handle.host, self.handle.port)


async def _serve_replica(instance_id: str, *, task_status: trio.TaskStatus[Replica]) -> None:
    async with trio.open_nursery() as nursery:
        handle = await nursery.start(
            partial(serve_from_config, execserver_config(), instance_id=instance_id)
        )
        task_status.started(
            Replica(instance_id=instance_id, handle=handle, scope=nursery.cancel_scope)
        )


async def start_replicas(nursery: trio.Nursery, *names: str) -> list[Replica]:
    return [await nursery.start(_serve_replica, name) for name in names]


async def instance_via(proxy: HAProxy) -> str:
    """Open one broker connection through the balancer; the replica's instance_id."""
    async with connect(proxy.url) as peer:
        return peer.hellos[0].instance_id


@pytest.mark.parametrize("mode", ["tcp", "http"])
async def test_round_robin_spreads_held_connections(
    nursery: trio.Nursery, mode: Literal["tcp", "http"]
) -> None:
    """Six broker websockets held at once through one address land two on each of three replicas."""
    replicas = await start_replicas(nursery, "a", "b", "c")
    async with (
        open_haproxy([r.backend for r in replicas], mode=mode) as proxy,
        AsyncExitStack() as stack,
    ):
        peers = [await stack.enter_async_context(connect(proxy.url)) for _ in range(6)]
        hellos = [peer.hellos[0] for peer in peers]
        assert Counter(h.instance_id for h in hellos) == {"a": 2, "b": 2, "c": 2}
        # HELLO.addr is the replica's own listener, not the dialled address.
        own = {r.instance_id: f"{r.handle.host}:{r.handle.port}" for r in replicas}
        assert all(h.addr == own[h.instance_id] != proxy.address for h in hellos)
        assert [b.sessions for b in await proxy.backends()] == [2, 2, 2]
        async with httpx.AsyncClient(timeout=WAIT) as http:
            answer = await http.get(f"{proxy.http_url}/healthz")
        assert (answer.status_code, answer.json()) == (200, {"status": "serving"})


async def test_added_backend_joins_and_removed_backend_leaves(nursery: trio.Nursery) -> None:
    """add_backend puts a fourth replica into the rotation; remove_backend takes it out at once."""
    a, b, c, d = await start_replicas(nursery, "a", "b", "c", "d")
    async with open_haproxy([a.backend, b.backend, c.backend], spare=1) as proxy:
        assert {await instance_via(proxy) for _ in range(3)} == {"a", "b", "c"}
        assert await proxy.add_backend(*d.backend) == "s3"
        seen = Counter([await instance_via(proxy) for _ in range(8)])
        assert seen == {"a": 2, "b": 2, "c": 2, "d": 2}
        states = await proxy.backends()
        assert [(s.name, s.port, s.up) for s in states] == [
            ("s0", a.handle.port, True),
            ("s1", b.handle.port, True),
            ("s2", c.handle.port, True),
            ("s3", d.handle.port, True),
        ]
        with pytest.raises(HAProxyError, match="no spare server slot left"):
            await proxy.add_backend("127.0.0.1", 1)
        await proxy.remove_backend(*d.backend)
        assert {await instance_via(proxy) for _ in range(6)} == {"a", "b", "c"}
        assert await proxy.add_backend(*d.backend) == "s3"  # the freed slot is reused
        assert "d" in {await instance_via(proxy) for _ in range(4)}


async def test_disabled_backend_is_skipped_until_enabled(nursery: trio.Nursery) -> None:
    """Disabling a replica with kill_connections cuts its tunnels and skips it until enabled."""
    replicas = {r.instance_id: r for r in await start_replicas(nursery, "a", "b")}
    async with open_haproxy([r.backend for r in replicas.values()]) as proxy:
        async with connect(proxy.url) as held:
            victim = replicas[held.hellos[0].instance_id]
            other = ({"a", "b"} - {victim.instance_id}).pop()
            await proxy.disable_backend(*victim.backend, kill_connections=True)
            with pytest.raises(ConnectionClosed):
                await held.recv()
        assert {await instance_via(proxy) for _ in range(4)} == {other}
        assert {s.port: s.status for s in await proxy.backends()}[victim.handle.port] == "MAINT"
        await proxy.enable_backend(*victim.backend)
        assert {await instance_via(proxy) for _ in range(4)} == {"a", "b"}


async def test_killed_backend_leaves_rotation_after_health_check(nursery: trio.Nursery) -> None:
    """Once a killed replica fails its checks, every new connection reaches a live one."""
    replicas = await start_replicas(nursery, "a", "b", "c")
    # One fresh TCP connection per request, so each request is one balancer pick.
    # (Plain HTTP, because trio-websocket 0.12 hangs until its connect timeout when
    # the balancer closes a connection before the upgrade answer.)
    async with (
        open_haproxy([r.backend for r in replicas]) as proxy,
        httpx.AsyncClient(timeout=WAIT, limits=httpx.Limits(max_keepalive_connections=0)) as http,
    ):

        async def probe() -> str:
            answer = await http.get(f"{proxy.http_url}/inspect/system/execserver")
            answer.raise_for_status()
            instance_id: str = answer.json()["instance_id"]
            return instance_id

        assert {await probe() for _ in range(3)} == {"a", "b", "c"}
        replicas[1].scope.cancel()  # its listener closes: connections are refused
        # Until the check notices, every third connection goes to the dead replica and
        # is closed unanswered; afterwards two full rounds in a row reach the live two.
        streak: list[str] = []
        with trio.fail_after(WAIT):
            while len(streak) < 4:
                try:
                    streak.append(await probe())
                except httpx.TransportError:
                    streak.clear()
        assert Counter(streak) == {"a": 2, "c": 2}
        states = await proxy.backends()
        assert [(s.up, s.status) for s in states][1] == (False, "DOWN")
        assert states[0].up
        assert states[2].up


async def test_draining_backend_fails_health_check(nursery: trio.Nursery) -> None:
    """A draining replica fails its /healthz check, so the balancer stops sending it anything."""
    a, b = await start_replicas(nursery, "a", "b")
    async with open_haproxy([a.backend, b.backend]) as proxy, connect(a.handle) as holder:
        # A running job keeps "a" draining (listening, not exited) for the whole test.
        offer = await holder.want("holder", "hold")
        assert isinstance(offer, p.Offer)
        await holder.run(offer, "hold", {"seconds": 300})
        with trio.fail_after(WAIT):
            await a.handle.wait_until(lambda: a.handle.broker.running() > 0)
        a.handle.drain()
        # Until the check notices, every other connection still reaches "a";
        # afterwards two full rounds in a row reach "b" only.
        streak: list[str] = []
        with trio.fail_after(WAIT):
            while len(streak) < 4:
                instance_id = await instance_via(proxy)
                streak = [*streak, instance_id] if instance_id == "b" else []
        assert [s.up for s in await proxy.backends()] == [False, True]


@asynccontextmanager
async def watching_exit(pids: list[int]) -> AsyncIterator[Callable[[], Awaitable[None]]]:
    """Watch processes that are not our children; yields "wait until all have ended"."""
    fds = [os.pidfd_open(pid) for pid in pids]
    try:

        async def ended() -> None:
            with trio.fail_after(WAIT):
                for fd in fds:
                    await trio.lowlevel.wait_readable(fd)  # readable once it has exited

        yield ended
    finally:
        for fd in fds:
            os.close(fd)


async def test_stop_leaves_no_process_and_keeps_workdir(tmp_path: Path) -> None:
    """Leaving the block stops the haproxy master and its worker; workdir keeps config and log."""
    async with open_haproxy([], workdir=tmp_path / "lb") as proxy:
        workers = [w.pid for w in psutil.Process(proxy.process.pid).children()]
        assert workers, "master-worker mode forks a worker"
        assert await proxy.backends() == ()
        async with watching_exit(workers) as workers_ended:
            await proxy.aclose()
            await workers_ended()
    assert proxy.process.returncode == 0  # it stopped in order, not killed
    assert "frontend fe" in proxy.config_path.read_text()
    assert "All workers exited" in proxy.log_text()


async def test_stuck_haproxy_is_killed_with_its_worker() -> None:
    """A haproxy that does not act on SIGTERM is killed after stop_within, worker included."""
    async with open_haproxy([], stop_within=0.5) as proxy:
        master = psutil.Process(proxy.process.pid)
        children = master.children()
        workers = [w.pid for w in children]
        assert workers
        # SIGSTOP: their SIGTERM handlers cannot run, only SIGKILL acts; a stopped
        # worker would not even notice its master's death.
        for process in [master, *children]:
            process.suspend()
        async with watching_exit(workers) as workers_ended:
            await proxy.aclose()
            await workers_ended()
    assert proxy.process.returncode == -signal.SIGKILL


async def test_missing_binary_is_a_clear_error() -> None:
    """A missing haproxy binary raises HAProxyNotFound naming the package to install."""
    with pytest.raises(HAProxyNotFound, match="apt-get install haproxy"):
        async with open_haproxy([], executable="/nonexistent/haproxy"):
            pass  # pragma: no cover


async def test_start_failure_quotes_haproxys_log(tmp_path: Path) -> None:
    """haproxy refusing its configuration at start-up raises HAProxyError with its own words."""
    with pytest.raises(HAProxyError, match=r"(?s)exited with status 1 .*ALERT.*overflow"):
        # Only haproxy itself knows its timers stop at 2**31 - 1 ms (about 25 days).
        async with open_haproxy([("127.0.0.1", 9)], check_interval=30e6, workdir=tmp_path):
            pass  # pragma: no cover
