"""The execserver's inspection document and metrics, pinned on one hand-made snapshot.

The builders take frozen snapshots only, so a snapshot written out by hand pins
their whole output: the JSON of ``/inspect/system/execserver`` and the text of
``/metrics`` must not change shape.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from trio_broker.core import protocol as p
from trio_broker.core.broker import (
    BrokerStatistics,
    ConnectionSnapshot,
    FinishedJob,
    ServiceSnapshot,
)
from trio_broker.trio.execserver import ExecserverStatistics
from trio_broker.trio.inspection import execserver_document, execserver_metrics
from trio_broker.trio.runner import RunnerStatistics, RunningJob


def snapshot() -> tuple[BrokerStatistics, RunnerStatistics]:
    """Two services, two connections (one registered), one running job, two receipts."""
    broker = BrokerStatistics(
        instance_id="inst-1",
        name="exec-a",
        slots=4,
        fast_reserve=1,
        unknown_cap=2,
        memory_budget=8_000_000_000,
        memory_reserved=100_000_000,
        busy=2,
        idle=1,
        draining=False,
        services=(
            ServiceSnapshot(
                name="thumbnail",
                kind="light",
                max_slots=0,
                capacity=4,
                running=1,
                offered=1,
                parked=3,
                completed=7,
                mean_runtime=0.25,
                peak_memory=50_000_000,
                footprint=40_000_000,
            ),
            ServiceSnapshot(
                name="video",
                kind="unknown",
                max_slots=2,
                capacity=2,
                running=0,
                offered=0,
                parked=0,
                completed=0,
                mean_runtime=None,
                peak_memory=None,
                footprint=None,
            ),
        ),
        connections=(
            ConnectionSnapshot(
                conn=1,
                addr="127.0.0.1:7000",
                opened_at=10.0,
                register=p.Register(
                    backend_id="fylr-1",
                    name="fylr",
                    version="1",
                    callback_url="http://10.0.0.5:8123",
                ),
                callback_check="ok",
                parked=3,
                offered=1,
                running=1,
            ),
            ConnectionSnapshot(
                conn=2,
                addr="127.0.0.1:7000",
                opened_at=11.0,
                register=None,
                callback_check=None,
                parked=0,
                offered=0,
                running=0,
            ),
        ),
        recent=(
            FinishedJob(
                job_id="j1",
                service="thumbnail",
                subject="file-1",
                conn=1,
                backend_id="fylr-1",
                delivered=True,
                receipt=p.Receipt(
                    status="ok",
                    exit_code=0,
                    error=None,
                    stderr_line=None,
                    stdout_prefix="hi\n",
                    stdout_bytes=3,
                    stdin_bytes=0,
                    started_at=1790000000.25,
                    duration_s=0.031,
                    peak_memory=18874368,
                    instance_id="inst-1",
                ),
            ),
            FinishedJob(
                job_id="j2",
                service="thumbnail",
                subject=None,
                conn=2,
                backend_id=None,
                delivered=False,
                receipt=p.Receipt(
                    status="stopped",
                    exit_code=None,
                    error="the stream broke",
                    stdout_prefix="",
                    stdout_bytes=0,
                    stdin_bytes=0,
                    started_at=1790000001.0,
                    duration_s=2.0,
                    instance_id="inst-1",
                ),
            ),
        ),
        counters={"wants": 11, "offers": 9},
    )
    runner = RunnerStatistics(
        running=(
            RunningJob(
                job_id="j3",
                service="thumbnail",
                started_at=1790000002.0,
                pid=4242,
                pgid=4242,
                rss=30_000_000,
                peak_memory=31_000_000,
            ),
        ),
        memory_used=30_000_000,
        memory_budget=8_000_000_000,
    )
    return broker, runner


def statistics(*, with_runner: bool = True) -> ExecserverStatistics:
    """The snapshot as ExecserverHandle.statistics() returns it."""
    broker, runner = snapshot()
    return ExecserverStatistics(broker=broker, runner=runner if with_runner else None)


DOCUMENT: dict[str, Any] = {
    "instance_id": "inst-1",
    "name": "exec-a",
    "draining": False,
    "pool": {
        "slots": 4,
        "fast_reserve": 1,
        "unknown_cap": 2,
        "busy": 2,
        "idle": 1,
        "memory_budget": 8000000000,
        "memory_reserved": 100000000,
        "memory_used": 30000000,
    },
    "services": {
        "thumbnail": {
            "kind": "light",
            "max_slots": 0,
            "capacity": 4,
            "running": 1,
            "offered": 1,
            "parked": 3,
            "completed": 7,
            "mean_runtime_s": 0.25,
            "peak_memory": 50000000,
            "footprint": 40000000,
        },
        "video": {
            "kind": "unknown",
            "max_slots": 2,
            "capacity": 2,
            "running": 0,
            "offered": 0,
            "parked": 0,
            "completed": 0,
            "mean_runtime_s": None,
            "peak_memory": None,
            "footprint": None,
        },
    },
    "connections": [
        {
            "id": 1,
            "addr": "127.0.0.1:7000",
            "backend_id": "fylr-1",
            "name": "fylr",
            "version": "1",
            "callback_url": "http://10.0.0.5:8123",
            "callback_check": "ok",
            "parked": 3,
            "offered": 1,
            "running": 1,
        },
        {
            "id": 2,
            "addr": "127.0.0.1:7000",
            "backend_id": None,
            "name": None,
            "version": None,
            "callback_url": None,
            "callback_check": None,
            "parked": 0,
            "offered": 0,
            "running": 0,
        },
    ],
    "running": [
        {
            "job_id": "j3",
            "service": "thumbnail",
            "pid": 4242,
            "rss": 30000000,
            "peak_memory": 31000000,
        }
    ],
    "recent": [
        {
            "job_id": "j2",
            "service": "thumbnail",
            "subject": None,
            "backend_id": None,
            "delivered": False,
            "receipt": {
                "status": "stopped",
                "exit_code": None,
                "error": "the stream broke",
                "stderr_line": None,
                "stdout_prefix": "",
                "stdout_bytes": 0,
                "stdin_bytes": 0,
                "started_at": 1790000001.0,
                "duration_s": 2.0,
                "peak_memory": None,
                "instance_id": "inst-1",
            },
        },
        {
            "job_id": "j1",
            "service": "thumbnail",
            "subject": "file-1",
            "backend_id": "fylr-1",
            "delivered": True,
            "receipt": {
                "status": "ok",
                "exit_code": 0,
                "error": None,
                "stderr_line": None,
                "stdout_prefix": "hi\n",
                "stdout_bytes": 3,
                "stdin_bytes": 0,
                "started_at": 1790000000.25,
                "duration_s": 0.031,
                "peak_memory": 18874368,
                "instance_id": "inst-1",
            },
        },
    ],
    "counters": {"wants": 11, "offers": 9},
}
METRICS = (
    "# HELP trio_broker_execserver_slots Slots in the pool.\n"
    "# TYPE trio_broker_execserver_slots gauge\n"
    "trio_broker_execserver_slots 4.0\n"
    "# HELP trio_broker_execserver_busy Slots running a job or holding an offer.\n"
    "# TYPE trio_broker_execserver_busy gauge\n"
    "trio_broker_execserver_busy 2.0\n"
    "# HELP trio_broker_execserver_idle Slots outside the fast reserve free through"
    " the last second.\n"
    "# TYPE trio_broker_execserver_idle gauge\n"
    "trio_broker_execserver_idle 1.0\n"
    "# HELP trio_broker_execserver_fast_reserve Slots heavy services never take.\n"
    "# TYPE trio_broker_execserver_fast_reserve gauge\n"
    "trio_broker_execserver_fast_reserve 1.0\n"
    "# HELP trio_broker_execserver_connections Open broker connections.\n"
    "# TYPE trio_broker_execserver_connections gauge\n"
    "trio_broker_execserver_connections 2.0\n"
    "# HELP trio_broker_execserver_draining 1 while the execserver drains.\n"
    "# TYPE trio_broker_execserver_draining gauge\n"
    "trio_broker_execserver_draining 0.0\n"
    "# HELP trio_broker_execserver_service_running Running jobs of the service.\n"
    "# TYPE trio_broker_execserver_service_running gauge\n"
    'trio_broker_execserver_service_running{service="thumbnail"} 1.0\n'
    'trio_broker_execserver_service_running{service="video"} 0.0\n'
    "# HELP trio_broker_execserver_service_offered Outstanding offers of the service.\n"
    "# TYPE trio_broker_execserver_service_offered gauge\n"
    'trio_broker_execserver_service_offered{service="thumbnail"} 1.0\n'
    'trio_broker_execserver_service_offered{service="video"} 0.0\n'
    "# HELP trio_broker_execserver_service_parked Parked wants of the service.\n"
    "# TYPE trio_broker_execserver_service_parked gauge\n"
    'trio_broker_execserver_service_parked{service="thumbnail"} 3.0\n'
    'trio_broker_execserver_service_parked{service="video"} 0.0\n'
    "# HELP trio_broker_execserver_service_mean_runtime_seconds Rolling mean runtime.\n"
    "# TYPE trio_broker_execserver_service_mean_runtime_seconds gauge\n"
    'trio_broker_execserver_service_mean_runtime_seconds{service="thumbnail"} 0.25\n'
    "# HELP trio_broker_execserver_service_footprint_bytes Learned memory footprint.\n"
    "# TYPE trio_broker_execserver_service_footprint_bytes gauge\n"
    'trio_broker_execserver_service_footprint_bytes{service="thumbnail"} 4e+07\n'
    "# HELP trio_broker_execserver_service_jobs_completed_total Jobs of the service"
    " that ran to a measured end.\n"
    "# TYPE trio_broker_execserver_service_jobs_completed_total counter\n"
    'trio_broker_execserver_service_jobs_completed_total{service="thumbnail"} 7.0\n'
    'trio_broker_execserver_service_jobs_completed_total{service="video"} 0.0\n'
    "# HELP trio_broker_execserver_wants_total Count of wants.\n"
    "# TYPE trio_broker_execserver_wants_total counter\n"
    "trio_broker_execserver_wants_total 11.0\n"
    "# HELP trio_broker_execserver_offers_total Count of offers.\n"
    "# TYPE trio_broker_execserver_offers_total counter\n"
    "trio_broker_execserver_offers_total 9.0\n"
)


def test_the_document_of_a_snapshot() -> None:
    """Every member of the inspection document, for a snapshot with a runner."""
    assert execserver_document(statistics()) == DOCUMENT


def test_the_document_without_runner_statistics() -> None:
    """A runner that keeps no statistics leaves memory_used null and running empty."""
    document = execserver_document(statistics(with_runner=False))
    assert document["pool"]["memory_used"] is None
    assert document["running"] == []
    assert {k: v for k, v in document.items() if k not in ("pool", "running")} == {
        k: v for k, v in DOCUMENT.items() if k not in ("pool", "running")
    }


def test_the_metrics_of_a_snapshot() -> None:
    """The whole Prometheus exposition of a snapshot, line for line."""
    assert execserver_metrics(statistics()).decode() == METRICS


def test_the_snapshot_is_frozen() -> None:
    """ExecserverStatistics cannot be changed after it was taken."""
    stats = statistics()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        stats.runner = None  # type: ignore[misc]
