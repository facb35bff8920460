"""Queue positions against the waits they announce: the estimate at enqueue vs the measured wait.

Run: ``.venv/bin/python benchmarks/position.py`` (``--files N``, ``--slots S``,
``--job-seconds D``, ``--load L``, ``--backlog B``, ``--execservers E``).

Every daemon is a real process: ``trio-broker fylr`` with its private
PostgreSQL cluster and ``E`` ``trio-broker execserver`` processes of ``S``
slots each. The fylr's one class runs one exec-bound step per file, its
``metadata`` step, on the builtin ``sleep`` service for ``D`` seconds, so the
service's capacity is known: ``E × S / D`` steps a second.

After a warm-up (``2 × E × S`` files through, so that the execservers measured
the service's mean runtime), ``B`` files are uploaded at once and then the rest
at a steady rate, ``L`` × the capacity (a queue that neither drains nor grows
much). Right after each upload the file's ``GET /api/v1/eas/<id>`` gives its
step's ``queue`` member: the position, the competitors it counts and
``eta_s``, the estimate of how long the step takes from now until it ends.

Measured per file, on the database's clock: from the file's ``created_at`` to
its ``updated_at`` once it is ``done`` (its only step ended). The benchmark
prints the ratio estimate / measured per file (its median, its spread, and how
many files are within a factor of 2 either way), the positions it saw, and a few
files in full. Nothing is asserted: the figures are reported.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_checkout  # noqa: F401  (tests.support is this checkout's)
import httpx
import trio
import yaml

from tests.support.processes import open_execserver_process, open_fylr_process


def execserver_config(slots: int) -> str:
    return yaml.safe_dump(
        {
            "listen": "127.0.0.1:0",
            "slots": slots,
            "fast_reserve": 0,
            "unknown_share": 1.0,
            "services": {"hold": {"builtin": "sleep"}},
        }
    )


def fylr_config(state: Path, execservers: list[str], job_seconds: float) -> str:
    return yaml.safe_dump(
        {
            "listen": "127.0.0.1:0",
            "name": "bench-fylr",
            "state_dir": str(state),
            "database": None,
            "execservers": execservers,
            "classes": {
                "text": {
                    "extensions": ["txt"],
                    "metadata": {"service": "hold", "params": {"seconds": job_seconds}},
                    "versions": {},
                }
            },
        }
    )


def instant(text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text)


class Run:
    """The files of one run: what was announced at enqueue, and what came."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http
        self.announced: dict[int, dict[str, Any] | None] = {}
        self.measured: dict[int, float] = {}

    async def upload(self, name: str) -> int:
        response = await self.http.put(
            "/eas/put", params={"filename": name}, content=b"bench\n", timeout=60
        )
        response.raise_for_status()
        file_id: int = response.json()["id"]
        document = (await self.http.get(f"/api/v1/eas/{file_id}", timeout=60)).json()
        self.announced[file_id] = document.get("queue")
        return file_id

    async def wait_done(self, ids: list[int], *, within: float) -> None:
        """Until every file is done; its wait from created_at to updated_at."""
        pending = set(ids)
        with trio.fail_after(within):
            while pending:
                for file_id in sorted(pending):
                    document = (await self.http.get(f"/api/v1/eas/{file_id}", timeout=60)).json()
                    if document["status"] == "done":
                        took = instant(document["updated_at"]) - instant(document["created_at"])
                        self.measured[file_id] = took.total_seconds()
                        pending.discard(file_id)
                    elif document["status"] == "failed":
                        raise RuntimeError(f"file {file_id} failed: {document.get('error')}")
                await trio.sleep(0.5)


async def steady_load(run: Run, files: int, backlog: int, rate: float) -> list[int]:
    """``backlog`` uploads at once, then one every 1/``rate`` seconds (each on time)."""
    ids: list[int] = []

    async def one(n: int) -> None:
        ids.append(await run.upload(f"f{n}.txt"))

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for n in range(files):
            due = start + max(0, n - backlog + 1) / rate
            await trio.sleep_until(due)
            nursery.start_soon(one, n)
    return ids


