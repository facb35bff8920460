"""A model check of priority aging: a low want's wait is bounded.

:func:`aging_machine` drives a :class:`~trio_broker.core.broker.Broker` whose pool
ages parked wants (``priority_aging``): connections park wants in the four
bands (-2, 0, 2, 4), unwant some, redeem or decline offers, jobs end, and time
passes by fractions and multiples of the interval. One service and no other
limit, so every want fits whenever a slot frees. Checked, besides the broker's
invariants after every step, the bound of *Aging* in :mod:`trio_broker.core.book`:

    A want W of connection X parked at ``b`` reaches its ceiling ``c`` (4 here)
    at ``t = parked_at + k * I``, ``k = ceil((c - b) / 2)``, at the first input
    from then on. From that moment until W is offered a slot, at most
    ``(m + 1) * (C - 1)`` offers go to other connections, where ``C`` is the
    number of connections and ``m`` the number of X's wants still parked that
    reached ``c`` no later than W (they go first, FIFO).

And on every grant, FIFO within the connection through the lifts (closed form,
from the rule of *Aging*, not from the book): the offered want W of X has the
highest priority among X's parked wants now, and among those at that priority
it arrived there first. A want parked at ``b`` at ``t0`` stands, at ``now``, at
``b + 2k`` with ``k`` the lifts due by then (``t0 + j * I <= now``, at most to
the top band), having arrived there at ``t0 + k * I``; arrivals at one instant
are ordered lifts first (they apply at the start of the input that parks), then
by how the two wants arrived at the priority before, back to the order X
parked them. So two wants of one connection that age together keep their order.

Use it as::

    from trio_broker.testing.aging import aging_machine

    TestAging = aging_machine(size=2, connections=3, interval=60.0).TestCase
"""

from __future__ import annotations

import itertools
import math
from typing import ClassVar

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from trio_broker.core import protocol as p
from trio_broker.core.book import aging_ceiling
from trio_broker.core.broker import StartJob
from trio_broker.core.pool import PoolConfig
from trio_broker.testing.machines import registered_broker
from trio_broker.testing.values import receipt

__all__ = ["AgingMachine", "aging_machine"]

_BANDS = (-2, 0, 2, 4)


