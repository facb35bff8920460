"""The topology of an installation: the JSON document, its schema, the websocket, the idle wire.

Real fylrs on one PostgreSQL, real execservers, a real HAProxy, real websockets.
(The page itself is driven in a real Chromium by tests/daemons/test_topology_page.py.)
"""

from __future__ import annotations

import datetime
import io
import json
import os
import sys
import types
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import jsonschema  # type: ignore[import-untyped]
import trio
from rich.console import Console
from trio_broker_daemons.commands import top
from trio_broker_daemons.execserver.app import serve_from_config
from trio_broker_daemons.fylr.app import serve_fylr
from trio_broker_daemons.fylr.topology import Topology, schema, topology_document
from trio_websocket import WebSocketConnection, open_websocket_url

from tests.support.frames import FrameCount, serve_counting_relay
from tests.support.installation import WAIT, execserver_config, fylr_config, open_installation
from tests.trio.test_client import client_config
from trio_broker.trio.client import open_broker_client
from trio_broker.trio.execserver import ExecserverHandle
from trio_broker.trio.views import BackendView

Document = dict[str, Any]


def validate(document: Document) -> None:
    jsonschema.validate(document, schema())


@asynccontextmanager
async def topology_socket(base_url: str) -> AsyncIterator[WebSocketConnection]:
    url = base_url.replace("http://", "ws://") + "/inspect/system/topology/ws"
    async with open_websocket_url(url) as ws:
        yield ws


async def document_where(
    ws: WebSocketConnection, predicate: Callable[[Document], bool]
) -> Document:
    """The first pushed document that satisfies ``predicate`` (each one is schema-checked)."""
    with trio.fail_after(WAIT):
        while True:
            document: Document = json.loads(await ws.get_message())
            validate(document)
            if predicate(document):
                return document


def kinds(document: Document) -> tuple[int, int, int]:
    return len(document["fylrs"]), len(document["balancers"]), len(document["execservers"])


