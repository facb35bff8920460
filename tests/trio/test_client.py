"""BrokerClient against real execservers over real websockets on 127.0.0.1."""

from __future__ import annotations

import contextlib
import logging
import random
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from trio_broker_daemons.execserver.app import serve_from_config
from trio_websocket import (
    ConnectionClosed,
    WebSocketConnection,
    WebSocketRequest,
    WebSocketServer,
)

from tests.support.processes import open_execserver_process
from tests.support.stalled import flood_pings, small_receive_buffer
from tests.support.wire import WAIT, execserver_config, start_execserver
from trio_broker.core import protocol as p
from trio_broker.core.client import ClientConfig
from trio_broker.core.errors import ClientClosed, JobLost, NoExecserver, NoSlot, UnknownService
from trio_broker.trio.client import BrokerClient, open_broker_client
from trio_broker.trio.driver import OUTBOX_FRAMES
from trio_broker.trio.execserver import ExecserverHandle
from trio_broker.trio.runner import JobControl, JobRequest


def client_config(*handles: ExecserverHandle | str, **overrides: Any) -> ClientConfig:
    addresses = tuple(h if isinstance(h, str) else f"{h.host}:{h.port}" for h in handles)
    data: dict[str, Any] = {
        "backend_id": "client-a",
        "name": "tests",
        "version": "1",
        "addresses": addresses,
        "reconnect_min": 0.05,
        "reconnect_max": 0.5,
    }
    data.update(overrides)
    return ClientConfig(**data)


@asynccontextmanager
async def client_for(
    *handles: ExecserverHandle | str, local_host: str | None = None, **overrides: Any
) -> AsyncIterator[BrokerClient]:
    async with open_broker_client(
        client_config(*handles, **overrides), local_host=local_host
    ) as client:
        yield client


def totals(handle: ExecserverHandle) -> tuple[int, int, int]:
    """(parked, offered, running) over every service of an execserver."""
    services = handle.broker.statistics().services
    return (
        sum(s.parked for s in services),
        sum(s.offered for s in services),
        sum(s.running for s in services),
    )


async def quiet(*handles: ExecserverHandle) -> None:
    for handle in handles:
        await handle.wait_until(lambda h=handle: totals(h) == (0, 0, 0))  # type: ignore[misc]


class RecordingRunner:
    """A runner that holds its slot ``params.seconds`` and records every start."""

    def __init__(self, starts: Counter[str]) -> None:
        self.starts = starts
        self.instance_id = ""

    async def run(self, request: JobRequest, control: JobControl) -> p.Receipt:
        self.starts[request.job_id] += 1
        started = trio.current_time()
        seconds = float(request.job.get("params", {}).get("seconds", 0))
        status = "ok"
        with trio.move_on_after(seconds):
            await control.wait_aborted()
            status = control.status or "ok"
        return p.Receipt(
            status=status,  # type: ignore[arg-type]
            error=None if status == "ok" else control.reason,
            stdout_prefix="",
            stdout_bytes=0,
            stdin_bytes=0,
            started_at=started,
            duration_s=trio.current_time() - started,
            instance_id=self.instance_id,
        )


async def test_run_returns_the_receipt_and_shows_the_pool() -> None:
    """One job on one execserver comes back with its receipt; the pool is one literal address."""
    async with trio.open_nursery() as nursery:
        handle = await start_execserver(nursery)
        async with client_for(handle) as client:
            receipt = await client.run("echo", {"params": {"text": "hi"}}, subject="file-1")
            assert receipt.status == "ok"
            assert receipt.stdout_prefix == "hi\n"
            stats = client.statistics()
            (address,) = stats.addresses
            assert address.connections == 1
            assert address.instances == (handle.broker.config.instance_id,)
            assert not address.balanced
            assert stats.finished == 1
            assert client.instance_loads()[0].processes == 2
        nursery.cancel_scope.cancel()


