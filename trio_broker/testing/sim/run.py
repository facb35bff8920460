"""Running a scenario: one seed, a replayed trace, or a range of seeds.

:func:`simulate` plans a seed's inputs and runs them; :func:`replay` runs a
trace as it is. Each returns a :class:`Result`: the violations (empty when
every check held), the trace that replays the run exactly (its noise recorded),
the last events of the run, and its :class:`~trio_broker.testing.sim.report.Figures`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs

from trio_broker.testing.sim.model import Violation
from trio_broker.testing.sim.report import Figures
from trio_broker.testing.sim.scenario import Scenario
from trio_broker.testing.sim.trace import Trace, plan
from trio_broker.testing.sim.world import World

__all__ = ["Result", "replay", "simulate"]


@attrs.frozen(kw_only=True)
class Result:
    """One run's outcome.

    Attributes:
        violations: what broke (empty: every check held).
        tolerated: what broke that the caller's ``tolerate`` accepted.
        trace: the run's inputs with the noise it drew: replaying it repeats
            the run exactly.
        log: the run's last events, oldest first.
        figures: what it measured.
    """

    violations: tuple[Violation, ...]
    tolerated: tuple[Violation, ...]
    trace: Trace
    log: tuple[str, ...]
    figures: Figures

    @property
    def ok(self) -> bool:
        return not self.violations


def simulate(
    scenario: Scenario,
    seed: int,
    *,
    record: bool = True,
    log_size: int = 400,
    tolerate: Callable[[Violation], bool] | None = None,
) -> Result:
    """Run one seed of a scenario.

    Args:
        scenario: the installation, workload and faults.
        seed: fixes every choice of the run.
        record: keep the noise, so that ``result.trace`` replays the run (off
            saves memory on long runs; the trace then only replays from its seed).
        log_size: how many of the last events to keep.
        tolerate: violations to accept and keep apart (see :class:`World`).
    """
    return replay(plan(scenario, seed), record=record, log_size=log_size, tolerate=tolerate)


def replay(
    trace: Trace,
    *,
    record: bool = True,
    log_size: int = 400,
    tolerate: Callable[[Violation], bool] | None = None,
) -> Result:
    """Run a trace: its jobs and faults, and its noise (fresh from its seed when None)."""
    world = World(trace, record=record, log_size=log_size, tolerate=tolerate)
    started = time.perf_counter()
    world.run()
    wall = time.perf_counter() - started
    noise = tuple(world.choices.drawn) if record else trace.noise
    return Result(
        violations=tuple(world.violations),
        tolerated=tuple(world.tolerated),
        trace=attrs.evolve(trace, noise=noise),
        log=tuple(world.log_lines()),
        figures=figures(world, wall),
    )


def figures(world: World, wall: float) -> Figures:
    """What a finished world measured."""
    now = world.now
    waits: dict[int, list[float]] = {}
    shares: dict[str, int] = {}
    client_waits: dict[str, list[float]] = {}
    counts = {"done": 0, "failed": 0, "abandoned": 0, "open": 0}
    last_end = 0.0
    for item in world.items:
        counts[item.ended or "open"] += 1
        if item.ended_at is not None:
            last_end = max(last_end, item.ended_at)
        if item.ended == "done" and item.start_of_done is not None:
            wait = item.start_of_done - item.job.at
            waits.setdefault(item.job.priority, []).append(wait)
            if item.done_by is not None:
                shares[item.done_by] = shares.get(item.done_by, 0) + 1
                client_waits.setdefault(item.done_by, []).append(wait)
    busy: dict[str, dict[str, float]] = {}
    capacity: dict[str, float] = {}
    for pod in world.pods.values():
        per = dict(pod.busy_time)
        for run in pod.runs.values():
            per[run.service] = per.get(run.service, 0.0) + (now - run.started)
        up = pod.up_time + (now - pod.up_since if pod.up_since is not None else 0.0)
        busy[pod.name] = per
        capacity[pod.name] = up * pod.spec.slots
    first = min((item.job.at for item in world.items), default=0.0)
    return Figures(
        seed=world.trace.seed,
        virtual=now,
        wall=wall,
        events=world.events,
        done=counts["done"],
        failed=counts["failed"],
        abandoned=counts["abandoned"],
        open=counts["open"],
        span=max(0.0, last_end - first),
        waits={k: tuple(v) for k, v in waits.items()},
        busy=busy,
        capacity=capacity,
        shares=shares,
        client_waits={k: tuple(v) for k, v in client_waits.items()},
        depth=tuple(world.depth),
        starts=sum(item.starts for item in world.items),
    )
