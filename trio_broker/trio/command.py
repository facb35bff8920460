"""The reference runner: each service is a supervised command, or a builtin.

A :class:`CommandRunner` implements :class:`~trio_broker.trio.runner.Runner`. It runs
each service as a configured argv template (:mod:`trio_broker.core.argv`, never a
shell) as the leader of a new session, in a work folder of its own, as the
configured user, with an environment of its own (:func:`job_environment`: a few
of the runner's variables and the configured ones, never the rest); it samples the
job's processes every ``sample_interval`` for :mod:`trio_broker.core.supervision`,
and kills every one of them at the end. Linux only: it reads ``/proc``
(:mod:`trio_broker.trio.procgroup`).

A job's processes: with a :class:`~trio_broker.trio.containment.Containment` that
has a delegated cgroup, the processes of the job's own cgroup (exact; killed with
one write; memory from its counters). Otherwise its *process tree*: its session
and process group, their descendants, and at the end every process carrying the
job's tag in its environment (:data:`~trio_broker.trio.procgroup.TAG_ENV`), so a
``setsid`` or a double fork does not outlive the job (see
:mod:`trio_broker.trio.procgroup`). Each leader is started by one long-lived thread
(:mod:`trio_broker.trio.spawn`) and, between fork and exec, enters the job's
cgroup, becomes the job user and asks for ``SIGKILL`` when the runner's process
dies (its parent-death signal).

The work folder is locked while its job runs (:mod:`trio_broker.trio.workdir`), so
that a sweep of stale folders never touches it, and is given to the job user.

Starting a job: the job object is read (:class:`~trio_broker.core.job.JobSpec`), its
``params`` fill the template, its pipes are opened (:mod:`trio_broker.trio.pipe_io`),
and only then does the command start. Anything refused on the way (an unknown
service, a bad job object, a missing parameter, a program that cannot run) ends
the job ``error`` and runs nothing; an in-pipe that cannot be reached ends it
``stopped`` (the network's fault: it is run again later) and runs nothing.

Ending a job:

* The leader exits on its own: the rest of the group gets ``SIGKILL`` (no stray
  helper survives), the leader is reaped, the receipt tells its exit status.
* A verdict (timeout, stall, memory), a pipe failure or
  :meth:`~trio_broker.trio.runner.JobControl.abort`: ``SIGTERM`` to the group, up to
  ``kill_grace`` seconds for the leader to exit, then ``SIGKILL`` to the group; the
  receipt keeps the leader's real exit status.
* The task running :meth:`CommandRunner.run` is cancelled (daemon shutdown):
  ``SIGKILL`` to the group at once, reap, clean up (shielded, bounded), and the
  cancellation propagates.

Every end-of-job verdict (which ending a verdict, an abort or a pipe failure is,
a stall that was a silent pipe's, the status an exit status means, what a failed
pipe does to an ``ok`` end) is the supervision core's
(:mod:`trio_broker.core.supervision`, *How a job ends*): this module observes
(what came first, the exit status, the pipes) and reports it there.

The leader is waited for through a pidfd, which becomes readable when it exits
but does not reap it: the job is signalled while the exited leader is still a
zombie holding its pid, so its session and group id cannot have been reused by then.

Builtin services (``noop``, ``sleep``) run in-process and ignore pipes.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import math
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any, Final, Literal

import attrs
import trio

from trio_broker.core.argv import ArgvTemplate, ParameterError
from trio_broker.core.job import JobSpec, JobSpecError, LastLine, ended_receipt, error_receipt
from trio_broker.core.protocol import Receipt, Status
from trio_broker.core.supervision import (
    Ending,
    MemoryBudget,
    Verdict,
    Watchdog,
    abort_ending,
    budget_verdict,
    command_end,
    pipe_ending,
    receipt_end,
    verdict_ending,
)
from trio_broker.trio import procgroup
from trio_broker.trio.cgroup import JobCgroup
from trio_broker.trio.containment import Containment, JobUser, JobUserError, reap_adopted
from trio_broker.trio.pipe_io import (
    PIPE_FINISH_TIMEOUT,
    InPipe,
    OutPipe,
    PipeConnector,
    PipeFault,
    PipeUnreachable,
    PipeUrls,
    StdoutReader,
    open_pipes,
    pipe_waits,
    pump_stdout,
    wait_stdout_end,
)
from trio_broker.trio.procgroup import TAG_ENV, JobTag
from trio_broker.trio.runner import (
    ContainmentInfo,
    JobControl,
    JobRequest,
    RunnerStatistics,
    RunningJob,
)
from trio_broker.trio.spawn import Child, spawn
from trio_broker.trio.workdir import WorkDir

__all__ = ["INHERITED_ENV", "SUPERVISED_ENV", "CommandRunner", "CommandSpec", "job_environment"]

logger = logging.getLogger(__name__)

SUPERVISED_ENV: Final = ("FYLR_EXEC_SUPERVISED", "FYLR_CONVERT_THREADS", TAG_ENV)
"""Variables the runner always sets itself (the tag is set per job, see
:class:`~trio_broker.trio.procgroup.JobTag`)."""
INHERITED_ENV: Final = ("PATH", "HOME", "LANG", "TMPDIR")
"""The only variables a job takes from the runner's own environment (when it has them).

