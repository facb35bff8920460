"""Test-session setup shared by every test module."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# These 2-core machines are noisy: no per-example deadlines, ever.
settings.register_profile(
    "default",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("thorough", parent=settings.get_profile("default"), max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# PostgreSQL fixtures (pg_cluster, pg_dsn) for the queue store and dispatcher tests.
from tests.support.pg import pg_cluster, pg_dsn  # noqa: E402, F401
