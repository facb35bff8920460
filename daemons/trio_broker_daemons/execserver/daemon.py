"""``trio-broker execserver --config FILE``: the execserver daemon's process.

It loads the configuration (the environment laid over the file), logs what will
hurt (:func:`~trio_broker_daemons.execserver.app.config_warnings`), checks the TLS
files, serves (:func:`~trio_broker_daemons.execserver.app.serve_from_config`) and
drains on SIGTERM or SIGINT; the steps and exit statuses shared with the fylr
are :mod:`trio_broker_daemons.runtime.process`'s.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path

import trio

from trio_broker.trio.execserver import ExecserverHandle
from trio_broker_daemons.config.values import ConfigError
from trio_broker_daemons.execserver.app import config_warnings, serve_from_config, tls_problem
from trio_broker_daemons.execserver.config import ExecserverConfig
from trio_broker_daemons.runtime.logfmt import fields
from trio_broker_daemons.runtime.process import (
    Started,
    config_line,
    run_daemon,
    watch_signals,
    write_ready,
)

__all__ = ["run_execserver"]

log = logging.getLogger("trio_broker_daemons.daemon")  # the name its lines have always had


def run_execserver(
    config_path: str,
    *,
    ready_file: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    """``trio-broker execserver --config FILE``: returns the exit status.

    Args:
        config_path: the YAML file.
        ready_file: written with ``HOST PORT`` once the listener is bound.
        environ: the ``TRIO_BROKER_…`` variables laid over the file; by default
            this process's environment.

    Returns:
        0 once drained; 1 for a start-up failure (one line printed); 2 for a
        configuration problem (one line naming the key path).
    """
    try:
        config = ExecserverConfig.from_yaml(
            config_path, environ=os.environ if environ is None else environ
        )
    except ConfigError as exc:
        return config_line("execserver", config_path, exc)
    for warning in config_warnings(config):
        log.warning(warning.text, extra=fields(**warning.fields))
    problem = tls_problem(config)
    if problem is not None:
        print(f"trio-broker execserver: {problem}", file=sys.stderr)
        return 1
    ready = Path(ready_file) if ready_file else None

    async def main(started: Started) -> None:
        async with trio.open_nursery() as nursery:
            handle: ExecserverHandle = await nursery.start(serve_from_config, config)
            started.serving = True
            nursery.start_soon(
                watch_signals,
                ("draining", handle.drain),
                ("stopping running jobs now", handle.stop),
            )
            await write_ready(ready, handle.host, handle.port)
            await handle.wait_closed()
            nursery.cancel_scope.cancel()

    return run_daemon("execserver", config.listen, main)
