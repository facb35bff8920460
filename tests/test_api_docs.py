"""The API reference (docs/api/) builds from the docstrings without a warning.

Sphinx runs with warnings as errors over every public module of the library, so
a docstring that breaks the markup, a module that no longer imports or a page
that names a module that is gone fails here instead of rotting unseen.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ROOT / "docs" / "api"

pytest.importorskip("sphinx", reason="the API reference needs sphinx (the test extra)")


def documented_modules() -> set[str]:
    return {
        line.split("::", 1)[1].strip()
        for page in SOURCES.glob("*.rst")
        for line in page.read_text().splitlines()
        if line.startswith(".. automodule::")
    }


def _package(path: Path, part: str) -> bool:
    """A package below the part (``testing/sim/__init__.py``): its own page entry."""
    return path.name == "__init__.py" and path.parent.name != part


def test_every_public_module_of_the_library_has_a_page() -> None:
    """Each module of trio_broker.core, .trio and .testing (and its packages) is on a page
    (none forgotten)."""
    modules = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for part in ("core", "trio", "testing")
        for path in (ROOT / "trio_broker" / part).rglob("*.py")
        if not path.name.startswith("_") or _package(path, part)
    }
    assert documented_modules() == modules


def test_the_api_reference_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    """sphinx-build -W: no warning from any docstring; the pages hold the classes."""
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-q", "-E", "-W", "--keep-going", "-b", "html",
         str(SOURCES), str(tmp_path / "html")],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    core = (tmp_path / "html" / "core.html").read_text()
    assert 'id="trio_broker.core.broker.Broker"' in core
    trio_page = (tmp_path / "html" / "trio.html").read_text()
    assert 'id="trio_broker.trio.pages.health_pages"' in trio_page
