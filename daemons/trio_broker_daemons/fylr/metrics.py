"""The fylr's inspection document and Prometheus metrics.

Theory of operation
===================

Both are taken from one snapshot when they are asked for, never kept up to date
in the background: :func:`inspect_document` (``GET /inspect/system/fylr``, JSON)
and :func:`metrics_text` (``GET /metrics``, the Prometheus text exposition) read
the queue's counts from the database (its rows are the work in progress: few),
the ``files`` table's counts as last counted (a full count of every file runs at
most once per ``counts_interval``, :meth:`FylrState.file_counts
<trio_broker_daemons.fylr.state.FylrState.file_counts>`, its age shown), and the process's
own counters, dispatcher, broker client and pipes from
:meth:`FylrState.statistics <trio_broker_daemons.fylr.state.FylrState.statistics>`.
The Prometheus side registers a one-shot collector in a fresh registry for each
scrape, so nothing is global.

Two operator routes sit beside them: ``POST /inspect/system/fylr/requeue``
puts the failed queue rows back (all, or ``?id=N`` once or more;
:func:`~trio_broker_daemons.fylr.failed.retry_failed`), and
``POST /inspect/system/fylr/sweep`` sweeps the storage folder now
(:class:`~trio_broker_daemons.fylr.sweep.StorageSweeper`). All four need the
``operator`` role (:mod:`~trio_broker_daemons.fylr.access`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from trio_broker._version import __version__
from trio_broker.trio.client import ClientStatistics
from trio_broker.trio.inspection import Histogram, iso_time
from trio_broker.trio.store import QueueCounts
from trio_broker_daemons.fylr.access import Role
from trio_broker_daemons.fylr.failed import failed_items, retry_failed
from trio_broker_daemons.fylr.guard import GuardedRoute, route
from trio_broker_daemons.fylr.state import FileCounts, FylrState, FylrStatistics
from trio_broker_daemons.fylr.sweep import StorageSweeper, result_document
from trio_broker_daemons.fylr.trouble import band_name
from trio_broker_daemons.runtime.logfmt import fields

__all__ = ["inspect_document", "metrics_text", "routes"]

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"

log = logging.getLogger("trio_broker_daemons.fylr.metrics")


async def inspect_document(state: FylrState) -> dict[str, Any]:
    """The document of ``/inspect/system/fylr`` (reads the database).

    Args:
        state: the process's shared state.

    Returns:
        Identity, the queue's and the files' counts by state, the failed queue
        rows with their reasons (``failed``, at most
        :data:`~trio_broker_daemons.fylr.failed.FAILED_SHOWN`), the storage
        sweep's figures (``storage``), the HTTP and step counters, and the
        dispatcher's, the client's and the pipes' snapshots.

    Raises:
        StoreUnavailable: the database could not be read.
    """
    queue = await state.store.counts()
    counted = await state.file_counts()
    failed = await failed_items(state.store)
    stats = state.statistics()
    files: dict[str, dict[str, int]] = {"original": {}, "version": {}}
    for (kind, status), count in sorted(counted.counts.items()):
        files.setdefault(kind, {})[status] = count
    config = state.config
    return {
        "backend_id": state.backend_id,
        "name": config.name,
        "version": __version__,
        "url": state.base_url,
        "database": state.database,
        "state_dir": str(config.state_dir),
        "stopping": state.stopping,
        "queue": attrs.asdict(queue),
        "files": files,
        "files_counted": {
            "at": iso_time(counted.counted_at),
            "age_s": round(counted.age, 3),
            "interval_s": config.counts_interval,
        },
        "failed": failed,
        "storage": {"folder": str(state.storage.root), **state.sweeper.document()},
        "http": dict(state.counters),
        "steps": dict(stats.steps),
        "dispatcher": attrs.asdict(stats.dispatcher) if stats.dispatcher else None,
        "store": attrs.asdict(state.store.statistics()),
        "client": _client_document(stats.client, config.execservers),
        "pipes": attrs.asdict(stats.pipes),
    }


async def metrics_text(state: FylrState) -> bytes:
    """The Prometheus text exposition of one snapshot (reads the database).

    Raises:
        StoreUnavailable: the database could not be read.
    """
    queue = await state.store.counts()
    ages = await state.store.ready_ages(QUEUE_AGE_BUCKETS)
    counted = await state.file_counts()
    registry = CollectorRegistry(auto_describe=False)
    stats = state.statistics()
    registry.register(_Collector(stats, queue, counted, state.sweeper))
    registry.register(_Histograms(stats, ages))
    return bytes(generate_latest(registry))


QUEUE_AGE_BUCKETS: Final = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
                            7200.0, 21600.0, 86400.0)  # fmt: skip
"""Upper bounds (seconds) of the queue-age histogram's buckets (``+Inf`` follows)."""


