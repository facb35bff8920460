"""Admission: how many queue items a dispatcher may have in flight.

Theory of operation
===================

A dispatcher (one per client process) claims queue items and runs each to its
end. *Exec-bound* items hold a slot on some execserver while they run; how many
of them one client should have in flight follows from what the execservers
announce in their ``HELLO`` (one :class:`InstanceLoad` per connected,
non-draining execserver instance) and from what the client sees itself. An item
also spends time outside its slot (fetching its input, writing its result), so
the slots alone would leave the execservers idle; the admission therefore adapts
to what the execservers absorb. The rules:

1. **Base.** Each instance's ``processes`` slots are split evenly among its
   ``clients``; the client's share is ``Σ ceil(processes / clients)`` over the
   instances, and the base is that share plus the client's CPU count
   (``cpus``: the items it can feed and finish at once beside the slots it
   holds). With no instance (no execserver reachable, or all draining) the
   limit is 0: nothing exec-bound is claimed.
2. **Rising.** Once per ``adapt_interval`` (a second, the period of the
   execservers' ``idle`` figure), while the queue is deep (the last claim got
   all it asked for) and none of this client's jobs waits for a slot, the slots
   the execservers report ``idle`` are unused by anyone: the admission rises by
   them. Every client sees the same ``idle`` figure, so each takes its share of
   it, ``ceil(idle / clients)`` per instance. The rise *accumulates*: it is
   kept in :class:`Admission` and grows second by second for as long as slots
   idle, up to the cap. ``idle`` counts a slot only when it stayed free through
   a whole second, which short jobs seldom leave one: so when no job of this
   client was seen waiting through a whole interval either (nothing it sent
   found the slots full), the rise grows by at least one.
3. **Falling.** Jobs of this client that wait at the execservers for a slot
   mean it claims more than they take. Waiting jobs up to ``cpus`` are the
   pipelining the base is for (wants parked ahead of the next freed slot) and
   lower nothing. Once per ``adapt_interval``, when the fewest jobs seen waiting
   since the last adjustment (the ones that stayed queued through it, the mirror
   of ``idle``) exceed ``cpus``, the accumulated rise drops by one, down to 0:
   the admission falls step by step for as long as jobs stay queued.
   Intervals start at the first observation after one ends (each adjustment
   judges the observations since the last one, this one included); while no
   execserver offers a slot the rise is 0 and the count starts over, the
   observations of that time counting towards the first interval after. A claimed
   item reaches its slot only after its input is fetched, so the jobs that
   queue now were admitted seconds ago and arrive in bursts; dropping the rise
   by every waiting job at once throws it away on one burst, and the admission
   swings between the base and an overshoot (measured with
   ``benchmarks/admission.py``: the execservers about 55 % busy that way, over
   90 % stepping down by one).
4. **Cap.** ``max_in_flight`` bounds everything in flight, the odd reserve
   included; 0 means automatic: ``4 × base``, at least 32, at most twice the
   database pool (every item in flight may need a database connection now and
   then). :func:`max_in_flight` is the one place that computes it.

Priority bands. Priorities come in bands (background −2, normal 0, interactive 2,
synchronous 4) and an odd priority is the "high" variant of the band below it.
A few admission slots are reserved for odd priorities (:func:`odd_reserve`;
the dispatcher plans with ``limit + reserve``, of which even items hold at most
``limit``, and ``limit + reserve`` never exceeds the cap), so urgent work is
claimed at the next claim even behind a full queue.

*Local-bound* items (work the client does itself) have their own limit, a
semaphore of the CPU count, with a reserve of its own for odd priorities on top
(:func:`local_reserve`), so an interactive item is never stuck behind a large
background run. :func:`plan_claims` turns both limits and what is in flight into
how many items one claim asks for, per kind.

:func:`exec_limit` is the memoryless form of rules 1-4 (one observation, no
accumulated rise); :class:`Admission` holds the accumulated rise and is fed the
``HELLO`` figures and the dispatcher's observations with the time passed in.
Everything here is pure: no trio, no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs

__all__ = [
    "Admission",
    "AdmissionConfig",
    "ClaimPlan",
    "InstanceLoad",
    "Limits",
    "auto_max_in_flight",
    "capacity",
    "exec_limit",
    "fair_share",
    "idle_share",
    "is_odd",
    "limits",
    "local_reserve",
    "max_in_flight",
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


def _positive_float(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attribute.name} must be more than 0, got {value}")


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
    """The knobs of the admission (see the module docstring).

    Attributes:
        cpus: the CPU count added to the share in the base; ``None`` = the CPUs
            this process may use (the trio dispatcher fills it in; the pure
            functions count ``None`` as 1).
        odd_reserve: admission slots kept for odd priorities (see :func:`odd_reserve`).
        max_in_flight: a fixed cap on exec-bound items in flight, the odd
            reserve included; 0 = automatic (:func:`max_in_flight`).
        db_pool: the database pool size, which bounds the automatic cap.
        use_idle: let the admission rise by the execservers' idle slots (rule 2).
        adapt_interval: seconds between two adjustments of the accumulated rise.
    """

    cpus: int | None = attrs.field(default=None)
    odd_reserve: int = attrs.field(default=2, validator=_not_negative)
    max_in_flight: int = attrs.field(default=0, validator=_not_negative)
    db_pool: int = attrs.field(default=10, validator=_positive)
    use_idle: bool = True
    adapt_interval: float = attrs.field(default=1.0, validator=_positive_float)

    @cpus.validator
    def _check_cpus(self, attribute: attrs.Attribute[int | None], value: int | None) -> None:
        if value is not None and value < 0:
            raise ValueError(f"cpus must be at least 0, got {value}")

    @property
    def cpu_count(self) -> int:
        """``cpus``, with ``None`` counted as 1."""
        return 1 if self.cpus is None else self.cpus


@attrs.frozen(kw_only=True)
class ClaimPlan:
    """How many items one claim asks for.

    Attributes:
        general: exec-bound items of any priority.
        odd_only: further exec-bound items of odd priority only (the reserve).
        local: local-bound items of any priority.
        local_odd_only: further local-bound items of odd priority only.
    """

    general: int = 0
    odd_only: int = 0
    local: int = 0
    local_odd_only: int = 0

    @property
    def exec_total(self) -> int:
        """Exec-bound items asked for."""
        return self.general + self.odd_only

    @property
    def local_total(self) -> int:
        """Local-bound items asked for."""
        return self.local + self.local_odd_only

    @property
    def total(self) -> int:
        """Items asked for in all; 0 means no claim is needed."""
        return self.exec_total + self.local_total


def is_odd(priority: int) -> bool:
    """Whether ``priority`` is the "high" variant of its band (−1, 1, 3, 5…)."""
    return priority % 2 != 0


def fair_share(loads: Iterable[InstanceLoad]) -> int:
    """``Σ ceil(processes / clients)`` over the instances (a client counts itself).

    An instance that announces no clients (a ``HELLO`` read before this client's
    connection counted) is treated as having one.
    """
    return sum(math.ceil(load.processes / max(1, load.clients)) for load in loads)


def capacity(loads: Iterable[InstanceLoad]) -> tuple[tuple[str, int, int], ...]:
    """What of the execservers' loads moves the base: which instances, their slots and clients.

    A dispatcher claims at once when it changes (a first ``HELLO``, an execserver
    gone, a client more). ``idle`` is left out: it moves with every job, and the
    rise follows it second by second anyway.
    """
    return tuple(sorted((load.instance_id, load.processes, load.clients) for load in loads))


def idle_share(loads: Iterable[InstanceLoad]) -> int:
    """``Σ ceil(idle / clients)``: this client's share of the slots that idled."""
    return sum(math.ceil(load.idle / max(1, load.clients)) for load in loads)


