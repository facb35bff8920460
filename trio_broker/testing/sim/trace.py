"""Traces: every input of one run, so that it replays exactly and shrinks.

A run is fixed by its :class:`Trace`: the scenario, the seed, the jobs the
producers made (:class:`JobInput`: when, for whom, which service, priority,
duration, memory, whether the input fails), the faults resolved to times and
targets (:class:`FaultInput`), and the *noise*: every other random choice the
run made, in the order it made them (network latencies, retransmissions, a
random balancer's picks, the client cores' reconnect jitter).

:func:`plan` draws the jobs and faults of a seed; the run draws its noise from
a :class:`Choices` seeded from the same seed and records it. A replayed trace
feeds the recorded noise back; where it runs out (a shrunk trace) every choice
takes its *simplest* value (a distribution's median, the first candidate), so a
trace with no noise at all is a valid, plain run. Traces are written and read
as JSON (:meth:`Trace.to_json`, :meth:`Trace.from_json`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any, Literal, TypeAlias

import attrs

from trio_broker.testing.sim.scenario import Dist, FaultKind, FaultSpec, Scenario, ScenarioError

__all__ = ["Choices", "FaultInput", "JobInput", "Trace", "plan"]

FaultAction: TypeAlias = Literal["crash", "restart", "cut", "heal", "drop"]


@attrs.frozen(kw_only=True)
class JobInput:
    """One job a producer made.

    Attributes:
        at: when it arrived.
        target: ``queue``, or the direct client it was submitted to.
        service, priority: what it asks for.
        duration, memory: how long its job runs and its peak memory.
        fails: whether its input fails the job (on every attempt).
    """

    at: float
    target: str
    service: str
    priority: int = 0
    duration: float = 1.0
    memory: int | None = None
    fails: bool = False


@attrs.frozen(kw_only=True)
class FaultInput:
    """One fault event at one time, for one target.

    ``crash`` (``silent``: no reset reaches the peers), ``restart``, ``cut``
    (the start of a partition; ``database``: the database too), ``heal`` and
    ``drop`` (every connection breaks).
    """

    at: float
    action: FaultAction
    target: str
    silent: bool = False
    database: bool = False


class Choices:
    """The run's random choices: drawn from a seed and recorded, or replayed.

    Args:
        seed: where fresh draws come from (``None``: replay only).
        recorded: the draws to replay first; past them, fresh draws when a seed
            is given, else the simplest value of each choice.
        record: keep every draw (for :attr:`drawn`).
    """

    __slots__ = ("_fresh", "_next", "_record", "_recorded", "drawn")

    def __init__(
        self,
        seed: int | None,
        recorded: Sequence[float] = (),
        *,
        record: bool = True,
    ) -> None:
        self._fresh = random.Random(seed) if seed is not None else None
        self._recorded = recorded
        self._next = 0
        self._record = record
        self.drawn: list[float] = []

    def unit(self) -> float | None:
        """A uniform draw in [0, 1), or ``None`` where the simplest value is to be used."""
        if self._next < len(self._recorded):
            u: float | None = self._recorded[self._next]
            self._next += 1
        elif self._fresh is not None:
            u = self._fresh.random()
        else:
            return None
        if self._record:
            assert u is not None
            self.drawn.append(u)
        return u

    def sample(self, dist: Dist) -> float:
        """A value of ``dist`` (its median where there is no draw)."""
        if dist.kind == "fixed":
            return dist.value
        u = self.unit()
        return dist.simplest if u is None else dist.sample(u)

    def chance(self, p: float) -> bool:
        """True with probability ``p`` (False where there is no draw)."""
        if p <= 0:
            return False
        u = self.unit()
        return u is not None and u < p

    def index(self, n: int) -> int:
        """An index below ``n`` (0 where there is no draw)."""
        u = self.unit()
        return 0 if u is None or n <= 1 else min(n - 1, int(u * n))


@attrs.frozen(kw_only=True)
class Trace:
    """Every input of one run (see the module docstring)."""

    scenario: Scenario
    seed: int
    jobs: tuple[JobInput, ...]
    faults: tuple[FaultInput, ...] = ()
    noise: tuple[float, ...] | None = None
    """The recorded draws; ``None``: draw them fresh from the seed (a first run)."""

    def to_json(self) -> str:
        return json.dumps(
            {
                "scenario": self.scenario.to_dict(),
                "seed": self.seed,
                "jobs": [attrs.asdict(job) for job in self.jobs],
                "faults": [attrs.asdict(fault) for fault in self.faults],
                "noise": None if self.noise is None else list(self.noise),
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> Trace:
        """A trace written by :meth:`to_json`.

        Raises:
            ScenarioError: the document is not a trace (names what is wrong).
        """
        try:
            data = json.loads(text)
            scenario = Scenario.from_dict(data["scenario"])
            return cls(
                scenario=scenario,
                seed=int(data["seed"]),
                jobs=tuple(JobInput(**job) for job in data["jobs"]),
                faults=tuple(FaultInput(**fault) for fault in data.get("faults", ())),
                noise=None if data.get("noise") is None else tuple(data["noise"]),
            )
        except ScenarioError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise ScenarioError(f"not a trace: {type(exc).__name__}: {exc}") from None


# -- planning a seed ---------------------------------------------------------------------


def _weighted(rng: random.Random, mix: dict[Any, float]) -> Any:
    total = sum(mix.values())
    point = rng.random() * total
    for key, weight in mix.items():
        point -= weight
        if point < 0:
            return key
    return next(reversed(mix))


def _jobs(scenario: Scenario, rng: random.Random) -> list[JobInput]:
    jobs: list[JobInput] = []
    targets = {c.name: c.names() for c in scenario.clients}
    for producer in scenario.producers:
        stop = scenario.duration if producer.stop is None else producer.stop
        at = producer.start
        made = 0
        turn = 0
        while producer.count is None or made < producer.count:
            at += producer.arrival.sample(rng.random())
            if at >= stop:
                break
            service = scenario.service(_weighted(rng, dict(producer.services)))
            priority = int(_weighted(rng, dict(producer.priorities)))
            duration = service.duration.sample(rng.random())
            memory = None if service.memory is None else int(service.memory.sample(rng.random()))
            fails = rng.random() < service.failure_rate
            target = producer.target
            if target != "queue":
                names = targets[target]
                target = names[turn % len(names)]
                turn += 1
            jobs.append(
                JobInput(
                    at=round(at, 6),
                    target=target,
                    service=service.name,
                    priority=priority,
                    duration=round(duration, 6),
                    memory=memory,
                    fails=fails,
                )
            )
            made += 1
    jobs.sort(key=lambda job: job.at)
    return jobs


def _faults(scenario: Scenario, rng: random.Random) -> list[FaultInput]:
    events: list[FaultInput] = []
    for fault in scenario.faults:
        at = fault.at
        while True:
            events += _fault_events(fault.kind, fault, at)
            if fault.repeat_every is None or fault.restart_after is None:
                break
            at += fault.restart_after + fault.repeat_every.sample(rng.random())
            assert fault.until is not None
            if at > fault.until:
                break
    events.sort(key=lambda event: event.at)
    return events


def _fault_events(kind: FaultKind, fault: FaultSpec, at: float) -> list[FaultInput]:
    target = fault.target
    if kind == "drop":
        return [FaultInput(at=at, action="drop", target=target)]
    if kind == "partition":
        return [
            FaultInput(at=at, action="cut", target=target, database=fault.database),
            FaultInput(at=at + fault.duration, action="heal", target=target),
        ]
    events = [FaultInput(at=at, action="crash", target=target, silent=fault.silent)]
    if fault.restart_after is not None:
        events.append(FaultInput(at=at + fault.restart_after, action="restart", target=target))
    return events


def plan(scenario: Scenario, seed: int) -> Trace:
    """The jobs and faults of one seed, and a trace that draws its noise from the seed."""
    rng = random.Random(f"{scenario.name}/{seed}/inputs")
    return Trace(
        scenario=scenario,
        seed=seed,
        jobs=tuple(_jobs(scenario, rng)),
        faults=tuple(_faults(scenario, rng)),
    )