Nothing else of the daemon's environment reaches a command (its tokens, its
database password, its cloud credentials): a job sees these, the
:data:`SUPERVISED_ENV` the runner sets, and the configured ``env``. ``PATH``
defaults to :data:`os.defpath` when the runner has none."""


def job_environment(
    spec: CommandSpec, env: Mapping[str, str], *, inherit: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment a command of ``spec`` runs with.

    Args:
        spec: the service (its ``env`` and ``threads``).
        env: the runner's ``env`` for every command (under the service's own).
        inherit: where :data:`INHERITED_ENV` is read; by default ``os.environ``.

    Returns:
        :data:`INHERITED_ENV` from ``inherit``, then ``env``, then ``spec.env``,
        then :data:`SUPERVISED_ENV` (which always win).
    """
    source = os.environ if inherit is None else inherit
    result = {name: source[name] for name in INHERITED_ENV if name in source}
    result.setdefault("PATH", os.defpath)
    result.update(env)
    result.update(spec.env)
    result["FYLR_EXEC_SUPERVISED"] = "1"
    result["FYLR_CONVERT_THREADS"] = str(spec.threads)
    return result


_READ_CHUNK: Final = 65536
_BULK_PIPE_BYTES: Final = 1 << 20
"""Kernel buffer asked for the stdin/stdout pipes of a body-mode job (Linux: at
most ``/proc/sys/fs/pipe-max-size``, 1 MiB by default): fewer, larger reads and
writes per megabyte streamed."""
_CLEANUP_TIMEOUT: Final = 5.0  # shielded cleanup after a cancellation
_GROUP_GONE_TIMEOUT: Final = 3.0  # for SIGKILLed members to die
_GROUP_GONE_POLL: Final = 0.02
_KILL_ROUNDS: Final = 20  # kill, wait, look again: a killed process cannot fork
_STDERR_DRAIN_TIMEOUT: Final = 2.0  # for stderr to reach its end once the group is dead


# -- the service specification -------------------------------------------------------


def _template(argv: Sequence[str] | None) -> ArgvTemplate | None:
    return None if argv is None else ArgvTemplate.parse(argv)


def _positive_or_none(spec: CommandSpec, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name} must be positive or None, got {value!r}")


@attrs.frozen(kw_only=True)
class CommandSpec:
    """How one service runs.

    Attributes:
        argv: the command as an argv template (:mod:`trio_broker.core.argv`):
            elements may hold ``{name}`` placeholders filled from the job's
            ``params``; ``{{``/``}}`` are literal braces. A sequence of strings is
            parsed; a parsed :class:`~trio_broker.core.argv.ArgvTemplate` is taken
            as it is.
        builtin: instead of a command, ``"noop"`` (ends at once) or ``"sleep"``
            (holds the slot for ``params.seconds``). Exactly one of ``argv`` and
            ``builtin`` is set.
        threads: the resolved thread count, given to the command as
            ``FYLR_CONVERT_THREADS``.
        timeout: the wall-clock ceiling in seconds, ``None`` for none.
        stall_timeout: seconds without progress before the job is stalled,
            ``None`` for no stall supervision.
        memory_limit: this job's own RSS ceiling in bytes, ``None`` for none.
        env: environment variables for the command, over the runner's ``env``
            (see :func:`job_environment`).

    Raises:
        TemplateError: a malformed template (a ``ValueError``).
        ValueError: both or neither of ``argv``/``builtin``; a non-positive limit
            or thread count.
    """

    argv: ArgvTemplate | None = attrs.field(default=None, converter=_template)
    builtin: Literal["noop", "sleep"] | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.in_(("noop", "sleep")))
    )
    threads: int = attrs.field(default=1)
    timeout: float | None = attrs.field(default=None, validator=_positive_or_none)
    stall_timeout: float | None = attrs.field(default=600.0, validator=_positive_or_none)
    memory_limit: int | None = attrs.field(default=None, validator=_positive_or_none)
    env: Mapping[str, str] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        if (self.argv is None) == (self.builtin is None):
            raise ValueError("a CommandSpec needs exactly one of argv and builtin")
        if type(self.threads) is not int or self.threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {self.threads!r}")


