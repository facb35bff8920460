"""On-demand renditions on real daemons: a fylr, an execserver, PostgreSQL, real commands.

Each test runs the fylr and one execserver in-process on loopback, uploads an
original and asks ``GET /api/v1/eas/download/<id>/custom`` for a rendition made at
request time: the answers of the renditions module's table (200, 503, 502, the
broken transfer) and a client going away mid-stream.
"""

from __future__ import annotations

import gzip
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from trio_broker_daemons.execserver.app import serve_from_config
from trio_broker_daemons.execserver.config import ExecserverConfig
from trio_broker_daemons.fylr.app import FylrHandle
from trio_broker_daemons.fylr.config import FylrConfig
from trio_broker_daemons.fylr.renditions import COMMIT_BUFFER

from tests.daemons.test_fylr import WAIT, ended, fylr_mapping, put, rows, running_fylr, stored_files
from trio_broker.trio import procgroup
from trio_broker.trio.execserver import ExecserverHandle

ORIGINAL = b"the quick brown fox jumps over the lazy dog\n" * 2000  # 88 000 bytes

SERVICES: dict[str, Any] = {
    "gzip": {"argv": ["gzip", "-c", "-n", "-{level}"]},
    "upper": {"argv": ["tr", "a-z", "A-Z"]},
    "fail_early": {
        "argv": ["sh", "-c", 'cat >/dev/null; echo "cannot render: $0" >&2; exit 3', "{why}"]
    },
    "fail_late": {
        "argv": [
            "sh",
            "-c",
            'cat >/dev/null; head -c 300000 /dev/zero; echo "broke after 300000" >&2; exit 4',
        ]
    },
    "endless": {
        "argv": [
            "sh",
            "-c",
            'echo $$ > "$0"; cat >/dev/null; while :; do head -c 65536 /dev/zero; done',
            "{pidfile}",
        ]
    },
    "hold": {"builtin": "sleep"},
}

CLASSES: dict[str, Any] = {
    "notes": {"extensions": ["notes"], "metadata": {"service": "upper"}},
    "text": {
        "extensions": ["txt"],
        "custom_versions": {
            "gzip": {
                "params": {"level": [1, 9]},
                "mimetype": "application/gzip",
                "filename": "{stem}-{level}.gz",
            }
        },
    },
}


def presets(tmp_path: Path) -> dict[str, Any]:
    return {
        "small_gz": {
            "service": "gzip",
            "params": {"level": 9},
            "mimetype": "application/gzip",
            "filename": "{stem}.{preset}.gz",
        },
        "shout": {"service": "upper", "mimetype": "text/plain"},
        "broken": {"service": "fail_early", "params": {"why": "no such codec"}},
        "late": {"service": "fail_late"},
        "endless": {"service": "endless", "params": {"pidfile": str(tmp_path / "endless.pid")}},
        "nobody": {"service": "not_offered"},
    }


def execserver_config(slots: int = 2, **extra: Any) -> ExecserverConfig:
    return ExecserverConfig.from_mapping(
        {
            "listen": "127.0.0.1:0",
            "name": "rendition-exec",
            "slots": slots,
            "fast_reserve": 0,
            "unknown_share": 1.0,
            "services": SERVICES,
            # the suite's job user (tests/conftest.py): the commands write the tests' folders
            "job_user": os.environ.get("TRIO_BROKER_JOB_USER"),
            **extra,
        }
    )


@asynccontextmanager
async def daemons(
    pg_dsn: str,
    tmp_path: Path,
    *,
    slots: int = 2,
    execserver: bool = True,
    exec_extra: dict[str, Any] | None = None,
    classes: dict[str, Any] | None = None,
    custom_version_presets: dict[str, Any] | None = None,
    **extra: Any,
) -> AsyncIterator[tuple[FylrHandle, ExecserverHandle | None, httpx.AsyncClient]]:
    """A fylr (with the test presets) and, unless told otherwise, one execserver."""
    async with trio.open_nursery() as nursery:
        handle: ExecserverHandle | None = None
        address = "127.0.0.1:9"  # nothing listens there: the fylr has no execserver
        if execserver:
            config = execserver_config(slots, **(exec_extra or {}))
            handle = await nursery.start(serve_from_config, config)
            address = f"{handle.host}:{handle.port}"
        mapping = fylr_mapping(
            pg_dsn,
            tmp_path / "state",
            address,
            classes or CLASSES,
            custom_version_presets=custom_version_presets or presets(tmp_path),
            **extra,
        )
        async with (
            running_fylr(FylrConfig.from_mapping(mapping)) as fylr,
            httpx.AsyncClient(base_url=fylr.url, timeout=WAIT) as http,
        ):
            if execserver:
                with trio.fail_after(WAIT):
                    await fylr.wait_until(
                        lambda s: s.client is not None and bool(s.client.addresses[0].instances)
                    )
            yield fylr, handle, http
        nursery.cancel_scope.cancel()


