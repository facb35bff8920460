"""``trio-broker fylr requeue --failed --config FILE``: failed work back into the queue.

For a fylr on a shared ``database``: the command connects to it directly (it
works while every fylr is down) and puts the failed queue rows back
with :func:`~trio_broker_daemons.fylr.failed.retry_failed`, their files back to
where their step starts. A fylr on its private cluster is asked over HTTP
instead (``POST /inspect/system/fylr/requeue``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

import psycopg
import trio

from trio_broker.trio.store import StoreUnavailable, open_store
from trio_broker_daemons.config.structure import load_config
from trio_broker_daemons.config.values import ConfigError
from trio_broker_daemons.fylr.config import FylrConfig
from trio_broker_daemons.fylr.failed import RetriedItem, retry_failed
from trio_broker_daemons.runtime.process import config_line

__all__ = ["requeue_main"]


def requeue_main(
    config_path: str, *, ids: Sequence[int] | None = None, environ: Mapping[str, str] | None = None
) -> int:
    """``trio-broker fylr requeue --failed --config FILE``: returns the exit status.

    Connects to the configured ``database`` (it works while every fylr is down),
    puts the failed rows back with
    :func:`~trio_broker_daemons.fylr.failed.retry_failed` and prints one line per
    row and a total. A fylr on its private cluster is asked over HTTP instead
    (``POST /inspect/system/fylr/requeue``): its database runs inside it.

    Returns:
        0 when done (also when nothing had failed); 1 when the database could not
        be reached, or has no queue of this version yet (no fylr of this version
        has started on it: that start migrates it); 2 for a configuration problem
        or a configuration without ``database``.
    """
    try:
        config = load_config(
            config_path, FylrConfig, environ=os.environ if environ is None else environ
        )
    except ConfigError as exc:
        return config_line("fylr requeue", config_path, exc)
    dsn = config.database
    if dsn is None:
        print(
            "trio-broker fylr requeue: the configuration has no 'database' (the fylr runs"
            " its private cluster): POST /inspect/system/fylr/requeue on its listener",
            file=sys.stderr,
        )
        return 2

    async def run() -> list[RetriedItem]:
        async with open_store(dsn, pool_size=1, migrate=False) as store:
            return await retry_failed(store, ids=ids)

    try:
        retried = trio.run(run)
    except StoreUnavailable as exc:
        print(f"trio-broker fylr requeue: {exc}", file=sys.stderr)
        return 1
    except psycopg.errors.UndefinedTable as exc:
        print(
            "trio-broker fylr requeue: the database has no queue of this version"
            f" ({exc.diag.message_primary}): start a fylr of this version on it once,"
            " which migrates it, then requeue",
            file=sys.stderr,
        )
        return 1
    for item in retried:
        print(f"requeued {item.id} {item.action} file {item.file_ref}; it had failed: {item.error}")
    print(f"{len(retried)} failed item(s) requeued")
    return 0