# -- one job --------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class _Start:
    """When a job started, and the receipts that tell how it ended."""

    started: float
    """On the trio clock (monotonic)."""
    started_at: float
    """On the wall clock."""
    instance_id: str

    def ended(self, status: Status, error: str | None = None, **fields: Any) -> Receipt:
        """The receipt of an end now; ``fields`` as for :func:`ended_receipt`."""
        return ended_receipt(
            status,
            error,
            started_at=self.started_at,
            duration_s=trio.current_time() - self.started,
            instance_id=self.instance_id,
            **fields,
        )

    def error(self, reason: str) -> Receipt:
        """The receipt of a job that could not start."""
        return error_receipt(
            reason,
            started_at=self.started_at,
            duration_s=trio.current_time() - self.started,
            instance_id=self.instance_id,
        )


def _only_cancelled(group: BaseExceptionGroup[BaseException]) -> trio.Cancelled | None:
    """The first Cancelled of a group that holds nothing else, else ``None``."""
    cancelled, rest = group.split(trio.Cancelled)
    if cancelled is None or rest is not None:
        return None
    leaf: BaseException = cancelled
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    assert isinstance(leaf, trio.Cancelled)
    return leaf


@attrs.frozen(kw_only=True)
class _Limits:
    """What a job's supervision needs from its runner."""

    budget: MemoryBudget[int] | None
    """The memory all running jobs share, ``None`` for no budget."""
    sample_interval: float
    kill_grace: float


async def _wait_gone(pids: Iterable[int]) -> None:
    """Return once none of ``pids`` runs (zombies count as gone).

    Event-driven: a pidfd becomes readable when its process exits, even for a
    process that is not our child; where there are no pidfds, it looks again soon.
    """
    pidfds = [procgroup.open_pidfd(pid) for pid in pids]
    opened = [fd for fd in pidfds if fd is not None]
    try:
        async with trio.open_nursery() as nursery:
            for fd in opened:
                nursery.start_soon(trio.lowlevel.wait_readable, fd)
    finally:
        for fd in opened:
            trio.lowlevel.notify_closing(fd)
            os.close(fd)
    if len(opened) < len(pidfds):  # gone already, or no pidfds here: look again soon
        await trio.sleep(_GROUP_GONE_POLL)


class _Members:
    """Finds, samples and signals the processes of one job (blocking: call in a thread).

    With a cgroup, they are the cgroup's. Without, they are the leader's session
    and group, their descendants, the processes found so far (``known``) and, when
    ``thorough``, the processes with the job's tag (see :mod:`procgroup`).
    """

    def __init__(self, leader: int, tag: JobTag, cgroup: JobCgroup | None) -> None:
        self.leader = leader
        self.tag = tag
        self.cgroup = cgroup
        self.known: dict[int, int] = {}
        """pid → start time of every process found in the job so far (tree mode)."""

    def _tree(self, *, thorough: bool) -> tuple[dict[int, procgroup.ProcessInfo], set[int]]:
        table = procgroup.scan_processes()
        extra = procgroup.tagged(table, self.tag.__eq__) if thorough else {}
        members = procgroup.job_members(table, self.leader, known=self.known, extra=extra)
        self.known = {pid: table[pid].start for pid in members}
        return table, members

    def sample(self) -> procgroup.GroupSample:
        """Their memory and CPU time now."""
        if self.cgroup is None:
            return procgroup.sample_pids(*self._tree(thorough=False))
        pids = self.cgroup.pids()
        reading = procgroup.sample_pids(procgroup.read_pids(pids), pids)
        memory, cpu = self.cgroup.memory_bytes(), self.cgroup.cpu_seconds()
        return attrs.evolve(
            reading,
            rss=reading.rss if memory is None else memory,
            cpu_seconds=reading.cpu_seconds if cpu is None else cpu,
        )

    def live(self, *, thorough: bool) -> tuple[int, ...]:
        """The members that have not exited."""
        if self.cgroup is not None:
            pids = self.cgroup.pids()
            return procgroup.sample_pids(procgroup.read_pids(pids), pids).live_pids
        return procgroup.sample_pids(*self._tree(thorough=thorough)).live_pids

    def signal(self, sig: signal.Signals, *, thorough: bool = False) -> tuple[int, ...]:
        """Send ``sig`` to every live member; the ones it was sent to."""
        if sig == signal.SIGKILL and self.cgroup is not None:
            self.cgroup.kill()
        procgroup.signal_group(self.leader, sig)
        pids = self.live(thorough=thorough)
        procgroup.signal_pids(pids, sig)
        return pids


