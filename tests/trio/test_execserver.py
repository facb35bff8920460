"""The execserver over real websockets on 127.0.0.1, with real subprocesses."""

from __future__ import annotations

import contextlib
import os
import ssl
import sys
from functools import partial
from pathlib import Path
from typing import Any, cast

import httpx
import psutil
import pytest
import trio
import trustme
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from trio_websocket import ConnectionClosed, wrap_client_stream

from tests.support.stalled import flood_pings, stalled_stream
from tests.support.wire import WAIT, Peer, connect, start_execserver
from trio_broker.core import protocol as p
from trio_broker.trio.execserver import ExecserverHandle


async def occupy(handle: ExecserverHandle, peer: Peer, job_id: str = "holder") -> None:
    """Take a slot with a job that runs until cancelled; return once it runs."""
    running = handle.broker.running()
    offer = await peer.want(job_id, "hold")
    assert isinstance(offer, p.Offer)
    await peer.run(offer, "hold", {"seconds": 300})
    with trio.fail_after(WAIT):
        await handle.wait_until(lambda: handle.broker.running() > running)


async def release(peer: Peer, job_id: str = "holder") -> p.Done:
    await peer.send(p.Cancel(job_id=job_id))
    done = await peer.done(job_id)
    assert done.receipt.status == "cancelled"
    return done


async def test_grant_order_over_the_wire(nursery: trio.Nursery) -> None:
    """Priority first, then round-robin across connections, then FIFO."""
    handle = await start_execserver(nursery, slots=1)
    async with connect(handle) as a, connect(handle) as b:
        await occupy(handle, a)
        for job_id in ("a1", "a2", "a3"):
            assert isinstance(await a.want(job_id, "noop"), p.Queued)
        for job_id in ("b1", "b2"):
            assert isinstance(await b.want(job_id, "noop"), p.Queued)
        assert isinstance(await b.want("b-urgent", "noop", priority=5), p.Queued)
        await release(a)
        expected = [
            (b, "b-urgent"),
            (a, "a1"),
            (b, "b1"),
            (a, "a2"),
            (b, "b2"),
            (a, "a3"),
        ]
        for peer, job_id in expected:
            offer = await peer.expect(p.Offer)
            assert offer.job_id == job_id
            await peer.send(p.Decline(token=offer.token))
    assert handle.broker.pool.busy == 0


async def test_idle_execserver_offers_at_once_otherwise_queued(nursery: trio.Nursery) -> None:
    """WANT on a free pool is answered by OFFER; on a full one by QUEUED, then OFFER."""
    handle = await start_execserver(nursery, slots=1)
    async with connect(handle) as peer:
        first = await peer.want("first", "echo")
        assert isinstance(first, p.Offer)
        assert len(first.token) >= 22
        assert isinstance(await peer.want("second", "echo"), p.Queued)
        await peer.run(first, "echo", {"text": "one"})
        # the freed slot is offered first, then the receipt follows
        second = await peer.expect(p.Offer)
        assert second.job_id == "second"
        done = await peer.done("first")
        assert done.receipt.stdout_prefix == "one\n"


async def test_offer_expiry(nursery: trio.Nursery) -> None:
    """An unredeemed offer expires with a notice; its token is then unknown."""
    handle = await start_execserver(nursery, slots=1, offer_ttl="0.5s")
    async with connect(handle) as peer:
        offer = await peer.want("late", "noop")
        assert isinstance(offer, p.Offer)
        await peer.expect_error("offer_expired", "late")
        await peer.run(offer, "noop")
        await peer.expect_error("unknown_token", "late")
        assert handle.broker.pool.busy == 0


async def test_decline_frees_the_slot_for_the_next_want(nursery: trio.Nursery) -> None:
    handle = await start_execserver(nursery, slots=1)
    async with connect(handle) as a, connect(handle) as b:
        offer = await a.want("surplus", "noop")
        assert isinstance(offer, p.Offer)
        assert isinstance(await b.want("next", "noop"), p.Queued)
        await a.send(p.Decline(token=offer.token))
        assert (await b.expect(p.Offer)).job_id == "next"