async def test_a_job_that_gets_its_slot_is_logged_with_its_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The core's Accepted effect is carried out, once per job: a debug line names the
    job, the connection that holds its slot and the address it was dialled through."""
    with caplog.at_level(logging.DEBUG, logger="trio_broker.trio.client"):
        async with trio.open_nursery() as nursery:
            handle = await start_execserver(nursery)
            async with client_for(handle) as client:
                await client.run("echo", {"params": {"text": "a"}}, job_id="job-a")
                await client.run("echo", {"params": {"text": "b"}}, job_id="job-b")
                (link,) = client.links()
            nursery.cancel_scope.cancel()
    lines = [r.getMessage() for r in caplog.records if "holds a slot" in r.getMessage()]
    assert lines == [
        f"job {job_id!r} holds a slot on connection {link.conn} ({link.address})"
        for job_id in ("job-a", "job-b")
    ]


async def test_no_execserver_fails_at_once() -> None:
    """With nothing listening at the only address, run() raises NoExecserver at once."""
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connections are refused
        async with client_for(f"127.0.0.1:{port}", connect_timeout=60) as client:
            with trio.fail_after(WAIT), pytest.raises(NoExecserver):
                await client.run("noop", {})


async def test_unknown_service_fails_at_once() -> None:
    """A service no connected execserver announced raises UnknownService."""
    async with trio.open_nursery() as nursery:
        handle = await start_execserver(nursery)
        async with client_for(handle) as client:
            with pytest.raises(UnknownService, match="'ffmpeg'"):
                await client.run("ffmpeg", {})
        nursery.cancel_scope.cancel()


async def test_no_slot_after_connect_timeout_and_the_want_is_withdrawn() -> None:
    """A job with every slot busy raises NoSlot after connect_timeout and leaves nothing parked."""
    async with trio.open_nursery() as nursery:
        handle = await start_execserver(nursery, slots=1)
        async with client_for(handle, connect_timeout=0.5) as client, trio.open_nursery() as bg:
            bg.start_soon(client.run, "hold", {"params": {"seconds": 30}})
            await handle.wait_until(lambda: totals(handle)[2] == 1)
            with pytest.raises(NoSlot, match="connect_timeout"):
                await client.run("noop", {})
            await handle.wait_until(lambda: totals(handle) == (0, 0, 1))
            bg.cancel_scope.cancel()
        nursery.cancel_scope.cancel()


async def test_cancelling_a_waiting_job_unwants_and_a_running_job_cancels() -> None:
    """Cancelling run() withdraws a parked want (UNWANT) and aborts a running job (CANCEL)."""
    async with trio.open_nursery() as nursery:
        handle = await start_execserver(nursery, slots=1)
        async with client_for(handle) as client, trio.open_nursery() as bg:
            running, waiting = trio.CancelScope(), trio.CancelScope()
            bg.start_soon(_run_in, running, client, "hold", {"params": {"seconds": 60}})
            await handle.wait_until(lambda: totals(handle)[2] == 1)
            bg.start_soon(_run_in, waiting, client, "noop", {})
            await handle.wait_until(lambda: totals(handle)[0] == 1)
            waiting.cancel()
            await handle.wait_until(lambda: totals(handle) == (0, 0, 1))
            running.cancel()
            await handle.wait_until(lambda: totals(handle) == (0, 0, 0))
            recent = handle.broker.statistics().recent
            assert recent[-1].receipt.status == "cancelled"
            await client.wait_until(lambda: client.statistics().running == 0, timeout=WAIT)
            bg.cancel_scope.cancel()
        nursery.cancel_scope.cancel()


async def _run_in(
    scope: trio.CancelScope, client: BrokerClient, service: str, job: Mapping[str, Any]
) -> None:
    with scope:
        await client.run(service, job)


async def test_first_offer_wins_and_surplus_offers_are_declined() -> None:
    """Jobs parked on two execservers run once each; surplus offers are declined; none linger."""
    starts: Counter[str] = Counter()
    async with trio.open_nursery() as nursery:
        a = await nursery.start(
            serve_from_config, execserver_config(slots=2), RecordingRunner(starts)
        )
        b = await nursery.start(
            serve_from_config, execserver_config(slots=2), RecordingRunner(starts)
        )
        async with client_for(a, b) as client:
            receipts: list[p.Receipt] = []

            async def one() -> None:
                receipts.append(await client.run("hold", {"params": {"seconds": 0.01}}))

            async with trio.open_nursery() as jobs:
                for _ in range(40):
                    jobs.start_soon(one)
            assert len(receipts) == 40
            assert len(starts) == 40
            assert set(starts.values()) == {1}
            await quiet(a, b)
        nursery.cancel_scope.cancel()


async def test_heterogeneous_fleet_parks_only_where_the_service_is() -> None:
    """A service announced by one execserver of two is parked only on that one."""
    async with trio.open_nursery() as nursery:
        a = await start_execserver(nursery, slots=1)
        b = await start_execserver(
            nursery,
            slots=1,
            services={"hold": {"builtin": "sleep"}, "only_b": {"builtin": "noop"}},
        )
        async with client_for(a, b) as client, trio.open_nursery() as bg:
            bg.start_soon(client.run, "hold", {"params": {"seconds": 60}})
            bg.start_soon(client.run, "hold", {"params": {"seconds": 60}})
            await a.wait_until(lambda: totals(a)[2] == 1)
            await b.wait_until(lambda: totals(b)[2] == 1)
            bg.start_soon(client.run, "only_b", {})
            await b.wait_until(lambda: totals(b)[0] == 1)
            assert totals(a)[0] == 0
            bg.cancel_scope.cancel()
        nursery.cancel_scope.cancel()


async def test_a_draining_execservers_wants_move_to_the_others() -> None:
    """When one execserver drains, a job parked there and elsewhere is withdrawn from its
    book and starts on the other one as soon as a slot frees there."""
    on_a: Counter[str] = Counter()
    on_b: Counter[str] = Counter()
    async with trio.open_nursery() as nursery:
        a = await nursery.start(
            serve_from_config, execserver_config(slots=1), RecordingRunner(on_a)
        )
        b = await nursery.start(
            serve_from_config, execserver_config(slots=1), RecordingRunner(on_b)
        )
        async with client_for(a, b) as client, trio.open_nursery() as bg:
            scopes = {name: trio.CancelScope() for name in ("h1", "h2")}
            result: list[p.Receipt] = []

            async def hold(job_id: str) -> None:
                with scopes[job_id]:
                    await client.run("hold", {"params": {"seconds": 60}}, job_id=job_id)

            async def waiter() -> None:
                result.append(await client.run("noop", {}, job_id="waiter"))

            for name in scopes:
                bg.start_soon(hold, name)
            await a.wait_until(lambda: len(on_a) == 1)
            await b.wait_until(lambda: len(on_b) == 1)
            bg.start_soon(waiter)
            await a.wait_until(lambda: totals(a)[0] == 1)
            await b.wait_until(lambda: totals(b)[0] == 1)
            a.drain()
            await a.wait_until(lambda: totals(a)[0] == 0)
            (b_job,) = on_b
            scopes[b_job].cancel()
            await client.wait_until(lambda: bool(result), timeout=WAIT)
            assert result[0].instance_id == b.broker.config.instance_id
            assert "waiter" in on_b
            assert "waiter" not in on_a
            bg.cancel_scope.cancel()
        nursery.cancel_scope.cancel()


async def test_killed_execserver_loses_its_running_job_and_moves_the_waiting() -> None:
    """kill -9 of an execserver process raises JobLost for the job it ran; a job parked there
    and on the survivor runs on the survivor."""
    yaml = (
        "listen: 127.0.0.1:0\nslots: 1\nfast_reserve: 0\nunknown_share: 1.0\n"
        "services:\n  hold: {builtin: sleep}\n  noop: {builtin: noop}\n"
    )
    starts: Counter[str] = Counter()
    async with trio.open_nursery() as nursery, open_execserver_process(yaml) as a:
        b = await nursery.start(
            serve_from_config,
            execserver_config(
                slots=1, services={"hold": {"builtin": "sleep"}, "noop": {"builtin": "noop"}}
            ),
            RecordingRunner(starts),
        )
        async with client_for(f"{a.host}:{a.port}", b) as client, trio.open_nursery() as bg:
            outcomes: dict[str, str] = {}
            scopes = {name: trio.CancelScope() for name in ("h1", "h2")}

            async def run(job_id: str, job: Mapping[str, Any]) -> None:
                with scopes.get(job_id, trio.CancelScope()):
                    try:
                        outcomes[job_id] = (await client.run("hold", job, job_id=job_id)).status
                    except JobLost:
                        outcomes[job_id] = "lost"

            for name in scopes:
                bg.start_soon(run, name, {"params": {"seconds": 60}})
            await client.wait_until(lambda: client.statistics().running == 2, timeout=WAIT)
            await b.wait_until(lambda: len(starts) == 1)
            (on_b,) = starts
            (on_a,) = set(scopes) - {on_b}
            bg.start_soon(run, "third", {"params": {"seconds": 0}})
            await b.wait_until(lambda: totals(b)[0] == 1)
            a.process.kill()
            await client.wait_until(lambda: outcomes.get(on_a) == "lost", timeout=WAIT)
            scopes[on_b].cancel()
            await client.wait_until(lambda: outcomes.get("third") == "ok", timeout=WAIT)
            assert starts["third"] == 1
            bg.cancel_scope.cancel()
        nursery.cancel_scope.cancel()


async def test_a_waiting_job_fails_at_once_when_its_only_execserver_stops() -> None:
    """A job waiting when its only execserver stopped raises NoExecserver at once (long
    before connect_timeout), so its caller can requeue it; once an execserver listens on
    that port again, the client reconnects and new jobs run there."""
    async with trio.open_nursery() as nursery:
        first = await start_execserver(nursery, slots=1)
        port = first.port
        async with client_for(first, connect_timeout=3600) as client, trio.open_nursery() as bg:
            hold: list[str] = []

            async def holder() -> None:
                receipt = await client.run("hold", {"params": {"seconds": 60}})
                hold.append(receipt.status)

            bg.start_soon(holder)
            await first.wait_until(lambda: totals(first)[2] == 1)
            result: list[BaseException] = []

            async def waiter() -> None:
                try:
                    await client.run("noop", {})
                except NoExecserver as exc:
                    result.append(exc)

            bg.start_soon(waiter)
            await first.wait_until(lambda: totals(first)[0] == 1)
            first.stop()
            await client.wait_until(lambda: bool(result), timeout=WAIT)
            assert "every execserver disappeared" in str(result[0])
            await first.wait_closed()
            second = await start_execserver(nursery, slots=1, listen=f"127.0.0.1:{port}")
            second_id = second.broker.config.instance_id
            await client.wait_until(
                lambda: any(link.hello.instance_id == second_id for link in client.links()),
                timeout=WAIT,
            )
            receipt = await client.run("noop", {})
            assert receipt.instance_id == second.broker.config.instance_id
            assert hold == ["stopped"]  # a stopping execserver still sends the receipt
            bg.cancel_scope.cancel()
        nursery.cancel_scope.cancel()


async def test_priority_from_another_client_overtakes_a_backlog() -> None:
    """Client B's priority-4 job gets the next free slot ahead of client A's priority-0 backlog."""
    async with trio.open_nursery() as nursery:
        handle = await start_execserver(nursery, slots=1)
        order: list[str] = []
        async with client_for(handle) as a, client_for(handle, backend_id="client-b") as b:

            async def job(client: BrokerClient, name: str, priority: int, seconds: float) -> None:
                await client.run("hold", {"params": {"seconds": seconds}}, priority=priority)
                order.append(name)

            blocker = trio.CancelScope()

            async def block() -> None:
                with blocker:
                    await a.run("hold", {"params": {"seconds": 60}})

            nursery.start_soon(block)
            await handle.wait_until(lambda: totals(handle)[2] == 1)
            for i in range(10):
                nursery.start_soon(job, a, f"a{i}", 0, 0)
            await handle.wait_until(lambda: totals(handle)[0] == 10)
            nursery.start_soon(job, b, "b", 4, 0)
            await handle.wait_until(lambda: totals(handle)[0] == 11)
            blocker.cancel()
            await a.wait_until(lambda: len(order) == 11, timeout=WAIT)
            assert order[0] == "b"
        nursery.cancel_scope.cancel()


async def test_position_answers_for_a_parked_job() -> None:
    """position() returns the execserver's POSITION for a job waiting behind a busy slot."""
    async with trio.open_nursery() as nursery:
        handle = await start_execserver(nursery, slots=1)
        async with client_for(handle) as client, trio.open_nursery() as bg:
            bg.start_soon(client.run, "hold", {"params": {"seconds": 60}})
            await handle.wait_until(lambda: totals(handle)[2] == 1)
            bg.start_soon(lambda: client.run("noop", {}, job_id="mine"))
            await handle.wait_until(lambda: totals(handle)[0] == 1)
            (position,) = await client.position("mine")
            assert (position.job_id, position.running, position.ahead) == ("mine", 1, 0)
            assert await client.position("nobody") == []
            bg.cancel_scope.cancel()
        nursery.cancel_scope.cancel()


