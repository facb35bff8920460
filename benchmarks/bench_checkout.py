"""This checkout's root first on ``sys.path``, for the test fixtures the benchmarks use.

The benchmarks run the daemons as processes (and HAProxy in front of them) with
the fixtures of ``tests/support``, which the wheel does not ship. A benchmark
imports this module before them (``import bench_checkout``), so that ``tests.support``
is this checkout's, however the script is started (``python benchmarks/X.py``).
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
"""The repository root: the folder above ``benchmarks/``."""

sys.path.insert(0, str(ROOT))