async def test_cancel_kills_the_whole_process_group(nursery: trio.Nursery, tmp_path: Path) -> None:
    """CANCEL ends a running command and the grandchild it started."""
    fifo = tmp_path / "grandchild.pid"
    os.mkfifo(fifo)
    script = 'sleep 300 & echo $! > "$1"; wait'
    handle = await start_execserver(
        nursery,
        services={"tree": {"argv": ["sh", "-c", script, "sh", "{fifo}"]}},
    )
    async with connect(handle) as peer:
        offer = await peer.want("tree", "tree")
        assert isinstance(offer, p.Offer)
        await peer.run(offer, "tree", {"fifo": str(fifo)})
        with trio.fail_after(WAIT):
            text = await trio.to_thread.run_sync(fifo.read_text)
        grandchild = psutil.Process(int(text))
        assert grandchild.is_running()
        await peer.send(p.Cancel(job_id="tree"))
        done = await peer.done("tree")
        assert done.receipt.status == "cancelled"
        assert not psutil.pid_exists(grandchild.pid) or (
            grandchild.status() == psutil.STATUS_ZOMBIE
        )


@pytest.mark.parametrize(
    ("service", "status", "error"),
    [
        ({"argv": ["sleep", "30"], "timeout": "1s"}, "timed_out", "timed out after 1s"),
        ({"argv": ["sleep", "30"], "stall_timeout": "1s"}, "stalled", "no progress for 1s"),
        (
            {
                "argv": [
                    sys.executable,
                    "-c",
                    "import signal; b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096]);"
                    " signal.pause()",
                ],
                "memory_limit": "100M",
                "stall_timeout": "0",
            },
            "out_of_memory",
            "out of memory",
        ),
        ({"argv": ["sh", "-c", "echo oops >&2; exit 3"]}, "failed", "exit status 3"),
    ],
    ids=["timeout", "stall", "memory", "failed"],
)
async def test_supervision_receipts(
    nursery: trio.Nursery, service: dict[str, object], status: str, error: str
) -> None:
    """Real commands end with the receipt status their supervision decided."""
    handle = await start_execserver(nursery, services={"job": service})
    async with connect(handle) as peer:
        offer = await peer.want("j", "job")
        assert isinstance(offer, p.Offer)
        await peer.run(offer, "job")
        receipt = (await peer.done("j")).receipt
        assert receipt.status == status, receipt
        assert receipt.error is not None
        assert error in receipt.error
        assert receipt.instance_id == handle.broker.config.instance_id


async def test_missing_parameter_is_an_error_receipt_not_an_error_frame(
    nursery: trio.Nursery,
) -> None:
    handle = await start_execserver(nursery)
    async with connect(handle) as peer:
        offer = await peer.want("j", "echo")
        assert isinstance(offer, p.Offer)
        await peer.run(offer, "echo", {})
        receipt = (await peer.done("j")).receipt
        assert receipt.status == "error"
        assert receipt.error == "missing parameter 'text'"
        assert receipt.exit_code is None


async def test_draining(nursery: trio.Nursery) -> None:
    """Draining: HELLO at once, WANT and JOB refused, running jobs finish, 1001, exit."""
    handle = await start_execserver(nursery, slots=2)
    async with connect(handle) as peer, httpx.AsyncClient() as http:
        running = await peer.want("running", "hold")
        assert isinstance(running, p.Offer)
        await peer.run(running, "hold", {"seconds": 1})
        withdrawn = await peer.want("withdrawn", "noop")
        assert isinstance(withdrawn, p.Offer)
        handle.drain()
        hello = await peer.recv(skip_hello=False)
        assert isinstance(hello, p.Hello)
        assert (hello.draining, hello.services, hello.processes) == (True, {}, 0)
        assert (await http.get(handle.http_url + "/healthz")).status_code == 503
        await peer.send(p.Want(job_id="new", service="noop", priority=0))
        await peer.expect_error("draining", "new")
        await peer.run(withdrawn, "noop")
        await peer.expect_error("draining", "withdrawn")
        assert (await peer.done("running")).receipt.status == "ok"
        with pytest.raises(ConnectionClosed) as closed:
            await peer.recv()
        assert closed.value.reason is not None
        assert closed.value.reason.code == 1001
    with trio.fail_after(WAIT):
        await handle.wait_closed()


async def test_drain_timeout_stops_running_jobs(nursery: trio.Nursery) -> None:
    handle = await start_execserver(nursery, drain_timeout="0.5s")
    async with connect(handle) as peer:
        await occupy(handle, peer, "long")
        handle.drain()
        receipt = (await peer.done("long")).receipt
        assert receipt.status == "stopped"
    with trio.fail_after(WAIT):
        await handle.wait_closed()


