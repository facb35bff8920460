"""Nothing lost when fylrs share a database and a storage folder, and failures by cause.

Real parts throughout: the test session's PostgreSQL (stopped and started again
for the outage test), real execservers running real commands, a fylr as a real
subprocess beside one in this process on one folder.

A *gate* holds a job where the test wants it: the command writes
:data:`MARK` (more than the execserver holds back before it opens the out-pipe),
then reads a FIFO, so the job waits until the test opens the
FIFO for writing; the command removes the FIFO, so a second run of the same job
passes at once. Once the fylr has received bytes its temporary file exists
(the rendition's writer opens it before it takes the first chunk), which the
test learns from the fylr's pipe figures.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import trio
import yaml
from trio_broker_daemons.commands.upload import follow, upload
from trio_broker_daemons.execserver.app import serve_from_config
from trio_broker_daemons.execserver.config import ExecserverConfig
from trio_broker_daemons.fylr.api import RETRY_AFTER
from trio_broker_daemons.fylr.app import FylrHandle
from trio_broker_daemons.fylr.config import FylrConfig
from trio_broker_daemons.fylr.pgcluster import PgCluster

from tests.daemons.test_fylr import (
    WAIT,
    download,
    ended,
    fylr_mapping,
    put,
    rows,
    running_fylr,
    settled,
    sha256_line,
    stored_files,
)
from tests.support.processes import open_fylr_process
from trio_broker.trio.execserver import ExecserverHandle

REPOSITORY = Path(__file__).resolve().parents[2]


MARK = b"\0" * 5000


def gated(gate: Path, *then: str) -> dict[str, Any]:
    """A service that writes :data:`MARK`, waits at ``gate`` (a FIFO) on its first run, then
    runs ``then``."""
    script = (
        'head -c 5000 /dev/zero; if [ -p "$0" ]; then cat "$0" >/dev/null; rm -f "$0"; fi;'
        ' exec "$@"'
    )
    return {"argv": ["sh", "-c", script, str(gate), *then]}


def make_gate(tmp_path: Path, name: str = "gate") -> Path:
    gate = tmp_path / name
    os.mkfifo(gate)
    return gate


async def open_gate(gate: Path) -> None:
    """Let the job waiting at ``gate`` go on (opening for writing waits for its reader)."""

    def release() -> None:
        with open(gate, "wb"):
            pass

    await trio.to_thread.run_sync(release)


async def writing(fylr: FylrHandle) -> None:
    """Wait until the gated job's first bytes reached ``fylr`` (its temporary file exists)."""
    with trio.fail_after(WAIT):
        await fylr.wait_until(lambda s: s.pipes.bytes_received > 0)


def temporaries(state: Path) -> list[Path]:
    return [p for p in stored_files(state) if p.name.startswith(".tmp-")]


def make_old(path: Path) -> None:
    then = time.time() - 3600
    os.utime(path, (then, then))


@asynccontextmanager
async def execserver(services: Mapping[str, Any], slots: int = 2) -> AsyncIterator[str]:
    config = ExecserverConfig.from_mapping(
        {
            "listen": "127.0.0.1:0",
            "name": "shared-exec",
            "job_user": os.environ.get("TRIO_BROKER_JOB_USER"),  # gates in tmp_path
            "slots": slots,
            "fast_reserve": 0,
            "unknown_share": 1.0,
            "services": dict(services),
        }
    )
    async with trio.open_nursery() as nursery:
        handle: ExecserverHandle = await nursery.start(serve_from_config, config)
        try:
            yield f"{handle.host}:{handle.port}"
        finally:
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def fylr_on(
    pg_dsn: str, state: Path, address: str, classes: Mapping[str, Any], **extra: Any
) -> AsyncIterator[tuple[FylrHandle, httpx.AsyncClient]]:
    config = FylrConfig.from_mapping(fylr_mapping(pg_dsn, state, address, classes, **extra))
    async with (
        running_fylr(config) as fylr,
        httpx.AsyncClient(base_url=fylr.url, timeout=WAIT) as http,
    ):
        yield fylr, http


# -- several fylrs on one folder ----------------------------------------------------------------


