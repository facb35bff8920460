"""The fleet simulator: scenarios as data, exact replay, the shipped library's checks,
shrinking, what-ifs and the ``trio-broker simulate`` command."""

from __future__ import annotations

import copy
import hashlib
import os
import re
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import pytest
from trio_broker_daemons.commands.cli import main

from tests.testing.test_sim_defects import known
from trio_broker.core.pool import PoolConfig, SlotPool
from trio_broker.testing.sim.checks import fits_without
from trio_broker.testing.sim.library import SCENARIOS, what_if
from trio_broker.testing.sim.model import Violation
from trio_broker.testing.sim.report import capacity_report, percentile, plot
from trio_broker.testing.sim.run import Result, replay, simulate
from trio_broker.testing.sim.scenario import (
    ClientSpec,
    Dist,
    FaultSpec,
    PodSpec,
    ProducerSpec,
    Scenario,
    ScenarioError,
    ServiceSpec,
)
from trio_broker.testing.sim.shrink import shrink
from trio_broker.testing.sim.trace import Trace, plan

SMALL = [name for name in SCENARIOS if not name.startswith("fleet-")]
SEEDS = 10
"""Seeds per shipped scenario in make test (make soak runs ten thousand in all)."""


def _seed(job: tuple[str, int]) -> tuple[int, tuple[Violation, ...], int]:
    name, seed = job
    result = simulate(SCENARIOS[name](), seed, record=False, log_size=0, tolerate=known)
    return seed, result.violations, result.figures.done


def run_seeds(name: str, seeds: range, workers: int = 2) -> list[tuple[int, Any, int]]:
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(_seed, [(name, seed) for seed in seeds]))


# -- the shipped scenarios ----------------------------------------------------------------


@pytest.mark.parametrize("name", SMALL)
def test_the_shipped_scenarios_keep_every_check(name: str) -> None:
    """Every seed of every shipped scenario keeps every invariant after every event and
    its liveness at the end, but for the defects found and known (test_sim_defects);
    and work gets done."""
    results = run_seeds(name, range(SEEDS))
    broken = [(seed, violations[0]) for seed, violations, _ in results if violations]
    assert broken == []
    assert all(done > 0 for _, _, done in results)


def _variant(kind: str) -> Scenario:
    base = SCENARIOS["pod-churn"]()
    lb = base.balancers[0]
    if kind == "random":
        return attrs.evolve(base, balancers=(attrs.evolve(lb, policy="random"),))
    if kind == "least_connections":
        return attrs.evolve(base, balancers=(attrs.evolve(lb, policy="least_connections"),))
    if kind == "drop":
        faults = tuple(FaultSpec(kind="drop", target=target, at=at) for target, at in
                       (("pod-0", 15.0), ("fylr-1", 25.0), ("leaving", 35.0)))  # fmt: skip
        return attrs.evolve(base, faults=faults, loss=0.05)
    pods = tuple(
        attrs.evolve(pod, priority_aging=5.0, memory_budget=300_000_000, fast_reserve=1)
        for pod in base.pods
    )
    return attrs.evolve(base, pods=pods)


@pytest.mark.parametrize("kind", ["random", "least_connections", "drop", "aging_memory"])
def test_the_other_policies_faults_and_pool_limits_keep_every_check(kind: str) -> None:
    """What the shipped scenarios leave out: random and least-connections balancers,
    dropped connections with retransmissions, priority aging with a memory budget and a
    fast reserve."""
    scenario = _variant(kind)
    for seed in range(2):
        result = simulate(scenario, seed, record=False, tolerate=known)
        assert result.violations == (), (seed, result.violations[0])
        assert result.figures.done > 0


def test_the_big_scenarios_are_built() -> None:
    """The size scenarios make what they say (they run in benchmarks/sim.py)."""
    big = SCENARIOS["fleet-100x1000"]()
    assert sum(pod.count for pod in big.pods) == 1000
    assert sum(client.count for client in big.clients) == 100
    assert len(big.balancers) == 10
    assert big.checks == "light"
    assert sum(pod.count for pod in SCENARIOS["fleet-100x20"]().pods) == 100


