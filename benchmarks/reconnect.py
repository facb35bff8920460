"""How soon the queue store works again after its database was away, by outage length.

Run: ``.venv/bin/python benchmarks/reconnect.py`` (``--outages 5,15,30``,
``--connect-timeout 5``).

Against a private PostgreSQL cluster started in a temporary folder: a store
(4 connections) works, the server is stopped (``pg_ctl stop -m fast``) for the
outage while a caller keeps calling (every 0.2 s, each call failing with
``StoreUnavailable``, as the fylr's dispatcher and its requests do), then the
server is started again on the same port. The figure is the time from the
server being back (``pg_ctl start`` returned) to the first call that succeeds
(calls every 0.1 s).

Each outage is measured twice in the same run: with the store's default
``reconnect_timeout`` (``RECONNECT_WINDOW`` × ``connect_timeout``) and, as the
baseline, with psycopg_pool's unbounded back-off (``reconnect_timeout`` of 24 h,
the store's setting before), whose delays double from 1 s, so its next try may
come about as long after the restart as the outage lasted.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
import time

import trio
from trio_broker_daemons.fylr.pgcluster import PgCluster

from trio_broker.trio.store import RECONNECT_WINDOW, StoreUnavailable, open_store

UNBOUNDED = 24 * 3600.0


async def lag(
    cluster: PgCluster, dsn: str, outage: float, connect_timeout: float, reconnect: float | None
) -> float:
    """Seconds from the server's restart to the first call that succeeds."""
    async with open_store(
        dsn, pool_size=4, connect_timeout=connect_timeout, reconnect_timeout=reconnect
    ) as store:
        await store.counts()
        await trio.to_thread.run_sync(cluster.stop)
        stopped = time.monotonic()
        while time.monotonic() - stopped < outage:
            with contextlib.suppress(StoreUnavailable):
                await store.counts()
            await trio.sleep(0.2)
        await trio.to_thread.run_sync(cluster.start)
        back = time.monotonic()
        while True:
            try:
                await store.counts()
            except StoreUnavailable:
                await trio.sleep(0.1)
            else:
                return time.monotonic() - back


async def main(outages: list[float], connect_timeout: float) -> None:
    folder = tempfile.mkdtemp(prefix="trio-broker-bench-reconnect-")
    try:
        with PgCluster(folder) as cluster:
            dsn = cluster.ensure_database("reconnect")
            print(
                f"connect_timeout {connect_timeout:g} s; default reconnect_timeout "
                f"{RECONNECT_WINDOW * connect_timeout:g} s; baseline: unbounded back-off"
            )
            print("outage s  first call ok after restart, s: default  baseline")
            for outage in outages:
                ours = await lag(cluster, dsn, outage, connect_timeout, None)
                base = await lag(cluster, dsn, outage, connect_timeout, UNBOUNDED)
                print(f"{outage:8g}  {ours:38.1f}  {base:8.1f}", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--outages", default="5,15,30", help="outage lengths, seconds")
    parser.add_argument("--connect-timeout", type=float, default=5.0)
    args = parser.parse_args()
    trio.run(main, [float(x) for x in args.outages.split(",")], args.connect_timeout)