class _CommandJob:
    """The state of one command while it runs (one per :meth:`CommandRunner.run`)."""

    def __init__(
        self,
        *,
        job_id: str,
        key: int,
        spec: CommandSpec,
        child: Child,
        members: _Members,
        workdir: str,
        start: _Start,
        limits: _Limits,
        in_pipe: InPipe | None,
        out_pipe: OutPipe | None,
    ) -> None:
        self.job_id = job_id
        self.key = key
        self.child = child
        self.pgid = child.pid
        self.members = members
        self.workdir = workdir
        self.limits = limits
        self.finish_within = spec.stall_timeout or PIPE_FINISH_TIMEOUT
        self.stall_timeout = spec.stall_timeout
        self.watchdog = Watchdog(
            started=start.started,
            timeout=spec.timeout,
            stall_timeout=spec.stall_timeout,
            memory_limit=spec.memory_limit,
        )
        self.reaped = False
        self.rss: int | None = None
        self.stdout = StdoutReader(child.stdout)
        self.stderr_bytes = 0
        self.stderr_line = LastLine()
        self.stderr_done = trio.Event()
        self.in_pipe = in_pipe
        self.out_pipe = out_pipe
        self.fault = PipeFault()
        """The first pipe failure: it ends the job (once it runs) or spoils an ``ok`` receipt."""

    @property
    def stdin_bytes(self) -> int:
        return 0 if self.in_pipe is None else self.in_pipe.bytes

    async def run(self, control: JobControl) -> tuple[Status, str | None]:
        """Pump the pipes and supervise until the command ends; kill the group.

        Returns:
            The command's status and error before the pipes' say
            (see :meth:`receipt`).
        """
        async with trio.open_nursery() as nursery:
            if self.in_pipe is not None:
                assert self.child.stdin is not None
                nursery.start_soon(self.in_pipe.pump, self.child.stdin, self.fault)
            nursery.start_soon(pump_stdout, self.stdout, self.out_pipe, self.fault)
            nursery.start_soon(self.pump_stderr)
            ending = await self.supervise(control)
            if ending is not None:
                await self.terminate(self.limits.kill_grace)
            await self.kill_and_reap()
            await self.wait_output_end()
            status, error = command_end(ending, self.exit_code)
            if self.out_pipe is not None:
                await self.out_pipe.finish(
                    self.stdout, self.fault, status == "ok", self.finish_within
                )
            nursery.cancel_scope.cancel()
        return status, error

    @property
    def exit_code(self) -> int:
        """The leader's exit status (negative: the signal); once it is reaped."""
        code = self.child.returncode
        assert code is not None
        return code

    async def pump_stderr(self) -> None:
        try:
            while chunk := await self.child.stderr.receive_some(_READ_CHUNK):
                self.stderr_bytes += len(chunk)
                self.stderr_line.feed(chunk)
        finally:
            self.stderr_done.set()

    async def wait_output_end(self) -> None:
        """Wait (bounded) for stderr and stdout to reach their ends once the group is dead."""
        with trio.move_on_after(_STDERR_DRAIN_TIMEOUT):
            await self.stderr_done.wait()
        await wait_stdout_end(self.stdout, self.out_pipe, self.finish_within)

    # -- supervision

    async def sample(self) -> Verdict | None:
        """Sample the group and its work dir once; the verdict if the job must end."""
        reading, dir_bytes = await trio.to_thread.run_sync(self._read, abandon_on_cancel=True)
        verdict = self.watchdog.sample(
            trio.current_time(),
            rss=reading.rss,
            cpu_seconds=reading.cpu_seconds,
            io_bytes=self.stdin_bytes + self.stdout.bytes + self.stderr_bytes,
            dir_bytes=dir_bytes,
        )
        self.rss = reading.rss
        budget = self.limits.budget
        if budget is not None:
            budget.report(self.key, reading.rss)
            if verdict is None and budget.over_budget() == self.key:
                verdict = budget_verdict(rss=reading.rss, used=budget.used(), total=budget.total)
        return verdict

    def _read(self) -> tuple[procgroup.GroupSample, int]:
        return self.members.sample(), procgroup.directory_bytes(self.workdir)

    async def supervise(self, control: JobControl) -> Ending | None:
        """Wait for the first of: the leader exits (``None``), a verdict, an abort, a pipe fault."""
        verdict = await self.sample()  # at least one sample: peak_memory is known
        if verdict is not None:
            return self.ending(verdict)
        endings: list[Ending | None] = []

        def decide(ending: Ending | None) -> None:
            if not endings:
                endings.append(ending)
                nursery.cancel_scope.cancel()

        async def leader_exited() -> None:
            await self.wait_leader_exited()
            decide(None)

        async def aborted() -> None:
            await control.wait_aborted()
            assert control.status is not None
            assert control.reason is not None
            decide(abort_ending(control.status, control.reason))

        async def pipe_failed() -> None:
            decide(pipe_ending(await self.fault.wait()))

        async def sampler() -> None:
            interval = self.limits.sample_interval
            while True:
                deadline = trio.current_time() + interval
                limit = self.watchdog.next_deadline()
                await trio.sleep_until(deadline if limit is None else min(deadline, limit))
                verdict = await self.sample()
                if verdict is not None:
                    decide(self.ending(verdict))
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(leader_exited)
            nursery.start_soon(aborted)
            nursery.start_soon(pipe_failed)
            nursery.start_soon(sampler)
        return endings[0]

    def ending(self, verdict: Verdict) -> Ending:
        """The job's end for a verdict, with what its pipes wait for now (the core decides)."""
        return verdict_ending(
            verdict,
            waits=pipe_waits(self.in_pipe, self.out_pipe),
            now=trio.current_time(),
            window=self.stall_timeout,
        )

    # -- ending

    async def wait_leader_exited(self) -> None:
        """Return once the leader has exited (a zombie: it is reaped by :meth:`kill_and_reap`)."""
        if not self.reaped:
            await self.child.wait_exited()

    async def terminate(self, grace: float) -> None:
        """SIGTERM to the job's processes, then up to ``grace`` seconds for the leader to exit."""
        await trio.to_thread.run_sync(self.members.signal, signal.SIGTERM)
        with trio.move_on_after(grace):
            await self.wait_leader_exited()

    async def kill_and_reap(self) -> None:
        """SIGKILL to every process of the job, reap the leader, wait (bounded) until none runs.

        Kill, wait, look again: a process forked while the first look ran is
        found by the next one (a killed process cannot fork any more).
        """
        kill = partial(self.members.signal, signal.SIGKILL, thorough=True)
        pids = await trio.to_thread.run_sync(kill)
        await self.child.wait()
        self.reaped = True
        with trio.move_on_after(_GROUP_GONE_TIMEOUT) as scope:
            for _ in range(_KILL_ROUNDS):
                await _wait_gone(pids)
                pids = await trio.to_thread.run_sync(kill)
                if not pids:
                    break
        if scope.cancelled_caught or pids:
            logger.warning(
                "job %s: processes %s survived SIGKILL for %ss",
                self.job_id,
                list(pids),
                _GROUP_GONE_TIMEOUT,
            )

    async def close(self) -> None:
        """Release everything; after a cancellation, first kill the job (shielded)."""
        with trio.CancelScope(shield=True), trio.move_on_after(_CLEANUP_TIMEOUT):
            if not self.reaped:
                await self.kill_and_reap()
            if self.members.cgroup is not None:
                await trio.to_thread.run_sync(self.members.cgroup.remove)
        if not self.reaped:
            logger.warning("job %s: leader %d not reaped", self.job_id, self.pgid)
        self.child.close()
        for stream in (self.child.stdin, self.child.stdout, self.child.stderr):
            if stream is not None:
                with trio.CancelScope(shield=True):
                    await stream.aclose()
        if self.limits.budget is not None:
            self.limits.budget.forget(self.key)

    # -- the receipt

    def receipt(self, start: _Start, status: Status, error: str | None) -> Receipt:
        """The receipt: the command's end, as the pipes amend it (the core decides)."""
        out_pipe = self.out_pipe
        aborted = out_pipe is not None and out_pipe.aborted
        status, error = receipt_end(
            status,
            error,
            pipe_fault=self.fault.error,
            output_aborted_after=out_pipe.sent if out_pipe is not None and aborted else None,
        )
        return start.ended(
            status,
            error,
            exit_code=self.exit_code,
            stderr_line=self.stderr_line.result(),
            stdout_prefix=self.stdout.prefix(),
            stdout_bytes=self.stdout.bytes,
            stdin_bytes=self.stdin_bytes,
            peak_memory=self.watchdog.peak_memory,
        )