# -- scenarios as data ------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_scenario_goes_to_data_and_back(name: str) -> None:
    """``to_dict`` gives the plain data ``from_dict`` builds the same scenario from."""
    scenario = SCENARIOS[name]()
    assert Scenario.from_dict(scenario.to_dict()) == scenario


def _mutate(path: list[Any], value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(data: dict[str, Any]) -> None:
        node: Any = data
        for step in path[:-1]:
            node = node[step]
        if value is _DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value

    return apply


_DELETE = object()


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (["pods", 0, "slots"], 0, "pods[0].slots: expected an integer >= 1, got 0"),
        (["pods", 0, "slotz"], 1, "pods[0]: unknown keys ['slotz']"),
        (["bogus"], 1, "scenario: unknown keys ['bogus']"),
        (["pods"], _DELETE, "missing 'pods'"),
        (["balancers", 0, "sticky"], "yes", "balancers[0].sticky: expected true or false"),
        (["balancers", 0, "policy"], "fastest", "balancers[0].policy"),
        (["services", 0, "duration"], {"gauss": 1}, "services[0].duration: expected one of"),
        (["services", 0, "duration"], {"uniform": [1]}, "duration.uniform: expected two numbers"),
        (["services", 0, "duration"], {"uniform": [2, 1]}, "high: expected a number >= low"),
        (["producers", 0, "priorities"], {"x": 1.0}, "priorities: expected an integer priority"),
        (["producers", 0, "services"], {"nope": 1.0}, "producers.calls-a.services"),
        (["pods", 0, "services"], ["nope"], "pods.pod.services: expected declared services"),
        (["pods", 0, "fast_reserve"], 9, "pods[0].fast_reserve: expected at most slots (4)"),
        (["clients", 0, "addresses"], ["nowhere"], "clients.a.addresses"),
        (["clients", 0, "stale_after"], 1.0, "stale_after: expected more than heartbeat"),
        (["faults"], [{"kind": "crash", "target": "pod-7", "at": 1.0}], "faults.target"),
        (["duration"], -1, "duration: expected a number > 0"),
        (["latency"], "fast", "latency: expected a number or one of"),
    ],
)
def test_a_bad_scenario_is_refused_naming_the_field(
    path: list[Any], value: Any, message: str
) -> None:
    """Bad scenario data raises ScenarioError whose message names where and what."""
    data = copy.deepcopy(SCENARIOS["two-pods"]().to_dict())
    _mutate(path, value)(data)
    with pytest.raises(ScenarioError) as caught:
        Scenario.from_dict(data)
    assert message in str(caught.value)


def test_a_fault_that_repeats_needs_its_bound() -> None:
    """A crash loop without ``until`` is refused, naming the field."""
    data = SCENARIOS["crash-loop"]().to_dict()
    data["faults"][0]["until"] = None
    with pytest.raises(ScenarioError, match="until: expected a bound"):
        Scenario.from_dict(data)


def test_distributions_sample_by_quantile() -> None:
    """A distribution maps a uniform draw to its quantile; the median is its simplest value."""
    assert Dist.fixed(2.0).sample(0.9) == 2.0
    assert Dist.uniform(1.0, 3.0).sample(0.25) == 1.5
    assert Dist.exponential(2.0).simplest == pytest.approx(2.0 * 0.6931471805599453)
    assert Dist.lognormal(1.5, 0.6).simplest == pytest.approx(1.5)
    assert Dist.lognormal(1.5, 0.6).sample(0.99) > Dist.lognormal(1.5, 0.6).sample(0.5)


# -- determinism, replay, traces ------------------------------------------------------------


def _digest(result: Result) -> str:
    text = repr((result.violations, result.log, attrs.evolve(result.figures, wall=0.0)))
    return hashlib.sha256(text.encode()).hexdigest()


