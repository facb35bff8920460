"""A job's own ``timeout`` and ``stall_timeout`` over the service's, with real subprocesses."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.support.wire import WAIT, connect, start_execserver
from trio_broker.core import protocol as p
from trio_broker.trio.command import CommandRunner, CommandSpec
from trio_broker.trio.runner import JobControl, JobRequest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the runner reads /proc")

SLEEP = ["sleep", "{seconds}"]


async def run_job(runner: CommandRunner, job: dict[str, Any]) -> p.Receipt:
    with trio.fail_after(WAIT):
        return await runner.run(JobRequest(job_id="j", service="svc", job=job), JobControl())


def runner(tmp_path: Path, **spec: Any) -> CommandRunner:
    return CommandRunner(
        {"svc": CommandSpec(argv=SLEEP, **spec)},
        temp_dir=str(tmp_path),
        instance_id="i",
        sample_interval=0.1,
        kill_grace=1.0,
    )


async def test_a_job_timeout_shorter_than_the_services_times_it_out(tmp_path: Path) -> None:
    """The job's 0.5s wins over the service's ceiling of an hour."""
    receipt = await run_job(
        runner(tmp_path, timeout=3600.0, stall_timeout=None),
        {"params": {"seconds": 30}, "timeout": "500ms"},
    )
    assert receipt.status == "timed_out"
    assert receipt.error == "timed out after 0.5s"


async def test_a_job_timeout_of_0_disables_the_services(tmp_path: Path) -> None:
    """A command longer than the service's ceiling runs to its end when the job says "0"."""
    limited = runner(tmp_path, timeout=0.3, stall_timeout=None)
    assert (await run_job(limited, {"params": {"seconds": 1}})).status == "timed_out"
    receipt = await run_job(limited, {"params": {"seconds": 1}, "timeout": "0"})
    assert receipt.status == "ok", receipt.error


async def test_a_job_stall_timeout_over_the_services(tmp_path: Path) -> None:
    """The job's stall window replaces the service's: shorter stalls it, "0" disables it."""
    patient = runner(tmp_path, timeout=None, stall_timeout=3600.0)
    receipt = await run_job(patient, {"params": {"seconds": 30}, "stall_timeout": "0.5s"})
    assert (receipt.status, receipt.error) == ("stalled", "stalled: no progress for 0.5s")
    strict = runner(tmp_path, timeout=None, stall_timeout=0.3)
    receipt = await run_job(strict, {"params": {"seconds": 1}, "stall_timeout": "0"})
    assert receipt.status == "ok", receipt.error


async def test_a_bad_job_duration_is_an_error_receipt(tmp_path: Path) -> None:
    """An invalid duration runs nothing and names the member."""
    receipt = await run_job(runner(tmp_path), {"params": {"seconds": 1}, "timeout": "soon"})
    assert receipt.status == "error"
    assert receipt.error is not None
    assert receipt.error.startswith("timeout must be a duration")


async def test_job_limits_through_a_real_execserver() -> None:
    """Over the broker: a job timeout shorter than the service's kills the command with
    status timed_out, and "0" lets a command outlive the service's timeout."""
    async with trio.open_nursery() as nursery:
        handle = await start_execserver(
            nursery,
            services={"slow": {"argv": SLEEP, "timeout": "0.4s", "stall_timeout": "0"}},
        )
        async with connect(handle) as peer:
            for job_id, job, status in (
                ("short", {"params": {"seconds": 30}, "timeout": "200ms"}, "timed_out"),
                ("service", {"params": {"seconds": 30}}, "timed_out"),
                ("none", {"params": {"seconds": 1}, "timeout": "0"}, "ok"),
            ):
                offer = await peer.want(job_id, "slow")
                assert isinstance(offer, p.Offer)
                await peer.send(
                    p.Job(job_id=job_id, token=offer.token, service="slow", subject="t", job=job)
                )
                done = await peer.done(job_id)
                assert done.receipt.status == status, (job_id, done.receipt.error)
                if job_id == "short":
                    assert done.receipt.error == "timed out after 0.2s"
                if job_id == "service":
                    assert done.receipt.error == "timed out after 0.4s"
        nursery.cancel_scope.cancel()