async def test_callback_base_uses_the_local_address_of_each_connection() -> None:
    """Clients dialling from 127.0.0.2 and 127.0.0.3 each register their own address as callback."""
    async with trio.open_nursery() as nursery:
        handle = await start_execserver(nursery)
        async with (
            client_for(handle, local_host="127.0.0.2", callback_port=8123) as two,
            client_for(
                handle, local_host="127.0.0.3", callback_port=8123, backend_id="b3"
            ) as three,
        ):
            await handle.wait_until(
                lambda: (
                    sum(c.register is not None for c in handle.broker.statistics().connections) == 2
                )
            )
            registered = sorted(
                c.register.callback_url or ""
                for c in handle.broker.statistics().connections
                if c.register is not None
            )
            assert registered == ["http://127.0.0.2:8123", "http://127.0.0.3:8123"]
            assert two.statistics().addresses[0].connections == 1
            assert three.statistics().addresses[0].connections == 1
        nursery.cancel_scope.cancel()


async def test_races_over_the_wire_every_job_once() -> None:
    """500 jobs with random durations and cancellations on three execservers: each runs at most
    once, every non-cancelled one exactly once, and nothing stays parked, offered or running."""
    rng = random.Random(20261130)
    starts: Counter[str] = Counter()
    async with trio.open_nursery() as nursery:
        handles = [
            await nursery.start(
                serve_from_config, execserver_config(slots=3), RecordingRunner(starts)
            )
            for _ in range(3)
        ]
        async with client_for(*handles, connect_timeout=WAIT) as client:
            finished: set[str] = set()
            cancelled: set[str] = set()

            async def one(i: int) -> None:
                job_id = f"job-{i}"
                seconds = rng.choice([0, 0, 0.001, 0.005, 0.02])
                with trio.CancelScope() as scope:
                    if rng.random() < 0.2:
                        scope.deadline = trio.current_time() + rng.uniform(0, 0.05)
                    await client.run("hold", {"params": {"seconds": seconds}}, job_id=job_id)
                    finished.add(job_id)
                if scope.cancelled_caught:
                    cancelled.add(job_id)

            with trio.fail_after(120):
                async with trio.open_nursery() as jobs:
                    for i in range(500):
                        jobs.start_soon(one, i)
            assert finished | cancelled == {f"job-{i}" for i in range(500)}
            assert max(starts.values()) == 1
            assert finished <= set(starts)
            await quiet(*handles)
        nursery.cancel_scope.cancel()


