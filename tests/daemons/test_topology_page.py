"""The topology page in a real headless Chromium, on real installations, in each state
an operator must see.

- **A failed callback check** (and the page followed live): two fylrs on one
  PostgreSQL, three execservers (two behind a real HAProxy), the last fylr's
  callback base behind a second HAProxy in front of the first fylr. The page is
  opened on the first fylr and must show every node, follow a job live over its
  websocket (no reload), mark the callback checks that the balancer broke, and
  turn red.
- **An unreachable address**: a fylr configured with a live execserver and an
  address nothing answers on; the address is a red node with its error and
  since when, and the page turns red.
- **A lost replica**: two execserver processes behind HAProxy, one killed; it
  stays on the page as lost (amber), its balancer says so.
- **A backlog**: steps ready in the queue for longer than ``connect_timeout``;
  the queue's table shows them per priority band and the page turns amber.

Each test saves a screenshot as an artifact (``tmp_path``, and
``$TRIO_BROKER_ARTIFACTS`` when set); the ones in ``docs/`` come from these tests.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import trio
import yaml
from trio_broker_daemons.execserver.app import serve_from_config
from trio_broker_daemons.fylr.app import FylrHandle, serve_fylr
from trio_broker_daemons.fylr.config import FylrConfig

from tests.daemons.test_topology import hold_one
from tests.support.browser import Browser, open_browser
from tests.support.haproxy import open_haproxy
from tests.support.installation import (
    SERVICES,
    WAIT,
    execserver_config,
    fylr_config,
    open_installation,
)
from tests.support.processes import open_execserver_process
from trio_broker.trio.execserver import ExecserverHandle

TIMEOUT_MS = WAIT * 1000
OPERATOR = "operator-token-for-the-page"


def count(selector: str) -> str:
    return f"document.querySelectorAll({selector!r}).length"


LEVEL = "document.body.dataset.level"
"""The page's health level (``ok``, ``warning``, ``error``), as its header's dot shows it."""


async def wait_for(browser: Browser, condition: str) -> None:
    """Wait (bounded) until the JavaScript ``condition`` holds on the page."""
    await browser.call(lambda page: page.wait_for_function(condition, timeout=TIMEOUT_MS))


async def open_page(browser: Browser, fylr: FylrHandle) -> None:
    """Open the topology page of ``fylr`` and wait until it follows its websocket."""
    await browser.call(lambda page: page.goto(f"{fylr.url}/inspect/system/topology"))
    await wait_for(browser, "document.getElementById('status').textContent === 'live'")


async def texts(browser: Browser, selector: str) -> list[str]:
    return await browser.call(lambda page: page.locator(selector).all_text_contents())


async def shoot(browser: Browser, path: Path) -> Path:
    """A full-page screenshot at ``path``, kept as an artifact."""
    size = await browser.call(lambda page: len(page.screenshot(path=str(path), full_page=True)))
    assert size > 10_000
    keep_artifact(path)
    return path


@asynccontextmanager
async def running_fylr(config: FylrConfig) -> AsyncIterator[FylrHandle]:
    async with trio.open_nursery() as nursery:
        fylr: FylrHandle = await nursery.start(serve_fylr, config)
        try:
            yield fylr
        finally:
            fylr.stop()
            with trio.fail_after(WAIT):
                await fylr.wait_closed()


async def test_the_page_shows_the_installation_and_follows_it_live(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Two fylr nodes, three execserver nodes and one balancer node; a job started while the
    page is open changes the running count without a reload; the callback base behind a
    balancer is warned about; nothing is fetched from outside 127.0.0.1."""
    async with (
        open_installation(pg_dsn, tmp_path, callback_balancer=True) as inst,
        open_browser() as browser,
    ):
        first = inst.fylrs[0]
        url = f"{first.url}/inspect/system/topology"
        exec_a = f"exec:{inst.direct[0].broker.config.instance_id}"
        await browser.call(lambda page: page.goto(url))
        nodes = (
            # nodes only: a problem line names its subject's kind too (data-kind, no data-node)
            f"{count('[data-node][data-kind=fylr]')} === 2"
            f" && {count('[data-node][data-kind=balancer]')} === 1"
            f" && {count('[data-node][data-kind=execserver]')} === 3"
        )
        await browser.call(lambda page: page.wait_for_function(nodes, timeout=TIMEOUT_MS))
        await browser.call(
            lambda page: page.wait_for_function(
                "document.getElementById('status').textContent === 'live'", timeout=TIMEOUT_MS
            )
        )
        await browser.call(lambda page: page.evaluate("window.notReloaded = true"))

        running = f"document.querySelector('[data-node=\"{exec_a}\"]')?.dataset.running"
        await browser.call(
            lambda page: page.wait_for_function(f"{running} === '0'", timeout=TIMEOUT_MS)
        )
        async with trio.open_nursery() as jobs:
            jobs.start_soon(hold_one, inst.direct[0])
            await browser.call(
                lambda page: page.wait_for_function(f"{running} === '1'", timeout=TIMEOUT_MS)
            )
            assert await browser.call(lambda page: page.evaluate("window.notReloaded === true"))
            warning = (
                "[...document.querySelectorAll('.callback-warning')]"
                ".some(li => li.textContent.includes('mismatch'))"
                f" && {count('.warn-marker')} === 2"
            )
            await browser.call(lambda page: page.wait_for_function(warning, timeout=TIMEOUT_MS))
            warnings = await browser.call(
                lambda page: page.locator(".callback-warning").all_text_contents()
            )
            shot = tmp_path / "topology.png"
            await browser.call(lambda page: page.screenshot(path=str(shot), full_page=True))
            jobs.cancel_scope.cancel()
        await browser.call(
            lambda page: page.wait_for_function(f"{running} === '0'", timeout=TIMEOUT_MS)
        )
        assert await browser.call(lambda page: page.evaluate("window.notReloaded === true"))
        summary = await browser.call(lambda page: page.text_content("#summary"))
        level = await browser.call(lambda page: page.evaluate(LEVEL))
    # one problem more since fylrs check their own callback base: fylr-2's balanced base
    # answers as fylr-1
    assert summary == "2 fylr, 1 balancer, 3 execserver, 0 running, 0 ready — 3 problems"
    assert level == "error"  # a callback check that fails: the pipes of its jobs fail
    assert len(warnings) == 2  # the last fylr's two connections (exec-a, its replica)
    assert all(w.startswith("⚠ fylr-2: callback check exec-") for w in warnings), warnings
    assert browser.blocked == []
    assert browser.requests  # the page, its websocket: all on 127.0.0.1
    assert shot.stat().st_size > 10_000
    keep_artifact(shot)