def auto_max_in_flight(base: int, db_pool: int) -> int:
    """The automatic cap: ``4 × base``, at least 32, at most ``2 × db_pool``."""
    return min(max(4 * base, MIN_AUTO_IN_FLIGHT), 2 * db_pool)


def max_in_flight(base: int, config: AdmissionConfig) -> int:
    """The cap on exec-bound items in flight, odd reserve included (rule 4).

    ``config.max_in_flight`` when set, else :func:`auto_max_in_flight` of the base.
    """
    return config.max_in_flight or auto_max_in_flight(base, config.db_pool)


@attrs.frozen(kw_only=True)
class Limits:
    """One admission decision.

    Attributes:
        base: the share plus ``cpus`` (0 without any slot).
        limit: exec-bound items of any priority allowed in flight.
        reserve: further items only odd priorities may take (``limit + reserve <= cap``).
        cap: the bound on ``limit + reserve``.
        rise: the accumulated rise above the base this decision used.
    """

    base: int = 0
    limit: int = 0
    reserve: int = 0
    cap: int = 0
    rise: int = 0


def limits(loads: Iterable[InstanceLoad], *, rise: int, config: AdmissionConfig) -> Limits:
    """The limit and odd reserve for a rise above the base (rules 1 and 4).

    Args:
        loads: one per connected, non-draining execserver instance.
        rise: how far above the base the admission stands (rules 2 and 3),
            clipped to what the cap leaves.
        config: ``cpus``, the odd reserve and the cap.
    """
    loads = tuple(loads)
    share = fair_share(loads)
    if share == 0:
        return Limits()
    cpus = config.cpu_count
    base = share + cpus
    cap = max_in_flight(base, config)
    rise = max(0, min(rise, cap - base))
    raw = base + rise
    reserve = odd_reserve(min(raw, cap), config.odd_reserve)
    return Limits(base=base, limit=min(raw, cap - reserve), reserve=reserve, cap=cap, rise=rise)


