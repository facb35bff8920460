"""The topology page in a real headless Chromium, on a real installation.

Two fylrs on one PostgreSQL, three execservers (two behind a real HAProxy),
the last fylr's callback base behind a second HAProxy in front of the first
fylr. The page is opened on the first fylr and must show every node, follow a
job live over its websocket (no reload), and mark the callback checks that the
balancer broke. A screenshot is saved as an artifact (``tmp_path``, and
``$TRIO_BROKER_ARTIFACTS`` when set).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import httpx
import trio
from trio_broker_daemons.fylr.app import FylrHandle, serve_fylr
from trio_broker_daemons.fylr.config import FylrConfig

from tests.daemons.test_topology import hold_one
from tests.support.browser import open_browser
from tests.support.installation import WAIT, open_installation

TIMEOUT_MS = WAIT * 1000
OPERATOR = "operator-token-for-the-page"


def count(selector: str) -> str:
    return f"document.querySelectorAll({selector!r}).length"


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
            f"{count('[data-kind=fylr]')} === 2 && {count('[data-kind=balancer]')} === 1"
            f" && {count('[data-kind=execserver]')} === 3"
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
    assert summary == "2 fylr, 1 balancer, 3 execserver, 0 running"
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


def keep_artifact(shot: Path) -> None:
    """Copy the screenshot to ``$TRIO_BROKER_ARTIFACTS`` when it is set (CI keeps it)."""
    artifacts = os.environ.get("TRIO_BROKER_ARTIFACTS")
    if artifacts:
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(artifacts) / shot.name)
