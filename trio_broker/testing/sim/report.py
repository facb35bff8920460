"""The figures of a run, and the capacity report of many.

:class:`Figures` is what one run measured (plain numbers, so runs in other
processes send them back): jobs done and failed, throughput, each job's wait
from its arrival to the start of the run that counted (by priority), slot use
per pod and service, the share of each client, the queue's depth over time.
:func:`capacity_report` pools the figures of several seeds into text: the
report ``trio-broker simulate`` prints, with an ASCII plot of the depth.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import attrs

__all__ = ["Figures", "capacity_report", "percentile", "plot"]


@attrs.frozen(kw_only=True)
class Figures:
    """What one run measured.

    Attributes:
        seed: the run's seed.
        virtual: virtual seconds simulated; wall: seconds it took; events: how many.
        done, failed, abandoned: jobs by how they ended (``open``: never ended).
        span: from the first arrival to the last job's end (seconds).
        waits: priority -> each done job's wait (arrival to the start of its run).
        busy: pod -> service -> slot-seconds of runs.
        capacity: pod -> slot-seconds it was up.
        shares: client -> jobs it did.
        client_waits: client -> the waits of the jobs it did.
        depth: (time, jobs not ended) samples.
        starts: runs started; duplicates: runs beyond one per done job.
    """

    seed: int
    virtual: float
    wall: float
    events: int
    done: int
    failed: int
    abandoned: int
    open: int
    span: float
    waits: Mapping[int, tuple[float, ...]]
    busy: Mapping[str, Mapping[str, float]]
    capacity: Mapping[str, float]
    shares: Mapping[str, int]
    client_waits: Mapping[str, tuple[float, ...]]
    depth: tuple[tuple[float, int], ...]
    starts: int = 0

    @property
    def throughput(self) -> float:
        return self.done / self.span if self.span > 0 else 0.0

    @property
    def speed(self) -> float:
        """Virtual seconds per wall second."""
        return self.virtual / self.wall if self.wall > 0 else math.inf


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by the nearest rank; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def plot(samples: Sequence[tuple[float, int]], *, width: int = 60, height: int = 8) -> list[str]:
    """An ASCII plot of (time, value) samples: ``height`` rows of ``#`` columns."""
    if not samples:
        return ["(no samples)"]
    end = max(t for t, _ in samples) or 1.0
    columns = [0] * width
    for t, value in samples:
        column = min(width - 1, int(t / end * (width - 1)))
        columns[column] = max(columns[column], value)
    top = max(columns) or 1
    label = len(str(top))
    lines = []
    for row in range(height, 0, -1):
        floor = top * (row - 0.5) / height
        mark = str(top) if row == height else ("0" if row == 1 else "")
        bar = "".join("#" if value >= floor and value > 0 else " " for value in columns)
        lines.append(f"{mark:>{label}} |{bar}")
    lines.append(f"{'':>{label}} +{'-' * width}")
    lines.append(f"{'':>{label}}  0s{f'{end:.0f}s':>{width - 2}}")
    return lines


def capacity_report(name: str, runs: Sequence[Figures]) -> list[str]:
    """The capacity report of the runs of one scenario (their figures pooled)."""
    if not runs:
        return [f"{name}: no runs"]
    n = len(runs)
    done = sum(r.done for r in runs)
    lines = [
        f"scenario {name}: {n} seed{'s' * (n != 1)}, {done} jobs done, "
        f"{sum(r.failed for r in runs)} failed (their input), "
        f"{sum(r.abandoned for r in runs)} lost with their client",
        f"  throughput   {sum(r.throughput for r in runs) / n:.2f} jobs/s "
        f"(mean over seeds; {sum(r.speed for r in runs) / n:.0f}x real time, "
        f"{sum(r.events for r in runs)} events)",
    ]
    lines += _utilisation(runs)
    lines += _waits(runs)
    lines += _shares(runs)
    depth = max(runs, key=lambda r: max((v for _, v in r.depth), default=0)).depth
    lines.append("  jobs not ended over time (the seed with the deepest queue):")
    lines += ["    " + line for line in plot(depth)]
    return lines


def _utilisation(runs: Sequence[Figures]) -> list[str]:
    busy: dict[str, dict[str, float]] = {}
    capacity: dict[str, float] = {}
    for run in runs:
        for pod, per_service in run.busy.items():
            into = busy.setdefault(pod, {})
            for service, seconds in per_service.items():
                into[service] = into.get(service, 0.0) + seconds
        for pod, seconds in run.capacity.items():
            capacity[pod] = capacity.get(pod, 0.0) + seconds
    lines = ["  slot use     (busy slot-seconds over slot-seconds up)"]
    pods = sorted(capacity, key=_natural)
    shown = pods if len(pods) <= 12 else pods[:5] + pods[-5:]
    for pod in shown:
        total = capacity[pod]
        per = busy.get(pod, {})
        use = sum(per.values()) / total if total else 0.0
        detail = ", ".join(f"{s} {v / total:.0%}" for s, v in sorted(per.items()) if total)
        lines.append(f"    {pod:<16} {use:>4.0%}  {detail}")
    if len(shown) < len(pods):
        uses = sorted(sum(busy.get(p, {}).values()) / capacity[p] for p in pods if capacity[p])
        lines.append(
            f"    ... {len(pods)} pods: min {uses[0]:.0%}, median {percentile(uses, 50):.0%}, "
            f"max {uses[-1]:.0%}"
        )
    return lines


def _waits(runs: Sequence[Figures]) -> list[str]:
    waits: dict[int, list[float]] = {}
    for run in runs:
        for priority, values in run.waits.items():
            waits.setdefault(priority, []).extend(values)
    lines = ["  wait         (arrival to the start of the run that counted)"]
    for priority in sorted(waits, reverse=True):
        pooled = waits[priority]
        lines.append(
            f"    priority {priority:>2}: p50 {percentile(pooled, 50):8.3f}s  "
            f"p99 {percentile(pooled, 99):8.3f}s  ({len(pooled)} jobs)"
        )
    return lines


def _shares(runs: Sequence[Figures]) -> list[str]:
    shares: dict[str, int] = {}
    waits: dict[str, list[float]] = {}
    for run in runs:
        for client, count in run.shares.items():
            shares[client] = shares.get(client, 0) + count
        for client, seen in run.client_waits.items():
            waits.setdefault(client, []).extend(seen)
    total = sum(shares.values()) or 1
    names = sorted(shares, key=_natural)
    lines = ["  share        (jobs done per client, and their p50 wait)"]
    if len(names) > 12:
        values = sorted(shares[n] / total for n in names)
        return [
            *lines,
            f"    {len(names)} clients: min {values[0]:.1%}, median "
            f"{percentile(values, 50):.1%}, max {values[-1]:.1%}",
        ]
    for name in names:
        p50 = percentile(waits.get(name, []), 50)
        lines.append(f"    {name:<16} {shares[name] / total:>5.1%}  p50 {p50:.3f}s")
    return lines


def _natural(name: str) -> tuple[str, int]:
    """``pod-2`` before ``pod-10``."""
    head, _, tail = name.rpartition("-")
    return (head, int(tail)) if tail.isdigit() else (name, -1)
