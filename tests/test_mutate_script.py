"""scripts/mutate.py: its mutants and the choice of tests each one runs."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def mutate() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mutate_script", ROOT / "scripts/mutate.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutate_script"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_mutant_changes_exactly_one_place(mutate: ModuleType) -> None:
    path = ROOT / mutate.MODULES["admission"][0]
    original = ast.dump(ast.parse(path.read_text()))
    found = mutate.mutants("admission")
    assert len(found) > 100
    sources = [source for _, source in found]
    assert len(set(sources)) == len(sources)  # no two mutants alike
    for mutant, source in found:
        assert ast.dump(ast.parse(source)) != original, mutant
        assert mutant.line <= mutant.end_line
    changes = {m.what for m, _ in found}
    assert {"Lt -> LtE", "Add -> Sub", "True -> False", "not dropped"} <= changes


def test_a_mutant_runs_the_tests_that_reach_its_lines_quickest_first(mutate: ModuleType) -> None:
    coverage = mutate.Coverage(
        import_lines={1, 2},
        tests={"slow": ({10, 11}, 5.0), "fast": ({11, 12}, 0.5), "other": ({20}, 1.0)},
    )

    def at(line: int, end: int) -> list[str]:
        chosen: list[str] = coverage.select(mutate.Mutant("admission", 0, line, end, "f", "x"))
        return chosen

    assert at(11, 11) == ["fast", "slow"]
    assert at(10, 10) == ["slow"]
    assert at(12, 20) == ["fast", "other"]  # a node over several lines
    assert at(30, 30) == []  # no test reaches it: nothing to run
    assert at(2, 2) == ["fast", "other", "slow"]  # run at import: every test
    assert coverage.seconds(["fast", "other"]) == pytest.approx(1.5)