def _widen_pipes(child: Child) -> None:
    """Ask for larger kernel buffers on a bulk job's pipes; keep the default if refused."""
    set_size = getattr(fcntl, "F_SETPIPE_SZ", None)
    if set_size is None:  # not Linux
        return
    for stream in (child.stdin, child.stdout):
        fileno = getattr(stream, "fileno", None)
        if fileno is not None:
            with contextlib.suppress(OSError):
                fcntl.fcntl(fileno(), set_size, _BULK_PIPE_BYTES)


async def _run_builtin(
    builtin: Literal["noop", "sleep"],
    params: Mapping[str, Any],
    control: JobControl,
    start: _Start,
) -> Receipt:
    if builtin == "noop":
        return start.ended("ok")
    if "seconds" not in params:
        return start.error("missing parameter 'seconds'")
    seconds = params["seconds"]
    if (
        not isinstance(seconds, int | float)
        or isinstance(seconds, bool)
        or not math.isfinite(seconds)
        or seconds < 0
    ):
        return start.error("parameter 'seconds' must be a non-negative number")
    with trio.move_on_after(seconds):
        await control.wait_aborted()
    if control.status is not None:
        return start.ended(control.status, control.reason)
    return start.ended("ok")


# -- the runner -----------------------------------------------------------------------