class _Histograms:
    """The histograms of one scrape: the ready rows' ages per priority band (a gauge
    histogram: the queue as it is now), the broker client's slot waits by service
    and outcome, and the steps' durations by action, service and outcome."""

    def __init__(self, stats: FylrStatistics, ages: Mapping[int, Histogram]) -> None:
        self.stats = stats
        self.ages = ages

    def collect(self) -> list[Metric]:
        ages = GaugeHistogramMetricFamily(
            "trio_broker_fylr_queue_age_seconds",
            "Ages of the claimable queue rows (seconds since enqueued), by priority band.",
            labels=["band"],
        )
        for priority, histogram in sorted(self.ages.items(), reverse=True):
            ages.add_metric(
                [band_name(priority)], histogram.cumulative(), gsum_value=histogram.total
            )
        waits = HistogramMetricFamily(
            "trio_broker_fylr_slot_wait_seconds",
            "Seconds a job waited for a slot, by service and outcome (offer: it got one;"
            " no_slot, no_execserver, unknown_service, closed, cancelled: it did not).",
            labels=["service", "outcome"],
        )
        client = self.stats.client
        for (service, outcome), histogram in (client.slot_waits if client else {}).items():
            waits.add_metric([service, outcome], histogram.cumulative(), histogram.total)
        steps = HistogramMetricFamily(
            "trio_broker_fylr_step_duration_seconds",
            "Seconds from a step's start to the dispatcher's decision, by action, the"
            " service its job asked for (local: none) and the decision's outcome.",
            labels=["action", "service", "outcome"],
        )
        for (action, service, outcome), histogram in self.stats.step_durations.items():
            steps.add_metric([action, service, outcome], histogram.cumulative(), histogram.total)
        return [ages, waits, steps]


def routes(state: FylrState) -> list[GuardedRoute]:
    """The inspection page, requeue, sweep and ``GET /metrics`` on ``state`` (operator)."""

    async def inspect_page(request: Request) -> Response:
        return JSONResponse(await inspect_document(state))

    async def metrics(request: Request) -> Response:
        return Response(await metrics_text(state), media_type=PROMETHEUS_TEXT)

    async def requeue(request: Request) -> Response:
        raw = request.query_params.getlist("id")
        if not all(text.isascii() and text.isdigit() and len(text) <= 18 for text in raw):
            return JSONResponse({"error": "id: expected queue row ids"}, status_code=400)
        retried = await retry_failed(state.store, ids=[int(text) for text in raw] or None)
        if retried:
            state.wake_dispatcher()
            state.changed()
        log.info("failed items requeued", extra=fields(items=len(retried)))
        return JSONResponse({"requeued": [attrs.asdict(item) for item in retried]})

    async def sweep(request: Request) -> Response:
        result = await state.sweeper.sweep()
        return JSONResponse(result_document(result))

    return [
        route("/inspect/system/fylr", inspect_page, role=Role.OPERATOR),
        route("/inspect/system/fylr/requeue", requeue, role=Role.OPERATOR, methods=("POST",)),
        route("/inspect/system/fylr/sweep", sweep, role=Role.OPERATOR, methods=("POST",)),
        route("/metrics", metrics, role=Role.OPERATOR),
    ]


def _client_document(
    stats: ClientStatistics | None, addresses: Sequence[str]
) -> dict[str, Any] | None:
    if stats is None:
        return None
    return {
        "waiting": stats.waiting,
        "running": stats.running,
        "finished": stats.finished,
        "failed": stats.failed,
        "surplus_offers": stats.surplus_offers,
        "addresses": [
            {
                "address": a.address,
                "connections": a.connections,
                "instances": list(a.instances),
                "names": dict(a.names),
                "covered": a.covered,
                "balanced": a.balanced,
            }
            for a in stats.addresses
        ],
    }


