"""Shrinking: a failing trace made as short and plain as still fails the same way.

:func:`shrink` takes a trace whose run broke a check and tries smaller ones,
keeping each that still breaks a check of the same kind (or whatever
``still_fails`` says), in passes that go from coarse to fine:

1. drop the noise: every latency its median, every other choice its simplest;
2. drop faults, one at a time;
3. drop jobs, in halves, then quarters... then one at a time (delta debugging);
4. make each job plainer: no memory, its input not failing, priority 0, a
   duration of a second or a round one, an arrival at 0 or an earlier round time
   (then 3 and 4 once more: plainer jobs may make more of them unneeded);
5. when the noise could not go, keep only as much of it as still fails.

The result replays to a violation like the original's and is the trace a
regression test keeps (:meth:`~trio_broker.testing.sim.trace.Trace.to_json`,
or the values themselves). The number of runs is bounded (``budget``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import TypeVar

import attrs

from trio_broker.testing.sim.run import Result, replay
from trio_broker.testing.sim.trace import JobInput, Trace

__all__ = ["same_kind", "shrink"]

T = TypeVar("T")


def same_kind(kind: str) -> Callable[[Result], bool]:
    """A ``still_fails`` that holds while a violation of this kind is found."""

    def still_fails(result: Result) -> bool:
        return any(v.kind == kind for v in result.violations)

    return still_fails


class _Shrinker:
    def __init__(self, still_fails: Callable[[Result], bool], budget: int) -> None:
        self.still_fails = still_fails
        self.budget = budget
        self.runs = 0

    def fails(self, trace: Trace) -> bool:
        if self.runs >= self.budget:
            return False
        self.runs += 1
        return self.still_fails(replay(trace, record=False, log_size=0))

    def fewer(self, trace: Trace, items: Sequence[T], rebuild: Callable[[tuple[T, ...]], Trace]
              ) -> Trace:  # fmt: skip
        """Delta debugging over ``items``: drop chunks while the trace still fails."""
        current = list(items)
        chunk = max(1, len(current) // 2)
        while current and chunk >= 1:
            start = 0
            while start < len(current):
                candidate = current[:start] + current[start + chunk :]
                attempt = rebuild(tuple(candidate))
                if self.fails(attempt):
                    current, trace = candidate, attempt
                else:
                    start += chunk
            if chunk == 1:
                break
            chunk = max(1, chunk // 2)
        return trace

    def plainer(self, trace: Trace) -> Trace:
        """Make each job plainer, one change at a time, while the trace still fails."""
        for index in range(len(trace.jobs)):
            changed = True
            while changed:
                changed = False
                for simpler in _simpler(trace.jobs[index]):
                    jobs = list(trace.jobs)
                    jobs[index] = simpler
                    attempt = attrs.evolve(trace, jobs=tuple(jobs))
                    if self.fails(attempt):
                        trace, changed = attempt, True
                        break
        return trace


def _with_jobs(trace: Trace, jobs: tuple[JobInput, ...]) -> Trace:
    return attrs.evolve(trace, jobs=jobs)


def _simpler(job: JobInput) -> list[JobInput]:
    """Plainer forms of one job, plainest change first."""
    forms = []
    if job.memory is not None:
        forms.append(attrs.evolve(job, memory=None))
    if job.fails:
        forms.append(attrs.evolve(job, fails=False))
    if job.priority != 0:
        forms.append(attrs.evolve(job, priority=0))
    for duration in (1.0, max(0.1, round(job.duration, 1))):
        if duration != job.duration:
            forms.append(attrs.evolve(job, duration=duration))
    for at in (0.0, float(math.floor(job.at / 10) * 10), float(math.floor(job.at))):
        if at < job.at:
            forms.append(attrs.evolve(job, at=at))
    return forms


def shrink(
    trace: Trace,
    still_fails: Callable[[Result], bool] | None = None,
    *,
    budget: int = 300,
) -> Trace:
    """A shorter, plainer trace whose run still fails (see the module docstring).

    Args:
        trace: a trace whose run fails (with its recorded noise).
        still_fails: whether a shorter trace's run still fails the same way;
            by default, a violation of the kind the original's first one has.
        budget: at most this many runs.

    Raises:
        ValueError: the trace's run does not fail.
    """
    first = replay(trace, record=False, log_size=0)
    if still_fails is None:
        if not first.violations:
            raise ValueError("the trace's run breaks no check: nothing to shrink")
        still_fails = same_kind(first.violations[0].kind)
    elif not still_fails(first):
        raise ValueError("the trace's run does not fail as still_fails asks")
    shrinker = _Shrinker(still_fails, budget)
    quiet = attrs.evolve(trace, noise=())
    noisy = not shrinker.fails(quiet)
    if not noisy:
        trace = quiet
    trace = shrinker.fewer(trace, trace.faults, lambda faults: attrs.evolve(trace, faults=faults))
    for _ in range(2):  # plainer jobs may make more of them unneeded
        trace = shrinker.fewer(trace, trace.jobs, functools.partial(_with_jobs, trace))
        trace = shrinker.plainer(trace)
    if noisy and trace.noise:
        noise = trace.noise
        length = len(noise)
        while length > 1:
            attempt = attrs.evolve(trace, noise=noise[: length // 2])
            if not shrinker.fails(attempt):
                break
            trace, length = attempt, length // 2
    return trace
