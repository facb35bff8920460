"""Sphinx configuration of the API reference (built by tests/test_api_docs.py).

sphinx-build -W -b html docs/api docs/api/_build/html
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from trio_broker._version import __version__  # noqa: E402

project = "trio_broker"
author = "the trio_broker authors"
copyright = "the trio_broker authors"
version = release = __version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
exclude_patterns = ["_build"]
# ``bytes`` in a type also names the ``bytes`` attributes of the pipe classes;
# the builtin is meant, and these ambiguity notes are not problems of the docs
suppress_warnings = ["ref.python"]
html_theme = "alabaster"
html_static_path: list[str] = []