async def test_literal_address_never_grows() -> None:
    """A sustained backlog on one literal execserver address keeps the pool at one connection."""
    async with trio.open_nursery() as nursery:
        handle = await start_execserver(nursery, slots=1)
        async with (
            client_for(handle, retry_tick=0.05, pool_grow_interval=0.05) as client,
            trio.open_nursery() as bg,
        ):
            bg.start_soon(client.run, "hold", {"params": {"seconds": 60}})
            await handle.wait_until(lambda: totals(handle)[2] == 1)
            for _ in range(3):
                bg.start_soon(client.run, "noop", {})
            await handle.wait_until(lambda: totals(handle)[0] == 3)
            # The pool tries a second connection, finds the same instance, closes it,
            # and marks the address covered: growth stops.
            await client.wait_until(lambda: client.statistics().addresses[0].covered, timeout=WAIT)
            assert client.statistics().addresses[0].connections == 1

            def opened() -> int:
                return handle.broker.statistics().counters["connections_opened"]

            assert opened() == 2  # the first connection and the one probe
            # With the backlog still parked, twenty more grow intervals open nothing.
            with trio.move_on_after(20 * 0.05):
                await handle.wait_until(lambda: opened() > 2)
            assert opened() == 2
            with trio.fail_after(WAIT):
                await handle.wait_until(lambda: len(handle.broker.connections()) == 1)
            bg.cancel_scope.cancel()
        nursery.cancel_scope.cancel()


