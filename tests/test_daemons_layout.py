"""The reference daemons' layout, checked on the code itself.

- the package's top level shows what it holds: the command line
  (``commands/``), the configuration both daemons share (``config/``), one
  folder per daemon (``execserver/``, ``fylr/``) and what their processes share
  (``runtime/``);
- no module imports another module's underscore names (``from X import _name``)
  of the project, neither in the daemons nor in the library: a name that is
  shared is public, or it lives where it is used;
- no import circle among the daemons' modules, counting every import statement
  (those deferred into a function and those for type checking only included).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest

ROOT = Path(__file__).resolve().parents[1]
DAEMONS = ROOT / "daemons"
PACKAGE = DAEMONS / "trio_broker_daemons"
PROJECT: Final = frozenset({"trio_broker", "trio_broker_daemons"})

ROOMS: Final = frozenset(
    {"__init__.py", "__main__.py", "py.typed"}
    | {"commands", "config", "execserver", "fylr", "runtime"}
)

# The library's own, left to the change that reworks trio_broker/core: the client core
# takes the records of its private module by their private names. A new one fails.
LIBRARY_KNOWN: Final = frozenset(
    f"trio_broker/core/client.py: from trio_broker.core._client_records import {name}"
    for name in ("_Address", "_Conn", "_Job", "_bare")
)


def module_name(path: Path, base: Path) -> str:
    parts = path.relative_to(base).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, wherever it stands."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


def absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module an ``import from`` names, relative imports resolved against ``module``."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def underscore_imports(base: Path, folder: Path) -> list[str]:
    """``file: from X import _name`` for every private name taken from a project module."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        name = module_name(path, base)
        for node in imports(path):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = absolute(node, name, path.name == "__init__.py")
            if node.level == 0 and source.split(".")[0] not in PROJECT:
                continue
            found += [
                f"{path.relative_to(base)}: from {source} import {alias.name}"
                for alias in node.names
                if alias.name.startswith("_")
                and not (alias.name.startswith("__") and alias.name.endswith("__"))
            ]
    return found


def import_graph(base: Path) -> dict[str, set[str]]:
    """Module → the modules under ``base`` it imports (a ``from`` import of a module
    counts as that module)."""
    paths = {module_name(path, base): path for path in base.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        edges: set[str] = set()
        for node in imports(path):
            if isinstance(node, ast.Import):
                edges |= {alias.name for alias in node.names if alias.name in paths}
                continue
            source = absolute(node, name, path.name == "__init__.py")
            for alias in node.names:
                if f"{source}.{alias.name}" in paths:
                    edges.add(f"{source}.{alias.name}")
                elif source in paths:
                    edges.add(source)
        graph[name] = edges - {name}
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (``a, b, …, a``), or ``None`` when the graph has none."""
    on_path: list[str] = []
    done: set[str] = set()

    def visit(node: str) -> list[str] | None:
        on_path.append(node)
        for child in sorted(graph[node]):
            if child in on_path:
                return [*on_path[on_path.index(child) :], child]
            if child not in done and (circle := visit(child)) is not None:
                return circle
        on_path.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done and (circle := visit(start)) is not None:
            return circle
    return None


def test_the_package_shows_its_rooms() -> None:
    """Its top level is the commands, the shared configuration, one folder per daemon
    and the runtime they share: no module lies loose beside them."""
    entries = {entry.name for entry in PACKAGE.iterdir() if entry.name != "__pycache__"}
    assert entries == ROOMS


def test_the_test_fixtures_live_with_the_tests() -> None:
    """HAProxy and the daemons as processes are test fixtures: tests/support, not the package."""
    assert (ROOT / "tests" / "support" / "haproxy.py").is_file()
    assert (ROOT / "tests" / "support" / "processes.py").is_file()
    assert not [p for p in PACKAGE.rglob("*.py") if p.name in ("haproxy.py", "processes.py")]


def test_no_daemon_module_imports_private_names() -> None:
    """No module of the daemons takes another module's underscore name."""
    assert underscore_imports(DAEMONS, PACKAGE) == []


def test_the_library_takes_no_new_private_names() -> None:
    """Under trio_broker/ the same holds, but for the known imports its own rework removes."""
    found = underscore_imports(ROOT, ROOT / "trio_broker")
    assert set(found) - LIBRARY_KNOWN == set()


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from trio_broker_daemons.config.values import show", []),
        ("from trio_broker_daemons.config.values import _show", ["_show"]),
        ("from trio_broker._version import __version__", []),
        ("from . import _rules", ["_rules"]),
        ("from trio_broker.core import protocol as _p", []),
        ("from attrs import _make", []),
    ],
)
def test_the_private_name_check_sees_what_it_should(
    tmp_path: Path, source: str, expected: list[str]
) -> None:
    """The check itself: a project module's private name counts, whatever the form; a
    dunder, an alias and another project's names do not."""
    package = tmp_path / "trio_broker_daemons"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text(source + "\n")
    found = underscore_imports(tmp_path, package)
    assert [line.rsplit(" ", 1)[1] for line in found] == expected


def test_the_daemons_import_no_circle() -> None:
    """The import graph of the daemons' modules has no circle."""
    graph = import_graph(DAEMONS)
    assert "trio_broker_daemons.commands.cli" in graph
    assert "trio_broker_daemons.execserver.app" in graph["trio_broker_daemons.execserver.daemon"]
    assert find_circle(graph) is None


def test_the_circle_check_finds_a_deferred_circle(tmp_path: Path) -> None:
    """The check itself: two modules that import each other, one of them inside a
    function, are a circle."""
    package = tmp_path / "trio_broker_daemons"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "daemon.py").write_text("from trio_broker_daemons.execserver import serve\n")
    (package / "execserver.py").write_text(
        "def serve() -> None:\n    from trio_broker_daemons.daemon import warn\n"
    )
    circle = find_circle(import_graph(tmp_path))
    assert circle is not None
    assert set(circle) == {"trio_broker_daemons.daemon", "trio_broker_daemons.execserver"}
    assert circle[0] == circle[-1]
