"""The work an operator acts on: files and steps listed, a step's attempts, cancel, retry,
delete, the admission; and a requeued step saying why it waits, at once.

A real fylr on a real PostgreSQL with a real execserver (in-process, real commands);
the ``trio-broker work`` and ``position`` commands run as processes against it.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from trio_broker_daemons.commands.position import queue_text, waiting_steps
from trio_broker_daemons.execserver.app import serve_from_config
from trio_broker_daemons.fylr.app import FylrHandle
from trio_broker_daemons.fylr.config import FylrConfig
from trio_broker_daemons.fylr.work import CANCEL_NOTE

from tests.daemons.test_fylr import (
    WAIT,
    execserver_config,
    fylr_mapping,
    put,
    rows,
    running_fylr,
    settled,
    stored_files,
)
from trio_broker.trio.execserver import ExecserverHandle

REPOSITORY = Path(__file__).resolve().parents[2]

SERVICES: dict[str, Any] = {
    "sha256": {"argv": ["sha256sum"]},
    "fail": {"argv": ["sh", "-c", 'cat >/dev/null; echo "$0" >&2; exit 3', "{message}"]},
    # holds its slot until it is cancelled
    "hold": {"argv": ["sh", "-c", "cat >/dev/null; exec sleep 600"]},
}

NOTICE = "no connected execserver offers service 'sha265' (did you mean 'sha256'?)"


def classes(**versions: Any) -> dict[str, Any]:
    return {"text": {"extensions": ["txt"], "versions": versions}}


@asynccontextmanager
async def installation(
    pg_dsn: str, tmp_path: Path, versions: dict[str, Any], **extra: Any
) -> AsyncIterator[tuple[FylrHandle, ExecserverHandle, httpx.AsyncClient]]:
    async with trio.open_nursery() as nursery:
        execserver: ExecserverHandle = await nursery.start(
            serve_from_config, execserver_config(**SERVICES)
        )
        mapping = fylr_mapping(
            pg_dsn,
            tmp_path / "state",
            f"{execserver.host}:{execserver.port}",
            classes(**versions),
            **extra,
        )
        async with (
            running_fylr(FylrConfig.from_mapping(mapping)) as fylr,
            httpx.AsyncClient(base_url=fylr.url, timeout=WAIT) as http,
        ):
            yield fylr, execserver, http
        nursery.cancel_scope.cancel()


async def get(http: httpx.AsyncClient, path: str, **params: Any) -> Any:
    response = await http.get(path, params=params)
    assert response.status_code == 200, response.text
    return response.json()


async def command(*args: str) -> tuple[int, str]:
    """Run ``trio-broker ARGS`` as a process; its exit status and its output."""
    result = await trio.run_process(
        [sys.executable, "-m", "trio_broker_daemons", *args],
        capture_stdout=True,
        capture_stderr=True,
        cwd=REPOSITORY,
        check=False,
    )
    return result.returncode, result.stdout.decode() + result.stderr.decode()


async def test_steps_and_files_are_listed_filtered_paged_and_a_step_shows_its_attempts(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Three files, each with a version waiting for a misspelled service and one whose job
    fails: the steps are listed by state, service, priority and age, paged by cursor; a
    step shows each attempt (backend, execserver instance, outcome, reason, the receipt's
    decisive line); the files are listed likewise; the admission shows its parts; and the
    command prints the same."""
    versions = {
        "ok": {"service": "sha256"},
        "typo": {"service": "sha265"},
        "bad": {"service": "fail", "params": {"message": "codec: not installed"}},
    }
    async with installation(pg_dsn, tmp_path, versions, retry_delay="1h") as (fylr, exe, http):
        created = [await put(http, f"f{n}.txt", b"text %d\n" % n, priority=p)
                   for n, p in enumerate((0, 2, 0))]  # fmt: skip
        assert fylr.dispatcher is not None
        with trio.fail_after(WAIT):  # 3 syncs and 3 ok done, 3 requeued, 3 failed
            await fylr.dispatcher.wait_until(
                lambda d: (d.completed, d.requeued, d.failed) == (6, 3, 3)
            )
        await settled(fylr)
        steps = (await get(http, "/inspect/system/fylr/steps"))["steps"]
        assert [s["id"] for s in steps] == sorted(s["id"] for s in steps)
        assert sorted((s["action"], s["version"], s["state"]) for s in steps) == sorted(
            [("produce", "typo", "delayed")] * 3 + [("produce", "bad", "failed")] * 3
        )
        waiting = [s for s in steps if s["state"] == "delayed"]
        assert {s["waits_because"] for s in waiting} == {f"UnknownService: {NOTICE}"}
        assert {s["service"] for s in waiting} == {"sha265"}
        failed = [s for s in steps if s["state"] == "failed"]
        assert {s["service"] for s in failed} == {"fail"}
        assert {s["waits_because"] for s in failed} == {None}

        # filters
        by_state = await get(http, "/inspect/system/fylr/steps", state="delayed")
        assert [s["id"] for s in by_state["steps"]] == [s["id"] for s in waiting]
        assert (await get(http, "/inspect/system/fylr/steps", state="ready"))["steps"] == []
        by_service = await get(http, "/inspect/system/fylr/steps", service="fail")
        assert [s["id"] for s in by_service["steps"]] == [s["id"] for s in failed]
        high = await get(http, "/inspect/system/fylr/steps", priority="2")
        assert [s["priority"] for s in high["steps"]] == [2, 2]
        of_file = await get(http, "/inspect/system/fylr/steps", file=str(created[2]["id"]))
        assert len(of_file["steps"]) == 2
        assert (await get(http, "/inspect/system/fylr/steps", older_than="3600"))["steps"] == []

        # pages
        first = await get(http, "/inspect/system/fylr/steps", limit="4")
        assert [s["id"] for s in first["steps"]] == [s["id"] for s in steps[:4]]
        second = await get(
            http, "/inspect/system/fylr/steps", limit="4", cursor=first["next_cursor"]
        )
        assert [s["id"] for s in second["steps"]] == [s["id"] for s in steps[4:]]
        assert second["next_cursor"] is None
        narrow = await get(http, "/inspect/system/fylr/steps", service="sha265", limit="2")
        rest = await get(
            http, "/inspect/system/fylr/steps", service="sha265", cursor=narrow["next_cursor"]
        )
        assert [s["id"] for s in narrow["steps"] + rest["steps"]] == [s["id"] for s in waiting]

        # one step and its attempts
        bad = await get(http, f"/inspect/system/fylr/steps/{failed[0]['id']}")
        [attempt] = bad["attempts_ended"]
        instance = exe.statistics().broker.instance_id
        assert attempt["attempt"] == 1
        assert attempt["backend"] == fylr.backend_id
        assert attempt["instance"] == instance
        assert attempt["outcome"] == "failed"
        assert attempt["decisive_line"] == "codec: not installed"
        assert "codec: not installed" in attempt["reason"]
        assert attempt["duration_s"] >= 0
        assert bad["current"] is None
        typo = await get(http, f"/inspect/system/fylr/steps/{waiting[0]['id']}")
        [attempt] = typo["attempts_ended"]
        assert (attempt["outcome"], attempt["instance"]) == ("unknown_service", None)
        assert NOTICE in attempt["reason"]

        # files
        files = await get(http, "/inspect/system/fylr/files", kind="original")
        assert [f["id"] for f in files["files"]] == [c["id"] for c in reversed(created)]
        page = await get(http, "/inspect/system/fylr/files", limit="2")
        assert len(page["files"]) == 2
        assert page["next_cursor"] is not None
        errors = await get(http, "/inspect/system/fylr/files", state="error")
        assert {(f["version"], f["error"]) for f in errors["files"]} == {
            ("bad", "codec: not installed")
        }
        assert len(errors["files"]) == 3
        high_files = await get(http, "/inspect/system/fylr/files", priority="2", kind="original")
        assert [f["id"] for f in high_files["files"]] == [created[1]["id"]]

        # the admission and the queue by band
        queues = await get(http, "/inspect/system/queues")
        admission = queues["admission"]
        assert admission["base"] == admission["share"] + admission["cpus"]
        assert admission["in_flight"] == 0
        assert [e["instance_id"] for e in queues["execservers"]] == [instance]
        bands = {b["band"]: b for b in queues["queue"]["bands"]}
        assert (bands["normal"]["delayed"], bands["normal"]["failed"]) == (2, 2)
        assert (bands["interactive"]["delayed"], bands["interactive"]["failed"]) == (1, 1)
        assert queues["queue"]["delayed"] == 3

        # the command prints the same
        server = ("--server", fylr.url)
        status, out = await command("work", "steps", "--state", "failed", *server)
        assert status == 0, out
        assert out.count(" failed, attempt 1") == 3
        assert "codec: not installed" in out
        status, out = await command("work", "steps", "--service", "sha265", "--limit", "2", *server)
        assert status == 0, out
        assert out.count("waits: UnknownService: no connected") == 2
        assert f"more: --cursor {narrow['next_cursor']}" in out
        status, out = await command("work", "step", str(failed[0]["id"]), *server)
        assert status == 0, out
        assert f"execserver {instance}" in out
        assert "decisive line: codec: not installed" in out
        status, out = await command("work", "files", "--state", "error", *server)
        assert status == 0, out
        assert out.count("codec: not installed") == 3
        status, out = await command("work", "queues", *server)
        assert status == 0, out
        assert "normal (0): 0 ready, 2 delayed, 0 claimed, 2 failed" in out


