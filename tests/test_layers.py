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

from tests.support.imports import import_cycles, import_graph, module_name

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "trio_broker"


def modules_under(folder: Path) -> list[str]:
    return sorted(module_name(path, ROOT) for path in folder.rglob("*.py"))


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