def exec_limit(
    loads: Iterable[InstanceLoad],
    *,
    waiting: int,
    queue_deep: bool,
    config: AdmissionConfig,
) -> int:
    """The limit of a single observation, without an accumulated rise.

    The rise is this one second's idle share (when the queue is deep and no job
    waits); :class:`Admission` is the form that remembers it across seconds, and
    that lowers it while jobs stay queued.

    Returns:
        Exec-bound items of any priority allowed in flight; 0 when no instance
        offers any slot.
    """
    loads = tuple(loads)
    rise = idle_share(loads) if config.use_idle and queue_deep and waiting == 0 else 0
    return limits(loads, rise=rise, config=config).limit


class Admission:
    """The adaptive admission of one dispatcher: the accumulated rise, time passed in.

    Feed it every claim decision with :meth:`update`; it adjusts the rise at most
    once per ``adapt_interval`` (rules 2 and 3) and answers the limits.

    Args:
        config: the knobs.
    """

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self._rise = 0
        self._adjusted: float | None = None
        self._least_waiting: int | None = None
        self._most_waiting = 0
        self.current = Limits()

    @property
    def rise(self) -> int:
        """The accumulated rise above the base."""
        return self._rise

    def update(
        self,
        now: float,
        loads: Iterable[InstanceLoad],
        *,
        waiting: int,
        queue_deep: bool,
    ) -> Limits:
        """Observe the execservers' figures and this client's jobs at ``now``.

        Every observation counts towards the fewest waiting jobs of the interval;
        the rise is adjusted at the first observation of each new interval.

        Args:
            now: the time, in seconds of any monotonic clock.
            loads: one per connected, non-draining execserver instance.
            waiting: this client's jobs now waiting at the execservers for a slot.
            queue_deep: whether the last claim got every item it asked for.

        Returns:
            The limits now (also kept in :attr:`current`).

        Raises:
            ValueError: ``waiting`` is negative.
        """
        if waiting < 0:
            raise ValueError(f"waiting must be at least 0, got {waiting}")
        loads = tuple(loads)
        config = self.config
        least = waiting if self._least_waiting is None else min(self._least_waiting, waiting)
        most = max(self._most_waiting, waiting)
        self._least_waiting, self._most_waiting = least, most
        if fair_share(loads) == 0:
            self._rise = 0
            self._adjusted = None  # start over when execservers are back
            self._least_waiting = self._most_waiting = waiting
        elif self._adjusted is None or now - self._adjusted >= config.adapt_interval:
            self._adjusted = now
            # the next interval starts with this observation
            self._least_waiting = self._most_waiting = waiting
            if least > config.cpu_count:
                self._rise = max(0, self._rise - 1)
            elif waiting == 0 and config.use_idle and queue_deep:
                self._rise += max(idle_share(loads), 1 if most == 0 else 0)
        self.current = limits(loads, rise=self._rise, config=config)
        # never keep more rise than the cap can use
        self._rise = self.current.rise
        return self.current


