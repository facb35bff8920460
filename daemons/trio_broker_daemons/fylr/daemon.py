"""``trio-broker fylr --config FILE``: the fylr daemon's process.

It loads the configuration (the environment laid over the file), serves
(:func:`~trio_broker_daemons.fylr.app.serve_fylr`) and stops gracefully on SIGTERM
or SIGINT; the steps and exit statuses shared with the execserver are
:mod:`trio_broker_daemons.runtime.process`'s. A database that cannot be started
or reached is one printed line at any time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import trio

from trio_broker.trio.store import StoreUnavailable
from trio_broker_daemons.config.structure import load_config
from trio_broker_daemons.config.values import ConfigError
from trio_broker_daemons.fylr.app import FylrHandle, serve_fylr
from trio_broker_daemons.fylr.config import FylrConfig
from trio_broker_daemons.fylr.pgcluster import PgClusterError
from trio_broker_daemons.runtime.process import (
    Started,
    config_line,
    run_daemon,
    watch_signals,
    write_ready,
)

__all__ = ["run_fylr"]


def run_fylr(
    config_path: str,
    *,
    ready_file: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    """``trio-broker fylr --config FILE``: returns the exit status.

    The configuration is read like the execserver's
    (:func:`~trio_broker_daemons.config.structure.load_config`: relative paths relative to
    the file, ``TRIO_BROKER_…`` variables over it).

    Args:
        config_path: the YAML file.
        ready_file: written with ``HOST PORT`` once it serves.
        environ: the variables laid over the file; by default this process's.

    Returns:
        0 once stopped by SIGTERM or SIGINT; 1 for a start-up failure (a port in
        use, a database that cannot be started or reached: one line printed); 2
        for a configuration problem (one line naming the key path).
    """
    try:
        config = load_config(
            config_path, FylrConfig, environ=os.environ if environ is None else environ
        )
    except ConfigError as exc:
        return config_line("fylr", config_path, exc)
    ready = Path(ready_file) if ready_file else None

    async def main(started: Started) -> None:
        async with trio.open_nursery() as nursery:
            handle: FylrHandle = await nursery.start(serve_fylr, config)
            started.serving = True
            nursery.start_soon(
                watch_signals,
                ("stopping", handle.stop),
                ("stopping at once", nursery.cancel_scope.cancel),
            )
            await write_ready(ready, handle.host, handle.port)
            await handle.wait_closed()
            nursery.cancel_scope.cancel()

    return run_daemon("fylr", config.listen, main, always=(PgClusterError, StoreUnavailable))
