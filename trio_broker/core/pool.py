"""The slot pool: which services fit right now, and what each service is like.

Theory of operation
===================

One pool of ``size`` slots is shared by every service an execserver offers. A
slot is *busy* while it holds an unredeemed offer or runs a job; busy slots count
against every limit below. A service *fits* when one more busy slot of it would
respect all of these at once:

* **the pool**: fewer than ``size`` slots are busy;
* **max_slots**: the service's own cap (0 = none beyond the pool);
* **the fast reserve**: a *heavy* service never takes the last ``fast_reserve``
  slots, so short work always finds one however busy the conversions are;
* **unknown_share**: services not measured yet together hold at most
  ``max(1, floor(unknown_share * size))`` slots, until their first runs classify
  them;
* **the memory budget**: the learned footprints of the busy slots plus this
  service's footprint stay within the budget. A service without a measured
  footprint reserves nothing. So that no service starves for ever, a service
  whose footprint alone exceeds the budget still fits when nothing else holds
  memory.

Classification. A service is ``unknown`` until a job of it has run. Then its
rolling mean runtime over the last ``window`` runs decides: ``heavy`` at or above
``heavy_threshold``, ``light`` below. Runs that count are the ones where a command
actually ran to an end the runner observed: ``ok``, ``failed``, ``timed_out``,
``stalled``, ``out_of_memory``. A cancelled, stopped or unstartable job says
nothing about how long the service takes. The footprint is the highest peak memory
among the last ``window`` measured runs (conservative on purpose: admitting by
a typical run would overcommit memory with every large one).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import Final

import attrs

from trio_broker.core.protocol import Kind, Receipt

__all__ = ["MEASURED_STATUSES", "PoolConfig", "ServiceStats", "SlotPool"]

MEASURED_STATUSES: Final = frozenset({"ok", "failed", "timed_out", "stalled", "out_of_memory"})
"""Receipt statuses whose runtime and memory peak teach the pool about a service."""


def _positive(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be at least 1, got {value}")


@attrs.frozen(kw_only=True)
class PoolConfig:
    """The limits of one slot pool (values already resolved: no "auto", no -1).

    Attributes:
        size: slots in the pool.
        fast_reserve: slots heavy services never take (0 <= fast_reserve <= size).
        heavy_threshold: mean runtime in seconds at or above which a service is heavy.
        unknown_share: share of the pool unmeasured services may hold together.
        memory_budget: bytes the busy slots' footprints may add up to; None = no limit.
        max_slots: every offered service with its cap (0 = no cap beyond the pool).
        window: how many recent runs the rolling mean and footprint look at.
        priority_aging: seconds of waiting per band a parked want rises (one band
            is 2; never above the top band, 4 or 5 for the high variant); None =
            strict priority. See *Aging* in :mod:`trio_broker.core.book`.
    """

    size: int = attrs.field(validator=_positive)
    fast_reserve: int = 0
    heavy_threshold: float = 10.0
    unknown_share: float = 0.5
    memory_budget: int | None = None
    max_slots: Mapping[str, int] = attrs.field(factory=dict)
    window: int = attrs.field(default=20, validator=_positive)
    priority_aging: float | None = None

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.fast_reserve <= self.size:
            raise ValueError(f"fast_reserve must be within 0..{self.size}, got {self.fast_reserve}")
        if not 0 < self.unknown_share <= 1:
            raise ValueError(f"unknown_share must be within (0, 1], got {self.unknown_share}")
        if self.priority_aging is not None and not self.priority_aging > 0:
            raise ValueError(
                f"priority_aging must be positive seconds or None, got {self.priority_aging}"
            )
        if self.heavy_threshold <= 0:
            raise ValueError(f"heavy_threshold must be positive, got {self.heavy_threshold}")
        for name, cap in self.max_slots.items():
            if cap < 0:
                raise ValueError(f"max_slots of {name!r} must be >= 0, got {cap}")

    @property
    def unknown_cap(self) -> int:
        """The most slots unmeasured services may hold together."""
        return max(1, math.floor(self.unknown_share * self.size))


class ServiceStats:
    """What the pool knows about one service: its limits, recent runs and load.

    ``kind``, ``mean_runtime`` and ``footprint`` are kept up to date by
    :meth:`record`, so reading them on the grant path costs nothing.
    """

    __slots__ = (
        "_heavy_threshold",
        "_peaks",
        "_runtimes",
        "busy",
        "cap",
        "completed",
        "footprint",
        "kind",
        "mean_runtime",
        "peak_memory",
    )

    def __init__(self, window: int, cap: int, heavy_threshold: float) -> None:
        self._runtimes: deque[float] = deque(maxlen=window)
        self._peaks: deque[int] = deque(maxlen=window)
        self._heavy_threshold = heavy_threshold
        self.cap = cap
        self.busy = 0
        self.completed = 0
        self.peak_memory: int | None = None
        self.mean_runtime: float | None = None
        """Rolling mean runtime in seconds; None until a run was measured."""
        self.footprint: int | None = None
        """The highest memory peak among the recent runs; None until measured."""
        self.kind: Kind = "unknown"

    def __repr__(self) -> str:
        return (
            f"ServiceStats(cap={self.cap!r}, busy={self.busy!r}, completed={self.completed!r}, "
            f"kind={self.kind!r}, mean_runtime={self.mean_runtime!r}, "
            f"peak_memory={self.peak_memory!r}, footprint={self.footprint!r})"
        )

    def record(self, duration: float, peak_memory: int | None) -> None:
        runtimes = self._runtimes
        runtimes.append(duration)
        self.completed += 1
        # recomputed from the window, so rounding errors never accumulate
        self.mean_runtime = max(0.0, math.fsum(runtimes) / len(runtimes))
        self.kind = "heavy" if self.mean_runtime >= self._heavy_threshold else "light"
        if peak_memory is not None:
            self._peaks.append(peak_memory)
            self.footprint = max(self._peaks)
            if self.peak_memory is None or peak_memory > self.peak_memory:
                self.peak_memory = peak_memory


class SlotPool:
    """Admission arithmetic for one pool. Pure: no I/O, no clock."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.busy = 0
        self.memory_reserved = 0
        self._unknown_busy = 0
        self._kinds: tuple[tuple[str, Kind], ...] | None = None
        self.services: dict[str, ServiceStats] = {
            name: ServiceStats(config.window, cap, config.heavy_threshold)
            for name, cap in config.max_slots.items()
        }
        self._size = config.size
        self._heavy_limit = config.size - config.fast_reserve
        self._unknown_cap = config.unknown_cap
        self._budget = config.memory_budget

    # -- queries -------------------------------------------------------------------

    @property
    def size(self) -> int:
        return self._size

    @property
    def free(self) -> int:
        """Slots neither running nor holding an offer."""
        return self._size - self.busy

    def offers(self, service: str) -> bool:
        """Whether this pool offers the service at all."""
        return service in self.services

    def kind(self, service: str) -> Kind:
        """``light``, ``heavy`` or ``unknown`` (not measured yet)."""
        return self.services[service].kind

    def unknown_busy(self) -> int:
        """Busy slots held by services that are unmeasured now."""
        return self._unknown_busy

    def fits(self, service: str) -> bool:
        """Whether one more slot of this service respects every limit right now."""
        if self.busy >= self._size:
            return False
        return self._fits(self.services[service])

    def _fits(self, stats: ServiceStats) -> bool:
        cap = stats.cap
        if cap and stats.busy >= cap:
            return False
        kind = stats.kind
        if kind == "unknown":
            if self._unknown_busy >= self._unknown_cap:
                return False
        elif kind == "heavy" and self.busy + 1 > self._heavy_limit:
            return False
        budget = self._budget
        if budget is not None and self.memory_reserved:
            footprint = stats.footprint
            if footprint is not None and self.memory_reserved + footprint > budget:
                return False
        return True

    def fitting(self) -> list[str]:
        """Every offered service that fits right now."""
        if self.busy >= self._size:
            return []
        fits = self._fits
        return [name for name, stats in self.services.items() if fits(stats)]

    def capacity(self, service: str) -> int:
        """The most slots this service may hold under the pool's static limits."""
        config = self.config
        result = config.size
        cap = config.max_slots[service]
        if cap:
            result = min(result, cap)
        kind = self.kind(service)
        if kind == "heavy":
            result = min(result, config.size - config.fast_reserve)
        elif kind == "unknown":
            result = min(result, config.unknown_cap)
        return result

    def mean_runtime(self, service: str) -> float | None:
        return self.services[service].mean_runtime

    def kinds(self) -> tuple[tuple[str, Kind], ...]:
        """Every service with its kind, in configuration order."""
        if self._kinds is None:
            self._kinds = tuple((name, stats.kind) for name, stats in self.services.items())
        return self._kinds

    # -- changes -------------------------------------------------------------------

    def acquire(self, service: str) -> int:
        """Make one slot of this service busy; returns the memory it reserved.

        Raises:
            RuntimeError: the service does not fit (the caller checks first).
        """
        stats = self.services[service]
        if self.busy >= self._size or not self._fits(stats):
            raise RuntimeError(f"service {service!r} does not fit the pool now")
        self.busy += 1
        stats.busy += 1
        if stats.kind == "unknown":
            self._unknown_busy += 1
        reserved = stats.footprint or 0
        self.memory_reserved += reserved
        return reserved

    def release(self, service: str, reserved: int) -> None:
        """Free a slot taken by :meth:`acquire` (with what it returned)."""
        stats = self.services[service]
        if stats.busy <= 0:  # the pool's count is the sum of the services'
            raise RuntimeError(f"release of {service!r} without a busy slot")
        stats.busy -= 1
        self.busy -= 1
        if stats.kind == "unknown":
            self._unknown_busy -= 1
        self.memory_reserved -= reserved

    def record(self, service: str, receipt: Receipt) -> bool:
        """Learn from a finished job. Returns True when the service's kind changed."""
        if receipt.status not in MEASURED_STATUSES:
            return False
        stats = self.services[service]
        before = stats.kind
        if before == "unknown":
            self._unknown_busy -= stats.busy
        stats.record(receipt.duration_s, receipt.peak_memory)
        self._kinds = None
        return stats.kind != before

    def check_invariants(self) -> None:
        """Raise AssertionError when the counters disagree or a limit is broken."""
        config = self.config
        assert self.busy == sum(s.busy for s in self.services.values())
        assert self._unknown_busy == sum(
            s.busy for s in self.services.values() if s.kind == "unknown"
        )
        assert self._unknown_busy <= config.unknown_cap
        assert 0 <= self.busy <= config.size
        assert self.memory_reserved >= 0
        for name, stats in self.services.items():
            assert stats.busy >= 0
            assert stats.kind == (
                "unknown"
                if stats.mean_runtime is None
                else "heavy"
                if stats.mean_runtime >= config.heavy_threshold
                else "light"
            )
            cap = config.max_slots[name]
            assert not cap or stats.busy <= cap, f"{name} holds {stats.busy} > max_slots {cap}"
