"""The layering rules of the package, checked on the code itself.

- every module of the sans-IO core (``trio_broker/core``) imports alone without
  loading trio, and so do the public harness (``trio_broker/testing``) and the
  package's face (``import trio_broker``);
- no module of the library (``trio_broker/``) imports the reference daemons
  (``trio_broker_daemons``), neither in its source nor when it is imported;
- no two modules of the library import each other, directly or around a circle
  (:func:`import_cycles`, which takes any package folder).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "trio_broker"


def module_name(path: Path, top: Path = ROOT) -> str:
    parts = path.relative_to(top).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_under(folder: Path) -> list[str]:
    return sorted(module_name(path) for path in folder.rglob("*.py"))


# Imports every module alone (trio and the package forgotten between modules) and
# prints the ones after which the module named in argv[1] was loaded.
PROBE = """
import importlib, sys
watched, modules = sys.argv[1], sys.argv[2:]
leaks = []
for name in modules:
    for key in [k for k in sys.modules if k.split(".")[0] in (watched, "trio_broker")]:
        del sys.modules[key]
    importlib.import_module(name)
    if watched in sys.modules:
        leaks.append(name)
print(" ".join(leaks))
"""


def leaks(watched: str, modules: list[str]) -> list[str]:
    # trio registers a hypothesis plugin that imports trio whenever hypothesis is
    # imported; that is the environment's doing, not ours, so plugins are off here.
    env = {**os.environ, "HYPOTHESIS_NO_PLUGINS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", PROBE, watched, *modules],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_the_core_modules_each_import_without_trio() -> None:
    """Every module under trio_broker/core, imported alone, leaves trio unloaded."""
    core = modules_under(LIBRARY / "core")
    assert "trio_broker.core.broker" in core
    assert len(core) > 10
    assert leaks("trio", core) == []


def test_the_harness_and_the_package_face_import_without_trio() -> None:
    """The public model checks and ``import trio_broker`` leave trio unloaded too."""
    assert leaks("trio", ["trio_broker", *modules_under(LIBRARY / "testing")]) == []


def test_no_library_source_imports_the_daemons() -> None:
    """No import statement under trio_broker/ names the daemons package."""
    found = []
    for path in sorted(LIBRARY.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module is not None:
                names = [node.module]
            found += [
                f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
                for name in names
                if name.split(".")[0] == "trio_broker_daemons"
            ]
    assert found == []


@pytest.mark.parametrize("folder", ["core", "trio", "testing"])
def test_importing_the_library_never_loads_the_daemons(folder: str) -> None:
    """Importing any library module leaves trio_broker_daemons unloaded."""
    assert leaks("trio_broker_daemons", modules_under(LIBRARY / folder)) == []


# -- import circles ----------------------------------------------------------------------


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports.

    ``root`` is a package folder (``trio_broker/``, ``daemons/trio_broker_daemons/``);
    names are dotted from its parent. Every import statement counts: at the top
    level, under ``if TYPE_CHECKING:`` (a circle a type checker must resolve) and
    inside functions (it closes the circle as surely, only later).
    ``from a import b`` counts as importing the submodule ``a.b`` when there is
    one, else ``a``; relative imports are resolved. The packages a dotted name
    passes through are not counted: Python runs a package's ``__init__`` before
    its submodules, whoever imports them.
    """
    paths = {module_name(path, root.parent): path for path in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
                continue
            if not isinstance(node, ast.ImportFrom):
                continue
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.add(submodule if submodule in paths else base)
        graph[name] = {target for target in targets if target in paths and target != name}
    return graph


def import_cycles(root: Path) -> list[list[str]]:
    """The import circles among the modules under ``root``, each sorted; none when clean.

    A circle is a group of modules of :func:`import_graph` that each reach all the
    others by following imports.
    """
    graph = import_graph(root)
    reach: dict[str, set[str]] = {}
    for start in graph:
        seen: set[str] = set()
        todo = list(graph[start])
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo.extend(graph[module])
        reach[start] = seen
    circles = {
        tuple(sorted(other for other in reach[module] if module in reach[other]))
        for module in graph
        if module in reach[module]
    }
    return sorted(list(circle) for circle in circles)


def test_the_library_has_no_import_circle() -> None:
    """No module under trio_broker/ imports one that imports it back, around any
    circle (imports for the type checker and inside functions included)."""
    graph = import_graph(LIBRARY)
    assert "trio_broker.core.protocol" in graph["trio_broker.core.broker"]
    assert import_cycles(LIBRARY) == []


def test_the_circle_finder_sees_hidden_and_submodule_imports(tmp_path: Path) -> None:
    """A circle closed by a ``TYPE_CHECKING`` import, a ``from package import submodule``
    and a relative import is found, and one closed inside a function; importing a
    submodule does not import back the package it sits in."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from pkg import a\n",
        "a.py": "from pkg.sub import b\n",
        "sub/__init__.py": "",
        "sub/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..c import C\n",
        "c.py": "import pkg.a\nclass C: ...\n",
        "d.py": "import pkg.e\n",
        "e.py": "def later():\n    import pkg.d\n",
    }
    for name, text in files.items():
        (package / name).write_text(text)
    assert import_graph(package)["pkg.sub.b"] == {"pkg.c"}
    assert import_cycles(package) == [["pkg.a", "pkg.c", "pkg.sub.b"], ["pkg.d", "pkg.e"]]