def odd_reserve(limit: int, reserve: int) -> int:
    """How many admission slots beyond ``limit`` only odd priorities may take.

    At most ``reserve``, and never more than half the limit (a limit of 1
    reserves nothing).
    """
    return max(0, min(reserve, limit // 2))


def local_reserve(local_limit: int) -> int:
    """Local-bound slots beyond ``local_limit`` only odd priorities may take.

    A quarter of the limit, at least one (none without local slots).
    """
    return max(1, local_limit // 4) if local_limit > 0 else 0


def _split(limit: int, reserve: int, in_flight: int, even_in_flight: int) -> tuple[int, int]:
    """(any priority, odd only) for ``limit + reserve`` slots, even items at most ``limit``."""
    free = max(0, limit + reserve - in_flight)
    general = max(0, min(limit - even_in_flight, free))
    return general, free - general


def plan_claims(
    *,
    exec_limit: int,
    reserve: int,
    exec_in_flight: int,
    even_in_flight: int,
    local_limit: int,
    local_in_flight: int,
    local_reserve: int = 0,
    local_even_in_flight: int | None = None,
) -> ClaimPlan:
    """How many items of each kind one claim asks for.

    Exec-bound: even items may hold at most ``exec_limit - reserve`` slots and
    all items together at most ``exec_limit``. Local-bound: even items may hold
    at most ``local_limit`` and all together ``local_limit + local_reserve``.
    Each general share is claimed in priority order (it may bring odd items
    too); the rest goes to odd items only.

    Args:
        exec_limit: the limit plus the odd reserve (:class:`Limits`).
        reserve: the odd reserve (``0 <= reserve <= exec_limit``).
        exec_in_flight: exec-bound items in flight, of any priority.
        even_in_flight: those of them with an even priority.
        local_limit: the local-bound semaphore's size for any priority.
        local_in_flight: local-bound items in flight.
        local_reserve: local slots beyond ``local_limit`` for odd priorities.
        local_even_in_flight: local-bound items in flight with an even priority
            (``None``: all of them).

    Returns:
        The plan; every count is at least 0.

    Raises:
        ValueError: an even count exceeds its total, a count is negative, or
            ``reserve`` is outside ``0..exec_limit``.
    """
    if local_even_in_flight is None:
        local_even_in_flight = local_in_flight
    counts = (exec_limit, exec_in_flight, even_in_flight, local_limit, local_in_flight)
    if min(*counts, local_reserve, local_even_in_flight) < 0:
        raise ValueError("limits and counts must be at least 0")
    if even_in_flight > exec_in_flight:
        raise ValueError(
            f"even_in_flight ({even_in_flight}) exceeds exec_in_flight ({exec_in_flight})"
        )
    if local_even_in_flight > local_in_flight:
        raise ValueError(
            f"local_even_in_flight ({local_even_in_flight}) exceeds local_in_flight "
            f"({local_in_flight})"
        )
    if not 0 <= reserve <= exec_limit:
        raise ValueError(f"reserve must be within 0..{exec_limit}, got {reserve}")
    general, odd_only = _split(exec_limit - reserve, reserve, exec_in_flight, even_in_flight)
    local, local_odd = _split(local_limit, local_reserve, local_in_flight, local_even_in_flight)
    return ClaimPlan(general=general, odd_only=odd_only, local=local, local_odd_only=local_odd)