def test_a_seed_fixes_the_run_and_its_trace_replays_it_exactly() -> None:
    """The same seed runs the same way twice, and its trace (with the noise it drew)
    replays it event for event."""
    scenario = SCENARIOS["crash-loop"]()
    first = simulate(scenario, 3, tolerate=known)
    assert _digest(simulate(scenario, 3, tolerate=known)) == _digest(first)
    assert first.trace.noise
    assert _digest(replay(first.trace, tolerate=known)) == _digest(first)
    assert _digest(simulate(scenario, 4, tolerate=known)) != _digest(first)


_HASH_PROBE = """
import hashlib, attrs
from tests.testing.test_sim_defects import known
from trio_broker.testing.sim.library import SCENARIOS
from trio_broker.testing.sim.run import simulate
r = simulate(SCENARIOS["partition"](), 5, tolerate=known)
text = repr((r.violations, r.log, attrs.evolve(r.figures, wall=0.0)))
print(hashlib.sha256(text.encode()).hexdigest())
"""


def test_runs_do_not_depend_on_the_hash_seed() -> None:
    """Two processes with different string hashing run a seed the same way (the CLI runs
    seeds in worker processes, and a failing one is replayed in another)."""
    root = Path(__file__).resolve().parents[2]
    digests = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run(
            [sys.executable, "-c", _HASH_PROBE],
            capture_output=True,
            text=True,
            cwd=root,
            env=env,
            timeout=300,
            check=True,
        )
        digests.add(out.stdout.strip())
    assert len(digests) == 1


def test_a_trace_goes_to_json_and_back() -> None:
    """A trace written as JSON reads back equal."""
    trace = simulate(SCENARIOS["two-pods"](), 1).trace
    assert Trace.from_json(trace.to_json()) == trace


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{}", "not a trace: KeyError"),
        ("[1]", "not a trace"),
        ("{not json", "not a trace: JSONDecodeError"),
    ],
)
def test_a_bad_trace_is_refused(text: str, message: str) -> None:
    """A document that is no trace raises ScenarioError saying so."""
    with pytest.raises(ScenarioError, match=message):
        Trace.from_json(text)


def test_a_replayed_trace_without_noise_takes_the_simplest_choices() -> None:
    """Where a trace has no noise left, every latency is the median: a plain, valid run."""
    trace = attrs.evolve(plan(SCENARIOS["one-execserver"](), 2), noise=())
    result = replay(trace, tolerate=known)
    assert result.ok
    assert result.figures.done == len(trace.jobs)
    assert result.trace.noise == ()


# -- checks ----------------------------------------------------------------------------------


def test_a_service_no_pod_offers_fails_without_a_violation() -> None:
    """A step whose service no pod offers fails for good after its attempts: expected, not a
    violation; the others are done."""
    scenario = attrs.evolve(
        SCENARIOS["pod-churn"](),
        services=(*SCENARIOS["pod-churn"]().services, ServiceSpec(name="video")),
        producers=(
            ProducerSpec(
                name="uploads",
                arrival=Dist.exponential(0.5),
                services={"preview": 1.0, "video": 0.2},
            ),
        ),
        duration=20.0,
    )
    result = simulate(scenario, 0, tolerate=known)
    assert result.ok, result.violations
    assert result.figures.failed >= sum(1 for job in result.trace.jobs if job.service == "video")
    assert result.figures.done > 0


def _too_much_work() -> Scenario:
    """Five seconds of calls for jobs of half a minute, and half a second to settle."""
    base = SCENARIOS["one-execserver"]()
    hold = attrs.evolve(base.services[0], duration=Dist.fixed(30.0))
    return attrs.evolve(base, services=(hold,), settle=0.5, duration=5.0)


def test_liveness_fails_a_run_whose_work_cannot_end_in_time() -> None:
    """With a bound shorter than the work, the jobs still open at the end are violations."""
    scenario = _too_much_work()
    result = simulate(scenario, 0, tolerate=known)
    assert {v.kind for v in result.violations} == {"liveness"}
    assert all("never ended" in v.message for v in result.violations)


