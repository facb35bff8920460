"""One decision per step, from the receipt to the queue row, and a failed version made again.

A real PostgreSQL, a real execserver process (killed with SIGKILL in mid-job) and
real commands: each way a step ends badly gets exactly one decision, the
dispatcher's, which the file worker carries out and the queue row shows.
"""

from __future__ import annotations

import ast
import os
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import trio
import yaml
from trio_broker_daemons.fylr import worker
from trio_broker_daemons.fylr.config import FylrConfig

from tests.daemons.test_fylr import (
    WAIT,
    download,
    fylr_mapping,
    put,
    rows,
    running_fylr,
    settled,
)
from tests.support.imports import imports
from tests.support.netns import until
from tests.support.processes import open_execserver_process, open_fylr_process

REPOSITORY = Path(__file__).resolve().parents[2]


def execserver_text(port: int, services: dict[str, Any]) -> str:
    return yaml.safe_dump(
        {
            "listen": f"127.0.0.1:{port}",
            "slots": 3,
            "fast_reserve": 0,
            "unknown_share": 1.0,
            "services": services,
        }
    )


def converter(marker: Path) -> dict[str, Any]:
    """A converter that fails (stderr line, exit 3) until ``marker`` exists: its codec."""
    script = (
        'cat >/dev/null; test -e "$0" || {{ echo "codec: not installed" >&2; exit 3; }};'
        " echo converted"
    )
    return {"argv": ["sh", "-c", script, str(marker)]}


# one slot at most, and a job that holds it streaming until its execserver dies
HOLD = {
    "argv": ["sh", "-c", "cat >/dev/null; while :; do echo tick; sleep 0.2; done"],
    "max_slots": 1,
}

CLASSES = {
    "text": {
        "extensions": ["txt"],
        "versions": {
            "converted": {"service": "convert"},
            "from_converted": {"service": "sha256", "source": "converted"},
            "held_a": {"service": "hold"},
            "held_b": {"service": "hold"},
        },
    }
}


def queue_rows(dsn: str) -> dict[str, tuple[str, int, str | None, bool, bool]]:
    """version name -> (status, attempts, last_error, due now, due in more than 50 minutes)."""
    found = rows(
        dsn,
        "SELECT f.version, q.status, q.attempts, q.last_error, q.start_after <= now(),"
        " q.start_after > now() + interval '50 minutes'"
        " FROM broker_queue q JOIN files f ON f.id = q.file_ref::bigint",
    )
    return {row[0]: row[1:] for row in found}