async def test_a_restart_beside_a_running_fylr_never_removes_its_writes(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A fylr is writing a version into the shared folder; another fylr (a subprocess) starts
    on the same folder and database and sweeps, at start-up and when asked: the write in
    progress survives and ends done."""
    gate = make_gate(tmp_path)
    classes = {"text": {"extensions": ["txt"], "versions": {"copy": {"service": "gated"}}}}
    state = tmp_path / "state"
    data = b"a version written while another fylr restarts\n" * 100
    async with (
        execserver({"gated": gated(gate, "cat")}) as address,
        fylr_on(pg_dsn, state, address, classes) as (first, http),
    ):
        created = await put(http, "a.txt", data)
        await writing(first)
        (temp,) = temporaries(state)
        make_old(temp)  # only its writer's heartbeat protects it now
        second_text = yaml.safe_dump(fylr_mapping(pg_dsn, state, address, classes))
        async with (
            open_fylr_process(second_text) as second,  # ready after its start-up sweep
            httpx.AsyncClient(base_url=second.http_url, timeout=WAIT) as other,
        ):
            assert temp.exists()
            swept = (await other.post("/inspect/system/fylr/sweep")).json()
            assert swept["temporary"] == swept["orphans"] == 0
            assert temp.exists()
            await open_gate(gate)
            document = await ended(other, created["id"])
        assert document["versions"]["copy"]["status"] == "done", document
        assert await download(http, created["id"], "copy") == MARK + data
        assert "produce.requeued" not in first.statistics().steps
    assert temporaries(state) == []


# -- failures by cause --------------------------------------------------------------------------


async def test_a_vanished_temporary_file_requeues_the_step(pg_dsn: str, tmp_path: Path) -> None:
    """A version's temporary file removed under it (another process's sweep) is a temporary
    failure: the step runs again and the version ends done."""
    gate = make_gate(tmp_path)
    classes = {
        "text": {
            "extensions": ["txt"],
            "versions": {
                "copy": {"service": "gated"},
                "copy_sha256": {"service": "sha256", "source": "copy"},
            },
        }
    }
    state = tmp_path / "state"
    services = {"gated": gated(gate, "cat"), "sha256": {"argv": ["sha256sum"]}}
    async with (
        execserver(services) as address,
        fylr_on(pg_dsn, state, address, classes) as (fylr, http),
    ):
        created = await put(http, "a.txt", b"some text\n")
        await writing(fylr)
        (temp,) = temporaries(state)
        temp.unlink()
        await open_gate(gate)
        document = await ended(http, created["id"])
        assert document["status"] == "done"
        assert {n: v["status"] for n, v in document["versions"].items()} == {
            "copy": "done",
            "copy_sha256": "done",
        }
        copy = await download(http, created["id"], "copy")
        assert copy == MARK + b"some text\n"
        assert await download(http, created["id"], "copy_sha256") == sha256_line(copy)
        steps = fylr.statistics().steps
        assert steps["produce.requeued"] == 1
        assert not {"produce.error", "produce.failed"} & set(steps)
        await settled(fylr)
        assert rows(pg_dsn, "SELECT count(*) FROM broker_queue") == [(0,)]


async def test_a_storage_folder_error_requeues_until_it_is_fixed(
    pg_dsn: str, tmp_path: Path
) -> None:
    """An OSError of the storage folder (here: ``versions`` is not a folder) requeues the step
    with the reason in the queue; once the folder is fixed the version is made. An upload
    meeting such an error is answered 503 with Retry-After."""
    classes = {"text": {"extensions": ["txt"], "versions": {"sha256": {"service": "sha256"}}}}
    state = tmp_path / "state"
    async with (
        execserver({"sha256": {"argv": ["sha256sum"]}}) as address,
        fylr_on(pg_dsn, state, address, classes) as (fylr, http),
    ):
        blocker = state / "files" / "versions"
        blocker.parent.mkdir(parents=True, exist_ok=True)
        blocker.write_bytes(b"not a folder")
        (state / "files" / "originals").write_bytes(b"not a folder either")
        refused = await http.put("/eas/put", params={"filename": "a.txt"}, content=b"text\n")
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == str(RETRY_AFTER)
        assert "could not be stored: [Errno 20] Not a directory" in refused.json()["error"]
        assert fylr.statistics().uploads_failed == 1
        (state / "files" / "originals").unlink()
        created = await put(http, "a.txt", b"text\n")
        assert fylr.dispatcher is not None
        with trio.fail_after(WAIT):  # the requeue is written
            await fylr.dispatcher.wait_until(lambda d: d.requeued >= 1)
        ((status, error),) = rows(pg_dsn, "SELECT status, last_error FROM broker_queue")
        assert status in ("new", "claimed")
        assert "storage: NotADirectoryError" in error
        document = (await http.get(f"/api/v1/eas/{created['id']}")).json()
        assert document["versions"]["sha256"]["status"] in ("pending", "processing")
        assert document["versions"]["sha256"]["error"] is None
        blocker.unlink()
        document = await ended(http, created["id"])
        assert document["versions"]["sha256"]["status"] == "done"
        assert await download(http, created["id"], "sha256") == sha256_line(b"text\n")
        assert not {"produce.error", "produce.failed"} & set(fylr.statistics().steps)


async def test_corrupt_input_fails_the_version_for_good_with_the_converters_error(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A converter that rejects its input fails the version for good, with its own message,
    and the versions made from it; its queue row stays failed with that message, nothing
    else is left in the queue."""
    classes = {
        "archive": {
            "extensions": ["gz"],
            "versions": {
                "unpacked": {"service": "gunzip"},
                "unpacked_sha256": {"service": "sha256", "source": "unpacked"},
            },
        }
    }
    services = {"gunzip": {"argv": ["gzip", "-d", "-c"]}, "sha256": {"argv": ["sha256sum"]}}
    async with (
        execserver(services) as address,
        fylr_on(pg_dsn, tmp_path / "state", address, classes) as (fylr, http),
    ):
        created = await put(http, "broken.gz", b"this is no gzip data\n")
        document = await ended(http, created["id"])
        versions = document["versions"]
        assert versions["unpacked"]["status"] == "failed"
        assert "not in gzip format" in versions["unpacked"]["error"]
        assert versions["unpacked_sha256"]["status"] == "failed"
        assert versions["unpacked_sha256"]["error"] == "source version 'unpacked' failed"
        assert "produce.requeued" not in fylr.statistics().steps
        await settled(fylr)
        [(action, status, error)] = rows(
            pg_dsn, "SELECT action, status, last_error FROM broker_queue"
        )
        assert (action, status) == ("produce", "failed")
        assert "not in gzip format" in error


