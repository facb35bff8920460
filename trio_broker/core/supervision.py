"""The supervision rules of a running job: pure decisions, no trio, no clock, no I/O.

The runner samples a job's processes every second or so and feeds the numbers
to a :class:`Watchdog`; the watchdog answers with a :class:`Verdict` when the job
must end, or ``None``. A :class:`MemoryBudget` shared by every running job says
which job to end when all of them together use more memory than the host allows.
When the job has ended, the functions of *How a job ends* turn what the runner
observed (the first of: its leader exited, a verdict, an abort, a pipe failure;
its exit status; what its pipes did) into the receipt's status and error, so the
runner only observes and reports. Time is an argument everywhere, so tests drive
these objects with plain numbers.

Theory of operation
-------------------

**Where the numbers come from** is the runner's business, not this module's: a
job's memory is the resident memory of its processes, or, where the job runs in
a cgroup of its own with the memory controller, that cgroup's counters (see
:mod:`trio_broker.trio.cgroup`); its CPU time likewise. The rules below take
whatever the runner measured as ``rss`` and ``cpu_seconds``.

**Progress.** A job makes progress between two consecutive samples when any of
these holds:

* ``io_bytes`` grew: bytes moved on the job's pipes (stdout, stderr, stdin);
* ``dir_bytes`` grew: the files of its work directory got bigger (a converter
  writing its output file without printing anything);
* its processes used at least ``cpu_share`` of one core since the previous
  sample: ``delta cpu_seconds >= cpu_share * delta time`` (and more than zero, so
  two samples at the same instant prove nothing).

A decrease is never progress: it is treated as no change (CPU time of a process
that exits and is not reaped inside the group leaves the sum; files get deleted).
The first sample compares against an empty job at ``started`` (no CPU, no bytes).

**Verdicts.** At each sample, in this order, the first rule that holds wins:

1. ``timed_out``: ``now >= started + timeout`` (the wall-clock ceiling).
2. ``stalled``: ``now >= last_progress + stall_timeout``, where ``last_progress``
   is the time of the latest sample that showed progress (``started`` before any).
3. ``out_of_memory``: the sampled memory of the job (``rss``) exceeds ``memory_limit``.

Why this order: the deadline-based verdicts were already true at an earlier
instant (the deadline), while a memory excess is only known at the sample that
shows it, so the verdict that held first is the one reported. Between the two
deadlines, the wall-clock ceiling is the client's own, exact, configured limit,
whereas a stall is a heuristic reading of the samples: when both hold, the exact
one explains the ending better ("give it a longer timeout"). The shared budget
(:class:`MemoryBudget`) is consulted by the runner only when the job's own
watchdog has no verdict: a job's own limits explain its ending better than the
behaviour of its neighbours.

A verdict is final: later samples return the same verdict. Deadlines compare
with the same sums that :meth:`Watchdog.next_deadline` returns, so a caller that
sleeps until the next deadline and samples then always gets the verdict (no
spinning on float rounding).

How a job ends
--------------

The runner ends a job early for the first of four reasons, an :class:`Ending`
each: a verdict (:func:`verdict_ending`), the memory budget
(:func:`budget_verdict`, then :func:`verdict_ending`), an abort of the execserver
(``stopped`` while draining, ``cancelled`` by the client: :func:`abort_ending`), or a
pipe that failed (:func:`pipe_ending`: ``stopped``, the stream's failure is no
verdict on the command). Otherwise its leader exits on its own. Then:

1. **A stall that was the network's.** A job that made no progress for its whole
   stall window while one of its pipes waited on the network that long (the
   in-pipe for the body's next bytes, the out-pipe for a chunk to be taken,
   :class:`PipeWait`) was held up by that stream: its ending is ``stopped``
   naming the stream, not ``stalled`` (run it again; the command was not at
   fault). The bytes a pipe last moved counted as progress, so the job's last
   progress came no earlier than the wait began.
2. **The command's end** (:func:`command_end`): an ending wins; else exit status
   0 is ``ok``, a positive one ``failed`` (``exit status N``), a signal
   ``failed`` (``killed by signal N``).
3. **What the pipes say** (:func:`receipt_end`): an ``ok`` command whose pipe
   failed is ``stopped`` with the pipe's sentence (its output or input is not
   whole); an output stream aborted in mid-transfer is named in the error.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from typing import Generic, Literal, TypeAlias, TypeVar

import attrs

from trio_broker.core.protocol import Status

__all__ = [
    "Ending",
    "MemoryBudget",
    "PipeWait",
    "Verdict",
    "VerdictStatus",
    "Watchdog",
    "abort_ending",
    "budget_verdict",
    "command_end",
    "format_bytes",
    "format_duration",
    "pipe_ending",
    "receipt_end",
    "verdict_ending",
]

VerdictStatus: TypeAlias = Literal["timed_out", "stalled", "out_of_memory"]
"""The receipt statuses a watchdog can decide."""


@attrs.frozen(kw_only=True)
class Verdict:
    """Why a job must end now: its receipt status and error sentence."""

    status: VerdictStatus
    error: str


# -- human-readable numbers -------------------------------------------------------


def format_duration(seconds: float) -> str:
    """A duration as in the configuration files: ``"0.5s"``, ``"2s"``, ``"10m"``, ``"1h30m"``.

    Under a minute, fractions of a second are kept (two decimals at most);
    from a minute on, whole seconds only.

    Raises:
        ValueError: ``seconds`` is negative or not finite.
    """
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"a duration must be a finite, non-negative number, got {seconds!r}")
    if seconds < 59.995:
        text = f"{seconds:.2f}".rstrip("0").rstrip(".")
        if text == "0" and seconds > 0:
            return f"{seconds * 1000:.2g}ms"
        return f"{text}s"
    hours, rest = divmod(round(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    parts = ((hours, "h"), (minutes, "m"), (secs, "s"))
    return "".join(f"{value}{unit}" for value, unit in parts if value)


_BYTE_UNITS = ("B", "kB", "MB", "GB", "TB", "PB", "EB")


def format_bytes(count: int) -> str:
    """A byte count in decimal units: ``"512 B"``, ``"1.2 GB"``, ``"310 MB"``.

    One decimal below 10 of a unit, whole units above (1 MB = 1,000,000 bytes).

    Raises:
        ValueError: ``count`` is negative.
    """
    if count < 0:
        raise ValueError(f"a byte count must be non-negative, got {count}")
    if count < 1000:
        return f"{count} B"
    for power, unit in enumerate(_BYTE_UNITS[1:], start=1):
        scaled = count / 1000**power
        if scaled < 999.5 or power == len(_BYTE_UNITS) - 1:
            return f"{scaled:.1f} {unit}" if scaled < 9.95 else f"{scaled:.0f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover


def budget_verdict(*, rss: int, used: int, total: int) -> Verdict:
    """The verdict for the job a :class:`MemoryBudget` chose to end.

    Args:
        rss: the chosen job's sampled group RSS.
        used: what all jobs together use (:meth:`MemoryBudget.used`).
        total: the budget.
    """
    return Verdict(
        status="out_of_memory",
        error=(
            f"out of memory: {format_bytes(used)} in use exceeds the shared budget of "
            f"{format_bytes(total)}, and this job holds the most ({format_bytes(rss)})"
        ),
    )


# -- the watchdog -----------------------------------------------------------------


def _check_limit(name: str, value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number or None, got {value!r}")


class Watchdog:
    """Decides from samples whether a job timed out, stalled or ran out of memory.

    See the module docstring for the rules and their order.

    Args:
        started: when the job started, on the caller's monotonic clock.
        timeout: the wall-clock ceiling in seconds, or ``None`` for none.
        stall_timeout: how long without progress makes a job stalled, or ``None``
            for no stall supervision.
        memory_limit: the job's own RSS ceiling in bytes, or ``None``.
        cpu_share: the share of one core that counts as progress.

    Raises:
        ValueError: a limit is zero, negative or not finite; ``cpu_share`` is
            outside ``(0, 1]``.
    """

    def __init__(
        self,
        *,
        started: float,
        timeout: float | None,
        stall_timeout: float | None,
        memory_limit: int | None,
        cpu_share: float = 0.05,
    ) -> None:
        _check_limit("timeout", timeout)
        _check_limit("stall_timeout", stall_timeout)
        _check_limit("memory_limit", memory_limit)
        if not 0 < cpu_share <= 1:
            raise ValueError(f"cpu_share must be in (0, 1], got {cpu_share!r}")
        self._started = started
        self._timeout = timeout
        self._stall_timeout = stall_timeout
        self._memory_limit = memory_limit
        self._cpu_share = cpu_share
        self._last_progress = started
        self._previous_time = started
        self._previous_cpu = 0.0
        self._previous_io = 0
        self._previous_dir = 0
        self._peak: int | None = None
        self._verdict: Verdict | None = None

    @property
    def peak_memory(self) -> int | None:
        """The highest RSS sampled so far, ``None`` before the first sample."""
        return self._peak

    @property
    def last_progress(self) -> float:
        """The time of the latest sample that showed progress (``started`` before any)."""
        return self._last_progress

    @property
    def verdict(self) -> Verdict | None:
        """The verdict once given, else ``None``."""
        return self._verdict

    def next_deadline(self) -> float | None:
        """The earliest time at which a sample could give a time-based verdict.

        ``None`` when there is no time limit or a verdict was already given.
        Sample at (or after) this time; sampling more often only matters for
        memory and progress.
        """
        if self._verdict is not None:
            return None
        deadlines = []
        if self._timeout is not None:
            deadlines.append(self._started + self._timeout)
        if self._stall_timeout is not None:
            deadlines.append(self._last_progress + self._stall_timeout)
        return min(deadlines, default=None)

    def sample(
        self, now: float, *, rss: int, cpu_seconds: float, io_bytes: int, dir_bytes: int
    ) -> Verdict | None:
        """Feed one sample of the job; returns the verdict if the job must end.

        Args:
            now: the sample's time, never earlier than the previous one.
            rss: the job's memory in bytes: its processes' resident memory, or
                its cgroup's counters.
            cpu_seconds: the job's total CPU time (user + system) so far.
            io_bytes: bytes moved on the job's pipes so far.
            dir_bytes: the total size of the files in the job's work directory.

        Returns:
            ``None`` while the job may go on; otherwise the :class:`Verdict`
            (the same one for every later sample).

        Raises:
            ValueError: ``now`` is earlier than the previous sample or the start.
        """
        if now < self._previous_time:
            raise ValueError(f"time went backwards: {now!r} < {self._previous_time!r}")
        if self._peak is None or rss > self._peak:
            self._peak = rss
        if self._verdict is not None:
            return self._verdict
        elapsed = now - self._previous_time
        cpu_used = cpu_seconds - self._previous_cpu
        progress = (
            io_bytes > self._previous_io
            or dir_bytes > self._previous_dir
            or (cpu_used > 0 and cpu_used >= self._cpu_share * elapsed)
        )
        if progress:
            self._last_progress = now
        self._previous_time = now
        self._previous_cpu = cpu_seconds
        self._previous_io = io_bytes
        self._previous_dir = dir_bytes
        self._verdict = self._decide(now, rss)
        return self._verdict

    def _decide(self, now: float, rss: int) -> Verdict | None:
        if self._timeout is not None and now >= self._started + self._timeout:
            return Verdict(
                status="timed_out", error=f"timed out after {format_duration(self._timeout)}"
            )
        if self._stall_timeout is not None and now >= self._last_progress + self._stall_timeout:
            return Verdict(
                status="stalled",
                error=f"stalled: no progress for {format_duration(self._stall_timeout)}",
            )
        if self._memory_limit is not None and rss > self._memory_limit:
            return Verdict(
                status="out_of_memory",
                error=(
                    f"out of memory: {format_bytes(rss)} exceeds the job's ceiling of "
                    f"{format_bytes(self._memory_limit)}"
                ),
            )
        return None


# -- the shared memory budget -------------------------------------------------------

K = TypeVar("K", bound=Hashable)


class MemoryBudget(Generic[K]):
    """The memory every running job shares; names the job to end when they overrun it.

    Each job reports its latest sampled RSS under its own key and is forgotten
    when it ends. When the sum exceeds the total, the job with the largest RSS is
    the one to end (on a tie, the one reported first): ending it frees the most.

    Args:
        total: the budget in bytes.

    Raises:
        ValueError: ``total`` is not positive.
    """

    def __init__(self, total: int) -> None:
        if total <= 0:
            raise ValueError(f"a memory budget must be positive, got {total}")
        self._total = total
        self._rss: dict[K, int] = {}
        self._used = 0

    @property
    def total(self) -> int:
        """The budget in bytes."""
        return self._total

    def report(self, key: K, rss: int) -> None:
        """Record a job's latest RSS (replacing its previous report).

        Raises:
            ValueError: ``rss`` is negative.
        """
        if rss < 0:
            raise ValueError(f"rss must be non-negative, got {rss}")
        self._used += rss - self._rss.get(key, 0)
        self._rss[key] = rss

    def forget(self, key: K) -> None:
        """Drop an ended job; unknown keys are ignored."""
        self._used -= self._rss.pop(key, 0)

    def rss(self, key: K) -> int | None:
        """The RSS last reported for ``key``, ``None`` if it is not known."""
        return self._rss.get(key)

    def used(self) -> int:
        """The sum of every job's latest report."""
        return self._used

    def over_budget(self) -> K | None:
        """The job to end when the reports exceed the total, else ``None``."""
        if self._used <= self._total:
            return None
        return max(self._rss, key=self._rss.__getitem__)


