"""The reference daemons' wiring: configuration, logging, signals. Thin by design."""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from trio_broker.trio.execserver import ExecserverHandle
from trio_broker_daemons.config import ConfigError, ExecserverConfig
from trio_broker_daemons.execserver import serve_from_config

if TYPE_CHECKING:  # the fylr's modules (psycopg…) load only for the fylr command
    from trio_broker_daemons.fylr.app import FylrHandle
    from trio_broker_daemons.fylr.config import FylrConfig

__all__ = ["run_execserver", "run_fylr"]

log = logging.getLogger("trio_broker_daemons.daemon")


async def _watch_signals(
    first: tuple[str, Callable[[], None]], second: tuple[str, Callable[[], None]]
) -> None:
    """The first SIGTERM/SIGINT calls ``first``, every later one ``second``.

    Each is ``(what it does, for the log line; the call)``.
    """
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        count = 0
        async for signum in signals:
            count += 1
            name = signal.Signals(signum).name
            if count == 1:
                log.info("%s: %s (send it again to stop at once)", name, first[0])
                first[1]()
            else:
                log.info("%s again: %s", name, second[0])
                second[1]()


async def _execserver_main(config: ExecserverConfig, ready_file: Path | None) -> None:
    async with trio.open_nursery() as nursery:
        handle: ExecserverHandle = await nursery.start(serve_from_config, config)
        nursery.start_soon(
            _watch_signals, ("draining", handle.drain), ("stopping running jobs now", handle.stop)
        )
        if ready_file is not None:
            await trio.Path(ready_file).write_text(f"{handle.host} {handle.port}\n")
        await handle.wait_closed()
        nursery.cancel_scope.cancel()


def run_execserver(config_path: str, *, ready_file: str | None = None) -> int:
    """``trio-broker execserver --config FILE``: returns the exit status.

    A configuration problem prints one line naming the key path and returns 2.
    A drained execserver returns 0.
    """
    try:
        config = ExecserverConfig.from_yaml(config_path)
    except ConfigError as exc:
        where = "" if exc.file else f"{config_path}: "
        print(f"trio-broker execserver: {where}{exc}", file=sys.stderr)
        return 2
    trio.run(_execserver_main, config, Path(ready_file) if ready_file else None)
    return 0


async def _fylr_main(config: FylrConfig, ready_file: Path | None) -> None:
    from trio_broker_daemons.fylr.app import serve_fylr

    async with trio.open_nursery() as nursery:
        handle: FylrHandle = await nursery.start(serve_fylr, config)
        nursery.start_soon(
            _watch_signals,
            ("stopping", handle.stop),
            ("stopping at once", nursery.cancel_scope.cancel),
        )
        if ready_file is not None:
            await trio.Path(ready_file).write_text(f"{handle.host} {handle.port}\n")
        await handle.wait_closed()
        nursery.cancel_scope.cancel()


def run_fylr(config_path: str, *, ready_file: str | None = None) -> int:
    """``trio-broker fylr --config FILE``: returns the exit status.

    A configuration problem prints one line naming the key path and returns 2; a
    database that cannot be started or reached prints one line and returns 1. A
    fylr stopped by SIGTERM or SIGINT returns 0.
    """
    from trio_broker.trio.store import StoreUnavailable
    from trio_broker_daemons.fylr.config import FylrConfig
    from trio_broker_daemons.pgcluster import PgClusterError

    try:
        config = FylrConfig.from_yaml(config_path)
    except ConfigError as exc:
        where = "" if exc.file else f"{config_path}: "
        print(f"trio-broker fylr: {where}{exc}", file=sys.stderr)
        return 2
    try:
        trio.run(_fylr_main, config, Path(ready_file) if ready_file else None)
    except (PgClusterError, StoreUnavailable) as exc:
        problems: list[BaseException] = [exc]
    except BaseExceptionGroup as group:
        matched, _ = group.split((PgClusterError, StoreUnavailable))
        if matched is None:
            raise
        problems = _leaves(matched)
    else:
        return 0
    for problem in problems:
        print(f"trio-broker fylr: {' '.join(str(problem).split())}", file=sys.stderr)
    return 1


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    found: list[BaseException] = []
    for exc in group.exceptions:
        found.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return found
