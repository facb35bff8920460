"""The client core's jobs in flight: one record per job, and the table that indexes them.

:class:`~trio_broker.core.client.ClientCore` keeps every job it was given, from
:meth:`~trio_broker.core.client.ClientCore.submit` to its end, in a
:class:`JobTable`. A job is *waiting* (for a slot: submitted, or its ``JOB`` was
refused) or *accepted* (its ``JOB`` went out on one connection, where it holds a
slot); at its end the table forgets it and its state is *ended*. The table owns
those three moves (:meth:`~JobTable.wait`, :meth:`~JobTable.accept`,
:meth:`~JobTable.forget`); the core owns everything that touches connections,
frames and timers.

Cost. Every move and every question the core asks on an input is O(1) or
amortised O(1) in the jobs in flight: waiting jobs are indexed by service (a new
connection gets the ``WANT`` of each waiting job of its services, and nothing
else is looked at), queued in the order they started waiting (the oldest one
decides when the pool grows; entries of jobs that stopped waiting are dropped
when they reach the front), and counted. The jobs that *probe* (no ready
connection offers their service, and they wait for growth to find one) are a
subset kept apart, so the core can settle them without scanning the rest.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterator
from typing import Any, Literal

from trio_broker.core.client_values import ConnId

JobState = Literal["waiting", "accepted", "ended"]


class JobRecord:
    """One job in flight: what was submitted, its state and where its wants are parked.

    ``parked_on`` names the connections where its ``WANT`` is parked (a waiting
    job); ``conn`` the connection holding its slot (an accepted one); ``timer``
    the handle of its armed ``connect_timeout`` timer while it waits (the core
    arms and disarms it).
    """

    __slots__ = (
        "conn",
        "deadline",
        "job",
        "job_id",
        "parked_on",
        "pipes",
        "priority",
        "service",
        "state",
        "subject",
        "timer",
        "traceparent",
        "waits",
    )

    def __init__(
        self,
        job_id: str,
        service: str,
        priority: int,
        subject: str | None,
        job: dict[str, Any],
        *,
        deadline: float,
        pipes: dict[str, str] | None = None,
    ) -> None:
        self.job_id = job_id
        self.service = service
        self.priority = priority
        self.subject = subject
        self.job = job
        self.deadline = deadline
        self.pipes = pipes
        self.state: JobState = "waiting"
        self.parked_on: set[ConnId] = set()
        self.conn: ConnId | None = None
        self.timer: int | None = None
        self.waits = 0  # how many times the job started waiting (stale queue entries)
        self.traceparent: str | None = None  # JOB.traceparent

    def __repr__(self) -> str:
        return (
            f"JobRecord(job_id={self.job_id!r}, service={self.service!r}, "
            f"priority={self.priority!r}, state={self.state!r}, conn={self.conn!r}, "
            f"parked_on={sorted(self.parked_on)!r}, deadline={self.deadline!r})"
        )


class JobTable:
    """Every job in flight of one client core, indexed so each step is cheap.

    See the module docstring. A job enters with :meth:`wait` (after
    :meth:`add`), holds a slot after :meth:`accept`, may :meth:`wait` again, and
    leaves with :meth:`forget`.
    """

    __slots__ = ("_count", "_jobs", "_queue", "_waiting", "probing")

    def __init__(self) -> None:
        self._jobs: dict[str, JobRecord] = {}
        self._waiting: dict[str, dict[str, JobRecord]] = {}  # service -> job id -> job
        self._count = 0  # waiting jobs
        self._queue: deque[tuple[float, int, JobRecord]] = deque()  # (since, waits, job)
        self.probing: dict[str, JobRecord] = {}
        """Waiting jobs no ready connection offers a slot to yet: growth looks for one."""

    # -- moves -------------------------------------------------------------------------

    def add(self, job: JobRecord) -> None:
        """Take a new job (its id must not be in flight)."""
        assert job.job_id not in self._jobs, job.job_id
        self._jobs[job.job_id] = job

    def wait(self, job: JobRecord, *, now: float) -> None:
        """The job waits for a slot from ``now`` (submitted, or its ``JOB`` was refused)."""
        job.state = "waiting"
        job.conn = None
        job.waits += 1
        self._waiting.setdefault(job.service, {})[job.job_id] = job
        self._count += 1
        self._queue.append((now, job.waits, job))

    def accept(self, job: JobRecord, conn: ConnId) -> None:
        """The waiting job's ``JOB`` went out on ``conn``: it holds a slot there."""
        self._stop_waiting(job)
        job.state = "accepted"
        job.conn = conn

    def forget(self, job: JobRecord) -> None:
        """The job ended (or will never be known to): it leaves the table."""
        if job.state == "waiting":
            self._stop_waiting(job)
        del self._jobs[job.job_id]
        job.state = "ended"

    def _stop_waiting(self, job: JobRecord) -> None:
        jobs = self._waiting[job.service]
        del jobs[job.job_id]
        if not jobs:
            del self._waiting[job.service]
        self._count -= 1
        self.probing.pop(job.job_id, None)

    # -- questions ---------------------------------------------------------------------

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def __iter__(self) -> Iterator[JobRecord]:
        """Every job in flight, in the order they were added."""
        return iter(self._jobs.values())

    def get(self, job_id: str) -> JobRecord | None:
        return self._jobs.get(job_id)

    def __getitem__(self, job_id: str) -> JobRecord:
        return self._jobs[job_id]

    def waiting_for(self, service: str) -> Collection[JobRecord]:
        """The waiting jobs of one service (a live view: do not add or remove meanwhile)."""
        return self._waiting.get(service, {}).values()

    def services(self) -> list[str]:
        """The services some job waits for. O(those services)."""
        return list(self._waiting)

    def waiting(self) -> list[JobRecord]:
        """Every waiting job. O(waiting jobs)."""
        return [job for jobs in self._waiting.values() for job in jobs.values()]

    @property
    def waiting_count(self) -> int:
        """How many jobs wait for a slot. O(1)."""
        return self._count

    @property
    def accepted_count(self) -> int:
        """How many jobs hold a slot. O(1)."""
        return len(self._jobs) - self._count

    def oldest_wait(self) -> float | None:
        """When the longest-waiting job started waiting (None: no job waits).

        Amortised O(1): stale queue entries (the job got a slot, ended, or waits
        again) are dropped as they reach the front.
        """
        queue = self._queue
        while queue:
            since, waits, job = queue[0]
            if job.state == "waiting" and job.waits == waits:
                return since
            queue.popleft()
        return None

    def check_invariants(self) -> None:
        """Raise AssertionError if the indexes disagree with the jobs."""
        waiting = [job for job in self._jobs.values() if job.state == "waiting"]
        assert self._count == len(waiting) == sum(map(len, self._waiting.values()))
        for job in waiting:
            assert self._waiting[job.service][job.job_id] is job
        for job in self._jobs.values():
            assert job.state != "ended", f"{job.job_id} ended and is still in flight"
            assert (job.conn is None) == (job.state == "waiting"), job
        for job in self.probing.values():
            assert job.state == "waiting"
            assert self._jobs[job.job_id] is job
