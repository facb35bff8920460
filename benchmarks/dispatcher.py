"""Dispatcher throughput on one PostgreSQL database, against a bare claim+delete floor.

Run: ``.venv/bin/python benchmarks/dispatcher.py`` (``--items``, ``--dsn``, ``--execserver``).

In one run, against a private PostgreSQL cluster started in a temporary folder
(default server settings: durable commits) or the server ``--dsn`` names:

1. **dispatchers**: 1, 2 and 4 dispatchers, each in its own process (as each
   client daemon would be), drain ``--items`` exec-bound items whose handler is a
   no-op, so every item is a claim, a handler run and a completion (its row
   deleted). The exec side is fixed: one instance of 16 slots, so each
   dispatcher admits 18 items at a time. With ``--execserver`` the handler runs
   a real ``noop`` job through a broker client on a real execserver process
   instead (WANT, OFFER, JOB, DONE per item).
2. **floor**: the same numbers of processes run the same claim statement and the
   same completion statement from plain psycopg code (no trio, no threads, no
   dispatcher), 18 rows per claim, until the queue is empty.

Each run gets a fresh database. The clock starts when the items are committed
and every process has been told to go (workers are started and connected
before), and stops when the queue is empty (polled every 5 ms). Each figure is
the median of ``--repeat`` runs.

With durable commits both sides wait mostly for WAL flushes: the floor commits
once per claim and once per completion of its 18 rows; the dispatcher commits
once per claim and once per batch of whatever completions piled up meanwhile
(its writer batches them), so it may beat the floor.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import psycopg
import trio
from trio_broker_daemons.fylr.pgcluster import PgCluster

from trio_broker.core.admission import AdmissionConfig, InstanceLoad
from trio_broker.trio.dispatcher import Action, Dispatcher, DispatcherConfig
from trio_broker.trio.queue_sql import FINISH, claim_query  # the dispatcher's own statements
from trio_broker.trio.store import NewItem, QueueItem, open_store

SLOTS = 16
CPUS = 2
BATCH = SLOTS + CPUS  # the admission limit: the fair share plus the CPU count
POOL = 10


class FixedExec:
    """One execserver instance of ``SLOTS`` slots, this client alone on it."""

    def instance_loads(self) -> Sequence[InstanceLoad]:
        return [InstanceLoad(instance_id="bench", processes=SLOTS, clients=1, idle=0)]

    def waiting(self) -> int:
        return 0

    async def wait_capacity_changed(self) -> None:
        await trio.sleep_forever()  # fixed: it never changes


# -- worker processes ----------------------------------------------------------------------


async def dispatcher_worker(dsn: str, backend_id: str, execserver: str | None) -> None:
    """Serve a dispatcher; claim at once on "go"; stop when stdin closes."""
    stdin = trio.lowlevel.FdStream(os.dup(0))
    async with open_store(dsn, pool_size=POOL, migrate=False) as store:
        config = DispatcherConfig(
            backend_id=backend_id,
            name=backend_id,
            admission=AdmissionConfig(cpus=CPUS, use_idle=False),
        )
        async with trio.open_nursery() as nursery:
            if execserver is None:

                async def noop(item: QueueItem) -> None:
                    pass

                dispatcher = Dispatcher(
                    store, [Action("exec", True, noop)], config, exec_client=FixedExec()
                )
                await nursery.start(dispatcher.serve)
                await _follow_stdin(stdin, dispatcher)
            else:
                from trio_broker.core.client import ClientConfig
                from trio_broker.trio.client import open_broker_client

                client_config = ClientConfig(
                    backend_id=backend_id, name=backend_id, version="bench", addresses=(execserver,)
                )
                async with open_broker_client(client_config) as client:

                    async def run(item: QueueItem) -> None:
                        receipt = await client.run("noop", {"params": {}}, subject=item.file_ref)
                        if receipt.status != "ok":
                            raise RuntimeError(receipt.error)

                    dispatcher = Dispatcher(
                        store, [Action("exec", True, run)], config, exec_client=client
                    )
                    await nursery.start(dispatcher.serve)
                    await _follow_stdin(stdin, dispatcher)
            nursery.cancel_scope.cancel()


async def _follow_stdin(stdin: trio.lowlevel.FdStream, dispatcher: Dispatcher) -> None:
    print("ready", flush=True)
    async with stdin:
        async for chunk in stdin:
            if b"go" in chunk:
                dispatcher.wake()


def floor_worker(dsn: str, backend_id: str) -> None:
    """On "go": claim ``BATCH`` rows, delete them, until a claim comes back empty."""
    claim = claim_query(((True, False),))
    with psycopg.connect(dsn, autocommit=True) as conn:
        print("ready", flush=True)
        sys.stdin.readline()
        while True:
            rows = conn.execute(claim, [["exec"], BATCH, backend_id]).fetchall()
            if not rows:
                break
            params: dict[str, Any] = {
                "backend": backend_id,
                "c_ids": [r[0] for r in rows],
                "c_attempts": [r[5] for r in rows],
                "o_ids": [],
                "o_attempts": [],
                "o_status": [],
                "o_delay": [],
                "o_error": [],
            }
            conn.execute(FINISH, params).fetchall()


# -- the driver ----------------------------------------------------------------------------


@contextmanager
def database(cluster: PgCluster | None, dsn: str | None, name: str) -> Iterator[str]:
    """A fresh database (on the private cluster, or beside the one ``dsn`` names)."""
    admin = cluster.dsn if cluster is not None else dsn
    assert admin is not None
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        if cluster is not None:
            yield cluster.dsn_for(name)
        else:
            yield psycopg.conninfo.make_conninfo(admin, dbname=name)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def prepare(dsn: str) -> None:
    """Apply the migrations (the workers start on a ready schema)."""
    async with open_store(dsn, pool_size=1):
        pass


async def enqueue(dsn: str, items: int) -> None:
    async with open_store(dsn, pool_size=1, migrate=False) as store:
        await store.enqueue_many(NewItem(file_ref=str(i), action="exec") for i in range(items))


def measure(dsn: str, workers: int, items: int, argv: list[str]) -> float:
    """Items per second through ``workers`` processes started with ``argv``."""
    trio.run(prepare, dsn)
    procs = [
        subprocess.Popen(
            [*argv, "--dsn", dsn, "--backend-id", f"w{i}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(workers)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError("a worker did not start")
        trio.run(enqueue, dsn, items)
        with psycopg.connect(dsn, autocommit=True) as conn:
            start = time.perf_counter()
            for proc in procs:
                assert proc.stdin is not None
                proc.stdin.write("go\n")
                proc.stdin.flush()
            while conn.execute("SELECT EXISTS (SELECT 1 FROM broker_queue)").fetchone() != (False,):
                time.sleep(0.005)
            elapsed = time.perf_counter() - start
    finally:
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.close()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return items / elapsed


@contextmanager
def execserver_daemon(config_text: str) -> Iterator[str]:
    """A real execserver daemon on this configuration (YAML text); yields host:port."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "execserver.yml"
        config.write_text(config_text)
        ready = Path(tmp) / "ready"
        os.mkfifo(ready)
        proc = subprocess.Popen(
            [sys.executable, "-m", "trio_broker_daemons", "--log-level", "warning", "execserver",
             "--config", str(config), "--ready-file", str(ready)],
        )  # fmt: skip
        try:
            host, port = ready.read_text().split()
            yield f"{host}:{port}"
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def execserver_process() -> AbstractContextManager[str]:
    """A real execserver daemon with 16 slots and a no-op service; yields host:port."""
    return execserver_daemon(
        "listen: 127.0.0.1:0\n"
        f"slots: {SLOTS}\n"
        "fast_reserve: 0\n"
        "unknown_share: 1.0\n"
        "services:\n"
        "  noop: {builtin: noop}\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=10_000, help="items per run")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure (median)")
    parser.add_argument("--dsn", help="use this server instead of a private cluster")
    parser.add_argument(
        "--execserver", action="store_true", help="run each item as a real noop job"
    )
    parser.add_argument("--worker", choices=("dispatcher", "floor"), help=argparse.SUPPRESS)
    parser.add_argument("--backend-id", help=argparse.SUPPRESS)
    parser.add_argument("--exec-address", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "dispatcher":
        trio.run(dispatcher_worker, args.dsn, args.backend_id, args.exec_address)
        return
    if args.worker == "floor":
        floor_worker(args.dsn, args.backend_id)
        return

    me = [sys.executable, os.path.abspath(__file__)]
    folder = None
    cluster = None
    if args.dsn is None:
        folder = tempfile.mkdtemp(prefix="trio-broker-bench-")
        cluster = PgCluster(folder).start()
        version = psycopg.connect(cluster.dsn).execute("SHOW server_version").fetchone()
        print(f"private PostgreSQL {version[0] if version else '?'} cluster, default settings")
    try:
        with contextmanager(_maybe_execserver)(args.execserver) as address:
            dispatch_argv = [*me, "--worker", "dispatcher"]
            if address is not None:
                dispatch_argv += ["--exec-address", address]
                print(f"each item runs a noop job on a real execserver ({SLOTS} slots)")
            print(f"{args.items:,} items per run, {BATCH} items per claim\n")
            print(f"median of {args.repeat} runs each, dispatcher and floor runs alternating\n")
            print("processes  dispatcher items/s  floor items/s  dispatcher/floor")
            for workers in (1, 2, 4):
                rates, floors = [], []
                for run in range(args.repeat):
                    with database(cluster, args.dsn, f"bench_d{workers}_{run}") as dsn:
                        rates.append(measure(dsn, workers, args.items, dispatch_argv))
                    with database(cluster, args.dsn, f"bench_f{workers}_{run}") as dsn:
                        floor_argv = [*me, "--worker", "floor"]
                        floors.append(measure(dsn, workers, args.items, floor_argv))
                rate, floor = statistics.median(rates), statistics.median(floors)
                print(f"{workers:9}  {rate:18,.0f}  {floor:13,.0f}  {rate / floor:16.2f}")
    finally:
        if cluster is not None:
            cluster.stop()
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def _maybe_execserver(wanted: bool) -> Iterator[str | None]:
    if not wanted:
        yield None
        return
    with execserver_process() as address:
        yield address


if __name__ == "__main__":
    main()