async def test_an_idle_client_sleeps_between_timers() -> None:
    """With nothing to do, the client's timer task wakes only for its timers: while the
    execserver sends three PINGs (0.2 s apart) the core is ticked a handful of times, not
    in a busy loop."""
    async with trio.open_nursery() as nursery:
        handle = await start_execserver(nursery, ping_interval="0.2s")
        async with client_for(handle, ping_interval=0.2) as client:
            ticks = [0]
            core_tick = client._core.tick

            def counting_tick(*, now: float, due: float | None = None) -> None:
                ticks[0] += 1
                core_tick(now=now, due=due)

            client._core.tick = counting_tick  # type: ignore[method-assign]
            pings = [0]
            core_receive = client._core.receive_text

            def counting_receive(conn: int, text: str | bytes, *, now: float) -> None:
                pings[0] += '"PING"' in str(text)
                core_receive(conn, text, now=now)

            client._core.receive_text = counting_receive  # type: ignore[method-assign,assignment]
            await client.wait_until(lambda: pings[0] >= 3, timeout=WAIT)
            assert ticks[0] < 50
        nursery.cancel_scope.cancel()


async def test_an_exception_in_the_block_comes_out_as_itself() -> None:
    """A KeyError raised inside ``async with open_broker_client(...)`` leaves it as that
    KeyError, not wrapped in an exception group."""
    async with trio.open_nursery() as nursery:
        handle = await start_execserver(nursery)
        with pytest.raises(KeyError, match="no such file") as raised:
            async with client_for(handle):
                raise KeyError("no such file")
        assert type(raised.value) is KeyError
        nursery.cancel_scope.cancel()