@attrs.define(kw_only=True, eq=False)
class _Entry:
    """A job in :meth:`CommandRunner.statistics`, from the start of ``run`` to its end."""

    request: JobRequest
    key: int
    started_at: float
    job: _CommandJob | None = None
    """Set once the command's process exists."""

    def snapshot(self) -> RunningJob:
        job = self.job
        return RunningJob(
            job_id=self.request.job_id,
            service=self.request.service,
            started_at=self.started_at,
            pid=None if job is None else job.pgid,
            pgid=None if job is None else job.pgid,
            rss=None if job is None else job.rss,
            peak_memory=None if job is None else job.watchdog.peak_memory,
        )


def _child_setup(cgroup_fd: int | None, user: JobUser | None, parent: int) -> Callable[[], None]:
    """What a job's child does between fork and exec (in this order, see the module docstring).

    Enter the job's cgroup (while it may: before it changes user), become the job
    user, drop any ambient capabilities (the job gets none), then ask for SIGKILL
    when the parent thread ends (after the change of user, which would clear it),
    and make sure the parent has not died meanwhile.
    It takes no lock and imports nothing (a forked child of a threaded process).
    """

    def setup() -> None:
        if cgroup_fd is not None:
            os.write(cgroup_fd, b"0")
        if user is not None:
            user.switch()
        with contextlib.suppress(OSError):  # kernels before 4.3 have no ambient set
            procgroup.clear_ambient_capabilities()
        procgroup.set_parent_death_signal(signal.SIGKILL)
        if os.getppid() != parent:
            raise RuntimeError("the runner's process ended")

    return setup