# -- the database unavailable -------------------------------------------------------------------


async def test_every_route_answers_503_while_the_database_restarts(
    pg_cluster: PgCluster, pg_dsn: str, tmp_path: Path
) -> None:
    """With PostgreSQL stopped, GET and PUT answer 503 with Retry-After; an upload started
    meanwhile retries and succeeds once the database is back, and so does following it."""
    classes = {"text": {"extensions": ["txt"], "versions": {"sha256": {"service": "sha256"}}}}
    source = tmp_path / "later.txt"
    source.write_bytes(b"sent while the database was down\n")
    async with (
        execserver({"sha256": {"argv": ["sha256sum"]}}) as address,
        fylr_on(pg_dsn, tmp_path / "state", address, classes) as (fylr, http),
    ):
        created = await put(http, "a.txt", b"text\n")
        await ended(http, created["id"])
        await trio.to_thread.run_sync(pg_cluster.stop)
        try:
            for response in (
                await http.get(f"/api/v1/eas/{created['id']}"),
                await http.get(f"/api/v1/eas/{created['id']}", params={"wait": "1"}),
                await http.get(f"/api/v1/eas/download/{created['id']}/original"),
                await http.post(f"/api/v1/eas/{created['id']}/sync"),
                await http.get("/inspect/system/fylr"),
                await http.put("/eas/put", params={"filename": "b.txt"}, content=b"x"),
            ):
                assert response.status_code == 503, (response.request.url, response.text)
                assert response.headers["retry-after"] == str(RETRY_AFTER)
                assert "database is unavailable" in response.json()["error"]
            failed_before = fylr.statistics().uploads_failed
            async with trio.open_nursery() as nursery:

                async def send() -> None:
                    document = await upload(http, fylr.url, source)
                    later.append(document)

                later: list[dict[str, Any]] = []
                nursery.start_soon(send)
                with trio.fail_after(WAIT):  # its first attempt was answered 503
                    await fylr.wait_until(lambda s: s.uploads_failed > failed_before)
                await trio.to_thread.run_sync(pg_cluster.start)
        finally:
            if not pg_cluster.running:
                await trio.to_thread.run_sync(pg_cluster.start)
        (document,) = later
        with trio.fail_after(WAIT):
            document = await follow(http, fylr.url, document["id"], wait=5)
        assert document["status"] == "done"
        assert await download(http, document["id"], "original") == source.read_bytes()


