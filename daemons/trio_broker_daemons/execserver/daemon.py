"""``trio-broker execserver --config FILE``: the execserver daemon's process.

It loads the configuration (the environment laid over the file), finds the user
jobs run as (:func:`~trio_broker_daemons.execserver.app.job_user_from`), logs
what will hurt (:func:`~trio_broker_daemons.execserver.app.config_warnings`),
checks the TLS files, drops the ``TRIO_BROKER_…`` variables (its token among them)
from its own environment, contains its jobs
(:func:`~trio_broker.trio.containment.serve_containment`: subreaper, not dumpable,
a cgroup per job where it is given one, the keeper, the leftovers of dead
predecessors removed), serves
(:func:`~trio_broker_daemons.execserver.app.serve_from_config`) and drains on
SIGTERM or SIGINT; the steps and exit statuses shared with the fylr are
:mod:`trio_broker_daemons.runtime.process`'s.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
from collections.abc import Mapping, MutableMapping
from functools import partial
from pathlib import Path

import trio

from trio_broker.trio.containment import Containment, serve_containment
from trio_broker.trio.execserver import ExecserverHandle
from trio_broker_daemons.config.sources import ENV_PREFIX
from trio_broker_daemons.config.values import ConfigError
from trio_broker_daemons.execserver.app import (
    config_warnings,
    job_user_from,
    serve_from_config,
    tls_problem,
)
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


def drop_secrets(environ: MutableMapping[str, str]) -> list[str]:
    """Remove the ``TRIO_BROKER_…`` variables from this process's environment, once read.

    What the process reads later (a library, a child started without an
    explicit environment) no longer finds them. ``/proc/<pid>/environ`` still
    shows the environment the process started with; the daemon's cleared
    dumpable flag is what keeps that from other processes.

    Returns:
        The names removed.
    """
    names = [name for name in environ if name.startswith(ENV_PREFIX)]
    for name in names:
        del environ[name]
    return names


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
        job_user = job_user_from(config)
    except ConfigError as exc:
        return config_line("execserver", config_path, exc)
    for warning in config_warnings(config, job_user=job_user):
        log.warning(warning.text, extra=fields(**warning.fields))
    problem = tls_problem(config)
    if problem is not None:
        print(f"trio-broker execserver: {problem}", file=sys.stderr)
        return 1
    if environ is None:
        drop_secrets(os.environ)
    ready = Path(ready_file) if ready_file else None
    instance = secrets.token_hex(8)
    temp_dir = None if config.temp_dir is None else str(config.temp_dir)

    async def main(started: Started) -> None:
        async with trio.open_nursery() as outer:
            containment: Containment = await outer.start(
                partial(
                    serve_containment,
                    temp_dir=temp_dir,
                    instance=instance,
                    use_cgroup=config.cgroup == "auto",
                )
            )
            async with trio.open_nursery() as nursery:
                handle: ExecserverHandle = await nursery.start(
                    partial(
                        serve_from_config,
                        config,
                        instance_id=instance,
                        job_user=job_user,
                        containment=containment,
                    )
                )
                started.serving = True
                log.info(containment.describe())
                nursery.start_soon(
                    watch_signals,
                    ("draining", handle.drain),
                    ("stopping running jobs now", handle.stop),
                )
                await write_ready(ready, handle.host, handle.port)
                await handle.wait_closed()
                nursery.cancel_scope.cancel()
            outer.cancel_scope.cancel()

    return run_daemon("execserver", config.listen, main)
