"""Client cost against its backlog: CPU per job and jobs/s with N run() calls waiting.

Run: ``.venv/bin/python benchmarks/backlog.py`` (``--seconds`` per measurement,
``--rounds``, ``--backlogs 10,100,1000,10000``, ``--compare CHECKOUT``).

One real execserver daemon process with a few slots (``--slots``, 4) and a no-op
service. For each backlog N, a client in a process of its own keeps N
:meth:`~trio_broker.trio.client.BrokerClient.run` calls going at once (each caller
submits its next job as soon as its last one ended), so about N jobs always wait
for the few slots. Once every caller submitted and 100 jobs are done, the client process
measures for ``--seconds``: jobs done per second, its own CPU time
(``time.process_time``) per job, and, beside it, the execserver process's CPU
time per job over the same window (``/proc``), which bounds jobs/s when the
client does not.

``--compare CHECKOUT`` runs the same client measurement with another checkout of
this repository (its ``trio_broker`` first on ``PYTHONPATH``), for example a
``git worktree`` of the previous commit, against the same execserver. Rounds
alternate which of the two goes first; the table shows each figure's median
over the rounds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import bench_checkout  # noqa: F401  (tests.support is this checkout's)
import trio

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SLOTS = 4

EXECSERVER = (
    "listen: 127.0.0.1:0\n"
    "slots: {slots}\n"
    "fast_reserve: 0\n"
    "unknown_share: 1.0\n"
    "services:\n"
    "  noop: {{builtin: noop}}\n"
)


# -- the client process -----------------------------------------------------------------


def process_cpu(pid: int) -> float:
    """CPU seconds (user and system) another process has used so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(
    address: str, backlog: int, seconds: float, warmup: float, exec_pid: int
) -> dict[str, float]:
    """In the client process: jobs/s and CPU seconds per job with ``backlog`` callers."""
    from trio_broker.core.client import ClientConfig
    from trio_broker.trio.client import open_broker_client

    config = ClientConfig(
        backend_id="backlog",
        name="backlog",
        version="1",
        addresses=(address,),
        connect_timeout=3600,
    )
    done = [0]
    warm = trio.Event()
    warm_at = min(backlog, 100)

    async with open_broker_client(config) as client:

        async def caller() -> None:
            while True:
                await client.run("noop", {})
                done[0] += 1
                if done[0] == warm_at:
                    warm.set()

        async with trio.open_nursery() as nursery:
            for _ in range(backlog):
                nursery.start_soon(caller)
            with trio.move_on_after(warmup):
                await warm.wait()  # every caller submitted, and 100 jobs are done
            if not warm.is_set():  # the client never got its backlog going
                nursery.cancel_scope.cancel()
                nan = math.nan
                return {"jobs_s": nan, "cpu_ms": nan, "exec_cpu_ms": nan, "waiting": nan}
            jobs, cpu, wall = done[0], time.process_time(), time.perf_counter()
            exec_cpu = process_cpu(exec_pid)
            await trio.sleep(seconds)
            jobs = done[0] - jobs
            cpu = time.process_time() - cpu
            exec_cpu = process_cpu(exec_pid) - exec_cpu
            wall = time.perf_counter() - wall
            waiting = client.statistics().waiting
            nursery.cancel_scope.cancel()
    return {
        "jobs_s": jobs / wall,
        "cpu_ms": 1000 * cpu / max(jobs, 1),
        "exec_cpu_ms": 1000 * exec_cpu / max(jobs, 1),
        "waiting": waiting,
    }


def run_client(
    address: str, exec_pid: int, backlog: int, seconds: float, warmup: float, checkout: str | None
) -> dict[str, float]:
    """One measurement in a fresh process (this tree, or ``checkout``'s client)."""
    tree = Path(checkout).resolve() if checkout else ROOT
    env = dict(os.environ, PYTHONPATH=f"{tree}:{tree / 'daemons'}")
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", address]
    argv += ["--exec-pid", str(exec_pid)]
    argv += ["--backlogs", str(backlog), "--seconds", str(seconds), "--warmup", str(warmup)]
    out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True, cwd=tree)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


# -- the driver ---------------------------------------------------------------------------


async def main(
    backlogs: list[int],
    seconds: float,
    warmup: float,
    rounds: int,
    slots: int,
    compare: str | None,
) -> None:
    from tests.support.processes import open_execserver_process

    trees: list[tuple[str, str | None]] = [("this", None)]
    if compare is not None:
        trees.append(("base", compare))
    results: dict[tuple[str, int], list[dict[str, float]]] = {}
    async with open_execserver_process(EXECSERVER.format(slots=slots)) as daemon:
        address = f"{daemon.host}:{daemon.port}"
        pid = daemon.process.pid
        for round_ in range(rounds):
            order = trees if round_ % 2 == 0 else trees[::-1]
            for backlog in backlogs:
                for label, checkout in order:
                    result = await trio.to_thread.run_sync(
                        run_client, address, pid, backlog, seconds, warmup, checkout
                    )
                    results.setdefault((label, backlog), []).append(result)
                    print(
                        f"round {round_ + 1} {label:>4} backlog {backlog:>6}: "
                        f"{result['jobs_s']:8,.0f} jobs/s  {result['cpu_ms']:6.3f} ms CPU/job"
                        f"  (execserver {result['exec_cpu_ms']:6.3f} ms CPU/job)",
                        flush=True,
                    )
    print()
    print(f"one execserver process, {slots} slots, no-op jobs; medians of {rounds} round(s)")
    print(f"(nan: the client did not get 100 jobs done within {warmup:g}s)")
    header = f"{'backlog':>8} " + " ".join(
        f"{label + ' jobs/s':>12} {label + ' CPU ms/job':>16} {'execserver':>10}"
        for label, _ in trees
    )
    print(header)
    for backlog in backlogs:
        cells = []
        for label, _ in trees:
            runs = results[(label, backlog)]
            rate = statistics.median(r["jobs_s"] for r in runs)
            cpu = statistics.median(r["cpu_ms"] for r in runs)
            exec_cpu = statistics.median(r["exec_cpu_ms"] for r in runs)
            cells.append(f"{rate:12,.0f} {cpu:16.3f} {exec_cpu:10.3f}")
        print(f"{backlog:>8} " + " ".join(cells))
    for label, _ in trees:
        if 100 in backlogs and 10000 in backlogs:
            at_100 = statistics.median(r["jobs_s"] for r in results[(label, 100)])
            at_10k = statistics.median(r["jobs_s"] for r in results[(label, 10000)])
            print(f"{label}: jobs/s at 10,000 waiting = {at_10k / at_100:.0%} of jobs/s at 100")


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    parser.add_argument(
        "--warmup",
        type=float,
        default=60.0,
        help="seconds the backlog may take to get its first 100 jobs done (else: nan)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--slots", type=int, default=SLOTS)
    parser.add_argument("--backlogs", default="10,100,1000,10000")
    parser.add_argument(
        "--compare",
        metavar="CHECKOUT",
        help="also measure the client of another checkout (e.g. a git worktree)",
    )
    parser.add_argument("--worker", metavar="ADDRESS", help=argparse.SUPPRESS)
    parser.add_argument("--exec-pid", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    args = parse()
    backlogs = [int(n) for n in args.backlogs.split(",")]
    if args.worker:
        result = trio.run(
            measure, args.worker, backlogs[0], args.seconds, args.warmup, args.exec_pid
        )
        print(json.dumps(result))
    else:
        trio.run(main, backlogs, args.seconds, args.warmup, args.rounds, args.slots, args.compare)
