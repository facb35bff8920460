"""The reference daemons' layout, checked on the code itself.

- the package's top level shows what it holds: the command line
  (``commands/``), the configuration both daemons share (``config/``), one
  folder per daemon (``execserver/``, ``fylr/``) and what their processes share
  (``runtime/``);
- no module imports another module's underscore names (``from X import _name``)
  of the project, neither in the daemons nor in the library: a name that is
  shared is public, or it lives where it is used;
- no import circle among the daemons' modules, counting every import statement
  (those deferred into a function and those for type checking only included);
- no string in the daemons' code is SQL on the library's queue tables: the
  application reaches them through :mod:`trio_broker.trio.store` only.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Final

import pytest

from tests.support.imports import import_cycles, import_graph, underscore_imports
from trio_broker.trio.queue_sql import TABLES

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


# -- the queue's tables are the store's ------------------------------------------------------

QUEUE_TABLES: Final = (*TABLES, "file_queue")
"""The library's queue tables, and the queue's name before migration 003."""
_TABLE = re.compile(r"(?<![\w.])\"?(" + "|".join(QUEUE_TABLES) + r")\"?(?!\w)")
_OLD_BACKENDS = re.compile(r"\b(from|join|into|update|table)\s+(only\s+)?\"?backends\b", re.I)
_SQL_WORD = re.compile(
    r"\b(select|insert|update|delete|from|join|into|where|returning|table|truncate|alter|copy)\b",
    re.I,
)


def _documentation(tree: ast.AST) -> set[int]:
    """The string constants that stand alone as statements: docstrings, never run."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str | bytes)
    }


def _queue_sql(text: str) -> bool:
    """Whether one string constant is (part of) SQL on a queue table."""
    if _OLD_BACKENDS.search(text):
        return True
    if _TABLE.search(text) is None:
        return False
    return _SQL_WORD.search(text) is not None or _TABLE.fullmatch(text.strip()) is not None


def queue_sql_in(root: Path) -> list[str]:
    """Every string constant of the modules under ``root`` that names a queue table in SQL.

    Each constant is read from the parsed source (adjacent literals joined, the
    literal parts of f-strings one by one, bytes too); docstrings are skipped. A
    constant counts when it names a table with an SQL word beside it, or is the
    bare table name (a name kept to build SQL with). Returns ``path:line: text``.
    """
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text("utf-8"), filename=str(path))
        skip = _documentation(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Constant) or id(node) in skip:
                continue
            value = node.value
            if isinstance(value, bytes):
                value = value.decode("utf-8", "replace")
            if isinstance(value, str) and _queue_sql(value):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {value.strip()[:80]}")
    return found


def test_no_daemon_module_holds_queue_sql() -> None:
    """No string in the daemons' code is SQL on the queue's tables: the application
    reaches them through the store's methods only."""
    assert queue_sql_in(PACKAGE) == []


def test_only_queue_sql_names_the_queue_tables_in_the_library() -> None:
    """Under trio_broker/ every statement on the queue's tables is in trio/queue_sql.py."""
    found = queue_sql_in(ROOT / "trio_broker")
    assert found
    assert {line.split(":", 1)[0] for line in found} == {"trio/queue_sql.py"}


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ('conn.execute("SELECT id FROM broker_queue WHERE id = %s", (1,))\n', 1),
        ('conn.execute(f"UPDATE broker_backends SET heartbeat = {now}")\n', 1),
        ('conn.execute("DELETE FROM file_queue" " WHERE action = %s", (a,))\n', 1),
        ('conn.execute(b"INSERT INTO broker_queue (file_ref) VALUES (1)")\n', 1),
        ('q = "SELECT backend_id FROM backends WHERE heartbeat > now()"\n', 1),
        ('TABLE = "broker_queue"\nq = f"SELECT * FROM {TABLE}"\n', 1),
        ('ident = sql.Identifier("broker_backends")\n', 1),
        ('"""Rows of broker_queue: read FROM the store."""\n', 0),
        ('def f():\n    """Deletes FROM broker_queue."""\n', 0),
        ('log.info("rows of broker_queue by state")\n', 0),
        ('conn.execute("SELECT id FROM files WHERE id = %s", (1,))\n', 0),
        ('text = "the backends from every fylr"\n', 0),
    ],
)
def test_the_queue_sql_check_sees_what_it_should(
    tmp_path: Path, source: str, expected: int
) -> None:
    """The check itself: SQL on a queue table counts in any literal form (joined,
    f-string, bytes, a bare table name); docstrings, prose and other tables do not."""
    (tmp_path / "mod.py").write_text(source)
    assert len(queue_sql_in(tmp_path)) == expected