async def requeue_failed(config: Path) -> None:
    """``trio-broker fylr requeue --failed``, which must requeue one failed row."""
    result = await trio.run_process(
        [sys.executable, "-m", "trio_broker_daemons", "fylr", "requeue",
         "--failed", "--config", str(config)],
        capture_stdout=True,
        capture_stderr=True,
        cwd=REPOSITORY,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "1 failed item(s) requeued" in result.stdout.decode()


async def killed_after_settling(config: Path, upload: tuple[str, bytes]) -> dict[str, Any]:
    """Run a fylr process with the worker's test-only exit hook, upload one file, and
    wait until the process exits right after settling the step's failure."""
    hooked = {**os.environ, worker.TEST_EXIT_AFTER_FAILURE_SETTLED: "1"}
    async with open_fylr_process(config, env=hooked) as first:
        async with httpx.AsyncClient(base_url=first.http_url, timeout=WAIT) as http:
            created = await put(http, *upload)
        with trio.fail_after(WAIT):
            assert await first.process.wait() == worker.TEST_EXIT_STATUS
    return created


async def test_each_failed_step_gets_one_decision_and_requeue_remakes_a_failed_version(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A converter failure, a lost job (its execserver killed with SIGKILL) and a no-slot
    timeout each get one decision, carried into the queue row: failed with the receipt's
    decisive line; requeued at once; requeued after retry_delay. Once the converter is fixed,
    ``trio-broker fylr requeue --failed`` makes the failed version (and the one made from it)."""
    marker = tmp_path / "codec-installed"
    services = {"convert": converter(marker), "hold": HOLD, "sha256": {"argv": ["sha256sum"]}}
    async with open_execserver_process(execserver_text(0, services)) as first:
        port = first.port
        mapping = fylr_mapping(
            pg_dsn,
            tmp_path / "state",
            f"127.0.0.1:{port}",
            CLASSES,
            connect_timeout="2s",
            retry_delay="1h",
        )
        async with (
            running_fylr(FylrConfig.from_mapping(mapping)) as fylr,
            httpx.AsyncClient(base_url=fylr.url, timeout=WAIT) as http,
        ):
            assert fylr.dispatcher is not None
            dispatcher = fylr.dispatcher
            created = await put(http, "a.txt", b"some text\n")
            with trio.fail_after(WAIT):
                # the sync done, the converter failed, one hold found no slot in time while
                # the other holds the slot
                await dispatcher.wait_until(
                    lambda s: (s.completed, s.failed, s.requeued, s.exec_in_flight) == (1, 1, 1, 1)
                )
            first.process.send_signal(signal.SIGKILL)
            assert await first.process.wait() == -signal.SIGKILL
            with trio.fail_after(WAIT):  # the held job is lost with its execserver
                await dispatcher.wait_until(lambda s: s.requeued == 2 and s.exec_in_flight == 0)
            await settled(fylr)
            stats = dispatcher.statistics()
            assert (stats.claimed, stats.completed, stats.failed, stats.requeued) == (4, 1, 1, 2)
            queue = queue_rows(pg_dsn)
            lost, timed_out = (
                ("held_a", "held_b")
                if "JobLost" in (queue["held_a"][2] or "")
                else ("held_b", "held_a")
            )
            # the converter's failure: a failed row with the receipt's decisive line
            status, attempts, error, _, _ = queue["converted"]
            assert (status, attempts) == ("failed", 1)
            assert error == "JobFailed: failed (exit status 3): codec: not installed"
            # the lost job: requeued at once (not claimed again: no execserver is connected)
            status, attempts, error, due_now, _ = queue[lost]
            assert (status, attempts, due_now) == ("new", 1, True)
            assert (error or "").startswith("JobLost: ")
            # no slot within connect_timeout: requeued after retry_delay (an hour)
            status, attempts, error, _, in_an_hour = queue[timed_out]
            assert (status, attempts, in_an_hour) == ("new", 1, True)
            assert (error or "").startswith("NoSlot: ")
            assert set(queue) == {"converted", lost, timed_out}
            # the worker carried each decision out once: the files follow the rows
            steps = fylr.statistics().steps
            assert (steps["produce.failed"], steps["produce.requeued"]) == (1, 2)
            document = (await http.get(f"/api/v1/eas/{created['id']}")).json()
            versions = document["versions"]
            assert versions["converted"]["status"] == "failed"
            assert versions["converted"]["error"] == "codec: not installed"
            assert versions["converted"]["metadata"]["produced"]["exit_code"] == 3
            assert versions["from_converted"]["status"] == "failed"
            assert versions["from_converted"]["error"] == "source version 'converted' failed"
            assert versions[lost]["status"] == versions[timed_out]["status"] == "pending"
            page = (await http.get("/inspect/system/fylr")).json()
            assert [item["reason"] for item in page["failed"]] == [queue["converted"][2]]

            # the codec is installed; the execserver comes back (its hold ends at once now)
            marker.touch()
            fixed = {**services, "hold": {"argv": ["sha256sum"], "max_slots": 1}}
            async with open_execserver_process(execserver_text(port, fixed)):
                config = tmp_path / "fylr.yml"
                config.write_text(yaml.safe_dump(mapping))
                await requeue_failed(config)
                dispatcher.wake()
                with trio.fail_after(WAIT):
                    await fylr.wait_until(lambda s: s.steps.get("produce.ok", 0) == 3)
                await settled(fylr)
                document = (await http.get(f"/api/v1/eas/{created['id']}")).json()
                versions = document["versions"]
                assert versions["converted"]["status"] == "done"
                assert versions["converted"]["error"] is None
                assert await download(http, created["id"], "converted") == b"converted\n"
                assert versions["from_converted"]["status"] == "done"
                assert versions[lost]["status"] == "done"  # the lost job ran again at once
                assert versions[timed_out]["status"] == "pending"  # still waits its hour
                assert set(queue_rows(pg_dsn)) == {timed_out}


async def test_a_failure_settled_by_a_killed_fylr_keeps_its_failed_row(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A fylr process that settled a failure (its version ended ``error``) and was killed
    before the row was written (the worker's test-only exit hook, between the two writes):
    the next fylr runs the step again, finds the version failed, and the row ends ``failed``
    with the recorded reason (it was deleted as done before), which ``trio-broker fylr
    requeue --failed`` then makes again."""
    marker = tmp_path / "codec-installed"
    classes = {"text": {"extensions": ["txt"], "versions": {"converted": {"service": "convert"}}}}
    async with open_execserver_process(execserver_text(0, {"convert": converter(marker)})) as ex:
        config = tmp_path / "fylr.yml"
        mapping = fylr_mapping(pg_dsn, tmp_path / "state", f"127.0.0.1:{ex.port}", classes)
        config.write_text(yaml.safe_dump(mapping))
        created = await killed_after_settling(config, ("a.txt", b"some text\n"))
        # the version settled, its row still claimed by the dead process
        versions = rows(pg_dsn, "SELECT status, error FROM files WHERE kind = 'version'")
        assert versions == [("error", "codec: not installed")]
        assert queue_rows(pg_dsn)["converted"][:2] == ("claimed", 1)

        async def queue() -> dict[str, tuple[str, int, str | None, bool, bool]]:
            return queue_rows(pg_dsn)

        def decided(found: dict[str, tuple[str, int, str | None, bool, bool]]) -> bool:
            return found.get("converted", ("deleted",))[0] not in ("new", "claimed")

        async with (
            open_fylr_process(config) as second,
            httpx.AsyncClient(base_url=second.http_url, timeout=WAIT) as http,
        ):
            with trio.fail_after(WAIT):  # requeued (the dead backend's), replayed, decided
                found = await until(queue, decided)
            status, attempts, error, _, _ = found.get("converted", ("deleted", 0, None, 0, 0))
            assert (status, attempts) == ("failed", 2)
            assert error == "FailedEarlier: codec: not installed"
            page = (await http.get("/inspect/system/fylr")).json()
            assert [item["reason"] for item in page["failed"]] == [error]

            marker.touch()  # the codec is installed: an operator retries the row
            await requeue_failed(config)

            async def document() -> dict[str, Any]:
                found: dict[str, Any] = (await http.get(f"/api/v1/eas/{created['id']}")).json()
                return found

            with trio.fail_after(WAIT):
                done = await until(
                    document, lambda d: d["versions"]["converted"]["status"] == "done"
                )
            assert done["versions"]["converted"]["error"] is None
            assert await download(http, created["id"], "converted") == b"converted\n"
            assert queue_rows(pg_dsn) == {}


async def test_a_metadata_failure_settled_by_a_killed_fylr_keeps_its_failed_row(
    pg_dsn: str, tmp_path: Path
) -> None:
    """The same for a metadata step that failed for good (no execserver offers its service,
    and the broker client looked for it a whole ``pool_reprobe_interval``): the original
    ended ``error`` before the kill; the next fylr fails the row with the recorded reason,
    and ``requeue --failed`` runs it again."""
    classes = {"data": {"extensions": ["bin"], "metadata": {"service": "probe"}}}
    async with open_execserver_process(execserver_text(0, {"convert": converter(tmp_path)})) as ex:
        config = tmp_path / "fylr.yml"
        mapping = fylr_mapping(
            pg_dsn,
            tmp_path / "state",
            f"127.0.0.1:{ex.port}",
            classes,
            pool_reprobe_interval="0.2s",
            retry_delay="0.5s",  # the second claim comes after the search ended
        )
        config.write_text(yaml.safe_dump(mapping))
        await killed_after_settling(config, ("a.bin", b"data\n"))
        ((status, recorded),) = rows(pg_dsn, "SELECT status, error FROM files")
        assert status == "error"
        assert recorded.startswith("metadata: ServiceNotOffered: ")
        assert rows(pg_dsn, "SELECT status, attempts FROM broker_queue") == [("claimed", 2)]

        async def queue() -> list[tuple[Any, ...]]:
            return rows(pg_dsn, "SELECT status, attempts, last_error FROM broker_queue")

        async with open_fylr_process(config):
            with trio.fail_after(WAIT):
                found = await until(queue, lambda q: [r[0] for r in q] in ([], ["failed"]))
            assert found == [("failed", 3, "FailedEarlier: " + recorded.removeprefix("metadata: "))]
            await requeue_failed(config)
            with trio.fail_after(WAIT):  # run again: not yet, then not offered (a new search)
                found = await until(queue, lambda q: q[0][:2] == ("failed", 5))
            assert (found[0][2] or "").startswith("ServiceNotOffered: ")


def test_the_worker_never_judges() -> None:
    """The file worker neither imports the outcome table's judge nor keeps a retry delay of
    its own: the dispatcher's decision is the only one."""
    source = Path(worker.__file__)
    names = {alias.name for node in imports(source) for alias in node.names}
    assert "judge" not in names
    tree = ast.parse(source.read_text(encoding="utf-8"))
    used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    used |= {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    assert "judge" not in used
    assert "retry_delay" not in used
