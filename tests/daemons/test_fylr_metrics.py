"""The fylr's histograms on its /metrics page, read by scraping it as Prometheus would:
queue age per priority band, slot wait and step duration per service and outcome."""

from __future__ import annotations

import datetime
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families
from trio_broker_daemons.fylr.config import FylrConfig

from tests.daemons.test_fylr import (
    WAIT,
    fylr_and_execserver,
    fylr_mapping,
    put,
    rows,
    running_fylr,
)
from trio_broker.trio.store import NewItem, Store, open_store

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(text: str) -> tuple[dict[str, str], Samples]:
    """The families' types and every sample, keyed by name and sorted labels."""
    types: dict[str, str] = {}
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return types, samples


def histogram(samples: Samples, name: str, **labels: str) -> tuple[list[float], float, float]:
    """A histogram's cumulative bucket counts (``le`` ascending, +Inf last), count and sum."""
    buckets: list[tuple[float, float]] = []
    count = total = None
    for (sample, found), value in samples.items():
        found_labels = dict(found)
        le = found_labels.pop("le", None)
        if found_labels != labels:
            continue
        if sample == f"{name}_bucket":
            assert le is not None
            buckets.append((float(le), value))
        elif sample in (f"{name}_count", f"{name}_gcount"):
            count = value
        elif sample in (f"{name}_sum", f"{name}_gsum"):
            total = value
    assert buckets, (name, labels)
    assert count is not None, (name, labels)
    assert total is not None, (name, labels)
    counts = [value for _, value in sorted(buckets)]
    assert counts == sorted(counts)  # cumulative
    assert counts[-1] == count
    return counts, count, total


async def test_slot_waits_and_step_durations_by_service_and_outcome(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Each step is counted once under its action, the service its job asked for and the
    dispatcher's outcome; each job's wait for a slot under its service and how it ended."""
    classes = {
        "text": {
            "extensions": ["txt"],
            "metadata": {"service": "mime"},
            "versions": {
                "gz": {"service": "gzip", "params": {"level": 9}},
                "sha256": {"service": "sha256"},
                "odd": {"service": "not_offered"},
            },
        }
    }
    async with fylr_and_execserver(pg_dsn, tmp_path, classes, retry_delay="1h") as (fylr, http):
        await put(http, "a.txt", b"some text\n")
        assert fylr.dispatcher is not None
        with trio.fail_after(WAIT):
            # metadata, sync and two versions done; the other version requeued
            await fylr.dispatcher.wait_until(lambda d: d.completed == 4 and d.requeued == 1)
        response = await http.get("/metrics")
        assert response.status_code == 200
    types, samples = scrape(response.text)
    assert types["trio_broker_fylr_step_duration_seconds"] == "histogram"
    assert types["trio_broker_fylr_slot_wait_seconds"] == "histogram"
    steps = "trio_broker_fylr_step_duration_seconds"
    for action, service, outcome in (
        ("metadata", "mime", "ok"),
        ("sync", "local", "ok"),
        ("produce", "gzip", "ok"),
        ("produce", "sha256", "ok"),
        ("produce", "not_offered", "unknown_service"),
    ):
        _, count, total = histogram(samples, steps, action=action, service=service, outcome=outcome)
        assert count == 1, (action, service, outcome)
        assert total > 0
    step_series = {labels for name, labels in samples if name == f"{steps}_count"}
    assert len(step_series) == 5
    waits = "trio_broker_fylr_slot_wait_seconds"
    for service, outcome in (
        ("mime", "offer"),
        ("gzip", "offer"),
        ("sha256", "offer"),
        ("not_offered", "unknown_service"),
    ):
        _, count, _ = histogram(samples, waits, service=service, outcome=outcome)
        assert count == 1, (service, outcome)
    assert len({labels for name, labels in samples if name == f"{waits}_count"}) == 4


async def test_queue_age_per_priority_band(pg_dsn: str, tmp_path: Path) -> None:
    """The claimable rows' ages per band, as they are at the scrape: an API-only node
    claims nothing, so every upload's first step waits; one is made 100 s old."""
    mapping = fylr_mapping(
        pg_dsn, tmp_path / "state", "127.0.0.1:1", {"text": {"extensions": ["txt"]}}
    )
    mapping["parallel"] = 0
    async with (
        running_fylr(FylrConfig.from_mapping(mapping)) as fylr,
        httpx.AsyncClient(base_url=fylr.url, timeout=WAIT) as http,
    ):
        for name, priority in (("a", 0), ("b", 0), ("c", 2), ("d", 3)):
            await put(http, f"{name}.txt", b"x\n", priority=priority)
        aged = rows(
            pg_dsn,
            "UPDATE broker_queue SET created_at = now() - interval '100 seconds'"
            " WHERE id = (SELECT min(id) FROM broker_queue) RETURNING priority",
        )
        assert aged == [(0,)]
        response = await http.get("/metrics")
        assert response.status_code == 200
    types, samples = scrape(response.text)
    # a gauge histogram: the text format writes its buckets as a histogram, _gcount and
    # _gsum as gauges
    assert types["trio_broker_fylr_queue_age_seconds"] == "histogram"
    name = "trio_broker_fylr_queue_age_seconds"
    counts, count, total = histogram(samples, name, band="normal")
    assert count == 2
    bounds = [
        float(dict(labels)["le"])
        for sample, labels in samples
        if sample == f"{name}_bucket" and dict(labels)["band"] == "normal"
    ]
    at = dict(zip(sorted(bounds), counts, strict=True))
    assert at[60.0] == 1  # the fresh one
    assert at[120.0] == 2  # and the one 100 s old
    assert 100 <= total < 100 + WAIT * 2
    assert histogram(samples, name, band="interactive")[1] == 1
    assert histogram(samples, name, band="interactive+1")[1] == 1
    assert not [labels for sample, labels in samples if dict(labels).get("band") == "background"]


@pytest.fixture
async def store(pg_dsn: str) -> AsyncIterator[Store]:
    async with open_store(pg_dsn, pool_size=2) as store:
        yield store


async def test_ready_ages_counts_only_claimable_rows_and_refuses_bad_bounds(
    store: Store,
) -> None:
    """Delayed, claimed and failed rows are not waiting to be claimed; bounds must rise."""
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)
    await store.enqueue_many(
        [
            NewItem(file_ref="1", action="a", priority=0),
            NewItem(file_ref="2", action="a", priority=0, start_after=later),
            NewItem(file_ref="3", action="a", priority=-2),
        ]
    )
    ages = await store.ready_ages([1.0, 10.0])
    assert sorted(ages) == [-2, 0]
    assert (ages[0].count, ages[-2].count) == (1, 1)
    assert ages[0].counts == (1, 0, 0)
    for bad in ([10.0, 1.0], [1.0, 1.0]):
        with pytest.raises(ValueError, match="ascending"):
            await store.ready_ages(bad)
