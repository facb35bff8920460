"""The execserver's inspection document and Prometheus metrics, built from snapshots.

Both builders take an :class:`ExecserverStatistics`
(what :meth:`~trio_broker.trio.execserver.ExecserverHandle.statistics` returns: the
broker core's frozen statistics, the runner's when it keeps them, and the job
figures of :class:`JobFigures`) and nothing else, so they never reach into a
running service and can be fed any snapshot, a stored one included:

- :func:`execserver_document`: the JSON object served at
  ``/inspect/system/execserver``: the pool, each service, each connection, the
  running jobs, the recent receipts and the counters. Instants are ISO 8601
  strings in UTC with their zone (``2026-01-02T03:04:05.678Z``); a receipt's
  ``stdout_prefix`` is cut to :data:`INSPECTION_PREFIX_CHARS` characters.
- :func:`execserver_metrics`: the same figures as Prometheus text exposition, as
  served at ``/metrics``: pool and memory gauges, per-service gauges, histograms
  of each service's slot wait and job duration, jobs by final status, the core's
  counters, and ``trio_broker_build_info``. Every family has a HELP text of its
  own.

Outcomes. A job's final status is the receipt's (:data:`OUTCOMES`, the
``status`` member of ``PROTOCOL.md``'s receipt): the same words label the
execserver's ``jobs_total`` counter and may label any client's own counts, so
one dashboard reads both sides.
"""

from __future__ import annotations

import datetime
import typing
from bisect import bisect_left
from collections.abc import Callable, Mapping
from typing import Any, Final

import attrs
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from trio_broker._version import __version__
from trio_broker.core import protocol as p
from trio_broker.core.broker import BrokerStatistics, FinishedJob, ServiceSnapshot
from trio_broker.trio.runner import RunnerStatistics

__all__ = [
    "DURATION_BUCKETS",
    "INSPECTION_PREFIX_CHARS",
    "METRICS_CONTENT_TYPE",
    "OUTCOMES",
    "WAIT_BUCKETS",
    "Buckets",
    "ExecserverStatistics",
    "Histogram",
    "JobFigures",
    "JobStatistics",
    "ServiceJobs",
    "execserver_document",
    "execserver_metrics",
    "iso_time",
]

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The media type of :func:`execserver_metrics` (Prometheus text format 0.0.4)."""
OUTCOMES: Final[tuple[p.Status, ...]] = typing.get_args(p.Status)
"""The final statuses of a job, in the receipt's order: the one outcome vocabulary."""
INSPECTION_PREFIX_CHARS: Final = 200
"""The inspection document shows at most this much of a receipt's ``stdout_prefix``."""
WAIT_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                       60.0, 120.0, 300.0, 600.0)  # fmt: skip
"""Upper bounds (seconds) of the slot-wait histogram's buckets (``+Inf`` follows)."""
DURATION_BUCKETS: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                           300.0, 600.0, 1800.0, 3600.0, 7200.0, 14400.0, 43200.0)  # fmt: skip
"""Upper bounds (seconds) of the job-duration histogram's buckets (``+Inf`` follows)."""


def iso_time(seconds: float) -> str:
    """A UNIX time as ISO 8601 in UTC with milliseconds: ``2026-01-02T03:04:05.678Z``."""
    stamp = datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)
    return stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp.microsecond // 1000:03d}Z"


# -- job figures ------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Histogram:
    """A frozen histogram: per-bucket counts (not cumulative), their sum and count.

    ``counts`` has one entry per bound of ``bounds`` and a last one for ``+Inf``.
    """

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float
    count: int

    def cumulative(self) -> list[tuple[str, float]]:
        """``(le, count)`` pairs as Prometheus writes them, ``+Inf`` last."""
        pairs: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            pairs.append(("+Inf" if bound == float("inf") else f"{bound:g}", running))
        return pairs


@attrs.frozen(kw_only=True)
class ServiceJobs:
    """The ended jobs of one service: their waits, durations and final statuses."""

    wait: Histogram
    duration: Histogram
    statuses: Mapping[p.Status, int]


@attrs.frozen(kw_only=True)
class JobStatistics:
    """A frozen snapshot of :class:`JobFigures`: service name → its ended jobs."""

    services: Mapping[str, ServiceJobs] = attrs.field(factory=dict)


