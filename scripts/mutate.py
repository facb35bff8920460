#!/usr/bin/env python3
"""Mutation testing of the sans-IO core: do the tests notice a one-token slip?

Each *mutant* changes one operator or constant of a module (``<`` into ``<=`` or
``>``, ``and`` into ``or``, ``+`` into ``-``, ``+=`` into ``-=``, a ``not``
dropped, ``True`` into ``False``, an integer ``n`` into ``n + 1``...). The
module is copied with the package and the tests into a temporary directory, the
mutant written over the copy (never over the worktree), and the module's fast
tests run against it with a small model-check budget. A mutant is *killed* when
they fail (or run past the timeout), and *survives* when they pass: either the
tests miss something, or the mutant is equivalent (behaves the same).

Run::

    .venv/bin/python scripts/mutate.py                     # book.py (the default)
    .venv/bin/python scripts/mutate.py book pool --jobs 2  # several modules
    .venv/bin/python scripts/mutate.py book --function pick --limit 10   # a quick subset
    .venv/bin/python scripts/mutate.py --all --report mutation.md        # everything
    .venv/bin/python scripts/mutate.py book --list         # print the mutants only

``make soak`` runs ``--all``. The report lists the kill rate per module and
every survivor with its line; ``docs/MUTATION.md`` says which survivors are
equivalent and which got a new check.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import coverage
import pytest

ROOT = Path(__file__).resolve().parent.parent

_MODEL = "tests/testing/test_model.py"
_BROKER_TESTS = ("tests/core/test_broker.py", "tests/core/test_figures.py")
_BROKER_MODELS = (_MODEL, "-k", "not Race")
# the client core is three modules (client.py, its job table and its connection pool),
# answered for by the same tests
_CLIENT_TESTS = (
    ("tests/core/test_client.py", "tests/core/test_client_rules.py"),
    ("tests/core/test_figures.py",),
    ("tests/testing/test_client_timers.py", "tests/testing/test_sim_defects.py", "-k", "not fylrs"),
    (_MODEL, "-k", "Race"),
)

# module name -> (path, the fast tests that guard it: pytest runs, quickest first,
# each stopping at its first failure; the next one runs only if the last passed)
MODULES: dict[str, tuple[str, tuple[tuple[str, ...], ...]]] = {
    "book": (
        "trio_broker/core/book.py",
        (("tests/core/test_book.py",), (_MODEL, "-k", "Book"), _BROKER_TESTS, _BROKER_MODELS),
    ),
    "pool": (
        "trio_broker/core/pool.py",
        (("tests/core/test_pool.py",), _BROKER_TESTS, _BROKER_MODELS),
    ),
    "broker": ("trio_broker/core/broker.py", (_BROKER_TESTS, _BROKER_MODELS)),
    "client_core": ("trio_broker/core/client.py", _CLIENT_TESTS),
    "client_jobs": ("trio_broker/core/_client_jobs.py", _CLIENT_TESTS),
    "client_pool": ("trio_broker/core/_client_pool.py", _CLIENT_TESTS),
    "admission": (
        "trio_broker/core/admission.py",
        (("tests/core/test_admission.py",), ("tests/testing/test_admission_model.py",)),
    ),
    "dispatch": (
        "trio_broker/core/dispatch.py",
        (("tests/core/test_dispatch.py",), ("tests/testing/test_dispatch_model.py",)),
    ),
}

_COMPARE_SWAPS: dict[type[ast.cmpop], tuple[type[ast.cmpop], ...]] = {
    ast.Lt: (ast.LtE, ast.Gt),
    ast.LtE: (ast.Lt, ast.GtE),
    ast.Gt: (ast.GtE, ast.Lt),
    ast.GtE: (ast.Gt, ast.LtE),
    ast.Eq: (ast.NotEq,),
    ast.NotEq: (ast.Eq,),
    ast.In: (ast.NotIn,),
    ast.NotIn: (ast.In,),
    ast.Is: (ast.IsNot,),
    ast.IsNot: (ast.Is,),
}
_BINOP_SWAPS: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.FloorDiv,
    ast.FloorDiv: ast.Mult,
    ast.BitOr: ast.BitAnd,
    ast.BitAnd: ast.BitOr,
    ast.BitXor: ast.BitOr,
    ast.LShift: ast.RShift,
    ast.RShift: ast.LShift,
}


@dataclass(frozen=True)
class Mutant:
    module: str
    index: int
    line: int
    end_line: int
    function: str
    what: str


def _functions(tree: ast.Module) -> dict[int, str]:
    """Line -> the qualified name of the innermost function around it."""
    owner: dict[int, str] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                end = child.end_lineno or child.lineno
                for line in range(child.lineno, end + 1):
                    owner[line] = name
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return owner


def _docstring_ids(tree: ast.Module) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _points(tree: ast.Module, kinds: str = "all") -> Iterator[tuple[ast.AST, str, object]]:
    """Every (node, description, change) one mutation can make, in source order.

    ``kinds``: "operator" (one-token slips), "semantic" (see :func:`_semantic_points`)
    or "all".
    """
    skip = _docstring_ids(tree)
    in_annotation: set[int] = set()
    for node in ast.walk(tree):
        for annotation in _annotations(node):
            in_annotation.update(id(n) for n in ast.walk(annotation))
    names = _names_in_scope(tree)
    nodes = [n for n in ast.walk(tree) if hasattr(n, "lineno") and id(n) not in in_annotation]
    nodes.sort(key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0)))
    for node in nodes:
        if kinds in ("all", "operator"):
            yield from _node_points(node, skip)
        if kinds in ("all", "semantic"):
            yield from _semantic_points(node, names.get(id(node), frozenset()))


# -- semantic mutation kinds ----------------------------------------------------------------
#
# Beyond one-token slips, the mistakes a reviewer makes on purpose to test a policy:
#
# * priority: a decision taken at the wrong priority (a want's ``priority`` read one band
#   low, or as the ``base`` it was parked with instead of the one aging lifted it to);
# * time: a decision taken at a slightly wrong time (a time compared a microsecond late);
# * reset: a deadline or a start of waiting reset to now where it is read (a lift that
#   restarts a want's wait, a refused job whose deadline starts over, an interval that
#   restarts at every observation);
# * rounding: a rounding direction turned (``floor`` and ``ceil`` swapped, ``a // b``
#   rounded up);
# * order: an order reversed (``min`` and ``max`` swapped, ``sorted`` reversed, a queue
#   taken from its other end, the first element read as the last).

_TIME_NAMES = frozenset(
    {"now", "_now", "deadline", "expires_at", "due", "parked_at", "last_grow", "_adjusted", "later"}
)
# what a time read is reset to, by what the enclosing function can see
_RESETS = {"deadline", "expires_at", "parked_at", "last_grow", "_adjusted", "wanted_at"}


def _names_in_scope(tree: ast.Module) -> dict[int, frozenset[str]]:
    """Node id -> the parameter names of its innermost function (``self`` included)."""
    scope: dict[int, frozenset[str]] = {}

    def visit(node: ast.AST, names: frozenset[str]) -> None:
        for child in ast.iter_child_nodes(node):
            inner = names
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                args = child.args
                every = [*args.posonlyargs, *args.args, *args.kwonlyargs]
                inner = frozenset(a.arg for a in every)
            scope[id(child)] = inner
            visit(child, inner)

    visit(tree, frozenset())
    return scope


def _time_of(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name) and node.id in _TIME_NAMES:
        return node.id
    if isinstance(node, ast.Attribute) and node.attr in _TIME_NAMES:
        return node.attr
    return None


def _now_in(names: frozenset[str]) -> str | None:
    """An expression for "now" in a function with these parameters (None: none)."""
    if "now" in names:
        return "now"
    if "self" in names:
        return "self._now"
    return None


def _semantic_points(node: ast.AST, names: frozenset[str]) -> Iterator[tuple[ast.AST, str, object]]:
    loads = isinstance(getattr(node, "ctx", None), ast.Load)
    if isinstance(node, ast.Attribute) and loads and node.attr == "priority":
        yield node, "priority: read one band low", ("sem", "(X - 2)")
        yield node, "priority: the base, not the lifted one", ("sem", "getattr(V, 'base', X)")
    if isinstance(node, ast.Compare):
        for pos, operand in enumerate([node.left, *node.comparators]):
            name = _time_of(operand)
            if name is not None:
                yield node, f"time: {name} compared 1e-6 late", ("time", pos)
    if isinstance(node, ast.Attribute) and loads and node.attr in _RESETS:
        now = _now_in(names)
        if now is not None and not (node.attr == "_adjusted" and now == "self._now"):
            yield node, f"reset: {node.attr} read as now", ("sem", now)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        method = node.func.attr
        swap = {"floor": "ceil", "ceil": "floor", "popleft": "pop", "heappop": None}.get(method)
        if method in ("floor", "ceil") and swap is not None:
            yield node, f"rounding: {method} -> {swap}", ("call", swap)
        elif method == "popleft":
            yield node, "order: popleft -> pop", ("call", "pop")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        if node.func.id in ("min", "max") and not node.keywords:
            other = "max" if node.func.id == "min" else "min"
            yield node, f"order: {node.func.id} -> {other}", ("name", other)
        elif node.func.id == "sorted":
            yield node, "order: sorted reversed", ("reverse",)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv):
        yield node, "rounding: a // b rounded up", ("sem", "-(-(L) // (R))")
    if (
        isinstance(node, ast.Subscript)
        and loads
        and isinstance(node.slice, ast.Constant)
        and node.slice.value == 0
    ):
        yield node, "order: [0] -> [-1]", ("const_index", -1)


def _node_points(node: ast.AST, skip: set[int]) -> Iterator[tuple[ast.AST, str, object]]:
    """The mutations of one node (none for most nodes)."""
    if isinstance(node, ast.Compare):
        for pos, op in enumerate(node.ops):
            for new in _COMPARE_SWAPS.get(type(op), ()):
                yield node, f"{type(op).__name__} -> {new.__name__}", ("cmp", pos, new)
    elif isinstance(node, ast.BoolOp):
        new_op = ast.Or if isinstance(node.op, ast.And) else ast.And
        yield node, f"{type(node.op).__name__} -> {new_op.__name__}", ("bool", new_op)
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINOP_SWAPS:
        new_bin = _BINOP_SWAPS[type(node.op)]
        yield node, f"{type(node.op).__name__} -> {new_bin.__name__}", ("bin", new_bin)
    elif isinstance(node, ast.AugAssign) and type(node.op) in _BINOP_SWAPS:
        new_aug = _BINOP_SWAPS[type(node.op)]
        yield node, f"{type(node.op).__name__}= -> {new_aug.__name__}=", ("aug", new_aug)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        yield node, "not dropped", ("not",)
    elif isinstance(node, ast.Constant) and id(node) not in skip:
        value = node.value
        if isinstance(value, bool):
            yield node, f"{value} -> {not value}", ("const", not value)
        elif isinstance(value, int):
            yield node, f"{value} -> {value + 1}", ("const", value + 1)
    elif isinstance(node, ast.Break):
        yield node, "break -> continue", ("break",)
    elif isinstance(node, ast.Continue):
        yield node, "continue -> break", ("continue",)


def _annotations(node: ast.AST) -> list[ast.AST]:
    found: list[ast.AST] = []
    if isinstance(node, ast.AnnAssign):
        found.append(node.annotation)
    if isinstance(node, ast.arg) and node.annotation is not None:
        found.append(node.annotation)
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns is not None:
        found.append(node.returns)
    return found


def _apply(node: ast.AST, change: tuple[object, ...]) -> ast.AST:
    kind = change[0]
    if kind == "cmp":
        assert isinstance(node, ast.Compare)
        pos, new = change[1], change[2]
        assert isinstance(pos, int)
        assert isinstance(new, type)
        node.ops[pos] = new()
    elif kind == "bool":
        assert isinstance(node, ast.BoolOp)
        assert isinstance(change[1], type)
        node.op = change[1]()
    elif kind in ("bin", "aug"):
        assert isinstance(node, ast.BinOp | ast.AugAssign)
        assert isinstance(change[1], type)
        node.op = change[1]()
    elif kind == "not":
        assert isinstance(node, ast.UnaryOp)
        return node.operand
    elif kind == "const":
        assert isinstance(node, ast.Constant)
        assert isinstance(change[1], bool | int)
        node.value = change[1]
    elif kind == "break":
        return ast.Continue()
    elif kind == "continue":
        return ast.Break()
    else:
        return _apply_semantic(node, change)
    return node


def _apply_semantic(node: ast.AST, change: tuple[object, ...]) -> ast.AST:
    kind = change[0]
    if kind == "sem":
        template = change[1]
        assert isinstance(template, str)
        text = template.replace("X", f"({ast.unparse(node)})")
        if isinstance(node, ast.Attribute):
            text = text.replace("V", f"({ast.unparse(node.value)})")
        if isinstance(node, ast.BinOp):
            text = text.replace("L", ast.unparse(node.left)).replace("R", ast.unparse(node.right))
        return ast.parse(text, mode="eval").body
    if kind == "time":
        assert isinstance(node, ast.Compare)
        pos = change[1]
        assert isinstance(pos, int)
        operand = [node.left, *node.comparators][pos]
        late = ast.BinOp(left=operand, op=ast.Add(), right=ast.Constant(1e-6))
        if pos == 0:
            node.left = late
        else:
            node.comparators[pos - 1] = late
    elif kind == "call":
        assert isinstance(node, ast.Call)
        assert isinstance(node.func, ast.Attribute)
        assert isinstance(change[1], str)
        node.func.attr = change[1]
    elif kind == "name":
        assert isinstance(node, ast.Call)
        assert isinstance(node.func, ast.Name)
        assert isinstance(change[1], str)
        node.func.id = change[1]
    elif kind == "reverse":
        assert isinstance(node, ast.Call)
        flip = [k for k in node.keywords if k.arg == "reverse"]
        if flip:
            flip[0].value = ast.UnaryOp(op=ast.Not(), operand=flip[0].value)
        else:
            node.keywords.append(ast.keyword(arg="reverse", value=ast.Constant(True)))
    elif kind == "const_index":
        assert isinstance(node, ast.Subscript)
        node.slice = ast.UnaryOp(op=ast.USub(), operand=ast.Constant(1))
    return node


class _Replace(ast.NodeTransformer):
    def __init__(self, target: int, change: tuple[object, ...]) -> None:
        self.target = target
        self.change = change
        self.count = 0

    def generic_visit(self, node: ast.AST) -> ast.AST:
        node = super().generic_visit(node)
        return node

    def visit(self, node: ast.AST) -> ast.AST:
        if getattr(node, "_mutation_id", None) == self.target:
            self.count += 1
            replaced = _apply(node, self.change)
            return ast.copy_location(replaced, node)
        return self.generic_visit(node)


def mutants(module: str, root: Path = ROOT, kinds: str = "all") -> list[tuple[Mutant, str]]:
    """Every mutant of a module (as it is under ``root``), with its source."""
    path = root / MODULES[module][0]
    source = path.read_text()
    tree = ast.parse(source)
    owner = _functions(tree)
    points = list(_points(tree, kinds))
    result = []
    for index, (node, what, change) in enumerate(points):
        mutated_tree = copy.deepcopy(tree)
        # find the same node in the copy by walking both in the same order
        originals = list(ast.walk(tree))
        copies = list(ast.walk(mutated_tree))
        target = copies[originals.index(node)]
        target._mutation_id = index  # type: ignore[attr-defined]
        replace = _Replace(index, change)  # type: ignore[arg-type]
        replace.visit(mutated_tree)
        assert replace.count == 1
        ast.fix_missing_locations(mutated_tree)
        line = getattr(node, "lineno", 0)
        end = getattr(node, "end_lineno", None) or line
        mutant = Mutant(module, index, line, end, owner.get(line, "<module>"), what)
        result.append((mutant, ast.unparse(mutated_tree)))
    return result


def _workspace() -> Path:
    """A private copy of the package and the tests."""
    base = Path(tempfile.mkdtemp(prefix="mutate-"))
    shutil.copytree(ROOT / "trio_broker", base / "trio_broker")
    shutil.copytree(ROOT / "tests", base / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", base / "pyproject.toml")
    return base


_ENV = {
    "HYPOTHESIS_PROFILE": "mutation",  # tests/conftest.py: fixed examples, no shrinking
    "PYTHONHASHSEED": "0",
    "PYTHONDONTWRITEBYTECODE": "1",
}


def _pytest(base: Path, args: list[str], timeout: float, scale: str) -> str:
    """Run pytest in the workspace: "passed", "failed", "timeout" or "error"."""
    env = dict(os.environ, TRIO_BROKER_MODEL_SCALE=scale, **_ENV)
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args]
    try:
        done = subprocess.run(
            command, cwd=base, env=env, capture_output=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return "timeout"
    if done.returncode == 0:
        return "passed"
    if done.returncode == 1:
        return "failed"
    # interrupted, internal error, usage, nothing collected: a mutant that breaks
    # the import fails collection (an Error), anything else is the script's fault
    return "failed" if b"Error" in done.stdout + done.stderr else "error"


# -- which tests reach which line --------------------------------------------------------


class LineRecorder:
    """A pytest plugin: each test's coverage context, and how long the test takes.

    Lines run outside a test (imports, decorators, default arguments, module
    constants) land in the empty context: a mutant there can change every test.
    """

    def __init__(self, cov: coverage.Coverage) -> None:
        self.cov = cov
        self.seconds: dict[str, float] = {}
        self.failed: list[str] = []

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Iterator[None]:
        self.cov.switch_context(item.nodeid)
        started = time.perf_counter()
        yield
        self.seconds[item.nodeid] = time.perf_counter() - started
        self.cov.switch_context("")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            self.failed.append(report.nodeid)


def _record(target: str, out: str, pytest_args: list[str]) -> int:
    """The child side of :func:`_cover`: run pytest under coverage, one context per test."""
    target = os.path.realpath(target)
    cov = coverage.Coverage(data_file=None, include=[target], config_file=False)
    recorder = LineRecorder(cov)
    cov.start()
    try:
        code = pytest.main(["-q", "-p", "no:cacheprovider", *pytest_args], plugins=[recorder])
    finally:
        cov.stop()
    by_line = cov.get_data().contexts_by_lineno(target)
    tests: dict[str, tuple[list[int], float]] = {n: ([], s) for n, s in recorder.seconds.items()}
    import_lines = []
    for line, contexts in sorted(by_line.items()):
        for context in contexts:
            if context in tests:
                tests[context][0].append(line)
            else:
                import_lines.append(line)
    data = {"import": import_lines, "tests": tests, "failed": recorder.failed}
    Path(out).write_text(json.dumps(data))
    return int(code)


@dataclass
class Coverage:
    """Which of a module's guard tests reach each line, from one traced run."""

    import_lines: set[int]
    tests: dict[str, tuple[set[int], float]]

    def select(self, mutant: Mutant) -> list[str]:
        """The tests that can notice the mutant, quickest first (none: no test reaches it).

        The tests run with fixed examples, so a test that never ran the mutated
        lines before the mutant runs them the same way under the mutant: the
        selection loses no kill.
        """
        span = set(range(mutant.line, mutant.end_line + 1))
        if span & self.import_lines:
            chosen = list(self.tests)
        else:
            chosen = [name for name, (lines, _) in self.tests.items() if span & lines]
        return sorted(chosen, key=lambda name: self.tests[name][1])

    def seconds(self, names: list[str]) -> float:
        return sum(self.tests[name][1] for name in names)


