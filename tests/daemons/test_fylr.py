"""The reference fylr: the file API, the file worker's steps, restarts, against real parts.

Every test uses a real PostgreSQL (a database of its own), real execservers
running real commands (coreutils), real sockets on 127.0.0.1 and real pipes.
Most run the fylr in-process (``serve_fylr`` in a nursery); the restart test
runs the daemons as subprocesses and kills the fylr with SIGKILL.
"""

from __future__ import annotations

import datetime
import gzip
import hashlib
import logging
import os
import random
import re
import signal
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import trio
import yaml
from trio_broker_daemons.commands.upload import FileOutcome, ended_done, follow, summary
from trio_broker_daemons.execserver.app import serve_from_config
from trio_broker_daemons.execserver.config import ExecserverConfig
from trio_broker_daemons.fylr.app import FylrHandle, serve_fylr
from trio_broker_daemons.fylr.config import FylrConfig
from trio_broker_daemons.fylr.state import STEP_OUTCOMES

from tests.support.processes import open_execserver_process, open_fylr_process
from trio_broker.trio.execserver import ExecserverHandle
from trio_broker.trio.inspection import OUTCOMES

WAIT = 60.0

SERVICES: dict[str, Any] = {
    "mime": {"argv": ["file", "--mime-type", "--brief", "-"]},
    "sha256": {"argv": ["sha256sum"]},
    "gzip": {"argv": ["gzip", "-c", "-n", "-{level}"]},
    "fail": {"argv": ["sh", "-c", 'cat >/dev/null; echo "$0" >&2; exit 3', "{message}"]},
    "slow_sha256": {"argv": ["sh", "-c", "sleep 0.3; sha256sum"]},
}

TEXT_CLASS: dict[str, Any] = {
    "extensions": ["txt"],
    "metadata": {"service": "mime"},
    "versions": {
        "gz": {"service": "gzip", "params": {"level": 9}, "mimetype": "application/gzip"},
        "sha256": {"service": "sha256", "mimetype": "text/plain"},
        "gz_sha256": {"service": "sha256", "source": "gz"},
    },
}


def execserver_config(**services: Any) -> ExecserverConfig:
    """Two slots, every service may use all of them."""
    return ExecserverConfig.from_mapping(
        {
            "listen": "127.0.0.1:0",
            "name": "test-exec",
            "slots": 2,
            "fast_reserve": 0,
            "unknown_share": 1.0,
            "services": services or SERVICES,
            # the suite's job user (tests/conftest.py): the commands read the tests' folders
            "job_user": os.environ.get("TRIO_BROKER_JOB_USER"),
        }
    )


def fylr_mapping(
    dsn: str, state_dir: Path, execserver: str, classes: Mapping[str, Any], **extra: Any
) -> dict[str, Any]:
    """A fylr configuration for tests: short heartbeats and retries, a small pool."""
    return {
        "listen": "127.0.0.1:0",
        "name": "test-fylr",
        "state_dir": str(state_dir),
        "database": dsn,
        "database_pool": 4,
        "execservers": [execserver],
        "connect_timeout": "30s",
        "retry_delay": "1s",
        "counts_interval": "0s",  # every page counts the files afresh
        "heartbeat_interval": "0.5s",
        "stale_after": "2s",
        "classes": dict(classes),
        **extra,
    }


@asynccontextmanager
async def running_execserver() -> AsyncIterator[ExecserverHandle]:
    async with trio.open_nursery() as nursery:
        handle: ExecserverHandle = await nursery.start(serve_from_config, execserver_config())
        try:
            yield handle
        finally:
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def running_fylr(config: FylrConfig) -> AsyncIterator[FylrHandle]:
    async with trio.open_nursery() as nursery:
        handle: FylrHandle = await nursery.start(serve_fylr, config)
        try:
            yield handle
        finally:
            handle.stop()
            with trio.fail_after(WAIT):
                await handle.wait_closed()


