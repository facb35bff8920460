"""The simulator's soak: ten thousand seeds across the shipped scenarios (make soak).

Every seed must keep every check but the known defects (test_sim_defects); how
often each of those showed is printed, for the record.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ProcessPoolExecutor

import pytest

from tests.testing.test_sim_defects import KNOWN_DEFECTS, known
from trio_broker.testing.sim.library import SCENARIOS
from trio_broker.testing.sim.model import Violation
from trio_broker.testing.sim.run import simulate

SMALL = [name for name in SCENARIOS if not name.startswith("fleet-")]
TOTAL = 10_000
FIRST = 1_000
"""The soak's seeds start here (make test runs the first few of each scenario)."""
SHORT: dict[str, str] = {}
"""A short name for each known defect (test_sim_defects.KNOWN_DEFECTS), for the table."""


def _one(job: tuple[str, int]) -> tuple[str, int, tuple[Violation, ...], tuple[str, ...]]:
    name, seed = job
    result = simulate(SCENARIOS[name](), seed, record=False, log_size=0, tolerate=known)
    defects = tuple(
        sorted(
            {
                SHORT[reason]
                for v in result.tolerated
                for reason, matches in KNOWN_DEFECTS.items()
                if matches(v)
            }
        )
    )
    return name, seed, result.violations, defects


@pytest.mark.soak
def test_ten_thousand_seeds_keep_every_check() -> None:
    """10,000 seeds, spread evenly over the small shipped scenarios, in two processes."""
    per = -(-TOTAL // len(SMALL))
    jobs = [(name, seed) for seed in range(FIRST, FIRST + per) for name in SMALL]
    broken: list[tuple[str, int, Violation]] = []
    defects: Counter[tuple[str, str]] = Counter()
    with ProcessPoolExecutor(max_workers=2) as pool:
        for done, (name, seed, violations, found) in enumerate(pool.map(_one, jobs, chunksize=8)):
            if violations:
                broken.append((name, seed, violations[0]))
                print(f"\n{name} seed {seed}: {violations[0]}", flush=True)
            defects.update((name, reason) for reason in found)
            if (done + 1) % 500 == 0:
                print(f"\n{done + 1} seeds, {len(broken)} broken", flush=True)
    print(f"\n{len(jobs)} seeds; seeds showing a known defect:")
    for (name, reason), count in sorted(defects.items()):
        print(f"  {name:<18} {count:>5}  {reason}")
    assert broken == []
