"""The execserver's HTTP pages on a real listener: health, the index, the token, the job log."""

from __future__ import annotations

import logging

import httpx
import pytest
import trio

from tests.support.rawhttp import UPGRADE, exchange
from tests.support.wire import WAIT, connect, start_execserver
from trio_broker.core import protocol as p
from trio_broker.trio.pages import bearer_matches

TOKEN = "s3cret-token"


async def test_livez_stays_200_while_draining_and_readyz_turns_503(nursery: trio.Nursery) -> None:
    """/livez answers 200 through the drain; /readyz and /healthz answer 503 once it drains."""
    handle = await start_execserver(nursery)
    async with connect(handle) as peer, httpx.AsyncClient(base_url=handle.http_url) as http:
        offer = await peer.want("running", "hold")
        assert isinstance(offer, p.Offer)
        await peer.run(offer, "hold", {"seconds": 30})
        for path in ("/livez", "/readyz", "/healthz"):
            answer = await http.get(path)
            assert (answer.status_code, answer.json()) == (200, {"status": "serving"}), path
        handle.drain()
        live = await http.get("/livez")
        assert (live.status_code, live.json()) == (200, {"status": "draining"})
        for path in ("/readyz", "/healthz"):
            answer = await http.get(path)
            assert (answer.status_code, answer.json()) == (503, {"status": "draining"}), path
        handle.stop()
        assert (await peer.done("running")).receipt.status == "stopped"


async def test_the_index_lists_every_route(nursery: trio.Nursery) -> None:
    """GET / is a JSON list of the routes, the websocket and whether each needs the token."""
    handle = await start_execserver(nursery, broker_token=TOKEN)
    async with httpx.AsyncClient(base_url=handle.http_url) as http:
        answer = await http.get("/")
    assert answer.status_code == 200
    routes = {route["path"]: route for route in answer.json()["routes"]}
    assert list(routes) == [
        "/broker",
        "/livez",
        "/readyz",
        "/healthz",
        "/inspect/system/execserver",
        "/metrics",
        "/",
    ]
    assert routes["/broker"]["kind"] == "websocket"
    assert {path for path, route in routes.items() if route["auth"] == "bearer"} == {
        "/broker",
        "/inspect/system/execserver",
        "/metrics",
    }
    assert all(route["what"] for route in routes.values())


@pytest.mark.parametrize("path", ["/inspect/system/execserver", "/metrics"])
async def test_inspection_and_metrics_need_the_token_when_one_is_set(
    nursery: trio.Nursery, path: str
) -> None:
    """With a broker token: 401 without it or with a wrong one, 200 with it; probes stay open."""
    handle = await start_execserver(nursery, broker_token=TOKEN)
    async with httpx.AsyncClient(base_url=handle.http_url) as http:
        refused = await http.get(path)
        wrong = await http.get(path, headers={"authorization": "Bearer nope"})
        allowed = await http.get(path, headers={"authorization": f"Bearer {TOKEN}"})
        probe = await http.get("/readyz")
    assert (refused.status_code, refused.headers["www-authenticate"]) == (401, "Bearer")
    assert wrong.status_code == 401
    assert allowed.status_code == 200
    assert probe.status_code == 200


def test_bearer_matches_only_the_exact_header() -> None:
    """The header must be exactly 'Bearer <token>'; no token configured lets anything in."""
    assert bearer_matches(f"Bearer {TOKEN}", TOKEN)
    assert not bearer_matches(f"bearer {TOKEN}", TOKEN)
    assert not bearer_matches(f"Bearer {TOKEN} ", TOKEN)
    assert not bearer_matches("", TOKEN)
    assert bearer_matches("", None)


async def test_each_job_is_one_structured_log_line(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """A job's end is one record with service, job id, subject, client, status, wait, duration."""
    handle = await start_execserver(nursery)
    with caplog.at_level(logging.INFO, logger="trio_broker.trio.execserver"):
        async with connect(handle) as peer:
            offer = await peer.want("j1", "echo")
            assert isinstance(offer, p.Offer)
            await peer.send(
                p.Job(
                    job_id="j1",
                    token=offer.token,
                    service="echo",
                    subject="file-7",
                    job={"params": {"text": "hi"}},
                )
            )
            with trio.fail_after(WAIT):
                receipt = (await peer.done("j1")).receipt
    (record,) = [r for r in caplog.records if r.getMessage().startswith("job j1 ")]
    assert record.getMessage() == "job j1 (echo) ended ok"
    fields = {
        key: getattr(record, key)
        for key in ("service", "job_id", "subject", "client", "status", "delivered")
    }
    assert fields == {
        "service": "echo",
        "job_id": "j1",
        "subject": "file-7",
        "client": "tests",
        "status": "ok",
        "delivered": True,
    }
    wait_s: float = getattr(record, "wait_s")  # noqa: B009
    duration_s: float = getattr(record, "duration_s")  # noqa: B009
    assert wait_s >= 0
    assert duration_s == round(receipt.duration_s, 6)
    assert getattr(record, "peak_memory") == receipt.peak_memory  # noqa: B009


TWO = (("authorization", f"Bearer {TOKEN}"), ("authorization", f"Bearer {TOKEN}"))
"""The right token, twice: still refused."""


@pytest.mark.parametrize("token", [TOKEN, None], ids=["token", "no-token"])
async def test_several_authorization_headers_are_400_on_every_route(
    nursery: trio.Nursery, token: str | None
) -> None:
    """Two Authorization headers (even both right) are refused with 400 on the pages, the
    probes, an unknown path, the /broker upgrade of a fresh connection (the listener's
    own path) and of a kept-alive one (the ASGI path), with a token configured or not;
    one header is judged as before."""
    handle = await start_execserver(nursery, broker_token=token)
    one = (("authorization", f"Bearer {TOKEN}"),)
    several = b"several Authorization headers: send one\n"
    for path in ("/inspect/system/execserver", "/metrics", "/livez", "/", "/nowhere"):
        answers = await exchange(handle.host, handle.port, [("GET", path, TWO), ("GET", path, one)])
        assert answers[0] == (400, several), path
        assert answers[1][0] == (404 if path == "/nowhere" else 200), path
    fresh = await exchange(handle.host, handle.port, [("GET", "/broker", (*UPGRADE, *TWO))])
    assert fresh == [(400, several)]
    kept_alive = await exchange(
        handle.host, handle.port, [("GET", "/livez", ()), ("GET", "/broker", (*UPGRADE, *TWO))]
    )
    assert kept_alive == [(200, b'{"status":"serving"}'), (400, several)]
    accepted = await exchange(handle.host, handle.port, [("GET", "/broker", (*UPGRADE, *one))])
    assert accepted[0][0] == 101
    refused = await exchange(
        handle.host,
        handle.port,
        [("GET", "/livez", ()), ("GET", "/broker", (*UPGRADE, ("authorization", "Bearer no")))],
    )
    assert refused[1][0] == (401 if token else 101)
