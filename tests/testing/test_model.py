"""The public model checks, run against several pool configurations.

``TRIO_BROKER_MODEL_SCALE`` (default 1) scales every example budget here, so a
mutation run can use a small one (``0.2``) and a soak a large one.
"""

from __future__ import annotations

import os

from hypothesis import settings

from trio_broker.core.pool import PoolConfig
from trio_broker.testing.aging import aging_machine
from trio_broker.testing.book import book_machine
from trio_broker.testing.machines import broker_machine, round_robin_machine, turn_hold_machine
from trio_broker.testing.race import race_machine

_SCALE = float(os.environ.get("TRIO_BROKER_MODEL_SCALE", "1"))


def _budget(examples: int, steps: int) -> settings:
    return settings(max_examples=max(5, round(examples * _SCALE)), stateful_step_count=steps)


_STEPS = _budget(150, 40)

TestSmallPool = broker_machine(
    PoolConfig(
        size=3,
        fast_reserve=1,
        heavy_threshold=10.0,
        unknown_share=1.0,
        max_slots={"light": 0, "heavy": 2},
    )
).TestCase
TestSmallPool.settings = _STEPS

TestMemoryBudget = broker_machine(
    PoolConfig(
        size=4,
        fast_reserve=0,
        unknown_share=0.5,
        memory_budget=1000,
        max_slots={"a": 0, "b": 1, "c": 0},
    )
).TestCase
TestMemoryBudget.settings = _STEPS

TestSingleSlot = broker_machine(
    PoolConfig(size=1, fast_reserve=0, unknown_share=1.0, max_slots={"only": 0}),
    priorities=(0, 5),
).TestCase
TestSingleSlot.settings = _STEPS

TestOnePriorityManyServices = broker_machine(
    PoolConfig(size=2, fast_reserve=0, unknown_share=1.0, max_slots={"x": 0, "y": 0, "z": 1}),
    priorities=(0,),
    job_ids=("a", "b", "c", "d", "e"),
).TestCase
TestOnePriorityManyServices.settings = _STEPS

# Capped services, several of them parked per connection at one priority: the
# oldest want of a connection often does not fit (FIFO among the fitting ones).
TestCappedServicesFifo = broker_machine(
    PoolConfig(
        size=2,
        fast_reserve=0,
        unknown_share=1.0,
        max_slots={"one": 1, "free": 0, "also": 0, "more": 0},
    ),
    priorities=(0,),
    job_ids=("a", "b", "c", "d", "e", "f"),
).TestCase
TestCappedServicesFifo.settings = _STEPS

TestRoundRobin = round_robin_machine(size=2, connections=3).TestCase
TestRoundRobin.settings = _budget(150, 60)

TestRoundRobinOneSlot = round_robin_machine(size=1, connections=4, priorities=(0,)).TestCase
TestRoundRobinOneSlot.settings = _budget(100, 60)

TestRoundRobinRefills = round_robin_machine(size=3, connections=3, priorities=(0,)).TestCase
TestRoundRobinRefills.settings = _budget(100, 60)

TestRaceTwoServers = race_machine(servers=2, slots=(1, 2)).TestCase
TestRaceTwoServers.settings = _budget(200, 50)

TestRaceThreeServers = race_machine(servers=3, slots=(1, 1, 2), offer_ttl=1.0).TestCase
TestRaceThreeServers.settings = _budget(150, 50)

# The book's machines check every position against the list model after each
# step, which makes them the slowest here; make soak runs them at ten times this.
TestBook = book_machine().TestCase
TestBook.settings = _budget(100, 50)

TestBookOnePriority = book_machine(
    services=("x", "y", "z"), priorities=(0,), connections=2
).TestCase
TestBookOnePriority.settings = _budget(60, 50)

TestAgingBound = aging_machine(size=2, connections=3, interval=60.0).TestCase
TestAgingBound.settings = _budget(150, 60)

TestAgingOneSlot = aging_machine(size=1, connections=4, interval=10.0).TestCase
TestAgingOneSlot.settings = _budget(100, 60)

# The turn hold across priorities and with aging: lifts fall due while slots are
# held (steps shorter than the hold), two services so that a hold's service and
# the want that takes it differ; every hold (for whom, at which priority, until
# when) and every grant at the lifted priority against the reference.
TestTurnHoldAging = broker_machine(
    PoolConfig(
        size=3,
        fast_reserve=0,
        unknown_share=1.0,
        max_slots={"s": 0, "t": 2},
        priority_aging=1.0,
    ),
    priorities=(-2, -1, 0, 2),
    turn_hold=0.25,
    time_steps=(0.0, 0.1, 0.2, 0.5, 1.0, 3.0),
).TestCase
TestTurnHoldAging.settings = _budget(60, 40)

# Fractional shares and sizes where rounding matters: floor(0.3 * 5) = 1 and
# floor(0.45 * 7) = 3 unknown slots (ceil or round would admit 2 and 3 or 4):
# what the broker reports as capacity is what it admits.
TestFractionalShares = broker_machine(
    PoolConfig(
        size=5,
        fast_reserve=1,
        heavy_threshold=10.0,
        unknown_share=0.3,
        max_slots={"a": 0, "b": 2, "c": 0},
    ),
).TestCase
TestFractionalShares.settings = _budget(40, 40)

TestFractionalSharesAging = broker_machine(
    PoolConfig(
        size=7,
        fast_reserve=2,
        unknown_share=0.45,
        memory_budget=1000,
        max_slots={"a": 0, "b": 3},
        priority_aging=2.0,
    ),
    priorities=(-1, 0, 1, 2),
).TestCase
TestFractionalSharesAging.settings = _budget(40, 40)

# Clients with several jobs in flight at several priorities, served by the rotation
# while older jobs run: who is owed the turn, and what a lift does to a hold.
TestTurnHolds = turn_hold_machine(
    PoolConfig(size=3, unknown_share=1.0, max_slots={"s": 0}, priority_aging=1.0),
    priorities=(0, 1, 2),
).TestCase
TestTurnHolds.settings = _budget(80, 50)

# Aging with per-connection FIFO: several wants of one connection lift together
# (bursts parked at one instant) or one after another, and every pick, rotation
# and position is checked at the lifted priorities against the plain model.
TestBookAging = book_machine(priorities=(-2, -1, 0, 2, 5), aging=1.0).TestCase
TestBookAging.settings = _budget(100, 50)