@asynccontextmanager
async def fylr_and_execserver(
    pg_dsn: str, tmp_path: Path, classes: Mapping[str, Any], **extra: Any
) -> AsyncIterator[tuple[FylrHandle, httpx.AsyncClient]]:
    async with running_execserver() as execserver:
        mapping = fylr_mapping(
            pg_dsn, tmp_path / "state", f"{execserver.host}:{execserver.port}", classes, **extra
        )
        async with (
            running_fylr(FylrConfig.from_mapping(mapping)) as fylr,
            httpx.AsyncClient(base_url=fylr.url, timeout=WAIT) as http,
        ):
            yield fylr, http


async def put(
    http: httpx.AsyncClient, filename: str, data: bytes, priority: int = 0
) -> dict[str, Any]:
    response = await http.put(
        "/eas/put", params={"filename": filename, "priority": priority}, content=data
    )
    assert response.status_code == 201, response.text
    document: dict[str, Any] = response.json()
    return document


async def ended(http: httpx.AsyncClient, file_id: int) -> dict[str, Any]:
    """The file's document once it is done or failed (the server wakes the request)."""
    with trio.fail_after(WAIT):
        return await follow(http, str(http.base_url), file_id, wait=10)


async def download(http: httpx.AsyncClient, file_id: int, version: str) -> bytes:
    response = await http.get(f"/api/v1/eas/download/{file_id}/{version}")
    assert response.status_code == 200, (version, response.text)
    return response.content


async def settled(fylr: FylrHandle) -> None:
    """Wait until the dispatcher has written the outcome of every item it claimed."""
    assert fylr.dispatcher is not None
    with trio.fail_after(WAIT):
        await fylr.dispatcher.wait_until(
            lambda d: d.completed + d.requeued + d.failed + d.fenced == d.claimed
        )


def sha256_line(data: bytes) -> bytes:
    return hashlib.sha256(data).hexdigest().encode() + b"  -\n"