async def test_aclose_ends_the_jobs_and_the_connections_and_can_be_repeated() -> None:
    """aclose() fails a running job with ClientClosed and closes every connection; a second
    aclose() does nothing, and a later run() raises ClientClosed."""
    async with trio.open_nursery() as nursery:
        handle = await start_execserver(nursery, slots=1)
        outcome: list[str] = []
        async with client_for(handle) as client:

            async def hold() -> None:
                try:
                    await client.run("hold", {"params": {"seconds": 60}})
                except ClientClosed:
                    outcome.append("closed")

            async with trio.open_nursery() as jobs:
                jobs.start_soon(hold)
                await handle.wait_until(lambda: totals(handle)[2] == 1)
                await client.aclose()
            assert outcome == ["closed"]
            await client.aclose()
            with pytest.raises(ClientClosed):
                await client.run("noop", {})
            with trio.fail_after(WAIT):
                await handle.wait_until(lambda: not handle.broker.connections())
            assert totals(handle) == (0, 0, 0)  # its job was stopped with its connection
        nursery.cancel_scope.cancel()


def fake_hello(port: int) -> str:
    """The HELLO of a stand-in execserver listening on ``port``."""
    hello = p.Hello(
        protocol=1,
        instance_id="stand-in",
        name="stand-in",
        services={},
        processes=1,
        idle=0,
        clients=1,
        draining=False,
        addr=f"127.0.0.1:{port}",
    )
    return p.encode(hello)