def _cover(base: Path, module: str, scale: str) -> Coverage:
    """Run the module's guard tests once, traced, in the workspace (no mutant)."""
    target = str(base / MODULES[module][0])
    env = dict(os.environ, TRIO_BROKER_MODEL_SCALE=scale, **_ENV)
    coverage = Coverage(set(), {})
    for phase in MODULES[module][1]:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            command = [sys.executable, __file__, "--record", target, out.name, "--", *phase]
            done = subprocess.run(command, cwd=base, env=env, capture_output=True, check=False)
            text = Path(out.name).read_text() if Path(out.name).stat().st_size else ""
        if done.returncode != 0 or not text:
            tail = (done.stdout + done.stderr).decode(errors="replace")[-2000:]
            raise SystemExit(f"{module}: the tests fail without any mutant ({phase}):\n{tail}")
        data = json.loads(text)
        coverage.import_lines.update(data["import"])
        for name, (lines, seconds) in data["tests"].items():
            coverage.tests[name] = (set(lines), seconds)
    return coverage


def _job(
    base: Path, mutant: Mutant, source: str, tests: list[str], timeout: float, scale: str
) -> str:
    if not tests:
        return "unreached"
    target = base / MODULES[mutant.module][0]
    original = target.read_text()
    target.write_text(source)
    try:
        outcome = _pytest(base, tests, timeout, scale)
    finally:
        target.write_text(original)
    return {"passed": "survived", "failed": "killed"}.get(outcome, outcome)