def stored_files(state_dir: Path) -> list[Path]:
    """Every regular file under the fylr's storage folder (temporary ones included)."""
    root = state_dir / "files"
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def rows(dsn: str, query: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return list(conn.execute(query.encode()).fetchall())


TEXT = b"".join(b"line %05d of a text that compresses well\n" % n for n in range(2000))


# -- the file API and the steps ---------------------------------------------------------------


async def test_every_version_is_made_stored_and_downloadable(pg_dsn: str, tmp_path: Path) -> None:
    """An upload goes through metadata, sync and produce; each version holds the right bytes."""
    async with fylr_and_execserver(pg_dsn, tmp_path, {"text": TEXT_CLASS}) as (fylr, http):
        created = await put(http, "notes.txt", TEXT, priority=2)
        assert created["status"] == "processing"  # its metadata step is queued
        assert created["filesize"] == len(TEXT)
        assert created["hash"] == {"sha256": hashlib.sha256(TEXT).hexdigest()}
        document = await ended(http, created["id"])
        assert document["status"] == "done"
        assert document["mimetype"] == "text/plain"
        assert document["metadata"] == {"mimetype": "text/plain"}
        versions = document["versions"]
        assert {name: v["status"] for name, v in versions.items()} == {
            "gz": "done",
            "sha256": "done",
            "gz_sha256": "done",
        }
        assert await download(http, created["id"], "original") == TEXT
        compressed = await download(http, created["id"], "gz")
        assert gzip.decompress(compressed) == TEXT
        assert versions["gz"]["filesize"] == len(compressed)
        assert versions["gz"]["hash"] == {"sha256": hashlib.sha256(compressed).hexdigest()}
        assert versions["gz"]["mimetype"] == "application/gzip"
        assert versions["gz"]["metadata"]["produced"]["status"] == "ok"
        assert versions["gz"]["metadata"]["produced"]["stdin_bytes"] == len(TEXT)
        assert versions["gz"]["metadata"]["params"] == {"level": 9}
        assert await download(http, created["id"], "sha256") == sha256_line(TEXT)
        assert versions["sha256"]["mimetype"] == "text/plain"
        assert versions["gz_sha256"]["source"] == "gz"
        assert versions["gz_sha256"]["mimetype"] == "application/octet-stream"
        assert await download(http, created["id"], "gz_sha256") == sha256_line(compressed)
        version_page = (await http.get(f"/api/v1/eas/{versions['gz']['id']}")).json()
        assert version_page["original"] == created["id"]
        assert version_page["version"] == "gz"
        assert fylr.statistics().steps["produce.ok"] == 3


async def test_a_failing_version_ends_error_and_the_original_still_ends(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A version whose command fails ends error with its stderr line; its dependents fail too."""
    classes = {
        "text": {
            "extensions": ["txt"],
            "versions": {
                "sha256": {"service": "sha256"},
                "broken": {"service": "fail", "params": {"message": "codec: no such format"}},
                "from_broken": {"service": "sha256", "source": "broken"},
            },
        }
    }
    async with fylr_and_execserver(pg_dsn, tmp_path, classes) as (fylr, http):
        created = await put(http, "a.txt", b"some text\n")
        document = await ended(http, created["id"])
        await settled(fylr)
        # the step outcomes are the receipt's statuses, as the execserver's jobs_total
        assert fylr.statistics().steps == {"sync.ok": 1, "produce.ok": 1, "produce.failed": 1}
        metrics = (await http.get("/metrics")).text
        assert 'trio_broker_fylr_steps_total{action="produce",outcome="failed"} 1.0' in metrics
        labels = re.findall(r'fylr_steps_total\{action="\w+",outcome="(\w+)"\}', metrics)
        assert set(labels) == {"ok", "failed"}
        assert STEP_OUTCOMES[: len(OUTCOMES)] == OUTCOMES
        assert document["status"] == "done"
        versions = document["versions"]
        assert versions["sha256"]["status"] == "done"
        assert versions["broken"]["status"] == "failed"
        assert versions["broken"]["error"] == "codec: no such format"
        assert versions["broken"]["metadata"]["produced"]["exit_code"] == 3
        assert versions["broken"]["url"] is None
        assert versions["from_broken"]["status"] == "failed"
        assert versions["from_broken"]["error"] == "source version 'broken' failed"
        missing = await http.get(f"/api/v1/eas/download/{created['id']}/broken")
        assert missing.status_code == 404


async def test_a_service_nobody_offers_requeues_the_step(pg_dsn: str, tmp_path: Path) -> None:
    """A version whose service no execserver offers waits in the queue instead of failing."""
    classes = {
        "text": {
            "extensions": ["txt"],
            "versions": {"sha256": {"service": "sha256"}, "odd": {"service": "not_offered"}},
        }
    }
    async with fylr_and_execserver(pg_dsn, tmp_path, classes, retry_delay="1h") as (fylr, http):
        created = await put(http, "a.txt", b"text\n")
        assert fylr.dispatcher is not None
        with trio.fail_after(WAIT):
            # the sync and the sha256 version are done, the other version's requeue written
            await fylr.dispatcher.wait_until(lambda d: d.completed == 2 and d.requeued == 1)
        assert fylr.statistics().steps["produce.ok"] == 1
        assert fylr.statistics().steps["produce.requeued"] == 1
        document = (await http.get(f"/api/v1/eas/{created['id']}")).json()
        assert document["status"] == "sync"  # its versions are being made
        assert document["versions"]["sha256"]["status"] == "done"
        assert document["versions"]["odd"]["status"] == "pending"
        # the reason is in the document while it waits; nothing offered is close to it
        assert document["versions"]["odd"]["error"] == (
            "no connected execserver offers service 'not_offered'"
            " (offered: fail, gzip, mime, sha256, slow_sha256)"
        )
        queued = rows(pg_dsn, "SELECT status, last_error, start_after > now() FROM broker_queue")
        assert len(queued) == 1
        status, error, later = queued[0]
        assert (status, later) == ("new", True)
        assert "UnknownService" in error


async def test_a_misspelled_service_fails_after_a_reprobe_with_a_suggestion(
    pg_dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A recipe naming a service nobody offers is requeued while the broker client looks
    for it, and ends failed once it looked a whole pool_reprobe_interval (the client's
    verdict, not a count of claims), saying what is close."""
    caplog.set_level(logging.DEBUG, logger="trio_broker_daemons.fylr.worker")
    classes = {
        "text": {
            "extensions": ["txt"],
            "versions": {"sha256": {"service": "sha256"}, "typo": {"service": "sha265"}},
        }
    }
    extra = {"retry_delay": "0.05s", "pool_reprobe_interval": "0.5s"}
    async with fylr_and_execserver(pg_dsn, tmp_path, classes, **extra) as (fylr, http):
        created = await put(http, "a.txt", b"text\n")
        document = await ended(http, created["id"])
        await settled(fylr)
    assert document["status"] == "done"
    assert document["versions"]["sha256"]["status"] == "done"
    typo = document["versions"]["typo"]
    assert typo["status"] == "failed"
    assert typo["error"] == (
        "ServiceNotOffered: no connected execserver offers service 'sha265'"
        " (did you mean 'sha256'?), after a whole re-probe of looking"
    )
    outcome = FileOutcome(path=Path("a.txt"), priority=0, document=document)
    assert not ended_done(outcome)  # upload --wait exits 1, printing the reason
    assert "  typo failed: ServiceNotOffered: no connected" in summary(outcome)
    requeued = fylr.statistics().steps["produce.requeued"]
    assert requeued >= 1  # the first claim's answer is "not yet"
    assert fylr.statistics().steps["produce.error"] == 1
    [(status, attempts, error)] = rows(
        pg_dsn, "SELECT status, attempts, last_error FROM broker_queue"
    )
    assert (status, attempts) == ("failed", requeued + 1)
    assert "did you mean 'sha256'?" in error
    waits = [r for r in caplog.records if r.getMessage() == "step waits for a service"]
    assert [r.levelno for r in waits] == [logging.WARNING] + [logging.DEBUG] * (requeued - 1)


async def test_a_class_without_versions_ends_done(pg_dsn: str, tmp_path: Path) -> None:
    """Files of a class with only a metadata step, and files of no class, end done at once."""
    classes = {"data": {"extensions": ["bin"], "metadata": {"service": "mime"}}}
    async with fylr_and_execserver(pg_dsn, tmp_path, classes) as (_, http):
        data = await put(http, "blob.bin", random.Random(7).randbytes(6000))
        unknown = await put(http, "README", b"no extension, no class\n")
        assert unknown["class"] is None
        data_document = await ended(http, data["id"])
        assert data_document["status"] == "done"
        assert data_document["versions"] == {}
        assert data_document["metadata"] == {"mimetype": "application/octet-stream"}
        unknown_document = await ended(http, unknown["id"])
        assert unknown_document["status"] == "done"
        assert unknown_document["versions"] == {}
        assert unknown_document["metadata"] == {}


async def test_a_failing_metadata_step_leaves_the_file_going(pg_dsn: str, tmp_path: Path) -> None:
    """A metadata command that fails records why, and the versions are still made."""
    classes = {
        "text": {
            "extensions": ["txt"],
            "metadata": {"service": "fail", "params": {"message": "probe: unreadable"}},
            "versions": {"sha256": {"service": "sha256"}},
        }
    }
    async with fylr_and_execserver(pg_dsn, tmp_path, classes) as (_, http):
        created = await put(http, "a.txt", b"text\n")
        document = await ended(http, created["id"])
        assert document["status"] == "done"
        assert document["metadata"] == {}
        assert document["error"] == "metadata: probe: unreadable"
        assert document["versions"]["sha256"]["status"] == "done"


async def test_resyncing_an_unchanged_file_produces_nothing(pg_dsn: str, tmp_path: Path) -> None:
    """A second sync of a file whose configuration did not change keeps every version as it is."""
    async with fylr_and_execserver(pg_dsn, tmp_path, {"text": TEXT_CLASS}) as (fylr, http):
        created = await put(http, "a.txt", TEXT)
        before = await ended(http, created["id"])
        produced = fylr.statistics().steps["produce.ok"]
        response = await http.post(f"/api/v1/eas/{created['id']}/sync")
        assert response.status_code == 202
        assert response.json()["status"] == "sync"
        after = await ended(http, created["id"])
        assert after["status"] == "done"
        assert fylr.statistics().steps["sync.ok"] == 2
        assert fylr.statistics().steps["produce.ok"] == produced
        for name, version in before["versions"].items():
            again = after["versions"][name]
            assert (again["id"], again["hash"], again["updated_at"]) == (
                version["id"],
                version["hash"],
                version["updated_at"],
            )
        await settled(fylr)
        assert rows(pg_dsn, "SELECT count(*) FROM broker_queue") == [(0,)]


async def test_a_changed_configuration_redoes_exactly_the_changed_versions(
    pg_dsn: str, tmp_path: Path
) -> None:
    """After a configuration change a sync removes and adds exactly the versions that changed."""
    before_class = {
        "extensions": ["txt"],
        "versions": {
            "same": {"service": "sha256"},
            "changed": {"service": "gzip", "params": {"level": 1}},
            "changed_child": {"service": "sha256", "source": "changed"},
            "dropped": {"service": "gzip", "params": {"level": 5}},
        },
    }
    after_class = {
        "extensions": ["txt"],
        "versions": {
            "same": {"service": "sha256"},
            "changed": {"service": "gzip", "params": {"level": 9}},
            "changed_child": {"service": "sha256", "source": "changed"},
            "added": {"service": "gzip", "params": {"level": 2}},
        },
    }
    state = tmp_path / "state"
    async with running_execserver() as execserver:
        address = f"{execserver.host}:{execserver.port}"
        first = FylrConfig.from_mapping(fylr_mapping(pg_dsn, state, address, {"t": before_class}))
        async with (
            running_fylr(first) as fylr,
            httpx.AsyncClient(base_url=fylr.url, timeout=WAIT) as http,
        ):
            created = await put(http, "a.txt", TEXT)
            before = (await ended(http, created["id"]))["versions"]
        dropped_key = rows(
            pg_dsn, f"SELECT storage_key FROM files WHERE id = {before['dropped']['id']}"
        )[0][0]
        assert (state / "files" / dropped_key).is_file()
        second = FylrConfig.from_mapping(fylr_mapping(pg_dsn, state, address, {"t": after_class}))
        async with (
            running_fylr(second) as fylr,
            httpx.AsyncClient(base_url=fylr.url, timeout=WAIT) as http,
        ):
            response = await http.post(f"/api/v1/eas/{created['id']}/sync")
            assert response.status_code == 202
            after = (await ended(http, created["id"]))["versions"]
            assert fylr.statistics().steps["produce.ok"] == 3  # changed, changed_child, added
            assert gzip.decompress(await download(http, created["id"], "added")) == TEXT
    assert set(after) == {"same", "changed", "changed_child", "added"}
    assert all(v["status"] == "done" for v in after.values())
    assert after["same"]["id"] == before["same"]["id"]
    assert after["same"]["updated_at"] == before["same"]["updated_at"]
    for name in ("changed", "changed_child"):
        assert after[name]["id"] != before[name]["id"]
        assert after[name]["produce_hash"] != before[name]["produce_hash"]
    assert after["changed"]["metadata"]["params"] == {"level": 9}
    assert not (state / "files" / dropped_key).exists()
    keys = {row[0] for row in rows(pg_dsn, "SELECT storage_key FROM files")}
    assert {p.relative_to(state / "files").as_posix() for p in stored_files(state)} == keys


async def test_unknown_file_ids_get_404(pg_dsn: str, tmp_path: Path) -> None:
    """Unknown, malformed and not-yet-stored ids and versions all answer 404."""
    async with fylr_and_execserver(pg_dsn, tmp_path, {"text": TEXT_CLASS}) as (_, http):
        created = await put(http, "a.txt", b"x\n")
        for path in (
            "/api/v1/eas/987654",
            "/api/v1/eas/abc",
            "/api/v1/eas/-1",
            "/api/v1/eas/download/987654/original",
            "/api/v1/eas/download/abc/original",
            f"/api/v1/eas/download/{created['id']}/no_such_version",
        ):
            response = await http.get(path)
            assert response.status_code == 404, path
            assert response.json() == {"error": "not found"}
        assert (await http.post("/api/v1/eas/987654/sync")).status_code == 404
        await ended(http, created["id"])


async def test_an_interrupted_upload_leaves_no_file_row(pg_dsn: str, tmp_path: Path) -> None:
    """A client that hangs up in mid-body leaves no row, no queued step and no stored bytes."""
    async with fylr_and_execserver(pg_dsn, tmp_path, {"text": TEXT_CLASS}) as (fylr, _):
        stream = await trio.open_tcp_stream(fylr.host, fylr.port)
        async with stream:
            await stream.send_all(
                b"PUT /eas/put?filename=big.txt HTTP/1.1\r\n"
                + f"host: {fylr.host}:{fylr.port}\r\n".encode()
                + b"content-length: 1000000\r\n\r\n"
                + b"x" * 300_000
            )
        with trio.fail_after(WAIT):
            await fylr.wait_until(lambda stats: stats.uploads_aborted == 1)
        assert fylr.statistics().uploads == 0
        assert rows(pg_dsn, "SELECT count(*) FROM files") == [(0,)]
        assert rows(pg_dsn, "SELECT count(*) FROM broker_queue") == [(0,)]
        assert stored_files(tmp_path / "state") == []


async def test_uploads_over_the_limit_and_bad_requests_are_refused(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Too large (declared or streamed), nameless and badly prioritised uploads store nothing."""

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(10):
            yield b"y" * 500

    classes = {"text": TEXT_CLASS}
    async with fylr_and_execserver(pg_dsn, tmp_path, classes, max_upload_size=1000) as (fylr, http):
        declared = await http.put("/eas/put", params={"filename": "a.txt"}, content=b"z" * 1001)
        assert declared.status_code == 413
        streamed = await http.put("/eas/put", params={"filename": "a.txt"}, content=chunks())
        assert streamed.status_code == 413
        nameless = await http.put("/eas/put", content=b"x")
        assert nameless.status_code == 400
        assert nameless.json()["error"].startswith("filename:")
        for priority in ("high", str(2**31)):
            bad = await http.put("/eas/put", params={"filename": "a.txt", "priority": priority})
            assert bad.status_code == 400
            assert bad.json()["error"].startswith("priority:")
        assert fylr.statistics().uploads_refused == 5
        assert rows(pg_dsn, "SELECT count(*) FROM files") == [(0,)]
        assert stored_files(tmp_path / "state") == []


async def test_health_identity_inspection_and_metrics(pg_dsn: str, tmp_path: Path) -> None:
    """The listener serves /healthz, /whoami, /inspect/system/fylr and /metrics."""
    async with fylr_and_execserver(pg_dsn, tmp_path, {"text": TEXT_CLASS}) as (fylr, http):
        created = await put(http, "a.txt", TEXT)
        await ended(http, created["id"])
        await settled(fylr)
        assert (await http.get("/healthz")).json() == {"status": "serving"}
        assert (await http.get("/whoami")).json() == {"backend_id": fylr.backend_id}
        page = (await http.get("/inspect/system/fylr")).json()
        assert page["backend_id"] == fylr.backend_id
        assert page["files"] == {"original": {"done": 1}, "version": {"done": 3}}
        assert page["queue"] == {"ready": 0, "delayed": 0, "claimed": 0, "failed": 0}
        assert page["dispatcher"]["completed"] == 5  # metadata, sync, three produces
        assert page["store"]["calls"]["files_create"] == 1  # the database calls by kind
        assert page["client"]["addresses"][0]["connections"] == 1
        assert page["pipes"]["done"] >= 6
        metrics = (await http.get("/metrics")).text
        assert 'trio_broker_fylr_files{kind="version",state="done"} 3.0' in metrics
        assert "trio_broker_fylr_uploads_total 1.0" in metrics
        assert 'trio_broker_fylr_steps_total{action="produce",outcome="ok"} 3.0' in metrics


async def test_a_request_until_ended_answers_once_the_file_has_ended(
    pg_dsn: str, tmp_path: Path
) -> None:
    """``?wait=S&until=ended`` skips the changes on the way: one request, the end."""
    classes = {"text": {"extensions": ["txt"], "versions": {"s": {"service": "slow_sha256"}}}}
    async with fylr_and_execserver(pg_dsn, tmp_path, classes) as (_, http):
        created = await put(http, "a.txt", b"a\n")
        assert created["status"] != "done"
        response = await http.get(
            f"/api/v1/eas/{created['id']}", params={"wait": "60", "until": "ended"}
        )
        assert response.json()["status"] == "done"
        assert response.json()["versions"]["s"]["status"] == "done"
        bad = await http.get(f"/api/v1/eas/{created['id']}", params={"until": "soon"})
        assert bad.status_code == 400


async def test_scrapes_within_counts_interval_share_one_count(pg_dsn: str, tmp_path: Path) -> None:
    """The files are counted at most once per counts_interval, whatever scrapes come."""
    classes = {"text": {"extensions": ["txt"]}}
    async with fylr_and_execserver(pg_dsn, tmp_path, classes, counts_interval="1h") as (fylr, http):
        created = await put(http, "a.txt", b"a\n")
        await ended(http, created["id"])
        pages = [(await http.get("/inspect/system/fylr")).json() for _ in range(3)]
        metrics = [(await http.get("/metrics")).text for _ in range(3)]
        await put(http, "b.txt", b"b\n")
        later = (await http.get("/inspect/system/fylr")).json()
        assert fylr.store.statistics().calls["files_counts"] == 1
    assert all(page["files"] == {"original": {"done": 1}, "version": {}} for page in pages)
    assert later["files"] == pages[0]["files"]  # the second upload waits for the next count
    counted = later["files_counted"]
    assert counted["interval_s"] == 3600
    assert counted["age_s"] >= 0
    assert datetime.datetime.fromisoformat(counted["at"]).tzinfo is not None
    assert all("trio_broker_fylr_files_counted_age_seconds " in text for text in metrics)


def instants(document: object, path: str = "") -> dict[str, object]:
    """Every member of a JSON document named ``at`` or ``*_at``, by its path."""
    found: dict[str, object] = {}
    if isinstance(document, dict):
        for key, value in document.items():
            if key == "at" or key.endswith("_at"):
                found[f"{path}.{key}"] = value
            found.update(instants(value, f"{path}.{key}"))
    elif isinstance(document, list):
        for index, value in enumerate(document):
            found.update(instants(value, f"{path}[{index}]"))
    return found


async def test_every_instant_in_the_documents_is_iso_8601_with_zone(
    pg_dsn: str, tmp_path: Path
) -> None:
    """The file document, the inspection page, a sweep and the topology: no epoch seconds."""
    async with fylr_and_execserver(pg_dsn, tmp_path, {"text": TEXT_CLASS}) as (_, http):
        created = await put(http, "a.txt", TEXT)
        documents = {
            "file": await ended(http, created["id"]),
            "sweep": (await http.post("/inspect/system/fylr/sweep")).json(),
            "inspect": (await http.get("/inspect/system/fylr")).json(),
            "topology": (await http.get("/inspect/system/topology/data")).json(),
        }
    found = {name + path: v for name, doc in documents.items() for path, v in instants(doc).items()}
    for name in ("file.created_at", "sweep.at", "inspect.storage.last.at", "topology.generated_at"):
        assert name in found
    for name, value in found.items():
        assert isinstance(value, str), (name, value)
        assert datetime.datetime.fromisoformat(value).utcoffset() is not None, (name, value)


async def test_a_counts_interval_of_zero_counts_at_every_scrape(
    pg_dsn: str, tmp_path: Path
) -> None:
    classes = {"text": {"extensions": ["txt"]}}
    async with fylr_and_execserver(pg_dsn, tmp_path, classes, counts_interval="0s") as (fylr, http):
        for _ in range(2):
            await http.get("/inspect/system/fylr")
            await http.get("/metrics")
        assert fylr.store.statistics().calls["files_counts"] == 4


# -- real daemons, and a fylr killed in mid-run ------------------------------------------------


async def test_a_killed_fylr_restarted_finishes_every_file(pg_dsn: str, tmp_path: Path) -> None:
    """After kill -9 of the fylr in mid-run and a restart, every file still ends done."""
    slow = {"slow_sha256": SERVICES["slow_sha256"], "sha256": SERVICES["sha256"]}
    exec_text = yaml.safe_dump(
        {"listen": "127.0.0.1:0", "slots": 2, "fast_reserve": 0, "unknown_share": 1.0,
         "services": slow}
    )  # fmt: skip
    classes = {
        "text": {
            "extensions": ["txt"],
            "versions": {
                "a": {"service": "slow_sha256"},
                "b": {"service": "sha256", "source": "a"},
            },
        }
    }
    contents = {f"file-{n:02d}.txt": f"content of file {n}\n".encode() * (n + 1) for n in range(8)}
    async with open_execserver_process(exec_text) as execserver:
        address = f"{execserver.host}:{execserver.port}"
        fylr_text = yaml.safe_dump(fylr_mapping(pg_dsn, tmp_path / "state", address, classes))
        async with open_fylr_process(fylr_text) as first:
            async with httpx.AsyncClient(base_url=first.http_url, timeout=WAIT) as http:
                ids: dict[str, int] = {}
                for name, data in contents.items():
                    # the first file goes first, so most of the work is still to do when it ends
                    ids[name] = (await put(http, name, data, 4 if name == "file-00.txt" else 0))[
                        "id"
                    ]
                await ended(http, ids["file-00.txt"])
            first.process.send_signal(signal.SIGKILL)
            assert await first.process.wait() == -signal.SIGKILL
        unfinished = rows(
            pg_dsn, "SELECT count(*) FROM files WHERE status NOT IN ('done', 'error')"
        )
        assert unfinished[0][0] > 0
        async with (
            open_fylr_process(fylr_text) as second,
            httpx.AsyncClient(base_url=second.http_url, timeout=WAIT) as http,
        ):
            for name, data in contents.items():
                document = await ended(http, ids[name])
                assert document["status"] == "done", name
                assert {v: d["status"] for v, d in document["versions"].items()} == {
                    "a": "done",
                    "b": "done",
                }
                a = await download(http, ids[name], "a")
                assert a == sha256_line(data)
                assert await download(http, ids[name], "b") == sha256_line(a)
            page = (await http.get("/inspect/system/fylr")).json()
            # nothing failed or left to do (the last outcomes may still be being written)
            assert page["queue"]["failed"] == page["queue"]["ready"] == 0
            # the killed process is no longer a live backend (its rows came back): once
            # its leftovers are past the grace, a sweep removes them
            for path in stored_files(tmp_path / "state"):
                if path.name.startswith(".tmp-"):
                    os.utime(path, (time.time() - 3600,) * 2)
            swept = await http.post("/inspect/system/fylr/sweep")
            assert swept.status_code == 200
    # every stored key is on disk; the killed process's unfinished writes were swept
    on_disk = stored_files(tmp_path / "state")
    keys = {row[0] for row in rows(pg_dsn, "SELECT storage_key FROM files")}
    assert keys <= {p.relative_to(tmp_path / "state" / "files").as_posix() for p in on_disk}
    assert not [p for p in on_disk if p.name.startswith(".tmp-")]