async def test_dropped_connection_frees_its_slots(nursery: trio.Nursery) -> None:
    """A connection that goes away releases its offers and stops its running jobs."""
    handle = await start_execserver(nursery, slots=2)
    async with connect(handle) as survivor:
        async with connect(handle) as doomed:
            await occupy(handle, doomed, "orphan")
            offered = await doomed.want("offered", "noop")
            assert isinstance(offered, p.Offer)
            assert isinstance(await survivor.want("waiting-1", "noop"), p.Queued)
            assert isinstance(await survivor.want("waiting-2", "noop"), p.Queued)
        # the offer frees at once; the running job's slot once it was stopped
        assert (await survivor.expect(p.Offer)).job_id == "waiting-1"
        assert (await survivor.expect(p.Offer)).job_id == "waiting-2"
    recent = handle.statistics().broker.recent
    orphan = next(r for r in recent if r.job_id == "orphan")
    assert orphan.delivered is False
    assert orphan.receipt.status == "stopped"


async def test_a_peer_that_does_not_read_is_closed(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """A peer that keeps sending PINGs but reads none of the PONGs fills its outbox: the
    execserver drops the connection instead of queueing answers without end."""
    handle = await start_execserver(nursery)
    stream = await stalled_stream(handle.host, handle.port)
    try:
        async with trio.open_nursery() as peer_tasks:
            ws = await wrap_client_stream(
                peer_tasks, stream, handle.host, "/broker", message_queue_size=0
            )
            with trio.fail_after(WAIT):
                await handle.wait_until(lambda: len(handle.broker.connections()) == 1)
                # the execserver may close before the last PINGs went out
                with contextlib.suppress(ConnectionClosed):
                    await flood_pings(ws)
                await handle.wait_until(lambda: not handle.broker.connections())
            peer_tasks.cancel_scope.cancel()
    finally:
        await stream.aclose()
    assert any("does not read its frames" in r.getMessage() for r in caplog.records)


async def upgrade_status(url: str, headers: dict[str, str] | None = None) -> int:
    """The HTTP status a websocket upgrade request gets (101 means accepted)."""
    request_headers = {
        "Connection": "Upgrade",
        "Upgrade": "websocket",
        "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
        **(headers or {}),
    }
    async with httpx.AsyncClient() as http, http.stream("GET", url, headers=request_headers) as r:
        return r.status_code


async def test_bearer_token(nursery: trio.Nursery) -> None:
    """Without the right token the upgrade is refused with 401; with it, HELLO."""
    handle = await start_execserver(nursery, broker_token="s3cret")
    url = handle.http_url + "/broker"
    assert await upgrade_status(url) == 401
    assert await upgrade_status(url, {"Authorization": "Bearer wrong"}) == 401
    assert await upgrade_status(url, {"Authorization": "s3cret"}) == 401
    assert await upgrade_status(url, {"Authorization": "Bearer s3cret"}) == 101
    async with connect(handle, headers=[("Authorization", "Bearer s3cret")]) as peer:
        assert peer.hellos[0].processes == 2
    with trio.fail_after(WAIT):
        await handle.wait_until(lambda: not handle.broker.connections())


async def test_other_paths_are_404(nursery: trio.Nursery) -> None:
    handle = await start_execserver(nursery)
    assert await upgrade_status(handle.http_url + "/elsewhere") == 404
    assert await upgrade_status(handle.http_url + "/broker") == 101


async def test_tls(nursery: trio.Nursery, tmp_path: Path) -> None:
    """wss:// with a certificate from a private CA."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(cert_file))
    cert.private_key_pem.write_to_path(str(key_file))
    handle = await start_execserver(nursery, tls={"cert": str(cert_file), "key": str(key_file)})
    assert handle.url.startswith("wss://")
    context = ssl.create_default_context()
    ca.configure_trust(context)
    async with connect(handle, ssl_context=context) as peer:
        offer = await peer.want("secure", "echo")
        assert isinstance(offer, p.Offer)
        await peer.run(offer, "echo", {"text": "over tls"})
        assert (await peer.done("secure")).receipt.stdout_prefix == "over tls\n"
    async with httpx.AsyncClient(verify=context) as http:
        assert (await http.get(handle.http_url + "/healthz")).status_code == 200


async def test_hello_content(nursery: trio.Nursery) -> None:
    """The first HELLO describes the pool, the services and this connection."""
    handle = await start_execserver(
        nursery, slots=3, services={"a": {"builtin": "noop", "max_slots": 2}}
    )
    async with connect(handle) as peer:
        hello = peer.hellos[0]
        assert hello.protocol == 1
        assert hello.instance_id == handle.broker.config.instance_id
        assert hello.name == "test-exec"
        assert hello.services == {"a": p.ServiceInfo(max_slots=2, kind="unknown")}
        assert (hello.processes, hello.idle, hello.clients, hello.draining) == (3, 0, 1, False)
        assert hello.addr == f"127.0.0.1:{handle.port}"


async def test_frame_size_limit(nursery: trio.Nursery) -> None:
    """Exactly max_frame_bytes is served; one byte more (in UTF-8) closes with 1009."""
    limit = 2048
    handle = await start_execserver(nursery, max_frame_bytes=limit)
    async with connect(handle) as peer:
        frame = '{"type":"PING","nonce":"fits","pad":"'
        frame += "x" * (limit - len(frame) - 2) + '"}'
        assert len(frame.encode()) == limit
        await peer.send(frame)
        assert (await peer.expect(p.Pong)).nonce == "fits"
    async with connect(handle) as peer:
        # 1,100 characters but 2,200 bytes: the limit counts bytes
        await peer.send('{"type":"PING","nonce":"' + "é" * 1100 + '"}')
        with pytest.raises(ConnectionClosed) as closed:
            await peer.recv()
        assert closed.value.reason is not None
        assert closed.value.reason.code == 1009
    async with connect(handle) as peer:
        await peer.send(b"\x00" * (limit + 1))
        with pytest.raises(ConnectionClosed) as closed:
            await peer.recv()
        assert closed.value.reason is not None
        assert closed.value.reason.code == 1009


async def test_bad_frames_get_errors_and_the_connection_survives(nursery: trio.Nursery) -> None:
    handle = await start_execserver(nursery)
    async with connect(handle, register=False) as peer:
        await peer.send(p.Want(job_id="early", service="noop", priority=0))
        await peer.expect_error("not_registered", "early")
        await peer.send(b"binary")
        await peer.expect_error("bad_frame")
        await peer.send('{"type":"OFFER","job_id":"x","token":"t"}')
        await peer.expect_error("unknown_type", "x")
        await peer.register()
        await peer.register()
        await peer.expect_error("already_registered")
        await peer.send(p.Want(job_id="j", service="ffmpeg", priority=0))
        await peer.expect_error("unknown_service", "j")
        await peer.send(p.Query(job_id="nothing"))
        await peer.expect_error("unknown_job", "nothing")
        offer = await peer.want("j", "noop")
        assert isinstance(offer, p.Offer)
        await peer.send(p.Want(job_id="j", service="noop", priority=0))
        await peer.expect_error("duplicate_job", "j")
        await peer.send(p.Job(job_id="other", token=offer.token, service="noop", job={}))
        await peer.expect_error("token_mismatch", "other")
        await peer.run(offer, "noop")
        assert (await peer.done("j")).receipt.status == "ok"


async def test_inspection_and_metrics(nursery: trio.Nursery) -> None:
    handle = await start_execserver(nursery)
    async with connect(handle) as peer, httpx.AsyncClient() as http:
        offer = await peer.want("seen", "echo")
        assert isinstance(offer, p.Offer)
        await peer.run(offer, "echo", {"text": "hi"})
        await peer.done("seen")
        page = (await http.get(handle.http_url + "/inspect/system/execserver")).json()
        assert page["pool"]["slots"] == 2
        assert page["services"]["echo"]["completed"] == 1
        assert page["services"]["echo"]["kind"] == "light"
        (conn,) = page["connections"]
        assert conn["backend_id"] == "test"
        assert page["recent"][0]["job_id"] == "seen"
        assert page["recent"][0]["receipt"]["stdout_prefix"] == "hi\n"
        metrics = (await http.get(handle.http_url + "/metrics")).text
        assert "trio_broker_execserver_slots 2.0" in metrics
        assert 'trio_broker_execserver_service_jobs_completed_total{service="echo"} 1.0' in metrics
        health = await http.get(handle.http_url + "/healthz")
        assert (health.status_code, health.json()) == (200, {"status": "serving"})


async def _serve_whoami(nursery: trio.Nursery, backend_id: str) -> str:
    """A client-side HTTP listener answering /whoami, as a real client serves it."""
    app = Starlette(
        routes=[Route("/whoami", lambda request: JSONResponse({"backend_id": backend_id}))]
    )
    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    binds = await nursery.start(partial(hypercorn_serve, cast(Any, app), config))
    return str(binds[0])


@pytest.mark.parametrize(("answer", "expected"), [("me", "ok"), ("someone-else", "mismatch")])
async def test_callback_check(nursery: trio.Nursery, answer: str, expected: str) -> None:
    """REGISTER's callback base is fetched; a different backend_id is reported."""
    handle = await start_execserver(nursery)
    base = await _serve_whoami(nursery, answer)
    async with connect(handle, register=False) as peer:
        await peer.register(backend_id="me", callback_url=base)

        def checked() -> bool:
            return any(c.callback_check for c in handle.statistics().broker.connections)

        with trio.fail_after(WAIT):
            await handle.wait_until(checked)
        (conn,) = handle.statistics().broker.connections
        assert conn.callback_check is not None
        assert conn.callback_check.startswith(expected)


async def test_callback_check_failure_keeps_the_connection(nursery: trio.Nursery) -> None:
    handle = await start_execserver(nursery)
    async with connect(handle, register=False) as peer:
        await peer.register(backend_id="me", callback_url=handle.http_url + "/nothing-here")

        def checked() -> bool:
            return any(c.callback_check for c in handle.statistics().broker.connections)

        with trio.fail_after(WAIT):
            await handle.wait_until(checked)
        (conn,) = handle.statistics().broker.connections
        assert conn.callback_check is not None
        assert conn.callback_check.startswith("failed:")
        offer = await peer.want("still-served", "noop")
        assert isinstance(offer, p.Offer)


@pytest.mark.parametrize("base", ["http://exa mple/\x00", "http://[::1/", "ftp://nowhere"])
async def test_a_callback_url_that_is_no_url_fails_its_check_and_nothing_else(
    nursery: trio.Nursery, base: str
) -> None:
    """A made-up callback base (a control character, a broken host) is a failed check on
    that connection; the execserver keeps serving it and everyone else."""
    handle = await start_execserver(nursery)
    async with connect(handle, register=False) as peer:
        await peer.register(backend_id="me", callback_url=base)

        def checked() -> bool:
            return any(c.callback_check for c in handle.statistics().broker.connections)

        with trio.fail_after(WAIT):
            await handle.wait_until(checked)
        (conn,) = handle.statistics().broker.connections
        assert conn.callback_check is not None
        assert conn.callback_check.startswith("failed:")
        assert isinstance(await peer.want("still-served", "noop"), p.Offer)
    async with connect(handle) as other:
        assert isinstance(await other.want("another", "noop"), p.Offer)


# -- bounded peers ----------------------------------------------------------------------


async def test_oversized_register_strings_are_refused_and_kept_nowhere(
    nursery: trio.Nursery,
) -> None:
    """100 connections each send a REGISTER whose name is 300 kB: each gets bad_field,
    stays open and unregistered, and the inspection document stays small."""
    handle = await start_execserver(nursery)
    name = "n" * 300_000
    async with contextlib.AsyncExitStack() as stack:
        peers = [
            await stack.enter_async_context(connect(handle, register=False)) for _ in range(100)
        ]
        for peer in peers:
            await peer.send(p.Register(backend_id="b", name=name, version="1"))
        for peer in peers:
            error = await peer.expect(p.Error)
            assert (error.code, error.job_id) == ("bad_field", None)
            assert error.message == "REGISTER.name: expected at most 200 characters, got 300000"
        statistics = handle.statistics().broker
        assert [c.register for c in statistics.connections] == [None] * 100
        async with httpx.AsyncClient() as http:
            page = await http.get(f"{handle.http_url}/inspect/system/execserver")
        assert page.status_code == 200
        assert len(page.content) < 200_000  # 100 connections, no 300 kB string in sight
        # a correct REGISTER still follows on the same connection
        await peers[0].register()
        assert isinstance(await peers[0].want("j", "noop"), p.Offer)


async def test_wants_beyond_max_wants_per_connection_get_too_many_wants(
    nursery: trio.Nursery,
) -> None:
    """The daemon's max_wants_per_connection reaches the broker: the third WANT on a
    connection with two parked or offered is answered too_many_wants; another
    connection is not affected."""
    handle = await start_execserver(nursery, slots=1, max_wants_per_connection=2)
    async with connect(handle) as a, connect(handle) as b:
        assert isinstance(await a.want("j1", "noop"), p.Offer)
        assert isinstance(await a.want("j2", "noop"), p.Queued)
        await a.send(p.Want(job_id="j3", service="noop", priority=0))
        await a.expect_error("too_many_wants", "j3")
        assert isinstance(await b.want("k1", "noop"), p.Queued)
