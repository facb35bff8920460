"""``trio-broker simulate SCENARIO``: a fleet simulated, seed by seed, on the real cores.

SCENARIO is a shipped scenario's name (``--list`` shows them), or a YAML or
JSON file with a scenario (:meth:`~trio_broker.testing.sim.scenario.Scenario.from_dict`),
or, with ``--replay``, a trace file written by ``--trace-out``. Seeds run in
parallel processes (``--jobs``). When a seed breaks a check, the command prints
each failing seed's violations, shrinks the first one's trace
(:func:`~trio_broker.testing.sim.shrink.shrink`), prints it with the end of its
run, writes it to ``--trace-out`` when given, and exits 1. Otherwise it prints
the capacity report, and for ``--add-execservers``, ``--slots`` or
``--clients`` the same report of the changed fleet on the same seeds, and exits 0.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from trio_broker.testing.sim.library import SCENARIOS, what_if
from trio_broker.testing.sim.model import Violation
from trio_broker.testing.sim.report import Figures, capacity_report
from trio_broker.testing.sim.run import replay, simulate
from trio_broker.testing.sim.scenario import Scenario, ScenarioError
from trio_broker.testing.sim.shrink import shrink
from trio_broker.testing.sim.trace import Trace

__all__ = ["load_scenario", "main", "parse_seeds"]

MAX_SHOWN = 5
"""Violations shown per failing seed."""


def parse_seeds(text: str) -> range:
    """``A..B`` (both included) or one seed ``N``.

    Raises:
        ValueError: anything else, or B below A.
    """
    first, dots, last = text.partition("..")
    try:
        low = int(first)
        high = int(last) if dots else low
    except ValueError:
        raise ValueError(f"expected seeds as A..B or N, got {text!r}") from None
    if low < 0 or high < low:
        raise ValueError(f"expected 0 <= A <= B in A..B, got {text!r}")
    return range(low, high + 1)


def load_scenario(name: str) -> Scenario:
    """A shipped scenario by name, or one from a YAML or JSON file.

    Raises:
        ScenarioError: no such scenario or file, or the file is not a valid scenario.
    """
    if name in SCENARIOS:
        return SCENARIOS[name]()
    path = Path(name)
    if not path.is_file():
        known = ", ".join(sorted(SCENARIOS))
        raise ScenarioError(f"no scenario {name!r}: give a file or one of {known}")
    import yaml  # the daemons extra

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ScenarioError(f"{path}: cannot read a scenario: {exc}") from None
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: expected a mapping at the top, got {type(data).__name__}")
    try:
        return Scenario.from_dict(data)
    except ScenarioError as exc:
        raise ScenarioError(f"{path}: {exc}") from None


def _run_seed(job: tuple[Scenario, int]) -> tuple[int, tuple[Violation, ...], Figures]:
    scenario, seed = job
    result = simulate(scenario, seed, record=False, log_size=0)
    return seed, result.violations, result.figures


def run_seeds(
    scenario: Scenario, seeds: Sequence[int], jobs: int
) -> list[tuple[int, tuple[Violation, ...], Figures]]:
    """Every seed's violations and figures, in seed order, ``jobs`` processes at once."""
    work = [(scenario, seed) for seed in seeds]
    if jobs <= 1 or len(work) <= 1:
        return [_run_seed(job) for job in work]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(_run_seed, work))


def _failures(scenario: Scenario, failed: list[tuple[int, tuple[Violation, ...]]],
              trace_out: str | None, budget: int) -> None:  # fmt: skip
    for seed, violations in failed:
        print(f"seed {seed}: {len(violations)} violation(s)")
        for violation in violations[:MAX_SHOWN]:
            print(f"  {violation}")
    seed, violations = failed[0]
    print(f"\nshrinking seed {seed} (a trace that still breaks {violations[0].kind!r})...")
    result = simulate(scenario, seed)
    small = shrink(result.trace, budget=budget)
    rerun = replay(small)
    print(f"shrunk trace of seed {seed}: {len(small.jobs)} job(s), {len(small.faults)} "
          f"fault(s), {len(small.noise or ())} random draw(s)")  # fmt: skip
    for job in small.jobs:
        print(f"  {job}")
    for fault in small.faults:
        print(f"  {fault}")
    print("its run, last events:")
    for line in rerun.log[-40:]:
        print(f"  {line}")
    for violation in rerun.violations[:MAX_SHOWN]:
        print(f"  -> {violation}")
    if trace_out is not None:
        Path(trace_out).write_text(small.to_json() + "\n", encoding="utf-8")
        print(f"trace written to {trace_out} (trio-broker simulate --replay {trace_out})")


def _replay(path: str) -> int:
    try:
        trace = Trace.from_json(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        print(f"trio-broker simulate: {path}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except ScenarioError as exc:
        print(f"trio-broker simulate: {path}: {exc}", file=sys.stderr)
        return 2
    result = replay(trace)
    for line in result.log[-60:]:
        print(line)
    for violation in result.violations:
        print(f"-> {violation}")
    if result.violations:
        return 1
    print("\n".join(capacity_report(trace.scenario.name, [result.figures])))
    return 0


def main(
    scenario_name: str,
    *,
    seeds: range,
    jobs: int | None = None,
    add_execservers: int = 0,
    slots: int | None = None,
    clients: int | None = None,
    trace_out: str | None = None,
    replay_trace: bool = False,
    shrink_budget: int = 300,
) -> int:
    """``trio-broker simulate``: returns the exit status (0 no violation, 1 some, 2 bad input)."""
    if replay_trace:
        return _replay(scenario_name)
    try:
        scenario = load_scenario(scenario_name)
        changed = what_if(scenario, add_execservers=add_execservers, slots=slots, clients=clients)
    except ScenarioError as exc:
        print(f"trio-broker simulate: {exc}", file=sys.stderr)
        return 2
    workers = jobs or os.cpu_count() or 1
    print(f"{scenario.name}: {scenario.description or 'a scenario'}; seeds "
          f"{seeds.start}..{seeds.stop - 1} on {workers} process(es)", flush=True)  # fmt: skip
    results = run_seeds(scenario, seeds, workers)
    failed = [(seed, violations) for seed, violations, _ in results if violations]
    if failed:
        _failures(scenario, failed, trace_out, shrink_budget)
        return 1
    print("\n".join(capacity_report(scenario.name, [figures for _, _, figures in results])))
    if changed != scenario:
        what = ", ".join(
            text
            for text, given in (
                (f"+{add_execservers} execservers", add_execservers),
                (f"{slots} slots each", slots),
                (f"{clients} clients", clients),
            )
            if given
        )
        print(f"\nwhat if: {what}")
        other = run_seeds(changed, seeds, workers)  # its name, so the seeds' workload, kept
        broken = [(seed, v) for seed, v, _ in other if v]
        if broken:
            _failures(changed, broken, trace_out, shrink_budget)
            return 1
        print("\n".join(capacity_report(f"{scenario.name} ({what})", [f for _, _, f in other])))
    return 0


def list_scenarios() -> int:
    """Print every shipped scenario with its description."""
    for name, make in SCENARIOS.items():
        print(f"{name:<18} {make().description}")
    return 0


def dump_scenario(name: str) -> int:
    """Print a scenario as JSON (a starting point for a file of one's own)."""
    try:
        scenario = load_scenario(name)
    except ScenarioError as exc:
        print(f"trio-broker simulate: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(scenario.to_dict(), indent=1))
    return 0
