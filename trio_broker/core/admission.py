"""Admission arithmetic: how many queue items a dispatcher may have in flight.

Theory of operation
===================

A dispatcher (one per client process) claims queue items and runs each to its
end. *Exec-bound* items hold a slot on some execserver while they run; how many
of them one client should have in flight follows from what the execservers
announce in their ``HELLO`` (one :class:`InstanceLoad` per connected,
non-draining execserver instance) and from what the client sees itself. The
rules, all in :func:`exec_limit`:

1. **Fair share.** Each instance's ``processes`` slots are split evenly among
   its ``clients``: the base is ``Σ ceil(processes / clients)`` over the
   instances. With no instance (no execserver reachable, or all draining) the
   limit is 0: nothing exec-bound is claimed.
2. **Headroom.** A few items more than the share (``headroom``) keep the next
   want parked while a slot is busy, so a freed slot never waits for a claim.
3. **Idle slots.** While the queue is deep (the last claim got all it asked
   for) and none of this client's jobs waits for a slot, the slots the
   execservers report ``idle`` are unused by anyone: the limit rises by them.
   Every client sees the same ``idle`` figure, so each takes its share of it,
   ``ceil(idle / clients)`` per instance, not all of it.
4. **Waiting jobs.** Jobs of this client that wait at the execservers for a slot
   beyond the headroom mean it is already ahead of its share: the limit drops by
   their number (not below 0). The first ``headroom`` waiting jobs are the
   pipelining the headroom is for (wants parked ahead of the next freed slot), so
   they do not lower it: counting them would leave fewer wants parked than the
   headroom asks for, and a freed slot would wait for the next claim.
5. **Cap.** ``max_in_flight`` bounds the result; 0 means automatic:
   ``4 × base``, at least 32, at most twice the database pool (every item in
   flight may need a database connection now and then).

Priority bands. Priorities come in bands (background −2, normal 0, interactive 2,
synchronous 4) and an odd priority is the "high" variant of the band below it.
A few admission slots beyond the limit are reserved for odd priorities
(:func:`odd_reserve`; the dispatcher plans with ``limit + reserve``, of which
even items hold at most ``limit``), so urgent work is claimed at the next claim
even behind a full queue, and even items keep their whole share and headroom.

*Local-bound* items (work the client does itself) have their own limit, a
semaphore of the CPU count; :func:`plan_claims` turns both limits and what is in
flight into how many items one claim asks for, per kind.

Everything here is pure: no trio, no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs

__all__ = [
    "AdmissionConfig",
    "ClaimPlan",
    "InstanceLoad",
    "auto_max_in_flight",
    "exec_limit",
    "fair_share",
    "is_odd",
    "odd_reserve",
    "plan_claims",
]

MIN_AUTO_IN_FLIGHT = 32
"""The automatic cap is at least this many items (before the database bound)."""


def _not_negative(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be at least 0, got {value}")


def _positive(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be at least 1, got {value}")


@attrs.frozen(kw_only=True)
class InstanceLoad:
    """What one execserver instance announced in its latest ``HELLO``.

    Attributes:
        instance_id: the instance (several connections may reach one).
        processes: its pool size in slots.
        clients: its open broker connections, this client's included.
        idle: slots outside its fast reserve that stayed free through the last second.
    """

    instance_id: str
    processes: int = attrs.field(validator=_not_negative)
    clients: int = attrs.field(validator=_not_negative)
    idle: int = attrs.field(validator=_not_negative)


@attrs.frozen(kw_only=True)
class AdmissionConfig:
    """The knobs of :func:`exec_limit`.

    Attributes:
        headroom: items admitted beyond the fair share (pipelining).
        odd_reserve: admission slots kept for odd priorities (see :func:`odd_reserve`).
        max_in_flight: a fixed cap on exec-bound items in flight; 0 = automatic.
        db_pool: the database pool size, which bounds the automatic cap.
        use_idle: raise the limit by the execservers' idle slots while the queue
            is deep (rule 3).
    """

    headroom: int = attrs.field(default=2, validator=_not_negative)
    odd_reserve: int = attrs.field(default=2, validator=_not_negative)
    max_in_flight: int = attrs.field(default=0, validator=_not_negative)
    db_pool: int = attrs.field(default=10, validator=_positive)
    use_idle: bool = True


@attrs.frozen(kw_only=True)
class ClaimPlan:
    """How many items one claim asks for.

    Attributes:
        general: exec-bound items of any priority.
        odd_only: further exec-bound items of odd priority only (the reserve).
        local: local-bound items.
    """

    general: int = 0
    odd_only: int = 0
    local: int = 0

    @property
    def exec_total(self) -> int:
        """Exec-bound items asked for."""
        return self.general + self.odd_only

    @property
    def total(self) -> int:
        """Items asked for in all; 0 means no claim is needed."""
        return self.general + self.odd_only + self.local


def is_odd(priority: int) -> bool:
    """Whether ``priority`` is the "high" variant of its band (−1, 1, 3, 5…)."""
    return priority % 2 != 0


def fair_share(loads: Iterable[InstanceLoad]) -> int:
    """``Σ ceil(processes / clients)`` over the instances (a client counts itself).

    An instance that announces no clients (a ``HELLO`` read before this client's
    connection counted) is treated as having one.
    """
    return sum(math.ceil(load.processes / max(1, load.clients)) for load in loads)


def auto_max_in_flight(base: int, db_pool: int) -> int:
    """The automatic cap: ``4 × base``, at least 32, at most ``2 × db_pool``."""
    return min(max(4 * base, MIN_AUTO_IN_FLIGHT), 2 * db_pool)


def exec_limit(
    loads: Iterable[InstanceLoad],
    *,
    waiting: int,
    queue_deep: bool,
    config: AdmissionConfig,
) -> int:
    """How many exec-bound items this client may have in flight now.

    Args:
        loads: one per connected, non-draining execserver instance.
        waiting: this client's jobs now waiting at the execservers for a slot.
        queue_deep: whether the last claim got every item it asked for.
        config: headroom, cap and whether idle slots count.

    Returns:
        The limit (the module docstring gives the rules); 0 when no instance
        offers any slot.
    """
    loads = tuple(loads)
    base = fair_share(loads)
    if base == 0:
        return 0
    limit = base + config.headroom
    if config.use_idle and queue_deep and waiting == 0:
        limit += sum(math.ceil(load.idle / max(1, load.clients)) for load in loads)
    limit = max(0, limit - max(0, waiting - config.headroom))
    cap = config.max_in_flight or auto_max_in_flight(base, config.db_pool)
    return min(limit, cap)


def odd_reserve(limit: int, reserve: int) -> int:
    """How many of ``limit`` admission slots only odd priorities may take.

    At most ``reserve``, and never more than half the limit, so even priorities
    always keep at least half (a limit of 1 reserves nothing).
    """
    return max(0, min(reserve, limit // 2))


def plan_claims(
    *,
    exec_limit: int,
    reserve: int,
    exec_in_flight: int,
    even_in_flight: int,
    local_limit: int,
    local_in_flight: int,
) -> ClaimPlan:
    """How many items of each kind one claim asks for.

    Even items may hold at most ``exec_limit - reserve`` slots and all items
    together at most ``exec_limit``. The general share is claimed in priority
    order (it may bring odd items too); the rest of the limit goes to odd items
    only.

    Args:
        exec_limit: from :func:`exec_limit`.
        reserve: from :func:`odd_reserve` (``0 <= reserve <= exec_limit``).
        exec_in_flight: exec-bound items in flight, of any priority.
        even_in_flight: those of them with an even priority.
        local_limit: the local-bound semaphore's size.
        local_in_flight: local-bound items in flight.

    Returns:
        The plan; every count is at least 0.

    Raises:
        ValueError: ``even_in_flight`` exceeds ``exec_in_flight``, a count is
            negative, or ``reserve`` is outside ``0..exec_limit``.
    """
    if min(exec_limit, exec_in_flight, even_in_flight, local_limit, local_in_flight) < 0:
        raise ValueError("limits and counts must be at least 0")
    if even_in_flight > exec_in_flight:
        raise ValueError(
            f"even_in_flight ({even_in_flight}) exceeds exec_in_flight ({exec_in_flight})"
        )
    if not 0 <= reserve <= exec_limit:
        raise ValueError(f"reserve must be within 0..{exec_limit}, got {reserve}")
    free = max(0, exec_limit - exec_in_flight)
    general = max(0, min(exec_limit - reserve - even_in_flight, free))
    return ClaimPlan(
        general=general,
        odd_only=free - general,
        local=max(0, local_limit - local_in_flight),
    )
