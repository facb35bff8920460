"""The keeper: ends what an execserver's jobs left, right after the execserver is gone.

``python -m trio_broker.trio.keeper --owner PID:START [--temp-dir DIR] [--cgroup DIR [--memory]]``

:func:`~trio_broker.trio.containment.serve_containment` starts it with a pipe as
its stdin whose other end only the execserver holds. It reads until the pipe
ends: when the execserver exits, however it exits (``kill -9`` included, the
kernel closes its end), or closes the pipe at its own orderly end. Then it

1. kills the job cgroups of the execserver's instance (``--cgroup``), at once;
2. kills every process tagged by the execserver (``--owner``, see
   :class:`~trio_broker.trio.procgroup.JobTag`) or by any other execserver
   that no longer runs, until a scan finds none (a killed process cannot fork);
3. leaves and removes the instance's cgroup folders;
4. removes the work folders in ``--temp-dir`` that no live process holds
   (:mod:`trio_broker.trio.workdir`);

and exits 0. It ignores SIGINT, SIGTERM and SIGHUP (it ends by itself, a moment
after the execserver) and runs in a session of its own. It imports neither trio
nor the execserver, so it starts fast and small.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from trio_broker.trio import cgroup, procgroup, workdir

__all__ = ["main"]

_GONE_TIMEOUT: Final = 5.0


def _owner(text: str) -> tuple[int, int]:
    pid, _, start = text.partition(":")
    if not (pid.isdigit() and start.isdigit()):
        raise argparse.ArgumentTypeError(f"expected PID:START, got {text!r}")
    return int(pid), int(start)


def main(argv: Sequence[str] | None = None) -> int:
    """Wait for the end of stdin, then clean up; the exit status."""
    parser = argparse.ArgumentParser(prog="python -m trio_broker.trio.keeper")
    parser.add_argument("--owner", type=_owner, required=True, help="the execserver's PID:START")
    parser.add_argument("--temp-dir", default=None, help="where the jobs' work folders are")
    parser.add_argument("--cgroup", default=None, help="the execserver's instance cgroup")
    parser.add_argument("--memory", action="store_true", help="the job cgroups count memory")
    args = parser.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    with open(sys.stdin.fileno(), "rb", buffering=0, closefd=False) as pipe:
        while pipe.read(4096):
            pass
    delegation = (
        None
        if args.cgroup is None
        else cgroup.Delegation(instance=Path(args.cgroup), memory=args.memory)
    )
    if delegation is not None:
        for job in delegation.jobs():
            job.kill()
    procgroup.kill_tagged(
        lambda tag: (tag.owner_pid, tag.owner_start) == args.owner or procgroup.orphaned(tag)
    )
    if delegation is not None:
        cgroup.remove_instance(delegation, timeout=_GONE_TIMEOUT)
    workdir.remove_stale(args.temp_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
