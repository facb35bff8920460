"""How a job's end reads to its caller: the receipt rules and the run failures of the core."""

from __future__ import annotations

from typing import get_args

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_broker.core import protocol as p
from trio_broker.core.client_values import Failed, FailReason
from trio_broker.core.dispatch import judge
from trio_broker.core.endings import (
    RUN_FAILURES,
    JobFailed,
    PipeState,
    decisive_line,
    interrupted,
    output_whole,
    receipt_failure,
    run_failure,
)
from trio_broker.core.errors import (
    JobLost,
    JobStopped,
    NoExecserver,
    NoSlot,
    UnknownService,
    WorkFailed,
)
from trio_broker.core.job import ended_receipt

STATUSES: tuple[p.Status, ...] = get_args(p.Status)
PIPE_STATES: tuple[PipeState, ...] = get_args(PipeState)


def receipt(
    status: p.Status = "ok",
    *,
    error: str | None = None,
    stderr_line: str | None = None,
    stdout_bytes: int = 0,
) -> p.Receipt:
    if status != "ok" and error is None:
        error = f"the {status} error"
    return ended_receipt(
        status,
        error,
        started_at=1.0,
        duration_s=0.5,
        instance_id="i",
        stderr_line=stderr_line,
        stdout_bytes=stdout_bytes,
    )


# -- runs that reached no end ----------------------------------------------------------------


def test_every_fail_reason_has_its_one_exception() -> None:
    """The table covers every reason of the client core; cancelled raises nothing."""
    assert set(RUN_FAILURES) == set(get_args(FailReason))
    expected = {"no_slot": NoSlot, "no_execserver": NoExecserver, "lost": JobLost}
    expected |= {"unknown_service": UnknownService}
    for reason, kind in expected.items():
        error = run_failure(Failed(job_id="j-1", reason=reason, detail="why"))  # type: ignore[arg-type]
        assert type(error) is kind
        assert str(error) == "job j-1: why"
    assert run_failure(Failed(job_id="j", reason="cancelled", detail="withdrawn")) is None


# -- receipts --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "error", "stderr_line", "line"),
    [
        ("failed", "exit status 3", "codec: no such format", "codec: no such format"),
        ("failed", "exit status 3", None, "exit status 3"),
        ("timed_out", "timed out after 30m", "frame 1200", "timed out after 30m"),
        ("stalled", "stalled: no progress for 10m", None, "stalled: no progress for 10m"),
        ("out_of_memory", "out of memory: 2 GB", "killed", "out of memory: 2 GB"),
        ("stopped", "the execserver is draining", "half", "the execserver is draining"),
        ("error", "cannot run 'x': No such file", None, "cannot run 'x': No such file"),
    ],
)
def test_the_decisive_line(
    status: p.Status, error: str, stderr_line: str | None, line: str
) -> None:
    """A command's own failure speaks through its stderr; an ending the runner decided
    through the receipt's error."""
    assert decisive_line(receipt(status, error=error, stderr_line=stderr_line)) == line


def test_a_failed_job_says_its_status_and_its_decisive_line() -> None:
    """JobFailed is the work's fault (not an operational error) and carries its receipt."""
    own = receipt("failed", error="exit status 3", stderr_line="codec: no such format")
    failed = JobFailed(own)
    assert isinstance(failed, WorkFailed)
    assert failed.receipt is own
    assert failed.line == "codec: no such format"
    assert str(failed) == "failed (exit status 3): codec: no such format"
    assert str(JobFailed(receipt("failed", error="exit status 3"))) == "failed: exit status 3"
    timed_out = JobFailed(receipt("timed_out", error="timed out after 2s", stderr_line="x"))
    assert str(timed_out) == "timed_out: timed out after 2s"
    verdict = judge(failed, retry_delay=60.0)
    assert (verdict.outcome, verdict.kind) == ("failed", "fail")
    assert verdict.error == "JobFailed: failed (exit status 3): codec: no such format"


@pytest.mark.parametrize(
    ("state", "stdout_bytes", "whole"),
    [
        ("done", 5, True),
        ("done", 0, True),
        ("closed", 0, True),
        ("closed", 5, False),
        ("aborted", 5, False),
        ("aborted", 0, False),
        ("open", 0, False),
        ("active", 5, False),
    ],
)
def test_stdout_arrived_whole(state: PipeState, stdout_bytes: int, whole: bool) -> None:
    """Whole: the pipe saw the stream's end, or there was nothing to stream."""
    assert output_whole(receipt(stdout_bytes=stdout_bytes), state) is whole


@given(
    status=st.sampled_from(STATUSES),
    stdout=st.none() | st.sampled_from(PIPE_STATES),
    stdout_bytes=st.sampled_from([0, 1, 10**6]),
    stderr_line=st.none() | st.sampled_from(["", "codec: bad"]),
)
def test_a_receipt_means_nothing_a_retry_or_a_failure(
    status: p.Status, stdout: PipeState | None, stdout_bytes: int, stderr_line: str | None
) -> None:
    """Every receipt reads as exactly one of: a result, JobStopped (interrupted, or a cut
    stream), JobFailed (any other ending); the decisive line is never empty."""
    got = receipt(status, stderr_line=stderr_line, stdout_bytes=stdout_bytes)
    failure = receipt_failure(got, stdout=stdout, what="the step")
    whole = stdout is None or output_whole(got, stdout)
    assert interrupted(got) == (status in ("stopped", "cancelled"))  # no older sentence here
    if interrupted(got):
        assert isinstance(failure, JobStopped)
        assert str(failure).startswith(f"the step was {status}: ")
    elif status != "ok":
        assert isinstance(failure, JobFailed)
        assert failure.receipt is got
    elif not whole:
        assert isinstance(failure, JobStopped)
        assert str(failure) == f"the output did not arrive whole (out-pipe {stdout})"
    else:
        assert failure is None
    assert decisive_line(got)


@pytest.mark.parametrize(
    ("status", "error", "temporary"),
    [
        ("stopped", "the in-pipe at http://10.0.0.1:7100 could not be reached (DNS failure)", True),
        ("stopped", "drain_timeout of 60s expired", True),
        ("cancelled", "cancelled by the client", True),
        ("failed", "exit status 3", False),
        ("timed_out", "timed out after 30m", False),
        ("stalled", "no progress for 5m", False),
        ("out_of_memory", "over its memory limit", False),
        ("error", "missing parameter 'text'", False),
        # an older execserver's sentence for an in-pipe it could not open
        ("error", "missing input: cannot read the in-pipe at http://h:1: ConnectError", True),
        ("error", "missing input: the in-pipe at http://h:1 answered 404", True),
    ],
)
def test_each_ending_is_temporary_or_permanent_by_its_cause(
    status: p.Status, error: str, temporary: bool
) -> None:
    """The network's and the execserver's faults are retried later; the work's fail it."""
    got = receipt(status, error=error)
    failure = receipt_failure(got, what="the step")
    assert isinstance(failure, JobStopped if temporary else JobFailed)
    verdict = judge(failure, retry_delay=60.0)
    assert (verdict.kind, verdict.delay) == (("requeue", 60.0) if temporary else ("fail", 0.0))
    if temporary:
        assert str(failure) == f"the step was {'stopped' if status == 'error' else status}: {error}"


def test_an_older_sentence_counts_only_without_a_process() -> None:
    """A command's own ``error`` receipt never passes for an unreachable pipe."""
    ran = attrs.evolve(receipt("error", error="missing input: x"), exit_code=1)
    assert isinstance(receipt_failure(ran), JobFailed)
