"""Execserver slot utilisation when steps spend most of their time outside the slot.

Run: ``.venv/bin/python benchmarks/admission.py --compare BASE_CHECKOUT``
(``--seconds``, ``--warmup``, ``--slot``, ``--outside``, ``--dsn``).

``BASE_CHECKOUT`` is a source tree of the commit to compare with, e.g. one made
by ``git worktree add /tmp/base b7618dd``; its ``trio_broker`` is put first on
the ``PYTHONPATH`` of the dispatcher process of the baseline run. Without
``--compare`` only this tree is measured.

In one run, against a private PostgreSQL cluster started in a temporary folder
(or the server ``--dsn`` names) and two real execserver daemon processes of two
slots each (``fast_reserve: 0``; a builtin ``sleep`` service, so a slot is held
for exactly the time asked for):

- for each tree, a fresh database gets ``--items`` exec-bound items, and one
  dispatcher process (default settings: the automatic cap, a database pool of
  20) drains them through a real broker client. Each item's handler sleeps
  ``--outside / 2`` seconds (fetching its input), runs a job holding a slot for
  ``--slot`` seconds, and sleeps ``--outside / 2`` seconds more (writing its
  result): by default 80 % of a step is spent outside the slot;
- the dispatcher process prints every receipt's start and duration; the slot
  utilisation is the share of the four slots' time, within the window from
  ``--warmup`` to ``--warmup + --seconds`` after the start, that jobs held.

The figures printed: utilisation (the execservers' busyness), steps per second
in the window, and the dispatcher's exec limit at the end of the window.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from typing import Any

import psycopg
import trio
import yaml
from trio_broker_daemons.fylr.pgcluster import PgCluster

EXECSERVERS = 2
SLOTS_EACH = 2
POOL = 20


# -- the dispatcher process (runs on either tree) -------------------------------------------


async def _trace(dispatcher: Any, client: Any) -> None:
    """Every second on stderr: the limit, what is in flight, and the execservers' figures."""
    start = trio.current_time()
    while True:
        await trio.sleep(1)
        s = dispatcher.statistics()
        idle = sum(load.idle for load in client.instance_loads())
        print(
            f"{trio.current_time() - start:5.1f}s limit {s.exec_limit:3} in flight "
            f"{s.exec_in_flight:3} waiting {client.waiting():3} idle {idle}",
            file=sys.stderr,
            flush=True,
        )


async def dispatcher_worker(
    dsn: str, addresses: list[str], slot: float, outside: float, seconds: float, trace: bool
) -> None:
    """Drain the queue for ``seconds``, printing each job's start and duration, then
    the dispatcher's statistics."""
    from trio_broker.core.client import ClientConfig
    from trio_broker.trio.client import open_broker_client
    from trio_broker.trio.dispatcher import Action, Dispatcher, DispatcherConfig
    from trio_broker.trio.store import QueueItem, open_store

    client_config = ClientConfig(
        backend_id="bench", name="bench", version="bench", addresses=tuple(addresses)
    )
    async with (
        open_store(dsn, pool_size=POOL, migrate=False) as store,
        open_broker_client(client_config) as client,
    ):

        async def step(item: QueueItem) -> None:
            await trio.sleep(outside / 2)  # fetching the input
            receipt = await client.run("hold", {"params": {"seconds": slot}}, subject=item.file_ref)
            if receipt.status != "ok":
                raise RuntimeError(receipt.error)
            print(f"job {receipt.started_at:.6f} {receipt.duration_s:.6f}", flush=True)
            await trio.sleep(outside / 2)  # writing the result

        def connected() -> bool:
            return len(client.instance_loads()) == EXECSERVERS

        await client.wait_until(connected, timeout=60)
        config = DispatcherConfig(backend_id="bench", name="bench")
        async with trio.open_nursery() as nursery:
            dispatcher = Dispatcher(store, [Action("step", True, step)], config, exec_client=client)
            print(f"start {time.time():.6f}", flush=True)
            await nursery.start(dispatcher.serve)
            if trace:
                nursery.start_soon(_trace, dispatcher, client)
            await trio.sleep(seconds)
            stats = dispatcher.statistics()
            print(
                f"stats {stats.exec_limit} {stats.peak_exec_in_flight} {stats.exec_in_flight}",
                flush=True,
            )
            nursery.cancel_scope.cancel()


# -- the driver ------------------------------------------------------------------------------


def execserver_config() -> str:
    return yaml.safe_dump(
        {
            "listen": "127.0.0.1:0",
            "slots": SLOTS_EACH,
            "fast_reserve": 0,
            "unknown_share": 1.0,
            "services": {"hold": {"builtin": "sleep"}},
        }
    )