class Buckets:
    """A histogram being counted: :meth:`observe` values, :meth:`snapshot` a frozen
    :class:`Histogram` (``bounds``: the buckets' upper bounds, ``+Inf`` follows)."""

    __slots__ = ("bounds", "count", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def snapshot(self) -> Histogram:
        return Histogram(
            bounds=self.bounds, counts=tuple(self.counts), total=self.total, count=self.count
        )


class JobFigures:
    """Counts every ended job of an execserver: wait and duration histograms, statuses.

    The execserver feeds it each :class:`~trio_broker.core.broker.FinishedJob`
    (delivered or not); :meth:`statistics` takes a frozen snapshot.
    """

    def __init__(self) -> None:
        self._services: dict[str, tuple[Buckets, Buckets, dict[p.Status, int]]] = {}

    def record(self, job: FinishedJob) -> None:
        """Count one ended job."""
        figures = self._services.get(job.service)
        if figures is None:
            figures = self._services[job.service] = (
                Buckets(WAIT_BUCKETS),
                Buckets(DURATION_BUCKETS),
                dict.fromkeys(OUTCOMES, 0),
            )
        wait, duration, statuses = figures
        wait.observe(max(0.0, job.wait_s))
        duration.observe(max(0.0, job.receipt.duration_s))
        statuses[job.receipt.status] += 1

    def statistics(self) -> JobStatistics:
        """A frozen snapshot of what was counted so far."""
        return JobStatistics(
            services={
                name: ServiceJobs(
                    wait=wait.snapshot(), duration=duration.snapshot(), statuses=dict(statuses)
                )
                for name, (wait, duration, statuses) in self._services.items()
            }
        )


# -- the snapshot ------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ExecserverStatistics:
    """A frozen snapshot of one execserver
    (:meth:`ExecserverHandle.statistics <trio_broker.trio.execserver.ExecserverHandle.statistics>`).

    Attributes:
        broker: the broker core's snapshot: the pool, each service, each
            connection, the recent receipts and the counters.
        runner: the runner's snapshot (running jobs and their memory), or None
            when the runner keeps none (only
            :class:`~trio_broker.trio.runner.CommandRunner` does).
        jobs: every ended job's wait, duration and status, by service
            (:class:`JobFigures`); None when not kept.
    """

    broker: BrokerStatistics
    runner: RunnerStatistics | None
    jobs: JobStatistics | None = None


# -- the document ------------------------------------------------------------------------


def _short(text: str) -> str:
    if len(text) <= INSPECTION_PREFIX_CHARS:
        return text
    return text[:INSPECTION_PREFIX_CHARS] + "…"


def _receipt(receipt: p.Receipt) -> dict[str, Any]:
    wire: dict[str, Any] = p.converter.unstructure(receipt)
    wire["started_at"] = iso_time(receipt.started_at)
    wire["stdout_prefix"] = _short(receipt.stdout_prefix)
    return wire


def _pool(broker: BrokerStatistics, memory_used: int | None) -> dict[str, Any]:
    return {
        "slots": broker.slots,
        "fast_reserve": broker.fast_reserve,
        "unknown_cap": broker.unknown_cap,
        "busy": broker.busy,
        "idle": broker.idle,
        "memory_budget": broker.memory_budget,
        "memory_reserved": broker.memory_reserved,
        "memory_used": memory_used,
    }


def _service(s: ServiceSnapshot) -> dict[str, Any]:
    return {
        "kind": s.kind,
        "max_slots": s.max_slots,
        "capacity": s.capacity,
        "running": s.running,
        "offered": s.offered,
        "parked": s.parked,
        "completed": s.completed,
        "mean_runtime_s": s.mean_runtime,
        "peak_memory": s.peak_memory,
        "footprint": s.footprint,
    }


def execserver_document(stats: ExecserverStatistics) -> dict[str, Any]:
    """The inspection document of one execserver, ready for JSON.

    Args:
        stats: the snapshot to describe.

    Returns:
        A JSON-ready object with the members ``instance_id``, ``name``,
        ``draining``, ``pool``, ``services``, ``connections``, ``running``,
        ``recent`` (newest first; each with its ``wait_s``, ``client`` and
        receipt), ``counters``, ``caches`` (each cached service's produce
        cache: ``entries``, ``bytes``, ``max_size``, ``hits``, ``misses``) and
        ``containment`` (how the runner keeps its jobs' processes together: its
        :class:`~trio_broker.trio.runner.ContainmentInfo`, null when the runner
        does not say). Instants are ISO 8601 strings with their zone.
    """
    broker, runner = stats.broker, stats.runner
    running = {job.job_id: job for job in runner.running} if runner else {}
    return {
        "instance_id": broker.instance_id,
        "name": broker.name,
        "draining": broker.draining,
        "pool": _pool(broker, runner.memory_used if runner else None),
        "services": {s.name: _service(s) for s in broker.services},
        "connections": [
            {
                "id": c.conn,
                "addr": c.addr,
                "backend_id": c.register.backend_id if c.register else None,
                "name": c.register.name if c.register else None,
                "version": c.register.version if c.register else None,
                "callback_url": c.register.callback_url if c.register else None,
                "callback_check": c.callback_check,
                "parked": c.parked,
                "offered": c.offered,
                "running": c.running,
            }
            for c in broker.connections
        ],
        "running": [
            {
                "job_id": job.job_id,
                "service": job.service,
                "started_at": iso_time(job.started_at),
                "pid": job.pid,
                "rss": job.rss,
                "peak_memory": job.peak_memory,
            }
            for job in running.values()
        ],
        "recent": [
            {
                "job_id": f.job_id,
                "service": f.service,
                "subject": f.subject,
                "backend_id": f.backend_id,
                "client": f.client,
                "delivered": f.delivered,
                "wait_s": f.wait_s,
                "receipt": _receipt(f.receipt),
            }
            for f in reversed(broker.recent)
        ],
        "counters": broker.counters,
        "caches": {name: dict(figures) for name, figures in runner.caches.items()}
        if runner
        else {},
        "containment": (
            attrs.asdict(runner.containment) if runner and runner.containment else None
        ),
    }


# -- the metrics -----------------------------------------------------------------------

_PREFIX: Final = "trio_broker_execserver"

_COUNTER_HELP: Final = {
    "wants": "WANT frames parked (each job once per execserver it asked).",
    "offers": "Offers sent: a slot reserved for one parked want.",
    "offers_redeemed": "Offers answered with JOB: the job started.",
    "offers_declined": "Offers the client declined or withdrew (it took a slot elsewhere).",
    "offers_expired": "Offers not answered within offer_ttl; the slot went to the next want.",
    "offers_withdrawn": "Offers withdrawn because the execserver began draining.",
    "jobs_started": "Jobs started in a slot.",
    "jobs_ended": "Jobs whose runner reported an end (any status).",
    "errors_sent": "ERROR frames sent to clients.",
    "connections_opened": "Broker websocket connections accepted.",
    "connections_closed": "Broker websocket connections that ended.",
}
"""HELP text of each broker counter; a counter missing here gets a generic one."""

_PER_SERVICE: Final[list[tuple[str, str, Callable[[ServiceSnapshot], float | None]]]] = [
    ("running", "Jobs of the service running now.", lambda s: s.running),
    ("offered", "Slots reserved by offers of the service, not yet answered.", lambda s: s.offered),
    ("parked", "Wants of the service parked, waiting for a slot.", lambda s: s.parked),
    ("capacity", "Slots the service may hold at once now.", lambda s: s.capacity),
    (
        "mean_runtime_seconds",
        "Rolling mean runtime of the service's last measured jobs.",
        lambda s: s.mean_runtime,
    ),
    (
        "footprint_bytes",
        "Memory a job of the service is expected to take (learned).",
        lambda s: s.footprint,
    ),
    (
        "peak_memory_bytes",
        "Highest process-group RSS a job of the service reached.",
        lambda s: s.peak_memory,
    ),
]


def _gauge(name: str, text: str, value: float | None) -> GaugeMetricFamily | None:
    return None if value is None else GaugeMetricFamily(f"{_PREFIX}_{name}", text, value=value)


def _pool_families(stats: ExecserverStatistics) -> list[Metric]:
    broker, runner = stats.broker, stats.runner
    pool: list[tuple[str, str, float | None]] = [
        ("slots", "Slots in the pool.", broker.slots),
        ("busy", "Slots running a job or holding an offer.", broker.busy),
        ("idle", "Slots outside the fast reserve free through the last second.", broker.idle),
        ("fast_reserve", "Slots heavy services never take.", broker.fast_reserve),
        ("unknown_cap", "Slots unmeasured services may hold together.", broker.unknown_cap),
        ("connections", "Open broker connections.", len(broker.connections)),
        ("draining", "1 while the execserver drains, else 0.", int(broker.draining)),
        ("memory_budget_bytes", "Memory all running jobs together may use.", broker.memory_budget),
        (
            "memory_reserved_bytes",
            "Memory reserved by running jobs and offers (learned footprints).",
            broker.memory_reserved,
        ),
        (
            "memory_used_bytes",
            "Resident memory of all running jobs' process groups (last sample).",
            runner.memory_used if runner else None,
        ),
    ]
    return [family for args in pool if (family := _gauge(*args)) is not None]


def _service_families(broker: BrokerStatistics) -> list[Metric]:
    metrics: list[Metric] = []
    for name, text, read in _PER_SERVICE:
        family = GaugeMetricFamily(f"{_PREFIX}_service_{name}", text, labels=["service"])
        for s in broker.services:
            value = read(s)
            if value is not None:
                family.add_metric([s.name], value)
        metrics.append(family)
    completed = CounterMetricFamily(
        f"{_PREFIX}_service_jobs_completed",
        "Jobs of the service that ran to a measured end (they teach its mean runtime).",
        labels=["service"],
    )
    for s in broker.services:
        completed.add_metric([s.name], s.completed)
    metrics.append(completed)
    return metrics


def _job_families(stats: ExecserverStatistics) -> list[Metric]:
    jobs = stats.jobs or JobStatistics()
    names = [s.name for s in stats.broker.services]
    names += sorted(set(jobs.services) - set(names))
    ended = CounterMetricFamily(
        f"{_PREFIX}_jobs",
        "Jobs that ended, by service and final status (the receipt's status).",
        labels=["service", "status"],
    )
    wait = HistogramMetricFamily(
        f"{_PREFIX}_job_wait_seconds",
        "Seconds from a job's WANT to its JOB: the wait for a slot and the offer's answer.",
        labels=["service"],
    )
    duration = HistogramMetricFamily(
        f"{_PREFIX}_job_duration_seconds",
        "Seconds a job ran, from the runner taking it to its receipt.",
        labels=["service"],
    )
    empty_wait = Buckets(WAIT_BUCKETS).snapshot()
    empty_duration = Buckets(DURATION_BUCKETS).snapshot()
    for name in names:
        service = jobs.services.get(name)
        statuses = service.statuses if service else {}
        for status in OUTCOMES:
            ended.add_metric([name, status], statuses.get(status, 0))
        for family, histogram in (
            (wait, service.wait if service else empty_wait),
            (duration, service.duration if service else empty_duration),
        ):
            family.add_metric([name], histogram.cumulative(), sum_value=histogram.total)
    return [ended, wait, duration]


def _metric_families(stats: ExecserverStatistics) -> list[Metric]:
    broker = stats.broker
    build = GaugeMetricFamily(
        "trio_broker_build_info",
        "The trio_broker version serving these figures (always 1).",
        labels=["version"],
    )
    build.add_metric([__version__], 1)
    info = GaugeMetricFamily(
        f"{_PREFIX}_info",
        "This execserver's name and instance id (always 1).",
        labels=["name", "instance_id"],
    )
    info.add_metric([broker.name, broker.instance_id], 1)
    metrics: list[Metric] = [build, info, *_pool_families(stats)]
    metrics += _service_families(broker)
    metrics += _job_families(stats)
    for name, value in broker.counters.items():
        text = _COUNTER_HELP.get(name, f"Broker events counted as {name!r}.")
        metrics.append(CounterMetricFamily(f"{_PREFIX}_{name}", text, value=value))
    return metrics


class _Snapshot:
    """A Prometheus collector that yields the families of one snapshot."""

    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> list[Metric]:
        return self.metrics


def execserver_metrics(stats: ExecserverStatistics) -> bytes:
    """The Prometheus text exposition of one execserver's figures.

    Args:
        stats: the snapshot to expose.

    Returns:
        The exposition, in :data:`METRICS_CONTENT_TYPE`.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(_metric_families(stats)))
    return bytes(generate_latest(registry))
