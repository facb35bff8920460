"""The fylr's probes on a real fylr: /livez answers while the process works, /readyz says
whether it can take work (its database, its migrations, its storage folder).

Each test runs a fylr in-process (``serve_fylr``) on a real PostgreSQL database and
a real loopback listener, breaks one thing for real (the storage folder, a
migration row, the database's connections) and asks the probes over HTTP. The
deployed paths and ports are asked of the daemon processes in ``tests/test_deploy.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg
import trio
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from trio_broker_daemons.fylr.app import FylrHandle, serve_fylr
from trio_broker_daemons.fylr.config import FylrConfig
from trio_broker_daemons.fylr.files import fylr_migrations
from trio_broker_daemons.fylr.pgcluster import PgCluster
from trio_broker_daemons.fylr.probes import OK, readiness

from tests.support.netns import until

WAIT = 60.0


@asynccontextmanager
async def fylr_on(pg_dsn: str, tmp_path: Path) -> AsyncIterator[tuple[FylrHandle, Any]]:
    """A fylr without execservers, and an HTTP client on its listener."""
    config = FylrConfig.from_mapping(
        {
            "listen": "127.0.0.1:0",
            "name": "probed-fylr",
            "state_dir": str(tmp_path / "state"),
            "database": pg_dsn,
            "database_pool": 4,
            "execservers": [],
        }
    )
    async with trio.open_nursery() as nursery:
        handle: FylrHandle = await nursery.start(serve_fylr, config)
        try:
            async with httpx.AsyncClient(base_url=handle.url, timeout=WAIT) as http:
                yield handle, http
        finally:
            handle.stop()
            with trio.fail_after(WAIT):
                await handle.wait_closed()


async def probes(http: httpx.AsyncClient) -> tuple[httpx.Response, httpx.Response]:
    return await http.get("/livez"), await http.get("/readyz")


async def test_a_serving_fylr_is_alive_and_ready(pg_dsn: str, tmp_path: Path) -> None:
    """Both probes answer 200; /readyz names each check it made."""
    async with fylr_on(pg_dsn, tmp_path) as (_, http):
        live, ready = await probes(http)
    assert (live.status_code, live.json()) == (200, {"status": "serving"})
    assert ready.status_code == 200
    assert ready.json() == {"status": "ready", "checks": {"database": OK, "storage": OK}}


async def test_a_storage_folder_that_cannot_be_written_makes_it_unready(
    pg_dsn: str, tmp_path: Path
) -> None:
    """With a file where the storage folder should be, /readyz answers 503 naming the
    folder (with Retry-After) while /livez stays 200; once the folder can be made again
    it is ready again."""
    async with fylr_on(pg_dsn, tmp_path) as (handle, http):
        root = handle.storage.root
        if root.is_dir():
            root.rmdir()  # nothing was uploaded: it is empty
        root.parent.mkdir(parents=True, exist_ok=True)
        root.write_text("not a folder")
        live, ready = await probes(http)
        root.unlink()
        _, again = await probes(http)
    assert live.status_code == 200
    assert ready.status_code == 503
    assert ready.headers["retry-after"] == "2"
    body = ready.json()
    assert (body["status"], body["failed"], body["checks"]["database"]) == (
        "unready",
        ["storage"],
        OK,
    )
    assert body["checks"]["storage"].startswith(f"not writable: {root}: ")
    assert again.status_code == 200


async def test_a_missing_migration_makes_it_unready(pg_dsn: str, tmp_path: Path) -> None:
    """A database that lacks one of the fylr's migrations (restored from an older backup)
    is named in /readyz's 503; /livez stays 200."""
    last = fylr_migrations()[-1]
    async with fylr_on(pg_dsn, tmp_path) as (_, http):
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(
                "DELETE FROM schema_migrations WHERE scope = %s AND version = %s",
                (last.scope, last.version),
            )
            live, ready = await probes(http)
            conn.execute(
                "INSERT INTO schema_migrations (scope, version, name) VALUES (%s, %s, %s)",
                (last.scope, last.version, last.name),
            )
        _, again = await probes(http)
    assert live.status_code == 200
    assert ready.status_code == 503
    assert ready.json()["checks"] == {
        "database": f"not migrated: {last.scope} {last.name} not applied",
        "storage": OK,
    }
    assert again.status_code == 200


async def test_a_database_that_refuses_connections_makes_it_unready(
    pg_dsn: str, pg_cluster: PgCluster, tmp_path: Path
) -> None:
    """Once the database refuses connections (its backends ended, new ones refused),
    /readyz answers 503 naming the database within its check's bound while /livez stays
    200; when the database takes connections again the fylr is ready again."""
    dbname = str(conninfo_to_dict(pg_dsn)["dbname"])
    name = sql.Identifier(dbname)
    async with fylr_on(pg_dsn, tmp_path) as (_, http):
        with psycopg.connect(pg_cluster.dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS false").format(name))
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = %s AND pid <> pg_backend_pid()",
                (dbname,),
            )
            with trio.fail_after(WAIT):
                live, ready = await probes(http)
            admin.execute(sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS true").format(name))
        with trio.fail_after(WAIT):  # the pool makes new connections at its own pace
            again = await until(lambda: http.get("/readyz"), lambda r: r.status_code == 200)
    assert live.status_code == 200
    assert ready.status_code == 503
    body = ready.json()
    assert body["failed"] == ["database"]
    assert body["checks"]["database"].startswith(("unavailable: ", "no answer within 3 s"))
    assert again.json()["status"] == "ready"


def test_a_stopping_fylr_is_not_ready_whatever_its_checks() -> None:
    """SIGTERM makes it unready at once (503 "stopping"), its checks passed or not; any
    failed check makes it unready and is named; all passed is ready."""
    assert readiness({}, stopping=True) == (
        503,
        {"status": "stopping", "checks": {"stopping": "stopping"}},
    )
    checks = {"database": OK, "storage": "not writable: /x: Read-only file system"}
    assert readiness(checks, stopping=False) == (
        503,
        {"status": "unready", "checks": checks, "failed": ["storage"]},
    )
    assert readiness({"database": OK}, stopping=False) == (
        200,
        {"status": "ready", "checks": {"database": OK}},
    )
