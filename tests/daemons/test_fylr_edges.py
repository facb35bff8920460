"""The fylr's small edges, over real processes: an early answer to an upload, names that
cannot be versions, and the client commands following a file through a fylr restart."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import trio
import yaml
from trio_broker_daemons.fylr.pgcluster import free_port

from tests.daemons.test_upload_cli import trio_broker
from tests.support.netns import until
from tests.support.processes import open_execserver_process, open_fylr_process

WAIT = 120.0
CLASSES = {"text": {"extensions": ["txt"], "versions": {"sha256": {"service": "sha256"}}}}
EXECSERVER = yaml.safe_dump(
    {
        "listen": "127.0.0.1:0",
        "slots": 2,
        "fast_reserve": 0,
        "unknown_share": 1.0,
        "services": {"sha256": {"argv": ["sha256sum"]}},
    }
)


def fylr_text(pg_dsn: str, state_dir: Path, *, port: int = 0, **more: Any) -> str:
    return yaml.safe_dump(
        {
            "listen": f"127.0.0.1:{port}",
            "state_dir": str(state_dir),
            "database": pg_dsn,
            "database_pool": 4,
            "execservers": [],
            "heartbeat_interval": "0.5s",
            "stale_after": "2s",
            "retry_delay": "0.5s",
            "classes": CLASSES,
            **more,
        }
    )


async def run_cli(*args: str) -> subprocess.CompletedProcess[bytes]:
    with trio.fail_after(WAIT):
        return await trio.run_process(
            trio_broker(*args), capture_stdout=True, capture_stderr=True, check=False
        )


async def test_an_upload_over_the_limit_gets_its_413_at_once(pg_dsn: str, tmp_path: Path) -> None:
    """64 MB to a fylr that takes 1 MB: the fylr answers 413 before reading the body and closes
    the connection, so ``trio-broker upload`` reports the answer at once instead of blocking
    on a write nobody reads (a minute, until a timeout)."""
    big = tmp_path / "big.txt"
    with big.open("wb") as sparse:
        sparse.truncate(64 << 20)
    async with open_fylr_process(fylr_text(pg_dsn, tmp_path / "state", max_upload_size="1MB")) as f:
        started = trio.current_time()
        with trio.fail_after(30):  # the bug held the write for 61 s
            result = await run_cli("upload", str(big), "--server", f.http_url)
        took = trio.current_time() - started
    assert result.returncode == 1
    out = result.stdout.decode()
    assert out.startswith("big.txt: not uploaded: the fylr answered 413:"), (out, took)


async def test_a_name_that_cannot_be_a_version_is_404_never_500(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A NUL, a space, a slash-free oddity or an overlong name in a download's path: 404."""
    async with (
        open_fylr_process(fylr_text(pg_dsn, tmp_path / "state")) as fylr,
        httpx.AsyncClient(base_url=fylr.http_url, timeout=WAIT) as http,
    ):
        response = await http.put("/eas/put", params={"filename": "a.txt"}, content=b"text\n")
        assert response.status_code == 201, response.text
        file_id = response.json()["id"]
        for name in ("sha%00256", "%00", "a%20b", "%FF%FE", "x" * 300, "..", "sha256%0A"):
            response = await http.get(f"/api/v1/eas/download/{file_id}/{name}")
            assert response.status_code == 404, (name, response.status_code, response.text)
            assert len(response.content) < 200
        for path in (f"/api/v1/eas/{file_id}%00", "/api/v1/eas/%00", "/api/v1/eas/download/%00/x"):
            response = await http.get(path)
            assert response.status_code in (400, 404), (path, response.status_code)


@asynccontextmanager
async def refusing_then_dropping(port: int) -> AsyncIterator[trio.Event]:
    """A listener on ``port`` that accepts and closes at once (a fylr on its way down);
    the event is set at its first connection. Gone when the block ends."""
    first = trio.Event()
    listener = trio.socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    await listener.bind(("127.0.0.1", port))
    listener.listen()

    async def serve() -> None:
        while True:
            conn, _ = await listener.accept()
            conn.close()
            first.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        try:
            yield first
        finally:
            nursery.cancel_scope.cancel()
            listener.close()


async def test_upload_wait_and_position_follow_a_file_through_a_fylr_restart(
    pg_dsn: str, tmp_path: Path
) -> None:
    """``upload --wait`` follows a file whose step waits while its fylr stops and a new one
    starts on the same address; it ends done and the command exits 0. ``position``, started
    while the address drops every connection, gets its answer once the fylr is back."""
    port = free_port()
    state_dir = tmp_path / "state"
    source = tmp_path / "a.txt"
    source.write_bytes(b"some text\n")
    held = socket.socket()  # the first fylr's only execserver address refuses connections
    held.bind(("127.0.0.1", 0))
    nowhere = f"127.0.0.1:{held.getsockname()[1]}"
    server = f"http://127.0.0.1:{port}"
    uploaded, located = trio.Event(), trio.Event()
    results: dict[str, subprocess.CompletedProcess[bytes]] = {}

    async def command(name: str, done: trio.Event, *args: str) -> None:
        results[name] = await run_cli(name, *args, "--server", server)
        done.set()

    with held:
        async with trio.open_nursery() as nursery:
            async with (
                open_fylr_process(
                    fylr_text(pg_dsn, state_dir, port=port, execservers=[nowhere])
                ) as first,
                httpx.AsyncClient(base_url=first.http_url, timeout=WAIT) as http,
            ):
                nursery.start_soon(command, "upload", uploaded, str(source), "--wait")

                async def first_file() -> httpx.Response:
                    return await http.get("/api/v1/eas/1")  # a fresh database: the first id

                def waiting(response: httpx.Response) -> bool:
                    versions = response.json().get("versions") if response.is_success else None
                    return versions is not None and versions["sha256"]["status"] == "pending"

                with trio.fail_after(WAIT):
                    await until(first_file, waiting)
            # the first fylr is gone: the follower meets a closed, then a dropping, address
            async with refusing_then_dropping(port) as dropped:
                nursery.start_soon(command, "position", located, "1")
                with trio.fail_after(WAIT):
                    await dropped.wait()
            async with (
                open_execserver_process(EXECSERVER) as execserver,
                open_fylr_process(
                    fylr_text(
                        pg_dsn,
                        state_dir,
                        port=port,
                        execservers=[f"127.0.0.1:{execserver.port}"],
                    )
                ),
            ):
                with trio.fail_after(WAIT):
                    await uploaded.wait()
                    await located.wait()
    result = results["upload"]
    assert result.returncode == 0, (result.stdout, result.stderr)
    assert result.stdout.decode().splitlines()[-1] == "a.txt: id 1 done (sha256 done)"
    result = results["position"]
    assert result.returncode == 0, (result.stdout, result.stderr)
    assert result.stdout.decode().startswith("a.txt #1: "), result.stdout
