"""Test-session setup shared by every test module."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

# These 2-core machines are noisy: no per-example deadlines, ever.
settings.register_profile(
    "default",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("thorough", parent=settings.get_profile("default"), max_examples=2000)
# scripts/mutate.py: the same examples on every run (so a test that never reached a
# mutated line behaves the same under the mutant), and no shrinking: a kill needs
# one failing example, not the smallest.
settings.register_profile(
    "mutation",
    parent=settings.get_profile("default"),
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    report_multiple_bugs=False,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# The execservers these tests start run their jobs as root when the tests run as
# root. The daemon's default there is `nobody`, and the interpreter of this
# suite's scripts may live in root's home (a virtualenv of root's Python), which
# is closed to `nobody`. The tests of job_user itself ask for the default
# (tests/support/processes.py: open_execserver_process(job_user=None)).
if os.geteuid() == 0:
    os.environ.setdefault("TRIO_BROKER_JOB_USER", "root")

# PostgreSQL fixtures (pg_cluster, pg_dsn) for the queue store and dispatcher tests.
from tests.support.pg import pg_cluster, pg_dsn  # noqa: E402, F401
