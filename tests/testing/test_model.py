"""The public model checks, run against several pool configurations."""

from __future__ import annotations

from hypothesis import settings

from trio_broker.core.pool import PoolConfig
from trio_broker.testing.machines import broker_machine, round_robin_machine
from trio_broker.testing.race import race_machine

_STEPS = settings(max_examples=150, stateful_step_count=40)

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

TestRoundRobin = round_robin_machine(size=2, connections=3).TestCase
TestRoundRobin.settings = settings(max_examples=150, stateful_step_count=60)

TestRoundRobinOneSlot = round_robin_machine(size=1, connections=4, priorities=(0,)).TestCase
TestRoundRobinOneSlot.settings = settings(max_examples=100, stateful_step_count=60)

TestRaceTwoServers = race_machine(servers=2, slots=(1, 2)).TestCase
TestRaceTwoServers.settings = settings(max_examples=200, stateful_step_count=50)

TestRaceThreeServers = race_machine(servers=3, slots=(1, 1, 2), offer_ttl=1.0).TestCase
TestRaceThreeServers.settings = settings(max_examples=150, stateful_step_count=50)