class AgingMachine(RuleBasedStateMachine):
    """See the module docstring; configure it with :func:`aging_machine`."""

    size: ClassVar[int] = 2
    connection_count: ClassVar[int] = 3
    interval: ClassVar[float] = 60.0

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        pool = PoolConfig(
            size=self.size, unknown_share=1.0, max_slots={"s": 0}, priority_aging=self.interval
        )
        self.broker, self.conns = registered_broker("aging", pool, self.connection_count)
        self.jobs = itertools.count()
        # (conn, job_id) -> when it reaches its ceiling
        self.parked: dict[tuple[int, str], float] = {}
        # (conn, job_id) -> (grant count when it reached its ceiling, m)
        self.reached: dict[tuple[int, str], tuple[int, int]] = {}
        self.granted: list[int] = []  # the connection of every offer, in order
        self.offers: list[tuple[int, str, str]] = []
        self.running: list[int] = []
        # (conn, job_id) -> (base, parked at, arrival number), for the FIFO check
        self.parks: dict[tuple[int, str], tuple[int, float, int]] = {}
        self.arrivals = itertools.count()

    def _standing(self, key: tuple[int, str]) -> tuple[int, tuple[object, ...]]:
        """A parked want's priority now and its place in its connection's FIFO there."""
        base, parked_at, arrival = self.parks[key]
        lifts = max(0, math.ceil((aging_ceiling(base) - base) / 2))
        k = sum(1 for j in range(1, lifts + 1) if parked_at + j * self.interval <= self.now)
        entries = tuple((parked_at + j * self.interval, 0) for j in range(k, 0, -1))
        return base + 2 * k, (*entries, (parked_at, 1), arrival)

    def _check_fifo(self, key: tuple[int, str]) -> None:
        priority, place = self._standing(key)
        for other in self.parked:
            if other[0] != key[0] or other == key:
                continue
            other_priority, other_place = self._standing(other)
            assert other_priority <= priority, f"{key} at {priority} before {other}"
            if other_priority == priority:
                assert place < other_place, f"FIFO broken at {priority}: {key} before {other}"

    def _reach(self) -> None:
        """Note the wants that reached their ceiling by now (before this input runs)."""
        for key, at in self.parked.items():
            if key not in self.reached and at <= self.now:
                ahead = sum(
                    1
                    for other, other_at in self.parked.items()
                    if other != key and other[0] == key[0] and other_at <= at
                )
                self.reached[key] = (len(self.granted), ahead)

    def _observe(self) -> None:
        for conn, message in self.broker.frames_to_send():
            if not isinstance(message, p.Offer):
                continue
            key = (conn, message.job_id)
            del self.parked[key]
            self._check_fifo(key)
            del self.parks[key]
            if key in self.reached:
                self._check_bound(key)
                del self.reached[key]
            self.granted.append(conn)
            self.offers.append((conn, message.job_id, message.token))
        for effect in self.broker.effects():
            if isinstance(effect, StartJob):
                self.running.append(effect.run_id)

    def _check_bound(self, key: tuple[int, str]) -> None:
        start, ahead = self.reached[key]
        others = sum(1 for c in self.granted[start:] if c != key[0])
        bound = (ahead + 1) * (self.connection_count - 1)
        note(f"{key}: {others} offers to others since its ceiling, bound {bound}")
        assert others <= bound, f"{key} waited {others} offers > {bound} at its ceiling"

    def _input(self, conn: int, message: p.Message) -> None:
        self._reach()
        self.broker.receive(conn, message, now=self.now)
        self._observe()

    @rule(data=st.data(), count=st.integers(1, 3))
    def want(self, data: st.DataObject, count: int) -> None:
        conn = data.draw(st.sampled_from(self.conns))
        base = data.draw(st.sampled_from(_BANDS))
        for _ in range(count):
            job_id = f"j{next(self.jobs)}"
            climb = max(0, math.ceil((aging_ceiling(base) - base) / 2))
            self.parked[(conn, job_id)] = self.now + climb * self.interval
            self.parks[(conn, job_id)] = (base, self.now, next(self.arrivals))
            self._input(conn, p.Want(job_id=job_id, service="s", priority=base))

    @precondition(lambda self: self.parked)
    @rule(data=st.data())
    def unwant(self, data: st.DataObject) -> None:
        conn, job_id = data.draw(st.sampled_from(sorted(self.parked)))
        del self.parked[(conn, job_id)]
        del self.parks[(conn, job_id)]
        self.reached.pop((conn, job_id), None)
        self._input(conn, p.Unwant(job_id=job_id))

    @precondition(lambda self: self.offers)
    @rule(data=st.data(), take=st.booleans())
    def answer(self, data: st.DataObject, take: bool) -> None:
        conn, job_id, token = data.draw(st.sampled_from(self.offers))
        self.offers.remove((conn, job_id, token))
        message: p.Message = (
            p.Job(job_id=job_id, token=token, service="s", subject=None, job={})
            if take
            else p.Decline(token=token)
        )
        self._input(conn, message)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def end(self, data: st.DataObject) -> None:
        run_id = data.draw(st.sampled_from(self.running))
        self.running.remove(run_id)
        self._reach()
        self.broker.job_ended(run_id, receipt("ok"), now=self.now)
        self._observe()

    @rule(step=st.sampled_from([0.1, 0.5, 1.0]))
    def advance(self, step: float) -> None:
        self.now += step * self.interval
        self._reach()
        self.broker.tick(now=self.now)
        self._observe()

    @invariant()
    def consistent(self) -> None:
        self.broker.check_invariants()
        for key in self.reached:  # waiting, and not longer than the bound so far
            self._check_bound(key)
        assert len(self.broker.book) == len(self.parked)


def aging_machine(
    *, size: int = 2, connections: int = 3, interval: float = 60.0
) -> type[AgingMachine]:
    """An :class:`AgingMachine` with this many slots and connections, and this interval."""
    if size < 1 or connections < 2 or not interval > 0:
        raise ValueError("aging_machine needs a slot, two connections and a positive interval")
    return type(
        "ConfiguredAgingMachine",
        (AgingMachine,),
        {"size": size, "connection_count": connections, "interval": interval},
    )
