"""The fylr's database fails over to a streaming replica in mid-run: nothing lost, nothing
run twice.

Real parts throughout: a PostgreSQL cluster of the test's own and a synchronous
streaming standby of it (``pg_basebackup -R``, :func:`tests.support.pg.streaming_replica`),
a real execserver running real commands, the fylr in this process. The fylr knows
the database only by a libpq multi-host connection string naming the standby
*first* and the primary second, with ``target_session_attrs=read-write``: libpq
passes over the read-only standby to the primary, and after the fail-over over the
dead primary to the promoted standby.

In mid-run, with both of the execserver's slots held at a gate (their steps
claimed, more claimed behind them), the primary is stopped as if its host failed
(``pg_ctl stop -m immediate``); a request is answered 503, an upload sent then is
answered 503 and sent again. The gate opens: the held jobs and the ones queued
behind them finish while no server takes writes, and their results wait (the
fylr tries them again, it does not requeue their steps). The standby is then
promoted (``pg_ctl promote``). Every file ends done with every version right, and
each step ran to completion exactly once: every job's command appends its output
(a digest unique to its step) to a log as it ends.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
from trio_broker_daemons.commands.upload import upload
from trio_broker_daemons.execserver.app import serve_from_config
from trio_broker_daemons.execserver.config import ExecserverConfig
from trio_broker_daemons.fylr.api import RETRY_AFTER
from trio_broker_daemons.fylr.state import FylrStatistics

from tests.daemons.test_fylr import WAIT, download, ended, put, sha256_line
from tests.daemons.test_fylr_shared import fylr_on, make_gate, open_gate
from tests.support.pg import crash, multi_host_dsn, own_cluster, streaming_replica
from trio_broker.trio.execserver import ExecserverHandle

FILES = 8
SLOTS = 2
POOL = 12

# "$0" is the gate (a FIFO: a job that finds it waits until it is opened), "$1" the log of
# the runs; a job appends its output to the log as it ends
HELD = 'if [ -p "$0" ]; then cat "$0" >/dev/null; rm -f "$0"; fi; sha256sum | tee -a "$1"'
LOGGED = 'sha256sum | tee -a "$0"'

CLASSES: dict[str, Any] = {
    "text": {
        "extensions": ["txt"],
        "versions": {
            "a": {"service": "held"},
            "b": {"service": "logged", "source": "a"},
        },
    }
}


@asynccontextmanager
async def execserver(services: Mapping[str, Any]) -> AsyncIterator[ExecserverHandle]:
    config = ExecserverConfig.from_mapping(
        {
            "listen": "127.0.0.1:0",
            "name": "failover-exec",
            "job_user": os.environ.get("TRIO_BROKER_JOB_USER"),  # the gate is in tmp_path
            "slots": SLOTS,
            "fast_reserve": 0,
            "unknown_share": 1.0,
            "services": dict(services),
        }
    )
    async with trio.open_nursery() as nursery:
        handle: ExecserverHandle = await nursery.start(serve_from_config, config)
        try:
            yield handle
        finally:
            nursery.cancel_scope.cancel()


def running(handle: ExecserverHandle) -> int:
    """The jobs the execserver runs now."""
    runner = handle.statistics().runner
    assert runner is not None
    return len(runner.running)


def met_the_outage(statistics: FylrStatistics) -> bool:
    """Whether the held jobs' steps have met the outage after their jobs ended: their
    results wait (tried again), or their handlers gave up (nothing in flight: the steps
    are requeued, and their jobs would run again)."""
    dispatcher = statistics.dispatcher
    assert dispatcher is not None
    return statistics.results_retried >= SLOTS or dispatcher.exec_in_flight == 0


async def test_a_fail_over_in_mid_run_loses_nothing_and_runs_no_step_twice(
    tmp_path: Path,
) -> None:
    gate = make_gate(tmp_path)
    runs = tmp_path / "runs.log"
    runs.touch()
    services = {
        "held": {"argv": ["sh", "-c", HELD, str(gate), str(runs)]},
        "logged": {"argv": ["sh", "-c", LOGGED, str(runs)]},
    }
    contents = {f"file-{n}.txt": f"content of file {n}\n".encode() * (n + 1) for n in range(FILES)}
    late = tmp_path / "late.txt"
    late.write_bytes(b"uploaded while no server took writes\n")
    with own_cluster() as primary:
        await trio.to_thread.run_sync(primary.ensure_database, "failover")
        with streaming_replica(primary) as replica:
            dsn = multi_host_dsn("failover", replica, primary, target_session_attrs="read-write")
            async with (
                execserver(services) as exec_handle,
                fylr_on(
                    dsn,
                    tmp_path / "state",
                    f"{exec_handle.host}:{exec_handle.port}",
                    CLASSES,
                    # a thread for every caller during the outage: none waits behind another's
                    # connection timeout
                    database_pool=POOL,
                ) as (fylr, http),
            ):
                ids = {name: (await put(http, name, data))["id"] for name, data in contents.items()}
                # both slots hold a claimed step whose outcome is not known yet
                with trio.fail_after(WAIT):
                    await exec_handle.wait_until(lambda: running(exec_handle) == SLOTS)

                await trio.to_thread.run_sync(crash, primary)
                response = await http.get(f"/api/v1/eas/{ids['file-0.txt']}")
                assert response.status_code == 503, response.text
                assert response.headers["retry-after"] == str(RETRY_AFTER)
                failed_before = fylr.statistics().uploads_failed
                later: list[dict[str, Any]] = []
                async with trio.open_nursery() as nursery:

                    async def send() -> None:
                        later.append(await upload(http, fylr.url, late))

                    nursery.start_soon(send)
                    with trio.fail_after(WAIT):  # answered 503: no server takes writes
                        await fylr.wait_until(lambda s: s.uploads_failed > failed_before)
                    # the held jobs end now, and their results find no server to take them
                    await open_gate(gate)
                    with trio.fail_after(WAIT):
                        await fylr.wait_until(met_the_outage)
                    await trio.to_thread.run_sync(replica.promote)
                (document,) = later
                ids[late.name] = document["id"]
                contents[late.name] = late.read_bytes()

                for name, data in contents.items():
                    document = await ended(http, ids[name])
                    assert document["status"] == "done", (name, document)
                    assert {v: d["status"] for v, d in document["versions"].items()} == {
                        "a": "done",
                        "b": "done",
                    }, (name, document)
                    a = await download(http, ids[name], "a")
                    assert a == sha256_line(data)
                    assert await download(http, ids[name], "b") == sha256_line(a)
                page = (await http.get("/inspect/system/fylr")).json()
                assert page["queue"]["failed"] == page["queue"]["ready"] == 0, page["queue"]
                # one completed run per step: every file's two digests, each once
                logged = Counter(runs.read_bytes().splitlines(keepends=True))
                expected: Counter[bytes] = Counter()
                for data in contents.values():
                    a = sha256_line(data)
                    expected.update([a, sha256_line(a)])
                twice = sorted(line.decode() for line, count in logged.items() if count > 1)
                assert not twice, f"steps run to completion more than once: {twice}"
                assert logged == expected
                statistics = fylr.statistics()
                assert statistics.results_retried >= SLOTS
                assert statistics.dispatcher is not None
                assert statistics.dispatcher.store_errors > 0
