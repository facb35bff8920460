"""This checkout's root first on ``sys.path``, for the test fixtures the demo uses.

The demo runs the daemons as processes with the fixtures of ``tests/support``,
which the wheel does not ship. ``demo.py`` imports this module before them
(``import demo_checkout``), so that ``tests.support`` is this checkout's, from
any working directory (``python examples/demo.py``, ``make demo``).
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
"""The repository root: the folder above ``examples/``."""

sys.path.insert(0, str(ROOT))
