"""Import statements of the project's packages, read with ``ast`` (never imported).

The layout tests use these: the import graph and its circles
(``tests/test_layers.py`` for the library, ``tests/test_daemons_layout.py`` for
the daemons) and the private names one module takes from another.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Final

PROJECT: Final = frozenset({"trio_broker", "trio_broker_daemons"})
"""The top-level packages whose private names no other module may take."""


def module_name(path: Path, top: Path) -> str:
    """The dotted name of the module at ``path``, counted from the folder ``top``."""
    parts = path.relative_to(top).with_suffix("").parts
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