async def uploaded(http: httpx.AsyncClient) -> int:
    document = await put(http, "fox.txt", ORIGINAL)
    await ended(http, document["id"])
    return int(document["id"])


def custom(file_id: int) -> str:
    return f"/api/v1/eas/download/{file_id}/custom"


async def test_a_preset_is_streamed_and_nothing_is_stored(pg_dsn: str, tmp_path: Path) -> None:
    """A preset's rendition is the command's output, labelled by the preset; nothing new
    lands in storage or in the files table. Small output carries Content-Length, output
    past the commit buffer is streamed chunked."""
    async with daemons(pg_dsn, tmp_path) as (_, execserver, http):
        file_id = await uploaded(http)
        files_before = stored_files(tmp_path / "state")
        rows_before = rows(pg_dsn, "SELECT id, kind, status FROM files ORDER BY id")

        response = await http.get(custom(file_id), params={"preset": "small_gz"})
        assert response.status_code == 200, response.text
        assert gzip.decompress(response.content) == ORIGINAL
        assert response.headers["content-type"] == "application/gzip"
        assert response.headers["content-disposition"] == (
            "attachment; filename*=UTF-8''fox.small_gz.gz"
        )
        assert int(response.headers["content-length"]) == len(response.content) < COMMIT_BUFFER

        shout = await http.get(custom(file_id), params={"preset": "shout"})
        assert shout.status_code == 200, shout.text
        assert shout.content == ORIGINAL.upper()
        assert len(ORIGINAL) > COMMIT_BUFFER
        assert "content-length" not in shout.headers
        assert shout.headers["transfer-encoding"] == "chunked"
        assert shout.headers["content-type"].startswith("text/plain")

        explicit = await http.get(custom(file_id), params={"service": "gzip", "level": "1"})
        assert explicit.status_code == 200, explicit.text
        assert gzip.decompress(explicit.content) == ORIGINAL
        assert "fox-1.gz" in explicit.headers["content-disposition"]

        assert stored_files(tmp_path / "state") == files_before
        assert rows(pg_dsn, "SELECT id, kind, status FROM files ORDER BY id") == rows_before
        assert execserver is not None
        recent = execserver.statistics().broker.recent
        assert [f.service for f in recent[-3:]] == ["gzip", "upper", "gzip"]


@pytest.mark.parametrize(
    ("params", "error"),
    [
        ({}, "expected preset=NAME, or service=NAME and its parameters"),
        ({"preset": "nope"}, "preset: expected one of broken, endless, late, nobody, shout,"),
        ({"preset": "shout", "level": "9"}, "unexpected parameters with a preset: level"),
        ({"service": "upper"}, "files of class 'text' allow custom versions of gzip, got 'upper'"),
        ({"service": "gzip"}, "level: required for 'gzip'"),
        ({"service": "gzip", "level": "5"}, "level: expected one of 1, 9, got '5'"),
        ({"service": "gzip", "level": "1", "x": "y"}, "unexpected parameters for 'gzip': x"),
    ],
)
async def test_a_rendition_nothing_allows_is_400(
    pg_dsn: str, tmp_path: Path, params: dict[str, str], error: str
) -> None:
    """A request no preset or class allows is refused with the reason; no job runs."""
    async with daemons(pg_dsn, tmp_path, execserver=False) as (_, _e, http):
        file_id = int((await put(http, "fox.txt", ORIGINAL))["id"])
        response = await http.get(custom(file_id), params=params)
        assert response.status_code == 400
        assert error in response.json()["error"]
        assert (await http.get(custom(file_id + 1000), params=params)).status_code == 404