async def test_the_document_shows_every_fylr_execserver_and_the_balancer(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Either fylr draws the whole installation; the document validates against its schema;
    the callback base behind a balancer is marked on the connections it broke."""
    async with open_installation(pg_dsn, tmp_path, callback_balancer=True) as inst:
        first, last = inst.fylrs
        async with httpx.AsyncClient(timeout=WAIT) as http:
            response = await http.get(f"{first.url}/inspect/system/topology/data")
        assert response.status_code == 200
        validate(response.json())
        assert inst.balancer is not None
        names = {h.broker.config.name for h in inst.execservers}
        async with topology_socket(last.url) as ws:

            def complete(d: Document) -> bool:
                checks = [c["callback_ok"] for c in d["connections"]]
                return (
                    kinds(d) == (2, 1, 3)
                    and None not in checks
                    and all(e["live"] for e in d["execservers"])
                )

            document = await document_where(ws, complete)
    assert {e["name"] for e in document["execservers"]} == names
    (balancer,) = document["balancers"]
    assert balancer["id"] == f"lb:{inst.balancer.address}"
    assert sorted(balancer["instances"]) == sorted(
        h.broker.config.instance_id for h in inst.balanced
    )
    by_fylr = {f["backend_id"]: f["id"] for f in document["fylrs"]}
    assert set(by_fylr) == {first.backend_id, last.backend_id}
    checks = {
        (c["fylr"], c["execserver"]): (c["callback_ok"], c["callback_check"])
        for c in document["connections"]
    }
    assert len(checks) == 4  # each fylr: exec-a directly, one replica through the balancer
    for (fylr, _), (ok, text) in checks.items():
        if fylr == by_fylr[first.backend_id]:
            assert ok, text
        else:
            assert not ok
            assert text.startswith("mismatch:")
            assert first.backend_id in text
    warned = [link for link in document["links"] if link["warnings"]]
    assert {link["from"] for link in warned} == {by_fylr[last.backend_id]}
    assert len(warned) == 2  # its link to exec-a and its link to the balancer
    through = [c for c in document["connections"] if c["via"] is not None]
    assert {c["execserver"] for c in through} == {
        f"exec:{h.broker.config.instance_id}" for h in inst.balanced
    }  # the round-robin gave each fylr its own replica


async def test_a_job_changes_the_pushed_figures(pg_dsn: str, tmp_path: Path) -> None:
    """A job started while a viewer is connected shows as running in the next pushes."""
    async with open_installation(pg_dsn, tmp_path, fylrs=1, balanced=0) as inst:
        (fylr,) = inst.fylrs
        (handle,) = inst.execservers
        async with topology_socket(fylr.url) as ws:
            await document_where(ws, lambda d: d["execservers"][0]["live"])
            async with trio.open_nursery() as jobs:
                jobs.start_soon(hold_one, handle)

                def running(count: int) -> Callable[[Document], bool]:
                    return lambda d: d["execservers"][0]["figures"]["running"] == count

                await document_where(ws, running(1))
                jobs.cancel_scope.cancel()
            document = await document_where(ws, running(0))
    assert document["execservers"][0]["figures"]["finished"] == 0
    assert document["execservers"][0]["figures"]["failed"] == 1  # the cancelled hold


async def hold_one(handle: ExecserverHandle) -> None:
    """Hold one slot of the execserver (through a client of its own) until cancelled."""
    async with open_broker_client(client_config(handle, backend_id="holder")) as client:
        await client.run("hold", {"params": {"seconds": 600}})


async def test_idle_wire_with_the_page_closed_is_ping_and_pong(pg_dsn: str, tmp_path: Path) -> None:
    """While a viewer is connected STATS flow; once it left, the fylr's broker connection
    carries nothing but PING and PONG, counted on the wire."""
    frames = FrameCount()
    async with trio.open_nursery() as nursery:
        handle: ExecserverHandle = await nursery.start(
            serve_from_config, execserver_config("exec-a", ping_interval="0.3s")
        )
        port = await nursery.start(serve_counting_relay, handle.host, handle.port, frames)
        config = fylr_config(
            pg_dsn,
            tmp_path / "fylr",
            "fylr-1",
            [f"127.0.0.1:{port}"],
            ping_interval="0.3s",
            ping_timeout="10s",
        )
        fylr = await nursery.start(serve_fylr, config)
        async with topology_socket(fylr.url) as ws:
            await document_where(
                ws, lambda d: bool(d["execservers"]) and d["execservers"][0]["live"]
            )
        with trio.fail_after(WAIT):
            await frames.wait_for("to exec", "UNSUBSCRIBE")
            # settled: the idle figure is back to 2 and the fylr was told (no HELLO pending)
            await handle.wait_until(lambda: handle.broker.idle() == 2)
            client = fylr._state.client
            assert client is not None
            await client.wait_until(lambda: [x.idle for x in client.instance_loads()] == [2])
        before = frames.counts.copy()
        with trio.fail_after(WAIT):
            await frames.wait_for("to exec", "PING", before["to exec", "PING"] + 5)
            await frames.wait_for("to client", "PING", before["to client", "PING"] + 5)
        window = frames.counts - before
        fylr.stop()
        with trio.fail_after(WAIT):
            await fylr.wait_closed()
        nursery.cancel_scope.cancel()
    assert before["to exec", "SUBSCRIBE"] == 1
    assert before["to client", "STATS"] >= 1
    assert {kind for _, kind in window} <= {"PING", "PONG"}, window


# -- the merge, on its own ---------------------------------------------------------------------


def backend(backend_id: str, view: Document | None, *, age: float = 0.1) -> BackendView:
    return BackendView(
        backend_id=backend_id,
        name=backend_id,
        started=datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC),
        heartbeat_age=age,
        view=view,
        view_age=None if view is None else age,
    )


def link(address: str, instance: str, *, check: str | None = "ok", live: bool = True) -> Document:
    hello = {
        "name": f"name-{instance}",
        "addr": f"10.0.0.{instance[-1]}:7000",
        "processes": 4,
        "idle": 1,
        "clients": 2,
        "draining": False,
        "services": {"s": "light"},
    }
    stats = {
        "slots": 4,
        "fast_reserve": 1,
        "running": 3,
        "offered": 0,
        "waiting": 2,
        "finished": 10,
        "failed": 1,
        "per_minute": 6,
        "bytes_in": 5,
        "bytes_out": 6,
        "clients": 2,
        "draining": False,
        "services": {
            "s": {"kind": "light", "capacity": 4, "mean_s": 1.5, "running": 3, "waiting": 2}
        },
    }
    return {
        "address": address,
        "instance_id": instance,
        "local_addr": "127.0.0.1:5000",
        "callback_base": "http://127.0.0.1:8000",
        "callback_check": check if live else None,
        "figures": "live" if live else "none",
        "hello": hello,
        "stats": stats if live else None,
    }


def view(backend_id: str, links: list[Document], balanced: tuple[str, ...] = ()) -> Document:
    addresses = {ln["address"] for ln in links}
    return {
        "version": 1,
        "backend_id": backend_id,
        "name": backend_id,
        "url": None,
        "software": "0",
        "watched": False,
        "jobs": None,
        "dispatcher": None,
        "pipes": None,
        "warnings": [],
        "addresses": [
            {"address": a, "balanced": a in balanced, "instances": []} for a in addresses
        ],
        "links": links,
    }


def test_the_merge_dedupes_execservers_prefers_live_figures_and_skips_stale_backends() -> None:
    """One node per instance (live figures win), a balancer node per balanced address,
    warnings on the failing connection's first hop, stale backends left out."""
    views = [
        backend("f1", view("f1", [link("a:1", "i1", live=False), link("lb:2", "i2")], ("lb:2",))),
        backend(
            "f2",
            view("f2", [link("a:1", "i1", check="mismatch: x"), link("lb:2", "i3")], ("lb:2",)),
        ),
        backend("gone", view("gone", [link("a:1", "i9")]), age=99.0),
        backend("new", None),
    ]
    document = topology_document(views, stale_after=5.0, served_by="f1", now=1.0)
    validate(document)
    assert document["generated_at"] == "1970-01-01T00:00:01.000Z"
    assert [f["backend_id"] for f in document["fylrs"]] == ["f1", "f2", "new"]
    assert [e["instance_id"] for e in document["execservers"]] == ["i1", "i2", "i3"]
    i1 = document["execservers"][0]
    assert i1["live"]  # f2's live figures beat f1's HELLO-only ones
    assert i1["figures"]["running"] == 3
    assert i1["seen_by"] == ["fylr:f1", "fylr:f2"]
    assert document["balancers"] == [
        {"id": "lb:lb:2", "address": "lb:2", "instances": ["i2", "i3"]}
    ]
    warned = {(ln["from"], ln["to"]): ln["warnings"] for ln in document["links"] if ln["warnings"]}
    assert warned == {("fylr:f2", "exec:i1"): ["name-i1: mismatch: x"]}


# -- trio-broker top ---------------------------------------------------------------------------


async def test_top_draws_the_live_document_and_once_prints_it(pg_dsn: str, tmp_path: Path) -> None:
    """The live view follows the pushed documents; --once prints every node by name."""
    async with open_installation(pg_dsn, tmp_path, fylrs=1, direct=1, balanced=2) as inst:
        (fylr,) = inst.fylrs
        out = io.StringIO()
        with trio.fail_after(WAIT):
            await top.live(fylr.url, Console(file=out, width=160), updates=1)
        drawn = out.getvalue()
        assert "1 fylr, 1 balancer, 2 execserver" in drawn  # one replica reached so far
        with trio.fail_after(WAIT):
            printed = await trio.run_process(
                [
                    sys.executable,
                    "-m",
                    "trio_broker_daemons",
                    "top",
                    "--once",
                    "--server",
                    fylr.url,
                ],
                capture_stdout=True,
                capture_stderr=True,
                env={**os.environ, "COLUMNS": "200"},
            )
    text = printed.stdout.decode()
    for name in ("fylr-1", "exec-a", inst.balancer.address if inst.balancer else ""):
        assert name in text, text
    assert "direct" in text


async def test_top_of_an_unreachable_fylr_exits_1() -> None:
    """No fylr at the address: one line naming it, exit status 1."""
    printed = await trio.run_process(
        [sys.executable, "-m", "trio_broker_daemons", "top", "--server", "http://127.0.0.1:9"],
        capture_stdout=True,
        check=False,
    )
    assert printed.returncode == 1
    assert "cannot follow http://127.0.0.1:9" in printed.stdout.decode()


async def test_renewing_a_position_lease_does_not_wake_the_publisher() -> None:
    """Only a change of whether this fylr is watched republishes its view at once.

    A client following its queued uploads renews the lease every few seconds per
    file; each renewal used to wake the publishing task (a database write each).
    """
    state: Any = types.SimpleNamespace(client=None)
    topology = Topology(state)
    topology.lease(30)  # watched now, not yet published as watched: wake
    assert topology._wake.is_set()
    topology._published_watched = True  # what the publishing task records (no database here)
    topology._wake = trio.Event()
    for _ in range(5):
        topology.lease(30)
    assert not topology._wake.is_set()
    with topology.viewer():  # still watched: nothing to tell
        assert not topology._wake.is_set()