def execserver_process() -> AbstractContextManager[str]:
    """A real execserver daemon with the ``hold`` service; yields host:port."""
    from dispatcher import execserver_daemon  # benchmarks/dispatcher.py, beside this file

    return execserver_daemon(execserver_config())


@contextmanager
def database(admin: str, name: str) -> Iterator[str]:
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield psycopg.conninfo.make_conninfo(admin, dbname=name)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def fill(dsn: str, items: int) -> None:
    """Apply the migrations and enqueue the items."""
    from trio_broker.trio.store import NewItem, open_store

    async with open_store(dsn, pool_size=1) as store:
        await store.enqueue_many(NewItem(file_ref=str(i), action="step") for i in range(items))


def measure(
    dsn: str, tree: Path | None, addresses: list[str], args: argparse.Namespace
) -> tuple[float, float, str]:
    """(utilisation, steps per second, limit) of one dispatcher process run on ``tree``."""
    trio.run(fill, dsn, args.items)
    env = dict(os.environ)
    if tree is not None:
        paths = [str(tree), str(tree / "daemons")]
        env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    total = args.warmup + args.seconds
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--dsn", dsn,
            "--slot", str(args.slot), "--outside", str(args.outside),
            "--seconds", str(total + 1), *(f"--address={a}" for a in addresses)]  # fmt: skip
    if args.trace:
        argv.append("--trace")
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=total + 120)
    if args.trace:
        print(out.stderr, file=sys.stderr)
    if out.returncode != 0:
        raise RuntimeError(f"the dispatcher process failed:\n{out.stderr}")
    start, jobs, stats = 0.0, [], "?"
    for line in out.stdout.splitlines():
        kind, *rest = line.split()
        if kind == "start":
            start = float(rest[0])
        elif kind == "job":
            jobs.append((float(rest[0]), float(rest[1])))
        elif kind == "stats":
            stats = f"{rest[0]} (peak in flight {rest[1]})"
    low, high = start + args.warmup, start + total
    busy = sum(max(0.0, min(s + d, high) - max(s, low)) for s, d in jobs)
    slots = EXECSERVERS * SLOTS_EACH
    done = sum(1 for s, d in jobs if low <= s + d < high)
    return busy / (slots * (high - low)), done / (high - low), stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", type=Path, help="a source tree of the baseline commit")
    parser.add_argument("--items", type=int, default=2000, help="items queued per run")
    parser.add_argument("--slot", type=float, default=2.0, help="seconds a step holds its slot")
    parser.add_argument("--outside", type=float, default=8.0, help="seconds outside the slot")
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds before the window")
    parser.add_argument("--seconds", type=float, default=60.0, help="the measured window")
    parser.add_argument("--dsn", help="use this server instead of a private cluster")
    parser.add_argument("--trace", action="store_true", help="the dispatcher's figures per second")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--address", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        trio.run(
            dispatcher_worker,
            *(args.dsn, args.address, args.slot, args.outside, args.seconds, args.trace),
        )
        return

    trees: list[tuple[str, Path | None]] = [("this tree", None)]
    if args.compare is not None:
        if not (args.compare / "trio_broker" / "__init__.py").exists():
            parser.error(f"--compare {args.compare}: no trio_broker package there")
        trees.insert(0, (f"baseline ({args.compare})", args.compare.resolve()))
    share = args.outside / (args.slot + args.outside)
    print(
        f"{EXECSERVERS} execserver processes x {SLOTS_EACH} slots; each step {args.outside:g} s "
        f"outside its slot and {args.slot:g} s inside ({share:.0%} outside); "
        f"window {args.warmup:g}..{args.warmup + args.seconds:g} s; {os.cpu_count()} CPUs\n"
    )
    with ExitStack() as stack:
        admin = args.dsn
        if admin is None:
            folder = tempfile.mkdtemp(prefix="trio-broker-admission-")
            stack.callback(shutil.rmtree, folder, ignore_errors=True)
            cluster = PgCluster(folder).start()
            stack.callback(cluster.stop)
            admin = cluster.dsn
        addresses = [stack.enter_context(execserver_process()) for _ in range(EXECSERVERS)]
        print(f"{'tree':44}  utilisation  steps/s  exec limit at the end")
        for index, (label, tree) in enumerate(trees):
            with database(admin, f"bench_admission_{index}") as dsn:
                utilisation, rate, stats = measure(dsn, tree, addresses, args)
            print(f"{label:44}  {utilisation:11.0%}  {rate:7.2f}  {stats}")
        ideal = EXECSERVERS * SLOTS_EACH / args.slot
        print(f"\n(all slots busy would be {ideal:.2f} steps/s)")


if __name__ == "__main__":
    main()
