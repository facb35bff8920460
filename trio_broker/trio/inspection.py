"""The execserver's inspection document and Prometheus metrics, built from snapshots.

Both builders take an :class:`~trio_broker.trio.execserver.ExecserverStatistics`
(what :meth:`~trio_broker.trio.execserver.ExecserverHandle.statistics` returns: the
broker core's frozen statistics and, when the runner keeps them, the runner's) and
nothing else, so they never reach into a running service and can be fed any
snapshot, a stored one included:

- :func:`execserver_document`: the JSON object served at
  ``/inspect/system/execserver``: the pool, each service, each connection, the
  running jobs, the recent receipts and the counters;
- :func:`execserver_metrics`: the same figures as Prometheus text exposition, as
  served at ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from trio_broker.core import protocol as p
from trio_broker.core.broker import ServiceSnapshot

if TYPE_CHECKING:
    from trio_broker.trio.execserver import ExecserverStatistics

__all__ = ["METRICS_CONTENT_TYPE", "execserver_document", "execserver_metrics"]

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The media type of :func:`execserver_metrics` (Prometheus text format 0.0.4)."""


def execserver_document(stats: ExecserverStatistics) -> dict[str, Any]:
    """The inspection document of one execserver, ready for JSON.

    Args:
        stats: the snapshot to describe.

    Returns:
        A JSON-ready object with the members ``instance_id``, ``name``,
        ``draining``, ``pool``, ``services``, ``connections``, ``running``,
        ``recent`` (newest first) and ``counters``.
    """
    broker, runner = stats.broker, stats.runner
    running = {job.job_id: job for job in runner.running} if runner else {}
    return {
        "instance_id": broker.instance_id,
        "name": broker.name,
        "draining": broker.draining,
        "pool": {
            "slots": broker.slots,
            "fast_reserve": broker.fast_reserve,
            "unknown_cap": broker.unknown_cap,
            "busy": broker.busy,
            "idle": broker.idle,
            "memory_budget": broker.memory_budget,
            "memory_reserved": broker.memory_reserved,
            "memory_used": runner.memory_used if runner else None,
        },
        "services": {
            s.name: {
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
            for s in broker.services
        },
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
                "delivered": f.delivered,
                "receipt": p.converter.unstructure(f.receipt),
            }
            for f in reversed(broker.recent)
        ],
        "counters": broker.counters,
    }


_PER_SERVICE: list[tuple[str, str, Callable[[ServiceSnapshot], float | None]]] = [
    ("running", "Running jobs of the service.", lambda s: s.running),
    ("offered", "Outstanding offers of the service.", lambda s: s.offered),
    ("parked", "Parked wants of the service.", lambda s: s.parked),
    ("mean_runtime_seconds", "Rolling mean runtime.", lambda s: s.mean_runtime),
    ("footprint_bytes", "Learned memory footprint.", lambda s: s.footprint),
]


def _metric_families(stats: ExecserverStatistics) -> list[Metric]:
    broker = stats.broker
    pool = [
        ("slots", "Slots in the pool.", broker.slots),
        ("busy", "Slots running a job or holding an offer.", broker.busy),
        ("idle", "Slots outside the fast reserve free through the last second.", broker.idle),
        ("fast_reserve", "Slots heavy services never take.", broker.fast_reserve),
        ("connections", "Open broker connections.", len(broker.connections)),
        ("draining", "1 while the execserver drains.", int(broker.draining)),
    ]
    metrics: list[Metric] = [
        GaugeMetricFamily(f"trio_broker_execserver_{name}", text, value=value)
        for name, text, value in pool
    ]
    for name, text, read in _PER_SERVICE:
        family = GaugeMetricFamily(
            f"trio_broker_execserver_service_{name}", text, labels=["service"]
        )
        for s in broker.services:
            value = read(s)
            if value is not None:
                family.add_metric([s.name], value)
        metrics.append(family)
    completed = CounterMetricFamily(
        "trio_broker_execserver_service_jobs_completed",
        "Jobs of the service that ran to a measured end.",
        labels=["service"],
    )
    for s in broker.services:
        completed.add_metric([s.name], s.completed)
    metrics.append(completed)
    for name, value in broker.counters.items():
        metrics.append(
            CounterMetricFamily(f"trio_broker_execserver_{name}", f"Count of {name}.", value=value)
        )
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
