"""``python -m tests.chaos``: one chaos soak run; exit status 1 when it found a violation.

    python -m tests.chaos                    # the short version (make test's)
    python -m tests.chaos --long --seed 7    # the long one (make soak's), seed 7
    python -m tests.chaos --files 120 --kills 10 --workdir /tmp/chaos
    python -m tests.chaos --fylrs 3 --mixed --cuts 1 --escapes 10   # the short one, widened

The work folder (samples, configurations, each daemon's log) is kept when the
run found a violation, or with ``--keep``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import attrs
import trio

from tests.chaos.run import LONG, SHORT, run_chaos


def main(argv: Sequence[str] | None = None) -> int:
    if os.geteuid() == 0:
        # as under pytest (tests/conftest.py): run as root, the execservers' default job
        # user is nobody, and this interpreter may live where nobody cannot reach it
        os.environ.setdefault("TRIO_BROKER_JOB_USER", "root")
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument("--long", action="store_true", help="the long version (make soak)")
    parser.add_argument("--seed", type=int, help="the seed (default 1)")
    parser.add_argument("--files", type=int, help="how many uploads")
    parser.add_argument("--kills", type=int, help="how many kill -9 of a daemon")
    parser.add_argument("--database-restarts", type=int, help="how many database restarts")
    parser.add_argument("--drains", type=int, help="how many drains of an execserver")
    parser.add_argument("--fylrs", type=int, help="how many fylrs")
    parser.add_argument(
        "--mixed", action=argparse.BooleanOptionalAction, default=None, help="a mixed fleet"
    )
    parser.add_argument("--cuts", type=int, help="how many cuts of the last fylr's pipe path")
    parser.add_argument("--escapes", type=int, help="how many renditions by the escape preset")
    parser.add_argument("--workdir", type=Path, help="the work folder (default: a new one)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args(argv)
    plan = LONG if args.long else SHORT
    changes = {
        key: value
        for key, value in (
            ("seed", args.seed),
            ("files", args.files),
            ("kills", args.kills),
            ("database_restarts", args.database_restarts),
            ("drains", args.drains),
            ("fylrs", args.fylrs),
            ("mixed", args.mixed),
            ("cuts", args.cuts),
            ("escapes", args.escapes),
        )
        if value is not None
    }
    try:
        plan = attrs.evolve(plan, **changes)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="trio-broker-chaos-"))
    report = trio.run(run_chaos, plan, workdir)
    print(report.summary())
    if report.violations or args.keep or args.workdir:
        print(f"work folder kept: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