async def test_bad_filters_and_unknown_ids_get_one_line_each(pg_dsn: str, tmp_path: Path) -> None:
    """A refused filter is 400 with one line naming it (exit 2 from the command); an
    unknown step or file is 404; retrying a step that has not failed or deleting a version
    is 409; nothing changes."""
    versions = {"typo": {"service": "sha265"}}
    async with installation(pg_dsn, tmp_path, versions, retry_delay="1h") as (fylr, _, http):
        created = await put(http, "a.txt", b"text\n")
        assert fylr.dispatcher is not None
        with trio.fail_after(WAIT):
            await fylr.dispatcher.wait_until(lambda d: d.requeued == 1)
        await settled(fylr)
        refused = {
            ("steps", "state", "bogus"): (
                "state: expected one of ready, delayed, claimed, failed; got 'bogus'"
            ),
            ("steps", "limit", "0"): "limit: expected 1 to 1000; got '0'",
            ("steps", "priority", "high"): "priority: expected an integer, got 'high'",
            ("steps", "older_than", "-1"): (
                "older_than: expected seconds (a number >= 0); got '-1'"
            ),
            ("steps", "cursor", "x"): "cursor: expected the next_cursor of a page; got 'x'",
            ("steps", "file", "x"): "file: expected a file id; got 'x'",
            ("files", "kind", "folder"): "kind: expected one of original, version; got 'folder'",
            ("files", "colour", "red"): (
                "colour: unknown parameter (expected kind, state, priority, class,"
                " older_than, limit, cursor)"
            ),
        }
        for (what, name, value), line in refused.items():
            response = await http.get(f"/inspect/system/fylr/{what}", params={name: value})
            assert (response.status_code, response.json()) == (400, {"error": line}), name
            assert "\n" not in line
        assert (
            await http.get("/inspect/system/fylr/steps", params={"file": "999999"})
        ).status_code == 404
        [step] = (await get(http, "/inspect/system/fylr/steps"))["steps"]
        for method, path in [
            ("GET", "/inspect/system/fylr/steps/999999"),
            ("GET", "/inspect/system/fylr/steps/abc"),
            ("POST", "/inspect/system/fylr/steps/999999/cancel"),
            ("POST", "/inspect/system/fylr/steps/999999/retry"),
            ("POST", "/inspect/system/fylr/files/999999/retry"),
            ("DELETE", "/inspect/system/fylr/files/999999"),
        ]:
            response = await http.request(method, path)
            assert response.status_code == 404, (method, path, response.text)
            assert response.json()["error"].startswith("no ")
        response = await http.post(f"/inspect/system/fylr/steps/{step['id']}/retry")
        assert response.status_code == 409
        assert (
            response.json()["error"] == f"step {step['id']} has not failed (new): nothing to retry"
        )
        version_id = created["id"] + 1
        response = await http.delete(f"/inspect/system/fylr/files/{version_id}")
        assert response.status_code == 409
        assert "goes with its original" in response.json()["error"]
        # nothing changed
        assert (await get(http, "/inspect/system/fylr/steps"))["steps"][0]["state"] == "delayed"
        assert (await get(http, f"/api/v1/eas/{created['id']}"))["versions"]["typo"]
        server = ("--server", fylr.url)
        status, out = await command("work", "steps", "--state", "bogus", *server)
        assert status == 2, out
        assert out.strip() == (
            "trio-broker work steps: the fylr answered 400: state: expected one of ready,"
            " delayed, claimed, failed; got 'bogus'"
        )
        status, out = await command("work", "step", "999999", *server)
        assert status == 1, out
        assert "the fylr answered 404: no step 999999" in out