class CommandRunner:
    """The reference runner: each service is a supervised command (or a builtin).

    Args:
        services: how each service runs, by name.
        env: environment variables for every command (under each service's own).
            A command's environment is :data:`INHERITED_ENV`, this, its service's
            ``env`` and :data:`SUPERVISED_ENV`: never the runner's whole environment.
        temp_dir: where the per-job work directories are made (default: the
            system's temporary directory).
        memory_budget: bytes that all running jobs together may use; when they
            exceed it, the job with the largest RSS ends ``out_of_memory``.
        instance_id: copied into every receipt.
        sample_interval: seconds between samples of a running job.
        kill_grace: seconds between SIGTERM and SIGKILL when the runner ends a job.
        job_user: the user commands run as; ``None``: the runner's own. Another
            user's job gets the work folder, and as ``HOME`` its home folder (or
            the work folder when it has none).
        containment: what the runner's process set up for its jobs
            (:func:`~trio_broker.trio.containment.serve_containment`): with a
            delegated cgroup, each job runs in a cgroup of its own. ``None``: the
            jobs are found by their process tree and tag.

    Raises:
        ValueError: a non-positive ``sample_interval`` or a negative ``kill_grace``.
        JobUserError: this process cannot run jobs as ``job_user`` (a ``ValueError``).
    """

    def __init__(
        self,
        services: Mapping[str, CommandSpec],
        *,
        env: Mapping[str, str] = {},
        temp_dir: str | None = None,
        memory_budget: int | None = None,
        instance_id: str = "",
        sample_interval: float = 1.0,
        kill_grace: float = 2.0,
        job_user: JobUser | None = None,
        containment: Containment | None = None,
    ) -> None:
        if not (math.isfinite(sample_interval) and sample_interval > 0):
            raise ValueError(f"sample_interval must be positive, got {sample_interval!r}")
        if not (math.isfinite(kill_grace) and kill_grace >= 0):
            raise ValueError(f"kill_grace must be non-negative, got {kill_grace!r}")
        if job_user is not None:
            problem = job_user.switch_problem()
            if problem is not None:
                raise JobUserError(problem)
        self._services = dict(services)
        self._env = dict(env)
        self._temp_dir = temp_dir
        self._limits = _Limits(
            budget=None if memory_budget is None else MemoryBudget(memory_budget),
            sample_interval=sample_interval,
            kill_grace=kill_grace,
        )
        self._instance_id = instance_id
        self._job_user = job_user or JobUser.current()
        self._switch = None if self._job_user.is_current else self._job_user
        self._containment = containment
        self._tag = JobTag.of_this_process(secrets.token_hex(4))
        self._keys = itertools.count()
        self._running: dict[int, _Entry] = {}
        self._connector = PipeConnector()
        for where, mapping in [("runner env", self._env)] + [
            (f"service {name!r} env", spec.env) for name, spec in self._services.items()
        ]:
            overridden = sorted(set(mapping) & set(SUPERVISED_ENV))
            if overridden:
                logger.warning(
                    "%s sets %s, which the runner always sets itself; ignored",
                    where,
                    ", ".join(overridden),
                )

    def containment(self) -> ContainmentInfo:
        """How the runner contains its jobs (the inspection page shows it)."""
        containment = self._containment or Containment(
            cgroup=None, reason="no containment was set up for this runner"
        )
        delegation = containment.cgroup
        memory_ok = delegation is not None and delegation.memory
        return ContainmentInfo(
            mode=containment.mode,
            cgroup=None if delegation is None else str(delegation.instance),
            memory="cgroup" if memory_ok else "processes",
            reason=containment.reason if delegation is None else delegation.note,
            subreaper=containment.subreaper,
            dumpable=containment.dumpable,
            keeper_pid=containment.keeper_pid,
            job_user=self._job_user.name,
        )

    def statistics(self) -> RunnerStatistics:
        """A snapshot of the running jobs and the memory they use."""
        running = tuple(entry.snapshot() for entry in self._running.values())
        budget = self._limits.budget
        return RunnerStatistics(
            running=running,
            memory_used=sum(job.rss or 0 for job in running),
            memory_budget=None if budget is None else budget.total,
            containment=self.containment(),
        )

    async def run(self, request: JobRequest, control: JobControl) -> Receipt:
        """Run one job to its end and describe how it ended (see :class:`Runner`)."""
        start = _Start(
            started=trio.current_time(), started_at=time.time(), instance_id=self._instance_id
        )
        spec = self._services.get(request.service)
        if spec is None:
            return start.error(f"unknown service {request.service!r}")
        entry = _Entry(request=request, key=next(self._keys), started_at=start.started_at)
        self._running[entry.key] = entry
        try:
            return await self._run_job(entry, spec, control, start)
        finally:
            del self._running[entry.key]

    async def _run_job(
        self, entry: _Entry, spec: CommandSpec, control: JobControl, start: _Start
    ) -> Receipt:
        if control.status is not None:
            return start.ended(control.status, control.reason)
        try:
            job = JobSpec.from_wire(entry.request.job)
        except JobSpecError as exc:
            return start.error(str(exc))
        if spec.builtin is not None:
            return await _run_builtin(spec.builtin, job.params, control, start)
        assert spec.argv is not None
        try:
            argv = spec.argv.fill(job.params)
            urls = PipeUrls.of(job)
        except (ParameterError, JobSpecError) as exc:
            return start.error(str(exc))
        user = self._switch
        try:
            workdir = WorkDir.create(
                self._temp_dir, owner=None if user is None else (user.uid, user.gid)
            )
        except OSError as exc:
            return start.error(f"cannot create a work directory: {exc}")
        # the job's own limits take precedence over the service's ("0": none)
        spec = attrs.evolve(
            spec,
            timeout=job.effective_timeout(spec.timeout),
            stall_timeout=job.effective_stall_timeout(spec.stall_timeout),
        )
        try:
            return await self._run_command(entry, spec, argv, workdir.path, control, start, urls)
        except BaseExceptionGroup as group:
            # Our nurseries wrap the cancellation of the calling task in groups of
            # Cancelled; callers expect the plain Cancelled that trio.run_process raises.
            cancelled = _only_cancelled(group)
            if cancelled is None:
                raise
            raise cancelled from None
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(_CLEANUP_TIMEOUT):
                await trio.to_thread.run_sync(workdir.remove, abandon_on_cancel=True)

    def _environment(self, spec: CommandSpec, workdir: str, tag: JobTag) -> dict[str, str]:
        """A job's environment: never the daemon's own (see :data:`INHERITED_ENV`)."""
        inherit: Mapping[str, str] = os.environ
        if self._switch is not None:  # another user: its own home, or the work folder
            inherit = {**os.environ, "HOME": self._switch.home or workdir}
        result = job_environment(spec, self._env, inherit=inherit)
        result[TAG_ENV] = str(tag)
        return result

    def _job_cgroup(self, name: str) -> JobCgroup | None:
        delegation = None if self._containment is None else self._containment.cgroup
        if delegation is None:
            return None
        try:
            return delegation.job(name)
        except OSError as exc:
            logger.warning("cannot make the cgroup of job %s, found by its tree: %s", name, exc)
            return None

    async def _start(
        self,
        argv: tuple[str, ...],
        env: dict[str, str],
        workdir: str,
        *,
        stdin: bool,
        cgroup: JobCgroup | None,
    ) -> Child | str:
        """Start the leader; the child, or why it could not start."""
        cgroup_fd = None if cgroup is None else cgroup.open_procs()
        try:
            return await spawn(
                argv,
                cwd=workdir,
                env=env,
                stdin=stdin,
                setup=_child_setup(cgroup_fd, self._switch, os.getpid()),
            )
        except OSError as exc:
            return f"cannot run {argv[0]!r}: {exc.strerror or exc}"
        except ValueError as exc:  # e.g. a NUL in the configured env
            return f"cannot run {argv[0]!r}: {exc}"
        except subprocess.SubprocessError:
            return (
                f"cannot run {argv[0]!r}: the job's process could not enter its cgroup,"
                f" become {self._job_user.name!r} or ask for its parent-death signal"
            )
        finally:
            if cgroup_fd is not None:
                os.close(cgroup_fd)

    async def _run_command(
        self,
        entry: _Entry,
        spec: CommandSpec,
        argv: tuple[str, ...],
        workdir: str,
        control: JobControl,
        start: _Start,
        urls: PipeUrls,
    ) -> Receipt:
        tag = attrs.evolve(self._tag, job=f"{self._tag.job}-{entry.key}")
        async with contextlib.AsyncExitStack() as stack:
            try:
                in_pipe, out_pipe = await open_pipes(stack, self._connector, urls)
            except PipeUnreachable as exc:  # the network's fault, not the input's
                return start.ended("stopped", str(exc))
            cgroup = self._job_cgroup(tag.job)
            child = await self._start(
                argv,
                self._environment(spec, workdir, tag),
                workdir,
                stdin=in_pipe is not None,
                cgroup=cgroup,
            )
            if isinstance(child, str):
                if cgroup is not None:
                    await trio.to_thread.run_sync(cgroup.remove)
                return start.error(child)
            if urls.any:
                _widen_pipes(child)
            job = entry.job = _CommandJob(
                job_id=entry.request.job_id,
                key=entry.key,
                spec=spec,
                child=child,
                members=_Members(child.pid, tag, cgroup),
                workdir=workdir,
                start=start,
                limits=self._limits,
                in_pipe=in_pipe,
                out_pipe=out_pipe,
            )
            job.stdout.tap = entry.request.stdout_tap  # the produce cache's copy, if any
            try:
                status, error = await job.run(control)
            finally:
                await job.close()
                if self._containment is not None and self._containment.subreaper:
                    with trio.CancelScope(shield=True):  # the job's orphans were ours
                        await trio.to_thread.run_sync(reap_adopted)
        return job.receipt(start, status, error)