# -- how a job ends -----------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Ending:
    """Why the runner ended a job before its leader exited: the receipt's status and error."""

    status: Status
    error: str


@attrs.frozen(kw_only=True)
class PipeWait:
    """One of a job's pipes waiting on the network, as the runner observed it.

    Attributes:
        stream: ``input`` (the in-pipe waits for the body's next bytes) or
            ``output`` (the out-pipe waits for a chunk to be taken).
        where: the pipe's URL, for the sentence.
        since: when the wait began (the runner's monotonic clock).
        moved: the bytes the pipe had moved by then.
    """

    stream: Literal["input", "output"]
    where: str
    since: float
    moved: int

    def sentence(self, silent: float) -> str:
        """The receipt's error for a job this wait held up for ``silent`` seconds."""
        if self.stream == "input":
            return (
                f"the input stream from {self.where} moved no bytes for {silent:.1f}s "
                f"after {self.moved} bytes: the network or the client went silent"
            )
        return (
            f"the output stream to {self.where} took no bytes for {silent:.1f}s after "
            f"{self.moved} bytes: the network or the client went silent"
        )


def verdict_ending(
    verdict: Verdict,
    *,
    waits: Iterable[PipeWait] = (),
    now: float = 0.0,
    window: float | None = None,
) -> Ending:
    """The ending of a job for a verdict (rule 1 of *How a job ends*).

    Args:
        verdict: the watchdog's (or the memory budget's) verdict.
        waits: the job's pipes that wait on the network now (the input first).
        now: the time of the verdict.
        window: the job's stall window (``None``: no stall supervision).

    Returns:
        ``stopped`` naming the stream, for a stall while a pipe waited at least
        the whole window; else the verdict's own status and error.
    """
    if verdict.status == "stalled" and window is not None:
        for wait in waits:
            silent = now - wait.since
            if silent >= window:
                return Ending(status="stopped", error=wait.sentence(silent))
    return Ending(status=verdict.status, error=verdict.error)


