"""The slot pool alone: its configuration, classification and admission arithmetic.

The broker tests and the model checks drive the pool through the broker; these
pin each limit at its boundary, so a loosened or tightened comparison shows.
"""

from __future__ import annotations

from typing import Any

import pytest

from trio_broker.core.pool import MEASURED_STATUSES, PoolConfig, SlotPool
from trio_broker.core.protocol import Status
from trio_broker.testing.values import receipt


def pool(size: int = 4, **config: Any) -> SlotPool:
    config.setdefault("max_slots", {"s": 0})
    return SlotPool(PoolConfig(size=size, **config))


def classify(slots: SlotPool, service: str, seconds: float, peak: int | None = None) -> None:
    slots.record(service, receipt("ok", duration=seconds, peak_memory=peak))


# -- configuration ----------------------------------------------------------------------


def test_documented_defaults() -> None:
    config = PoolConfig(size=3)
    assert config.fast_reserve == 0
    assert config.heavy_threshold == 10.0
    assert config.unknown_share == 0.5
    assert config.memory_budget is None
    assert dict(config.max_slots) == {}
    assert config.window == 20
    assert config.priority_aging is None


def test_configuration_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        PoolConfig(3)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"size": 0}, "size must be at least 1, got 0"),
        ({"size": 2, "window": 0}, "window must be at least 1, got 0"),
        ({"size": 2, "fast_reserve": -1}, r"fast_reserve must be within 0\.\.2, got -1"),
        ({"size": 2, "fast_reserve": 3}, r"fast_reserve must be within 0\.\.2, got 3"),
        ({"size": 2, "unknown_share": 0.0}, r"unknown_share must be within \(0, 1\]"),
        ({"size": 2, "unknown_share": 1.01}, r"unknown_share must be within \(0, 1\]"),
        ({"size": 2, "priority_aging": 0.0}, "priority_aging must be positive"),
        ({"size": 2, "heavy_threshold": 0.0}, "heavy_threshold must be positive, got 0.0"),
        ({"size": 2, "max_slots": {"a": -1}}, "max_slots of 'a' must be >= 0, got -1"),
    ],
)
def test_bad_configuration_names_the_field(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PoolConfig(**config)


def test_edges_of_the_configuration_are_accepted() -> None:
    PoolConfig(size=1, window=1)
    PoolConfig(size=2, fast_reserve=0)
    PoolConfig(size=2, fast_reserve=2)
    PoolConfig(size=2, unknown_share=1.0)
    PoolConfig(size=2, unknown_share=0.01)
    PoolConfig(size=2, priority_aging=0.001)
    PoolConfig(size=2, heavy_threshold=0.001)
    PoolConfig(size=2, max_slots={"a": 0})


@pytest.mark.parametrize(
    ("size", "share", "cap"),
    [(4, 0.5, 2), (3, 0.5, 1), (5, 0.5, 2), (1, 0.5, 1), (2, 0.1, 1), (10, 1.0, 10)],
)
def test_unknown_cap_is_the_floor_of_the_share_but_at_least_one(
    size: int, share: float, cap: int
) -> None:
    assert PoolConfig(size=size, unknown_share=share).unknown_cap == cap


# -- classification ---------------------------------------------------------------------


def test_kind_is_heavy_at_the_threshold_and_light_below() -> None:
    slots = pool(max_slots={"a": 0, "b": 0}, heavy_threshold=2.0)
    assert slots.kind("a") == slots.kind("b") == "unknown"
    assert slots.record("a", receipt("ok", duration=2.0))
    assert slots.record("b", receipt("ok", duration=1.999))
    assert (slots.kind("a"), slots.kind("b")) == ("heavy", "light")


def test_mean_runtime_is_over_the_window_only() -> None:
    slots = pool(window=3, heavy_threshold=5.0)
    assert slots.mean_runtime("s") is None
    for seconds in (100.0, 1.0, 2.0, 3.0):
        classify(slots, "s", seconds)
    assert slots.mean_runtime("s") == pytest.approx(2.0)
    assert slots.kind("s") == "light"
    assert slots.services["s"].completed == 4


def test_the_default_window_is_twenty_runs() -> None:
    slots = pool()
    classify(slots, "s", 21.0)
    for _ in range(20):
        classify(slots, "s", 1.0)
    assert slots.mean_runtime("s") == pytest.approx(1.0)


def test_footprint_is_the_window_peak_and_peak_memory_the_highest_ever() -> None:
    slots = pool(window=2)

    def memory(peak: int | None) -> tuple[int | None, int | None]:
        classify(slots, "s", 1.0, peak=peak)
        stats = slots.services["s"]
        return stats.footprint, stats.peak_memory

    assert memory(None) == (None, None)
    assert memory(500) == (500, 500)
    assert memory(200) == (500, 500)
    assert memory(100) == (200, 500)  # 500 left the window of peaks
    assert memory(700) == (700, 700)


def test_only_measured_statuses_teach_the_pool() -> None:
    assert MEASURED_STATUSES == {"ok", "failed", "timed_out", "stalled", "out_of_memory"}
    slots = pool()
    unmeasured: tuple[Status, ...] = ("cancelled", "error", "stopped")
    for status in unmeasured:
        assert not slots.record("s", receipt(status, duration=50.0))
    assert slots.kind("s") == "unknown"
    assert slots.services["s"].completed == 0
    assert slots.record("s", receipt("stalled", duration=50.0))
    assert slots.kind("s") == "heavy"


def test_record_says_whether_the_kind_changed() -> None:
    slots = pool(heavy_threshold=10.0, window=1)
    assert slots.record("s", receipt("ok", duration=1.0))  # unknown -> light
    assert not slots.record("s", receipt("ok", duration=2.0))  # light -> light
    assert slots.record("s", receipt("ok", duration=11.0))  # light -> heavy


# -- admission --------------------------------------------------------------------------


def test_the_pool_size_bounds_every_service() -> None:
    slots = pool(2, max_slots={"a": 0, "b": 0}, unknown_share=1.0)
    assert (slots.size, slots.free) == (2, 2)
    assert slots.offers("a")
    assert not slots.offers("c")
    slots.acquire("a")
    assert slots.fits("b")
    assert slots.fitting() == ["a", "b"]
    slots.acquire("b")
    assert slots.free == 0
    assert not slots.fits("a")
    assert slots.fitting() == []
    with pytest.raises(RuntimeError, match="does not fit"):
        slots.acquire("a")


def test_a_cap_holds_at_its_value_and_zero_is_no_cap() -> None:
    slots = pool(4, max_slots={"capped": 2, "free": 0}, unknown_share=1.0)
    slots.acquire("capped")
    assert slots.fits("capped")
    slots.acquire("capped")
    assert not slots.fits("capped")
    assert slots.fitting() == ["free"]
    slots.acquire("free")
    assert slots.fits("free")
    assert slots.capacity("capped") == 2
    assert slots.capacity("free") == 4


def test_unmeasured_services_share_the_unknown_cap() -> None:
    slots = pool(4, max_slots={"a": 0, "b": 0, "known": 0}, unknown_share=0.5)
    classify(slots, "known", 1.0)
    slots.acquire("a")
    assert slots.unknown_busy() == 1
    assert slots.fits("b")
    slots.acquire("b")
    assert slots.unknown_busy() == 2
    assert not slots.fits("a")
    assert not slots.fits("b")
    assert slots.fits("known")
    slots.acquire("known")
    assert slots.unknown_busy() == 2
    assert slots.capacity("a") == 2
    assert slots.capacity("known") == 4


def test_classifying_a_busy_service_frees_its_unknown_slots() -> None:
    slots = pool(4, max_slots={"a": 0, "b": 0}, unknown_share=0.5)
    slots.acquire("a")
    slots.acquire("a")
    assert not slots.fits("b")
    classify(slots, "a", 1.0)  # a's two running slots are light now
    assert slots.unknown_busy() == 0
    assert slots.fits("b")
    slots.release("a", 0)
    assert slots.unknown_busy() == 0


def test_heavy_services_leave_the_fast_reserve() -> None:
    slots = pool(4, max_slots={"heavy": 0, "light": 0}, fast_reserve=1, heavy_threshold=5.0)
    classify(slots, "heavy", 9.0)
    classify(slots, "light", 1.0)
    assert slots.capacity("heavy") == 3
    assert slots.capacity("light") == 4
    slots.acquire("heavy")
    slots.acquire("heavy")
    assert slots.fits("heavy")  # the third: 3 busy = size - reserve
    slots.acquire("heavy")
    assert not slots.fits("heavy")
    assert slots.fitting() == ["light"]
    slots.acquire("light")


def test_memory_budget_counts_footprints_to_the_byte() -> None:
    slots = pool(4, max_slots={"big": 0, "small": 0, "new": 0}, memory_budget=1000)
    classify(slots, "big", 1.0, peak=600)
    classify(slots, "small", 1.0, peak=400)
    assert slots.acquire("big") == 600
    assert slots.memory_reserved == 600
    assert slots.fits("small")  # 600 + 400 = the budget exactly
    assert not slots.fits("big")
    assert slots.fits("new")  # unmeasured: reserves nothing
    assert slots.acquire("new") == 0
    assert slots.acquire("small") == 400
    assert not slots.fits("small")
    slots.release("small", 400)
    slots.release("big", 600)
    assert slots.memory_reserved == 0


def test_a_footprint_beyond_the_budget_fits_when_nothing_else_holds_memory() -> None:
    slots = pool(4, max_slots={"huge": 0, "other": 0}, memory_budget=100)
    classify(slots, "huge", 1.0, peak=500)
    classify(slots, "other", 1.0, peak=None)
    slots.acquire("other")  # busy, but reserves no memory
    assert slots.fits("huge")
    assert slots.acquire("huge") == 500
    assert not slots.fits("huge")


def test_release_undoes_acquire() -> None:
    slots = pool(3, max_slots={"a": 1, "b": 0}, unknown_share=1.0)
    slots.acquire("a")
    slots.acquire("b")
    slots.release("a", 0)
    assert (slots.busy, slots.free, slots.unknown_busy()) == (1, 2, 1)
    assert slots.services["a"].busy == 0
    assert slots.fits("a")
    slots.release("b", 0)
    assert (slots.busy, slots.unknown_busy()) == (0, 0)
    with pytest.raises(RuntimeError, match="without a busy slot"):
        slots.release("b", 0)
    slots.check_invariants()


def test_release_of_an_idle_service_is_refused_while_another_is_busy() -> None:
    slots = pool(3, max_slots={"a": 0, "b": 0}, unknown_share=1.0)
    slots.acquire("a")
    with pytest.raises(RuntimeError, match="without a busy slot"):
        slots.release("b", 0)
    assert slots.busy == 1


def test_kinds_follow_the_configuration_order_and_each_record() -> None:
    slots = pool(max_slots={"z": 0, "a": 0}, heavy_threshold=5.0)
    assert slots.kinds() == (("z", "unknown"), ("a", "unknown"))
    classify(slots, "a", 9.0)
    assert slots.kinds() == (("z", "unknown"), ("a", "heavy"))
    classify(slots, "z", 1.0)
    assert slots.kinds() == (("z", "light"), ("a", "heavy"))


def test_a_full_pool_refuses_even_a_measured_service_without_limits() -> None:
    slots = pool(1, max_slots={"s": 0})
    classify(slots, "s", 1.0)  # light, no cap, no memory: only the pool bounds it
    slots.acquire("s")
    assert not slots.fits("s")
    assert slots.fitting() == []
    with pytest.raises(RuntimeError, match="does not fit"):
        slots.acquire("s")
    assert slots.busy == 1