async def test_an_operator_opens_the_page_with_the_token_as_password(
    pg_dsn: str, tmp_path: Path
) -> None:
    """With tokens configured, a browser opens the page through its login prompt (the
    operator token as the password) and the page follows the websocket through the signed
    link it embeds (a browser cannot give a websocket a token); a browser without the
    login gets 401 and a login prompt (the Basic challenge)."""
    config = FylrConfig.from_mapping(
        {
            "listen": "127.0.0.1:0",
            "name": "guarded-fylr",
            "state_dir": str(tmp_path / "state"),
            "database": pg_dsn,
            "database_pool": 4,
            "execservers": [],
            "tokens": {"operator": OPERATOR, "read": "r" * 20, "upload": "u" * 20},
        }
    )
    async with trio.open_nursery() as nursery:
        fylr: FylrHandle = await nursery.start(serve_fylr, config)
        url = f"{fylr.url}/inspect/system/topology"
        async with httpx.AsyncClient(timeout=WAIT) as http:
            stranger = await http.get(url)
        assert stranger.status_code == 401
        assert 'Basic realm="fylr", charset="UTF-8"' in stranger.headers.get_list(
            "www-authenticate"
        )
        async with open_browser(http_credentials=("operator", OPERATOR)) as browser:
            answer = await browser.call(lambda page: page.goto(url))
            assert answer is not None
            assert answer.status == 200
            await browser.call(
                lambda page: page.wait_for_function(
                    "document.getElementById('status').textContent === 'live'",
                    timeout=TIMEOUT_MS,
                )
            )
            summary = await browser.call(lambda page: page.text_content("#summary"))
            assert summary is not None
            assert summary.startswith("1 fylr, 0 balancer, 0 execserver")
            link = await browser.call(lambda page: page.evaluate("WEBSOCKET"))
            assert re.fullmatch(
                r"/inspect/system/topology/ws\?expires=\d+&signature=[\w-]{43}", link
            ), link
        fylr.stop()
        with trio.fail_after(WAIT):
            await fylr.wait_closed()