async def serve_stand_in(
    nursery: trio.Nursery,
    handler: Callable[[WebSocketConnection, int], Awaitable[None]],
    *,
    small_buffer: bool = False,
) -> int:
    """Serve ``handler(ws, port)`` on a real websocket on 127.0.0.1; return the port.

    Its own reader hands on nothing until the handler asks (``message_queue_size=0``);
    with ``small_buffer`` its sockets also take few bytes in, so it can stop reading.
    """
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    if small_buffer:
        small_receive_buffer(listeners[0].socket)  # accepted sockets inherit it
    port: int = listeners[0].socket.getsockname()[1]

    async def accept(request: WebSocketRequest) -> None:
        ws = await request.accept()
        with contextlib.suppress(ConnectionClosed):
            await handler(ws, port)

    nursery.start_soon(WebSocketServer(accept, listeners, message_queue_size=0).run)
    return port


async def test_a_frame_over_max_frame_bytes_in_utf8_closes_the_connection() -> None:
    """A frame of fewer characters than max_frame_bytes but more UTF-8 bytes closes the
    client's connection with 1009, as on the execserver."""
    codes: list[int | None] = []

    async def oversized(ws: WebSocketConnection, port: int) -> None:
        await ws.send_message(fake_hello(port))
        await ws.send_message('{"type":"PING","nonce":"' + "é" * 1100 + '"}')
        try:
            while True:
                await ws.get_message()
        except ConnectionClosed as closed:
            codes.append(closed.reason.code if closed.reason else None)

    async with trio.open_nursery() as nursery:
        port = await serve_stand_in(nursery, oversized)
        config = client_config(f"127.0.0.1:{port}", reconnect_min=60, reconnect_max=60)
        async with open_broker_client(config, max_frame_bytes=2048) as client:
            with trio.fail_after(WAIT):
                await client.wait_until(lambda: bool(codes))
            assert codes == [p.CLOSE_TOO_BIG]
        nursery.cancel_scope.cancel()


async def test_a_client_whose_execserver_does_not_read_closes_the_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An execserver that keeps sending PINGs but reads none of the PONGs fills the client's
    outbox: the client drops that connection and dials again, instead of queueing without
    end."""
    redialled = trio.Event()
    accepted: list[int] = []

    async def stalled(ws: WebSocketConnection, port: int) -> None:
        accepted.append(port)
        await ws.send_message(fake_hello(port))
        if len(accepted) == 1:
            await flood_pings(ws)  # and never read: the client may close meanwhile
            await trio.sleep_forever()
        redialled.set()
        while True:  # later connections read what they get
            await ws.get_message()

    async with trio.open_nursery() as nursery:
        port = await serve_stand_in(nursery, stalled, small_buffer=True)
        async with client_for(f"127.0.0.1:{port}") as client:
            with trio.fail_after(WAIT):
                await redialled.wait()
                # connected again, on the new connection
                await client.wait_until(lambda: client.statistics().addresses[0].instances != ())
        nursery.cancel_scope.cancel()
    assert any("does not read its frames" in r.getMessage() for r in caplog.records)


async def test_more_waiting_jobs_than_the_outbox_holds_keep_the_connection() -> None:
    """More run() calls at once than an outbox holds frames: their WANT frames are the
    client's own, so the connection is kept, every want is parked, and cancelling them
    all withdraws every want on the same connection."""
    count = OUTBOX_FRAMES + 500
    async with trio.open_nursery() as nursery:
        handle = await start_execserver(nursery, slots=1)
        async with client_for(handle, connect_timeout=3600) as client:
            async with trio.open_nursery() as bg:
                bg.start_soon(client.run, "hold", {"params": {"seconds": 3600}})
                await handle.wait_until(lambda: totals(handle)[2] == 1)
                (conn,) = [link.conn for link in client.links()]
                for _ in range(count):
                    bg.start_soon(client.run, "noop", {})
                await handle.wait_until(lambda: totals(handle)[0] == count)
                assert client.waiting() == count
                bg.cancel_scope.cancel()
            await handle.wait_until(lambda: totals(handle)[:2] == (0, 0))
            assert [link.conn for link in client.links()] == [conn]
        nursery.cancel_scope.cancel()
