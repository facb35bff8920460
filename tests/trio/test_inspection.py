"""The execserver's inspection document and metrics, pinned on one hand-made snapshot.

The builders take frozen snapshots only, so a snapshot written out by hand pins
their whole output: the JSON of ``/inspect/system/execserver`` and the text of
``/metrics`` must not change shape.
"""

from __future__ import annotations

import typing
from typing import Any

import attrs
import pytest
from prometheus_client.parser import text_string_to_metric_families

from trio_broker import __version__
from trio_broker.core import protocol as p
from trio_broker.core.broker import (
    BrokerStatistics,
    ConnectionSnapshot,
    FinishedJob,
    ServiceSnapshot,
)
from trio_broker.trio.inspection import (
    OUTCOMES,
    ExecserverStatistics,
    JobFigures,
    execserver_document,
    execserver_metrics,
)
from trio_broker.trio.runner import ContainmentInfo, RunnerStatistics, RunningJob


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
                wait_s=0.5,
                client="fylr",
                receipt=p.Receipt(
                    status="ok",
                    exit_code=0,
                    error=None,
                    stderr_line=None,
                    stdout_prefix="hi\n" * 150,
                    stdout_bytes=450,
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
        containment=ContainmentInfo(
            mode="cgroup",
            cgroup="/sys/fs/cgroup/system.slice/x.service/trio-broker-inst-1",
            memory="cgroup",
            reason=None,
            subreaper=True,
            dumpable=False,
            keeper_pid=4200,
            job_user="nobody",
        ),
    )
    return broker, runner


def statistics(*, with_runner: bool = True) -> ExecserverStatistics:
    """The snapshot as ExecserverHandle.statistics() returns it (its recent jobs counted)."""
    broker, runner = snapshot()
    figures = JobFigures()
    for job in broker.recent:
        figures.record(job)
    return ExecserverStatistics(
        broker=broker, runner=runner if with_runner else None, jobs=figures.statistics()
    )


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
            "started_at": "2026-09-21T14:13:22.000Z",
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
            "client": None,
            "delivered": False,
            "wait_s": 0.0,
            "receipt": {
                "status": "stopped",
                "exit_code": None,
                "error": "the stream broke",
                "stderr_line": None,
                "stdout_prefix": "",
                "stdout_bytes": 0,
                "stdin_bytes": 0,
                "started_at": "2026-09-21T14:13:21.000Z",
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
            "client": "fylr",
            "delivered": True,
            "wait_s": 0.5,
            "receipt": {
                "status": "ok",
                "exit_code": 0,
                "error": None,
                "stderr_line": None,
                "stdout_prefix": ("hi\n" * 150)[:200] + "…",  # a short prefix only
                "stdout_bytes": 450,
                "stdin_bytes": 0,
                "started_at": "2026-09-21T14:13:20.250Z",
                "duration_s": 0.031,
                "peak_memory": 18874368,
                "instance_id": "inst-1",
            },
        },
    ],
    "counters": {"wants": 11, "offers": 9},
    "caches": {},
    "containment": {
        "mode": "cgroup",
        "cgroup": "/sys/fs/cgroup/system.slice/x.service/trio-broker-inst-1",
        "memory": "cgroup",
        "reason": None,
        "subreaper": True,
        "dumpable": False,
        "keeper_pid": 4200,
        "job_user": "nobody",
    },
}
METRICS_HEAD = (
    "# HELP trio_broker_build_info The trio_broker version serving these figures (always 1).\n"
    "# TYPE trio_broker_build_info gauge\n"
    f'trio_broker_build_info{{version="{__version__}"}} 1.0\n'
    "# HELP trio_broker_execserver_info This execserver's name and instance id (always 1).\n"
    "# TYPE trio_broker_execserver_info gauge\n"
    'trio_broker_execserver_info{instance_id="inst-1",name="exec-a"} 1.0\n'
    "# HELP trio_broker_execserver_slots Slots in the pool.\n"
    "# TYPE trio_broker_execserver_slots gauge\n"
    "trio_broker_execserver_slots 4.0\n"
    "# HELP trio_broker_execserver_busy Slots running a job or holding an offer.\n"
    "# TYPE trio_broker_execserver_busy gauge\n"
    "trio_broker_execserver_busy 2.0\n"
)
"""The start of the exposition, line for line."""