async def test_a_running_step_is_cancelled_at_its_execserver_and_retried(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Cancelling a running step sends the broker's CANCEL (the execserver ends the job
    ``cancelled`` and frees the slot), keeps the claim as a ``cancelled`` attempt, fails
    the row and the version with the operator's reason; a retry of the file runs it again;
    a queued (delayed) step is cancelled too, and a failed one answers 409."""
    versions = {"held": {"service": "hold"}, "typo": {"service": "sha265"}}
    async with installation(pg_dsn, tmp_path, versions, retry_delay="1h") as (fylr, exe, http):
        created = await put(http, "a.txt", b"text\n")
        assert fylr.dispatcher is not None
        with trio.fail_after(WAIT):
            await exe.wait_until(lambda: exe.statistics().broker.busy == 1)
            await fylr.dispatcher.wait_until(lambda d: d.requeued == 1)
        steps = {s["version"]: s for s in (await get(http, "/inspect/system/fylr/steps"))["steps"]}
        held, typo = steps["held"], steps["typo"]
        assert held["state"] == "claimed"
        assert held["claimed_by"] == fylr.backend_id
        shown = await get(http, f"/inspect/system/fylr/steps/{held['id']}")
        assert shown["current"]["attempt"] == 1
        assert shown["current"]["backend"] == fylr.backend_id

        status, out = await command("work", "cancel", str(held["id"]), "--server", fylr.url)
        assert status == 0, out
        assert out.strip() == (
            f"cancelled step {held['id']} produce of file {held['file']}"
            f" (claimed, held by {fylr.backend_id})"
        )
        job_id = f"q{held['id']}.1"
        with trio.fail_after(WAIT):  # the job ended cancelled at the execserver
            await exe.wait_until(
                lambda: any(
                    j.job_id == job_id and j.receipt.status == "cancelled"
                    for j in exe.statistics().broker.recent
                )
            )
        assert exe.statistics().broker.busy == 0
        shown = await get(http, f"/inspect/system/fylr/steps/{held['id']}")
        assert (shown["state"], shown["last_error"], shown["current"]) == (
            "failed",
            CANCEL_NOTE,
            None,
        )
        [attempt] = shown["attempts_ended"]
        assert (attempt["outcome"], attempt["backend"]) == ("cancelled", fylr.backend_id)
        document = await get(http, f"/api/v1/eas/{created['id']}")
        assert document["versions"]["held"]["status"] == "failed"
        assert document["versions"]["held"]["error"] == CANCEL_NOTE
        assert fylr.dispatcher.statistics().lost == 1  # no outcome written over the cancel

        again = await http.post(f"/inspect/system/fylr/steps/{held['id']}/cancel")
        assert again.status_code == 409

        # a queued step
        response = await http.post(f"/inspect/system/fylr/steps/{typo['id']}/cancel")
        assert response.status_code == 200, response.text
        assert response.json()["cancelled"]["was"] == "new"
        assert (await get(http, f"/inspect/system/fylr/steps/{typo['id']}"))["state"] == "failed"

        # retry the file: both steps come back, the held one runs again
        status, out = await command(
            "work", "retry", "--file", str(created["id"]), "--server", fylr.url
        )
        assert status == 0, out
        assert "2 failed step(s) requeued" in out
        with trio.fail_after(WAIT):
            await exe.wait_until(lambda: exe.statistics().broker.busy == 1)
        shown = await get(http, f"/inspect/system/fylr/steps/{held['id']}")
        assert (shown["state"], shown["current"]["attempt"]) == ("claimed", 2)
        document = await get(http, f"/api/v1/eas/{created['id']}")
        assert document["versions"]["held"]["status"] != "failed"


async def test_deleting_a_file_removes_its_versions_rows_and_stored_bytes(
    pg_dsn: str, tmp_path: Path
) -> None:
    """An original with a done version and a running one is deleted: its rows, its queue
    rows (the running job cancelled at the execserver) and its stored files go; another
    file stays; deleting it again is 404."""
    versions = {"ok": {"service": "sha256"}, "held": {"service": "hold"}}
    async with installation(pg_dsn, tmp_path, versions) as (fylr, exe, http):
        keep = await put(http, "keep.dat", b"kept\n")  # no class: done at once
        gone = await put(http, "gone.txt", b"gone\n")
        assert fylr.dispatcher is not None
        with trio.fail_after(WAIT):  # keep's sync, gone's sync and its ok version
            await fylr.dispatcher.wait_until(lambda d: d.completed == 3)
            await exe.wait_until(lambda: exe.statistics().broker.busy == 1)
        before = set(stored_files(tmp_path / "state"))
        status, out = await command("work", "delete", str(gone["id"]), "--server", fylr.url)
        assert status == 0, out
        assert (
            out.strip()
            == f"deleted file {gone['id']} with 2 version(s), 1 queued step(s) and 2 stored file(s)"
        )
        with trio.fail_after(WAIT):
            await exe.wait_until(
                lambda: any(j.receipt.status == "cancelled" for j in exe.statistics().broker.recent)
            )
        assert exe.statistics().broker.busy == 0
        # the original and its done version; the held job's partial output went with it
        left = set(stored_files(tmp_path / "state"))
        assert len(before) == 4
        assert len(left) == 1  # keep's original
        assert (await http.get(f"/api/v1/eas/{gone['id']}")).status_code == 404
        assert rows(
            pg_dsn,
            f"SELECT count(*) FROM files WHERE id = {gone['id']} OR parent_id = {gone['id']}",
        ) == [(0,)]
        refs = "', '".join(str(gone["id"] + n) for n in range(3))
        assert rows(pg_dsn, f"SELECT count(*) FROM broker_queue WHERE file_ref IN ('{refs}')") == [
            (0,)
        ]
        assert rows(
            pg_dsn, f"SELECT count(*) FROM broker_attempts WHERE file_ref IN ('{refs}')"
        ) == [(0,)]
        assert (await get(http, f"/api/v1/eas/{keep['id']}"))["id"] == keep["id"]
        assert (await http.delete(f"/inspect/system/fylr/files/{gone['id']}")).status_code == 404


async def test_a_requeued_step_says_why_at_once_in_position_and_upload_wait(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A version whose service is misspelled says so from its first requeue: the file
    document's queue member carries the reason and when it is tried again, and
    ``trio-broker position`` prints it (no waiting for the bound of attempts)."""
    versions = {"typo": {"service": "sha265"}}
    async with installation(pg_dsn, tmp_path, versions, retry_delay="1h") as (fylr, _, http):
        created = await put(http, "a.txt", b"text\n")
        assert fylr.dispatcher is not None
        with trio.fail_after(WAIT):
            await fylr.dispatcher.wait_until(lambda d: d.requeued == 1)
        await settled(fylr)
        document = await get(http, f"/api/v1/eas/{created['id']}")
        queue = document["versions"]["typo"]["queue"]
        assert queue["waits_because"] == f"UnknownService: {NOTICE}"
        assert 3000 < queue["retry_in_s"] <= 3600
        assert round(queue["retry_in_s"] / 60) == 60  # what the command rounds it to
        status, out = await command("position", str(created["id"]), "--server", fylr.url)
        assert status == 0, out
        line = (
            f"a.txt #{created['id']} typo: waits: UnknownService: {NOTICE}"
            " (tried again in roughly 60 minutes)"
        )
        assert out.startswith(line), out
        # upload --wait shows the same words for the same document, from the same functions
        assert [f"{label}: {queue_text(q)}" for label, q in waiting_steps(document)] == [line]