def report(run: Run, ids: list[int], capacity: float) -> None:
    rows: list[tuple[int, float | None, float, dict[str, Any] | None]] = []
    for file_id in ids:
        queue = run.announced.get(file_id)
        measured = run.measured[file_id]
        if queue is None or queue.get("eta_s") is None:
            rows.append((file_id, None, measured, queue))
            continue
        rows.append((file_id, queue["eta_s"], measured, queue))
    estimated: list[tuple[float, float]] = [(e, m) for _, e, m, _ in rows if e is not None]
    print(f"  files: {len(ids)}, with an estimate at enqueue: {len(estimated)}")
    if not estimated:
        return
    ratios = [e / m for e, m in estimated]
    within = sum(1 for r in ratios if 0.5 <= r <= 2.0)
    quantiles = statistics.quantiles(ratios, n=10)
    print(
        f"  estimate / measured: median {statistics.median(ratios):.2f},"
        f" 10th percentile {quantiles[0]:.2f}, 90th {quantiles[-1]:.2f};"
        f" within a factor of 2: {within} of {len(ratios)} ({100 * within / len(ratios):.0f} %)"
    )
    took = [m for _, m in estimated]
    print(
        f"  measured enqueue → done: median {statistics.median(took):.1f} s,"
        f" max {max(took):.1f} s; estimated: median"
        f" {statistics.median(e for e, _ in estimated):.1f} s"
    )
    positions = [q["position"] for *_, q in rows if q is not None]
    print(
        f"  positions at enqueue: median {statistics.median(positions):.0f}, max {max(positions)};"
        f" position / capacity would take {statistics.median(positions) / capacity:.1f} s"
    )
    print(
        "  file  position  running  waiting  rows_ahead  held_ahead  capacity"
        "  eta_s  measured_s  basis"
    )
    for file_id, eta, measured, queue in rows[:: max(1, len(rows) // 12)]:
        if queue is None:
            print(f"  {file_id:4}  (no queue member: the step already ran)  {measured:.1f}")
            continue
        print(
            f"  {file_id:4}  {queue['position']:8}  {queue['running']:7}  {queue['waiting']!s:>7}"
            f"  {queue['rows_ahead']:10}  {queue.get('held_ahead', 0):10}  {queue['capacity']:8}"
            f"  {eta or 0:5.1f}  {measured:10.1f}"
            f"  {queue['basis']}"
        )


async def main(args: argparse.Namespace) -> None:
    capacity = args.execservers * args.slots / args.job_seconds
    rate = args.load * capacity
    print(
        f"{args.execservers} execserver(s) × {args.slots} slots, {args.job_seconds} s a step:"
        f" capacity {capacity:.1f} steps/s; load {args.load} → {rate:.2f} uploads/s after a"
        f" backlog of {args.backlog}; {args.files} files"
    )
    with tempfile.TemporaryDirectory(prefix="trio-broker-position-") as tmp:
        folder = Path(tmp)
        os.chmod(folder, 0o755)  # the private cluster runs as 'postgres' under root
        async with (
            open_execserver_process(execserver_config(args.slots)) as first,
            open_execserver_process(execserver_config(args.slots)) as second,
        ):
            execservers = [first, second][: args.execservers]
            addresses = [f"{d.host}:{d.port}" for d in execservers]
            config = fylr_config(folder / "state", addresses, args.job_seconds)
            async with (
                open_fylr_process(config) as fylr,
                httpx.AsyncClient(base_url=fylr.http_url) as http,
            ):
                run = Run(http)
                warm = [
                    await run.upload(f"warm{n}.txt")
                    for n in range(2 * args.execservers * args.slots)
                ]
                await run.wait_done(warm, within=120)
                run.announced.clear()
                started = time.monotonic()
                ids = await steady_load(run, args.files, args.backlog, rate)
                await run.wait_done(ids, within=args.files * args.job_seconds * 10 + 120)
                print(f"  run took {time.monotonic() - started:.1f} s")
                report(run, ids, capacity)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=120)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--job-seconds", type=float, default=0.5)
    parser.add_argument("--load", type=float, default=0.9)
    parser.add_argument("--backlog", type=int, default=30)
    parser.add_argument("--execservers", type=int, choices=(1, 2), default=2)
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(trio.run(main, parse()))