WAIT = "trio_broker_execserver_job_wait_seconds"
DURATION = "trio_broker_execserver_job_duration_seconds"
THUMB = ("service", "thumbnail")
SAMPLES = {
    ("trio_broker_execserver_idle", ()): 1.0,
    ("trio_broker_execserver_fast_reserve", ()): 1.0,
    ("trio_broker_execserver_unknown_cap", ()): 2.0,
    ("trio_broker_execserver_connections", ()): 2.0,
    ("trio_broker_execserver_draining", ()): 0.0,
    ("trio_broker_execserver_memory_budget_bytes", ()): 8e9,
    ("trio_broker_execserver_memory_reserved_bytes", ()): 1e8,
    ("trio_broker_execserver_memory_used_bytes", ()): 3e7,
    ("trio_broker_execserver_service_running", (("service", "thumbnail"),)): 1.0,
    ("trio_broker_execserver_service_parked", (("service", "thumbnail"),)): 3.0,
    ("trio_broker_execserver_service_capacity", (("service", "video"),)): 2.0,
    ("trio_broker_execserver_service_mean_runtime_seconds", (("service", "thumbnail"),)): 0.25,
    ("trio_broker_execserver_service_footprint_bytes", (("service", "thumbnail"),)): 4e7,
    ("trio_broker_execserver_service_peak_memory_bytes", (("service", "thumbnail"),)): 5e7,
    ("trio_broker_execserver_service_jobs_completed_total", (("service", "thumbnail"),)): 7.0,
    ("trio_broker_execserver_jobs_total", (("service", "thumbnail"), ("status", "ok"))): 1.0,
    ("trio_broker_execserver_jobs_total", (("service", "thumbnail"), ("status", "stopped"))): 1.0,
    ("trio_broker_execserver_jobs_total", (("service", "thumbnail"), ("status", "failed"))): 0.0,
    ("trio_broker_execserver_jobs_total", (("service", "video"), ("status", "ok"))): 0.0,
    (f"{WAIT}_bucket", (("le", "0.25"), THUMB)): 1.0,
    (f"{WAIT}_bucket", (("le", "0.5"), THUMB)): 2.0,
    (f"{WAIT}_bucket", (("le", "+Inf"), THUMB)): 2.0,
    (f"{WAIT}_sum", (("service", "thumbnail"),)): 0.5,
    (f"{WAIT}_count", (("service", "thumbnail"),)): 2.0,
    (f"{DURATION}_bucket", (("le", "0.01"), THUMB)): 0.0,
    (f"{DURATION}_bucket", (("le", "0.05"), THUMB)): 1.0,
    (f"{DURATION}_bucket", (("le", "1"), THUMB)): 1.0,
    (f"{DURATION}_bucket", (("le", "2.5"), THUMB)): 2.0,
    (f"{DURATION}_sum", (("service", "thumbnail"),)): 2.031,
    (f"{DURATION}_count", (("service", "video"),)): 0.0,
    ("trio_broker_execserver_wants_total", ()): 11.0,
    ("trio_broker_execserver_offers_total", ()): 9.0,
}  # fmt: skip
"""Samples of the exposition: two jobs ended, waits 0 and 0.5 s, durations 0.031 and 2 s."""


def test_the_document_of_a_snapshot() -> None:
    """Every member of the inspection document, for a snapshot with a runner."""
    assert execserver_document(statistics()) == DOCUMENT


def test_the_document_without_runner_statistics() -> None:
    """A runner that keeps no statistics leaves memory_used and containment null, running empty."""
    document = execserver_document(statistics(with_runner=False))
    assert document["pool"]["memory_used"] is None
    assert document["running"] == []
    assert document["containment"] is None
    left_out = ("pool", "running", "containment")
    assert {k: v for k, v in document.items() if k not in left_out} == {
        k: v for k, v in DOCUMENT.items() if k not in left_out
    }


def test_the_metrics_of_a_snapshot() -> None:
    """The exposition starts as pinned and holds every pinned sample, histograms included."""
    text = execserver_metrics(statistics()).decode()
    assert text.startswith(METRICS_HEAD)
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    for key, value in SAMPLES.items():
        assert samples[key] == pytest.approx(value), key


def test_every_metric_has_a_help_text_of_its_own() -> None:
    """No HELP is generated from the metric's name; each says what it counts."""
    text = execserver_metrics(statistics()).decode()
    families = list(text_string_to_metric_families(text))
    assert len(families) >= 25
    for family in families:
        assert family.documentation, family.name
        assert not family.documentation.startswith(("Count of", "Broker events counted"))
    helps = [family.documentation for family in families]
    assert len(set(helps)) == len(helps)


def test_jobs_are_counted_by_the_receipt_statuses() -> None:
    """jobs_total has one series per service and receipt status: the shared outcome words."""
    assert OUTCOMES == typing.get_args(p.Status)
    text = execserver_metrics(statistics()).decode()
    (family,) = [f for f in text_string_to_metric_families(text) if f.name.endswith("_jobs")]
    statuses = {s.labels["status"] for s in family.samples if s.name.endswith("_total")}
    assert statuses == set(OUTCOMES)


def test_histograms_count_into_the_first_bucket_that_holds_the_value() -> None:
    """A value on a bound counts in that bucket (le means at most); beyond the last, in +Inf."""
    figures = JobFigures()
    base = snapshot()[0].recent[0]
    for wait in (0.005, 0.0051, 1000.0):
        figures.record(attrs.evolve(base, wait_s=wait))
    wait_histogram = figures.statistics().services["thumbnail"].wait
    cumulative = dict(wait_histogram.cumulative())
    assert (cumulative["0.005"], cumulative["0.01"], cumulative["600"]) == (1, 2, 2)
    assert cumulative["+Inf"] == wait_histogram.count == 3


def test_the_snapshot_is_frozen() -> None:
    """ExecserverStatistics cannot be changed after it was taken."""
    stats = statistics()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        stats.runner = None  # type: ignore[misc]
