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

from pathlib import Path
from typing import Final

import pytest

from tests.support.imports import import_cycles, import_graph, underscore_imports

ROOT = Path(__file__).resolve().parents[1]
DAEMONS = ROOT / "daemons"
PACKAGE = DAEMONS / "trio_broker_daemons"

ROOMS: Final = frozenset(
    {"__init__.py", "__main__.py", "py.typed"}
    | {"commands", "config", "execserver", "fylr", "runtime"}
)


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


def test_no_library_module_imports_private_names() -> None:
    """Under trio_broker/ the same holds."""
    assert underscore_imports(ROOT, ROOT / "trio_broker") == []


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
    graph = import_graph(PACKAGE)
    assert "trio_broker_daemons.commands.cli" in graph
    assert "trio_broker_daemons.execserver.app" in graph["trio_broker_daemons.execserver.daemon"]
    assert import_cycles(PACKAGE) == []


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
    assert import_cycles(package) == [
        ["trio_broker_daemons.daemon", "trio_broker_daemons.execserver"]
    ]