def _job_untraced(
    base: Path, mutant: Mutant, source: str, timeout: float, scale: str
) -> tuple[str, int]:
    """Run the module's guard phases in order against the mutant (no selection)."""
    target = base / MODULES[mutant.module][0]
    original = target.read_text()
    target.write_text(source)
    try:
        for count, phase in enumerate(MODULES[mutant.module][1], 1):
            outcome = _pytest(base, list(phase), timeout, scale)
            if outcome != "passed":
                return {"failed": "killed"}.get(outcome, outcome), count
        return "survived", len(MODULES[mutant.module][1])
    finally:
        target.write_text(original)


def untraced(
    module: str, todo: list[tuple[Mutant, str]], timeout: float, scale: str
) -> dict[Mutant, str]:
    """Each mutant against the whole guard, phase after phase (``--no-trace``)."""
    base = _workspace()
    outcomes: dict[Mutant, str] = {}
    try:
        text = (base / MODULES[module][0]).read_text().splitlines()
        for mutant, source in todo:
            outcome, phases = _job_untraced(base, mutant, source, timeout, scale)
            outcomes[mutant] = outcome
            print(
                f"{module}#{mutant.index} line {mutant.line} {mutant.function}: {mutant.what}"
                f" [{phases} phases]: {outcome}  | {text[mutant.line - 1].strip()}",
                flush=True,
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return outcomes


def _rank(function: str, first: list[str]) -> int:
    return next((i for i, name in enumerate(first) if name in function), len(first))


def _campaign(
    module: str, todo: list[tuple[Mutant, str]], bases: list[Path], timeout: float, scale: str
) -> dict[Mutant, str]:
    """Run the mutants over the workspaces, printing each outcome as it comes."""
    poison = Mutant(module, -1, 1, 1, "<module>", "raise at import")
    raising = "raise RuntimeError('mutation workspace check')\n"
    everything = [name for phase in MODULES[module][1] for name in phase if "::" not in name]
    if _job(bases[0], poison, raising, everything[:1], timeout, scale) == "survived":
        raise SystemExit(f"{module}: the tests do not import the workspace copy")
    started = time.monotonic()
    coverage = _cover(bases[0], module, scale)
    print(
        f"{module}: {len(coverage.tests)} guard tests traced in {time.monotonic() - started:.0f} s,"
        f" {len(todo)} mutants to run",
        flush=True,
    )
    text = (bases[0] / MODULES[module][0]).read_text().splitlines()
    outcomes: dict[Mutant, str] = {}
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(len(bases)) as pool:
        free = list(bases)
        pending: dict[concurrent.futures.Future[str], tuple[Mutant, Path, int]] = {}
        queue = list(todo)
        while queue or pending:
            while queue and free:
                mutant, source = queue.pop(0)
                tests = coverage.select(mutant)
                # a traced run is slower than a plain one: its time is a generous bound
                limit = min(timeout, 60 + 3 * coverage.seconds(tests))
                base = free.pop()
                future = pool.submit(_job, base, mutant, source, tests, limit, scale)
                pending[future] = (mutant, base, len(tests))
            done, _ = concurrent.futures.wait(
                pending, return_when=concurrent.futures.FIRST_COMPLETED
            )
            for future in done:
                mutant, base, count = pending.pop(future)
                free.append(base)
                outcomes[mutant] = future.result()
                print(
                    f"{module}#{mutant.index} line {mutant.line} {mutant.function}: {mutant.what}"
                    f" [{count} tests]: {outcomes[mutant]}  | {text[mutant.line - 1].strip()}",
                    flush=True,
                )
    killed = sum(1 for o in outcomes.values() if o in ("killed", "timeout"))
    print(f"{module}: {killed}/{len(outcomes)} killed in {time.monotonic() - started:.0f} s")
    return outcomes


# -- deliberate bugs and the budgets that find them -----------------------------------------
#
# Each bug: (name, what, [(file, old text, new text) or (file, git revision)], the test
# classes that should catch it). ``--bugs`` puts one at a time into a private copy and runs
# each test class at rising ``TRIO_BROKER_MODEL_SCALE`` (fixed examples, the mutation
# profile): the smallest scale that kills it is the budget it needs.

_BEFORE_29 = "2d8d082"  # main before the turn-hold and growth-timer fixes
_M = "tests/testing/test_model.py::"
BUGS: list[tuple[str, str, list[tuple[str, ...]], list[str]]] = [
    (
        "turn-hold-ended-grant",
        "the turn hold judged by the ended job's grant (the old core)",
        [("trio_broker/core/book.py", _BEFORE_29), ("trio_broker/core/broker.py", _BEFORE_29)],
        [_M + "TestTurnHolds", _M + "TestTurnHoldAging"],
    ),
    (
        "hold-kept-after-lift",
        "a lift above a held priority (or of the holder's want to it) leaves the hold",
        [
            (
                "trio_broker/core/broker.py",
                "and self.book.age(now) and self._holds:",
                "and self.book.age(now) and self._holds and False:",
            )
        ],
        [_M + "TestTurnHolds"],
    ),
    (
        "aging-ties-reversed",
        "lifts due at one instant applied newest first (FIFO through aging)",
        [
            (
                "trio_broker/core/book.py",
                "heapq.heappush(heap, (due, self._seq, want))",
                "heapq.heappush(heap, (due, -self._seq, want))",
            )
        ],
        [_M + "TestBookAging", _M + "TestAgingBound"],
    ),
    (
        "aging-wait-reset",
        "a lift restarts the want's wait (parked_at reset to now)",
        [
            (
                "trio_broker/core/book.py",
                "priority, want.base, want.parked_at)",
                "priority, want.base, now)",
            )
        ],
        [_M + "TestBookAging"],
    ),
    (
        "unknown-share-rounded-up",
        "unknown_share rounded up (ceil) in what is admitted and reported",
        [
            (
                "trio_broker/core/pool.py",
                "return max(1, math.floor(self.unknown_share * self.size))",
                "return max(1, math.ceil(self.unknown_share * self.size))",
            )
        ],
        [_M + "TestFractionalShares"],
    ),
    (
        "capacity-rounded",
        "capacity reports round(unknown_share * size) while admission floors it",
        [
            (
                "trio_broker/core/pool.py",
                "result = min(result, config.unknown_cap)",
                "result = min(result, max(1, round(config.unknown_share * config.size)))",
            )
        ],
        [_M + "TestFractionalShares"],
    ),
    (
        "grow-timer-difference",
        "growth compares now - last_grow with the interval (the old pool)",
        [("trio_broker/core/_client_pool.py", _BEFORE_29)],
        ["tests/testing/test_client_timers.py"],
    ),
    (
        "deadline-reset-on-refusal",
        "a refused JOB restarts the job's connect_timeout",
        [
            (
                "trio_broker/core/client.py",
                "        self._jobs.wait(job, now=self._now)\n",
                "        self._jobs.wait(job, now=self._now)\n"
                "        job.deadline = self._now + self.config.connect_timeout\n",
            )
        ],
        ["tests/testing/test_client_timers.py"],
    ),
    (
        "rise-judged-by-fewest",
        "the at-least-one rise judged by the fewest waiting jobs, not the most",
        [
            (
                "trio_broker/core/admission.py",
                "1 if most == 0 else 0",
                "1 if least == 0 else 0",
            )
        ],
        ["tests/testing/test_admission_model.py"],
    ),
    (
        "fall-by-all-waiting",
        "the rise falls by every waiting job at once instead of by one",
        [
            (
                "trio_broker/core/admission.py",
                "self._rise = max(0, self._rise - 1)",
                "self._rise = max(0, self._rise - least)",
            )
        ],
        ["tests/testing/test_admission_model.py"],
    ),
    (
        "interval-strict",
        "an adjustment only strictly after adapt_interval",
        [
            (
                "trio_broker/core/admission.py",
                "now - self._adjusted >= config.adapt_interval",
                "now - self._adjusted > config.adapt_interval",
            )
        ],
        ["tests/testing/test_admission_model.py"],
    ),
]
_LADDER = (0.05, 0.1, 0.2, 0.5, 1.0, 3.0)


def _plant(base: Path, changes: list[tuple[str, ...]]) -> None:
    for change in changes:
        target = base / change[0]
        if len(change) == 2:
            shown = subprocess.run(
                ["git", "show", f"{change[1]}:{change[0]}"],
                cwd=ROOT,
                capture_output=True,
                check=True,
            )
            target.write_bytes(shown.stdout)
            continue
        text = target.read_text()
        if text.count(change[1]) != 1:
            raise SystemExit(f"{change[0]}: the bug's text is not there exactly once: {change[1]}")
        target.write_text(text.replace(change[1], change[2]))


def ladder(names: list[str], timeout: float) -> str:
    """Each bug against each of its tests: the smallest scale that kills it."""
    rows = ["| bug | test | smallest scale that kills it |", "| --- | --- | --- |"]
    for name, what, changes, tests in BUGS:
        if names and name not in names:
            continue
        base = _workspace()
        try:
            _plant(base, changes)
            for test in tests:
                found = "not at 3"
                for scale in _LADDER:
                    outcome = _pytest(base, [test], timeout, str(scale))
                    if outcome in ("failed", "timeout"):
                        found = f"{scale:g}"
                        break
                rows.append(f"| `{name}` ({what}) | `{test.split('::')[-1]}` | {found} |")
                print(rows[-1], flush=True)
        finally:
            shutil.rmtree(base, ignore_errors=True)
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help=f"any of {', '.join(MODULES)}")
    parser.add_argument("--all", action="store_true", help="every module")
    parser.add_argument("--function", help="only mutants inside functions whose name has this")
    parser.add_argument("--limit", type=int, help="at most this many mutants per module")
    parser.add_argument(
        "--skip",
        action="append",
        default=None,
        help="leave out functions whose name has this (default: check_invariants, __repr__;"
        " the checkers are test oracles; --skip '' keeps everything)",
    )
    parser.add_argument(
        "--first",
        default="",
        help="comma-separated function names whose mutants run first, in this order",
    )
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once (default 1)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds per mutant (a mutant that runs longer, an endless loop, is killed)",
    )
    parser.add_argument("--scale", default="0.2", help="TRIO_BROKER_MODEL_SCALE for the runs")
    parser.add_argument("--report", type=Path, help="also write the report (Markdown) here")
    parser.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    parser.add_argument("--only", help="comma-separated mutant numbers (as printed) to run")
    parser.add_argument(
        "--kinds",
        choices=("all", "operator", "semantic"),
        default="all",
        help="operator (one-token slips), semantic (wrong priority or time, a deadline"
        " reset, a rounding direction, an order reversed) or all (default); mutant"
        " numbers are per choice",
    )
    parser.add_argument(
        "--no-trace",
        action="store_true",
        help="run every mutant against the module's whole guard, phase after phase,"
        " without the traced run that selects tests (worth it for a few mutants)",
    )
    parser.add_argument(
        "--bugs",
        nargs="*",
        help="run the deliberate bugs (all, or these names) at rising budgets instead",
    )
    args = parser.parse_args()
    if args.bugs is not None:
        table = ladder(args.bugs, args.timeout)
        print(table)
        if args.report:
            args.report.write_text(table + "\n")
        return 0
    chosen = list(MODULES) if args.all else (args.modules or ["book"])
    unknown = [m for m in chosen if m not in MODULES]
    if unknown:
        parser.error(f"unknown module(s) {unknown}: expected any of {list(MODULES)}")

    lines = [
        "| module | mutants | killed | survived (of which no test reaches) | kill rate |",
        "| --- | --- | --- | --- | --- |",
    ]
    survivors: list[str] = []
    for module in chosen:
        # the workspaces first: mutants and tests then come from one snapshot,
        # whatever happens to the worktree meanwhile
        bases = [] if args.list else [_workspace() for _ in range(max(1, args.jobs))]
        skip = [s for s in (args.skip or ["check_invariants", "__repr__"]) if s]
        todo = [
            (m, src)
            for m, src in mutants(module, bases[0] if bases else ROOT, args.kinds)
            if (not args.function or args.function in m.function)
            and (not args.only or str(m.index) in args.only.split(","))
            and not any(s in m.function for s in skip)
        ]
        first = [name for name in args.first.split(",") if name]
        todo = sorted(todo, key=lambda item: _rank(item[0].function, first))[: args.limit]
        if args.list:
            for m, _ in todo:
                print(f"{module}#{m.index} line {m.line} {m.function}: {m.what}")
            continue
        try:
            if args.no_trace:
                outcomes = untraced(module, todo, args.timeout, args.scale)
            else:
                outcomes = _campaign(module, todo, bases, args.timeout, args.scale)
        finally:
            for base in bases:
                shutil.rmtree(base, ignore_errors=True)
        killed = sum(1 for o in outcomes.values() if o in ("killed", "timeout"))
        alive = sorted(
            (m for m, o in outcomes.items() if o in ("survived", "unreached")),
            key=lambda m: m.index,
        )
        unreached = sum(1 for o in outcomes.values() if o == "unreached")
        total = killed + len(alive)
        rate = f"{100 * killed / total:.1f} %" if total else "-"
        lines.append(f"| {module} | {total} | {killed} | {len(alive)} ({unreached}) | {rate} |")
        survivors += [
            f"- `{m.module}` #{m.index} line {m.line} (`{m.function}`): {m.what}"
            + (" (no test reaches it)" if outcomes[m] == "unreached" else "")
            for m in alive
        ]
        errors = [m for m, o in outcomes.items() if o == "error"]
        survivors += [f"- `{m.module}` line {m.line}: {m.what} (test run error)" for m in errors]
    if args.list:
        return 0
    report = "\n".join([*lines, "", "Survivors:", "", *(survivors or ["- none"]), ""])
    print(report)
    if args.report:
        args.report.write_text(report)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--record"]:  # the traced child of _cover
        sys.exit(_record(sys.argv[2], sys.argv[3], sys.argv[5:]))
    sys.exit(main())