class _Collector:
    """Prometheus metrics from one snapshot, taken when ``/metrics`` is scraped."""

    def __init__(
        self,
        stats: FylrStatistics,
        queue: QueueCounts,
        files: FileCounts,
        sweeper: StorageSweeper,
    ) -> None:
        self.stats = stats
        self.queue = queue
        self.files = files
        self.sweeper = sweeper

    def collect(self) -> list[Metric]:
        stats = self.stats
        metrics: list[Metric] = []
        files = GaugeMetricFamily(
            "trio_broker_fylr_files", "Files by kind and internal state.", labels=["kind", "state"]
        )
        for (kind, state), count in sorted(self.files.counts.items()):
            files.add_metric([kind, state], count)
        metrics.append(files)
        metrics.append(
            GaugeMetricFamily(
                "trio_broker_fylr_files_counted_age_seconds",
                "Age of the files count (counted again at most once per counts_interval).",
                value=self.files.age,
            )
        )
        queue = GaugeMetricFamily(
            "trio_broker_fylr_queue_items", "Rows of broker_queue by state.", labels=["state"]
        )
        for state, count in attrs.asdict(self.queue).items():
            queue.add_metric([state], count)
        metrics.append(queue)
        http = [
            ("uploads", "Uploads stored and recorded.", stats.uploads),
            ("uploads_refused", "Uploads refused before storing.", stats.uploads_refused),
            ("uploads_aborted", "Uploads whose sender went away.", stats.uploads_aborted),
            ("uploads_failed", "Uploads the storage failed to keep.", stats.uploads_failed),
            (
                "swept_temporary",
                "Temporary files of killed writers removed.",
                self.sweeper.temporary_removed,
            ),
            (
                "swept_orphans",
                "Unreferenced stored files of killed writers removed.",
                self.sweeper.orphans_removed,
            ),
            ("uploaded_bytes", "Bytes of recorded uploads.", stats.bytes_uploaded),
            ("downloads", "Downloads started.", stats.downloads),
            (
                "results_retried",
                "Records of finished jobs' results tried again (database unavailable).",
                stats.results_retried,
            ),
        ]
        for name, text, value in http:
            metrics.append(CounterMetricFamily(f"trio_broker_fylr_{name}", text, value=value))
        steps = CounterMetricFamily(
            "trio_broker_fylr_steps",
            "Step ends by action and outcome.",
            labels=["action", "outcome"],
        )
        for key, value in sorted(stats.steps.items()):
            action, _, outcome = key.partition(".")
            steps.add_metric([action, outcome], value)
        metrics.append(steps)
        if stats.dispatcher is not None:
            d = stats.dispatcher
            for name, value in (
                ("exec_limit", d.exec_limit),
                ("exec_in_flight", d.exec_in_flight),
                ("local_in_flight", d.local_in_flight),
                ("pending_outcomes", d.pending_outcomes),
            ):
                metrics.append(
                    GaugeMetricFamily(
                        f"trio_broker_fylr_dispatcher_{name}", f"Dispatcher {name}.", value=value
                    )
                )
            for name, value in (
                ("claims", d.claims),
                ("claimed", d.claimed),
                ("completed", d.completed),
                ("requeued", d.requeued),
                ("failed", d.failed),
                ("stale_requeued", d.stale_requeued),
                ("store_errors", d.store_errors),
            ):
                metrics.append(
                    CounterMetricFamily(
                        f"trio_broker_fylr_dispatcher_{name}", f"Dispatcher {name}.", value=value
                    )
                )
        if stats.client is not None:
            c = stats.client
            metrics.append(
                GaugeMetricFamily(
                    "trio_broker_fylr_jobs_waiting", "Jobs waiting for a slot.", value=c.waiting
                )
            )
            metrics.append(
                GaugeMetricFamily(
                    "trio_broker_fylr_jobs_running", "Jobs holding a slot.", value=c.running
                )
            )
            metrics.append(
                CounterMetricFamily(
                    "trio_broker_fylr_jobs_finished", "Jobs ended with a receipt.", value=c.finished
                )
            )
            connections = GaugeMetricFamily(
                "trio_broker_fylr_broker_connections",
                "Open broker connections per configured address.",
                labels=["address"],
            )
            for a in c.addresses:
                connections.add_metric([a.address], a.connections)
            metrics.append(connections)
        pipes = stats.pipes
        for name, text, value in (
            ("pipe_bytes_served", "Bytes sent through in-pipes.", pipes.bytes_served),
            ("pipe_bytes_received", "Bytes received through out-pipes.", pipes.bytes_received),
            ("pipes_aborted", "Pipes whose transfer did not complete.", pipes.aborted),
        ):
            metrics.append(CounterMetricFamily(f"trio_broker_fylr_{name}", text, value=value))
        return metrics