async def test_no_slot_in_time_is_503_with_retry_after(pg_dsn: str, tmp_path: Path) -> None:
    """With the only slot held by a long job, the rendition gets no slot within
    connect_timeout: 503 with Retry-After, not a wait past it and not a requeue."""
    async with daemons(pg_dsn, tmp_path, slots=1, connect_timeout="1s") as (fylr, ex, http):
        assert ex is not None
        file_id = await uploaded(http)
        async with trio.open_nursery() as nursery:
            client = fylr._state.client
            assert client is not None

            async def hold() -> None:
                await client.run("hold", {"params": {"seconds": 120}}, subject="busy")

            nursery.start_soon(hold)
            with trio.fail_after(WAIT):
                await ex.wait_until(lambda: ex.statistics().broker.busy == 1)
            started = trio.current_time()
            response = await http.get(custom(file_id), params={"preset": "shout"})
            waited = trio.current_time() - started
            assert response.status_code == 503, response.text
            assert int(response.headers["retry-after"]) >= 1
            assert "no slot" in response.json()["error"]
            assert 1.0 <= waited < WAIT
            nursery.cancel_scope.cancel()


async def test_no_execserver_is_503_at_once(pg_dsn: str, tmp_path: Path) -> None:
    """Without an execserver (or without one that offers the service) the answer is 503
    at once, long before connect_timeout."""
    async with daemons(pg_dsn, tmp_path, execserver=False, connect_timeout="50s") as (_, _e, h):
        file_id = int((await put(h, "fox.txt", ORIGINAL))["id"])
        with trio.fail_after(10):
            response = await h.get(custom(file_id), params={"preset": "shout"})
        assert response.status_code == 503, response.text
        assert "retry-after" in response.headers
    async with daemons(pg_dsn, tmp_path / "2", connect_timeout="50s") as (_, _e, http):
        file_id = await uploaded(http)
        with trio.fail_after(10):
            response = await http.get(custom(file_id), params={"preset": "nobody"})
        assert response.status_code == 503, response.text
        assert "not_offered" in response.json()["error"]


async def test_an_early_failure_is_502_with_its_line(pg_dsn: str, tmp_path: Path) -> None:
    """A command that fails before its output passed 4,000 bytes: 502 with the line of
    stderr that says why."""
    async with daemons(pg_dsn, tmp_path) as (_, _e, http):
        file_id = await uploaded(http)
        response = await http.get(custom(file_id), params={"preset": "broken"})
        assert response.status_code == 502
        assert response.json() == {"error": "cannot render: no such codec"}


async def test_a_late_failure_aborts_the_transfer(pg_dsn: str, tmp_path: Path) -> None:
    """A command that fails after the response was committed: the client sees a broken
    transfer (no final chunk), never a complete 200 with a truncated body."""
    async with daemons(pg_dsn, tmp_path) as (_, _e, http):
        file_id = await uploaded(http)
        received: list[int] = []

        async def read_all(response: httpx.Response) -> None:
            async for chunk in response.aiter_raw():
                received.append(len(chunk))

        async with http.stream("GET", custom(file_id), params={"preset": "late"}) as response:
            assert response.status_code == 200
            with pytest.raises(httpx.RemoteProtocolError):
                await read_all(response)
        assert COMMIT_BUFFER < sum(received) <= 300000


async def test_a_client_going_away_cancels_the_job(pg_dsn: str, tmp_path: Path) -> None:
    """A client that disconnects mid-stream: the job is cancelled (CANCEL), its receipt
    says so, and its process group is gone."""
    async with daemons(pg_dsn, tmp_path) as (fylr, execserver, http):
        assert execserver is not None
        file_id = await uploaded(http)
        # a raw socket: the client reads a part of the stream and hangs up
        stream = await trio.open_tcp_stream(fylr.host, fylr.port)
        request = f"GET {custom(file_id)}?preset=endless HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        await stream.send_all(request.encode())
        head = b""
        received = 0
        while received < 4 * COMMIT_BUFFER:
            chunk = await stream.receive_some(65536)
            assert chunk, "the stream ended early"
            head = head or chunk[:12]
            received += len(chunk)
        assert head == b"HTTP/1.1 200"
        await stream.aclose()
        pgid = int((tmp_path / "endless.pid").read_text())
        with trio.fail_after(WAIT):
            await execserver.wait_until(
                lambda: any(f.service == "endless" for f in execserver.statistics().broker.recent)
            )
        finished = [f for f in execserver.statistics().broker.recent if f.service == "endless"]
        assert finished[0].receipt.status == "cancelled", finished[0].receipt
        live = [
            info.pid
            for info in procgroup.scan_processes().values()
            if info.pgrp == pgid and not info.zombie  # zombies left to init do not count
        ]
        assert live == []
