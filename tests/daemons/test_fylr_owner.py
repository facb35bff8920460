"""The embedded database has one owner: two real fylr processes on one ``state_dir``.

The first fylr starts the private PostgreSQL under ``<state_dir>/pg`` and locks
the folder; a second one started with the same ``state_dir`` refuses to start,
with one line naming the process that holds it, and leaves the server alone: the
first keeps serving. A server that somebody else started on the folder is used
and left running when the fylr stops.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio
import yaml
from trio_broker_daemons.fylr.pgcluster import PgCluster

from tests.daemons.test_fylr import WAIT
from tests.support.processes import open_fylr_process


@pytest.fixture
def state_dir() -> Iterator[Path]:
    """A state folder the ``postgres`` user can reach (pytest's own are root-only)."""
    path = Path(tempfile.mkdtemp(prefix="trio-broker-owner-"))
    path.chmod(0o711)
    try:
        yield path / "state"
    finally:
        shutil.rmtree(path, ignore_errors=True)


def server_running(cluster: PgCluster) -> bool:
    """Whether the cluster's postmaster (``postmaster.pid``) is alive."""
    pid = cluster.postmaster_pid
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def embedded_config(state_dir: Path) -> str:
    return yaml.safe_dump(
        {
            "listen": "127.0.0.1:0",
            "state_dir": str(state_dir),
            "database_pool": 2,
            "execservers": [],
        }
    )


def run_second(config: str, folder: Path) -> subprocess.CompletedProcess[str]:
    path = folder / "second.yml"
    path.write_text(config)
    return subprocess.run(
        [sys.executable, "-m", "trio_broker_daemons", "--log-level", "error", "fylr",
         "--config", str(path)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


async def test_a_second_fylr_on_the_same_state_dir_refuses_and_the_first_keeps_serving(
    state_dir: Path, tmp_path: Path
) -> None:
    """The second fylr exits 1 with one line naming the first's pid; the first's database is
    untouched (it stores a file afterwards), and it stops its own server when it ends."""
    config = embedded_config(state_dir)
    cluster = PgCluster(state_dir / "pg")
    async with (
        open_fylr_process(config) as first,
        httpx.AsyncClient(base_url=first.http_url, timeout=WAIT) as http,
    ):
        assert server_running(cluster)
        result = await trio.to_thread.run_sync(run_second, config, tmp_path)
        assert result.returncode == 1, result.stderr
        assert result.stderr.splitlines() == [
            f"trio-broker fylr: the private PostgreSQL in {state_dir / 'pg'} is in use by"
            f" process {first.process.pid} (another fylr with the same state_dir): stop it, or"
            " give each fylr a state_dir of its own"
        ]
        assert server_running(cluster)
        response = await http.put("/eas/put", params={"filename": "a.bin"}, content=b"abc")
        assert response.status_code == 201, response.text
        assert (await http.get("/healthz")).status_code == 200
    assert not server_running(cluster)  # the first fylr started it, and stopped it


async def test_a_server_somebody_else_started_is_left_running(state_dir: Path) -> None:
    """A fylr that finds the server running (not started by a fylr of this folder) uses it
    and leaves it running when it stops."""
    cluster = PgCluster(state_dir / "pg", settings={"fsync": "off"})
    with cluster:
        async with (
            open_fylr_process(embedded_config(state_dir)) as fylr,
            httpx.AsyncClient(base_url=fylr.http_url, timeout=WAIT) as http,
        ):
            response = await http.put("/eas/put", params={"filename": "a.bin"}, content=b"abc")
            assert response.status_code == 201, response.text
        assert server_running(cluster)