@pytest.mark.parametrize("token", [None, "wrong", "read", "operator"])
async def test_the_work_routes_need_the_operator_token(
    pg_dsn: str, tmp_path: Path, token: str | None
) -> None:
    """Every work route answers 401 without a token or with a wrong one, 403 with the read
    token, and works with the operator token (here and through the command)."""
    tokens = {"read": "read-secret", "operator": "operator-secret", "upload": "upload-secret"}
    async with installation(pg_dsn, tmp_path, {}, tokens=tokens) as (fylr, _, http):
        given = {None: None, "wrong": "not-a-token"}.get(token, tokens.get(token or ""))
        headers = {} if given is None else {"authorization": f"Bearer {given}"}
        expected = {None: 401, "wrong": 401, "read": 403, "operator": 200}[token]
        for method, path in [
            ("GET", "/inspect/system/fylr/files"),
            ("GET", "/inspect/system/fylr/steps"),
            ("GET", "/inspect/system/queues"),
        ]:
            response = await http.request(method, path, headers=headers)
            assert response.status_code == expected, (path, response.text)
        for method, path in [
            ("GET", "/inspect/system/fylr/steps/1"),
            ("POST", "/inspect/system/fylr/steps/1/cancel"),
            ("POST", "/inspect/system/fylr/steps/1/retry"),
            ("POST", "/inspect/system/fylr/files/1/retry"),
            ("DELETE", "/inspect/system/fylr/files/1"),
        ]:
            response = await http.request(method, path, headers=headers)
            assert response.status_code == (404 if expected == 200 else expected), path
        extra = () if given is None else ("--token", given)
        status, out = await command("work", "queues", "--server", fylr.url, *extra)
        assert status == (0 if expected == 200 else 1), out