def abort_ending(status: Status, reason: str) -> Ending:
    """The ending of a job the execserver aborted (``stopped`` draining, ``cancelled``)."""
    return Ending(status=status, error=reason)


def pipe_ending(error: str) -> Ending:
    """The ending of a job whose pipe failed: ``stopped`` (the stream's failure, not the
    command's), with the pipe's sentence."""
    return Ending(status="stopped", error=error)


def command_end(ending: Ending | None, exit_code: int) -> tuple[Status, str | None]:
    """A command's status and error from its ending (if any) and its leader's exit status.

    Args:
        ending: why the runner ended it, ``None`` when its leader exited on its own.
        exit_code: the leader's exit status (negative: minus the signal number).

    Returns:
        The ending's; else ``ok`` for 0, ``failed`` with ``exit status N`` or
        ``killed by signal N``.
    """
    if ending is not None:
        return ending.status, ending.error
    if exit_code == 0:
        return "ok", None
    if exit_code > 0:
        return "failed", f"exit status {exit_code}"
    return "failed", f"killed by signal {-exit_code}"


def receipt_end(
    status: Status,
    error: str | None,
    *,
    pipe_fault: str | None,
    output_aborted_after: int | None,
) -> tuple[Status, str | None]:
    """The receipt's status and error: the command's end as its pipes amend it.

    Args:
        status, error: the command's end (:func:`command_end`).
        pipe_fault: the first pipe failure's sentence, ``None`` when none failed.
        output_aborted_after: the bytes the out-pipe had sent when its transfer
            was aborted, ``None`` when it was not.

    Returns:
        ``stopped`` with the pipe's sentence for an ``ok`` command whose pipe
        failed; otherwise the command's end, its error naming an aborted output
        stream.
    """
    if output_aborted_after is not None:
        error = f"{error}; the output stream was aborted after {output_aborted_after} bytes"
    if status == "ok" and pipe_fault is not None:
        return "stopped", pipe_fault
    return status, error
