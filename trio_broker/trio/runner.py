"""Runners: what an execserver calls to run a granted job.

The execserver grants a slot, creates a :class:`JobControl` for the job and awaits
``runner.run(request, control)``; the runner returns a
:class:`~trio_broker.core.protocol.Receipt`, whatever happened to the job (build it
with :func:`~trio_broker.core.job.ended_receipt` or
:func:`~trio_broker.core.job.error_receipt`). This module is the contract only:

* :class:`JobRequest`: the redeemed ``JOB`` message. Its ``job`` member is the job
  object as it came; the reference runner reads it as a
  :class:`~trio_broker.core.job.JobSpec`, another runner may read it its own way.
* :class:`JobControl`: the execserver's handle on a running job (``CANCEL``,
  shutdown, a broken stream end it through :meth:`JobControl.abort`).
* :class:`Runner`: the protocol a runner implements.
* :class:`RunningJob`, :class:`RunnerStatistics`, :class:`ContainmentInfo`: what
  a runner that keeps statistics reports in the execserver's inspection data.

The reference runner, which runs each service as a supervised command, is
:class:`trio_broker.trio.command.CommandRunner`; the execserver's end of the pipes
it streams through is :mod:`trio_broker.trio.pipe_io`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Protocol, TypeAlias, runtime_checkable

import attrs
import trio

from trio_broker.core.protocol import Receipt

__all__ = [
    "AbortStatus",
    "ContainmentInfo",
    "JobControl",
    "JobRequest",
    "ReportingRunner",
    "Runner",
    "RunnerStatistics",
    "RunningJob",
    "StdoutTap",
]

AbortStatus: TypeAlias = Literal["cancelled", "stopped"]
"""The receipt statuses of an aborted job: ``CANCEL`` from the client, or an
operational interruption (shutdown, broken stream)."""


@attrs.frozen(kw_only=True)
class JobRequest:
    """A job to run: the redeemed ``JOB`` message.

    Attributes:
        job_id: the client's job id.
        service: the service to run it with.
        subject: what the job is about (for logs), if the client said.
        job: the ``JOB`` message's object; parameters are in ``job["params"]``.
    """

    job_id: str
    service: str
    subject: str | None = None
    job: Mapping[str, Any] = attrs.field(factory=dict)
    stdout_tap: StdoutTap | None = attrs.field(default=None, eq=False, repr=False)
    """Not from the wire: where a wrapping runner (the produce cache,
    :mod:`trio_broker.trio.produce_cache`) wants a copy of the command's stdout."""


class StdoutTap(Protocol):
    """Takes a copy of a command's stdout, chunk by chunk, as the runner reads it.

    It must not raise: a tap that cannot keep up with its own storage gives up
    quietly (the job does not fail for it).
    """

    async def write(self, chunk: bytes) -> None:
        """Keep one chunk of stdout (chunks come in order); ``b""`` marks its end."""
        ...


class JobControl:
    """The execserver's handle on one running job: it can ask the runner to end it.

    Created by the execserver per job and passed to :meth:`Runner.run`. Use it
    from the trio thread only.
    """

    def __init__(self) -> None:
        self._event = trio.Event()
        self._status: AbortStatus | None = None
        self._reason: str | None = None

    def abort(self, status: AbortStatus, reason: str) -> None:
        """Ask the runner to end the job now; the first call wins, later ones are ignored.

        Args:
            status: the receipt status, ``"cancelled"`` (the client's ``CANCEL``)
                or ``"stopped"`` (shutdown, broken stream).
            reason: the receipt's error sentence.

        Raises:
            ValueError: ``status`` is neither of the two.
        """
        if status not in ("cancelled", "stopped"):
            raise ValueError(f"an abort status is 'cancelled' or 'stopped', not {status!r}")
        if self._status is None:
            self._status = status
            self._reason = reason
            self._event.set()

    @property
    def aborted(self) -> bool:
        """Whether :meth:`abort` was called."""
        return self._status is not None

    @property
    def status(self) -> AbortStatus | None:
        """The first abort's status, ``None`` before any."""
        return self._status

    @property
    def reason(self) -> str | None:
        """The first abort's reason, ``None`` before any."""
        return self._reason

    async def wait_aborted(self) -> None:
        """Return once :meth:`abort` has been called."""
        await self._event.wait()


class Runner(Protocol):
    """Runs granted jobs for an execserver."""

    async def run(self, request: JobRequest, control: JobControl) -> Receipt:
        """Run one job to its end and describe how it ended.

        Never raises for job-level problems (unknown service, bad parameters,
        a command that fails or cannot start): those are receipts. If the calling
        task is cancelled, the job is killed and the cancellation propagates.
        """
        ...


@attrs.frozen(kw_only=True)
class RunningJob:
    """One running job in a runner's statistics."""

    job_id: str
    service: str
    started_at: float
    pid: int | None
    """The leader's pid; ``None`` for builtins."""
    pgid: int | None
    """The process group (equal to ``pid``); ``None`` for builtins."""
    rss: int | None
    """The latest sampled RSS of the group."""
    peak_memory: int | None


@attrs.frozen(kw_only=True)
class ContainmentInfo:
    """How a runner keeps its jobs' processes together and away from its secrets."""

    mode: Literal["cgroup", "process_tree"]
    """``cgroup``: each job in a cgroup of its own; ``process_tree``: a job's
    session, process group, descendants and tagged processes."""
    cgroup: str | None
    """The folder the jobs' cgroups are made in (cgroup mode)."""
    memory: Literal["cgroup", "processes"]
    """Where a job's memory is read: its cgroup's counters, or its processes' RSS."""
    reason: str | None
    """Why there is no cgroup, or why its memory counters are not used."""
    subreaper: bool
    """Whether the runner's process adopts its jobs' orphans."""
    dumpable: bool
    """Whether the runner's process's ``/proc`` files are readable by its user."""
    keeper_pid: int | None
    """The process that ends what the jobs left once the runner's process is gone."""
    job_user: str
    """The user jobs run as."""


@attrs.frozen(kw_only=True)
class RunnerStatistics:
    """A snapshot of a runner: its running jobs and the memory they use."""

    running: tuple[RunningJob, ...]
    memory_used: int
    """The latest sampled RSS of every running job, summed."""
    memory_budget: int | None
    caches: Mapping[str, Mapping[str, int]] = attrs.field(factory=dict)
    """Each cached service's produce cache figures (``entries``, ``bytes``,
    ``max_size``, ``hits``, ``misses``), by service; empty without a cache."""
    containment: ContainmentInfo | None = None
    """How the jobs are contained, when the runner says."""


@runtime_checkable
class ReportingRunner(Runner, Protocol):
    """A runner that can also say what it runs now (the inspection pages show it)."""

    def statistics(self) -> RunnerStatistics:
        """A snapshot of the running jobs and the memory they use."""
        ...