# -- failed rows: shown, explained, retried -----------------------------------------------------


async def test_a_failed_row_is_shown_and_requeued_by_the_operator(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A metadata step whose stored input is missing fails for good; /inspect shows the row
    and why; ``trio-broker fylr requeue --failed`` (once the file is back) brings it back and
    the file ends done."""
    gate = make_gate(tmp_path)
    classes = {
        "blocker": {"extensions": ["bin"], "versions": {"held": {"service": "gated"}}},
        "text": {
            "extensions": ["txt"],
            "metadata": {"service": "mime"},
            "versions": {"sha256": {"service": "sha256"}},
        },
    }
    services = {
        "gated": gated(gate, "cat"),
        "mime": {"argv": ["file", "--mime-type", "--brief", "-"]},
        "sha256": {"argv": ["sha256sum"]},
    }
    state = tmp_path / "state"
    async with (
        execserver(services, slots=1) as address,
        fylr_on(pg_dsn, state, address, classes, connect_timeout="60s") as (fylr, http),
    ):
        blocker = await put(http, "hold.bin", b"holds the only slot\n")
        await writing(fylr)  # it runs
        created = await put(http, "a.txt", b"some text\n")
        with trio.fail_after(WAIT):  # its metadata step is claimed, waiting for the slot
            await fylr.wait_until(lambda s: s.dispatcher is not None and s.dispatcher.claimed >= 3)
        ((key,),) = rows(pg_dsn, f"SELECT storage_key FROM files WHERE id = {created['id']}")
        hidden = tmp_path / "hidden"
        (state / "files" / key).rename(hidden)
        await open_gate(gate)
        await ended(http, blocker["id"])
        document = await ended(http, created["id"])
        assert document["status"] == "failed"
        assert "the stored input" in document["error"]
        assert "is missing" in document["error"]
        await settled(fylr)
        page = (await http.get("/inspect/system/fylr")).json()
        assert page["queue"]["failed"] == 1
        (item,) = page["failed"]
        assert item["action"] == "metadata"
        assert item["file_ref"] == str(created["id"])
        assert "is missing" in item["reason"]
        assert item["file"]["filename"] == "a.txt"
        assert item["file"]["state"] == "error"
        hidden.rename(state / "files" / key)
        config = tmp_path / "fylr.yml"
        config.write_text(yaml.safe_dump(fylr_mapping(pg_dsn, state, address, classes)))
        result = await trio.run_process(
            [sys.executable, "-m", "trio_broker_daemons", "fylr", "requeue", "--failed",
             "--config", str(config)],
            capture_stdout=True,
            capture_stderr=True,
            cwd=REPOSITORY,
            check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        out = result.stdout.decode()
        assert f"requeued {item['id']} metadata file {created['id']}" in out
        assert "1 failed item(s) requeued" in out
        if fylr.dispatcher is not None:
            fylr.dispatcher.wake()
        document = await ended(http, created["id"])
        assert document["status"] == "done", document
        assert document["error"] is None
        assert document["versions"]["sha256"]["status"] == "done"
        await settled(fylr)
        page = (await http.get("/inspect/system/fylr")).json()
        assert page["failed"] == []
        assert (await http.post("/inspect/system/fylr/requeue")).json() == {"requeued": []}
        bad = await http.post("/inspect/system/fylr/requeue", params={"id": "x"})
        assert bad.status_code == 400
