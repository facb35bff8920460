"""The shared timer heap of the sans-IO cores: cancelled timers are never due."""

from __future__ import annotations

from typing import Any, Literal

from trio_broker.core.liveness import Liveness
from trio_broker.core.sansio import SansIOCore


class Timers(SansIOCore[str, Literal["t", "ping", "dead"]]):
    def __init__(self) -> None:
        super().__init__(now=0.0, liveness=Liveness(5.0, 15.0))
        self.fired: list[Any] = []

    def _fire(self, kind: Literal["t", "ping", "dead"], key: Any, now: float) -> None:
        self.fired.append(key)


def test_a_cancelled_timer_is_never_reported_nor_fired() -> None:
    core = Timers()
    first = core._push_timer(1.0, "t", "first")
    core._push_timer(2.0, "t", "second")
    assert core.next_deadline() == 1.0
    core._cancel_timer(first)
    assert core.next_deadline() == 2.0  # the driver sleeps until a live timer only
    core.tick(now=5.0)
    assert core.fired == ["second"]
    assert core.next_deadline() is None


def test_cancelled_entries_are_compacted_away() -> None:
    """Many cancelled timers far in the future do not pile up in the heap."""
    core = Timers()
    core._push_timer(1.0, "t", "live")
    for i in range(1000):
        core._cancel_timer(core._push_timer(100.0 + i, "t", i))
    assert len(core._timers) < 200
    core.tick(now=2000.0)
    assert core.fired == ["live"]
