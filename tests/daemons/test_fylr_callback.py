"""A fylr whose callback base does not lead back to it: one warning, and requeues, not failures.

A real fylr process listens on 127.0.0.2 while its broker connection to a real
execserver process on 127.0.0.1 leaves from 127.0.0.1, the way a host with several
addresses routes it: the callback base it registers, ``http://127.0.0.1:<port>``,
reaches nothing (the test holds that address and port bound, not listening, so the
connections are refused whatever else runs on this host). The execserver therefore
cannot open any pipe: every job ends ``stopped`` and its step is requeued, never
failed, and the fylr says so itself in one warning line, also on its topology page.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import yaml

from tests.daemons.test_fylr import WAIT
from tests.support.netns import until
from tests.support.processes import open_execserver_process, open_fylr_process

CLASSES = {"text": {"extensions": ["txt"], "versions": {"sha256": {"service": "sha256"}}}}


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port bound on 127.0.0.1 and not listening (a connection to it is refused), and
    free on 127.0.0.2 for the fylr."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]


def fylr_text(pg_dsn: str, state_dir: Path, port: int, execserver: str) -> str:
    return yaml.safe_dump(
        {
            "listen": f"127.0.0.2:{port}",
            "name": "multi-homed",
            "state_dir": str(state_dir),
            "database": pg_dsn,
            "database_pool": 4,
            "execservers": [execserver],
            "retry_delay": "0.5s",
            "counts_interval": "0s",
            "heartbeat_interval": "0.5s",
            "stale_after": "2s",
            "classes": CLASSES,
        }
    )


async def test_a_callback_base_that_misses_the_fylr_is_one_warning_and_steps_are_requeued(
    pg_dsn: str, tmp_path: Path, held_port: int
) -> None:
    """The callback base names an address the listener does not serve: the fylr logs one
    warning naming the base and the fix (``callback_own_url``, ``listen``), shows it on its
    topology, and its steps are requeued again and again (``stopped`` receipts naming the
    refused pipe), while no version fails."""
    exec_config = yaml.safe_dump(
        {
            "listen": "127.0.0.1:0",
            "slots": 2,
            "fast_reserve": 0,
            "unknown_share": 1.0,
            "services": {"sha256": {"argv": ["sha256sum"]}},
        }
    )
    log_file = tmp_path / "fylr.log"
    base = f"http://127.0.0.1:{held_port}"
    async with open_execserver_process(exec_config) as execserver:
        config = fylr_text(pg_dsn, tmp_path / "state", held_port, f"127.0.0.1:{execserver.port}")
        async with (
            open_fylr_process(config, log_level="info", stderr=log_file) as fylr,
            httpx.AsyncClient(base_url=fylr.http_url, timeout=WAIT) as http,
            httpx.AsyncClient(base_url=execserver.http_url, timeout=WAIT) as exec_http,
        ):

            async def topology() -> dict[str, Any]:
                document: dict[str, Any] = (await http.get("/inspect/system/topology/data")).json()
                return document

            async def page() -> dict[str, Any]:
                found: dict[str, Any] = (await http.get("/inspect/system/fylr")).json()
                return found

            with trio.fail_after(WAIT):
                document = await until(topology, lambda d: any(f["warnings"] for f in d["fylrs"]))
            (fylr_node,) = document["fylrs"]
            (warning,) = fylr_node["warnings"]
            assert warning.startswith(
                f"callback base {base} does not lead back to this fylr: it does not answer"
                " (connection refused"
            ), warning
            assert "callback_own_url" in warning
            assert f"listen (127.0.0.2:{held_port})" in warning

            response = await http.put(
                "/eas/put", params={"filename": "a.txt"}, content=b"some text\n"
            )
            assert response.status_code == 201, response.text
            file_id = response.json()["id"]
            with trio.fail_after(WAIT):
                await until(page, lambda p: p["steps"].get("produce.requeued", 0) >= 3)
            versions = (await http.get(f"/api/v1/eas/{file_id}")).json()["versions"]
            assert versions["sha256"]["status"] in ("pending", "processing")
            current = await page()
            assert current["queue"]["failed"] == 0
            assert current["steps"].get("produce.error", 0) == 0
            recent = (await exec_http.get("/inspect/system/execserver")).json()["recent"]
            assert recent
            for job in recent:
                assert job["receipt"]["status"] == "stopped"
                assert job["receipt"]["error"].startswith(
                    f"the in-pipe at {base} could not be reached (connection refused):"
                )
    lines = [line for line in log_file.read_text().splitlines() if "level=warning" in line]
    ours = [line for line in lines if f"callback base {base}" in line]
    assert len(ours) == 1, lines  # one line, however many connections and requeues