def test_a_grant_is_judged_with_the_slots_it_took_given_back() -> None:
    """fits_without: a higher want fits once the granted slots are given back, unless its
    own limits stop it."""
    pool = SlotPool(PoolConfig(size=2, unknown_share=1.0, max_slots={"a": 0, "b": 1}))
    pool.acquire("a")
    pool.acquire("b")
    assert not pool.fits("a")
    assert fits_without(pool, "a", ["a"])
    assert fits_without(pool, "b", ["a"]) is False  # b's own cap of 1 is taken
    assert fits_without(pool, "b", ["b"])


# -- shrinking -------------------------------------------------------------------------------


def test_a_failing_trace_shrinks_to_what_it_needs() -> None:
    """Asked to keep "a preview job ran on pod-1", the shrinker drops the noise and most
    jobs (those that make the pools grow to pod-1 stay), and the shorter trace still does it."""
    scenario = attrs.evolve(SCENARIOS["pod-churn"](), duration=20.0)
    full = simulate(scenario, 2).trace

    def on_pod_1(result: Result) -> bool:
        return any("pod-1 starts run" in line and "preview" in line for line in result.log)

    def still(result: Result) -> bool:
        return on_pod_1(replay(result.trace, log_size=100_000))

    assert still(simulate(scenario, 2))
    small = shrink(full, still, budget=200)
    assert len(small.jobs) < len(full.jobs) // 5
    assert small.noise == ()
    assert still(replay(small))


def test_shrinking_a_run_that_does_not_fail_is_refused() -> None:
    trace = simulate(SCENARIOS["two-pods"](), 0).trace
    with pytest.raises(ValueError, match="breaks no check"):
        shrink(trace)


# -- what-ifs and the report -------------------------------------------------------------------


def test_what_if_adds_execservers_behind_the_balancer() -> None:
    scenario = SCENARIOS["two-pods"]()
    more = what_if(scenario, add_execservers=3, slots=2, clients=5)
    assert [pod.name for pod in more.pods] == ["pod", "added"]
    assert more.pods[1].count == 3
    assert more.balancers[0].pods == ("pod", "added")
    assert {pod.slots for pod in more.pods} == {2}
    assert more.clients[0].count == 5
    assert what_if(scenario) == scenario