async def test_an_unreachable_address_is_drawn_red_with_its_error_and_since_when(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A fylr dials a live execserver and an address nothing listens on: that address is
    a node of its own, red, with the dial's error and since when, linked from the fylr;
    a red problem line says the same; the header's dot and summary turn red. (It used to
    be drawn as nothing at all, under a green dot.)"""
    with socket.socket() as unused:  # bound, never listening: every dial is refused
        unused.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{unused.getsockname()[1]}"
        async with trio.open_nursery() as nursery:
            live: ExecserverHandle = await nursery.start(
                serve_from_config, execserver_config("exec-a")
            )
            config = fylr_config(
                pg_dsn, tmp_path / "fylr", "fylr-1", [f"{live.host}:{live.port}", dead]
            )
            async with running_fylr(config) as fylr, open_browser() as browser:
                await open_page(browser, fylr)
                node = f"[data-node='addr:{dead}']"
                await wait_for(
                    browser,
                    f"document.querySelector(\"{node}\")?.dataset.state === 'unreachable'"
                    f" && {LEVEL} === 'error'"
                    f" && {count('[data-node][data-kind=execserver]')} === 1",
                )
                drawn = " ".join(await texts(browser, f"{node} text"))
                problems = await texts(browser, "#problems li.unreachable")
                summary = await browser.call(lambda page: page.text_content("#summary"))
                link = await browser.call(
                    lambda page: page.get_attribute(f"path[data-to='addr:{dead}']", "class")
                )
                await shoot(browser, tmp_path / "topology-unreachable.png")
            nursery.cancel_scope.cancel()
    assert f"{dead} unreachable for " in drawn
    assert "ConnectionRefusedError" in drawn
    assert re.search(r"since \d\d:\d\d:\d\d UTC", drawn), drawn
    assert "from fylr-1" in drawn
    (line,) = problems
    assert line.startswith(f"⚠ fylr-1 cannot reach {dead} since 20")
    assert "ConnectionRefusedError" in line
    assert summary == "1 fylr, 0 balancer, 1 execserver, 0 running, 0 ready — 1 problem"
    assert link == "link unreachable"


def execserver_yaml(name: str) -> str:
    return yaml.safe_dump(
        {
            "listen": "127.0.0.1:0",
            "name": name,
            "slots": 2,
            "fast_reserve": 0,
            "unknown_share": 1.0,
            "services": SERVICES,
        }
    )


async def test_a_killed_replica_stays_on_the_page_as_lost(pg_dsn: str, tmp_path: Path) -> None:
    """Two execserver processes behind a real HAProxy and two fylrs that dial it, started
    one after the other so that round-robin hands each fylr its own replica. The first
    fylr's replica is killed (SIGKILL): no fylr reaches it any more, and it stays drawn as
    lost (amber, with since when) behind its balancer, which counts it; the header turns
    amber. (It used to disappear: "1 replicas behind it".)"""
    async with (
        open_execserver_process(execserver_yaml("exec-b")) as b,
        open_execserver_process(execserver_yaml("exec-c")) as c,
        open_haproxy([(b.host, b.port), (c.host, c.port)], workdir=tmp_path / "lb") as lb,
    ):
        configs = [
            fylr_config(pg_dsn, tmp_path / f"fylr-{n}", f"fylr-{n}", [lb.address]) for n in (1, 2)
        ]
        async with running_fylr(configs[0]) as first:
            reached = await reached_instance(first)
            async with running_fylr(configs[1]) as second:
                other = await reached_instance(second)
                assert other != reached, "round-robin gave both fylrs the same replica"
                ((victim, name),) = [
                    (v, n) for v, n in ((b, "exec-b"), (c, "exec-c")) if n == reached[1]
                ]
                victim.process.kill()
                lost_id = f"exec:{reached[0]}"
                lost = f"[data-node='{lost_id}']"
                async with open_browser() as browser:
                    await open_page(browser, second)
                    await wait_for(
                        browser,
                        f"document.querySelector(\"{lost}\")?.dataset.state === 'lost'"
                        f" && {LEVEL} === 'warning'",
                    )
                    drawn = " ".join(await texts(browser, f"{lost} text"))
                    balancer = " ".join(await texts(browser, "[data-kind=balancer] text"))
                    problems = await texts(browser, "#problems li.lost")
                    link = await browser.call(
                        lambda page: page.get_attribute(f"path[data-to='{lost_id}']", "data-state")
                    )
                    await shoot(browser, tmp_path / "topology-lost.png")
    assert name in drawn
    assert "lost: gone for " in drawn
    assert "1 lost" in balancer
    (line,) = problems
    assert line.startswith(f"⚠ {name} ({reached[0]}) is gone: no connection reaches it")
    assert link == "lost"


async def reached_instance(fylr: FylrHandle) -> tuple[str, str]:
    """The one execserver instance ``fylr`` reached through its one address: id, name."""
    with trio.fail_after(WAIT):
        await fylr.wait_until(
            lambda s: s.client is not None and bool(s.client.addresses[0].instances)
        )
    client = fylr.statistics().client
    assert client is not None
    ((instance, name),) = client.addresses[0].names.items()
    return instance, name


HOLD_CLASS: dict[str, Any] = {
    "extensions": ["txt"],
    "metadata": {"service": "hold", "params": {"seconds": 600}},
    "versions": {},
}
"""Every text file's metadata step holds its slot for ten minutes."""