def test_what_if_without_a_balancer_gives_the_clients_the_new_addresses() -> None:
    more = what_if(SCENARIOS["one-execserver"](), add_execservers=2)
    assert more.clients[0].addresses == ("exec", "added-0", "added-1")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"add_execservers": -1}, "add_execservers: expected a number >= 0"),
        ({"slots": 0}, "slots: expected a number >= 1"),
        ({"clients": 0}, "clients: expected a number >= 1"),
    ],
)
def test_a_bad_what_if_is_refused(changes: dict[str, int], message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        what_if(SCENARIOS["two-pods"](), **changes)


def test_more_execservers_shorten_the_waits() -> None:
    """The what-if of twice the pods on a loaded fleet: the p99 wait drops."""
    scenario = attrs.evolve(SCENARIOS["two-pods"](), duration=30.0)
    base = [simulate(scenario, s, record=False).figures for s in range(2)]
    more = [simulate(what_if(scenario, add_execservers=2), s, record=False).figures for s in (0, 1)]

    def p99(runs: list[Any]) -> float:
        return percentile([w for r in runs for ws in r.waits.values() for w in ws], 99)

    assert p99(more) < p99(base)


def test_the_capacity_report_names_its_figures() -> None:
    runs = [simulate(SCENARIOS["two-pods"](), s, record=False).figures for s in (0, 1)]
    text = "\n".join(capacity_report("two-pods", runs))
    for heading in ("throughput", "slot use", "wait", "priority  2", "share", "pod-0"):
        assert heading in text
    assert "#" in text
    assert re.search(r"\n    b +\d+\.\d% +p50 \d+\.\d+s", text), text


def test_the_plot_is_as_high_as_asked() -> None:
    lines = plot([(0.0, 0), (5.0, 10), (10.0, 4)], width=20, height=5)
    assert len(lines) == 7
    assert lines[0].startswith("10 |")
    assert plot([]) == ["(no samples)"]


# -- the command -------------------------------------------------------------------------------


def test_the_command_lists_the_scenarios(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--list"]) == 0
    out = capsys.readouterr().out
    for name in SCENARIOS:
        assert name in out


def test_the_command_prints_the_capacity_report_and_a_what_if(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Seeds that keep every check: the report, then the what-if's (exit 0)."""
    status = main(["simulate", "one-execserver", "--seeds", "0", "--jobs", "1", "--slots", "2"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "scenario one-execserver: 1 seed" in out
    assert "what if: 2 slots each" in out
    assert out.count("throughput") == 2


def _write_scenario(path: Path, scenario: Scenario) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(scenario.to_dict()), encoding="utf-8")
    return path


def test_the_command_prints_a_violation_with_its_seed_and_shrunk_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A scenario from a YAML file whose bound is too short for its work: exit 1, the seed,
    the violation, the shrunk trace and the end of its run; the trace file replays it."""
    path = _write_scenario(tmp_path / "short.yml", _too_much_work())
    out_trace = tmp_path / "trace.json"
    status = main(["simulate", str(path), "--seeds", "3", "--trace-out", str(out_trace)])
    out = capsys.readouterr().out
    assert status == 1
    assert "seed 3:" in out
    assert "liveness" in out
    shrunk = re.search(r"shrunk trace of seed 3: (\d+) job\(s\), 0 fault\(s\), 0 random", out)
    assert shrunk is not None, out
    assert int(shrunk.group(1)) <= 5  # four slots: a fifth job cannot end in time
    assert "JobInput(" in out
    assert main(["simulate", str(out_trace), "--replay"]) == 1
    assert "never ended" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "nowhere"], "no scenario 'nowhere'"),
        (["simulate"], "give a SCENARIO"),
        (["simulate", "two-pods", "--slots", "0"], "--slots and --clients need at least 1"),
    ],
)
def test_the_command_refuses_bad_input(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_the_command_refuses_a_bad_scenario_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.yml"
    path.write_text("pods: [1]\n", encoding="utf-8")
    assert main(["simulate", str(path)]) == 2
    assert f"{path}: missing 'name'" in capsys.readouterr().err
    path.write_text("- a list\n", encoding="utf-8")
    assert main(["simulate", str(path)]) == 2
    assert "expected a mapping at the top" in capsys.readouterr().err
    assert main(["simulate", str(tmp_path / "missing.json"), "--replay"]) == 2
    assert "No such file" in capsys.readouterr().err


@pytest.mark.parametrize("seeds", ["5..2", "x", "-1..3"])
def test_the_command_refuses_bad_seeds(seeds: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", "two-pods", "--seeds", seeds])
    assert exit_.value.code == 2
    assert "--seeds" in capsys.readouterr().err


def test_a_dumped_scenario_is_a_file_the_command_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", "one-execserver", "--dump"]) == 0
    path = tmp_path / "mine.json"
    path.write_text(capsys.readouterr().out, encoding="utf-8")
    assert main(["simulate", str(path), "--seeds", "0", "--jobs", "1"]) == 0
    assert "scenario one-execserver: 1 seed" in capsys.readouterr().out


def test_the_scenario_checks_its_own_specs() -> None:
    """Specs built in Python are checked too."""
    with pytest.raises(ScenarioError, match="services: expected at least one service"):
        PodSpec(name="p", services=())
    with pytest.raises(ScenarioError, match="addresses: expected at least one"):
        ClientSpec(name="c", addresses=())


def test_the_readme_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """The README's *Simulate your fleet* example runs as written and prints a report."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    (example,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "what_if" in b]
    exec(example, {})
    assert "scenario two-pods + 1: 2 seeds" in capsys.readouterr().out