async def test_steps_waiting_longer_than_connect_timeout_turn_the_page_amber(
    pg_dsn: str, tmp_path: Path
) -> None:
    """One slot, held by the first file's step; the dispatcher may have one step in flight,
    so the later files' steps stay ready in the queue. Once the oldest has waited longer
    than connect_timeout (3 s here) the page turns amber, says so, and its queue table
    shows the ready steps per priority band with the oldest one's age."""
    async with open_installation(
        pg_dsn,
        tmp_path,
        fylrs=1,
        balanced=0,
        execserver={"slots": 1},
        fylr={"classes": {"text": HOLD_CLASS}, "max_in_flight": 1, "connect_timeout": "3s"},
    ) as inst:
        (fylr,) = inst.fylrs
        async with httpx.AsyncClient(base_url=fylr.url, timeout=WAIT) as http:
            for n, priority in enumerate((0, 0, 0, 2, 2, -2)):
                response = await http.put(
                    "/eas/put",
                    params={"filename": f"f{n}.txt", "priority": str(priority)},
                    content=b"text\n",
                )
                assert response.status_code == 201, response.text
        async with open_browser() as browser:
            await open_page(browser, fylr)
            await wait_for(
                browser,
                f"{LEVEL} === 'warning' && {count('#problems li.backlog')} === 1",
            )
            problems = await texts(browser, "#problems li")
            rows = await browser.call(
                lambda page: page.eval_on_selector_all(
                    "#queue tbody tr",
                    "rows => rows.map(r => [...r.cells].map(c => c.textContent))",
                )
            )
            late = await texts(browser, "#queue td.late")
            summary = await browser.call(lambda page: page.text_content("#summary"))
            await shoot(browser, tmp_path / "topology-backlog.png")
    (line,) = problems
    assert re.fullmatch(
        r"⚠ 5 steps ready in the queue; the oldest waits for \d+ s, longer than"
        r" connect_timeout \(3 s\)",
        line,
    ), line
    by_band = {row[0]: row[1:] for row in rows}
    assert list(by_band) == ["interactive (2)", "normal (0)", "background (-2)", "all"]
    assert [cells[0] for cells in by_band.values()] == ["2", "2", "1", "5"]  # ready
    assert by_band["normal (0)"][2] == "1"  # claimed: the step holding the slot
    assert late  # the oldest ready age, marked
    assert summary == "1 fylr, 0 balancer, 1 execserver, 1 running, 5 ready — 1 problem"


def keep_artifact(shot: Path) -> None:
    """Copy the screenshot to ``$TRIO_BROKER_ARTIFACTS`` when it is set (CI keeps it)."""
    artifacts = os.environ.get("TRIO_BROKER_ARTIFACTS")
    if artifacts:
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(artifacts) / shot.name)
